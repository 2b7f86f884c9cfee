/*
 * test_sha256.c: SHA-256 against the FIPS 180 examples and NIST's long-message vectors, fed
 * both in one piece and in awkward pieces (block boundaries are where implementations break).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gp_test.h"
#include "sha256.h"

static void check_pieces(const uint8_t *msg, size_t len, const uint8_t want[32])
{
    static const size_t steps[] = {1, 3, 55, 56, 63, 64, 65, 127, 1000};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        gp_sha256_ctx ctx;
        uint8_t got[32];
        gp_sha256_init(&ctx);
        for (size_t off = 0; off < len; off += steps[s])
            gp_sha256_update(&ctx, msg + off, len - off < steps[s] ? len - off : steps[s]);
        gp_sha256_final(&ctx, got);
        CHECK_MEM_EQ(got, want, 32);
    }
}

static void check(const void *msg, size_t len, const char *hex)
{
    uint8_t want[32], got[32];
    char got_hex[65];
    CHECK_EQ(gp_test_unhex(hex, want, sizeof want), 32);
    gp_sha256(msg, len, got);
    CHECK_MEM_EQ(got, want, 32);
    gp_sha256_hex(got, got_hex);
    CHECK_STR_EQ(got_hex, hex);
    check_pieces(msg, len, want);
}

static void check_str(const char *msg, const char *hex)
{
    check(msg, strlen(msg), hex);
}

int main(void)
{
    check_str("", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    check_str("abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    check_str("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    check_str("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmn"
              "opqrlmnopqrsmnopqrstnopqrstu",
              "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");

    /* Lengths around the padding boundary (55/56/64 bytes of 'a'), values from Python hashlib. */
    static uint8_t a[1000000];
    memset(a, 'a', sizeof a);
    check(a, 55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
    check(a, 56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
    check(a, 64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");

    /* NIST: one million 'a'. */
    check(a, sizeof a, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

    return gp_test_done("test_sha256");
}
