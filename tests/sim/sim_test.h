/*
 * sim_test.h: a small test runner for the simulated device's C tests.
 *
 * Every test runs in its own forked child: the sim's cuInit happens once per process and reads
 * its configuration then, so a fresh process per test is what lets each test choose its own
 * configuration (setenv before cuInit). A failed check prints both values and exits the child;
 * a crash or a sanitizer report fails that test only, and the others still run.
 */
#ifndef GP_SIM_TEST_H
#define GP_SIM_TEST_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sim_api.h"

struct sim_test {
    const char *name;
    void (*fn)(void);
};

#define SIM_TEST_SKIP_CODE 77

/* Runs the tests named on the command line, or all of them; returns the process exit code. */
int sim_test_main(int argc, char **argv, const struct sim_test *tests, size_t ntests);

/* A test program's main over its tests, each SIM_T(name) for a function test_<name>:
 * SIM_TEST_MAIN(SIM_T(streams), SIM_T(events)) runs test_streams and test_events, or the ones
 * named on the command line. */
#define SIM_T(name)                                                                                \
    {                                                                                              \
#name, test_##name                                                                         \
    }
#define SIM_TEST_MAIN(...)                                                                         \
    int main(int argc, char **argv)                                                                \
    {                                                                                              \
        static const struct sim_test tests[] = {__VA_ARGS__};                                      \
        return sim_test_main(argc, argv, tests, sizeof(tests) / sizeof(tests[0]));                 \
    }

/* Ends the current test as skipped (e.g. a test input was not provided). */
void sim_test_skip(const char *why) __attribute__((noreturn));

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) {                                                                            \
            fprintf(stderr, "%s:%d: %s == %s failed: %lld (0x%llx) != %lld (0x%llx)\n", __FILE__,  \
                    __LINE__, #a, #b, a_, (unsigned long long)a_, b_, (unsigned long long)b_);     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_RC(call, want)                                                                       \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != (want)) {                                                                        \
            const char *n_ = NULL, *w_ = NULL;                                                     \
            if (cuGetErrorName(r_, &n_) != CUDA_SUCCESS)                                           \
                n_ = "?";                                                                          \
            if (cuGetErrorName((want), &w_) != CUDA_SUCCESS)                                       \
                w_ = "?";                                                                          \
            fprintf(stderr, "%s:%d: %s returned %d (%s), want %d (%s); detail: '%s'\n", __FILE__,  \
                    __LINE__, #call, (int)r_, n_, (int)(want), w_, gpupoolSimLastErrorDetail());   \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define OK(call) CHECK_RC(call, CUDA_SUCCESS)

/* cuInit, retain device 0's primary context and make it current. */
CUcontext sim_test_init(void);

/* Byte i of test pattern `seed`, and device memory filled with it (through cuMemcpyHtoD). */
unsigned char sim_test_pattern(unsigned seed, uint64_t i);
void sim_test_fill(CUdeviceptr p, uint64_t n, unsigned seed);

/* Writes text to a new temporary file and returns its path (static storage). */
const char *sim_test_write_temp(const char *text);

/* Reads a whole file; NULL when it cannot. The caller frees the result. */
unsigned char *sim_test_read_file(const char *path, size_t *len);

/* The test input file named by an environment variable, or skips the test. */
unsigned char *sim_test_input(const char *env, size_t *len);

/* Redirects stderr into a buffer between begin and end; end returns what was written (free it). */
void sim_test_stderr_begin(void);
char *sim_test_stderr_end(void);

/* Minimal PTX text: the sim accepts it as a module whose kernel names it cannot know. */
extern const char sim_test_ptx[];

#endif /* GP_SIM_TEST_H */
