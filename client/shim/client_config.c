/*
 * client_config.c: the client configuration (client_config.h; docs/dev/issue5-contracts.md
 * section 3): the file, the TOML subset it may use, and the environment on top of it.
 *
 * The subset (what `gpupool login` writes, and what people write by hand):
 *   # comments                    anywhere outside a string
 *   key = value                   bare keys; values: "basic" strings (escapes \" \\ \n \t
 *                                 \uXXXX), 'literal' strings, integers, floats, true/false,
 *                                 arrays of strings (on one line or several)
 *   [requirements]                gpu, model, min_memory
 *   [[servers]]                   address, token, tls, tls_ca, tls_cert, tls_key
 * Anything else (inline tables, dotted or quoted keys, multi-line strings, dates, other arrays)
 * is an error naming FILE:LINE and what is supported. An unknown key or table is one warning and
 * is ignored. Relative paths are relative to the file's folder; "~/" is the home folder.
 *
 * Then the environment, key by key (a variable set to "" counts as unset): GPUPOOL_SERVER (a
 * comma-separated list that replaces the file's; an address the file has as a [[servers]] entry
 * keeps that entry's token and TLS settings), GPUPOOL_TOKEN, GPUPOOL_TLS, GPUPOOL_TLS_CA,
 * GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY (every server), GPUPOOL_CONNECT_TIMEOUT,
 * GPUPOOL_PROBE_TIMEOUT, GPUPOOL_GPU (alias GPUPOOL_DEVICE), GPUPOOL_GPU_MODEL,
 * GPUPOOL_MIN_MEMORY.
 *
 * Self-contained: no shim state, no globals (the NVML shim links this file too).
 */
#include <errno.h>
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_config.h"
#include "gp_log.h"
#include "net.h"

#define MAX_FILE_SIZE (1 << 20)
#define MAX_STRING 8192 /* longest string value the subset reads */
#define MAX_ITEMS 64    /* longest array of strings */

static const char SUPPORTED[] =
    "the gpupool configuration is a TOML subset: comments, key = value with \"strings\", "
    "'strings', integers, floats, true/false and arrays of strings, [requirements] and "
    "[[servers]]";

/* ====================================================================== helpers == */

static void set_err(char *err, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

/* $HOME, else the password database's home; "" when neither is known. */
static void home_dir(char *out, size_t cap) {
    const char *h = getenv("HOME");
    if (h && *h) {
        snprintf(out, cap, "%s", h);
        return;
    }
    struct passwd pw, *res = NULL;
    char buf[4096];
    if (getpwuid_r(geteuid(), &pw, buf, sizeof buf, &res) == 0 && res && res->pw_dir)
        snprintf(out, cap, "%s", res->pw_dir);
    else
        out[0] = 0;
}

/* An environment variable, NULL when unset or "". */
static const char *env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* "~/x" -> "$HOME/x"; a relative path -> dir/path (dir NULL: left as is). 0, or -1 (too long,
 * or no home folder). */
static int expand_path(const char *in, const char *dir, char *out, size_t cap) {
    int n;
    if (!*in) {
        out[0] = 0;
        return 0;
    }
    if (in[0] == '~' && (in[1] == '/' || in[1] == 0)) {
        char home[4096];
        home_dir(home, sizeof home);
        if (!*home) return -1;
        n = snprintf(out, cap, "%s%s", home, in + 1);
    } else if (in[0] != '/' && dir) {
        n = snprintf(out, cap, "%s/%s", dir, in);
    } else {
        n = snprintf(out, cap, "%s", in);
    }
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

/* 1/yes/true/on -> 1, 0/no/false/off -> 0, else -1. */
static int parse_bool_text(const char *v) {
    if (!strcmp(v, "1") || !strcasecmp(v, "yes") || !strcasecmp(v, "true") ||
        !strcasecmp(v, "on"))
        return 1;
    if (!strcmp(v, "0") || !strcasecmp(v, "no") || !strcasecmp(v, "false") ||
        !strcasecmp(v, "off"))
        return 0;
    return -1;
}

/* A number of seconds: finite and >= 0, nothing else around it but blanks. 0, or -1. */
static int parse_seconds(const char *v, double *out) {
    while (*v == ' ' || *v == '\t') v++;
    if (!*v || *v == '-' || *v == '+') return -1;
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (errno || end == v || !isfinite(d) || d < 0) return -1;
    while (*end == ' ' || *end == '\t') end++;
    if (*end) return -1;
    for (const char *p = v; p < end; p++) /* no hex, inf or nan spellings */
        if (!strchr("0123456789.eE+- \t", *p)) return -1;
    *out = d;
    return 0;
}

/* Trim blanks and check a requirement text: fits cap-1 bytes, no control characters, UTF-8.
 * 0, or -1 with err: "<what> is longer than ...; set it to <how>". */
static int check_text(const char *what, const char *value, const char *how, char *dst,
                      size_t cap, char *err, size_t ecap) {
    dst[0] = 0;
    while (*value == ' ' || *value == '\t') value++;
    size_t n = strlen(value);
    while (n > 0 && (value[n - 1] == ' ' || value[n - 1] == '\t')) n--;
    if (n >= cap) {
        set_err(err, ecap, "%s is longer than %zu bytes; set it to %s", what, cap - 1, how);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        if ((unsigned char)value[i] < 0x20 || value[i] == 0x7f) {
            set_err(err, ecap, "%s contains a control character; set it to %s", what, how);
            return -1;
        }
    }
    if (gp_utf8_clean(dst, cap, value, n) != n || memcmp(dst, value, n) != 0) {
        set_err(err, ecap, "%s is not valid UTF-8; set it to %s", what, how);
        dst[0] = 0;
        return -1;
    }
    return 0;
}

static const char GPU_HOW[] = "a GPU index of the server or a GPU UUID (prefix)";
static const char MODEL_HOW[] = "a part of the GPU name, e.g. A100";
static const char SIZE_HOW[] =
    "write bytes or a number with a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB (40*2^30), "
    "512M, 17179869184";

/* An address as a user writes it: [tls://]host[:port] / [tls://][v6]:port. Fills srv's address,
 * host, port and *tls_prefix. 0, or -1. */
static int parse_address(const char *text, gp_server_config *srv, int *tls_prefix) {
    while (*text == ' ' || *text == '\t') text++;
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == ' ' || text[n - 1] == '\t')) n--;
    *tls_prefix = 0;
    if (n >= 6 && strncasecmp(text, "tls://", 6) == 0) {
        *tls_prefix = 1;
        text += 6;
        n -= 6;
    }
    if (n == 0 || n >= sizeof srv->address) return -1;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)text[i] <= ' ' || text[i] == 0x7f || text[i] == '/' ||
            text[i] == ',')
            return -1;
    memcpy(srv->address, text, n);
    srv->address[n] = 0;
    return gp_split_hostport(srv->address, srv->host, sizeof srv->host, srv->port,
                             sizeof srv->port);
}

