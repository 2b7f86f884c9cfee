/*
 * test_nvml_view.c: unit tests of nvml_view.c, from info replies (encoded here with the generated
 * code of protocol/gpupool.toml, then decoded as the NVML shim decodes them) to NVML's answers:
 * identity, units, unknown values as NOT_SUPPORTED, requirements, this client's processes,
 * NVML's count protocol and struct layouts. Run by tests/test_nvml_view.py (also under
 * ASan/UBSan). Prints "all checks passed" and exits 0, or names each failure.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_protocol.h"
#include "info_client.h"
#include "nvml_view.h"

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                 \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

/* A record's text field from a literal. */
#define TEXT(field_, s_) ((field_) = (s_), (field_##_len) = (uint32_t)strlen(s_))

/* A GPU view whose live values are all unknown (-1, NaN). */
static gp_info_gpu unknown_gpu(unsigned index, const char *name, const char *uuid,
                               uint64_t memory_total)
{
    gp_info_gpu g;
    memset(&g, 0, sizeof g);
    g.index = index;
    TEXT(g.name, name);
    TEXT(g.uuid, uuid);
    TEXT(g.pci_bus_id, "");
    TEXT(g.state, "free");
    g.memory_total = memory_total;
    g.live_at = NAN;
    g.live_memory_total = g.memory_used = g.memory_free = -1;
    g.gpu_util = g.memory_util = g.temperature_c = g.sm_clock_mhz = g.mem_clock_mhz = -1;
    g.power_w = g.power_limit_w = g.energy_j = NAN;
    g.cuda_driver_version = 13000;
    return g;
}

static gp_info_lease lease(uint64_t id, unsigned gpu, const char *host, unsigned pid, int mine)
{
    gp_info_lease l;
    memset(&l, 0, sizeof l);
    l.id = id;
    l.gpu = gpu;
    TEXT(l.client_host, host);
    l.client_pid = pid;
    l.mine = (uint32_t)mine;
    return l;
}

/* An info reply as a server sends it, decoded as the NVML shim decodes it. */
typedef struct reply {
    uint8_t *body;
    gp_info_reply r;
} reply;

static int build(reply *out, const gp_info_gpu *gpus, uint32_t ngpus, const gp_info_lease *leases,
                 uint32_t nleases)
{
    gp_info_reply m;
    memset(&m, 0, sizeof m);
    m.major = GP_PROTO_MAJOR;
    m.minor = GP_PROTO_MINOR;
    TEXT(m.driver_version, "580.65.06");
    m.cuda_driver_version = 13000;
    m.gpu_views.count = ngpus;
    m.gpu_views_items = gpus;
    m.lease_views.count = nleases;
    m.lease_views_items = leases;
    size_t n = gp_info_reply_size(&m);
    out->body = malloc(n);
    if (!out->body || gp_info_reply_encode(out->body, &m) != n)
        return -1;
    return gp_info_reply_decode(out->body, n, &out->r);
}

/* The i-th GPU view of a reply. */
static int view(const reply *rep, unsigned i, gp_info_gpu *out)
{
    gp_record_span s = rep->r.gpu_views;
    for (unsigned k = 0; gp_info_gpu_next(&s, out) == 0; k++)
        if (k == i)
            return 0;
    return -1;
}

/* The reply most tests read: an H100 with every live value, a simulated GPU with some unknown,
 * an old server's GPU with none; leases of this client ("mine") and of others. */
static int load(reply *out)
{
    gp_info_gpu g[3];
    g[0] = unknown_gpu(0, "NVIDIA H100 80GB HBM3", "GPU-0a1b2c3d-0000-1111-2222-333344445555",
                       85520809984ull);
    TEXT(g[0].pci_bus_id, "00000000:18:00.0");
    TEXT(g[0].state, "leased");
    g[0].live_at = 1767225600.0;
    g[0].live_memory_total = 85520809984ll;
    g[0].memory_used = 1073741824ll;
    g[0].memory_free = 84447068160ll;
    g[0].gpu_util = 38;
    g[0].memory_util = 5;
    g[0].temperature_c = 41;
    g[0].power_w = 123.4567;
    g[0].power_limit_w = 700.0;
    g[0].energy_j = 5000.25;
    g[0].sm_clock_mhz = 1980;
    g[0].mem_clock_mhz = 2619;
    g[1] =
        unknown_gpu(1, "Simulated GPU", "GPU-5e000000-0000-0000-0000-000000000001", 17179869184ull);
    TEXT(g[1].pci_bus_id, "00000000:41:00.0");
    g[1].simulated = 1;
    g[1].live_at = 1767225600.0;
    g[1].live_memory_total = 17179869184ll;
    g[1].memory_used = 0;
    g[1].memory_free = 17179869184ll;
    g[1].gpu_util = 0;
    g[1].memory_util = 0;
    g[2] = unknown_gpu(2, "Old server GPU", "", 1000);
    gp_info_lease l[5] = {
        lease(7, 0, "laptop", 4242, 1), lease(8, 0, "other", 99, 0),
        lease(9, 0, "laptop", 4343, 1), lease(10, 1, "laptop", 5555, 0),
        lease(11, 1, "laptop", 0, 1), /* no pid known */
    };
    int rc = build(out, g, 3, l, 5);
    if (rc != 0)
        printf("  (decoding the reply failed: %d)\n", rc);
    return rc;
}

