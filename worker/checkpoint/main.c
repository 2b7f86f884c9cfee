/*
 * gpupool-checkpoint: detach a worker's CUDA state from its GPU and attach it again, with the
 * driver's process checkpoints (cuCheckpointProcess*, CUDA 12.8+ drivers; the simulated device
 * has them too). See worker/checkpoint/README.md.
 *
 * A process of its own, like gpupool-scrub: the calls act on another process (the worker) by
 * pid, and a driver hang here must not take the daemon or the worker down. Single-threaded.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gp_cuda.h"

#define MAX_MOVES 16

enum {
    EXIT_OK = 0,
    EXIT_FAILED = 1,
    EXIT_USAGE = 2,
    EXIT_BUSY = 3
};

struct drv {
    CUresult (*cuInit)(unsigned int);
    CUresult (*getState)(int, CUprocessState *);
    CUresult (*lock)(int, CUcheckpointLockArgs *);
    CUresult (*checkpoint)(int, CUcheckpointCheckpointArgs *);
    CUresult (*restore)(int, CUcheckpointRestoreArgs *);
    CUresult (*unlock)(int, CUcheckpointUnlockArgs *);
    CUresult (*cuGetErrorName)(CUresult, const char **); /* optional */
};

static const char *const state_names[] = {"running", "locked", "checkpointed", "failed"};

static const char *state_name(CUprocessState s)
{
    return s >= 0 && s < 4 ? state_names[s] : "unknown";
}

static double now_s(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0.0;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void usage(const char *why)
{
    fprintf(
        stderr,
        "gpupool-checkpoint: %s\n"
        "usage: gpupool-checkpoint --driver PATH --pid PID detach [--timeout-ms N]\n"
        "       gpupool-checkpoint --driver PATH --pid PID attach [--move OLD_UUID=NEW_UUID]...\n"
        "       gpupool-checkpoint --driver PATH --pid PID state\n",
        why);
    exit(EXIT_USAGE);
}

/* The one JSON line on stdout: the result for gpupoold (worker/checkpoint/README.md). Messages
 * are ours, so they hold no quote or backslash to escape. */
static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (n < 0)
        msg[0] = '\0';
    for (char *p = msg; *p; p++)
        if (*p == '"' || *p == '\\')
            *p = '\'';
    printf("{\"ok\":false,\"busy\":%s,\"error\":\"%s\"}\n", code == EXIT_BUSY ? "true" : "false",
           msg);
    return code;
}

static const char *err_name(const struct drv *d, CUresult rc)
{
    static char buf[32];
    const char *name = NULL;
    if (d->cuGetErrorName && d->cuGetErrorName(rc, &name) == CUDA_SUCCESS && name)
        return name;
    snprintf(buf, sizeof(buf), "CUresult %d", (int)rc);
    return buf;
}

static void *sym(void *lib, const char *name)
{
    dlerror();
    void *p = dlsym(lib, name);
    return dlerror() ? NULL : p;
}

static int load(struct drv *d, const char *path)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        return fail(EXIT_FAILED, "cannot load the driver %s: %s", path,
                    why ? why : "unknown error");
    }
    static const char *const names[] = {"cuInit",
                                        "cuCheckpointProcessGetState",
                                        "cuCheckpointProcessLock",
                                        "cuCheckpointProcessCheckpoint",
                                        "cuCheckpointProcessRestore",
                                        "cuCheckpointProcessUnlock"};
    void *p[6];
    for (int i = 0; i < 6; i++) {
        p[i] = sym(lib, names[i]);
        if (!p[i])
            return fail(EXIT_FAILED,
                        "the driver %s lacks %s: detaching idle leases needs a driver with CUDA "
                        "12.8 process checkpoints (R570 or later); leases on this GPU keep it",
                        path, names[i]);
    }
    _Static_assert(sizeof(void *) == sizeof(void (*)(void)), "function pointers must fit void *");
    memcpy(&d->cuInit, &p[0], sizeof(void *));
    memcpy(&d->getState, &p[1], sizeof(void *));
    memcpy(&d->lock, &p[2], sizeof(void *));
    memcpy(&d->checkpoint, &p[3], sizeof(void *));
    memcpy(&d->restore, &p[4], sizeof(void *));
    memcpy(&d->unlock, &p[5], sizeof(void *));
    void *g = sym(lib, "cuGetErrorName");
    memcpy(&d->cuGetErrorName, &g, sizeof(void *));
    return EXIT_OK;
}

/* "GPU-8ca6d4d2-33a4-...": the nvidia-smi form, or the 32 hex digits with or without dashes. */
static int parse_uuid(const char *s, CUuuid *u)
{
    if (strncmp(s, "GPU-", 4) == 0)
        s += 4;
    int n = 0;
    for (; *s && n < 32; s++) {
        if (*s == '-')
            continue;
        int v = (*s >= '0' && *s <= '9')   ? *s - '0'
                : (*s >= 'a' && *s <= 'f') ? *s - 'a' + 10
                : (*s >= 'A' && *s <= 'F') ? *s - 'A' + 10
                                           : -1;
        if (v < 0)
            return -1;
        if (n % 2 == 0)
            u->bytes[n / 2] = (char)(v << 4);
        else
            u->bytes[n / 2] = (char)(u->bytes[n / 2] | v);
        n++;
    }
    return n == 32 && *s == '\0' ? 0 : -1;
}

