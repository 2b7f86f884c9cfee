/*
 * info_client.h: the `info` request in C (info_client.c; docs/protocol.md, message 6): what a
 * server has, without taking a GPU. Used by server selection in libcuda.so.1 (connect.c) and by
 * the NVML shim. Self-contained (net.c, tls.c, log.c, client_config.c, the generated protocol
 * code): no shim state.
 */
#ifndef GP_INFO_CLIENT_H
#define GP_INFO_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "client_config.h"
#include "gp_protocol.h"

typedef struct gp_info_result {
    int32_t result; /* 0 or a GP_E* code (refused: message says why) */
    char message[4096];
    uint16_t major, minor; /* the server's protocol version */
    char server[256];
    uint32_t gpus, matching, free_matching, queue;
    /* The whole reply, decoded (server facts, you, the GPU, lease and queue views as record
     * spans): its strings and spans point into `body` (malloc'd; gp_info_free). */
    gp_info_reply reply;
    uint8_t *body;
} gp_info_result;

/* probe_timeout 0 (and any timeout_s <= 0) means this many seconds for a probe: never forever. */
#define GP_INFO_DEFAULT_TIMEOUT 2.0
/* gp_info_fetch's answer for a server that speaks protocol 1.0: it answered the info frame with
 * its notice "the first frame must be hello" (it knows hello, not info). */
#define GP_INFO_OLD_SERVER (-2)

/* Connect (TLS per srv), send info with cfg's requirements, read the reply. 0 when the server
 * answered (out->result may be nonzero), -1 when it could not be reached or spoke garbage (err
 * says why: "connection refused", "timed out after 2 s", "TLS: certificate verify failed"),
 * GP_INFO_OLD_SERVER (-2) when it speaks protocol 1.0 (err: "server speaks protocol 1.0 ...").
 * timeout_s is a hard limit for the whole exchange (connect, TLS, request, answer; only name
 * resolution is not bounded); <= 0 means GP_INFO_DEFAULT_TIMEOUT. An answer bigger than an info
 * reply can be is refused unread. On failure out holds nothing to free (gp_info_free is
 * harmless). Thread-safe. */
int gp_info_fetch(const gp_client_config *cfg, const gp_server_config *srv, double timeout_s,
                  gp_info_result *out, char *err, size_t errcap);
void gp_info_free(gp_info_result *r);

/* The most bytes gp_info_reply_decode_any appends to a reply (info_decode.c): a caller's body
 * has this much room after its length. */
#define GP_INFO_APPENDED_MAX 20u

/* Decode an info reply of this protocol version, of a newer 1.x (its added fields ignored) or of
 * an older 1.x from 1.3 on (the fields added since read as empty). `body` must have
 * GP_INFO_APPENDED_MAX writable bytes after `len` (the strings and spans of *r point into it).
 * 0, or -1 when it is none of those. */
int gp_info_reply_decode_any(uint8_t *body, size_t len, gp_info_reply *r);

#endif /* GP_INFO_CLIENT_H */
