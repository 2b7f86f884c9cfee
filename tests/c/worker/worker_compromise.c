/*
 * worker_compromise.c: a worker a tenant has taken over, for tests/test_worker_sandbox.py.
 *
 * Linked only into build/tests/gpupool-worker-compromise (worker/worker.mk), never into the
 * shipped gpupool-worker: it defines wk_test_compromise, which prestart.c calls through a weak
 * reference once a session has started (after the client's first frame). It then does what code
 * run by a tenant's exploit would try, and logs one line per attempt ("compromise: ..."), which
 * gpupoold relays to its log:
 *
 *   open   every path of GPUPOOL_WORKER_TEST_SECRETS (':'-separated): the admin token, the
 *          database password file, the TLS key
 *   ptrace PTRACE_ATTACH to each sibling worker (the pids the test leaves in
 *          <cache_dir>/compromise-pids), and read its /proc/PID/mem and /proc/PID/environ, and
 *          gpupoold's /proc/PID/environ
 *   memory each needle of GPUPOOL_WORKER_TEST_NEEDLES (comma-separated hex, every byte XORed
 *          with 0xa5 so that the environment does not hold the needle itself: the TLS key's
 *          private numbers) searched for in the worker's own private writable memory
 *
 * and the controls that show the probes work: /proc/self/status opens, a file in --cache-dir is
 * written, and a marker put on the heap is found by the memory search.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <unistd.h>

#include "worker.h"

#define MAX_NEEDLES 16
#define MAX_SCAN ((size_t)1 << 30) /* larger mappings: the simulated GPU's reservations */

static void try_open(const char *what, const char *path, int flags)
{
    int fd = open(path, flags | O_CLOEXEC, 0600);
    if (fd < 0) {
        wk_log("compromise: open %s %s: refused (%s)", what, path, strerror(errno));
        return;
    }
    char c;
    ssize_t n = (flags & O_ACCMODE) == O_RDONLY ? read(fd, &c, 1) : write(fd, "x", 1);
    wk_log("compromise: open %s %s: OPENED (%s: %zd)", what, path,
           (flags & O_ACCMODE) == O_RDONLY ? "read" : "write", n);
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
}

/* The sibling workers: the test writes the pids of the daemon's workers to
 * <cache_dir>/compromise-pids before the session starts (a worker cannot list /proc any more);
 * ours is left out. */
static int siblings(const struct wk_options *o, pid_t *out, int cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/compromise-pids", o->cache_dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        wk_log("compromise: %s: %s", path, strerror(errno));
        return 0;
    }
    int n = 0, pid;
    while (n < cap && fscanf(f, "%d", &pid) == 1)
        if (pid != getpid())
            out[n++] = pid;
    if (fclose(f) != 0)
        wk_warn("fclose: %s", strerror(errno));
    return n;
}

static void try_sibling(pid_t pid)
{
    if (ptrace(PTRACE_ATTACH, pid, NULL, NULL) == 0) {
        wk_log("compromise: ptrace attach to sibling %d: ATTACHED", pid);
        int st;
        if (waitpid(pid, &st, __WALL) < 0 || ptrace(PTRACE_DETACH, pid, NULL, NULL) != 0)
            wk_warn("detaching from %d: %s", pid, strerror(errno));
    } else {
        wk_log("compromise: ptrace attach to sibling %d: refused (%s)", pid, strerror(errno));
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    try_open("sibling environ", path, O_RDONLY);
    snprintf(path, sizeof path, "/proc/%d/mem", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        wk_log("compromise: open sibling mem %s: refused (%s)", path, strerror(errno));
        return;
    }
    /* Its stack or heap: any mapped address will do; the program's own header is mapped. */
    char buf[8];
    ssize_t n = pread(fd, buf, sizeof buf, 0x400000);
    wk_log("compromise: open sibling mem %s: OPENED (read: %zd)", path, n);
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
}

struct needle {
    unsigned char *bytes;
    size_t len;
    int found;
};

static int parse_needles(const char *text, struct needle *nd, int cap)
{
    int n = 0;
    for (const char *p = text; p && *p && n < cap;) {
        size_t hex = strcspn(p, ",");
        if (hex >= 16 && hex % 2 == 0) {
            nd[n].len = hex / 2;
            nd[n].bytes = malloc(nd[n].len);
            if (!nd[n].bytes)
                break;
            for (size_t i = 0; i < nd[n].len; i++) {
                unsigned v = 0;
                if (sscanf(p + 2 * i, "%2x", &v) != 1)
                    v = 0;
                nd[n].bytes[i] = (unsigned char)(v ^ 0xa5u);
            }
            nd[n].found = 0;
            n++;
        }
        p += hex;
        if (*p == ',')
            p++;
    }
    return n;
}

/* Is [p, p + len) inside one of the needles' own buffers? */
static int own_buffer(const unsigned char *p, const struct needle *nd, int n)
{
    for (int i = 0; i < n; i++)
        if (p >= nd[i].bytes && p < nd[i].bytes + nd[i].len)
            return 1;
    return 0;
}

/* Counts each needle found anywhere in the private writable mappings. */
static void scan(struct needle *nd, int n)
{
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps) {
        wk_log("compromise: /proc/self/maps: %s", strerror(errno));
        return;
    }
    char line[512];
    while (fgets(line, sizeof line, maps)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3)
            continue;
        if (perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p' || hi - lo > MAX_SCAN)
            continue;
        const unsigned char *base = (const unsigned char *)lo;
        size_t size = hi - lo;
        for (int i = 0; i < n; i++) {
            const unsigned char *at = base;
            size_t left = size;
            while (left >= nd[i].len) {
                const unsigned char *hit = memmem(at, left, nd[i].bytes, nd[i].len);
                if (!hit)
                    break;
                if (!own_buffer(hit, nd, n)) {
                    nd[i].found++;
                    break;
                }
                left -= (size_t)(hit + 1 - at);
                at = hit + 1;
            }
        }
    }
    if (fclose(maps) != 0)
        wk_warn("fclose: %s", strerror(errno));
}

