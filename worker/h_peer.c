/*
 * h_peer.c: server-to-server copies of a spread lease (issue 37, item 3; docs/multi-gpu.md,
 * "Across servers"; docs/protocol.md, "Server-to-server links"): this worker is one end of links
 * to the workers of the lease's other parts, and a peer copy streams from the source part's
 * worker straight to the destination part's, instead of through the client.
 *
 * The worker makes no connection itself (Landlock forbids it, and it holds no identity): for
 * peer_link it asks gpupoold (worker_peer_connect / worker_peer_accept), which opens and
 * authenticates the connection between the two servers and hands over the plain socket; the
 * link's own records (peer_link.c) are sealed under the key the client gave both workers, and
 * the sender's first record (HELLO with the link id) proves to the receiver that it holds it.
 *
 * A copy holds the worker for its whole length, as any synchronous copy does; the client hears
 * keepalives meanwhile (heartbeat.c: the copy runs as one long call, the client socket
 * untouched). Device memory goes through the staging buffers (h_copy.c) in the current
 * context, which the client set to the address's device's primary context, on a stream of our
 * own (CU_STREAM_NON_BLOCKING, one per context, made at its first peer copy): the legacy NULL
 * stream would wait for every blocking stream of the context, and a long kernel of the program
 * would then pass for the link's silence. The client orders the copy after its own stream.
 * Any failure of a copy closes the link (the other end fails too, by an ABORT with the sender's
 * words, the link's end or its silence); the client then copies through itself or fails the copy
 * (its spread_copy mode), so our words say what happened, never what the client does.
 */
#include <errno.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "peer_link.h"
#include "worker.h"

#define MAX_LINKS 64   /* one per ordered pair of parts, and a spread lease has few parts */
#define MAX_STREAMS 16 /* contexts with a stream for peer copies (primaries: one per device) */
/* gpupoold's worst case for a connect: its TCP connect (5 s), then TLS and the peer_hello, which
 * the other server answers only once its own worker asked to accept the link (it waits up to
 * PEER_ACCEPT_WAIT_S, 10 s); an accept waits at most that 10 s. 20 s covers both with a margin,
 * under the client's 30 s server timeout (no keepalive goes out during this wait). */
#define ANSWER_TIMEOUT_MS 20000
#define HELLO_TIMEOUT_MS 10000 /* the sender's first record, once the socket is here */
#define SILENCE_MS 30000       /* the longest a whole record may take (GPUPOOL_WORKER_PEER_...) */
#define ABORT_TIMEOUT_MS 2000  /* telling the receiver about a failure: best effort */
/* What the kernel's buffers of both ends of a link hold at most before the receiver reads: the
 * sender's records that start below this offset of a copy may wait as long as the receiver waits
 * for a copy to start (copy_wait_ms), as the receiving worker may first finish another thread's
 * long call; beyond, the receiver is reading, and each record has the silence limit. */
#define PATIENT_BYTES ((uint64_t)16 << 20)
#define ABORT_WORDS_MAX 512 /* the sender's reason in an ABORT record */

struct link {
    uint64_t id; /* 0: a free slot */
    uint32_t role, peer_part;
    struct wk_peer_end end;
};

/* The stream of a context for peer copies: made at its first copy, destroyed with the context
 * (wk_peer_ctx_gone) or at the session's end. */
struct ctx_stream {
    uint64_t ctx; /* the context's client id (w->cur_ctx) */
    CUstream s;   /* NULL: a free slot */
};

struct wk_peer_links {
    struct link l[MAX_LINKS];
    struct ctx_stream streams[MAX_STREAMS];
    uint8_t *rec; /* one whole record (WK_PEER_BUF bytes): sealed or opened in place */
};

/* The longest a whole record of the link may take (its silence limit): 30 s, or
 * GPUPOOL_WORKER_PEER_SILENCE_MS (1..600000), a knob for the tests (worker/README.md). */
