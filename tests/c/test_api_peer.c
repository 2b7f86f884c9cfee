/*
 * Unit test of the client's end of server-to-server copies (client/shim/api_peer.c,
 * gp_spread_copy_direct) against a fake shim core: the gp_* functions it calls are defined here,
 * and gp_request answers peer_link / peer_send / peer_recv per part as each scenario sets them.
 * Checks what goes on the wire (links made, copies, unlinks, the legacy-stream waits before a
 * copy), what the caller is told (through the client or not, the code) and the lines (whose
 * words, how often), for: retries after a failed copy, a pair that waits after failing links
 * and tries again once its time is up (the clock is faked), failures that are not the link's,
 * a lost server, plain-TCP connections. Run by tests/test_worker_peer_links.py.
 *
 * Usage: test_api_peer
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "client_config.h"
#include "generated/gp_cuda_tables.h"
#include "shim.h"
#include "shim_core.h"

#include "gp_check_said.h"

#define NPARTS 16

/* ---- the fake core ----------------------------------------------------------------------- */
static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int tl_route = -1;
static __thread uint64_t tl_ctx;

static struct {
    /* answers, per part */
    int32_t link_code[NPARTS], copy_code[NPARTS];
    const char *link_words[NPARTS], *copy_words[NPARTS];
    int lost[NPARTS]; /* 1: the part is lost (waits and requests); 2: its requests only */
    int plain[NPARTS];
    int mode;
    /* seen, per part */
    int links[NPARTS], sends[NPARTS], recvs[NPARTS], unlinks[NPARTS], waits[NPARTS];
    uint64_t copy_ctx[NPARTS]; /* the context a copy ran in */
    int errors, infos;
    char last_line[2048];
} fk;

static int64_t clock_shift_s; /* the fake clock: the real one plus this */

int clock_gettime(clockid_t id, struct timespec *t)
{
    int rc = (int)syscall(SYS_clock_gettime, id, t);
    if (rc == 0 && id == CLOCK_MONOTONIC)
        t->tv_sec += clock_shift_s;
    return rc;
}

void gp_conn_route(int part)
{
    tl_route = part;
}

void gp_conn_use_ctx(uint64_t ctx_id)
{
    tl_ctx = ctx_id;
}

uint64_t gp_conn_wire_ctx(void)
{
    return tl_ctx;
}

int gp_conn_part_first_device(int p)
{
    return p; /* one device per part */
}

const char *gp_conn_part_server(int p)
{
    static const char *names[NPARTS] = {"s0", "s1", "s2",  "s3",  "s4",  "s5",  "s6",  "s7",
                                        "s8", "s9", "s10", "s11", "s12", "s13", "s14", "s15"};
    return p >= 0 && p < NPARTS ? names[p] : "";
}

int gp_conn_part_tls(int p)
{
    return !fk.plain[p];
}

const gp_device_snapshot *gp_device(int ordinal)
{
    static gp_device_snapshot dev = {.proto_minor = 9};
    return ordinal >= 0 && ordinal < NPARTS ? &dev : NULL;
}

int gp_state_spread_copy(void)
{
    return fk.mode;
}

const char *gp_cuda_error_name(CUresult r)
{
    return r == CUDA_ERROR_NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED" : NULL;
}

CUresult gp_cu_result(int32_t r)
{
    return r >= 100000 ? CUDA_ERROR_UNKNOWN : (CUresult)r;
}

static void line(int *count, const char *fmt, va_list ap)
{
    pthread_mutex_lock(&fake_lock);
    (*count)++;
    vsnprintf(fk.last_line, sizeof fk.last_line, fmt, ap);
    pthread_mutex_unlock(&fake_lock);
}

void gp_log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    line(&fk.errors, fmt, ap);
    va_end(ap);
}

void gp_log_info(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    line(&fk.infos, fmt, ap);
    va_end(ap);
}

void gp_log_debug(const char *fmt, ...)
{
    (void)fmt;
}

