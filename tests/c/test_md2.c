/*
 * test_md2.c: MD2 against the RFC 1319 test suite (appendix A.5) and HMAC-MD2 against values
 * from Python's hmac module driving an independent MD2 (HMAC-MD2 has no RFC vectors).
 */
#include <stdint.h>
#include <string.h>

#include "gp_test.h"
#include "hmac_md2.h"
#include "md2.h"

static void check_md2(const char *msg, const char *hex)
{
    uint8_t want[16], got[16];
    CHECK_EQ(gp_test_unhex(hex, want, sizeof want), 16);
    gp_md2(msg, strlen(msg), got);
    CHECK_MEM_EQ(got, want, 16);

    /* The same message fed in awkward pieces must give the same digest. */
    for (size_t step = 1; step <= 17; step += 3) {
        gp_md2_ctx ctx;
        gp_md2_init(&ctx);
        size_t len = strlen(msg);
        for (size_t off = 0; off < len; off += step)
            gp_md2_update(&ctx, msg + off, len - off < step ? len - off : step);
        gp_md2_update(&ctx, NULL, 0);
        gp_md2_final(&ctx, got);
        CHECK_MEM_EQ(got, want, 16);
    }
}

static void check_hmac(const void *key, size_t key_len, const char *msg, const char *hex)
{
    uint8_t want[16], got[16];
    CHECK_EQ(gp_test_unhex(hex, want, sizeof want), 16);
    gp_hmac_md2(key, key_len, msg, strlen(msg), got);
    CHECK_MEM_EQ(got, want, 16);
}

int main(void)
{
    /* RFC 1319, A.5 */
    check_md2("", "8350e5a3e24c153df2275c9f80692773");
    check_md2("a", "32ec01ec4a6dac72c0ab96fb34c0b5d1");
    check_md2("abc", "da853b0d3f88d99b30283a69e6ded6bb");
    check_md2("message digest", "ab4f496bfb2a530b219ff33031fe06b0");
    check_md2("abcdefghijklmnopqrstuvwxyz", "4e8ddff3650292ab5a4108c3aa47940b");
    check_md2("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
              "da33def2a42df13975352846c30338cd");
    check_md2("1234567890123456789012345678901234567890123456789012345678901234567890123456"
              "7890",
              "d5976f79d83d3a0dc9806c3c66f3efd8");

    /* HMAC-MD2: the integrity check's 16-byte key (exactly one MD2 block), a short key, a key
     * longer than a block (hashed first), and the empty key and message. */
    static const uint8_t integrity_key[16] = {0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52,
                                              0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F};
    check_hmac(integrity_key, sizeof integrity_key, "The quick brown fox jumps over the lazy dog",
               "6ff0a92b1488b5790782668dc4f71b6a");
    check_hmac("key", 3, "The quick brown fox jumps over the lazy dog",
               "13758b9534bfb38d850457814613b0c1");
    uint8_t long_key[40];
    memset(long_key, 0xaa, sizeof long_key);
    check_hmac(long_key, sizeof long_key, "Hi There", "27392e4a0bd419dab44986beec1a434b");
    check_hmac("", 0, "", "6f6e031223b36cd2a997787a03d16bf5");

    return gp_test_done("test_md2");
}
