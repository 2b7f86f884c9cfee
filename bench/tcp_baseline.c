/*
 * tcp_baseline.c: the raw figures of a TCP link, for the remoting benchmark to compare against.
 *
 *     tcp_baseline [--host 127.0.0.1] [--reps 3] [--quick] [--server-netns NAME] [--streams N]
 *
 * Forks a server process (as gpupoold's worker is a separate process) and, over loopback with
 * TCP_NODELAY on both ends (or, with --server-netns, from this network namespace to a server in
 * the named one, `ip netns` style under /var/run/netns: a link between two namespaces, such as
 * bench/link_bench.py's shaped veth pair; --host is then the server's address there), measures:
 *   rtt         16-byte request, 16-byte answer, N round trips (mean and median in microseconds,
 *               of the best of at least 5 runs);
 *   msgs        16-byte one-way messages, then one answer (messages per second);
 *   bulk        a 256 MiB buffer sent in 1 MiB writes, 1 GiB in all, then a 1-byte answer
 *               (bytes per second): the raw bulk figure; with the CPU seconds per GiB moved of
 *               the sender (this process) and the receiver (the server process), all runs;
 *   stream S    S-byte writes (S = 4 KiB, 1 MiB), then a 1-byte answer (bytes per second);
 *   reqresp S   16-byte request, S-byte answer, repeated (bytes per second): the shape of a
 *               synchronous device-to-host copy;
 *   parallel    with --streams N (N > 1): the bulk stream split over N connections sending at
 *               once from N threads (bytes per second, all together): whether striping a copy
 *               over several connections could fill more of a link than one connection does.
 * The server serves each connection on a thread of its own.
 * Each other figure is the median of --reps runs. Prints one JSON object on stdout.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
    MODE_RTT = 1,
    MODE_MSGS = 2,
    MODE_STREAM = 3,
    MODE_REQRESP = 4,
    MODE_QUIT = 9
};

struct cmd {
    uint32_t mode;
    uint32_t pad;
    uint64_t size;  /* message size */
    uint64_t count; /* number of messages */
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "tcp_baseline: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            die("send");
        }
        p += w;
        n -= (size_t)w;
    }
}

static int read_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r == 0)
            return -1;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("recv");
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Discards n bytes, reading through buf (at most cap bytes per read). */
static void drain(int fd, char *buf, size_t cap, uint64_t n)
{
    while (n > 0) {
        size_t want = n < cap ? (size_t)n : cap;
        ssize_t r = recv(fd, buf, want, 0);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            die("recv (drain)");
        }
        n -= (uint64_t)r;
    }
}

static void nodelay(int fd)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0)
        die("TCP_NODELAY");
}

#define BUF_CAP (1u << 20)

static pthread_mutex_t answer_lock = PTHREAD_MUTEX_INITIALIZER;
static char *answer; /* MODE_REQRESP's answers; guarded by answer_lock */
static size_t answer_cap;

/* One connection: its command, then the exchange it names. */
static void *serve_one(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char *buf = malloc(BUF_CAP);
    if (!buf)
        die("malloc");
    nodelay(fd);
    struct cmd c;
    if (read_all(fd, &c, sizeof c) == 0) {
        char msg[16] = {0};
        switch (c.mode) {
        case MODE_RTT:
            for (uint64_t i = 0; i < c.count; i++) {
                if (read_all(fd, msg, 16) < 0)
                    break;
                write_all(fd, msg, 16);
            }
            break;
        case MODE_MSGS:
        case MODE_STREAM:
            drain(fd, buf, BUF_CAP, c.count * c.size);
            write_all(fd, msg, 1);
            break;
        case MODE_REQRESP:
            /* The answer buffer is kept from one connection to the next (filling 256 MiB
             * would be timed by the client); its lock serialises these exchanges. */
            pthread_mutex_lock(&answer_lock);
            if (answer_cap < c.size) {
                free(answer);
                answer = malloc(c.size);
                if (!answer)
                    die("malloc");
                memset(answer, 0x5a, c.size);
                answer_cap = c.size;
            }
            for (uint64_t i = 0; i < c.count; i++) {
                if (read_all(fd, msg, 16) < 0)
                    break;
                write_all(fd, answer, c.size);
            }
            pthread_mutex_unlock(&answer_lock);
            break;
        case MODE_QUIT:
            close(fd);
            exit(0);
        }
    }
    close(fd);
    free(buf);
    return NULL;
}

