/*
 * call_counts.c: what a program sends to the server, counted per protocol op, for the link model
 * (bench/link_model.py): how many requests the program waited for (synchronous round trips),
 * kernel launches and other frames sent without waiting, replies that arrive later (asynchronous
 * device-to-host copies), bytes each way and module image bytes.
 *
 * Off unless GPUPOOL_CALL_COUNTS=1 or GPUPOOL_PROFILE (profile.c, which writes these counts to a
 * file at exit) is in the environment when the library loads: counting costs a few atomic
 * additions and two clock reads per call, which the launch hot path should not pay for nothing.
 *
 * The counts are taken where every API entry point hands its frame to the connection: the four
 * transport functions of conn.c (gp_post, gp_post_lz4, gp_request, gp_request_detached) are
 * wrapped at link time (shim.mk: -Wl,--wrap), so the transport itself carries no counting code
 * and no API file needs a hook. What conn.c sends on its own (context switches in front of a
 * frame, keepalive pings, the hello) is not a program's call and is not counted.
 *
 * Bytes are what the frames carry: header, body and bulk data as the program handed them over
 * (an LZ4-compressed copy counts its uncompressed size); a reply counts its header, body and bulk.
 * A detached request counts its reply, with the bulk it asked for, as received when it is sent.
 *
 * gpupool_call_counts() (exported; ctypes reads it from Python) writes the totals as one JSON
 * object. The counters are independent relaxed atomics: a snapshot taken while other threads
 * send may mix calls before and after it, but never tears a counter.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "call_counts.h"
#include "entry_profile.h"
#include "shim.h"

static atomic_int gp_count_on; /* set once, by the constructor below */
static atomic_uint_fast64_t gp_counts[GP_COUNT_OPS][GP_COUNT_FIELDS];

__attribute__((constructor)) static void gp_count_setup(void)
{
    const char *v = getenv("GPUPOOL_CALL_COUNTS");
    const char *profile = getenv("GPUPOOL_PROFILE");
    atomic_store(&gp_count_on,
                 (v != NULL && strcmp(v, "1") == 0) || (profile != NULL && profile[0] != '\0'));
}

int gp_count_is_on(void)
{
    return atomic_load_explicit(&gp_count_on, memory_order_relaxed) != 0;
}

void gp_count_snapshot(uint64_t out[GP_COUNT_OPS][GP_COUNT_FIELDS])
{
    for (unsigned op = 0; op < GP_COUNT_OPS; op++)
        for (int f = 0; f < GP_COUNT_FIELDS; f++)
            out[op][f] = atomic_load_explicit(&gp_counts[op][f], memory_order_relaxed);
}

/* Monotonic nanoseconds: what a transport call took, the client's time in it. */
static uint64_t gp_count_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC; a 0 makes the call count no time */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t gp_count_since(uint64_t t0)
{
    uint64_t t1 = gp_count_now_ns();
    return t0 && t1 > t0 ? t1 - t0 : 0;
}

static inline bool gp_count_enabled(void)
{
    return atomic_load_explicit(&gp_count_on, memory_order_relaxed) != 0;
}

static void gp_count_add(const uint8_t *frame, int field, uint64_t sent, uint64_t received,
                         uint64_t ns)
{
    unsigned op = gp_rd_u16(frame + 4) % GP_COUNT_OPS;
    atomic_uint_fast64_t *c = gp_counts[op];
    atomic_fetch_add_explicit(&c[GP_COUNT_FRAMES], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c[GP_COUNT_CLIENT_NS], ns, memory_order_relaxed);
    if (field >= 0)
        atomic_fetch_add_explicit(&c[field], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c[GP_COUNT_SENT], sent, memory_order_relaxed);
    if (received)
        atomic_fetch_add_explicit(&c[GP_COUNT_RECEIVED], received, memory_order_relaxed);
    if (field == GP_COUNT_WAITED)
        atomic_fetch_add_explicit(&c[GP_COUNT_WAITED_BYTES], sent + received, memory_order_relaxed);
    gp_entry_note_frame(field == GP_COUNT_WAITED, sent, received, ns);
}

