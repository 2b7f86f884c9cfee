/*
 * client_config_keys.c: the table of the client configuration's keys (client_config_keys.h) and
 * the setters that read each one from the file. A setter checks the value's type and text, and
 * records the value and its line; a key that a [[servers]] entry sets itself is marked in
 * fs->set (CC_F_*), so that the defaults and the environment know what not to replace
 * (client_config_env.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_config_internal.h"
#include "client_config_keys.h"

/* ====================================================================== values == */

static int want_type(gp_toml_lexer *ps, const char *key, const gp_toml_value *v,
                     enum gp_toml_type t, const char *how)
{
    if (v->type == t)
        return 0;
    gp_toml_error(ps, "%s must be %s", key, how);
    return -1;
}

/* A string setting stripped (*n its length, 0: unset) and checked: no control character, at
 * most max bytes. The text, or NULL (error set). */
static const char *string_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v,
                                const char *type, const char *how, size_t max, size_t *n)
{
    if (want_type(ps, key, v, GP_TOML_STR, type) != 0)
        return NULL;
    *n = strlen(v->s);
    const char *s = gp_cc_strip(v->s, n);
    if (gp_cc_has_control(s, *n)) {
        gp_toml_error(ps, "%s contains a control character; set it to %s", key, how);
        return NULL;
    }
    if (*n > max) {
        gp_toml_error(ps, "%s is longer than %zu bytes; set it to %s", key, max, how);
        return NULL;
    }
    return s;
}

/* A path setting: expanded into out (cap 4096), "" when unset. 0, or -1 (error set). */
static int path_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v, const char *dir,
                      char *out)
{
    size_t n;
    const char *s = string_value(ps, key, v, "a file path in quotes", gp_cc_path_how, 4095, &n);
    if (!s)
        return -1;
    int rc = gp_cc_expand_path(s, n, dir, out, 4096);
    if (rc == -2) {
        gp_toml_error(ps,
                      "%s = \"%.*s\": ~ stands for the home folder, and HOME is not set; write "
                      "the whole path",
                      key, (int)n, s);
        return -1;
    }
    if (rc != 0) {
        gp_toml_error(ps, "%s is longer than 4095 bytes once expanded; use a shorter path", key);
        return -1;
    }
    return 0;
}

static int token_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v, char *out)
{
    size_t n;
    const char *s = string_value(ps, key, v, "a string in quotes (the token gpupoold gave you)",
                                 gp_cc_token_how, 4096, &n);
    if (!s)
        return -1;
    memcpy(out, s, n);
    out[n] = 0;
    return 0;
}

static int timeout_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v, double *out)
{
    double d = v->type == GP_TOML_INT ? (double)v->i : v->type == GP_TOML_FLOAT ? v->f : -1;
    if ((v->type != GP_TOML_INT && v->type != GP_TOML_FLOAT) || d < 0) {
        gp_toml_error(ps, "%s must be a number of seconds, 0 or more (%s), e.g. %s = 10", key,
                      !strcmp(key, "probe_timeout") ? "0: the default, 2" : "0: no limit", key);
        return -1;
    }
    *out = d;
    return 0;
}

/* An address setting (a [[servers]] address or an item of servers = [...]) into s. 1 when set,
 * 0 when blank (unset), -1 (error set). */
static int address_value(gp_toml_lexer *ps, const char *text, gp_server_config *s, int *prefix)
{
    size_t n = strlen(text);
    const char *t = gp_cc_strip(text, &n);
    if (n == 0)
        return 0;
    if (gp_cc_parse_address(t, n, s, prefix) != 0) {
        gp_toml_error(ps,
                      "'%.*s' is not a server address: write host, host:port, [v6]:port or "
                      "tls://host:port",
                      (int)n, t);
        return -1;
    }
    return 1;
}

/* A boolean setting into *out. 0, or -1 (error set). */
static int bool_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v, int *out)
{
    if (want_type(ps, key, v, GP_TOML_BOOL, "true or false") != 0)
        return -1;
    *out = v->b;
    return 0;
}

/* A compression setting: *t and *n its stripped text; GP_COMPRESSION_*, -1 for a text that is
 * none, or -2 (not a string: error set). */
static int compression_text(gp_toml_lexer *ps, const char *key, const gp_toml_value *v,
                            const char **t, size_t *n)
{
    if (want_type(ps, key, v, GP_TOML_STR, "\"off\" or \"lz4\"") != 0)
        return -2;
    *n = strlen(v->s);
    *t = gp_cc_strip(v->s, n);
    return gp_cc_compression_value(*t, *n);
}

