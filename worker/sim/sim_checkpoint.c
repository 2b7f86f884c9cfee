/*
 * sim_checkpoint.c: cuCheckpointProcess* (lock, checkpoint, restore, unlock another process's
 * CUDA work), as the driver offers them from CUDA 12.8, for processes using the simulated device.
 *
 * The driver acts on another process by pid; so does the sim. Every process that initialises the
 * sim serves these requests on an abstract Unix socket named after its pid
 * ("\0gpupool-sim-checkpoint-<pid>": nothing on disk, gone with the process), from a thread of its
 * own; the calls connect to it, send one request and read one reply. Only the same user or root
 * may ask (SO_PEERCRED), as only they may ptrace it.
 *
 * What each state means, as in the driver:
 *   RUNNING       the process makes CUDA calls;
 *   LOCKED        the serving thread holds the sim's lock: every CUDA call of the process waits
 *                 (work in flight has ended: the sim is synchronous, so taking the lock is the
 *                 wait for it; a lock that cannot be taken within timeoutMs leaves it RUNNING
 *                 and answers CUDA_ERROR_NOT_READY);
 *   CHECKPOINTED  every byte of device memory is in the process's host memory, and the device
 *                 memory (heap pages, VMM allocations, its ranges of the memory file) is given
 *                 back; addresses, handles, modules, streams and events stay as they are;
 *   FAILED        a restore could not complete (the process cannot use the device any more).
 * Restore maps the memory back at the same addresses, on the same GPUs or on those the GPU UUID
 * pairs name (then the process's device ordinals are those GPUs: their UUID, PCI address and
 * part of the memory file), and leaves the process LOCKED; unlock lets it go on. Peers the
 * process opened as devices (a worker holding every GPU of a lease) are ordinals like the
 * others: each one that holds memory must be paired too, and moves with its pair.
 * Not simulated: the restore thread (cuCheckpointProcessGetRestoreThreadId answers the serving
 * thread's id), a process that forks after cuInit (its child serves no requests).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "sim_api.h"
#include "sim_internal.h"

#define CK_MAGIC 0x67706b63u /* "gpkc" */

enum ck_op {
    CK_GET_STATE = 1,
    CK_LOCK,
    CK_CHECKPOINT,
    CK_RESTORE,
    CK_UNLOCK,
    CK_RESTORE_TID,
};

struct ck_request {
    uint32_t magic;
    uint32_t op;
    uint32_t timeout_ms;
    uint32_t npairs;
    unsigned char pairs[SIM_MAX_DEVICES][2][16]; /* old UUID, new UUID */
};

struct ck_reply {
    uint32_t magic;
    int32_t result;
    int32_t state;
    int32_t tid;
};

/* The serving thread's state. Only that thread changes it; ck_mu lets the others read it. */
static pthread_mutex_t ck_mu = PTHREAD_MUTEX_INITIALIZER;
static CUprocessState ck_state = CU_PROCESS_STATE_RUNNING;
static int ck_tid;

static void socket_name(int pid, struct sockaddr_un *sa, socklen_t *len)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    /* Abstract: sun_path starts with a NUL, the name is the bytes after it (no terminator). */
    int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "gpupool-sim-checkpoint-%d", pid);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static CUprocessState get_state(void)
{
    CUprocessState s = CU_PROCESS_STATE_FAILED;
    if (pthread_mutex_lock(&ck_mu) == 0) {
        s = ck_state;
        if (pthread_mutex_unlock(&ck_mu) != 0)
            fprintf(stderr, "gpupool-sim: checkpoint: unlock failed\n");
    }
    return s;
}

static void set_state(CUprocessState s)
{
    if (pthread_mutex_lock(&ck_mu) != 0) {
        fprintf(stderr, "gpupool-sim: checkpoint: lock failed\n");
        return;
    }
    ck_state = s;
    if (pthread_mutex_unlock(&ck_mu) != 0)
        fprintf(stderr, "gpupool-sim: checkpoint: unlock failed\n");
}

static int device_of_uuid(const unsigned char uuid[16])
{
    for (int d = 0; d < sim_phys_count(&sim_cfg); d++) {
        unsigned char u[16];
        sim_phys_uuid(&sim_cfg, d, u);
        if (memcmp(u, uuid, 16) == 0)
            return d;
    }
    return -1;
}

/* Which ordinals had device memory when checkpointed: the GPUs a pair list must name. */
static bool in_use[SIM_MAX_DEVICES];

/* Every ordinal of the process: its configured devices and the peers it opened as devices (a
 * worker holding every GPU of a lease of several, issue 37), each of which moves as the driver
 * moves every GPU of a checkpointed process. */
static int ordinals(void)
{
    return sim_next_peer_device();
}

/* The GPUs the ordinals go to on restore, from the request's UUID pairs: every GPU that held
 * memory must be named (as the driver requires: "every checkpointed GPU"), each new one must
 * exist and be taken once; an ordinal not named keeps its GPU, or takes one left free by the
 * moves when another ordinal moved onto it. */
