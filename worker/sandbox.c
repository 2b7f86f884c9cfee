/*
 * sandbox.c: what a worker may still do once it is set up (docs/security.md, "The worker").
 *
 * A worker parses a tenant's frames; a bug there must not hand the tenant gpupoold's secrets.
 * Two steps:
 *
 *   wk_harden_process, first thing in main: not dumpable (no ptrace or /proc/PID/mem by other
 *     processes of gpupoold's user, /proc/PID/environ readable by root only), no core files
 *     (a core would hold the TLS key and tenants' data), and no_new_privs (nothing it executes
 *     gains privileges; Landlock needs it too).
 *   wk_sandbox_apply, once the TLS files are read and before the driver loads (Landlock confines
 *     the calling thread and the threads it starts later, and the driver starts threads of its
 *     own): a Landlock domain (Linux 5.13+) that lets the worker read and execute its
 *     libraries, read its own /proc/PID and the driver's parts of /proc and /sys, use the GPU's
 *     device files, and write only its own folders (--cache-dir, --adopt-dir, the folders of
 *     --sandbox-rw; --sandbox-ro adds what it reads: the simulated GPU's config). Everything
 *     else is refused, whatever the file modes say: the state directory (local-admin.token, the
 *     identity key, the database), /etc/gpupool, the TLS key file, other users' homes, other
 *     processes' /proc/PID. Where the kernel knows them it also refuses TCP bind/connect (a
 *     worker only uses the socket it was given) and signals and abstract Unix sockets outside
 *     its own domain. Landlock also keeps it from ptracing any process outside its domain,
 *     root's included.
 *
 * The rules are all in this file (the list is in docs/security.md); a kernel without Landlock
 * gets a warning in the log and the worker goes on (the process-level steps still hold).
 * `--no-sandbox` (gpupoold's `worker_sandbox = false`) skips the Landlock step, for a driver that
 * needs more than the list allows; docs/validation.md says what a real GPU must check.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "worker.h"

/* Rights newer than some UAPI headers (the values are the kernel's ABI, fixed forever). */
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14) /* ABI 3 */
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#endif
#ifndef LANDLOCK_ACCESS_NET_BIND_TCP
#define LANDLOCK_ACCESS_NET_BIND_TCP (1ULL << 0) /* ABI 4 */
#define LANDLOCK_ACCESS_NET_CONNECT_TCP (1ULL << 1)
#endif
#ifndef LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET
#define LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0) /* ABI 6 */
#define LANDLOCK_SCOPE_SIGNAL (1ULL << 1)
#endif

/* struct landlock_ruleset_attr as of ABI 6; the kernel takes the size we pass, so an older
 * kernel is given only the first field (ABI 1-3) or two (ABI 4-5). */
struct ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

#define FS_READ (LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR)
#define FS_EXEC (FS_READ | LANDLOCK_ACCESS_FS_EXECUTE)
#define FS_DEV                                                                                     \
    (LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_IOCTL_DEV)
#define FS_RW                                                                                      \
    (FS_READ | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |                     \
     LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |  \
     LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_TRUNCATE)
/* The rights a rule on a file (not a folder) may carry. */
#define FS_FILE_RIGHTS                                                                             \
    (LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE |   \
     LANDLOCK_ACCESS_FS_TRUNCATE | LANDLOCK_ACCESS_FS_IOCTL_DEV)

/* Read and execute: the loader's folders and what the driver dlopens later (the CUDA driver
 * loads its PTX JIT and other libraries lazily, at the first use). */
static const char *const exec_paths[] = {
    "/usr",  "/lib", "/lib64",           "/lib32",          "/libx32",          "/bin",
    "/sbin", "/opt", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d"};
/* Read only: what glibc and the NVIDIA driver read (driver parameters in /proc/driver/nvidia,
 * device numbers in /proc/devices, the PCI topology in /sys, the time zone). Not /proc as a
 * whole: Landlock refuses ptrace and /proc/PID/mem outside the domain, but not the reads the
 * kernel checks in ptrace's read mode, so /proc/PID/environ of gpupoold (its PGPASSWORD) would
 * be open to a worker of the same user. The worker's own /proc/PID: see allow_proc_self. */
static const char *const read_paths[] = {
    "/proc/driver",  "/proc/devices", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
    "/proc/sys",     "/proc/modules", "/proc/version", "/proc/uptime",  "/proc/filesystems",
    "/proc/loadavg", "/sys",          "/etc/localtime"};
/* Device files read and written (and ioctl'd, for the GPU's). */
static const char *const dev_paths[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random",
                                        "/dev/urandom"};

static long ll_create(const struct ruleset_attr *a, size_t size, uint32_t flags)
{
    return syscall(SYS_landlock_create_ruleset, a, size, flags);
}

int wk_harden_process(void)
{
    int rc = 0;
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        wk_warn("PR_SET_DUMPABLE: %s", strerror(errno));
        rc = -1;
    }
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none) != 0) {
        wk_warn("RLIMIT_CORE: %s", strerror(errno));
        rc = -1;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        wk_warn("PR_SET_NO_NEW_PRIVS: %s", strerror(errno));
        rc = -1;
    }
    return rc;
}

