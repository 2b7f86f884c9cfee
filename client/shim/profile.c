/*
 * profile.c: GPUPOOL_PROFILE=FILE, the program's calls written to FILE when it exits: per
 * protocol op (call_counts.c's counters) and per CUDA entry point (entry_profile.c's): calls,
 * round trips (calls whose caller waited for the server's reply), bytes each way and the time
 * the program spent, the costliest lines first. A plain-text table, or JSON when FILE ends in
 * ".json"; "%p" in FILE stands for the process id (for programs that fork or run several
 * processes). docs/user-guide.md ("Where the time goes") explains the columns.
 *
 * A third table lists the calls of each slot of the export tables the shim serves as trampolines
 * (export_tables.c: tables it does not implement itself, the tools-module table's slot 7), and
 * a fourth the client's time per phase of its module loads (module_phases.h: hash, probe,
 * upload; the driver's load and JIT are module_load's worker ms).
 *
 * The worker's own time per op (worker ms) comes from the worker itself: conn.c calls
 * gp_profile_at_close() (its close hook) at exit before it says goodbye, which asks for it once
 * (op_times);
 * "-" when the program never connected or the worker could not answer.
 *
 * The file is written at exit (atexit, registered when the library loads) to FILE.tmp.PID and
 * renamed over FILE, so a reader never sees half a table. A process that sent nothing and called
 * no entry point writes nothing, nor does a child forked from the program (it holds a copy of its
 * parent's counters, and CUDA cannot be used after fork: a child that uses it execs, which loads
 * the library afresh): a compile worker does not overwrite the profile of the program.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "call_counts.h"
#include "entry_profile.h"
#include "export_tables.h"
#include "gp_log.h"
#include "module_phases.h"
#include "shim.h"
#include "shim_core.h"

#define GP_PROFILE_MAX_ENTRIES 2048 /* entry_profile.c's table size */

static char gp_profile_path[4096]; /* GPUPOOL_PROFILE as it was at load; "" = off */
static uint64_t gp_profile_t0_ns;
/* The worker's per-op calls and nanoseconds, from gp_profile_at_close; worker_known: they came. */
static uint64_t gp_profile_worker_calls[GP_COUNT_OPS], gp_profile_worker_ns[GP_COUNT_OPS];
static int gp_profile_worker_known;

CUresult __real_gp_request(uint8_t *frame, size_t frame_len, const void *bulk, uint64_t bulk_len,
                           void *bulk_dst, uint64_t bulk_cap, gp_reply *reply);

/* At exit, while the session is still open (conn.c's close hook, before its goodbye): asks the
 * worker once for its own time per op (op_times) for the table written afterwards. */
static void gp_profile_at_close(void)
{
    if (!gp_profile_path[0])
        return;
    gp_op_times m = {0};
    uint8_t f[16];
    size_t n = gp_op_times_frame(f, gp_conn_new_req(), &m);
    gp_reply rep = {0};
    /* Not through the counting wrapper: the profile's own question is not the program's call. */
    CUresult r = __real_gp_request(f, n, NULL, 0, NULL, 0, &rep);
    if (r != CUDA_SUCCESS) {
        gp_log_debug("GPUPOOL_PROFILE: the worker did not give its times (error %d); worker ms "
                     "stays '-'",
                     (int)r);
        return;
    }
    gp_op_times_reply wt;
    if (gp_op_times_reply_decode(rep.body, rep.len, &wt) == 0 && wt.calls_count == GP_COUNT_OPS &&
        wt.ns_count == GP_COUNT_OPS) {
        for (unsigned op = 0; op < GP_COUNT_OPS; op++) {
            gp_profile_worker_calls[op] = gp_rd_u64(wt.calls + 8 * op);
            gp_profile_worker_ns[op] = gp_rd_u64(wt.ns + 8 * op);
        }
        gp_profile_worker_known = 1;
    } else {
        gp_log_debug("GPUPOOL_PROFILE: the worker's times did not decode; worker ms stays '-'");
    }
    gp_reply_free(&rep);
}

/* One line of a table. */
typedef struct gp_profile_row {
    char name[96];
    uint64_t calls, frames, round_trips, detached, sent, received, client_ns, wait_ns;
    int op; /* the protocol op of an op line; -1 otherwise */
} gp_profile_row;

