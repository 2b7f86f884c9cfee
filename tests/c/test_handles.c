/*
 * test_handles: client-chosen handles (client/shim/handles.c): the value layout, lookups by
 * kind, removal, fixed registrations, bulk removal by predicate, growth past many entries and
 * concurrent use from several threads.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "shim.h"
#include "gp_test.h"

static int objs[64];

static void test_layout(void)
{
    uint64_t h = gp_handle_new(GP_H_STREAM, &objs[0]);
    CHECK(h != 0);
    CHECK_EQ(h & 0xffff000000000000ull, GP_HANDLE_TAG);
    CHECK_EQ((h >> 40) & 0xff, GP_H_STREAM);
    CHECK_EQ(gp_handle_kind_of(h), GP_H_STREAM);
    CHECK(h > 2); /* never collides with 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
    CHECK(h != GP_PRIMARY_CTX_ID);
    CHECK_EQ(gp_handle_kind_of(0), 0);
    CHECK_EQ(gp_handle_kind_of(1), 0);
    CHECK_EQ(gp_handle_kind_of(0x7fff00001234ull), 0);
    CHECK_PTR_EQ(gp_handle_get(h, GP_H_STREAM), &objs[0]);
    CHECK_PTR_EQ(gp_handle_get(h, GP_H_EVENT), NULL); /* wrong kind */
    CHECK_PTR_EQ(gp_handle_get(h + 1, GP_H_STREAM), NULL);
    CHECK_PTR_EQ(gp_handle_get(0, GP_H_STREAM), NULL);
    CHECK_PTR_EQ(gp_handle_remove(h, GP_H_EVENT), NULL);
    CHECK_PTR_EQ(gp_handle_remove(h, GP_H_STREAM), &objs[0]);
    CHECK_PTR_EQ(gp_handle_remove(h, GP_H_STREAM), NULL);
    CHECK_PTR_EQ(gp_handle_get(h, GP_H_STREAM), NULL);

    uint64_t h2 = gp_handle_new(GP_H_STREAM, &objs[1]);
    CHECK(h2 != h); /* never reused */
    CHECK_PTR_EQ(gp_handle_remove(h2, GP_H_STREAM), &objs[1]);

    /* A NULL object is a valid registration (dummy handles) but reads as "not live". */
    uint64_t pool = gp_handle_new(GP_H_MEMPOOL, NULL);
    CHECK(pool != 0);
    CHECK_EQ(gp_handle_kind_of(pool), GP_H_MEMPOOL);
    gp_handle_remove(pool, GP_H_MEMPOOL);
}

static void test_register(void)
{
    CHECK_EQ(gp_handle_register(GP_PRIMARY_CTX_ID, GP_H_CTX, &objs[2]), 0);
    CHECK_PTR_EQ(gp_handle_get(GP_PRIMARY_CTX_ID, GP_H_CTX), &objs[2]);
    CHECK_EQ(gp_handle_register(GP_PRIMARY_CTX_ID, GP_H_CTX, &objs[3]), -1); /* taken */
    CHECK_PTR_EQ(gp_handle_get(GP_PRIMARY_CTX_ID, GP_H_CTX), &objs[2]);
    CHECK_EQ(gp_handle_register(GP_PRIMARY_CTX_ID, GP_H_STREAM, &objs[3]), -1); /* wrong kind */
    CHECK_EQ(gp_handle_register(12345, GP_H_CTX, &objs[3]), -1);                /* no tag */
    /* fresh context handles never collide with the fixed primary one */
    for (int i = 0; i < 100; i++) {
        uint64_t h = gp_handle_new(GP_H_CTX, &objs[4]);
        CHECK(h != GP_PRIMARY_CTX_ID);
        gp_handle_remove(h, GP_H_CTX);
    }
    CHECK_PTR_EQ(gp_handle_remove(GP_PRIMARY_CTX_ID, GP_H_CTX), &objs[2]);
}

static int odd_obj(uint64_t h, void *obj, void *arg)
{
    (void)h;
    (void)arg;
    return ((int *)obj - objs) % 2 == 1;
}

