/*
 * client_config_file.c: a client configuration file read into its settings (file_settings).
 * The lexer (toml_lexer.c) reads the TOML subset and calls the handlers here; they keep track of
 * the table being read ([requirements], each [[servers]] entry), refuse a key set twice, and
 * hand each key to its setter in the key table (client_config_keys.c). An unknown key or table
 * is one warning and is ignored.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_config_internal.h"
#include "client_config_keys.h"

#define MAX_KEYS 64 /* most keys in one table */

const char gp_cc_supported[] =
    "the gpupool configuration is a TOML subset: comments, key = value with \"strings\", "
    "'strings', integers, floats, true/false and arrays of strings, [requirements] and "
    "[[servers]]";

/* The state of one file's reading. */
typedef struct file_reader {
    file_settings *fs;
    enum gp_config_section table; /* the table being read */
    int requirements_seen;
    int header_line; /* of the table being read */
    /* The keys seen in the table being read, for "set twice". */
    char seen[MAX_KEYS][GP_TOML_MAX_KEY + 1];
    int nseen;
} file_reader;

/* 1 if key was seen in this table before (error set), 0 if not (now it is), -1 if the table has
 * too many keys (error set). */
static int seen_before(gp_toml_lexer *lx, file_reader *r, const char *key)
{
    for (int i = 0; i < r->nseen; i++) {
        if (!strcmp(r->seen[i], key)) {
            gp_toml_error(lx, "%s is set twice in the same table; keep one", key);
            return 1;
        }
    }
    if (r->nseen >= MAX_KEYS) {
        gp_toml_error(lx, "more than %d settings in one table; this is not a gpupool configuration",
                      MAX_KEYS);
        return -1;
    }
    snprintf(r->seen[r->nseen++], sizeof r->seen[0], "%s", key);
    return 0;
}

/* A value as written, to the hooks' visitor. */
static void visit_value(const char *key, const gp_toml_value *v)
{
    char num[64];
    switch (v->type) {
    case GP_TOML_STR:
        gp_cc_visit(GP_VISIT_STRING, key, v->s);
        break;
    case GP_TOML_INT:
        snprintf(num, sizeof num, "%lld", v->i);
        gp_cc_visit(GP_VISIT_INTEGER, key, num);
        break;
    case GP_TOML_FLOAT:
        snprintf(num, sizeof num, "%.17g", v->f);
        gp_cc_visit(GP_VISIT_FLOAT, key, num);
        break;
    case GP_TOML_BOOL:
        gp_cc_visit(GP_VISIT_BOOL, key, v->b ? "true" : "false");
        break;
    case GP_TOML_ARRAY:
        gp_cc_visit(GP_VISIT_ARRAY, key, NULL);
        for (int i = 0; i < v->nitems; i++)
            gp_cc_visit(GP_VISIT_ITEM, key, v->items[i]);
        break;
    }
}

/* The keys of a table that its warnings name, from the key table: "a, b, c". */
static void known_keys(enum gp_config_section table, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < gp_config_nkeys; i++) {
        const gp_config_key *k = &gp_config_keys[i];
        if (k->table != table || k->unlisted)
            continue;
        int n = snprintf(out + o, cap - o, "%s%s", o ? ", " : "", k->name);
        if (n < 0 || (size_t)n >= cap - o)
            return;
        o += (size_t)n;
    }
}

static int on_key_value(void *ctx, gp_toml_lexer *lx, const char *key, const gp_toml_value *v)
{
    file_reader *r = ctx;
    if (r->table == GP_SECTION_UNKNOWN) {
        visit_value(key, v);
        return 0; /* the table was warned about */
    }
    if (seen_before(lx, r, key) != 0)
        return -1;
    visit_value(key, v);
    const gp_config_key *k = gp_config_key_find(r->table, key);
    if (k)
        return k->set(lx, r->fs, key, v);
    static const char *const where[] = {"", " in [requirements]", " in [[servers]]"};
    char known[512];
    known_keys(r->table, known, sizeof known);
    gp_cc_warn("%s:%d: unknown setting '%s'%s ignored (known there: %s)", lx->file, lx->line, key,
               where[r->table], known);
    return 0;
}

