/*
 * client_config_env.c: the GPUPOOL_* environment on top of the configuration file, key by key
 * (docs/client-configuration.md, "The environment on top"; the variables are the env column of
 * the key table, client_config_keys.c). Every value is stripped of blanks at both ends and a
 * blank one counts as unset. GPUPOOL_SERVER replaces the file's list (an address the file has
 * keeps that entry's token, TLS and compression settings); the others apply to every server,
 * over the file's entries or only where an entry sets nothing, as each one's comment says.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "client_config_internal.h"

/* GPUPOOL_SERVER replaces the list; entries also in the file keep their settings. */
static int env_servers(const char *list, size_t len, const file_settings *fs, gp_client_config *cfg,
                       unsigned *set, char *err, size_t ecap)
{
    if (!gp_cc_is_utf8(list, len)) { /* blanks and control characters: refused item by item */
        gp_cc_set_err(err, ecap,
                      "GPUPOOL_SERVER is not valid UTF-8: write host:port, [v6]:port, host "
                      "(port %s) or tls://host:port, separated by commas",
                      GP_DEFAULT_PORT);
        return -1;
    }
    char *copy = strndup(list, len);
    if (!copy) {
        gp_cc_set_err(err, ecap, "out of memory");
        return -1;
    }
    int rc = 0;
    char *save = NULL;
    cfg->nservers = 0;
    for (char *e = strtok_r(copy, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
        size_t el = strlen(e);
        const char *item = gp_cc_strip(e, &el);
        if (el == 0)
            continue;
        if (cfg->nservers >= GP_MAX_SERVERS) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_SERVER names more than %d servers; keep the %d you "
                          "prefer",
                          GP_MAX_SERVERS, GP_MAX_SERVERS);
            rc = -1;
            break;
        }
        gp_server_config *s = &cfg->servers[cfg->nservers];
        int prefix;
        if (gp_cc_parse_address(item, el, s, &prefix) != 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_SERVER: '%.*s' is not a server address: write "
                          "host:port, [v6]:port, host (port %s) or tls://host:port, separated by "
                          "commas",
                          (int)el, item, GP_DEFAULT_PORT);
            rc = -1;
            break;
        }
        unsigned bits = 0;
        gp_cc_src_what(&s->source[GP_SRV_ADDRESS], "GPUPOOL_SERVER");
        for (int j = 0; j < fs->nservers; j++) {
            const gp_server_config *f = &fs->servers[j];
            if (strcasecmp(f->host, s->host) != 0 || strcmp(f->port, s->port) != 0)
                continue;
            /* Its token, TLS and compression settings; the address as GPUPOOL_SERVER writes
             * it. */
            memcpy(s->token, f->token, sizeof s->token);
            s->tls = f->tls;
            memcpy(s->tls_ca, f->tls_ca, sizeof s->tls_ca);
            memcpy(s->tls_cert, f->tls_cert, sizeof s->tls_cert);
            memcpy(s->tls_key, f->tls_key, sizeof s->tls_key);
            memcpy(s->tls_fingerprint, f->tls_fingerprint, sizeof s->tls_fingerprint);
            s->compression = f->compression;
            s->tls_prefix = f->tls_prefix || s->tls_prefix;
            for (int k = GP_SRV_TOKEN; k < GP_SRV_NSETTINGS; k++)
                s->source[k] = f->source[k];
            bits = fs->set[j];
            break;
        }
        if (prefix)
            bits |= CC_F_PREFIX;
        set[cfg->nservers] = bits;
        cfg->nservers++;
    }
    free(copy);
    if (rc == 0 && cfg->nservers == 0) {
        gp_cc_set_err(err, ecap,
                      "GPUPOOL_SERVER='%.*s' names no server: set GPUPOOL_SERVER=host:port",
                      (int)len, list);
        rc = -1;
    }
    return rc;
}

/* GPUPOOL_TLS_CA/CERT/KEY into dst (cap 4096): "~/" expanded, a relative path left as the
 * caller's. 1 set, 0 unset, -1 with err. */
static int env_tls_file(const char *name, char *dst, char *err, size_t ecap)
{
    size_t n;
    const char *v = gp_cc_env_view(name, &n);
    if (!v)
        return 0;
    if (gp_cc_has_control(v, n)) {
        gp_cc_set_err(err, ecap, "%s contains a control character; set it to %s", name,
                      gp_cc_path_how);
        return -1;
    }
    int rc = gp_cc_expand_path(v, n, NULL, dst, 4096);
    if (rc == -2) {
        gp_cc_set_err(err, ecap,
                      "%s=%.*s: ~ stands for the home folder, and HOME is not set; write "
                      "the whole path",
                      name, (int)n, v);
        return -1;
    }
    if (rc != 0) {
        gp_cc_set_err(err, ecap, "%s is longer than 4095 bytes once expanded; use a shorter path",
                      name);
        return -1;
    }
    return 1;
}

