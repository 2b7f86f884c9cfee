/*
 * sim_ipc.c: device memory shared between processes, the VMM way (cuMemExportToShareableHandle
 * and cuMemImportFromShareableHandle with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), which is
 * how gpupool's workers carry CUDA IPC between two processes of one job (docs/multi-gpu.md,
 * "CUDA IPC between the workers of one job").
 *
 * The driver's fd is the allocation itself. Here device memory lives in the GPU's memory file
 * (sim_memfile.c), and gpupoold gives each simulated GPU's process the other GPUs of the server
 * as peers with their memory files (key `peer`), so the fd only has to say where the bytes are:
 * it is a sealed memfd holding a record (the physical GPU's UUID, the allocation's offset in that
 * GPU's part of the file, its size). The importer finds the GPU among its own devices and peers
 * by UUID, and cuMemMap then maps that range of that file MAP_SHARED at the importer's own
 * address: both processes see the same bytes, at the addresses each one's window gives.
 *
 * The record grants nothing the importer could not do already (it opens the files anyway); what
 * keeps tenants apart is that only gpupool's workers ever hold these fds, and gpupoold gives one
 * to a worker only for a lease of the exporter's job (gpupoold/workers/ipc_broker.py).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_api.h"
#include "sim_internal.h"

#define IPC_MAGIC 0x3163706970677067ull /* "gpgpipc1" */
#define PAGE 4096ull

struct ipc_record {
    uint64_t magic;
    unsigned char uuid[16]; /* the physical GPU that holds the bytes */
    uint64_t rel_off;       /* within that GPU's part of its memory file */
    uint64_t size;
};

/* A sealed memfd holding rec; -1 with errno on failure. */
static int record_fd(const struct ipc_record *rec)
{
    int fd = memfd_create("gpupool-sim-ipc", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (pwrite(fd, rec, sizeof(*rec), 0) != (ssize_t)sizeof(*rec) ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        int err = errno ? errno : EIO;
        if (close(fd) != 0)
            err = errno; /* the fd is gone either way; say the later failure */
        errno = err;
        return -1;
    }
    return fd;
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      int handleType, unsigned long long flags)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!shareableHandle || flags != 0)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        sim_detail("the simulated device exports POSIX file descriptors only (handle type %d)",
                   handleType);
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    struct sim_vmm_share sh;
    rc = sim_vmm_share(handle, &sh);
    if (rc != CUDA_SUCCESS)
        return sim_leave(rc);
    int phys = sim_phys_dev(sh.dev);
    struct ipc_record rec = {.magic = IPC_MAGIC,
                             .rel_off = sh.file_off - sim_memfile_stride() * (uint64_t)phys,
                             .size = sh.size};
    sim_phys_uuid(&sim_cfg, phys, rec.uuid);
    int fd = record_fd(&rec);
    if (fd < 0) {
        sim_detail("cannot make the shareable handle's file: %s", strerror(errno));
        return sim_leave(CUDA_ERROR_OUT_OF_MEMORY);
    }
    *(int *)shareableHandle = fd;
    return sim_leave(CUDA_SUCCESS);
}

/* Reads and checks the record behind fd; false (detail said) when it is not one of ours. */
static bool read_record(int fd, struct ipc_record *rec)
{
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != (off_t)sizeof(*rec) ||
        seals < 0 || !(seals & F_SEAL_WRITE) ||
        pread(fd, rec, sizeof(*rec), 0) != (ssize_t)sizeof(*rec) || rec->magic != IPC_MAGIC) {
        sim_detail("file descriptor %d is not a shareable handle of the simulated device", fd);
        return false;
    }
    return true;
}

/* The physical GPU of this process (device or peer) with this UUID; -1 when none. */
static int phys_by_uuid(const unsigned char uuid[16])
{
    for (int n = 0; n < sim_phys_count(&sim_cfg); n++) {
        unsigned char u[16];
        sim_phys_uuid(&sim_cfg, n, u);
        if (memcmp(u, uuid, 16) == 0)
            return n;
    }
    return -1;
}

/* The ordinal an imported allocation reports: the device that is that GPU, else device 0 (the
 * importer reaches a peer's memory from its own device, as through peer access). */
