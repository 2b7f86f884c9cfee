/*
 * test_export_tables.c: cuGetExportTable and its tables, called the way cudart and cuBLASLt call
 * them (through the slots), with the shim core's hooks defined here: context-local storage,
 * the fixed and computed integrity answers, the buffers and the "return 0" slots; tables the
 * shim does not implement (trampolines, with the slot count a stand-in server reports) and the
 * tools-module table's slot 7 (with a stand-in server iteration).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "export_tables.h"
#include "gp_test.h"
#include "integrity.h"
#include "md2.h"

/* ---- the hooks the shim core will define ------------------------------------------------- */

static _Thread_local CUcontext test_current; /* per thread, like the shim's context stack */
static int test_driver_version = 13000;      /* only changed while no other thread runs */
static int test_device_count = 2;

#define PRIMARY_0 ((CUcontext)0x6750000100000001ull)
#define PRIMARY_1 ((CUcontext)0x6750000100000002ull)

CUcontext gp_ctx_current_for_tables(void)
{
    return test_current;
}

CUcontext gp_ctx_primary_for_tables(int dev)
{
    return dev == 0 ? PRIMARY_0 : dev == 1 ? PRIMARY_1 : NULL;
}

static const CUuuid test_uuids[2] = {
    {{0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
      0x10}},
    {{(char)0xf0, (char)0xe1, (char)0xd2, (char)0xc3, (char)0xb4, (char)0xa5, (char)0x96,
      (char)0x87, 0x78, 0x69, 0x5a, 0x4b, 0x3c, 0x2d, 0x1e, 0x0f}},
};
static const int test_pci[2][3] = {{0, 0x1b, 0}, {1, 0xc1, 3}};

int gp_integrity_driver_version(void)
{
    return test_driver_version;
}

int gp_integrity_devices(CUuuid *uuids, int *pci_domain, int *pci_bus, int *pci_dev, int max)
{
    if (test_device_count < 0)
        return -1;
    int n = test_device_count < max ? test_device_count : max;
    for (int i = 0; i < n; i++) {
        uuids[i] = test_uuids[i];
        pci_domain[i] = test_pci[i][0];
        pci_bus[i] = test_pci[i][1];
        pci_dev[i] = test_pci[i][2];
    }
    return n;
}

/* The server, as the hooks see it: the tools-module table (8 slots), a table only its driver
 * knows (10 slots), one without a size word (0), one longer than the shim serves (300), one it
 * cannot answer about (-2: no server); every other uuid unknown. Its tools iteration calls back 3 times and returns 0. */
static int slots_asked; /* how often the server was asked about a table */

int gp_export_table_slots_for_tables(const CUuuid *uuid)
{
    slots_asked++;
    static const struct {
        unsigned char last;
        int slots;
    } known[] = {{0x10, 10}, {0x11, 0}, {0x12, 300}, {0x13, -2}};
    static const unsigned char prefix[15] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static const unsigned char tools[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                            0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};
    if (memcmp(uuid->bytes, tools, 16) == 0)
        return 8;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (memcmp(uuid->bytes, prefix, 15) == 0 && (unsigned char)uuid->bytes[15] == known[i].last)
            return known[i].slots;
    return -1;
}

#define TEST_MODULE ((CUmodule)0x6750000500000001ull)
static CUcontext tools_ctx_seen;
static unsigned long long tools_flags_seen;

CUresult gp_tools_module_functions_for_tables(CUcontext ctx, CUmodule module,
                                              unsigned long long flags, int32_t *value,
                                              uint32_t *count)
{
    tools_ctx_seen = ctx;
    tools_flags_seen = flags;
    if (module != TEST_MODULE)
        return CUDA_ERROR_INVALID_HANDLE;
    *value = 0;
    *count = 3;
    return CUDA_SUCCESS;
}

/* ---- helpers ------------------------------------------------------------------------------ */

typedef union slot {
    size_t size;
    void (*fn)(void);
} slot;

