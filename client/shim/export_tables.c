/*
 * export_tables.c: cuGetExportTable and the tables it serves (facts section 4).
 *
 * Each table is a constant array of pointer-sized slots. Where the driver convention has one,
 * slot 0 holds the table's size in bytes; the CONTEXT_LOCAL_STORAGE table has no size word.
 * Every table has GP_ET_SLOTS slots, far more than any caller was seen to use: a slot nobody
 * told us about holds a function that logs "gpupool: export table X slot N called" once and
 * returns 0, instead of a NULL (or a neighbouring table's word) that the caller would jump to.
 *
 * The tables above never talk to the server: cudart calls the context-local-storage "get" about
 * once per runtime call, so a round trip there would cost more than the work itself.
 *
 * A table none of them is (a uuid the shim does not implement) is asked about once: if the
 * server's driver knows it, the caller gets a table of trampolines of the driver's table's size
 * (the slot count the worker read from its size word), each of which logs "gpupool: export table
 * <uuid> slot N called" once and returns CUDA_ERROR_NOT_SUPPORTED; if not, it is refused as the
 * driver refuses an unknown uuid. The tools-module table is served that way too, with its slot 7
 * (a module's function iterator) run on the server. Every call of these tables' slots is counted
 * (gp_export_table_slot_calls).
 */
#include "export_tables.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "integrity.h"

#define GP_ET_SLOTS 32

/* A slot holds either the size word or a function. The functions have many signatures; they are
 * stored as one function-pointer type and called by the consumer with its own. */
typedef void (*gp_et_fn)(void);
typedef union gp_et_slot {
    size_t size;
    gp_et_fn fn;
} gp_et_slot;

enum gp_et_table {
    ET_CUDART_INTERFACE,
    ET_TOOLS_RUNTIME_CALLBACK_HOOKS,
    ET_TOOLS_TLS,
    ET_CONTEXT_LOCAL_STORAGE,
    ET_CONTEXT_CHECKS,
    ET_INTEGRITY_CHECK,
    ET_21318C60,
    ET_1734DC26,
    ET_COUNT
};

static const char *const table_names[ET_COUNT] = {
    [ET_CUDART_INTERFACE] = "CUDART_INTERFACE",
    [ET_TOOLS_RUNTIME_CALLBACK_HOOKS] = "TOOLS_RUNTIME_CALLBACK_HOOKS",
    [ET_TOOLS_TLS] = "TOOLS_TLS",
    [ET_CONTEXT_LOCAL_STORAGE] = "CONTEXT_LOCAL_STORAGE",
    [ET_CONTEXT_CHECKS] = "CONTEXT_CHECKS",
    [ET_INTEGRITY_CHECK] = "INTEGRITY_CHECK",
    [ET_21318C60] = "21318c60",
    [ET_1734DC26] = "1734dc26",
};

/* UUIDs in memory byte order (the order the caller's CUuuid holds them). */
static const uint8_t UUID_F8CFF951[16] = {0xf8, 0xcf, 0xf9, 0x51, 0x21, 0x46, 0x8b, 0x4e,
                                          0xb9, 0xe2, 0xfb, 0x46, 0x9e, 0x7c, 0x0d, 0xd9};
static const uint8_t table_uuids[ET_COUNT][16] = {
    [ET_CUDART_INTERFACE] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39,
                             0x12, 0xfd, 0x9d, 0xf9},
    [ET_TOOLS_RUNTIME_CALLBACK_HOOKS] = {0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2,
                                         0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66},
    [ET_TOOLS_TLS] = {0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a,
                      0x3a, 0xec, 0xdc},
    [ET_CONTEXT_LOCAL_STORAGE] = {0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68,
                                  0xf3, 0x55, 0xd8, 0x95, 0x93},
    [ET_CONTEXT_CHECKS] = {0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5,
                           0x00, 0x6d, 0xfa, 0x7e},
    [ET_INTEGRITY_CHECK] = {0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12,
                            0x3c, 0x66, 0xe1, 0xf2},
    [ET_21318C60] = {0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73,
                     0x24, 0xc8, 0xf2},
    [ET_1734DC26] = {0x17, 0x34, 0xdc, 0x26, 0x80, 0x0d, 0x47, 0x45, 0x87, 0x26, 0xc0, 0xf1, 0xe7,
                     0xdd, 0x8b, 0xca},
};

/* ---- logging ------------------------------------------------------------------------------ */