static int disposed;
static void count_dispose(void *obj)
{
    (void)obj;
    disposed++;
}

static void test_many(void)
{
    enum {
        N = 20000
    };
    uint64_t *hs = malloc(N * sizeof *hs);
    for (int i = 0; i < N; i++) {
        hs[i] = gp_handle_new(i % 3 == 0 ? GP_H_EVENT : GP_H_STREAM, &objs[i % 64]);
        CHECK(hs[i] != 0);
    }
    for (int i = 0; i < N; i++) {
        int kind = i % 3 == 0 ? GP_H_EVENT : GP_H_STREAM;
        CHECK_PTR_EQ(gp_handle_get(hs[i], kind), &objs[i % 64]);
        if (i > 0)
            CHECK(hs[i] != hs[i - 1]);
    }
    /* remove every other one, the rest must stay reachable (backward-shift deletion) */
    for (int i = 0; i < N; i += 2) {
        int kind = i % 3 == 0 ? GP_H_EVENT : GP_H_STREAM;
        CHECK_PTR_EQ(gp_handle_remove(hs[i], kind), &objs[i % 64]);
    }
    for (int i = 0; i < N; i++) {
        int kind = i % 3 == 0 ? GP_H_EVENT : GP_H_STREAM;
        CHECK_PTR_EQ(gp_handle_get(hs[i], kind), i % 2 ? &objs[i % 64] : NULL);
    }
    /* bulk removal: streams whose object index is odd */
    int expect = 0;
    for (int i = 1; i < N; i += 2)
        if (i % 3 != 0 && (i % 64) % 2 == 1)
            expect++;
    disposed = 0;
    CHECK_EQ(gp_handle_remove_if(GP_H_STREAM, odd_obj, NULL, count_dispose), expect);
    CHECK_EQ(disposed, expect);
    for (int i = 1; i < N; i += 2) {
        int kind = i % 3 == 0 ? GP_H_EVENT : GP_H_STREAM;
        int gone = kind == GP_H_STREAM && (i % 64) % 2 == 1;
        CHECK_PTR_EQ(gp_handle_get(hs[i], kind), gone ? NULL : &objs[i % 64]);
    }
    /* everything else, by kind */
    int left_ev = 0, left_st = 0;
    for (int i = 1; i < N; i += 2) {
        if (i % 3 == 0)
            left_ev++;
        else if ((i % 64) % 2 == 0)
            left_st++;
    }
    CHECK_EQ(gp_handle_remove_if(GP_H_EVENT, NULL, NULL, NULL), left_ev);
    CHECK_EQ(gp_handle_remove_if(GP_H_STREAM, NULL, NULL, NULL), left_st);
    CHECK_EQ(gp_handle_remove_if(GP_H_STREAM, NULL, NULL, NULL), 0);
    free(hs);
}

static void *churn(void *arg)
{
    int kind = (int)(uintptr_t)arg;
    uint64_t mine[256];
    int bad = 0;
    for (int round = 0; round < 500; round++) {
        for (int i = 0; i < 256; i++)
            mine[i] = gp_handle_new(kind, &objs[i % 64]);
        for (int i = 0; i < 256; i++)
            if (gp_handle_get(mine[i], kind) != &objs[i % 64])
                bad++;
        for (int i = 0; i < 256; i++)
            if (gp_handle_remove(mine[i], kind) != &objs[i % 64])
                bad++;
    }
    return (void *)(uintptr_t)bad;
}

static void test_threads(void)
{
    pthread_t th[8];
    for (int t = 0; t < 8; t++)
        pthread_create(&th[t], NULL, churn, (void *)(uintptr_t)(t % 2 ? GP_H_STREAM : GP_H_FUNC));
    for (int t = 0; t < 8; t++) {
        void *bad;
        pthread_join(th[t], &bad);
        CHECK_EQ((uintptr_t)bad, 0);
    }
}

int main(void)
{
    test_layout();
    test_register();
    test_many();
    test_threads();
    return gp_test_done("test_handles");
}
