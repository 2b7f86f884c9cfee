/*
 * test_nvml_view.c: unit tests of nvml_view.c, from info documents (JSON text) to NVML's
 * answers: identity, units, nulls as NOT_SUPPORTED, requirements, this client's processes,
 * NVML's count protocol and struct layouts. Run by tests/test_nvml_json.py (also under
 * ASan/UBSan). Prints "all checks passed" and exits 0, or names each failure.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "nvml_view.h"

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                 \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static const char *DOC =
    "{\"schema\": 1,"
    " \"server\": {\"version\": \"0.1.0\", \"host\": \"gpu-box\", \"protocol\": \"1.1\","
    "   \"simulated\": false, \"driver_version\": \"580.65.06\", \"cuda_driver_version\": 13000},"
    " \"you\": {\"name\": \"alice\", \"role\": \"user\"}, \"time\": 1767225600.1,"
    " \"gpus\": ["
    "  {\"index\": 0, \"name\": \"NVIDIA H100 80GB HBM3\","
    "   \"uuid\": \"GPU-0a1b2c3d-0000-1111-2222-333344445555\","
    "   \"simulated\": false, \"memory_total\": 85520809984, \"pci_bus_id\": \"00000000:18:00.0\","
    "   \"state\": \"leased\", \"compute_capability\": \"9.0\","
    "   \"live\": {\"at\": 1767225600.0, \"memory_total\": 85520809984,"
    "     \"memory_used\": 1073741824,"
    "     \"memory_free\": 84447068160, \"gpu_util\": 37.6, \"memory_util\": 5,"
    "     \"temperature_c\": 41, \"power_w\": 123.4567, \"power_limit_w\": 700.0,"
    "     \"energy_j\": 5000.25, \"sm_clock_mhz\": 1980, \"mem_clock_mhz\": 2619,"
    "     \"cuda_driver_version\": 13000}},"
    "  {\"index\": 1, \"name\": \"Simulated GPU\","
    "   \"uuid\": \"GPU-5e000000-0000-0000-0000-000000000001\","
    "   \"simulated\": true, \"memory_total\": 17179869184, \"pci_bus_id\": \"00000000:41:00.0\","
    "   \"state\": \"free\","
    "   \"live\": {\"at\": 1767225600.0, \"memory_total\": 17179869184, \"memory_used\": 0,"
    "     \"memory_free\": 17179869184, \"gpu_util\": 0, \"memory_util\": 0,"
    "     \"temperature_c\": null, \"power_w\": null, \"power_limit_w\": null, \"energy_j\": null,"
    "     \"sm_clock_mhz\": null, \"mem_clock_mhz\": null, \"cuda_driver_version\": 13000}},"
    "  {\"index\": 2, \"name\": \"Old server GPU\", \"uuid\": \"\", \"simulated\": false,"
    "   \"memory_total\": 1000, \"pci_bus_id\": \"\"}"
    " ],"
    " \"leases\": ["
    "  {\"id\": 7, \"gpu\": 0, \"client\": {\"host\": \"laptop\", \"pid\": 4242}, \"mine\": true},"
    "  {\"id\": 8, \"gpu\": 0, \"client\": {\"host\": \"other\", \"pid\": 99}, \"mine\": false},"
    "  {\"id\": 9, \"gpu\": 0, \"client\": {\"host\": \"laptop\", \"pid\": 4343}, \"mine\": true},"
    "  {\"id\": 10, \"gpu\": 1, \"client\": {\"host\": \"laptop\", \"pid\": 5555}},"
    "  {\"id\": 11, \"gpu\": 1, \"client\": {\"host\": \"laptop\", \"pid\": -1}, \"mine\": true}"
    " ],"
    " \"queue\": []}";

static gp_json_value *load(const char *text)
{
    char err[300];
    gp_json_value *doc = gp_nvml_parse_info(text, strlen(text), err, sizeof err);
    if (!doc)
        printf("  (parse failed: %s)\n", err);
    return doc;
}

/* 1 when text is refused (err says why). */
static int parse_fails(const char *text, char *err, size_t cap)
{
    gp_json_value *doc = gp_nvml_parse_info(text, strlen(text), err, cap);
    gp_json_free(doc);
    return doc == NULL;
}

static void test_parse_checks(void)
{
    char err[300];
    CHECK(parse_fails("{\"schema\": 2, \"gpus\": []}", err, sizeof err));
    CHECK(strstr(err, "schema 2") && strstr(err, "upgrade the gpupool client"));
    CHECK(parse_fails("{\"gpus\": []}", err, sizeof err));
    CHECK(strstr(err, "no schema"));
    CHECK(parse_fails("{\"schema\": 1}", err, sizeof err));
    CHECK(strstr(err, "\"gpus\""));
    CHECK(parse_fails("[1, 2", err, sizeof err));
    CHECK(strstr(err, "not valid JSON"));
    CHECK(parse_fails("", err, sizeof err));
}