static int silence_ms(void)
{
    const char *v = getenv("GPUPOOL_WORKER_PEER_SILENCE_MS");
    if (!v || !*v)
        return SILENCE_MS;
    char *end;
    errno = 0;
    long ms = strtol(v, &end, 10);
    if (errno != 0 || *end != '\0' || ms < 1 || ms > 600000) {
        wk_warn("GPUPOOL_WORKER_PEER_SILENCE_MS=%s is not 1..600000 ms; using %d", v, SILENCE_MS);
        return SILENCE_MS;
    }
    return (int)ms;
}

/* The longest the receiver waits for a copy's COPY record: the sending worker may first finish
 * another thread's long synchronous call (its frames are handled in order), which is no silence
 * of the link; its DATA records then keep the per-record limit. */
static int copy_wait_ms(void)
{
    return 10 * silence_ms();
}

static struct wk_peer_links *table(struct worker *w)
{
    if (!w->peer_links) {
        struct wk_peer_links *t = calloc(1, sizeof *t);
        if (!t)
            return NULL;
        t->rec = malloc(WK_PEER_BUF);
        if (!t->rec) {
            free(t);
            return NULL;
        }
        for (int i = 0; i < MAX_LINKS; i++)
            t->l[i].end.fd = -1;
        w->peer_links = t;
    }
    return w->peer_links;
}

static struct link *find(struct worker *w, uint64_t id)
{
    for (int i = 0; w->peer_links && id != 0 && i < MAX_LINKS; i++)
        if (w->peer_links->l[i].id == id)
            return &w->peer_links->l[i];
    return NULL;
}

/* Closes a link: its socket, its cipher (the key schedule cleared), and the record buffer (the
 * last record's plaintext: the tenant's data). */
static void link_close(struct worker *w, struct link *l)
{
    if (l->id != 0 && w->peer_links_open > 0)
        w->peer_links_open--;
    wk_peer_end_close(&l->end);
    memset(l, 0, sizeof *l);
    l->end.fd = -1;
    OPENSSL_cleanse(w->peer_links->rec, WK_PEER_BUF);
}

void wk_peer_ctx_gone(struct worker *w, uint64_t ctx_id, int all)
{
    struct wk_peer_links *t = w->peer_links;
    for (int i = 0; t && i < MAX_STREAMS; i++) {
        struct ctx_stream *c = &t->streams[i];
        if (!c->s || (!all && c->ctx != ctx_id))
            continue;
        CUresult rc = DRV(w, cuStreamDestroy, c->s);
        if (rc != CUDA_SUCCESS)
            wk_warn("destroying the stream of peer copies: %s", wk_err_name(w, rc));
        c->s = NULL;
        c->ctx = 0;
    }
}

/* The current context's stream for peer copies, made now if it has none. */
static CUresult copy_stream(struct worker *w, CUstream *s, char *err, size_t errlen)
{
    struct wk_peer_links *t = w->peer_links;
    struct ctx_stream *slot = NULL;
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (t->streams[i].s && t->streams[i].ctx == w->cur_ctx) {
            *s = t->streams[i].s;
            return CUDA_SUCCESS;
        }
        if (!t->streams[i].s && !slot)
            slot = &t->streams[i];
    }
    if (!slot) { /* more contexts than slots: the last one's stream goes */
        slot = &t->streams[MAX_STREAMS - 1];
        wk_peer_ctx_gone(w, slot->ctx, 0);
    }
    CUresult rc = DRV(w, cuStreamCreateWithPriority, &slot->s, CU_STREAM_NON_BLOCKING, 0);
    if (rc != CUDA_SUCCESS) {
        slot->s = NULL;
        snprintf(err, errlen, "creating a stream for the copy failed (%s)", wk_err_name(w, rc));
        return rc;
    }
    slot->ctx = w->cur_ctx;
    *s = slot->s;
    return CUDA_SUCCESS;
}

void wk_peer_close_all(struct worker *w)
{
    struct wk_peer_links *t = w->peer_links;
    if (!t)
        return;
    for (int i = 0; i < MAX_LINKS; i++)
        if (t->l[i].id != 0)
            link_close(w, &t->l[i]);
    wk_peer_ctx_gone(w, 0, 1);
    OPENSSL_cleanse(t->rec, WK_PEER_BUF); /* the last record's plaintext: the tenant's data */
    free(t->rec);
    free(t);
    w->peer_links = NULL;
}

