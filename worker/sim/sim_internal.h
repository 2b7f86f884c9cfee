/*
 * sim_internal.h: what the files of the simulated device share. Nothing here is exported.
 *
 * Locking: one mutex (sim_mu in sim_core.c) guards all of the sim's state. Every API entry point takes it
 * through sim_enter*() and drops it through sim_leave(); the functions declared below that touch
 * shared state expect the caller to hold it. Work runs under the lock too (copies, kernels): the
 * simulated device is synchronous, and it keeps a concurrent cuMemUnmap from pulling memory out
 * from under a running copy.
 */
#ifndef GP_SIM_INTERNAL_H
#define GP_SIM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gp_cuda.h"

#define SIM_MAX_DEVICES 16
/* Physical GPUs one process may know: its devices and the peers it may be restored onto. A
 * server lists every other simulated GPU as a peer of each, so this bounds a server's simulated
 * GPUs (far above what one host runs; peers are allocated as they are read). */
#define SIM_MAX_GPUS 1024
#define SIM_NAME_MAX 256
#define SIM_PATH_MAX 4096
#define SIM_LIMIT_COUNT 10 /* CU_LIMIT_MAX of the 13.0 driver */

/* Result codes and enum values that gp_cuda.h does not declare (prefixed so that they never clash
 * with names it may declare later). Values are those of the driver ABI. */
enum {
    SIM_ERR_UNSUPPORTED_LIMIT = 215,
    SIM_ERR_INVALID_CLUSTER_SIZE = 912,
};
enum {
    SIM_FUNC_ATTR_MAX_THREADS_PER_BLOCK = 0,
    SIM_FUNC_ATTR_SHARED_SIZE_BYTES = 1,
    SIM_FUNC_ATTR_CONST_SIZE_BYTES = 2,
    SIM_FUNC_ATTR_LOCAL_SIZE_BYTES = 3,
    SIM_FUNC_ATTR_NUM_REGS = 4,
    SIM_FUNC_ATTR_PTX_VERSION = 5,
    SIM_FUNC_ATTR_BINARY_VERSION = 6,
    SIM_FUNC_ATTR_CACHE_MODE_CA = 7,
    SIM_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    SIM_FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
    SIM_FUNC_ATTR_CLUSTER_SIZE_MUST_BE_SET = 10,
    SIM_FUNC_ATTR_REQUIRED_CLUSTER_WIDTH = 11,
    SIM_FUNC_ATTR_REQUIRED_CLUSTER_HEIGHT = 12,
    SIM_FUNC_ATTR_REQUIRED_CLUSTER_DEPTH = 13,
    SIM_FUNC_ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
    SIM_FUNC_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 15,
    SIM_FUNC_ATTR_COUNT = 16,
};
enum {
    SIM_LAUNCH_ATTR_CLUSTER_DIMENSION = 4
};

/* ---- configuration (sim_config.c) -------------------------------------------------------- */
/* Another simulated GPU of the same pool (key `peer`): a checkpointed process may be restored
 * onto it (sim_checkpoint.c). Its memory is its own memory file (part 0, as that GPU's own
 * processes use it). */
struct sim_peer {
    unsigned char uuid[16];
    /* Its PCI address; domain and device -1: the configured pci_domain / pci_device (a peer
     * given by its bus number alone). */
    int pci_domain, pci_bus, pci_device;
    char memory_file[SIM_PATH_MAX];
};

