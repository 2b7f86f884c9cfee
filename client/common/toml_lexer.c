/*
 * toml_lexer.c: the TOML subset of the client configuration, as text (toml_lexer.h). The
 * reader's handlers give the keys and tables their meaning; this file only says whether the text
 * is the subset, and what it holds.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "toml_lexer.h"
#include "utf8.h"

#define MAX_STRING GP_TOML_MAX_STRING
#define MAX_ITEMS GP_TOML_MAX_ITEMS
#define MAX_NUMBER GP_TOML_MAX_NUMBER
#define MAX_KEY GP_TOML_MAX_KEY

void gp_toml_error(gp_toml_lexer *lx, const char *fmt, ...)
{
    int o = snprintf(lx->err, lx->ecap, "%s:%d: ", lx->file, lx->line);
    if (o > 0 && (size_t)o < lx->ecap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(lx->err + o, lx->ecap - (size_t)o, fmt, ap);
        va_end(ap);
    }
}

static void value_free(gp_toml_value *v)
{
    free(v->s);
    for (int i = 0; i < v->nitems; i++)
        free(v->items[i]);
    memset(v, 0, sizeof *v);
}

/* How much of the text at p to quote in a message: up to 20 bytes, not past the line. */
static int snippet(const char *p, const char *end)
{
    int n = 0;
    while (p + n < end && n < 20 && p[n] != '\n' && p[n] != '\r')
        n++;
    return n;
}

static void skip_blank(gp_toml_lexer *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t'))
        ps->p++;
}

/* A comment up to its newline, and the CR of a CRLF: the next byte is the newline, or the end. */
static void skip_comment(gp_toml_lexer *ps)
{
    if (ps->p < ps->end && *ps->p == '#')
        while (ps->p < ps->end && *ps->p != '\n')
            ps->p++;
    if (ps->p < ps->end && *ps->p == '\r' && ps->p + 1 < ps->end && ps->p[1] == '\n')
        ps->p++;
}

/* After a value or header: blanks, an optional comment, then the end of the line (consumed).
 * 0, or -1 (error set). */
static int end_of_line(gp_toml_lexer *ps, const char *after)
{
    skip_blank(ps);
    skip_comment(ps);
    if (ps->p >= ps->end)
        return 0;
    if (*ps->p != '\n') {
        gp_toml_error(ps, "unexpected text after %s: '%.*s'; %s", after, snippet(ps->p, ps->end),
                      ps->p, ps->supported);
        return -1;
    }
    ps->p++;
    ps->line++;
    return 0;
}

static int is_key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
}

