/*
 * gp_test_kernels.cuh: the CUDA device code of the gp_test_* kernels.
 *
 * The simulated device (worker/sim/sim_kernels.c) carries host versions of exactly these kernels,
 * with the same names, parameter lists and results. Test programs include this file so that the
 * same program runs on a real GPU (as a reference) and on the simulated device. Keep the two in
 * step: tests/sim/test_sim_elf.c checks that the parameter layout nvcc gives these kernels is the
 * layout the simulator's table declares.
 *
 * The kernels are extern "C" so that their names are not mangled: the simulator finds its host
 * version by the plain name.
 */
#ifndef GP_TEST_KERNELS_CUH
#define GP_TEST_KERNELS_CUH

/* 400 bytes: larger than the 256 bytes that a handful of tools still assume is the limit. */
struct gp_big_arg {
    int v[100];
};

extern "C" __global__ void gp_test_noop(void) {}

extern "C" __global__ void gp_test_axpy(float a, const float *x, float *y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}

/* One parameter of each scalar size so that the argument packing (alignment, padding) is tested. */
extern "C" __global__ void gp_test_scalars(double *out, char c, short s, int i, long long l,
                                           float f, double d)
{
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 &&
        threadIdx.y == 0 && threadIdx.z == 0) {
        out[0] = (double)c;
        out[1] = (double)s;
        out[2] = (double)i;
        out[3] = (double)l;
        out[4] = (double)f;
        out[5] = d;
    }
}

extern "C" __global__ void gp_test_big_struct(struct gp_big_arg arg, long long *out)
{
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 &&
        threadIdx.y == 0 && threadIdx.z == 0) {
        long long sum = 0;
        for (int k = 0; k < 100; k++)
            sum += (long long)arg.v[k] * (k + 1);
        out[0] = sum;
        out[1] = arg.v[0];
        out[2] = arg.v[99];
    }
}

/* Every thread of a 3D grid of 3D blocks writes its own linear index (hashed), so a wrong
 * dimension order shows up as a wrong value at a known place. */
extern "C" __global__ void gp_test_index(unsigned int *out, unsigned int n)
{
    unsigned int tid =
        ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) *
            (blockDim.x * blockDim.y * blockDim.z) +
        (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    if (tid < n)
        out[tid] = tid * 2654435761u;
}

/* Busy-waits about ns nanoseconds, for event timing tests. Only the first thread waits; the
 * others are done at once, so the launch takes about ns whatever its shape. */
extern "C" __global__ void gp_test_spin(unsigned long long ns)
{
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 &&
        threadIdx.y == 0 && threadIdx.z == 0) {
        unsigned long long start = 0, now = 0;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        } while (now - start < ns);
    }
}

#endif /* GP_TEST_KERNELS_CUH */
