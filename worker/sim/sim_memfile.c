/*
 * sim_memfile.c: the memory file, device memory that outlives the process (key memory_file).
 *
 * A GPU's DRAM keeps what a process wrote after the process is gone; the next process that
 * allocates the same memory can read it. That is why gpupoold scrubs a GPU between tenants, and
 * the scrub can only be tested if the simulated device behaves the same way. So, when configured,
 * device memory is not anonymous host memory but pages of one sparse file, mapped MAP_SHARED at
 * the device addresses the sim chooses anyway:
 *
 *   - device n owns [n * stride, n * stride + usable) of the file (stride: total_memory rounded up
 *     to a page; usable: rounded down), so the file is device_count * stride bytes;
 *   - allocations take file ranges first fit from the start of the device's part. Placement is a
 *     function of the sequence of allocations and frees only, so a new process repeating them
 *     gets the same bytes back;
 *   - freeing a range does not clear it (nor does the GPU);
 *   - zeroing whole pages punches a hole (sim_memfile_punch): a scrub of 80 GiB costs no disk
 *     space, no memory and almost no time, and the file shrinks back to what holds data;
 *   - a peer GPU (key `peer`, physical GPU device_count + k) is part 0 of its own memory file,
 *     opened when a restore first moves memory there. Offsets here are "virtual": physical GPU
 *     n's part starts at n * stride whichever file holds it (fd_at translates).
 *
 * Every function here runs under the sim lock (sim_internal.h), which is what makes the range
 * lists below safe to share between threads. Other processes using the same file are not seen:
 * each process believes it has the whole device (worker/sim/README.md, "Limitations").
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_internal.h"
#include "sim_shared.h"

#define PAGE 4096ull

struct range {
    uint64_t off, len;
};

/* Per device: the file ranges in use, sorted by offset, never overlapping. */
struct dev_ranges {
    struct range *r;
    size_t n, cap;
};

static int mem_fd = -1;
static int peer_fd[SIM_MAX_GPUS]; /* by peer; +1: opened (fd + 1, so that zero means not yet) */
static uint64_t stride, usable;
static struct dev_ranges used[SIM_MAX_GPUS]; /* by physical GPU: devices, then peers */
static bool punch_unsupported; /* the file system said so once: write zeros from then on */

bool sim_memfile_enabled(void)
{
    return mem_fd >= 0;
}

uint64_t sim_memfile_stride(void)
{
    return stride;
}