void gp_server_desc(const gp_server_config *srv, char *out, size_t cap) {
    if (strchr(srv->address, ':'))
        snprintf(out, cap, "%s", srv->address);
    else
        snprintf(out, cap, "%s:%s", srv->host, srv->port);
}

/* ================================================================ the TOML subset == */

enum vtype { V_STR = 1, V_INT, V_FLOAT, V_BOOL, V_ARRAY };

typedef struct value {
    enum vtype type;
    char *s; /* V_STR (malloc'd) */
    long long i;
    double f;
    int b;
    char *items[MAX_ITEMS]; /* V_ARRAY of strings (malloc'd) */
    int nitems;
} value;

static void value_free(value *v) {
    free(v->s);
    for (int i = 0; i < v->nitems; i++) free(v->items[i]);
    memset(v, 0, sizeof *v);
}

typedef struct parser {
    const char *p, *end;
    int line;
    const char *file;
    char *err;
    size_t ecap;
} parser;

#define PERR(ps, ...)                                                                           \
    do {                                                                                        \
        int o_ = snprintf((ps)->err, (ps)->ecap, "%s:%d: ", (ps)->file, (ps)->line);            \
        if (o_ > 0 && (size_t)o_ < (ps)->ecap)                                                  \
            snprintf((ps)->err + o_, (ps)->ecap - (size_t)o_, __VA_ARGS__);                     \
    } while (0)

/* How much of the text at p to quote in a message: up to 20 bytes, not past the line. */
static int snippet(const char *p, const char *end) {
    int n = 0;
    while (p + n < end && n < 20 && p[n] != '\n' && p[n] != '\r') n++;
    return n;
}

static void skip_blank(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t')) ps->p++;
}

/* After a value or header: blanks, an optional comment, then the end of the line (consumed).
 * 0, or -1 (error set). */
static int end_of_line(parser *ps, const char *after) {
    skip_blank(ps);
    if (ps->p < ps->end && *ps->p == '#')
        while (ps->p < ps->end && *ps->p != '\n') ps->p++;
    if (ps->p < ps->end && *ps->p == '\r' && ps->p + 1 < ps->end && ps->p[1] == '\n') ps->p++;
    if (ps->p >= ps->end) return 0;
    if (*ps->p != '\n') {
        PERR(ps, "unexpected text after %s: '%.*s'; %s", after, snippet(ps->p, ps->end),
             ps->p, SUPPORTED);
        return -1;
    }
    ps->p++;
    ps->line++;
    return 0;
}

static int is_key_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
}

/* Append the UTF-8 encoding of code point cp. */
static int put_utf8(char *out, size_t *o, size_t cap, unsigned long cp) {
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
    if (*o + k >= cap) return -1;
    memcpy(out + *o, b, k);
    *o += k;
    return 0;
}

/* A "basic" or 'literal' string at ps->p (on its quote); *out malloc'd. 0, or -1. */
static int parse_string(parser *ps, char **out) {
    char q = *ps->p;
    if (ps->p + 2 < ps->end && ps->p[1] == q && ps->p[2] == q) {
        PERR(ps, "multi-line strings (%c%c%c) are not supported; write the value on one line",
             q, q, q);
        return -1;
    }
    ps->p++;
    char *buf = malloc(MAX_STRING);
    if (!buf) {
        PERR(ps, "out of memory");
        return -1;
    }
    size_t o = 0;
    for (;;) {
        if (ps->p >= ps->end || *ps->p == '\n' || *ps->p == '\r') {
            PERR(ps, "this string has no closing %c on its line", q);
            goto fail;
        }
        unsigned char c = (unsigned char)*ps->p;
        if (c == (unsigned char)q) {
            ps->p++;
            break;
        }
        if ((c < 0x20 && c != '\t') || c == 0x7f) {
            PERR(ps, "a control character inside a string; write it as an escape (\\n, \\t, "
                     "\\uXXXX)");
            goto fail;
        }
        if (c == '\\' && q == '"') {
            char e = ps->p + 1 < ps->end ? ps->p[1] : 0;
            ps->p += 2;
            char plain = e == '"' ? '"' : e == '\\' ? '\\' : e == 'n' ? '\n' : e == 't' ? '\t' : 0;
            if (plain) {
                if (o + 1 >= MAX_STRING) goto too_long;
                buf[o++] = plain;
                continue;
            }
            if (e == 'u') {
                unsigned long cp = 0;
                for (int k = 0; k < 4; k++, ps->p++) {
                    char h = ps->p < ps->end ? *ps->p : 0;
                    int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                    if (d < 0) {
                        PERR(ps, "\\u needs four hex digits (\\u00e9)");
                        goto fail;
                    }
                    cp = cp * 16 + (unsigned long)d;
                }
                if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) {
                    PERR(ps, "\\u%04lx is not a character a value may hold", cp);
                    goto fail;
                }
                if (put_utf8(buf, &o, MAX_STRING, cp) != 0) goto too_long;
                continue;
            }
            PERR(ps, "unsupported escape \\%c; the supported escapes are \\\" \\\\ \\n \\t "
                     "\\uXXXX (or use a 'literal string')",
                 e >= 0x20 && e < 0x7f ? e : '?');
            goto fail;
        }
        if (o + 1 >= MAX_STRING) goto too_long;
        buf[o++] = (char)c;
        ps->p++;
    }
    buf[o] = 0;
    {
        char check[MAX_STRING];
        if (gp_utf8_clean(check, sizeof check, buf, o) != o || memcmp(check, buf, o) != 0) {
            PERR(ps, "this string is not valid UTF-8; save the file as UTF-8");
            goto fail;
        }
    }
    *out = buf;
    return 0;
