/*
 * client_config.c: the client configuration (client_config.h;
 * docs/client-configuration.md): the file, the TOML subset it may use, and the environment on top of it.
 * The one reader of this file: the shims link it, and the `gpupool` command calls it through
 * libgpupool-config.so (client/config/binding.c; tests/test_client_config_cases.py runs a table of
 * cases through it, also under ASan/UBSan).
 *
 * The subset (what `gpupool login` writes, and what people write by hand):
 *   # comments                    anywhere outside a string
 *   keep_gpu = true | false       keep the GPU while idle: the server never detaches the lease
 *                                 (GPUPOOL_KEEP_GPU=1 too)
 *   compression = "off" | "lz4"   LZ4-compressed copies (docs/architecture.md): at the top level
 *                                 (every server's default) and in a [[servers]] table (that
 *                                 server's own)
 *   key = value                   bare keys; values: "basic" strings (escapes \" \\ \n \t
 *                                 \uXXXX), 'literal' strings, integers, floats, true/false,
 *                                 arrays of strings (on one line or several)
 *   [requirements]                gpu, model, min_memory
 *   [[servers]]                   address, token, tls, tls_ca, tls_cert, tls_key,
 *                                 tls_fingerprint, compression
 * TLS is the default (tls = true unless a server's entry, the top level or GPUPOOL_TLS=0 says
 * false); tls_fingerprint = "SHA256:..." pins the server's identity (gp_fingerprint_valid).
 * Anything else (inline tables, dotted or quoted keys, multi-line strings, dates, other arrays)
 * is an error naming FILE:LINE and what is supported. An unknown key or table is one warning and
 * is ignored. Numbers: TOML's decimal grammar (underscores between digits, an optional sign,
 * fraction and exponent), at most 100 characters, integers within 64-bit signed.
 *
 * Values: a string setting is stripped of blanks (space, tab, CR, LF, FF, VT) at both ends, and
 * one that is empty after that counts as unset (a [[servers]] entry with token = "" takes the
 * default token). No setting may hold a control character. Paths: "~" and "~/..." are the home
 * folder; a relative path is relative to the folder of the file after symlinks are resolved
 * (realpath), so a symlinked config.toml finds the files next to its target.
 *
 * Then the environment, key by key: every GPUPOOL_* value is stripped the same way and a blank
 * one counts as unset. GPUPOOL_SERVER (a comma-separated list that replaces the file's; an
 * address the file has as a [[servers]] entry keeps that entry's token, TLS and compression
 * settings),
 * GPUPOOL_TOKEN, GPUPOOL_TLS, GPUPOOL_TLS_CA, GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY (every server;
 * "~/" expanded, a relative path is the caller's), GPUPOOL_TLS_FINGERPRINT (the pin of every
 * server whose entry has none: the servers of GPUPOOL_SERVER run without a file), GPUPOOL_CONNECT_TIMEOUT,
 * GPUPOOL_PROBE_TIMEOUT (digits with an optional fraction: "10", "2.5"), GPUPOOL_GPU (alias
 * GPUPOOL_DEVICE), GPUPOOL_GPU_MODEL, GPUPOOL_MIN_MEMORY, GPUPOOL_COMPRESSION (off, lz4; every
 * server, over the servers' own compression).
 *
 * Self-contained: no shim state (the NVML shim links this file too). The only static state is
 * the hooks of the load running on this thread (thread-local, so no lock).
 */
#include <errno.h>
#include <limits.h>
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
#define MAX_NUMBER 100  /* longest number, as written */
#define MAX_KEY 63      /* longest key or table name */
#define MAX_KEYS 64     /* most keys in one table */

static const char SUPPORTED[] =
    "the gpupool configuration is a TOML subset: comments, key = value with \"strings\", "
    "'strings', integers, floats, true/false and arrays of strings, [requirements] and "
    "[[servers]]";

/* ====================================================================== helpers == */

/* The hooks of the gp_client_config_load_with running on this thread (NULL: none): set for the
 * duration of that call only. Thread-local, so loads on other threads never see them. */
static _Thread_local const gp_config_hooks *hooks;

