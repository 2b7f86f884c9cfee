/*
 * ipc_share: two processes of one job share device memory through CUDA IPC (issue 37, item 4),
 * run by tests/test_e2e_ipc.py through gpupoold on simulated GPUs.
 *
 *   ipc_share export HANDLE_FILE BYTES    allocate, fill with pattern A, write the 64 bytes of
 *                                         cuIpcGetMemHandle to HANDLE_FILE, say "READY", wait
 *                                         for a line on stdin, then check the buffer holds
 *                                         pattern B (written by the importer) bit-exact
 *   ipc_share import HANDLE_FILE BYTES    cuIpcOpenMemHandle, check pattern A bit-exact, write
 *                                         pattern B, cuIpcCloseMemHandle (cuMemFree of it and
 *                                         a second close are CUDA_ERROR_INVALID_VALUE)
 *   ipc_share stranger HANDLE_FILE BYTES  cuIpcOpenMemHandle must fail with
 *                                         CUDA_ERROR_INVALID_VALUE and give no pointer
 * Ends with "PASS ipc_share <mode>" or "FAIL ipc_share <mode>: why" (exit status 1).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_more.h"

typedef struct {
    char reserved[64];
} ipc_handle; /* CUipcMemHandle */

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuIpcGetMemHandle(ipc_handle *, CUdeviceptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, ipc_handle, unsigned int);
CUresult cuIpcCloseMemHandle(CUdeviceptr);

#define LAZY_ENABLE_PEER_ACCESS 0x1u

static const char *mode = "?";

static int fail(const char *what, CUresult rc)
{
    printf("FAIL ipc_share %s: %s (CUresult %d)\n", mode, what, (int)rc);
    return 1;
}

static unsigned char pattern(size_t i, int which)
{
    return which == 0 ? (unsigned char)(i * 7u + 3u) : (unsigned char)(i * 13u + 101u);
}

static int check(const unsigned char *got, size_t n, int which)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != pattern(i, which)) {
            printf("FAIL ipc_share %s: byte %zu is %u, not %u\n", mode, i, got[i],
                   pattern(i, which));
            return 1;
        }
    return 0;
}

static int export_side(const char *path, size_t n, unsigned char *host)
{
    CUdeviceptr d = 0;
    CUresult rc = cuMemAlloc_v2(&d, n);
    if (rc != CUDA_SUCCESS)
        return fail("cuMemAlloc", rc);
    for (size_t i = 0; i < n; i++)
        host[i] = pattern(i, 0);
    rc = cuMemcpyHtoD_v2(d, host, n);
    if (rc != CUDA_SUCCESS)
        return fail("cuMemcpyHtoD", rc);
    ipc_handle h;
    memset(&h, 0, sizeof h);
    rc = cuIpcGetMemHandle(&h, d);
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcGetMemHandle", rc);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(&h, sizeof h, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
        printf("FAIL ipc_share export: cannot write %s\n", path);
        return 1;
    }
    printf("READY\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) {
        printf("FAIL ipc_share export: stdin closed before the check\n");
        return 1;
    }
    memset(host, 0, n);
    rc = cuMemcpyDtoH_v2(host, d, n);
    if (rc != CUDA_SUCCESS)
        return fail("cuMemcpyDtoH", rc);
    if (check(host, n, 1))
        return 1;
    rc = cuMemFree_v2(d);
    if (rc != CUDA_SUCCESS)
        return fail("cuMemFree", rc);
    return 0;
}

static int import_side(ipc_handle h, size_t n, unsigned char *host, int stranger)
{
    CUdeviceptr d = 0;
    CUresult rc = cuIpcOpenMemHandle_v2(&d, h, LAZY_ENABLE_PEER_ACCESS);
    if (stranger) {
        if (rc != CUDA_ERROR_INVALID_VALUE)
            return fail("a stranger's cuIpcOpenMemHandle did not give CUDA_ERROR_INVALID_VALUE",
                        rc);
        if (d != 0)
            return fail("a refused cuIpcOpenMemHandle set the pointer", rc);
        return 0;
    }
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcOpenMemHandle", rc);
    rc = cuMemcpyDtoH_v2(host, d, n);
    if (rc != CUDA_SUCCESS)
        return fail("cuMemcpyDtoH of the opened memory", rc);
    if (check(host, n, 0))
        return 1;
    for (size_t i = 0; i < n; i++)
        host[i] = pattern(i, 1);
    rc = cuMemcpyHtoD_v2(d, host, n);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxSynchronize();
    if (rc != CUDA_SUCCESS)
        return fail("writing the opened memory", rc);
    rc = cuMemFree_v2(d); /* opened memory is closed, never freed */
    if (rc != CUDA_ERROR_INVALID_VALUE)
        return fail("cuMemFree of opened memory did not give CUDA_ERROR_INVALID_VALUE", rc);
    rc = cuIpcCloseMemHandle(d);
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcCloseMemHandle", rc);
    if (cuIpcCloseMemHandle(d) != CUDA_ERROR_INVALID_VALUE)
        return fail("a second cuIpcCloseMemHandle did not give CUDA_ERROR_INVALID_VALUE", rc);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: ipc_share export|import|stranger HANDLE_FILE BYTES\n");
        return 2;
    }
    mode = argv[1];
    size_t n = (size_t)strtoull(argv[3], NULL, 10);
    unsigned char *host = malloc(n ? n : 1);
    if (!host || n == 0) {
        printf("FAIL ipc_share %s: bad size\n", mode);
        return 1;
    }
    CUdevice dev;
    CUcontext ctx;
    CUresult rc = cuInit(0);
    if (rc == CUDA_SUCCESS)
        rc = cuDeviceGet(&dev, 0);
    if (rc == CUDA_SUCCESS)
        rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxSetCurrent(ctx);
    if (rc != CUDA_SUCCESS)
        return fail("set-up", rc);
    int bad;
    if (strcmp(mode, "export") == 0) {
        bad = export_side(argv[2], n, host);
    } else {
        ipc_handle h;
        FILE *f = fopen(argv[2], "rb");
        if (!f || fread(&h, sizeof h, 1, f) != 1) {
            printf("FAIL ipc_share %s: cannot read %s\n", mode, argv[2]);
            return 1;
        }
        if (fclose(f) != 0)
            return fail("fclose", CUDA_SUCCESS);
        bad = import_side(h, n, host, strcmp(mode, "stranger") == 0);
    }
    free(host);
    if (!bad)
        printf("PASS ipc_share %s\n", mode);
    return bad;
}