/* The ruleset being built, and the first failure (a bug or an unusable path we were told of). */
struct rules {
    int fd;
    uint64_t fs; /* the handled file system rights */
    char *err;
    size_t cap;
};

/* Allow `access` under `path`. A path that is not there is skipped (not every system has /lib32);
 * `required` paths (the folders we were given) must be there. */
static int allow(struct rules *r, const char *path, uint64_t access, int required)
{
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0) {
        if (!required && (errno == ENOENT || errno == ENOTDIR || errno == EACCES))
            return 0;
        snprintf(r->err, r->cap, "sandbox: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(r->err, r->cap, "sandbox: cannot stat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    struct landlock_path_beneath_attr pb = {.allowed_access = access & r->fs, .parent_fd = fd};
    if (!S_ISDIR(st.st_mode))
        pb.allowed_access &= FS_FILE_RIGHTS;
    long rc = syscall(SYS_landlock_add_rule, r->fd, LANDLOCK_RULE_PATH_BENEATH, &pb, 0);
    int e = errno;
    if (close(fd) != 0)
        wk_warn("close: %s", strerror(errno));
    if (rc != 0) {
        snprintf(r->err, r->cap, "sandbox: cannot add the rule for %s: %s", path, strerror(e));
        return -1;
    }
    return 0;
}

/* Every /dev/nvidia* file (nvidia0, nvidiactl, nvidia-uvm, nvidia-modeset, ...) and the
 * /dev/nvidia-caps folder (MIG). */
static int allow_gpu_devices(struct rules *r)
{
    DIR *d = opendir("/dev");
    if (!d)
        return 0;
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "nvidia", 6) != 0)
            continue;
        char path[300];
        snprintf(path, sizeof path, "/dev/%s", e->d_name);
        rc = allow(r, path, FS_DEV | FS_READ, 0);
    }
    if (closedir(d) != 0)
        wk_warn("closedir /dev: %s", strerror(errno));
    return rc;
}

/* The worker's own /proc/PID (what /proc/self and /proc/thread-self lead to): read, and written
 * (thread names, oom_score_adj). A rule holds the inode of the folder, and /proc makes a new
 * inode when a PID's entry has left the cache: the descriptor kept open here pins the entry for
 * the life of the process, so the rule keeps matching. */
