/*
 * sim_shared.c: a simulated GPU shared by several processes (key shared_dir).
 *
 * On a real GPU the processes of several tenants (each its own context) share one DRAM and one
 * set of SMs: their allocations together meet the GPU's size, a process allocating after another
 * freed (or died) may read what it left (the driver does not clear), and their kernels take turns.
 * Without this file every process simulating a GPU has a private allocator and runs its kernels
 * on host CPUs whenever it likes, so none of that can be tested. With shared_dir, per GPU (by
 * UUID) one state file <shared_dir>/gpu-<UUID>.state, mapped MAP_SHARED by every process of the
 * GPU, holds:
 *
 *   - the allocator of the GPU's part of the memory file: a table of ranges (offset, length,
 *     owner slot). Placement is first fit over all processes' ranges, so the bytes a process frees
 *     (or leaves behind by dying) are the next allocation's, unchanged;
 *   - one slot per process: the process holds an OFD lock on the slot's byte for as long as it
 *     lives (the kernel drops it when the process dies, whatever its PID namespace), so a range
 *     whose slot nobody holds belongs to a dead process and is taken back. That happens at every
 *     allocation and cuMemGetInfo of any process of the GPU, and when a new process claims the
 *     slot: so the scrub (gpupool-scrub allocates all free memory and zeroes it) clears and takes
 *     back everything no live process holds;
 *   - the kernel turn: an OFD lock on another byte that a process holds while one of its kernels
 *     runs, and the slots waiting for it, so that a process that just had a turn lets a waiting
 *     one go first (otherwise a process launching back to back takes the lock again before the
 *     waiter has woken up, and the other tenant starves).
 *
 * Locks are OFD byte locks on the state file (fcntl F_OFD_SETLK*), not mutexes in the mapping: a
 * process that dies holding one cannot leave it held. The table is written so that a process dying
 * in the middle of a change leaves it consistent: an entry is filled before it is marked in use,
 * and removing one only clears the mark; the GPU's use is summed from the table each time.
 *
 * Everything here runs under the sim lock (sim_internal.h): one thread of a process at a time.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sim_api.h"
#include "sim_internal.h"
#include "sim_shared.h"

#define PAGE 4096ull
#define SH_MAGIC 0x3172687370677067ull /* "gpgpshr1" */
#define SH_VERSION 1u
#define SH_SLOTS 256      /* processes of one GPU at a time (tenants, the scrub, tools) */
#define SH_RANGES 65536u  /* live allocations of all processes of one GPU */
#define SH_RANGES_AT 4096 /* the header's page */
#define SH_FILE_SIZE (SH_RANGES_AT + (uint64_t)SH_RANGES * sizeof(struct sh_range))
/* Bytes locked (OFD locks; past the end of the file, which locks may be). */
#define LOCK_ALLOC 0x100000000ll
#define LOCK_TURN 0x100000001ll
#define LOCK_SLOT0 0x100001000ll
/* How long a process that had the last kernel turn waits for a waiting one to take the next (it
 * normally does within microseconds; a waiter that died waiting must not slow the GPU down). */
#define POLITE_MAX_NS 2000000ull
#define POLITE_STEP_NS 50000l

struct sh_range {
    uint64_t off, len; /* within the GPU's part of the memory file */
    uint32_t slot;
    uint32_t in_use; /* set last when added, cleared alone when removed */
};

struct sh_header {
    uint64_t magic; /* written last when the file is set up */
    uint32_t version, slots, ranges;
    uint32_t hwm;              /* entries [0, hwm) of the table may be in use */
    uint64_t usable;           /* the GPU's bytes: every process of the GPU must agree */
    uint32_t last_turn;        /* slot + 1 of the process whose kernel ran last; 0: none yet */
    uint8_t waiting[SH_SLOTS]; /* slot s waits for the kernel turn */
};
_Static_assert(sizeof(struct sh_header) <= SH_RANGES_AT, "the header fits its page");