/* The [[servers]] entry being read: the last one. */
static int entry(const file_settings *fs)
{
    return fs->nservers - 1;
}

/* ================================================================= the top level == */

static int set_token(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    if (token_value(ps, key, v, fs->token) != 0)
        return -1;
    if (*fs->token) {
        fs->holds_token = 1;
        gp_cc_src_line(&fs->default_src[GP_SRV_TOKEN], ps->line);
    }
    return 0;
}

static int set_tls(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    if (bool_value(ps, key, v, &fs->tls) != 0)
        return -1;
    gp_cc_src_line(&fs->default_src[GP_SRV_TLS], ps->line);
    return 0;
}

/* A top-level TLS file: the default of the servers whose entry names none. */
static int set_tls_file(gp_toml_lexer *ps, file_settings *fs, const char *key, char *dst,
                        int setting, const gp_toml_value *v)
{
    if (path_value(ps, key, v, fs->dir, dst) != 0)
        return -1;
    if (*dst)
        gp_cc_src_line(&fs->default_src[setting], ps->line);
    return 0;
}

static int set_tls_ca(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    return set_tls_file(ps, fs, key, fs->tls_ca, GP_SRV_TLS_CA, v);
}

static int set_tls_cert(gp_toml_lexer *ps, file_settings *fs, const char *key,
                        const gp_toml_value *v)
{
    return set_tls_file(ps, fs, key, fs->tls_cert, GP_SRV_TLS_CERT, v);
}

static int set_tls_key(gp_toml_lexer *ps, file_settings *fs, const char *key,
                       const gp_toml_value *v)
{
    return set_tls_file(ps, fs, key, fs->tls_key, GP_SRV_TLS_KEY, v);
}

static int set_keep_gpu(gp_toml_lexer *ps, file_settings *fs, const char *key,
                        const gp_toml_value *v)
{
    if (bool_value(ps, key, v, &fs->keep_gpu) != 0)
        return -1;
    gp_cc_src_line(&fs->src[GP_CFG_KEEP_GPU], ps->line);
    return 0;
}

static int set_connect_timeout(gp_toml_lexer *ps, file_settings *fs, const char *key,
                               const gp_toml_value *v)
{
    fs->has_connect_timeout = 1;
    gp_cc_src_line(&fs->src[GP_CFG_CONNECT_TIMEOUT], ps->line);
    return timeout_value(ps, key, v, &fs->connect_timeout);
}

static int set_probe_timeout(gp_toml_lexer *ps, file_settings *fs, const char *key,
                             const gp_toml_value *v)
{
    fs->has_probe_timeout = 1;
    gp_cc_src_line(&fs->src[GP_CFG_PROBE_TIMEOUT], ps->line);
    return timeout_value(ps, key, v, &fs->probe_timeout);
}

static int set_compression(gp_toml_lexer *ps, file_settings *fs, const char *key,
                           const gp_toml_value *v)
{
    size_t n;
    const char *t;
    int c = compression_text(ps, key, v, &t, &n);
    if (c == -2)
        return -1;
    if (c < 0) {
        gp_toml_error(ps,
                      "compression = \"%.*s\" is not supported: write \"off\" (the default) or "
                      "\"lz4\"",
                      (int)n, t);
        return -1;
    }
    fs->compression = c;
    gp_cc_src_line(&fs->src[GP_CFG_COMPRESSION], ps->line);
    return 0;
}

/* servers = [...]: the short form of [[servers]], one entry per address. */
static int set_servers(gp_toml_lexer *ps, file_settings *fs, const char *key,
                       const gp_toml_value *v)
{
    if (want_type(ps, key, v, GP_TOML_ARRAY,
                  "an array of addresses, servers = [\"gpu1:7070\", \"tls://gpu2:7070\"] "
                  "(or one [[servers]] table per server)") != 0)
        return -1;
    fs->short_form_line = ps->line;
    for (int i = 0; i < v->nitems; i++) {
        size_t n = strlen(v->items[i]);
        gp_cc_strip(v->items[i], &n);
        if (n == 0)
            continue; /* a blank item: unset */
        if (fs->nservers >= GP_MAX_SERVERS) {
            gp_toml_error(ps, "more than %d servers; keep the %d you prefer", GP_MAX_SERVERS,
                          GP_MAX_SERVERS);
            return -1;
        }
        int prefix;
        if (address_value(ps, v->items[i], &fs->servers[fs->nservers], &prefix) < 0)
            return -1;
        gp_cc_src_line(&fs->servers[fs->nservers].source[GP_SRV_ADDRESS], ps->line);
        if (prefix)
            fs->set[fs->nservers] |= CC_F_PREFIX;
        fs->nservers++;
    }
    return 0;
}

