/*
 * fuzz_shim_replies: the shim's side of a session with a hostile or broken server: everything
 * client/shim/conn.c does with the bytes a server sends after the hello (frame headers, replies
 * with and without bulk data, LZ4-compressed copy data, notices, deferred errors, replies to
 * requests nobody made), inside every tenant's process.
 *
 * conn.c is included whole, with the files of the connection it calls (its parts table and its
 * start and end: conn_route.c, conn_life.c; the streams in and out,
 * the keepalive clock, the pending error, the request ids), so that their private state can
 * be set up per input: the connection
 * is declared ready on a socket whose other end carries the input, four callers wait for
 * replies 1 to 4 (4 KiB buffers for bulk data) and two detached copies wait for 5 and 6; then
 * the reader loop runs until the stream ends or breaks, and the failure path completes and
 * frees every waiter. Byte 0 of the input is a mode (bit 0: LZ4 copies negotiated), the rest is
 * the server's stream.
 */
#include "conn.c"
#include "conn_life.c"
#include "conn_read.c"
#include "conn_route.c"
#include "conn_write.c"
#include "fuzz_feed.h"
#include "keepalive.c"
#include "pending.c"
#include "request_ids.c"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* conn.c's neighbours that this target never reaches (the connection is set up by hand: one
 * part, so no call is routed by its context and no context id is rewritten). */
CUresult gp_connect_parts(gp_part_link *parts, int cap, int *nparts)
{
    (void)parts;
    (void)cap;
    *nparts = 0;
    return CUDA_ERROR_NO_DEVICE;
}

gp_ctx_obj *gp_ctx_obj_get(uint64_t h)
{
    (void)h;
    return NULL;
}

int gp_vamap_find(uint64_t addr, gp_range *out) /* conn_route.c: no ranges here */
{
    (void)addr;
    (void)out;
    return -1;
}

int gp_primary_index(uint64_t h)
{
    (void)h;
    return -1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    setenv("GPUPOOL_LOG", "quiet", 1);
    gp_conn_process.rs.buf = malloc(GP_READ_BUF_SIZE);
    gp_conn_process.rs.quiet = gp_conn_silence_check; /* as conn_start sets it */
    if (!gp_conn_process.rs.buf || signal(SIGPIPE, SIG_IGN) == SIG_ERR)
        abort();
    return 0;
}

#define CALLERS 4
#define DETACHED 2
#define BUF 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        abort();
    /* A fresh connection state, as gp_conn_ensure leaves it. */
    gp_conn *c = &gp_conn_process;
    c->sock = c->rs.sock = c->ws.sock = sv[1];
    atomic_store(&c->state, ST_READY);
    atomic_store(&c->dead, 0);
    atomic_store(&c->lz4_on, data[0] & 1);
    atomic_store(&c->ka.on, 0);
    atomic_store(&pending_error, 0);
    notice_count = 0;
    c->rs.pos = c->rs.len = 0;
    c->reader = RD_NONE;

    static gp_waiter callers[CALLERS];
    static uint8_t dst[CALLERS + DETACHED][BUF];
    for (int i = 0; i < CALLERS; i++) {
        callers[i] = (gp_waiter){.req = (uint64_t)i + 1, .dst = dst[i], .cap = BUF};
        if (pthread_cond_init(&callers[i].cv, NULL) != 0 || waiter_add(c, &callers[i]) != 0)
            abort();
    }
    for (int i = 0; i < DETACHED; i++) {
        gp_waiter *d = calloc(1, sizeof *d);
        if (!d)
            abort();
        *d = (gp_waiter){
            .req = (uint64_t)(CALLERS + i) + 1, .detached = 1, .dst = dst[CALLERS + i], .cap = BUF};
        if (waiter_add(c, d) != 0)
            abort();
    }

    struct fuzz_feed feed;
    fuzz_feed_start(&feed, sv[0], data + 1, size - 1); /* the server's side */
    const char *why = "end of the input";
    c->reader = RD_CALLER;
    while (read_frame(c, &why) == 0)
        ;
    c->reader = RD_NONE;
    atomic_store(&c->state, ST_CLOSED); /* the loss without its line on stderr for each input */
    conn_fail(c, "%s", why);            /* completes the callers, frees the detached waiters */

    fuzz_feed_join(&feed);
    for (int i = 0; i < CALLERS; i++) {
        if (!callers[i].done)
            abort(); /* every caller is completed, with its reply or the loss */
        free(callers[i].body);
        if (pthread_cond_destroy(&callers[i].cv) != 0)
            abort();
    }
    if (c->wait_head != NULL || c->detached_count != 0)
        abort(); /* nothing left waiting */
    if (close(sv[0]) != 0 || close(sv[1]) != 0)
        abort();
    c->sock = c->rs.sock = c->ws.sock = -1;
    return 0;
}
