/*
 * test_sim_memfile.c: device memory in a memory file (key memory_file) outlives the process like
 * a GPU's DRAM: the same allocations in a new process read back what the last one wrote; freeing
 * does not clear; zeroing whole pages punches holes; VMM allocations keep their contents in the
 * allocation. Also the anonymous (no file) zeroing path and bad memory_file values.
 *
 * "Processes" are forked children (each runs its own cuInit); the test itself never calls cuInit
 * before forking them.
 */
#include <fcntl.h>
#include <sys/stat.h>

#include "sim_test.h"

#define KIB 1024ull
#define MIB (1024ull * KIB)

static char dir[64];
static char file[128];

/* A fresh directory with the memory file's path in it (the sim creates the file). */
static void use_memory_file(const char *total)
{
    snprintf(dir, sizeof(dir), "/tmp/gp_memfile_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(file, sizeof(file), "%s/gpu.mem", dir);
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", file, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", total, 1) == 0);
}

static void cleanup(void)
{
    CHECK(unlink(file) == 0);
    CHECK(rmdir(dir) == 0);
}

static void in_child(void (*fn)(void))
{
    CHECK(fflush(NULL) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        fn();
        exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* How many bytes of [p, p+n) hold pattern `seed`, and how many are zero. */
static void count(CUdeviceptr p, uint64_t n, unsigned seed, uint64_t *match, uint64_t *zero)
{
    unsigned char *b = malloc(n);
    CHECK(b != NULL);
    OK(cuMemcpyDtoH_v2(b, p, n));
    *match = *zero = 0;
    for (uint64_t i = 0; i < n; i++) {
        *match += b[i] == sim_test_pattern(seed, i);
        *zero += b[i] == 0;
    }
    free(b);
}

static const uint64_t sizes[] = {1000, 3 * MIB + 5, 64 * KIB + 1};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static void tenant_a(void)
{
    sim_test_init();
    CUdeviceptr p = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        OK(cuMemAlloc_v2(&p, sizes[k]));
        sim_test_fill(p, sizes[k], (unsigned)k);
    }
    /* exits holding the memory, as a crashed tenant would */
}

static void tenant_b(void)
{
    sim_test_init();
    CUdeviceptr p = 0;
    uint64_t match = 0, zero = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        OK(cuMemAlloc_v2(&p, sizes[k]));
        count(p, sizes[k], (unsigned)k, &match, &zero);
        CHECK_EQ(match, sizes[k]);
    }
}

static void test_persists_across_processes(void)
{
    use_memory_file("256MiB");
    in_child(tenant_a);
    struct stat st;
    CHECK(stat(file, &st) == 0);
    CHECK_EQ(st.st_size, 256 * MIB);
    CHECK_EQ(st.st_mode & 0777, 0600); /* tenants' data */
    in_child(tenant_b);
    cleanup();
}

static void anon_tenant_b(void)
{
    sim_test_init();
    CUdeviceptr p = 0;
    uint64_t match = 0, zero = 0;
    OK(cuMemAlloc_v2(&p, sizes[0]));
    count(p, sizes[0], 0, &match, &zero);
    CHECK_EQ(zero, sizes[0]);
}

/* Without the key nothing persists (the behaviour before memory files existed). */
static void test_no_file_no_persistence(void)
{
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "256MiB", 1) == 0);
    in_child(tenant_a);
    in_child(anon_tenant_b);
}

/* Freed memory keeps its bytes; the next allocation of the same place sees them. */
static void test_free_keeps_contents(void)
{
    use_memory_file("64MiB");
    sim_test_init();
    CUdeviceptr p = 0, q = 0;
    OK(cuMemAlloc_v2(&p, 2 * MIB));
    sim_test_fill(p, 2 * MIB, 7);
    OK(cuMemFree_v2(p));
    OK(cuMemAlloc_v2(&q, 2 * MIB));
    CHECK_EQ(q, p);
    uint64_t match = 0, zero = 0;
    count(q, 2 * MIB, 7, &match, &zero);
    CHECK_EQ(match, 2 * MIB);
    cleanup();
}

static uint64_t file_blocks(void)
{
    int fd = open(file, O_RDONLY);
    CHECK(fd >= 0);
    CHECK(fsync(fd) == 0); /* so that delayed allocation has given the written pages blocks */
    struct stat st;
    CHECK(fstat(fd, &st) == 0);
    CHECK(close(fd) == 0);
    return (uint64_t)st.st_blocks * 512;
}

/* cuMemsetD8/D32 of zero over whole pages punches holes (the file gives its blocks back); the
 * partial pages at either end are written; a non-zero memset writes. */
