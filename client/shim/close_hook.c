/*
 * close_hook.c: the one function that runs at exit while the connection is still open, before
 * its goodbye (conn.c's say_goodbye): the profile's question to the worker (profile.c). Kept out
 * of conn.c so that the transport names nothing above it (no circle between the files).
 */
#include <stdatomic.h>
#include <stddef.h>

#include "shim.h"
#include "shim_core.h"

static void (*_Atomic gp_close_hook)(void);

void gp_conn_set_close_hook(void (*fn)(void))
{
    atomic_store(&gp_close_hook, fn);
}

void gp_conn_close_hook_run(void)
{
    void (*fn)(void) = atomic_load(&gp_close_hook);
    if (fn)
        fn();
}