static uint64_t gp_profile_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Costliest first: client time, then calls, then the name (a stable order for equal rows). */
static int gp_profile_row_cmp(const void *a, const void *b)
{
    const gp_profile_row *x = a, *y = b;
    if (x->client_ns != y->client_ns)
        return x->client_ns > y->client_ns ? -1 : 1;
    if (x->calls != y->calls)
        return x->calls > y->calls ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The protocol ops sent at least once, into rows (cap GP_COUNT_OPS); how many. */
static size_t gp_profile_op_rows(gp_profile_row *rows)
{
    static uint64_t snap[GP_COUNT_OPS][GP_COUNT_FIELDS];
    gp_count_snapshot(snap);
    size_t n = 0;
    for (unsigned op = 0; op < GP_COUNT_OPS; op++) {
        const uint64_t *c = snap[op];
        if (c[GP_COUNT_FRAMES] == 0)
            continue;
        gp_profile_row *r = &rows[n++];
        memset(r, 0, sizeof *r);
        const char *name = gp_op_name(op);
        if (!name || strcmp(name, "?") == 0)
            snprintf(r->name, sizeof r->name, "op_%u", op);
        else
            snprintf(r->name, sizeof r->name, "%s", name);
        r->op = (int)op;
        r->calls = r->frames = c[GP_COUNT_FRAMES];
        r->round_trips = c[GP_COUNT_WAITED];
        r->detached = c[GP_COUNT_DETACHED];
        r->sent = c[GP_COUNT_SENT];
        r->received = c[GP_COUNT_RECEIVED];
        r->client_ns = r->wait_ns = c[GP_COUNT_CLIENT_NS];
    }
    qsort(rows, n, sizeof *rows, gp_profile_row_cmp);
    return n;
}

/* The entry points called, named (cap GP_PROFILE_MAX_ENTRIES + 1); how many. Functions that
 * have no exported name (helpers run outermost by the shim's own threads) are summed into one
 * row, "(shim_threads)". */
static size_t gp_profile_entry_rows(gp_profile_row *rows)
{
    static gp_entry_counts snap[GP_PROFILE_MAX_ENTRIES];
    size_t total = gp_entry_snapshot(snap, GP_PROFILE_MAX_ENTRIES);
    if (total > GP_PROFILE_MAX_ENTRIES)
        total = GP_PROFILE_MAX_ENTRIES;
    size_t n = 0;
    gp_profile_row other = {.name = "(shim_threads)", .op = -1};
    for (size_t i = 0; i < total; i++) {
        const uint64_t *v = snap[i].v;
        if (v[GP_ENTRY_CALLS] == 0 && v[GP_ENTRY_FRAMES] == 0)
            continue;
        Dl_info info;
        gp_profile_row *r = &other;
        if (dladdr((void *)snap[i].fn, &info) != 0 && info.dli_sname &&
            (uintptr_t)info.dli_saddr == snap[i].fn) {
            r = &rows[n++];
            memset(r, 0, sizeof *r);
            r->op = -1;
            snprintf(r->name, sizeof r->name, "%s", info.dli_sname);
        }
        r->calls += v[GP_ENTRY_CALLS];
        r->frames += v[GP_ENTRY_FRAMES];
        r->round_trips += v[GP_ENTRY_WAITED];
        r->sent += v[GP_ENTRY_SENT];
        r->received += v[GP_ENTRY_RECEIVED];
        r->client_ns += v[GP_ENTRY_NS];
        r->wait_ns += v[GP_ENTRY_WAIT_NS];
    }
    if (other.calls || other.frames)
        rows[n++] = other;
    qsort(rows, n, sizeof *rows, gp_profile_row_cmp);
    return n;
}

static double gp_ms(uint64_t ns)
{
    return (double)ns / 1e6;
}

static void gp_profile_sum(const gp_profile_row *rows, size_t n, gp_profile_row *sum)
{
    for (size_t i = 0; i < n; i++) {
        sum->calls += rows[i].calls;
        sum->frames += rows[i].frames;
        sum->round_trips += rows[i].round_trips;
        sum->detached += rows[i].detached;
        sum->sent += rows[i].sent;
        sum->received += rows[i].received;
        sum->client_ns += rows[i].client_ns;
        sum->wait_ns += rows[i].wait_ns;
    }
}

#define GP_PROFILE_MAX_SLOTS 1024

/* The export-table slots called, into out (cap GP_PROFILE_MAX_SLOTS); how many. */
static size_t gp_profile_slots(gp_et_slot_calls *out)
{
    size_t n = gp_export_table_slot_calls(out, GP_PROFILE_MAX_SLOTS);
    return n < GP_PROFILE_MAX_SLOTS ? n : GP_PROFILE_MAX_SLOTS;
}

/* A table's uuid as the driver's headers write it: 8-4-4-4-12 hex digits. */
static void gp_profile_uuid(const CUuuid *u, char out[37])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 37, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* The width of the name column: the longest name, at least that of the title. */
static int gp_profile_width(const gp_profile_row *rows, size_t n, const char *title)
{
    size_t w = strlen(title);
    for (size_t i = 0; i < n; i++)
        if (strlen(rows[i].name) > w)
            w = strlen(rows[i].name);
    return (int)w;
}

static void gp_profile_text(FILE *f, const gp_profile_row *ops, size_t nops,
                            const gp_profile_row *eps, size_t neps, double seconds)
{
    fprintf(f,
            "# gpupool profile of %s (pid %ld), %.3f s from load to exit\n"
            "# round trips: calls whose caller waited for the server's reply; client ms: time "
            "the program's threads spent (per op: in sending and waiting); worker ms: the "
            "worker's own time for them (the driver's and its decoding; for a call sent without "
            "waiting, queueing it; -: not known)\n\n",
            program_invocation_short_name, (long)getpid(), seconds);
    int w = gp_profile_width(ops, nops, "protocol op");
    fprintf(f, "%-*s  %10s  %11s  %9s  %14s  %14s  %12s  %10s\n", w, "protocol op", "calls",
            "round trips", "detached", "bytes sent", "bytes received", "client ms", "worker ms");
    gp_profile_row sum = {.name = "total", .op = -1};
    gp_profile_sum(ops, nops, &sum);
    uint64_t worker_total = 0;
    for (size_t i = 0; i <= nops; i++) {
        const gp_profile_row *r = i < nops ? &ops[i] : &sum;
        char worker[32] = "-";
        if (gp_profile_worker_known) {
            uint64_t ns = r->op >= 0 ? gp_profile_worker_ns[r->op] : worker_total;
            worker_total += r->op >= 0 ? ns : 0;
            snprintf(worker, sizeof worker, "%.3f", gp_ms(ns));
        }
        fprintf(f, "%-*s  %10llu  %11llu  %9llu  %14llu  %14llu  %12.3f  %10s\n", w, r->name,
                (unsigned long long)r->calls, (unsigned long long)r->round_trips,
                (unsigned long long)r->detached, (unsigned long long)r->sent,
                (unsigned long long)r->received, gp_ms(r->client_ns), worker);
    }
    w = gp_profile_width(eps, neps, "CUDA entry point");
    fprintf(f, "\n%-*s  %10s  %10s  %11s  %14s  %14s  %12s  %12s\n", w, "CUDA entry point", "calls",
            "frames", "round trips", "bytes sent", "bytes received", "client ms", "waiting ms");
    for (size_t i = 0; i < neps; i++) {
        const gp_profile_row *r = &eps[i];
        fprintf(f, "%-*s  %10llu  %10llu  %11llu  %14llu  %14llu  %12.3f  %12.3f\n", w, r->name,
                (unsigned long long)r->calls, (unsigned long long)r->frames,
                (unsigned long long)r->round_trips, (unsigned long long)r->sent,
                (unsigned long long)r->received, gp_ms(r->client_ns), gp_ms(r->wait_ns));
    }
    uint64_t lost = gp_entry_overflow();
    if (lost)
        fprintf(f, "# %llu calls of entry points beyond the table's size are not listed\n",
                (unsigned long long)lost);
    gp_module_phase ph[GP_MODPHASES];
    gp_module_phases_snapshot(ph);
    if (ph[GP_MODPHASE_HASH].count) {
        fprintf(f, "\n%-18s  %10s  %14s  %12s\n", "module load phase", "calls", "image bytes",
                "client ms");
        for (int i = 0; i < GP_MODPHASES; i++)
            fprintf(f, "%-18s  %10llu  %14llu  %12.3f\n", gp_module_phase_names[i],
                    (unsigned long long)ph[i].count, (unsigned long long)ph[i].bytes,
                    gp_ms(ph[i].ns));
    }
    static gp_et_slot_calls slots[GP_PROFILE_MAX_SLOTS];
    size_t nslots = gp_profile_slots(slots);
    if (nslots == 0)
        return;
    fprintf(f, "\n%-36s  %5s  %10s\n", "export table", "slot", "calls");
    for (size_t i = 0; i < nslots; i++) {
        char uuid[37];
        gp_profile_uuid(&slots[i].table, uuid);
        fprintf(f, "%-36s  %5u  %10llu\n", uuid, (unsigned)slots[i].slot,
                (unsigned long long)slots[i].calls);
    }
}

static void gp_profile_json(FILE *f, const gp_profile_row *ops, size_t nops,
                            const gp_profile_row *eps, size_t neps, double seconds)
{
    /* Op and symbol names are [A-Za-z0-9_] and "(shim_threads)": no JSON escaping needed. */
    fprintf(f, "{\"program\": \"%s\", \"pid\": %ld, \"seconds\": %.6f, \"ops\": {",
            program_invocation_short_name[0] && !strpbrk(program_invocation_short_name, "\"\\")
                ? program_invocation_short_name
                : "?",
            (long)getpid(), seconds);
    for (size_t i = 0; i < nops; i++) {
        const gp_profile_row *r = &ops[i];
        char wcalls[24] = "null", wns[24] = "null";
        if (gp_profile_worker_known && r->op >= 0) {
            snprintf(wcalls, sizeof wcalls, "%llu",
                     (unsigned long long)gp_profile_worker_calls[r->op]);
            snprintf(wns, sizeof wns, "%llu", (unsigned long long)gp_profile_worker_ns[r->op]);
        }
        fprintf(f,
                "%s\n  \"%s\": {\"calls\": %llu, \"round_trips\": %llu, \"detached\": %llu, "
                "\"sent\": %llu, \"received\": %llu, \"client_ns\": %llu, \"worker_calls\": %s, "
                "\"worker_ns\": %s}",
                i ? "," : "", r->name, (unsigned long long)r->calls,
                (unsigned long long)r->round_trips, (unsigned long long)r->detached,
                (unsigned long long)r->sent, (unsigned long long)r->received,
                (unsigned long long)r->client_ns, wcalls, wns);
    }
    fprintf(f, "},\n\"entry_points\": {");
    for (size_t i = 0; i < neps; i++) {
        const gp_profile_row *r = &eps[i];
        fprintf(f,
                "%s\n  \"%s\": {\"calls\": %llu, \"frames\": %llu, \"round_trips\": %llu, "
                "\"sent\": %llu, \"received\": %llu, \"client_ns\": %llu, \"wait_ns\": %llu}",
                i ? "," : "", r->name, (unsigned long long)r->calls, (unsigned long long)r->frames,
                (unsigned long long)r->round_trips, (unsigned long long)r->sent,
                (unsigned long long)r->received, (unsigned long long)r->client_ns,
                (unsigned long long)r->wait_ns);
    }
    gp_module_phase ph[GP_MODPHASES];
    gp_module_phases_snapshot(ph);
    static const char *const keys[GP_MODPHASES] = {"hash", "probe", "upload"};
    fprintf(f, "},\n\"module_load_phases\": {");
    for (int i = 0; i < GP_MODPHASES; i++)
        fprintf(f, "%s\n  \"%s\": {\"calls\": %llu, \"bytes\": %llu, \"client_ns\": %llu}",
                i ? "," : "", keys[i], (unsigned long long)ph[i].count,
                (unsigned long long)ph[i].bytes, (unsigned long long)ph[i].ns);
    fprintf(f, "},\n\"entry_points_not_listed\": %llu,\n\"export_table_slots\": [",
            (unsigned long long)gp_entry_overflow());
    static gp_et_slot_calls slots[GP_PROFILE_MAX_SLOTS];
    size_t nslots = gp_profile_slots(slots);
    for (size_t i = 0; i < nslots; i++) {
        char uuid[37];
        gp_profile_uuid(&slots[i].table, uuid);
        fprintf(f, "%s\n  {\"table\": \"%s\", \"slot\": %u, \"calls\": %llu}", i ? "," : "", uuid,
                (unsigned)slots[i].slot, (unsigned long long)slots[i].calls);
    }
    fprintf(f, "]}\n");
}

/* FILE with each "%p" replaced by the process id, into out (cap bytes). 0, or -1: too long. */
static int gp_profile_expand(const char *path, char *out, size_t cap)
{
    size_t n = 0;
    for (const char *p = path; *p; p++) {
        char pid[24];
        const char *add = pid;
        if (p[0] == '%' && p[1] == 'p') {
            snprintf(pid, sizeof pid, "%ld", (long)getpid());
            p++;
        } else {
            pid[0] = *p;
            pid[1] = '\0';
        }
        size_t k = strlen(add);
        if (n + k >= cap)
            return -1;
        memcpy(out + n, add, k);
        n += k;
    }
    out[n] = '\0';
    return 0;
}

static int gp_profile_ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static void gp_profile_write(void)
{
    if (!gp_profile_path[0])
        return;
    static gp_profile_row ops[GP_COUNT_OPS];
    static gp_profile_row eps[GP_PROFILE_MAX_ENTRIES + 1];
    double seconds = (double)(gp_profile_now_ns() - gp_profile_t0_ns) / 1e9;
    size_t nops = gp_profile_op_rows(ops);
    size_t neps = gp_profile_entry_rows(eps);
    if (nops == 0 && neps == 0)
        return; /* nothing to say (a forked helper, a program that never used CUDA) */
    char path[4096], tmp[4200];
    if (gp_profile_expand(gp_profile_path, path, sizeof path) != 0) {
        gp_log_error("GPUPOOL_PROFILE: the file name is too long once %%p is replaced; no "
                     "profile written");
        return;
    }
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        gp_log_error("GPUPOOL_PROFILE: cannot write %s (%s); no profile written: set it to a "
                     "file in a folder that exists and that you can write",
                     tmp, strerror(errno));
        return;
    }
    if (gp_profile_ends_with(path, ".json"))
        gp_profile_json(f, ops, nops, eps, neps, seconds);
    else
        gp_profile_text(f, ops, nops, eps, neps, seconds);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        gp_log_error("GPUPOOL_PROFILE: writing %s failed (%s); no profile written", tmp,
                     strerror(errno));
        if (unlink(tmp) != 0)
            gp_log_debug("GPUPOOL_PROFILE: cannot remove %s: %s", tmp, strerror(errno));
        return;
    }
    if (rename(tmp, path) != 0) {
        gp_log_error("GPUPOOL_PROFILE: cannot rename %s to %s (%s); the profile is left in %s", tmp,
                     path, strerror(errno), tmp);
        return;
    }
    gp_log_debug("GPUPOOL_PROFILE: profile written to %s", path);
}

/* In a forked child: no profile (the header comment says why). */
static void gp_profile_forked(void)
{
    gp_profile_path[0] = '\0';
}

__attribute__((constructor)) static void gp_profile_setup(void)
{
    const char *p = getenv("GPUPOOL_PROFILE");
    if (!p || !p[0])
        return;
    if (strlen(p) >= sizeof gp_profile_path) {
        gp_log_error("GPUPOOL_PROFILE is longer than %zu bytes; no profile will be written",
                     sizeof gp_profile_path - 1);
        return;
    }
    snprintf(gp_profile_path, sizeof gp_profile_path, "%s", p);
    gp_profile_t0_ns = gp_profile_now_ns();
    gp_conn_set_close_hook(gp_profile_at_close);
    if (atexit(gp_profile_write) != 0 || pthread_atfork(NULL, NULL, gp_profile_forked) != 0)
        gp_log_error("GPUPOOL_PROFILE: cannot register the exit handler; no profile will be "
                     "written");
}