static void test_zero_punches_holes(void)
{
    use_memory_file("64MiB");
    sim_test_init();
    const uint64_t n = 8 * MIB;
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, n));
    sim_test_fill(p, n, 3);
    uint64_t before = file_blocks();
    CHECK(before >= n);
    /* Leave 100 bytes of pattern at each end: partial pages. */
    OK(cuMemsetD8_v2(p + 100, 0, n - 200));
    uint64_t after = file_blocks();
    CHECK(before - after >= n - 2 * 4096);
    unsigned char *b = malloc(n);
    CHECK(b != NULL);
    OK(cuMemcpyDtoH_v2(b, p, n));
    for (uint64_t i = 0; i < n; i++)
        CHECK_EQ(b[i], i < 100 || i >= n - 100 ? sim_test_pattern(3, i) : 0);
    /* D32 zero punches too; a non-zero value is written. */
    sim_test_fill(p, n, 4);
    before = file_blocks();
    OK(cuMemsetD32_v2(p, 0, n / 4));
    CHECK(before - file_blocks() >= n);
    OK(cuMemsetD8_v2(p, 0x5a, n));
    CHECK(file_blocks() >= n);
    OK(cuMemcpyDtoH_v2(b, p, n));
    for (uint64_t i = 0; i < n; i++)
        CHECK_EQ(b[i], 0x5a);
    free(b);
    cleanup();
}

/* A new process sees the zeros a memset left (the scrub's promise). */
static void zero_tenant(void)
{
    sim_test_init();
    CUdeviceptr p = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        OK(cuMemAlloc_v2(&p, sizes[k]));
        OK(cuMemsetD8_v2(p, 0, sizes[k]));
    }
}

static void check_zero_tenant(void)
{
    sim_test_init();
    CUdeviceptr p = 0;
    uint64_t match = 0, zero = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        OK(cuMemAlloc_v2(&p, sizes[k]));
        count(p, sizes[k], (unsigned)k, &match, &zero);
        CHECK_EQ(zero, sizes[k]);
    }
}

static void test_zeros_persist(void)
{
    use_memory_file("256MiB");
    in_child(tenant_a);
    in_child(zero_tenant);
    in_child(check_zero_tenant);
    cleanup();
}

/* Without a file, zeroing drops anonymous pages; the results are the same. */
static void test_zero_anonymous(void)
{
    sim_test_init();
    const uint64_t n = 4 * MIB + 123;
    CUdeviceptr p = 0;
    void *h = NULL;
    OK(cuMemAlloc_v2(&p, n));
    sim_test_fill(p, n, 5);
    const uint64_t halves = (n - 10) / 2;
    OK(cuMemsetD16_v2(p + 2, 0, halves));
    uint64_t match = 0, zero = 0;
    count(p, n, 5, &match, &zero);
    CHECK(zero >= 2 * halves);
    unsigned char tail[8];
    OK(cuMemcpyDtoH_v2(tail, p + n - 8, 8));
    CHECK_EQ(tail[7], sim_test_pattern(5, n - 1));
    OK(cuMemcpyDtoH_v2(tail, p, 2));
    CHECK_EQ(tail[0], sim_test_pattern(5, 0));
    CHECK_EQ(tail[1], sim_test_pattern(5, 1));
    /* Pinned host memory zeroes the same way. */
    OK(cuMemHostAlloc(&h, 1 * MIB, 0));
    memset(h, 0x77, 1 * MIB);
    OK(cuMemsetD8_v2((CUdeviceptr)(uintptr_t)h, 0, 1 * MIB));
    for (uint64_t i = 0; i < 1 * MIB; i++)
        CHECK_EQ(((unsigned char *)h)[i], 0);
    OK(cuMemFreeHost(h));
}

static const CUmemAllocationProp dev0 = {
    .type = CU_MEM_ALLOCATION_TYPE_PINNED,
    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
};

static void vmm_tenant_a(void)
{
    OK(cuInit(0));
    sim_test_init();
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    OK(cuMemCreate(&h, 4 * MIB, &dev0, 0));
    OK(cuMemAddressReserve(&va, 8 * MIB, 0, 0, 0));
    /* Two mappings of one allocation alias, as on a GPU. */
    OK(cuMemMap(va, 4 * MIB, 0, h, 0));
    OK(cuMemMap(va + 4 * MIB, 4 * MIB, 0, h, 0));
    sim_test_fill(va, 4 * MIB, 9);
    uint64_t match = 0, zero = 0;
    count(va + 4 * MIB, 4 * MIB, 9, &match, &zero);
    CHECK_EQ(match, 4 * MIB);
    /* Unmapped and mapped again: still there. */
    OK(cuMemUnmap(va, 8 * MIB));
    OK(cuMemMap(va + 2 * MIB, 2 * MIB, 2 * MIB, h, 0)); /* the second half, at an offset */
    unsigned char b[2];
    OK(cuMemcpyDtoH_v2(b, va + 2 * MIB, 2));
    CHECK_EQ(b[0], sim_test_pattern(9, 2 * MIB));
    CHECK_EQ(b[1], sim_test_pattern(9, 2 * MIB + 1));
    /* The simulated-device direct copy path sees the file's bytes too. */
    void *host = NULL;
    OK(gpupoolSimHostPointer(va + 2 * MIB, 2 * MIB, &host));
    CHECK_EQ(((unsigned char *)host)[1], sim_test_pattern(9, 2 * MIB + 1));
}