static long parse_long(const char *s, long lo, long hi, const char *what)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || !end || *end != '\0' || v < lo || v > hi) {
        char why[128];
        snprintf(why, sizeof(why), "%s: '%s' is not a number from %ld to %ld", what, s, lo, hi);
        usage(why);
    }
    return v;
}

int main(int argc, char **argv)
{
    const char *driver = NULL, *action = NULL;
    int pid = 0;
    unsigned timeout_ms = 0;
    CUcheckpointGpuPair moves[MAX_MOVES];
    unsigned nmoves = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--driver") == 0 && i + 1 < argc) {
            driver = argv[++i];
        } else if (strcmp(a, "--pid") == 0 && i + 1 < argc) {
            pid = (int)parse_long(argv[++i], 1, 0x7fffffff, "--pid");
        } else if (strcmp(a, "--timeout-ms") == 0 && i + 1 < argc) {
            timeout_ms = (unsigned)parse_long(argv[++i], 0, 3600000, "--timeout-ms");
        } else if (strcmp(a, "--move") == 0 && i + 1 < argc) {
            const char *v = argv[++i], *eq = strchr(v, '=');
            char old[64];
            if (nmoves == MAX_MOVES || !eq || (size_t)(eq - v) >= sizeof(old))
                usage("--move takes OLD_UUID=NEW_UUID (at most 16 of them)");
            memcpy(old, v, (size_t)(eq - v));
            old[eq - v] = '\0';
            if (parse_uuid(old, &moves[nmoves].oldUuid) != 0 ||
                parse_uuid(eq + 1, &moves[nmoves].newUuid) != 0)
                usage("--move: a GPU UUID is GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx");
            nmoves++;
        } else if (a[0] != '-' && !action) {
            action = a;
        } else {
            usage("unknown option or missing value");
        }
    }
    if (!driver || !pid || !action)
        usage("--driver, --pid and an action are needed");
    bool detach = strcmp(action, "detach") == 0, attach = strcmp(action, "attach") == 0;
    if (!detach && !attach && strcmp(action, "state") != 0)
        usage("the action is detach, attach or state");
    if (nmoves && !attach)
        usage("--move is for attach");

    struct drv d;
    memset(&d, 0, sizeof(d));
    int rc = load(&d, driver);
    if (rc != EXIT_OK)
        return rc;
    /* The driver needs cuInit in the caller (restore: or persistence mode). */
    CUresult r = d.cuInit(0);
    if (r != CUDA_SUCCESS)
        return fail(EXIT_FAILED, "cuInit failed: %s", err_name(&d, r));
    CUprocessState st;
    r = d.getState(pid, &st);
    if (r != CUDA_SUCCESS)
        return fail(EXIT_FAILED, "process %d is not a CUDA process this driver can checkpoint (%s)",
                    pid, err_name(&d, r));
    double t0 = now_s(), t1 = t0, t2 = t0;
    if (detach) {
        CUcheckpointLockArgs la;
        memset(&la, 0, sizeof(la));
        la.timeoutMs = timeout_ms;
        r = d.lock(pid, &la);
        t1 = now_s();
        if (r == CUDA_ERROR_NOT_READY || r == CUDA_ERROR_TIMEOUT)
            return fail(EXIT_BUSY, "process %d still had work running after %u ms: not detached",
                        pid, timeout_ms);
        if (r != CUDA_SUCCESS)
            return fail(EXIT_FAILED, "locking process %d (%s) failed: %s", pid, state_name(st),
                        err_name(&d, r));
        r = d.checkpoint(pid, NULL);
        t2 = now_s();
        if (r != CUDA_SUCCESS) {
            /* Let it go on where it was, on its GPU. */
            CUresult u = d.unlock(pid, NULL);
            return fail(EXIT_FAILED, "checkpointing process %d failed: %s (unlocked again: %s)",
                        pid, err_name(&d, r), u == CUDA_SUCCESS ? "yes" : err_name(&d, u));
        }
    } else if (attach) {
        CUcheckpointRestoreArgs ra;
        memset(&ra, 0, sizeof(ra));
        ra.gpuPairs = nmoves ? moves : NULL;
        ra.gpuPairsCount = nmoves;
        r = d.restore(pid, &ra);
        t1 = now_s();
        if (r != CUDA_SUCCESS) {
            CUprocessState now = CU_PROCESS_STATE_FAILED;
            (void)d.getState(pid, &now);
            return fail(EXIT_FAILED, "restoring process %d failed: %s (it is %s)", pid,
                        err_name(&d, r), state_name(now));
        }
        r = d.unlock(pid, NULL);
        t2 = now_s();
        if (r != CUDA_SUCCESS)
            return fail(EXIT_FAILED, "unlocking process %d failed: %s", pid, err_name(&d, r));
    }
    if (d.getState(pid, &st) != CUDA_SUCCESS)
        st = CU_PROCESS_STATE_FAILED;
    printf("{\"ok\":true,\"action\":\"%s\",\"state\":\"%s\",\"first_s\":%.6f,\"second_s\":%.6f}\n",
           action, state_name(st), t1 - t0, t2 - t1);
    return EXIT_OK;
}