struct sim_config {
    char name[SIM_NAME_MAX];
    uint64_t total_memory; /* bytes, per device */
    int cc_major, cc_minor, sm_count;
    unsigned char uuid[16]; /* device 0's; device n adds n to the last byte */
    int pci_domain, pci_bus, pci_device;
    int driver_version;
    uint64_t granularity; /* VMM allocation granularity */
    uint64_t heap_base;   /* where cuMemAlloc's heap starts (device 0; the others follow) */
    uint64_t va_base;     /* where cuMemAddressReserve(addr = 0) looks first */
    int device_count;
    char memory_file[SIM_PATH_MAX]; /* "" : device memory is anonymous host memory */
    /* "" : each process has its GPUs to itself; else the folder of the state every process of a
     * GPU shares (sim_shared.c: one allocator, kernels in turns) */
    char shared_dir[SIM_PATH_MAX];
    /* Physical GPUs device_count .. device_count + peer_count - 1 (sim_phys_dev may name one). */
    struct sim_peer *peers; /* malloc'd, peer_cap entries; never freed (read once per process) */
    int peer_count, peer_cap;
    bool attr_set[CU_DEVICE_ATTRIBUTE_MAX];
    int attr_value[CU_DEVICE_ATTRIBUTE_MAX];
    /* Key `count_only` (benchmarks only, SIM_COUNT_MODE_ENV must be "1"): every kernel launch
     * succeeds without running unless the sim has a host version of the kernel, so that a real
     * program's call stream can be counted (bench/link_model.py). The name says so. */
    bool count_only;
};
/* The variable that confirms `count_only` is wanted: a benchmark sets it, nothing else does. */
#define SIM_COUNT_MODE_ENV "GPUPOOL_BENCH_COUNT_MODE"
/* What count mode appends to the device name. */
#define SIM_COUNT_MODE_SUFFIX " [count mode: kernels not run]"

/* Defaults, then the GPUPOOL_SIM_CONFIG file, then GPUPOOL_SIM_<KEY> variables. On a bad key or
 * value: one line on stderr and CUDA_ERROR_INVALID_VALUE. */
CUresult sim_config_load(struct sim_config *cfg);
/* The value of device attribute `attrib` (1 .. CU_DEVICE_ATTRIBUTE_MAX-1) of physical GPU `dev`
 * (a peer from device_count on). */
int sim_config_attr(const struct sim_config *cfg, int dev, int attrib);
/* The UUID of physical GPU `phys`: device n's is the configured one plus n in its last byte, a
 * peer's is its own. */
void sim_phys_uuid(const struct sim_config *cfg, int phys, unsigned char out[16]);
/* The number of physical GPUs: devices and peers. */
int sim_phys_count(const struct sim_config *cfg);

/* ---- core state (sim_core.c) ------------------------------------------------------------- */
struct sim_ctx {
    uint64_t handle;
    int dev;
    bool primary;
    bool active;       /* a primary context is active while retained */
    unsigned refcount; /* primary contexts: retain count */
    unsigned flags;
    CUresult sticky; /* CUDA_ERROR_ILLEGAL_ADDRESS after a faulting kernel, else 0 */
    size_t limits[SIM_LIMIT_COUNT];
};

extern struct sim_config sim_cfg; /* valid once initialised; read-only afterwards */

/* Lock, check cuInit has succeeded, clear the thread's error detail. Unlocks on failure. */
CUresult sim_enter(void);
/* For cuInit and cuDriverGetVersion (sim_init.c): take the lock and clear the detail, whether or
 * not cuInit has succeeded; sim_leave releases it. */
void sim_enter_uninitialised(void);
/* cuInit's result, set once by sim_init.c (sim_enter refuses every call until it is success). */
void sim_set_init_result(CUresult rc);
CUresult sim_init_result(void);
/* The detail of the last call becomes why configuration or cuInit failed, if it did. */
void sim_detail_init_error(void);
/* sim_enter() and also require a current, usable context (returned in *ctx). The context's sticky
 * error, if any, is returned (unlocked) as the driver returns it from every later call. */
CUresult sim_enter_ctx(struct sim_ctx **ctx);
/* Unlock and return rc (so that `return sim_leave(rc);` ends an entry point). */
CUresult sim_leave(CUresult rc);
/* Record the detail behind an error for gpupoolSimLastErrorDetail() (printf format). */
void sim_detail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Why cuInit fails (configuration, heap reservation): one line on stderr, and kept as the error
 * detail of every later cuInit / cuDriverGetVersion that returns the same failure. */
void sim_init_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
bool sim_dev_valid(CUdevice dev);
/* The simulated GPU behind device ordinal `dev` of this process (its UUID, PCI address and part
 * of the memory file); the identity until a checkpoint is restored onto other GPUs. */
int sim_phys_dev(int dev);
void sim_set_phys_dev(int dev, int phys);
/* Issue 37: peer GPU `phys` (device_count + k for peer k) as a device of this process, as one
 * process holds several GPUs of a server. sim_core.c keeps the table, sim_device.c opens them
 * (it makes the primary context: the base file calls no context code): the ordinal peer `phys`
 * has, or -1; the ordinal the next one gets; record one. */
