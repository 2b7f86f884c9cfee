/*
 * sim_config.c: the simulated device's properties. Defaults describe one H100-like device; a
 * `key = value` file named by GPUPOOL_SIM_CONFIG and GPUPOOL_SIM_<KEY> variables change them.
 * Every key is one entry of sim_keys (below): how its value is read, and what
 * worker/sim/README.md's table says about it (gpupoolSimConfigKey hands the table out;
 * tests/test_sim_device.py checks the README against it).
 *
 * A configuration mistake must not produce a device that quietly differs from what the operator
 * asked for, so any unknown key or bad value fails cuInit and names the key on stderr.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "sim_api.h"
#include "sim_internal.h"

extern char **environ;

#define KIB (1024ull)
#define MIB (1024ull * KIB)
#define GIB (1024ull * MIB)
#define TIB (1024ull * GIB)

/* Highest address (exclusive) we let the sim place memory below: the top of the x86-64 user
 * address space is the host's stack and libraries. */
#define SIM_VA_TOP 0x7f0000000000ull
/* Lowest: far above where programs and their heaps live (and above ASan's shadow memory, which
 * ends at 0x10007fff8000). */
#define SIM_VA_BOTTOM 0x100000000000ull

/* H100 (SXM, 80 GB) values from public specifications and deviceQuery listings. Attributes whose
 * feature the sim cannot provide at all (shareable memory handles, RDMA, IPC events, sparse arrays)
 * say 0 so that a program does not pick a path that is bound to fail. The ones that depend on
 * configuration keys are filled in by sim_config_attr(). */