static int part_now(void)
{
    if (tl_route < 0 || tl_route >= NPARTS) {
        fprintf(stderr, "a frame went out with no part routed\n");
        abort();
    }
    return tl_route;
}

CUresult gp_stream_wait_wire(uint64_t wire)
{
    CHECK(wire == 0, "the wait before a copy is on the legacy stream, not %llu",
          (unsigned long long)wire);
    int p = part_now();
    pthread_mutex_lock(&fake_lock);
    fk.waits[p]++;
    pthread_mutex_unlock(&fake_lock);
    return fk.lost[p] == 1 ? GP_LOST_CONNECTION_ERROR : CUDA_SUCCESS;
}

CUresult gp_post(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len)
{
    (void)frame_len, (void)bulk, (void)bulk_len;
    int p = part_now();
    if (gp_rd_u16(frame + 4) == GP_OP_PEER_UNLINK) {
        pthread_mutex_lock(&fake_lock);
        fk.unlinks[p]++;
        pthread_mutex_unlock(&fake_lock);
    }
    return CUDA_SUCCESS;
}

void gp_reply_free(gp_reply *reply)
{
    free(reply->body);
    reply->body = NULL;
}

CUresult gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                    void *bulk_dst, uint64_t bulk_cap, gp_reply *reply)
{
    (void)frame_len, (void)bulk, (void)bulk_len, (void)bulk_dst, (void)bulk_cap;
    int p = part_now();
    uint16_t op = gp_rd_u16(frame + 4);
    memset(reply, 0, sizeof *reply);
    pthread_mutex_lock(&fake_lock);
    gp_peer_link_reply rep = {0};
    if (op == GP_OP_PEER_LINK) {
        fk.links[p]++;
        rep.code = fk.link_code[p];
        rep.error = fk.link_words[p] ? fk.link_words[p] : "";
    } else if (op == GP_OP_PEER_SEND || op == GP_OP_PEER_RECV) {
        (op == GP_OP_PEER_SEND ? fk.sends : fk.recvs)[p]++;
        fk.copy_ctx[p] = tl_ctx;
        rep.code = fk.copy_code[p];
        rep.error = fk.copy_words[p] ? fk.copy_words[p] : "";
    } else {
        fprintf(stderr, "unexpected request op %u\n", op);
        abort();
    }
    int lost = fk.lost[p];
    pthread_mutex_unlock(&fake_lock);
    if (lost)
        return GP_LOST_CONNECTION_ERROR;
    rep.error_len = (uint32_t)strlen(rep.error);
    reply->len = gp_peer_link_reply_size(&rep);
    reply->body = malloc(reply->len);
    if (!reply->body)
        abort();
    gp_peer_link_reply_encode(reply->body, &rep);
    return CUDA_SUCCESS;
}

/* ---- scenarios --------------------------------------------------------------------------- */
static void reset_counts(void)
{
    pthread_mutex_lock(&fake_lock);
    memset(fk.links, 0, sizeof fk.links);
    memset(fk.sends, 0, sizeof fk.sends);
    memset(fk.recvs, 0, sizeof fk.recvs);
    memset(fk.unlinks, 0, sizeof fk.unlinks);
    memset(fk.waits, 0, sizeof fk.waits);
    fk.errors = fk.infos = 0;
    fk.last_line[0] = 0;
    pthread_mutex_unlock(&fake_lock);
}

#define CTX_OF(p) (0x1000u + (uint64_t)(p))

/* One copy from part ps to part pd: its result; *through the caller's flag. */
static CUresult copy(int ps, int pd, int *through)
{
    return gp_spread_copy_direct(0x2000, pd, CTX_OF(pd), 0x1000, ps, CTX_OF(ps), 4096, through);
}

