/*
 * connect_parts.h: the connect step for a lease that may come in parts (issue 37, item 3:
 * `spread = true`, docs/multi-gpu.md "Across servers"). gp_connect (shim_core.h) connects a
 * lease of one server; gp_connect_parts connects every part of a lease, one connection each,
 * for the caller that holds one connection per part (conn.c, once it routes calls by device).
 */
#ifndef GP_CONNECT_PARTS_H
#define GP_CONNECT_PARTS_H

#include <stddef.h>
#include <stdint.h>

#include "gp_cuda.h"
#include "gp_tls.h"

/* One connected part of the lease: its devices are the program's ordinals first_device ..
 * first_device + ndevices - 1, its device pointers lie in [va_base, va_base + va_size) (a slice
 * of the process's window; the whole window for a lease of one part). */
typedef struct gp_part_link {
    int fd;            /* the connected socket */
    gp_tls *tls;       /* the TLS session with that part's worker, NULL over plain TCP */
    unsigned features; /* GP_HELLO_LZ4 / GP_HELLO_KEEPALIVE, as both sides agreed */
    char desc[300];    /* the server ("host:port"), for messages */
    int first_device, ndevices;
    uint64_t va_base, va_size;
    uint64_t session_id;
} gp_part_link;

/* As gp_connect, for up to cap parts: CUDA_SUCCESS with *nparts connections in parts[] (1 for
 * a lease of one server, the parts in device order for a spread lease) and every part's device
 * snapshot stored (state.c); else one line went to stderr, nothing stays connected and the
 * result is CUDA_ERROR_NO_DEVICE. */
CUresult gp_connect_parts(gp_part_link *parts, int cap, int *nparts);

#endif /* GP_CONNECT_PARTS_H */