static void serve(int lfd)
{
    for (;;) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            die("accept");
        }
        pthread_t t;
        int e = pthread_create(&t, NULL, serve_one, (void *)(intptr_t)fd);
        if (e != 0 || (e = pthread_detach(t)) != 0) {
            errno = e;
            die("pthread_create");
        }
    }
}

static struct sockaddr_in server_addr;

static pid_t server_pid;
/* CPU seconds of the sender (this process) and the receiver (the server) in the timed parts of
 * every run_span so far: buffer set-up and connecting are not counted. */
static double sender_cpu, receiver_cpu;

/* CPU seconds consumed so far by process pid (0: this one), from its CPU-time clock. */
static double cpu_seconds(pid_t pid)
{
    clockid_t clk = CLOCK_PROCESS_CPUTIME_ID;
    if (pid && clock_getcpuclockid(pid, &clk) != 0)
        die("clock_getcpuclockid");
    struct timespec ts;
    if (clock_gettime(clk, &ts) != 0)
        die("clock_gettime (CPU time)");
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int connect_server(const struct cmd *c)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket");
    if (connect(fd, (struct sockaddr *)&server_addr, sizeof server_addr) < 0)
        die("connect");
    nodelay(fd);
    write_all(fd, c, sizeof *c);
    return fd;
}

/* Returns seconds for the whole run; for MODE_RTT fills lat[] with each round trip. Stream
 * writes walk through a source buffer of `span` bytes (at least `size`), `size` at a time. */
static double run_span(uint32_t mode, uint64_t size, uint64_t count, double *lat, uint64_t span)
{
    struct cmd c = {mode, 0, size, count};
    int fd = connect_server(&c);
    char msg[16] = {1};
    if (span < size)
        span = size;
    if (span < BUF_CAP)
        span = BUF_CAP;
    char *buf = malloc(span);
    memset(buf, 0x33, span);
    uint64_t pos = 0;
    double send0 = cpu_seconds(0), recv0 = cpu_seconds(server_pid);
    double t0 = now();
    switch (mode) {
    case MODE_RTT:
        for (uint64_t i = 0; i < count; i++) {
            double a = now();
            write_all(fd, msg, 16);
            if (read_all(fd, msg, 16) < 0)
                die("short rtt");
            if (lat)
                lat[i] = now() - a;
        }
        break;
    case MODE_MSGS:
    case MODE_STREAM:
        for (uint64_t i = 0; i < count; i++) {
            if (pos + size > span)
                pos = 0;
            write_all(fd, buf + pos, size);
            pos += size;
        }
        if (read_all(fd, msg, 1) < 0)
            die("no stream answer");
        break;
    case MODE_REQRESP:
        for (uint64_t i = 0; i < count; i++) {
            write_all(fd, msg, 16);
            if (read_all(fd, buf, size) < 0)
                die("short answer");
        }
        break;
    }
    double t = now() - t0;
    sender_cpu += cpu_seconds(0) - send0;
    receiver_cpu += cpu_seconds(server_pid) - recv0;
    close(fd);
    free(buf);
    return t;
}

static double run(uint32_t mode, uint64_t size, uint64_t count, double *lat)
{
    return run_span(mode, size, count, lat, size);
}

/* --streams: one sender of the parallel bulk figure. */
struct sender {
    pthread_t thread;
    uint64_t bytes;
    pthread_barrier_t *start;
};

static void *send_stream(void *arg)
{
    struct sender *sd = arg;
    const uint64_t span = 64u << 20;
    struct cmd c = {MODE_STREAM, 0, 1u << 20, sd->bytes >> 20};
    int fd = connect_server(&c);
    char *buf = malloc(span);
    if (!buf)
        die("malloc");
    memset(buf, 0x33, span);
    pthread_barrier_wait(sd->start);
    for (uint64_t i = 0, pos = 0; i < c.count; i++, pos = (pos + c.size) % span)
        write_all(fd, buf + pos, c.size);
    char msg[1];
    if (read_all(fd, msg, 1) < 0)
        die("no stream answer");
    close(fd);
    free(buf);
    return NULL;
}