/* ============================================================== [requirements] == */

static int set_gpu(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    (void)key;
    char text[64], why[600];
    const char *t = v->s;
    if (v->type == GP_TOML_INT && v->i >= 0) {
        snprintf(text, sizeof text, "%lld", v->i);
        t = text;
    } else if (v->type != GP_TOML_STR) {
        gp_toml_error(ps, "gpu must be a GPU index (1 or \"1\") or a GPU UUID (prefix) in quotes");
        return -1;
    }
    if (gp_cc_check_text("gpu", t, strlen(t), gp_cc_gpu_how, fs->gpu, sizeof fs->gpu, why,
                         sizeof why) != 0) {
        gp_toml_error(ps, "%s", why);
        return -1;
    }
    if (*fs->gpu)
        gp_cc_src_line(&fs->src[GP_CFG_GPU], ps->line);
    return 0;
}

static int set_model(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    char why[600];
    if (want_type(ps, key, v, GP_TOML_STR, "a part of the GPU name in quotes (\"H100\")") != 0)
        return -1;
    if (gp_cc_check_text("model", v->s, strlen(v->s), gp_cc_model_how, fs->model, sizeof fs->model,
                         why, sizeof why) != 0) {
        gp_toml_error(ps, "%s", why);
        return -1;
    }
    if (*fs->model)
        gp_cc_src_line(&fs->src[GP_CFG_MODEL], ps->line);
    return 0;
}

/* A size setting (min_memory, memory): bytes as an integer, or a size in quotes; blank: unset.
 * 0 with *out set and its line recorded when set, or -1 (error set). */
static int size_value(gp_toml_lexer *ps, const char *key, const gp_toml_value *v, uint64_t *out,
                      gp_config_source *src)
{
    if (v->type == GP_TOML_INT && v->i >= 0) {
        *out = (uint64_t)v->i;
        gp_cc_src_line(src, ps->line); /* 0 as an integer: set */
        return 0;
    }
    if (v->type != GP_TOML_STR) {
        gp_toml_error(ps, "%s must be a size in quotes (\"40GiB\", \"80G\") or bytes as an integer",
                      key);
        return -1;
    }
    size_t n = strlen(v->s);
    const char *s = gp_cc_strip(v->s, &n);
    *out = 0;
    if (n == 0)
        return 0; /* blank: unset */
    char *text = strndup(s, n);
    if (!text) {
        gp_toml_error(ps, "out of memory");
        return -1;
    }
    int bad = gp_parse_size(text, out) != 0;
    free(text);
    if (bad) {
        gp_toml_error(ps, "%s = \"%.*s\" is not a size: %s", key, (int)n, s, gp_cc_size_how);
        return -1;
    }
    if (*out)
        gp_cc_src_line(src, ps->line);
    return 0;
}

static int set_min_memory(gp_toml_lexer *ps, file_settings *fs, const char *key,
                          const gp_toml_value *v)
{
    return size_value(ps, key, v, &fs->min_memory, &fs->src[GP_CFG_MIN_MEMORY]);
}

/* gpus: a whole number of GPUs, 1 to GP_MAX_GPUS (issue 37). */
static int set_gpus(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    if (v->type != GP_TOML_INT || v->i < 1 || v->i > GP_MAX_GPUS) {
        gp_toml_error(ps, "%s must be %s, e.g. %s = 4", key, gp_cc_gpus_how, key);
        return -1;
    }
    fs->gpus = (int)v->i;
    gp_cc_src_line(&fs->src[GP_CFG_GPUS], ps->line);
    return 0;
}

/* spread: a lease of gpus > 1 may take its GPUs from several servers of a fleet (issue 37). */
static int set_spread(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    if (bool_value(ps, key, v, &fs->spread) != 0)
        return -1;
    gp_cc_src_line(&fs->src[GP_CFG_SPREAD], ps->line);
    return 0;
}