struct sh_gpu {
    int fd;
    struct sh_header *h;
    struct sh_range *r;
    int slot;
    bool open, failed;
};

static struct sh_gpu gpus[SIM_MAX_GPUS]; /* by physical GPU */
static bool enabled;
static __thread uint64_t turn_wait_ns;

bool sim_shared_enabled(void)
{
    return enabled;
}

/* No memory_file given: the GPU's memory is a file in the shared directory. Runs once, in cuInit
 * before anything reads the configuration's memory_file (the only change made to sim_cfg after
 * it is read). */
static void default_memory_file(void)
{
    if (sim_cfg.memory_file[0] != '\0')
        return;
    char u[33];
    for (int i = 0; i < 16; i++)
        snprintf(u + 2 * i, 3, "%02x", sim_cfg.uuid[i]);
    /* shared_dir leaves room for the name (sim_config.c); built in parts so that the compiler
     * sees no truncation */
    size_t n = strlen(sim_cfg.shared_dir);
    memcpy(sim_cfg.memory_file, sim_cfg.shared_dir, n);
    memcpy(sim_cfg.memory_file + n, "/gpu-", 5);
    memcpy(sim_cfg.memory_file + n + 5, u, 32);
    memcpy(sim_cfg.memory_file + n + 37, ".mem", sizeof(".mem"));
}

/* One OFD lock operation on byte `at`, retried when a signal interrupts a wait. */
static int ofd(int fd, int cmd, short type, long long at)
{
    struct flock fl;
    memset(&fl, 0, sizeof(fl)); /* l_pid must be 0 for OFD locks */
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)at;
    fl.l_len = 1;
    int rc;
    do {
        rc = fcntl(fd, cmd, &fl);
    } while (rc != 0 && errno == EINTR);
    return rc;
}

/* Whether the process of slot s lives (holds the slot's lock). When that cannot be found out it
 * counts as alive: keeping a dead process's memory is safer than handing out a live one's. */
static bool slot_alive(const struct sh_gpu *g, uint32_t s)
{
    if ((int)s == g->slot)
        return true;
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(LOCK_SLOT0 + s);
    fl.l_len = 1;
    if (fcntl(g->fd, F_OFD_GETLK, &fl) != 0)
        return true;
    return fl.l_type != F_UNLCK;
}

static int lock_alloc(const struct sh_gpu *g)
{
    if (ofd(g->fd, F_OFD_SETLKW, F_WRLCK, LOCK_ALLOC) == 0)
        return 0;
    fprintf(stderr, "gpupool-sim: cannot lock the shared GPU state: %s\n", strerror(errno));
    return -1;
}

static void unlock_alloc(const struct sh_gpu *g)
{
    if (ofd(g->fd, F_OFD_SETLK, F_UNLCK, LOCK_ALLOC) != 0)
        fprintf(stderr, "gpupool-sim: cannot unlock the shared GPU state: %s\n", strerror(errno));
}

/* Takes back the ranges of dead processes (and any entry that is not a valid range); returns the
 * bytes the live ones hold. Allocation lock held. */
static uint64_t reap(struct sh_gpu *g)
{
    signed char alive[SH_SLOTS];
    memset(alive, -1, sizeof(alive));
    uint64_t used = 0, usable = g->h->usable;
    uint32_t hwm = g->h->hwm < SH_RANGES ? g->h->hwm : SH_RANGES;
    for (uint32_t i = 0; i < hwm; i++) {
        struct sh_range *r = &g->r[i];
        if (!__atomic_load_n(&r->in_use, __ATOMIC_ACQUIRE))
            continue;
        uint32_t s = r->slot;
        bool valid = s < SH_SLOTS && r->len > 0 && r->off <= usable && r->len <= usable - r->off;
        if (valid && alive[s] < 0)
            alive[s] = slot_alive(g, s) ? 1 : 0;
        if (!valid || !alive[s]) {
            __atomic_store_n(&r->in_use, 0, __ATOMIC_RELEASE);
            continue;
        }
        used += r->len;
    }
    return used;
}

