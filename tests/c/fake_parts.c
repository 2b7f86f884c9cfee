/*
 * fake_parts.c: the parts table of a lease of one server, for C tests that link shim files
 * against a fake core (test_module_api): one part, every frame to it. The spread routing itself
 * is tested end to end (tests/test_e2e_spread.py).
 */
#include "shim.h"

int gp_conn_parts(void)
{
    return 1;
}

void gp_conn_route(int part)
{
    (void)part;
}

void gp_conn_use_ctx(uint64_t ctx_id)
{
    (void)ctx_id;
}

int gp_conn_next_part(void)
{
    return 0;
}
