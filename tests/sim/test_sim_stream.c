/*
 * test_sim_stream.c: contexts, streams and events (handles validated, timing from host clocks),
 * and many threads using the sim at once.
 */
#include <pthread.h>
#include <time.h>

#include "sim_test.h"

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void test_primary_context(void)
{
    OK(cuInit(0));
    unsigned flags = 9;
    int active = 9;
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK_EQ(flags, 0);
    CHECK_EQ(active, 0);
    CHECK_RC(cuDevicePrimaryCtxGetState(1, &flags, &active), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDevicePrimaryCtxRelease_v2(0), CUDA_ERROR_INVALID_CONTEXT); /* not retained */
    CUcontext a = NULL, b = NULL, cur = (CUcontext)1;
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == NULL);
    OK(cuDevicePrimaryCtxRetain(&a, 0));
    OK(cuDevicePrimaryCtxRetain(&b, 0));
    CHECK(a == b && a != NULL); /* one primary context per device */
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK_EQ(active, 1);
    OK(cuCtxSetCurrent(a));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == a);
    OK(cuCtxSynchronize());
    OK(cuDevicePrimaryCtxRelease_v2(0));
    OK(cuCtxSynchronize()); /* still retained once */
    OK(cuDevicePrimaryCtxRelease_v2(0));
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK_EQ(active, 0);
    CHECK_RC(cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT); /* current but released */
    CHECK_RC(cuCtxSetCurrent(a), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == NULL);
    OK(cuDevicePrimaryCtxRetain(&b, 0));
    CHECK(b == a); /* the same handle again */
    OK(cuDevicePrimaryCtxReset_v2(0));
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK_EQ(active, 0);
    CHECK_RC(cuDevicePrimaryCtxRetain(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDevicePrimaryCtxRetain(&b, 2), CUDA_ERROR_INVALID_DEVICE);
}

static void test_created_context(void)
{
    OK(cuInit(0));
    CUcontext c = NULL, cur = NULL;
    CHECK_RC(cuCtxCreate_v2(&c, 3, 0), CUDA_ERROR_INVALID_VALUE);     /* bad scheduling mode */
    CHECK_RC(cuCtxCreate_v2(&c, 0x100, 0), CUDA_ERROR_INVALID_VALUE); /* unknown flag */
    CHECK_RC(cuCtxCreate_v2(&c, 0, 1), CUDA_ERROR_INVALID_DEVICE);
    OK(cuCtxCreate_v2(&c, 0x4 | 0x8, 0)); /* blocking sync + map host */
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == c); /* made current */
    size_t v = 0;
    OK(cuCtxGetLimit(&v, CU_LIMIT_STACK_SIZE));
    CHECK_EQ(v, 1024);
    OK(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 1 << 26));
    OK(cuCtxGetLimit(&v, CU_LIMIT_MALLOC_HEAP_SIZE));
    CHECK_EQ(v, 1 << 26);
    CHECK_RC(cuCtxSetLimit(7, 1), 215); /* SHMEM_SIZE: query only (UNSUPPORTED_LIMIT) */
    CHECK_RC(cuCtxGetLimit(&v, 42), 215);
    CHECK_RC(cuCtxGetLimit(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    int least = 9, greatest = 9;
    OK(cuCtxGetStreamPriorityRange(&least, &greatest));
    CHECK_EQ(least, 0);
    CHECK_EQ(greatest, -5);
    OK(cuCtxGetStreamPriorityRange(NULL, NULL));
    CUcontext prim = NULL;
    OK(cuDevicePrimaryCtxRetain(&prim, 0));
    CHECK_RC(cuCtxDestroy_v2(prim), CUDA_ERROR_INVALID_CONTEXT); /* primaries are released */
    OK(cuCtxDestroy_v2(c));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == NULL);
    CHECK_RC(cuCtxDestroy_v2(c), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuCtxSetCurrent(c), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuCtxSetCurrent((CUcontext)0x1234), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxSetCurrent(NULL));
}

