/*
 * call_counts.h: the per-op counters of call_counts.c, for the profile (profile.c) that writes
 * them to a file at exit. call_counts.c's header comment says what is counted and where.
 */
#ifndef GP_CALL_COUNTS_H
#define GP_CALL_COUNTS_H

#include <stdint.h>

#define GP_COUNT_OPS 256 /* every op of the protocol is below this (gp_protocol.h) */

enum {
    GP_COUNT_FRAMES,       /* frames sent with this op */
    GP_COUNT_WAITED,       /* of which the caller waited for the reply: synchronous round trips */
    GP_COUNT_DETACHED,     /* of which the reply arrives later, nobody waiting (async D2H) */
    GP_COUNT_SENT,         /* bytes sent */
    GP_COUNT_RECEIVED,     /* bytes received in replies */
    GP_COUNT_WAITED_BYTES, /* of GP_COUNT_SENT + GP_COUNT_RECEIVED: those of round trips */
    GP_COUNT_CLIENT_NS,    /* nanoseconds the callers spent in the transport: a round trip's
                              send and wait for the reply, a posted frame's hand-over (which
                              blocks only while the send buffer is full) */
    GP_COUNT_FIELDS
};

/* Whether the counters count (GPUPOOL_CALL_COUNTS=1 or GPUPOOL_PROFILE set at load). */
int gp_count_is_on(void);

/* Every counter now, each read atomically (a snapshot taken while others send may mix calls
 * before and after it, never tear a counter). */
void gp_count_snapshot(uint64_t out[GP_COUNT_OPS][GP_COUNT_FIELDS]);

#endif /* GP_CALL_COUNTS_H */