int sim_opened_peer(int phys);
int sim_next_peer_device(void);
void sim_add_opened_peer(int dev, int phys);
/* For sim_checkpoint.c's control thread: take the global lock (waiting at most timeout_ms, 0: no
 * limit; 0 or ETIMEDOUT returned) and hold it across requests, so that every API call of the
 * process waits; then give it back. */
int sim_lock_wait(unsigned timeout_ms);
void sim_lock_release(void);
/* The context of a handle, or NULL when it names none (or a released primary context). */
struct sim_ctx *sim_ctx_get(CUcontext h);
/* Frees everything a context owns (streams, events, modules, heap memory). */
void sim_ctx_release_resources(struct sim_ctx *ctx);
CUresult sim_ctx_create_primaries(void);
/* A primary context for ordinal dev (an opened peer's), if it has none yet. */
CUresult sim_ctx_create_primary(int dev);
/* The calling thread's current context handle (0: none), possibly stale. */
uint64_t sim_current_ctx(void);
void sim_set_current_ctx(uint64_t h);
uint64_t sim_now_ns(void);

/* ---- interprocess events (sim_ipc.c; sim_stream.c keeps the events and their entry points) */
/* An event of CU_EVENT_INTERPROCESS that was exported or opened has a record shared with the
 * other process; NULL in the event otherwise. */
struct sim_ipc_event;
/* cuIpcGetEventHandle's work: *ev made on the first export; the handle naming it in *out. */
CUresult sim_ipc_event_export(struct sim_ipc_event **ev, CUipcEventHandle *out);
/* cuIpcOpenEventHandle's work: the record the handle names, mapped (detail said on failure). */
CUresult sim_ipc_event_import(const CUipcEventHandle *handle, struct sim_ipc_event **ev);
void sim_ipc_event_recorded(struct sim_ipc_event *ev, uint64_t t_ns);
/* Query / synchronize of a shared event: CUDA_SUCCESS, or why not (detail said). */
CUresult sim_ipc_event_done(const struct sim_ipc_event *ev);
/* The event is destroyed (or its context released): unmap; the exporter also removes the file. */
void sim_ipc_event_close(struct sim_ipc_event *ev);

/* ---- handles (sim_handles.c) ------------------------------------------------------------- */
/* Handles given to callers are tagged integers, never pointers: a stale or forged handle is
 * looked up, not dereferenced, so it yields CUDA_ERROR_INVALID_HANDLE instead of a crash. */
enum sim_kind {
    SIM_K_CTX = 1,
    SIM_K_STREAM,
    SIM_K_EVENT,
    SIM_K_MODULE,
    SIM_K_LIBRARY,
    SIM_K_FUNC,
    SIM_K_KERNEL,
    SIM_K_MEMHANDLE,
    SIM_K_GRAPH = 20, /* sim_graph.c (explicit values: other kinds may be added above) */
    SIM_K_GRAPH_EXEC = 21,
};
uint64_t sim_handle_new(enum sim_kind kind, void *obj); /* 0 when out of memory */
void *sim_handle_get(uint64_t h, enum sim_kind kind);   /* NULL when unknown */
void sim_handle_del(uint64_t h);
/* Calls fn for every live handle of `kind`; fn may delete handles but not create any. */
void sim_handle_foreach(enum sim_kind kind, void (*fn)(uint64_t h, void *obj, void *arg),
                        void *arg);

/* ---- device memory (sim_memory.c) -------------------------------------------------------- */
enum sim_seg_kind {
    SIM_SEG_HEAP = 1,
    SIM_SEG_VMM,
    SIM_SEG_HOST
};
enum {
    SIM_SEG_GLOBAL = 1
}; /* heap segment holding a module global (cuMemFree refuses it) */

struct sim_seg {
    uint64_t start;
    uint64_t len;  /* bytes that may be touched */
    uint64_t foot; /* bytes of address space and accounted memory it occupies */
    enum sim_seg_kind kind;
    unsigned flags;
    int dev;
    uint64_t owner;    /* heap: the owning context's handle */
    void *obj;         /* VMM: the physical allocation mapped here */
    bool in_file;      /* mapped from the memory file (sim_memfile.c) */
    uint64_t file_off; /* in_file: where `start` lies in the memory file */
};

