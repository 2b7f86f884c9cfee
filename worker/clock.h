/*
 * clock.h: the worker's one clock (a base file: it includes nothing of the worker).
 */
#ifndef GP_WK_CLOCK_H
#define GP_WK_CLOCK_H

#include <stdint.h>

/* CLOCK_MONOTONIC in nanoseconds: stats intervals, latencies, idle and grace times. */
uint64_t wk_now_ns(void);

#endif /* GP_WK_CLOCK_H */