static const int h100_attrs[CU_DEVICE_ATTRIBUTE_MAX] = {
    [1] = 1024,                                      /* MAX_THREADS_PER_BLOCK */
    [2] = 1024,                                      /* MAX_BLOCK_DIM_X */
    [3] = 1024,                                      /* MAX_BLOCK_DIM_Y */
    [4] = 64,                                        /* MAX_BLOCK_DIM_Z */
    [5] = 2147483647,                                /* MAX_GRID_DIM_X */
    [6] = 65535,                                     /* MAX_GRID_DIM_Y */
    [7] = 65535,                                     /* MAX_GRID_DIM_Z */
    [8] = 49152,                                     /* MAX_SHARED_MEMORY_PER_BLOCK */
    [9] = 65536,                                     /* TOTAL_CONSTANT_MEMORY */
    [10] = 32,                                       /* WARP_SIZE */
    [11] = 2147483647,                               /* MAX_PITCH */
    [12] = 65536,                                    /* MAX_REGISTERS_PER_BLOCK */
    [13] = 1980000,                                  /* CLOCK_RATE (kHz) */
    [14] = 512,                                      /* TEXTURE_ALIGNMENT */
    [15] = 1,                                        /* GPU_OVERLAP */
    [17] = 0,                                        /* KERNEL_EXEC_TIMEOUT */
    [18] = 0,                                        /* INTEGRATED */
    [19] = 1,                                        /* CAN_MAP_HOST_MEMORY */
    [20] = 0,                                        /* COMPUTE_MODE: default */
    [21] = 131072,      [22] = 131072, [23] = 65536, /* texture 1D / 2D sizes */
    [24] = 16384,       [25] = 16384,  [26] = 16384, /* texture 3D */
    [27] = 32768,       [28] = 32768,  [29] = 2048,  /* texture 2D layered */
    [30] = 512,                                      /* SURFACE_ALIGNMENT */
    [31] = 1,                                        /* CONCURRENT_KERNELS */
    [32] = 1,                                        /* ECC_ENABLED */
    [35] = 0,                                        /* TCC_DRIVER */
    [36] = 2619000,                                  /* MEMORY_CLOCK_RATE (kHz) */
    [37] = 5120,                                     /* GLOBAL_MEMORY_BUS_WIDTH (bits) */
    [38] = 52428800,                                 /* L2_CACHE_SIZE */
    [39] = 2048,                                     /* MAX_THREADS_PER_MULTIPROCESSOR */
    [40] = 3,                                        /* ASYNC_ENGINE_COUNT */
    [41] = 1,                                        /* UNIFIED_ADDRESSING */
    [42] = 32768,       [43] = 2048,                 /* texture 1D layered */
    [44] = 0,                                        /* CAN_TEX2D_GATHER (deprecated) */
    [45] = 32768,       [46] = 32768,                /* texture 2D gather */
    [47] = 8192,        [48] = 8192,   [49] = 32768, /* texture 3D alternate */
    [51] = 32,                                       /* TEXTURE_PITCH_ALIGNMENT */
    [52] = 32768,       [53] = 32768,  [54] = 2046,  /* texture cubemap */
    [55] = 32768,       [56] = 131072, [57] = 65536, /* surface 1D / 2D */
    [58] = 16384,       [59] = 16384,  [60] = 16384, /* surface 3D */
    [61] = 32768,       [62] = 2048,                 /* surface 1D layered */
    [63] = 32768,       [64] = 32768,  [65] = 2048,  /* surface 2D layered */
    [66] = 32768,       [67] = 32768,  [68] = 2046,  /* surface cubemap */
    [69] = 268435456,   [70] = 131072, [71] = 65000, [72] = 2097120, /* linear textures */
    [73] = 32768,       [74] = 32768,                                /* mipmapped 2D */
    [77] = 32768,       /* MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH */
    [78] = 1,           /* STREAM_PRIORITIES_SUPPORTED */
    [79] = 1,           /* GLOBAL_L1_CACHE_SUPPORTED */
    [80] = 1,           /* LOCAL_L1_CACHE_SUPPORTED */
    [81] = 233472,      /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    [82] = 65536,       /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    [83] = 1,           /* MANAGED_MEMORY */
    [84] = 0,           /* MULTI_GPU_BOARD */
    [86] = 0,           /* HOST_NATIVE_ATOMIC_SUPPORTED */
    [87] = 2,           /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    [88] = 0,           /* PAGEABLE_MEMORY_ACCESS */
    [89] = 1,           /* CONCURRENT_MANAGED_ACCESS */
    [90] = 1,           /* COMPUTE_PREEMPTION_SUPPORTED */
    [91] = 0,           /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    [95] = 1,           /* COOPERATIVE_LAUNCH */
    [96] = 1,           /* COOPERATIVE_MULTI_DEVICE_LAUNCH (deprecated) */
    [97] = 232448,      /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    [98] = 0,           /* CAN_FLUSH_REMOTE_WRITES */
    [99] = 1,           /* HOST_REGISTER_SUPPORTED */
    [100] = 0,          /* PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES */
    [101] = 0,          /* DIRECT_MANAGED_MEM_ACCESS_FROM_HOST */
    [102] = 1,          /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    [103] = 0,          /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1 with memory_file */
    [106] = 32,         /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    [107] = 0,          /* GENERIC_COMPRESSION_SUPPORTED */
    [108] = 32505856,   /* MAX_PERSISTING_L2_CACHE_SIZE */
    [109] = 134213632,  /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    [110] = 0,          /* GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
    [111] = 1024,       /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    [112] = 0,          /* SPARSE_CUDA_ARRAY_SUPPORTED */
    [113] = 0,          /* READ_ONLY_HOST_REGISTER_SUPPORTED */
    [114] = 0,          /* TIMELINE_SEMAPHORE_INTEROP_SUPPORTED */
    [115] = 1,          /* MEMORY_POOLS_SUPPORTED */
    [116] = 0,          /* GPU_DIRECT_RDMA_SUPPORTED */
    [117] = 0,          /* GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS */
    [118] = 0,          /* GPU_DIRECT_RDMA_WRITES_ORDERING */
    [119] = 0,          /* MEMPOOL_SUPPORTED_HANDLE_TYPES */
    [120] = 1,          /* CLUSTER_LAUNCH */
    [121] = 0,          /* DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED */
    [122] = 1,          /* CAN_USE_64_BIT_STREAM_MEM_OPS */
    [123] = 1,          /* CAN_USE_STREAM_WAIT_VALUE_NOR */
    [124] = 0,          /* DMA_BUF_SUPPORTED */
    [125] = 0,          /* IPC_EVENT_SUPPORTED: 1 with memory_file */
    [126] = 4,          /* MEM_SYNC_DOMAIN_COUNT */
    [127] = 1,          /* TENSOR_MAP_ACCESS_SUPPORTED */
    [128] = 0,          /* HANDLE_TYPE_FABRIC_SUPPORTED */
    [129] = 0,          /* UNIFIED_FUNCTION_POINTERS */
    [130] = 0,          /* NUMA_CONFIG: none */
    [131] = -1,         /* NUMA_ID */
    [132] = 0,          /* MULTICAST_SUPPORTED */
    [133] = 0,          /* MPS_ENABLED */
    [134] = 0,          /* HOST_NUMA_ID */
    [139] = 0x233010de, /* GPU_PCI_DEVICE_ID: device 0x2330 (H100 SXM5 80GB), vendor NVIDIA */
    [140] = 0x16c110de, /* GPU_PCI_SUBSYSTEM_ID */
};

