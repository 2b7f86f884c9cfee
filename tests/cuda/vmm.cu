/*
 * vmm.cu: the virtual memory management calls (as PyTorch's expandable segments use them) and
 * the stream-ordered allocator's default pool (as its cudaMallocAsync backend uses it).
 *
 * VMM: granularity; reserve; two physical allocations mapped side by side; access; copies H2D,
 * D2D, D2H and a memset across the boundary between them; pointer attributes; retain; a second
 * mapping of one allocation (aliasing); unmap and remap (the data stays in the allocation);
 * release while mapped (the memory stays until unmapped); the driver's error codes for a map
 * outside a reservation, an unmap of an unmapped range and a copy into unmapped addresses.
 * Pools: default pool, release threshold, cudaMallocAsync / cudaFreeAsync with copies, used and
 * reserved memory and their high-water marks, trim, cudaMallocFromPoolAsync.
 */
#include "gp_check.cuh"

#include <vector>

typedef CUresult (*granularity_fn)(size_t *, const CUmemAllocationProp *,
                                   CUmemAllocationGranularity_flags);
typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*address_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                           unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*set_access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*get_access_fn)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
typedef CUresult (*props_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*retain_fn)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*ptr_attr_fn)(void *, CUpointer_attribute, CUdeviceptr);

static granularity_fn pGranularity;
static reserve_fn pReserve;
static address_free_fn pAddressFree;
static create_fn pCreate;
static release_fn pRelease;
static map_fn pMap;
static unmap_fn pUnmap;
static set_access_fn pSetAccess;
static get_access_fn pGetAccess;
static props_fn pProps;
static retain_fn pRetain;
static ptr_attr_fn pPtrAttr;

#define EXPECT_CU_ERR(call, want)                                                              \
    do {                                                                                       \
        CUresult gp_r_ = (call);                                                               \
        ++gp_checks;                                                                           \
        if (gp_r_ != (want))                                                                   \
            gp_fail(__FILE__, __LINE__, "%s -> CUresult %d, expected %d", #call, (int)gp_r_,   \
                    (int)(want));                                                              \
    } while (0)

static void resolve(void)
{
#define RESOLVE(var, name)                                                                     \
    do {                                                                                       \
        var = (decltype(var))gp_driver_fn(name);                                               \
        EXPECT(var != NULL, "driver entry point %s not found", name);                          \
        if (!var)                                                                              \
            exit(gp_finish());                                                                 \
    } while (0)
    RESOLVE(pGranularity, "cuMemGetAllocationGranularity");
    RESOLVE(pReserve, "cuMemAddressReserve");
    RESOLVE(pAddressFree, "cuMemAddressFree");
    RESOLVE(pCreate, "cuMemCreate");
    RESOLVE(pRelease, "cuMemRelease");
    RESOLVE(pMap, "cuMemMap");
    RESOLVE(pUnmap, "cuMemUnmap");
    RESOLVE(pSetAccess, "cuMemSetAccess");
    RESOLVE(pGetAccess, "cuMemGetAccess");
    RESOLVE(pProps, "cuMemGetAllocationPropertiesFromHandle");
    RESOLVE(pRetain, "cuMemRetainAllocationHandle");
    RESOLVE(pPtrAttr, "cuPointerGetAttribute");
#undef RESOLVE
}

/* Copies n bytes at d back and compares them with the pattern (seed, starting at position pos). */
static void expect_pattern(CUdeviceptr d, size_t n, uint64_t seed, const char *what)
{
    std::vector<uint8_t> back(n), want(n);
    CHECK(cudaMemcpy(back.data(), (void *)d, n, cudaMemcpyDeviceToHost));
    gp_fill(want.data(), n, seed);
    size_t bad = 0;
    while (bad < n && back[bad] == want[bad])
        bad++;
    EXPECT(bad == n, "%s: byte %zu of %zu differs (0x%02x, expected 0x%02x)", what, bad, n,
           bad < n ? back[bad] : 0, bad < n ? want[bad] : 0);
}

