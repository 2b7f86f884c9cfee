/*
 * loop.c: the frame loop. Each frame is decoded with the generated decoder (a body that does not
 * decode to exactly its length closes the connection) and handed to its handler. The loop names
 * no handler: the cases come from WK_DISPATCH_TABLE (generated/wk_calls.h, from the messages of
 * protocol/gpupool.toml that carry a call_class); the session messages are in h_session.c.
 *
 * Each dispatched CUDA call also counts in its class (launch, copy, alloc, sync, other) for the
 * daemon's accounting: one array increment, nothing else on the hot path. The session messages
 * (goodbye, notice, ping, stats) are not calls and are not counted. Each call is also timed into
 * the latency histogram (stats.lat_counts, lat_sum_ns) and per op (stats.op_calls, op_ns, for
 * the client's profile): one clock_gettime pair and a few increments.
 */
#include "worker.h"

/* A call that started at t0 (wk_now_ns()) is done: count its latency. No allocation, one clock
 * read and at most 17 comparisons (most calls stop at the first few bounds). */
static void latency_done(struct worker *w, uint16_t op, uint64_t t0)
{
    static const uint64_t bounds[WK_LAT_BUCKETS - 1] = WK_LAT_BOUNDS_NS;
    uint64_t t1 = wk_now_ns();
    uint64_t d = t1 > t0 ? t1 - t0 : 0;
    unsigned i = 0;
    while (i < WK_LAT_BUCKETS - 1 && d > bounds[i])
        i++;
    w->stats.lat_counts[i]++;
    w->stats.lat_sum_ns += d;
    w->stats.op_calls[op & 255u]++;
    w->stats.op_ns[op & 255u] += d;
}

/* Count the frame in its call class, decode the body as message `name_`, call wk_h_<name_>. A
 * call (class_ not WK_CALL_NONE) is timed from here (its body has been read) to the return of its
 * handler (its reply, if any, is queued); a malformed one too, so that the latency counts always
 * add up to the calls once the call is over. */
#define DISPATCH(OP_, name_, class_)                                                               \
    case OP_: {                                                                                    \
        gp_##name_ msg;                                                                            \
        uint64_t t0_ = 0;                                                                          \
        if (class_ != WK_CALL_NONE) {                                                              \
            w->stats.calls[class_]++;                                                              \
            t0_ = wk_now_ns();                                                                     \
        }                                                                                          \
        if (gp_##name_##_decode(body, h->len, &msg) != 0)                                          \
            wk_protocol_error(w, h->op, "malformed %s message (%u bytes)", #name_, h->len);        \
        else                                                                                       \
            wk_h_##name_(w, h->req, &msg);                                                         \
        if (class_ != WK_CALL_NONE)                                                                \
            latency_done(w, h->op, t0_);                                                           \
        return;                                                                                    \
    }

static void dispatch(struct worker *w, const gp_frame_header *h, const uint8_t *body)
{
    if (h->flags & GP_FLAG_REPLY) {
        wk_protocol_error(w, h->op, "the client sent a reply frame (op %u)", h->op);
        return;
    }
    switch (h->op) {
        WK_DISPATCH_TABLE(DISPATCH)
    default:
        /* Known to the spec but not a request the worker takes (a second hello). */
        wk_protocol_error(w, h->op, "unexpected %s message", gp_op_name(h->op));
    }
}

/* A client that keeps the worker busy (launches sent back to back, never a synchronise) never lets
 * the loop wait, where stats go out and END, signals and the daemon's departure are seen. So the
 * loop looks itself, between two frames, once this long has passed since it last did (or every
 * 1024 frames, whichever comes first): the daemon's live view of the session (busy time, memory
 * used: at most one stats event a second, control.c) then lags by about a second, however long
 * the client goes without waiting. Between frames no call is half done, so the checks' callbacks
 * never meet the CUDA state mid-change. */
#define BUSY_CHECK_NS 250000000ull

void wk_worker_loop(struct worker *w)
{
    uint64_t check_at = 0; /* the next look of a busy loop (wk_now_ns) */
    while (!w->closing) {
        gp_frame_header h;
        const uint8_t *body;
        int r = wk_io_next_frame(w, &h, &body);
        if (r == 0) {
            wk_log("client closed the connection");
            wk_end_session(w, WK_END_CLIENT_LOST,
                           "the client closed the connection without goodbye");
            break;
        }
        if (r < 0)
            break;
        /* The busy loop's look (BUSY_CHECK_NS): one clock read per frame, a poll when due. */
        w->stats.frames++;
        if (w->ctl.fd >= 0 || w->ctl.listen_fd >= 0) {
            uint64_t now = wk_now_ns();
            if ((w->stats.frames & 1023) == 0 || now >= check_at) {
                check_at = now + BUSY_CHECK_NS;
                if (wk_io_check(w) != 0)
                    break;
            }
        }
        w->in_call = 1; /* a copy's bulk is read inside its handler: not idle meanwhile */
        dispatch(w, &h, body);
        w->in_call = 0;
        if (w->out_len >= WK_FLUSH_AT && wk_io_flush(w) != 0)
            break;
    }
    if (w->out_len > 0 && wk_io_flush(w) != 0)
        wk_error("could not send the last replies");
}