static void config_defaults(struct sim_config *cfg)
{
    static const unsigned char uuid[16] = {'g', 'p', 'u', 'p', 'o', 'o', 'l', '-',
                                           's', 'i', 'm', '-', 'd', 'e', 'v', '0'};
    memset(cfg, 0, sizeof(*cfg));
    snprintf(cfg->name, sizeof(cfg->name), "%s", "NVIDIA H100 80GB HBM3 (gpupool simulated)");
    cfg->total_memory = 80 * GIB;
    cfg->cc_major = 9;
    cfg->cc_minor = 0;
    cfg->sm_count = 132;
    memcpy(cfg->uuid, uuid, sizeof(uuid));
    cfg->pci_domain = 0;
    cfg->pci_bus = 0x1b;
    cfg->pci_device = 0;
    cfg->driver_version = 13000;
    cfg->granularity = 2 * MIB;
    cfg->heap_base = 0x300000000000ull;
    cfg->va_base = 0x400000000000ull;
    cfg->device_count = 1;
}

void sim_phys_uuid(const struct sim_config *cfg, int phys, unsigned char out[16])
{
    if (phys >= cfg->device_count && phys - cfg->device_count < cfg->peer_count) {
        memcpy(out, cfg->peers[phys - cfg->device_count].uuid, 16);
        return;
    }
    memcpy(out, cfg->uuid, 16);
    out[15] = (unsigned char)(cfg->uuid[15] + (unsigned)phys);
}

int sim_phys_count(const struct sim_config *cfg)
{
    return cfg->device_count + cfg->peer_count;
}

int sim_config_attr(const struct sim_config *cfg, int dev, int attrib)
{
    if (cfg->attr_set[attrib])
        return cfg->attr_value[attrib];
    const struct sim_peer *peer = NULL;
    if (dev >= cfg->device_count && dev - cfg->device_count < cfg->peer_count)
        peer = &cfg->peers[dev - cfg->device_count];
    switch (attrib) {
    case 103: /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: with a memory file (sim_ipc.c) */
    case 125: /* IPC_EVENT_SUPPORTED: the shared record lives beside the memory file */
        return cfg->memory_file[0] != '\0';
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        return cfg->sm_count;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        return cfg->cc_major;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        return cfg->cc_minor;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
        if (peer && peer->pci_domain >= 0)
            return peer->pci_domain;
        return cfg->pci_domain;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
        if (peer)
            return peer->pci_bus;
        return cfg->pci_bus + dev; /* each further device sits on the next bus */
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
        if (peer && peer->pci_device >= 0)
            return peer->pci_device;
        return cfg->pci_device;
    case 85: /* MULTI_GPU_BOARD_GROUP_ID: distinct per device */
        return dev;
    default:
        return h100_attrs[attrib];
    }
}

/* ---- value parsers: return NULL when fine, else why not ---------------------------------- */

/* Decimal, or hexadecimal with 0x; a leading '-' only when min < 0. Octal is deliberately not
 * accepted: "010" meaning 8 would surprise whoever writes a config file. */
static const char *parse_int(const char *s, long long min, long long max, long long *out)
{
    bool neg = false;
    if (*s == '-') {
        neg = true;
        s++;
    }
    int base = 10;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    if (!isxdigit((unsigned char)*s))
        return "expected a number";
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, base);
    if (errno != 0 || *end != '\0')
        return "expected a number";
    if (v > (unsigned long long)LLONG_MAX)
        return "out of range";
    long long sv = neg ? -(long long)v : (long long)v;
    if (sv < min || sv > max)
        return "out of range";
    *out = sv;
    return NULL;
}

/* Bytes: a number (decimal or 0x hex) with an optional KiB/MiB/GiB/TiB suffix. */
static const char *parse_bytes(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    static const char expected[] = "expected bytes, optionally with a KiB/MiB/GiB/TiB suffix";
    const char *p = s;
    int base = 10;
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
        base = 16;
        p += 2;
    }
    if (!(base == 16 ? isxdigit((unsigned char)*p) : isdigit((unsigned char)*p)))
        return expected;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(p, &end, base);
    if (errno != 0)
        return "out of range";
    while (*end == ' ' || *end == '\t')
        end++;
    uint64_t mult = 1;
    if (*end == '\0')
        mult = 1;
    else if (strcasecmp(end, "KiB") == 0)
        mult = KIB;
    else if (strcasecmp(end, "MiB") == 0)
        mult = MIB;
    else if (strcasecmp(end, "GiB") == 0)
        mult = GIB;
    else if (strcasecmp(end, "TiB") == 0)
        mult = TIB;
    else
        return expected;
    if (v > max / mult)
        return "out of range";
    uint64_t bytes = (uint64_t)v * mult;
    if (bytes < min)
        return "out of range";
    *out = bytes;
    return NULL;
}

