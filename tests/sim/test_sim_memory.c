/*
 * test_sim_memory.c: device memory: the cuMemAlloc heap, the VMM calls (reserve at a hint,
 * create, map, unmap, out of memory), bounds-checked copies and memsets, pinned host memory.
 */
#include "sim_test.h"

#define MIB (1024ull * 1024)
#define GIB (1024ull * MIB)

static const CUmemAllocationProp dev0_prop = {
    .type = CU_MEM_ALLOCATION_TYPE_PINNED,
    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
};

static void test_heap(void)
{
    OK(cuInit(0));
    CUdeviceptr p = 0, q = 0;
    CHECK_RC(cuMemAlloc_v2(&p, 16), CUDA_ERROR_INVALID_CONTEXT); /* no current context */
    sim_test_init();
    size_t free0 = 0, total = 0, free1 = 0;
    OK(cuMemGetInfo_v2(&free0, &total));
    CHECK_EQ(total, 80 * GIB);
    OK(cuMemAlloc_v2(&p, 1000));
    CHECK(p >= 0x300000000000ull && p < 0x300000000000ull + 80 * GIB);
    OK(cuMemAlloc_v2(&q, 5000));
    CHECK(q != p);
    OK(cuMemGetInfo_v2(&free1, NULL));
    CHECK_EQ(free0 - free1, 4096 + 8192); /* whole pages */
    CHECK_RC(cuMemAlloc_v2(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAlloc_v2(NULL, 8), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr huge = 0;
    CHECK_RC(cuMemAlloc_v2(&huge, 81 * GIB), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(p));
    OK(cuMemFree_v2(q));
    CHECK_RC(cuMemFree_v2(q), CUDA_ERROR_INVALID_VALUE); /* twice */
    CHECK_RC(cuMemFree_v2(0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree_v2(0x1234), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemGetInfo_v2(&free1, NULL));
    CHECK_EQ(free1, free0);
    /* The freed space is reused: first fit from the heap's base. */
    CUdeviceptr r = 0;
    OK(cuMemAlloc_v2(&r, 10));
    CHECK_EQ(r, p);
    CHECK_RC(cuMemGetInfo_v2(NULL, NULL), CUDA_ERROR_INVALID_VALUE);
}

static void test_heap_oom(void)
{
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "64MiB", 1) == 0);
    sim_test_init();
    CUdeviceptr a = 0, b = 0;
    OK(cuMemAlloc_v2(&a, 48 * MIB));
    CHECK_RC(cuMemAlloc_v2(&b, 20 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree_v2(a));
    OK(cuMemAlloc_v2(&b, 20 * MIB));
}

static void test_reserve(void)
{
    OK(cuInit(0)); /* the VMM calls need no context */
    CUdeviceptr p = 0, q = 0, r = 0;
    const CUdeviceptr hint = 0x200000000000ull;
    OK(cuMemAddressReserve(&p, 1 * GIB, 0, hint, 0));
    CHECK_EQ(p, hint);
    /* The hint is taken: the driver returns another address and the caller decides. */
    OK(cuMemAddressReserve(&q, 1 * GIB, 0, hint, 0));
    CHECK(q != hint && q != 0);
    CHECK(q + 1 * GIB <= hint || q >= hint + 1 * GIB);
    /* No hint: any address, aligned as asked. */
    OK(cuMemAddressReserve(&r, 2 * MIB, 1 * GIB, 0, 0));
    CHECK(r != 0 && r % GIB == 0);
    CHECK_RC(cuMemAddressReserve(&r, 3 * MIB, 0, 0, 0), CUDA_ERROR_INVALID_VALUE); /* granularity */
    CHECK_RC(cuMemAddressReserve(&r, 0, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(NULL, 2 * MIB, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, 2 * MIB, 3, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, 2 * MIB, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressFree(p, 2 * GIB), CUDA_ERROR_INVALID_VALUE); /* wrong size */
    OK(cuMemAddressFree(p, 1 * GIB));
    CHECK_RC(cuMemAddressFree(p, 1 * GIB), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAddressFree(q, 1 * GIB));
    /* Freed: the hint can be honoured again. */
    OK(cuMemAddressReserve(&p, 1 * GIB, 0, hint, 0));
    CHECK_EQ(p, hint);
    /* A misaligned hint is not honoured. */
    OK(cuMemAddressReserve(&q, 2 * MIB, 0, hint + 3 * GIB + 4096, 0));
    CHECK(q % (2 * MIB) == 0);
}

static void test_vmm_map(void)
{
    sim_test_init();
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &dev0_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK_EQ(g, 2 * MIB);
    CHECK_RC(cuMemGetAllocationGranularity(&g, &dev0_prop, 7), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr va = 0;
    OK(cuMemAddressReserve(&va, 64 * MIB, 0, 0x200000000000ull, 0));
    CUmemGenericAllocationHandle h1 = 0, h2 = 0;
    OK(cuMemCreate(&h1, 4 * MIB, &dev0_prop, 0));
    OK(cuMemCreate(&h2, 2 * MIB, &dev0_prop, 0));
    CHECK_RC(cuMemCreate(&h2, 3 * MIB, &dev0_prop, 0), CUDA_ERROR_INVALID_VALUE);
    CUmemAllocationProp bad = dev0_prop;
    bad.location.id = 5;
    CHECK_RC(cuMemCreate(&h2, 2 * MIB, &bad, 0), CUDA_ERROR_INVALID_DEVICE);
    bad = dev0_prop;
    bad.type = 7;
    CHECK_RC(cuMemCreate(&h2, 2 * MIB, &bad, 0), CUDA_ERROR_INVALID_VALUE);

    /* Outside any reservation, overlapping, misaligned, too big for the handle: refused. */
    CHECK_RC(cuMemMap(0x7000000000ull, 4 * MIB, 0, h1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(va + 62 * MIB, 4 * MIB, 0, h1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(va + 4096, 2 * MIB, 0, h1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(va, 4 * MIB, 2 * MIB, h1, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(va, 4 * MIB, 0, 0x1234, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemMap(va, 4 * MIB, 0, h1, 0));
    CHECK_RC(cuMemMap(va + 2 * MIB, 2 * MIB, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* overlap */
    OK(cuMemMap(va + 4 * MIB, 2 * MIB, 0, h2, 0));
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(va, 6 * MIB, &acc, 1)); /* spans both mappings */
    CHECK_RC(cuMemSetAccess(va, 8 * MIB, &acc, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemSetAccess(va, 6 * MIB, NULL, 1), CUDA_ERROR_INVALID_VALUE);

    /* Data round trip, also across the boundary of the two mappings. */
    static unsigned char buf[3 * 1024 * 1024], back[3 * 1024 * 1024];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (unsigned char)(i * 7 + 3);
    OK(cuMemcpyHtoD_v2(va + 3 * MIB, buf, sizeof(buf)));
    OK(cuMemcpyDtoH_v2(back, va + 3 * MIB, sizeof(back)));
    CHECK(memcmp(buf, back, sizeof(buf)) == 0);

    /* Unmap: whole mappings only; afterwards the range is not device memory, and the memory of
     * a released handle returns to the pool only with its last mapping. */
    CHECK_RC(cuMemUnmap(va, 2 * MIB), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(va, 5 * MIB), CUDA_ERROR_INVALID_VALUE);
    size_t free0 = 0, free1 = 0;
    OK(cuMemGetInfo_v2(&free0, NULL));
    OK(cuMemRelease(h1));
    CHECK_RC(cuMemRelease(h1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemGetInfo_v2(&free1, NULL));
    CHECK_EQ(free1, free0); /* still mapped */
    OK(cuMemUnmap(va, 4 * MIB));
    OK(cuMemGetInfo_v2(&free1, NULL));
    CHECK_EQ(free1 - free0, 4 * MIB);
    CHECK_RC(cuMemcpyHtoD_v2(va, buf, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(va, 4 * MIB, 0, h1, 0), CUDA_ERROR_INVALID_VALUE); /* released handle */

    /* Map h2 again elsewhere after unmapping: the data is gone (fresh pages). */
    OK(cuMemUnmap(va + 4 * MIB, 2 * MIB));
    OK(cuMemMap(va, 2 * MIB, 0, h2, 0));
    OK(cuMemcpyDtoH_v2(back, va, 4096));
    for (size_t i = 0; i < 4096; i++)
        CHECK_EQ(back[i], 0);
    /* Freeing the reservation drops the mapping still inside it. */
    OK(cuMemAddressFree(va, 64 * MIB));
    CHECK_RC(cuMemcpyDtoH_v2(back, va, 16), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemRelease(h2));
    size_t free2 = 0;
    OK(cuMemGetInfo_v2(&free2, NULL));
    CHECK_EQ(free2, 80 * GIB);
}

static void test_vmm_oom(void)
{
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "64MiB", 1) == 0);
    OK(cuInit(0));
    CUmemGenericAllocationHandle a = 0, b = 0;
    OK(cuMemCreate(&a, 64 * MIB, &dev0_prop, 0));
    CHECK_RC(cuMemCreate(&b, 2 * MIB, &dev0_prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemRelease(a));
    OK(cuMemCreate(&b, 2 * MIB, &dev0_prop, 0));
    /* Heap and VMM memory share the total. */
    sim_test_init();
    CUdeviceptr p = 0;
    CHECK_RC(cuMemAlloc_v2(&p, 63 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemAlloc_v2(&p, 62 * MIB));
}

static void test_granularity_config(void)
{
    CHECK(setenv("GPUPOOL_SIM_GRANULARITY", "64KiB", 1) == 0);
    OK(cuInit(0));
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &dev0_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK_EQ(g, 65536);
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    OK(cuMemAddressReserve(&va, 1 * MIB, 0, 0, 0));
    OK(cuMemCreate(&h, 64 * 1024, &dev0_prop, 0));
    OK(cuMemMap(va + 128 * 1024, 64 * 1024, 0, h, 0));
}

static void test_copies(void)
{
    sim_test_init();
    CUdeviceptr a = 0, b = 0;
    OK(cuMemAlloc_v2(&a, 1000));
    OK(cuMemAlloc_v2(&b, 1000));
    unsigned char src[1001], dst[1001];
    for (int i = 0; i < 1001; i++)
        src[i] = (unsigned char)i;
    OK(cuMemcpyHtoD_v2(a, src, 1000));
    CHECK_RC(cuMemcpyHtoD_v2(a, src, 1001), CUDA_ERROR_INVALID_VALUE); /* one byte too many */
    CHECK(strstr(gpupoolSimLastErrorDetail(), "not device memory") != NULL);
    OK(cuMemcpyDtoH_v2(dst, a + 999, 1));
    CHECK_EQ(dst[0], src[999]);
    CHECK_RC(cuMemcpyDtoH_v2(dst, a + 999, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyDtoH_v2(dst, 0x1234, 4), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyDtoH_v2(dst, (CUdeviceptr)(uintptr_t)dst, 4), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyDtoH_v2(dst, a + 4096 * 100, 4), CUDA_ERROR_INVALID_VALUE); /* heap gap */
    CHECK_RC(cuMemcpyDtoH_v2(dst, ~0ull - 2, 8), CUDA_ERROR_INVALID_VALUE);      /* wraps */
    CHECK_RC(cuMemcpyHtoD_v2(a, NULL, 4), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemcpyHtoD_v2(0x1234, src, 0)); /* nothing to do */
    OK(cuMemcpyDtoD_v2(b, a, 1000));
    OK(cuMemcpyDtoH_v2(dst, b, 1000));
    CHECK(memcmp(dst, src, 1000) == 0);
    OK(cuMemcpyDtoD_v2(a + 1, a, 999)); /* overlapping: memmove semantics */
    OK(cuMemcpyDtoH_v2(dst, a, 1000));
    CHECK_EQ(dst[1], src[0]);
    CHECK_EQ(dst[999], src[998]);
    CHECK_RC(cuMemcpyDtoD_v2(b, a, 1001), CUDA_ERROR_INVALID_VALUE);

    CUstream s = NULL;
    OK(cuStreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0));
    OK(cuMemcpyHtoDAsync_v2(a, src, 1000, s));
    OK(cuMemcpyDtoDAsync_v2(b, a, 1000, CU_STREAM_PER_THREAD));
    memset(dst, 0, sizeof(dst));
    OK(cuMemcpyDtoHAsync_v2(dst, b, 1000, CU_STREAM_LEGACY));
    CHECK(memcmp(dst, src, 1000) == 0); /* done when the call returns */
    CHECK_RC(cuMemcpyHtoDAsync_v2(a, src, 8, (CUstream)0x5555), CUDA_ERROR_INVALID_HANDLE);
    OK(cuStreamDestroy_v2(s));
    CHECK_RC(cuMemcpyDtoHAsync_v2(dst, a, 8, s), CUDA_ERROR_INVALID_HANDLE);
}

/* gpupoolSimHostPointer: the host address of a device range, only when all of it is mapped. */
static void test_host_pointer(void)
{
    sim_test_init();
    CUdeviceptr va = 0;
    OK(cuMemAddressReserve(&va, 16 * MIB, 0, 0x200000000000ull, 0));
    CUmemGenericAllocationHandle h1 = 0, h2 = 0, h3 = 0;
    OK(cuMemCreate(&h1, 2 * MIB, &dev0_prop, 0));
    OK(cuMemCreate(&h2, 2 * MIB, &dev0_prop, 0));
    OK(cuMemCreate(&h3, 2 * MIB, &dev0_prop, 0));
    /* [va, +4 MiB) mapped as two adjacent mappings, a hole at [+4 MiB, +6 MiB), then mapped. */
    OK(cuMemMap(va, 2 * MIB, 0, h1, 0));
    OK(cuMemMap(va + 2 * MIB, 2 * MIB, 0, h2, 0));
    OK(cuMemMap(va + 6 * MIB, 2 * MIB, 0, h3, 0));
    CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(va, 4 * MIB, &acc, 1));
    OK(cuMemSetAccess(va + 6 * MIB, 2 * MIB, &acc, 1));

    void *host = NULL;
    OK(gpupoolSimHostPointer(va + 3, 4 * MIB - 3, &host)); /* across the two mappings */
    CHECK(host != NULL);
    /* The address is the device memory itself: what is written there, a copy reads back. */
    unsigned char *p = host;
    for (size_t i = 0; i < 4 * MIB - 3; i += 4099)
        p[i] = (unsigned char)(i ^ 0x5a);
    unsigned char b = 0;
    OK(cuMemcpyDtoH_v2(&b, va + 3 + 4099 * 7, 1));
    CHECK_EQ(b, (unsigned char)((4099 * 7) ^ 0x5a));
    OK(gpupoolSimHostPointer(va + 4 * MIB - 1, 1, &host)); /* the last mapped byte */
    OK(gpupoolSimHostPointer(va + 6 * MIB, 2 * MIB, &host));

    /* Partly unmapped: one byte into the hole, straddling the hole, or starting in it. */
    void *const untouched = (void *)(uintptr_t)0x1234;
    host = untouched;
    CHECK_RC(gpupoolSimHostPointer(va, 4 * MIB + 1, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "not device memory") != NULL);
    CHECK_RC(gpupoolSimHostPointer(va + 3 * MIB, 4 * MIB, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(gpupoolSimHostPointer(va + 5 * MIB, 2 * MIB, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(gpupoolSimHostPointer(va + 6 * MIB, 2 * MIB + 1, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(gpupoolSimHostPointer(va + 4 * MIB, 1, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(gpupoolSimHostPointer(0x1234, 4, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(gpupoolSimHostPointer(~0ull - 2, 8, &host), CUDA_ERROR_INVALID_VALUE); /* wraps */
    CHECK_RC(gpupoolSimHostPointer(va, 0, &host), CUDA_ERROR_INVALID_VALUE);
    CHECK(host == untouched); /* no result on failure */
    CHECK_RC(gpupoolSimHostPointer(va, 16, NULL), CUDA_ERROR_INVALID_VALUE);

    /* cuMemAlloc memory too; once unmapped or freed, the range is gone. */
    CUdeviceptr a = 0;
    OK(cuMemAlloc_v2(&a, 1000));
    OK(gpupoolSimHostPointer(a, 1000, &host));
    CHECK_EQ((uintptr_t)host, (uintptr_t)a);
    OK(cuMemFree_v2(a));
    CHECK_RC(gpupoolSimHostPointer(a, 1000, &host), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(va + 2 * MIB, 2 * MIB));
    CHECK_RC(gpupoolSimHostPointer(va, 4 * MIB, &host), CUDA_ERROR_INVALID_VALUE);
    OK(gpupoolSimHostPointer(va, 2 * MIB, &host));

    /* Like a copy, it needs a current context. */
    OK(cuCtxSetCurrent(NULL));
    CHECK_RC(gpupoolSimHostPointer(va, 16, &host), CUDA_ERROR_INVALID_CONTEXT);
}

static void test_memsets(void)
{
    sim_test_init();
    CUdeviceptr a = 0;
    OK(cuMemAlloc_v2(&a, 64));
    unsigned char out[64];
    OK(cuMemsetD8_v2(a, 0xab, 64));
    OK(cuMemcpyDtoH_v2(out, a, 64));
    for (int i = 0; i < 64; i++)
        CHECK_EQ(out[i], 0xab);
    OK(cuMemsetD16_v2(a + 2, 0x1234, 3));
    OK(cuMemcpyDtoH_v2(out, a, 10));
    uint16_t h[5];
    memcpy(h, out, 10);
    CHECK_EQ(h[0], 0xabab);
    CHECK_EQ(h[1], 0x1234);
    CHECK_EQ(h[3], 0x1234);
    CHECK_EQ(h[4], 0xabab);
    OK(cuMemsetD32_v2(a + 16, 0xdeadbeef, 12));
    uint32_t w[16];
    OK(cuMemcpyDtoH_v2(w, a, 64));
    CHECK_EQ(w[3], 0xabababab);
    CHECK_EQ(w[4], 0xdeadbeef);
    CHECK_EQ(w[15], 0xdeadbeef);
    CHECK_RC(cuMemsetD16_v2(a + 1, 0, 2), CUDA_ERROR_INVALID_VALUE); /* misaligned */
    CHECK_RC(cuMemsetD32_v2(a + 2, 0, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD32_v2(a, 0, 17), CUDA_ERROR_INVALID_VALUE); /* 68 bytes > 64 */
    CHECK_RC(cuMemsetD8_v2(a, 0, (size_t)-1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD32_v2(a, 0, (size_t)-1 / 2), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemsetD8Async(a, 1, 64, NULL));
    OK(cuMemsetD16Async(a, 2, 32, CU_STREAM_LEGACY));
    OK(cuMemsetD32Async(a, 3, 16, CU_STREAM_PER_THREAD));
    OK(cuMemcpyDtoH_v2(w, a, 64));
    CHECK_EQ(w[7], 3);
    CHECK_RC(cuMemsetD8Async(a, 1, 64, (CUstream)0x77), CUDA_ERROR_INVALID_HANDLE);

    /* 2D: 3 rows of 2 elements, rows 16 bytes apart; the gaps keep their bytes. */
    OK(cuMemsetD8_v2(a, 0, 64));
    OK(cuMemsetD2D32Async(a + 4, 16, 0x01020304, 2, 3, NULL));
    OK(cuMemcpyDtoH_v2(w, a, 64));
    for (int i = 0; i < 16; i++)
        CHECK_EQ(w[i], (i % 4 == 1 || i % 4 == 2) && i < 12 ? 0x01020304u : 0u);
    OK(cuMemsetD2D16Async(a, 8, 0xbeef, 1, 8, NULL));
    OK(cuMemsetD2D8Async(a + 63, 1, 0x7f, 1, 1, NULL));
    OK(cuMemcpyDtoH_v2(out, a, 64));
    CHECK_EQ(out[56] | out[57] << 8, 0xbeef);
    CHECK_EQ(out[63], 0x7f);
    OK(cuMemsetD2D8Async(a, 0, 1, 0, 5, NULL)); /* nothing to do */
    /* pitch < width; misaligned pitch; past the end of the allocation */
    CHECK_RC(cuMemsetD2D8Async(a, 4, 1, 8, 2, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD2D32Async(a, 6, 1, 1, 2, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD2D8Async(a, 16, 1, 16, 5, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD2D8Async(a, 16, 1, 16, 2, (CUstream)0x77), CUDA_ERROR_INVALID_HANDLE);
}

static void test_host_alloc(void)
{
    sim_test_init();
    void *p = NULL;
    OK(cuMemHostAlloc(&p, 10000, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
    memset(p, 0x5a, 10000);
    /* With unified addressing, pinned host memory is also reachable as device memory. */
    CUdeviceptr d = 0;
    OK(cuMemAlloc_v2(&d, 10000));
    OK(cuMemcpyDtoD_v2(d, (CUdeviceptr)(uintptr_t)p, 10000));
    unsigned char c = 0;
    OK(cuMemcpyDtoH_v2(&c, d + 9999, 1));
    CHECK_EQ(c, 0x5a);
    size_t free0 = 0;
    OK(cuMemGetInfo_v2(&free0, NULL));
    CHECK_EQ(80 * GIB - free0, 12288); /* pinned memory is not device memory */
    CHECK_RC(cuMemHostAlloc(&p, 16, 0x80), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemHostAlloc(&p, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFreeHost((char *)p + 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFreeHost(p));
    CHECK_RC(cuMemFreeHost(p), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFreeHost(&c), CUDA_ERROR_INVALID_VALUE);
}

static void test_context_owns_memory(void)
{
    OK(cuInit(0));
    CUcontext c1 = NULL;
    OK(cuCtxCreate_v2(&c1, 0, 0));
    CUdeviceptr p = 0;
    void *h = NULL;
    OK(cuMemAlloc_v2(&p, 32 * MIB));
    OK(cuMemHostAlloc(&h, 4096, 0));
    OK(cuCtxDestroy_v2(c1));
    sim_test_init();
    size_t free0 = 0;
    OK(cuMemGetInfo_v2(&free0, NULL));
    CHECK_EQ(free0, 80 * GIB); /* the destroyed context's memory was freed with it */
    unsigned char x = 0;
    CHECK_RC(cuMemcpyDtoH_v2(&x, p, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFreeHost(h), CUDA_ERROR_INVALID_VALUE);
}

SIM_TEST_MAIN(SIM_T(heap), SIM_T(heap_oom), SIM_T(reserve), SIM_T(vmm_map), SIM_T(vmm_oom),
              SIM_T(granularity_config), SIM_T(copies), SIM_T(host_pointer), SIM_T(memsets),
              SIM_T(host_alloc), SIM_T(context_owns_memory))