/* spread_copy: how peer copies between the servers of a spread lease go (issue 37, item 3). */
static int set_spread_copy(gp_toml_lexer *ps, file_settings *fs, const char *key,
                           const gp_toml_value *v)
{
    if (want_type(ps, key, v, GP_TOML_STR, "\"auto\", \"server\" or \"client\"") != 0)
        return -1;
    size_t n = strlen(v->s);
    const char *t = gp_cc_strip(v->s, &n);
    int mode = gp_cc_spread_copy_value(t, n);
    if (mode < 0) {
        gp_toml_error(ps,
                      "spread_copy = \"%.*s\" is not understood: write \"auto\" (the default: "
                      "server to server, through the client when the servers cannot reach each "
                      "other), \"server\" or \"client\"",
                      (int)n, t);
        return -1;
    }
    fs->spread_copy = mode;
    gp_cc_src_line(&fs->src[GP_CFG_SPREAD_COPY], ps->line);
    return 0;
}

/* memory: the size of a share of a shared GPU (issue 32); 0: a whole GPU. */
static int set_memory(gp_toml_lexer *ps, file_settings *fs, const char *key, const gp_toml_value *v)
{
    return size_value(ps, key, v, &fs->memory, &fs->src[GP_CFG_MEMORY]);
}

/* ================================================================= [[servers]] == */

static int set_address(gp_toml_lexer *ps, file_settings *fs, const char *key,
                       const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    if (want_type(ps, key, v, GP_TOML_STR, "a server address in quotes (\"gpu1:7070\")") != 0)
        return -1;
    int prefix, rc = address_value(ps, v->s, s, &prefix);
    if (rc < 0)
        return -1;
    if (rc > 0)
        gp_cc_src_line(&s->source[GP_SRV_ADDRESS], ps->line);
    if (prefix)
        fs->set[i] |= CC_F_PREFIX;
    return 0;
}

static int set_server_token(gp_toml_lexer *ps, file_settings *fs, const char *key,
                            const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    if (token_value(ps, key, v, s->token) != 0)
        return -1;
    if (*s->token) {
        fs->set[i] |= CC_F_TOKEN;
        fs->holds_token = 1;
        gp_cc_src_line(&s->source[GP_SRV_TOKEN], ps->line);
    }
    return 0;
}

static int set_server_tls(gp_toml_lexer *ps, file_settings *fs, const char *key,
                          const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    if (bool_value(ps, key, v, &s->tls) != 0)
        return -1;
    fs->set[i] |= CC_F_TLS;
    gp_cc_src_line(&s->source[GP_SRV_TLS], ps->line);
    return 0;
}

/* An entry's own TLS file (bit: CC_F_CA, CC_F_CERT or CC_F_KEY). */
static int set_server_tls_file(gp_toml_lexer *ps, file_settings *fs, const char *key, unsigned bit,
                               int setting, const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    char *dst = bit == CC_F_CA ? s->tls_ca : bit == CC_F_CERT ? s->tls_cert : s->tls_key;
    if (path_value(ps, key, v, fs->dir, dst) != 0)
        return -1;
    if (*dst) {
        fs->set[i] |= bit;
        gp_cc_src_line(&s->source[setting], ps->line);
    }
    return 0;
}

static int set_server_tls_ca(gp_toml_lexer *ps, file_settings *fs, const char *key,
                             const gp_toml_value *v)
{
    return set_server_tls_file(ps, fs, key, CC_F_CA, GP_SRV_TLS_CA, v);
}

static int set_server_tls_cert(gp_toml_lexer *ps, file_settings *fs, const char *key,
                               const gp_toml_value *v)
{
    return set_server_tls_file(ps, fs, key, CC_F_CERT, GP_SRV_TLS_CERT, v);
}

static int set_server_tls_key(gp_toml_lexer *ps, file_settings *fs, const char *key,
                              const gp_toml_value *v)
{
    return set_server_tls_file(ps, fs, key, CC_F_KEY, GP_SRV_TLS_KEY, v);
}

