/*
 * test_sim_config.c: initialisation, error names, device properties, and their configuration
 * (defaults, config file, GPUPOOL_SIM_* overrides, rejected keys and values).
 */
#include <string.h>

#include "sim_test.h"

static void test_before_init(void)
{
    int n = 0, v = 0;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
    CUdeviceptr p = 0;
    CHECK_RC(cuMemAlloc_v2(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
    /* These work before cuInit, as with the driver. */
    OK(cuDriverGetVersion(&v));
    CHECK_EQ(v, 13000);
    const char *s = NULL;
    OK(cuGetErrorName(CUDA_ERROR_ILLEGAL_ADDRESS, &s));
    CHECK(strcmp(s, "CUDA_ERROR_ILLEGAL_ADDRESS") == 0);
    OK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s));
    CHECK(strcmp(s, "out of memory") == 0);
    CHECK_RC(cuGetErrorName(12345, &s), CUDA_ERROR_INVALID_VALUE);
    CHECK(s == NULL);
    CHECK_RC(cuGetErrorName(0, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDriverGetVersion(NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    OK(cuInit(0)); /* again: fine */
    OK(cuDeviceGetCount(&n));
    CHECK_EQ(n, 1);
}

static void test_defaults(void)
{
    OK(cuInit(0));
    CUdevice d = -1;
    OK(cuDeviceGet(&d, 0));
    CHECK_EQ(d, 0);
    CHECK_RC(cuDeviceGet(&d, 1), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDeviceGet(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    char name[256];
    OK(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "NVIDIA H100 80GB HBM3 (gpupool simulated)") == 0);
    OK(cuDeviceGetName(name, 5, 0));
    CHECK(strcmp(name, "NVID") == 0);
    CHECK_RC(cuDeviceGetName(name, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetName(name, 10, 3), CUDA_ERROR_INVALID_DEVICE);
    size_t total = 0;
    OK(cuDeviceTotalMem_v2(&total, 0));
    CHECK_EQ(total, 80ull << 30);
    CUuuid u, u2;
    OK(cuDeviceGetUuid(&u, 0));
    OK(cuDeviceGetUuid_v2(&u2, 0));
    CHECK(memcmp(u.bytes, "gpupool-sim-dev0", 16) == 0);
    CHECK(memcmp(u.bytes, u2.bytes, 16) == 0);
    char bus[32];
    OK(cuDeviceGetPCIBusId(bus, sizeof(bus), 0));
    CHECK(strcmp(bus, "0000:1b:00.0") == 0);
    int v = 0;
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    CHECK_EQ(v, 9);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    CHECK_EQ(v, 0);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CHECK_EQ(v, 132);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
    CHECK_EQ(v, 0x1b);
    OK(cuDriverGetVersion(&v));
    CHECK_EQ(v, 13000);
}

static void test_attributes(void)
{
    OK(cuInit(0));
    int v = 0;
    for (int a = 1; a < CU_DEVICE_ATTRIBUTE_MAX; a++)
        OK(cuDeviceGetAttribute(&v, a, 0));
    CHECK_RC(cuDeviceGetAttribute(&v, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(&v, -3, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(NULL, 1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(&v, 1, 1), CUDA_ERROR_INVALID_DEVICE);
    static const int expect[][2] = {
        {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1},
        {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
        {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
        {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
        {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
        {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 232448},
        {CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 50 << 20},
        {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048},
        {CU_DEVICE_ATTRIBUTE_INTEGRATED, 0},
        {CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0},
    };
    for (size_t i = 0; i < sizeof(expect) / sizeof(expect[0]); i++) {
        OK(cuDeviceGetAttribute(&v, expect[i][0], 0));
        CHECK_EQ(v, expect[i][1]);
    }
}

static void test_config_file(void)
{
    const char *path = sim_test_write_temp("# a test device\n"
                                           "name = Test GPU (simulated)   # trailing comment\n"
                                           "\n"
                                           "total_memory = 16 GiB\n"
                                           "cc_major = 8\n"
                                           "  cc_minor=6\n"
                                           "sm_count = 84\n"
                                           "uuid = 00112233-4455-6677-8899-aabbccddeeff\n"
                                           "pci_domain = 0x2\n"
                                           "pci_bus = 0x41\n"
                                           "pci_device = 3\n"
                                           "driver_version = 12080\n"
                                           "device_count = 2\n"
                                           "granularity = 64KiB\n"
                                           "heap_base = 0x310000000000\n"
                                           "attr.13 = 1500000\n"
                                           "attr.131 = -1\n");
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    OK(cuInit(0));
    int n = 0, v = 0;
    OK(cuDeviceGetCount(&n));
    CHECK_EQ(n, 2);
    char name[64];
    OK(cuDeviceGetName(name, sizeof(name), 1));
    CHECK(strcmp(name, "Test GPU (simulated)") == 0);
    size_t total = 0;
    OK(cuDeviceTotalMem_v2(&total, 1));
    CHECK_EQ(total, 16ull << 30);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    CHECK_EQ(v, 8);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    CHECK_EQ(v, 6);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1));
    CHECK_EQ(v, 84);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 0));
    CHECK_EQ(v, 1500000);
    OK(cuDeviceGetAttribute(&v, 131, 0));
    CHECK_EQ(v, -1);
    CUuuid u0, u1;
    OK(cuDeviceGetUuid(&u0, 0));
    OK(cuDeviceGetUuid(&u1, 1));
    static const unsigned char want[16] = {0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77,
                                           0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff};
    CHECK(memcmp(u0.bytes, want, 16) == 0);
    CHECK(memcmp(u1.bytes, want, 15) == 0);
    CHECK_EQ((unsigned char)u1.bytes[15], 0x00); /* 0xff + 1, wrapped: devices still differ */
    char bus[32];
    OK(cuDeviceGetPCIBusId(bus, sizeof(bus), 0));
    CHECK(strcmp(bus, "0002:41:03.0") == 0);
    OK(cuDeviceGetPCIBusId(bus, sizeof(bus), 1));
    CHECK(strcmp(bus, "0002:42:03.0") == 0);
    OK(cuDriverGetVersion(&v));
    CHECK_EQ(v, 12080);
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1}};
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK_EQ(g, 65536);
    /* The heap of device 0 starts at heap_base. */
    CUcontext ctx;
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    CUdeviceptr p = 0;
    OK(cuMemAlloc_v2(&p, 100));
    CHECK_EQ(p, 0x310000000000ull);
    CHECK(unlink(path) == 0);
}

static void test_env_overrides(void)
{
    const char *path = sim_test_write_temp("sm_count = 10\ntotal_memory = 2GiB\n");
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_SM_COUNT", "20", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_ATTR_38", "1234", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_ATTR.39", "1536", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_NAME", "Env GPU (simulated)", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_DRIVER_VERSION", "12090", 1) == 0);
    int v = 0;
    OK(cuDriverGetVersion(&v)); /* reads the configuration too, before cuInit */
    CHECK_EQ(v, 12090);
    OK(cuInit(0));
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CHECK_EQ(v, 20);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 0));
    CHECK_EQ(v, 1234);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 0));
    CHECK_EQ(v, 1536);
    size_t total = 0;
    OK(cuDeviceTotalMem_v2(&total, 0));
    CHECK_EQ(total, 2ull << 30); /* from the file: no override */
    char name[64];
    OK(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "Env GPU (simulated)") == 0);
    CHECK(unlink(path) == 0);
}

/* cuInit fails with CUDA_ERROR_INVALID_VALUE and one stderr line containing `needle`, and keeps
 * failing; the device stays unusable. */
static void expect_init_failure(const char *needle)
{
    sim_test_stderr_begin();
    CUresult rc = cuInit(0);
    char *err = sim_test_stderr_end();
    CHECK_EQ(rc, CUDA_ERROR_INVALID_VALUE);
    if (!strstr(err, needle)) {
        fprintf(stderr, "stderr '%s' does not contain '%s'\n", err, needle);
        exit(1);
    }
    char *nl = strchr(err, '\n');
    CHECK(nl != NULL && nl[1] == '\0'); /* exactly one line */
    free(err);
    /* The worker forwards the reason: it is also the error detail, again on a later cuInit. */
    CHECK(strstr(gpupoolSimLastErrorDetail(), needle) != NULL);
    CHECK_RC(cuInit(0), CUDA_ERROR_INVALID_VALUE);
    CHECK(strstr(gpupoolSimLastErrorDetail(), needle) != NULL);
    int n = 0;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
}

static void test_bad_key_in_file(void)
{
    const char *path = sim_test_write_temp("# ok\nsm_count = 12\nbogus = 1\n");
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    char needle[128];
    snprintf(needle, sizeof(needle), "%s:3: unknown key 'bogus'", path);
    expect_init_failure(needle);
    CHECK(unlink(path) == 0);
}

static void test_bad_values_in_file(void)
{
    static const char *cases[][2] = {
        {"total_memory = lots\n", "'total_memory'"},
        {"total_memory = 12 GB\n", "'total_memory'"},
        {"cc_major = 0\n", "'cc_major'"},
        {"uuid = 0011\n", "'uuid'"},
        {"granularity = 3000000\n", "'granularity'"},
        {"heap_base = 0x1000\n", "'heap_base'"},
        {"attr.13 = fast\n", "'attr.13'"},
        {"attr.999 = 1\n", "unknown key 'attr.999'"},
        {"name = NVIDIA H100\n", "'name'"},
        {"device_count = 17\n", "'device_count'"},
        {"pci_bus = 0xf8\ndevice_count = 9\n", "passes bus 0xff"},
        {"peer = 00112233445566778899aabbccddeeff 256 /tmp/p.mem\n", "PCI bus number (0..255)"},
        {"peer = 00112233445566778899aabbccddeeff 0000:108:00.0 /tmp/p.mem\n", "out of range"},
        {"peer = 00112233445566778899aabbccddeeff 10000:18:00.0 /tmp/p.mem\n", "out of range"},
        {"peer = 00112233445566778899aabbccddeeff 0000:18:20.0 /tmp/p.mem\n", "out of range"},
        {"peer = 00112233445566778899aabbccddeeff 0000:18:00.1 /tmp/p.mem\n", "function 0"},
        {"peer = 00112233445566778899aabbccddeeff 0000:18 /tmp/p.mem\n", "DOMAIN:BUS:DEVICE.0"},
        {"peer = 00112233445566778899aabbccddeeff 0001:18:00.0 p.mem\n", "absolute"},
        {"just some words\n", "expected 'key = value'"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        /* Each case needs a fresh process: cuInit's verdict is final. */
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            const char *path = sim_test_write_temp(cases[i][0]);
            CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
            expect_init_failure(cases[i][1]);
            CHECK(unlink(path) == 0);
            exit(0);
        }
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "case %zu (%s) failed\n", i, cases[i][0]);
            exit(1);
        }
    }
}