static const char *parse_uuid(const char *s, unsigned char out[16])
{
    if (strncasecmp(s, "GPU-", 4) == 0)
        s += 4; /* nvidia-smi's spelling */
    int nibbles = 0;
    unsigned char bytes[16] = {0};
    for (; *s != '\0'; s++) {
        if (*s == '-')
            continue;
        if (!isxdigit((unsigned char)*s) || nibbles >= 32)
            return "expected 32 hexadecimal digits (dashes allowed)";
        int v = isdigit((unsigned char)*s) ? *s - '0' : tolower((unsigned char)*s) - 'a' + 10;
        bytes[nibbles / 2] = (unsigned char)(bytes[nibbles / 2] | (v << (nibbles % 2 ? 0 : 4)));
        nibbles++;
    }
    if (nibbles != 32)
        return "expected 32 hexadecimal digits (dashes allowed)";
    memcpy(out, bytes, 16);
    return NULL;
}

static bool is_pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

/* ---- the keys ------------------------------------------------------------------------------ */

/* How a key's value is read: a number into an int member within [min, max]; bytes into a
 * uint64_t member within [min, max] (and a power of two, or a multiple of `multiple`); or by a
 * setter of its own. */
enum sim_key_kind {
    SIM_KEY_INT,
    SIM_KEY_BYTES,
    SIM_KEY_OWN
};

/* One key of the configuration: what the reader does with it and what worker/sim/README.md says
 * about it (gpupoolSimConfigKey; tests/test_sim_device.py checks the README's table). A name
 * ending in "<N>" stands for every key that starts with what comes before it (attr.<N>). */
struct sim_key {
    const char *name;
    const char *dflt; /* Markdown, as the README shows it */
    const char *doc;  /* Markdown */
    enum sim_key_kind kind;
    size_t member; /* offsetof the member in struct sim_config (INT, BYTES) */
    long long min, max;
    uint64_t multiple; /* BYTES: the value must be a multiple of it (0: any) */
    bool pow2;         /* BYTES: the value must be a power of two */
    /* OWN: reads val into cfg (key: as written, for attr.<N>). NULL when fine, else why not;
     * *unknown when the key does not exist after all. */
    const char *(*set)(struct sim_config *cfg, const char *key, const char *val, bool *unknown);
};

static const char *set_name(struct sim_config *cfg, const char *key, const char *val, bool *unknown)
{
    (void)key, (void)unknown;
    size_t n = strlen(val);
    if (n == 0 || n >= SIM_NAME_MAX)
        return "expected 1 to 255 characters";
    if (strcasestr(val, "simulated") == NULL)
        return "the name must contain the word 'simulated' (nobody should mistake the sim "
               "for a GPU)";
    memcpy(cfg->name, val, n + 1);
    return NULL;
}

static const char *set_uuid(struct sim_config *cfg, const char *key, const char *val, bool *unknown)
{
    (void)key, (void)unknown;
    return parse_uuid(val, cfg->uuid);
}

static const char *set_memory_file(struct sim_config *cfg, const char *key, const char *val,
                                   bool *unknown)
{
    (void)key, (void)unknown;
    /* Empty: no memory file (lets GPUPOOL_SIM_MEMORY_FILE= switch off a file's setting). */
    size_t n = strlen(val);
    if (n >= sizeof(cfg->memory_file))
        return "path too long";
    if (n > 0 && val[0] != '/')
        return "expected an absolute path (the worker and the scrub run in other directories)";
    memcpy(cfg->memory_file, val, n + 1);
    return NULL;
}

static const char *set_shared_dir(struct sim_config *cfg, const char *key, const char *val,
                                  bool *unknown)
{
    (void)key, (void)unknown;
    size_t n = strlen(val);
    if (n >= sizeof(cfg->shared_dir) - 64) /* room for gpu-<UUID>.state in it */
        return "path too long";
    if (n > 0 && val[0] != '/')
        return "expected an absolute path (the worker and the scrub run in other directories)";
    memcpy(cfg->shared_dir, val, n + 1);
    return NULL;
}

/* A PCI address as cuDeviceGetPCIBusId and nvidia-smi write it, DOMAIN:BUS:DEVICE.FUNCTION in
 * hexadecimal (domain up to 0xffff, written with 4 or 8 digits), into the peer. A GPU is
 * function 0, the only one the sim reports. NULL when fine, else why not. */