static void test_a_copy_waits_for_both_legacy_streams_and_keeps_its_link(void)
{
    int s = 0, d = 1, through = -1;
    reset_counts();
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "through %d", through);
    CHECK(fk.links[s] == 1 && fk.links[d] == 1, "links %d %d", fk.links[s], fk.links[d]);
    CHECK(fk.sends[s] == 1 && fk.recvs[d] == 1, "send %d recv %d", fk.sends[s], fk.recvs[d]);
    CHECK(fk.waits[s] == 1 && fk.waits[d] == 1, "waits %d %d", fk.waits[s], fk.waits[d]);
    CHECK(fk.copy_ctx[s] == CTX_OF(s) && fk.copy_ctx[d] == CTX_OF(d), "contexts");
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "second copy");
    CHECK(fk.links[s] == 1 && fk.links[d] == 1, "the link is kept: links %d", fk.links[s]);
    CHECK(fk.unlinks[s] == 0 && fk.unlinks[d] == 0, "nothing unlinked");
    CHECK(fk.infos == 0 && fk.errors == 0, "no line: %s", fk.last_line);
}

static void test_a_failed_copy_unlinks_both_and_the_next_copy_makes_a_new_link(void)
{
    int s = 2, d = 3, through = -1;
    reset_counts();
    fk.mode = GP_SPREAD_COPY_AUTO;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "first copy");
    /* Failed copies between copies that went over a link never make the pair wait. */
    for (int i = 0; i < 3; i++) {
        fk.copy_code[d] = CUDA_ERROR_ILLEGAL_ADDRESS;
        fk.copy_words[d] = "dst words";
        CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "auto: through the client");
        CHECK(fk.unlinks[s] == i + 1 && fk.unlinks[d] == i + 1, "unlinks %d %d", fk.unlinks[s],
              fk.unlinks[d]);
        fk.copy_code[d] = 0;
        CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "a new link");
        CHECK(fk.links[s] == i + 2 && fk.links[d] == i + 2, "links %d", fk.links[s]);
    }
    CHECK(fk.infos == 0, "no line for a copy the next one retries: %s", fk.last_line);
    /* Two links in a row whose copy failed: the pair waits, with one line. */
    fk.copy_code[d] = CUDA_ERROR_ILLEGAL_ADDRESS;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "fails once");
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "fails twice");
    fk.copy_code[d] = 0;
    int links = fk.links[s];
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "waiting: through the client");
    CHECK(fk.links[s] == links, "no link while the pair waits");
    CHECK(fk.infos == 1 && strstr(fk.last_line, "dst words") &&
              strstr(fk.last_line, "go through this client") &&
              strstr(fk.last_line, "tried again in"),
          "the line: %s", fk.last_line);
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1 && fk.infos == 1,
          "auto says it once per pair");
    /* Once its time is up the pair links again. */
    clock_shift_s += 31;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "server to server again");
    CHECK(fk.links[s] == links + 1, "a new link after the wait");
    /* Set-ups that keep failing (servers that cannot reach each other) wait twice as long each
     * time: 30, 60, 120 s...; a copy that goes over a link again starts over at 30 s. */
    fk.copy_code[d] = CUDA_ERROR_ILLEGAL_ADDRESS; /* the link goes: the next copy makes one */
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "the link fails");
    fk.copy_code[d] = 0;
    fk.link_code[s] = fk.link_code[d] = CUDA_ERROR_NOT_SUPPORTED;
    fk.link_words[s] = "server s could not be reached";
    links = fk.links[s];
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1 && fk.links[s] == links + 1,
          "no link: waits 30 s");
    links = fk.links[s];
    clock_shift_s += 29;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1 && fk.links[s] == links,
          "no try within the first 30 s");
    clock_shift_s -= 29;
    clock_shift_s += 31;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "tried after 30 s, fails");
    CHECK(fk.links[s] == links + 1, "a try after the first wait");
    clock_shift_s += 31;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1 && fk.links[s] == links + 1,
          "the second wait is 60 s: no try after 31 s");
    clock_shift_s += 30;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1 && fk.links[s] == links + 2,
          "a try after 61 s");
    clock_shift_s += 61;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && fk.links[s] == links + 2,
          "the third wait is 120 s: no try after 61 s");
    fk.link_code[s] = fk.link_code[d] = 0;
    fk.link_words[s] = NULL;
    clock_shift_s += 60;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0 && fk.links[s] == links + 3,
          "linked after 121 s");
    fk.copy_code[d] = CUDA_ERROR_ILLEGAL_ADDRESS;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "fails once");
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "fails twice: waits");
    fk.copy_code[d] = 0;
    links = fk.links[s];
    clock_shift_s += 31;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0 && fk.links[s] == links + 1,
          "a copy over a link started the waits over: 30 s again");
}