/* getenv, or the hooks' environment block. */
static const char *cfg_getenv(const char *name)
{
    if (!hooks || !hooks->envp)
        return getenv(name);
    size_t n = strlen(name);
    for (char *const *e = hooks->envp; *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=')
            return *e + n + 1;
    return NULL;
}

/* A warning: one line to the hooks' warn, else to the log. */
static void warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn(const char *fmt, ...)
{
    char line[8448];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (hooks && hooks->warn)
        hooks->warn(hooks->ctx, line);
    else
        gp_log_info("%s", line);
}

static void visit(int kind, const char *key, const char *text)
{
    if (hooks && hooks->visit)
        hooks->visit(hooks->ctx, kind, key, text);
}

static void src_line(gp_config_source *src, int line)
{
    src->line = line;
    src->what = NULL;
}

static void src_what(gp_config_source *src, const char *what)
{
    src->line = 0;
    src->what = what;
}

static void set_err(char *err, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

/* The blanks stripped from both ends of every value. */
static int is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* s without the blanks at both ends: its first byte, *n its length (in: strlen(s) or less). */
static const char *strip(const char *s, size_t *n)
{
    while (*n > 0 && is_blank(*s)) {
        s++;
        (*n)--;
    }
    while (*n > 0 && is_blank(s[*n - 1]))
        (*n)--;
    return s;
}

/* $HOME, else the password database's home; "" when neither is known. */
static void home_dir(char *out, size_t cap)
{
    const char *h = cfg_getenv("HOME");
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

/* A GPUPOOL_* variable without the blanks at its ends: NULL when unset or blank, else its first
 * byte, with *n its length (the text is not NUL-terminated there). */
static const char *env_view(const char *name, size_t *n)
{
    const char *v = cfg_getenv(name);
    if (!v)
        return NULL;
    *n = strlen(v);
    v = strip(v, n);
    return *n ? v : NULL;
}

/* An environment variable as it is (not a GPUPOOL_* one: XDG_CONFIG_HOME), NULL when unset or
 * "". */
static const char *env_raw(const char *name)
{
    const char *v = cfg_getenv(name);
    return v && *v ? v : NULL;
}

/* in[0..n): "~" / "~/x" -> "$HOME" / "$HOME/x"; a relative path -> dir/path (dir NULL: left as
 * is). 0; -1 too long for cap; -2 "~" but no home folder. */
static int expand_path(const char *in, size_t n, const char *dir, char *out, size_t cap)
{
    int k;
    if (n == 0) {
        out[0] = 0;
        return 0;
    }
    if (in[0] == '~' && (n == 1 || in[1] == '/')) {
        char home[4096];
        home_dir(home, sizeof home);
        if (!*home)
            return -2;
        k = snprintf(out, cap, "%s%.*s", home, (int)(n - 1), in + 1);
    } else if (in[0] != '/' && dir) {
        k = snprintf(out, cap, "%s/%.*s", dir, (int)n, in);
    } else {
        k = snprintf(out, cap, "%.*s", (int)n, in);
    }
    return k < 0 || (size_t)k >= cap ? -1 : 0;
}

/* 1/yes/true/on -> 1, 0/no/false/off -> 0 (any case), else -1. */
static int parse_bool_text(const char *v, size_t n)
{
    static const char *const yes[] = {"1", "yes", "true", "on"}, *const no[] = {"0", "no", "false",
                                                                                "off"};
    for (int i = 0; i < 4; i++) {
        if (strlen(yes[i]) == n && !strncasecmp(v, yes[i], n))
            return 1;
        if (strlen(no[i]) == n && !strncasecmp(v, no[i], n))
            return 0;
    }
    return -1;
}

/* A number of seconds as the environment writes it: digits with an optional fraction ("10",
 * "2.5"); no sign, exponent, underscore, hex, inf or nan. v[n] must not be a digit, '.' or 'e'
 * (a blank or the end). 0, or -1. */
static int parse_seconds(const char *v, size_t n, double *out)
{
    size_t i = 0;
    while (i < n && v[i] >= '0' && v[i] <= '9')
        i++;
    if (i == 0)
        return -1;
    if (i < n && v[i] == '.') {
        size_t j = ++i;
        while (i < n && v[i] >= '0' && v[i] <= '9')
            i++;
        if (i == j)
            return -1;
    }
    if (i != n)
        return -1;
    double d = strtod(v, NULL);
    if (!isfinite(d))
        return -1;
    *out = d;
    return 0;
}

/* A control character (C0 or DEL) in s[0..n)? */
static int has_control(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return 1;
    return 0;
}

/* Valid UTF-8? */
static int is_utf8(const char *s, size_t n)
{
    char *check = malloc(n + 1);
    if (!check)
        return 0;
    int ok = gp_utf8_clean(check, n + 1, s, n) == n && memcmp(check, s, n) == 0;
    free(check);
    return ok;
}

/* Strip and check a text setting (value[0..n)): fits cap-1 bytes, no control characters, UTF-8.
 * 0 with dst set, or -1 with err: "<what> is longer than ...; set it to <how>". */
static int check_text(const char *what, const char *value, size_t n, const char *how, char *dst,
                      size_t cap, char *err, size_t ecap)
{
    dst[0] = 0;
    value = strip(value, &n);
    if (n >= cap) {
        set_err(err, ecap, "%s is longer than %zu bytes; set it to %s", what, cap - 1, how);
        return -1;
    }
    if (has_control(value, n)) {
        set_err(err, ecap, "%s contains a control character; set it to %s", what, how);
        return -1;
    }
    if (!is_utf8(value, n)) {
        set_err(err, ecap, "%s is not valid UTF-8; set it to %s", what, how);
        return -1;
    }
    memcpy(dst, value, n);
    dst[n] = 0;
    return 0;
}

static const char GPU_HOW[] = "a GPU index of the server or a GPU UUID (prefix)";
static const char MODEL_HOW[] = "a part of the GPU name, e.g. A100";
static const char TOKEN_HOW[] = "the token gpupoold gave you";
static const char PATH_HOW[] = "a file path";
static const char SIZE_HOW[] =
    "write bytes or a number with a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB (40*2^30), "
    "512M, 17179869184";

/* An address as a user writes it (already stripped, n bytes): [tls://]host[:port] /
 * [tls://][v6]:port, port 1..65535 in at most 5 digits; no blanks, control characters, '/' or
 * ','. Fills srv's address, host, port and *tls_prefix. 0, or -1. */
static int parse_address(const char *text, size_t n, gp_server_config *srv, int *tls_prefix)
{
    *tls_prefix = 0;
    srv->tls_prefix = 0;
    if (n >= 6 && strncasecmp(text, "tls://", 6) == 0) {
        *tls_prefix = 1;
        text += 6;
        n -= 6;
    }
    if (n == 0 || n >= sizeof srv->address)
        return -1;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)text[i] <= ' ' || text[i] == 0x7f || text[i] == '/' || text[i] == ',')
            return -1;
    memcpy(srv->address, text, n);
    srv->address[n] = 0;
    if (gp_split_hostport(srv->address, srv->host, sizeof srv->host, srv->port, sizeof srv->port) !=
        0)
        return -1;
    size_t pl = strlen(srv->port);
    long port = strtol(srv->port, NULL, 10);
    if (pl < 1 || pl > 5 || port < 1 || port > 65535)
        return -1;
    srv->tls_prefix = *tls_prefix;
    return 0;
}

int gp_parse_server_address(const char *text, gp_server_config *srv)
{
    size_t n = strlen(text);
    const char *t = strip(text, &n);
    int prefix;
    return parse_address(t, n, srv, &prefix);
}

int gp_fingerprint_valid(const char *text, size_t n)
{
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    if (n != GP_FINGERPRINT_LEN || memcmp(text, "SHA256:", 7) != 0)
        return 0;
    for (size_t i = 7; i < n; i++) {
        const char *c = text[i] ? strchr(b64, text[i]) : NULL;
        if (!c)
            return 0;
        if (i == n - 1 && (c - b64) % 4 != 0) /* 32 bytes: the last character's 2 low bits 0 */
            return 0;
    }
    return 1;
}

void gp_server_desc(const gp_server_config *srv, char *out, size_t cap)
{
    if (strchr(srv->address, ':'))
        snprintf(out, cap, "%s", srv->address);
    else
        snprintf(out, cap, "%s:%s", srv->host, srv->port);
}

/* ================================================================ the TOML subset == */

enum vtype {
    V_STR = 1,
    V_INT,
    V_FLOAT,
    V_BOOL,
    V_ARRAY
};

typedef struct value {
    enum vtype type;
    char *s; /* V_STR (malloc'd) */
    long long i;
    double f;
    int b;
    char *items[MAX_ITEMS]; /* V_ARRAY of strings (malloc'd) */
    int nitems;
} value;

static void value_free(value *v)
{
    free(v->s);
    for (int i = 0; i < v->nitems; i++)
        free(v->items[i]);
    memset(v, 0, sizeof *v);
}

typedef struct parser {
    const char *p, *end;
    int line;
    const char *file;
    char *err;
    size_t ecap;
} parser;

#define PERR(ps, ...)                                                                              \
    do {                                                                                           \
        int o_ = snprintf((ps)->err, (ps)->ecap, "%s:%d: ", (ps)->file, (ps)->line);               \
        if (o_ > 0 && (size_t)o_ < (ps)->ecap)                                                     \
            snprintf((ps)->err + o_, (ps)->ecap - (size_t)o_, __VA_ARGS__);                        \
    } while (0)

/* How much of the text at p to quote in a message: up to 20 bytes, not past the line. */
static int snippet(const char *p, const char *end)
{
    int n = 0;
    while (p + n < end && n < 20 && p[n] != '\n' && p[n] != '\r')
        n++;
    return n;
}

static void skip_blank(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t'))
        ps->p++;
}

/* After a value or header: blanks, an optional comment, then the end of the line (consumed).
 * 0, or -1 (error set). */
static int end_of_line(parser *ps, const char *after)
{
    skip_blank(ps);
    if (ps->p < ps->end && *ps->p == '#')
        while (ps->p < ps->end && *ps->p != '\n')
            ps->p++;
    if (ps->p < ps->end && *ps->p == '\r' && ps->p + 1 < ps->end && ps->p[1] == '\n')
        ps->p++;
    if (ps->p >= ps->end)
        return 0;
    if (*ps->p != '\n') {
        PERR(ps, "unexpected text after %s: '%.*s'; %s", after, snippet(ps->p, ps->end), ps->p,
             SUPPORTED);
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
static int parse_string(parser *ps, char **out)
{
    char q = *ps->p;
    if (ps->p + 2 < ps->end && ps->p[1] == q && ps->p[2] == q) {
        PERR(ps, "multi-line strings (%c%c%c) are not supported; write the value on one line", q, q,
             q);
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
                        PERR(ps, "\\u needs four hex digits (\\u00e9)");
                        goto fail;
                    }
                    cp = cp * 16 + (unsigned long)d;
                }
                if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) {
                    PERR(ps, "\\u%04lx is not a character a value may hold", cp);
                    goto fail;
                }
                if (put_utf8(buf, &o, MAX_STRING, cp) != 0)
                    goto too_long;
                continue;
            }
            PERR(ps,
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
static void skip_array_space(parser *ps)
{
    for (;;) {
        skip_blank(ps);
        if (ps->p < ps->end && *ps->p == '#')
            while (ps->p < ps->end && *ps->p != '\n')
                ps->p++;
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
static int parse_number(parser *ps, value *v)
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
        v->type = V_FLOAT;
        v->f = strtod(d, NULL); /* an underflow is 0 or subnormal: fine */
        if (!isfinite(v->f))
            return -1;
    } else {
        v->type = V_INT;
        v->i = strtoll(d, NULL, 10);
        if (errno)
            return -1;
    }
    ps->p = p;
    return 0;
}

/* The value after "key = ". 0, or -1 (error set). */
static int parse_value(parser *ps, const char *key, value *v)
{
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
    if (((c >= '0' && c <= '9') || c == '+' || c == '-') && parse_number(ps, v) == 0)
        return 0;
    PERR(ps,
         "cannot read the value of %s (strings need quotes: %s = \"...\"; dates, hex "
         "numbers, inf and nan are not supported); %s",
         key, key, SUPPORTED);
    return -1;
}

/* ============================================================ the file's settings == */

/* What a server entry sets itself. F_PREFIX: its address is tls://... (TLS whatever else says). */
enum {
    F_TOKEN = 1,
    F_TLS = 2,
    F_CA = 4,
    F_CERT = 8,
    F_KEY = 16,
    F_PREFIX = 32,
    F_COMP = 64,
    F_FP = 128
};

typedef struct file_settings {
    gp_server_config servers[GP_MAX_SERVERS]; /* address/host/port and their own settings */
    unsigned set[GP_MAX_SERVERS];             /* F_*: what the entry sets itself */
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
    int keep_gpu;
    int compression;
    /* A [[servers]] compression that is not a known value: refused when its entry ends, naming
     * the entry's address (it may come after). 0: none. */
    int bad_compression_line;
    char bad_compression[MAX_STRING];
    int holds_token;
    char dir[4096]; /* the file's folder, symlinks resolved: relative paths start there */
    gp_config_source src[GP_CFG_NSETTINGS];         /* the top-level settings' lines */
    gp_config_source default_src[GP_SRV_NSETTINGS]; /* token, tls, tls_* at the top level */
} file_settings;

enum section {
    SEC_TOP,
    SEC_REQ,
    SEC_SERVER,
    SEC_UNKNOWN
};

/* Keys seen in the current table, for "set twice". */
typedef struct seen_keys {
    char names[MAX_KEYS][MAX_KEY + 1];
    int n;
} seen_keys;

/* 1 if key was seen in this table before (error set), 0 if not (now it is), -1 if the table has
 * too many keys (error set). */
static int seen_before(parser *ps, seen_keys *s, const char *key)
{
    for (int i = 0; i < s->n; i++) {
        if (!strcmp(s->names[i], key)) {
            PERR(ps, "%s is set twice in the same table; keep one", key);
            return 1;
        }
    }
    if (s->n >= MAX_KEYS) {
        PERR(ps, "more than %d settings in one table; this is not a gpupool configuration",
             MAX_KEYS);
        return -1;
    }
    snprintf(s->names[s->n++], sizeof s->names[0], "%s", key);
    return 0;
}

static int want_type(parser *ps, const char *key, const value *v, enum vtype t, const char *how)
{
    if (v->type == t)
        return 0;
    PERR(ps, "%s must be %s", key, how);
    return -1;
}

/* A string setting stripped (*n its length, 0: unset) and checked: no control character, at
 * most max bytes. The text, or NULL (error set). */
static const char *string_value(parser *ps, const char *key, const value *v, const char *type,
                                const char *how, size_t max, size_t *n)
{
    if (want_type(ps, key, v, V_STR, type) != 0)
        return NULL;
    *n = strlen(v->s);
    const char *s = strip(v->s, n);
    if (has_control(s, *n)) {
        PERR(ps, "%s contains a control character; set it to %s", key, how);
        return NULL;
    }
    if (*n > max) {
        PERR(ps, "%s is longer than %zu bytes; set it to %s", key, max, how);
        return NULL;
    }
    return s;
}

/* A path setting: expanded into out (cap 4096), "" when unset. 0, or -1 (error set). */
static int path_value(parser *ps, const char *key, const value *v, const char *dir, char *out)
{
    size_t n;
    const char *s = string_value(ps, key, v, "a file path in quotes", PATH_HOW, 4095, &n);
    if (!s)
        return -1;
    int rc = expand_path(s, n, dir, out, 4096);
    if (rc == -2) {
        PERR(ps,
             "%s = \"%.*s\": ~ stands for the home folder, and HOME is not set; write "
             "the whole path",
             key, (int)n, s);
        return -1;
    }
    if (rc != 0) {
        PERR(ps, "%s is longer than 4095 bytes once expanded; use a shorter path", key);
        return -1;
    }
    return 0;
}

static int token_value(parser *ps, const char *key, const value *v, char *out)
{
    size_t n;
    const char *s = string_value(ps, key, v, "a string in quotes (the token gpupoold gave you)",
                                 TOKEN_HOW, 4096, &n);
    if (!s)
        return -1;
    memcpy(out, s, n);
    out[n] = 0;
    return 0;
}

static int timeout_value(parser *ps, const char *key, const value *v, double *out)
{
    double d = v->type == V_INT ? (double)v->i : v->type == V_FLOAT ? v->f : -1;
    if ((v->type != V_INT && v->type != V_FLOAT) || d < 0) {
        PERR(ps, "%s must be a number of seconds, 0 or more (%s), e.g. %s = 10", key,
             !strcmp(key, "probe_timeout") ? "0: the default, 2" : "0: no limit", key);
        return -1;
    }
    *out = d;
    return 0;
}

/* An address setting (a [[servers]] address or an item of servers = [...]) into s. 1 when set,
 * 0 when blank (unset), -1 (error set). */
static int address_value(parser *ps, const char *text, gp_server_config *s, int *prefix)
{
    size_t n = strlen(text);
    const char *t = strip(text, &n);
    if (n == 0)
        return 0;
    if (parse_address(t, n, s, prefix) != 0) {
        PERR(ps,
             "'%.*s' is not a server address: write host, host:port, [v6]:port or "
             "tls://host:port",
             (int)n, t);
        return -1;
    }
    return 1;
}

/* compression: "" (unset) and "off" -> GP_COMPRESSION_OFF, "lz4" -> GP_COMPRESSION_LZ4, else -1. */
static int compression_value(const char *t, size_t n)
{
    if (n == 0 || (n == 3 && !memcmp(t, "off", 3)))
        return GP_COMPRESSION_OFF;
    if (n == 3 && !memcmp(t, "lz4", 3))
        return GP_COMPRESSION_LZ4;
    return -1;
}

/* One `key = value` in section sec. 0, or -1 (error set). */
static int apply_key(parser *ps, file_settings *fs, enum section sec, const char *key, value *v)
{
    char why[600];
    const char *dir = fs->dir;
    if (sec == SEC_UNKNOWN)
        return 0; /* the table was warned about */
    if (sec == SEC_TOP) {
        if (!strcmp(key, "token")) {
            if (token_value(ps, key, v, fs->token) != 0)
                return -1;
            if (*fs->token) {
                fs->holds_token = 1;
                src_line(&fs->default_src[GP_SRV_TOKEN], ps->line);
            }
            return 0;
        }
        if (!strcmp(key, "tls")) {
            if (want_type(ps, key, v, V_BOOL, "true or false") != 0)
                return -1;
            fs->tls = v->b;
            src_line(&fs->default_src[GP_SRV_TLS], ps->line);
            return 0;
        }
        int which = !strcmp(key, "tls_ca")     ? GP_SRV_TLS_CA
                    : !strcmp(key, "tls_cert") ? GP_SRV_TLS_CERT
                    : !strcmp(key, "tls_key")  ? GP_SRV_TLS_KEY
                                               : -1;
        if (which >= 0) {
            char *dst = which == GP_SRV_TLS_CA     ? fs->tls_ca
                        : which == GP_SRV_TLS_CERT ? fs->tls_cert
                                                   : fs->tls_key;
            if (path_value(ps, key, v, dir, dst) != 0)
                return -1;
            if (*dst)
                src_line(&fs->default_src[which], ps->line);
            return 0;
        }
        if (!strcmp(key, "keep_gpu")) {
            if (want_type(ps, key, v, V_BOOL, "true or false") != 0)
                return -1;
            fs->keep_gpu = v->b;
            src_line(&fs->src[GP_CFG_KEEP_GPU], ps->line);
            return 0;
        }
        if (!strcmp(key, "connect_timeout")) {
            fs->has_connect_timeout = 1;
            src_line(&fs->src[GP_CFG_CONNECT_TIMEOUT], ps->line);
            return timeout_value(ps, key, v, &fs->connect_timeout);
        }
        if (!strcmp(key, "probe_timeout")) {
            fs->has_probe_timeout = 1;
            src_line(&fs->src[GP_CFG_PROBE_TIMEOUT], ps->line);
            return timeout_value(ps, key, v, &fs->probe_timeout);
        }
        if (!strcmp(key, "compression")) {
            if (want_type(ps, key, v, V_STR, "\"off\" or \"lz4\"") != 0)
                return -1;
            size_t n = strlen(v->s);
            const char *t = strip(v->s, &n);
            int c = compression_value(t, n);
            if (c < 0) {
                PERR(ps,
                     "compression = \"%.*s\" is not supported: write \"off\" (the default) or "
                     "\"lz4\"",
                     (int)n, t);
                return -1;
            }
            fs->compression = c;
            src_line(&fs->src[GP_CFG_COMPRESSION], ps->line);
            return 0;
        }
        if (!strcmp(key, "servers")) {
            if (want_type(ps, key, v, V_ARRAY,
                          "an array of addresses, servers = [\"gpu1:7070\", \"tls://gpu2:7070\"] "
                          "(or one [[servers]] table per server)") != 0)
                return -1;
            fs->short_form_line = ps->line;
            for (int i = 0; i < v->nitems; i++) {
                size_t n = strlen(v->items[i]);
                strip(v->items[i], &n);
                if (n == 0)
                    continue; /* a blank item: unset */
                if (fs->nservers >= GP_MAX_SERVERS) {
                    PERR(ps, "more than %d servers; keep the %d you prefer", GP_MAX_SERVERS,
                         GP_MAX_SERVERS);
                    return -1;
                }
                int prefix;
                if (address_value(ps, v->items[i], &fs->servers[fs->nservers], &prefix) < 0)
                    return -1;
                src_line(&fs->servers[fs->nservers].source[GP_SRV_ADDRESS], ps->line);
                if (prefix)
                    fs->set[fs->nservers] |= F_PREFIX;
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
                PERR(ps, "gpu must be a GPU index (1 or \"1\") or a GPU UUID (prefix) in quotes");
                return -1;
            }
            if (check_text("gpu", t, strlen(t), GPU_HOW, fs->gpu, sizeof fs->gpu, why,
                           sizeof why) != 0) {
                PERR(ps, "%s", why);
                return -1;
            }
            if (*fs->gpu)
                src_line(&fs->src[GP_CFG_GPU], ps->line);
            return 0;
        }
        if (!strcmp(key, "model")) {
            if (want_type(ps, key, v, V_STR, "a part of the GPU name in quotes (\"H100\")") != 0)
                return -1;
            if (check_text("model", v->s, strlen(v->s), MODEL_HOW, fs->model, sizeof fs->model, why,
                           sizeof why) != 0) {
                PERR(ps, "%s", why);
                return -1;
            }
            if (*fs->model)
                src_line(&fs->src[GP_CFG_MODEL], ps->line);
            return 0;
        }
        if (!strcmp(key, "min_memory")) {
            if (v->type == V_INT && v->i >= 0) {
                fs->min_memory = (uint64_t)v->i;
                src_line(&fs->src[GP_CFG_MIN_MEMORY], ps->line); /* 0 as an integer: set */
            } else if (v->type != V_STR) {
                PERR(ps, "min_memory must be a size in quotes (\"40GiB\", \"80G\") or bytes as "
                         "an integer");
                return -1;
            } else {
                size_t n = strlen(v->s);
                const char *s = strip(v->s, &n);
                fs->min_memory = 0;
                if (n == 0)
                    return 0; /* blank: unset */
                char *text = strndup(s, n);
                if (!text) {
                    PERR(ps, "out of memory");
                    return -1;
                }
                int bad = gp_parse_size(text, &fs->min_memory) != 0;
                free(text);
                if (bad) {
                    PERR(ps, "min_memory = \"%.*s\" is not a size: %s", (int)n, s, SIZE_HOW);
                    return -1;
                }
                if (fs->min_memory)
                    src_line(&fs->src[GP_CFG_MIN_MEMORY], ps->line);
            }
            return 0;
        }
    } else if (sec == SEC_SERVER) {
        int i = fs->nservers - 1;
        gp_server_config *s = &fs->servers[i];
        if (!strcmp(key, "address")) {
            if (want_type(ps, key, v, V_STR, "a server address in quotes (\"gpu1:7070\")") != 0)
                return -1;
            int prefix, rc = address_value(ps, v->s, s, &prefix);
            if (rc < 0)
                return -1;
            if (rc > 0)
                src_line(&s->source[GP_SRV_ADDRESS], ps->line);
            if (prefix)
                fs->set[i] |= F_PREFIX;
            return 0;
        }
        if (!strcmp(key, "token")) {
            if (token_value(ps, key, v, s->token) != 0)
                return -1;
            if (*s->token) {
                fs->set[i] |= F_TOKEN;
                fs->holds_token = 1;
                src_line(&s->source[GP_SRV_TOKEN], ps->line);
            }
            return 0;
        }
        if (!strcmp(key, "tls")) {
            if (want_type(ps, key, v, V_BOOL, "true or false") != 0)
                return -1;
            s->tls = v->b;
            fs->set[i] |= F_TLS;
            src_line(&s->source[GP_SRV_TLS], ps->line);
            return 0;
        }
        unsigned bit = !strcmp(key, "tls_ca")     ? F_CA
                       : !strcmp(key, "tls_cert") ? F_CERT
                       : !strcmp(key, "tls_key")  ? F_KEY
                                                  : 0;
        if (bit) {
            char *dst = bit == F_CA ? s->tls_ca : bit == F_CERT ? s->tls_cert : s->tls_key;
            if (path_value(ps, key, v, dir, dst) != 0)
                return -1;
            if (*dst) {
                fs->set[i] |= bit;
                src_line(&s->source[bit == F_CA     ? GP_SRV_TLS_CA
                                    : bit == F_CERT ? GP_SRV_TLS_CERT
                                                    : GP_SRV_TLS_KEY],
                         ps->line);
            }
            return 0;
        }
        if (!strcmp(key, "tls_fingerprint")) {
            if (want_type(ps, key, v, V_STR,
                          "the server's fingerprint in quotes (\"SHA256:...\", as `gpupoold "
                          "fingerprint` prints it)") != 0)
                return -1;
            size_t n = strlen(v->s);
            const char *t = strip(v->s, &n);
            if (n == 0)
                return 0; /* blank: unset */
            if (!gp_fingerprint_valid(t, n)) {
                PERR(ps,
                     "tls_fingerprint = \"%.*s\" is not a fingerprint: write what `gpupoold "
                     "fingerprint` prints on the server, \"SHA256:\" and 43 base64 characters "
                     "(or run `gpupool login` again)",
                     (int)(n > 100 ? 100 : n), t);
                return -1;
            }
            memcpy(s->tls_fingerprint, t, n);
            s->tls_fingerprint[n] = 0;
            fs->set[i] |= F_FP;
            src_line(&s->source[GP_SRV_TLS_FINGERPRINT], ps->line);
            return 0;
        }
        if (!strcmp(key, "compression")) {
            if (want_type(ps, key, v, V_STR, "\"off\" or \"lz4\"") != 0)
                return -1;
            size_t n = strlen(v->s);
            const char *t = strip(v->s, &n);
            int c = compression_value(t, n);
            if (c < 0) { /* check_entry refuses it, naming the server */
                fs->bad_compression_line = ps->line;
                snprintf(fs->bad_compression, sizeof fs->bad_compression, "%.*s", (int)n, t);
                return 0;
            }
            s->compression = c;
            if (n) { /* blank: unset, the top level's applies */
                fs->set[i] |= F_COMP;
                src_line(&s->source[GP_SRV_COMPRESSION], ps->line);
            }
            return 0;
        }
    }
    static const char *const known[] = {
        ("token, tls, tls_ca, tls_cert, tls_key, connect_timeout, probe_timeout, compression, "
         "servers"),
        "gpu, model, min_memory",
        "address, token, tls, tls_ca, tls_cert, tls_key, tls_fingerprint, compression",
    };
    static const char *const where[] = {"", " in [requirements]", " in [[servers]]"};
    warn("%s:%d: unknown setting '%s'%s ignored (known there: %s)", ps->file, ps->line, key,
         where[sec], known[sec]);
    return 0;
}

/* A value as written, to the hooks' visitor. */
static void visit_value(const char *key, const value *v)
{
    if (!hooks || !hooks->visit)
        return;
    char num[64];
    switch (v->type) {
    case V_STR:
        visit(GP_VISIT_STRING, key, v->s);
        break;
    case V_INT:
        snprintf(num, sizeof num, "%lld", v->i);
        visit(GP_VISIT_INTEGER, key, num);
        break;
    case V_FLOAT:
        snprintf(num, sizeof num, "%.17g", v->f);
        visit(GP_VISIT_FLOAT, key, num);
        break;
    case V_BOOL:
        visit(GP_VISIT_BOOL, key, v->b ? "true" : "false");
        break;
    case V_ARRAY:
        visit(GP_VISIT_ARRAY, key, NULL);
        for (int i = 0; i < v->nitems; i++)
            visit(GP_VISIT_ITEM, key, v->items[i]);
        break;
    }
}

/* A [table] or [[table]] header line at ps->p. 0, or -1 (error set). */
static int parse_header(parser *ps, file_settings *fs, enum section *sec, int *req_seen)
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
        PERR(ps, "unsupported table header (quoted or dotted names); %s", SUPPORTED);
        return -1;
    }
    if (nl > MAX_KEY) {
        PERR(ps, "the table name '%.20s...' is longer than %d characters; %s", name, MAX_KEY,
             SUPPORTED);
        return -1;
    }
    if (*ps->p != ']' || (dbl && (ps->p + 1 >= ps->end || ps->p[1] != ']'))) {
        PERR(ps, "this table header has no closing %s", dbl ? "]]" : "]");
        return -1;
    }
    ps->p += dbl ? 2 : 1;
    char n[MAX_KEY + 1];
    snprintf(n, sizeof n, "%.*s", (int)nl, name);
    int hline = ps->line;
    if (end_of_line(ps, "the table header") != 0)
        return -1;
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
            if (!fs->tables_line)
                fs->tables_line = ps->line;
            fs->nservers++;
            *sec = SEC_SERVER;
        }
    } else {
        warn("%s:%d: unknown table %s%s%s ignored (known: [requirements], [[servers]])", ps->file,
             ps->line, dbl ? "[[" : "[", n, dbl ? "]]" : "]");
        *sec = SEC_UNKNOWN;
    }
    ps->line = next_line;
    if (rc == 0)
        visit(dbl ? GP_VISIT_ARRAY_TABLE : GP_VISIT_TABLE, NULL, n);
    return rc;
}