static const char *parse_pci_bus_id(const char *s, struct sim_peer *p)
{
    static const char expected[] = "expected the PCI address as DOMAIN:BUS:DEVICE.0 in "
                                   "hexadecimal (e.g. 0001:18:00.0) or a PCI bus number";
    static const char seps[4] = {':', ':', '.', '\0'};
    static const unsigned long max[4] = {0xffff, 0xff, 0x1f, 0};
    unsigned long v[4] = {0};
    for (int i = 0; i < 4; i++) {
        const char *start = s;
        unsigned long x = 0;
        while (isxdigit((unsigned char)*s) && s - start < 8) {
            int d = isdigit((unsigned char)*s) ? *s - '0' : tolower((unsigned char)*s) - 'a' + 10;
            x = x * 16 + (unsigned long)d;
            s++;
        }
        if (s == start || *s != seps[i])
            return expected;
        if (x > max[i])
            return i == 3 ? "a GPU is PCI function 0" : "PCI domain, bus or device out of range";
        v[i] = x;
        if (i < 3)
            s++;
    }
    p->pci_domain = (int)v[0];
    p->pci_bus = (int)v[1];
    p->pci_device = (int)v[2];
    return NULL;
}

/* peer = UUID PCI MEMORY_FILE: another simulated GPU of the pool (sim_internal.h). PCI is its
 * PCI address (DOMAIN:BUS:DEVICE.0) or, as earlier versions wrote it, its bus number alone (the
 * domain and device are then the configured ones). */
static const char *set_peer(struct sim_config *cfg, const char *key, const char *val, bool *unknown)
{
    (void)key, (void)unknown;
    if (cfg->peer_count >= SIM_MAX_GPUS - 1)
        return "too many peers (a process knows at most 1024 GPUs, its own included)";
    if (cfg->peer_count == cfg->peer_cap) {
        int ncap = cfg->peer_cap ? cfg->peer_cap * 2 : 16;
        if (ncap > SIM_MAX_GPUS - 1)
            ncap = SIM_MAX_GPUS - 1;
        struct sim_peer *np = realloc(cfg->peers, (size_t)ncap * sizeof(*np));
        if (!np)
            return "out of host memory for the peers";
        cfg->peers = np;
        cfg->peer_cap = ncap;
    }
    struct sim_peer *p = &cfg->peers[cfg->peer_count];
    memset(p, 0, sizeof(*p));
    p->pci_domain = p->pci_device = -1;
    char uuid[80], pci[80], path[SIM_PATH_MAX];
    int used = 0;
    if (strlen(val) >= sizeof(path) || sscanf(val, "%79s %79s %n", uuid, pci, &used) != 2)
        return "expected UUID PCI MEMORY_FILE";
    const char *why = parse_uuid(uuid, p->uuid);
    if (why)
        return why;
    if (strchr(pci, ':')) {
        why = parse_pci_bus_id(pci, p);
    } else {
        long long bus = 0;
        why = parse_int(pci, 0, 0xff, &bus);
        p->pci_bus = (int)bus;
        if (why)
            why = "expected the PCI address as DOMAIN:BUS:DEVICE.0 in hexadecimal (e.g. "
                  "0001:18:00.0) or a PCI bus number (0..255)";
    }
    if (why)
        return why;
    snprintf(path, sizeof(path), "%s", val + used);
    if (path[0] != '/')
        return "expected an absolute memory file path after the PCI address";
    memcpy(p->memory_file, path, strlen(path) + 1);
    cfg->peer_count++;
    return NULL;
}

static const char *set_count_only(struct sim_config *cfg, const char *key, const char *val,
                                  bool *unknown)
{
    (void)key, (void)unknown;
    if (strcmp(val, "true") == 0 || strcmp(val, "1") == 0)
        cfg->count_only = true;
    else if (strcmp(val, "false") == 0 || strcmp(val, "0") == 0)
        cfg->count_only = false;
    else
        return "expected true or false";
    return NULL;
}

/* attr.<N> = value: device attribute N for all devices. */
static const char *set_attr(struct sim_config *cfg, const char *key, const char *val, bool *unknown)
{
    long long id = 0, v = 0;
    if (parse_int(key + 5, 1, CU_DEVICE_ATTRIBUTE_MAX - 1, &id) != NULL) {
        *unknown = true;
        return "unknown key";
    }
    const char *why = parse_int(val, INT32_MIN, INT32_MAX, &v);
    if (!why) {
        cfg->attr_set[id] = true;
        cfg->attr_value[id] = (int)v;
    }
    return why;
}