/* ---- the wrapped transport (the real functions are conn.c's) ---------------------------- */
CUresult __real_gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len);
CUresult __real_gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n);
CUresult __real_gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                           void *bulk_dst, uint64_t bulk_cap, gp_reply *reply);
CUresult __real_gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst,
                                    uint64_t bulk_cap);
CUresult __wrap_gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len);
CUresult __wrap_gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n);
CUresult __wrap_gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                           void *bulk_dst, uint64_t bulk_cap, gp_reply *reply);
CUresult __wrap_gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst,
                                    uint64_t bulk_cap);

CUresult __wrap_gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    if (!gp_count_enabled())
        return __real_gp_post(frame, frame_len, bulk, bulk_len);
    uint64_t t0 = gp_count_now_ns();
    CUresult r = __real_gp_post(frame, frame_len, bulk, bulk_len);
    if (r == CUDA_SUCCESS)
        gp_count_add(frame, -1, frame_len + bulk_len, 0, gp_count_since(t0));
    return r;
}

CUresult __wrap_gp_post_lz4(uint8_t *frame, size_t frame_len, const void *src, uint64_t n)
{
    if (!gp_count_enabled())
        return __real_gp_post_lz4(frame, frame_len, src, n);
    uint64_t t0 = gp_count_now_ns();
    CUresult r = __real_gp_post_lz4(frame, frame_len, src, n);
    if (r == CUDA_SUCCESS)
        gp_count_add(frame, -1, frame_len + n, 0, gp_count_since(t0));
    return r;
}

CUresult __wrap_gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                           void *bulk_dst, uint64_t bulk_cap, gp_reply *reply)
{
    if (!gp_count_enabled() || !frame || frame_len < 16)
        return __real_gp_request(frame, frame_len, bulk, bulk_len, bulk_dst, bulk_cap, reply);
    gp_reply mine;
    gp_reply *rep = reply ? reply : &mine;
    uint64_t t0 = gp_count_now_ns();
    CUresult r = __real_gp_request(frame, frame_len, bulk, bulk_len, bulk_dst, bulk_cap, rep);
    uint64_t ns = gp_count_since(t0);
    /* A failed request has its body freed already: its result (4 bytes) is what came back. */
    uint64_t got = 16 + (rep->body ? rep->len : 4) + rep->bulk_len;
    if (!reply)
        gp_reply_free(&mine);
    gp_count_add(frame, GP_COUNT_WAITED, frame_len + bulk_len, got, ns);
    return r;
}

CUresult __wrap_gp_request_detached(uint8_t *frame, size_t frame_len, void *bulk_dst,
                                    uint64_t bulk_cap)
{
    if (!gp_count_enabled())
        return __real_gp_request_detached(frame, frame_len, bulk_dst, bulk_cap);
    uint64_t t0 = gp_count_now_ns();
    CUresult r = __real_gp_request_detached(frame, frame_len, bulk_dst, bulk_cap);
    /* Its reply (memcpy_dtoh's, the one detached request): header, result, the data's length
     * and the data. The time is the send's: nobody waits for the reply. */
    if (r == CUDA_SUCCESS)
        gp_count_add(frame, GP_COUNT_DETACHED, frame_len, 16 + 4 + 8 + (bulk_dst ? bulk_cap : 0),
                     gp_count_since(t0));
    return r;
}

/* ---- the snapshot ------------------------------------------------------------------------ */
struct gp_count_out {
    char *buf;
    size_t cap, len; /* len: what the whole text needs, even past cap */
};

