/*
 * test_sim_shared.c: a simulated GPU shared by several processes (key shared_dir, sim_shared.c).
 *
 * Two "tenant" processes (forked children, each with its own cuInit) on one simulated GPU:
 * their memory together meets the GPU's size and cuMemGetInfo counts both; what one wrote and
 * freed (or left by dying) is what the next allocation reads, as on a GPU's DRAM (so an isolation
 * test of wiping has teeth); a dead process's memory comes back, a live one's does not; their
 * kernels take turns (their running intervals do not overlap, and both get turns). Without
 * shared_dir each process still has the GPU to itself. A share's VMM memory that its checkpoint
 * cannot zero (writes made to fail here) is not handed to the next share.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <time.h>

#include "sim_test.h"

#define MIB (1024ull * 1024)
#define TOTAL (64 * MIB) /* the smallest GPU the sim allows */

static char dir[64];

/* A fresh shared directory and a 64 MiB GPU for the tenants forked after this. */
static void use_shared_dir(void)
{
    snprintf(dir, sizeof(dir), "/tmp/gp_shared_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    CHECK(setenv("GPUPOOL_SIM_SHARED_DIR", dir, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "64MiB", 1) == 0);
}

/* How many files the shared directory holds; with remove, deletes them and the directory. */
static int shared_files(bool remove)
{
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        n++;
        if (remove) {
            char path[512];
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            CHECK(unlink(path) == 0);
        }
    }
    CHECK(closedir(d) == 0);
    if (remove)
        CHECK(rmdir(dir) == 0);
    return n;
}

static pid_t spawn(void (*fn)(int arg), int arg)
{
    CHECK(fflush(NULL) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        fn(arg);
        exit(0);
    }
    return pid;
}

static void wait_ok(pid_t pid)
{
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Bytes of [p, p+n) equal to v. */
static uint64_t count_byte(CUdeviceptr p, uint64_t n, unsigned char v)
{
    unsigned char *b = malloc(n);
    CHECK(b != NULL);
    OK(cuMemcpyDtoH_v2(b, p, n));
    uint64_t c = 0;
    for (uint64_t i = 0; i < n; i++)
        c += b[i] == v;
    free(b);
    return c;
}

static uint64_t free_now(void)
{
    size_t fr = 0, total = 0;
    OK(cuMemGetInfo_v2(&fr, &total));
    CHECK_EQ(total, TOTAL);
    return fr;
}

/* Pipes between the test and a tenant: the tenant says "ready", then waits for "go" (EOF). */
static int ready_pipe[2], go_pipe[2];

static void say_ready_and_wait(void)
{
    char c = 'r';
    CHECK(write(ready_pipe[1], &c, 1) == 1);
    CHECK(read(go_pipe[0], &c, 1) == 0); /* the test closes its end: go */
}

static void holder(int mib)
{
    CHECK(close(go_pipe[1]) == 0);
    sim_test_init();
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, (uint64_t)mib * MIB));
    CHECK_EQ(free_now(), TOTAL - (uint64_t)mib * MIB);
    say_ready_and_wait();
}