too_long:
    PERR(ps, "this string is longer than %d bytes", MAX_STRING - 1);
fail:
    free(buf);
    return -1;
}

/* Blanks, newlines and comments inside an array. */
static void skip_array_space(parser *ps) {
    for (;;) {
        skip_blank(ps);
        if (ps->p < ps->end && *ps->p == '#')
            while (ps->p < ps->end && *ps->p != '\n') ps->p++;
        if (ps->p < ps->end && *ps->p == '\r' && ps->p + 1 < ps->end && ps->p[1] == '\n')
            ps->p++;
        if (ps->p < ps->end && *ps->p == '\n') {
            ps->p++;
            ps->line++;
            continue;
        }
        return;
    }
}

/* Digits with single underscores between them (TOML), copied into d[*n]. 0, or -1. */
static int digit_run(const char **pp, const char *end, char *d, size_t *n, size_t cap) {
    const char *p = *pp;
    int want_digit = 1;
    for (; p < end; p++) {
        if (*p >= '0' && *p <= '9') {
            if (*n + 2 >= cap) return -1;
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

/* TOML's number grammar (decimal only): 0 with v set, -1 if the text at p is not one. */
static int parse_number(parser *ps, value *v) {
    const char *p = ps->p;
    char d[128];
    size_t n = 0;
    int is_float = 0;
    if (*p == '+' || *p == '-') d[n++] = *p++;
    if (p >= ps->end || *p < '0' || *p > '9') return -1;
    if (*p == '0' && p + 1 < ps->end && p[1] >= '0' && p[1] <= '9') return -1; /* 007 */
    if (digit_run(&p, ps->end, d, &n, sizeof d) != 0) return -1;
    if (p < ps->end && *p == '.') {
        is_float = 1;
        d[n++] = *p++;
        if (digit_run(&p, ps->end, d, &n, sizeof d) != 0) return -1;
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        is_float = 1;
        d[n++] = 'e';
        p++;
        if (p < ps->end && (*p == '+' || *p == '-')) d[n++] = *p++;
        if (digit_run(&p, ps->end, d, &n, sizeof d) != 0) return -1;
    }
    if (p < ps->end && !strchr(" \t\r\n#,]", *p)) return -1; /* what follows ends the value */
    d[n] = 0;
    errno = 0;
    if (is_float) {
        v->type = V_FLOAT;
        v->f = strtod(d, NULL);
        if (errno || !isfinite(v->f)) return -1;
    } else {
        v->type = V_INT;
        v->i = strtoll(d, NULL, 10);
        if (errno) return -1;
    }
    ps->p = p;
    return 0;
}

/* The value after "key = ". 0, or -1 (error set). */
static int parse_value(parser *ps, const char *key, value *v) {
    memset(v, 0, sizeof *v);
    skip_blank(ps);
    if (ps->p >= ps->end || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '#') {
        PERR(ps, "%s has no value; write %s = \"...\"", key, key);
        return -1;
    }
    char c = *ps->p;
    if (c == '"' || c == '\'') {
        v->type = V_STR;
        return parse_string(ps, &v->s);
    }
    if (c == '[') {
        v->type = V_ARRAY;
        ps->p++;
        for (;;) {
            skip_array_space(ps);
            if (ps->p >= ps->end) {
                PERR(ps, "the array of %s has no closing ]", key);
                return -1;
            }
            if (*ps->p == ']') {
                ps->p++;
                return 0;
            }
            if (*ps->p != '"' && *ps->p != '\'') {
                PERR(ps, "the array of %s may only hold strings; %s", key, SUPPORTED);
                return -1;
            }
            if (v->nitems >= MAX_ITEMS) {
                PERR(ps, "the array of %s has more than %d items", key, MAX_ITEMS);
                return -1;
            }
            if (parse_string(ps, &v->items[v->nitems]) != 0) return -1;
            v->nitems++;
            skip_array_space(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            if (ps->p < ps->end && *ps->p == ']') continue;
            PERR(ps, "expected , or ] in the array of %s", key);
            return -1;
        }
    }
    if (!strncmp(ps->p, "true", 4) || !strncmp(ps->p, "false", 5)) {
        int t = ps->p[0] == 't';
        const char *after = ps->p + (t ? 4 : 5);
        if (after >= ps->end || strchr(" \t\r\n#", *after)) {
            v->type = V_BOOL;
            v->b = t;
            ps->p = after;
            return 0;
        }
    }
    if (c == '{') {
        PERR(ps, "inline tables ({...}) are not supported; %s", SUPPORTED);
        return -1;
    }
    if (((c >= '0' && c <= '9') || c == '+' || c == '-') && parse_number(ps, v) == 0) return 0;
    PERR(ps, "cannot read the value of %s (strings need quotes: %s = \"...\"; dates, hex "
             "numbers, inf and nan are not supported); %s",
         key, key, SUPPORTED);
    return -1;
}

/* ============================================================ the file's settings == */

/* What a server entry sets itself. F_PREFIX: its address is tls://... (TLS whatever else says). */
enum { F_TOKEN = 1, F_TLS = 2, F_CA = 4, F_CERT = 8, F_KEY = 16, F_PREFIX = 32 };

typedef struct file_settings {
    gp_server_config servers[GP_MAX_SERVERS]; /* address/host/port and their own settings */
    unsigned set[GP_MAX_SERVERS];             /* F_*: what the entry sets itself */
    int nservers;
    int short_form_line;  /* line of `servers = [...]`, 0 if none */
    int tables_line;      /* line of the first [[servers]], 0 if none */
    char token[4097];
    int tls;
    char tls_ca[4096], tls_cert[4096], tls_key[4096];
    double connect_timeout, probe_timeout;
    int has_connect_timeout, has_probe_timeout;
    char gpu[256], model[256];
    uint64_t min_memory;
    int has_gpu, has_model, has_min_memory;
    int holds_token;
} file_settings;

enum section { SEC_TOP, SEC_REQ, SEC_SERVER, SEC_UNKNOWN };

/* Keys seen in the current table, for "set twice". */
typedef struct seen_keys {
    char names[32][32];
    int n;
} seen_keys;

static int seen_before(seen_keys *s, const char *key) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], key)) return 1;
    if (s->n < 32 && strlen(key) < sizeof s->names[0]) strcpy(s->names[s->n++], key);
    return 0;
}

