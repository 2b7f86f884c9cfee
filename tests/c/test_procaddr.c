/*
 * test_procaddr.c: cuGetProcAddress against the measured facts (facts section 2), the
 * per-thread variants, the fallbacks and error answers, the generated tables' invariants, and
 * the weak stubs' "not implemented" answer.
 *
 * Linked with procaddr.o, the generated tables and stubs, and unimplemented.o: the stubs stand
 * in for the functions the shim core will implement, so pointers can be compared by name.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gp_test.h"
#include "gp_unimplemented.h"
#include "procaddr.h"

/* Real signatures of the two functions under test. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);

/* Functions whose addresses the answers are compared with (weak stubs here). */
/* A table clang-format cannot lay out stably: kept as written. */
// clang-format off
#define FN(name) extern CUresult name(void);
FN(cuCtxGetDevice) FN(cuCtxGetDevice_v2) FN(cuCtxSynchronize) FN(cuCtxSynchronize_v2)
FN(cuEventElapsedTime) FN(cuEventElapsedTime_v2) FN(cuMemAlloc) FN(cuMemAlloc_v2)
FN(cuDeviceGetUuid) FN(cuDeviceGetUuid_v2) FN(cuDevicePrimaryCtxRelease)
FN(cuDevicePrimaryCtxRelease_v2) FN(cuMemcpyHtoD) FN(cuMemcpyHtoD_v2) FN(cuMemcpyHtoD_v2_ptds)
FN(cuLaunchKernel) FN(cuLaunchKernel_ptsz) FN(cuStreamBeginCapture_ptsz)
FN(cuStreamBeginCapture_v2) FN(cuStreamBeginCapture_v2_ptsz) FN(cuGraphInstantiateWithFlags)
FN(cuDeviceTotalMem_v2) FN(cuMemcpyDtoHAsync_v2) FN(cuMemcpyDtoHAsync_v2_ptsz) FN(cuInit)
FN(cuLinkCreate_v2) FN(cuStreamGetCtx_v2) FN(cuCtxCreate_v4) FN(cuMemFree_v2)
// clang-format on
#undef FN

                                    static void *lookup(const char *name, int version,
                                                        cuuint64_t flags, CUresult want_rc,
                                                        CUdriverProcAddressQueryResult want_status)
{
    void *fn = (void *)0x1;
    CUdriverProcAddressQueryResult status = (CUdriverProcAddressQueryResult)99;
    CUresult rc = cuGetProcAddress_v2(name, &fn, version, flags, &status);
    if (rc != want_rc || status != want_status)
        fprintf(stderr, "lookup %s@%d flags %llu:\n", name, version, (unsigned long long)flags);
    CHECK_EQ(rc, want_rc);
    CHECK_EQ(status, want_status);
    if (rc != CUDA_SUCCESS)
        CHECK_PTR_EQ(fn, NULL);
    return fn;
}

#define EXPECT(name, version, flags, target)                                                       \
    CHECK_PTR_EQ(lookup(name, version, flags, CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS),          \
                 (void *)(target))