void wk_test_compromise(struct worker *w, const struct wk_options *o)
{
    wk_log("compromise: session started; tls key held: %s; dumpable: %d", w->tls_key ? "YES" : "no",
           prctl(PR_GET_DUMPABLE, 0, 0, 0, 0));
    const char *secrets = getenv("GPUPOOL_WORKER_TEST_SECRETS");
    char list[4096];
    snprintf(list, sizeof list, "%s", secrets ? secrets : "");
    for (char *save = NULL, *p = strtok_r(list, ":", &save); p; p = strtok_r(NULL, ":", &save))
        try_open("secret", p, O_RDONLY);
    try_open("control", "/proc/self/status", O_RDONLY);
    char mine[4096];
    snprintf(mine, sizeof mine, "%s/compromise-%d", o->cache_dir, (int)getpid());
    try_open("control", mine, O_WRONLY | O_CREAT | O_TRUNC);
    if (unlink(mine) != 0)
        wk_warn("unlink %s: %s", mine, strerror(errno));

    pid_t sib[16];
    int ns = siblings(o, sib, 16);
    wk_log("compromise: %d sibling worker(s)", ns);
    for (int i = 0; i < ns; i++)
        try_sibling(sib[i]);
    /* gpupoold itself: its environment holds PGPASSWORD. */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", (int)getppid());
    try_open("daemon environ", path, O_RDONLY);

    struct needle nd[MAX_NEEDLES + 1];
    int n = parse_needles(getenv("GPUPOOL_WORKER_TEST_NEEDLES"), nd, MAX_NEEDLES);
    /* The control: 32 bytes of our own, copied to the heap, must be found. */
    unsigned char *marker = malloc(32);
    nd[n].len = 32;
    nd[n].bytes = malloc(32);
    if (!marker || !nd[n].bytes) {
        wk_warn("compromise: out of memory");
        free(marker);
        free(nd[n].bytes);
        for (int i = 0; i < n; i++)
            free(nd[i].bytes);
        return;
    }
    for (int i = 0; i < 32; i++)
        nd[n].bytes[i] = (unsigned char)(0x5a ^ (i * 37) ^ (getpid() & 0xff));
    memcpy(marker, nd[n].bytes, 32);
    __asm__ volatile("" : : "r"(marker) : "memory"); /* the copy must really be made */
    nd[n].found = 0;
    scan(nd, n + 1);
    for (int i = 0; i < n; i++)
        wk_log("compromise: key needle %d (%zu bytes) in memory: %s", i, nd[i].len,
               nd[i].found ? "FOUND" : "not found");
    wk_log("compromise: control marker in memory: %s", nd[n].found ? "found" : "NOT FOUND");
    memset(marker, 0, 32);
    free(marker);
    for (int i = 0; i <= n; i++)
        free(nd[i].bytes);
    wk_log("compromise: done");
}