static int want_type(parser *ps, const char *key, const value *v, enum vtype t, const char *how) {
    if (v->type == t) return 0;
    PERR(ps, "%s must be %s", key, how);
    return -1;
}

/* A string value that is a path: expanded into out. */
static int path_value(parser *ps, const char *key, const value *v, const char *dir, char *out,
                      size_t cap) {
    if (want_type(ps, key, v, V_STR, "a file path in quotes") != 0) return -1;
    if (expand_path(v->s, dir, out, cap) != 0) {
        PERR(ps, "%s = \"%s\": the path is too long (or ~ has no home folder)", key, v->s);
        return -1;
    }
    return 0;
}

static int token_value(parser *ps, const char *key, const value *v, char *out, size_t cap) {
    if (want_type(ps, key, v, V_STR, "a string in quotes (the token gpupoold gave you)") != 0)
        return -1;
    if (strlen(v->s) >= cap) {
        PERR(ps, "%s is longer than %zu bytes; is it the right value?", key, cap - 1);
        return -1;
    }
    snprintf(out, cap, "%s", v->s);
    return 0;
}

static int timeout_value(parser *ps, const char *key, const value *v, double *out) {
    double d = v->type == V_INT ? (double)v->i : v->type == V_FLOAT ? v->f : -1;
    if ((v->type != V_INT && v->type != V_FLOAT) || d < 0) {
        PERR(ps, "%s must be a number of seconds, 0 or more (0: no limit), e.g. %s = 10", key,
             key);
        return -1;
    }
    *out = d;
    return 0;
}

