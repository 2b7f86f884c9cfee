/*
 * test_connect_parts: the checks of a spread lease's parts (client/shim/connect_parts.c, issue 37,
 * item 3) where the end-to-end test cannot reach them: over TLS (tests/tools/mini_server.py
 * speaks plain TCP), a part's pin against the client's own pin for that address, and the window
 * slices at their edges. The end-to-end path (the hellos, the refusals on stderr) is
 * tests/test_shim_spread_connect.py's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "connect_internal.h"
#include "gp_test.h"

#define PIN_A "SHA256:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
#define PIN_B "SHA256:BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBA"
#define MIB2 (2ull << 20)

static gp_client_config cfg; /* large: not on the stack */
static gp_server_config from;
static gp_spread_plan plan;

static hello_ctx ctx(int tls, int gpus)
{
    memset(&cfg, 0, sizeof cfg);
    cfg.gpus = gpus;
    cfg.spread = 1;
    memset(&from, 0, sizeof from);
    if (gp_parse_server_address("fleet1:7070", &from) != 0)
        abort();
    from.tls = tls;
    snprintf(from.token, sizeof from.token, "gpt_fleet");
    snprintf(from.tls_fingerprint, sizeof from.tls_fingerprint, "%s", PIN_A);
    return (hello_ctx){.cfg = &cfg, .srv = &from, .desc = "fleet1:7070", .plan = &plan};
}

/* The kind gp_connect_parse_parts gives for these parts, through an encoded and decoded reply
 * as the shim reads it; msg gets its line. */
static int parse(hello_ctx *hc, const gp_redirect_part *parts, uint32_t n, uint64_t group,
                 char *msg, size_t mcap)
{
    gp_hello_reply r = {.result = GP_EREDIRECT,
                        .major = GP_PROTO_MAJOR,
                        .minor = GP_PROTO_MINOR,
                        .message = "",
                        .server = "",
                        .name = "",
                        .redirect = "",
                        .redirect_fingerprint = "",
                        .spread_group = group,
                        .redirect_parts = {.count = n},
                        .redirect_parts_items = parts};
    size_t len = gp_hello_reply_size(&r);
    uint8_t *body = malloc(len);
    if (!body)
        abort();
    gp_hello_reply_encode(body, &r);
    gp_hello_reply d;
    CHECK_EQ(gp_hello_reply_decode(body, len, &d), 0);
    msg[0] = 0;
    int k = gp_connect_parse_parts(hc, &d, &plan, msg, mcap);
    free(body);
    return k;
}

static gp_redirect_part part(const char *server, const char *pin, uint32_t gpus, uint32_t first)
{
    return (gp_redirect_part){.server = server,
                              .server_len = (uint32_t)strlen(server),
                              .fingerprint = pin,
                              .fingerprint_len = (uint32_t)strlen(pin),
                              .gpus = gpus,
                              .first_device = first};
}

static void test_pins_over_tls(void)
{
    char msg[2048];
    hello_ctx hc = ctx(1, 4);
    gp_redirect_part good[] = {part("gpu1:7070", PIN_A, 3, 0), part("gpu2:7070", PIN_B, 1, 3)};
    CHECK_EQ(parse(&hc, good, 2, 9, msg, sizeof msg), ATTEMPT_PARTS);
    CHECK_EQ(plan.nparts, 2);
    CHECK_EQ(plan.group, 9);
    CHECK_STR_EQ(plan.part[1].server, "gpu2:7070");
    CHECK_STR_EQ(plan.part[1].fingerprint, PIN_B);
    CHECK_EQ(plan.part[1].first_device, 3);

    gp_redirect_part none[] = {part("gpu1:7070", PIN_A, 2, 0), part("gpu2:7070", "", 2, 2)};
    CHECK_EQ(parse(&hc, none, 2, 9, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "it gave part 1 (gpu2:7070) no fingerprint") != NULL);
    CHECK(strstr(msg, "Nothing was sent to any part") != NULL);
    gp_redirect_part bad[] = {part("gpu1:7070", "SHA256:short", 2, 0),
                              part("gpu2:7070", PIN_B, 2, 2)};
    CHECK_EQ(parse(&hc, bad, 2, 9, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "it gave part 0 (gpu1:7070) an invalid fingerprint") != NULL);

    /* Over plain TCP a pin is not needed (the trust rules then want one of our own servers). */
    hc = ctx(0, 4);
    CHECK_EQ(parse(&hc, none, 2, 9, msg, sizeof msg), ATTEMPT_PARTS);
}

