/*
 * test_sim_checkpoint.c: cuCheckpointProcess* on processes using the simulated device: the
 * states and their errors, a lock that holds every CUDA call of the target, a lock that times
 * out while a kernel runs, and checkpoint + restore that bring back every byte at the same
 * addresses, with and without a memory file, on the same GPU and on another one (UUID pairs),
 * while the device memory in between is given back (and wiped, as a scrub would), and a
 * process holding two GPUs (one opened as a peer) restored onto two others, every GPU paired.
 *
 * The target is a forked child (its own cuInit) that talks to the test over pipes; the test
 * process calls the checkpoint API on the child's pid after its own cuInit.
 */
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>

#include "sim_test.h"

#define KIB 1024ull
#define MIB (1024ull * KIB)

struct target {
    pid_t pid;
    int to_child, from_child; /* pipes: commands in, reports out */
};

static void say(int fd, const void *buf, size_t n)
{
    CHECK(write(fd, buf, n) == (ssize_t)n);
}

static void hear(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        CHECK(r > 0);
        got += (size_t)r;
    }
}

/* Forks a target running fn(commands, reports); the child exits 0 when fn returns. */
static struct target spawn(void (*fn)(int in, int out))
{
    int down[2], up[2];
    CHECK(pipe(down) == 0 && pipe(up) == 0);
    CHECK(fflush(NULL) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        CHECK(close(down[1]) == 0 && close(up[0]) == 0);
        fn(down[0], up[1]);
        exit(0);
    }
    CHECK(close(down[0]) == 0 && close(up[1]) == 0);
    return (struct target){.pid = pid, .to_child = down[1], .from_child = up[0]};
}