static pthread_once_t quiet_once = PTHREAD_ONCE_INIT;
static int quiet_flag; /* written once under quiet_once, read-only afterwards */

static void read_quiet(void)
{
    const char *env = getenv("GPUPOOL_LOG");
    quiet_flag = (env != NULL && strcmp(env, "quiet") == 0);
}

static int quiet(void)
{
    if (pthread_once(&quiet_once, read_quiet) != 0)
        return 0; /* cannot happen; rather log than hide */
    return quiet_flag;
}

static void format_uuid(const uint8_t b[16], char out[37])
{
    (void)snprintf(out, 37, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                   b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
                   b[13], b[14], b[15]);
}

/* ---- slots nobody was seen to call: log once, return 0 ---------------------------------- */

/* One flag per (table, slot): lock-free, and a duplicate line in a race is harmless. */
static atomic_uchar slot_logged[ET_COUNT][GP_ET_SLOTS];

static uint64_t unexpected_slot(enum gp_et_table t, int slot)
{
    if (!atomic_exchange(&slot_logged[t][slot], 1) && !quiet())
        (void)fprintf(stderr, "gpupool: export table %s slot %d called (returned 0)\n",
                      table_names[t], slot);
    /* 64-bit zero: whatever the caller's return type, the whole register reads 0. */
    return 0;
}

/* A table clang-format cannot lay out stably: kept as written. */
// clang-format off
#define GP_ET_SLOT_NUMBERS(X, t)                                                                \
    X(t, 0) X(t, 1) X(t, 2) X(t, 3) X(t, 4) X(t, 5) X(t, 6) X(t, 7) X(t, 8) X(t, 9) X(t, 10)     \
    X(t, 11) X(t, 12) X(t, 13) X(t, 14) X(t, 15) X(t, 16) X(t, 17) X(t, 18) X(t, 19) X(t, 20)   \
    X(t, 21) X(t, 22) X(t, 23) X(t, 24) X(t, 25) X(t, 26) X(t, 27) X(t, 28) X(t, 29) X(t, 30)   \
    X(t, 31)
// clang-format on

/* A distinct function per (table, slot) so that the log line can say which slot was called. */
#define GP_ET_DEFINE_FILLER(t, n)                                                                  \
    static uint64_t filler_##t##_##n(void)                                                         \
    {                                                                                              \
        return unexpected_slot(t, n);                                                              \
    }
#define GP_ET_FILLER_INIT(t, n) [n] = {.fn = (gp_et_fn)filler_##t##_##n},

GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_CUDART_INTERFACE)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_TOOLS_RUNTIME_CALLBACK_HOOKS)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_TOOLS_TLS)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_CONTEXT_LOCAL_STORAGE)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_CONTEXT_CHECKS)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_INTEGRITY_CHECK)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_21318C60)
GP_ET_SLOT_NUMBERS(GP_ET_DEFINE_FILLER, ET_1734DC26)

/* ---- CUDART_INTERFACE ----------------------------------------------------------------------- */

/* Slot 2: the device's primary context, not retained and not made current: cudart retains it
 * itself afterwards (cuDevicePrimaryCtxRetain). */
static CUresult cudart_get_primary_ctx(CUcontext *pctx, CUdevice dev)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext ctx = gp_ctx_primary_for_tables(dev);
    if (ctx == NULL) {
        *pctx = NULL;
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *pctx = ctx;
    return CUDA_SUCCESS;
}

/* ---- TOOLS_RUNTIME_CALLBACK_HOOKS ---------------------------------------------------------- */

/* Slots 2 and 6 hand out (pointer, length) of zeroed, driver-owned buffers: all zero means "no
 * tool has installed callbacks". We assume the signature void fn(void **ptr, size_t *len) and
 * report the lengths the facts give (1024 and 14) as element counts. The unit of the length is
 * not known for certain (bytes, u32 or u64 elements), so the buffers have 8-byte elements: the
 * caller stays inside them whichever unit it reads the length in.
 * The caller owns what it writes there (as with the driver's buffers); the shim never reads it. */
static uint64_t hooks_buffer_2[1024];
static uint64_t hooks_buffer_6[14];

static void hooks_get_buffer_2(void **ptr, size_t *len)
{
    if (ptr != NULL)
        *ptr = hooks_buffer_2;
    if (len != NULL)
        *len = sizeof hooks_buffer_2 / sizeof hooks_buffer_2[0];
}

static void hooks_get_buffer_6(void **ptr, size_t *len)
{
    if (ptr != NULL)
        *ptr = hooks_buffer_6;
    if (len != NULL)
        *len = sizeof hooks_buffer_6 / sizeof hooks_buffer_6[0];
}