/* A long wait on the link: the client hears keepalives meanwhile. Replies already queued go out
 * first: while the keepalive thread may write, the main thread leaves the client socket alone. */
static int long_begin(struct worker *w)
{
    if (w->out_len > 0 && wk_io_flush(w) != 0)
        return -1;
    hb_enter(w);
    return 0;
}

static void long_end(struct worker *w)
{
    (void)hb_leave(w, CUDA_SUCCESS);
}

/* ============================================================================ making a link == */

/* gpupoold's answer to our worker_peer_connect/accept for link `id`: 0 with the socket in *fd,
 * or the CUresult with err. Answers name their link, so a late answer for an earlier link (its
 * wait timed out) is dropped, its socket closed. */
static CUresult await_socket(struct worker *w, int sending, uint64_t id, int *fd, char *err,
                             size_t errlen)
{
    unsigned op = sending ? GP_OP_WORKER_PEER_CONNECTED : GP_OP_WORKER_PEER_ACCEPTED;
    uint8_t buf[WK_CTL_MAX + 1];
    for (;;) {
        int timed_out = 0;
        ssize_t n = wk_ctl_wait_answer(w, op, buf, WK_CTL_MAX, fd, ANSWER_TIMEOUT_MS, &timed_out,
                                       err, errlen);
        if (n < 0) {
            if (timed_out) {
                snprintf(err, errlen,
                         "gpupoold did not %s the server-to-server link in %d s: see its log",
                         sending ? "connect" : "accept", ANSWER_TIMEOUT_MS / 1000);
            } else {
                char why[256];
                snprintf(why, sizeof why, "%s", err);
                snprintf(err, errlen, "no server-to-server link: %s", why);
            }
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        const uint8_t *body = buf + GP_PROTO_HEADER_SIZE;
        size_t len = (size_t)n - GP_PROTO_HEADER_SIZE;
        uint64_t link_id, session_id;
        int32_t code;
        const char *text;
        uint32_t text_len;
        int bad;
        if (sending) {
            gp_worker_peer_connected a;
            bad = gp_worker_peer_connected_decode(body, len, &a);
            link_id = a.link_id, session_id = a.session_id, code = a.code, text = a.error;
            text_len = a.error_len;
        } else {
            gp_worker_peer_accepted a;
            bad = gp_worker_peer_accepted_decode(body, len, &a);
            link_id = a.link_id, session_id = a.session_id, code = a.code, text = a.error;
            text_len = a.error_len;
        }
        if (!bad && (link_id != id || session_id != w->ctl.session_id)) {
            wk_log("dropping gpupoold's answer for link 0x%llx of session %llu (late, or not "
                   "this session's)",
                   (unsigned long long)link_id, (unsigned long long)session_id);
            if (*fd >= 0 && close(*fd) != 0)
                wk_warn("close: %s", strerror(errno));
            *fd = -1;
            continue;
        }
        if (bad) {
            snprintf(err, errlen, "gpupoold's answer to a server-to-server link was unreadable");
            code = CUDA_ERROR_UNKNOWN;
        } else if (code != 0) {
            snprintf(err, errlen, "%.*s", (int)text_len, text);
            if (!*err)
                snprintf(err, errlen, "gpupoold refused the server-to-server link");
        } else if (*fd < 0) {
            snprintf(err, errlen, "gpupoold's answer came without the link's socket");
            code = CUDA_ERROR_UNKNOWN;
        }
        if (code != 0 && *fd >= 0) {
            if (close(*fd) != 0)
                wk_warn("close: %s", strerror(errno));
            *fd = -1;
        }
        return (CUresult)code;
    }
}

/* The receiving end: the sender's first record, HELLO with our link id. 0, or -1 with err. */
static int read_hello(struct worker *w, struct link *l, char *err, size_t errlen)
{
    uint8_t *p;
    size_t n;
    if (long_begin(w) != 0) {
        snprintf(err, errlen, "the client connection is gone");
        return -1;
    }
    int r = wk_peer_read(&l->end, w->peer_links->rec, HELLO_TIMEOUT_MS, &p, &n, err, errlen);
    long_end(w);
    if (r != 0)
        return -1;
    if (n != 9 || p[0] != WK_PEER_HELLO || wk_peer_get64(p + 1) != l->id) {
        snprintf(err, errlen,
                 "the link's first record was not the hello of link 0x%llx (the other worker "
                 "is not this link's other end)",
                 (unsigned long long)l->id);
        return -1;
    }
    return 0;
}

static CUresult link_make(struct worker *w, const gp_peer_link *m, char *err, size_t errlen)
{
    if (m->role != GP_PEER_SEND && m->role != GP_PEER_RECV) {
        snprintf(err, errlen, "peer_link role %u is neither GP_PEER_SEND (0) nor GP_PEER_RECV (1)",
                 m->role);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (m->link_id == 0) {
        snprintf(err, errlen, "link id 0 is not a valid link id");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (w->ctl.fd < 0 || w->ctl.gone || !w->ctl.in_session) {
        snprintf(err, errlen,
                 "server-to-server links need gpupoold to connect the servers, and this session "
                 "has none now (its worker was started by hand or its daemon is gone)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!table(w)) {
        snprintf(err, errlen, "out of memory for the server-to-server links");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (find(w, m->link_id)) {
        snprintf(err, errlen, "link id 0x%llx is in use in this process: pick another",
                 (unsigned long long)m->link_id);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct link *l = NULL;
    for (int i = 0; i < MAX_LINKS && !l; i++)
        if (w->peer_links->l[i].id == 0)
            l = &w->peer_links->l[i];
    if (!l) {
        snprintf(err, errlen,
                 "this worker holds %d server-to-server links already (peer_unlink some)",
                 MAX_LINKS);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    int sending = m->role == GP_PEER_SEND;
    size_t n;
    if (sending) {
        gp_worker_peer_connect c = {
            .session_id = w->ctl.session_id, .link_id = m->link_id, .to_part = m->peer_part};
        n = WK_CTL_ENCODE(w, worker_peer_connect, &c);
    } else {
        gp_worker_peer_accept c = {
            .session_id = w->ctl.session_id, .link_id = m->link_id, .from_part = m->peer_part};
        n = WK_CTL_ENCODE(w, worker_peer_accept, &c);
    }
    if (wk_ctl_send(w, n, 0) != 0) {
        snprintf(err, errlen, "the worker could not reach gpupoold (see its log)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    int fd = -1;
    CUresult rc = await_socket(w, sending, m->link_id, &fd, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (wk_peer_end_open(&l->end, fd, sending, m->key, silence_ms(), err, errlen) != 0)
        return CUDA_ERROR_NOT_SUPPORTED; /* fd closed */
    l->id = m->link_id;
    w->peer_links_open++; /* link_close counts it down */
    l->role = m->role;
    l->peer_part = m->peer_part;
    int r;
    if (sending) {
        uint8_t hello[8];
        wk_peer_put64(hello, l->id);
        r = wk_peer_write(&l->end, WK_PEER_HELLO, hello, sizeof hello, NULL, 0, w->peer_links->rec,
                          silence_ms(), err, errlen);
    } else {
        r = read_hello(w, l, err, errlen);
    }
    if (r != 0) {
        link_close(w, l);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
}

/* The key's copy in the frame body, in the worker's input buffer (the dispatcher decodes in
 * place, and the body stays there until later frames overwrite it): cleared before anything
 * else happens. The frame is the one just read, whole, right before w->in_pos. */
static void cleanse_frame_key(struct worker *w, const gp_peer_link *m)
{
    size_t body = gp_peer_link_size(m), at = 8; /* u64 link_id, then the key */
    if (w->in_pos < body || memcmp(w->in + w->in_pos - body + at, m->key, sizeof m->key) != 0) {
        wk_warn("peer_link: the key's copy in the input buffer was not where expected");
        return;
    }
    OPENSSL_cleanse(w->in + w->in_pos - body + at, sizeof m->key);
}

WK_HANDLER(peer_link)
{
    gp_peer_link_reply r = {0};
    char err[1024] = "", text[1024];
    cleanse_frame_key(w, m);
    r.code = link_make(w, m, err, sizeof err);
    /* The decoded message is the dispatcher's own (non-const) copy: its key goes now. What holds
     * the key from here: the link's cipher (until the link closes) and, where the client
     * connection is TLS, OpenSSL's record buffer of that connection until later records
     * overwrite it (docs/security.md). */
    OPENSSL_cleanse((void *)m->key, sizeof m->key);
    if (r.code != CUDA_SUCCESS)
        wk_log("peer_link 0x%llx (%s, part %u): %s", (unsigned long long)m->link_id,
               m->role == GP_PEER_SEND ? "send" : "receive", m->peer_part, err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_peer_link_reply, &r);
}

WK_HANDLER(peer_unlink)
{
    (void)req;
    struct link *l = find(w, m->link_id);
    if (l)
        link_close(w, l);
}

/* ================================================================================= copies == */

/* The link of a copy: known and of the right role, else NULL with err. */
static struct link *copy_link(struct worker *w, uint64_t id, uint32_t role, char *err,
                              size_t errlen)
{
    struct link *l = find(w, id);
    if (!l) {
        snprintf(err, errlen,
                 "no server-to-server link 0x%llx in this worker (never made, unlinked, or "
                 "closed after a failure): make a new one",
                 (unsigned long long)id);
    } else if (l->role != role) {
        snprintf(err, errlen, "link 0x%llx is this worker's %s end: it cannot %s",
                 (unsigned long long)id, l->role == GP_PEER_SEND ? "sending" : "receiving",
                 role == GP_PEER_SEND ? "send" : "receive");
        l = NULL;
    }
    return l;
}

/* A copy on the wrong end of a link (the client's ends crossed): the link closes, as after any
 * failed copy, so the other end's copy fails at once with the link's end instead of waiting
 * for its silence limit. */
static void close_misused(struct worker *w, uint64_t id)
{
    struct link *l = find(w, id);
    if (l)
        link_close(w, l);
}

/* A copy's range: size > 0, no larger than any device range (the memcpy handlers' limit), no
 * wrap. Checked on both ends before the link carries anything of the copy. */
static CUresult check_range(struct worker *w, uint64_t addr, uint64_t size, char *err,
                            size_t errlen)
{
    if (size == 0) {
        snprintf(err, errlen, "a peer copy of 0 bytes (the client sends none)");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (size > wk_copy_limit(w)) {
        snprintf(err, errlen,
                 "a peer copy of %llu bytes is larger than any device range (%llu bytes at most)",
                 (unsigned long long)size, (unsigned long long)wk_copy_limit(w));
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (size > UINT64_MAX - addr) {
        snprintf(err, errlen, "0x%llx + %llu bytes is no device range", (unsigned long long)addr,
                 (unsigned long long)size);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* Both staging buffers ready and free (an earlier asynchronous copy may still use them). */
static CUresult staging_take(struct worker *w, char *err, size_t errlen)
{
    if (wk_staging_ready(w) != 0) {
        snprintf(err, errlen, "out of host memory for the copy's staging buffers");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = wk_staging_wait(w, 0), rc1 = wk_staging_wait(w, 1);
    if (rc == CUDA_SUCCESS)
        rc = rc1;
    if (rc != CUDA_SUCCESS)
        snprintf(err, errlen, "an earlier copy failed (%s)", wk_err_name(w, rc));
    return rc;
}

/* Tells the receiver that this copy fails, with the code and our words (best effort: the link
 * closes right after, and the receiver sees that end at the latest). */
static void send_abort(struct worker *w, struct link *l, CUresult rc, const char *why)
{
    uint8_t code[4];
    for (int b = 0; b < 4; b++)
        code[b] = (uint8_t)((uint32_t)rc >> (8 * b));
    size_t n = strnlen(why, ABORT_WORDS_MAX);
    char ignored[256];
    if (wk_peer_write(&l->end, WK_PEER_ABORT, code, 4, why, n, w->peer_links->rec, ABORT_TIMEOUT_MS,
                      ignored, sizeof ignored) != 0)
        wk_log("telling the receiving worker about the failed copy: %s", ignored);
}

/* The sending end: COPY, then the memory as DATA records. Chunk k+1 is read from the device
 * into one staging buffer while chunk k is sealed and written from the other. A device error
 * sends ABORT with its code. */
static CUresult send_copy(struct worker *w, struct link *l, const gp_peer_send *m, char *err,
                          size_t errlen)
{
    uint8_t *rec = w->peer_links->rec;
    int limit = silence_ms();
    CUstream st = NULL;
    CUresult rc = check_range(w, m->src, m->size, err, errlen);
    if (rc == CUDA_SUCCESS)
        rc = staging_take(w, err, errlen);
    if (rc == CUDA_SUCCESS)
        rc = copy_stream(w, &st, err, errlen);
    uint8_t head[16];
    wk_peer_put64(head, m->copy_id);
    wk_peer_put64(head + 8, m->size);
    if (rc == CUDA_SUCCESS &&
        wk_peer_write(&l->end, WK_PEER_COPY, head, 16, NULL, 0, rec, copy_wait_ms(), err, errlen))
        return CUDA_ERROR_NOT_SUPPORTED;
    CUresult queued[2] = {CUDA_SUCCESS, CUDA_SUCCESS};
    uint64_t off = 0;
    int i = 0;
    if (rc == CUDA_SUCCESS) {
        size_t first = m->size < WK_CHUNK ? (size_t)m->size : WK_CHUNK;
        queued[0] = DRV_BUSY(w, cuMemcpyDtoHAsync, w->st.buf[0], m->src, first, st);
        if (queued[0] == CUDA_SUCCESS)
            queued[0] = wk_staging_mark(w, 0, st);
    }
    while (rc == CUDA_SUCCESS && off < m->size) {
        size_t len = m->size - off < WK_CHUNK ? (size_t)(m->size - off) : WK_CHUNK;
        CUresult done = wk_staging_wait(w, i);
        rc = queued[i] != CUDA_SUCCESS ? queued[i] : done;
        if (rc != CUDA_SUCCESS) {
            snprintf(err, errlen, "reading %zu bytes of device memory at 0x%llx failed (%s)", len,
                     (unsigned long long)(m->src + off), wk_err_name(w, rc));
            break;
        }
        uint64_t next = off + len;
        if (next < m->size) {
            size_t nlen = m->size - next < WK_CHUNK ? (size_t)(m->size - next) : WK_CHUNK;
            queued[i ^ 1] =
                DRV_BUSY(w, cuMemcpyDtoHAsync, w->st.buf[i ^ 1], m->src + next, nlen, st);
            if (queued[i ^ 1] == CUDA_SUCCESS)
                queued[i ^ 1] = wk_staging_mark(w, i ^ 1, st);
        }
        const uint8_t *src = w->st.buf[i];
        for (size_t k = 0; k < len; k += WK_PEER_DATA_MAX) {
            size_t dn = len - k < WK_PEER_DATA_MAX ? len - k : WK_PEER_DATA_MAX;
            int patient = off + k < PATIENT_BYTES;
            if (wk_peer_write(&l->end, WK_PEER_DATA, NULL, 0, src + k, dn, rec,
                              patient ? copy_wait_ms() : limit, err, errlen) != 0) {
                (void)wk_staging_wait(w, i ^ 1); /* never leave a copy running into a buffer */
                return CUDA_ERROR_NOT_SUPPORTED;
            }
        }
        off = next;
        i ^= 1;
    }
    if (rc != CUDA_SUCCESS) {
        (void)wk_staging_wait(w, 0);
        (void)wk_staging_wait(w, 1);
        send_abort(w, l, rc, err);
        return rc;
    }
    w->stats.d2h_bytes += m->size; /* device memory that left for the network */
    return CUDA_SUCCESS;
}

/* An ABORT record: i32 code, then the sender's words (at most ABORT_WORDS_MAX bytes). */
static int is_abort(const uint8_t *p, size_t n)
{
    return p[0] == WK_PEER_ABORT && n >= 5 && n - 5 <= ABORT_WORDS_MAX;
}

/* An ABORT record's code (never 0), with err giving the sender's words. */
static CUresult aborted(struct worker *w, const uint8_t *p, size_t n, char *err, size_t errlen)
{
    int32_t code = (int32_t)((uint32_t)p[1] | (uint32_t)p[2] << 8 | (uint32_t)p[3] << 16 |
                             (uint32_t)p[4] << 24);
    CUresult rc = code != 0 ? (CUresult)code : CUDA_ERROR_UNKNOWN;
    char words[ABORT_WORDS_MAX + 1];
    size_t k = 0;
    for (size_t j = 5; j < n; j++) /* the other worker's text: printable bytes only */
        words[k++] = p[j] >= 0x20 && p[j] < 0x7f ? (char)p[j] : '?';
    words[k] = '\0';
    snprintf(err, errlen, "the sending worker could not send the copy (%s): %s", wk_err_name(w, rc),
             k > 0 ? words : "its own reply says why");
    return rc;
}

/* The next record of the copy: DATA (its bytes in *data, *dn) or a failure (ABORT, anything
 * else, the link's end or silence) with err. */
static CUresult next_data(struct worker *w, struct link *l, uint64_t left, const uint8_t **data,
                          size_t *dn, char *err, size_t errlen)
{
    uint8_t *p;
    size_t n;
    if (wk_peer_read(&l->end, w->peer_links->rec, silence_ms(), &p, &n, err, errlen) != 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (is_abort(p, n))
        return aborted(w, p, n, err, errlen);
    if (p[0] != WK_PEER_DATA || n < 2 || n - 1 > WK_PEER_DATA_MAX || n - 1 > left) {
        snprintf(err, errlen,
                 "the link carried a record of kind %u and %zu bytes where the copy's next "
                 "bytes (%llu left) were due",
                 p[0], n, (unsigned long long)left);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    *data = p + 1;
    *dn = n - 1;
    return CUDA_SUCCESS;
}

/* Queues the fill bytes of staging buffer i to the device at dst. */
static CUresult put_chunk(struct worker *w, CUstream st, int i, uint64_t dst, size_t fill,
                          char *err, size_t errlen)
{
    CUresult rc = DRV_BUSY(w, cuMemcpyHtoDAsync, dst, w->st.buf[i], fill, st);
    if (rc == CUDA_SUCCESS)
        rc = wk_staging_mark(w, i, st);
    if (rc != CUDA_SUCCESS)
        snprintf(err, errlen, "writing %zu bytes of device memory at 0x%llx failed (%s)", fill,
                 (unsigned long long)dst, wk_err_name(w, rc));
    return rc;
}

/* The receiving end: COPY must name this copy, then DATA records fill one staging buffer while
 * the other goes to the device. */
static CUresult recv_copy(struct worker *w, struct link *l, const gp_peer_recv *m, char *err,
                          size_t errlen)
{
    CUstream st = NULL;
    CUresult rc = check_range(w, m->dst, m->size, err, errlen);
    if (rc == CUDA_SUCCESS)
        rc = staging_take(w, err, errlen);
    if (rc == CUDA_SUCCESS)
        rc = copy_stream(w, &st, err, errlen);
    if (rc != CUDA_SUCCESS)
        return rc;
    uint8_t *p;
    size_t n;
    if (wk_peer_read(&l->end, w->peer_links->rec, copy_wait_ms(), &p, &n, err, errlen) != 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (is_abort(p, n))
        return aborted(w, p, n, err, errlen);
    if (p[0] != WK_PEER_COPY || n != 17 || wk_peer_get64(p + 1) != m->copy_id ||
        wk_peer_get64(p + 9) != m->size) {
        snprintf(err, errlen,
                 "the sending worker started another copy than copy %llu of %llu bytes (%s %llu "
                 "of %llu bytes): the two ends of the link are out of step",
                 (unsigned long long)m->copy_id, (unsigned long long)m->size,
                 p[0] == WK_PEER_COPY && n == 17 ? "copy" : "a record of another kind, as",
                 n == 17 ? (unsigned long long)wk_peer_get64(p + 1) : 0ull,
                 n == 17 ? (unsigned long long)wk_peer_get64(p + 9) : 0ull);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    uint64_t off = 0; /* bytes received */
    size_t fill = 0;  /* of them, in staging buffer i and not yet on the device */
    int i = 0;
    while (rc == CUDA_SUCCESS && off < m->size) {
        const uint8_t *data = NULL;
        size_t dn = 0;
        rc = next_data(w, l, m->size - off, &data, &dn, err, errlen);
        if (rc != CUDA_SUCCESS)
            break;
        if (fill + dn > WK_CHUNK) { /* a buffer full: to the device, and take the other */
            rc = put_chunk(w, st, i, m->dst + off - fill, fill, err, errlen);
            i ^= 1;
            fill = 0;
            CUresult done = wk_staging_wait(w, i);
            if (rc == CUDA_SUCCESS && done != CUDA_SUCCESS) {
                rc = done;
                snprintf(err, errlen, "writing device memory failed (%s)", wk_err_name(w, rc));
            }
            if (rc != CUDA_SUCCESS)
                break;
        }
        memcpy((uint8_t *)w->st.buf[i] + fill, data, dn);
        fill += dn;
        off += dn;
    }
    if (rc == CUDA_SUCCESS && fill > 0)
        rc = put_chunk(w, st, i, m->dst + off - fill, fill, err, errlen);
    CUresult done = wk_staging_wait(w, 0), done1 = wk_staging_wait(w, 1);
    if (rc == CUDA_SUCCESS && (done != CUDA_SUCCESS || done1 != CUDA_SUCCESS)) {
        rc = done != CUDA_SUCCESS ? done : done1;
        snprintf(err, errlen, "writing device memory failed (%s)", wk_err_name(w, rc));
    }
    if (rc == CUDA_SUCCESS)
        w->stats.h2d_bytes += m->size; /* device memory that came from the network */
    return rc;
}

WK_HANDLER(peer_send)
{
    gp_peer_send_reply r = {0};
    char err[1024] = "", text[1024];
    struct link *l = copy_link(w, m->link_id, GP_PEER_SEND, err, sizeof err);
    if (!l) {
        r.code = CUDA_ERROR_INVALID_VALUE;
        close_misused(w, m->link_id); /* the receiver then fails at once, not at its limit */
    } else if (long_begin(w) != 0) {
        return; /* the client is gone: no reply to write */
    } else {
        r.code = send_copy(w, l, m, err, sizeof err);
        long_end(w);
        if (r.code != CUDA_SUCCESS)
            link_close(w, l); /* the receiver sees its end (or the ABORT before it) */
    }
    if (r.code != CUDA_SUCCESS)
        wk_log("peer_send 0x%llx copy %llu: %s", (unsigned long long)m->link_id,
               (unsigned long long)m->copy_id, err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_peer_send_reply, &r);
}

WK_HANDLER(peer_recv)
{
    gp_peer_recv_reply r = {0};
    char err[1024] = "", text[1024];
    struct link *l = copy_link(w, m->link_id, GP_PEER_RECV, err, sizeof err);
    if (!l) {
        r.code = CUDA_ERROR_INVALID_VALUE;
        close_misused(w, m->link_id); /* the sender's next write fails at once */
    } else if (long_begin(w) != 0) {
        return;
    } else {
        r.code = recv_copy(w, l, m, err, sizeof err);
        long_end(w);
        if (r.code != CUDA_SUCCESS)
            link_close(w, l); /* the sender's next write fails: it fails its copy too */
    }
    if (r.code != CUDA_SUCCESS)
        wk_log("peer_recv 0x%llx copy %llu: %s", (unsigned long long)m->link_id,
               (unsigned long long)m->copy_id, err);
    WK_SET_TEXT(r.error, text, err);
    WK_REPLY(w, req, gp_peer_recv_reply, &r);
}