/* Append the UTF-8 encoding of code point cp. */
static int put_utf8(char *out, size_t *o, size_t cap, unsigned long cp)
{
    unsigned char b[4];
    size_t k;
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        k = 1;
    } else if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | (cp >> 6));
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        k = 2;
    } else if (cp < 0x10000) {
        b[0] = (unsigned char)(0xE0 | (cp >> 12));
        b[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        k = 3;
    } else {
        b[0] = (unsigned char)(0xF0 | (cp >> 18));
        b[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        b[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        b[3] = (unsigned char)(0x80 | (cp & 0x3F));
        k = 4;
    }
    if (*o + k >= cap)
        return -1;
    memcpy(out + *o, b, k);
    *o += k;
    return 0;
}

/* A "basic" or 'literal' string at ps->p (on its quote); *out malloc'd. 0, or -1. */
static int parse_string(gp_toml_lexer *ps, char **out)
{
    char q = *ps->p;
    if (ps->p + 2 < ps->end && ps->p[1] == q && ps->p[2] == q) {
        gp_toml_error(ps,
                      "multi-line strings (%c%c%c) are not supported; write the value on one line",
                      q, q, q);
        return -1;
    }
    ps->p++;
    char *buf = malloc(MAX_STRING);
    if (!buf) {
        gp_toml_error(ps, "out of memory");
        return -1;
    }
    size_t o = 0;
    for (;;) {
        if (ps->p >= ps->end || *ps->p == '\n' || *ps->p == '\r') {
            gp_toml_error(ps, "this string has no closing %c on its line", q);
            goto fail;
        }
        unsigned char c = (unsigned char)*ps->p;
        if (c == (unsigned char)q) {
            ps->p++;
            break;
        }
        if ((c < 0x20 && c != '\t') || c == 0x7f) {
            gp_toml_error(ps,
                          "a control character inside a string; write it as an escape (\\n, \\t, "
                          "\\uXXXX)");
            goto fail;
        }
        if (c == '\\' && q == '"') {
            char e = ps->p + 1 < ps->end ? ps->p[1] : 0;
            ps->p += 2;
            char plain = e == '"' ? '"' : e == '\\' ? '\\' : e == 'n' ? '\n' : e == 't' ? '\t' : 0;
            if (plain) {
                if (o + 1 >= MAX_STRING)
                    goto too_long;
                buf[o++] = plain;
                continue;
            }
            if (e == 'u') {
                unsigned long cp = 0;
                for (int k = 0; k < 4; k++, ps->p++) {
                    char h = ps->p < ps->end ? *ps->p : 0;
                    int d = h >= '0' && h <= '9'   ? h - '0'
                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                   : -1;
                    if (d < 0) {
                        gp_toml_error(ps, "\\u needs four hex digits (\\u00e9)");
                        goto fail;
                    }
                    cp = cp * 16 + (unsigned long)d;
                }
                if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) {
                    gp_toml_error(ps, "\\u%04lx is not a character a value may hold", cp);
                    goto fail;
                }
                if (put_utf8(buf, &o, MAX_STRING, cp) != 0)
                    goto too_long;
                continue;
            }
            gp_toml_error(ps,
                          "unsupported escape \\%c; the supported escapes are \\\" \\\\ \\n \\t "
                          "\\uXXXX (or use a 'literal string')",
                          e >= 0x20 && e < 0x7f ? e : '?');
            goto fail;
        }
        if (o + 1 >= MAX_STRING)
            goto too_long;
        buf[o++] = (char)c;
        ps->p++;
    }
    buf[o] = 0;
    {
        char check[MAX_STRING];
        if (gp_utf8_clean(check, sizeof check, buf, o) != o || memcmp(check, buf, o) != 0) {
            gp_toml_error(ps, "this string is not valid UTF-8; save the file as UTF-8");
            goto fail;
        }
    }
    *out = buf;
    return 0;
too_long:
    gp_toml_error(ps, "this string is longer than %d bytes", MAX_STRING - 1);
fail:
    free(buf);
    return -1;
}

/* Blanks, newlines and comments inside an array. */
static void skip_array_space(gp_toml_lexer *ps)
{
    for (;;) {
        skip_blank(ps);
        skip_comment(ps);
        if (ps->p < ps->end && *ps->p == '\n') {
            ps->p++;
            ps->line++;
            continue;
        }
        return;
    }
}

/* Digits with single underscores between them (TOML), copied into d[*n]. 0, or -1. */
static int digit_run(const char **pp, const char *end, char *d, size_t *n, size_t cap)
{
    const char *p = *pp;
    int want_digit = 1;
    for (; p < end; p++) {
        if (*p >= '0' && *p <= '9') {
            if (*n + 2 >= cap)
                return -1;
            d[(*n)++] = *p;
            want_digit = 0;
        } else if (*p == '_' && !want_digit) {
            want_digit = 1;
        } else {
            break;
        }
    }
    *pp = p;
    return want_digit ? -1 : 0;
}

/* TOML's number grammar (decimal only), at most MAX_NUMBER characters; integers within 64-bit
 * signed, floats finite. 0 with v set, -1 if the text at p is not one. */
static int parse_number(gp_toml_lexer *ps, gp_toml_value *v)
{
    const char *p = ps->p;
    char d[128];
    size_t n = 0;
    int is_float = 0;
    if (*p == '+' || *p == '-')
        d[n++] = *p++;
    if (p >= ps->end || *p < '0' || *p > '9')
        return -1;
    if (*p == '0' && p + 1 < ps->end && p[1] >= '0' && p[1] <= '9')
        return -1; /* 007 */
    if (digit_run(&p, ps->end, d, &n, sizeof d) != 0)
        return -1;
    if (p < ps->end && *p == '.') {
        is_float = 1;
        d[n++] = *p++;
        if (digit_run(&p, ps->end, d, &n, sizeof d) != 0)
            return -1;
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        is_float = 1;
        d[n++] = 'e';
        p++;
        if (p < ps->end && (*p == '+' || *p == '-'))
            d[n++] = *p++;
        if (digit_run(&p, ps->end, d, &n, sizeof d) != 0)
            return -1;
    }
    if (p < ps->end && !strchr(" \t\r\n#,]", *p))
        return -1; /* what follows ends the value */
    if (p - ps->p > MAX_NUMBER)
        return -1;
    d[n] = 0;
    errno = 0;
    if (is_float) {
        v->type = GP_TOML_FLOAT;
        v->f = strtod(d, NULL); /* an underflow is 0 or subnormal: fine */
        if (!isfinite(v->f))
            return -1;
    } else {
        v->type = GP_TOML_INT;
        v->i = strtoll(d, NULL, 10);
        if (errno)
            return -1;
    }
    ps->p = p;
    return 0;
}

/* The value after "key = ". 0, or -1 (error set). */
static int parse_value(gp_toml_lexer *ps, const char *key, gp_toml_value *v)
{
    memset(v, 0, sizeof *v);
    skip_blank(ps);
    if (ps->p >= ps->end || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '#') {
        gp_toml_error(ps, "%s has no value; write %s = \"...\"", key, key);
        return -1;
    }
    char c = *ps->p;
    if (c == '"' || c == '\'') {
        v->type = GP_TOML_STR;
        return parse_string(ps, &v->s);
    }
    if (c == '[') {
        v->type = GP_TOML_ARRAY;
        ps->p++;
        for (;;) {
            skip_array_space(ps);
            if (ps->p >= ps->end) {
                gp_toml_error(ps, "the array of %s has no closing ]", key);
                return -1;
            }
            if (*ps->p == ']') {
                ps->p++;
                return 0;
            }
            if (*ps->p != '"' && *ps->p != '\'') {
                gp_toml_error(ps, "the array of %s may only hold strings; %s", key, ps->supported);
                return -1;
            }
            if (v->nitems >= MAX_ITEMS) {
                gp_toml_error(ps, "the array of %s has more than %d items", key, MAX_ITEMS);
                return -1;
            }
            if (parse_string(ps, &v->items[v->nitems]) != 0)
                return -1;
            v->nitems++;
            skip_array_space(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            if (ps->p < ps->end && *ps->p == ']')
                continue;
            gp_toml_error(ps, "expected , or ] in the array of %s", key);
            return -1;
        }
    }
    if (!strncmp(ps->p, "true", 4) || !strncmp(ps->p, "false", 5)) {
        int t = ps->p[0] == 't';
        const char *after = ps->p + (t ? 4 : 5);
        if (after >= ps->end || strchr(" \t\r\n#", *after)) {
            v->type = GP_TOML_BOOL;
            v->b = t;
            ps->p = after;
            return 0;
        }
    }
    if (c == '{') {
        gp_toml_error(ps, "inline tables ({...}) are not supported; %s", ps->supported);
        return -1;
    }
    if (((c >= '0' && c <= '9') || c == '+' || c == '-') && parse_number(ps, v) == 0)
        return 0;
    gp_toml_error(ps,
                  "cannot read the value of %s (strings need quotes: %s = \"...\"; dates, hex "
                  "numbers, inf and nan are not supported); %s",
                  key, key, ps->supported);
    return -1;
}

/* A [table] or [[table]] header at ps->p, read with the rest of its line, then given to the
 * handler with the header's line. 0, or -1 (error set). */
static int read_header(gp_toml_lexer *ps, const gp_toml_handlers *h, void *ctx)
{
    int dbl = ps->p + 1 < ps->end && ps->p[1] == '[';
    ps->p += dbl ? 2 : 1;
    skip_blank(ps);
    const char *name = ps->p;
    while (ps->p < ps->end && is_key_char(*ps->p))
        ps->p++;
    size_t nl = (size_t)(ps->p - name);
    skip_blank(ps);
    if (nl == 0 || ps->p >= ps->end || *ps->p == '.' || *ps->p == '"' || *ps->p == '\'') {
        gp_toml_error(ps, "unsupported table header (quoted or dotted names); %s", ps->supported);
        return -1;
    }
    if (nl > MAX_KEY) {
        gp_toml_error(ps, "the table name '%.20s...' is longer than %d characters; %s", name,
                      MAX_KEY, ps->supported);
        return -1;
    }
    if (*ps->p != ']' || (dbl && (ps->p + 1 >= ps->end || ps->p[1] != ']'))) {
        gp_toml_error(ps, "this table header has no closing %s", dbl ? "]]" : "]");
        return -1;
    }
    ps->p += dbl ? 2 : 1;
    char n[MAX_KEY + 1];
    snprintf(n, sizeof n, "%.*s", (int)nl, name);
    int hline = ps->line;
    if (end_of_line(ps, "the table header") != 0)
        return -1;
    int next_line = ps->line;
    ps->line = hline; /* the handler's errors name the header's line */
    int rc = h->table(ctx, ps, dbl, n);
    ps->line = next_line;
    return rc;
}

/* key = value at ps->p (on the key), given to the handler before the rest of the line is
 * read. 0, or -1 (error set). */
static int read_key_value(gp_toml_lexer *ps, const gp_toml_handlers *h, void *ctx)
{
    const char *k = ps->p;
    while (ps->p < ps->end && is_key_char(*ps->p))
        ps->p++;
    size_t kl = (size_t)(ps->p - k);
    if (kl == 0) {
        gp_toml_error(ps, "expected key = value, a [table] or a comment, not '%.*s'; %s",
                      snippet(k, ps->end), k, ps->supported);
        return -1;
    }
    if (kl > MAX_KEY) {
        gp_toml_error(ps, "the key '%.20s...' is longer than %d characters; %s", k, MAX_KEY,
                      ps->supported);
        return -1;
    }
    char key[MAX_KEY + 1];
    snprintf(key, sizeof key, "%.*s", (int)kl, k);
    skip_blank(ps);
    if (ps->p < ps->end && *ps->p == '.') {
        gp_toml_error(ps, "dotted keys (%s.x = ...) are not supported; %s", key, ps->supported);
        return -1;
    }
    if (ps->p >= ps->end || *ps->p != '=') {
        gp_toml_error(ps, "expected = after %s (key = value)", key);
        return -1;
    }
    ps->p++;
    int line = ps->line;
    gp_toml_value v;
    if (parse_value(ps, key, &v) != 0) {
        value_free(&v);
        return -1;
    }
    int value_end_line = ps->line;
    ps->line = line; /* messages about the key name the line it starts on */
    int rc = h->key_value(ctx, ps, key, &v);
    value_free(&v);
    ps->line = value_end_line;
    if (rc == 0)
        rc = end_of_line(ps, "the value");
    return rc;
}

int gp_toml_read(const char *file, const char *text, size_t len, const char *supported,
                 const gp_toml_handlers *h, void *ctx, char *err, size_t ecap)
{
    gp_toml_lexer ps = {.p = text,
                        .end = text + len,
                        .line = 1,
                        .file = file,
                        .supported = supported,
                        .err = err,
                        .ecap = ecap};
    int rc = 0;
    if (len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3))
        ps.p += 3; /* a UTF-8 byte order mark */
    while (rc == 0 && ps.p < ps.end) {
        skip_blank(&ps);
        if (ps.p >= ps.end)
            break;
        char c = *ps.p;
        if (c == '\n' || c == '\r' || c == '#') {
            rc = end_of_line(&ps, "the comment");
        } else if (c == '[') {
            rc = h->table_ends(ctx, &ps);
            if (rc == 0)
                rc = read_header(&ps, h, ctx);
        } else if (c == '"' || c == '\'') {
            gp_toml_error(&ps,
                          "quoted keys are not supported; write the key bare (token = \"...\"); %s",
                          supported);
            rc = -1;
        } else {
            rc = read_key_value(&ps, h, ctx);
        }
    }
    if (rc != 0)
        return -1;
    return h->table_ends(ctx, &ps);
}