/* Bytes per second of `total` bytes sent over n connections at once. */
static double run_parallel(int n, uint64_t total)
{
    struct sender sd[16];
    pthread_barrier_t start;
    if (pthread_barrier_init(&start, NULL, (unsigned)n + 1) != 0)
        die("pthread_barrier_init");
    for (int i = 0; i < n; i++) {
        sd[i].bytes = total / (uint64_t)n;
        sd[i].start = &start;
        int e = pthread_create(&sd[i].thread, NULL, send_stream, &sd[i]);
        if (e != 0) {
            errno = e;
            die("pthread_create");
        }
    }
    pthread_barrier_wait(&start);
    double t0 = now();
    for (int i = 0; i < n; i++)
        pthread_join(sd[i].thread, NULL);
    double t = now() - t0;
    pthread_barrier_destroy(&start);
    return (double)(total / (uint64_t)n * (uint64_t)n) / t;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The JSON members "size": bytes per second of `mode` for the first n of 4 KiB, 1 MiB and
 * 256 MiB messages (64 MiB, 512 MiB and 1 GiB in all; a quarter with --quick), median of reps. */
static void sized_rates(uint32_t mode, int n, int reps, int quick)
{
    const uint64_t sizes[] = {4096, 1u << 20, 256u << 20};
    const uint64_t totals[] = {64u << 20, 512u << 20, 1024u << 20};
    for (int k = 0; k < n; k++) {
        uint64_t s = sizes[k], total = quick ? totals[k] / 4 : totals[k];
        if (total < s)
            total = s;
        uint64_t count = total / s;
        double v[50];
        for (int r = 0; r < reps; r++)
            v[r] = (double)(count * s) / run(mode, s, count, NULL);
        printf("%s\"%llu\": %.0f", k ? ", " : "", (unsigned long long)s, median(v, reps));
    }
}

/* A listening socket on host (port 0: any), bound in this process's network namespace. */
static int listener(const char *host)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    if (lfd < 0)
        die("socket");
    int one = 1;
    if (setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        die("setsockopt");
    memset(&server_addr, 0, sizeof server_addr);
    server_addr.sin_family = AF_INET;
    if (inet_pton(AF_INET, host, &server_addr.sin_addr) != 1) {
        fprintf(stderr, "tcp_baseline: bad address %s\n", host);
        exit(2);
    }
    if (bind(lfd, (struct sockaddr *)&server_addr, sizeof server_addr) < 0)
        die("bind");
    socklen_t alen = sizeof server_addr;
    if (getsockname(lfd, (struct sockaddr *)&server_addr, &alen) < 0)
        die("getsockname");
    if (listen(lfd, 16) < 0)
        die("listen");
    return lfd;
}

/* The server in network namespace `ns`: a child that enters it, listens on host and tells the
 * parent its port through a pipe. Returns the child's pid; server_addr is set for connecting. */
static pid_t serve_in_netns(const char *ns, const char *host)
{
    int p[2];
    if (pipe(p) < 0)
        die("pipe");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        char path[512];
        snprintf(path, sizeof path, "/var/run/netns/%s", ns);
        int nsfd = open(path, O_RDONLY | O_CLOEXEC);
        if (nsfd < 0 || setns(nsfd, CLONE_NEWNET) < 0)
            die("entering the server's network namespace");
        close(nsfd);
        int lfd = listener(host);
        if (write(p[1], &server_addr.sin_port, sizeof server_addr.sin_port) !=
            (ssize_t)sizeof server_addr.sin_port)
            die("write");
        close(p[1]);
        serve(lfd);
    }
    close(p[1]);
    in_port_t port;
    if (read(p[0], &port, sizeof port) != (ssize_t)sizeof port) {
        fprintf(stderr, "tcp_baseline: the server in namespace %s did not start\n", ns);
        exit(1);
    }
    close(p[0]);
    memset(&server_addr, 0, sizeof server_addr);
    server_addr.sin_family = AF_INET;
    server_addr.sin_port = port;
    if (inet_pton(AF_INET, host, &server_addr.sin_addr) != 1)
        exit(2);
    return pid;
}

