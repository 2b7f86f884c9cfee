/*
 * sim_memtool.c: one "tenant" process on the simulated device, for the tests of device memory
 * that outlives a process (memory_file) and of the scrub (tests/test_sim_device.py,
 * tests/test_scrub.py). Configure the device with GPUPOOL_SIM_* as usual.
 *
 *   sim_memtool [--vmm] fill SEED SIZE...   allocate each size in order, write a pattern, exit
 *   sim_memtool [--vmm] check SEED SIZE...  allocate the same way, count the bytes that still hold
 *                                           the pattern and the zero bytes; one JSON line
 *   sim_memtool [--vmm] zero SIZE...        allocate, cuMemsetD8 0 over each allocation, exit
 *
 * Allocations are never freed (the process just exits), as a crashing tenant would leave them.
 * --vmm: cuMemCreate + cuMemAddressReserve + cuMemMap (sizes rounded up to the granularity)
 * instead of cuMemAlloc. Exit 0, or 1 with the failed call on stderr.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_api.h"

#define MAX_ALLOCS 64

static void die_rc(const char *what, CUresult rc)
{
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS)
        name = "?";
    fprintf(stderr, "sim_memtool: %s: %s (%s)\n", what, name, gpupoolSimLastErrorDetail());
    exit(1);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        CUresult rc_ = (call);                                                                     \
        if (rc_ != CUDA_SUCCESS)                                                                   \
            die_rc(#call, rc_);                                                                    \
    } while (0)

static uint64_t parse_u64(const char *s)
{
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0' || *s == '-') {
        fprintf(stderr, "sim_memtool: bad number '%s'\n", s);
        exit(1);
    }
    return v;
}

/* The pattern byte at offset i of allocation k: never the same in two places a test compares. */
static unsigned char pattern(uint64_t seed, size_t k, uint64_t i)
{
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + k * 0xBF58476D1CE4E5B9ull + i;
    x ^= x >> 29;
    x *= 0x94D049BB133111EBull;
    return (unsigned char)(x >> 32);
}

static CUdeviceptr alloc(bool vmm, uint64_t size)
{
    CUdeviceptr p = 0;
    if (!vmm) {
        CK(cuMemAlloc_v2(&p, size));
        return p;
    }
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
    size_t g = 0;
    CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    uint64_t rounded = (size + g - 1) / g * g;
    CUmemGenericAllocationHandle h = 0;
    CK(cuMemCreate(&h, rounded, &prop, 0));
    CK(cuMemAddressReserve(&p, rounded, 0, 0, 0));
    CK(cuMemMap(p, rounded, 0, h, 0));
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CK(cuMemSetAccess(p, rounded, &acc, 1));
    return p;
}

int main(int argc, char **argv)
{
    int a = 1;
    bool vmm = a < argc && strcmp(argv[a], "--vmm") == 0;
    if (vmm)
        a++;
    if (a >= argc) {
        fprintf(stderr, "usage: sim_memtool [--vmm] fill|check SEED SIZE... | zero SIZE...\n");
        return 1;
    }
    const char *cmd = argv[a++];
    bool zero = strcmp(cmd, "zero") == 0;
    if (!zero && strcmp(cmd, "fill") != 0 && strcmp(cmd, "check") != 0) {
        fprintf(stderr, "sim_memtool: unknown command '%s'\n", cmd);
        return 1;
    }
    uint64_t seed = 0;
    if (!zero && a < argc)
        seed = parse_u64(argv[a++]);
    size_t n = (size_t)(argc - a);
    if (n == 0 || n > MAX_ALLOCS) {
        fprintf(stderr, "sim_memtool: give 1 to %d sizes\n", MAX_ALLOCS);
        return 1;
    }
    CUcontext ctx = NULL;
    CK(cuInit(0));
    CK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CK(cuCtxSetCurrent(ctx));
    if (strcmp(cmd, "check") == 0)
        printf("{\"allocations\":[");
    for (size_t k = 0; k < n; k++) {
        uint64_t size = parse_u64(argv[a + (int)k]);
        CUdeviceptr p = alloc(vmm, size);
        if (zero) {
            CK(cuMemsetD8_v2(p, 0, size));
            continue;
        }
        unsigned char *buf = malloc(size);
        if (!buf) {
            fprintf(stderr, "sim_memtool: out of host memory\n");
            return 1;
        }
        uint64_t match = 0, zeros = 0;
        if (strcmp(cmd, "fill") == 0) {
            for (uint64_t i = 0; i < size; i++)
                buf[i] = pattern(seed, k, i);
            CK(cuMemcpyHtoD_v2(p, buf, size));
        } else {
            CK(cuMemcpyDtoH_v2(buf, p, size));
            for (uint64_t i = 0; i < size; i++) {
                match += buf[i] == pattern(seed, k, i);
                zeros += buf[i] == 0;
            }
            printf("%s{\"size\":%llu,\"pattern\":%llu,\"zero\":%llu}", k ? "," : "",
                   (unsigned long long)size, (unsigned long long)match, (unsigned long long)zeros);
        }
        free(buf);
    }
    if (strcmp(cmd, "check") == 0)
        printf("]}\n");
    if (fflush(stdout) != 0)
        return 1;
    return 0;
}
