/*
 * loop.c: the frame loop. Each frame is decoded with the generated decoder (a body that does not
 * decode to exactly its length closes the connection) and handed to its handler; the session
 * messages that touch no driver state (ping, stats, goodbye, notice) are answered here.
 */
#include "worker.h"

static void h_ping(struct worker *w, uint64_t req, const gp_ping *m)
{
    gp_ping_reply r = {0};
    r.token = m->token;
    WK_REPLY(w, req, gp_ping_reply, &r);
}

static void h_stats(struct worker *w, uint64_t req, const gp_stats *m)
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

static void h_goodbye(struct worker *w, uint64_t req, const gp_goodbye *m)
{
    (void)req;
    (void)m;
    wlog("client said goodbye");
    w->closing = 1;
}

static void h_notice(struct worker *w, uint64_t req, const gp_notice *m)
{
    /* A client may tell us things; nothing here depends on them. */
    (void)w;
    (void)req;
    (void)m;
}

/* Decode the body as message `name_` and call h_<name_>. */
#define DISPATCH(OP_, name_)                                                                       \
    case OP_: {                                                                                    \
        gp_##name_ msg;                                                                            \
        if (gp_##name_##_decode(body, h->len, &msg) != 0) {                                        \
            protocol_error(w, h->op, "malformed %s message (%u bytes)", #name_, h->len);           \
            return;                                                                                \
        }                                                                                          \
        h_##name_(w, h->req, &msg);                                                                \
        return;                                                                                    \
    }

static void dispatch(struct worker *w, const gp_frame_header *h, const uint8_t *body)
{
    if (h->flags & GP_FLAG_REPLY) {
        protocol_error(w, h->op, "the client sent a reply frame (op %u)", h->op);
        return;
    }
    switch (h->op) {
        DISPATCH(GP_OP_GOODBYE, goodbye)
        DISPATCH(GP_OP_NOTICE, notice)
        DISPATCH(GP_OP_PING, ping)
        DISPATCH(GP_OP_STATS, stats)
        DISPATCH(GP_OP_CTX_CREATE, ctx_create)
        DISPATCH(GP_OP_CTX_DESTROY, ctx_destroy)
        DISPATCH(GP_OP_CTX_SET_CURRENT, ctx_set_current)
        DISPATCH(GP_OP_CTX_SYNCHRONIZE, ctx_synchronize)
        DISPATCH(GP_OP_CTX_SET_LIMIT, ctx_set_limit)
        DISPATCH(GP_OP_CTX_GET_LIMIT, ctx_get_limit)
        DISPATCH(GP_OP_MEM_GET_INFO, mem_get_info)
        DISPATCH(GP_OP_PRIMARY_CTX_RESET, primary_ctx_reset)
        DISPATCH(GP_OP_MEM_ALLOC, mem_alloc)
        DISPATCH(GP_OP_MEM_FREE, mem_free)
        DISPATCH(GP_OP_MEMCPY_HTOD, memcpy_htod)
        DISPATCH(GP_OP_MEMCPY_DTOH, memcpy_dtoh)
        DISPATCH(GP_OP_MEMCPY_DTOD, memcpy_dtod)
        DISPATCH(GP_OP_MEMSET, memset)
        DISPATCH(GP_OP_MEMSET_2D, memset_2d)
        DISPATCH(GP_OP_STREAM_CREATE, stream_create)
        DISPATCH(GP_OP_STREAM_DESTROY, stream_destroy)
        DISPATCH(GP_OP_STREAM_SYNCHRONIZE, stream_synchronize)
        DISPATCH(GP_OP_STREAM_QUERY, stream_query)
        DISPATCH(GP_OP_STREAM_WAIT_EVENT, stream_wait_event)
        DISPATCH(GP_OP_EVENT_CREATE, event_create)
        DISPATCH(GP_OP_EVENT_DESTROY, event_destroy)
        DISPATCH(GP_OP_EVENT_RECORD, event_record)
        DISPATCH(GP_OP_EVENT_QUERY, event_query)
        DISPATCH(GP_OP_EVENT_SYNCHRONIZE, event_synchronize)
        DISPATCH(GP_OP_EVENT_ELAPSED_TIME, event_elapsed_time)
        DISPATCH(GP_OP_MODULE_LOAD, module_load)
        DISPATCH(GP_OP_MODULE_UNLOAD, module_unload)
        DISPATCH(GP_OP_GET_FUNCTION, get_function)
        DISPATCH(GP_OP_GET_GLOBAL, get_global)
        DISPATCH(GP_OP_FUNC_GET_ATTRIBUTE, func_get_attribute)
        DISPATCH(GP_OP_FUNC_SET_ATTRIBUTE, func_set_attribute)
        DISPATCH(GP_OP_OCCUPANCY, occupancy)
        DISPATCH(GP_OP_LAUNCH, launch)
    default:
        /* Known to the spec but not a request the worker takes (a second hello). */
        protocol_error(w, h->op, "unexpected %s message", gp_op_name(h->op));
    }
}

void worker_loop(struct worker *w)
{
    while (!w->closing) {
        gp_frame_header h;
        const uint8_t *body;
        int r = io_next_frame(w, &h, &body);
        if (r == 0) {
            wlog("client closed the connection");
            break;
        }
        if (r < 0)
            break;
        w->stats.frames++;
        dispatch(w, &h, body);
        if (w->out_len >= WK_FLUSH_AT && io_flush(w) != 0)
            break;
    }
    if (w->out_len > 0 && io_flush(w) != 0)
        wlog("could not send the last replies");
}