static void test_decoding(void)
{
    reply rep;
    CHECK(load(&rep) == 0);
    size_t n = gp_info_reply_size(&rep.r); /* a decoded reply re-encodes its spans as they are */
    uint8_t *again = malloc(n);
    CHECK(again && gp_info_reply_encode(again, &rep.r) == n);
    CHECK(again && rep.r.gpu_views.count == 3 && rep.r.lease_views.count == 5);
    gp_info_reply cut;
    for (size_t k = 0; again && k < n; k += 7) /* every shorter body is refused */
        CHECK(gp_info_reply_decode(again, k, &cut) != 0);
    if (again) {
        uint8_t *longer = malloc(n + 1);
        CHECK(longer != NULL);
        if (longer) {
            memcpy(longer, again, n);
            longer[n] = 0;
            CHECK(gp_info_reply_decode(longer, n + 1, &cut) == GP_PROTO_ETRAILING);
            free(longer);
        }
    }
    free(again);
    /* a span's count past the spec's limit is refused before any record is read */
    gp_info_reply m;
    memset(&m, 0, sizeof m);
    uint8_t body[256];
    size_t k = gp_info_reply_encode(body, &m);
    gp_wr_u32(body + k - 12, 1025); /* shared_gpus (third from the end): 1,025 of 1,024 */
    CHECK(gp_info_reply_decode(body, k, &cut) == GP_PROTO_EMALFORMED);
    free(rep.body);
}

static void test_server_and_identity(void)
{
    reply rep;
    CHECK(load(&rep) == 0);
    gp_nvml_server s;
    gp_nvml_server_from_reply(&rep.r, &s);
    CHECK(strcmp(s.driver_version, "580.65.06") == 0 && s.cuda_driver_version == 13000);

    gp_info_gpu v;
    CHECK(gp_nvml_find_gpu(&rep.r, "gpu-5E000000-0000-0000-0000-000000000001", &v) == 0);
    CHECK(gp_nvml_find_gpu(&rep.r, "GPU-nope", &v) == -1 && gp_nvml_find_gpu(&rep.r, "", &v) == -1);
    CHECK(gp_nvml_find_gpu(&rep.r, "GPU-5e000000", &v) == -1); /* a prefix is not the UUID */
    gp_nvml_gpu g;
    CHECK(gp_nvml_find_gpu(&rep.r, "GPU-5e000000-0000-0000-0000-000000000001", &v) == 0 &&
          gp_nvml_gpu_from_view(&rep.r, &v, &g) == 0);
    CHECK(g.server_index == 1 && g.simulated == 1 && strcmp(g.name, "Simulated GPU") == 0);
    CHECK(strcmp(g.uuid, "GPU-5e000000-0000-0000-0000-000000000001") == 0);
    CHECK(g.cc_major == -1); /* the reply does not carry it: the lease's libcuda answers */
    CHECK(gp_nvml_brand(g.name) == NVML_BRAND_UNKNOWN);
    CHECK(gp_nvml_find_gpu_index(&rep.r, 2, &v) == 0 && v.index == 2);
    CHECK(gp_nvml_find_gpu_index(&rep.r, 3, &v) == -1);

    gp_nvml_gpu h;
    CHECK(view(&rep, 0, &v) == 0 && gp_nvml_gpu_from_view(&rep.r, &v, &h) == 0);
    CHECK(strcmp(h.pci_bus_id, "00000000:18:00.0") == 0);

    /* a view without a name is no GPU to show */
    gp_info_gpu nameless = unknown_gpu(5, "", "GPU-x", 1);
    reply other;
    CHECK(build(&other, &nameless, 1, NULL, 0) == 0);
    CHECK(view(&other, 0, &v) == 0 && gp_nvml_gpu_from_view(&other.r, &v, &g) == -1);
    free(other.body);
    /* invalid UTF-8 from a server is cleaned, never passed on to tools */
    gp_info_gpu odd = unknown_gpu(0, "bad \xff name", "GPU-y", 1);
    CHECK(build(&other, &odd, 1, NULL, 0) == 0);
    CHECK(view(&other, 0, &v) == 0 && gp_nvml_gpu_from_view(&other.r, &v, &g) == 0 &&
          strcmp(g.name, "bad ? name") == 0);
    free(other.body);
    free(rep.body);

    CHECK(gp_nvml_brand("NVIDIA GeForce RTX 4090") == NVML_BRAND_GEFORCE);
    CHECK(gp_nvml_brand("Quadro RTX 6000") == NVML_BRAND_QUADRO);
    CHECK(gp_nvml_brand("Tesla V100-SXM2-16GB") == NVML_BRAND_TESLA);
    CHECK(gp_nvml_brand("NVIDIA TITAN RTX") == NVML_BRAND_TITAN);
}