static int set_server_fingerprint(gp_toml_lexer *ps, file_settings *fs, const char *key,
                                  const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    if (want_type(ps, key, v, GP_TOML_STR,
                  "the server's fingerprint in quotes (\"SHA256:...\", as `gpupoold "
                  "fingerprint` prints it)") != 0)
        return -1;
    size_t n = strlen(v->s);
    const char *t = gp_cc_strip(v->s, &n);
    if (n == 0)
        return 0; /* blank: unset */
    if (!gp_fingerprint_valid(t, n)) {
        gp_toml_error(ps,
                      "tls_fingerprint = \"%.*s\" is not a fingerprint: write what `gpupoold "
                      "fingerprint` prints on the server, \"SHA256:\" and 43 base64 characters "
                      "(or run `gpupool login` again)",
                      (int)(n > 100 ? 100 : n), t);
        return -1;
    }
    memcpy(s->tls_fingerprint, t, n);
    s->tls_fingerprint[n] = 0;
    fs->set[i] |= CC_F_FP;
    gp_cc_src_line(&s->source[GP_SRV_TLS_FINGERPRINT], ps->line);
    return 0;
}

static int set_server_compression(gp_toml_lexer *ps, file_settings *fs, const char *key,
                                  const gp_toml_value *v)
{
    int i = entry(fs);
    gp_server_config *s = &fs->servers[i];
    size_t n;
    const char *t;
    int c = compression_text(ps, key, v, &t, &n);
    if (c == -2)
        return -1;
    if (c < 0) { /* the end of the entry refuses it, naming the server (client_config_file.c) */
        fs->bad_compression_line = ps->line;
        snprintf(fs->bad_compression, sizeof fs->bad_compression, "%.*s", (int)n, t);
        return 0;
    }
    s->compression = c;
    if (n) { /* blank: unset, the top level's applies */
        fs->set[i] |= CC_F_COMP;
        gp_cc_src_line(&s->source[GP_SRV_COMPRESSION], ps->line);
    }
    return 0;
}

/* =================================================================== the table == */

#define PATH_VALUES "a file; ~/ is the home folder, a relative path starts at the file's folder"
#define ADDRESS_VALUES "host, host:port, [v6]:port, tls://host:port (port 1 to 65535, default 7070)"

