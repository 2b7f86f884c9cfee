/*
 * main.c: gpupool-scrub: command line, driver and context set-up, the JSON result.
 *
 *   gpupool-scrub --driver PATH --device ORDINAL [--simulated] [--samples N] [--min-chunk BYTES]
 *
 * One JSON line on stdout (what gpupoold/gpu/scrub.py reads, worker/scrub/README.md), progress on stderr. Exit 0 when the memory was wiped and verified, 1 otherwise.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "scrub.h"

#define DEFAULT_SAMPLES 256u
#define MAX_SAMPLES 1000000u
#define DEFAULT_MIN_CHUNK (2ull * 1024 * 1024)

static const char usage[] = "usage: gpupool-scrub --driver PATH --device ORDINAL [--simulated] "
                            "[--samples N] [--min-chunk BYTES]";

static double now_s(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0.0; /* cannot fail for CLOCK_MONOTONIC on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void scrub_log(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n >= 0) /* one write per line: lines do not interleave in the daemon's log */
        fprintf(stderr, "gpupool-scrub: %s\n", line);
}

int scrub_fail(struct scrub_run *r, const char *stage, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(r->error, sizeof(r->error), fmt, ap);
    va_end(ap);
    if (n < 0)
        snprintf(r->error, sizeof(r->error), "%s failed", stage);
    r->stage = stage;
    scrub_log("failed (%s): %s", stage, r->error);
    return -1;
}

int scrub_fail_cu(struct scrub_run *r, const char *stage, CUresult rc, const char *what,
                  const char *advice)
{
    char desc[1024];
    return scrub_fail(r, stage, "%s failed: %s; %s", what,
                      scrub_describe(&r->drv, rc, desc, sizeof(desc)), advice);
}

/* Bytes: a number with an optional KiB, MiB or GiB suffix. */
static int parse_bytes(const char *s, uint64_t *out)
{
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *s == '-')
        return -1;
    uint64_t mult = 1;
    if (strcasecmp(end, "KiB") == 0)
        mult = 1024;
    else if (strcasecmp(end, "MiB") == 0)
        mult = 1024 * 1024;
    else if (strcasecmp(end, "GiB") == 0)
        mult = 1024ull * 1024 * 1024;
    else if (*end != '\0')
        return -1;
    if (v > UINT64_MAX / mult)
        return -1;
    *out = v * mult;
    return 0;
}

static int parse_args(struct scrub_run *r, int argc, char **argv, const char **driver)
{
    bool have_device = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n = 0;
        if (strcmp(a, "--simulated") == 0) {
            r->simulated = true;
            continue;
        }
        if (strcmp(a, "--driver") != 0 && strcmp(a, "--device") != 0 &&
            strcmp(a, "--samples") != 0 && strcmp(a, "--min-chunk") != 0)
            return scrub_fail(r, "init", "unknown option %s; %s", a, usage);
        if (!v)
            return scrub_fail(r, "init", "%s needs a value; %s", a, usage);
        i++;
        if (strcmp(a, "--driver") == 0) {
            *driver = v;
        } else if (strcmp(a, "--device") == 0) {
            if (parse_bytes(v, &n) != 0 || n > 1024 || strpbrk(v, "KMGkmg"))
                return scrub_fail(r, "init", "--device %s: expected a device ordinal", v);
            r->ordinal = (int)n;
            have_device = true;
        } else if (strcmp(a, "--samples") == 0) {
            if (parse_bytes(v, &n) != 0 || n > MAX_SAMPLES || strpbrk(v, "KMGkmg"))
                return scrub_fail(r, "init", "--samples %s: expected 0 to %u", v, MAX_SAMPLES);
            r->samples = (unsigned)n;
        } else if (strcmp(a, "--min-chunk") == 0) {
            if (parse_bytes(v, &n) != 0 || n < 4096 || n > (1ull << 40))
                return scrub_fail(r, "init",
                                  "--min-chunk %s: expected 4096 bytes to 1 TiB (suffixes KiB, "
                                  "MiB, GiB)",
                                  v);
            r->min_chunk = n;
        }
    }
    if (!*driver || !have_device)
        return scrub_fail(r, "init", "--driver and --device are required; %s", usage);
    return 0;
}