static void test_server_and_identity(void)
{
    gp_json_value *doc = load(DOC);
    CHECK(doc != NULL);
    if (!doc)
        return;
    gp_nvml_server s;
    gp_nvml_server_from_doc(doc, &s);
    CHECK(strcmp(s.driver_version, "580.65.06") == 0 && s.cuda_driver_version == 13000);

    const gp_json_value *v = gp_nvml_find_gpu(doc, "gpu-5E000000-0000-0000-0000-000000000001");
    CHECK(v != NULL);
    CHECK(gp_nvml_find_gpu(doc, "GPU-nope") == NULL && gp_nvml_find_gpu(doc, "") == NULL);
    gp_nvml_gpu g;
    CHECK(gp_nvml_gpu_from_view(doc, v, &g) == 0);
    CHECK(g.server_index == 1 && g.simulated == 1 && strcmp(g.name, "Simulated GPU") == 0);
    CHECK(strcmp(g.uuid, "GPU-5e000000-0000-0000-0000-000000000001") == 0);
    CHECK(g.cc_major == -1);
    CHECK(gp_nvml_brand(g.name) == NVML_BRAND_UNKNOWN);

    gp_nvml_gpu h;
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 0), &h) == 0);
    CHECK(h.cc_major == 9 && h.cc_minor == 0);
    CHECK(strcmp(h.pci_bus_id, "00000000:18:00.0") == 0);

    /* not a GPU view */
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_get(doc, "server"), &g) == -1);
    gp_json_free(doc);

    CHECK(gp_nvml_brand("NVIDIA GeForce RTX 4090") == NVML_BRAND_GEFORCE);
    CHECK(gp_nvml_brand("Quadro RTX 6000") == NVML_BRAND_QUADRO);
    CHECK(gp_nvml_brand("Tesla V100-SXM2-16GB") == NVML_BRAND_TESLA);
    CHECK(gp_nvml_brand("NVIDIA TITAN RTX") == NVML_BRAND_TITAN);
}

static void test_live_values(void)
{
    gp_json_value *doc = load(DOC);
    if (!doc) {
        failures++;
        return;
    }
    gp_nvml_gpu h, sim, old;
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 0), &h) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 1), &sim) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 2), &old) == 0);

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
    /* an old server's view without live values: not supported, never made up */
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

    /* a newer document updates only the live values */
    const char *newer = "{\"schema\": 1, \"gpus\": [{\"index\": 1, \"name\": \"renamed\", "
                        "\"uuid\": \"GPU-5e000000-0000-0000-0000-000000000001\", "
                        "\"memory_total\": 17179869184, \"live\": {\"memory_used\": 1048576, "
                        "\"memory_free\": 17178820608, \"gpu_util\": 100.0, "
                        "\"memory_util\": 0}}], \"leases\": []}";
    gp_json_value *doc2 = load(newer);
    CHECK(doc2 != NULL);
    gp_nvml_live_from_view(doc2, gp_json_at(gp_json_get(doc2, "gpus"), 0), &sim.live);
    CHECK(strcmp(sim.name, "Simulated GPU") == 0);
    CHECK(gp_nvml_memory(&sim, &m) == NVML_SUCCESS && m.used == 1048576 &&
          m.total == 17179869184ull && m.free == 17178820608ull);
    CHECK(gp_nvml_utilization(&sim, &u) == NVML_SUCCESS && u.gpu == 100);
    gp_json_free(doc2);
    gp_json_free(doc);
}

static void test_pci(void)
{
    gp_json_value *doc = load(DOC);
    if (!doc) {
        failures++;
        return;
    }
    gp_nvml_gpu h, old;
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 0), &h) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 2), &old) == 0);
    gp_json_free(doc);

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
    gp_json_value *doc = load(DOC);
    if (!doc) {
        failures++;
        return;
    }
    gp_nvml_gpu h, sim;
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 0), &h) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 1), &sim) == 0);
    gp_json_free(doc);
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
    gp_json_value *doc = load(DOC);
    if (!doc) {
        failures++;
        return;
    }
    gp_nvml_gpu h, sim;
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 0), &h) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gp_json_get(doc, "gpus"), 1), &sim) == 0);
    gp_json_free(doc);
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

/* min_memory needs only the GPU's size: a view whose live memory use is null (or that has no
 * live values at all) still meets it through the view's own memory_total, as on the server. */
static void test_requirements_without_memory_use(void)
{
    const char *text =
        "{\"schema\": 1, \"gpus\": ["
        "  {\"index\": 0, \"name\": \"A\", \"uuid\": \"GPU-a\", \"memory_total\": 17179869184,"
        "   \"live\": {\"memory_total\": null, \"memory_used\": null, \"memory_free\": null,"
        "     \"gpu_util\": null}},"
        "  {\"index\": 1, \"name\": \"B\", \"uuid\": \"GPU-b\", \"memory_total\": 1000},"
        "  {\"index\": 2, \"name\": \"C\", \"uuid\": \"GPU-c\","
        "   \"live\": {\"memory_total\": 2000, \"memory_used\": null}},"
        "  {\"index\": 3, \"name\": \"D\", \"uuid\": \"GPU-d\", \"memory_total\": null,"
        "   \"live\": {\"memory_used\": 5}}"
        "]}";
    gp_json_value *doc = load(text);
    if (!doc) {
        failures++;
        return;
    }
    gp_nvml_gpu a, b, c, d;
    const gp_json_value *gpus = gp_json_get(doc, "gpus");
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gpus, 0), &a) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gpus, 1), &b) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gpus, 2), &c) == 0);
    CHECK(gp_nvml_gpu_from_view(doc, gp_json_at(gpus, 3), &d) == 0);
    gp_json_free(doc);
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

int main(void)
{
    test_parse_checks();
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
