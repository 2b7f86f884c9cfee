/*
 * client_config.h: the client configuration (docs/client-configuration.md; the user's
 * view: docs/user-guide.md). One meaning, read by libcuda.so.1 and libnvidia-ml.so.1 here and by
 * the `gpupool` command (client/gpupool/config.py).
 *
 * The file: $GPUPOOL_CONFIG when set (it must exist; "none": no file), else
 * ${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml when it exists, else
 * /etc/gpupool/config.toml when it exists, else none. A TOML subset (client_config.c says which);
 * the environment (GPUPOOL_SERVER, GPUPOOL_TOKEN, GPUPOOL_TLS*, GPUPOOL_*_TIMEOUT, GPUPOOL_GPU,
 * GPUPOOL_GPU_MODEL, GPUPOOL_MIN_MEMORY, GPUPOOL_COMPRESSION) overrides it key by key. Values
 * are stripped of blanks at both ends and an empty one counts as unset, in the file and the
 * environment alike.
 *
 * Self-contained (client_config.c, requirements.c, log.c): no shim state, so that the NVML shim
 * links it too.
 */
#ifndef GP_CLIENT_CONFIG_H
#define GP_CLIENT_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#define GP_MAX_SERVERS 16
#define GP_COMPRESSION_OFF 0
#define GP_COMPRESSION_LZ4 1
#define GP_DEFAULT_PORT "7070" /* gpupoold's default remoting listener */

typedef struct gp_server_config {
    char address[512]; /* as written, without tls:// ("host:port", "host", "[v6]:port") */
    char host[256], port[32];
    int tls; /* 0/1 after all overrides */
    char token[4097];
    char tls_ca[4096], tls_cert[4096], tls_key[4096];
    int compression; /* GP_COMPRESSION_*: GPUPOOL_COMPRESSION, else its own, else the top level */
} gp_server_config;

typedef struct gp_client_config {
    gp_server_config servers[GP_MAX_SERVERS];
    int nservers;
    double connect_timeout, probe_timeout; /* seconds; connect 0: no limit; probe 0: 2 s */
    char gpu[256], model[256];
    uint64_t min_memory;
    int compression; /* top level (or GPUPOOL_COMPRESSION): the servers' default; connections
                      * use each server's own (gp_server_config.compression) */
    char file[4096]; /* the file read, "" for none */
} gp_client_config;

/* 0, or -1 with a one-line error in err (what, where, what to do). Warnings go to gp_log_*.
 * The struct is large (~270 KB): allocate it, do not put it on a thread's stack. */
int gp_client_config_load(gp_client_config *cfg, char *err, size_t errcap);

/* "host:port" of a server for messages: its address, with the default port added to a bare
 * host name. */
void gp_server_desc(const gp_server_config *srv, char *out, size_t cap);

/* ---- requirements.c: texts and sizes ------------------------------------------------------ */
/* Copy src (n bytes) into dst as valid UTF-8 of at most cap-1 bytes (invalid bytes become '?',
 * truncation never splits a character); returns the length. */
size_t gp_utf8_clean(char *dst, size_t cap, const char *src, size_t n);
/* "40G", "40GB" (40*10^9), "40GiB" (40*2^30), "1.5T", "512M", "17179869184": 0 with *out set,
 * or -1 (not a size, or past 2^64). Units are case-insensitive; K/M/G/T alone are decimal. */
int gp_parse_size(const char *s, uint64_t *out);

#endif /* GP_CLIENT_CONFIG_H */