static void test_the_words_are_those_of_the_side_whose_code_is_returned(void)
{
    int s = 4, d = 5, through = -1;
    reset_counts();
    fk.mode = GP_SPREAD_COPY_SERVER;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS, "linked");
    fk.copy_code[s] = CUDA_ERROR_ILLEGAL_ADDRESS;
    fk.copy_words[s] = "src words";
    fk.copy_code[d] = CUDA_ERROR_INVALID_VALUE;
    fk.copy_words[d] = "dst words";
    CHECK(copy(s, d, &through) == CUDA_ERROR_INVALID_VALUE && through == 0, "D's code");
    CHECK(strstr(fk.last_line, "dst words") && !strstr(fk.last_line, "src words"), "line: %s",
          fk.last_line);
    fk.copy_code[d] = 0;
    CHECK(copy(s, d, &through) == CUDA_ERROR_ILLEGAL_ADDRESS && through == 0, "S's code");
    CHECK(strstr(fk.last_line, "src words"), "line: %s", fk.last_line);
    CHECK(fk.errors == 2, "server: a line per failing copy (%d)", fk.errors);
    /* Set-up (the other direction): the source's words first (it reaches out to the other
     * server). */
    fk.copy_code[s] = fk.copy_code[d] = 0;
    s = 5, d = 4;
    fk.link_code[s] = fk.link_code[d] = CUDA_ERROR_NOT_SUPPORTED;
    fk.link_words[s] = "server s5 could not be reached";
    fk.link_words[d] = "no server connected";
    CHECK(copy(s, d, &through) == CUDA_ERROR_NOT_SUPPORTED && through == 0, "no link");
    CHECK(strstr(fk.last_line, "could not be reached"), "line: %s", fk.last_line);
    CHECK(!strstr(fk.last_line, "no server connected"), "line: %s", fk.last_line);
    /* server: every copy while the pair waits fails and says why. */
    int links = fk.links[s];
    CHECK(copy(s, d, &through) == CUDA_ERROR_NOT_SUPPORTED && through == 0, "waits");
    CHECK(fk.links[s] == links && fk.errors == 4, "no link, a line (%d)", fk.errors);
    CHECK(strstr(fk.last_line, "could not be reached") &&
              strstr(fk.last_line, "spread_copy = server"),
          "line: %s", fk.last_line);
    fk.link_code[s] = fk.link_code[d] = 0;
}

static void test_a_busy_gpupoold_or_no_memory_costs_no_try(void)
{
    int s = 6, d = 7, through = -1;
    reset_counts();
    fk.mode = GP_SPREAD_COPY_AUTO;
    fk.link_code[s] = CUDA_ERROR_NOT_SUPPORTED;
    fk.link_words[s] = "this server is busy making 12 links; a later copy tries again";
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "busy: through the client");
    CHECK(fk.unlinks[s] == 1 && fk.unlinks[d] == 1, "the other end unlinked");
    fk.link_code[s] = 0;
    fk.link_code[d] = CUDA_ERROR_OUT_OF_MEMORY;
    fk.link_words[d] = "out of memory for the server-to-server links";
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "no memory: through the client");
    fk.link_code[d] = 0;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "the next copy links");
    CHECK(fk.links[s] == 3, "a link tried at each copy: %d", fk.links[s]);
    CHECK(fk.infos == 0, "no lasting line: %s", fk.last_line);
}