/* The [[servers]] entry that ended (or the last one) must have an address, and a known
 * compression if it sets one. */
static int check_entry(parser *ps, file_settings *fs, enum section sec, int header_line)
{
    if (sec != SEC_SERVER)
        return 0;
    const gp_server_config *s = &fs->servers[fs->nservers - 1];
    int line = ps->line;
    if (!s->address[0]) {
        ps->line = header_line;
        PERR(ps, "this [[servers]] entry has no address; write address = \"host:port\" under "
                 "it");
    } else if (fs->bad_compression_line) {
        ps->line = fs->bad_compression_line;
        PERR(ps,
             "server %s: compression = \"%s\" is not supported: write \"off\" or \"lz4\", "
             "or leave it out for the top-level compression",
             s->address, fs->bad_compression);
    } else {
        return 0;
    }
    ps->line = line;
    return -1;
}

/* Parse text (the file's bytes) into fs (fs->dir set). 0, or -1 with err. */
static int parse_file(const char *file, const char *text, size_t len, file_settings *fs, char *err,
                      size_t ecap)
{
    parser ps = {.p = text, .end = text + len, .line = 1, .file = file, .err = err, .ecap = ecap};
    enum section sec = SEC_TOP;
    int req_seen = 0, header_line = 0;
    seen_keys *seen = calloc(1, sizeof *seen);
    if (!seen) {
        set_err(err, ecap, "out of memory reading %s", file);
        return -1;
    }
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
            continue;
        }
        if (c == '[') {
            rc = check_entry(&ps, fs, sec, header_line);
            header_line = ps.line;
            if (rc == 0)
                rc = parse_header(&ps, fs, &sec, &req_seen);
            seen->n = 0;
            continue;
        }
        if (c == '"' || c == '\'') {
            PERR(&ps, "quoted keys are not supported; write the key bare (token = \"...\"); %s",
                 SUPPORTED);
            rc = -1;
            break;
        }
        const char *k = ps.p;
        while (ps.p < ps.end && is_key_char(*ps.p))
            ps.p++;
        size_t kl = (size_t)(ps.p - k);
        if (kl == 0) {
            PERR(&ps, "expected key = value, a [table] or a comment, not '%.*s'; %s",
                 snippet(k, ps.end), k, SUPPORTED);
            rc = -1;
            break;
        }
        if (kl > MAX_KEY) {
            PERR(&ps, "the key '%.20s...' is longer than %d characters; %s", k, MAX_KEY, SUPPORTED);
            rc = -1;
            break;
        }
        char key[MAX_KEY + 1];
        snprintf(key, sizeof key, "%.*s", (int)kl, k);
        skip_blank(&ps);
        if (ps.p < ps.end && *ps.p == '.') {
            PERR(&ps, "dotted keys (%s.x = ...) are not supported; %s", key, SUPPORTED);
            rc = -1;
            break;
        }
        if (ps.p >= ps.end || *ps.p != '=') {
            PERR(&ps, "expected = after %s (key = value)", key);
            rc = -1;
            break;
        }
        ps.p++;
        int line = ps.line;
        value v;
        if (parse_value(&ps, key, &v) != 0) {
            value_free(&v);
            rc = -1;
            break;
        }
        int value_end_line = ps.line;
        ps.line = line; /* messages about the key name the line it starts on */
        if (sec != SEC_UNKNOWN && seen_before(&ps, seen, key) != 0)
            rc = -1;
        if (rc == 0) {
            visit_value(key, &v);
            rc = apply_key(&ps, fs, sec, key, &v);
        }
        value_free(&v);
        ps.line = value_end_line;
        if (rc == 0)
            rc = end_of_line(&ps, "the value");
    }
    free(seen);
    if (rc != 0)
        return -1;
    return check_entry(&ps, fs, sec, header_line);
}

