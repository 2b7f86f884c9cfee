/*
 * Protocol golden test: every generated C encoder must reproduce, byte for byte, the sample
 * bodies that the Python side encoded (protocol/golden/samples.hex); every decoder must accept
 * exactly those bytes and reject every truncation and every extension of them.
 * Usage: test_protocol PATH/TO/samples.hex
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_protocol.h"

static int failures;

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                       \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        failures++;                                                                                \
    } while (0)

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static uint8_t golden[1 << 20], mine[1 << 20], again[1 << 20];

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s samples.hex\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (!f) {
        perror(argv[1]);
        return 2;
    }
    char *line = NULL;
    size_t cap = 0;
    int checked = 0;
    while (getline(&line, &cap, f) > 0) {
        if (line[0] == '#') continue;
        char *sp = strchr(line, ' ');
        if (!sp) continue;
        *sp = 0;
        const char *hex = sp + 1;
        size_t n = 0;
        while (hexval(hex[0]) >= 0 && hexval(hex[1]) >= 0 && n < sizeof golden) {
            golden[n++] = (uint8_t)(hexval(hex[0]) << 4 | hexval(hex[1]));
            hex += 2;
        }
        const gp_sample_entry *e = NULL;
        for (int i = 0; i < GP_SAMPLE_COUNT; i++)
            if (strcmp(gp_samples[i].name, line) == 0) e = &gp_samples[i];
        if (!e) {
            FAIL("golden entry %s has no C sample", line);
            continue;
        }
        size_t m = e->enc(mine, sizeof mine);
        if (m != n || memcmp(mine, golden, n) != 0) {
            FAIL("%s: C encoding (%zu bytes) differs from Python's (%zu bytes)", line, m, n);
            continue;
        }
        const gp_sample_entry *d = e;
        size_t n2 = 0;
        if (d->rt(golden, n, again, &n2) != 0 || n2 != n || memcmp(again, golden, n) != 0)
            FAIL("%s: decode+encode does not round-trip", line);
        for (size_t cut = 0; cut < n; cut++)
            if (d->dec(golden, cut) == 0) FAIL("%s: truncated body of %zu bytes accepted", line, cut);
        golden[n] = 0;
        if (d->dec(golden, n + 1) == 0) FAIL("%s: body with a trailing byte accepted", line);
        checked++;
    }
    free(line);
    fclose(f);
    if (checked != GP_SAMPLE_COUNT) FAIL("checked %d samples, expected %d", checked, GP_SAMPLE_COUNT);
    printf("test_protocol: %d samples, %d failures\n", checked, failures);
    return failures ? 1 : 0;
}
