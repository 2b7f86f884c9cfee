/*
 * config_dump: the client configuration as the shims read it (client/common/client_config.c),
 * printed as one JSON object on stdout, for tests/test_config_agreement.py to compare with
 * `gpupool.config.load` on the same files and environment.
 *
 *   {"ok": true, "file": "...", "connect_timeout": 10, "probe_timeout": 2, "gpu": "",
 *    "model": "", "min_memory": 0, "compression": "off", "servers": [{"address": ...,
 *    "host": ..., "port": ..., "tls": false, "token": ..., "tls_ca": ..., "tls_cert": ...,
 *    "tls_key": ..., "compression": "off"}, ...]}
 * The top-level "compression" is the servers' default; each server's is what its connection
 * uses.
 *   {"ok": false, "error": "the one-line error"}
 *
 * Warnings go to stderr as the shims print them ("gpupool: ..."). Exit status 0 either way (2
 * when it cannot even allocate the configuration).
 */
#include <stdio.h>
#include <stdlib.h>

#include "client_config.h"

/* A JSON string: quotes, backslashes and control characters escaped, other bytes as they are. */
static void put_string(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

static void put_key_string(const char *key, const char *value, int comma)
{
    printf("%s\"%s\": ", comma ? ", " : "", key);
    put_string(value);
}

static const char *compression_name(int c)
{
    return c == GP_COMPRESSION_LZ4 ? "lz4" : "off";
}

int main(void)
{
    gp_client_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) {
        fprintf(stderr, "config_dump: out of memory\n");
        return 2;
    }
    char err[4096];
    if (gp_client_config_load(cfg, err, sizeof err) != 0) {
        printf("{\"ok\": false");
        put_key_string("error", err, 1);
        printf("}\n");
        free(cfg);
        return 0;
    }
    printf("{\"ok\": true");
    put_key_string("file", cfg->file, 1);
    printf(", \"connect_timeout\": %.17g, \"probe_timeout\": %.17g", cfg->connect_timeout,
           cfg->probe_timeout);
    put_key_string("gpu", cfg->gpu, 1);
    put_key_string("model", cfg->model, 1);
    printf(", \"min_memory\": %llu, \"compression\": \"%s\", \"servers\": [",
           (unsigned long long)cfg->min_memory, compression_name(cfg->compression));
    for (int i = 0; i < cfg->nservers; i++) {
        const gp_server_config *s = &cfg->servers[i];
        printf("%s{", i ? ", " : "");
        put_key_string("address", s->address, 0);
        put_key_string("host", s->host, 1);
        put_key_string("port", s->port, 1);
        printf(", \"tls\": %s", s->tls ? "true" : "false");
        put_key_string("token", s->token, 1);
        put_key_string("tls_ca", s->tls_ca, 1);
        put_key_string("tls_cert", s->tls_cert, 1);
        put_key_string("tls_key", s->tls_key, 1);
        put_key_string("compression", compression_name(s->compression), 1);
        printf("}");
    }
    printf("]}\n");
    free(cfg);
    return fflush(stdout) == 0 ? 0 : 1;
}
