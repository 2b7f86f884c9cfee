/*
 * clock.c: the worker's monotonic clock, for every file that times something.
 */
#include <time.h>

#include "clock.h"

uint64_t wk_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0; /* cannot fail for CLOCK_MONOTONIC; 0 only delays a stats event */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