static void reap(struct target *t)
{
    int status = 0;
    CHECK(waitpid(t->pid, &status, 0) == t->pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(close(t->to_child) == 0 && close(t->from_child) == 0);
}

static CUprocessState state_of(pid_t pid)
{
    CUprocessState s = -1;
    OK(cuCheckpointProcessGetState(pid, &s));
    return s;
}

static double now_s(void)
{
    struct timespec ts;
    CHECK(clock_gettime(CLOCK_MONOTONIC, &ts) == 0);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- states --------------------------------------------------------------------------- */

static void idle_target(int in, int out)
{
    CUdeviceptr p;
    sim_test_init();
    OK(cuMemAlloc_v2(&p, 4096)); /* GPU 0 holds memory: a restore's pair list must name it */
    char c = 'r';
    say(out, &c, 1);
    hear(in, &c, 1); /* until the test is done with us */
}

static void test_states_and_errors(void)
{
    struct target t = spawn(idle_target);
    char c;
    hear(t.from_child, &c, 1);
    CHECK_RC(cuCheckpointProcessGetState(t.pid, &(CUprocessState){0}), CUDA_ERROR_NOT_INITIALIZED);
    OK(cuInit(0));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_RUNNING);
    CHECK_RC(cuCheckpointProcessCheckpoint(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    CHECK_RC(cuCheckpointProcessRestore(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    CHECK_RC(cuCheckpointProcessUnlock(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    OK(cuCheckpointProcessLock(t.pid, NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_LOCKED);
    CHECK_RC(cuCheckpointProcessLock(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    CHECK_RC(cuCheckpointProcessRestore(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    OK(cuCheckpointProcessCheckpoint(t.pid, NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_CHECKPOINTED);
    CHECK_RC(cuCheckpointProcessUnlock(t.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    /* A pair list that leaves the GPU in use out is refused and changes nothing. */
    CUcheckpointGpuPair pair;
    memset(&pair, 0x5a, sizeof(pair));
    CUcheckpointRestoreArgs ra;
    memset(&ra, 0, sizeof(ra));
    ra.gpuPairs = &pair;
    ra.gpuPairsCount = 1;
    CHECK_RC(cuCheckpointProcessRestore(t.pid, &ra), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_CHECKPOINTED);
    OK(cuCheckpointProcessRestore(t.pid, NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_LOCKED);
    int tid = 0;
    OK(cuCheckpointProcessGetRestoreThreadId(t.pid, &tid));
    CHECK(tid > 0);
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_RUNNING);
    CHECK_RC(cuCheckpointProcessGetState(t.pid, NULL), CUDA_ERROR_INVALID_VALUE);
    say(t.to_child, &c, 1);
    reap(&t);
    /* A process that is gone (or never used CUDA) is not a CUDA process. */
    CHECK_RC(cuCheckpointProcessGetState(t.pid, &(CUprocessState){0}), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuCheckpointProcessLock(-1, NULL), CUDA_ERROR_INVALID_VALUE);
}

/* ---- a lock holds the target's calls ------------------------------------------------------ */

static volatile long *calls; /* shared with the target: calls it has completed */
static volatile int *stop;

static void busy_target(int in, int out)
{
    (void)in;
    sim_test_init();
    char c = 'r';
    say(out, &c, 1);
    while (!*stop) {
        size_t free_b, total_b;
        OK(cuMemGetInfo_v2(&free_b, &total_b));
        __atomic_add_fetch(calls, 1, __ATOMIC_SEQ_CST);
    }
}

static void test_lock_holds_every_call(void)
{
    void *shm = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(shm != MAP_FAILED);
    calls = shm;
    stop = (volatile int *)((char *)shm + 64);
    struct target t = spawn(busy_target);
    char c;
    hear(t.from_child, &c, 1);
    OK(cuInit(0));
    usleep(50 * 1000);
    OK(cuCheckpointProcessLock(t.pid, NULL));
    usleep(50 * 1000); /* a call that had the lock before us has finished counting */
    long held = __atomic_load_n(calls, __ATOMIC_SEQ_CST);
    usleep(300 * 1000);
    CHECK_EQ(__atomic_load_n(calls, __ATOMIC_SEQ_CST), held);
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    usleep(100 * 1000);
    CHECK(__atomic_load_n(calls, __ATOMIC_SEQ_CST) > held);
    *stop = 1;
    reap(&t);
    CHECK(munmap(shm, 4096) == 0);
}

/* ---- a lock waits for a kernel, or times out -------------------------------------------------- */

static void spin_target(int in, int out)
{
    sim_test_init();
    size_t n = 0;
    unsigned char *image = sim_test_input("GP_SIM_TEST_CUBIN", &n);
    CUmodule mod;
    CUfunction fn;
    OK(cuModuleLoadData(&mod, image));
    OK(cuModuleGetFunction(&fn, mod, "gp_test_spin"));
    unsigned long long ns = 1500ull * 1000 * 1000;
    void *args[] = {&ns};
    char c = 'r';
    say(out, &c, 1);
    OK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL)); /* holds the sim 1.5 s */
    hear(in, &c, 1);
    free(image);
}

static void test_lock_waits_for_work_or_times_out(void)
{
    if (!getenv("GP_SIM_TEST_CUBIN"))
        sim_test_skip("GP_SIM_TEST_CUBIN not set (nvcc-built test kernels)");
    struct target t = spawn(spin_target);
    char c;
    hear(t.from_child, &c, 1);
    OK(cuInit(0));
    usleep(200 * 1000); /* the kernel is running */
    CUcheckpointLockArgs la;
    memset(&la, 0, sizeof(la));
    la.timeoutMs = 100;
    double t0 = now_s();
    CHECK_RC(cuCheckpointProcessLock(t.pid, &la), CUDA_ERROR_NOT_READY);
    CHECK(now_s() - t0 < 1.0);
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_RUNNING);
    la.timeoutMs = 0; /* no limit: waits for the kernel */
    OK(cuCheckpointProcessLock(t.pid, &la));
    CHECK(now_s() - t0 >= 1.0);
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    say(t.to_child, &c, 1);
    reap(&t);
}

/* ---- checkpoint and restore ----------------------------------------------------------------- */

#define NALLOC 4
static const uint64_t alloc_sizes[NALLOC] = {1000, 3 * MIB + 5, 64 * KIB + 1, 4096};

struct layout {
    CUdeviceptr heap[NALLOC];
    CUdeviceptr vmm; /* 2 granules, both mapped from one allocation */
    uint64_t vmm_size;
    size_t free_before;
};

static void expect(CUdeviceptr p, uint64_t n, unsigned seed)
{
    unsigned char *b = malloc(n);
    CHECK(b != NULL);
    OK(cuMemcpyDtoH_v2(b, p, n));
    for (uint64_t i = 0; i < n; i++)
        if (b[i] != sim_test_pattern(seed, i)) {
            fprintf(stderr, "byte %llu of 0x%llx: %u, expected %u\n", (unsigned long long)i,
                    (unsigned long long)p, b[i], sim_test_pattern(seed, i));
            CHECK(0);
        }
    free(b);
}

static bool report_pci; /* the tenant says its PCI address after the restore */

static void tenant(int in, int out)
{
    sim_test_init();
    struct layout L;
    memset(&L, 0, sizeof(L));
    for (int i = 0; i < NALLOC; i++) {
        OK(cuMemAlloc_v2(&L.heap[i], alloc_sizes[i]));
        sim_test_fill(L.heap[i], alloc_sizes[i], (unsigned)i + 1);
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    L.vmm_size = 2 * g;
    CUmemGenericAllocationHandle h;
    OK(cuMemAddressReserve(&L.vmm, L.vmm_size, 0, 0, 0));
    OK(cuMemCreate(&h, L.vmm_size, &prop, 0));
    OK(cuMemMap(L.vmm, L.vmm_size, 0, h, 0));
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(L.vmm, L.vmm_size, &acc, 1));
    sim_test_fill(L.vmm, L.vmm_size, 9);
    size_t total = 0;
    OK(cuMemGetInfo_v2(&L.free_before, &total));
    say(out, &L, sizeof(L));
    /* The test checkpoints and restores us here, then says which GPU we should be on. */
    CUuuid want;
    hear(in, &want, sizeof(want));
    for (int i = 0; i < NALLOC; i++)
        expect(L.heap[i], alloc_sizes[i], (unsigned)i + 1);
    expect(L.vmm, L.vmm_size, 9);
    size_t free_after = 0;
    OK(cuMemGetInfo_v2(&free_after, &total));
    CHECK_EQ(free_after, L.free_before);
    CUuuid uuid;
    OK(cuDeviceGetUuid(&uuid, 0));
    CHECK(memcmp(uuid.bytes, want.bytes, 16) == 0);
    if (report_pci) { /* where the ordinal sits now, for the test to check */
        char bus[16] = {0};
        OK(cuDeviceGetPCIBusId(bus, sizeof(bus), 0));
        say(out, bus, sizeof(bus));
    }
    /* Everything still works: kernels' memory, frees, new allocations. */
    for (int i = 0; i < NALLOC; i++)
        OK(cuMemFree_v2(L.heap[i]));
    OK(cuMemUnmap(L.vmm, L.vmm_size));
    OK(cuMemRelease(h));
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, MIB));
    sim_test_fill(p, MIB, 5);
    expect(p, MIB, 5);
    OK(cuMemFree_v2(p));
}

static char dir[64], file[128];

static void use_memory_file(void)
{
    snprintf(dir, sizeof(dir), "/tmp/gp_ckpt_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(file, sizeof(file), "%s/gpu.mem", dir);
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", file, 1) == 0);
}

/* What a scrub does to the GPUs between two tenants: every byte of the memory file zeroed. */
static void wipe_memory_file(void)
{
    int fd = open(file, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0);
    struct stat st;
    CHECK(fstat(fd, &st) == 0);
    CHECK(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, st.st_size) == 0);
    CHECK(close(fd) == 0);
}

/* How many bytes of the memory file's part `dev` are not zero. */
static uint64_t nonzero_in_part(int dev, uint64_t part)
{
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    uint64_t n = 0;
    static unsigned char buf[1 << 16];
    for (uint64_t off = 0; off < part; off += sizeof(buf)) {
        ssize_t r = pread(fd, buf, sizeof(buf), (off_t)((uint64_t)dev * part + off));
        CHECK(r > 0);
        for (ssize_t i = 0; i < r; i++)
            n += buf[i] != 0;
    }
    CHECK(close(fd) == 0);
    return n;
}

static void uuid_of(int dev, CUuuid *u)
{
    CUdevice d;
    OK(cuDeviceGet(&d, dev));
    OK(cuDeviceGetUuid(u, d));
}

static void checkpoint_and_restore(bool memory_file, bool move)
{
    uint64_t part = 256 * MIB;
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "256MiB", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_DEVICE_COUNT", "2", 1) == 0);
    if (memory_file)
        use_memory_file();
    struct target t = spawn(tenant);
    struct layout L;
    hear(t.from_child, &L, sizeof(L));
    OK(cuInit(0));
    CUuuid u0, u1;
    uuid_of(0, &u0);
    uuid_of(1, &u1);
    OK(cuCheckpointProcessLock(t.pid, NULL));
    OK(cuCheckpointProcessCheckpoint(t.pid, NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_CHECKPOINTED);
    if (memory_file) {
        CHECK(nonzero_in_part(0, part) > 3 * MIB); /* the tenant's bytes, until the scrub */
        wipe_memory_file();
    }
    CUcheckpointGpuPair pair = {.oldUuid = u0, .newUuid = u1};
    CUcheckpointRestoreArgs ra;
    memset(&ra, 0, sizeof(ra));
    ra.gpuPairs = &pair;
    ra.gpuPairsCount = 1;
    OK(cuCheckpointProcessRestore(t.pid, move ? &ra : NULL));
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_LOCKED);
    if (memory_file) { /* the bytes are back, in the part of the GPU restored onto */
        CHECK(nonzero_in_part(move ? 1 : 0, part) > 3 * MIB);
        CHECK_EQ(nonzero_in_part(move ? 0 : 1, part), 0);
    }
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    say(t.to_child, move ? &u1 : &u0, sizeof(CUuuid));
    reap(&t);
    if (memory_file) {
        CHECK(unlink(file) == 0);
        CHECK(rmdir(dir) == 0);
    }
}

static void test_restore_same_gpu_memory_file(void)
{
    checkpoint_and_restore(true, false);
}

static void test_restore_other_gpu_memory_file(void)
{
    checkpoint_and_restore(true, true);
}

static void test_restore_same_gpu_anonymous(void)
{
    checkpoint_and_restore(false, false);
}

static void test_restore_other_gpu_anonymous(void)
{
    checkpoint_and_restore(false, true);
}

/* A server of many simulated GPUs lists every other one as a peer of each: a restore onto the
 * 40th peer (past the 16 devices a process may have), whose PCI address has a domain of its
 * own, brings the bytes back in that peer's memory file and reports its UUID and address. */
static void test_restore_onto_far_peer(void)
{
    enum {
        NPEERS = 40
    };
    uint64_t part = 256 * MIB;
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "256MiB", 1) == 0);
    use_memory_file();
    static char conf[NPEERS * 160];
    size_t len = 0;
    char peer_file[sizeof(file)];
    for (int k = 0; k < NPEERS; k++) {
        int n = snprintf(conf + len, sizeof(conf) - len,
                         "peer = 00112233445566778899aabbccdd%04x %04x:%02x:00.0 %s/peer%d.mem\n",
                         k, 1 + k / 15, 0x18 + 0x10 * (k % 15), dir, k);
        CHECK(n > 0 && (size_t)n < sizeof(conf) - len);
        len += (size_t)n;
    }
    const char *path = sim_test_write_temp(conf);
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    report_pci = true;
    struct target t = spawn(tenant);
    struct layout L;
    hear(t.from_child, &L, sizeof(L));
    OK(cuInit(0));
    int count = 0;
    OK(cuDeviceGetCount(&count));
    CHECK_EQ(count, 1); /* peers are restore targets, not devices */
    CUuuid u0, far;
    uuid_of(0, &u0);
    static const unsigned char far_bytes[16] = {0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77,
                                                0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0x00, 39};
    memcpy(far.bytes, far_bytes, 16);
    OK(cuCheckpointProcessLock(t.pid, NULL));
    OK(cuCheckpointProcessCheckpoint(t.pid, NULL));
    wipe_memory_file();
    CUcheckpointGpuPair pair = {.oldUuid = u0, .newUuid = far};
    CUcheckpointRestoreArgs ra;
    memset(&ra, 0, sizeof(ra));
    ra.gpuPairs = &pair;
    ra.gpuPairsCount = 1;
    OK(cuCheckpointProcessRestore(t.pid, &ra));
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    CHECK_EQ(nonzero_in_part(0, part), 0);
    snprintf(peer_file, sizeof(peer_file), "%s/peer39.mem", dir);
    memcpy(file, peer_file, sizeof(file)); /* nonzero_in_part reads `file` */
    CHECK(nonzero_in_part(0, part) > 3 * MIB);
    say(t.to_child, &far, sizeof(far));
    char bus[16];
    hear(t.from_child, bus, sizeof(bus));
    CHECK(strcmp(bus, "0003:a8:00.0") == 0); /* peer 39: domain 1 + 39 / 15, bus 0x18 + 0x10 x 9 */
    reap(&t);
    CHECK(unlink(peer_file) == 0);
    snprintf(file, sizeof(file), "%s/gpu.mem", dir);
    CHECK(unlink(file) == 0);
    CHECK(rmdir(dir) == 0);
    CHECK(unlink(path) == 0);
}

/* A worker holding both GPUs of a lease of 2 (issue 37): gpupoold's simulated GPU 0 lists the
 * server's GPUs 1..3 as peers, each with its own memory file, and the worker opens GPU 1 as its
 * ordinal 1 (cuDeviceGet(1)). Both ordinals hold memory; the checkpoint takes both, the GPUs are
 * wiped, and the restore pairs every GPU (0 -> 2, 1 -> 3): each ordinal's bytes come back at the
 * same addresses in the new GPU's memory file, and the ordinals report the new GPUs' UUIDs. A
 * pair list that leaves out the opened peer is refused, since it holds memory. */
#define LEASE_GPUS 2
static const uint64_t lease_sizes[LEASE_GPUS] = {3 * MIB + 5, 2 * MIB + 3};

static void lease_tenant(int in, int out)
{
    CUcontext ctx[LEASE_GPUS];
    CUdeviceptr p[LEASE_GPUS];
    ctx[0] = sim_test_init();
    CUdevice d1;
    OK(cuDeviceGet(&d1, 1)); /* peer 0, GPU 1 of the server, as this process's ordinal 1 */
    CHECK_EQ(d1, 1);
    OK(cuDevicePrimaryCtxRetain(&ctx[1], d1));
    for (int k = 0; k < LEASE_GPUS; k++) {
        OK(cuCtxSetCurrent(ctx[k]));
        OK(cuMemAlloc_v2(&p[k], lease_sizes[k]));
        sim_test_fill(p[k], lease_sizes[k], 20u + (unsigned)k);
    }
    say(out, p, sizeof(p));
    CUuuid want[LEASE_GPUS];
    hear(in, want, sizeof(want));
    for (int k = 0; k < LEASE_GPUS; k++) {
        OK(cuCtxSetCurrent(ctx[k]));
        expect(p[k], lease_sizes[k], 20u + (unsigned)k);
        CUuuid u;
        OK(cuDeviceGetUuid(&u, k));
        CHECK(memcmp(u.bytes, want[k].bytes, 16) == 0);
        OK(cuMemFree_v2(p[k]));
    }
}

/* How many of the n bytes that sim_test_fill(seed) writes are not zero. */
static uint64_t nonzero_of_pattern(unsigned seed, uint64_t n)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++)
        k += sim_test_pattern(seed, i) != 0;
    return k;
}

static void peer_file_name(char *out, size_t n, int peer)
{
    snprintf(out, n, "%s/peer%d.mem", dir, peer);
}

static uint64_t nonzero_in_file(const char *path, uint64_t part)
{
    char keep[sizeof(file)];
    memcpy(keep, file, sizeof(file));
    snprintf(file, sizeof(file), "%s", path);
    uint64_t n = nonzero_in_part(0, part);
    memcpy(file, keep, sizeof(file));
    return n;
}

static void test_restore_lease_of_two_gpus_onto_two_others(void)
{
    enum {
        NPEERS = 3
    };
    uint64_t part = 256 * MIB;
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "256MiB", 1) == 0);
    use_memory_file();
    char conf[NPEERS * 160];
    size_t len = 0;
    char peer_file[NPEERS][sizeof(file)];
    for (int k = 0; k < NPEERS; k++) {
        peer_file_name(peer_file[k], sizeof(peer_file[k]), k);
        int n = snprintf(conf + len, sizeof(conf) - len,
                         "peer = 00112233445566778899aabbccdd%04x 0000:%02x:00.0 %s\n", k, 0x20 + k,
                         peer_file[k]);
        CHECK(n > 0 && (size_t)n < sizeof(conf) - len);
        len += (size_t)n;
    }
    const char *path = sim_test_write_temp(conf);
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    struct target t = spawn(lease_tenant);
    CUdeviceptr p[LEASE_GPUS];
    hear(t.from_child, p, sizeof(p));
    OK(cuInit(0));
    CUuuid u[1 + NPEERS];
    for (int g = 0; g <= NPEERS; g++)
        uuid_of(g, &u[g]); /* GPU g of the server: device 0, then peer g - 1 */
    OK(cuCheckpointProcessLock(t.pid, NULL));
    OK(cuCheckpointProcessCheckpoint(t.pid, NULL));
    uint64_t bytes0 = nonzero_of_pattern(20, lease_sizes[0]);
    uint64_t bytes1 = nonzero_of_pattern(21, lease_sizes[1]);
    CHECK_EQ(nonzero_in_part(0, part), bytes0);            /* GPU 0's bytes, until the scrub */
    CHECK_EQ(nonzero_in_file(peer_file[0], part), bytes1); /* GPU 1's */
    wipe_memory_file();
    memcpy(file, peer_file[0], sizeof(file)); /* wipe_memory_file wipes `file` */
    wipe_memory_file();
    snprintf(file, sizeof(file), "%s/gpu.mem", dir);
    CUcheckpointGpuPair pairs[LEASE_GPUS] = {{.oldUuid = u[0], .newUuid = u[2]},
                                             {.oldUuid = u[1], .newUuid = u[3]}};
    CUcheckpointRestoreArgs ra;
    memset(&ra, 0, sizeof(ra));
    ra.gpuPairs = pairs;
    ra.gpuPairsCount = 1; /* GPU 1 left out: it holds memory, the restore is refused */
    CHECK_RC(cuCheckpointProcessRestore(t.pid, &ra), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(state_of(t.pid), CU_PROCESS_STATE_CHECKPOINTED);
    ra.gpuPairsCount = LEASE_GPUS;
    OK(cuCheckpointProcessRestore(t.pid, &ra));
    OK(cuCheckpointProcessUnlock(t.pid, NULL));
    CHECK_EQ(nonzero_in_part(0, part), 0);                 /* nothing back on GPU 0 */
    CHECK_EQ(nonzero_in_file(peer_file[0], part), 0);      /* nor on GPU 1 */
    CHECK_EQ(nonzero_in_file(peer_file[1], part), bytes0); /* GPU 0's bytes on GPU 2 */
    CHECK_EQ(nonzero_in_file(peer_file[2], part), bytes1); /* GPU 1's on GPU 3 */
    CUuuid want[LEASE_GPUS] = {u[2], u[3]};
    say(t.to_child, want, sizeof(want));
    reap(&t);
    for (int k = 0; k < NPEERS; k++)
        CHECK(unlink(peer_file[k]) == 0 || errno == ENOENT);
    CHECK(unlink(file) == 0);
    CHECK(rmdir(dir) == 0);
    CHECK(unlink(path) == 0);
}

SIM_TEST_MAIN(SIM_T(states_and_errors), SIM_T(lock_holds_every_call),
              SIM_T(lock_waits_for_work_or_times_out), SIM_T(restore_same_gpu_memory_file),
              SIM_T(restore_other_gpu_memory_file), SIM_T(restore_same_gpu_anonymous),
              SIM_T(restore_other_gpu_anonymous), SIM_T(restore_onto_far_peer),
              SIM_T(restore_lease_of_two_gpus_onto_two_others))