/* ======================================================================= the file == */

/* Which file: 1 with path set, 0 for none, -1 with err; why (cap 8448) says why that file or why
 * none, for `gpupool config`. */
static int find_file(char *path, size_t cap, char *why, char *err, size_t ecap)
{
    size_t n;
    const char *explicit_ = env_view("GPUPOOL_CONFIG", &n);
    struct stat st;
    if (explicit_) {
        if (n == 4 && !strncmp(explicit_, "none", 4)) {
            snprintf(why, 8448, "GPUPOOL_CONFIG=none: no file is read");
            return 0;
        }
        int rc = expand_path(explicit_, n, NULL, path, cap);
        if (rc != 0) {
            set_err(err, ecap,
                    "GPUPOOL_CONFIG=%.*s: %s; point it at the configuration file, or "
                    "set GPUPOOL_CONFIG=none to read none",
                    (int)n, explicit_,
                    rc == -2 ? "~ stands for the home folder, and HOME is not set"
                             : "the path is too long");
            return -1;
        }
        if (stat(path, &st) != 0) {
            set_err(err, ecap,
                    "GPUPOOL_CONFIG=%.*s: %s; point it at the configuration file, or "
                    "set GPUPOOL_CONFIG=none to read none",
                    (int)n, explicit_, strerror(errno));
            return -1;
        }
        snprintf(why, 8448, "from GPUPOOL_CONFIG");
        return 1;
    }
    const char *xdg = env_raw("XDG_CONFIG_HOME");
    char home[4096];
    int k = -1;
    if (xdg) {
        k = snprintf(path, cap, "%s/gpupool/config.toml", xdg);
    } else {
        home_dir(home, sizeof home);
        if (*home)
            k = snprintf(path, cap, "%s/.config/gpupool/config.toml", home);
    }
    if (k > 0 && (size_t)k < cap && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(why, 8448, "the user's file");
        return 1;
    }
    char user[4096];
    if (k > 0 && (size_t)k < cap)
        snprintf(user, sizeof user, "%s", path);
    else
        snprintf(user, sizeof user, "(no home folder)");
    snprintf(path, cap, "%s",
             hooks && hooks->system_file ? hooks->system_file : "/etc/gpupool/config.toml");
    if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(why, 8448, "the system file (no user file at %s)", user);
        return 1;
    }
    snprintf(why, 8448, "no file (%s and %s do not exist)", user, path);
    path[0] = 0;
    return 0;
}

