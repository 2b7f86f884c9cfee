/*
 * loop.c: the frame loop. Each frame is decoded with the generated decoder (a body that does not
 * decode to exactly its length closes the connection) and handed to its handler; the session
 * messages that touch no driver state (ping, stats, goodbye, notice) are answered here.
 *
 * Each dispatched CUDA call also counts in its class (launch, copy, alloc, sync, other) for the
 * daemon's accounting: one array increment, nothing else on the hot path. The session messages
 * (goodbye, notice, ping, stats) are not calls and are not counted. Each call is also timed into
 * the latency histogram (stats.lat_counts, lat_sum_ns): one clock_gettime pair and an increment.
 */
#include "worker.h"

static void wk_h_ping(struct worker *w, uint64_t req, const gp_ping *m)
{
    gp_ping_reply r = {0};
    r.token = m->token;
    WK_REPLY(w, req, gp_ping_reply, &r);
}

static void wk_h_stats(struct worker *w, uint64_t req, const gp_stats *m)
{
    (void)m;
    gp_stats_reply r = {0};
    r.frames = w->stats.frames;
    r.module_bytes_received = w->stats.module_bytes_received;
    r.modules_loaded = w->stats.modules_loaded;
    r.module_cache_hits = w->stats.module_cache_hits;
    r.h2d_bytes = w->stats.h2d_bytes;
    r.d2h_bytes = w->stats.d2h_bytes;
    r.launches = w->stats.launches;
    WK_REPLY(w, req, gp_stats_reply, &r);
}

static void wk_h_goodbye(struct worker *w, uint64_t req, const gp_goodbye *m)
{
    (void)req;
    (void)m;
    wk_log("client said goodbye");
    wk_end_session(w, WK_END_CLIENT_EXIT, "the client said goodbye");
}

static void wk_h_notice(struct worker *w, uint64_t req, const gp_notice *m)
{
    /* A client may tell us things; nothing here depends on them. */
    (void)w;
    (void)req;
    (void)m;
}

/* `info` is gpupoold's (the first frame of a connection, instead of hello): a worker never
 * serves it. Answer so that the client reads why, then close as for any protocol error. */
static void wk_h_info(struct worker *w, uint64_t req, const gp_info *m)
{
    (void)m;
    static const char text[] = "info is answered by gpupoold as the first frame of a connection, "
                               "not by a GPU's worker during a session: open a new connection";
    gp_info_reply r = {0};
    r.result = GP_EPROTO;
    r.major = GP_PROTO_MAJOR;
    r.minor = GP_PROTO_MINOR;
    r.message = text;
    r.message_len = (uint32_t)(sizeof text - 1);
    WK_REPLY(w, req, gp_info_reply, &r);
    wk_protocol_error(w, GP_OP_INFO, "unexpected info message during a session");
}

/* A call that started at t0 (wk_now_ns()) is done: count its latency. No allocation, one clock
 * read and at most 17 comparisons (most calls stop at the first few bounds). */
static void latency_done(struct worker *w, uint64_t t0)
{
    static const uint64_t bounds[WK_LAT_BUCKETS - 1] = WK_LAT_BOUNDS_NS;
    uint64_t t1 = wk_now_ns();
    uint64_t d = t1 > t0 ? t1 - t0 : 0;
    unsigned i = 0;
    while (i < WK_LAT_BUCKETS - 1 && d > bounds[i])
        i++;
    w->stats.lat_counts[i]++;
    w->stats.lat_sum_ns += d;
}

