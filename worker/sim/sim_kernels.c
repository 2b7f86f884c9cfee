/*
 * sim_kernels.c: the kernels the simulated device can run: host versions of the gp_test_*
 * kernels of tests/sim/gp_test_kernels.cuh, with the same names, parameters and results.
 *
 * The parameter table mirrors each kernel's signature as a C struct, so offsetof gives the
 * layout the C ABI (and nvcc, which follows it for kernel parameters) uses: natural alignment,
 * device pointers 8 bytes. tests/sim/test_sim_elf.c checks this table against the parameter
 * records nvcc writes into a real cubin.
 *
 * A kernel checks every device range it touches (the whole range, before touching any of it)
 * against mapped device memory. A bad pointer fails the launch with CUDA_ERROR_ILLEGAL_ADDRESS
 * (the caller makes it sticky, as the device does) instead of crashing the worker.
 */
#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#include "sim_internal.h"

/* A garbage argument must not hang the worker. The fuzzing build (tests/fuzz/fuzz.mk) sets a
 * far lower cap, so that an input costs milliseconds. */
#ifdef SIM_MAX_SPIN_NS
#define MAX_SPIN_NS SIM_MAX_SPIN_NS
#else
#define MAX_SPIN_NS (60ull * 1000000000ull)
#endif

static uint64_t total_threads(const struct sim_dims *d)
{
    return (uint64_t)d->grid[0] * d->grid[1] * d->grid[2] * d->block[0] * d->block[1] * d->block[2];
}

/* The host address of a device range a kernel is about to touch, or NULL (detail recorded). */
static void *touch(const char *kernel, const char *param, uint64_t addr, uint64_t len)
{
    void *p = sim_dev_range(addr, len);
    if (!p)
        sim_detail("kernel %s: parameter %s: [0x%llx, +%llu bytes) is not device memory", kernel,
                   param, (unsigned long long)addr, (unsigned long long)len);
    return p;
}

/* Unpacks a parameter buffer into the kernel's argument struct (tail padding stays zero). */
#define UNPACK(type, var, params, nbytes)                                                          \
    type var;                                                                                      \
    memset(&var, 0, sizeof(var));                                                                  \
    memcpy(&var, params, nbytes)

/* ---- gp_test_noop() ---------------------------------------------------------------------- */
static CUresult k_noop(const unsigned char *params, const struct sim_dims *d)
{
    (void)params;
    (void)d;
    return CUDA_SUCCESS;
}

/* ---- gp_test_axpy(float a, const float *x, float *y, int n) ------------------------------ */
struct axpy_args {
    float a;
    uint64_t x, y;
    int n;
};

static CUresult k_axpy(const unsigned char *params, const struct sim_dims *d)
{
    UNPACK(struct axpy_args, args, params, offsetof(struct axpy_args, n) + sizeof(int));
    /* Thread i = blockIdx.x*blockDim.x + threadIdx.x touches x[i] and y[i] for i < n, so the
     * threads touch [0, min(n, gridDim.x*blockDim.x)). (The device computes i in 32 bits; threads
     * whose index wraps land on a negative i, which does nothing, or repeat a smaller one.) */
    uint64_t span = (uint64_t)d->grid[0] * d->block[0];
    uint64_t m = args.n <= 0 ? 0 : ((uint64_t)args.n < span ? (uint64_t)args.n : span);
    if (m == 0)
        return CUDA_SUCCESS;
    const unsigned char *x = touch("gp_test_axpy", "x", args.x, m * 4);
    unsigned char *y = x ? touch("gp_test_axpy", "y", args.y, m * 4) : NULL;
    if (!x || !y)
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    /* Threads that differ only in their y/z indices compute the same i; on the device they race
     * on y[i], each reading the old value, so the element ends up updated once. So: one update
     * per distinct i, in thread order. */
    for (uint64_t i = 0; i < m; i++) {
        float xv, yv;
        memcpy(&xv, x + i * 4, 4);
        memcpy(&yv, y + i * 4, 4);
        yv = args.a * xv + yv;
        memcpy(y + i * 4, &yv, 4);
    }
    return CUDA_SUCCESS;
}

/* ---- gp_test_scalars(double *out, char c, short s, int i, long long l, float f, double d) - */
struct scalars_args {
    uint64_t out;
    char c;
    short s;
    int i;
    long long l;
    float f;
    double d;
};

static CUresult k_scalars(const unsigned char *params, const struct sim_dims *d)
{
    (void)d; /* only thread 0 of block 0 writes */
    UNPACK(struct scalars_args, args, params, sizeof(struct scalars_args));
    unsigned char *out = touch("gp_test_scalars", "out", args.out, 6 * sizeof(double));
    if (!out)
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    double v[6] = {(double)args.c, (double)args.s, (double)args.i,
                   (double)args.l, (double)args.f, args.d};
    memcpy(out, v, sizeof(v));
    return CUDA_SUCCESS;
}

/* ---- gp_test_big_struct(struct gp_big_arg arg, long long *out) --------------------------- */
struct big_args {
    struct {
        int v[100];
    } arg;
    uint64_t out;
};