/* count_only is a benchmark-only mode: refused without GPUPOOL_BENCH_COUNT_MODE=1, from a file
 * or the environment, and a value other than true/false is a bad value. */
static void test_count_only_refused(void)
{
    const char *path = sim_test_write_temp("count_only = true\n");
    CHECK(setenv("GPUPOOL_SIM_CONFIG", path, 1) == 0);
    CHECK(unsetenv("GPUPOOL_BENCH_COUNT_MODE") == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        expect_init_failure("count_only = true is a benchmark-only mode");
        exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(unlink(path) == 0);
    CHECK(unsetenv("GPUPOOL_SIM_CONFIG") == 0);
    pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        CHECK(setenv("GPUPOOL_SIM_COUNT_ONLY", "true", 1) == 0);
        CHECK(setenv("GPUPOOL_BENCH_COUNT_MODE", "yes", 1) == 0); /* only "1" confirms it */
        expect_init_failure("refused unless GPUPOOL_BENCH_COUNT_MODE=1 is set");
        exit(0);
    }
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(setenv("GPUPOOL_SIM_COUNT_ONLY", "maybe", 1) == 0);
    CHECK(setenv("GPUPOOL_BENCH_COUNT_MODE", "1", 1) == 0);
    expect_init_failure("bad value for key 'count_only': expected true or false");
}

