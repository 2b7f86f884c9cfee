/*
 * ipc_event: two processes of one job order their work through a CUDA IPC event (issue 37,
 * item 4, events), run by tests/test_e2e_ipc.py through gpupoold on simulated GPUs. Lines on
 * stdin and stdout pace the two (the test passes them on):
 *
 *   ipc_event export DIR N    allocate N 32-bit words filled with 0xEE bytes; an event without
 *                             CU_EVENT_INTERPROCESS is CUDA_ERROR_INVALID_VALUE for
 *                             cuIpcGetEventHandle; write the interprocess event's handle to
 *                             DIR/event and the buffer's to DIR/memory, say "READY"; on "go":
 *                             launch a slow kernel (gp_test_spin, SPIN_MS) and then gp_test_index
 *                             writing the buffer on a stream, record the event on it, say
 *                             "RECORDED" at once; on "end": destroy the event, free the buffer
 *   ipc_event import DIR N    open both handles, say "OPENED"; on "recorded": cuStreamWaitEvent
 *                             then a copy, which must see the whole buffer written (bit-exact);
 *                             cuEventSynchronize and cuEventQuery succeed; close both
 *   ipc_event stranger DIR N  cuIpcOpenEventHandle must be CUDA_ERROR_INVALID_VALUE, no event
 *
 * With IPC_EVENT_GRAPH=1 the exporter captures the kernels and the record in a CUDA graph and
 * launches that instead: the launch must wait for its worker as cuEventRecord does (one round
 * trip more in the shim's call counts, GPUPOOL_CALL_COUNTS=1), or "RECORDED" could come first.
 *
 * The importer copies as soon as the exporter said it recorded, while the slow kernel may still
 * run: without the wait on the event it would read 0xEE bytes. The simulated device runs the
 * kernels themselves (their PTX bodies are empty: sim_kernels.c).
 * Ends with "PASS ipc_event <mode>" or "FAIL ipc_event <mode>: why" (exit status 1).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_cuda_more.h"

typedef struct {
    char reserved[64];
} ipc_handle; /* CUipcMemHandle, CUipcEventHandle */

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventQuery(CUevent);
CUresult cuEventSynchronize(CUevent);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int);
CUresult cuIpcGetMemHandle(ipc_handle *, CUdeviceptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, ipc_handle, unsigned int);
CUresult cuIpcCloseMemHandle(CUdeviceptr);
CUresult cuIpcGetEventHandle(ipc_handle *, CUevent);
CUresult cuIpcOpenEventHandle(CUevent *, ipc_handle);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
size_t gpupool_call_counts(char *, size_t); /* the shim's (client/shim/call_counts.c) */

#define EVENT_INTERPROCESS 0x4u
#define EVENT_DISABLE_TIMING 0x2u
#define SPIN_MS 1000ull
#define BLOCK 256u

static const char PTX[] = ".version 8.0\n.target sm_90\n.address_size 64\n"
                          ".visible .entry gp_test_spin(.param .u64 ns)\n{\n    ret;\n}\n"
                          ".visible .entry gp_test_index(.param .u64 out, .param .u32 n)\n"
                          "{\n    ret;\n}\n";

static const char *mode = "?";

static int fail(const char *what, CUresult rc)
{
    printf("FAIL ipc_event %s: %s (CUresult %d)\n", mode, what, (int)rc);
    return 1;
}

static int say_and_wait(const char *say, const char *want)
{
    if (say) {
        printf("%s\n", say);
        fflush(stdout);
    }
    char line[64];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, want, strlen(want)) != 0) {
        printf("FAIL ipc_event %s: stdin ended before \"%s\"\n", mode, want);
        return 1;
    }
    return 0;
}

static int write_handle(const char *dir, const char *name, const ipc_handle *h)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(h, sizeof *h, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
        printf("FAIL ipc_event %s: cannot write %s\n", mode, path);
        return 1;
    }
    return 0;
}

static int read_handle(const char *dir, const char *name, ipc_handle *h)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    int ok = f && fread(h, sizeof *h, 1, f) == 1;
    if (f && fclose(f) != 0)
        ok = 0;
    if (!ok)
        printf("FAIL ipc_event %s: cannot read %s\n", mode, path);
    return !ok;
}

