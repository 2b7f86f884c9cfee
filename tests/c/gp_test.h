/*
 * gp_test.h: the few checks the C unit tests need. A failing check prints both values and
 * where it happened, then the test goes on, so one run shows every failure; gp_test_done()
 * turns the count into the exit status.
 */
#ifndef GP_TEST_H
#define GP_TEST_H

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int gp_test_failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

/* Integers (any width, signed or unsigned: compared as long long / printed in dec and hex). */
#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long gp_a_ = (long long)(a), gp_b_ = (long long)(b);                                  \
        if (gp_a_ != gp_b_) {                                                                      \
            fprintf(stderr, "%s:%d: CHECK_EQ(%s, %s) failed: %lld (0x%llx) != %lld (0x%llx)\n",    \
                    __FILE__, __LINE__, #a, #b, gp_a_, (unsigned long long)gp_a_, gp_b_,           \
                    (unsigned long long)gp_b_);                                                    \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

#define CHECK_PTR_EQ(a, b)                                                                         \
    do {                                                                                           \
        const void *gp_a_ = (const void *)(a), *gp_b_ = (const void *)(b);                         \
        if (gp_a_ != gp_b_) {                                                                      \
            fprintf(stderr, "%s:%d: CHECK_PTR_EQ(%s, %s) failed: %p != %p\n", __FILE__, __LINE__,  \
                    #a, #b, gp_a_, gp_b_);                                                         \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

#define CHECK_STR_EQ(a, b)                                                                         \
    do {                                                                                           \
        const char *gp_a_ = (a), *gp_b_ = (b);                                                     \
        if (gp_a_ == NULL || gp_b_ == NULL || strcmp(gp_a_, gp_b_) != 0) {                         \
            fprintf(stderr, "%s:%d: CHECK_STR_EQ(%s, %s) failed: \"%s\" != \"%s\"\n", __FILE__,    \
                    __LINE__, #a, #b, gp_a_ ? gp_a_ : "(null)", gp_b_ ? gp_b_ : "(null)");         \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

/* Byte buffers, shown as hex. */
#define CHECK_MEM_EQ(a, b, n)                                                                      \
    do {                                                                                           \
        const unsigned char *gp_a_ = (const unsigned char *)(a);                                   \
        const unsigned char *gp_b_ = (const unsigned char *)(b);                                   \
        size_t gp_n_ = (n);                                                                        \
        if (memcmp(gp_a_, gp_b_, gp_n_) != 0) {                                                    \
            fprintf(stderr, "%s:%d: CHECK_MEM_EQ(%s, %s, %zu) failed:\n  ", __FILE__, __LINE__,    \
                    #a, #b, gp_n_);                                                                \
            for (size_t gp_i_ = 0; gp_i_ < gp_n_; gp_i_++)                                         \
                fprintf(stderr, "%02x", gp_a_[gp_i_]);                                             \
            fprintf(stderr, "\n  ");                                                               \
            for (size_t gp_i_ = 0; gp_i_ < gp_n_; gp_i_++)                                         \
                fprintf(stderr, "%02x", gp_b_[gp_i_]);                                             \
            fprintf(stderr, "\n");                                                                 \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

/* Parse lower/upper-case hex into bytes; returns the byte count (for expected digests). */
static inline size_t gp_test_unhex(const char *hex, unsigned char *out, size_t max)
{
    size_t n = 0;
    for (; hex[0] && hex[1] && n < max; hex += 2) {
        unsigned v = 0;
        for (int k = 0; k < 2; k++) {
            char c = hex[k];
            v = v * 16 + (unsigned)(c >= '0' && c <= '9'   ? c - '0'
                                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                           : c - 'A' + 10);
        }
        out[n++] = (unsigned char)v;
    }
    return n;
}

static inline int gp_test_done(const char *name)
{
    if (gp_test_failures) {
        fprintf(stderr, "%s: %d check(s) FAILED\n", name, gp_test_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

/* Runs `call` with stderr redirected to a temporary file and returns what was written. */
static inline char *capture_stderr(void (*call)(void))
{
    static char buf[4096];
    buf[0] = '\0';
    FILE *tmp = tmpfile();
    CHECK(tmp != NULL);
    if (tmp == NULL)
        return buf;
    int saved = dup(2);
    CHECK(saved >= 0);
    CHECK(fflush(stderr) == 0);
    CHECK(dup2(fileno(tmp), 2) == 2);
    call();
    CHECK(fflush(stderr) == 0);
    CHECK(dup2(saved, 2) == 2);
    CHECK(close(saved) == 0);
    rewind(tmp);
    size_t n = fread(buf, 1, sizeof buf - 1, tmp);
    buf[n] = '\0';
    CHECK(fclose(tmp) == 0);
    return buf;
}

#endif /* GP_TEST_H */