/* ---- slots that are called and for which "0, nothing written" is the measured answer -------- */

/* TOOLS_TLS slot 2 (cuBLASLt), 21318c60 / 1734dc26 slot 4 (cuBLASLt GEMM, fp16 path),
 * CONTEXT_CHECKS slot 3 (cudart init). Argument lists unknown and ignored. */
static uint64_t known_slot_returns_zero(void)
{
    return 0;
}

/* ---- CONTEXT_CHECKS ------------------------------------------------------------------------- */

/* Slot 2: context_check(ctx, u32 *out, void **) at context use and synchronisation; the answer
 * "0 and *out = 0" lets cudart go on. The third argument is left alone. */
static CUresult context_check(CUcontext ctx, uint32_t *out, void **unused)
{
    (void)ctx;
    (void)unused;
    if (out != NULL)
        *out = 0;
    return CUDA_SUCCESS;
}

/* ---- CONTEXT_LOCAL_STORAGE ------------------------------------------------------------------ */

/* Destructor signature as we understand it: destructor(ctx, key, value). */
typedef void (*gp_cls_dtor)(CUcontext ctx, void *key, void *value);

typedef struct cls_entry {
    CUcontext ctx;
    void *key;
    void *value;
    gp_cls_dtor dtor;
    int used;
} cls_entry;

/* Open-addressing hash map keyed by (ctx, key), linear probing, deletion by backward shift (no
 * tombstones, so lookups stay short). A handful of entries per context in practice; one mutex
 * is cheap uncontended and the critical sections are a few probes long. */
static pthread_mutex_t cls_lock = PTHREAD_MUTEX_INITIALIZER;
static cls_entry *cls_slots; /* guarded by cls_lock */
static size_t cls_cap;       /* guarded by cls_lock; 0 or a power of two */
static size_t cls_count;     /* guarded by cls_lock */

static size_t cls_hash(CUcontext ctx, void *key)
{
    /* splitmix64 finaliser over both pointers: pointers share low and high bits, so they must
     * be mixed before masking. */
    uint64_t x = (uint64_t)(uintptr_t)ctx * 0x9e3779b97f4a7c15u ^ (uint64_t)(uintptr_t)key;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9u;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebu;
    x ^= x >> 31;
    return (size_t)x;
}

/* Slot of (ctx, key), or of the empty slot where it would go. Caller holds the lock; cap > 0. */
static size_t cls_probe(CUcontext ctx, void *key)
{
    size_t mask = cls_cap - 1;
    size_t i = cls_hash(ctx, key) & mask;
    while (cls_slots[i].used && !(cls_slots[i].ctx == ctx && cls_slots[i].key == key))
        i = (i + 1) & mask;
    return i;
}

/* Caller holds the lock. Returns 0, or -1 if memory ran out (the map is unchanged then). */
static int cls_grow(void)
{
    size_t new_cap = cls_cap ? cls_cap * 2 : 64;
    cls_entry *fresh = calloc(new_cap, sizeof *fresh);
    if (fresh == NULL)
        return -1;
    cls_entry *old = cls_slots;
    size_t old_cap = cls_cap;
    cls_slots = fresh;
    cls_cap = new_cap;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].used)
            cls_slots[cls_probe(old[i].ctx, old[i].key)] = old[i];
    free(old);
    return 0;
}

