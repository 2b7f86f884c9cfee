/*
 * test_sim_ipc.c: device memory shared between two processes of two simulated GPUs of one server
 * (cuMemExportToShareableHandle / cuMemImportFromShareableHandle, sim_ipc.c), as two workers of
 * one job carry CUDA IPC (docs/multi-gpu.md).
 *
 * Two forked "workers", each with its own cuInit, GPU and memory file, each the other's peer
 * (as gpupoold configures simulated GPUs): the exporter fills an allocation and passes its fd
 * over a Unix socket (SCM_RIGHTS, as through gpupoold); the importer maps it in its own VA
 * window and reads the same bytes; what the importer writes the exporter reads; the exporter's
 * cuMemRelease while it is imported keeps the bytes (a new allocation of the exporter does not
 * take them). An fd that is not an exported handle is refused.
 *
 * Events (cuIpcGetEventHandle / cuIpcOpenEventHandle, issue 37 item 4): only an event made with
 * CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING exports; its 64 bytes open in the other process
 * as an event that query, synchronize, stream waits and records take; once the exporter destroys
 * it the importer's query says so, and the record beside the memory file is gone.
 */
#include <fcntl.h>
#include <sys/socket.h>

#include "sim_test.h"

#define MIB (1024ull * 1024)
#define SIZE (4 * MIB)
#define UUID_A "11111111222233334444555555555555"
#define UUID_B "66666666777788889999aaaaaaaaaaaa"

static char dir[64], file_a[128], file_b[128];
static int sock[2]; /* [0]: the exporter's end, [1]: the importer's */

static void configure(bool exporter)
{
    char peer[256];
    snprintf(peer, sizeof(peer), "%s %s %s", exporter ? UUID_B : UUID_A, exporter ? "0x30" : "0x20",
             exporter ? file_b : file_a);
    CHECK(setenv("GPUPOOL_SIM_TOTAL_MEMORY", "64MiB", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_UUID", exporter ? UUID_A : UUID_B, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_PCI_BUS", exporter ? "0x20" : "0x30", 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", exporter ? file_a : file_b, 1) == 0);
    CHECK(setenv("GPUPOOL_SIM_PEER", peer, 1) == 0);
}

static CUmemAllocationProp prop_of(int handle_types)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = handle_types;
    return prop;
}

/* Reserves SIZE in this process's window and maps h there, read-write for device 0. */
static CUdeviceptr map_here(CUmemGenericAllocationHandle h)
{
    CUdeviceptr p = 0;
    OK(cuMemAddressReserve(&p, SIZE, 0, 0, 0));
    OK(cuMemMap(p, SIZE, 0, h, 0));
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    OK(cuMemSetAccess(p, SIZE, &acc, 1));
    return p;
}

static bool has_pattern(CUdeviceptr p, unsigned seed)
{
    unsigned char *b = malloc(SIZE);
    CHECK(b != NULL);
    OK(cuMemcpyDtoH_v2(b, p, SIZE));
    bool same = true;
    for (uint64_t i = 0; i < SIZE && same; i++)
        same = b[i] == sim_test_pattern(seed, i);
    free(b);
    return same;
}

static void send_fd(int s, int fd)
{
    char byte = 'f';
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof(u));
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    CHECK(sendmsg(s, &msg, 0) == 1);
}

static int recv_fd(int s)
{
    char byte = 0;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof(u.buf)};
    CHECK(recvmsg(s, &msg, 0) == 1);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    CHECK(c != NULL && c->cmsg_type == SCM_RIGHTS);
    int fd = -1;
    memcpy(&fd, CMSG_DATA(c), sizeof(int));
    return fd;
}

static void step(int s, char say)
{
    CHECK(write(s, &say, 1) == 1);
}

static void await(int s, char want)
{
    char c = 0;
    CHECK(read(s, &c, 1) == 1);
    CHECK_EQ(c, want);
}

