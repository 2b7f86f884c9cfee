/*
 * test_sim_export.c: the simulated device's export tables (worker/sim/sim_export.c): the
 * tools-module table's size word and its slot 7 function iterator over a real nvcc cubin, the
 * table only the simulated device knows, and an unknown uuid refused.
 */
#include <stdint.h>

#include "sim_test.h"

typedef void (*tools_cb)(void *opaque, void *node, void *owner);
typedef CUresult (*tools_iterator)(CUcontext ctx, CUmodule module, tools_cb cb, void *opaque,
                                   CUmodule module2, unsigned long long flags);

static const CUuuid TOOLS_MODULE = {{0x6e, 0x16, 0x3f, (char)0xbe, (char)0xb9, 0x58, 0x44, 0x4d,
                                     (char)0x83, 0x5c, (char)0xe1, (char)0x82, (char)0xaf,
                                     (char)0xf1, (char)0x99, 0x1e}};
static const CUuuid SIM_TEST = {
    {'g', 'p', 'u', 'p', 'o', 'o', 'l', ' ', 's', 'i', 'm', ' ', 't', 'b', 'l', 0}};

struct seen {
    int calls;
    CUmodule owner;
    CUfunction nodes[16];
};

static void collect(void *opaque, void *node, void *owner)
{
    struct seen *s = opaque;
    if (s->calls < 16)
        s->nodes[s->calls] = node;
    s->calls++;
    s->owner = owner;
}

static tools_iterator slot7(void)
{
    const void *table = NULL;
    OK(cuGetExportTable(&table, &TOOLS_MODULE));
    CHECK(table != NULL);
    const uint64_t *words = table;
    CHECK_EQ(words[0], 8 * 8); /* size word: eight slots */
    tools_iterator it;
    memcpy(&it, &words[7], sizeof it);
    CHECK(it != NULL);
    return it;
}

static void test_tools_module_iterates_the_kernels(void)
{
    size_t len = 0;
    unsigned char *cubin = sim_test_input("GP_SIM_TEST_CUBIN", &len);
    sim_test_init();
    CUmodule mod;
    OK(cuModuleLoadData(&mod, cubin));
    tools_iterator it = slot7();
    struct seen s = {0};
    OK(it(NULL, mod, collect, &s, mod, 0));
    CHECK_EQ(s.calls, 7); /* six gp_test_* kernels and gp_other_kernel (test_sim_elf.c) */
    CHECK(s.owner == mod);
    /* The nodes are the module's functions: the handles cuModuleGetFunction gives. */
    CUfunction f;
    OK(cuModuleGetFunction(&f, mod, "gp_test_axpy"));
    int found = 0;
    for (int i = 0; i < 7; i++)
        found += s.nodes[i] == f;
    CHECK_EQ(found, 1);
    /* Bad arguments are refused, not followed. */
    CHECK_RC(it(NULL, mod, NULL, &s, mod, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(it(NULL, mod, collect, &s, mod, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(it(NULL, (CUmodule)(uintptr_t)0x12345, collect, &s, NULL, 0),
             CUDA_ERROR_INVALID_HANDLE);
    OK(cuModuleUnload(mod));
    CHECK_RC(it(NULL, mod, collect, &s, mod, 0), CUDA_ERROR_INVALID_HANDLE);
    free(cubin);
}

static void test_ptx_module_has_no_known_functions(void)
{
    sim_test_init();
    CUmodule mod;
    OK(cuModuleLoadData(&mod, sim_test_ptx));
    struct seen s = {0};
    OK(slot7()(NULL, mod, collect, &s, NULL, 0));
    CHECK_EQ(s.calls, 0);
}

static void test_other_tables(void)
{
    const void *table = (const void *)1;
    CHECK_RC(cuGetExportTable(&table, &SIM_TEST), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(table == NULL);
    sim_test_init();
    OK(cuGetExportTable(&table, &SIM_TEST));
    CHECK_EQ(((const uint64_t *)table)[0], 6 * 8);
    CUuuid unknown = SIM_TEST;
    unknown.bytes[15] = 1;
    table = (const void *)1;
    CHECK_RC(cuGetExportTable(&table, &unknown), CUDA_ERROR_INVALID_VALUE);
    CHECK(table == NULL);
    CHECK_RC(cuGetExportTable(NULL, &SIM_TEST), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGetExportTable(&table, NULL), CUDA_ERROR_INVALID_VALUE);
}

SIM_TEST_MAIN(SIM_T(tools_module_iterates_the_kernels), SIM_T(ptx_module_has_no_known_functions),
              SIM_T(other_tables))