static CUresult plan_restore(const struct ck_request *rq, int *phys)
{
    int n = ordinals();
    for (int d = 0; d < n; d++)
        phys[d] = sim_phys_dev(d);
    if (rq->npairs == 0)
        return CUDA_SUCCESS;
    if (rq->npairs > SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    bool named[SIM_MAX_DEVICES] = {false}; /* by ordinal */
    bool taken[SIM_MAX_GPUS] = {false};    /* by physical GPU (a peer's index is beyond 16) */
    for (int d = 0; d < n; d++) {
        int from = sim_phys_dev(d);
        for (uint32_t i = 0; i < rq->npairs; i++) {
            if (device_of_uuid(rq->pairs[i][0]) != from)
                continue;
            int to = device_of_uuid(rq->pairs[i][1]);
            if (to < 0 || taken[to])
                return CUDA_ERROR_INVALID_VALUE;
            phys[d] = to;
            named[d] = taken[to] = true;
        }
        if (!named[d] && in_use[d])
            return CUDA_ERROR_INVALID_VALUE;
    }
    int gpus = sim_phys_count(&sim_cfg);
    for (int d = 0; d < n; d++) {
        if (named[d])
            continue;
        if (taken[phys[d]]) { /* its GPU went to a moved ordinal: the first one left */
            int free_gpu = 0;
            while (free_gpu < gpus && taken[free_gpu])
                free_gpu++;
            if (free_gpu == gpus)
                return CUDA_ERROR_INVALID_VALUE;
            phys[d] = free_gpu;
        }
        taken[phys[d]] = true;
    }
    return CUDA_SUCCESS;
}

static CUresult do_checkpoint(void)
{
    CUresult rc = sim_vmm_save();
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = sim_memory_save();
    if (rc != CUDA_SUCCESS) {
        sim_vmm_discard();
        return rc; /* nothing was released: still LOCKED */
    }
    for (int d = 0; d < ordinals(); d++)
        in_use[d] = sim_mem_used(d) > 0;
    sim_memory_release();
    sim_vmm_release();
    return CUDA_SUCCESS;
}

static CUresult do_restore(const struct ck_request *rq)
{
    int phys[SIM_MAX_DEVICES];
    CUresult rc = plan_restore(rq, phys);
    if (rc != CUDA_SUCCESS)
        return rc;
    for (int d = 0; d < ordinals(); d++)
        sim_set_phys_dev(d, phys[d]);
    rc = sim_vmm_restore();
    if (rc == CUDA_SUCCESS)
        rc = sim_memory_restore();
    sim_vmm_discard();
    return rc;
}

static struct ck_reply serve(const struct ck_request *rq)
{
    struct ck_reply rp = {.magic = CK_MAGIC, .result = CUDA_SUCCESS};
    CUprocessState st = get_state();
    switch (rq->op) {
    case CK_GET_STATE:
        break;
    case CK_RESTORE_TID:
        rp.tid = ck_tid;
        break;
    case CK_LOCK:
        if (st != CU_PROCESS_STATE_RUNNING) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        if (sim_lock_wait(rq->timeout_ms) != 0) {
            rp.result = CUDA_ERROR_NOT_READY; /* still RUNNING */
            break;
        }
        st = CU_PROCESS_STATE_LOCKED;
        break;
    case CK_CHECKPOINT:
        if (st != CU_PROCESS_STATE_LOCKED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        rp.result = do_checkpoint();
        if (rp.result == CUDA_SUCCESS)
            st = CU_PROCESS_STATE_CHECKPOINTED;
        break;
    case CK_RESTORE:
        if (st != CU_PROCESS_STATE_CHECKPOINTED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        rp.result = do_restore(rq);
        if (rp.result == CUDA_SUCCESS)
            st = CU_PROCESS_STATE_LOCKED;
        else if (rp.result != CUDA_ERROR_INVALID_VALUE) /* a bad pair list changes nothing */
            st = CU_PROCESS_STATE_FAILED;
        break;
    case CK_UNLOCK:
        if (st != CU_PROCESS_STATE_LOCKED) {
            rp.result = CUDA_ERROR_ILLEGAL_STATE;
            break;
        }
        sim_lock_release();
        st = CU_PROCESS_STATE_RUNNING;
        break;
    default:
        rp.result = CUDA_ERROR_INVALID_VALUE;
    }
    set_state(st);
    rp.state = st;
    return rp;
}

static void *serve_thread(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    ck_tid = (int)syscall(SYS_gettid);
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            fprintf(stderr, "gpupool-sim: checkpoint: accept: %s; no more requests served\n",
                    strerror(errno));
            return NULL;
        }
        struct ucred cred;
        socklen_t clen = sizeof(cred);
        struct ck_request rq;
        ssize_t n = -1;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) == 0 &&
            (cred.uid == 0 || cred.uid == geteuid()))
            n = recv(fd, &rq, sizeof(rq), 0);
        if (n == (ssize_t)sizeof(rq) && rq.magic == CK_MAGIC) {
            struct ck_reply rp = serve(&rq);
            if (send(fd, &rp, sizeof(rp), MSG_NOSIGNAL) != (ssize_t)sizeof(rp))
                fprintf(stderr, "gpupool-sim: checkpoint: reply not sent: %s\n", strerror(errno));
        }
        if (close(fd) != 0)
            fprintf(stderr, "gpupool-sim: checkpoint: close: %s\n", strerror(errno));
    }
}