static void test_vmm(void)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;

    size_t g = 0, rec = 0;
    CHECK_CU(pGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK_CU(pGranularity(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    EXPECT(g != 0 && (g & (g - 1)) == 0, "granularity %zu is not a power of two", g);
    EXPECT(rec >= g && rec % g == 0, "recommended granularity %zu vs minimum %zu", rec, g);
    if (g == 0)
        return;

    CUdeviceptr base = 0;
    CHECK_CU(pReserve(&base, 4 * g, 0, 0, 0));
    EXPECT(base != 0 && base % g == 0, "reservation at 0x%llx", (unsigned long long)base);
    EXPECT_CU_ERR(pReserve(&base, g + 1, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);

    CUmemGenericAllocationHandle h1 = 0, h2 = 0;
    CHECK_CU(pCreate(&h1, g, &prop, 0));
    CHECK_CU(pCreate(&h2, 2 * g, &prop, 0));
    EXPECT_CU_ERR(pCreate(&h2, g / 2, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    /* More than the device has: the call's own result (PyTorch frees its cache and retries). */
    size_t total = 0, free_b = 0;
    CHECK(cudaMemGetInfo(&free_b, &total));
    CUmemGenericAllocationHandle huge = 0;
    EXPECT_CU_ERR(pCreate(&huge, (2 * total + g - 1) / g * g, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CUmemAllocationProp got;
    memset(&got, 0xff, sizeof got);
    CHECK_CU(pProps(&got, h2));
    EXPECT(got.type == CU_MEM_ALLOCATION_TYPE_PINNED &&
               got.location.type == CU_MEM_LOCATION_TYPE_DEVICE && got.location.id == 0,
           "properties from handle: type %d location %d/%d", (int)got.type,
           (int)got.location.type, got.location.id);

    /* h1 at [0, g), h2 at [g, 3g): one contiguous span of 3g. */
    CHECK_CU(pMap(base, g, 0, h1, 0));
    CHECK_CU(pMap(base + g, 2 * g, 0, h2, 0));
    CUmemLocation loc = prop.location;
    unsigned long long flags = 99;
    CHECK_CU(pGetAccess(&flags, &loc, base));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_NONE, "access before cuMemSetAccess: %llu", flags);
    CUmemAccessDesc access;
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CHECK_CU(pSetAccess(base, 3 * g, &access, 1));
    CHECK_CU(pGetAccess(&flags, &loc, base + g + 5));
    EXPECT(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access after cuMemSetAccess: %llu", flags);

    /* Copies over the whole span and across the boundary. */
    size_t span = 3 * g;
    std::vector<uint8_t> host(span);
    gp_fill(host.data(), span, 11);
    CHECK(cudaMemcpy((void *)base, host.data(), span, cudaMemcpyHostToDevice));
    expect_pattern(base, span, 11, "H2D/D2H of the whole span");
    size_t win = 1 << 20, at = g - win / 2; /* straddles h1 | h2 */
    std::vector<uint8_t> w(win);
    gp_fill(w.data(), win, 12);
    CHECK(cudaMemcpy((void *)(base + at), w.data(), win, cudaMemcpyHostToDevice));
    expect_pattern(base + at, win, 12, "H2D/D2H across the boundary");
    CHECK(cudaMemcpy((void *)(base + 2 * g), (void *)(base + at), win, cudaMemcpyDeviceToDevice));
    expect_pattern(base + 2 * g, win, 12, "D2D from across the boundary");
    CHECK(cudaMemset((void *)(base + g - 100), 0xab, 200));
    std::vector<uint8_t> ms(300);
    CHECK(cudaMemcpy(ms.data(), (void *)(base + g - 150), 300, cudaMemcpyDeviceToHost));
    long long bad = gp_verify_byte(ms.data() + 50, 200, 0xab);
    EXPECT(bad < 0, "memset across the boundary: byte %lld", bad);
    CHECK(cudaDeviceSynchronize());

    /* Pointer attributes, answered for mapped memory. */
    unsigned int mtype = 0;
    CHECK_CU(pPtrAttr(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, base + g + 5));
    EXPECT(mtype == CU_MEMORYTYPE_DEVICE, "memory type %u", mtype);
    CUdeviceptr mbase = 0;
    size_t msize = 0;
    CHECK_CU(pPtrAttr(&mbase, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, base + g + 5));
    CHECK_CU(pPtrAttr(&msize, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, base + g + 5));
    EXPECT(mbase == base + g && msize == 2 * g, "mapping 0x%llx+%zu, expected 0x%llx+%zu",
           (unsigned long long)mbase, msize, (unsigned long long)(base + g), 2 * g);
    int aflags = 0;
    CHECK_CU(pPtrAttr(&aflags, CU_POINTER_ATTRIBUTE_ACCESS_FLAGS, base));
    EXPECT(aflags == CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE, "access flags %d", aflags);
    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, (void *)(base + 7)));
    EXPECT(pa.type == cudaMemoryTypeDevice && pa.device == 0, "cudart type %d device %d",
           (int)pa.type, pa.device);

    CUmemGenericAllocationHandle r = 0;
    CHECK_CU(pRetain(&r, (void *)(base + g + 5)));
    EXPECT(r == h2, "retained handle 0x%llx, expected 0x%llx", (unsigned long long)r,
           (unsigned long long)h2);
    CHECK_CU(pRelease(r)); /* drops the reference cuMemRetainAllocationHandle added */

    /* The error codes. gpupool maps only inside the program's own reservations and within the
     * handle's size; the real driver (580.x on an H200) accepted a mapping that runs past the
     * reservation's end, answers a non-zero offset with CUDA_ERROR_NOT_SUPPORTED and unmaps
     * a range that holds no mapping without complaint; gpupool refuses all three. */
    if (gp_through_gpupool()) {
        EXPECT_CU_ERR(pMap(base + 3 * g, 2 * g, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);
        EXPECT_CU_ERR(pMap(base + 3 * g, g, 2 * g, h2, 0), CUDA_ERROR_INVALID_VALUE);
        EXPECT_CU_ERR(pUnmap(base + 3 * g, g), CUDA_ERROR_INVALID_VALUE);
    }
    EXPECT(cudaMemcpy((void *)(base + 3 * g), host.data(), 4096, cudaMemcpyHostToDevice) !=
               cudaSuccess,
           "a copy into reserved but unmapped addresses succeeded");
    (void)cudaGetLastError();

    /* A second mapping of h1 at [3g, 4g) aliases the first. */
    CHECK_CU(pMap(base + 3 * g, g, 0, h1, 0));
    CHECK_CU(pSetAccess(base + 3 * g, g, &access, 1));
    std::vector<uint8_t> a(4096);
    gp_fill(a.data(), a.size(), 13);
    CHECK(cudaMemcpy((void *)(base + 3 * g + 8192), a.data(), a.size(), cudaMemcpyHostToDevice));
    expect_pattern(base + 8192, a.size(), 13, "the first mapping of h1 after writing the second");

    /* Unmap h1's first mapping and map it again: the data is in the allocation. */
    CHECK_CU(pUnmap(base, g));
    EXPECT(cudaMemcpy(ms.data(), (void *)base, 16, cudaMemcpyDeviceToHost) != cudaSuccess,
           "a copy from an unmapped range succeeded");
    (void)cudaGetLastError();
    CHECK_CU(pMap(base, g, 0, h1, 0));
    CHECK_CU(pSetAccess(base, g, &access, 1));
    expect_pattern(base + 8192, a.size(), 13, "h1 after unmap and remap");

    /* Release h2 while it is mapped: its memory stays until the unmap. */
    CHECK_CU(pRelease(h2));
    std::vector<uint8_t> tail(4096);
    CHECK(cudaMemcpy(tail.data(), (void *)(base + 2 * g), tail.size(), cudaMemcpyDeviceToHost));
    std::vector<uint8_t> want(win);
    gp_fill(want.data(), win, 12);
    EXPECT(memcmp(tail.data(), want.data(), tail.size()) == 0,
           "h2's data changed after cuMemRelease while mapped");

    CHECK_CU(pUnmap(base, g));
    CHECK_CU(pUnmap(base + g, 2 * g));
    CHECK_CU(pUnmap(base + 3 * g, g));
    if (gp_through_gpupool())
        EXPECT_CU_ERR(pUnmap(base, g), CUDA_ERROR_INVALID_VALUE);
    CHECK_CU(pRelease(h1));
    CHECK_CU(pAddressFree(base, 4 * g));
    CHECK(cudaDeviceSynchronize());
}

static void test_pool(void)
{
    cudaMemPool_t pool = NULL;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    cuuint64_t threshold = 1, v = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    EXPECT(threshold == 0, "default release threshold %llu", (unsigned long long)threshold);
    cuuint64_t big = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &big));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &v));
    EXPECT(v == UINT64_MAX, "release threshold %llu after setting it", (unsigned long long)v);
    int reuse = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &reuse));
    EXPECT(reuse == 1, "opportunistic reuse %d", reuse);

    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const size_t na = 5 << 20, nb = (1 << 20) + 3;
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK(cudaMallocAsync(&a, na, s));
    CHECK(cudaMallocAsync(&b, nb, s));
    std::vector<uint8_t> host(na), back(nb);
    gp_fill(host.data(), na, 21);
    CHECK(cudaMemcpyAsync(a, host.data(), na, cudaMemcpyHostToDevice, s));
    CHECK(cudaMemcpyAsync(b, (uint8_t *)a + 77, nb, cudaMemcpyDeviceToDevice, s));
    CHECK(cudaMemcpyAsync(back.data(), b, nb, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    EXPECT(memcmp(back.data(), host.data() + 77, nb) == 0, "stream-ordered allocation data differs");

    cuuint64_t used = 0, reserved = 0, used_high = 0, reserved_high = 0;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_high));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved_high));
    EXPECT(used >= na + nb, "used %llu < %zu", (unsigned long long)used, na + nb);
    EXPECT(reserved >= used, "reserved %llu < used %llu", (unsigned long long)reserved,
           (unsigned long long)used);
    EXPECT(used_high >= used && reserved_high >= reserved, "high-water marks %llu/%llu",
           (unsigned long long)used_high, (unsigned long long)reserved_high);
    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, a));
    EXPECT(pa.type == cudaMemoryTypeDevice, "pointer type %d", (int)pa.type);

    CHECK(cudaFreeAsync(a, s));
    CHECK(cudaFreeAsync(b, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    EXPECT(used == 0, "used %llu after freeing everything", (unsigned long long)used);
    CHECK(cudaMemPoolTrimTo(pool, 0));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    EXPECT(reserved == 0, "reserved %llu after trimming to 0", (unsigned long long)reserved);
    cuuint64_t zero = 0;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used_high));
    EXPECT(used_high == 0, "used high %llu after the reset", (unsigned long long)used_high);
    cuuint64_t one = 1;
    EXPECT_ERR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &one),
               cudaErrorInvalidValue);

    CHECK(cudaMallocFromPoolAsync(&c, 1 << 20, pool, s));
    CHECK(cudaMemsetAsync(c, 0x5a, 1 << 20, s));
    std::vector<uint8_t> cb(1 << 20);
    CHECK(cudaMemcpyAsync(cb.data(), c, cb.size(), cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    long long bad = gp_verify_byte(cb.data(), cb.size(), 0x5a);
    EXPECT(bad < 0, "pool allocation memset: byte %lld", bad);
    CHECK(cudaFreeAsync(c, s));
    CHECK(cudaStreamSynchronize(s));

    if (gp_is_simulated()) {
        /* Over gpupool only the default pool exists (one line on stderr says so). */
        cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = 0;
        cudaMemPool_t mine;
        EXPECT_ERR(cudaMemPoolCreate(&mine, &props), cudaErrorNotSupported);
        (void)cudaGetLastError();
    }
    CHECK(cudaStreamDestroy(s));
}

int main(void)
{
    gp_begin("vmm");
    REQUIRE(cudaFree(0));
    resolve();
    test_vmm();
    test_pool();
    return gp_finish();
}