CUresult sim_memory_init(void);
/* The host address of [addr, addr+len) when all of it is device-accessible memory (heap
 * allocations, VMM mappings, cuMemHostAlloc memory), else NULL. len 0 is never valid. */
void *sim_dev_range(uint64_t addr, uint64_t len);
CUresult sim_heap_alloc(int dev, uint64_t owner, uint64_t size, unsigned flags, uint64_t *out);
CUresult sim_heap_free(uint64_t addr, bool allow_global);
void sim_heap_free_owner(uint64_t owner);
/* Physical memory in use on a device (heap footprints + live cuMemCreate allocations). */
uint64_t sim_mem_used(int dev);
void sim_mem_account(int dev, int64_t delta);
/* Segment registry shared with the VMM code. */
CUresult sim_seg_add(const struct sim_seg *s);
const struct sim_seg *sim_seg_find(uint64_t addr); /* footprint containing addr */
const struct sim_seg *sim_seg_from(uint64_t addr); /* first starting at or after addr */
void sim_seg_remove(uint64_t start);
/* Replace [addr, addr+len) by fresh memory of protection prot (PROT_NONE drops the contents). */
int sim_remap(uint64_t addr, uint64_t len, int prot);
/* Writes zeros over [addr, addr+len), which sim_dev_range() has accepted. Whole pages are given
 * back instead of written (a hole punched in the memory file, or fresh anonymous pages), so that
 * zeroing a whole simulated GPU costs neither time nor memory. */
void sim_zero_range(uint64_t addr, uint64_t len);

/* ---- the memory file (sim_memfile.c): device memory that outlives the process -------------- */
/* With the memory_file key, all device memory (cuMemAlloc heap, module globals, cuMemCreate) is
 * carved out of one sparse file, device n's part starting at n x total_memory (rounded up to a
 * page), placed first fit from the start of that part, so that the same allocations in the same
 * order get the same bytes back in the next process, as from a GPU's DRAM. All of these expect
 * the sim lock to be held. */
CUresult sim_memfile_init(void); /* no-op without memory_file */
bool sim_memfile_enabled(void);
/* Reserves len bytes (a multiple of the page size) of device dev's part of the file. */
CUresult sim_memfile_alloc(int dev, uint64_t len, uint64_t *off);
void sim_memfile_free(int dev, uint64_t off);
/* Reads or writes [off, off+len) of the file; -1 on an I/O error. */
int sim_memfile_read(uint64_t off, void *buf, uint64_t len);
int sim_memfile_write(uint64_t off, const void *buf, uint64_t len);
/* Maps [off, off+len) of the file read-write and shared at addr (replacing what is there). */
int sim_memfile_map(uint64_t addr, uint64_t len, uint64_t off);
/* Zeroes [off, off+len) of the file (page-aligned) by punching a hole; -1 when the file system
 * cannot, and the caller writes the zeros itself. */
int sim_memfile_punch(uint64_t off, uint64_t len);
/* Where physical GPU n's part starts: n x this (0 without a memory file). */
uint64_t sim_memfile_stride(void);

/* ---- CUDA IPC's VMM export and import (sim_ipc.c, sim_vmm.c) ----------------------------- */
/* An allocation as an export sees it: its device (ordinal), size and place in the memory file. */
struct sim_vmm_share {
    int dev;
    uint64_t size, file_off;
};
/* Fills *out for the cuMemCreate handle and marks it exported: from then on its range of the
 * memory file stays reserved until the process ends, even after cuMemRelease, because an
 * importer may still map it (the sim does not count importers). INVALID_VALUE: not a handle, or
 * it was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; NOT_SUPPORTED: no memory
 * file (detail said). */
CUresult sim_vmm_share(uint64_t handle, struct sim_vmm_share *out);
/* A new cuMemCreate-like handle for another process's allocation at file_off (a virtual offset,
 * sim_memfile.c): mappable like any other; its release never frees that range nor counts
 * against dev's memory, which stays the exporter's. */
