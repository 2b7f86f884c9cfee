/*
 * pacing.c: fair GPU time between the shares of one GPU (issue 32, item 4).
 *
 * The driver time-slices the contexts of a shared GPU by itself, evenly at best. A share's weight
 * (3:1, say) needs more: each worker of the GPU keeps, in a small record per GPU that all of them
 * map (<GPUPOOL_WORKER_PACE_DIR>/gpu-<GPU>.pace), its weight, its recent GPU time and whether it
 * wants the GPU now. Before a launch, a worker whose part of the recent GPU time of the shares
 * that want the GPU exceeds its weight's part sleeps (1 ms at a time) until it no longer does, or
 * until nobody else wants the GPU: a share alone is never slowed down, and a share that goes idle
 * stops counting within ACTIVE_NS.
 *
 * "Recent": GPU time decays, acc(t) = acc * H / (H + t - stamp) with H = DECAY_NS, so the last
 * second or so counts. GPU time is a launch's time from call to return less the wait for its turn
 * on the simulated device (synchronous there: the kernel ran inside the call). On a real GPU a
 * launch returns before its kernel runs, so this measures little there: pacing then needs the
 * kernels' times from events (not done; docs/validation.md's shares step is where to look).
 *
 * Each slot is written by its owner only (plain 64-bit stores), read by all without a lock (a
 * stale value costs one wrong decision, never a hang). A worker holds an OFD lock on its slot's
 * byte of the record for as long as it lives, so the slot of a worker that died is taken by the
 * next one; its stale "wants" mark runs out by itself.
 *
 * A share restored on another GPU after an idle detach (issue 32, item 5) moves to that GPU's
 * record (wk_pace_move): its slot in the old one is freed, the new one is opened at its next
 * launch, keyed by the UUID gpupoold names in worker_attached.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "pacing.h"

#define PACE_MAGIC 0x3165636170706777ull /* "wgppace1" */
#define PACE_SLOTS 64
#define LOCK_SLOT0 0x100000000ll /* bytes locked, past the end of the file */
#define DECAY_NS 500000000.0     /* H: GPU time half counts after 0.5 s */
#define ACTIVE_NS 100000000ull   /* a share wants the GPU until 100 ms after its last launch */
#define SLEEP_NS 1000000l        /* one pacing sleep */
#define MAX_PACE_NS 500000000ull /* at most this long per launch: pacing must not stall a share */

struct pace_slot {
    uint64_t weight; /* 0: free */
    uint64_t acc_ns; /* decayed GPU time at stamp_ns */
    uint64_t stamp_ns;
    uint64_t want_until_ns; /* the share wants the GPU until then */
};

struct pace_record {
    uint64_t magic;
    struct pace_slot slot[PACE_SLOTS];
};

static struct pace_record *rec; /* NULL: no pacing */
static int rec_fd = -1;         /* holds the slot's lock */
static int my_slot = -1;
static char moved_gpu[65]; /* the GPU's key after a move (wk_pace_move); empty: the environment's */
static bool looked;
static uint64_t (*turn_wait_ns)(void); /* the simulated device's, or NULL */
static uint64_t launch_t0, launch_wait0;

static uint64_t now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t load(const uint64_t *p)
{
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}

static void store(uint64_t *p, uint64_t v)
{
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

/* Slot s's GPU time as of now. */
static double decayed(const struct pace_slot *s, uint64_t now)
{
    uint64_t stamp = load(&s->stamp_ns), acc = load(&s->acc_ns);
    double dt = now > stamp ? (double)(now - stamp) : 0.0;
    return (double)acc * DECAY_NS / (DECAY_NS + dt);
}

static int lock_slot(int fd, int s)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl)); /* l_pid must be 0 for OFD locks */
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(LOCK_SLOT0 + s);
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* The configuration from the environment; NULL when the worker does not pace, else the record's
 * path in buf, with the weight. A bad value is a warning and no pacing (the share still runs). */
static const char *config(char *buf, size_t len, uint64_t *weight)
{
    const char *dir = getenv(WK_PACE_DIR_ENV);
    const char *gpu = moved_gpu[0] ? moved_gpu : getenv(WK_PACE_GPU_ENV);
    const char *w = getenv(WK_PACE_WEIGHT_ENV);
    if (!dir || !*dir)
        return NULL;
    size_t glen = gpu ? strlen(gpu) : 0;
    bool ok = dir[0] == '/' && glen > 0 && glen <= 64;
    for (size_t i = 0; ok && i < glen; i++)
        ok = (gpu[i] >= '0' && gpu[i] <= '9') || (gpu[i] >= 'a' && gpu[i] <= 'z') ||
             (gpu[i] >= 'A' && gpu[i] <= 'Z') || gpu[i] == '-';
    *weight = 1;
    if (ok && w && *w) {
        char *end = NULL;
        errno = 0;
        unsigned long v = strtoul(w, &end, 10);
        ok = errno == 0 && *end == '\0' && v >= 1 && v <= 1000;
        *weight = v;
    }
    int n = ok ? snprintf(buf, len, "%s/gpu-%s.pace", dir, gpu) : -1;
    if (n < 0 || (size_t)n >= len) {
        wk_warn(
            "pacing: %s=%s, %s=%s, %s=%s are not a usable setting (an absolute folder, the GPU's "
            "UUID, a weight 1..1000); this share runs without pacing",
            WK_PACE_DIR_ENV, dir, WK_PACE_GPU_ENV, gpu ? gpu : "(unset)", WK_PACE_WEIGHT_ENV,
            w ? w : "(unset)");
        return NULL;
    }
    return buf;
}