static void test_a_lost_server_unlinks_the_other_end_and_is_the_copys_error(void)
{
    int s = 8, d = 9, through = -1;
    reset_counts();
    fk.mode = GP_SPREAD_COPY_AUTO;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "linked");
    fk.lost[d] = 1;
    fk.copy_code[d] = 0;
    /* the legacy wait on D already finds it lost */
    CHECK(copy(s, d, &through) == GP_LOST_CONNECTION_ERROR && through == 0, "lost: its error");
    CHECK(fk.sends[s] == 1, "no copy sent after a failed wait: %d", fk.sends[s]);
    fk.lost[d] = 0;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 0, "the link was untouched");
    /* lost during the copy: both ends unlinked, the next copy links again */
    fk.lost[s] = 2;
    CHECK(copy(s, d, &through) == GP_LOST_CONNECTION_ERROR && through == 0, "lost mid-copy");
    CHECK(fk.unlinks[s] == 1 && fk.unlinks[d] == 1, "unlinks %d %d", fk.unlinks[s], fk.unlinks[d]);
    fk.lost[s] = 0;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && fk.links[s] == 2, "a new link");
}

static void test_plain_tcp_connections_never_link(void)
{
    int s = 10, d = 11, through = -1;
    reset_counts();
    fk.mode = GP_SPREAD_COPY_AUTO;
    fk.plain[d] = 1;
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "through the client");
    CHECK(copy(s, d, &through) == CUDA_SUCCESS && through == 1, "again");
    CHECK(fk.links[s] == 0 && fk.links[d] == 0, "no key sent");
    CHECK(fk.infos == 1 && strstr(fk.last_line, "server s11 is plain TCP"), "line: %s",
          fk.last_line);
    fk.mode = GP_SPREAD_COPY_SERVER;
    CHECK(copy(s, d, &through) == CUDA_ERROR_NOT_SUPPORTED && through == 0, "server fails");
    fk.mode = GP_SPREAD_COPY_CLIENT;
    CHECK(copy(12, 13, &through) == CUDA_SUCCESS && through == 1 && fk.links[12] == 0, "client");
    fk.mode = GP_SPREAD_COPY_AUTO;
}

/* Copies of pairs sharing parts from several threads at once, both directions and a cycle:
 * all finish (the part locks are taken in one order). */
static void *copier(void *arg)
{
    int k = (int)(intptr_t)arg, through;
    static const int route[][2] = {{13, 14}, {14, 13}, {14, 15}, {15, 13}};
    for (int i = 0; i < 200; i++)
        if (copy(route[k][0], route[k][1], &through) != CUDA_SUCCESS || through)
            return (void *)1;
    return NULL;
}

static void test_copies_from_several_threads_all_finish(void)
{
    pthread_t t[4];
    for (int k = 0; k < 4; k++)
        CHECK(pthread_create(&t[k], NULL, copier, (void *)(intptr_t)k) == 0, "thread");
    for (int k = 0; k < 4; k++) {
        void *r = (void *)1;
        CHECK(pthread_join(t[k], &r) == 0 && r == NULL, "copier %d failed", k);
    }
}

int main(void)
{
    test_a_copy_waits_for_both_legacy_streams_and_keeps_its_link();
    test_a_failed_copy_unlinks_both_and_the_next_copy_makes_a_new_link();
    test_the_words_are_those_of_the_side_whose_code_is_returned();
    test_a_busy_gpupoold_or_no_memory_costs_no_try();
    test_a_lost_server_unlinks_the_other_end_and_is_the_copys_error();
    test_plain_tcp_connections_never_link();
    test_copies_from_several_threads_all_finish();
    printf("%s test_api_peer: %d checks, %d failed\n", failures ? "FAIL" : "PASS", checks,
           failures);
    return failures ? 1 : 0;
}