static void test_streams(void)
{
    sim_test_init();
    CUstream s = NULL, t = NULL;
    OK(cuStreamCreateWithPriority(&s, CU_STREAM_DEFAULT, -100)); /* clamped, not refused */
    OK(cuStreamCreateWithPriority(&t, CU_STREAM_NON_BLOCKING, 7));
    CHECK(s != t && s != NULL);
    CHECK_RC(cuStreamCreateWithPriority(&t, 4, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuStreamCreateWithPriority(NULL, 0, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamSynchronize(s));
    OK(cuStreamQuery(s));
    OK(cuStreamSynchronize(NULL));
    OK(cuStreamSynchronize(CU_STREAM_LEGACY));
    OK(cuStreamQuery(CU_STREAM_PER_THREAD));
    CHECK_RC(cuStreamQuery((CUstream)0xdead), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamDestroy_v2(NULL), CUDA_ERROR_INVALID_HANDLE);
    OK(cuStreamDestroy_v2(s));
    CHECK_RC(cuStreamDestroy_v2(s), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
    CUevent e = NULL;
    OK(cuEventCreate(&e, 0));
    OK(cuStreamWaitEvent(t, e, 0));
    CHECK_RC(cuStreamWaitEvent(t, e, 8), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuStreamWaitEvent(s, e, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamWaitEvent(t, (CUevent)t, 0), CUDA_ERROR_INVALID_HANDLE); /* wrong kind */
    /* Streams go with their context. */
    OK(cuDevicePrimaryCtxReset_v2(0));
    sim_test_init();
    CHECK_RC(cuStreamQuery(t), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
}

static void test_events(void)
{
    sim_test_init();
    CUevent a = NULL, b = NULL, notime = NULL, never = NULL;
    OK(cuEventCreate(&a, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&b, CU_EVENT_BLOCKING_SYNC));
    OK(cuEventCreate(&notime, CU_EVENT_DISABLE_TIMING));
    OK(cuEventCreate(&never, 0));
    CHECK_RC(cuEventCreate(&a, 0x40), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventCreate(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventCreate(&a, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);

    OK(cuEventRecord(a, NULL));
    sleep_ms(30);
    OK(cuEventRecordWithFlags(b, CU_STREAM_LEGACY, 0));
    OK(cuEventRecord(notime, NULL));
    OK(cuEventSynchronize(b));
    OK(cuEventQuery(a));
    float ms = 0;
    OK(cuEventElapsedTime_v2(&ms, a, b));
    CHECK(ms >= 29.0f && ms < 2000.0f);
    float back = 0;
    OK(cuEventElapsedTime_v2(&back, b, a));
    CHECK(back < 0 && back > -2000.0f);
    /* Re-recording moves the timestamp. */
    OK(cuEventRecord(a, NULL));
    OK(cuEventElapsedTime_v2(&ms, b, a));
    CHECK(ms >= 0.0f && ms < 1000.0f);

    CHECK_RC(cuEventElapsedTime_v2(&ms, a, notime), CUDA_ERROR_INVALID_HANDLE);
    /* Never recorded: CUDA_ERROR_INVALID_HANDLE, as the driver documents (and does). */
    CHECK_RC(cuEventElapsedTime_v2(&ms, a, never), CUDA_ERROR_INVALID_HANDLE);
    OK(cuEventQuery(never)); /* an unrecorded event counts as complete */
    OK(cuEventSynchronize(never));
    CHECK_RC(cuEventElapsedTime_v2(NULL, a, b), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventRecord(a, (CUstream)0x99), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuEventRecordWithFlags(a, NULL, 4), CUDA_ERROR_INVALID_VALUE);
    OK(cuEventDestroy_v2(never));
    CHECK_RC(cuEventQuery(never), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuEventDestroy_v2(never), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuEventElapsedTime_v2(&ms, a, never), CUDA_ERROR_INVALID_HANDLE);
}

/* Many threads, each with its own context, allocating, copying, recording and freeing at once:
 * the sim's single lock must keep its tables consistent (run under ASan by the SAN=1 build). */
static void *worker(void *arg)
{
    (void)arg;
    CUcontext c = NULL;
    OK(cuCtxCreate_v2(&c, 0, 0));
    unsigned char buf[256], back[256];
    for (int i = 0; i < 300; i++) {
        CUdeviceptr p = 0;
        CUevent e = NULL;
        CUstream s = NULL;
        OK(cuMemAlloc_v2(&p, 256));
        OK(cuStreamCreateWithPriority(&s, 0, 0));
        OK(cuEventCreate(&e, 0));
        memset(buf, i & 0xff, sizeof(buf));
        OK(cuMemcpyHtoDAsync_v2(p, buf, sizeof(buf), s));
        OK(cuEventRecord(e, s));
        OK(cuMemcpyDtoH_v2(back, p, sizeof(back)));
        CHECK(memcmp(buf, back, sizeof(buf)) == 0);
        OK(cuEventDestroy_v2(e));
        OK(cuStreamDestroy_v2(s));
        OK(cuMemFree_v2(p));
    }
    OK(cuCtxDestroy_v2(c));
    return NULL;
}

static void test_threads(void)
{
    OK(cuInit(0));
    pthread_t t[6];
    for (int i = 0; i < 6; i++)
        CHECK(pthread_create(&t[i], NULL, worker, NULL) == 0);
    for (int i = 0; i < 6; i++)
        CHECK(pthread_join(t[i], NULL) == 0);
    CUcontext cur = (CUcontext)1;
    OK(cuCtxGetCurrent(&cur)); /* current contexts are per thread */
    CHECK(cur == NULL);
}

SIM_TEST_MAIN(SIM_T(primary_context), SIM_T(created_context), SIM_T(streams), SIM_T(events),
              SIM_T(threads))