#define INT_KEY(key, member_, lo, hi, dflt_, doc_)                                                 \
    {                                                                                              \
        .name = key, .dflt = dflt_, .doc = doc_, .kind = SIM_KEY_INT,                              \
        .member = offsetof(struct sim_config, member_), .min = lo, .max = hi                       \
    }
#define BYTES_KEY(key, member_, lo, hi, multiple_, pow2_, dflt_, doc_)                             \
    {                                                                                              \
        .name = key, .dflt = dflt_, .doc = doc_, .kind = SIM_KEY_BYTES,                            \
        .member = offsetof(struct sim_config, member_), .min = (long long)(lo),                    \
        .max = (long long)(hi), .multiple = multiple_, .pow2 = pow2_                               \
    }
#define OWN_KEY(key, set_, dflt_, doc_)                                                            \
    {                                                                                              \
        .name = key, .dflt = dflt_, .doc = doc_, .kind = SIM_KEY_OWN, .set = set_                  \
    }

static const struct sim_key sim_keys[] = {
    OWN_KEY("name", set_name, "`NVIDIA H100 80GB HBM3 (gpupool simulated)`",
            "device name; must contain the word \"simulated\"; up to 255 characters"),
    BYTES_KEY("total_memory", total_memory, 64 * MIB, 16 * TIB, 0, false, "`80GiB`",
              "memory per device (64 MiB .. 16 TiB), shared by cuMemAlloc and cuMemCreate"),
    INT_KEY("cc_major", cc_major, 1, 99, "`9`", "compute capability major (1..99)"),
    INT_KEY("cc_minor", cc_minor, 0, 9, "`0`", "compute capability minor (0..9)"),
    INT_KEY("sm_count", sm_count, 1, 4096, "`132`", "multiprocessors (1..4096)"),
    OWN_KEY("uuid", set_uuid, "`67707570-6f6f-6c2d-7369-6d2d64657630` (\"gpupool-sim-dev0\")",
            "device 0's UUID: 32 hex digits, dashes allowed, optional `GPU-` prefix"),
    INT_KEY("pci_domain", pci_domain, 0, 0xffff, "`0`", "PCI domain (0..0xffff)"),
    INT_KEY("pci_bus", pci_bus, 0, 0xff, "`0x1b`",
            "PCI bus of device 0 (0..0xff); device *n* is on `pci_bus + n`, which must not "
            "pass 0xff"),
    INT_KEY("pci_device", pci_device, 0, 0x1f, "`0`", "PCI device (0..0x1f)"),
    INT_KEY("driver_version", driver_version, 1000, 999999, "`13000`",
            "what `cuDriverGetVersion` reports (1000..999999)"),
    BYTES_KEY("granularity", granularity, 4 * KIB, 1 * GIB, 0, true, "`2MiB`",
              "VMM allocation granularity: a power of two, 4 KiB .. 1 GiB"),
    BYTES_KEY("heap_base", heap_base, SIM_VA_BOTTOM, SIM_VA_TOP - 1, 2 * MIB, false,
              "`0x300000000000`",
              "start of the cuMemAlloc heap (multiple of 2 MiB, within [16 TiB, "
              "0x7f0000000000)); the heaps of all devices must fit below `0x7f0000000000`"),
    BYTES_KEY("va_base", va_base, SIM_VA_BOTTOM, SIM_VA_TOP - 1, 2 * MIB, false, "`0x400000000000`",
              "where `cuMemAddressReserve` without a hint starts looking (same rules)"),
    INT_KEY("device_count", device_count, 0, SIM_MAX_DEVICES, "`1`",
            "number of devices, 0..16 (0: `cuInit` returns `CUDA_ERROR_NO_DEVICE`)"),
    OWN_KEY("memory_file", set_memory_file, "(none)",
            "absolute path of a file holding all device memory, so that it outlives the process "
            "(see \"Device memory that outlives the process\"); created (mode 0600) if missing; "
            "empty: none"),
    OWN_KEY("shared_dir", set_shared_dir, "(none)",
            "absolute path of a directory (which must exist) where every process simulating the "
            "same GPU (same UUID) shares it, as the processes of several tenants share a real GPU "
            "(see \"A GPU shared by several processes\"): one allocator for the GPU's memory, "
            "kernels in turns; the memory file defaults to `gpu-<UUID>.mem` in it; empty: each "
            "process has its GPUs to itself"),
    OWN_KEY("peer", set_peer, "(none)",
            "`UUID PCI MEMORY_FILE`: another simulated GPU of the same pool (its UUID as 32 "
            "hex digits; its PCI address `DOMAIN:BUS:DEVICE.0` in hexadecimal, e.g. "
            "`0001:18:00.0`, or its bus number alone, the domain and device then being "
            "`pci_domain` and `pci_device`; its own absolute memory file); repeatable, up to "
            "1024 GPUs with `device_count`. A checkpointed process may be restored onto a peer "
            "(`cuCheckpointProcessRestore` with a UUID pair naming it): the ordinal then reports "
            "the peer's UUID and PCI address and its memory lives in the peer's memory file "
            "(part 0, as the peer's own processes use it). gpupoold writes every other simulated "
            "GPU of the daemon as a peer of each (idle detach moves leases between them)"),
    OWN_KEY("attr.<N>", set_attr, "(H100 values)",
            "overrides device attribute *N* (1..147) for all devices; any 32-bit integer"),
    OWN_KEY("count_only", set_count_only, "`false`",
            "`true`: the benchmark-only count mode (see \"Count mode\"); refused unless "
            "`GPUPOOL_BENCH_COUNT_MODE=1` is in the environment. `true`/`false` (or `1`/`0`)"),
};
#define SIM_NKEYS (sizeof(sim_keys) / sizeof(sim_keys[0]))

