/*
 * request_ids.c: the request ids of the process's connections to its workers. A reply names
 * the request it answers by its id, so no two frames of a connection may share one: the info
 * and hello frames of connect.c and every frame conn.c sends take theirs from this counter.
 */
#include <stdatomic.h>
#include <stdint.h>

#include "shim.h"
#include "shim_core.h"

/* One counter for the process, even with one connection per part of a spread lease: ids unique
 * across the connections are unique on each, and a single atomic costs no more than one each. */
static atomic_uint_fast64_t next_req = 1;

uint64_t gp_conn_new_req(void)
{
    return atomic_fetch_add(&next_req, 1);
}
