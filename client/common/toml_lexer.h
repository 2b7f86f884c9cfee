/*
 * toml_lexer.h: the TOML subset of the client configuration, as text. It reads comments,
 * `key = value` (basic strings with the escapes \" \\ \n \t \uXXXX, literal strings, decimal
 * integers and floats, true/false, arrays of strings on one line or several) and [table] /
 * [[table]] headers, and refuses everything else with FILE:LINE and what is supported. It knows
 * no key and no table: at each header and each key = value it calls its reader's handlers
 * (client_config_file.c), which say what they mean. docs/client-configuration.md, "The TOML it
 * reads", is the reference.
 */
#ifndef GP_TOML_LEXER_H
#define GP_TOML_LEXER_H

#include <stddef.h>

#define GP_TOML_MAX_STRING 8192 /* longest string value the subset reads, with its NUL */
#define GP_TOML_MAX_ITEMS 64    /* longest array of strings */
#define GP_TOML_MAX_NUMBER 100  /* longest number, as written */
#define GP_TOML_MAX_KEY 63      /* longest key or table name */

enum gp_toml_type {
    GP_TOML_STR = 1,
    GP_TOML_INT,
    GP_TOML_FLOAT,
    GP_TOML_BOOL,
    GP_TOML_ARRAY
};

typedef struct gp_toml_value {
    enum gp_toml_type type;
    char *s; /* GP_TOML_STR (malloc'd) */
    long long i;
    double f;
    int b;
    char *items[GP_TOML_MAX_ITEMS]; /* GP_TOML_ARRAY of strings (malloc'd) */
    int nitems;
} gp_toml_value;

typedef struct gp_toml_lexer {
    const char *p, *end;
    int line; /* what errors name: see the handlers for which line that is */
    const char *file;
    const char *supported; /* ends syntax errors: what the subset holds */
    char *err;
    size_t ecap;
} gp_toml_lexer;

/* What a reader does with what the lexer finds. Each returns 0, or -1 with an error set
 * (gp_toml_error), which ends the reading. */
typedef struct gp_toml_handlers {
    /* At a '[' that starts a header, before the header is read, and at the end of the text:
     * the table before it ends there. */
    int (*table_ends)(void *ctx, gp_toml_lexer *lx);
    /* A header, read with the rest of its line: array is 1 for [[name]]; lx->line is the
     * header's line. */
    int (*table)(void *ctx, gp_toml_lexer *lx, int array, const char *name);
    /* key = value, before the rest of its line is read (an error of the value comes first);
     * lx->line is the key's line. */
    int (*key_value)(void *ctx, gp_toml_lexer *lx, const char *key, const gp_toml_value *v);
} gp_toml_handlers;

/* Read text (len bytes, from file) with handlers h. 0, or -1 with err ("FILE:LINE: ..."). */
int gp_toml_read(const char *file, const char *text, size_t len, const char *supported,
                 const gp_toml_handlers *h, void *ctx, char *err, size_t ecap);

/* "FILE:LINE: " and the message into the lexer's error. */
void gp_toml_error(gp_toml_lexer *lx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* GP_TOML_LEXER_H */
