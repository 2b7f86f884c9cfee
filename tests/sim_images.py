"""Module images the simulated device accepts, for the tests and the fuzz seeds: PTX text whose
entries are the gp_test_* kernels it runs by name (worker/sim/sim_kernels.c)."""

NOOP_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry gp_test_noop()
{
    ret;
}
\0"""
