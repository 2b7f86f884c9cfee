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
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
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