/* Launches the slow kernel and then the one that writes words 0..n-1 of d, on s. */
static CUresult slow_write(CUdeviceptr d, unsigned n, CUstream s)
{
    CUmodule mod;
    CUfunction spin, index;
    CUresult rc = cuModuleLoadData(&mod, PTX);
    if (rc == CUDA_SUCCESS)
        rc = cuModuleGetFunction(&spin, mod, "gp_test_spin");
    if (rc == CUDA_SUCCESS)
        rc = cuModuleGetFunction(&index, mod, "gp_test_index");
    unsigned long long ns = SPIN_MS * 1000000ull;
    void *spin_args[] = {&ns};
    void *index_args[] = {&d, &n};
    if (rc == CUDA_SUCCESS)
        rc = cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, spin_args, NULL);
    if (rc == CUDA_SUCCESS)
        rc = cuLaunchKernel(index, (n + BLOCK - 1) / BLOCK, 1, 1, BLOCK, 1, 1, 0, s, index_args,
                            NULL);
    return rc;
}

/* The shim's count of calls that waited for the worker; -1 when counting is off. */
static long long round_trips(void)
{
    char buf[256];
    gpupool_call_counts(buf, sizeof buf); /* cut short: the totals come first */
    const char *at = strstr(buf, "\"round_trips\": ");
    long long n = -1;
    if (!strstr(buf, "\"enabled\": true") || !at ||
        sscanf(at + strlen("\"round_trips\": "), "%lld", &n) != 1)
        return -1;
    return n;
}

/* The slow kernels and the record of ev on s, captured in a graph and launched; the launch
 * must have waited for the worker once (the record is an interprocess event's). */
