/*
 * binding.c: libgpupool-config.so, the client configuration reader (client/common/client_config.c)
 * for the `gpupool` command, which calls it through ctypes (client/gpupool/config.py). One reader
 * of the file for the shims and the command alike; docs/architecture.md says why a library of its
 * own: its soname is not libcuda.so.1 or libnvidia-ml.so.1, so loading it never stands in for the
 * real driver in a process that loads one later.
 *
 * The interface is functions and plain C types only (no struct layout to mirror in Python):
 * load the configuration, then ask for each setting by its name in the file.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_config.h"
#include "client_config_keys.h"
#include "gp_tls.h"

#define GP_EXPORT __attribute__((visibility("default")))

typedef void (*warn_fn)(void *ctx, const char *line);
typedef void (*visit_fn)(void *ctx, int kind, const char *key, const char *text);

/* The effective configuration, read as the shims read it, with envp ("NAME=VALUE", NULL-terminated;
 * NULL: this process's environment) instead of the environment, warnings to warn (NULL: stderr),
 * every header and value of the file to visit (may be NULL), and system_file in place of
 * /etc/gpupool/config.toml (NULL: that file). NULL with a one-line error in err when it cannot be
 * used. Free it with gpupool_config_free. */
GP_EXPORT gp_client_config *gpupool_config_load(char *const *envp, warn_fn warn, visit_fn visit,
                                                const char *system_file, char *err, size_t errcap);
GP_EXPORT void gpupool_config_free(gp_client_config *cfg);
/* How many servers. */
GP_EXPORT int gpupool_config_servers(const gp_client_config *cfg);
/* A setting as text into out, and where it came from into source ("FILE:LINE", the variable,
 * "tls:// in the address", or "" for the default). server -1: the top level (file, file_reason,
 * connect_timeout, probe_timeout, compression, gpu, model, min_memory, gpus, spread, spread_copy, memory, keep_gpu,
 * servers); else that server's (address, host, port, tls, tls_prefix, token, tls_ca, tls_cert,
 * tls_key, tls_fingerprint, compression). Numbers as %.17g or decimal, booleans as 1/0. 0, or -1 (no such setting, or a
 * buffer too small). */
GP_EXPORT int gpupool_config_get(const gp_client_config *cfg, int server, const char *key,
                                 char *out, size_t cap, char *source, size_t scap);
/* An address as a user writes it: 1 (written tls://...) or 0 with its parts (address without
 * tls://, host, port), or -1 when it is not one. */
GP_EXPORT int gpupool_config_split_address(const char *text, char *address, size_t acap, char *host,
                                           size_t hcap, char *port, size_t pcap);
/* The key table of the file (client_config_keys.h), for `gpupool config --help` and the table of
 * docs/client-configuration.md (gpupool/config_keys.py): gpupool_config_key_count entries, each
 * asked for field by field: "name", "table" ("", "requirements", "servers"), "type", "values",
 * "default", "env" ("" for none) or "doc". NULL past the end or for another field. */
GP_EXPORT size_t gpupool_config_key_count(void);
GP_EXPORT const char *gpupool_config_key_field(size_t key, const char *field);

/* The trust rules of the shims (tls.c), for the `gpupool` command's own connections:
 * gpupool_config_trust: 0 when cfg's server may be sent a token (plain TCP by choice, or TLS with
 * a pin or a CA), else -1 with the one-line fix in err. gpupool_fingerprint_of_cert: the
 * fingerprint of a DER certificate ("SHA256:..." into out, cap >= 64): 0, or -1 with err.
 * gpupool_check_pin: 0 when the DER certificate has the pin `expected`, else -1 with the loud
 * message for server desc ("host:port") in err. */
GP_EXPORT int gpupool_config_trust(const gp_client_config *cfg, int server, char *err,
                                   size_t errcap);
GP_EXPORT int gpupool_fingerprint_of_cert(const unsigned char *der, size_t len, char *out,
                                          size_t cap, char *err, size_t errcap);
GP_EXPORT int gpupool_check_pin(const unsigned char *der, size_t len, const char *expected,
                                const char *desc, char *err, size_t errcap);

int gpupool_config_trust(const gp_client_config *cfg, int server, char *err, size_t errcap)
{
    if (server < 0 || server >= cfg->nservers) {
        snprintf(err, errcap, "no server %d", server);
        return -1;
    }
    return gp_tls_trusted(&cfg->servers[server], err, errcap);
}