static int by_offset(const void *a, const void *b)
{
    uint64_t x = ((const struct sh_range *)a)->off, y = ((const struct sh_range *)b)->off;
    return x < y ? -1 : x > y;
}

/* First fit of len bytes over every process's ranges. Allocation lock held, dead ones reaped. */
static CUresult place(struct sh_gpu *g, uint64_t len, uint64_t *rel_off)
{
    uint32_t hwm = g->h->hwm < SH_RANGES ? g->h->hwm : SH_RANGES;
    struct sh_range *live = malloc(((size_t)hwm + 1) * sizeof(*live));
    if (!live)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t n = 0;
    uint32_t free_entry = hwm;
    for (uint32_t i = 0; i < hwm; i++) {
        if (__atomic_load_n(&g->r[i].in_use, __ATOMIC_ACQUIRE))
            live[n++] = g->r[i];
        else if (free_entry == hwm)
            free_entry = i;
    }
    qsort(live, n, sizeof(*live), by_offset);
    uint64_t cand = 0;
    size_t i = 0;
    for (; i < n; i++) {
        if (live[i].off - cand >= len)
            break;
        cand = live[i].off + live[i].len;
    }
    free(live);
    if (g->h->usable - cand < len)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (free_entry == SH_RANGES) {
        fprintf(stderr, "gpupool-sim: the shared GPU's table of %u allocations is full\n",
                SH_RANGES);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct sh_range *r = &g->r[free_entry];
    r->off = cand;
    r->len = len;
    r->slot = (uint32_t)g->slot;
    if (free_entry == hwm)
        g->h->hwm = hwm + 1;
    __atomic_store_n(&r->in_use, 1, __ATOMIC_RELEASE); /* complete before it counts */
    *rel_off = cand;
    return CUDA_SUCCESS;
}

/* Sets up a new (or half set up) state file, or checks an existing one. Allocation lock held. */
static const char *attach(struct sh_gpu *g, uint64_t usable, char *why, size_t why_len)
{
    struct stat st;
    if (fstat(g->fd, &st) != 0)
        return strerror(errno);
    if (!S_ISREG(st.st_mode))
        return "not a regular file";
    if (st.st_uid != geteuid())
        return "belongs to another user (remove it: it says who holds which tenant's memory)";
    if ((uint64_t)st.st_size != SH_FILE_SIZE) {
        if (st.st_size != 0)
            return "not a state file of this version (remove it when no process uses the GPU)";
        if (ftruncate(g->fd, (off_t)SH_FILE_SIZE) != 0)
            return strerror(errno);
    }
    void *p = mmap(NULL, SH_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, g->fd, 0);
    if (p == MAP_FAILED)
        return strerror(errno);
    g->h = p;
    g->r = (struct sh_range *)((char *)p + SH_RANGES_AT);
    if (g->h->magic != SH_MAGIC) {
        /* New, or its creator died setting it up (under the same lock): start it afresh. */
        memset(g->h, 0, sizeof(*g->h));
        g->h->version = SH_VERSION;
        g->h->slots = SH_SLOTS;
        g->h->ranges = SH_RANGES;
        g->h->usable = usable;
        __atomic_store_n(&g->h->magic, SH_MAGIC, __ATOMIC_RELEASE);
    } else if (g->h->version != SH_VERSION || g->h->slots != SH_SLOTS ||
               g->h->ranges != SH_RANGES) {
        return "written by another version of the simulated device (remove it when no process "
               "uses the GPU)";
    } else if (g->h->usable != usable) {
        snprintf(why, why_len,
                 "its processes disagree on the GPU's memory: the file says %llu bytes, this "
                 "process's total_memory %llu; give every process of the GPU the same "
                 "configuration",
                 (unsigned long long)g->h->usable, (unsigned long long)usable);
        return why;
    }
    /* A slot nobody holds; what a dead holder left in it is taken back (not cleared). */
    for (int s = 0; s < SH_SLOTS; s++) {
        if (ofd(g->fd, F_OFD_SETLK, F_WRLCK, LOCK_SLOT0 + s) != 0)
            continue;
        g->slot = s;
        __atomic_store_n(&g->h->waiting[s], 0, __ATOMIC_RELAXED);
        uint32_t hwm = g->h->hwm < SH_RANGES ? g->h->hwm : SH_RANGES;
        for (uint32_t i = 0; i < hwm; i++)
            if (g->r[i].slot == (uint32_t)s)
                __atomic_store_n(&g->r[i].in_use, 0, __ATOMIC_RELEASE);
        return NULL;
    }
    return "more than 256 processes use this GPU at once";
}

/* Opens GPU phys's state file and claims a slot; on failure the reason is in why. */
static int open_gpu(int phys, struct sh_gpu *g, char *why, size_t why_len)
{
    unsigned char uuid[16];
    sim_phys_uuid(&sim_cfg, phys, uuid);
    char path[SIM_PATH_MAX + 64];
    int n = snprintf(path, sizeof(path), "%s/gpu-", sim_cfg.shared_dir);
    for (int i = 0; i < 16 && n > 0 && (size_t)n + 3 < sizeof(path); i++)
        n += snprintf(path + n, sizeof(path) - (size_t)n, "%02x", uuid[i]);
    if (n < 0 || (size_t)n + sizeof(".state") > sizeof(path)) {
        snprintf(why, why_len, "shared_dir: path too long");
        return -1;
    }
    memcpy(path + n, ".state", sizeof(".state"));
    /* 0600 and never through a link, as the memory file (sim_memfile.c). */
    g->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (g->fd < 0) {
        snprintf(why, why_len,
                 "cannot open the shared GPU state %s (key shared_dir): %s; check that the "
                 "directory exists and is writable",
                 path, strerror(errno));
        return -1;
    }
    if (lock_alloc(g) != 0) {
        snprintf(why, why_len, "cannot lock the shared GPU state %s", path);
        if (close(g->fd) != 0)
            fprintf(stderr, "gpupool-sim: close failed\n");
        return -1;
    }
    char detail[256];
    const char *bad = attach(g, sim_cfg.total_memory / PAGE * PAGE, detail, sizeof(detail));
    unlock_alloc(g);
    if (bad) {
        snprintf(why, why_len, "shared GPU state %s (key shared_dir): %s", path, bad);
        if (g->h && munmap(g->h, SH_FILE_SIZE) != 0)
            fprintf(stderr, "gpupool-sim: munmap failed\n");
        g->h = NULL;
        if (close(g->fd) != 0)
            fprintf(stderr, "gpupool-sim: close failed\n");
        return -1;
    }
    return 0;
}

/* GPU phys's state, opened on first use (peers only when memory moves there); NULL when the GPU
 * is not shared or its state cannot be used (said on stderr once). */
static struct sh_gpu *gpu(int phys)
{
    if (!enabled || phys < 0 || phys >= SIM_MAX_GPUS)
        return NULL;
    struct sh_gpu *g = &gpus[phys];
    if (g->open)
        return g;
    if (g->failed)
        return NULL;
    char why[SIM_PATH_MAX + 512];
    if (open_gpu(phys, g, why, sizeof(why)) != 0) {
        g->failed = true;
        fprintf(stderr, "gpupool-sim: %s\n", why);
        return NULL;
    }
    g->open = true;
    return g;
}

CUresult sim_shared_init(void)
{
    if (sim_cfg.shared_dir[0] == '\0')
        return CUDA_SUCCESS;
    enabled = true;
    default_memory_file();
    for (int d = 0; d < sim_cfg.device_count; d++) {
        struct sh_gpu *g = &gpus[d];
        char why[SIM_PATH_MAX + 512];
        if (g->open)
            continue;
        if (open_gpu(d, g, why, sizeof(why)) != 0) {
            g->failed = true;
            sim_init_fail("%s", why);
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
        g->open = true;
    }
    return CUDA_SUCCESS;
}

CUresult sim_shared_alloc(int phys, uint64_t len, uint64_t *rel_off)
{
    struct sh_gpu *g = gpu(phys);
    if (!g || lock_alloc(g) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t used = reap(g);
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (len <= g->h->usable - used)
        rc = place(g, len, rel_off);
    unlock_alloc(g);
    return rc;
}

void sim_shared_free(int phys, uint64_t rel_off)
{
    struct sh_gpu *g = gpu(phys);
    if (!g || lock_alloc(g) != 0)
        return;
    bool found = false;
    uint32_t hwm = g->h->hwm < SH_RANGES ? g->h->hwm : SH_RANGES;
    for (uint32_t i = 0; i < hwm && !found; i++) {
        struct sh_range *r = &g->r[i];
        if (r->in_use && r->slot == (uint32_t)g->slot && r->off == rel_off) {
            __atomic_store_n(&r->in_use, 0, __ATOMIC_RELEASE); /* the bytes stay */
            found = true;
        }
    }
    unlock_alloc(g);
    if (!found) /* a bookkeeping bug: callers free only what they allocated */
        fprintf(stderr, "gpupool-sim: shared GPU range at %llu is not this process's\n",
                (unsigned long long)rel_off);
}

uint64_t sim_shared_used(int phys)
{
    struct sh_gpu *g = gpu(phys);
    if (!g || lock_alloc(g) != 0)
        return 0;
    uint64_t used = reap(g);
    unlock_alloc(g);
    return used;
}

static bool others_waiting(const struct sh_gpu *g)
{
    for (int s = 0; s < SH_SLOTS; s++)
        if (s != g->slot && __atomic_load_n(&g->h->waiting[s], __ATOMIC_ACQUIRE))
            return true;
    return false;
}

/* A process whose kernel ran last lets a waiting process go first. Bounded: a waiter that died
 * waiting leaves its mark, which is cleared once the wait runs out. */
static void let_waiter_go_first(struct sh_gpu *g)
{
    uint64_t start = sim_now_ns();
    while (__atomic_load_n(&g->h->last_turn, __ATOMIC_ACQUIRE) == (uint32_t)g->slot + 1 &&
           others_waiting(g)) {
        if (sim_now_ns() - start > POLITE_MAX_NS) {
            for (uint32_t s = 0; s < SH_SLOTS; s++)
                if (g->h->waiting[s] && !slot_alive(g, s))
                    __atomic_store_n(&g->h->waiting[s], 0, __ATOMIC_RELEASE);
            return;
        }
        struct timespec ts = {0, POLITE_STEP_NS};
        nanosleep(&ts, NULL); /* an early wake-up only means one more look */
    }
}

void sim_shared_turn_begin(int phys)
{
    struct sh_gpu *g = gpu(phys);
    if (!g)
        return;
    uint64_t t0 = sim_now_ns();
    let_waiter_go_first(g);
    __atomic_store_n(&g->h->waiting[g->slot], 1, __ATOMIC_RELEASE);
    if (ofd(g->fd, F_OFD_SETLKW, F_WRLCK, LOCK_TURN) != 0)
        fprintf(stderr,
                "gpupool-sim: cannot wait for the shared GPU's kernel turn (%s); the kernel "
                "runs without it\n",
                strerror(errno));
    __atomic_store_n(&g->h->waiting[g->slot], 0, __ATOMIC_RELEASE);
    __atomic_store_n(&g->h->last_turn, (uint32_t)g->slot + 1, __ATOMIC_RELEASE);
    turn_wait_ns += sim_now_ns() - t0;
}

void sim_shared_turn_end(int phys)
{
    struct sh_gpu *g = gpu(phys);
    if (g && ofd(g->fd, F_OFD_SETLK, F_UNLCK, LOCK_TURN) != 0)
        fprintf(stderr, "gpupool-sim: cannot end the shared GPU's kernel turn: %s\n",
                strerror(errno));
}

uint64_t gpupoolSimTurnWaitNs(void)
{
    return turn_wait_ns;
}