/* GPUs 0, 1, 2 of the usual reply. */
static int three(gp_nvml_gpu *h, gp_nvml_gpu *sim, gp_nvml_gpu *old)
{
    reply rep;
    if (load(&rep) != 0) {
        free(rep.body);
        return -1;
    }
    gp_info_gpu v;
    int rc = 0;
    rc |= view(&rep, 0, &v) || gp_nvml_gpu_from_view(&rep.r, &v, h);
    rc |= view(&rep, 1, &v) || gp_nvml_gpu_from_view(&rep.r, &v, sim);
    rc |= view(&rep, 2, &v) || gp_nvml_gpu_from_view(&rep.r, &v, old);
    free(rep.body);
    return rc ? -1 : 0;
}

static void test_live_values(void)
{
    gp_nvml_gpu h, sim, old;
    if (three(&h, &sim, &old) != 0) {
        failures++;
        return;
    }
    nvmlMemory_t m;
    CHECK(gp_nvml_memory(&h, &m) == NVML_SUCCESS);
    CHECK(m.total == 85520809984ull && m.used == 1073741824ull && m.free == 84447068160ull);
    CHECK(gp_nvml_memory(&h, NULL) == NVML_ERROR_INVALID_ARGUMENT);
    nvmlMemory_v2_t m2;
    memset(&m2, 0xAB, sizeof m2);
    m2.version = nvmlMemory_v2;
    CHECK(nvmlMemory_v2 == 0x02000028u); /* pynvml's nvmlMemory_v2 */
    CHECK(gp_nvml_memory_v2(&h, &m2) == NVML_SUCCESS);
    CHECK(m2.total == 85520809984ull && m2.reserved == 0 && m2.used == 1073741824ull &&
          m2.free == 84447068160ull);
    m2.version = 1;
    CHECK(gp_nvml_memory_v2(&h, &m2) == NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    /* a GPU without live values: not supported, never made up */
    CHECK(gp_nvml_memory(&old, &m) == NVML_ERROR_NOT_SUPPORTED);
    nvmlUtilization_t u;
    CHECK(gp_nvml_utilization(&old, &u) == NVML_ERROR_NOT_SUPPORTED);

    CHECK(gp_nvml_utilization(&h, &u) == NVML_SUCCESS && u.gpu == 38 && u.memory == 5);
    CHECK(gp_nvml_utilization(&sim, &u) == NVML_SUCCESS && u.gpu == 0 && u.memory == 0);

    unsigned t = 0, mw = 0, mhz = 0;
    unsigned long long mj = 0;
    CHECK(gp_nvml_temperature(&h, NVML_TEMPERATURE_GPU, &t) == NVML_SUCCESS && t == 41);
    CHECK(gp_nvml_temperature(&h, 1, &t) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(gp_nvml_temperature(&sim, NVML_TEMPERATURE_GPU, &t) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_power_usage(&h, &mw) == NVML_SUCCESS && mw == 123457);
    CHECK(gp_nvml_power_usage(&sim, &mw) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_power_limit(&h, &mw) == NVML_SUCCESS && mw == 700000);
    CHECK(gp_nvml_power_limit(&sim, &mw) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_energy(&h, &mj) == NVML_SUCCESS && mj == 5000250ull);
    CHECK(gp_nvml_energy(&sim, &mj) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_clock(&h, NVML_CLOCK_SM, 0, &mhz) == NVML_SUCCESS && mhz == 1980);
    CHECK(gp_nvml_clock(&h, NVML_CLOCK_GRAPHICS, 0, &mhz) == NVML_SUCCESS && mhz == 1980);
    CHECK(gp_nvml_clock(&h, NVML_CLOCK_MEM, 0, &mhz) == NVML_SUCCESS && mhz == 2619);
    CHECK(gp_nvml_clock(&h, NVML_CLOCK_VIDEO, 0, &mhz) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_clock(&h, NVML_CLOCK_SM, 1, &mhz) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_clock(&h, 7, 0, &mhz) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(gp_nvml_clock(&sim, NVML_CLOCK_SM, 0, &mhz) == NVML_ERROR_NOT_SUPPORTED);

    /* a newer reply updates only the live values */
    gp_info_gpu newer =
        unknown_gpu(1, "renamed", "GPU-5e000000-0000-0000-0000-000000000001", 17179869184ull);
    newer.memory_used = 1048576;
    newer.memory_free = 17178820608ll;
    newer.gpu_util = 100;
    newer.memory_util = 0;
    reply rep2;
    gp_info_gpu v;
    CHECK(build(&rep2, &newer, 1, NULL, 0) == 0 && view(&rep2, 0, &v) == 0);
    gp_nvml_live_from_view(&rep2.r, &v, &sim.live);
    free(rep2.body);
    CHECK(strcmp(sim.name, "Simulated GPU") == 0);
    CHECK(gp_nvml_memory(&sim, &m) == NVML_SUCCESS && m.used == 1048576 &&
          m.total == 17179869184ull && m.free == 17178820608ull);
    CHECK(gp_nvml_utilization(&sim, &u) == NVML_SUCCESS && u.gpu == 100);
}

static void test_pci(void)
{
    gp_nvml_gpu h, sim, old;
    if (three(&h, &sim, &old) != 0) {
        failures++;
        return;
    }

    /* the layouts pynvml uses */
    CHECK(sizeof(nvmlPciInfo_t) == 68 && offsetof(nvmlPciInfo_t, busId) == 36);
    CHECK(sizeof(nvmlPciInfo_v2_t) == 52);
    CHECK(sizeof(nvmlProcessInfo_t) == 24 && sizeof(nvmlProcessInfo_v1_t) == 16);
    CHECK(sizeof(nvmlMemory_v2_t) == 40 && sizeof(nvmlMemory_t) == 24);

    nvmlPciInfo_t p3;
    memset(&p3, 0xAB, sizeof p3);
    CHECK(gp_nvml_pci_info(&h, &p3, 3) == NVML_SUCCESS);
    CHECK(strcmp(p3.busId, "00000000:18:00.0") == 0);
    CHECK(strcmp(p3.busIdLegacy, "0000:18:00.0") == 0);
    CHECK(p3.domain == 0 && p3.bus == 0x18 && p3.device == 0 && p3.pciDeviceId == 0);

    /* v1/v2 write 52 bytes and no more */
    unsigned char buf[68];
    memset(buf, 0xAB, sizeof buf);
    CHECK(gp_nvml_pci_info(&h, buf, 2) == NVML_SUCCESS);
    nvmlPciInfo_v2_t p2;
    memcpy(&p2, buf, sizeof p2);
    CHECK(strcmp(p2.busId, "0000:18:00.0") == 0 && p2.bus == 0x18 && p2.reserved3 == 0);
    CHECK(buf[52] == 0xAB && buf[67] == 0xAB);

    CHECK(gp_nvml_pci_info(&old, &p3, 3) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_pci_info(&h, NULL, 3) == NVML_ERROR_INVALID_ARGUMENT);
}

static void test_processes(void)
{
    gp_nvml_gpu h, sim, old;
    if (three(&h, &sim, &old) != 0) {
        failures++;
        return;
    }
    /* only the leases marked mine, on this GPU, with a real pid */
    CHECK(h.live.npids == 2 && h.live.pids[0] == 4242 && h.live.pids[1] == 4343);
    CHECK(sim.live.npids == 0);

    unsigned count = 0;
    CHECK(gp_nvml_processes(&h, &count, NULL, 3) == NVML_ERROR_INSUFFICIENT_SIZE && count == 2);
    nvmlProcessInfo_t infos[3];
    count = 1;
    CHECK(gp_nvml_processes(&h, &count, infos, 3) == NVML_ERROR_INSUFFICIENT_SIZE && count == 2);
    count = 3;
    CHECK(gp_nvml_processes(&h, &count, infos, 3) == NVML_SUCCESS && count == 2);
    CHECK(infos[0].pid == 4242 && infos[1].pid == 4343);
    CHECK(infos[0].usedGpuMemory == 1073741824ull && infos[0].gpuInstanceId == 0xFFFFFFFFu &&
          infos[0].computeInstanceId == 0xFFFFFFFFu);
    nvmlProcessInfo_v1_t v1[2];
    count = 2;
    CHECK(gp_nvml_processes(&h, &count, v1, 1) == NVML_SUCCESS && count == 2);
    CHECK(v1[1].pid == 4343 && v1[1].usedGpuMemory == 1073741824ull);

    count = 0;
    CHECK(gp_nvml_processes(&sim, &count, NULL, 3) == NVML_SUCCESS && count == 0);
    CHECK(gp_nvml_processes(&sim, NULL, NULL, 3) == NVML_ERROR_INVALID_ARGUMENT);
}

static void test_requirements(void)
{
    gp_nvml_gpu h, sim, old;
    if (three(&h, &sim, &old) != 0) {
        failures++;
        return;
    }
    CHECK(gp_nvml_gpu_matches(&h, "", "", 0));
    CHECK(gp_nvml_gpu_matches(&h, NULL, NULL, 0));
    CHECK(gp_nvml_gpu_matches(&h, "0", "", 0) && !gp_nvml_gpu_matches(&sim, "0", "", 0));
    CHECK(gp_nvml_gpu_matches(&sim, "1", "", 0));
    CHECK(!gp_nvml_gpu_matches(&sim, "4294967297", "", 0)); /* no wrap-around to 1 */
    CHECK(gp_nvml_gpu_matches(&h, "gpu-0A1B", "", 0));
    CHECK(!gp_nvml_gpu_matches(&sim, "GPU-0a1b", "", 0));
    CHECK(gp_nvml_gpu_matches(&h, "", "h100", 0) && !gp_nvml_gpu_matches(&sim, "", "H100", 0));
    CHECK(gp_nvml_gpu_matches(&h, "", "", 79ull << 30));
    CHECK(!gp_nvml_gpu_matches(&h, "", "", 80ull << 30));
    CHECK(!gp_nvml_gpu_matches(&sim, "", "", 79ull << 30));
    CHECK(gp_nvml_gpu_matches(&sim, "", "", 16ull << 30));
}

/* min_memory needs only the GPU's size: a view whose live memory use is unknown (or that has no
 * live values at all) still meets it through the view's own memory_total, as on the server. */
static void test_requirements_without_memory_use(void)
{
    gp_info_gpu g[4] = {
        unknown_gpu(0, "A", "GPU-a", 17179869184ull),
        unknown_gpu(1, "B", "GPU-b", 1000),
        unknown_gpu(2, "C", "GPU-c", 0),
        unknown_gpu(3, "D", "GPU-d", 0),
    };
    g[2].live_memory_total = 2000;
    g[3].memory_used = 5;
    reply rep;
    if (build(&rep, g, 4, NULL, 0) != 0) {
        failures++;
        free(rep.body);
        return;
    }
    gp_nvml_gpu a, b, c, d;
    gp_info_gpu v;
    CHECK(view(&rep, 0, &v) == 0 && gp_nvml_gpu_from_view(&rep.r, &v, &a) == 0);
    CHECK(view(&rep, 1, &v) == 0 && gp_nvml_gpu_from_view(&rep.r, &v, &b) == 0);
    CHECK(view(&rep, 2, &v) == 0 && gp_nvml_gpu_from_view(&rep.r, &v, &c) == 0);
    CHECK(view(&rep, 3, &v) == 0 && gp_nvml_gpu_from_view(&rep.r, &v, &d) == 0);
    free(rep.body);
    CHECK(a.live.has_memory_total && a.live.memory_total == 17179869184ull && !a.live.has_memory);
    CHECK(gp_nvml_gpu_matches(&a, "", "", 16ull << 30));
    CHECK(gp_nvml_gpu_matches(&a, "", "", 17179869184ull));
    CHECK(!gp_nvml_gpu_matches(&a, "", "", 17179869185ull));
    CHECK(gp_nvml_gpu_matches(&b, "", "", 1000) && !gp_nvml_gpu_matches(&b, "", "", 1001));
    CHECK(gp_nvml_gpu_matches(&c, "", "", 2000) && !gp_nvml_gpu_matches(&c, "", "", 2001));
    /* the size unknown everywhere: it cannot meet a minimum, and nothing is invented */
    CHECK(!d.live.has_memory_total && !gp_nvml_gpu_matches(&d, "", "", 1));
    CHECK(gp_nvml_gpu_matches(&d, "", "", 0));
    /* the memory queries still need the use: not supported rather than a made-up number */
    nvmlMemory_t m;
    CHECK(gp_nvml_memory(&a, &m) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_memory(&c, &m) == NVML_ERROR_NOT_SUPPORTED);
    CHECK(gp_nvml_memory(&d, &m) == NVML_ERROR_NOT_SUPPORTED);
    unsigned count = 4;
    nvmlProcessInfo_t infos[4];
    CHECK(gp_nvml_processes(&a, &count, infos, 3) == NVML_SUCCESS && count == 0);
}

static void test_strings_and_errors(void)
{
    char buf[8];
    CHECK(gp_nvml_copy_string("1234567", buf, sizeof buf) == NVML_SUCCESS);
    CHECK(strcmp(buf, "1234567") == 0);
    CHECK(gp_nvml_copy_string("12345678", buf, sizeof buf) == NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(gp_nvml_copy_string("x", buf, 0) == NVML_ERROR_INSUFFICIENT_SIZE);
    CHECK(gp_nvml_copy_string("x", NULL, 8) == NVML_ERROR_INVALID_ARGUMENT);
    CHECK(strcmp(gp_nvml_error_string(NVML_ERROR_NOT_SUPPORTED), "Not Supported") == 0);
    CHECK(strcmp(gp_nvml_error_string(NVML_SUCCESS), "Success") == 0);
    CHECK(strcmp(gp_nvml_error_string((nvmlReturn_t)12345), "Unknown Error") == 0);
}

/* Replies of older and newer servers (client/common/info_decode.c): a 1.6 server's ends before
 * the 1.7 lists, a 1.3 server's before 1.4's fields too; a newer one's has more. */
static void test_other_versions(void)
{
    gp_info_reply m, got;
    memset(&m, 0, sizeof m);
    m.major = GP_PROTO_MAJOR;
    uint8_t body[512];
    struct {
        uint16_t minor;
        size_t cut;
        int ok;
    } cases[] = {
        {6, 12, 1}, /* 1.6: no shared_gpus, share_views, lease_gpus */
        {3, 20, 1}, /* 1.3: no fingerprint, fleet_servers either */
        {4, 12, 1}, /* 1.4 and 1.5 end where 1.6 does */
        {7, 12, 0}, /* a 1.7 reply without its 1.7 fields is garbage */
        {6, 4, 0},  /* neither a 1.6 reply nor a 1.7 one */
        {6, 8, 0},  /* a 1.6 reply cut elsewhere than where 1.7 added */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        m.minor = cases[i].minor;
        m.result = 7;
        size_t k = gp_info_reply_encode(body, &m);
        int rc = gp_info_reply_decode_any(body, k - cases[i].cut, &got);
        CHECK((rc == 0) == cases[i].ok);
        if (rc == 0)
            CHECK(got.minor == cases[i].minor && got.result == 7 && got.share_views.count == 0 &&
                  got.lease_gpus.count == 0);
    }
    m.minor = GP_PROTO_MINOR + 1; /* a newer server: one more field than we know */
    size_t k = gp_info_reply_encode(body, &m);
    body[k] = 0;
    CHECK(gp_info_reply_decode_any(body, k + 1, &got) == 0 && got.minor == GP_PROTO_MINOR + 1);
    m.minor = GP_PROTO_MINOR; /* ours with a byte too many: garbage */
    k = gp_info_reply_encode(body, &m);
    CHECK(gp_info_reply_decode_any(body, k + 1, &got) != 0);
}

int main(void)
{
    test_decoding();
    test_other_versions();
    test_server_and_identity();
    test_live_values();
    test_pci();
    test_processes();
    test_requirements();
    test_requirements_without_memory_use();
    test_strings_and_errors();
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
