/*
 * fuzz_info: the reader of a server's info reply (the generated decoder of protocol/gpupool.toml's
 * info reply and its records, then client/nvml/nvml_view.c), which libnvidia-ml.so.1 runs on
 * whatever the server at GPUPOOL_SERVER sends: an untrusted server must not be able to crash
 * nvidia-smi-like tools on the client.
 *
 * Input: the reply's body. Everything the NVML shim derives from it is derived: the server
 * facts, each GPU view (identity, live values, this client's processes), lookups by UUID and
 * index, the requirement match, and the NVML answers that copy strings out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gp_protocol.h"
#include "nvml_view.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gp_info_reply r;
    int rc = gp_info_reply_decode(data, size, &r);
    if (rc != 0 && rc != GP_PROTO_ETRAILING)
        return 0;
    gp_nvml_server server;
    gp_nvml_server_from_reply(&r, &server);
    gp_record_span views = r.gpu_views;
    gp_info_gpu view;
    for (int i = 0; i < 64 && gp_info_gpu_next(&views, &view) == 0; i++) {
        gp_nvml_gpu g;
        memset(&g, 0, sizeof g);
        if (gp_nvml_gpu_from_view(&r, &view, &g) != 0)
            continue;
        if (strnlen(g.name, sizeof g.name) == sizeof g.name ||
            strnlen(g.uuid, sizeof g.uuid) == sizeof g.uuid)
            abort();
        gp_info_gpu again;
        /* A GPU's own UUID, when it came through unchanged (valid UTF-8 that fits), finds a
         * view. */
        if (g.uuid[0] && strlen(g.uuid) == view.uuid_len &&
            memcmp(g.uuid, view.uuid, view.uuid_len) == 0 &&
            gp_nvml_find_gpu(&r, g.uuid, &again) != 0)
            abort();
        (void)gp_nvml_find_gpu_index(&r, g.server_index, &again);
        (void)gp_nvml_gpu_matches(&g, "", "", 0);
        (void)gp_nvml_gpu_matches(&g, "0", "H100", 1ull << 30);
        char small[8];
        (void)gp_nvml_copy_string(g.name, small, sizeof small);
        nvmlMemory_t m;
        (void)gp_nvml_memory(&g, &m);
    }
    return 0;
}