static void exporter(void)
{
    CHECK(close(sock[1]) == 0); /* so that a failed importer is an EOF here, not a hang */
    configure(true);
    sim_test_init();
    int posix_fd = 0;
    OK(cuDeviceGetAttribute(&posix_fd, 103 /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */, 0));
    CHECK_EQ(posix_fd, 1);
    CUmemAllocationProp plain = prop_of(CU_MEM_HANDLE_TYPE_NONE),
                        shareable = prop_of(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h = 0, other = 0;
    int fd = -1;
    /* Not asked for at cuMemCreate: not exportable, as on the driver. */
    OK(cuMemCreate(&other, SIZE, &plain, 0));
    CHECK_RC(cuMemExportToShareableHandle(&fd, other, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
             CUDA_ERROR_INVALID_VALUE);
    OK(cuMemRelease(other));

    OK(cuMemCreate(&h, SIZE, &shareable, 0));
    CUdeviceptr p = map_here(h);
    sim_test_fill(p, SIZE, 1);
    OK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    send_fd(sock[0], fd);
    CHECK(close(fd) == 0);

    await(sock[0], 'w'); /* the importer read pattern 1 and wrote pattern 3 */
    CHECK(has_pattern(p, 3));
    /* Freed while imported: the bytes stay the importer's until it unmaps them. */
    OK(cuMemUnmap(p, SIZE));
    OK(cuMemRelease(h));
    OK(cuMemAddressFree(p, SIZE));
    OK(cuMemCreate(&other, SIZE, &plain, 0));
    CUdeviceptr q = map_here(other);
    sim_test_fill(q, SIZE, 5);
    step(sock[0], 'r');

    int ipc_events = 0;
    OK(cuDeviceGetAttribute(&ipc_events, 125 /* IPC_EVENT_SUPPORTED */, 0));
    CHECK_EQ(ipc_events, 1);
    CUevent plain_ev = NULL, ev = NULL;
    CUipcEventHandle eh;
    OK(cuEventCreate(&plain_ev, CU_EVENT_DISABLE_TIMING));
    CHECK_RC(cuIpcGetEventHandle(&eh, plain_ev), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventCreate(&ev, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);
    OK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    OK(cuIpcGetEventHandle(&eh, ev));
    OK(cuEventRecord(ev, NULL));
    CHECK(write(sock[0], &eh, sizeof eh) == (ssize_t)sizeof eh);
    await(sock[0], 'e'); /* the importer opened, waited for and recorded the event */
    OK(cuEventQuery(ev));
    OK(cuEventDestroy_v2(ev));
    OK(cuEventDestroy_v2(plain_ev));
    step(sock[0], 'x');
    await(sock[0], 'd');
}

static void importer(void)
{
    CHECK(close(sock[0]) == 0);
    configure(false);
    sim_test_init();
    int fd = recv_fd(sock[1]);
    CUmemGenericAllocationHandle h = 0;
    CHECK_RC(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, 2), CUDA_ERROR_NOT_SUPPORTED);
    OK(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CHECK(close(fd) == 0); /* the import does not need the fd any more, as with the driver */
    CUdeviceptr p = map_here(h);
    CHECK(has_pattern(p, 1));
    sim_test_fill(p, SIZE, 3);
    step(sock[1], 'w');
    await(sock[1], 'r');
    CHECK(has_pattern(p, 3)); /* not the exporter's new allocation (pattern 5) */

    CUipcEventHandle eh;
    CHECK(read(sock[1], &eh, sizeof eh) == (ssize_t)sizeof eh);
    CUevent ev = NULL, bogus = NULL;
    OK(cuIpcOpenEventHandle(&ev, eh));
    OK(cuStreamWaitEvent(NULL, ev, 0));
    OK(cuEventSynchronize(ev));
    OK(cuEventQuery(ev));
    OK(cuEventRecord(ev, NULL));
    float ms = 0;
    CHECK_RC(cuEventElapsedTime_v2(&ms, ev, ev), CUDA_ERROR_INVALID_HANDLE); /* no timing */
    CUipcEventHandle forged = eh;
    forged.reserved[8] = 'z';
    CHECK_RC(cuIpcOpenEventHandle(&bogus, forged), CUDA_ERROR_INVALID_VALUE);
    step(sock[1], 'e');
    await(sock[1], 'x'); /* the exporter destroyed its event */
    CHECK_RC(cuEventQuery(ev), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuIpcOpenEventHandle(&bogus, eh), CUDA_ERROR_INVALID_VALUE);
    OK(cuEventDestroy_v2(ev));
    OK(cuMemUnmap(p, SIZE));
    OK(cuMemRelease(h));
    OK(cuMemAddressFree(p, SIZE));

    /* Any other fd is not a handle: a plain file, and no file at all. */
    const char *path = sim_test_write_temp("not a handle");
    int bad = open(path, O_RDONLY | O_CLOEXEC);
    CHECK(bad >= 0);
    CHECK_RC(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)bad,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             CUDA_ERROR_INVALID_VALUE);
    CHECK(close(bad) == 0);
    CHECK(unlink(path) == 0);
    CHECK_RC(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)-1,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             CUDA_ERROR_INVALID_VALUE);
    step(sock[1], 'd');
}

static pid_t spawn(void (*fn)(void))
{
    CHECK(fflush(NULL) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        fn();
        exit(0);
    }
    return pid;
}

static void wait_ok(pid_t pid)
{
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void test_two_workers_share_memory(void)
{
    snprintf(dir, sizeof(dir), "/tmp/gp_ipc_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(file_a, sizeof(file_a), "%s/a.mem", dir);
    snprintf(file_b, sizeof(file_b), "%s/b.mem", dir);
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sock) == 0);
    pid_t a = spawn(exporter), b = spawn(importer);
    CHECK(close(sock[0]) == 0 && close(sock[1]) == 0);
    wait_ok(a);
    wait_ok(b);
    CHECK(unlink(file_a) == 0 && unlink(file_b) == 0 && rmdir(dir) == 0);
}

/* Without a memory file there is nothing another process could map. */
static void test_needs_a_memory_file(void)
{
    CHECK(setenv("GPUPOOL_SIM_MEMORY_FILE", "", 1) == 0);
    sim_test_init();
    int posix_fd = 1;
    OK(cuDeviceGetAttribute(&posix_fd, 103 /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */, 0));
    CHECK_EQ(posix_fd, 0);
    CUmemAllocationProp shareable = prop_of(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h = 0;
    int fd = -1;
    OK(cuMemCreate(&h, SIZE, &shareable, 0));
    CHECK_RC(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
             CUDA_ERROR_NOT_SUPPORTED);
    CHECK(strstr(gpupoolSimLastErrorDetail(), "memory_file") != NULL);
    OK(cuMemRelease(h));
}

SIM_TEST_MAIN(SIM_T(two_workers_share_memory), SIM_T(needs_a_memory_file))