/* Confirmed: the device comes up and its name says that kernels are not run; false is the
 * default and changes nothing. */
static void test_count_only_name(void)
{
    CHECK(setenv("GPUPOOL_SIM_COUNT_ONLY", "true", 1) == 0);
    CHECK(setenv("GPUPOOL_BENCH_COUNT_MODE", "1", 1) == 0);
    OK(cuInit(0));
    char name[256];
    OK(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "NVIDIA H100 80GB HBM3 (gpupool simulated) [count mode: kernels not run]") ==
          0);
}

static void test_bad_env(void)
{
    CHECK(setenv("GPUPOOL_SIM_SM_COUNT", "many", 1) == 0);
    expect_init_failure("GPUPOOL_SIM_SM_COUNT=many: bad value for key 'sm_count'");
}

static void test_unknown_env_key(void)
{
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEM", "1GiB", 1) == 0);
    expect_init_failure("unknown key 'total_mem'");
}

static void test_missing_file(void)
{
    CHECK(setenv("GPUPOOL_SIM_CONFIG", "/nonexistent/gpupool-sim.conf", 1) == 0);
    expect_init_failure("/nonexistent/gpupool-sim.conf");
}

static void test_no_device(void)
{
    CHECK(setenv("GPUPOOL_SIM_DEVICE_COUNT", "0", 1) == 0);
    CHECK_RC(cuInit(0), CUDA_ERROR_NO_DEVICE);
    int n = 0;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
}

static void test_heap_base_taken(void)
{
    /* Somebody already holds the heap's address range: cuInit says so instead of mapping over. */
    void *want = (void *)0x300000000000ull;
    void *p = mmap(want, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(p == want);
    sim_test_stderr_begin();
    CUresult rc = cuInit(0);
    char *err = sim_test_stderr_end();
    CHECK_EQ(rc, CUDA_ERROR_OPERATING_SYSTEM);
    CHECK(strstr(err, "heap_base") != NULL);
    free(err);
}

SIM_TEST_MAIN(SIM_T(before_init), SIM_T(defaults), SIM_T(attributes), SIM_T(config_file),
              SIM_T(env_overrides), SIM_T(bad_key_in_file), SIM_T(bad_values_in_file),
              SIM_T(count_only_refused), SIM_T(count_only_name), SIM_T(bad_env),
              SIM_T(unknown_env_key), SIM_T(missing_file), SIM_T(no_device), SIM_T(heap_base_taken))