/* Remove the entry in slot i and close the gap. Caller holds the lock. */
static void cls_remove_at(size_t i)
{
    size_t mask = cls_cap - 1;
    cls_slots[i].used = 0;
    cls_count--;
    for (size_t j = (i + 1) & mask; cls_slots[j].used; j = (j + 1) & mask) {
        size_t home = cls_hash(cls_slots[j].ctx, cls_slots[j].key) & mask;
        /* Move j back into the hole i unless its home lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            cls_slots[i] = cls_slots[j];
            cls_slots[j].used = 0;
            i = j;
        }
    }
}

static CUresult cls_resolve_ctx(CUcontext *ctx)
{
    if (*ctx == NULL)
        *ctx = gp_ctx_current_for_tables();
    return *ctx == NULL ? CUDA_ERROR_INVALID_CONTEXT : CUDA_SUCCESS;
}

/* Slot 0: put(ctx, key, value, destructor). A second put for the same (ctx, key) replaces the
 * value and destructor without running the old destructor (the caller replaced its own data). */
static CUresult cls_put(CUcontext ctx, void *key, void *value, gp_cls_dtor dtor)
{
    CUresult rc = cls_resolve_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pthread_mutex_lock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    rc = CUDA_SUCCESS;
    if ((cls_count + 1) * 2 > cls_cap && cls_grow() != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        size_t i = cls_probe(ctx, key);
        if (!cls_slots[i].used)
            cls_count++;
        cls_slots[i] = (cls_entry){.ctx = ctx, .key = key, .value = value, .dtor = dtor, .used = 1};
    }
    if (pthread_mutex_unlock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    return rc;
}

/* Slot 1: delete(ctx, key). Does NOT run the destructor: like pthread_key_delete, deleting is
 * the owner unregistering its data (cudart calls it during its own teardown, after or before
 * freeing the value itself); running the destructor as well could free the value twice. The
 * destructor is for the context going away underneath the owner (gp_cls_context_destroyed).
 * Deleting an absent entry succeeds: teardown after a context reset must not fail. */
static CUresult cls_delete(CUcontext ctx, void *key)
{
    CUresult rc = cls_resolve_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pthread_mutex_lock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    if (cls_cap > 0) {
        size_t i = cls_probe(ctx, key);
        if (cls_slots[i].used)
            cls_remove_at(i);
    }
    if (pthread_mutex_unlock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    return CUDA_SUCCESS;
}

/* Slot 2: get(&value, ctx, key) -> CUDA_ERROR_INVALID_HANDLE (and value NULL) if absent. */
static CUresult cls_get(void **value, CUcontext ctx, void *key)
{
    if (value == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *value = NULL;
    CUresult rc = cls_resolve_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pthread_mutex_lock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    rc = CUDA_ERROR_INVALID_HANDLE;
    if (cls_cap > 0) {
        size_t i = cls_probe(ctx, key);
        if (cls_slots[i].used) {
            *value = cls_slots[i].value;
            rc = CUDA_SUCCESS;
        }
    }
    if (pthread_mutex_unlock(&cls_lock) != 0)
        return CUDA_ERROR_UNKNOWN;
    return rc;
}

void gp_cls_context_destroyed(CUcontext ctx)
{
    if (ctx == NULL)
        return;
    /* One entry per pass, destructor called without the lock held: destructors are cudart code
     * and may call back into the driver (and into this table). A context has a handful of
     * entries, so rescanning is cheaper than allocating a list. At most as many entries as the
     * context has now are destroyed, so a destructor that registers again for the same context
     * cannot make this loop forever. */
    size_t remaining = 0;
    if (pthread_mutex_lock(&cls_lock) != 0)
        return;
    for (size_t i = 0; i < cls_cap; i++)
        remaining += cls_slots[i].used && cls_slots[i].ctx == ctx;
    if (pthread_mutex_unlock(&cls_lock) != 0)
        return;
    for (; remaining > 0; remaining--) {
        cls_entry found = {0};
        if (pthread_mutex_lock(&cls_lock) != 0)
            return;
        for (size_t i = 0; i < cls_cap; i++) {
            if (cls_slots[i].used && cls_slots[i].ctx == ctx) {
                found = cls_slots[i];
                cls_remove_at(i);
                break;
            }
        }
        if (pthread_mutex_unlock(&cls_lock) != 0)
            return;
        if (!found.used)
            return;
        if (found.dtor != NULL)
            found.dtor(found.ctx, found.key, found.value);
    }
}

/* ---- the tables ------------------------------------------------------------------------------ */

#define GP_ET_SIZE_WORD [0] = {.size = GP_ET_SLOTS * sizeof(gp_et_slot)}

/* INTEGRITY_CHECK slot 1: the answer hashes this function's address and the two tables'. */
static CUresult integrity_check_slot(unsigned int version, unsigned long long unix_seconds,
                                     unsigned long long out[2])
{
    const gp_integrity_addresses addr = {
        .cudart_interface = gp_export_table_cudart_interface(),
        .integrity_table = gp_export_table_integrity_check(),
        .check_fn = (const void *)(uintptr_t)&integrity_check_slot,
    };
    return gp_integrity_answer(version, unix_seconds, &addr, out);
}

/* Each table starts from "every slot logs and returns 0" and then names its known slots; the
 * later designated initializer wins (C11 6.7.9p19). GCC's -Woverride-init (in -Wextra) flags
 * exactly this on purpose, so it is silenced for these definitions only. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverride-init"

static const gp_et_slot cudart_interface[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_CUDART_INTERFACE) GP_ET_SIZE_WORD,
    [2] = {.fn = (gp_et_fn)cudart_get_primary_ctx},
};

static const gp_et_slot tools_runtime_callback_hooks[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_TOOLS_RUNTIME_CALLBACK_HOOKS) GP_ET_SIZE_WORD,
    [2] = {.fn = (gp_et_fn)hooks_get_buffer_2},
    [6] = {.fn = (gp_et_fn)hooks_get_buffer_6},
};

static const gp_et_slot tools_tls[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_TOOLS_TLS) GP_ET_SIZE_WORD,
    [2] = {.fn = (gp_et_fn)known_slot_returns_zero},
};

/* No size word: slot 0 is put. */
static const gp_et_slot context_local_storage[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_CONTEXT_LOCAL_STORAGE)[0] = {.fn = (gp_et_fn)cls_put},
    [1] = {.fn = (gp_et_fn)cls_delete},
    [2] = {.fn = (gp_et_fn)cls_get},
};

static const gp_et_slot context_checks[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_CONTEXT_CHECKS) GP_ET_SIZE_WORD,
    [2] = {.fn = (gp_et_fn)context_check},
    [3] = {.fn = (gp_et_fn)known_slot_returns_zero},
};

static const gp_et_slot integrity_check[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_INTEGRITY_CHECK) GP_ET_SIZE_WORD,
    [1] = {.fn = (gp_et_fn)integrity_check_slot},
};

/* Unnamed tables used by cuBLASLt: slot 4 answers 0 and writes nothing (measured enough for
 * GEMM); every other slot is the harmless log-once-and-return-0 filler. */
static const gp_et_slot table_21318c60[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_21318C60) GP_ET_SIZE_WORD,
    [4] = {.fn = (gp_et_fn)known_slot_returns_zero},
};

static const gp_et_slot table_1734dc26[GP_ET_SLOTS] = {
    GP_ET_SLOT_NUMBERS(GP_ET_FILLER_INIT, ET_1734DC26) GP_ET_SIZE_WORD,
    [4] = {.fn = (gp_et_fn)known_slot_returns_zero},
};

#pragma GCC diagnostic pop

static const gp_et_slot *const tables[ET_COUNT] = {
    [ET_CUDART_INTERFACE] = cudart_interface,
    [ET_TOOLS_RUNTIME_CALLBACK_HOOKS] = tools_runtime_callback_hooks,
    [ET_TOOLS_TLS] = tools_tls,
    [ET_CONTEXT_LOCAL_STORAGE] = context_local_storage,
    [ET_CONTEXT_CHECKS] = context_checks,
    [ET_INTEGRITY_CHECK] = integrity_check,
    [ET_21318C60] = table_21318c60,
    [ET_1734DC26] = table_1734dc26,
};

const void *gp_export_table_cudart_interface(void)
{
    return cudart_interface;
}

const void *gp_export_table_integrity_check(void)
{
    return integrity_check;
}

/* ---- tables the shim does not implement: trampolines ----------------------------------------- */

/* At most GP_ET_DYN_TABLES such tables of at most GP_ET_DYN_SLOTS slots each: each slot needs
 * a function of its own that knows its (table, slot), and C has no closures, so the functions
 * are made by the macros below. A driver table longer than that gets a size word of our size. */
#define GP_ET_DYN_TABLES 8
#define GP_ET_DYN_SLOTS 128
/* Module functions the shim hands stand-in nodes for in one iteration, at most. */
#define GP_TOOLS_MAX_NODES (1u << 20)

static const uint8_t UUID_TOOLS_MODULE[16] = {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d,
                                              0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e};

/* dyn_used, dyn_uuid and dyn_table[t] are written under dyn_lock before table t is handed out,
 * and only read afterwards (the reader got the table from cuGetExportTable, through the lock). */
static pthread_mutex_t dyn_lock = PTHREAD_MUTEX_INITIALIZER;
static int dyn_used;
static uint8_t dyn_uuid[GP_ET_DYN_TABLES][16];
static gp_et_slot dyn_table[GP_ET_DYN_TABLES][GP_ET_DYN_SLOTS];
static atomic_uchar dyn_logged[GP_ET_DYN_TABLES][GP_ET_DYN_SLOTS];
static atomic_uint_least64_t dyn_calls[GP_ET_DYN_TABLES][GP_ET_DYN_SLOTS];

static uint64_t trampoline(int t, int slot)
{
    atomic_fetch_add_explicit(&dyn_calls[t][slot], 1, memory_order_relaxed);
    if (!atomic_exchange(&dyn_logged[t][slot], 1) && !quiet()) {
        char text[37];
        format_uuid(dyn_uuid[t], text);
        (void)fprintf(stderr,
                      "gpupool: export table %s slot %d called (returned "
                      "CUDA_ERROR_NOT_SUPPORTED: gpupool does not forward it)\n",
                      text, slot);
    }
    /* Whatever the caller's return type: the low 32 bits read as the CUresult. */
    return CUDA_ERROR_NOT_SUPPORTED;
}

// clang-format off
#define GP_ET_TEN(X, t, h)                                                                      \
    X(t, h##0) X(t, h##1) X(t, h##2) X(t, h##3) X(t, h##4)                                      \
    X(t, h##5) X(t, h##6) X(t, h##7) X(t, h##8) X(t, h##9)
#define GP_ET_DYN_SLOT_NUMBERS(X, t)                                                            \
    GP_ET_TEN(X, t, ) GP_ET_TEN(X, t, 1) GP_ET_TEN(X, t, 2) GP_ET_TEN(X, t, 3)                  \
    GP_ET_TEN(X, t, 4) GP_ET_TEN(X, t, 5) GP_ET_TEN(X, t, 6) GP_ET_TEN(X, t, 7)                 \
    GP_ET_TEN(X, t, 8) GP_ET_TEN(X, t, 9) GP_ET_TEN(X, t, 10) GP_ET_TEN(X, t, 11)               \
    X(t, 120) X(t, 121) X(t, 122) X(t, 123) X(t, 124) X(t, 125) X(t, 126) X(t, 127)
#define GP_ET_DYN_TABLE_NUMBERS(X)                                                              \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
// clang-format on

#define GP_ET_DEFINE_TRAMPOLINE(t, n)                                                              \
    static uint64_t trampoline_##t##_##n(void)                                                     \
    {                                                                                              \
        return trampoline(t, n);                                                                   \
    }
#define GP_ET_TRAMPOLINE_REF(t, n) (gp_et_fn) trampoline_##t##_##n,
#define GP_ET_DEFINE_TABLE_TRAMPOLINES(t) GP_ET_DYN_SLOT_NUMBERS(GP_ET_DEFINE_TRAMPOLINE, t)
#define GP_ET_TABLE_TRAMPOLINE_REFS(t) {GP_ET_DYN_SLOT_NUMBERS(GP_ET_TRAMPOLINE_REF, t)},

GP_ET_DYN_TABLE_NUMBERS(GP_ET_DEFINE_TABLE_TRAMPOLINES)

static const gp_et_fn trampolines[GP_ET_DYN_TABLES][GP_ET_DYN_SLOTS] = {
    GP_ET_DYN_TABLE_NUMBERS(GP_ET_TABLE_TRAMPOLINE_REFS)};

_Static_assert(GP_ET_DYN_TABLES == 8 && GP_ET_DYN_SLOTS == 128,
               "the trampoline macros make 8 tables of 128 slots");

/* ---- the tools-module table's slot 7: a module's functions, iterated on the server ---------- */

typedef void (*gp_tools_cb)(void *opaque, void *node, void *owner);

/* Stand-in nodes: the driver's node for a function is its own structure, which cannot cross the
 * network. The callback gets instead the address of a 64-byte record owned by the shim, distinct
 * for each position in the iteration, whose first 8 bytes hold the position (0, 1, ...) and the
 * rest zero. Callers may keep the pointers, so records are never freed: a longer iteration gets
 * a new, larger array and the old one stays (at most twice the largest iteration). */
#define STANDIN_BYTES 64
static pthread_mutex_t standin_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *standin; /* guarded by standin_lock */
static uint32_t standin_count; /* guarded by standin_lock */

static unsigned char *standin_nodes(uint32_t n)
{
    unsigned char *base = NULL;
    if (pthread_mutex_lock(&standin_lock) != 0)
        return NULL;
    if (n > standin_count) {
        uint32_t want = n < 256 ? 256 : n;
        unsigned char *fresh = aligned_alloc(STANDIN_BYTES, (size_t)want * STANDIN_BYTES);
        if (fresh != NULL) {
            memset(fresh, 0, (size_t)want * STANDIN_BYTES);
            for (uint32_t i = 0; i < want; i++) {
                uint64_t pos = i;
                memcpy(fresh + (size_t)i * STANDIN_BYTES, &pos, sizeof pos);
            }
            standin = fresh; /* the old array stays: callers may hold its records */
            standin_count = want;
        }
    }
    if (n <= standin_count)
        base = standin;
    if (pthread_mutex_unlock(&standin_lock) != 0)
        return NULL;
    return base;
}

static _Atomic int tools_table = -1; /* the dyn table serving the tools-module uuid, or -1 */

/* it(ctx, module, cb, opaque, module, 0): the driver calls cb(opaque, node, owner) once per
 * function of the module; here the server's driver iterates and the client's callback is called
 * as many times, with stand-in nodes and the caller's module as the owner. */
static CUresult tools_module_functions(CUcontext ctx, CUmodule module, gp_tools_cb cb, void *opaque,
                                       CUmodule module2, unsigned long long flags)
{
    int t = atomic_load(&tools_table);
    if (t >= 0)
        atomic_fetch_add_explicit(&dyn_calls[t][7], 1, memory_order_relaxed);
    if (cb == NULL || module == NULL || (module2 != NULL && module2 != module))
        return CUDA_ERROR_INVALID_VALUE; /* only the form every caller was seen to use */
    int32_t value = 0;
    uint32_t count = 0;
    CUresult r = gp_tools_module_functions_for_tables(ctx, module, flags, &value, &count);
    if (r != CUDA_SUCCESS)
        return r;
    if (count > GP_TOOLS_MAX_NODES) {
        (void)fprintf(stderr,
                      "gpupool: export table tools-module slot 7: the server's driver iterated "
                      "%u functions, more than gpupool hands out (%u): returned "
                      "CUDA_ERROR_NOT_SUPPORTED\n",
                      count, GP_TOOLS_MAX_NODES);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    unsigned char *nodes = count > 0 ? standin_nodes(count) : NULL;
    if (count > 0 && nodes == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < count; i++)
        cb(opaque, nodes + (size_t)i * STANDIN_BYTES, (void *)module);
    return (CUresult)value;
}

/* ---- which tables are served as trampolines ----------------------------------------------- */

static int dyn_find_locked(const uint8_t id[16])
{
    for (int t = 0; t < dyn_used; t++)
        if (memcmp(dyn_uuid[t], id, 16) == 0)
            return t;
    return -1;
}

/* Table t for uuid id, of `slots` slots as the server's driver reported (0: no size word). */
static void dyn_fill_locked(int t, const uint8_t id[16], int slots)
{
    memcpy(dyn_uuid[t], id, 16);
    int n = slots > GP_ET_DYN_SLOTS || slots == 0 ? GP_ET_DYN_SLOTS : slots;
    for (int i = 0; i < GP_ET_DYN_SLOTS; i++)
        dyn_table[t][i].fn = trampolines[t][i];
    if (slots > 0)
        dyn_table[t][0].size = (size_t)n * sizeof(gp_et_slot);
    if (memcmp(id, UUID_TOOLS_MODULE, 16) == 0 && n > 7) {
        dyn_table[t][7].fn = (gp_et_fn)tools_module_functions;
        atomic_store(&tools_table, t);
    }
}

/* The trampoline table for id, asking the server about it the first time; NULL: refuse it, and
 * *unknown = 1 when that is because the server's driver does not know it either. */
static const void *dyn_table_for(const uint8_t id[16], int *unknown)
{
    if (pthread_mutex_lock(&dyn_lock) != 0)
        return NULL;
    int t = dyn_find_locked(id);
    if (pthread_mutex_unlock(&dyn_lock) != 0 || t >= 0)
        return t >= 0 ? dyn_table[t] : NULL;
    CUuuid uuid;
    memcpy(uuid.bytes, id, 16);
    int slots = gp_export_table_slots_for_tables(&uuid); /* a round trip: not under the lock */
    if (slots < 0) {
        *unknown = slots == -1;
        return NULL;
    }
    int full = 0, fresh = 0;
    if (pthread_mutex_lock(&dyn_lock) != 0)
        return NULL;
    t = dyn_find_locked(id); /* another thread may have asked meanwhile */
    if (t < 0 && dyn_used < GP_ET_DYN_TABLES) {
        t = dyn_used;
        dyn_fill_locked(t, id, slots);
        dyn_used++;
        fresh = 1;
    }
    full = t < 0;
    if (pthread_mutex_unlock(&dyn_lock) != 0)
        return NULL;
    char text[37];
    format_uuid(id, text);
    if (full) {
        (void)fprintf(stderr,
                      "gpupool: cuGetExportTable: table %s refused (CUDA_ERROR_INVALID_VALUE): "
                      "gpupool serves at most %d tables it does not implement; please report it\n",
                      text, GP_ET_DYN_TABLES);
        return NULL;
    }
    if (fresh && !quiet()) {
        if (slots > GP_ET_DYN_SLOTS)
            (void)fprintf(stderr,
                          "gpupool: cuGetExportTable: table %s has %d slots on the server; "
                          "gpupool serves the first %d\n",
                          text, slots, GP_ET_DYN_SLOTS);
        if (memcmp(id, UUID_TOOLS_MODULE, 16) != 0)
            (void)fprintf(stderr,
                          "gpupool: cuGetExportTable: table %s is not implemented by gpupool: "
                          "each slot answers CUDA_ERROR_NOT_SUPPORTED\n",
                          text);
    }
    return dyn_table[t];
}

size_t gp_export_table_slot_calls(gp_et_slot_calls *out, size_t max)
{
    size_t n = 0;
    if (pthread_mutex_lock(&dyn_lock) != 0)
        return 0;
    for (int t = 0; t < dyn_used; t++) {
        for (int i = 0; i < GP_ET_DYN_SLOTS; i++) {
            uint64_t calls = atomic_load_explicit(&dyn_calls[t][i], memory_order_relaxed);
            if (calls == 0)
                continue;
            if (n < max) {
                memcpy(out[n].table.bytes, dyn_uuid[t], 16);
                out[n].slot = (uint32_t)i;
                out[n].calls = calls;
            }
            n++;
        }
    }
    if (pthread_mutex_unlock(&dyn_lock) != 0)
        return 0;
    return n;
}

/* ---- UUIDs neither the shim nor the server's driver knows: refuse, say so once per UUID ------ */

#define UNKNOWN_REMEMBERED 16
static pthread_mutex_t unknown_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t unknown_seen[UNKNOWN_REMEMBERED][16]; /* guarded by unknown_lock */
static int unknown_count;                            /* guarded by unknown_lock */

/* A uuid refused before: refused again without asking the server (while it is remembered). */
static int already_refused(const uint8_t id[16])
{
    int seen = 0;
    if (pthread_mutex_lock(&unknown_lock) != 0)
        return 0;
    for (int i = 0; i < unknown_count; i++)
        if (memcmp(unknown_seen[i], id, 16) == 0)
            seen = 1;
    if (pthread_mutex_unlock(&unknown_lock) != 0)
        return 0;
    return seen;
}

static void report_unknown(const uint8_t id[16])
{
    int first = 1;
    if (pthread_mutex_lock(&unknown_lock) == 0) {
        for (int i = 0; i < unknown_count; i++)
            if (memcmp(unknown_seen[i], id, 16) == 0)
                first = 0;
        if (first && unknown_count < UNKNOWN_REMEMBERED)
            memcpy(unknown_seen[unknown_count++], id, 16);
        if (pthread_mutex_unlock(&unknown_lock) != 0)
            first = 0;
    }
    if (first && !quiet()) {
        char text[37];
        format_uuid(id, text);
        (void)fprintf(stderr,
                      "gpupool: cuGetExportTable: unknown table %s (returned "
                      "CUDA_ERROR_INVALID_VALUE); please report it\n",
                      text);
    }
}

__attribute__((visibility("default"))) CUresult cuGetExportTable(const void **ppExportTable,
                                                                 const CUuuid *pExportTableId)
{
    if (ppExportTable == NULL || pExportTableId == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const uint8_t *id = (const uint8_t *)pExportTableId->bytes;
    *ppExportTable = NULL;
    for (int t = 0; t < ET_COUNT; t++) {
        if (memcmp(id, table_uuids[t], 16) == 0) {
            *ppExportTable = tables[t];
            return CUDA_SUCCESS;
        }
    }
    /* Every cudart asks for f8cff951 first and copes with a refusal (facts section 4): refuse
     * quietly, it is expected, and without asking the server (a table of trampolines instead
     * of the refusal would send cudart down another path). */
    if (memcmp(id, UUID_F8CFF951, 16) == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int unknown = 1;
    if (!already_refused(id)) {
        unknown = 0;
        *ppExportTable = dyn_table_for(id, &unknown);
        if (*ppExportTable != NULL)
            return CUDA_SUCCESS;
    }
    if (unknown) /* remembered and said once; without an answer, asked again next time */
        report_unknown(id);
    return CUDA_ERROR_INVALID_VALUE;
}
