/*
 * test_requirements: the sizes GPUPOOL_MIN_MEMORY and min_memory accept and refuse
 * (client/common/requirements.c). What the environment and the configuration file turn into is
 * test_client_config's; the end-to-end path (the values in the hello, the messages on stderr) is
 * tests/test_shim_core.py's.
 */
#include <stdint.h>
#include <stdlib.h>

#include "client_config.h"
#include "gp_test.h"

static void size_ok(const char *text, uint64_t want)
{
    uint64_t got = 12345;
    int rc = gp_parse_size(text, &got);
    if (rc != 0 || got != want)
        fprintf(stderr, "gp_parse_size(\"%s\"): rc %d, %llu; want %llu\n", text, rc,
                (unsigned long long)got, (unsigned long long)want);
    CHECK_EQ(rc, 0);
    CHECK_EQ(got, want);
}

static void size_bad(const char *text)
{
    uint64_t got = 12345;
    int rc = gp_parse_size(text, &got);
    if (rc != -1)
        fprintf(stderr, "gp_parse_size(\"%s\") accepted: %llu\n", text, (unsigned long long)got);
    CHECK_EQ(rc, -1);
    CHECK_EQ(got, 12345); /* untouched on failure */
}

static void test_sizes(void)
{
    size_ok("0", 0);
    size_ok("17179869184", 17179869184ull);
    size_ok("40G", 40000000000ull);
    size_ok("40GB", 40000000000ull);
    size_ok("40gb", 40000000000ull);
    size_ok("40GiB", 40ull << 30);
    size_ok("40gib", 40ull << 30);
    size_ok("512M", 512000000ull);
    size_ok("512MiB", 512ull << 20);
    size_ok("4k", 4000);
    size_ok("4KiB", 4096);
    size_ok("1T", 1000000000000ull);
    size_ok("2TiB", 2ull << 40);
    size_ok("100B", 100);
    size_ok("1.5G", 1500000000ull);
    size_ok("1.5GiB", 3ull << 29);
    size_ok(" 40 GB ", 40000000000ull);
    size_ok("0.0000001G", 0); /* digits past the sixth are dropped */
    size_ok("18446744073709551615", UINT64_MAX);
    size_ok("16777215TiB", 16777215ull << 40);
    size_bad("");
    size_bad("   ");
    size_bad("G");
    size_bad("-1");
    size_bad("+1G");
    size_bad("40X");
    size_bad("40 G B");
    size_bad("40GBs");
    size_bad("1.G");
    size_bad(".5G");
    size_bad("40G 1");
    size_bad("0x100");
    size_bad("18446744073709551616"); /* 2^64 */
    size_bad("16777216TiB");          /* 2^64 */
    size_bad("18446744073709551615.5K");
    size_ok("10.5", 10); /* a fraction of a byte is dropped */
}

int main(void)
{
    test_sizes();
    return gp_test_done("test_requirements");
}
