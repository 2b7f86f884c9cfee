/*
 * entry_profile.c: calls and time per CUDA entry point, when GPUPOOL_PROFILE is set (profile.c
 * writes them at exit), counted in ONE place without a hook in any API function: the API files
 * (client/shim/api_*.c) are compiled with -finstrument-functions (shim.mk), so the compiler calls
 * __cyg_profile_func_enter/exit below around every function in them. The outermost such call on a
 * thread is the entry point the program called (cuLaunchKernel, or the same function through a
 * pointer from cuGetProcAddress); the functions it calls in turn (static helpers, another entry
 * point the shim uses inside) belong to it and are not counted on their own. At exit profile.c
 * names each address with dladdr(): an exported cu* function has its name; a helper that some
 * other thread of the shim runs outermost has none and is left out.
 *
 * Off (the hooks return after one relaxed load) unless GPUPOOL_PROFILE was set when the library
 * loaded. The counters are relaxed atomics in a fixed open-addressing table keyed by the
 * function's address (a slot is claimed with a compare-and-swap, never freed): any thread may
 * count at any time without a lock. This file must not itself be instrumented (it is not an
 * api_*.c file), or the hooks would call themselves.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "entry_profile.h"

#define GP_ENTRY_SLOTS 2048u /* a power of two; the shim exports some 500 cu* functions */

struct gp_entry_slot {
    _Atomic uintptr_t fn; /* 0: free */
    atomic_uint_fast64_t v[GP_ENTRY_FIELDS];
};

static atomic_int gp_entry_on;
static struct gp_entry_slot gp_entry_slots[GP_ENTRY_SLOTS];
static atomic_uint_fast64_t gp_entry_overflow_calls;

/* The calling thread: how deep in instrumented functions, the outermost one's slot and when it
 * was entered. */
static _Thread_local unsigned gp_entry_depth;
static _Thread_local struct gp_entry_slot *gp_entry_cur;
static _Thread_local uint64_t gp_entry_t0;

#define GP_NO_HOOK __attribute__((no_instrument_function))

GP_NO_HOOK __attribute__((constructor)) static void gp_entry_setup(void)
{
    const char *p = getenv("GPUPOOL_PROFILE");
    atomic_store(&gp_entry_on, p != NULL && p[0] != '\0');
}

GP_NO_HOOK static uint64_t gp_entry_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC; 0 makes the call count no time */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* fn's slot, claimed if it has none; NULL when the table is full. */
GP_NO_HOOK static struct gp_entry_slot *gp_entry_slot_of(uintptr_t fn)
{
    uint64_t h = ((uint64_t)fn >> 4) * UINT64_C(0x9e3779b97f4a7c15);
    for (unsigned i = 0; i < GP_ENTRY_SLOTS; i++) {
        struct gp_entry_slot *s = &gp_entry_slots[(h + i) & (GP_ENTRY_SLOTS - 1)];
        uintptr_t k = atomic_load_explicit(&s->fn, memory_order_acquire);
        if (k == fn)
            return s;
        if (k == 0) {
            uintptr_t expected = 0;
            if (atomic_compare_exchange_strong(&s->fn, &expected, fn) || expected == fn)
                return s;
        }
    }
    return NULL;
}

GP_NO_HOOK void __cyg_profile_func_enter(void *fn, void *call_site);
GP_NO_HOOK void __cyg_profile_func_exit(void *fn, void *call_site);

GP_NO_HOOK void __cyg_profile_func_enter(void *fn, void *call_site)
{
    (void)call_site;
    if (!atomic_load_explicit(&gp_entry_on, memory_order_relaxed))
        return;
    if (gp_entry_depth++ != 0)
        return;
    gp_entry_cur = gp_entry_slot_of((uintptr_t)fn);
    if (!gp_entry_cur)
        atomic_fetch_add_explicit(&gp_entry_overflow_calls, 1, memory_order_relaxed);
    gp_entry_t0 = gp_entry_now_ns();
}

GP_NO_HOOK void __cyg_profile_func_exit(void *fn, void *call_site)
{
    (void)fn;
    (void)call_site;
    if (!atomic_load_explicit(&gp_entry_on, memory_order_relaxed) || gp_entry_depth == 0)
        return;
    if (--gp_entry_depth != 0)
        return;
    struct gp_entry_slot *s = gp_entry_cur;
    gp_entry_cur = NULL;
    if (!s)
        return;
    uint64_t t1 = gp_entry_now_ns();
    atomic_fetch_add_explicit(&s->v[GP_ENTRY_CALLS], 1, memory_order_relaxed);
    if (gp_entry_t0 && t1 > gp_entry_t0)
        atomic_fetch_add_explicit(&s->v[GP_ENTRY_NS], t1 - gp_entry_t0, memory_order_relaxed);
}

GP_NO_HOOK void gp_entry_note_frame(int waited, uint64_t sent, uint64_t received, uint64_t ns)
{
    struct gp_entry_slot *s = gp_entry_cur;
    if (!s)
        return;
    atomic_fetch_add_explicit(&s->v[GP_ENTRY_FRAMES], 1, memory_order_relaxed);
    if (waited)
        atomic_fetch_add_explicit(&s->v[GP_ENTRY_WAITED], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->v[GP_ENTRY_SENT], sent, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->v[GP_ENTRY_RECEIVED], received, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->v[GP_ENTRY_WAIT_NS], ns, memory_order_relaxed);
}

GP_NO_HOOK size_t gp_entry_snapshot(gp_entry_counts *out, size_t cap)
{
    size_t n = 0;
    for (unsigned i = 0; i < GP_ENTRY_SLOTS; i++) {
        uintptr_t fn = atomic_load_explicit(&gp_entry_slots[i].fn, memory_order_acquire);
        if (fn == 0)
            continue;
        if (n < cap) {
            out[n].fn = fn;
            for (int f = 0; f < GP_ENTRY_FIELDS; f++)
                out[n].v[f] = atomic_load_explicit(&gp_entry_slots[i].v[f], memory_order_relaxed);
        }
        n++;
    }
    return n;
}

GP_NO_HOOK uint64_t gp_entry_overflow(void)
{
    return atomic_load_explicit(&gp_entry_overflow_calls, memory_order_relaxed);
}
