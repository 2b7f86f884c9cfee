/*
 * client_config_values.c: the checks of the client configuration's values, shared by the file's
 * keys (client_config_keys.c) and the environment (client_config_env.c): blanks stripped at both
 * ends, no control characters, UTF-8, paths with "~" and relative to a folder, booleans and
 * seconds as the environment writes them, addresses, fingerprints, compression.
 */
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "client_config_internal.h"
#include "net.h"

void gp_cc_src_line(gp_config_source *src, int line)
{
    src->line = line;
    src->what = NULL;
}

void gp_cc_src_what(gp_config_source *src, const char *what)
{
    src->line = 0;
    src->what = what;
}

void gp_cc_set_err(char *err, size_t cap, const char *fmt, ...)
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
const char *gp_cc_strip(const char *s, size_t *n)
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
void gp_cc_home_dir(char *out, size_t cap)
{
    const char *h = gp_cc_getenv("HOME");
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
const char *gp_cc_env_view(const char *name, size_t *n)
{
    const char *v = gp_cc_getenv(name);
    if (!v)
        return NULL;
    *n = strlen(v);
    v = gp_cc_strip(v, n);
    return *n ? v : NULL;
}

/* An environment variable as it is (not a GPUPOOL_* one: XDG_CONFIG_HOME), NULL when unset or
 * "". */
const char *gp_cc_env_raw(const char *name)
{
    const char *v = gp_cc_getenv(name);
    return v && *v ? v : NULL;
}

/* in[0..n): "~" / "~/x" -> "$HOME" / "$HOME/x"; a relative path -> dir/path (dir NULL: left as
 * is). 0; -1 too long for cap; -2 "~" but no home folder. */
int gp_cc_expand_path(const char *in, size_t n, const char *dir, char *out, size_t cap)
{
    int k;
    if (n == 0) {
        out[0] = 0;
        return 0;
    }
    if (in[0] == '~' && (n == 1 || in[1] == '/')) {
        char home[4096];
        gp_cc_home_dir(home, sizeof home);
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
int gp_cc_parse_bool_text(const char *v, size_t n)
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
int gp_cc_parse_seconds(const char *v, size_t n, double *out)
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
int gp_cc_has_control(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return 1;
    return 0;
}

/* Valid UTF-8? */
int gp_cc_is_utf8(const char *s, size_t n)
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
int gp_cc_check_text(const char *what, const char *value, size_t n, const char *how, char *dst,
                     size_t cap, char *err, size_t ecap)
{
    dst[0] = 0;
    value = gp_cc_strip(value, &n);
    if (n >= cap) {
        gp_cc_set_err(err, ecap, "%s is longer than %zu bytes; set it to %s", what, cap - 1, how);
        return -1;
    }
    if (gp_cc_has_control(value, n)) {
        gp_cc_set_err(err, ecap, "%s contains a control character; set it to %s", what, how);
        return -1;
    }
    if (!gp_cc_is_utf8(value, n)) {
        gp_cc_set_err(err, ecap, "%s is not valid UTF-8; set it to %s", what, how);
        return -1;
    }
    memcpy(dst, value, n);
    dst[n] = 0;
    return 0;
}

const char gp_cc_gpu_how[] = "a GPU index of the server or a GPU UUID (prefix)";
const char gp_cc_model_how[] = "a part of the GPU name, e.g. A100";
const char gp_cc_token_how[] = "the token gpupoold gave you";
const char gp_cc_path_how[] = "a file path";
const char gp_cc_gpus_how[] = "a whole number of GPUs from 1 to 64";
const char gp_cc_size_how[] =
    "write bytes or a number with a unit, e.g. 40G or 40GB (40*10^9 bytes), 40GiB (40*2^30), "
    "512M, 17179869184";

/* An address as a user writes it (already stripped, n bytes): [tls://]host[:port] /
 * [tls://][v6]:port, port 1..65535 in at most 5 digits; no blanks, control characters, '/' or
 * ','. Fills srv's address, host, port and *tls_prefix. 0, or -1. */
int gp_cc_parse_address(const char *text, size_t n, gp_server_config *srv, int *tls_prefix)
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
    const char *t = gp_cc_strip(text, &n);
    int prefix;
    return gp_cc_parse_address(t, n, srv, &prefix);
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

/* spread_copy: "" (the file's empty string; an empty GPUPOOL_SPREAD_COPY is unset, as every
 * variable: gp_cc_env_view) and "auto" -> GP_SPREAD_COPY_AUTO, "server", "client", else -1. */
int gp_cc_spread_copy_value(const char *t, size_t n)
{
    if (n == 0 || (n == 4 && !memcmp(t, "auto", 4)))
        return GP_SPREAD_COPY_AUTO;
    if (n == 6 && !memcmp(t, "server", 6))
        return GP_SPREAD_COPY_SERVER;
    if (n == 6 && !memcmp(t, "client", 6))
        return GP_SPREAD_COPY_CLIENT;
    return -1;
}

/* compression: "" (unset) and "off" -> GP_COMPRESSION_OFF, "lz4" -> GP_COMPRESSION_LZ4, else -1. */
int gp_cc_compression_value(const char *t, size_t n)
{
    if (n == 0 || (n == 3 && !memcmp(t, "off", 3)))
        return GP_COMPRESSION_OFF;
    if (n == 3 && !memcmp(t, "lz4", 3))
        return GP_COMPRESSION_LZ4;
    return -1;
}
