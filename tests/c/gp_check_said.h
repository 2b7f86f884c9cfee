/*
 * gp_check_said.h: CHECK(cond, fmt, ...) for the C unit tests that say why a check failed in
 * their own words (gp_test.h's checks print the two values instead). Counts checks and
 * failures in this file's `checks` and `failures`; the test's main prints and returns them.
 */
#ifndef GP_CHECK_SAID_H
#define GP_CHECK_SAID_H

#include <stdio.h>

static int failures, checks;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        checks++;                                                                                  \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#endif