const char *gpupoolSimConfigKey(int key, int field)
{
    if (key < 0 || (size_t)key >= SIM_NKEYS)
        return NULL;
    const struct sim_key *k = &sim_keys[key];
    return field == 0 ? k->name : field == 1 ? k->dflt : field == 2 ? k->doc : NULL;
}

/* The entry of key, or NULL. */
static const struct sim_key *find_key(const char *key)
{
    for (size_t i = 0; i < SIM_NKEYS; i++) {
        const char *name = sim_keys[i].name, *any = strstr(name, "<N>");
        if (any ? strncmp(key, name, (size_t)(any - name)) == 0 : strcmp(key, name) == 0)
            return &sim_keys[i];
    }
    return NULL;
}

/* Applies one key. Returns NULL when fine; *unknown is set when the key does not exist. */
static const char *apply_key(struct sim_config *cfg, const char *key, const char *val,
                             bool *unknown)
{
    *unknown = false;
    const struct sim_key *k = find_key(key);
    if (!k) {
        *unknown = true;
        return "unknown key";
    }
    char *member = (char *)cfg + k->member;
    const char *why = NULL;
    if (k->kind == SIM_KEY_INT) {
        long long v = 0;
        if (!(why = parse_int(val, k->min, k->max, &v)))
            *(int *)(void *)member = (int)v;
    } else if (k->kind == SIM_KEY_BYTES) {
        uint64_t b = 0;
        why = parse_bytes(val, (uint64_t)k->min, (uint64_t)k->max, &b);
        if (!why && k->pow2 && !is_pow2(b))
            why = "must be a power of two";
        if (!why && k->multiple && (b % k->multiple) != 0)
            why = "must be a multiple of 2 MiB"; /* the only multiple a key asks for */
        if (!why)
            *(uint64_t *)(void *)member = b;
    } else {
        why = k->set(cfg, key, val, unknown);
    }
    return why;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        s[--n] = '\0';
    return s;
}