/* One `key = value` in section sec. 0, or -1 (error set). */
static int apply_key(parser *ps, file_settings *fs, enum section sec, const char *key,
                     value *v, const char *dir, int *warned_unknown) {
    char why[600];
    if (sec == SEC_UNKNOWN) return 0; /* the table was warned about */
    if (sec == SEC_TOP) {
        if (!strcmp(key, "token")) {
            if (token_value(ps, key, v, fs->token, sizeof fs->token) != 0) return -1;
            if (*fs->token) fs->holds_token = 1;
            return 0;
        }
        if (!strcmp(key, "tls")) {
            if (want_type(ps, key, v, V_BOOL, "true or false") != 0) return -1;
            fs->tls = v->b;
            return 0;
        }
        if (!strcmp(key, "tls_ca"))
            return path_value(ps, key, v, dir, fs->tls_ca, sizeof fs->tls_ca);
        if (!strcmp(key, "tls_cert"))
            return path_value(ps, key, v, dir, fs->tls_cert, sizeof fs->tls_cert);
        if (!strcmp(key, "tls_key"))
            return path_value(ps, key, v, dir, fs->tls_key, sizeof fs->tls_key);
        if (!strcmp(key, "connect_timeout")) {
            fs->has_connect_timeout = 1;
            return timeout_value(ps, key, v, &fs->connect_timeout);
        }
        if (!strcmp(key, "probe_timeout")) {
            fs->has_probe_timeout = 1;
            return timeout_value(ps, key, v, &fs->probe_timeout);
        }
        if (!strcmp(key, "servers")) {
            if (want_type(ps, key, v, V_ARRAY,
                          "an array of addresses, servers = [\"gpu1:7070\", \"tls://gpu2:7070\"] "
                          "(or one [[servers]] table per server)") != 0)
                return -1;
            fs->short_form_line = ps->line;
            for (int i = 0; i < v->nitems; i++) {
                if (fs->nservers >= GP_MAX_SERVERS) {
                    PERR(ps, "more than %d servers; keep the %d you prefer", GP_MAX_SERVERS,
                         GP_MAX_SERVERS);
                    return -1;
                }
                int prefix;
                gp_server_config *s = &fs->servers[fs->nservers];
                if (parse_address(v->items[i], s, &prefix) != 0) {
                    PERR(ps, "'%s' is not a server address: write host, host:port, [v6]:port or "
                             "tls://host:port",
                         v->items[i]);
                    return -1;
                }
                if (prefix) fs->set[fs->nservers] |= F_PREFIX;
                fs->nservers++;
            }
            return 0;
        }
    } else if (sec == SEC_REQ) {
        if (!strcmp(key, "gpu")) {
            char text[64];
            const char *t = v->s;
            if (v->type == V_INT && v->i >= 0) {
                snprintf(text, sizeof text, "%lld", v->i);
                t = text;
            } else if (v->type != V_STR) {
                PERR(ps, "gpu must be a GPU index (\"1\") or a GPU UUID (prefix) in quotes");
                return -1;
            }
            if (check_text("gpu", t, GPU_HOW, fs->gpu, sizeof fs->gpu, why, sizeof why) != 0) {
                PERR(ps, "%s", why);
                return -1;
            }
            fs->has_gpu = 1;
            return 0;
        }
        if (!strcmp(key, "model")) {
            if (want_type(ps, key, v, V_STR, "a part of the GPU name in quotes (\"H100\")") != 0)
                return -1;
            if (check_text("model", v->s, MODEL_HOW, fs->model, sizeof fs->model, why,
                           sizeof why) != 0) {
                PERR(ps, "%s", why);
                return -1;
            }
            fs->has_model = 1;
            return 0;
        }
        if (!strcmp(key, "min_memory")) {
            if (v->type == V_INT && v->i >= 0) {
                fs->min_memory = (uint64_t)v->i;
            } else if (v->type != V_STR) {
                PERR(ps, "min_memory must be a size in quotes (\"40GiB\", \"80G\") or bytes as "
                         "an integer");
                return -1;
            } else {
                int blank = 1;
                for (const char *p = v->s; *p; p++) blank &= *p == ' ' || *p == '\t';
                fs->min_memory = 0;
                if (!blank && gp_parse_size(v->s, &fs->min_memory) != 0) {
                    PERR(ps, "min_memory = \"%s\" is not a size: %s", v->s, SIZE_HOW);
                    return -1;
                }
            }
            fs->has_min_memory = 1;
            return 0;
        }
    } else if (sec == SEC_SERVER) {
        int i = fs->nservers - 1;
        gp_server_config *s = &fs->servers[i];
        if (!strcmp(key, "address")) {
            if (want_type(ps, key, v, V_STR, "a server address in quotes (\"gpu1:7070\")") != 0)
                return -1;
            int prefix;
            if (parse_address(v->s, s, &prefix) != 0) {
                PERR(ps, "'%s' is not a server address: write host, host:port, [v6]:port or "
                         "tls://host:port",
                     v->s);
                return -1;
            }
            if (prefix) fs->set[i] |= F_PREFIX;
            return 0;
        }
        if (!strcmp(key, "token")) {
            if (token_value(ps, key, v, s->token, sizeof s->token) != 0) return -1;
            fs->set[i] |= F_TOKEN;
            if (*s->token) fs->holds_token = 1;
            return 0;
        }
        if (!strcmp(key, "tls")) {
            if (want_type(ps, key, v, V_BOOL, "true or false") != 0) return -1;
            s->tls = v->b;
            fs->set[i] |= F_TLS;
            return 0;
        }
        unsigned bit = !strcmp(key, "tls_ca") ? F_CA : !strcmp(key, "tls_cert") ? F_CERT
                       : !strcmp(key, "tls_key") ? F_KEY : 0;
        if (bit) {
            char *dst = bit == F_CA ? s->tls_ca : bit == F_CERT ? s->tls_cert : s->tls_key;
            fs->set[i] |= bit;
            return path_value(ps, key, v, dir, dst, sizeof s->tls_ca);
        }
    }
    static const char *const known[] = {
        "token, tls, tls_ca, tls_cert, tls_key, connect_timeout, probe_timeout, servers",
        "gpu, model, min_memory",
        "address, token, tls, tls_ca, tls_cert, tls_key",
    };
    static const char *const where[] = {"", " in [requirements]", " in [[servers]]"};
    gp_log_info("%s:%d: unknown setting '%s'%s ignored (known there: %s)", ps->file, ps->line,
                key, where[sec], known[sec]);
    (*warned_unknown)++;
    return 0;
}

/* A [table] or [[table]] header line at ps->p. 0, or -1 (error set). */
static int parse_header(parser *ps, file_settings *fs, enum section *sec, int *req_seen) {
    int dbl = ps->p + 1 < ps->end && ps->p[1] == '[';
    ps->p += dbl ? 2 : 1;
    skip_blank(ps);
    const char *name = ps->p;
    while (ps->p < ps->end && is_key_char(*ps->p)) ps->p++;
    size_t nl = (size_t)(ps->p - name);
    skip_blank(ps);
    if (nl == 0 || ps->p >= ps->end || *ps->p == '.' || *ps->p == '"' || *ps->p == '\'') {
        PERR(ps, "unsupported table header (quoted or dotted names); %s", SUPPORTED);
        return -1;
    }
    if (*ps->p != ']' || (dbl && (ps->p + 1 >= ps->end || ps->p[1] != ']'))) {
        PERR(ps, "this table header has no closing %s", dbl ? "]]" : "]");
        return -1;
    }
    ps->p += dbl ? 2 : 1;
    char n[64];
    snprintf(n, sizeof n, "%.*s", (int)(nl < 63 ? nl : 63), name);
    int hline = ps->line;
    if (end_of_line(ps, "the table header") != 0) return -1;
    int next_line = ps->line;
    ps->line = hline; /* the errors below name the header's line */
    int rc = 0;
    if (!strcmp(n, "requirements")) {
        if (dbl) {
            PERR(ps, "[[requirements]] is not supported: write [requirements] (one table)");
            rc = -1;
        } else if ((*req_seen)++) {
            PERR(ps, "[requirements] appears twice; merge the two tables");
            rc = -1;
        } else {
            *sec = SEC_REQ;
        }
    } else if (!strcmp(n, "servers")) {
        if (!dbl) {
            PERR(ps, "[servers] is not supported: write [[servers]] before each server's "
                     "address = \"...\" (or servers = [\"a:7070\", \"b:7070\"] at the top)");
            rc = -1;
        } else if (fs->short_form_line) {
            PERR(ps, "[[servers]] together with servers = [...] (line %d): use one form",
                 fs->short_form_line);
            rc = -1;
        } else if (fs->nservers >= GP_MAX_SERVERS) {
            PERR(ps, "more than %d servers; keep the %d you prefer", GP_MAX_SERVERS,
                 GP_MAX_SERVERS);
            rc = -1;
        } else {
            if (!fs->tables_line) fs->tables_line = ps->line;
            fs->nservers++;
            *sec = SEC_SERVER;
        }
    } else {
        gp_log_info("%s:%d: unknown table %s%s%s ignored (known: [requirements], [[servers]])",
                    ps->file, ps->line, dbl ? "[[" : "[", n, dbl ? "]]" : "]");
        *sec = SEC_UNKNOWN;
    }
    ps->line = next_line;
    return rc;
}