/* A size variable (GPUPOOL_MIN_MEMORY, GPUPOOL_MEMORY) into *out when set. 0, or -1 with err. */
static int env_size(const char *name, uint64_t *out, gp_config_source *src, char *err, size_t ecap)
{
    size_t n;
    const char *v = gp_cc_env_view(name, &n);
    if (!v)
        return 0;
    char *text = strndup(v, n);
    if (!text) {
        gp_cc_set_err(err, ecap, "out of memory");
        return -1;
    }
    int bad = gp_parse_size(text, out) != 0;
    free(text);
    if (bad) {
        gp_cc_set_err(err, ecap, "%s=%.*s is not a size: %s", name, (int)n, v, gp_cc_size_how);
        return -1;
    }
    gp_cc_src_what(src, name);
    return 0;
}

static int env_requirements(gp_client_config *cfg, char *err, size_t ecap)
{
    size_t gn = 0, on = 0, n;
    const char *gpu = gp_cc_env_view("GPUPOOL_GPU", &gn),
               *old = gp_cc_env_view("GPUPOOL_DEVICE", &on);
    const char *gpu_var = "GPUPOOL_GPU";
    if (!gpu) {
        gpu = old;
        gn = on;
        gpu_var = "GPUPOOL_DEVICE";
    } else if (old && (on != gn || memcmp(old, gpu, gn) != 0)) {
        gp_cc_warn(
            "GPUPOOL_DEVICE=%.*s ignored: GPUPOOL_GPU=%.*s is set (GPUPOOL_DEVICE is its old "
            "name)",
            (int)on, old, (int)gn, gpu);
    }
    if (gpu && gp_cc_check_text(gpu_var, gpu, gn, gp_cc_gpu_how, cfg->gpu, sizeof cfg->gpu, err,
                                ecap) != 0)
        return -1;
    if (gpu)
        gp_cc_src_what(&cfg->source[GP_CFG_GPU], gpu_var);
    const char *model = gp_cc_env_view("GPUPOOL_GPU_MODEL", &n);
    if (model && gp_cc_check_text("GPUPOOL_GPU_MODEL", model, n, gp_cc_model_how, cfg->model,
                                  sizeof cfg->model, err, ecap) != 0)
        return -1;
    if (model)
        gp_cc_src_what(&cfg->source[GP_CFG_MODEL], "GPUPOOL_GPU_MODEL");
    if (env_size("GPUPOOL_MIN_MEMORY", &cfg->min_memory, &cfg->source[GP_CFG_MIN_MEMORY], err,
                 ecap) != 0 ||
        env_size("GPUPOOL_MEMORY", &cfg->memory, &cfg->source[GP_CFG_MEMORY], err, ecap) != 0)
        return -1;
    const char *gpus = gp_cc_env_view("GPUPOOL_GPUS", &n);
    if (gpus) {
        int count = 0, ok = n <= 2;
        for (size_t i = 0; ok && i < n; i++) {
            ok = gpus[i] >= '0' && gpus[i] <= '9';
            count = count * 10 + (gpus[i] - '0');
        }
        if (!ok || count < 1 || count > GP_MAX_GPUS) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_GPUS=%.*s is not a number of GPUs: write %s, e.g. "
                          "GPUPOOL_GPUS=4",
                          (int)n, gpus, gp_cc_gpus_how);
            return -1;
        }
        cfg->gpus = count;
        gp_cc_src_what(&cfg->source[GP_CFG_GPUS], "GPUPOOL_GPUS");
    }
    const char *spread = gp_cc_env_view("GPUPOOL_SPREAD", &n);
    if (spread) {
        int on = gp_cc_parse_bool_text(spread, n);
        if (on < 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_SPREAD=%.*s is not understood: use 1 (a lease of several GPUs "
                          "may take them from several servers of a fleet) or 0 (all from one "
                          "server, the default)",
                          (int)n, spread);
            return -1;
        }
        cfg->spread = on;
        gp_cc_src_what(&cfg->source[GP_CFG_SPREAD], "GPUPOOL_SPREAD");
    }
    const char *copy = gp_cc_env_view("GPUPOOL_SPREAD_COPY", &n);
    if (copy) {
        int mode = gp_cc_spread_copy_value(copy, n);
        if (mode < 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_SPREAD_COPY=%.*s is not understood: use auto (server to "
                          "server, through the client when the servers cannot reach each other; "
                          "the default), server or client",
                          (int)n, copy);
            return -1;
        }
        cfg->spread_copy = mode;
        gp_cc_src_what(&cfg->source[GP_CFG_SPREAD_COPY], "GPUPOOL_SPREAD_COPY");
    }
    return 0;
}

