/*
 * conn_route.c: the parts table and the routing of frames to parts (issue 37, item 3). A lease
 * spread over servers (docs/multi-gpu.md, "Across servers") has one connection per part; this
 * file says which connection is part k's, which part holds a device or a device address, and
 * which part the calling thread's next frame goes to (its context's, or the one it routed to
 * with gp_conn_route). conn.c sends on the connection chosen here (conn_route in conn_state.h,
 * inline: it runs per frame) and conn_life.c fills the table when connecting.
 *
 * Apart from conn.c because it is a job of its own (a lookup over read-only data) that reads
 * nothing of the session's send and receive paths; it calls nothing of conn.c or conn_life.c,
 * so part 0's connection, which the table holds from the start, is defined here, and its read
 * slices' silence check is set when it starts (conn_life.c, conn_start).
 */
#include <stdatomic.h>
#include <stdint.h>

#include "conn_state.h"
#include "shim.h"
#include "shim_core.h"

/* The process's connection: the only one for a lease of one server, part 0's for a lease spread
 * over servers (docs/multi-gpu.md, "Across servers"). */
gp_conn gp_conn_process = {
    .state = ST_NONE,
    .sock = -1,
    .send_lock = PTHREAD_MUTEX_INITIALIZER,
    .ws = {.sock = -1, .dead = &gp_conn_process.dead, .ka = &gp_conn_process.ka},
    .wait_lock = PTHREAD_MUTEX_INITIALIZER,
    .rs = {.sock = -1, .ka = &gp_conn_process.ka, .owner = &gp_conn_process},
};

/* Part k's connection: part 0's is gp_conn_process, a spread lease's later parts are set up
 * (conn_life.c, conn_fresh) and connected under init_lock, then read-only but for their own
 * locked state. gp_conn_part_count is published (before the parts' state turns ST_READY) once
 * every part is connected. One part: gp_conn_part_count 1 and every frame takes gp_conn_process
 * without looking further (conn_route). */
gp_conn *gp_conn_part[GP_MAX_DEVICES] = {&gp_conn_process};
atomic_int gp_conn_part_count = 1;

/* The calling thread's context for the worker (gp_conn_use_ctx): per thread, not per
 * connection (the program sets its current context without naming a server); each connection
 * remembers what it last sent (last_ctx_sent). */
__thread uint64_t gp_conn_tl_wire_ctx;

/* The part the calling thread's next frames go to (gp_conn_route; -1: its context's part), and
 * the part of its context as gp_conn_route_spread last found it (what conn.c's apply_ctx_locked
 * compares with). */
static __thread int tl_route_part = -1;
__thread int gp_conn_tl_ctx_part;

int gp_conn_parts(void)
{
    return conn_nparts();
}

int gp_conn_part_of_device(int dev)
{
    int n = conn_nparts();
    for (int k = 0; k < n; k++)
        if (dev >= gp_conn_part[k]->first_device &&
            dev < gp_conn_part[k]->first_device + gp_conn_part[k]->ndevices)
            return k;
    return n == 1 && dev >= 0 ? 0 : -1;
}

static int ctx_part_of(uint64_t ctx);

int gp_conn_part_of_addr(uint64_t a)
{
    int n = conn_nparts();
    if (n == 1)
        return 0;
    for (int k = 0; k < n; k++)
        if (a >= gp_conn_part[k]->va_base &&
            a - gp_conn_part[k]->va_base < gp_conn_part[k]->va_size)
            return k;
    /* Outside every slice: a module's global lies where its worker's driver put it; the VA map
     * knows the context it belongs to, and so its part (the thread's own part's copy when two
     * parts have one at this address). */
    gp_range rg;
    if (gp_conn_find_range(a, &rg) == 0 && rg.ctx)
        return ctx_part_of(rg.ctx);
    return -1;
}

/* A context of the calling thread's part (gp_vamap_global_of's choice). */
static int on_thread_part(uint64_t ctx)
{
    return ctx_part_of(ctx) == ctx_part_of(gp_conn_tl_wire_ctx);
}

int gp_conn_find_range(uint64_t a, gp_range *out)
{
    if (gp_vamap_find(a, out) != 0)
        return -1;
    gp_range mine;
    if (out->kind == GP_RANGE_GLOBAL && conn_nparts() > 1 &&
        gp_vamap_global_of(a, on_thread_part, &mine) == 0)
        *out = mine;
    return 0;
}

int gp_conn_local_device(int dev)
{
    int k = gp_conn_part_of_device(dev);
    return k < 0 ? dev : dev - gp_conn_part[k]->first_device;
}

int gp_conn_part_first_device(int p)
{
    return p >= 0 && p < conn_nparts() ? gp_conn_part[p]->first_device : -1;
}

const char *gp_conn_part_server(int p)
{
    return p >= 0 && p < conn_nparts() ? gp_conn_part[p]->server_desc : "";
}

int gp_conn_part_tls(int p)
{
    return p >= 0 && p < conn_nparts() && gp_conn_part[p]->tls != NULL;
}

void gp_conn_route(int part)
{
    tl_route_part = part >= 0 && part < conn_nparts() ? part : -1;
}

/* The part of context ctx (0 for none or one unknown: calls before the first context go to part
 * 0, as the device they mean is device 0). */
static int ctx_part_of(uint64_t ctx)
{
    if (!ctx || conn_nparts() == 1)
        return 0;
    const gp_ctx_obj *o = gp_ctx_obj_get(ctx);
    int k = o ? gp_conn_part_of_device(o->device) : 0;
    return k < 0 ? 0 : k;
}

int gp_conn_next_part(void)
{
    return tl_route_part >= 0 ? tl_route_part : ctx_part_of(gp_conn_tl_wire_ctx);
}

gp_conn *gp_conn_route_spread(void)
{
    gp_conn_tl_ctx_part = ctx_part_of(gp_conn_tl_wire_ctx);
    return gp_conn_part[tl_route_part >= 0 ? tl_route_part : gp_conn_tl_ctx_part];
}

void gp_conn_use_ctx(uint64_t ctx_id)
{
    gp_conn_tl_wire_ctx = ctx_id;
}

uint64_t gp_conn_wire_ctx(void)
{
    return gp_conn_tl_wire_ctx;
}