/* The [[servers]] entry that ended (or the last one) must have an address. */
static int check_entry(parser *ps, file_settings *fs, enum section sec, int header_line) {
    if (sec != SEC_SERVER || fs->servers[fs->nservers - 1].address[0]) return 0;
    int line = ps->line;
    ps->line = header_line;
    PERR(ps, "this [[servers]] entry has no address; write address = \"host:port\" under it");
    ps->line = line;
    return -1;
}

/* Parse text (the file's bytes) into fs. dir: the file's folder. 0, or -1 with err. */
static int parse_file(const char *file, const char *dir, const char *text, size_t len,
                      file_settings *fs, char *err, size_t ecap) {
    parser ps = {.p = text, .end = text + len, .line = 1, .file = file, .err = err, .ecap = ecap};
    enum section sec = SEC_TOP;
    int req_seen = 0, header_line = 0, warned = 0;
    seen_keys seen = {0};
    if (len >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3)) ps.p += 3; /* a UTF-8 byte order mark */
    while (ps.p < ps.end) {
        skip_blank(&ps);
        if (ps.p >= ps.end) break;
        char c = *ps.p;
        if (c == '\n' || c == '\r' || c == '#') {
            if (end_of_line(&ps, "the comment") != 0) return -1;
            continue;
        }
        if (c == '[') {
            if (check_entry(&ps, fs, sec, header_line) != 0) return -1;
            header_line = ps.line;
            if (parse_header(&ps, fs, &sec, &req_seen) != 0) return -1;
            memset(&seen, 0, sizeof seen);
            continue;
        }
        if (c == '"' || c == '\'') {
            PERR(&ps, "quoted keys are not supported; write the key bare (token = \"...\"); %s",
                 SUPPORTED);
            return -1;
        }
        const char *k = ps.p;
        while (ps.p < ps.end && is_key_char(*ps.p)) ps.p++;
        size_t kl = (size_t)(ps.p - k);
        if (kl == 0) {
            PERR(&ps, "expected key = value, a [table] or a comment, not '%.*s'; %s",
                 snippet(k, ps.end), k,
                 SUPPORTED);
            return -1;
        }
        char key[64];
        snprintf(key, sizeof key, "%.*s", (int)(kl < 63 ? kl : 63), k);
        skip_blank(&ps);
        if (ps.p < ps.end && *ps.p == '.') {
            PERR(&ps, "dotted keys (%s.x = ...) are not supported; %s", key, SUPPORTED);
            return -1;
        }
        if (ps.p >= ps.end || *ps.p != '=') {
            PERR(&ps, "expected = after %s (key = value)", key);
            return -1;
        }
        ps.p++;
        int line = ps.line;
        value v;
        if (parse_value(&ps, key, &v) != 0) {
            value_free(&v);
            return -1;
        }
        int value_end_line = ps.line;
        ps.line = line; /* messages about the key name the line it starts on */
        int rc = 0;
        if (sec != SEC_UNKNOWN && seen_before(&seen, key)) {
            PERR(&ps, "%s is set twice in the same table; keep one", key);
            rc = -1;
        }
        if (rc == 0) rc = apply_key(&ps, fs, sec, key, &v, dir, &warned);
        value_free(&v);
        ps.line = value_end_line;
        if (rc != 0 || end_of_line(&ps, "the value") != 0) return -1;
    }
    return check_entry(&ps, fs, sec, header_line);
}

/* ======================================================================= the file == */

/* Which file: 1 with path set, 0 for none, -1 with err. */
static int find_file(char *path, size_t cap, char *err, size_t ecap) {
    const char *explicit_ = env("GPUPOOL_CONFIG");
    struct stat st;
    if (explicit_) {
        if (!strcmp(explicit_, "none")) return 0;
        if (stat(explicit_, &st) != 0) {
            set_err(err, ecap, "GPUPOOL_CONFIG=%s: %s; point it at the configuration file, or "
                    "set GPUPOOL_CONFIG=none to read none", explicit_, strerror(errno));
            return -1;
        }
        snprintf(path, cap, "%s", explicit_);
        return 1;
    }
    const char *xdg = env("XDG_CONFIG_HOME");
    char home[4096];
    int n = -1;
    if (xdg) {
        n = snprintf(path, cap, "%s/gpupool/config.toml", xdg);
    } else {
        home_dir(home, sizeof home);
        if (*home) n = snprintf(path, cap, "%s/.config/gpupool/config.toml", home);
    }
    if (n > 0 && (size_t)n < cap && stat(path, &st) == 0) return 1;
    snprintf(path, cap, "/etc/gpupool/config.toml");
    if (stat(path, &st) == 0) return 1;
    path[0] = 0;
    return 0;
}