/* Read the whole file (NUL-terminated, malloc'd). 0, or -1 with err. */
static int read_file(const char *path, char **out, size_t *len, struct stat *st, char *err,
                     size_t ecap)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, ecap,
                "cannot read the configuration file %s: %s; fix its permissions or "
                "set GPUPOOL_CONFIG to another file",
                path, strerror(errno));
        return -1;
    }
    if (fstat(fileno(f), st) != 0 || !S_ISREG(st->st_mode)) {
        set_err(err, ecap, "the configuration file %s is not a regular file", path);
        fclose(f);
        return -1;
    }
    if (st->st_size > MAX_FILE_SIZE) {
        set_err(err, ecap,
                "the configuration file %s is larger than %d bytes; is it the right "
                "file?",
                path, MAX_FILE_SIZE);
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
        set_err(err, ecap,
                "cannot read the configuration file %s: %s; fix its permissions or "
                "set GPUPOOL_CONFIG to another file",
                path, strerror(EIO));
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

/* The folder of path after symlinks are resolved (relative paths in the file start there). 0,
 * or -1 with err. */
static int file_folder(const char *path, char *dir, size_t cap, char *err, size_t ecap)
{
    char *real = realpath(path, NULL);
    if (!real) {
        set_err(err, ecap, "cannot resolve the configuration file %s: %s", path, strerror(errno));
        return -1;
    }
    char *slash = strrchr(real, '/');
    if (slash == real)
        slash[1] = 0; /* a file in / */
    else if (slash)
        *slash = 0;
    int k = snprintf(dir, cap, "%s", real);
    free(real);
    if (k < 0 || (size_t)k >= cap) {
        set_err(err, ecap, "the folder of the configuration file %s is longer than %zu bytes", path,
                cap - 1);
        return -1;
    }
    return 0;
}

/* 1 if path lies under the home folder (both resolved when they exist). */
static int under_home(const char *path)
{
    char home[4096], rhome[PATH_MAX], rpath[PATH_MAX];
    home_dir(home, sizeof home);
    if (!*home)
        return 0;
    const char *h = realpath(home, rhome) ? rhome : home;
    const char *p = realpath(path, rpath) ? rpath : path;
    size_t hl = strlen(h);
    while (hl > 1 && h[hl - 1] == '/')
        hl--;
    return hl > 1 && strncmp(p, h, hl) == 0 && p[hl] == '/';
}

/* The mode warning: a file under the home folder holding a token, readable by others. */
static void check_mode(const char *path, const struct stat *st, const file_settings *fs)
{
    if (!fs->holds_token || !(st->st_mode & 044) || !under_home(path))
        return;
    warn("%s holds a token and is readable by other users (mode %04o): chmod 600 %s", path,
         (unsigned)(st->st_mode & 07777), path);
}

/* ================================================================ the environment == */

/* GPUPOOL_SERVER replaces the list; entries also in the file keep their settings. */
static int env_servers(const char *list, size_t len, const file_settings *fs, gp_client_config *cfg,
                       unsigned *set, char *err, size_t ecap)
{
    if (!is_utf8(list, len)) { /* blanks and control characters: refused item by item */
        set_err(err, ecap,
                "GPUPOOL_SERVER is not valid UTF-8: write host:port, [v6]:port, host "
                "(port %s) or tls://host:port, separated by commas",
                GP_DEFAULT_PORT);
        return -1;
    }
    char *copy = strndup(list, len);
    if (!copy) {
        set_err(err, ecap, "out of memory");
        return -1;
    }
    int rc = 0;
    char *save = NULL;
    cfg->nservers = 0;
    for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        size_t el = strlen(e);
        const char *item = strip(e, &el);
        if (el == 0)
            continue;
        if (cfg->nservers >= GP_MAX_SERVERS) {
            set_err(err, ecap,
                    "GPUPOOL_SERVER names more than %d servers; keep the %d you "
                    "prefer",
                    GP_MAX_SERVERS, GP_MAX_SERVERS);
            rc = -1;
            break;
        }
        gp_server_config *s = &cfg->servers[cfg->nservers];
        int prefix;
        if (parse_address(item, el, s, &prefix) != 0) {
            set_err(err, ecap,
                    "GPUPOOL_SERVER: '%.*s' is not a server address: write "
                    "host:port, [v6]:port, host (port %s) or tls://host:port, separated by "
                    "commas",
                    (int)el, item, GP_DEFAULT_PORT);
            rc = -1;
            break;
        }
        unsigned bits = 0;
        src_what(&s->source[GP_SRV_ADDRESS], "GPUPOOL_SERVER");
        for (int j = 0; j < fs->nservers; j++) {
            const gp_server_config *f = &fs->servers[j];
            if (strcasecmp(f->host, s->host) != 0 || strcmp(f->port, s->port) != 0)
                continue;
            /* Its token, TLS and compression settings; the address as GPUPOOL_SERVER writes
             * it. */
            memcpy(s->token, f->token, sizeof s->token);
            s->tls = f->tls;
            memcpy(s->tls_ca, f->tls_ca, sizeof s->tls_ca);
            memcpy(s->tls_cert, f->tls_cert, sizeof s->tls_cert);
            memcpy(s->tls_key, f->tls_key, sizeof s->tls_key);
            memcpy(s->tls_fingerprint, f->tls_fingerprint, sizeof s->tls_fingerprint);
            s->compression = f->compression;
            s->tls_prefix = f->tls_prefix || s->tls_prefix;
            for (int k = GP_SRV_TOKEN; k < GP_SRV_NSETTINGS; k++)
                s->source[k] = f->source[k];
            bits = fs->set[j];
            break;
        }
        if (prefix)
            bits |= F_PREFIX;
        set[cfg->nservers] = bits;
        cfg->nservers++;
    }
    free(copy);
    if (rc == 0 && cfg->nservers == 0) {
        set_err(err, ecap, "GPUPOOL_SERVER='%.*s' names no server: set GPUPOOL_SERVER=host:port",
                (int)len, list);
        rc = -1;
    }
    return rc;
}

