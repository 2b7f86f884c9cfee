/*
 * fuzz_worker: the worker's frame loop on the simulated device, after a valid hello: every
 * frame a tenant can send (decoders, handlers, bulk data, deferred errors, the driver calls they
 * make), as gpupool-worker runs them (worker/loop.c and the h_*.c handlers).
 *
 * Input: the client's byte stream after its hello. Each input is one whole session: the device
 * is opened, the hello (a fixed, valid one) answered, the input fed through a socket, the loop
 * run to the end of the stream, and everything released, so that inputs do not depend on one
 * another (and the leak checker sees what a session leaves behind). The simulated device is
 * small (256 MiB, GPUPOOL_SIM_CONFIG) and, in this build, its test kernel gp_test_spin spins at
 * most 1 ms (SIM_MAX_SPIN_NS), so that an input costs milliseconds.
 *
 * The simulated device library comes from $GPUPOOL_FUZZ_SIM, else beside this binary.
 */
#include <errno.h>
#include <ftw.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "worker.h"
#include "fuzz_feed.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char sim_path[PATH_MAX];
static char cache_dir[PATH_MAX];
static char scratch[PATH_MAX];

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    (void)remove(path);
    return 0;
}

static void remove_scratch(void)
{
    if (scratch[0])
        (void)nftw(scratch, remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    const char *sim = getenv("GPUPOOL_FUZZ_SIM");
    if (sim) {
        snprintf(sim_path, sizeof sim_path, "%s", sim);
    } else {
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0)
            abort();
        self[n] = '\0';
        snprintf(sim_path, sizeof sim_path, "%s/libgpupool-sim.so", dirname(self));
    }
    (void)argc;
    (void)argv;
    /* A small device and a private scratch area for the module cache. */
    char tmpl[] = "/tmp/gpupool-fuzz-worker-XXXXXX";
    if (!mkdtemp(tmpl))
        abort();
    snprintf(scratch, sizeof scratch, "%s", tmpl);
    if (atexit(remove_scratch) != 0)
        abort();
    snprintf(cache_dir, sizeof cache_dir, "%s/cache", tmpl);
    char conf[PATH_MAX];
    snprintf(conf, sizeof conf, "%s/sim.conf", tmpl);
    FILE *f = fopen(conf, "w");
    if (!f || fprintf(f, "total_memory = 256MiB\n") < 0 || fclose(f) != 0)
        abort();
    setenv("GPUPOOL_SIM_CONFIG", conf, 1);
    unsetenv("GPUPOOL_WORKER_STAGED_COPIES");
    if (signal(SIGPIPE, SIG_IGN) == SIG_ERR)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        abort();
    struct worker *w = calloc(1, sizeof *w);
    if (!w || wk_io_init(w, sv[1], -1) != 0)
        abort();
    w->ctl.fd = -1;
    w->ctl.listen_fd = -1;
    w->simulated = 1;
    struct wk_options o = {.fd = sv[1],
                           .control_fd = -1,
                           .driver = sim_path,
                           .ordinal = 0,
                           .cache_dir = cache_dir,
                           .session_id = 1,
                           .hello_req = 1,
                           .simulated = 1};
    gp_hello hello = {.magic = GP_PROTO_MAGIC,
                      .major = GP_PROTO_MAJOR,
                      .minor = GP_PROTO_MINOR,
                      .pid = 1,
                      .flags = GP_HELLO_KEEPALIVE,
                      .host = "fuzz",
                      .host_len = 4,
                      .user = "fuzz",
                      .user_len = 4,
                      .program = "fuzz",
                      .program_len = 4,
                      .va_base = 0x200000000000ull,
                      .va_size = 1ull << 30};
    struct fuzz_feed feed;
    fuzz_feed_start(&feed, sv[0], data, size); /* the client's side */
    if (wk_session_start(w, &o, &hello) == 0)
        wk_worker_loop(w);
    wk_session_end(w);
    if (shutdown(sv[1], SHUT_RDWR) != 0 && errno != ENOTCONN)
        abort();
    fuzz_feed_join(&feed);
    if (close(sv[0]) != 0 || close(sv[1]) != 0)
        abort();
    wk_io_free(w);
    wk_tls_free(w);
    free(w);
    return 0;
}
