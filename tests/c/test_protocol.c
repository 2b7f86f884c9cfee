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

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

static uint8_t golden[1 << 20], mine[1 << 20], again[1 << 20];

/* Append a little-endian integer / a protocol string to a hand-built body. */
static uint8_t *put(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        *p++ = (uint8_t)(v >> (8 * i));
    return p;
}
static uint8_t *put_str(uint8_t *p, const char *s)
{
    size_t n = strlen(s);
    p = put(p, n, 4);
    memcpy(p, s, n);
    return p + n;
}

/* The hello's layout, written out by hand as docs/protocol.md describes it, independently of the
 * generator: the daemon, the worker and clients of other versions depend on exactly these bytes
 * (the 8-byte prefix never moves; the requirements sit between the token and the VA window). */
static void check_hello_layout(void)
{
    uint8_t body[512], *p = body;
    p = put(p, GP_PROTO_MAGIC, 4);
    p = put(p, GP_PROTO_MAJOR, 2);
    p = put(p, GP_PROTO_MINOR, 2);
    p = put(p, 4242, 4); /* pid */
    p = put(p, 0, 4);    /* flags */
    p = put_str(p, "node7");
    p = put_str(p, "ada");
    p = put_str(p, "train.py --epochs 3");
    p = put_str(p, "gpt_abc");
    p = put_str(p, "GPU-8f3a");
    p = put_str(p, "A100");
    p = put(p, 40ull << 30, 8);       /* min_memory */
    p = put(p, 0x200000000000ull, 8); /* va_base */
    p = put(p, 1ull << 40, 8);        /* va_size */
    p = put(p, 500, 4);               /* connect_timeout_ms (protocol 1.5) */
    p = put(p, 4, 4);                 /* gpus (protocol 1.6) */
    p = put(p, 8ull << 30, 8);        /* memory (protocol 1.6) */
    p = put(p, 0xABCull, 8);          /* spread_group (protocol 1.8) */
    p = put(p, 1, 4);                 /* part (protocol 1.8) */
    p = put(p, 2, 4);                 /* parts (protocol 1.8) */
    size_t n = (size_t)(p - body);
    gp_hello h;
    if (gp_hello_decode(body, n, &h) != 0) {
        FAIL("hand-built hello does not decode");
        return;
    }
    if (h.magic != GP_PROTO_MAGIC || h.major != GP_PROTO_MAJOR || h.pid != 4242)
        FAIL("hello prefix decoded wrong");
    if (h.gpu_len != 8 || memcmp(h.gpu, "GPU-8f3a", 8) != 0)
        FAIL("hello gpu decoded wrong");
    if (h.model_len != 4 || memcmp(h.model, "A100", 4) != 0)
        FAIL("hello model decoded wrong");
    if (h.min_memory != 40ull << 30)
        FAIL("hello min_memory decoded wrong");
    if (h.va_base != 0x200000000000ull || h.va_size != 1ull << 40)
        FAIL("hello window wrong");
    if (h.connect_timeout_ms != 500)
        FAIL("hello connect_timeout_ms decoded wrong");
    if (h.gpus != 4 || h.memory != 8ull << 30)
        FAIL("hello gpus/memory decoded wrong");
    if (h.spread_group != 0xABC || h.part != 1 || h.parts != 2)
        FAIL("hello spread_group/part/parts decoded wrong");
    if (gp_hello_size(&h) != n)
        FAIL("gp_hello_size %zu, hand-built %zu", gp_hello_size(&h), n);
    if (gp_hello_encode(mine, &h) != n || memcmp(mine, body, n) != 0)
        FAIL("hello re-encodes differently from the hand-built bytes");
}

/* Informational notice codes are named like results but are never errors. */
static void check_codes(void)
{
    if (!gp_code_is_info(GP_INFO_QUEUED))
        FAIL("GP_INFO_QUEUED is not informational");
    if (gp_code_is_info(0) || gp_code_is_info(GP_EBUSY) || gp_code_is_info(700))
        FAIL("an error code counts as informational");
    const char *name = gp_result_name(GP_INFO_QUEUED);
    if (!name || strcmp(name, "GP_INFO_QUEUED") != 0)
        FAIL("no name for GP_INFO_QUEUED");
}

int main(int argc, char **argv)
{
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
        if (line[0] == '#')
            continue;
        char *sp = strchr(line, ' ');
        if (!sp)
            continue;
        *sp = 0;
        const char *hex = sp + 1;
        size_t n = 0;
        while (hexval(hex[0]) >= 0 && hexval(hex[1]) >= 0 && n < sizeof golden) {
            golden[n++] = (uint8_t)(hexval(hex[0]) << 4 | hexval(hex[1]));
            hex += 2;
        }
        const gp_sample_entry *e = NULL;
        for (int i = 0; i < GP_SAMPLE_COUNT; i++)
            if (strcmp(gp_samples[i].name, line) == 0)
                e = &gp_samples[i];
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
            if (d->dec(golden, cut) != GP_PROTO_EMALFORMED)
                FAIL("%s: truncated body of %zu bytes not refused as malformed", line, cut);
        golden[n] = 0;
        /* Trailing bytes: every field read, the extra told apart (a newer minor version's). */
        if (d->dec(golden, n + 1) != GP_PROTO_ETRAILING)
            FAIL("%s: body with a trailing byte not reported as GP_PROTO_ETRAILING", line);
        checked++;
    }
    free(line);
    fclose(f);
    check_hello_layout();
    check_codes();
    if (checked != GP_SAMPLE_COUNT)
        FAIL("checked %d samples, expected %d", checked, GP_SAMPLE_COUNT);
    printf("test_protocol: %d samples, %d failures\n", checked, failures);
    return failures ? 1 : 0;
}