static int ordinal_of(int phys)
{
    for (int d = 0; d < sim_cfg.device_count; d++)
        if (sim_phys_dev(d) == phys)
            return d;
    return 0;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        int shHandleType)
{
    CUresult rc = sim_enter();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!handle)
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        sim_detail("the simulated device imports POSIX file descriptors only (handle type %d)",
                   shHandleType);
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    if (!sim_memfile_enabled()) {
        sim_detail("sharing device memory between processes needs a memory file (key "
                   "memory_file)");
        return sim_leave(CUDA_ERROR_NOT_SUPPORTED);
    }
    int fd = (int)(intptr_t)osHandle;
    struct ipc_record rec;
    if (!read_record(fd, &rec))
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    int phys = phys_by_uuid(rec.uuid);
    if (phys < 0) {
        sim_detail("the shared memory is on a GPU this process does not know (not a device, "
                   "nor a peer: key peer)");
        return sim_leave(CUDA_ERROR_INVALID_DEVICE);
    }
    uint64_t usable = sim_cfg.total_memory / PAGE * PAGE;
    if (rec.size == 0 || rec.size % sim_cfg.granularity != 0 || rec.rel_off % PAGE != 0 ||
        rec.rel_off > usable || rec.size > usable - rec.rel_off) {
        sim_detail("the shareable handle names bytes outside its GPU's memory");
        return sim_leave(CUDA_ERROR_INVALID_VALUE);
    }
    uint64_t off = sim_memfile_stride() * (uint64_t)phys + rec.rel_off;
    return sim_leave(sim_vmm_import(ordinal_of(phys), off, rec.size, handle));
}

/*
 * Interprocess events (cuIpcGetEventHandle / cuIpcOpenEventHandle). The driver's handle is 64
 * bytes any process on the machine may open; gpupool's workers pass them through gpupoold's
 * broker, which gives them only to a lease of the exporter's token (gpupoold/workers/
 * ipc_broker.py). Here an exported event is a small record in a file beside the memory file
 * (the GPU's private folder, which only gpupool's processes open): the exporter's and the
 * importer's cuEventRecord update it, their query and synchronize read it. Work on the simulated
 * device is complete when its call returns, so a recorded event is always complete: the record
 * says whether the exporter still has the event (the driver leaves using an event whose exporter
 * destroyed it undefined; here it is CUDA_ERROR_INVALID_HANDLE, so that a test can see it). The
 * handle names the file by 32 random hex digits. The exporter removes the file when it destroys
 * the event (a killed worker leaves it behind, 64 bytes, until the folder is cleaned).
 */
#define IPC_EVENT_MAGIC 0x3176657069706770ull /* "pgpipev1" */
#define EVENT_NAME_LEN 32

struct ipc_event_record {
    uint64_t magic;
    _Atomic uint64_t records;       /* cuEventRecord calls, in either process */
    _Atomic uint64_t last_t_ns;     /* CLOCK_MONOTONIC of the latest */
    _Atomic uint32_t exporter_gone; /* the exporting process destroyed its event */
};

struct sim_ipc_event {
    struct ipc_event_record *rec; /* MAP_SHARED */
    bool exporter;
    char name[EVENT_NAME_LEN + 1];
    char path[SIM_PATH_MAX];
};

/* What the driver-level handle holds (the program never sees it: gpupoold keeps it). */
struct ipc_event_wire {
    uint64_t magic;
    char name[EVENT_NAME_LEN];
};
_Static_assert(sizeof(struct ipc_event_wire) <= sizeof(CUipcEventHandle), "handle layout");

/* The record file's path for name; false when the memory file's folder leaves no room. */
static bool event_path(const char *name, char *out, size_t cap)
{
    const char *slash = strrchr(sim_cfg.memory_file, '/');
    size_t dir = slash ? (size_t)(slash - sim_cfg.memory_file) : 0;
    int n = snprintf(out, cap, "%.*s/ipc-event-%s", (int)dir, sim_cfg.memory_file, name);
    return n > 0 && (size_t)n < cap;
}