static void second_tenant(int unused)
{
    (void)unused;
    sim_test_init();
    CHECK_EQ(free_now(), TOTAL - 40 * MIB); /* the other process's 40 MiB are not free */
    CUdeviceptr p = 0;
    CHECK_RC(cuMemAlloc_v2(&p, 40 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, 20 * MIB));
    CHECK_EQ(free_now(), 4 * MIB);
    CHECK_RC(cuMemAlloc_v2(&p, 8 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
    /* cuMemCreate counts against the same memory */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    CHECK_RC(cuMemCreate(&h, 8 * MIB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemCreate(&h, 4 * MIB, &prop, 0));
    CHECK_EQ(free_now(), 0);
    OK(cuMemRelease(h));
}

/* Two processes' allocations together meet the GPU's size; a live holder keeps its memory. */
static void test_memory_is_the_gpus(void)
{
    use_shared_dir();
    CHECK(pipe(ready_pipe) == 0 && pipe(go_pipe) == 0);
    pid_t a = spawn(holder, 40);
    CHECK(close(go_pipe[0]) == 0);
    char c;
    CHECK(read(ready_pipe[0], &c, 1) == 1);
    wait_ok(spawn(second_tenant, 0));
    CHECK(close(go_pipe[1]) == 0);
    wait_ok(a);
    shared_files(true);
}

static void write_then(int die)
{
    sim_test_init();
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 48 * MIB));
    OK(cuMemsetD8_v2(p, 0xAB, 48 * MIB));
    if (die)
        raise(SIGKILL); /* a crashed tenant: nothing freed */
    OK(cuMemFree_v2(p));
}

static void read_after(int unused)
{
    (void)unused;
    sim_test_init();
    CHECK_EQ(free_now(), TOTAL); /* a dead process's 48 MiB came back */
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 48 * MIB));
    /* the driver does not clear memory between owners: every byte is the last owner's */
    CHECK_EQ(count_byte(p, 48 * MIB, 0xAB), 48 * MIB);
    /* a scrub's zeroing clears it for the next one */
    OK(cuMemsetD8_v2(p, 0, 48 * MIB));
    OK(cuMemFree_v2(p));
}

static void read_zeros(int unused)
{
    (void)unused;
    sim_test_init();
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 48 * MIB));
    CHECK_EQ(count_byte(p, 48 * MIB, 0), 48 * MIB);
}

static void test_leftovers_of_a_freed_allocation_are_visible(void)
{
    use_shared_dir();
    wait_ok(spawn(write_then, 0));
    wait_ok(spawn(read_after, 0));
    wait_ok(spawn(read_zeros, 0));
    shared_files(true);
}

static void test_a_dead_process_memory_is_taken_back(void)
{
    use_shared_dir();
    pid_t a = spawn(write_then, 1);
    int status = 0;
    CHECK(waitpid(a, &status, 0) == a);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    wait_ok(spawn(read_after, 0));
    shared_files(true);
}

/* ---- a checkpoint that cannot zero ----------------------------------------------------- */
/* Set in one tenant: the memory file's hole punching and writes fail there (EIO), as on a
 * failing disk; the library's calls reach these through the executable's symbols. */
static volatile int fail_file_writes;