static const slot *get_table(const char *uuid_hex)
{
    CUuuid id;
    CHECK_EQ(gp_test_unhex(uuid_hex, (unsigned char *)id.bytes, 16), 16);
    const void *table = NULL;
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_SUCCESS);
    CHECK(table != NULL);
    return table;
}

#define CUDART_INTERFACE "6bd5fb6c5bf4e74a8987d93912fd9df9"
#define TOOLS_HOOKS "a094798c2e742e7493f20800200c0a66"
#define TOOLS_TLS "42d85a8123f6cb478298f6e78a3aecdc"
#define CLS "c693336e1121df11a8c368f355d89593"
#define CONTEXT_CHECKS "263e88607cd2614392f6bbd5006dfa7e"
#define INTEGRITY "d4082055bde6704b8d34ba123c66e1f2"
#define T_21318C60 "21318c60971432488ca641ff7324c8f2"
#define T_1734DC26 "1734dc26800d47458726c0f1e7dd8bca"

/* ---- lookups -------------------------------------------------------------------------------- */

static void unknown_twice(void)
{
    CUuuid id;
    CHECK_EQ(gp_test_unhex("0ca50b8c1004929a89a7d0df10e77286", (unsigned char *)id.bytes, 16), 16);
    const void *table = (const void *)0x1;
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE);
    CHECK_PTR_EQ(table, NULL);
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE);
    /* f8cff951 is refused, quietly: every cudart asks for it and copes. */
    CHECK_EQ(gp_test_unhex("f8cff95121468b4eb9e2fb469e7c0dd9", (unsigned char *)id.bytes, 16), 16);
    table = (const void *)0x1;
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE);
    CHECK_PTR_EQ(table, NULL);
}

static void test_lookup(void)
{
    static const char *const known[] = {CUDART_INTERFACE, TOOLS_HOOKS, TOOLS_TLS,  CLS,
                                        CONTEXT_CHECKS,   INTEGRITY,   T_21318C60, T_1734DC26};
    const void *seen[8];
    for (int i = 0; i < 8; i++) {
        seen[i] = get_table(known[i]);
        for (int j = 0; j < i; j++)
            CHECK(seen[i] != seen[j]);
    }
    /* The same table every time: the integrity hash includes these addresses. */
    CHECK_PTR_EQ(get_table(CUDART_INTERFACE), gp_export_table_cudart_interface());
    CHECK_PTR_EQ(get_table(INTEGRITY), gp_export_table_integrity_check());

    CUuuid id = {{0}};
    CHECK_EQ(cuGetExportTable(NULL, &id), CUDA_ERROR_INVALID_VALUE);
    const void *table = NULL;
    CHECK_EQ(cuGetExportTable(&table, NULL), CUDA_ERROR_INVALID_VALUE);

    const char *out = capture_stderr(unknown_twice);
    CHECK_STR_EQ(out, "gpupool: cuGetExportTable: unknown table "
                      "0ca50b8c-1004-929a-89a7-d0df10e77286 (returned CUDA_ERROR_INVALID_VALUE); "
                      "please report it\n");
}

/* ---- tables the shim does not implement: trampolines ----------------------------------------- */

#define SERVER_ONLY "0102030405060708090a0b0c0d0e0f10"
#define NO_SIZE_WORD "0102030405060708090a0b0c0d0e0f11"
#define LONG_TABLE "0102030405060708090a0b0c0d0e0f12"
#define TOOLS_MODULE "6e163fbeb958444d835ce182aff1991e"

static uint64_t slot_calls(const char *uuid_hex, uint32_t slot)
{
    gp_et_slot_calls calls[64];
    size_t n = gp_export_table_slot_calls(calls, 64);
    CHECK(n <= 64);
    unsigned char id[16];
    CHECK_EQ(gp_test_unhex(uuid_hex, id, 16), 16);
    for (size_t i = 0; i < n; i++)
        if (memcmp(calls[i].table.bytes, id, 16) == 0 && calls[i].slot == slot)
            return calls[i].calls;
    return 0;
}