/* A header: which table is read next. */
static int on_table(void *ctx, gp_toml_lexer *lx, int array, const char *name)
{
    file_reader *r = ctx;
    file_settings *fs = r->fs;
    int rc = 0;
    r->nseen = 0;
    if (!strcmp(name, "requirements")) {
        if (array) {
            gp_toml_error(lx,
                          "[[requirements]] is not supported: write [requirements] (one table)");
            rc = -1;
        } else if (r->requirements_seen++) {
            gp_toml_error(lx, "[requirements] appears twice; merge the two tables");
            rc = -1;
        } else {
            r->table = GP_SECTION_REQUIREMENTS;
        }
    } else if (!strcmp(name, "servers")) {
        if (!array) {
            gp_toml_error(lx, "[servers] is not supported: write [[servers]] before each server's "
                              "address = \"...\" (or servers = [\"a:7070\", \"b:7070\"] at the "
                              "top)");
            rc = -1;
        } else if (fs->short_form_line) {
            gp_toml_error(lx, "[[servers]] together with servers = [...] (line %d): use one form",
                          fs->short_form_line);
            rc = -1;
        } else if (fs->nservers >= GP_MAX_SERVERS) {
            gp_toml_error(lx, "more than %d servers; keep the %d you prefer", GP_MAX_SERVERS,
                          GP_MAX_SERVERS);
            rc = -1;
        } else {
            if (!fs->tables_line)
                fs->tables_line = lx->line;
            fs->nservers++;
            r->table = GP_SECTION_SERVERS;
        }
    } else {
        gp_cc_warn("%s:%d: unknown table %s%s%s ignored (known: [requirements], [[servers]])",
                   lx->file, lx->line, array ? "[[" : "[", name, array ? "]]" : "]");
        r->table = GP_SECTION_UNKNOWN;
    }
    if (rc == 0)
        gp_cc_visit(array ? GP_VISIT_ARRAY_TABLE : GP_VISIT_TABLE, NULL, name);
    return rc;
}

/* The [[servers]] entry that ended (or the last one) must have an address, and a known
 * compression if it sets one. */
static int on_table_ends(void *ctx, gp_toml_lexer *lx)
{
    file_reader *r = ctx;
    const file_settings *fs = r->fs;
    int header_line = r->header_line;
    r->header_line = lx->line; /* a header follows, or the text ends */
    if (r->table != GP_SECTION_SERVERS)
        return 0;
    const gp_server_config *s = &fs->servers[fs->nservers - 1];
    int line = lx->line;
    if (!s->address[0]) {
        lx->line = header_line;
        gp_toml_error(lx, "this [[servers]] entry has no address; write address = \"host:port\" "
                          "under it");
    } else if (fs->bad_compression_line) {
        lx->line = fs->bad_compression_line;
        gp_toml_error(lx,
                      "server %s: compression = \"%s\" is not supported: write \"off\" or "
                      "\"lz4\", or leave it out for the top-level compression",
                      s->address, fs->bad_compression);
    } else {
        return 0;
    }
    lx->line = line;
    return -1;
}

int gp_cc_parse_file(const char *file, const char *text, size_t len, file_settings *fs, char *err,
                     size_t ecap)
{
    static const gp_toml_handlers handlers = {
        .table_ends = on_table_ends,
        .table = on_table,
        .key_value = on_key_value,
    };
    file_reader *r = calloc(1, sizeof *r);
    if (!r) {
        gp_cc_set_err(err, ecap, "out of memory reading %s", file);
        return -1;
    }
    r->fs = fs;
    r->table = GP_SECTION_TOP;
    int rc = gp_toml_read(file, text, len, gp_cc_supported, &handlers, r, err, ecap);
    free(r);
    return rc;
}