static CUresult k_big_struct(const unsigned char *params, const struct sim_dims *d)
{
    (void)d;
    UNPACK(struct big_args, args, params, sizeof(struct big_args));
    unsigned char *out = touch("gp_test_big_struct", "out", args.out, 3 * sizeof(long long));
    if (!out)
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    long long r[3] = {0, args.arg.v[0], args.arg.v[99]};
    for (int k = 0; k < 100; k++)
        r[0] += (long long)args.arg.v[k] * (k + 1);
    memcpy(out, r, sizeof(r));
    return CUDA_SUCCESS;
}

/* ---- gp_test_index(unsigned int *out, unsigned int n) ------------------------------------ */
struct index_args {
    uint64_t out;
    unsigned n;
};

static CUresult k_index(const unsigned char *params, const struct sim_dims *d)
{
    UNPACK(struct index_args, args, params, offsetof(struct index_args, n) + sizeof(unsigned));
    /* tid covers 0 .. threads-1 (32-bit, as on the device), so out[0 .. min(n, threads)) is
     * exactly what the grid writes. */
    uint64_t threads = total_threads(d);
    uint64_t m = args.n < threads ? args.n : threads;
    if (m == 0)
        return CUDA_SUCCESS;
    unsigned char *out = touch("gp_test_index", "out", args.out, m * 4);
    if (!out)
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    const unsigned gx = d->grid[0], gy = d->grid[1], bx_n = d->block[0], by_n = d->block[1];
    const uint32_t bsize = d->block[0] * d->block[1] * d->block[2];
    /* Blocks and threads visited in linear order, so tid grows by one per thread and the walk
     * can stop at n instead of visiting a huge grid. */
    uint64_t visited = 0;
    for (unsigned bz = 0; bz < d->grid[2]; bz++)
        for (unsigned by = 0; by < gy; by++)
            for (unsigned bx = 0; bx < gx; bx++)
                for (unsigned tz = 0; tz < d->block[2]; tz++)
                    for (unsigned ty = 0; ty < by_n; ty++)
                        for (unsigned tx = 0; tx < bx_n; tx++) {
                            if (visited++ >= m)
                                return CUDA_SUCCESS;
                            uint32_t tid =
                                ((bz * gy + by) * gx + bx) * bsize + (tz * by_n + ty) * bx_n + tx;
                            if (tid < args.n) {
                                uint32_t v = tid * 2654435761u;
                                memcpy(out + (size_t)tid * 4, &v, 4);
                            }
                        }
    return CUDA_SUCCESS;
}

/* ---- gp_test_spin(unsigned long long ns) ------------------------------------------------- */
struct spin_args {
    unsigned long long ns;
};

static CUresult k_spin(const unsigned char *params, const struct sim_dims *d)
{
    (void)d;
    UNPACK(struct spin_args, args, params, sizeof(struct spin_args));
    unsigned long long ns = args.ns > MAX_SPIN_NS ? MAX_SPIN_NS : args.ns;
    /* The real kernel keeps the GPU busy and the host's CPU idle: the simulated device sleeps
     * until its clock has run ns (an absolute deadline, so a signal only resumes the wait). A
     * host busy-wait would make every busy simulated GPU a busy CPU core, and the GPU time of
     * tenants sharing a GPU would measure the CPU scheduler of a loaded machine. */
    uint64_t end = sim_now_ns() + ns;
    struct timespec at = {.tv_sec = (time_t)(end / 1000000000ull),
                          .tv_nsec = (long)(end % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL) == EINTR) {
    }
    return CUDA_SUCCESS;
}

/* ---- the table --------------------------------------------------------------------------- */
#define P(type, member)                                                                            \
    {                                                                                              \
        offsetof(type, member), sizeof(((type *)0)->member)                                        \
    }

static const struct sim_kernel_def kernels[] = {
    {"gp_test_noop", 0, {{0, 0}}, k_noop},
    {"gp_test_axpy",
     4,
     {P(struct axpy_args, a), P(struct axpy_args, x), P(struct axpy_args, y),
      P(struct axpy_args, n)},
     k_axpy},
    {"gp_test_scalars",
     7,
     {P(struct scalars_args, out), P(struct scalars_args, c), P(struct scalars_args, s),
      P(struct scalars_args, i), P(struct scalars_args, l), P(struct scalars_args, f),
      P(struct scalars_args, d)},
     k_scalars},
    {"gp_test_big_struct", 2, {P(struct big_args, arg), P(struct big_args, out)}, k_big_struct},
    {"gp_test_index", 2, {P(struct index_args, out), P(struct index_args, n)}, k_index},
    {"gp_test_spin", 1, {P(struct spin_args, ns)}, k_spin},
};

const struct sim_kernel_def *sim_kernel_find(const char *name)
{
    for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++)
        if (strcmp(kernels[i].name, name) == 0)
            return &kernels[i];
    return NULL;
}

uint32_t sim_params_size(int nparams, const struct sim_param *params)
{
    uint32_t end = 0;
    for (int i = 0; i < nparams; i++)
        if (params[i].offset + params[i].size > end)
            end = params[i].offset + params[i].size;
    return end;
}