static struct sim_ipc_event *map_event(const char *name, bool create)
{
    struct sim_ipc_event *ev = calloc(1, sizeof(*ev));
    if (!ev)
        return NULL;
    memcpy(ev->name, name, EVENT_NAME_LEN);
    ev->exporter = create;
    if (!event_path(ev->name, ev->path, sizeof ev->path)) {
        sim_detail("the memory file's folder name is too long for an event record");
        free(ev);
        return NULL;
    }
    int fd =
        open(ev->path, create ? O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC : O_RDWR | O_CLOEXEC, 0600);
    struct stat st;
    bool ok = fd >= 0 && (!create || ftruncate(fd, sizeof(struct ipc_event_record)) == 0) &&
              fstat(fd, &st) == 0 && st.st_size == (off_t)sizeof(struct ipc_event_record);
    void *p =
        ok ? mmap(NULL, sizeof(struct ipc_event_record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
           : MAP_FAILED;
    int err = errno;
    if (fd >= 0 && close(fd) != 0 && p != MAP_FAILED)
        err = errno; /* the mapping stays valid; only say it */
    if (p == MAP_FAILED) {
        sim_detail("interprocess event record %s: %s", ev->path,
                   ok ? strerror(err) : "missing or not one (its exporter destroyed the event?)");
        if (create && unlink(ev->path) != 0 && errno != ENOENT)
            sim_detail("interprocess event record %s: %s", ev->path, strerror(errno));
        free(ev);
        return NULL;
    }
    ev->rec = p;
    if (create) {
        ev->rec->magic = IPC_EVENT_MAGIC;
    } else if (ev->rec->magic != IPC_EVENT_MAGIC) {
        sim_detail("%s is not an interprocess event record", ev->path);
        sim_ipc_event_close(ev);
        return NULL;
    }
    return ev;
}

CUresult sim_ipc_event_export(struct sim_ipc_event **ev, CUipcEventHandle *out)
{
    if (!sim_memfile_enabled()) {
        sim_detail("interprocess events need a memory file (key memory_file): their record "
                   "lives beside it");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!*ev) {
        unsigned char rnd[EVENT_NAME_LEN / 2];
        if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
            sim_detail("getrandom: %s", strerror(errno));
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        char name[EVENT_NAME_LEN + 1];
        for (size_t i = 0; i < sizeof rnd; i++)
            snprintf(name + 2 * i, 3, "%02x", rnd[i]);
        *ev = map_event(name, true);
        if (!*ev)
            return CUDA_ERROR_OUT_OF_MEMORY; /* why: the detail */
    }
    struct ipc_event_wire wire = {.magic = IPC_EVENT_MAGIC};
    memcpy(wire.name, (*ev)->name, EVENT_NAME_LEN);
    memset(out, 0, sizeof(*out));
    memcpy(out->reserved, &wire, sizeof wire);
    return CUDA_SUCCESS;
}

CUresult sim_ipc_event_import(const CUipcEventHandle *handle, struct sim_ipc_event **ev)
{
    struct ipc_event_wire wire;
    memcpy(&wire, handle->reserved, sizeof wire);
    bool named = wire.magic == IPC_EVENT_MAGIC;
    for (int i = 0; named && i < EVENT_NAME_LEN; i++)
        named = (wire.name[i] >= '0' && wire.name[i] <= '9') ||
                (wire.name[i] >= 'a' && wire.name[i] <= 'f');
    if (!named) {
        sim_detail("not an interprocess event handle of the simulated device");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!sim_memfile_enabled()) {
        sim_detail("interprocess events need a memory file (key memory_file)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    char name[EVENT_NAME_LEN + 1];
    memcpy(name, wire.name, EVENT_NAME_LEN);
    name[EVENT_NAME_LEN] = '\0';
    *ev = map_event(name, false);
    return *ev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

void sim_ipc_event_recorded(struct sim_ipc_event *ev, uint64_t t_ns)
{
    atomic_store(&ev->rec->last_t_ns, t_ns);
    atomic_fetch_add(&ev->rec->records, 1);
}

CUresult sim_ipc_event_done(const struct sim_ipc_event *ev)
{
    if (!ev->exporter && atomic_load(&ev->rec->exporter_gone)) {
        sim_detail("the exporting process destroyed this interprocess event");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return CUDA_SUCCESS; /* every recorded work is complete when its call returns */
}

void sim_ipc_event_close(struct sim_ipc_event *ev)
{
    if (ev->exporter) {
        atomic_store(&ev->rec->exporter_gone, 1);
        if (unlink(ev->path) != 0 && errno != ENOENT)
            sim_detail("removing interprocess event record %s: %s", ev->path, strerror(errno));
    }
    if (munmap(ev->rec, sizeof(struct ipc_event_record)) != 0)
        sim_detail("munmap of an interprocess event record: %s", strerror(errno));
    free(ev);
}