static CUresult graph_write(CUdeviceptr d, unsigned n, CUstream s, CUevent ev)
{
    CUgraph g;
    CUgraphExec x;
    CUresult rc = cuStreamBeginCapture_v2(s, 0);
    if (rc == CUDA_SUCCESS)
        rc = slow_write(d, n, s);
    if (rc == CUDA_SUCCESS)
        rc = cuEventRecord(ev, s);
    CUresult end = cuStreamEndCapture(s, &g);
    if (rc == CUDA_SUCCESS)
        rc = end;
    if (rc == CUDA_SUCCESS)
        rc = cuGraphInstantiateWithFlags(&x, g, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    long long before = round_trips();
    rc = cuGraphLaunch(x, s);
    long long after = round_trips();
    if (rc == CUDA_SUCCESS && (before < 0 || after != before + 1)) {
        printf("FAIL ipc_event %s: the graph's launch waited for the worker %lld times, not once "
               "(GPUPOOL_CALL_COUNTS=1 must be set)\n",
               mode, after - before);
        return CUDA_ERROR_UNKNOWN;
    }
    return rc;
}

static int export_side(const char *dir, unsigned n)
{
    CUdeviceptr d = 0;
    CUevent plain, ev;
    CUstream s;
    ipc_handle eh, mh;
    CUresult rc = cuMemAlloc_v2(&d, (size_t)n * 4);
    if (rc == CUDA_SUCCESS)
        rc = cuMemsetD8_v2(d, 0xEE, (size_t)n * 4);
    if (rc != CUDA_SUCCESS)
        return fail("allocating and filling the buffer", rc);
    rc = cuEventCreate(&plain, EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS)
        return fail("cuEventCreate", rc);
    rc = cuIpcGetEventHandle(&eh, plain);
    if (rc != CUDA_ERROR_INVALID_VALUE)
        return fail("cuIpcGetEventHandle of a plain event is not CUDA_ERROR_INVALID_VALUE", rc);
    rc = cuEventCreate(&ev, EVENT_INTERPROCESS | EVENT_DISABLE_TIMING);
    if (rc == CUDA_SUCCESS)
        rc = cuIpcGetEventHandle(&eh, ev);
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcGetEventHandle", rc);
    rc = cuIpcGetMemHandle(&mh, d);
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcGetMemHandle", rc);
    if (write_handle(dir, "event", &eh) || write_handle(dir, "memory", &mh))
        return 1;
    if (say_and_wait("READY", "go"))
        return 1;
    const char *graph = getenv("IPC_EVENT_GRAPH");
    rc = cuStreamCreate(&s, 0);
    if (rc == CUDA_SUCCESS && graph && strcmp(graph, "1") == 0) {
        rc = graph_write(d, n, s, ev);
    } else if (rc == CUDA_SUCCESS) {
        rc = slow_write(d, n, s);
        if (rc == CUDA_SUCCESS)
            rc = cuEventRecord(ev, s);
    }
    if (rc != CUDA_SUCCESS)
        return fail("the slow kernels and the record", rc);
    if (say_and_wait("RECORDED", "end"))
        return 1;
    rc = cuEventDestroy_v2(ev);
    if (rc == CUDA_SUCCESS)
        rc = cuEventDestroy_v2(plain);
    if (rc == CUDA_SUCCESS)
        rc = cuMemFree_v2(d);
    return rc == CUDA_SUCCESS ? 0 : fail("destroying the events, freeing the buffer", rc);
}

static int check(CUdeviceptr p, unsigned n, const char *after)
{
    uint32_t *host = malloc((size_t)n * 4);
    if (!host)
        return fail("malloc", CUDA_SUCCESS);
    CUresult rc = cuMemcpyDtoH_v2(host, p, (size_t)n * 4);
    int bad = rc != CUDA_SUCCESS ? fail("cuMemcpyDtoH of the opened buffer", rc) : 0;
    for (unsigned i = 0; !bad && i < n; i++)
        if (host[i] != i * 2654435761u) { /* gp_test_index's words */
            printf("FAIL ipc_event import: after %s, word %u is 0x%08x, not 0x%08x\n", after, i,
                   host[i], i * 2654435761u);
            bad = 1;
        }
    free(host);
    return bad;
}

static int import_side(const char *dir, unsigned n, int stranger)
{
    ipc_handle eh, mh;
    if (read_handle(dir, "event", &eh))
        return 1;
    CUevent ev = NULL;
    CUresult rc = cuIpcOpenEventHandle(&ev, eh);
    if (stranger) {
        if (rc != CUDA_ERROR_INVALID_VALUE || ev != NULL)
            return fail("a stranger's cuIpcOpenEventHandle was not CUDA_ERROR_INVALID_VALUE", rc);
        return 0;
    }
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcOpenEventHandle", rc);
    CUdeviceptr p = 0;
    if (read_handle(dir, "memory", &mh))
        return 1;
    rc = cuIpcOpenMemHandle_v2(&p, mh, 0);
    if (rc != CUDA_SUCCESS)
        return fail("cuIpcOpenMemHandle", rc);
    if (say_and_wait("OPENED", "recorded"))
        return 1;
    /* The legacy stream waits for the exporter's kernels; the copy on it comes after. */
    rc = cuStreamWaitEvent(NULL, ev, 0);
    if (rc != CUDA_SUCCESS)
        return fail("cuStreamWaitEvent", rc);
    if (check(p, n, "cuStreamWaitEvent"))
        return 1;
    rc = cuEventSynchronize(ev);
    if (rc == CUDA_SUCCESS)
        rc = cuEventQuery(ev);
    if (rc != CUDA_SUCCESS)
        return fail("cuEventSynchronize / cuEventQuery", rc);
    if (check(p, n, "cuEventSynchronize"))
        return 1;
    rc = cuEventDestroy_v2(ev);
    if (rc == CUDA_SUCCESS)
        rc = cuIpcCloseMemHandle(p);
    return rc == CUDA_SUCCESS ? 0 : fail("destroying the event, closing the memory", rc);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: ipc_event export|import|stranger DIR WORDS\n");
        return 2;
    }
    mode = argv[1];
    unsigned n = (unsigned)strtoul(argv[3], NULL, 10);
    if (n == 0)
        return fail("bad size", CUDA_SUCCESS);
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
    int bad = strcmp(mode, "export") == 0 ? export_side(argv[2], n)
                                          : import_side(argv[2], n, strcmp(mode, "stranger") == 0);
    if (!bad)
        printf("PASS ipc_event %s\n", mode);
    return bad;
}