int main(int argc, char **argv)
{
    const char *host = "127.0.0.1", *server_ns = NULL;
    int reps = 3, quick = 0, streams = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--host") && i + 1 < argc)
            host = argv[++i];
        else if (!strcmp(argv[i], "--server-netns") && i + 1 < argc)
            server_ns = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--streams") && i + 1 < argc)
            streams = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--host ADDR] [--reps N] [--quick] [--server-netns NAME] "
                    "[--streams N]\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1 || reps > 40)
        reps = 3;
    if (streams < 1 || streams > 16) {
        fprintf(stderr, "tcp_baseline: --streams takes 1 to 16\n");
        return 2;
    }

    pid_t pid;
    if (server_ns) {
        pid = serve_in_netns(server_ns, host);
    } else {
        int lfd = listener(host);
        pid = fork();
        if (pid < 0)
            die("fork");
        if (pid == 0)
            serve(lfd);
        close(lfd);
    }

    server_pid = pid;
    const uint64_t rtt_n = quick ? 2000 : 10000;
    const int rtt_reps = reps < 5 ? 5 : reps;
    double *lat = malloc(rtt_n * sizeof(double));
    double r_mean[50], r_p50[50], r_msgs[50];
    run(MODE_RTT, 16, rtt_n / 10, NULL); /* warm up */
    for (int r = 0; r < rtt_reps; r++) {
        double t = run(MODE_RTT, 16, rtt_n, lat);
        r_mean[r] = t / (double)rtt_n * 1e6;
        r_p50[r] = median(lat, (int)rtt_n) * 1e6;
    }
    const uint64_t msgs_n = quick ? 100000 : 1000000;
    for (int r = 0; r < reps; r++)
        r_msgs[r] = (double)msgs_n / run(MODE_MSGS, 16, msgs_n, NULL);

    /* Round trips: the best run (lowest median). On a virtual machine the round trip is
     * bimodal (both ends on one vCPU, or a wake-up of an idle vCPU each way), and the shim's
     * figure is taken the same way, so the two are compared like for like. */
    double best_mean = r_mean[0], best_p50 = r_p50[0];
    for (int r = 1; r < rtt_reps; r++) {
        if (r_p50[r] < best_p50)
            best_p50 = r_p50[r];
        if (r_mean[r] < best_mean)
            best_mean = r_mean[r];
    }
    printf("{\"rtt_us_mean\": %.3f, \"rtt_us_p50\": %.3f, \"msgs_per_s_16B\": %.0f", best_mean,
           best_p50, median(r_msgs, reps));

    /* bulk: a 256 MiB buffer sent in 1 MiB writes, 1 GiB in all */
    {
        uint64_t total = quick ? (256u << 20) : (1024u << 20), count = total >> 20;
        double v[50];
        sender_cpu = receiver_cpu = 0;
        for (int r = 0; r < reps; r++)
            v[r] = (double)total / run_span(MODE_STREAM, 1u << 20, count, NULL, 256u << 20);
        double gib = (double)total * reps / (double)(1u << 30);
        printf(", \"bulk_Bps\": %.0f, \"bulk_send_cpu_s_per_gib\": %.4f, "
               "\"bulk_recv_cpu_s_per_gib\": %.4f",
               median(v, reps), sender_cpu / gib, receiver_cpu / gib);
        if (streams > 1) {
            for (int r = 0; r < reps; r++)
                v[r] = run_parallel(streams, total);
            printf(", \"bulk_streams\": %d, \"bulk_parallel_Bps\": %.0f", streams, median(v, reps));
        }
    }

    printf(", \"stream_Bps\": {");
    sized_rates(MODE_STREAM, 2, reps, quick); /* 4 KiB and 1 MiB writes */
    printf("}, \"reqresp_Bps\": {");
    sized_rates(MODE_REQRESP, 3, reps, quick); /* 4 KiB, 1 MiB and 256 MiB answers */
    printf("}}\n");
    fflush(stdout);

    struct cmd q = {MODE_QUIT, 0, 0, 0};
    close(connect_server(&q));
    waitpid(pid, NULL, 0);
    free(lat);
    return 0;
}