__attribute__((visibility("default"))) int fallocate(int fd, int mode, off_t off, off_t len)
{
    if (fail_file_writes) {
        errno = EIO;
        return -1;
    }
    int (*real)(int, int, off_t, off_t) =
        (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate");
    CHECK(real != NULL);
    return real(fd, mode, off, len);
}

__attribute__((visibility("default"))) ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
    if (fail_file_writes) {
        errno = EIO;
        return -1;
    }
    ssize_t (*real)(int, const void *, size_t, off_t) =
        (ssize_t(*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
    CHECK(real != NULL);
    return real(fd, buf, n, off);
}

/* cuMemCreate + map of n bytes (a multiple of the granularity) on device 0. */
static CUdeviceptr vmm_alloc(uint64_t n)
{
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr p = 0;
    OK(cuMemCreate(&h, n, &prop, 0));
    OK(cuMemAddressReserve(&p, n, 0, 0, 0));
    OK(cuMemMap(p, n, 0, h, 0));
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(p, n, &acc, 1));
    return p;
}

static void vmm_writer(int unused)
{
    (void)unused;
    CHECK(close(go_pipe[1]) == 0);
    sim_test_init();
    CUdeviceptr p = vmm_alloc(16 * MIB);
    OK(cuMemsetD8_v2(p, 0xAB, 16 * MIB));
    fail_file_writes = 1; /* from here: the checkpoint's zeroing fails */
    say_ready_and_wait();
    fail_file_writes = 0;
}

static void checkpointer(int pid)
{
    sim_test_init();
    OK(cuCheckpointProcessLock(pid, NULL));
    OK(cuCheckpointProcessCheckpoint(pid, NULL)); /* its memory goes (the zeroing fails) */
}

static void vmm_reader(int unused)
{
    (void)unused;
    sim_test_init();
    /* All the memory file has left: the writer's range, had it come back unzeroed, is in it. */
    CUdeviceptr p = vmm_alloc(48 * MIB);
    CHECK_EQ(count_byte(p, 48 * MIB, 0xAB), 0);
    CHECK_EQ(count_byte(p, 48 * MIB, 0), 48 * MIB);
}

static void test_memory_a_checkpoint_cannot_zero_is_not_handed_on(void)
{
    use_shared_dir();
    CHECK(pipe(ready_pipe) == 0 && pipe(go_pipe) == 0);
    pid_t writer = spawn(vmm_writer, 0);
    CHECK(close(go_pipe[0]) == 0);
    char c;
    CHECK(read(ready_pipe[0], &c, 1) == 1);
    wait_ok(spawn(checkpointer, (int)writer));
    wait_ok(spawn(vmm_reader, 0));
    CHECK(close(go_pipe[1]) == 0);
    wait_ok(writer);
    CHECK(close(ready_pipe[0]) == 0 && close(ready_pipe[1]) == 0);
    shared_files(true);
}

/* ---- kernel turns ------------------------------------------------------------------------ */
#define LAUNCHES 8
#define SPIN_NS 20000000ull /* 20 ms of "GPU" time per kernel */

struct interval {
    uint64_t start, end; /* when the kernel ran (CLOCK_MONOTONIC, ns) */
};
static struct interval *runs; /* [tenant][launch], in memory shared with the children */

static uint64_t now_ns(void)
{
    struct timespec ts;
    CHECK(clock_gettime(CLOCK_MONOTONIC, &ts) == 0);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void spinner(int tenant)
{
    CHECK(close(go_pipe[1]) == 0);
    sim_test_init();
    CUmodule m = NULL;
    CUfunction f = NULL;
    OK(cuModuleLoadData(&m, sim_test_ptx));
    OK(cuModuleGetFunction(&f, m, "gp_test_spin"));
    say_ready_and_wait();
    for (int i = 0; i < LAUNCHES; i++) {
        unsigned long long ns = SPIN_NS;
        void *args[] = {&ns};
        uint64_t t0 = now_ns(), w0 = gpupoolSimTurnWaitNs();
        OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
        /* The kernel began no earlier than t0 plus the wait for its turn and spun SPIN_NS from
         * its start; when the launch returned says little on a busy machine (the process that
         * hands the turn on is often descheduled for the one that takes it). */
        uint64_t start = t0 + (gpupoolSimTurnWaitNs() - w0);
        CHECK(now_ns() >= start + SPIN_NS);
        runs[tenant * LAUNCHES + i] = (struct interval){start, start + SPIN_NS};
    }
}

static uint64_t overlap(struct interval a, struct interval b)
{
    uint64_t s = a.start > b.start ? a.start : b.start, e = a.end < b.end ? a.end : b.end;
    return e > s ? e - s : 0;
}

static void test_kernels_of_two_processes_take_turns(void)
{
    use_shared_dir();
    runs = mmap(NULL, 2 * LAUNCHES * sizeof(*runs), PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(runs != MAP_FAILED);
    CHECK(pipe(ready_pipe) == 0 && pipe(go_pipe) == 0);
    pid_t a = spawn(spinner, 0), b = spawn(spinner, 1);
    CHECK(close(go_pipe[0]) == 0);
    char c;
    CHECK(read(ready_pipe[0], &c, 1) == 1 && read(ready_pipe[0], &c, 1) == 1);
    CHECK(close(go_pipe[1]) == 0); /* both start launching now */
    wait_ok(a);
    wait_ok(b);
    uint64_t both = 0, first_start[2], last_end[2];
    for (int t = 0; t < 2; t++) {
        first_start[t] = runs[t * LAUNCHES].start;
        last_end[t] = runs[t * LAUNCHES + LAUNCHES - 1].end;
    }
    for (int i = 0; i < LAUNCHES; i++)
        for (int j = 0; j < LAUNCHES; j++)
            both += overlap(runs[i], runs[LAUNCHES + j]);
    /* Serialised: only the moments between a launch's first clock read and its wait for the turn
     * can meet the other's kernels (microseconds, more when a busy machine deschedules the
     * process there): at most 20 ms in all, where kernels running side by side would overlap
     * for up to the 160 ms each process spins. */
    if (both > 20000000ull) {
        fprintf(stderr, "kernels of the two processes ran at the same time for %llu ns\n",
                (unsigned long long)both);
        exit(1);
    }
    /* Both got turns while the other was busy: neither ran all its kernels before the other's
     * first one. */
    CHECK(first_start[1] < last_end[0] && first_start[0] < last_end[1]);
    CHECK(munmap(runs, 2 * LAUNCHES * sizeof(*runs)) == 0);
    shared_files(true);
}

/* ---- the default: each process has the GPU to itself ------------------------------------- */
static void private_tenant(int unused)
{
    (void)unused;
    sim_test_init();
    CHECK_EQ(free_now(), TOTAL);
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 40 * MIB));
    CHECK_EQ(free_now(), TOTAL - 40 * MIB);
    CUmodule m = NULL;
    CUfunction f = NULL;
    OK(cuModuleLoadData(&m, sim_test_ptx));
    OK(cuModuleGetFunction(&f, m, "gp_test_spin"));
    unsigned long long ns = 1000000;
    void *args[] = {&ns};
    OK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
    CHECK_EQ(gpupoolSimTurnWaitNs(), 0);
}

static void test_without_shared_dir_each_process_has_the_gpu(void)
{
    snprintf(dir, sizeof(dir), "/tmp/gp_shared_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "64MiB", 1) == 0);
    CHECK(pipe(ready_pipe) == 0 && pipe(go_pipe) == 0);
    pid_t a = spawn(holder, 40);
    CHECK(close(go_pipe[0]) == 0);
    char c;
    CHECK(read(ready_pipe[0], &c, 1) == 1);
    wait_ok(spawn(private_tenant, 0)); /* 40 MiB more while the first holds 40 */
    CHECK(close(go_pipe[1]) == 0);
    wait_ok(a);
    CHECK_EQ(shared_files(true), 0);
}

static void test_bad_shared_dir(void)
{
    CHECK(setenv("GPUPOOL_SIM_SHARED_DIR", "relative/dir", 1) == 0);
    CHECK_RC(cuInit(0), CUDA_ERROR_INVALID_VALUE);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "shared_dir") != NULL);
}

