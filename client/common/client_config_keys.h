/*
 * client_config_keys.h: every key of the client configuration file, declared once. An entry
 * names its key and table, says what it holds (type, values, default, the GPUPOOL_* variable
 * over it, one line of documentation) and points at the setter that reads it into the file's
 * settings. The file reader (client_config_file.c) dispatches through the table and names its
 * keys in its warnings; libgpupool-config.so hands it to the `gpupool` command
 * (gpupool_config_key), whose `gpupool config --help` and `python -m gpupool.config_keys`
 * (the table of docs/client-configuration.md, checked by tests/test_client_config_keys.py) come
 * from it. The environment's own rules (what a variable replaces, and how) are
 * client_config_env.c's.
 */
#ifndef GP_CLIENT_CONFIG_KEYS_H
#define GP_CLIENT_CONFIG_KEYS_H

#include <stddef.h>

#include "toml_lexer.h"

/* The tables of the file. */
enum gp_config_section {
    GP_SECTION_TOP,          /* outside any table */
    GP_SECTION_REQUIREMENTS, /* [requirements] */
    GP_SECTION_SERVERS,      /* a [[servers]] entry */
    GP_SECTION_UNKNOWN       /* a table the reader does not know (warned about, ignored) */
};

struct file_settings;

/* Reads the value of key into the file's settings. 0, or -1 with the lexer's error set. */
typedef int (*gp_config_setter)(gp_toml_lexer *lx, struct file_settings *fs, const char *key,
                                const gp_toml_value *v);

typedef struct gp_config_key {
    const char *name;             /* as written in the file */
    enum gp_config_section table; /* where */
    const char *type;             /* what the value is written as */
    const char *values;           /* which values are accepted */
    const char *dflt;             /* what applies when it is not set */
    const char *env;              /* the variable over it, NULL for none */
    const char *doc;              /* what it does, one line */
    int unlisted;                 /* left out of the "known there" list of warnings */
    gp_config_setter set;
} gp_config_key;

/* The table, in the order of the warnings' lists, and its length. */
extern const gp_config_key gp_config_keys[];
extern const size_t gp_config_nkeys;

/* The entry of key in table, or NULL. */
const gp_config_key *gp_config_key_find(enum gp_config_section table, const char *key);

/* The file's name for a table: "", "requirements", "servers". */
const char *gp_config_section_name(enum gp_config_section table);

#endif /* GP_CLIENT_CONFIG_KEYS_H */
