/*
 * devices.cu: device count and properties as the program sees them.
 *
 *     devices [expected_count]
 *
 * Checks the count (when given) and prints, for every device, the properties as `key=value`
 * lines prefixed with `dev<N>.`, so tests/test_e2e_cuda.py compares them with what the server
 * declares (/api/v1/gpus or the simulated device's defaults). Also checks that the runtime and the
 * driver API agree with each other, and that out-of-range devices are refused.
 */
#include "gp_check.cuh"

typedef CUresult (*pfn_cuDeviceGetName)(char *, int, CUdevice);
typedef CUresult (*pfn_cuDeviceTotalMem)(size_t *, CUdevice);
typedef CUresult (*pfn_cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*pfn_cuDriverGetVersion)(int *);

static void print_uuid(int dev, const unsigned char *b)
{
    printf("dev%d.uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", dev,
           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
           b[14], b[15]);
}

int main(int argc, char **argv)
{
    gp_begin("devices");
    int count = -1;
    REQUIRE(cudaGetDeviceCount(&count));
    printf("device_count=%d\n", count);
    if (argc > 1) {
        int want = atoi(argv[1]);
        EXPECT(count == want, "cudaGetDeviceCount = %d, expected %d", count, want);
    }
    int drv = 0, rt = 0;
    CHECK(cudaDriverGetVersion(&drv));
    CHECK(cudaRuntimeGetVersion(&rt));
    printf("driver_version=%d\nruntime_version=%d\n", drv, rt);
    EXPECT(drv >= 13000, "driver version %d is older than CUDA 13", drv);

    pfn_cuDeviceGetName getName = (pfn_cuDeviceGetName)gp_driver_fn("cuDeviceGetName");
    pfn_cuDeviceTotalMem totalMem = (pfn_cuDeviceTotalMem)gp_driver_fn("cuDeviceTotalMem");
    pfn_cuDeviceGetAttribute getAttr = (pfn_cuDeviceGetAttribute)gp_driver_fn("cuDeviceGetAttribute");
    pfn_cuDriverGetVersion drvVersion = (pfn_cuDriverGetVersion)gp_driver_fn("cuDriverGetVersion");
    EXPECT(getName && totalMem && getAttr && drvVersion, "driver entry points not found");

    if (drvVersion) {
        int v = 0;
        CHECK_CU(drvVersion(&v));
        EXPECT(v == drv, "cuDriverGetVersion %d != cudaDriverGetVersion %d", v, drv);
    }

    for (int d = 0; d < count; d++) {
        cudaDeviceProp p;
        memset(&p, 0, sizeof p);
        CHECK(cudaGetDeviceProperties(&p, d));
        printf("dev%d.name=%s\n", d, p.name);
        print_uuid(d, (const unsigned char *)p.uuid.bytes);
        printf("dev%d.totalGlobalMem=%zu\n", d, p.totalGlobalMem);
        printf("dev%d.major=%d\n", d, p.major);
        printf("dev%d.minor=%d\n", d, p.minor);
        printf("dev%d.multiProcessorCount=%d\n", d, p.multiProcessorCount);
        printf("dev%d.pciDomainID=%d\n", d, p.pciDomainID);
        printf("dev%d.pciBusID=%d\n", d, p.pciBusID);
        printf("dev%d.pciDeviceID=%d\n", d, p.pciDeviceID);
        printf("dev%d.maxThreadsPerBlock=%d\n", d, p.maxThreadsPerBlock);
        printf("dev%d.maxThreadsDim=%d,%d,%d\n", d, p.maxThreadsDim[0], p.maxThreadsDim[1],
               p.maxThreadsDim[2]);
        printf("dev%d.maxGridSize=%d,%d,%d\n", d, p.maxGridSize[0], p.maxGridSize[1], p.maxGridSize[2]);
        printf("dev%d.warpSize=%d\n", d, p.warpSize);
        printf("dev%d.sharedMemPerBlock=%zu\n", d, p.sharedMemPerBlock);
        printf("dev%d.sharedMemPerBlockOptin=%zu\n", d, p.sharedMemPerBlockOptin);
        printf("dev%d.regsPerBlock=%d\n", d, p.regsPerBlock);
        printf("dev%d.l2CacheSize=%d\n", d, p.l2CacheSize);
        printf("dev%d.memoryBusWidth=%d\n", d, p.memoryBusWidth);
        printf("dev%d.asyncEngineCount=%d\n", d, p.asyncEngineCount);
        printf("dev%d.unifiedAddressing=%d\n", d, p.unifiedAddressing);
        printf("dev%d.integrated=%d\n", d, p.integrated);
        printf("dev%d.totalConstMem=%zu\n", d, p.totalConstMem);

        /* Sanity that holds for any CUDA 13 device. */
        EXPECT(p.name[0] != 0, "device %d has an empty name", d);
        EXPECT(p.totalGlobalMem > 0, "device %d totalGlobalMem is 0", d);
        EXPECT(p.major >= 7, "device %d compute capability %d.%d < 7.5", d, p.major, p.minor);
        EXPECT(p.multiProcessorCount > 0, "device %d has no SMs", d);
        EXPECT(p.warpSize == 32, "device %d warpSize %d", d, p.warpSize);
        EXPECT(p.maxThreadsPerBlock >= 1024, "device %d maxThreadsPerBlock %d", d, p.maxThreadsPerBlock);
        EXPECT(p.unifiedAddressing == 1, "device %d unifiedAddressing %d", d, p.unifiedAddressing);

        /* The runtime's answer and the driver's answer must be the same. */
        int v = -1;
        CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d));
        EXPECT(v == p.multiProcessorCount, "attribute SM count %d != props %d", v,
               p.multiProcessorCount);
        if (getName && totalMem && getAttr) {
            char name[256] = {0};
            size_t tm = 0;
            CHECK_CU(getName(name, sizeof name, d));
            EXPECT(strcmp(name, p.name) == 0, "cuDeviceGetName '%s' != props '%s'", name, p.name);
            CHECK_CU(totalMem(&tm, d));
            EXPECT(tm == p.totalGlobalMem, "cuDeviceTotalMem %zu != props %zu", tm, p.totalGlobalMem);
            int cc = -1;
            CHECK_CU(getAttr(&cc, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d));
            EXPECT(cc == p.major, "driver cc major %d != props %d", cc, p.major);
            CHECK_CU(getAttr(&cc, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d));
            EXPECT(cc == p.pciBusID, "driver pci bus %d != props %d", cc, p.pciBusID);
        }
        char busid[64] = {0};
        CHECK(cudaDeviceGetPCIBusId(busid, sizeof busid, d));
        printf("dev%d.pciBusIdString=%s\n", d, busid);
        int back = -1;
        CHECK(cudaDeviceGetByPCIBusId(&back, busid));
        EXPECT(back == d, "cudaDeviceGetByPCIBusId(%s) = %d, expected %d", busid, back, d);
    }

    /* memory info of device 0 through a context */
    if (count > 0) {
        size_t freeb = 0, total = 0;
        CHECK(cudaSetDevice(0));
        CHECK(cudaMemGetInfo(&freeb, &total));
        printf("dev0.memGetInfo.free=%zu\ndev0.memGetInfo.total=%zu\n", freeb, total);
        cudaDeviceProp p;
        CHECK(cudaGetDeviceProperties(&p, 0));
        EXPECT(total == p.totalGlobalMem, "cudaMemGetInfo total %zu != totalGlobalMem %zu", total,
               p.totalGlobalMem);
        EXPECT(freeb <= total && freeb > 0, "cudaMemGetInfo free %zu of %zu", freeb, total);
        int cur = -1;
        CHECK(cudaGetDevice(&cur));
        EXPECT(cur == 0, "cudaGetDevice = %d", cur);
    }

    /* out of range */
    cudaDeviceProp bad;
    EXPECT_ERR(cudaGetDeviceProperties(&bad, count), cudaErrorInvalidDevice);
    EXPECT_ERR(cudaSetDevice(count + 3), cudaErrorInvalidDevice);
    (void)cudaGetLastError();
    return gp_finish();
}