static void missing_dir_tenant(int unused)
{
    (void)unused;
    CHECK(setenv("GPUPOOL_SIM_SHARED_DIR", "/nonexistent/gp_shared", 1) == 0);
    CHECK_RC(cuInit(0), CUDA_ERROR_OPERATING_SYSTEM);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "directory exists") != NULL);
}

static void test_missing_shared_dir_fails_cuinit(void)
{
    wait_ok(spawn(missing_dir_tenant, 0));
}

static void bigger_gpu_tenant(int unused)
{
    (void)unused;
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "128MiB", 1) == 0);
    CHECK_RC(cuInit(0), CUDA_ERROR_OPERATING_SYSTEM);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "disagree on the GPU's memory") != NULL);
}

/* Processes of one GPU that disagree on its size cannot share one allocator: cuInit says so. */
static void test_processes_of_a_gpu_must_agree_on_its_size(void)
{
    use_shared_dir();
    wait_ok(spawn(read_zeros, 0)); /* sets the GPU up at 64 MiB */
    wait_ok(spawn(bigger_gpu_tenant, 0));
    shared_files(true);
}

SIM_TEST_MAIN(SIM_T(memory_is_the_gpus), SIM_T(leftovers_of_a_freed_allocation_are_visible),
              SIM_T(a_dead_process_memory_is_taken_back),
              SIM_T(kernels_of_two_processes_take_turns),
              SIM_T(without_shared_dir_each_process_has_the_gpu), SIM_T(bad_shared_dir),
              SIM_T(missing_shared_dir_fails_cuinit),
              SIM_T(processes_of_a_gpu_must_agree_on_its_size),
              SIM_T(memory_a_checkpoint_cannot_zero_is_not_handed_on))
