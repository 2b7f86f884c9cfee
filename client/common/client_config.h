/*
 * client_config.h: the client configuration (docs/client-configuration.md; the user's
 * view: docs/user-guide.md). The one reader of that file: libcuda.so.1 and libnvidia-ml.so.1 link
 * it, and the `gpupool` command calls it through libgpupool-config.so (client/config/, ctypes).
 *
 * The file: $GPUPOOL_CONFIG when set (it must exist; "none": no file), else
 * ${XDG_CONFIG_HOME:-$HOME/.config}/gpupool/config.toml when it exists, else
 * /etc/gpupool/config.toml when it exists, else none. A TOML subset (client_config.c says which);
 * the environment (GPUPOOL_SERVER, GPUPOOL_TOKEN, GPUPOOL_TLS*, GPUPOOL_*_TIMEOUT, GPUPOOL_GPU,
 * GPUPOOL_GPU_MODEL, GPUPOOL_MIN_MEMORY, GPUPOOL_GPUS, GPUPOOL_SPREAD, GPUPOOL_SPREAD_COPY, GPUPOOL_MEMORY,
 * GPUPOOL_COMPRESSION)
 * overrides it key by key. Values
 * are stripped of blanks at both ends and an empty one counts as unset, in the file and the
 * environment alike.
 *
 * Self-contained (client_config.c and the units it names, toml_lexer.c, requirements.c, log.c):
 * no shim state, so that the NVML shim links it too. The keys: client_config_keys.h.
 */
#ifndef GP_CLIENT_CONFIG_H
#define GP_CLIENT_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "utf8.h"

#define GP_MAX_SERVERS 16
#define GP_MAX_GPUS 64 /* gpus: the hello's device list (worker_session's array:i32:64) */
#define GP_COMPRESSION_OFF 0
#define GP_COMPRESSION_LZ4 1
/* spread_copy: how a peer copy between two servers of a spread lease goes (issue 37, item 3). */
#define GP_SPREAD_COPY_AUTO 0   /* server to server; through the client when no link can be made */
#define GP_SPREAD_COPY_SERVER 1 /* server to server only: a copy fails when no link can be made */
#define GP_SPREAD_COPY_CLIENT 2 /* always through the client */
#define GP_DEFAULT_PORT "7070"  /* gpupoold's default remoting listener */
/* "SHA256:" + 43 base64 characters (32 bytes, no '=' padding), with its NUL. */
#define GP_FINGERPRINT_LEN 50
#define GP_FINGERPRINT_CAP 64

/* Where a setting's value came from: line > 0, the config file (gp_client_config.file) at that
 * line; else `what`, a static text (the environment variable, or "tls:// in the address"); neither:
 * the default. */
typedef struct gp_config_source {
    int line;
    const char *what;
} gp_config_source;

/* The settings of a server, in the order of gp_server_config.source. */
enum gp_server_setting {
    GP_SRV_ADDRESS,
    GP_SRV_TOKEN,
    GP_SRV_TLS,
    GP_SRV_TLS_CA,
    GP_SRV_TLS_CERT,
    GP_SRV_TLS_KEY,
    GP_SRV_COMPRESSION,
    GP_SRV_TLS_FINGERPRINT,
    GP_SRV_NSETTINGS
};

/* The top-level settings, in the order of gp_client_config.source. */
enum gp_client_setting {
    GP_CFG_CONNECT_TIMEOUT,
    GP_CFG_PROBE_TIMEOUT,
    GP_CFG_COMPRESSION,
    GP_CFG_GPU,
    GP_CFG_MODEL,
    GP_CFG_MIN_MEMORY,
    GP_CFG_KEEP_GPU,
    GP_CFG_GPUS,
    GP_CFG_MEMORY,
    GP_CFG_SPREAD,
    GP_CFG_SPREAD_COPY,
    GP_CFG_SERVERS, /* the list itself: GPUPOOL_SERVER, else the file */
    GP_CFG_NSETTINGS
};

typedef struct gp_server_config {
    char address[512]; /* as written, without tls:// ("host:port", "host", "[v6]:port") */
    char host[256], port[32];
    int tls; /* 0/1 after all overrides (default 1: plain TCP only with tls = false) */
    char token[4097];
    char tls_ca[4096], tls_cert[4096], tls_key[4096];
    /* The pinned identity of the server, "SHA256:" + 43 base64 characters (the SHA-256 of its
     * certificate's SubjectPublicKeyInfo, unpadded base64), or "" for none: tls_fingerprint of
     * its entry, else GPUPOOL_TLS_FINGERPRINT (servers whose entry pins none). */
    char tls_fingerprint[GP_FINGERPRINT_CAP];
    int compression; /* GP_COMPRESSION_*: GPUPOOL_COMPRESSION, else its own, else the top level */
    int tls_prefix;  /* written tls://... (TLS whatever else says) */
    gp_config_source source[GP_SRV_NSETTINGS];
} gp_server_config;