/* GPUPOOL_TLS_CA/CERT/KEY into dst (cap 4096): "~/" expanded, a relative path left as the
 * caller's. 1 set, 0 unset, -1 with err. */
static int env_tls_file(const char *name, char *dst, char *err, size_t ecap)
{
    size_t n;
    const char *v = env_view(name, &n);
    if (!v)
        return 0;
    if (has_control(v, n)) {
        set_err(err, ecap, "%s contains a control character; set it to %s", name, PATH_HOW);
        return -1;
    }
    int rc = expand_path(v, n, NULL, dst, 4096);
    if (rc == -2) {
        set_err(err, ecap,
                "%s=%.*s: ~ stands for the home folder, and HOME is not set; write "
                "the whole path",
                name, (int)n, v);
        return -1;
    }
    if (rc != 0) {
        set_err(err, ecap, "%s is longer than 4095 bytes once expanded; use a shorter path", name);
        return -1;
    }
    return 1;
}

static int env_requirements(gp_client_config *cfg, char *err, size_t ecap)
{
    size_t gn = 0, on = 0, n;
    const char *gpu = env_view("GPUPOOL_GPU", &gn), *old = env_view("GPUPOOL_DEVICE", &on);
    const char *gpu_var = "GPUPOOL_GPU";
    if (!gpu) {
        gpu = old;
        gn = on;
        gpu_var = "GPUPOOL_DEVICE";
    } else if (old && (on != gn || memcmp(old, gpu, gn) != 0)) {
        warn("GPUPOOL_DEVICE=%.*s ignored: GPUPOOL_GPU=%.*s is set (GPUPOOL_DEVICE is its old "
             "name)",
             (int)on, old, (int)gn, gpu);
    }
    if (gpu && check_text(gpu_var, gpu, gn, GPU_HOW, cfg->gpu, sizeof cfg->gpu, err, ecap) != 0)
        return -1;
    if (gpu)
        src_what(&cfg->source[GP_CFG_GPU], gpu_var);
    const char *model = env_view("GPUPOOL_GPU_MODEL", &n);
    if (model && check_text("GPUPOOL_GPU_MODEL", model, n, MODEL_HOW, cfg->model, sizeof cfg->model,
                            err, ecap) != 0)
        return -1;
    if (model)
        src_what(&cfg->source[GP_CFG_MODEL], "GPUPOOL_GPU_MODEL");
    const char *mem = env_view("GPUPOOL_MIN_MEMORY", &n);
    if (mem) {
        char *text = strndup(mem, n);
        if (!text) {
            set_err(err, ecap, "out of memory");
            return -1;
        }
        int bad = gp_parse_size(text, &cfg->min_memory) != 0;
        free(text);
        if (bad) {
            set_err(err, ecap, "GPUPOOL_MIN_MEMORY=%.*s is not a size: %s", (int)n, mem, SIZE_HOW);
            return -1;
        }
        src_what(&cfg->source[GP_CFG_MIN_MEMORY], "GPUPOOL_MIN_MEMORY");
    }
    return 0;
}

