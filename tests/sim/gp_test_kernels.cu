// gp_test_kernels.cu: the test kernels as one CUDA translation unit, compiled by
// tests/test_sim_device.py (nvcc -cubin / -fatbin) into the images the sim's C tests load.
// Besides the gp_test_* kernels (which the sim can run) it has an ordinary kernel and module
// globals, for the tests of name lookup, parameter records and globals.
#include "gp_test_kernels.cuh"

__device__ int gp_counter;
__device__ float gp_table[16] = {1.0f, 2.0f, 3.0f};
__constant__ int gp_consts[4] = {5, 6, 7, 8};

// Not simulated: launching it on the sim fails with CUDA_ERROR_NOT_SUPPORTED.
extern "C" __global__ void gp_other_kernel(int a, double b, struct gp_big_arg c, int *out)
{
    out[0] = a * gp_counter + gp_consts[a & 3] + (int)b + c.v[1] + (int)gp_table[a & 15];
}
