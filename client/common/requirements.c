/*
 * requirements.c: the texts and sizes of what the client asks of its GPU (client_config.c reads
 * them from the configuration file and the environment: GPUPOOL_GPU, GPUPOOL_GPU_MODEL,
 * GPUPOOL_MIN_MEMORY, [requirements]).
 *
 * The server honours them or refuses the session with its reason. A value the shim cannot send
 * as meant (a size it cannot read, a text too long for the protocol) is an error rather than
 * silently dropped: a dropped requirement would hand the program a GPU it said it cannot use,
 * and it would fail later, far from the cause. Shared by libcuda.so.1 and libnvidia-ml.so.1.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "client_config.h"

/* Units of GPUPOOL_MIN_MEMORY. The SI ones are powers of 1000 on purpose: GPUs are sold by
 * decimal sizes and report a little less than the binary one (an "A100 40GB" has 42.5e9 bytes,
 * under 40 GiB), so "40G" must not refuse the GPU the user means. */
static const struct {
    const char *name;
    uint64_t mult;
} units[] = {
    {"", 1},
    {"b", 1},
    {"k", 1000ull},
    {"kb", 1000ull},
    {"kib", 1ull << 10},
    {"m", 1000000ull},
    {"mb", 1000000ull},
    {"mib", 1ull << 20},
    {"g", 1000000000ull},
    {"gb", 1000000000ull},
    {"gib", 1ull << 30},
    {"t", 1000000000000ull},
    {"tb", 1000000000000ull},
    {"tib", 1ull << 40},
};

int gp_parse_size(const char *s, uint64_t *out)
{
    while (*s == ' ' || *s == '\t')
        s++;
    if (!isdigit((unsigned char)*s))
        return -1; /* no sign, no empty number */
    /* The number as whole + frac / 10^fdigits, in integers (no float rounding surprises). */
    uint64_t whole = 0, frac = 0, fscale = 1;
    for (; isdigit((unsigned char)*s); s++) {
        uint64_t d = (uint64_t)(*s - '0');
        if (whole > UINT64_MAX / 10 || whole * 10 > UINT64_MAX - d)
            return -1;
        whole = whole * 10 + d;
    }
    if (*s == '.') {
        s++;
        if (!isdigit((unsigned char)*s))
            return -1;
        for (; isdigit((unsigned char)*s); s++) {
            if (fscale >= 1000000ull)
                continue; /* digits past the sixth cannot matter */
            frac = frac * 10 + (uint64_t)(*s - '0');
            fscale *= 10;
        }
    }
    while (*s == ' ' || *s == '\t')
        s++;
    const char *unit = s;
    size_t ul = strlen(unit);
    while (ul > 0 && (unit[ul - 1] == ' ' || unit[ul - 1] == '\t'))
        ul--;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strlen(units[i].name) != ul || strncasecmp(unit, units[i].name, ul) != 0)
            continue;
        uint64_t m = units[i].mult;
        if (whole > UINT64_MAX / m)
            return -1;
        uint64_t v = whole * m;
        /* No overflow: frac < fscale <= 10^6 < 2^20 and m <= 2^40. */
        uint64_t f = frac * m / fscale;
        if (f > UINT64_MAX - v)
            return -1;
        *out = v + f;
        return 0;
    }
    return -1;
}