static int env_seconds(const char *name, const char *zero, double *out, char *err, size_t ecap)
{
    size_t n;
    const char *v = env_view(name, &n);
    if (v && parse_seconds(v, n, out) != 0) {
        set_err(err, ecap, "%s=%.*s is not a number of seconds: write e.g. 10 or 2.5 (%s)", name,
                (int)n, v, zero);
        return -1;
    }
    return 0;
}

/* =================================================================== the loader == */

static int load(gp_client_config *cfg, file_settings *fs, char *err, size_t ecap)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->connect_timeout = 10;
    cfg->probe_timeout = 2;

    char path[4096];
    int found = find_file(path, sizeof path, cfg->file_reason, err, ecap);
    if (found < 0)
        return -1;
    if (found) {
        char *text;
        size_t len;
        struct stat st;
        if (read_file(path, &text, &len, &st, err, ecap) != 0)
            return -1;
        int rc = file_folder(path, fs->dir, sizeof fs->dir, err, ecap);
        if (rc == 0)
            rc = parse_file(path, text, len, fs, err, ecap);
        free(text);
        if (rc != 0)
            return -1;
        snprintf(cfg->file, sizeof cfg->file, "%s", path);
        check_mode(path, &st, fs);
        if (fs->has_connect_timeout)
            cfg->connect_timeout = fs->connect_timeout;
        if (fs->has_probe_timeout)
            cfg->probe_timeout = fs->probe_timeout;
        snprintf(cfg->gpu, sizeof cfg->gpu, "%s", fs->gpu);
        snprintf(cfg->model, sizeof cfg->model, "%s", fs->model);
        cfg->min_memory = fs->min_memory;
        cfg->keep_gpu = fs->keep_gpu;
        cfg->compression = fs->compression;
        memcpy(cfg->source, fs->src, sizeof cfg->source);
    }

    /* The list, with what each entry sets itself. */
    unsigned set[GP_MAX_SERVERS] = {0};
    size_t n;
    const char *list = env_view("GPUPOOL_SERVER", &n);
    if (list) {
        if (env_servers(list, n, fs, cfg, set, err, ecap) != 0)
            return -1;
        src_what(&cfg->source[GP_CFG_SERVERS], "GPUPOOL_SERVER");
    } else {
        cfg->nservers = fs->nservers;
        for (int i = 0; i < fs->nservers; i++) {
            cfg->servers[i] = fs->servers[i];
            set[i] = fs->set[i];
        }
    }

    /* The defaults for what an entry does not set, then the environment for every server. */
    char token[4097];
    size_t tn;
    const char *tv = env_view("GPUPOOL_TOKEN", &tn);
    if (tv && check_text("GPUPOOL_TOKEN", tv, tn, TOKEN_HOW, token, sizeof token, err, ecap) != 0)
        return -1;
    const char *tls_text = env_view("GPUPOOL_TLS", &n);
    int tls_env = tls_text ? parse_bool_text(tls_text, n) : -2;
    if (tls_env == -1) {
        set_err(err, ecap, "GPUPOOL_TLS=%.*s is not understood: use 1 (TLS) or 0 (plain TCP)",
                (int)n, tls_text);
        return -1;
    }
    char ca[4096], cert[4096], key[4096];
    snprintf(ca, sizeof ca, "%s", fs->tls_ca);
    snprintf(cert, sizeof cert, "%s", fs->tls_cert);
    snprintf(key, sizeof key, "%s", fs->tls_key);
    int env_ca = env_tls_file("GPUPOOL_TLS_CA", ca, err, ecap);
    int env_cert = env_ca < 0 ? -1 : env_tls_file("GPUPOOL_TLS_CERT", cert, err, ecap);
    int env_key = env_cert < 0 ? -1 : env_tls_file("GPUPOOL_TLS_KEY", key, err, ecap);
    if (env_key < 0)
        return -1;
    size_t fpn;
    const char *fpv = env_view("GPUPOOL_TLS_FINGERPRINT", &fpn);
    if (fpv && !gp_fingerprint_valid(fpv, fpn)) {
        set_err(err, ecap,
                "GPUPOOL_TLS_FINGERPRINT=%.*s is not a fingerprint: set it to what `gpupoold "
                "fingerprint` prints on the server, \"SHA256:\" and 43 base64 characters",
                (int)(fpn > 100 ? 100 : fpn), fpv);
        return -1;
    }
    for (int i = 0; i < cfg->nservers; i++) {
        gp_server_config *s = &cfg->servers[i];
        gp_config_source *src = s->source;
        const gp_config_source *dflt = fs->default_src;
        if (tv) {
            memcpy(s->token, token, sizeof token);
            src_what(&src[GP_SRV_TOKEN], "GPUPOOL_TOKEN");
        } else if (!(set[i] & F_TOKEN)) {
            memcpy(s->token, fs->token, sizeof fs->token);
            src[GP_SRV_TOKEN] = dflt[GP_SRV_TOKEN];
        }
        if (set[i] & F_PREFIX) {
            s->tls = 1; /* tls://: TLS whatever else says */
            src_what(&src[GP_SRV_TLS], "tls:// in the address");
        } else if (tls_env >= 0) {
            s->tls = tls_env;
            src_what(&src[GP_SRV_TLS], "GPUPOOL_TLS");
        } else if (!(set[i] & F_TLS)) {
            s->tls = fs->tls;
            src[GP_SRV_TLS] = dflt[GP_SRV_TLS];
        }
        /* The pin: the entry's own, else GPUPOOL_TLS_FINGERPRINT. */
        if (fpv && !(set[i] & F_FP)) {
            memcpy(s->tls_fingerprint, fpv, fpn);
            s->tls_fingerprint[fpn] = 0;
            src_what(&src[GP_SRV_TLS_FINGERPRINT], "GPUPOOL_TLS_FINGERPRINT");
        }
        /* The three TLS files: the variable, else the entry's own, else the top level's. */
        const struct {
            int env;
            unsigned bit;
            int setting;
            const char *var, *value;
            char *dst;
        } files[] = {
            {env_ca, F_CA, GP_SRV_TLS_CA, "GPUPOOL_TLS_CA", ca, s->tls_ca},
            {env_cert, F_CERT, GP_SRV_TLS_CERT, "GPUPOOL_TLS_CERT", cert, s->tls_cert},
            {env_key, F_KEY, GP_SRV_TLS_KEY, "GPUPOOL_TLS_KEY", key, s->tls_key},
        };
        for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
            if (files[k].env)
                src_what(&src[files[k].setting], files[k].var);
            else if (!(set[i] & files[k].bit))
                src[files[k].setting] = dflt[files[k].setting];
            if (files[k].env || !(set[i] & files[k].bit))
                memcpy(files[k].dst, files[k].value, 4096);
        }
    }

    if (env_seconds("GPUPOOL_CONNECT_TIMEOUT", "0: no limit", &cfg->connect_timeout, err, ecap) !=
            0 ||
        env_seconds("GPUPOOL_PROBE_TIMEOUT", "0: the default, 2", &cfg->probe_timeout, err, ecap) !=
            0 ||
        env_requirements(cfg, err, ecap) != 0)
        return -1;
    if (env_view("GPUPOOL_CONNECT_TIMEOUT", &n))
        src_what(&cfg->source[GP_CFG_CONNECT_TIMEOUT], "GPUPOOL_CONNECT_TIMEOUT");
    if (env_view("GPUPOOL_PROBE_TIMEOUT", &n))
        src_what(&cfg->source[GP_CFG_PROBE_TIMEOUT], "GPUPOOL_PROBE_TIMEOUT");
    size_t kn;
    const char *kv = env_view("GPUPOOL_KEEP_GPU", &kn);
    if (kv) {
        int keep = parse_bool_text(kv, kn);
        if (keep < 0) {
            set_err(err, ecap,
                    "GPUPOOL_KEEP_GPU=%.*s is not understood: use 1 (keep the GPU while idle) or "
                    "0 (let the server detach an idle lease, the default)",
                    (int)kn, kv);
            return -1;
        }
        cfg->keep_gpu = keep;
        src_what(&cfg->source[GP_CFG_KEEP_GPU], "GPUPOOL_KEEP_GPU");
    }
    size_t cn;
    const char *cv = env_view("GPUPOOL_COMPRESSION", &cn);
    if (cv) {
        int c = compression_value(cv, cn);
        if (c < 0) {
            set_err(err, ecap,
                    "GPUPOOL_COMPRESSION=%.*s is not supported: write off (the "
                    "default) or lz4",
                    (int)cn, cv);
            return -1;
        }
        cfg->compression = c;
        src_what(&cfg->source[GP_CFG_COMPRESSION], "GPUPOOL_COMPRESSION");
    }
    /* Each server's compression: GPUPOOL_COMPRESSION, else its own, else the top level's. */
    for (int i = 0; i < cfg->nservers; i++) {
        if (cv || !(set[i] & F_COMP)) {
            cfg->servers[i].compression = cfg->compression;
            cfg->servers[i].source[GP_SRV_COMPRESSION] = cfg->source[GP_CFG_COMPRESSION];
        }
    }

    /* A client certificate needs its key, and a key its certificate. */
    for (int i = 0; i < cfg->nservers; i++) {
        const gp_server_config *s = &cfg->servers[i];
        if (!*s->tls_cert == !*s->tls_key)
            continue;
        const char *have = *s->tls_cert ? "tls_cert" : "tls_key";
        const char *lack = *s->tls_cert ? "tls_key" : "tls_cert";
        set_err(err, ecap,
                "server %s: %s is set but %s is not: set both (a client certificate "
                "and its key, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY) or neither",
                s->address, have, lack);
        return -1;
    }
    return 0;
}

int gp_client_config_load_with(gp_client_config *cfg, const gp_config_hooks *with, char *err,
                               size_t errcap)
{
    file_settings *fs = calloc(1, sizeof *fs);
    if (!fs) {
        set_err(err, errcap, "out of memory reading the gpupool configuration");
        return -1;
    }
    fs->tls = 1; /* TLS unless the file or GPUPOOL_TLS says otherwise */
    const gp_config_hooks *outer = hooks;
    hooks = with;
    int rc = load(cfg, fs, err, errcap);
    hooks = outer;
    free(fs);
    return rc;
}

int gp_client_config_load(gp_client_config *cfg, char *err, size_t errcap)
{
    return gp_client_config_load_with(cfg, NULL, err, errcap);
}
