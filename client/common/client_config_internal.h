/*
 * client_config_internal.h: what the units of the client configuration reader share, and no one
 * else. The reader is five units, each with one job (docs/client-configuration.md):
 *   toml_lexer.c           the TOML subset as text (knows no key)
 *   client_config_keys.c   the table of keys: name, type, range, variable, default, doc, setter
 *   client_config_file.c   a file's headers and keys through the table into file_settings
 *   client_config_env.c    the GPUPOOL_* environment on top, key by key
 *   client_config.c        which file, reading it, and the public entry points
 * with client_config_values.c for the value checks they all use (addresses, paths, texts) and
 * client_config_hooks.c for the hooks of the running load (environment, warnings, visitor).
 * Everything here is hidden (-fvisibility=hidden): the libraries export only client_config.h.
 */
#ifndef GP_CLIENT_CONFIG_INTERNAL_H
#define GP_CLIENT_CONFIG_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "client_config.h"
#include "toml_lexer.h"

/* Syntax errors end with this: what the subset holds. */
extern const char gp_cc_supported[];

/* ---- the hooks of the load running on this thread (client_config_hooks.c) ------------------ */

/* Set by gp_client_config_load_with for the duration of the call only; thread-local, so loads
 * on other threads never see them. NULL: none. */
extern _Thread_local const gp_config_hooks *gp_cc_hooks;

/* getenv, or the hooks' environment block. */
const char *gp_cc_getenv(const char *name);
/* A warning: one line to the hooks' warn, else to the log. */
void gp_cc_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A header or value of the file, to the hooks' visitor (none: nothing). */
void gp_cc_visit(int kind, const char *key, const char *text);

/* ---- values (client_config_values.c) ------------------------------------------------------- */

void gp_cc_src_line(gp_config_source *src, int line);
void gp_cc_src_what(gp_config_source *src, const char *what);
void gp_cc_set_err(char *err, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* s without the blanks (space, tab, CR, LF, FF, VT) at both ends: its first byte, *n its length
 * (in: strlen(s) or less). */
const char *gp_cc_strip(const char *s, size_t *n);
/* A control character (C0 or DEL) in s[0..n)? */
int gp_cc_has_control(const char *s, size_t n);
/* Valid UTF-8? */
int gp_cc_is_utf8(const char *s, size_t n);
/* $HOME, else the password database's home; "" when neither is known. */
void gp_cc_home_dir(char *out, size_t cap);
/* A GPUPOOL_* variable without the blanks at its ends: NULL when unset or blank, else its first
 * byte, with *n its length (the text is not NUL-terminated there). */
const char *gp_cc_env_view(const char *name, size_t *n);
/* An environment variable as it is (not a GPUPOOL_* one: XDG_CONFIG_HOME), NULL when unset or
 * "". */
const char *gp_cc_env_raw(const char *name);
/* in[0..n): "~" / "~/x" -> "$HOME" / "$HOME/x"; a relative path -> dir/path (dir NULL: left as
 * is). 0; -1 too long for cap; -2 "~" but no home folder. */
int gp_cc_expand_path(const char *in, size_t n, const char *dir, char *out, size_t cap);
/* 1/yes/true/on -> 1, 0/no/false/off -> 0 (any case), else -1. */
int gp_cc_parse_bool_text(const char *v, size_t n);
/* A number of seconds as the environment writes it: digits with an optional fraction ("10",
 * "2.5"). 0, or -1. */
int gp_cc_parse_seconds(const char *v, size_t n, double *out);
/* Strip and check a text setting (value[0..n)): fits cap-1 bytes, no control characters, UTF-8.
 * 0 with dst set, or -1 with err: "<what> is longer than ...; set it to <how>". */
int gp_cc_check_text(const char *what, const char *value, size_t n, const char *how, char *dst,
                     size_t cap, char *err, size_t ecap);
/* An address as a user writes it (already stripped, n bytes) into srv's address, host, port and
 * *tls_prefix. 0, or -1. */
int gp_cc_parse_address(const char *text, size_t n, gp_server_config *srv, int *tls_prefix);
/* compression: "" (unset) and "off" -> GP_COMPRESSION_OFF, "lz4" -> GP_COMPRESSION_LZ4, else -1. */
int gp_cc_compression_value(const char *t, size_t n);
/* spread_copy: "" (unset) and "auto" -> GP_SPREAD_COPY_AUTO, "server", "client", else -1. */
int gp_cc_spread_copy_value(const char *t, size_t n);

/* What to set a value to, in errors ("...; set it to <how>"). */
extern const char gp_cc_gpu_how[], gp_cc_model_how[], gp_cc_token_how[], gp_cc_path_how[],
    gp_cc_size_how[], gp_cc_gpus_how[];

/* ---- what the file sets (client_config_file.c fills it, the environment goes on top) ------- */

/* What a server entry sets itself. CC_F_PREFIX: its address is tls://... (TLS whatever else
 * says). */
enum {
    CC_F_TOKEN = 1,
    CC_F_TLS = 2,
    CC_F_CA = 4,
    CC_F_CERT = 8,
    CC_F_KEY = 16,
    CC_F_PREFIX = 32,
    CC_F_COMP = 64,
    CC_F_FP = 128
};

typedef struct file_settings {
    gp_server_config servers[GP_MAX_SERVERS]; /* address/host/port and their own settings */
    unsigned set[GP_MAX_SERVERS];             /* CC_F_*: what the entry sets itself */
    int nservers;
    int short_form_line; /* line of `servers = [...]`, 0 if none */
    int tables_line;     /* line of the first [[servers]], 0 if none */
    char token[4097];
    int tls;
    char tls_ca[4096], tls_cert[4096], tls_key[4096];
    double connect_timeout, probe_timeout;
    int has_connect_timeout, has_probe_timeout;
    char gpu[256], model[256];
    uint64_t min_memory;
    int gpus; /* 0: unset (1) */
    uint64_t memory;
    int spread;
    int spread_copy;
    int keep_gpu;
    int compression;
    /* A [[servers]] compression that is not a known value: refused when its entry ends, naming
     * the entry's address (it may come after). 0: none. */
    int bad_compression_line;
    char bad_compression[GP_TOML_MAX_STRING];
    int holds_token;
    char dir[4096]; /* the file's folder, symlinks resolved: relative paths start there */
    gp_config_source src[GP_CFG_NSETTINGS];         /* the top-level settings' lines */
    gp_config_source default_src[GP_SRV_NSETTINGS]; /* token, tls, tls_* at the top level */
} file_settings;

/* Parse text (the file's bytes) into fs (fs->dir set). 0, or -1 with err. */
int gp_cc_parse_file(const char *file, const char *text, size_t len, file_settings *fs, char *err,
                     size_t ecap);

/* The environment on top of what the file set (cfg holds the file's top-level settings). 0, or
 * -1 with err. */
int gp_cc_apply_environment(gp_client_config *cfg, const file_settings *fs, char *err, size_t ecap);

#endif /* GP_CLIENT_CONFIG_INTERNAL_H */