/* Opens the GPU's record and takes a free slot; a failure is a warning and no pacing. */
static void open_record(void)
{
    char path[4200];
    uint64_t weight = 1;
    if (!config(path, sizeof(path), &weight))
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    struct stat st;
    const char *why = NULL;
    if (fd < 0 || fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid())
        why = "not a regular file of gpupoold's user";
    else if ((uint64_t)st.st_size < sizeof(struct pace_record) &&
             ftruncate(fd, (off_t)sizeof(struct pace_record)) != 0)
        why = strerror(errno);
    void *p =
        why ? MAP_FAILED
            : mmap(NULL, sizeof(struct pace_record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!why && p == MAP_FAILED)
        why = strerror(errno);
    int slot = -1;
    for (int s = 0; !why && s < PACE_SLOTS && slot < 0; s++)
        if (lock_slot(fd, s) == 0)
            slot = s;
    if (!why && slot < 0)
        why = "more than 64 shares of this GPU";
    if (why) {
        wk_warn("pacing: cannot use %s (%s); this share runs without pacing (check that the folder "
                "exists and is writable)",
                path, why);
        if (p != MAP_FAILED && munmap(p, sizeof(struct pace_record)) != 0)
            wk_warn("pacing: munmap failed");
        if (fd >= 0 && close(fd) != 0)
            wk_warn("pacing: close failed");
        return;
    }
    /* The fd stays open for the worker's life (or until a move): it holds the slot's lock. */
    rec = p;
    rec_fd = fd;
    __atomic_store_n(&rec->magic, PACE_MAGIC, __ATOMIC_RELAXED);
    struct pace_slot *me = &rec->slot[slot];
    store(&me->acc_ns, 0); /* a dead predecessor's time is not ours */
    store(&me->stamp_ns, now_ns());
    store(&me->want_until_ns, 0);
    store(&me->weight, weight);
    my_slot = slot;
}

/* Whether this share is over its part while another share wants the GPU. */
static bool over_share(uint64_t now)
{
    double sum_acc = 0.0, sum_w = 0.0;
    bool others = false;
    for (int s = 0; s < PACE_SLOTS; s++) {
        const struct pace_slot *p = &rec->slot[s];
        uint64_t w = load(&p->weight);
        if (w == 0 || (s != my_slot && load(&p->want_until_ns) <= now))
            continue;
        sum_w += (double)w;
        sum_acc += decayed(p, now);
        others = others || s != my_slot;
    }
    if (!others || sum_acc <= 0.0)
        return false;
    double mine = decayed(&rec->slot[my_slot], now), my_w = (double)rec->slot[my_slot].weight;
    return mine / sum_acc > my_w / sum_w;
}

void wk_pace_launch_begin(void *drv_lib)
{
    if (!looked) {
        looked = true;
        /* The simulated device's turn counter (worker/sim/README.md); a real driver has none. */
        void *sym = dlsym(drv_lib ? drv_lib : RTLD_DEFAULT, "gpupoolSimTurnWaitNs");
        if (sym)
            memcpy(&turn_wait_ns, &sym, sizeof(sym)); /* object to function pointer, as dlsym */
        open_record();
    }
    if (rec) {
        struct pace_slot *me = &rec->slot[my_slot];
        uint64_t start = now_ns(), now = start;
        store(&me->want_until_ns, now + ACTIVE_NS);
        while (now - start < MAX_PACE_NS && over_share(now)) {
            struct timespec ts = {0, SLEEP_NS};
            nanosleep(&ts, NULL); /* woken early: one more look */
            now = now_ns();
            store(&me->want_until_ns, now + ACTIVE_NS); /* still wanting it */
        }
    }
    launch_wait0 = turn_wait_ns ? turn_wait_ns() : 0;
    launch_t0 = now_ns();
}

uint64_t wk_pace_launch_end(void)
{
    uint64_t t1 = now_ns(), waited = turn_wait_ns ? turn_wait_ns() - launch_wait0 : 0;
    uint64_t took = t1 > launch_t0 ? t1 - launch_t0 : 0;
    if (waited > took)
        waited = took;
    if (rec) {
        struct pace_slot *me = &rec->slot[my_slot];
        store(&me->acc_ns, (uint64_t)(decayed(me, t1) + (double)(took - waited)));
        store(&me->stamp_ns, t1);
        store(&me->want_until_ns, t1 + ACTIVE_NS);
    }
    return waited;
}

void wk_pace_move(const char *uuid, size_t len)
{
    /* The key as gpupoold makes it from the UUID (pool/share_leases.py): letters, digits, '-'. */
    size_t n = 0;
    for (size_t i = 0; i < len && n + 1 < sizeof(moved_gpu); i++)
        if ((uuid[i] >= '0' && uuid[i] <= '9') || (uuid[i] >= 'a' && uuid[i] <= 'z') ||
            (uuid[i] >= 'A' && uuid[i] <= 'Z') || uuid[i] == '-')
            moved_gpu[n++] = uuid[i];
    moved_gpu[n] = '\0';
    if (rec) {
        struct pace_slot *me = &rec->slot[my_slot];
        store(&me->want_until_ns, 0);
        store(&me->weight, 0); /* no longer a share of that GPU */
        if (munmap(rec, sizeof(struct pace_record)) != 0)
            wk_warn("pacing: munmap failed");
        if (close(rec_fd) != 0)
            wk_warn("pacing: close failed");
        rec = NULL;
        rec_fd = my_slot = -1;
    }
    looked = false; /* the new GPU's record is opened at the next launch */
}