CUresult sim_memfile_init(void)
{
    const char *path = sim_cfg.memory_file;
    if (path[0] == '\0')
        return CUDA_SUCCESS;
    stride = (sim_cfg.total_memory + PAGE - 1) / PAGE * PAGE;
    usable = sim_cfg.total_memory / PAGE * PAGE;
    uint64_t want = stride * (uint64_t)sim_cfg.device_count;
    /* 0600: the file holds tenants' data, exactly what the scrub exists to protect. Never
     * through a link, and only a file of our own: the folder may be in /dev/shm, where any
     * user could have put either there first (gpupoold also checks the folder). */
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        sim_init_fail("cannot open the memory file %s (key memory_file): %s; check that its "
                      "directory exists and is writable",
                      path, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    struct stat st;
    const char *why = NULL;
    int err = 0;
    if (fstat(fd, &st) != 0) {
        err = errno;
        why = "fstat";
    } else if (!S_ISREG(st.st_mode)) {
        why = "not a regular file";
    } else if (st.st_uid != geteuid()) {
        why = "belongs to another user (remove it: someone may be reading tenants' memory)";
    } else if ((uint64_t)st.st_size < want && ftruncate(fd, (off_t)want) != 0) {
        /* Only ever grown: shrinking would pull pages from under another process mapping it. */
        err = errno;
        why = "cannot extend it to device_count x total_memory";
    }
    if (why) {
        sim_init_fail("memory file %s (key memory_file): %s%s%s", path, why, err ? ": " : "",
                      err ? strerror(err) : "");
        if (close(fd) != 0)
            fprintf(stderr, "gpupool-sim: close of the memory file failed\n");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    mem_fd = fd;
    return CUDA_SUCCESS;
}

/* The file and real offset behind virtual offset `off`; -1 when a peer's file cannot be opened. */
static int fd_at(uint64_t off, uint64_t *real)
{
    uint64_t part = off / stride;
    if (part < (uint64_t)sim_cfg.device_count) {
        *real = off;
        return mem_fd;
    }
    uint64_t k = part - (uint64_t)sim_cfg.device_count;
    if (k >= (uint64_t)sim_cfg.peer_count)
        return -1;
    if (peer_fd[k] == 0) {
        const char *path = sim_cfg.peers[k].memory_file;
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        struct stat st;
        int bad = fd < 0 || fstat(fd, &st) != 0;
        if (!bad && (!S_ISREG(st.st_mode) || st.st_uid != geteuid())) {
            bad = 1;
            errno = EPERM; /* not a file of ours (the same rule as our own memory file) */
        }
        if (bad || ((uint64_t)st.st_size < stride && ftruncate(fd, (off_t)stride) != 0)) {
            fprintf(stderr, "gpupool-sim: cannot use the memory file %s of peer GPU %llu: %s\n",
                    path, (unsigned long long)k, strerror(errno));
            if (fd >= 0 && close(fd) != 0)
                fprintf(stderr, "gpupool-sim: close failed\n");
            return -1;
        }
        peer_fd[k] = fd + 1;
    }
    *real = off - part * stride;
    return peer_fd[k] - 1;
}

CUresult sim_memfile_alloc(int dev, uint64_t len, uint64_t *off)
{
    dev = sim_phys_dev(dev); /* the GPU behind the ordinal: its part of the file */
    struct dev_ranges *d = &used[dev];
    if (len == 0 || len % PAGE != 0 || len > usable)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (sim_shared_enabled()) { /* one allocator for every process of the GPU (sim_shared.c) */
        uint64_t rel = 0;
        CUresult rc = sim_shared_alloc(dev, len, &rel);
        if (rc == CUDA_SUCCESS)
            *off = stride * (uint64_t)dev + rel;
        return rc;
    }
    if (d->n == d->cap) {
        size_t ncap = d->cap ? d->cap * 2 : 64;
        struct range *nr = realloc(d->r, ncap * sizeof(*nr));
        if (!nr)
            return CUDA_ERROR_OUT_OF_MEMORY;
        d->r = nr;
        d->cap = ncap;
    }
    /* First fit, from the start of the device's part: deterministic placement. */
    uint64_t base = stride * (uint64_t)dev, top = base + usable, cand = base;
    size_t i = 0;
    for (; i < d->n; i++) {
        if (d->r[i].off - cand >= len)
            break;
        cand = d->r[i].off + d->r[i].len;
    }
    if (top - cand < len)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memmove(&d->r[i + 1], &d->r[i], (d->n - i) * sizeof(*d->r));
    d->r[i] = (struct range){.off = cand, .len = len};
    d->n++;
    *off = cand;
    return CUDA_SUCCESS;
}

void sim_memfile_free(int dev, uint64_t off)
{
    /* The part the range lies in (the ordinal may have moved to another GPU since). */
    (void)dev;
    uint64_t part = off / stride;
    if (part >= SIM_MAX_GPUS) {
        fprintf(stderr, "gpupool-sim: memory file offset %llu is past the devices' parts\n",
                (unsigned long long)off);
        return;
    }
    if (sim_shared_enabled()) {
        sim_shared_free((int)part, off - part * stride);
        return;
    }
    struct dev_ranges *d = &used[part];
    size_t lo = 0, hi = d->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (d->r[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == d->n || d->r[lo].off != off) {
        /* A bookkeeping bug, not a caller error: callers only free what they allocated. */
        fprintf(stderr, "gpupool-sim: memory file range at %llu not allocated\n",
                (unsigned long long)off);
        return;
    }
    memmove(&d->r[lo], &d->r[lo + 1], (d->n - lo - 1) * sizeof(*d->r));
    d->n--;
}

/* All of [off, off+len) of the file read into buf, or buf written there; -1 on an I/O error. */
static int file_io(bool write, uint64_t voff, void *buf, uint64_t len)
{
    uint64_t off;
    int fd = fd_at(voff, &off);
    if (fd < 0)
        return -1;
    for (uint64_t done = 0; done < len;) {
        char *at = (char *)buf + done;
        ssize_t n = write ? pwrite(fd, at, len - done, (off_t)(off + done))
                          : pread(fd, at, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        done += (uint64_t)n;
    }
    return 0;
}

int sim_memfile_read(uint64_t off, void *buf, uint64_t len)
{
    return file_io(false, off, buf, len);
}

int sim_memfile_write(uint64_t off, const void *buf, uint64_t len)
{
    return file_io(true, off, (void *)(uintptr_t)buf, len); /* pwrite only reads it */
}

int sim_memfile_map(uint64_t addr, uint64_t len, uint64_t voff)
{
    uint64_t off;
    int fd = fd_at(voff, &off);
    if (fd < 0)
        return -1;
    void *want = (void *)(uintptr_t)addr;
    void *p = mmap(want, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)off);
    return p == want ? 0 : -1;
}

int sim_memfile_punch(uint64_t voff, uint64_t len)
{
    if (punch_unsupported)
        return -1;
    uint64_t off;
    int fd = fd_at(voff, &off);
    if (fd < 0)
        return -1;
    /* KEEP_SIZE: the file stays device_count x total_memory; the range reads back as zeros, in
     * this process's mapping as in any other's. */
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len) == 0)
        return 0;
    if (errno == EOPNOTSUPP || errno == ENOSYS) {
        punch_unsupported = true;
        fprintf(stderr, "gpupool-sim: the memory file's file system cannot punch holes; zeroing "
                        "device memory writes zeros instead (slower, and the file keeps its "
                        "blocks)\n");
    }
    return -1;
}
