/*
 * gp_check.cuh: the small harness shared by the gpupool end-to-end CUDA test programs.
 *
 * Every program counts its checks, prints one line per failed check (file:line, what, CUDA error
 * name) to stdout, and ends with exactly one summary line:
 *     PASS <program>: <n> checks
 *     FAIL <program>: <k> of <n> checks failed
 * and exits 0 only when nothing failed. The programs never print kernel names on stderr
 * themselves: tests/test_e2e_cuda.py looks for messages of the shim there.
 *
 * The data pattern is a xorshift64 stream that depends only on (seed, byte index / 8), so any
 * window of it can be regenerated for verification without storing a copy.
 */
#ifndef GP_CHECK_CUH
#define GP_CHECK_CUH

#include <cuda.h> /* types and constants only: we never link -lcuda (that is the toolkit stub) */
#include <cuda_runtime.h>

#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>

static std::atomic<long> gp_checks{0};
static std::atomic<long> gp_failures{0};
static const char *gp_program = "?";

static inline void gp_begin(const char *program)
{
    gp_program = program;
    setvbuf(stdout, NULL, _IOLBF, 0);
}

/* One failed check: a line on stdout (never stderr, see above). */
static inline void gp_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    long n = ++gp_failures;
    if (n <= 50)
        printf("  check failed at %s:%d: %s\n", file, line, msg);
    else if (n == 51)
        printf("  (further failures not shown)\n");
}

/* CHECK(call): the CUDA runtime call must return cudaSuccess. */
#define CHECK(call)                                                                            \
    do {                                                                                       \
        cudaError_t gp_e_ = (call);                                                            \
        ++gp_checks;                                                                           \
        if (gp_e_ != cudaSuccess)                                                              \
            gp_fail(__FILE__, __LINE__, "%s -> %s (%d): %s", #call, cudaGetErrorName(gp_e_),   \
                    (int)gp_e_, cudaGetErrorString(gp_e_));                                    \
    } while (0)

/* CHECK_CU(call): the driver API call must return CUDA_SUCCESS. */
#define CHECK_CU(call)                                                                         \
    do {                                                                                       \
        CUresult gp_r_ = (call);                                                               \
        ++gp_checks;                                                                           \
        if (gp_r_ != CUDA_SUCCESS)                                                             \
            gp_fail(__FILE__, __LINE__, "%s -> CUresult %d", #call, (int)gp_r_);               \
    } while (0)

/* EXPECT(cond, fmt, ...): a plain condition with a message that shows the values. */
#define EXPECT(cond, ...)                                                                      \
    do {                                                                                       \
        ++gp_checks;                                                                           \
        if (!(cond))                                                                           \
            gp_fail(__FILE__, __LINE__, __VA_ARGS__);                                          \
    } while (0)

/* EXPECT_ERR(call, want): the call must return exactly `want`. */
#define EXPECT_ERR(call, want)                                                                 \
    do {                                                                                       \
        cudaError_t gp_e_ = (call);                                                            \
        ++gp_checks;                                                                           \
        if (gp_e_ != (want))                                                                   \
            gp_fail(__FILE__, __LINE__, "%s -> %s (%d), expected %s (%d)", #call,              \
                    cudaGetErrorName(gp_e_), (int)gp_e_, cudaGetErrorName(want), (int)(want)); \
    } while (0)

/* Stops at once (after the summary) when a failure makes every later check meaningless. */
#define REQUIRE(call)                                                                          \
    do {                                                                                       \
        cudaError_t gp_e_ = (call);                                                            \
        ++gp_checks;                                                                           \
        if (gp_e_ != cudaSuccess) {                                                            \
            gp_fail(__FILE__, __LINE__, "%s -> %s (%d): %s (cannot go on)", #call,             \
                    cudaGetErrorName(gp_e_), (int)gp_e_, cudaGetErrorString(gp_e_));           \
            exit(gp_finish());                                                                 \
        }                                                                                      \
    } while (0)

static inline int gp_finish(void)
{
    long f = gp_failures.load(), n = gp_checks.load();
    if (f == 0)
        printf("PASS %s: %ld checks\n", gp_program, n);
    else
        printf("FAIL %s: %ld of %ld checks failed\n", gp_program, f, n);
    fflush(stdout);
    return f == 0 ? 0 : 1;
}

static inline double gp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------- pattern */

static inline uint64_t gp_mix(uint64_t seed, uint64_t word)
{
    /* splitmix64 of (seed, word index): cheap, and every 8-byte word differs. */
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + word * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The pattern byte at stream position pos. */
static inline uint8_t gp_pattern_byte(uint64_t seed, uint64_t pos)
{
    return (uint8_t)(gp_mix(seed, pos >> 3) >> ((pos & 7) * 8));
}

/* Fills buf[0..n) with the pattern stream positions [0, n). */
static inline void gp_fill(void *buf, size_t n, uint64_t seed)
{
    uint8_t *p = (uint8_t *)buf;
    size_t words = n / 8, i;
    for (i = 0; i < words; i++) {
        uint64_t w = gp_mix(seed, i);
        memcpy(p + i * 8, &w, 8); /* little-endian: byte k of word i is position 8i+k */
    }
    for (size_t pos = words * 8; pos < n; pos++)
        p[pos] = gp_pattern_byte(seed, pos);
}

/* Returns the index of the first byte of buf[0..n) that differs from the pattern, or -1. */
static inline long long gp_verify(const void *buf, size_t n, uint64_t seed)
{
    const uint8_t *p = (const uint8_t *)buf;
    size_t words = n / 8, i;
    for (i = 0; i < words; i++) {
        uint64_t w = gp_mix(seed, i), got;
        memcpy(&got, p + i * 8, 8);
        if (got != w) {
            for (size_t k = 0; k < 8; k++)
                if (p[i * 8 + k] != gp_pattern_byte(seed, i * 8 + k))
                    return (long long)(i * 8 + k);
        }
    }
    for (size_t pos = words * 8; pos < n; pos++)
        if (p[pos] != gp_pattern_byte(seed, pos))
            return (long long)pos;
    return -1;
}

/* Returns the index of the first byte of buf[0..n) that is not `value`, or -1. */
static inline long long gp_verify_byte(const void *buf, size_t n, uint8_t value)
{
    const uint8_t *p = (const uint8_t *)buf;
    for (size_t i = 0; i < n; i++)
        if (p[i] != value)
            return (long long)i;
    return -1;
}

/* ------------------------------------------------------------------------------- driver API */

/* Resolves a driver API entry point through cudart (which asks libcuda.so.1, i.e. the shim) so
 * that the programs need not link the toolkit's stub libcuda. Returns NULL when not found. */
static inline void *gp_driver_fn(const char *name)
{
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess)
        return NULL;
    return fn;
}

/* True when this program runs through gpupool (the shim reads GPUPOOL_SERVER; the tests and the
 * GPU validation always set it), false when it runs on a local driver: a few checks differ
 * where gpupool deliberately answers otherwise than a driver (docs/user-guide.md). */
static inline bool gp_through_gpupool(void) { return getenv("GPUPOOL_SERVER") != NULL; }

/* True when device 0 is gpupool's simulated device (its name says so). */
static inline bool gp_is_simulated(void)
{
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess)
        return false;
    return strstr(p.name, "imulated") != NULL;
}

#endif /* GP_CHECK_CUH */
