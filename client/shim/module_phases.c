/*
 * module_phases.c: the counters of module_phases.h. Relaxed atomics: loads run on any thread,
 * and the profile reads the totals once, at exit.
 */
#include "module_phases.h"

#include <time.h>

const char *const gp_module_phase_names[GP_MODPHASES] = {"hash (SHA-256)", "probe (no image)",
                                                         "upload (image)"};

static gp_module_phase gp_phases[GP_MODPHASES];

uint64_t gp_module_phase_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC; a 0 makes the phase's time 0, not garbage */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void gp_module_phase_add(int phase, uint64_t bytes, uint64_t ns)
{
    if (phase < 0 || phase >= GP_MODPHASES)
        return;
    __atomic_fetch_add(&gp_phases[phase].count, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&gp_phases[phase].bytes, bytes, __ATOMIC_RELAXED);
    __atomic_fetch_add(&gp_phases[phase].ns, ns, __ATOMIC_RELAXED);
}

void gp_module_phases_snapshot(gp_module_phase out[GP_MODPHASES])
{
    for (int i = 0; i < GP_MODPHASES; i++) {
        out[i].count = __atomic_load_n(&gp_phases[i].count, __ATOMIC_RELAXED);
        out[i].bytes = __atomic_load_n(&gp_phases[i].bytes, __ATOMIC_RELAXED);
        out[i].ns = __atomic_load_n(&gp_phases[i].ns, __ATOMIC_RELAXED);
    }
}