static int env_seconds(const char *name, const char *zero, double *out, char *err, size_t ecap)
{
    size_t n;
    const char *v = gp_cc_env_view(name, &n);
    if (v && gp_cc_parse_seconds(v, n, out) != 0) {
        gp_cc_set_err(err, ecap, "%s=%.*s is not a number of seconds: write e.g. 10 or 2.5 (%s)",
                      name, (int)n, v, zero);
        return -1;
    }
    return 0;
}

int gp_cc_apply_environment(gp_client_config *cfg, const file_settings *fs, char *err, size_t ecap)
{
    /* The list, with what each entry sets itself. */
    unsigned set[GP_MAX_SERVERS] = {0};
    size_t n;
    const char *list = gp_cc_env_view("GPUPOOL_SERVER", &n);
    if (list) {
        if (env_servers(list, n, fs, cfg, set, err, ecap) != 0)
            return -1;
        gp_cc_src_what(&cfg->source[GP_CFG_SERVERS], "GPUPOOL_SERVER");
    } else {
        cfg->nservers = fs->nservers;
        for (int i = 0; i < fs->nservers; i++) {
            cfg->servers[i] = fs->servers[i];
            set[i] = fs->set[i];
        }
    }

    /* The defaults for what an entry does not set, then the environment for every server. */
    char token[4097];
    size_t tn;
    const char *tv = gp_cc_env_view("GPUPOOL_TOKEN", &tn);
    if (tv && gp_cc_check_text("GPUPOOL_TOKEN", tv, tn, gp_cc_token_how, token, sizeof token, err,
                               ecap) != 0)
        return -1;
    const char *tls_text = gp_cc_env_view("GPUPOOL_TLS", &n);
    int tls_env = tls_text ? gp_cc_parse_bool_text(tls_text, n) : -2;
    if (tls_env == -1) {
        gp_cc_set_err(err, ecap, "GPUPOOL_TLS=%.*s is not understood: use 1 (TLS) or 0 (plain TCP)",
                      (int)n, tls_text);
        return -1;
    }
    char ca[4096], cert[4096], key[4096];
    snprintf(ca, sizeof ca, "%s", fs->tls_ca);
    snprintf(cert, sizeof cert, "%s", fs->tls_cert);
    snprintf(key, sizeof key, "%s", fs->tls_key);
    int env_ca = env_tls_file("GPUPOOL_TLS_CA", ca, err, ecap);
    int env_cert = env_ca < 0 ? -1 : env_tls_file("GPUPOOL_TLS_CERT", cert, err, ecap);
    int env_key = env_cert < 0 ? -1 : env_tls_file("GPUPOOL_TLS_KEY", key, err, ecap);
    if (env_key < 0)
        return -1;
    size_t fpn;
    const char *fpv = gp_cc_env_view("GPUPOOL_TLS_FINGERPRINT", &fpn);
    if (fpv && !gp_fingerprint_valid(fpv, fpn)) {
        gp_cc_set_err(err, ecap,
                      "GPUPOOL_TLS_FINGERPRINT=%.*s is not a fingerprint: set it to what `gpupoold "
                      "fingerprint` prints on the server, \"SHA256:\" and 43 base64 characters",
                      (int)(fpn > 100 ? 100 : fpn), fpv);
        return -1;
    }
    for (int i = 0; i < cfg->nservers; i++) {
        gp_server_config *s = &cfg->servers[i];
        gp_config_source *src = s->source;
        const gp_config_source *dflt = fs->default_src;
        if (tv) {
            memcpy(s->token, token, sizeof token);
            gp_cc_src_what(&src[GP_SRV_TOKEN], "GPUPOOL_TOKEN");
        } else if (!(set[i] & CC_F_TOKEN)) {
            memcpy(s->token, fs->token, sizeof fs->token);
            src[GP_SRV_TOKEN] = dflt[GP_SRV_TOKEN];
        }
        if (set[i] & CC_F_PREFIX) {
            s->tls = 1; /* tls://: TLS whatever else says */
            gp_cc_src_what(&src[GP_SRV_TLS], "tls:// in the address");
        } else if (tls_env >= 0) {
            s->tls = tls_env;
            gp_cc_src_what(&src[GP_SRV_TLS], "GPUPOOL_TLS");
        } else if (!(set[i] & CC_F_TLS)) {
            s->tls = fs->tls;
            src[GP_SRV_TLS] = dflt[GP_SRV_TLS];
        }
        /* The pin: the entry's own, else GPUPOOL_TLS_FINGERPRINT. */
        if (fpv && !(set[i] & CC_F_FP)) {
            memcpy(s->tls_fingerprint, fpv, fpn);
            s->tls_fingerprint[fpn] = 0;
            gp_cc_src_what(&src[GP_SRV_TLS_FINGERPRINT], "GPUPOOL_TLS_FINGERPRINT");
        }
        /* The three TLS files: the variable, else the entry's own, else the top level's. */
        const struct {
            int env;
            unsigned bit;
            int setting;
            const char *var, *value;
            char *dst;
        } files[] = {
            {env_ca, CC_F_CA, GP_SRV_TLS_CA, "GPUPOOL_TLS_CA", ca, s->tls_ca},
            {env_cert, CC_F_CERT, GP_SRV_TLS_CERT, "GPUPOOL_TLS_CERT", cert, s->tls_cert},
            {env_key, CC_F_KEY, GP_SRV_TLS_KEY, "GPUPOOL_TLS_KEY", key, s->tls_key},
        };
        for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
            if (files[k].env)
                gp_cc_src_what(&src[files[k].setting], files[k].var);
            else if (!(set[i] & files[k].bit))
                src[files[k].setting] = dflt[files[k].setting];
            if (files[k].env || !(set[i] & files[k].bit))
                memcpy(files[k].dst, files[k].value, 4096);
        }
    }

    if (env_seconds("GPUPOOL_CONNECT_TIMEOUT", "0: no limit", &cfg->connect_timeout, err, ecap) !=
            0 ||
        env_seconds("GPUPOOL_PROBE_TIMEOUT", "0: the default, 2", &cfg->probe_timeout, err, ecap) !=
            0 ||
        env_requirements(cfg, err, ecap) != 0)
        return -1;
    if (gp_cc_env_view("GPUPOOL_CONNECT_TIMEOUT", &n))
        gp_cc_src_what(&cfg->source[GP_CFG_CONNECT_TIMEOUT], "GPUPOOL_CONNECT_TIMEOUT");
    if (gp_cc_env_view("GPUPOOL_PROBE_TIMEOUT", &n))
        gp_cc_src_what(&cfg->source[GP_CFG_PROBE_TIMEOUT], "GPUPOOL_PROBE_TIMEOUT");
    size_t kn;
    const char *kv = gp_cc_env_view("GPUPOOL_KEEP_GPU", &kn);
    if (kv) {
        int keep = gp_cc_parse_bool_text(kv, kn);
        if (keep < 0) {
            gp_cc_set_err(
                err, ecap,
                "GPUPOOL_KEEP_GPU=%.*s is not understood: use 1 (keep the GPU while idle) or "
                "0 (let the server detach an idle lease, the default)",
                (int)kn, kv);
            return -1;
        }
        cfg->keep_gpu = keep;
        gp_cc_src_what(&cfg->source[GP_CFG_KEEP_GPU], "GPUPOOL_KEEP_GPU");
    }
    size_t cn;
    const char *cv = gp_cc_env_view("GPUPOOL_COMPRESSION", &cn);
    if (cv) {
        int c = gp_cc_compression_value(cv, cn);
        if (c < 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_COMPRESSION=%.*s is not supported: write off (the "
                          "default) or lz4",
                          (int)cn, cv);
            return -1;
        }
        cfg->compression = c;
        gp_cc_src_what(&cfg->source[GP_CFG_COMPRESSION], "GPUPOOL_COMPRESSION");
    }
    /* Each server's compression: GPUPOOL_COMPRESSION, else its own, else the top level's. */
    for (int i = 0; i < cfg->nservers; i++) {
        if (cv || !(set[i] & CC_F_COMP)) {
            cfg->servers[i].compression = cfg->compression;
            cfg->servers[i].source[GP_SRV_COMPRESSION] = cfg->source[GP_CFG_COMPRESSION];
        }
    }

    /* A client certificate needs its key, and a key its certificate. */
    for (int i = 0; i < cfg->nservers; i++) {
        const gp_server_config *s = &cfg->servers[i];
        if (!*s->tls_cert == !*s->tls_key)
            continue;
        const char *have = *s->tls_cert ? "tls_cert" : "tls_key";
        const char *lack = *s->tls_cert ? "tls_key" : "tls_cert";
        gp_cc_set_err(err, ecap,
                      "server %s: %s is set but %s is not: set both (a client certificate "
                      "and its key, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY) or neither",
                      s->address, have, lack);
        return -1;
    }
    return 0;
}
