/*
 * fuzz_client_config: the client configuration file reader (client/common/client_config.c), run
 * by every client process and by libnvidia-ml.so.1 on a file a user (or anyone who can write
 * there) controls.
 *
 * Input: the file's bytes, in a scratch file named by $GPUPOOL_CONFIG. Checked: no read or
 * write outside its buffers (ASan/UBSan), a result that is 0 or -1 with an error text, and
 * strings in the result that fit their fields.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_config.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static gp_client_config *cfg;
static int fd = -1;
static const char *scratch;

static void remove_scratch(void)
{
    if (scratch)
        (void)unlink(scratch);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    /* Only the file: no server, token or TLS settings from the environment. */
    static const char *const vars[] = {
        "GPUPOOL_SERVER",       "GPUPOOL_TOKEN",       "GPUPOOL_TLS",
        "GPUPOOL_TLS_CA",       "GPUPOOL_TLS_CERT",    "GPUPOOL_TLS_KEY",
        "GPUPOOL_GPU",          "GPUPOOL_DEVICE",      "GPUPOOL_GPU_MODEL",
        "GPUPOOL_MIN_MEMORY",   "GPUPOOL_COMPRESSION", "GPUPOOL_CONNECT_TIMEOUT",
        "GPUPOOL_PROBE_TIMEOUT"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        unsetenv(vars[i]);
    setenv("GPUPOOL_LOG", "quiet", 1);
    cfg = malloc(sizeof *cfg);
    /* A real file (the reader resolves the path, so a memfd's /proc/self/fd link will not do),
     * rewritten for every input; in /dev/shm when there is one. */
    static char path[] = "/dev/shm/gpupool-fuzz-config-XXXXXX";
    static char fallback[] = "/tmp/gpupool-fuzz-config-XXXXXX";
    fd = mkstemp(path);
    const char *name = path;
    if (fd < 0) {
        fd = mkstemp(fallback);
        name = fallback;
    }
    if (!cfg || fd < 0)
        abort();
    scratch = name;
    if (atexit(remove_scratch) != 0)
        abort();
    setenv("GPUPOOL_CONFIG", name, 1);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != (ssize_t)size)
        abort();
    char err[1024];
    err[0] = '\0';
    memset(cfg, 0, sizeof *cfg);
    int rc = gp_client_config_load(cfg, err, sizeof err);
    if (rc != 0 && rc != -1)
        abort();
    if (rc == -1 && !err[0])
        abort(); /* a refusal always says why */
    if (rc == 0) {
        if (cfg->nservers < 0 || cfg->nservers > GP_MAX_SERVERS)
            abort();
        for (int i = 0; i < cfg->nservers; i++) {
            const gp_server_config *s = &cfg->servers[i];
            if (strnlen(s->address, sizeof s->address) == sizeof s->address ||
                strnlen(s->token, sizeof s->token) == sizeof s->token ||
                strnlen(s->host, sizeof s->host) == sizeof s->host)
                abort(); /* an unterminated field */
            char desc[600];
            gp_server_desc(s, desc, sizeof desc);
        }
    }
    return 0;
}