static CUresult load_file(struct sim_config *cfg, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        sim_init_fail("cannot read the config file %s (GPUPOOL_SIM_CONFIG): %s", path,
                      strerror(errno));
        return CUDA_ERROR_INVALID_VALUE;
    }
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0;
    CUresult rc = CUDA_SUCCESS;
    while (rc == CUDA_SUCCESS && getline(&line, &cap, f) >= 0) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *s = trim(line);
        if (*s == '\0')
            continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            sim_init_fail("%s:%d: expected 'key = value', got '%s'", path, lineno, s);
            rc = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        *eq = '\0';
        char *key = trim(s), *val = trim(eq + 1);
        bool unknown = false;
        const char *why = apply_key(cfg, key, val, &unknown);
        if (why) {
            if (unknown)
                sim_init_fail("%s:%d: unknown key '%s'", path, lineno, key);
            else
                sim_init_fail("%s:%d: bad value '%s' for key '%s': %s", path, lineno, val, key,
                              why);
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (rc == CUDA_SUCCESS && ferror(f)) {
        sim_init_fail("error reading the config file %s", path);
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    free(line);
    if (fclose(f) != 0 && rc == CUDA_SUCCESS) {
        sim_init_fail("error closing the config file %s", path);
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    return rc;
}

/* GPUPOOL_SIM_<KEY>=value: KEY is the key in upper case; ATTR_<N> (or ATTR.<N>) for attr.<N>. */
static CUresult load_env(struct sim_config *cfg)
{
    static const char prefix[] = "GPUPOOL_SIM_";
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, prefix, sizeof(prefix) - 1) != 0)
            continue;
        const char *rest = *e + sizeof(prefix) - 1;
        const char *eq = strchr(rest, '=');
        if (!eq)
            continue;
        size_t klen = (size_t)(eq - rest);
        char lower[64];
        if (klen == 6 && strncmp(rest, "CONFIG", 6) == 0)
            continue;
        if (klen == 0 || klen >= sizeof(lower)) {
            sim_init_fail("environment %.*s: unknown key", (int)(eq - *e), *e);
            return CUDA_ERROR_INVALID_VALUE;
        }
        for (size_t i = 0; i < klen; i++)
            lower[i] = (char)tolower((unsigned char)rest[i]);
        lower[klen] = '\0';
        if (strncmp(lower, "attr_", 5) == 0)
            lower[4] = '.';
        char val[SIM_PATH_MAX + 64];
        if (strlen(eq + 1) >= sizeof(val)) {
            sim_init_fail("environment %.*s: value too long", (int)(eq - *e), *e);
            return CUDA_ERROR_INVALID_VALUE;
        }
        snprintf(val, sizeof(val), "%s", eq + 1);
        bool unknown = false;
        const char *why = apply_key(cfg, lower, trim(val), &unknown);
        if (why) {
            if (unknown)
                sim_init_fail("environment %.*s: unknown key '%s'", (int)(eq - *e), *e, lower);
            else
                sim_init_fail("environment %s: bad value for key '%s': %s", *e, lower, why);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

/* Checks that need several keys at once. */
static CUresult check_config(const struct sim_config *cfg)
{
    uint64_t stride = (cfg->total_memory + 2 * MIB - 1) / (2 * MIB) * (2 * MIB);
    if (cfg->heap_base + stride * (uint64_t)cfg->device_count > SIM_VA_TOP) {
        sim_init_fail("config: heap_base 0x%llx + device_count x total_memory does not fit "
                      "below 0x%llx",
                      (unsigned long long)cfg->heap_base, (unsigned long long)SIM_VA_TOP);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (cfg->device_count > 0 && cfg->pci_bus + cfg->device_count - 1 > 0xff) {
        /* Device n sits on bus pci_bus + n: the last one must still be a bus number. */
        sim_init_fail("config: pci_bus 0x%x + device_count %d passes bus 0xff; choose a lower "
                      "pci_bus",
                      (unsigned)cfg->pci_bus, cfg->device_count);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (cfg->device_count + cfg->peer_count > SIM_MAX_GPUS) {
        sim_init_fail("config: device_count + peers exceed %d GPUs", SIM_MAX_GPUS);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (cfg->total_memory < cfg->granularity) {
        sim_init_fail("config: total_memory is smaller than granularity");
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* count_only = true: refused unless the benchmark says it wants it (the mode computes nothing, so
 * a tenant must never get it by accident), and the device name says it. */
static CUresult apply_count_mode(struct sim_config *cfg)
{
    if (!cfg->count_only)
        return CUDA_SUCCESS;
    const char *ok = getenv(SIM_COUNT_MODE_ENV);
    if (!ok || strcmp(ok, "1") != 0) {
        sim_init_fail("config: count_only = true is a benchmark-only mode (kernels are accepted "
                      "and not run, so every result is garbage); it is refused unless %s=1 is "
                      "set, as bench/link_model.py and `bench/torch_workloads.py --count` do",
                      SIM_COUNT_MODE_ENV);
        return CUDA_ERROR_INVALID_VALUE;
    }
    size_t n = strlen(cfg->name), add = strlen(SIM_COUNT_MODE_SUFFIX);
    if (n + add >= sizeof(cfg->name)) {
        sim_init_fail("config: the name is too long to add '%s' (count_only)",
                      SIM_COUNT_MODE_SUFFIX);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memcpy(cfg->name + n, SIM_COUNT_MODE_SUFFIX, add + 1);
    return CUDA_SUCCESS;
}

CUresult sim_config_load(struct sim_config *cfg)
{
    config_defaults(cfg);
    const char *path = getenv("GPUPOOL_SIM_CONFIG");
    CUresult rc = CUDA_SUCCESS;
    if (path && *path)
        rc = load_file(cfg, path);
    if (rc == CUDA_SUCCESS)
        rc = load_env(cfg);
    if (rc == CUDA_SUCCESS)
        rc = check_config(cfg);
    if (rc == CUDA_SUCCESS)
        rc = apply_count_mode(cfg);
    return rc;
}
