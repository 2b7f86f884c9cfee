/*
 * test_requirements: the client's GPU requirements (client/shim/requirements.c): the sizes
 * GPUPOOL_MIN_MEMORY accepts and refuses, and what the environment turns into. The end-to-end
 * path (the values in the hello, the messages on stderr) is tests/test_shim_core.py's.
 */
#include <stdint.h>
#include <stdlib.h>

#include "../../client/shim/shim_core.h"
#include "gp_test.h"

static void size_ok(const char *text, uint64_t want) {
    uint64_t got = 12345;
    int rc = gp_parse_size(text, &got);
    if (rc != 0 || got != want)
        fprintf(stderr, "gp_parse_size(\"%s\"): rc %d, %llu; want %llu\n", text, rc,
                (unsigned long long)got, (unsigned long long)want);
    CHECK_EQ(rc, 0);
    CHECK_EQ(got, want);
}

static void size_bad(const char *text) {
    uint64_t got = 12345;
    int rc = gp_parse_size(text, &got);
    if (rc != -1) fprintf(stderr, "gp_parse_size(\"%s\") accepted: %llu\n", text,
                          (unsigned long long)got);
    CHECK_EQ(rc, -1);
    CHECK_EQ(got, 12345); /* untouched on failure */
}

static void test_sizes(void) {
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
    size_ok("0.0000001G", 0);               /* digits past the sixth are dropped */
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

static void set(const char *name, const char *value) {
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

static int from_env(const char *gpu, const char *device, const char *model, const char *mem,
                    gp_requirements *r) {
    set("GPUPOOL_GPU", gpu);
    set("GPUPOOL_DEVICE", device);
    set("GPUPOOL_GPU_MODEL", model);
    set("GPUPOOL_MIN_MEMORY", mem);
    return gp_requirements_from_env(r);
}

static void test_environment(void) {
    gp_requirements r;
    CHECK_EQ(from_env(NULL, NULL, NULL, NULL, &r), 0);
    CHECK_STR_EQ(r.gpu, "");
    CHECK_STR_EQ(r.model, "");
    CHECK_EQ(r.min_memory, 0);

    CHECK_EQ(from_env(" 1 ", NULL, " A100 ", " 40GiB ", &r), 0);
    CHECK_STR_EQ(r.gpu, "1");
    CHECK_STR_EQ(r.model, "A100");
    CHECK_EQ(r.min_memory, 40ull << 30);

    /* the old name is an alias; the new one wins when both are set */
    CHECK_EQ(from_env(NULL, "GPU-8f3a", NULL, "", &r), 0);
    CHECK_STR_EQ(r.gpu, "GPU-8f3a");
    CHECK_EQ(r.min_memory, 0);
    CHECK_EQ(from_env("2", "GPU-8f3a", NULL, NULL, &r), 0);
    CHECK_STR_EQ(r.gpu, "2");
    CHECK_EQ(from_env("", "3", NULL, NULL, &r), 0);
    CHECK_STR_EQ(r.gpu, "3");

    /* refused, each with one line on stderr (the Python test checks the words) */
    CHECK_EQ(from_env(NULL, NULL, NULL, "forty", &r), -1);
    CHECK_EQ(from_env(NULL, NULL, "A1\n00", NULL, &r), -1);
    CHECK_EQ(from_env(NULL, NULL, "\xff\xfe", NULL, &r), -1);
    char longer[300];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = 0;
    CHECK_EQ(from_env(longer, NULL, NULL, NULL, &r), -1);
    longer[255] = 0; /* exactly the protocol's limit */
    CHECK_EQ(from_env(longer, NULL, NULL, NULL, &r), 0);
    CHECK_EQ(strlen(r.gpu), 255);
    CHECK_EQ(from_env(NULL, NULL, "\xc3\x9c-GPU", NULL, &r), 0); /* valid UTF-8 is fine */
}

int main(void) {
    test_sizes();
    test_environment();
    return gp_test_done("test_requirements");
}