typedef struct gp_client_config {
    gp_server_config servers[GP_MAX_SERVERS];
    int nservers;
    double connect_timeout, probe_timeout; /* seconds; connect 0: no limit; probe 0: 2 s */
    char gpu[256], model[256];
    uint64_t min_memory;
    int gpus;        /* how many GPUs the process takes, all or nothing (1..GP_MAX_GPUS; 1) */
    uint64_t memory; /* bytes of a shared GPU to ask for; 0: a whole GPU */
    int spread;      /* 1: gpus > 1 may come from several servers of a fleet (issue 37, item 3) */
    int spread_copy; /* GP_SPREAD_COPY_*: peer copies between the servers of a spread lease */
    int keep_gpu;    /* 1: ask the server never to detach this process's idle lease */
    int compression; /* top level (or GPUPOOL_COMPRESSION): the servers' default; connections
                      * use each server's own (gp_server_config.compression) */
    char file[4096]; /* the file read, "" for none */
    char file_reason[8448]; /* why that file, or why none ("the user's file", ...) */
    gp_config_source source[GP_CFG_NSETTINGS];
} gp_client_config;

/* 0, or -1 with a one-line error in err (what, where, what to do). Warnings go to gp_log_*.
 * The struct is large (~270 KB): allocate it, do not put it on a thread's stack. */
int gp_client_config_load(gp_client_config *cfg, char *err, size_t errcap);

/* What a caller other than the shims may change in how the configuration is read (the
 * `gpupool` command, through client/config/binding.c). Any member may be NULL: the process's
 * environment, warnings to gp_log_info, no visitor, /etc/gpupool/config.toml. */
enum gp_config_visit {
    GP_VISIT_TABLE = 1,   /* [name]: text is the name, key NULL */
    GP_VISIT_ARRAY_TABLE, /* [[name]] */
    GP_VISIT_STRING,      /* key = "text" (as written, unstripped) */
    GP_VISIT_INTEGER,     /* key = text (decimal) */
    GP_VISIT_FLOAT,       /* key = text (%.17g: reads back to the same double) */
    GP_VISIT_BOOL,        /* key = text ("true" or "false") */
    GP_VISIT_ARRAY,       /* key = [ ... ]: text NULL, then one GP_VISIT_ITEM per string */
    GP_VISIT_ITEM
};
typedef struct gp_config_hooks {
    char *const *envp; /* "NAME=VALUE" strings, NULL-terminated, read instead of environ */
    void (*warn)(void *ctx, const char *line);
    /* Every header and value of the file, in order, as written: what `gpupool login` needs to
     * rewrite the file (the reader's checks still apply: an error stops the visit). */
    void (*visit)(void *ctx, int kind, const char *key, const char *text);
    void *ctx;
    const char *system_file;
} gp_config_hooks;
int gp_client_config_load_with(gp_client_config *cfg, const gp_config_hooks *hooks, char *err,
                               size_t errcap);

/* Split an address as a user writes it ([tls://]host[:port], [v6]:port) into srv's address,
 * host and port and srv->tls_prefix. 0, or -1 (not an address). */
int gp_parse_server_address(const char *text, gp_server_config *srv);

/* 1 if text (n bytes) is a fingerprint as `gpupoold fingerprint` prints it: "SHA256:" and 43
 * characters of unpadded base64 (A-Z a-z 0-9 + /, the last one of A E I M Q U Y c g k o s w 0
 * 4 8, as 32 bytes end). */
int gp_fingerprint_valid(const char *text, size_t n);

/* "host:port" of a server for messages: its address, with the default port added to a bare
 * host name. */
void gp_server_desc(const gp_server_config *srv, char *out, size_t cap);

/* ---- requirements.c: texts and sizes ------------------------------------------------------ */
/* gp_utf8_clean: common/utf8.h. */
/* "40G", "40GB" (40*10^9), "40GiB" (40*2^30), "1.5T", "512M", "17179869184": 0 with *out set,
 * or -1 (not a size, or past 2^64). Units are case-insensitive; K/M/G/T alone are decimal. */
int gp_parse_size(const char *s, uint64_t *out);

#endif /* GP_CLIENT_CONFIG_H */