void sim_checkpoint_listen(void)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fprintf(stderr, "gpupool-sim: checkpoint requests not served (socket: %s)\n",
                strerror(errno));
        return;
    }
    struct sockaddr_un sa;
    socklen_t len;
    socket_name((int)getpid(), &sa, &len);
    pthread_t t;
    pthread_attr_t attr;
    if (bind(fd, (struct sockaddr *)&sa, len) != 0 || listen(fd, 8) != 0) {
        fprintf(stderr, "gpupool-sim: checkpoint requests not served (bind: %s)\n",
                strerror(errno));
    } else if (pthread_attr_init(&attr) != 0) {
        fprintf(stderr, "gpupool-sim: checkpoint requests not served (thread attributes)\n");
    } else {
        /* The thread takes no signal: a program that blocks a signal to read it elsewhere (a
         * signalfd) must not see it delivered here. It inherits the mask set around its
         * creation. */
        sigset_t all, old;
        int e = sigfillset(&all) == 0 ? pthread_sigmask(SIG_BLOCK, &all, &old) : EINVAL;
        bool masked = e == 0;
        if (e == 0)
            e = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (e == 0)
            e = pthread_create(&t, &attr, serve_thread, (void *)(intptr_t)fd);
        if (masked && pthread_sigmask(SIG_SETMASK, &old, NULL) != 0)
            fprintf(stderr, "gpupool-sim: checkpoint: cannot restore the signal mask\n");
        if (pthread_attr_destroy(&attr) != 0)
            fprintf(stderr, "gpupool-sim: checkpoint: pthread_attr_destroy failed\n");
        if (e == 0)
            return;
        fprintf(stderr, "gpupool-sim: checkpoint requests not served (thread: %s)\n", strerror(e));
    }
    if (close(fd) != 0)
        fprintf(stderr, "gpupool-sim: checkpoint: close: %s\n", strerror(errno));
}

/* ---- the calls, made on another process ---------------------------------------------------- */

static CUresult request(int pid, struct ck_request *rq, struct ck_reply *rp)
{
    CUresult rc = sim_enter(); /* as the driver: cuInit first */
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_leave(CUDA_SUCCESS); /* the request itself runs without the lock */
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    rq->magic = CK_MAGIC;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    struct sockaddr_un sa;
    socklen_t len;
    socket_name(pid, &sa, &len);
    rc = CUDA_ERROR_INVALID_VALUE; /* no such process, or not one using CUDA */
    if (connect(fd, (struct sockaddr *)&sa, len) == 0) {
        rc = CUDA_ERROR_OPERATING_SYSTEM;
        ssize_t n;
        if (send(fd, rq, sizeof(*rq), MSG_NOSIGNAL) == (ssize_t)sizeof(*rq)) {
            do
                n = recv(fd, rp, sizeof(*rp), 0);
            while (n < 0 && errno == EINTR);
            if (n == (ssize_t)sizeof(*rp) && rp->magic == CK_MAGIC)
                rc = (CUresult)rp->result;
        }
    }
    if (close(fd) != 0)
        fprintf(stderr, "gpupool-sim: checkpoint: close: %s\n", strerror(errno));
    return rc;
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    struct ck_request rq = {.op = CK_GET_STATE};
    struct ck_reply rp;
    CUresult rc = request(pid, &rq, &rp);
    if (rc == CUDA_SUCCESS)
        *state = rp.state;
    return rc;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    struct ck_request rq = {.op = CK_RESTORE_TID};
    struct ck_reply rp;
    CUresult rc = request(pid, &rq, &rp);
    if (rc == CUDA_SUCCESS)
        *tid = rp.tid;
    return rc;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    struct ck_request rq = {.op = CK_LOCK, .timeout_ms = args ? args->timeoutMs : 0};
    struct ck_reply rp;
    return request(pid, &rq, &rp);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    (void)args;
    struct ck_request rq = {.op = CK_CHECKPOINT};
    struct ck_reply rp;
    return request(pid, &rq, &rp);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    struct ck_request rq = {.op = CK_RESTORE};
    if (args && args->gpuPairsCount > 0) {
        if (!args->gpuPairs || args->gpuPairsCount > SIM_MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
        rq.npairs = args->gpuPairsCount;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            memcpy(rq.pairs[i][0], args->gpuPairs[i].oldUuid.bytes, 16);
            memcpy(rq.pairs[i][1], args->gpuPairs[i].newUuid.bytes, 16);
        }
    }
    struct ck_reply rp;
    return request(pid, &rq, &rp);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    (void)args;
    struct ck_request rq = {.op = CK_UNLOCK};
    struct ck_reply rp;
    return request(pid, &rq, &rp);
}