static void test_hostile_lists(void)
{
    char msg[2048];
    hello_ctx hc = ctx(0, 4);
    gp_redirect_part two[] = {part("gpu1:7070", "", 2, 0), part("gpu2:7070", "", 2, 2)};
    CHECK_EQ(parse(&hc, two, 2, 0, msg, sizeof msg), ATTEMPT_UNTRUSTED); /* no group */
    CHECK(strstr(msg, "without a spread group") != NULL);
    /* An address with a NUL inside, and one written tls://: neither is a part's address. */
    gp_redirect_part nul[] = {part("gpu1:7070", "", 2, 0), part("gpu2:7070", "", 2, 2)};
    nul[1].server = "gpu2\0evil:1";
    nul[1].server_len = 11;
    CHECK_EQ(parse(&hc, nul, 2, 5, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "it gave part 1 the address") != NULL);
    gp_redirect_part prefixed[] = {part("tls://gpu1:7070", "", 2, 0), part("gpu2:7070", "", 2, 2)};
    CHECK_EQ(parse(&hc, prefixed, 2, 5, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    gp_redirect_part overlap[] = {part("gpu1:7070", "", 2, 0), part("gpu2:7070", "", 2, 1)};
    CHECK_EQ(parse(&hc, overlap, 2, 5, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "part 1 (gpu2:7070) starts at device 1, not 2") != NULL);
    gp_redirect_part huge[] = {part("gpu1:7070", "", 0xffffffffu, 0), part("gpu2:7070", "", 5, 1)};
    CHECK_EQ(parse(&hc, huge, 2, 5, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "4294967295 GPUs") != NULL);
}

/* A part's pin from the fleet must equal the client's own pin for that address. */
static void test_own_pin_wins(void)
{
    char msg[2048];
    hello_ctx hc = ctx(1, 4);
    gp_redirect_part parts[] = {part("gpu1:7070", PIN_A, 2, 0), part("gpu2:7070", PIN_B, 2, 2)};
    CHECK_EQ(parse(&hc, parts, 2, 9, msg, sizeof msg), ATTEMPT_PARTS);
    CHECK_EQ(gp_connect_resolve_parts(&hc, &from, &plan, msg, sizeof msg), ATTEMPT_OK);
    CHECK_EQ(plan.hop[1].tls, 1);
    CHECK_STR_EQ(plan.hop[1].tls_fingerprint, PIN_B);
    CHECK_STR_EQ(plan.hop[1].token, "gpt_fleet"); /* the fleet's token, as for one redirect */
    CHECK_STR_EQ(plan.hop[1].host, "gpu2");

    cfg.nservers = 1; /* our own entry for gpu2 pins another key */
    if (gp_parse_server_address("gpu2:7070", &cfg.servers[0]) != 0)
        abort();
    cfg.servers[0].tls = 1;
    snprintf(cfg.servers[0].tls_fingerprint, GP_FINGERPRINT_CAP, "%s", PIN_A);
    CHECK_EQ(gp_connect_resolve_parts(&hc, &from, &plan, msg, sizeof msg), ATTEMPT_UNTRUSTED);
    CHECK(strstr(msg, "part 2 of 2 of a spread lease (2 GPUs at gpu2:7070)") != NULL);
    free(plan.hop);
    plan.hop = NULL;
}

static void test_slices(void)
{
    uint64_t b[3], s[3];
    uint64_t base = 0x200000000000ull, size = 1ull << 40;
    for (int k = 0; k < 3; k++)
        CHECK_EQ(gp_connect_slice(base, size, 3, k, &b[k], &s[k]), 0);
    CHECK_EQ(b[0], base);
    CHECK_EQ(s[0] % MIB2, 0);
    CHECK_EQ(s[0], s[2]);
    CHECK_EQ(b[1], b[0] + s[0]);
    CHECK(b[2] + s[2] <= base + size);
    CHECK(b[2] + s[2] + 3 * MIB2 > base + size); /* no more than one 2 MiB step lost per part */
    /* A base off the 2 MiB grid (GPUPOOL_VA_BASE is page-aligned only): slices start on it. */
    uint64_t odd = base + 4096;
    CHECK_EQ(gp_connect_slice(odd, size, 2, 0, &b[0], &s[0]), 0);
    CHECK_EQ(b[0], base + MIB2);
    CHECK_EQ(gp_connect_slice(odd, size, 2, 1, &b[1], &s[1]), 0);
    CHECK(b[1] + s[1] <= odd + size);
    /* Too small for one 2 MiB slice each, or a part that is not one. */
    CHECK_EQ(gp_connect_slice(base, 5 * MIB2, 3, 0, &b[0], &s[0]), 0);
    CHECK_EQ(gp_connect_slice(base, 5 * MIB2, 6, 0, &b[0], &s[0]), -1);
    CHECK_EQ(gp_connect_slice(odd, MIB2, 1, 0, &b[0], &s[0]), -1);
    CHECK_EQ(gp_connect_slice(base, size, 2, 2, &b[0], &s[0]), -1);
}

int main(void)
{
    test_pins_over_tls();
    test_hostile_lists();
    test_own_pin_wins();
    test_slices();
    return gp_test_done("test_connect_parts");
}
