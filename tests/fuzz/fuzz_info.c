/*
 * fuzz_info: the reader of a server's info document (client/nvml/json.c and nvml_view.c), which
 * libnvidia-ml.so.1 runs on whatever the server at GPUPOOL_SERVER sends: an untrusted server
 * must not be able to crash nvidia-smi-like tools on the client.
 *
 * Input: the document's bytes. Everything the NVML shim derives from it is derived: the server
 * view, each GPU view (identity, live values, this client's processes), lookups by UUID, the
 * requirement match, and the NVML answers that copy strings out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "nvml_view.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    gp_json_value *doc = gp_nvml_parse_info((const char *)data, size, err, sizeof err);
    if (!doc) {
        if (!err[0])
            abort(); /* a refusal always says why */
        return 0;
    }
    gp_nvml_server server;
    gp_nvml_server_from_doc(doc, &server);
    const gp_json_value *gpus = gp_json_get(doc, "gpus");
    size_t n = gp_json_count(gpus);
    for (size_t i = 0; i < n && i < 64; i++) {
        gp_nvml_gpu g;
        memset(&g, 0, sizeof g);
        if (gp_nvml_gpu_from_view(doc, gp_json_at(gpus, i), &g) != 0)
            continue;
        if (strnlen(g.name, sizeof g.name) == sizeof g.name ||
            strnlen(g.uuid, sizeof g.uuid) == sizeof g.uuid)
            abort();
        (void)gp_nvml_find_gpu(doc, g.uuid);
        (void)gp_nvml_gpu_matches(&g, "", "", 0);
        (void)gp_nvml_gpu_matches(&g, "0", "H100", 1ull << 30);
        char small[8];
        (void)gp_nvml_copy_string(g.name, small, sizeof small);
        nvmlMemory_t m;
        (void)gp_nvml_memory(&g, &m);
    }
    gp_json_free(doc);
    return 0;
}