const gp_config_key gp_config_keys[] = {
    {"token", GP_SECTION_TOP, "string", "the token gpupoold gave you, at most 4096 bytes", "none",
     "GPUPOOL_TOKEN", "the token of every server whose entry has none", 0, set_token},
    {"tls", GP_SECTION_TOP, "boolean", "true, false", "true", "GPUPOOL_TLS",
     "TLS to every server whose entry does not say; false: plain TCP", 0, set_tls},
    {"tls_ca", GP_SECTION_TOP, "string", PATH_VALUES, "none", "GPUPOOL_TLS_CA",
     "the CA certificate(s), PEM, of every server whose entry names none", 0, set_tls_ca},
    {"tls_cert", GP_SECTION_TOP, "string", PATH_VALUES, "none", "GPUPOOL_TLS_CERT",
     "a client certificate (PEM chain) for every server whose entry names none; needs tls_key", 0,
     set_tls_cert},
    {"tls_key", GP_SECTION_TOP, "string", PATH_VALUES, "none", "GPUPOOL_TLS_KEY",
     "the unencrypted key of tls_cert", 0, set_tls_key},
    {"connect_timeout", GP_SECTION_TOP, "number", "seconds, 0 or more; 0: no limit", "10",
     "GPUPOOL_CONNECT_TIMEOUT", "how long to wait for the TCP connection at the first CUDA call", 0,
     set_connect_timeout},
    {"probe_timeout", GP_SECTION_TOP, "number", "seconds, 0 or more; 0: the default", "2",
     "GPUPOOL_PROBE_TIMEOUT", "how long each server's state query may take when choosing one", 0,
     set_probe_timeout},
    {"compression", GP_SECTION_TOP, "string", "\"off\", \"lz4\"", "\"off\"", "GPUPOOL_COMPRESSION",
     "LZ4-compressed copies: the default of every server", 0, set_compression},
    {"servers", GP_SECTION_TOP, "array of strings", ADDRESS_VALUES "; at most 16", "none",
     "GPUPOOL_SERVER", "the servers, the short form of [[servers]] (not together with it)", 0,
     set_servers},
    /* Unlisted: the warnings' list of known top-level keys predates keep_gpu, and issue 30 (a
     * restructuring) changes no message. */
    {"keep_gpu", GP_SECTION_TOP, "boolean", "true, false", "false", "GPUPOOL_KEEP_GPU",
     "keep the GPU while the program idles: the server never detaches the lease", 1, set_keep_gpu},
    {"gpu", GP_SECTION_REQUIREMENTS, "integer or string",
     "a GPU index of the server (0 or more), or a GPU UUID or UUID prefix", "any", "GPUPOOL_GPU",
     "one particular GPU of the server (GPUPOOL_DEVICE is the variable's old name)", 0, set_gpu},
    {"model", GP_SECTION_REQUIREMENTS, "string", "a part of the GPU name, any case (\"A100\")",
     "any", "GPUPOOL_GPU_MODEL", "a GPU whose name contains this text", 0, set_model},
    {"min_memory", GP_SECTION_REQUIREMENTS, "integer or string",
     "bytes, or a size: 40G or 40GB (40*10^9), 40GiB (40*2^30), 512M, 1.5T", "0 (any)",
     "GPUPOOL_MIN_MEMORY", "a GPU with at least this much device memory", 0, set_min_memory},
    {"gpus", GP_SECTION_REQUIREMENTS, "integer", "1 to 64", "1", "GPUPOOL_GPUS",
     "how many GPUs the process takes (devices 0..gpus-1), all at once or none", 0, set_gpus},
    {"spread", GP_SECTION_REQUIREMENTS, "boolean", "true, false", "false", "GPUPOOL_SPREAD",
     "with gpus > 1 in a fleet: take them from several servers when no one server has them all", 0,
     set_spread},
    {"spread_copy", GP_SECTION_REQUIREMENTS, "string", "auto, server, client", "auto",
     "GPUPOOL_SPREAD_COPY",
     "peer copies between the servers of a spread lease: server to server (auto: through the "
     "client when they cannot reach each other; server: fail then), or always through the client",
     0, set_spread_copy},
    {"memory", GP_SECTION_REQUIREMENTS, "integer or string",
     "bytes, or a size as min_memory takes it (8GiB, 16G)", "0 (a whole GPU)", "GPUPOOL_MEMORY",
     "a share of this much device memory on a shared GPU, instead of a whole GPU", 0, set_memory},
    {"address", GP_SECTION_SERVERS, "string", ADDRESS_VALUES, "none: required", "GPUPOOL_SERVER",
     "the server's remoting address (the variable replaces the whole list)", 0, set_address},
    {"token", GP_SECTION_SERVERS, "string", "the token gpupoold gave you, at most 4096 bytes",
     "the top level's", "GPUPOOL_TOKEN", "this server's token", 0, set_server_token},
    {"tls", GP_SECTION_SERVERS, "boolean", "true, false", "the top level's", "GPUPOOL_TLS",
     "TLS to this server; false: plain TCP (an address written tls:// is TLS whatever this says)",
     0, set_server_tls},
    {"tls_ca", GP_SECTION_SERVERS, "string", PATH_VALUES, "the top level's", "GPUPOOL_TLS_CA",
     "the CA certificate(s), PEM, that signed this server's certificate", 0, set_server_tls_ca},
    {"tls_cert", GP_SECTION_SERVERS, "string", PATH_VALUES, "the top level's", "GPUPOOL_TLS_CERT",
     "a client certificate (PEM chain) for this server; needs tls_key", 0, set_server_tls_cert},
    {"tls_key", GP_SECTION_SERVERS, "string", PATH_VALUES, "the top level's", "GPUPOOL_TLS_KEY",
     "the unencrypted key of tls_cert", 0, set_server_tls_key},
    {"tls_fingerprint", GP_SECTION_SERVERS, "string",
     "\"SHA256:\" and 43 base64 characters, as `gpupoold fingerprint` prints it", "none",
     "GPUPOOL_TLS_FINGERPRINT",
     "the pinned identity of the server (the variable: for entries without one)", 0,
     set_server_fingerprint},
    {"compression", GP_SECTION_SERVERS, "string", "\"off\", \"lz4\"", "the top level's",
     "GPUPOOL_COMPRESSION", "LZ4-compressed copies with this server", 0, set_server_compression},
};
const size_t gp_config_nkeys = sizeof gp_config_keys / sizeof gp_config_keys[0];

const gp_config_key *gp_config_key_find(enum gp_config_section table, const char *key)
{
    for (size_t i = 0; i < gp_config_nkeys; i++)
        if (gp_config_keys[i].table == table && !strcmp(gp_config_keys[i].name, key))
            return &gp_config_keys[i];
    return NULL;
}

const char *gp_config_section_name(enum gp_config_section table)
{
    switch (table) {
    case GP_SECTION_TOP:
        return "";
    case GP_SECTION_REQUIREMENTS:
        return "requirements";
    case GP_SECTION_SERVERS:
        return "servers";
    case GP_SECTION_UNKNOWN:
        break;
    }
    return "?";
}
