/*
 * unimplemented.c: the answer of every driver function the shim does not implement.
 *
 * A name is logged once: a program that calls an unimplemented function in a loop must not
 * flood stderr, but the first call must be visible, because "function not implemented" without
 * saying which is the most common complaint about remoting shims.
 */
#include "gp_unimplemented.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Open-addressing set of names already reported. The shim exports about 650 names, so 1024
 * slots never fill in practice; if they ever do, we log again rather than lose a report. */
#define SEEN_SLOTS 1024u

static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;
static const char *seen[SEEN_SLOTS]; /* guarded by seen_lock */
static int quiet = -1;               /* guarded by seen_lock; -1 = GPUPOOL_LOG not read yet */

static uint32_t name_hash(const char *s)
{
    /* FNV-1a: short identifiers, no adversary; only needs to spread them over the slots. */
    uint32_t h = 2166136261u;
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 16777619u;
    }
    return h;
}

/* Returns 1 if `name` was not seen before (and records it), 0 if it was. Caller holds the lock. */
static int first_sighting(const char *name)
{
    uint32_t i = name_hash(name) & (SEEN_SLOTS - 1);
    for (uint32_t probes = 0; probes < SEEN_SLOTS; probes++, i = (i + 1) & (SEEN_SLOTS - 1)) {
        if (seen[i] == NULL) {
            seen[i] = name;
            return 1;
        }
        if (seen[i] == name || strcmp(seen[i], name) == 0)
            return 0;
    }
    return 1; /* full: report again rather than stay silent */
}

CUresult gp_unimplemented(const char *name)
{
    if (name == NULL)
        name = "(unnamed function)";
    int report = 0;
    if (pthread_mutex_lock(&seen_lock) == 0) {
        if (quiet < 0) {
            const char *env = getenv("GPUPOOL_LOG");
            quiet = (env != NULL && strcmp(env, "quiet") == 0);
        }
        report = !quiet && first_sighting(name);
        if (pthread_mutex_unlock(&seen_lock) != 0)
            report = 0; /* cannot happen with a default mutex we locked; stay quiet, stay alive */
    } else {
        /* Cannot lock (not expected for a static default mutex): a duplicate line is better
         * than a silent failure, unless the user asked for silence. */
        const char *env = getenv("GPUPOOL_LOG");
        report = !(env != NULL && strcmp(env, "quiet") == 0);
    }
    if (report) {
        /* One fprintf call = one line; stderr is unbuffered, so lines from threads do not mix. */
        (void)fprintf(stderr,
                      "gpupool: %s is not implemented by the gpupool shim "
                      "(returned CUDA_ERROR_NOT_SUPPORTED); please report it\n",
                      name);
    }
    return CUDA_ERROR_NOT_SUPPORTED;
}
