/*
 * export_tables.cu: cuGetExportTable through gpupool on the simulated device, through the driver
 * API (run by tests/test_e2e_export_tables.py; docs/architecture.md, "Export tables"):
 *
 * - the tools-module table (6e163fbe-..., CU_ETID_ToolsModule) is served: size word, and slot 7
 *   iterates the functions of a loaded module (this file's three kernels, from its cubin, argv[1])
 *   on the server, calling back once per kernel with distinct stand-in nodes and the module;
 * - a table the server's driver knows and the shim does not (the simulated device's own
 *   "gpupool sim tbl") is served as trampolines of the driver's size: a slot answers
 *   CUDA_ERROR_NOT_SUPPORTED, called twice here (the shim logs it once: the test counts);
 * - a uuid neither knows is refused with CUDA_ERROR_INVALID_VALUE, as before.
 * For the simulated device only (a real driver has neither the sim's table nor, perhaps, slot 7).
 */
#include "gp_check.cuh"

#include <cstring>
#include <vector>

extern "C" __global__ void et_first(int *p) { p[threadIdx.x] = 1; }
extern "C" __global__ void et_second(float *p, float a) { p[threadIdx.x] *= a; }
extern "C" __global__ void et_third(void) {}

#define EXPECT_CU(call, want)                                                                  \
    do {                                                                                       \
        CUresult gp_r_ = (call);                                                               \
        ++gp_checks;                                                                           \
        if (gp_r_ != (want))                                                                   \
            gp_fail(__FILE__, __LINE__, "%s -> %d, expected %d", #call, (int)gp_r_,             \
                    (int)(want));                                                              \
    } while (0)

static const unsigned char TOOLS_MODULE[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                               0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};
static const unsigned char SIM_ONLY[16] = {'g', 'p', 'u', 'p', 'o', 'o', 'l', ' ',
                                           's', 'i', 'm', ' ', 't', 'b', 'l', 0};
static const unsigned char NOBODY[16] = {0xe5, 0x7a, 0x0b, 0x1e, 0x00, 0x11, 0x22, 0x33,
                                         0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb};

typedef void (*tools_cb)(void *opaque, void *node, void *owner);
typedef CUresult (*tools_iterator)(CUcontext, CUmodule, tools_cb, void *, CUmodule,
                                   unsigned long long);

struct seen {
    std::vector<void *> nodes;
    void *owner = nullptr;
};

static void collect(void *opaque, void *node, void *owner)
{
    seen *s = (seen *)opaque;
    s->nodes.push_back(node);
    s->owner = owner;
}

static const uint64_t *table(const unsigned char id[16], CUresult want)
{
    CUuuid uuid;
    memcpy(uuid.bytes, id, 16);
    const void *t = (const void *)1;
    EXPECT_CU(cuGetExportTable(&t, &uuid), want);
    EXPECT(want == CUDA_SUCCESS ? t != nullptr : t == nullptr, "table pointer %p", t);
    return (const uint64_t *)t;
}

static std::vector<char> read_file(const char *path)
{
    std::vector<char> v;
    FILE *f = fopen(path, "rb");
    if (!f) {
        gp_fail(__FILE__, __LINE__, "cannot open %s", path);
        exit(gp_finish());
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        v.insert(v.end(), buf, buf + n);
    fclose(f);
    return v;
}

int main(int argc, char **argv)
{
    gp_begin("export_tables");
    if (argc != 2) {
        printf("usage: export_tables THIS_FILE.cubin\n");
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGet(&dev, 0));
    CHECK_CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK_CU(cuCtxSetCurrent(ctx));
    std::vector<char> cubin = read_file(argv[1]);
    CUmodule mod = nullptr;
    CHECK_CU(cuModuleLoadData(&mod, cubin.data()));
    if (gp_failures.load() != 0)
        return gp_finish();

    /* The tools-module table: the driver's size (eight slots on the simulated device). */
    const uint64_t *tools = table(TOOLS_MODULE, CUDA_SUCCESS);
    if (tools) {
        EXPECT(tools[0] == 64, "tools-module size word %llu, expected 64",
               (unsigned long long)tools[0]);
        tools_iterator it;
        memcpy(&it, &tools[7], sizeof it);
        seen s;
        EXPECT_CU(it(ctx, mod, collect, &s, mod, 0), CUDA_SUCCESS);
        EXPECT(s.nodes.size() == 3, "slot 7 called back %zu times, expected 3 (the kernels)",
               s.nodes.size());
        EXPECT(s.owner == (void *)mod, "owner %p, expected the module %p", s.owner, (void *)mod);
        for (size_t i = 0; i < s.nodes.size(); i++)
            for (size_t j = 0; j < i; j++)
                EXPECT(s.nodes[i] != s.nodes[j], "nodes %zu and %zu are the same", i, j);
        /* A module handle that is none, and a flag nobody knows: refused. */
        seen none;
        EXPECT_CU(it(ctx, (CUmodule)(uintptr_t)0x1234, collect, &none, nullptr, 0),
                  CUDA_ERROR_INVALID_HANDLE);
        EXPECT_CU(it(ctx, mod, collect, &none, mod, 1), CUDA_ERROR_NOT_SUPPORTED);
        EXPECT(none.nodes.empty(), "refused iterations called back %zu times", none.nodes.size());
        /* The same table again. */
        EXPECT(table(TOOLS_MODULE, CUDA_SUCCESS) == tools, "a second lookup gave another table");
    }

    /* Known to the server's driver only: trampolines of its size. */
    const uint64_t *sim_only = table(SIM_ONLY, CUDA_SUCCESS);
    if (sim_only) {
        EXPECT(sim_only[0] == 48, "size word %llu, expected 48", (unsigned long long)sim_only[0]);
        CUresult (*slot4)(void);
        memcpy(&slot4, &sim_only[4], sizeof slot4);
        EXPECT_CU(slot4(), CUDA_ERROR_NOT_SUPPORTED);
        EXPECT_CU(slot4(), CUDA_ERROR_NOT_SUPPORTED);
    }

    /* Known to nobody: refused, twice (asked once). */
    table(NOBODY, CUDA_ERROR_INVALID_VALUE);
    table(NOBODY, CUDA_ERROR_INVALID_VALUE);

    CHECK_CU(cuModuleUnload(mod));
    CHECK_CU(cuDevicePrimaryCtxRelease(dev));
    return gp_finish();
}