CUresult sim_vmm_import(int dev, uint64_t file_off, uint64_t size,
                        CUmemGenericAllocationHandle *handle);

/* ---- streams and events (sim_stream.c) --------------------------------------------------- */
/* CUDA_SUCCESS for NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD and live streams. */
CUresult sim_stream_check(CUstream s);
void sim_stream_release_ctx(uint64_t ctx);

/* ---- images (sim_elf.c, sim_image.c) ----------------------------------------------------- */
struct sim_param {
    uint32_t offset, size;
};

struct sim_elf_kernel {
    char *name;
    int nparams;              /* -1: the image does not say */
    struct sim_param *params; /* nparams entries, by index */
    int regs;                 /* -1: unknown */
};

struct sim_elf_global {
    char *name;
    uint64_t size;
    unsigned char *init; /* initial bytes (size of them), or NULL for zeros */
};

struct sim_elf_info {
    int sm; /* e.g. 90, or 0 when the header does not say in a way we know */
    struct sim_elf_kernel *kernels;
    size_t nkernels;
    struct sim_elf_global *globals;
    size_t nglobals;
};

/* Parses a cubin of exactly len bytes. Never reads outside [buf, buf+len).
 * CUDA_ERROR_INVALID_IMAGE when it is not a well-formed CUDA ELF. */
CUresult sim_elf_parse(const unsigned char *buf, size_t len, struct sim_elf_info *out);
void sim_elf_free(struct sim_elf_info *info);

struct sim_image {
    bool any_name; /* kernels and globals unknown (PTX, compressed code): accept any name */
    struct sim_elf_info elf;
};
/* Parses a fatbin of exactly len bytes, picking the code for a device of compute capability
 * dev_sm (major*10+minor). Never reads outside [buf, buf+len). */
CUresult sim_fatbin_parse(const unsigned char *buf, size_t len, int dev_sm, struct sim_image *out);
/* Any image the driver accepts: fatbin wrapper, fatbin, cubin, PTX text. The extent of the image
 * is taken from its own headers (the API passes no length). */
CUresult sim_image_load(const void *image, int dev_sm, struct sim_image *out);
void sim_image_free(struct sim_image *img);
/* A PTX text being loaded: recorded in the stand-in JIT cache (sim_jitcache.c). */
void sim_jit_cache_note(const char *ptx);

/* ---- ZSTD-compressed code (sim_zstd.c) --------------------------------------------------- */
/* true when the system's libzstd.so.1 could be loaded (checked once). */
bool sim_zstd_available(void);
/* Decompresses the ZSTD frame at the start of src (trailing padding allowed) into a new
 * malloc()ed buffer of at most max_out bytes. CUDA_ERROR_NOT_SUPPORTED without libzstd,
 * CUDA_ERROR_INVALID_IMAGE for a bad or oversized frame. */
CUresult sim_zstd_decompress(const unsigned char *src, size_t src_len, size_t max_out,
                             unsigned char **out, size_t *out_len);

/* ---- simulated kernels (sim_kernels.c) --------------------------------------------------- */
#define SIM_KERNEL_MAX_PARAMS 8
struct sim_dims {
    unsigned grid[3], block[3];
};
typedef CUresult (*sim_kernel_fn)(const unsigned char *params, const struct sim_dims *d);
struct sim_kernel_def {
    const char *name;
    int nparams;
    struct sim_param params[SIM_KERNEL_MAX_PARAMS];
    sim_kernel_fn fn;
};
const struct sim_kernel_def *sim_kernel_find(const char *name);
uint32_t sim_params_size(int nparams, const struct sim_param *params);

/* ---- modules and functions (sim_module.c) ------------------------------------------------ */
struct sim_module;
struct sim_func {
    uint64_t fh; /* CUfunction handle */
    uint64_t kh; /* CUkernel handle (library kernels), else 0 */
    struct sim_module *mod;
    char *name;
    const struct sim_kernel_def *def; /* the host version, or NULL */
    int nparams;                      /* -1: unknown */
    const struct sim_param *params;
    int regs;
    int attr[SIM_FUNC_ATTR_COUNT]; /* settable attributes */
    int cache_config;
};
/* The function named by a CUfunction or a CUkernel handle, or NULL. */
struct sim_func *sim_func_get(uint64_t h);
void sim_module_release_ctx(uint64_t ctx);
/* Calls fn(arg, CUfunction handle) for each kernel of module hmod that the image names, in the
 * image's order (the functions are created as cuModuleGetFunction would); returns how many, or -1
 * if hmod is not a module. Caller holds the lock (sim_export.c, the tools-module table). */