static void gp_count_put(struct gp_count_out *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void gp_count_put(struct gp_count_out *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *at = o->len < o->cap ? o->buf + o->len : NULL;
    int n = vsnprintf(at, at ? o->cap - o->len : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->len += (size_t)n;
}

/* Writes the counts since the library loaded as one JSON object, NUL-terminated, into buf (cap
 * bytes; cut when too small) and returns the length of the whole text (without the NUL), as
 * snprintf does: call again with a larger buffer when it is >= cap. The object:
 *   {"enabled": true|false, "round_trips": N, "launches": N, "graph_launches": N,
 *    "detached": N, "frames": N, "bytes_sent": N, "bytes_received": N, "waited_bytes": N,
 *    "module_bytes": N,
 *    "ops": {"<op name>": {"frames": N, "round_trips": N, "detached": N, "sent": N,
 *                          "received": N, "waited_bytes": N}, ...}}
 * waited_bytes: the bytes (both ways) of the round trips, which the caller waited for.
 * "ops" lists only the ops sent at least once. "enabled" is false (and every count 0) unless
 * GPUPOOL_CALL_COUNTS=1 (or GPUPOOL_PROFILE) was set when the library loaded. */
GP_EXPORT size_t gpupool_call_counts(char *buf, size_t cap)
{
    struct gp_count_out o = {.buf = buf, .cap = buf ? cap : 0, .len = 0};
    uint64_t snap[GP_COUNT_OPS][GP_COUNT_FIELDS];
    uint64_t total[GP_COUNT_FIELDS] = {0};
    gp_count_snapshot(snap);
    for (unsigned op = 0; op < GP_COUNT_OPS; op++)
        for (int f = 0; f < GP_COUNT_FIELDS; f++)
            total[f] += snap[op][f];
    gp_count_put(
        &o,
        "{\"enabled\": %s, \"round_trips\": %llu, \"launches\": %llu, "
        "\"graph_launches\": %llu, \"detached\": %llu, \"frames\": %llu, "
        "\"bytes_sent\": %llu, \"bytes_received\": %llu, \"waited_bytes\": %llu, "
        "\"module_bytes\": %llu, \"ops\": {",
        gp_count_enabled() ? "true" : "false", (unsigned long long)total[GP_COUNT_WAITED],
        (unsigned long long)snap[GP_OP_LAUNCH][GP_COUNT_FRAMES],
        (unsigned long long)snap[GP_OP_GRAPH_LAUNCH][GP_COUNT_FRAMES],
        (unsigned long long)total[GP_COUNT_DETACHED], (unsigned long long)total[GP_COUNT_FRAMES],
        (unsigned long long)total[GP_COUNT_SENT], (unsigned long long)total[GP_COUNT_RECEIVED],
        (unsigned long long)total[GP_COUNT_WAITED_BYTES],
        (unsigned long long)snap[GP_OP_MODULE_LOAD][GP_COUNT_SENT]);
    const char *sep = "";
    for (unsigned op = 0; op < GP_COUNT_OPS; op++) {
        if (snap[op][GP_COUNT_FRAMES] == 0)
            continue;
        /* Op names are [a-z0-9_] (the protocol's spec), so they need no JSON escaping; an op
         * the table does not know is named by its number. */
        const char *name = gp_op_name(op);
        char unknown[16];
        if (!name || strcmp(name, "?") == 0) {
            snprintf(unknown, sizeof unknown, "op_%u", op);
            name = unknown;
        }
        gp_count_put(&o,
                     "%s\"%s\": {\"frames\": %llu, \"round_trips\": %llu, \"detached\": %llu, "
                     "\"sent\": %llu, \"received\": %llu, \"waited_bytes\": %llu}",
                     sep, name, (unsigned long long)snap[op][GP_COUNT_FRAMES],
                     (unsigned long long)snap[op][GP_COUNT_WAITED],
                     (unsigned long long)snap[op][GP_COUNT_DETACHED],
                     (unsigned long long)snap[op][GP_COUNT_SENT],
                     (unsigned long long)snap[op][GP_COUNT_RECEIVED],
                     (unsigned long long)snap[op][GP_COUNT_WAITED_BYTES]);
        sep = ", ";
    }
    gp_count_put(&o, "}}");
    if (o.cap > 0 && o.len >= o.cap)
        o.buf[o.cap - 1] = '\0'; /* vsnprintf cut it; keep it a string */
    return o.len;
}
