/*
 * test_vamap: the shim's map of address ranges (client/shim/vamap.c): the reserved window,
 * overlap rules, lookups, device spans, per-context removal, module globals, and a randomised
 * comparison against a brute-force model, plus concurrent use from several threads.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shim.h"
#include "shim_core.h"
#include "gp_test.h"

#define MIB (1ull << 20)
#define GIB (1ull << 30)

/* A base where nothing is mapped in a test process: 0x300000000000 and up. */
static uint64_t free_base(uint64_t size)
{
    for (uint64_t b = 0x300000000000ull; b < 0x700000000000ull; b += 0x10000000000ull) {
        void *p = mmap((void *)(uintptr_t)b, size, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (p == MAP_FAILED)
            continue;
        munmap(p, size);
        if ((uint64_t)(uintptr_t)p == b)
            return b;
    }
    return 0;
}

static int page_is_mapped(uint64_t addr)
{
    long pg = sysconf(_SC_PAGESIZE);
    void *p = mmap((void *)(uintptr_t)(addr & ~(uint64_t)(pg - 1)), (size_t)pg, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED)
        return errno == EEXIST;
    munmap(p, (size_t)pg);
    return (uint64_t)(uintptr_t)p != (addr & ~(uint64_t)(pg - 1)); /* old kernel: a hint */
}

static gp_range dev_range(uint64_t base, uint64_t size, uint64_t ctx)
{
    gp_range r = {.base = base, .size = size, .kind = GP_RANGE_DEVICE, .ctx = ctx};
    return r;
}

static void test_window(uint64_t base)
{
    CHECK_EQ(gp_vamap_window_size(), 0);
    CHECK(!gp_vamap_in_window(base));
    CHECK_EQ(gp_vamap_reserve_window(base, 4 * GIB), 0);
    CHECK_EQ(gp_vamap_window_base(), base);
    CHECK_EQ(gp_vamap_window_size(), 4 * GIB);
    CHECK(gp_vamap_in_window(base));
    CHECK(gp_vamap_in_window(base + 4 * GIB - 1));
    CHECK(!gp_vamap_in_window(base + 4 * GIB));
    CHECK(!gp_vamap_in_window(base - 1));
    CHECK(page_is_mapped(base + GIB));                /* really reserved */
    CHECK_EQ(gp_vamap_reserve_window(base, GIB), -1); /* only one window */
    gp_vamap_release_window();
    CHECK_EQ(gp_vamap_window_size(), 0);
    CHECK(!page_is_mapped(base + GIB));

    /* Something already mapped there: refused, nothing replaced. */
    long pg = sysconf(_SC_PAGESIZE);
    void *blocker = mmap((void *)(uintptr_t)(base + MIB), (size_t)pg, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(blocker != MAP_FAILED);
    *(volatile char *)blocker = 7;
    CHECK_EQ(gp_vamap_reserve_window(base, GIB), -1);
    CHECK_EQ(*(volatile char *)blocker, 7);
    munmap(blocker, (size_t)pg);

    CHECK_EQ(gp_vamap_reserve_window(base, 4 * GIB), 0); /* kept for the other tests */
}

static void test_basic(uint64_t base)
{
    gp_range a = dev_range(base, 4000, 11), b = dev_range(base + 2 * MIB, 2 * MIB, 11);
    CHECK_EQ(gp_vamap_add(&a), 0);
    CHECK_EQ(gp_vamap_add(&b), 0);
    gp_range o;
    CHECK_EQ(gp_vamap_add(&a), -1); /* same range again */
    gp_range over = dev_range(base + 3999, 10, 11);
    CHECK_EQ(gp_vamap_add(&over), -1); /* overlaps a's last byte */
    over = dev_range(base + 2 * MIB - 1, 2, 11);
    CHECK_EQ(gp_vamap_add(&over), -1); /* overlaps b's first byte */
    over = dev_range(base - 10, 100 * MIB, 11);
    CHECK_EQ(gp_vamap_add(&over), -1); /* covers both */
    gp_range zero = dev_range(base + 10 * MIB, 0, 11);
    CHECK_EQ(gp_vamap_add(&zero), -1);
    gp_range adj = dev_range(base + 4000, 96, 12); /* touches a: fine */
    CHECK_EQ(gp_vamap_add(&adj), 0);

    CHECK_EQ(gp_vamap_find(base, &o), 0);
    CHECK_EQ(o.base, base);
    CHECK_EQ(o.size, 4000);
    CHECK(o.buffer_id != 0);
    uint64_t id_a = o.buffer_id;
    CHECK_EQ(gp_vamap_find(base + 3999, &o), 0);
    CHECK_EQ(o.base, base);
    CHECK_EQ(gp_vamap_find(base + 4000, &o), 0);
    CHECK_EQ(o.base, base + 4000);
    CHECK(o.buffer_id != id_a);
    CHECK_EQ(gp_vamap_find(base + 4096, &o), -1);
    CHECK_EQ(gp_vamap_find(base - 1, &o), -1);
    CHECK_EQ(gp_vamap_find(base + 4 * MIB, &o), -1);
    CHECK_EQ(gp_vamap_find(base + 4 * MIB - 1, NULL), 0);

    CHECK(gp_vamap_device_span(base, 4000));
    CHECK(gp_vamap_device_span(base + 1000, 3000));
    CHECK(!gp_vamap_device_span(base + 1000, 3001)); /* runs past the end */
    CHECK(!gp_vamap_device_span(base, 4096));        /* spans two ranges: refused */
    CHECK(gp_vamap_device_span(base + 3999, 1));
    CHECK(gp_vamap_device_span(base + 3999, 0));
    CHECK(!gp_vamap_device_span(base + 5000, 1));
    CHECK(!gp_vamap_device_span(base + 2 * MIB, UINT64_MAX));

    /* Host ranges are never device spans. */
    static char host[8192];
    gp_range h = {.base = (uint64_t)(uintptr_t)host,
                  .size = sizeof host,
                  .kind = GP_RANGE_HOST_ALLOC,
                  .ctx = 11,
                  .flags = 2};
    CHECK_EQ(gp_vamap_add(&h), 0);
    CHECK(!gp_vamap_device_span((uint64_t)(uintptr_t)host, 1));
    CHECK_EQ(gp_vamap_find((uint64_t)(uintptr_t)host + 100, &o), 0);
    CHECK_EQ(o.kind, GP_RANGE_HOST_ALLOC);
    CHECK_EQ(o.flags, 2);
    /* Host spans: inside one host range only (mapped host memory, api_copy.c). */
    uint64_t hb = (uint64_t)(uintptr_t)host;
    CHECK(gp_vamap_host_span(hb, sizeof host));
    CHECK(gp_vamap_host_span(hb + 100, sizeof host - 100));
    CHECK(gp_vamap_host_span(hb + sizeof host - 1, 1));
    CHECK(!gp_vamap_host_span(hb + 100, sizeof host - 99)); /* runs past the end */
    CHECK(!gp_vamap_host_span(hb + 1, UINT64_MAX));
    CHECK(!gp_vamap_host_span(hb + sizeof host, 1)); /* just past it: not host memory we know */
    CHECK(!gp_vamap_host_span(base, 1));             /* device memory is not a host span */
    static char reg[4096];
    gp_range hr = {.base = (uint64_t)(uintptr_t)reg, .size = 1000, .kind = GP_RANGE_HOST_REG};
    CHECK_EQ(gp_vamap_add(&hr), 0);
    CHECK(gp_vamap_host_span(hr.base + 10, 990));
    CHECK(!gp_vamap_host_span(hr.base + 10, 991)); /* registered bytes only, not the page */
    CHECK_EQ(gp_vamap_remove(hr.base, NULL), 0);
    CHECK(!gp_vamap_host_span(hr.base + 10, 1));

    /* Removal only by base. */
    CHECK_EQ(gp_vamap_remove(base + 1, &o), -1);
    CHECK_EQ(gp_vamap_remove(base, &o), 0);
    CHECK_EQ(o.size, 4000);
    CHECK_EQ(gp_vamap_remove(base, &o), -1);
    CHECK_EQ(gp_vamap_find(base, &o), -1);
    CHECK(!gp_vamap_device_span(base, 1));
    /* A new allocation at the same address gets a new buffer id. */
    CHECK_EQ(gp_vamap_add(&a), 0);
    CHECK_EQ(gp_vamap_find(base, &o), 0);
    CHECK(o.buffer_id != id_a);

    /* Per-context removal: device ranges of ctx 11 go, ctx 12 and host ranges stay. */
    CHECK_EQ(gp_vamap_remove_ctx(11), 2);
    CHECK_EQ(gp_vamap_find(base, &o), -1);
    CHECK_EQ(gp_vamap_find(base + 2 * MIB, &o), -1);
    CHECK_EQ(gp_vamap_find(base + 4000, &o), 0);
    CHECK_EQ(gp_vamap_find((uint64_t)(uintptr_t)host, &o), 0);
    CHECK_EQ(gp_vamap_remove_ctx(11), 0);
    CHECK_EQ(gp_vamap_remove(base + 4000, NULL), 0);
    CHECK_EQ(gp_vamap_remove((uint64_t)(uintptr_t)host, NULL), 0);
}

static void test_globals(uint64_t win)
{
    /* Inside the window: just recorded. */
    CHECK_EQ(gp_vamap_add_global(win + 64 * MIB, 64, 5), 0);
    CHECK_EQ(gp_vamap_add_global(win + 64 * MIB, 64, 5), 0);  /* idempotent */
    CHECK_EQ(gp_vamap_add_global(win + 64 * MIB, 65, 5), -1); /* a different range there */
    CHECK(gp_vamap_device_span(win + 64 * MIB + 60, 4));
    gp_range o;
    CHECK_EQ(gp_vamap_find(win + 64 * MIB, &o), 0);
    CHECK_EQ(o.kind, GP_RANGE_GLOBAL);

    /* Outside the window: its pages get reserved so that nothing else lands there. */
    uint64_t out = free_base(GIB);
    CHECK(out != 0);
    CHECK(!page_is_mapped(out + 100));
    CHECK_EQ(gp_vamap_add_global(out + 100, 4, 5), 0);
    CHECK(page_is_mapped(out + 100));
    CHECK_EQ(gp_vamap_add_global(out + 200, 8, 5), 0); /* same page, already reserved: fine */
    CHECK(gp_vamap_device_span(out + 200, 8));
    CHECK_EQ(gp_vamap_remove_ctx(5), 3);
}

/* A lease spread over servers: two parts' copies of one global at the same address (their
 * workers' drivers chose alike). The second is a twin: found for a context that wants it, and
 * it takes the map's place when the first goes (by its unload, or its context's end). */
static uint64_t wanted_ctx;
static int wants(uint64_t ctx)
{
    return ctx == wanted_ctx;
}

static void test_global_twins(uint64_t win)
{
    uint64_t g = win + 96 * MIB;
    gp_range o;
    CHECK_EQ(gp_vamap_add_global(g, 64, 7), 0);
    CHECK_EQ(gp_vamap_add_global(g, 64, 8), 0);  /* the other part's copy: a twin */
    CHECK_EQ(gp_vamap_add_global(g, 64, 8), 0);  /* idempotent */
    CHECK_EQ(gp_vamap_add_global(g, 32, 9), -1); /* another size there: refused */
    CHECK_EQ(gp_vamap_find(g + 10, &o), 0);
    CHECK_EQ(o.ctx, 7); /* the map's */
    wanted_ctx = 8;
    CHECK_EQ(gp_vamap_global_of(g + 10, wants, &o), 0);
    CHECK_EQ(o.ctx, 8);
    CHECK_EQ(o.base, g);
    wanted_ctx = 7;
    CHECK_EQ(gp_vamap_global_of(g + 63, wants, &o), 0);
    CHECK_EQ(o.ctx, 7);
    wanted_ctx = 9;
    CHECK_EQ(gp_vamap_global_of(g, wants, &o), -1);
    /* Context 7's copy unloaded: context 8's takes its place in the map. */
    CHECK_EQ(gp_vamap_remove_global(g, 9), -1);
    CHECK_EQ(gp_vamap_remove_global(g, 7), 0);
    CHECK_EQ(gp_vamap_find(g, &o), 0);
    CHECK_EQ(o.ctx, 8);
    wanted_ctx = 7;
    CHECK_EQ(gp_vamap_global_of(g, wants, &o), -1);
    /* A twin goes with its context; the map's copy, with its own, leaves a twin in its place. */
    CHECK_EQ(gp_vamap_add_global(g, 64, 7), 0);
    CHECK_EQ(gp_vamap_remove_ctx(7), 1);
    CHECK_EQ(gp_vamap_find(g, &o), 0);
    CHECK_EQ(o.ctx, 8);
    CHECK_EQ(gp_vamap_add_global(g, 64, 7), 0);
    CHECK_EQ(gp_vamap_remove_ctx(8), 1);
    CHECK_EQ(gp_vamap_find(g, &o), 0);
    CHECK_EQ(o.ctx, 7);
    CHECK_EQ(gp_vamap_remove_global(g, 7), 0);
    CHECK_EQ(gp_vamap_find(g, &o), -1);
}

/* Random operations against a brute-force model. */
#define MODEL_N 512
static struct {
    uint64_t base, size;
    int live;
} model[MODEL_N];

static void test_random(uint64_t win)
{
    unsigned seed = 12345;
    for (int step = 0; step < 20000; step++) {
        seed = seed * 1103515245u + 12345u;
        int i = (int)((seed >> 8) % MODEL_N);
        seed = seed * 1103515245u + 12345u;
        uint64_t base = win + ((seed >> 4) % (64 * MIB));
        seed = seed * 1103515245u + 12345u;
        uint64_t size = 1 + (seed >> 8) % (256 * 1024);
        if (model[i].live) {
            CHECK_EQ(gp_vamap_remove(model[i].base, NULL), 0);
            model[i].live = 0;
        } else {
            int overlaps = 0;
            for (int k = 0; k < MODEL_N; k++)
                if (model[k].live && base < model[k].base + model[k].size &&
                    model[k].base < base + size)
                    overlaps = 1;
            gp_range r = dev_range(base, size, 77);
            int rc = gp_vamap_add(&r);
            CHECK_EQ(rc, overlaps ? -1 : 0);
            if (rc == 0) {
                model[i].base = base;
                model[i].size = size;
                model[i].live = 1;
            }
        }
        /* probe a few addresses */
        for (int p = 0; p < 4; p++) {
            seed = seed * 1103515245u + 12345u;
            uint64_t a = win + ((seed >> 4) % (64 * MIB + MIB));
            int expect = -1;
            uint64_t eb = 0;
            for (int k = 0; k < MODEL_N; k++)
                if (model[k].live && a >= model[k].base && a < model[k].base + model[k].size) {
                    expect = 0;
                    eb = model[k].base;
                }
            gp_range o;
            int rc = gp_vamap_find(a, &o);
            CHECK_EQ(rc, expect);
            if (rc == 0 && expect == 0)
                CHECK_EQ(o.base, eb);
        }
    }
    int live = 0;
    for (int k = 0; k < MODEL_N; k++)
        live += model[k].live;
    CHECK_EQ(gp_vamap_remove_ctx(77), live);
}

/* Several threads adding, finding and removing their own ranges at once. */
static uint64_t thread_win;

static void *worker(void *arg)
{
    uint64_t t = (uint64_t)(uintptr_t)arg;
    uint64_t base = thread_win + 128 * MIB + t * 16 * MIB;
    int bad = 0;
    for (int round = 0; round < 2000; round++) {
        for (uint64_t k = 0; k < 8; k++) {
            gp_range r = dev_range(base + k * MIB, MIB / 2, 100 + t);
            if (gp_vamap_add(&r) != 0)
                bad++;
        }
        for (uint64_t k = 0; k < 8; k++) {
            if (!gp_vamap_device_span(base + k * MIB + 10, 100))
                bad++;
            if (gp_vamap_device_span(base + k * MIB + MIB / 2, 1))
                bad++;
        }
        for (uint64_t k = 0; k < 8; k++)
            if (gp_vamap_remove(base + k * MIB, NULL) != 0)
                bad++;
    }
    return (void *)(uintptr_t)bad;
}

static void test_threads(uint64_t win)
{
    thread_win = win;
    pthread_t th[8];
    for (uintptr_t t = 0; t < 8; t++)
        pthread_create(&th[t], NULL, worker, (void *)t);
    for (int t = 0; t < 8; t++) {
        void *bad;
        pthread_join(th[t], &bad);
        CHECK_EQ((uintptr_t)bad, 0);
    }
}

int main(void)
{
    setenv("GPUPOOL_LOG", "quiet", 1);
    uint64_t base = free_base(4 * GIB);
    CHECK(base != 0);
    if (!base)
        return gp_test_done("test_vamap");
    test_window(base);
    test_basic(base);
    test_globals(base);
    test_global_twins(base);
    test_random(base);
    test_threads(base);
    return gp_test_done("test_vamap");
}