static void vmm_tenant_b(void)
{
    sim_test_init();
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    OK(cuMemCreate(&h, 4 * MIB, &dev0, 0));
    OK(cuMemAddressReserve(&va, 4 * MIB, 0, 0, 0));
    OK(cuMemMap(va, 4 * MIB, 0, h, 0));
    uint64_t match = 0, zero = 0;
    count(va, 4 * MIB, 9, &match, &zero);
    CHECK_EQ(match, 4 * MIB);
    OK(cuMemUnmap(va, 4 * MIB));
    OK(cuMemRelease(h));
    /* cuMemAlloc memory shares the file with VMM memory: the released range comes first. */
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 4 * MIB));
    count(p, 4 * MIB, 9, &match, &zero);
    CHECK_EQ(match, 4 * MIB);
}

static void test_vmm_in_file(void)
{
    use_memory_file("128MiB");
    in_child(vmm_tenant_a);
    in_child(vmm_tenant_b);
    cleanup();
}

static void two_devices_a(void)
{
    OK(cuInit(0));
    CUcontext c0 = NULL, c1 = NULL;
    CUdeviceptr p0 = 0, p1 = 0;
    OK(cuDevicePrimaryCtxRetain(&c0, 0));
    OK(cuDevicePrimaryCtxRetain(&c1, 1));
    OK(cuCtxSetCurrent(c0));
    OK(cuMemAlloc_v2(&p0, 1 * MIB));
    sim_test_fill(p0, 1 * MIB, 1);
    OK(cuCtxSetCurrent(c1));
    OK(cuMemAlloc_v2(&p1, 1 * MIB));
    sim_test_fill(p1, 1 * MIB, 2);
}

static void two_devices_b(void)
{
    OK(cuInit(0));
    CUcontext c1 = NULL;
    CUdeviceptr p1 = 0;
    OK(cuDevicePrimaryCtxRetain(&c1, 1));
    OK(cuCtxSetCurrent(c1));
    OK(cuMemAlloc_v2(&p1, 1 * MIB));
    uint64_t match = 0, zero = 0;
    count(p1, 1 * MIB, 2, &match, &zero); /* device 1's bytes, not device 0's */
    CHECK_EQ(match, 1 * MIB);
}

static void test_devices_have_their_own_part(void)
{
    use_memory_file("64MiB");
    CHECK(setenv("GPUPOOL_SIM_DEVICE_COUNT", "2", 1) == 0);
    in_child(two_devices_a);
    struct stat st;
    CHECK(stat(file, &st) == 0);
    CHECK_EQ(st.st_size, 128 * MIB);
    in_child(two_devices_b);
    cleanup();
}

static void test_bad_memory_file(void)
{
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", "relative/gpu.mem", 1) == 0);
    sim_test_stderr_begin();
    CHECK_RC(cuInit(0), CUDA_ERROR_INVALID_VALUE);
    char *err = sim_test_stderr_end();
    CHECK(strstr(err, "memory_file") && strstr(err, "absolute path"));
    free(err);
}

static void test_memory_file_in_missing_dir(void)
{
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", "/nonexistent-gpupool-dir/gpu.mem", 1) == 0);
    sim_test_stderr_begin();
    CHECK_RC(cuInit(0), CUDA_ERROR_OPERATING_SYSTEM);
    char *err = sim_test_stderr_end();
    CHECK(strstr(err, "/nonexistent-gpupool-dir/gpu.mem") && strstr(err, "memory_file"));
    CHECK(strstr(gpupoolSimLastErrorDetail(), "memory_file") != NULL);
    free(err);
}

/* An empty value switches a config file's memory file off. */
static void test_empty_memory_file(void)
{
    const char *conf = sim_test_write_temp("memory_file = /nonexistent-gpupool-dir/x.mem\n");
    CHECK(setenv("GPUPOOL_SIM_CONFIG", conf, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", "", 1) == 0);
    sim_test_init();
    CHECK(unlink(conf) == 0);
}

SIM_TEST_MAIN(SIM_T(persists_across_processes), SIM_T(no_file_no_persistence),
              SIM_T(free_keeps_contents), SIM_T(zero_punches_holes), SIM_T(zeros_persist),
              SIM_T(zero_anonymous), SIM_T(vmm_in_file), SIM_T(devices_have_their_own_part),
              SIM_T(bad_memory_file), SIM_T(memory_file_in_missing_dir), SIM_T(empty_memory_file))