static void test_facts(void)
{
    EXPECT("cuCtxGetDevice", 13000, 0, cuCtxGetDevice_v2);
    EXPECT("cuCtxGetDevice", 12090, 0, cuCtxGetDevice);
    EXPECT("cuCtxSynchronize", 13000, 0, cuCtxSynchronize_v2);
    EXPECT("cuCtxSynchronize", 12000, 0, cuCtxSynchronize);
    EXPECT("cuEventElapsedTime", 12080, 0, cuEventElapsedTime_v2);
    EXPECT("cuEventElapsedTime", 12070, 0, cuEventElapsedTime);
    EXPECT("cuMemAlloc", 3020, 0, cuMemAlloc_v2);
    EXPECT("cuMemAlloc", 13000, 0, cuMemAlloc_v2);
    EXPECT("cuMemAlloc", 3010, 0, cuMemAlloc); /* the legacy 32-bit revision */
    EXPECT("cuDeviceGetUuid", 9020, 0, cuDeviceGetUuid);
    EXPECT("cuDeviceGetUuid", 11030, 0, cuDeviceGetUuid);
    EXPECT("cuDeviceGetUuid", 11040, 0, cuDeviceGetUuid_v2);
    EXPECT("cuDevicePrimaryCtxRelease", 11000, 0, cuDevicePrimaryCtxRelease_v2);
    EXPECT("cuDevicePrimaryCtxRelease", 10020, 0, cuDevicePrimaryCtxRelease);
    EXPECT("cuDevicePrimaryCtxRelease", 7000, 0, cuDevicePrimaryCtxRelease);
    EXPECT("cuDeviceTotalMem", 13000, 0, cuDeviceTotalMem_v2);
    EXPECT("cuLinkCreate", 13000, 0, cuLinkCreate_v2);
    EXPECT("cuStreamGetCtx", 12050, 0, cuStreamGetCtx_v2);
    EXPECT("cuCtxCreate", 13000, 0, cuCtxCreate_v4);
    EXPECT("cuMemFree", 13000, 0, cuMemFree_v2);
    EXPECT("cuInit", 2000, 0, cuInit);
    EXPECT("cuInit", 13000, 0, cuInit);
    /* Override (cudaapi/procaddr_overrides.toml): the 12.0 3-argument cuGraphInstantiate. */
    EXPECT("cuGraphInstantiate", 12000, 0, cuGraphInstantiateWithFlags);

    /* cudart asks for cuGetProcAddress itself at 11030 and 12000. */
    EXPECT("cuGetProcAddress", 11030, 0, cuGetProcAddress);
    EXPECT("cuGetProcAddress", 12000, 0, cuGetProcAddress_v2);
    EXPECT("cuGetProcAddress", 13000, 2, cuGetProcAddress_v2);

    /* Too old a version for any revision. */
    lookup("cuDeviceGetUuid", 9010, 0, CUDA_ERROR_NOT_FOUND,
           CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    lookup("cuLibraryLoadData", 11080, 0, CUDA_ERROR_NOT_FOUND,
           CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    lookup("cuInit", 0, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
}

static void test_per_thread(void)
{
    const cuuint64_t ptds = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    EXPECT("cuMemcpyHtoD", 13000, ptds, cuMemcpyHtoD_v2_ptds);
    EXPECT("cuMemcpyHtoD", 13000, 0, cuMemcpyHtoD_v2);
    EXPECT("cuMemcpyHtoD", 13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, cuMemcpyHtoD_v2);
    EXPECT("cuMemcpyHtoD", 6050, ptds, cuMemcpyHtoD_v2); /* no _ptds before 7000 */
    EXPECT("cuMemcpyHtoD", 3010, ptds, cuMemcpyHtoD);
    EXPECT("cuMemcpyDtoHAsync", 13000, ptds, cuMemcpyDtoHAsync_v2_ptsz);
    EXPECT("cuMemcpyDtoHAsync", 13000, 0, cuMemcpyDtoHAsync_v2);
    EXPECT("cuLaunchKernel", 13000, ptds, cuLaunchKernel_ptsz);
    EXPECT("cuLaunchKernel", 13000, 0, cuLaunchKernel);
    EXPECT("cuStreamBeginCapture", 10000, ptds, cuStreamBeginCapture_ptsz);
    EXPECT("cuStreamBeginCapture", 10010, ptds, cuStreamBeginCapture_v2_ptsz);
    EXPECT("cuStreamBeginCapture", 13000, 0, cuStreamBeginCapture_v2);
    EXPECT("cuMemAlloc", 13000, ptds, cuMemAlloc_v2); /* no per-thread variant: the plain one */
}

static void test_fallbacks_and_errors(void)
{
    /* An exact exported name resolves even though it is not a base name. */
    EXPECT("cuMemAlloc_v2", 13000, 0, cuMemAlloc_v2);
    EXPECT("cuMemcpyHtoD_v2_ptds", 2000, 0, cuMemcpyHtoD_v2_ptds);
    lookup("cuDoesNotExist", 13000, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    lookup("", 13000, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    /* Graphics interop is not exported (facts section 2). */
    lookup("cuGLGetDevices", 13000, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    lookup("cuGraphicsGLRegisterBuffer", 13000, 0, CUDA_ERROR_NOT_FOUND,
           CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);

    void *fn = (void *)0x1;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    CHECK_EQ(cuGetProcAddress_v2(NULL, &fn, 13000, 0, &status), CUDA_ERROR_INVALID_VALUE);
    CHECK_PTR_EQ(fn, NULL);
    CHECK_EQ(status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    CHECK_EQ(cuGetProcAddress_v2("cuInit", NULL, 13000, 0, &status), CUDA_ERROR_INVALID_VALUE);

    /* symbolStatus is optional; the v1 entry point has none. */
    fn = NULL;
    CHECK_EQ(cuGetProcAddress_v2("cuInit", &fn, 13000, 0, NULL), CUDA_SUCCESS);
    CHECK_PTR_EQ(fn, (void *)cuInit);
    fn = NULL;
    CHECK_EQ(cuGetProcAddress("cuCtxGetDevice", &fn, 13000, 0), CUDA_SUCCESS);
    CHECK_PTR_EQ(fn, (void *)cuCtxGetDevice_v2);
    fn = (void *)0x1;
    CHECK_EQ(cuGetProcAddress("cuNope", &fn, 13000, 0), CUDA_ERROR_NOT_FOUND);
    CHECK_PTR_EQ(fn, NULL);
}

static void test_table_invariants(void)
{
    CHECK(gp_procaddr_bases_len > 400);
    CHECK(gp_symbol_table_len >= gp_procaddr_bases_len);
    size_t covered = 0;
    for (size_t i = 0; i < gp_procaddr_bases_len; i++) {
        const gp_procaddr_base *b = &gp_procaddr_bases[i];
        if (i > 0 && strcmp(gp_procaddr_bases[i - 1].name, b->name) >= 0) {
            fprintf(stderr, "bases not sorted at %s\n", b->name);
            CHECK(0);
        }
        CHECK_EQ(b->first, covered);
        CHECK(b->count > 0);
        covered += b->count;
        int saw_plain = 0;
        for (unsigned k = 0; k < b->count; k++) {
            const gp_procaddr_entry *e = &gp_procaddr_entries[b->first + k];
            CHECK(e->fn != NULL);
            if (k > 0)
                CHECK(gp_procaddr_entries[b->first + k - 1].version <= e->version);
            /* The lowest revision of every base is a default-stream one. */
            if (!e->ptds)
                saw_plain = 1;
            else
                CHECK(saw_plain);
        }
    }
    CHECK_EQ(covered, gp_procaddr_entries_len);
    for (size_t i = 0; i < gp_symbol_table_len; i++) {
        const gp_symbol_entry *s = &gp_symbol_table[i];
        if (i > 0 && strcmp(gp_symbol_table[i - 1].name, s->name) >= 0) {
            fprintf(stderr, "symbols not sorted at %s\n", s->name);
            CHECK(0);
        }
        CHECK(strncmp(s->name, "cu", 2) == 0);
        CHECK_PTR_EQ((void *)gp_symbol_lookup(s->name), (void *)s->fn);
    }
    CHECK_PTR_EQ((void *)gp_symbol_lookup("cuNope"), NULL);
    CHECK_PTR_EQ((void *)gp_symbol_lookup(NULL), NULL);
}

static void test_speed(void)
{
    /* cudart does ~440 lookups per instance at start-up; make sure that costs nothing. */
    static const char *const names[] = {"cuInit",         "cuMemAlloc",     "cuStreamSynchronize",
                                        "cuLaunchKernel", "cuCtxGetDevice", "cuWhatever"};
    struct timespec t0, t1;
    CHECK_EQ(clock_gettime(CLOCK_MONOTONIC, &t0), 0);
    const int rounds = 200000;
    size_t found = 0, expected = 0;
    for (int i = 0; i < rounds; i++) {
        void *fn = NULL;
        expected += (i % 6 != 5);
        if (cuGetProcAddress_v2(names[i % 6], &fn, 13000, (cuuint64_t)(i & 2), NULL) ==
            CUDA_SUCCESS)
            found++;
    }
    CHECK_EQ(clock_gettime(CLOCK_MONOTONIC, &t1), 0);
    double ns =
        ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / rounds;
    printf("test_procaddr: %.0f ns per lookup\n", ns);
    CHECK_EQ(found, expected);
    CHECK(ns < 20000.0); /* generous: sanitizer builds and loaded CI machines */
}

static void call_stubs(void)
{
    CHECK_EQ(cuMemFree_v2(), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(cuMemFree_v2(), CUDA_ERROR_NOT_SUPPORTED);
    /* The same name from another string (not the stub's literal): still reported only once. */
    char copy[] = "cuMemFree_v2";
    CHECK_EQ(gp_unimplemented(copy), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(cuLinkCreate_v2(), CUDA_ERROR_NOT_SUPPORTED);
}

static void test_stubs(void)
{
    /* GPUPOOL_LOG=quiet silences the report. The setting is read once, at the first report, so
     * this runs in a child forked before this process reports anything. */
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        if (setenv("GPUPOOL_LOG", "quiet", 1) != 0)
            _exit(2);
        const char *quiet_out = capture_stderr(call_stubs);
        _exit(quiet_out[0] == '\0' && gp_test_failures == 0 ? 0 : 1);
    }
    if (pid > 0) {
        int wstatus = 0;
        CHECK_EQ(waitpid(pid, &wstatus, 0), pid);
        CHECK(WIFEXITED(wstatus));
        CHECK_EQ(WEXITSTATUS(wstatus), 0);
    }

    const char *out = capture_stderr(call_stubs);
    CHECK_STR_EQ(out, "gpupool: cuMemFree_v2 is not implemented by the gpupool shim (returned "
                      "CUDA_ERROR_NOT_SUPPORTED); please report it\n"
                      "gpupool: cuLinkCreate_v2 is not implemented by the gpupool shim (returned "
                      "CUDA_ERROR_NOT_SUPPORTED); please report it\n");
}

int main(void)
{
    test_facts();
    test_per_thread();
    test_fallbacks_and_errors();
    test_table_invariants();
    test_speed();
    test_stubs();
    CHECK_STR_EQ(gp_cuda_error_name(CUDA_ERROR_INVALID_VALUE), "CUDA_ERROR_INVALID_VALUE");
    CHECK_STR_EQ(gp_cuda_error_name(CUDA_ERROR_NOT_SUPPORTED), "CUDA_ERROR_NOT_SUPPORTED");
    CHECK_STR_EQ(gp_cuda_error_name(0), "CUDA_SUCCESS");
    CHECK_PTR_EQ(gp_cuda_error_name(12345), NULL);
    CHECK(gp_cuda_error_string(CUDA_ERROR_UNKNOWN) != NULL);
    CHECK_PTR_EQ(gp_cuda_error_string(-1), NULL);
    return gp_test_done("test_procaddr");
}