int gpupool_fingerprint_of_cert(const unsigned char *der, size_t len, char *out, size_t cap,
                                char *err, size_t errcap)
{
    return gp_tls_fingerprint_of_cert(der, len, out, cap, err, errcap);
}

int gpupool_check_pin(const unsigned char *der, size_t len, const char *expected, const char *desc,
                      char *err, size_t errcap)
{
    char seen[GP_FINGERPRINT_CAP];
    if (gp_tls_fingerprint_of_cert(der, len, seen, sizeof seen, err, errcap) != 0)
        return -1;
    return gp_tls_pin_matches(seen, expected, desc, err, errcap);
}

gp_client_config *gpupool_config_load(char *const *envp, warn_fn warn, visit_fn visit,
                                      const char *system_file, char *err, size_t errcap)
{
    gp_client_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) {
        snprintf(err, errcap, "out of memory reading the gpupool configuration");
        return NULL;
    }
    gp_config_hooks hooks = {
        .envp = envp, .warn = warn, .visit = visit, .ctx = NULL, .system_file = system_file};
    if (gp_client_config_load_with(cfg, &hooks, err, errcap) != 0) {
        free(cfg);
        return NULL;
    }
    return cfg;
}

void gpupool_config_free(gp_client_config *cfg)
{
    free(cfg);
}

int gpupool_config_servers(const gp_client_config *cfg)
{
    return cfg->nservers;
}

static const char *compression_name(int c)
{
    return c == GP_COMPRESSION_LZ4 ? "lz4" : "off";
}