/* Count the frame in its call class, decode the body as message `name_`, call h_<name_>. A call
 * (class_ not WK_CALL_NONE) is timed from here (its body has been read) to the return of its
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
            latency_done(w, t0_);                                                                  \
        return;                                                                                    \
    }

static void dispatch(struct worker *w, const gp_frame_header *h, const uint8_t *body)
{
    if (h->flags & GP_FLAG_REPLY) {
        wk_protocol_error(w, h->op, "the client sent a reply frame (op %u)", h->op);
        return;
    }
    switch (h->op) {
        DISPATCH(GP_OP_GOODBYE, goodbye, WK_CALL_NONE)
        DISPATCH(GP_OP_NOTICE, notice, WK_CALL_NONE)
        DISPATCH(GP_OP_PING, ping, WK_CALL_NONE)
        DISPATCH(GP_OP_STATS, stats, WK_CALL_NONE)
        DISPATCH(GP_OP_INFO, info, WK_CALL_NONE)
        DISPATCH(GP_OP_CTX_CREATE, ctx_create, WK_CALL_OTHER)
        DISPATCH(GP_OP_CTX_DESTROY, ctx_destroy, WK_CALL_OTHER)
        DISPATCH(GP_OP_CTX_SET_CURRENT, ctx_set_current, WK_CALL_OTHER)
        DISPATCH(GP_OP_CTX_SYNCHRONIZE, ctx_synchronize, WK_CALL_SYNC)
        DISPATCH(GP_OP_CTX_SET_LIMIT, ctx_set_limit, WK_CALL_OTHER)
        DISPATCH(GP_OP_CTX_GET_LIMIT, ctx_get_limit, WK_CALL_OTHER)
        DISPATCH(GP_OP_MEM_GET_INFO, mem_get_info, WK_CALL_OTHER)
        DISPATCH(GP_OP_PRIMARY_CTX_RESET, primary_ctx_reset, WK_CALL_OTHER)
        DISPATCH(GP_OP_MEM_ALLOC, mem_alloc, WK_CALL_ALLOC)
        DISPATCH(GP_OP_MEM_FREE, mem_free, WK_CALL_ALLOC)
        DISPATCH(GP_OP_MEMCPY_HTOD, memcpy_htod, WK_CALL_COPY)
        DISPATCH(GP_OP_MEMCPY_DTOH, memcpy_dtoh, WK_CALL_COPY)
        DISPATCH(GP_OP_MEMCPY_DTOD, memcpy_dtod, WK_CALL_COPY)
        DISPATCH(GP_OP_MEMSET, memset, WK_CALL_COPY)
        DISPATCH(GP_OP_MEMSET_2D, memset_2d, WK_CALL_COPY)
        DISPATCH(GP_OP_STREAM_CREATE, stream_create, WK_CALL_OTHER)
        DISPATCH(GP_OP_STREAM_DESTROY, stream_destroy, WK_CALL_OTHER)
        DISPATCH(GP_OP_STREAM_SYNCHRONIZE, stream_synchronize, WK_CALL_SYNC)
        DISPATCH(GP_OP_STREAM_QUERY, stream_query, WK_CALL_SYNC)
        DISPATCH(GP_OP_STREAM_WAIT_EVENT, stream_wait_event, WK_CALL_OTHER)
        DISPATCH(GP_OP_EVENT_CREATE, event_create, WK_CALL_OTHER)
        DISPATCH(GP_OP_EVENT_DESTROY, event_destroy, WK_CALL_OTHER)
        DISPATCH(GP_OP_EVENT_RECORD, event_record, WK_CALL_OTHER)
        DISPATCH(GP_OP_EVENT_QUERY, event_query, WK_CALL_SYNC)
        DISPATCH(GP_OP_EVENT_SYNCHRONIZE, event_synchronize, WK_CALL_SYNC)
        DISPATCH(GP_OP_EVENT_ELAPSED_TIME, event_elapsed_time, WK_CALL_OTHER)
        DISPATCH(GP_OP_MODULE_LOAD, module_load, WK_CALL_OTHER)
        DISPATCH(GP_OP_MODULE_UNLOAD, module_unload, WK_CALL_OTHER)
        DISPATCH(GP_OP_GET_FUNCTION, get_function, WK_CALL_OTHER)
        DISPATCH(GP_OP_GET_GLOBAL, get_global, WK_CALL_OTHER)
        DISPATCH(GP_OP_FUNC_GET_ATTRIBUTE, func_get_attribute, WK_CALL_OTHER)
        DISPATCH(GP_OP_FUNC_SET_ATTRIBUTE, func_set_attribute, WK_CALL_OTHER)
        DISPATCH(GP_OP_OCCUPANCY, occupancy, WK_CALL_OTHER)
        DISPATCH(GP_OP_LAUNCH, launch, WK_CALL_LAUNCH)
        DISPATCH(GP_OP_STREAM_BEGIN_CAPTURE, stream_begin_capture, WK_CALL_OTHER)
        DISPATCH(GP_OP_STREAM_END_CAPTURE, stream_end_capture, WK_CALL_OTHER)
        DISPATCH(GP_OP_GRAPH_INSTANTIATE, graph_instantiate, WK_CALL_OTHER)
        DISPATCH(GP_OP_GRAPH_LAUNCH, graph_launch, WK_CALL_LAUNCH)
        DISPATCH(GP_OP_GRAPH_EXEC_DESTROY, graph_exec_destroy, WK_CALL_OTHER)
        DISPATCH(GP_OP_GRAPH_DESTROY, graph_destroy, WK_CALL_OTHER)
        DISPATCH(GP_OP_GRAPH_GET_NODE_COUNT, graph_get_node_count, WK_CALL_OTHER)
        DISPATCH(GP_OP_VMM_RESERVE, vmm_reserve, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_ADDRESS_FREE, vmm_address_free, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_CREATE, vmm_create, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_RELEASE, vmm_release, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_MAP, vmm_map, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_UNMAP, vmm_unmap, WK_CALL_ALLOC)
        DISPATCH(GP_OP_VMM_SET_ACCESS, vmm_set_access, WK_CALL_ALLOC)
    default:
        /* Known to the spec but not a request the worker takes (a second hello). */
        wk_protocol_error(w, h->op, "unexpected %s message", gp_op_name(h->op));
    }
}

void wk_worker_loop(struct worker *w)
{
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
        /* A client that keeps us busy never lets the loop wait, where stats go out and END,
         * signals and the daemon's departure are seen: look every 1024 frames instead (one
         * clock read and one poll, nothing per frame). */
        if ((++w->stats.frames & 1023) == 0 && (w->ctl.fd >= 0 || w->ctl.listen_fd >= 0) &&
            wk_io_check(w) != 0)
            break;
        w->in_call = 1; /* a copy's bulk is read inside its handler: not idle meanwhile */
        dispatch(w, &h, body);
        w->in_call = 0;
        if (w->out_len >= WK_FLUSH_AT && wk_io_flush(w) != 0)
            break;
    }
    if (w->out_len > 0 && wk_io_flush(w) != 0)
        wk_error("could not send the last replies");
}