/* Read the whole file (NUL-terminated, malloc'd). 0, or -1 with err. */
static int read_file(const char *path, char **out, size_t *len, struct stat *st, char *err,
                     size_t ecap) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, ecap, "cannot read the configuration file %s: %s", path, strerror(errno));
        return -1;
    }
    if (fstat(fileno(f), st) != 0 || !S_ISREG(st->st_mode)) {
        set_err(err, ecap, "the configuration file %s is not a regular file", path);
        fclose(f);
        return -1;
    }
    if (st->st_size > MAX_FILE_SIZE) {
        set_err(err, ecap, "the configuration file %s is larger than %d bytes; is it the right "
                "file?", path, MAX_FILE_SIZE);
        fclose(f);
        return -1;
    }
    char *buf = malloc((size_t)st->st_size + 1);
    if (!buf) {
        set_err(err, ecap, "out of memory reading %s", path);
        fclose(f);
        return -1;
    }
    size_t n = fread(buf, 1, (size_t)st->st_size, f);
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        set_err(err, ecap, "cannot read the configuration file %s: %s", path, strerror(EIO));
        free(buf);
        return -1;
    }
    if (memchr(buf, 0, n)) {
        set_err(err, ecap, "the configuration file %s holds a NUL byte: it must be a text file",
                path);
        free(buf);
        return -1;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

/* 1 if path lies under the home folder (both resolved when they exist). */
static int under_home(const char *path) {
    char home[4096], rhome[4096], rpath[4096];
    home_dir(home, sizeof home);
    if (!*home) return 0;
    const char *h = realpath(home, rhome) ? rhome : home;
    const char *p = realpath(path, rpath) ? rpath : path;
    size_t hl = strlen(h);
    while (hl > 1 && h[hl - 1] == '/') hl--;
    return hl > 1 && strncmp(p, h, hl) == 0 && p[hl] == '/';
}

/* The mode warning: a file under the home folder holding a token, readable by others. */
static void check_mode(const char *path, const struct stat *st, const file_settings *fs) {
    if (!fs->holds_token || !(st->st_mode & 044) || !under_home(path)) return;
    gp_log_info("%s holds a token and is readable by other users (mode %04o): chmod 600 %s",
                path, (unsigned)(st->st_mode & 07777), path);
}

/* ================================================================ the environment == */

/* GPUPOOL_SERVER replaces the list; entries also in the file keep their settings. */
static int env_servers(const char *list, const file_settings *fs, gp_client_config *cfg,
                       unsigned *set, char *err, size_t ecap) {
    char *copy = strdup(list);
    if (!copy) {
        set_err(err, ecap, "out of memory");
        return -1;
    }
    int rc = 0;
    char *save = NULL;
    cfg->nservers = 0;
    for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        while (*e == ' ' || *e == '\t') e++;
        if (!*e) continue;
        if (cfg->nservers >= GP_MAX_SERVERS) {
            set_err(err, ecap, "GPUPOOL_SERVER names more than %d servers; keep the %d you "
                    "prefer", GP_MAX_SERVERS, GP_MAX_SERVERS);
            rc = -1;
            break;
        }
        gp_server_config *s = &cfg->servers[cfg->nservers];
        int prefix;
        if (parse_address(e, s, &prefix) != 0) {
            size_t el = strlen(e);
            while (el > 0 && (e[el - 1] == ' ' || e[el - 1] == '\t')) e[--el] = 0;
            set_err(err, ecap, "GPUPOOL_SERVER: '%s' is not a server address: write "
                    "host:port, [v6]:port, host (port %s) or tls://host:port, separated by "
                    "commas", e, GP_DEFAULT_PORT);
            rc = -1;
            break;
        }
        unsigned bits = 0;
        for (int j = 0; j < fs->nservers; j++) {
            const gp_server_config *f = &fs->servers[j];
            if (strcasecmp(f->host, s->host) != 0 || strcmp(f->port, s->port) != 0) continue;
            char address[sizeof s->address];
            memcpy(address, s->address, sizeof address);
            *s = *f; /* its token and TLS settings */
            memcpy(s->address, address, sizeof address);
            bits = fs->set[j];
            break;
        }
        if (prefix) bits |= F_PREFIX;
        set[cfg->nservers] = bits;
        cfg->nservers++;
    }
    free(copy);
    if (rc == 0 && cfg->nservers == 0) {
        set_err(err, ecap, "GPUPOOL_SERVER='%s' names no server: set GPUPOOL_SERVER=host:port",
                list);
        rc = -1;
    }
    return rc;
}

static int env_tls_file(const char *name, char *dst, size_t cap, char *err, size_t ecap) {
    const char *v = env(name);
    if (!v) return 0;
    if (expand_path(v, NULL, dst, cap) != 0) {
        set_err(err, ecap, "%s is too long (at most %zu bytes)", name, cap - 1);
        return -1;
    }
    return 0;
}

static int env_requirements(gp_client_config *cfg, char *err, size_t ecap) {
    const char *gpu = env("GPUPOOL_GPU"), *old = env("GPUPOOL_DEVICE");
    const char *gpu_var = "GPUPOOL_GPU";
    if (!gpu) {
        gpu = old;
        gpu_var = "GPUPOOL_DEVICE";
    } else if (old && strcmp(old, gpu) != 0) {
        gp_log_info("GPUPOOL_DEVICE=%s ignored: GPUPOOL_GPU=%s is set (GPUPOOL_DEVICE is its old "
                    "name)", old, gpu);
    }
    if (gpu && check_text(gpu_var, gpu, GPU_HOW, cfg->gpu, sizeof cfg->gpu, err, ecap) != 0)
        return -1;
    const char *model = env("GPUPOOL_GPU_MODEL");
    if (model && check_text("GPUPOOL_GPU_MODEL", model, MODEL_HOW, cfg->model,
                            sizeof cfg->model, err, ecap) != 0)
        return -1;
    const char *mem = env("GPUPOOL_MIN_MEMORY");
    if (mem) {
        int blank = 1;
        for (const char *p = mem; *p; p++) blank &= *p == ' ' || *p == '\t';
        cfg->min_memory = 0;
        if (!blank && gp_parse_size(mem, &cfg->min_memory) != 0) {
            set_err(err, ecap, "GPUPOOL_MIN_MEMORY=%s is not a size: %s", mem, SIZE_HOW);
            return -1;
        }
    }
    return 0;
}