static int put(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static int put(char *out, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    return k < 0 || (size_t)k >= cap ? -1 : 0;
}

static int put_source(const gp_client_config *cfg, const gp_config_source *src, char *out,
                      size_t cap)
{
    if (src->line > 0)
        return put(out, cap, "%s:%d", cfg->file, src->line);
    return put(out, cap, "%s", src->what ? src->what : "");
}

static int top_setting(const gp_client_config *cfg, const char *key, char *out, size_t cap,
                       const gp_config_source **src)
{
    static const char *const names[GP_CFG_NSETTINGS] = {
        [GP_CFG_CONNECT_TIMEOUT] = "connect_timeout",
        [GP_CFG_PROBE_TIMEOUT] = "probe_timeout",
        [GP_CFG_COMPRESSION] = "compression",
        [GP_CFG_GPU] = "gpu",
        [GP_CFG_MODEL] = "model",
        [GP_CFG_MIN_MEMORY] = "min_memory",
        [GP_CFG_KEEP_GPU] = "keep_gpu",
        [GP_CFG_GPUS] = "gpus",
        [GP_CFG_MEMORY] = "memory",
        [GP_CFG_SPREAD] = "spread",
        [GP_CFG_SPREAD_COPY] = "spread_copy",
        [GP_CFG_SERVERS] = "servers",
    };
    if (!strcmp(key, "file"))
        return put(out, cap, "%s", cfg->file);
    if (!strcmp(key, "file_reason"))
        return put(out, cap, "%s", cfg->file_reason);
    for (int i = 0; i < GP_CFG_NSETTINGS; i++) {
        if (strcmp(key, names[i]) != 0)
            continue;
        *src = &cfg->source[i];
        switch (i) {
        case GP_CFG_CONNECT_TIMEOUT:
            return put(out, cap, "%.17g", cfg->connect_timeout);
        case GP_CFG_PROBE_TIMEOUT:
            return put(out, cap, "%.17g", cfg->probe_timeout);
        case GP_CFG_COMPRESSION:
            return put(out, cap, "%s", compression_name(cfg->compression));
        case GP_CFG_GPU:
            return put(out, cap, "%s", cfg->gpu);
        case GP_CFG_MODEL:
            return put(out, cap, "%s", cfg->model);
        case GP_CFG_MIN_MEMORY:
            return put(out, cap, "%llu", (unsigned long long)cfg->min_memory);
        case GP_CFG_KEEP_GPU:
            return put(out, cap, "%d", cfg->keep_gpu ? 1 : 0);
        case GP_CFG_GPUS:
            return put(out, cap, "%d", cfg->gpus);
        case GP_CFG_MEMORY:
            return put(out, cap, "%llu", (unsigned long long)cfg->memory);
        case GP_CFG_SPREAD:
            return put(out, cap, "%d", cfg->spread ? 1 : 0);
        case GP_CFG_SPREAD_COPY:
            return put(out, cap, "%s",
                       cfg->spread_copy == GP_SPREAD_COPY_SERVER   ? "server"
                       : cfg->spread_copy == GP_SPREAD_COPY_CLIENT ? "client"
                                                                   : "auto");
        default:
            return put(out, cap, "%d", cfg->nservers);
        }
    }
    return -1;
}

static int server_setting(const gp_server_config *s, const char *key, char *out, size_t cap,
                          const gp_config_source **src)
{
    static const char *const names[GP_SRV_NSETTINGS] = {
        [GP_SRV_ADDRESS] = "address",
        [GP_SRV_TOKEN] = "token",
        [GP_SRV_TLS] = "tls",
        [GP_SRV_TLS_CA] = "tls_ca",
        [GP_SRV_TLS_CERT] = "tls_cert",
        [GP_SRV_TLS_KEY] = "tls_key",
        [GP_SRV_COMPRESSION] = "compression",
        [GP_SRV_TLS_FINGERPRINT] = "tls_fingerprint",
    };
    if (!strcmp(key, "host"))
        return put(out, cap, "%s", s->host);
    if (!strcmp(key, "port"))
        return put(out, cap, "%s", s->port);
    if (!strcmp(key, "tls_prefix"))
        return put(out, cap, "%d", s->tls_prefix ? 1 : 0);
    for (int i = 0; i < GP_SRV_NSETTINGS; i++) {
        if (strcmp(key, names[i]) != 0)
            continue;
        *src = &s->source[i];
        switch (i) {
        case GP_SRV_ADDRESS:
            return put(out, cap, "%s", s->address);
        case GP_SRV_TOKEN:
            return put(out, cap, "%s", s->token);
        case GP_SRV_TLS:
            return put(out, cap, "%d", s->tls ? 1 : 0);
        case GP_SRV_TLS_CA:
            return put(out, cap, "%s", s->tls_ca);
        case GP_SRV_TLS_CERT:
            return put(out, cap, "%s", s->tls_cert);
        case GP_SRV_TLS_KEY:
            return put(out, cap, "%s", s->tls_key);
        case GP_SRV_TLS_FINGERPRINT:
            return put(out, cap, "%s", s->tls_fingerprint);
        default:
            return put(out, cap, "%s", compression_name(s->compression));
        }
    }
    return -1;
}

int gpupool_config_get(const gp_client_config *cfg, int server, const char *key, char *out,
                       size_t cap, char *source, size_t scap)
{
    static const gp_config_source none = {0, NULL};
    const gp_config_source *src = &none;
    int rc;
    if (server < 0)
        rc = top_setting(cfg, key, out, cap, &src);
    else if (server < cfg->nservers)
        rc = server_setting(&cfg->servers[server], key, out, cap, &src);
    else
        rc = -1;
    if (rc != 0)
        return -1;
    return put_source(cfg, src, source, scap);
}

int gpupool_config_split_address(const char *text, char *address, size_t acap, char *host,
                                 size_t hcap, char *port, size_t pcap)
{
    gp_server_config *s = calloc(1, sizeof *s);
    if (!s)
        return -1;
    int rc = gp_parse_server_address(text, s);
    if (rc == 0 && (put(address, acap, "%s", s->address) != 0 ||
                    put(host, hcap, "%s", s->host) != 0 || put(port, pcap, "%s", s->port) != 0))
        rc = -1;
    if (rc == 0)
        rc = s->tls_prefix ? 1 : 0;
    free(s);
    return rc;
}

size_t gpupool_config_key_count(void)
{
    return gp_config_nkeys;
}

const char *gpupool_config_key_field(size_t key, const char *field)
{
    if (key >= gp_config_nkeys)
        return NULL;
    const gp_config_key *k = &gp_config_keys[key];
    if (!strcmp(field, "name"))
        return k->name;
    if (!strcmp(field, "table"))
        return gp_config_section_name(k->table);
    if (!strcmp(field, "type"))
        return k->type;
    if (!strcmp(field, "values"))
        return k->values;
    if (!strcmp(field, "default"))
        return k->dflt;
    if (!strcmp(field, "env"))
        return k->env ? k->env : "";
    if (!strcmp(field, "doc"))
        return k->doc;
    return NULL;
}