static int allow_proc_self(struct rules *r)
{
    static int pinned = -1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d", (int)getpid());
    if (pinned < 0)
        pinned = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (pinned < 0) {
        snprintf(r->err, r->cap, "sandbox: cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    return allow(r, path, FS_READ | LANDLOCK_ACCESS_FS_WRITE_FILE, 1);
}

/* Each folder of a colon-separated search path (LD_LIBRARY_PATH): read and execute. */
static int allow_search_path(struct rules *r, const char *list)
{
    if (!list)
        return 0;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *p = strtok_r(buf, ":", &save); p; p = strtok_r(NULL, ":", &save))
        if (*p == '/' && allow(r, p, FS_EXEC, 0) != 0)
            return -1;
    return 0;
}

/* The folder of the driver library when --driver is a path (the simulated device's, or a driver
 * installed outside the usual folders). */
static int allow_driver_dir(struct rules *r, const char *driver)
{
    if (!driver || !strchr(driver, '/'))
        return 0; /* a name for the loader: it is in one of the folders above */
    char *real = realpath(driver, NULL);
    if (!real)
        return 0; /* it was loaded already; nothing more to find there */
    char *slash = strrchr(real, '/');
    if (slash && slash != real)
        *slash = '\0';
    int rc = allow(r, real, FS_EXEC, 0);
    free(real);
    return rc;
}

static int add_rules(struct rules *r, const struct wk_options *o)
{
    for (size_t i = 0; i < sizeof exec_paths / sizeof *exec_paths; i++)
        if (allow(r, exec_paths[i], FS_EXEC, 0) != 0)
            return -1;
    for (size_t i = 0; i < sizeof read_paths / sizeof *read_paths; i++)
        if (allow(r, read_paths[i], FS_READ, 0) != 0)
            return -1;
    for (size_t i = 0; i < sizeof dev_paths / sizeof *dev_paths; i++)
        if (allow(r, dev_paths[i], FS_DEV, 0) != 0)
            return -1;
    if (allow_proc_self(r) != 0 || allow_gpu_devices(r) != 0 ||
        allow_search_path(r, getenv("LD_LIBRARY_PATH")) != 0 || allow_driver_dir(r, o->driver) != 0)
        return -1;
    /* The worker's own folders. gpupoold makes the cache and adoption folders before it starts
     * workers; one that is missing is left out (the module cache then works in memory only,
     * the session ends with its daemon), the others must be there. */
    const char *own[] = {o->cache_dir, o->adopt_dir};
    for (size_t i = 0; i < sizeof own / sizeof *own; i++) {
        if (own[i] && access(own[i], F_OK) != 0)
            wk_warn("sandbox: %s is missing: left out of what this worker may write", own[i]);
        else if (own[i] && allow(r, own[i], FS_RW, 1) != 0)
            return -1;
    }
    for (int i = 0; i < o->n_sandbox_rw; i++)
        if (allow(r, o->sandbox_rw[i], FS_RW, 1) != 0)
            return -1;
    for (int i = 0; i < o->n_sandbox_ro; i++)
        if (allow(r, o->sandbox_ro[i], FS_READ, 1) != 0)
            return -1;
    /* The driver's JIT cache, when the operator moved it (else it is off: HOME is not passed). */
    const char *jit = getenv("CUDA_CACHE_PATH");
    if (jit && *jit == '/' && allow(r, jit, FS_RW, 0) != 0)
        return -1;
    return 0;
}

int wk_sandbox_abi(void)
{
    long abi = ll_create(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

/* The threads of this process (Threads: in /proc/self/status), 0 when unknown. */
static int thread_count(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return 0;
    char line[128];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    if (fclose(f) != 0)
        wk_warn("fclose /proc/self/status: %s", strerror(errno));
    return n;
}

int wk_sandbox_apply(const struct wk_options *o, char *err, size_t cap)
{
    /* Landlock confines the calling thread and those it starts from then on: a thread started
     * earlier (by a library's constructor) would stay free, and code that takes the worker over
     * could borrow it. */
    int threads = thread_count();
    if (threads > 1)
        wk_warn("sandbox: %d threads run already and stay outside the sandbox (a library "
                "started them before the worker's set-up)",
                threads - 1);
    int abi = wk_sandbox_abi();
    if (abi < 1) {
        wk_warn("this kernel has no Landlock: the worker runs without its file system sandbox "
                "(docs/security.md, \"The worker\"); Linux 5.13 or later with landlock in its "
                "lsm= list has it");
        return 1;
    }
    struct ruleset_attr a = {0};
    size_t size = sizeof a.handled_access_fs;
    a.handled_access_fs = FS_RW | FS_EXEC | LANDLOCK_ACCESS_FS_MAKE_CHAR |
                          LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_BLOCK |
                          LANDLOCK_ACCESS_FS_MAKE_SYM;
    if (abi >= 2)
        a.handled_access_fs |= LANDLOCK_ACCESS_FS_REFER;
    if (abi < 3)
        a.handled_access_fs &= ~LANDLOCK_ACCESS_FS_TRUNCATE;
    if (abi >= 4) {
        a.handled_access_net = LANDLOCK_ACCESS_NET_BIND_TCP | LANDLOCK_ACCESS_NET_CONNECT_TCP;
        size = offsetof(struct ruleset_attr, scoped);
    }
    if (abi >= 5)
        a.handled_access_fs |= LANDLOCK_ACCESS_FS_IOCTL_DEV;
    if (abi >= 6) {
        a.scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL;
        size = sizeof a;
    }
    struct rules r = {.fs = a.handled_access_fs, .err = err, .cap = cap};
    r.fd = (int)ll_create(&a, size, 0);
    if (r.fd < 0) {
        snprintf(err, cap, "sandbox: landlock_create_ruleset (ABI %d): %s", abi, strerror(errno));
        return -1;
    }
    int rc = add_rules(&r, o);
    if (rc == 0 && syscall(SYS_landlock_restrict_self, r.fd, 0) != 0) {
        snprintf(err, cap, "sandbox: landlock_restrict_self: %s", strerror(errno));
        rc = -1;
    }
    if (close(r.fd) != 0)
        wk_warn("close: %s", strerror(errno));
    return rc;
}