static int env_seconds(const char *name, double *out, char *err, size_t ecap) {
    const char *v = env(name);
    if (v && parse_seconds(v, out) != 0) {
        set_err(err, ecap, "%s=%s is not a number of seconds: write e.g. 10 or 2.5 (0: no "
                "limit)", name, v);
        return -1;
    }
    return 0;
}

/* =================================================================== the loader == */

static int load(gp_client_config *cfg, file_settings *fs, char *err, size_t ecap) {
    memset(cfg, 0, sizeof *cfg);
    cfg->connect_timeout = 10;
    cfg->probe_timeout = 2;

    char path[4096];
    int found = find_file(path, sizeof path, err, ecap);
    if (found < 0) return -1;
    if (found) {
        char *text;
        size_t len;
        struct stat st;
        if (read_file(path, &text, &len, &st, err, ecap) != 0) return -1;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash == dir)
            dir[1] = 0;
        else if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
        int rc = parse_file(path, dir, text, len, fs, err, ecap);
        free(text);
        if (rc != 0) return -1;
        snprintf(cfg->file, sizeof cfg->file, "%s", path);
        check_mode(path, &st, fs);
        if (fs->has_connect_timeout) cfg->connect_timeout = fs->connect_timeout;
        if (fs->has_probe_timeout) cfg->probe_timeout = fs->probe_timeout;
        snprintf(cfg->gpu, sizeof cfg->gpu, "%s", fs->gpu);
        snprintf(cfg->model, sizeof cfg->model, "%s", fs->model);
        cfg->min_memory = fs->min_memory;
    }

    /* The list, with what each entry sets itself. */
    unsigned set[GP_MAX_SERVERS] = {0};
    const char *list = env("GPUPOOL_SERVER");
    if (list) {
        if (env_servers(list, fs, cfg, set, err, ecap) != 0) return -1;
    } else {
        cfg->nservers = fs->nservers;
        for (int i = 0; i < fs->nservers; i++) {
            cfg->servers[i] = fs->servers[i];
            set[i] = fs->set[i];
        }
    }

    /* The defaults for what an entry does not set, then the environment for every server. */
    const char *token = env("GPUPOOL_TOKEN");
    if (token && strlen(token) > 4096) {
        set_err(err, ecap, "GPUPOOL_TOKEN is longer than 4096 bytes; is it the right value?");
        return -1;
    }
    const char *tls_text = env("GPUPOOL_TLS");
    int tls_env = tls_text ? parse_bool_text(tls_text) : -2;
    if (tls_env == -1) {
        set_err(err, ecap, "GPUPOOL_TLS=%s is not understood: use 1 (TLS) or 0 (plain TCP)",
                tls_text);
        return -1;
    }
    char ca[4096], cert[4096], key[4096];
    snprintf(ca, sizeof ca, "%s", fs->tls_ca);
    snprintf(cert, sizeof cert, "%s", fs->tls_cert);
    snprintf(key, sizeof key, "%s", fs->tls_key);
    unsigned env_files = (env("GPUPOOL_TLS_CA") ? F_CA : 0) |
                         (env("GPUPOOL_TLS_CERT") ? F_CERT : 0) |
                         (env("GPUPOOL_TLS_KEY") ? F_KEY : 0);
    if (env_tls_file("GPUPOOL_TLS_CA", ca, sizeof ca, err, ecap) != 0 ||
        env_tls_file("GPUPOOL_TLS_CERT", cert, sizeof cert, err, ecap) != 0 ||
        env_tls_file("GPUPOOL_TLS_KEY", key, sizeof key, err, ecap) != 0)
        return -1;
    for (int i = 0; i < cfg->nservers; i++) {
        gp_server_config *s = &cfg->servers[i];
        if (token)
            snprintf(s->token, sizeof s->token, "%s", token);
        else if (!(set[i] & F_TOKEN))
            snprintf(s->token, sizeof s->token, "%s", fs->token);
        if (set[i] & F_PREFIX)
            s->tls = 1; /* tls://: TLS whatever else says */
        else if (tls_env >= 0)
            s->tls = tls_env;
        else if (!(set[i] & F_TLS))
            s->tls = fs->tls;
        if ((env_files & F_CA) || !(set[i] & F_CA)) memcpy(s->tls_ca, ca, sizeof ca);
        if ((env_files & F_CERT) || !(set[i] & F_CERT)) memcpy(s->tls_cert, cert, sizeof cert);
        if ((env_files & F_KEY) || !(set[i] & F_KEY)) memcpy(s->tls_key, key, sizeof key);
    }

    if (env_seconds("GPUPOOL_CONNECT_TIMEOUT", &cfg->connect_timeout, err, ecap) != 0 ||
        env_seconds("GPUPOOL_PROBE_TIMEOUT", &cfg->probe_timeout, err, ecap) != 0)
        return -1;
    return env_requirements(cfg, err, ecap);
}

int gp_client_config_load(gp_client_config *cfg, char *err, size_t errcap) {
    file_settings *fs = calloc(1, sizeof *fs);
    if (!fs) {
        set_err(err, errcap, "out of memory reading the gpupool configuration");
        return -1;
    }
    int rc = load(cfg, fs, err, errcap);
    free(fs);
    return rc;
}
