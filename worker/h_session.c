/*
 * h_session.c: the session messages the worker answers that touch no driver state (ping, stats,
 * op_times, goodbye, notice, and info, which belongs to gpupoold). They are not CUDA calls: their
 * call_class in protocol/gpupool.toml is "none", so the loop does not count or time them.
 */
#include "worker.h"

WK_HANDLER(ping)
{
    gp_ping_reply r = {0};
    r.token = m->token;
    WK_REPLY(w, req, gp_ping_reply, &r);
}

WK_HANDLER(stats)
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

/* The per-op timings of the loop (loop.c), for the client's profile (GPUPOOL_PROFILE). */
WK_HANDLER(op_times)
{
    (void)m;
    uint8_t calls[256 * 8], ns[256 * 8];
    for (unsigned op = 0; op < 256; op++) {
        gp_wr_u64(calls + 8 * op, w->stats.op_calls[op]);
        gp_wr_u64(ns + 8 * op, w->stats.op_ns[op]);
    }
    gp_op_times_reply r = {0};
    r.calls = calls;
    r.calls_count = 256;
    r.ns = ns;
    r.ns_count = 256;
    WK_REPLY(w, req, gp_op_times_reply, &r);
}

WK_HANDLER(goodbye)
{
    (void)req;
    (void)m;
    wk_log("client said goodbye");
    wk_end_session(w, WK_END_CLIENT_EXIT, "the client said goodbye");
}

WK_HANDLER(notice)
{
    /* A client may tell us things; nothing here depends on them. */
    (void)w;
    (void)req;
    (void)m;
}

/* `info` is gpupoold's (the first frame of a connection, instead of hello): a worker never
 * serves it. Answer so that the client reads why, then close as for any protocol error. */
WK_HANDLER(info)
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

/* `peer_hello` is gpupoold's too (the first frame of a connection from another server of the
 * fleet): a worker never serves it; answered and closed as info is. */
WK_HANDLER(peer_hello)
{
    (void)m;
    static const char text[] = "peer_hello is answered by gpupoold as the first frame of a "
                               "connection, not by a GPU's worker during a session";
    gp_peer_hello_reply r = {0};
    r.result = GP_EPROTO;
    r.message = text;
    r.message_len = (uint32_t)(sizeof text - 1);
    WK_REPLY(w, req, gp_peer_hello_reply, &r);
    wk_protocol_error(w, GP_OP_PEER_HELLO, "unexpected peer_hello message during a session");
}