static void call_trampolines(void)
{
    const slot *t = get_table(SERVER_ONLY);
    CHECK_EQ(t[0].size, 10 * sizeof(slot)); /* the server's driver's size */
    uint64_t (*fn)(void) = (uint64_t(*)(void))t[3].fn;
    CHECK_EQ((uint32_t)fn(), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ((uint32_t)fn(), CUDA_ERROR_NOT_SUPPORTED);
    /* Asked once: the same table again without a round trip. */
    int asked = slots_asked;
    CHECK_PTR_EQ(get_table(SERVER_ONLY), t);
    CHECK_EQ(slots_asked, asked);
    fn = (uint64_t(*)(void))t[9].fn;
    CHECK_EQ((uint32_t)fn(), CUDA_ERROR_NOT_SUPPORTED);
}

static void test_trampolines(void)
{
    const char *out = capture_stderr(call_trampolines);
    CHECK_STR_EQ(out, "gpupool: cuGetExportTable: table 01020304-0506-0708-090a-0b0c0d0e0f10 is "
                      "not implemented by gpupool: each slot answers CUDA_ERROR_NOT_SUPPORTED\n"
                      "gpupool: export table 01020304-0506-0708-090a-0b0c0d0e0f10 slot 3 called "
                      "(returned CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)\n"
                      "gpupool: export table 01020304-0506-0708-090a-0b0c0d0e0f10 slot 9 called "
                      "(returned CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)\n");
    CHECK_EQ(slot_calls(SERVER_ONLY, 3), 2);
    CHECK_EQ(slot_calls(SERVER_ONLY, 9), 1);
    CHECK_EQ(slot_calls(SERVER_ONLY, 4), 0);
    /* No size word on the server: slot 0 is a trampoline too, and 128 slots are served. */
    const slot *t = get_table(NO_SIZE_WORD);
    CHECK_EQ(((uint32_t(*)(void))t[0].fn)(), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(((uint32_t(*)(void))t[127].fn)(), CUDA_ERROR_NOT_SUPPORTED);
    CHECK_EQ(slot_calls(NO_SIZE_WORD, 0), 1);
    CHECK_EQ(slot_calls(NO_SIZE_WORD, 127), 1);
    /* Longer than the shim serves: the size word says what is there. */
    t = get_table(LONG_TABLE);
    CHECK_EQ(t[0].size, 128 * sizeof(slot));
    /* Tables are distinct, and a refused uuid is not asked about twice. */
    CHECK(get_table(SERVER_ONLY) != get_table(NO_SIZE_WORD));
    int asked = slots_asked;
    CUuuid id;
    CHECK_EQ(gp_test_unhex("0ca50b8c1004929a89a7d0df10e77286", (unsigned char *)id.bytes, 16), 16);
    const void *table = NULL;
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE); /* refused in test_lookup */
    CHECK_EQ(slots_asked, asked);
}

static void no_answer_twice(void)
{
    CUuuid id;
    CHECK_EQ(gp_test_unhex("0102030405060708090a0b0c0d0e0f13", (unsigned char *)id.bytes, 16), 16);
    const void *table = (const void *)0x1;
    int asked = slots_asked;
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE);
    CHECK_PTR_EQ(table, NULL);
    CHECK_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(slots_asked, asked + 2); /* not remembered: asked again once there is a server */
}

/* Without a server's answer a table is refused quietly and not remembered as unknown. */
static void test_no_server_answer(void)
{
    CHECK_STR_EQ(capture_stderr(no_answer_twice), "");
}

struct tools_seen {
    int calls;
    void *owner;
    const unsigned char *nodes[4];
};

static void tools_collect(void *opaque, void *node, void *owner)
{
    struct tools_seen *s = opaque;
    if (s->calls < 4)
        s->nodes[s->calls] = node;
    s->calls++;
    s->owner = owner;
}

typedef CUresult (*tools_iterator)(CUcontext, CUmodule, void (*)(void *, void *, void *), void *,
                                   CUmodule, unsigned long long);