long sim_module_foreach_function(uint64_t hmod, void (*fn)(void *arg, uint64_t fh), void *arg);

/* ---- launches (sim_launch.c) ------------------------------------------------------------- */
int sim_func_attr_value(const struct sim_func *f, int attrib);

/* ---- stream capture and graphs (sim_stream.c, sim_graph.c) -------------------------------- */
enum {
    SIM_ERR_ILLEGAL_STATE = 401,
    SIM_ERR_CAPTURE_INVALIDATED = 901
};
/* What a capturing stream records instead of doing it; a graph launch replays them in order. */
enum sim_op_kind {
    SIM_OP_MEMSET = 1,
    SIM_OP_DTOD,
    SIM_OP_KERNEL,
    SIM_OP_EVENT_RECORD,
    SIM_OP_EVENT_WAIT
};
struct sim_op {
    enum sim_op_kind kind;
    uint64_t dst, src, n; /* memset: n elements of elem bytes; dtod: n bytes */
    unsigned value, elem;
    uint64_t func;         /* kernel: the CUfunction / CUkernel handle */
    unsigned char *params; /* kernel: packed arguments (the graph owns a copy) */
    uint32_t params_len;
    struct sim_dims dims;
    uint64_t event; /* event record / wait */
};
struct sim_graph;
/* Where work submitted to stream s goes: CUDA_SUCCESS with *g NULL when s is not capturing (run
 * it), or with the graph being captured (record it with sim_graph_add); CUDA_ERROR_STREAM_CAPTURE_
 * INVALIDATED (901) when s's capture was invalidated. Lock held. */
CUresult sim_capture_target(CUstream s, struct sim_graph **g);
/* An illegal call on stream s (synchronize, query, a host copy): if s is capturing, invalidate
 * the capture and return true. Lock held. */
bool sim_capture_invalidate(CUstream s);
/* Records op (the kernel parameters are copied). Lock held. */
CUresult sim_graph_add(struct sim_graph *g, const struct sim_op *op);
struct sim_graph *sim_graph_new(uint64_t ctx); /* NULL: out of memory */
void sim_graph_free(struct sim_graph *g);
/* Gives g a CUgraph handle (0: out of memory, g untouched). */
uint64_t sim_graph_publish(struct sim_graph *g);
/* Replay of an event record: the event completes now. Lock held. */
void sim_event_replay_record(uint64_t event);
/* Frees the graphs and graph execs created in context ctx (it is being destroyed). */
void sim_graph_release_ctx(uint64_t ctx);
/* A memset of n elements of elem (1, 2, 4) bytes, checked; the work of cuMemsetD*. Lock held. */
CUresult sim_memset_run(uint64_t dst, unsigned value, size_t n, unsigned elem);

/* ---- process checkpoints (sim_checkpoint.c, with sim_memory.c and sim_vmm.c) ------------- */
/* Starts the thread that serves cuCheckpointProcess* calls made on this process by another one
 * (cuInit calls it). */
void sim_checkpoint_listen(void);
/* With the lock held. Saving copies every device byte to host memory and changes nothing else
 * (undone by discard); releasing then gives the device memory back; restoring maps it again, at
 * the same addresses, on the GPUs sim_phys_dev() now names, and writes the bytes back. */
CUresult sim_memory_save(void);
void sim_memory_discard(void);
void sim_memory_release(void);
CUresult sim_memory_restore(void);
CUresult sim_vmm_save(void);
void sim_vmm_discard(void);
void sim_vmm_release(void);
CUresult sim_vmm_restore(void);
/* The memory file offset of a VMM mapping of physical allocation `obj` once it is restored. */
uint64_t sim_vmm_restored_offset(void *obj, uint64_t old_file_off);

#endif /* GP_SIM_INTERNAL_H */