/* Load the driver, open the device's primary context, read its memory. */
static int init(struct scrub_run *r, const char *driver)
{
    static const char advice_drv[] = "check that the driver works (nvidia-smi) and the GPU is "
                                     "visible to this process (CUDA_VISIBLE_DEVICES)";
    CUresult rc;
    if (scrub_load_driver(&r->drv, driver, r->error, sizeof(r->error)) != 0) {
        r->stage = "init";
        scrub_log("failed (init): %s", r->error);
        return -1;
    }
    if ((rc = r->drv.cuInit(0)) != CUDA_SUCCESS)
        return scrub_fail_cu(r, "init", rc, "cuInit", advice_drv);
    if (r->simulated && !r->drv.sim_detail)
        return scrub_fail(r, "init",
                          "--simulated, but %s is not the simulated device (it lacks "
                          "gpupoolSimLastErrorDetail): the daemon's GPU list mixes up real and "
                          "simulated GPUs; check its `sim_lib` and `driver` settings",
                          driver);
    if ((rc = r->drv.cuDeviceGet(&r->dev, r->ordinal)) != CUDA_SUCCESS) {
        char what[64];
        snprintf(what, sizeof(what), "cuDeviceGet(%d)", r->ordinal);
        return scrub_fail_cu(r, "init", rc, what,
                             "check the device ordinal (with CUDA_DEVICE_ORDER=PCI_BUS_ID it is "
                             "the nvidia-smi index)");
    }
    char name[256] = "?";
    if (r->drv.cuDeviceGetName && r->drv.cuDeviceGetName(name, sizeof(name), r->dev) != 0)
        snprintf(name, sizeof(name), "?");
    CUcontext ctx = NULL;
    if ((rc = r->drv.cuDevicePrimaryCtxRetain(&ctx, r->dev)) != CUDA_SUCCESS)
        return scrub_fail_cu(r, "init", rc, "cuDevicePrimaryCtxRetain", advice_drv);
    if ((rc = r->drv.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS)
        return scrub_fail_cu(r, "init", rc, "cuCtxSetCurrent", advice_drv);
    if ((rc = r->drv.cuMemGetInfo(&r->free_before, &r->total)) != CUDA_SUCCESS)
        return scrub_fail_cu(r, "init", rc, "cuMemGetInfo_v2", advice_drv);
    scrub_log("device %d (%s%s): %zu of %zu bytes free", r->ordinal, name,
              r->drv.sim_detail ? ", simulated device" : "", r->free_before, r->total);
    return 0;
}

static int release_context(struct scrub_run *r)
{
    if (!r->drv.cuDevicePrimaryCtxRelease)
        return 0; /* the context goes with the process */
    CUresult rc = r->drv.cuDevicePrimaryCtxRelease(r->dev);
    if (rc != CUDA_SUCCESS)
        return scrub_fail_cu(r, "free", rc, "cuDevicePrimaryCtxRelease_v2",
                             "the GPU may be faulty: keep it out of service and reset it");
    return 0;
}

/* A JSON string literal of s (quotes, backslashes and control characters escaped). */
static void put_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--help") == 0) {
        printf("%s\n", usage);
        return 0;
    }
    double t0 = now_s(), init_s = 0.0;
    struct scrub_run r = {.min_chunk = DEFAULT_MIN_CHUNK, .samples = DEFAULT_SAMPLES};
    r.rng = ((uint64_t)(t0 * 1e9) ^ ((uint64_t)getpid() << 32)) | 1; /* never 0 for xorshift */
    const char *driver = NULL;
    int rc = parse_args(&r, argc, argv, &driver);
    if (rc == 0)
        rc = init(&r, driver);
    init_s = now_s() - t0;
    if (rc == 0)
        rc = scrub_alloc_all(&r);
    if (rc == 0)
        rc = scrub_zero_all(&r);
    if (rc == 0)
        rc = scrub_sync(&r);
    if (rc == 0)
        rc = scrub_verify(&r);
    if (rc == 0)
        rc = scrub_free_all(&r);
    if (rc == 0)
        rc = release_context(&r);
    /* After a failure, allocations still held go back to the driver with the process. */
    free(r.allocs);
    double duration = now_s() - t0;
    if (rc == 0) {
        printf("{\"ok\":true,\"bytes\":%llu,\"allocations\":%zu,\"free_before\":%zu,"
               "\"total\":%zu,\"samples\":%llu,\"duration_s\":%.6f,\"init_s\":%.6f}\n",
               (unsigned long long)r.bytes, r.nallocs, r.free_before, r.total,
               (unsigned long long)r.samples_done, duration, init_s);
    } else {
        printf("{\"ok\":false,\"stage\":");
        put_json_string(stdout, r.stage ? r.stage : "init");
        printf(",\"error\":");
        put_json_string(stdout, r.error);
        printf("}\n");
    }
    if (fflush(stdout) != 0) {
        scrub_log("cannot write the result to stdout: %s", strerror(errno));
        return 1;
    }
    if (rc == 0)
        scrub_log("done in %.3f s (init %.3f s)", duration, init_s);
    return rc == 0 ? 0 : 1;
}