static void test_tools_module(void)
{
    const slot *t = get_table(TOOLS_MODULE);
    CHECK_EQ(t[0].size, 8 * sizeof(slot));
    tools_iterator it = (tools_iterator)t[7].fn;
    struct tools_seen s = {0};
    CHECK_EQ(it(PRIMARY_0, TEST_MODULE, tools_collect, &s, TEST_MODULE, 0), CUDA_SUCCESS);
    CHECK_EQ(s.calls, 3);
    CHECK_PTR_EQ(s.owner, (void *)TEST_MODULE);
    CHECK_PTR_EQ(tools_ctx_seen, PRIMARY_0);
    for (int i = 0; i < 3; i++) {
        uint64_t pos;
        memcpy(&pos, s.nodes[i], sizeof pos);
        CHECK_EQ(pos, (uint64_t)i);
        for (int j = 0; j < i; j++)
            CHECK(s.nodes[i] != s.nodes[j]);
    }
    /* The same stand-ins next time (callers may keep them). */
    struct tools_seen again = {0};
    CHECK_EQ(it(NULL, TEST_MODULE, tools_collect, &again, NULL, 0), CUDA_SUCCESS);
    CHECK_PTR_EQ(again.nodes[2], s.nodes[2]);
    /* Flags are passed on (the server decides); other forms are refused here. */
    CHECK_EQ(it(NULL, TEST_MODULE, tools_collect, &again, NULL, 5), CUDA_SUCCESS);
    CHECK_EQ(tools_flags_seen, 5);
    CHECK_EQ(it(NULL, TEST_MODULE, NULL, &again, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(it(NULL, NULL, tools_collect, &again, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(it(NULL, TEST_MODULE, tools_collect, &again, (CUmodule)0x1, 0),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(it(NULL, (CUmodule)0x2, tools_collect, &again, NULL, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(slot_calls(TOOLS_MODULE, 7), 7); /* every call counted, refused ones too */
    /* The other slots are trampolines. */
    CHECK_EQ(((uint32_t(*)(void))t[6].fn)(), CUDA_ERROR_NOT_SUPPORTED);
}

/* ---- simple tables -------------------------------------------------------------------------- */

static void call_unexpected_slots(void)
{
    const slot *t = get_table(CUDART_INTERFACE);
    uint64_t (*fn)(void) = (uint64_t(*)(void))t[9].fn;
    CHECK_EQ(fn(), 0);
    CHECK_EQ(fn(), 0);
    const slot *cls = get_table(CLS);
    fn = (uint64_t(*)(void))cls[31].fn;
    CHECK_EQ(fn(), 0);
}

static void test_simple_tables(void)
{
    const slot *t = get_table(CUDART_INTERFACE);
    CHECK_EQ(t[0].size, 32 * sizeof(slot));
    for (int i = 1; i < 32; i++)
        CHECK(t[i].fn != NULL);
    CUresult (*get_primary)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))t[2].fn;
    CUcontext ctx = NULL;
    CHECK_EQ(get_primary(&ctx, 1), CUDA_SUCCESS);
    CHECK_PTR_EQ(ctx, PRIMARY_1);
    CHECK_EQ(get_primary(&ctx, 0), CUDA_SUCCESS);
    CHECK_PTR_EQ(ctx, PRIMARY_0);
    CHECK_EQ(get_primary(&ctx, 7), CUDA_ERROR_INVALID_DEVICE);
    CHECK_EQ(get_primary(NULL, 0), CUDA_ERROR_INVALID_VALUE);

    t = get_table(TOOLS_HOOKS);
    CHECK_EQ(t[0].size, 32 * sizeof(slot));
    void (*get_buf)(void **, size_t *) = (void (*)(void **, size_t *))t[2].fn;
    void *p = NULL;
    size_t len = 0;
    get_buf(&p, &len);
    CHECK(p != NULL);
    CHECK_EQ(len, 1024);
    for (size_t i = 0; p != NULL && i < len * sizeof(uint32_t); i++)
        CHECK_EQ(((unsigned char *)p)[i], 0);
    get_buf = (void (*)(void **, size_t *))t[6].fn;
    void *p6 = NULL;
    get_buf(&p6, &len);
    CHECK(p6 != NULL && p6 != p);
    CHECK_EQ(len, 14);
    for (size_t i = 0; p6 != NULL && i < len * sizeof(uint32_t); i++)
        CHECK_EQ(((unsigned char *)p6)[i], 0);

    /* Slots measured as "returns 0, writes nothing": the arguments cuBLASLt passes stay as they
     * were. */
    uint64_t sentinel[4] = {0xa5a5, 0xa5a5, 0xa5a5, 0xa5a5};
    static const char *const zero_tables[] = {TOOLS_TLS, T_21318C60, T_1734DC26};
    static const int zero_slots[] = {2, 4, 4};
    for (int i = 0; i < 3; i++) {
        t = get_table(zero_tables[i]);
        CHECK_EQ(t[0].size, 32 * sizeof(slot));
        uint64_t (*fn)(void *, void *, void *) =
            (uint64_t(*)(void *, void *, void *))t[zero_slots[i]].fn;
        CHECK_EQ(fn(&sentinel[0], &sentinel[1], &sentinel[2]), 0);
        for (int k = 0; k < 4; k++)
            CHECK_EQ(sentinel[k], 0xa5a5);
    }

    t = get_table(CONTEXT_CHECKS);
    CHECK_EQ(t[0].size, 32 * sizeof(slot));
    CHECK_EQ(((uint64_t(*)(void))t[3].fn)(), 0);
    CUresult (*check)(CUcontext, uint32_t *, void **) =
        (CUresult(*)(CUcontext, uint32_t *, void **))t[2].fn;
    uint32_t out = 0xdeadbeef;
    void *third = (void *)0x1234;
    CHECK_EQ(check(PRIMARY_0, &out, &third), CUDA_SUCCESS);
    CHECK_EQ(out, 0);
    CHECK_PTR_EQ(third, (void *)0x1234);

    const char *log = capture_stderr(call_unexpected_slots);
    CHECK_STR_EQ(log, "gpupool: export table CUDART_INTERFACE slot 9 called (returned 0)\n"
                      "gpupool: export table CONTEXT_LOCAL_STORAGE slot 31 called (returned 0)\n");
}

/* ---- context-local storage ----------------------------------------------------------------- */

typedef CUresult (*cls_put_fn)(CUcontext, void *, void *, void (*)(CUcontext, void *, void *));
typedef CUresult (*cls_delete_fn)(CUcontext, void *);
typedef CUresult (*cls_get_fn)(void **, CUcontext, void *);
static cls_put_fn cls_put;
static cls_delete_fn cls_delete;
static cls_get_fn cls_get;

/* Destructor log (single-threaded parts only). */
typedef struct dtor_call {
    CUcontext ctx;
    void *key, *value;
} dtor_call;
static dtor_call dtor_calls[64];
static int dtor_count;

static void record_dtor(CUcontext ctx, void *key, void *value)
{
    if (dtor_count < 64)
        dtor_calls[dtor_count] = (dtor_call){ctx, key, value};
    dtor_count++;
}

/* A destructor that uses the table again (cudart's may): must not deadlock. */
static void reentrant_dtor(CUcontext ctx, void *key, void *value)
{
    record_dtor(ctx, key, value);
    void *v = NULL;
    CHECK_EQ(cls_get(&v, ctx, key), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(cls_put((CUcontext)0x77, key, value, NULL), CUDA_SUCCESS);
}

/* A destructor that registers again in the dying context (must not loop forever). */
static int readd_key;
static void readding_dtor(CUcontext ctx, void *key, void *value)
{
    record_dtor(ctx, key, value);
    CHECK_EQ(cls_put(ctx, &readd_key, value, NULL), CUDA_SUCCESS);
}

static void test_cls_basic(void)
{
    const slot *t = get_table(CLS);
    cls_put = (cls_put_fn)t[0].fn;
    cls_delete = (cls_delete_fn)t[1].fn;
    cls_get = (cls_get_fn)t[2].fn;
    CUcontext a = (CUcontext)0x1000, b = (CUcontext)0x2000;
    int key1, key2;
    void *v = (void *)0x1;

    /* Absent. */
    CHECK_EQ(cls_get(&v, a, &key1), CUDA_ERROR_INVALID_HANDLE);
    CHECK_PTR_EQ(v, NULL);
    CHECK_EQ(cls_get(NULL, a, &key1), CUDA_ERROR_INVALID_VALUE);

    CHECK_EQ(cls_put(a, &key1, (void *)0xa1, record_dtor), CUDA_SUCCESS);
    CHECK_EQ(cls_put(a, &key2, (void *)0xa2, record_dtor), CUDA_SUCCESS);
    CHECK_EQ(cls_put(b, &key1, (void *)0xb1, NULL), CUDA_SUCCESS);
    CHECK_EQ(cls_get(&v, a, &key1), CUDA_SUCCESS);
    CHECK_PTR_EQ(v, (void *)0xa1);
    CHECK_EQ(cls_get(&v, b, &key1), CUDA_SUCCESS);
    CHECK_PTR_EQ(v, (void *)0xb1);
    CHECK_EQ(cls_get(&v, b, &key2), CUDA_ERROR_INVALID_HANDLE);

    /* ctx NULL means the calling thread's current context. */
    test_current = a;
    CHECK_EQ(cls_get(&v, NULL, &key2), CUDA_SUCCESS);
    CHECK_PTR_EQ(v, (void *)0xa2);
    CHECK_EQ(cls_put(NULL, &key2, (void *)0xa3, record_dtor), CUDA_SUCCESS); /* replaces */
    CHECK_EQ(cls_get(&v, a, &key2), CUDA_SUCCESS);
    CHECK_PTR_EQ(v, (void *)0xa3);
    test_current = NULL;
    CHECK_EQ(cls_get(&v, NULL, &key2), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_EQ(cls_put(NULL, &key2, (void *)0xa3, NULL), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_EQ(dtor_count, 0); /* replacing does not destroy */

    /* delete unregisters without running the destructor; deleting again is fine. */
    CHECK_EQ(cls_delete(a, &key1), CUDA_SUCCESS);
    CHECK_EQ(cls_get(&v, a, &key1), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(cls_delete(a, &key1), CUDA_SUCCESS);
    CHECK_EQ(dtor_count, 0);
    CHECK_EQ(cls_get(&v, b, &key1), CUDA_SUCCESS);

    /* The context going away runs the remaining destructors, once, with (ctx, key, value). */
    gp_cls_context_destroyed(a);
    CHECK_EQ(dtor_count, 1);
    CHECK_PTR_EQ(dtor_calls[0].ctx, a);
    CHECK_PTR_EQ(dtor_calls[0].key, &key2);
    CHECK_PTR_EQ(dtor_calls[0].value, (void *)0xa3);
    CHECK_EQ(cls_get(&v, a, &key2), CUDA_ERROR_INVALID_HANDLE);
    gp_cls_context_destroyed(a);
    CHECK_EQ(dtor_count, 1);
    /* Entries without a destructor just go. */
    gp_cls_context_destroyed(b);
    CHECK_EQ(cls_get(&v, b, &key1), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(dtor_count, 1);

    /* A destructor that calls back into the table. */
    dtor_count = 0;
    CHECK_EQ(cls_put(a, &key1, (void *)0xc1, reentrant_dtor), CUDA_SUCCESS);
    gp_cls_context_destroyed(a);
    CHECK_EQ(dtor_count, 1);
    CHECK_EQ(cls_get(&v, (CUcontext)0x77, &key1), CUDA_SUCCESS);
    CHECK_PTR_EQ(v, (void *)0xc1);
    gp_cls_context_destroyed((CUcontext)0x77);

    dtor_count = 0;
    CHECK_EQ(cls_put(a, &key1, (void *)0xd1, readding_dtor), CUDA_SUCCESS);
    gp_cls_context_destroyed(a);
    CHECK_EQ(dtor_count, 1);
    CHECK_EQ(cls_get(&v, a, &readd_key), CUDA_SUCCESS);
    gp_cls_context_destroyed(a);
    CHECK_EQ(cls_get(&v, a, &readd_key), CUDA_ERROR_INVALID_HANDLE);
    CHECK_EQ(dtor_count, 1);
}

static void test_cls_many(void)
{
    /* Enough entries to grow the map several times, then delete every other one: lookups must
     * still find the rest (this exercises deletion's backward shift). */
    enum {
        N = 3000
    };
    static char keys[N];
    for (int i = 0; i < N; i++) {
        CUcontext ctx = (CUcontext)(uintptr_t)(0x10000 + (i % 7) * 0x100);
        CHECK_EQ(cls_put(ctx, &keys[i], (void *)(uintptr_t)(i + 1), NULL), CUDA_SUCCESS);
    }
    for (int i = 0; i < N; i += 2) {
        CUcontext ctx = (CUcontext)(uintptr_t)(0x10000 + (i % 7) * 0x100);
        CHECK_EQ(cls_delete(ctx, &keys[i]), CUDA_SUCCESS);
    }
    for (int i = 0; i < N; i++) {
        CUcontext ctx = (CUcontext)(uintptr_t)(0x10000 + (i % 7) * 0x100);
        void *v = NULL;
        CUresult rc = cls_get(&v, ctx, &keys[i]);
        if (i % 2) {
            CHECK_EQ(rc, CUDA_SUCCESS);
            CHECK_PTR_EQ(v, (void *)(uintptr_t)(i + 1));
        } else {
            CHECK_EQ(rc, CUDA_ERROR_INVALID_HANDLE);
        }
    }
    for (int c = 0; c < 7; c++)
        gp_cls_context_destroyed((CUcontext)(uintptr_t)(0x10000 + c * 0x100));
    for (int i = 1; i < N; i += 2) {
        CUcontext ctx = (CUcontext)(uintptr_t)(0x10000 + (i % 7) * 0x100);
        void *v = NULL;
        CHECK_EQ(cls_get(&v, ctx, &keys[i]), CUDA_ERROR_INVALID_HANDLE);
    }
}

static void *cls_thread(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    CUcontext ctx = (CUcontext)(0x500000 + id * 0x1000);
    test_current = ctx;
    static char keys[8][64];
    int bad = 0;
    for (int round = 0; round < 2000; round++) {
        char *key = &keys[id][round % 64];
        void *v = NULL;
        bad += cls_put(NULL, key, (void *)(uintptr_t)(round + 1), NULL) != CUDA_SUCCESS;
        bad += cls_get(&v, NULL, key) != CUDA_SUCCESS || v != (void *)(uintptr_t)(round + 1);
        if (round % 3 == 0)
            bad += cls_delete(ctx, key) != CUDA_SUCCESS;
    }
    gp_cls_context_destroyed(ctx);
    return (void *)(uintptr_t)bad;
}

static void test_cls_threads(void)
{
    pthread_t th[8];
    for (uintptr_t i = 0; i < 8; i++)
        CHECK_EQ(pthread_create(&th[i], NULL, cls_thread, (void *)i), 0);
    for (int i = 0; i < 8; i++) {
        void *bad = (void *)1;
        CHECK_EQ(pthread_join(th[i], &bad), 0);
        CHECK_EQ((uintptr_t)bad, 0);
    }
}

/* ---- integrity ------------------------------------------------------------------------------- */

typedef CUresult (*integrity_fn)(unsigned int, unsigned long long, unsigned long long *);

/* The expected answer, built independently of integrity.c and hmac_md2.c: the message packed
 * with memcpy from native values (x86-64 is little-endian) and HMAC spelled out with MD2. */
static void expected_integrity(unsigned int version, unsigned long long secs, const void *fn,
                               unsigned long long out[2])
{
    unsigned char msg[48 + 28 * 2];
    uint32_t u32[4] = {(uint32_t)test_driver_version, version, (uint32_t)getpid(),
                       (uint32_t)pthread_self()};
    uint64_t u64[4] = {(uint64_t)(uintptr_t)get_table(CUDART_INTERFACE),
                       (uint64_t)(uintptr_t)get_table(INTEGRITY), (uint64_t)(uintptr_t)fn,
                       (uint64_t)secs};
    memcpy(msg, u32, 16);
    memcpy(msg + 16, u64, 32);
    for (int d = 0; d < 2; d++) {
        memcpy(msg + 48 + 28 * d, test_uuids[d].bytes, 16);
        int32_t pci[3] = {test_pci[d][0], test_pci[d][1], test_pci[d][2]};
        memcpy(msg + 48 + 28 * d + 16, pci, 12);
    }
    static const unsigned char key[16] = {0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52,
                                          0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F};
    unsigned char block[16], inner[16], digest[16];
    gp_md2_ctx ctx;
    for (int i = 0; i < 16; i++)
        block[i] = key[i] ^ 0x36;
    gp_md2_init(&ctx);
    gp_md2_update(&ctx, block, 16);
    gp_md2_update(&ctx, msg, sizeof msg);
    gp_md2_final(&ctx, inner);
    for (int i = 0; i < 16; i++)
        block[i] = key[i] ^ 0x5c;
    gp_md2_init(&ctx);
    gp_md2_update(&ctx, block, 16);
    gp_md2_update(&ctx, inner, 16);
    gp_md2_final(&ctx, digest);
    memcpy(out, digest, 16);
}

static void test_integrity(void)
{
    const slot *t = get_table(INTEGRITY);
    CHECK_EQ(t[0].size, 32 * sizeof(slot));
    integrity_fn check = (integrity_fn)t[1].fn;
    unsigned long long out[2] = {0, 0};

    /* The fixed answers (cudart's first two calls: 13000 and 13001). */
    CHECK_EQ(check(13000, 1795323445ull, out), CUDA_SUCCESS);
    CHECK_EQ(out[0], 0x3341181C03CB675CULL);
    CHECK_EQ(out[1], 0x8ED383AA1F4CD1E8ULL);
    CHECK_EQ(check(13001, 1795323445ull, out), CUDA_SUCCESS);
    CHECK_EQ(out[0], 0x1841181C03CB675CULL);
    CHECK_EQ(out[1], 0x8ED383AA1F4CD1E8ULL);
    CHECK_EQ(check(12090, 1, out), CUDA_SUCCESS);
    CHECK_EQ(out[0], 0x3341181C03CB675CULL);

    /* The computed answer (cudart's third call). */
    unsigned long long want[2];
    CHECK_EQ(check(13002, 1795323445ull, out), CUDA_SUCCESS);
    expected_integrity(13002, 1795323445ull, (const void *)t[1].fn, want);
    CHECK_EQ(out[0], want[0]);
    CHECK_EQ(out[1], want[1]);

    /* Everything in the message matters: the time, the version, the reported driver version. */
    unsigned long long other[2];
    CHECK_EQ(check(13002, 1795323446ull, other), CUDA_SUCCESS);
    CHECK(other[0] != out[0] || other[1] != out[1]);
    expected_integrity(13002, 1795323446ull, (const void *)t[1].fn, want);
    CHECK_EQ(other[0], want[0]);
    CHECK_EQ(other[1], want[1]);
    test_driver_version = 13020;
    CHECK_EQ(check(13002, 1795323445ull, other), CUDA_SUCCESS);
    CHECK(other[0] != out[0] || other[1] != out[1]);
    expected_integrity(13002, 1795323445ull, (const void *)t[1].fn, want);
    CHECK_EQ(other[0], want[0]);
    CHECK_EQ(other[1], want[1]);
    test_driver_version = 13000;

    /* No device list yet: refuse rather than answer wrongly. */
    test_device_count = -1;
    CHECK_EQ(check(13002, 1, other), CUDA_ERROR_NOT_INITIALIZED);
    test_device_count = 2;
    CHECK_EQ(check(13002, 1, NULL), CUDA_ERROR_INVALID_VALUE);
}

int main(void)
{
    test_lookup();
    test_trampolines();
    test_tools_module();
    test_no_server_answer();
    test_simple_tables();
    test_cls_basic();
    test_cls_many();
    test_cls_threads();
    test_integrity();
    return gp_test_done("test_export_tables");
}
