/*
 * sim_test.c: the runner and helpers declared in sim_test.h.
 */
#include "sim_test.h"

#include <errno.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define TEST_TIMEOUT_S 120

const char sim_test_ptx[] = ".version 9.0\n"
                            ".target sm_90\n"
                            ".address_size 64\n"
                            ".visible .entry gp_test_noop()\n{\n\tret;\n}\n";

void sim_test_skip(const char *why)
{
    fprintf(stderr, "skipped: %s\n", why);
    exit(SIM_TEST_SKIP_CODE);
}

/* The configuration a test sees is only what it sets itself. */
static void clear_sim_env(void)
{
    for (;;) {
        char **e = environ;
        while (e && *e && strncmp(*e, "GPUPOOL_SIM_", 12) != 0)
            e++;
        if (!e || !*e)
            return;
        char name[256];
        size_t n = strcspn(*e, "=");
        if (n >= sizeof(name))
            n = sizeof(name) - 1;
        memcpy(name, *e, n);
        name[n] = '\0';
        if (unsetenv(name) != 0)
            return;
    }
}

static int run_one(const struct sim_test *t)
{
    if (fflush(NULL) != 0)
        perror("fflush");
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        clear_sim_env();
        alarm(TEST_TIMEOUT_S);
        t->fn();
        exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            perror("waitpid");
            return 1;
        }
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        printf("PASS %s\n", t->name);
        return 0;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == SIM_TEST_SKIP_CODE) {
        printf("SKIP %s\n", t->name);
        return 0;
    }
    if (WIFSIGNALED(status))
        printf("FAIL %s (signal %d)\n", t->name, WTERMSIG(status));
    else
        printf("FAIL %s (exit %d)\n", t->name, WEXITSTATUS(status));
    return 1;
}

int sim_test_main(int argc, char **argv, const struct sim_test *tests, size_t ntests)
{
    int failed = 0, ran = 0;
    for (size_t i = 0; i < ntests; i++) {
        bool wanted = argc <= 1;
        for (int a = 1; a < argc && !wanted; a++)
            wanted = strcmp(argv[a], tests[i].name) == 0;
        if (!wanted)
            continue;
        ran++;
        failed += run_one(&tests[i]);
    }
    printf("%d of %d tests failed\n", failed, ran);
    if (fflush(stdout) != 0)
        return 1;
    return failed == 0 && ran > 0 ? 0 : 1;
}

CUcontext sim_test_init(void)
{
    CUcontext ctx = NULL;
    OK(cuInit(0));
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    return ctx;
}

unsigned char sim_test_pattern(unsigned seed, uint64_t i)
{
    return (unsigned char)(i * 131 + seed * 17 + 1);
}

void sim_test_fill(CUdeviceptr p, uint64_t n, unsigned seed)
{
    unsigned char *b = malloc(n);
    CHECK(b != NULL);
    for (uint64_t i = 0; i < n; i++)
        b[i] = sim_test_pattern(seed, i);
    OK(cuMemcpyHtoD_v2(p, b, n));
    free(b);
}

const char *sim_test_write_temp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof(path), "/tmp/gp_sim_test_XXXXXX");
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    size_t n = strlen(text);
    CHECK(write(fd, text, n) == (ssize_t)n);
    CHECK(close(fd) == 0);
    return path;
}

unsigned char *sim_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    unsigned char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : 65536;
            unsigned char *nb = realloc(buf, cap);
            CHECK(nb != NULL);
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    CHECK(!ferror(f));
    CHECK(fclose(f) == 0);
    *len = n;
    return buf;
}

unsigned char *sim_test_input(const char *env, size_t *len)
{
    const char *path = getenv(env);
    if (!path || !*path) {
        char why[128];
        snprintf(why, sizeof(why), "%s not set (tests/test_sim_device.py sets it)", env);
        sim_test_skip(why);
    }
    unsigned char *b = sim_test_read_file(path, len);
    if (!b) {
        fprintf(stderr, "cannot read %s=%s\n", env, path);
        exit(1);
    }
    return b;
}

static int saved_stderr = -1;
static FILE *captured;

void sim_test_stderr_begin(void)
{
    CHECK(fflush(stderr) == 0);
    captured = tmpfile();
    CHECK(captured != NULL);
    saved_stderr = dup(2);
    CHECK(saved_stderr >= 0);
    CHECK(dup2(fileno(captured), 2) == 2);
}

char *sim_test_stderr_end(void)
{
    CHECK(fflush(stderr) == 0);
    CHECK(dup2(saved_stderr, 2) == 2);
    CHECK(close(saved_stderr) == 0);
    CHECK(fseek(captured, 0, SEEK_END) == 0);
    long n = ftell(captured);
    CHECK(n >= 0);
    rewind(captured);
    char *s = calloc(1, (size_t)n + 1);
    CHECK(s != NULL);
    CHECK(fread(s, 1, (size_t)n, captured) == (size_t)n);
    CHECK(fclose(captured) == 0);
    fputs(s, stderr); /* still visible in the test log */
    return s;
}
