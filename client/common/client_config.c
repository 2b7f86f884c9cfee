/*
 * client_config.c: the client configuration (client_config.h;
 * docs/client-configuration.md): the file, the TOML subset it may use, and the environment on top of it.
 * The one reader of this file: the shims link it, and the `gpupool` command calls it through
 * libgpupool-config.so (client/config/binding.c; tests/test_client_config_cases.py runs a table of
 * cases through it, also under ASan/UBSan).
 *
 * The subset (what `gpupool login` writes, and what people write by hand):
 *   # comments                    anywhere outside a string
 *   keep_gpu = true | false       keep the GPU while idle: the server never detaches the lease
 *                                 (GPUPOOL_KEEP_GPU=1 too)
 *   compression = "off" | "lz4"   LZ4-compressed copies (docs/architecture.md): at the top level
 *                                 (every server's default) and in a [[servers]] table (that
 *                                 server's own)
 *   key = value                   bare keys; values: "basic" strings (escapes \" \\ \n \t
 *                                 \uXXXX), 'literal' strings, integers, floats, true/false,
 *                                 arrays of strings (on one line or several)
 *   [requirements]                gpu, model, min_memory, gpus, spread, spread_copy, memory
 *   [[servers]]                   address, token, tls, tls_ca, tls_cert, tls_key,
 *                                 tls_fingerprint, compression
 * TLS is the default (tls = true unless a server's entry, the top level or GPUPOOL_TLS=0 says
 * false); tls_fingerprint = "SHA256:..." pins the server's identity (gp_fingerprint_valid).
 * Anything else (inline tables, dotted or quoted keys, multi-line strings, dates, other arrays)
 * is an error naming FILE:LINE and what is supported. An unknown key or table is one warning and
 * is ignored. Numbers: TOML's decimal grammar (underscores between digits, an optional sign,
 * fraction and exponent), at most 100 characters, integers within 64-bit signed.
 *
 * Values: a string setting is stripped of blanks (space, tab, CR, LF, FF, VT) at both ends, and
 * one that is empty after that counts as unset (a [[servers]] entry with token = "" takes the
 * default token). No setting may hold a control character. Paths: "~" and "~/..." are the home
 * folder; a relative path is relative to the folder of the file after symlinks are resolved
 * (realpath), so a symlinked config.toml finds the files next to its target.
 *
 * Then the environment, key by key: every GPUPOOL_* value is stripped the same way and a blank
 * one counts as unset. GPUPOOL_SERVER (a comma-separated list that replaces the file's; an
 * address the file has as a [[servers]] entry keeps that entry's token, TLS and compression
 * settings),
 * GPUPOOL_TOKEN, GPUPOOL_TLS, GPUPOOL_TLS_CA, GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY (every server;
 * "~/" expanded, a relative path is the caller's), GPUPOOL_TLS_FINGERPRINT (the pin of every
 * server whose entry has none: the servers of GPUPOOL_SERVER run without a file), GPUPOOL_CONNECT_TIMEOUT,
 * GPUPOOL_PROBE_TIMEOUT (digits with an optional fraction: "10", "2.5"), GPUPOOL_GPU (alias
 * GPUPOOL_DEVICE), GPUPOOL_GPU_MODEL, GPUPOOL_MIN_MEMORY, GPUPOOL_GPUS, GPUPOOL_SPREAD,
 * GPUPOOL_SPREAD_COPY, GPUPOOL_MEMORY, GPUPOOL_COMPRESSION (off, lz4; every
 * server, over the servers' own compression).
 *
 * Self-contained: no shim state (the NVML shim links this file too). The only static state is
 * the hooks of the load running on this thread (client_config_hooks.c; thread-local, so no lock).
 *
 * The reader is six units (client_config_internal.h says which does what); this one finds and
 * reads the file, then runs the file's reader and the environment's.
 */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_config.h"
#include "client_config_internal.h"
#include "gp_log.h"

#define MAX_FILE_SIZE (1 << 20)

/* ======================================================================= the file == */

/* Which file: 1 with path set, 0 for none, -1 with err; why (cap 8448) says why that file or why
 * none, for `gpupool config`. */
static int find_file(char *path, size_t cap, char *why, char *err, size_t ecap)
{
    size_t n;
    const char *explicit_ = gp_cc_env_view("GPUPOOL_CONFIG", &n);
    struct stat st;
    if (explicit_) {
        if (n == 4 && !strncmp(explicit_, "none", 4)) {
            snprintf(why, 8448, "GPUPOOL_CONFIG=none: no file is read");
            return 0;
        }
        int rc = gp_cc_expand_path(explicit_, n, NULL, path, cap);
        if (rc != 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_CONFIG=%.*s: %s; point it at the configuration file, or "
                          "set GPUPOOL_CONFIG=none to read none",
                          (int)n, explicit_,
                          rc == -2 ? "~ stands for the home folder, and HOME is not set"
                                   : "the path is too long");
            return -1;
        }
        if (stat(path, &st) != 0) {
            gp_cc_set_err(err, ecap,
                          "GPUPOOL_CONFIG=%.*s: %s; point it at the configuration file, or "
                          "set GPUPOOL_CONFIG=none to read none",
                          (int)n, explicit_, strerror(errno));
            return -1;
        }
        snprintf(why, 8448, "from GPUPOOL_CONFIG");
        return 1;
    }
    const char *xdg = gp_cc_env_raw("XDG_CONFIG_HOME");
    char home[4096];
    int k = -1;
    if (xdg) {
        k = snprintf(path, cap, "%s/gpupool/config.toml", xdg);
    } else {
        gp_cc_home_dir(home, sizeof home);
        if (*home)
            k = snprintf(path, cap, "%s/.config/gpupool/config.toml", home);
    }
    if (k > 0 && (size_t)k < cap && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(why, 8448, "the user's file");
        return 1;
    }
    char user[4096];
    if (k > 0 && (size_t)k < cap)
        snprintf(user, sizeof user, "%s", path);
    else
        snprintf(user, sizeof user, "(no home folder)");
    snprintf(path, cap, "%s",
             gp_cc_hooks && gp_cc_hooks->system_file ? gp_cc_hooks->system_file
                                                     : "/etc/gpupool/config.toml");
    if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(why, 8448, "the system file (no user file at %s)", user);
        return 1;
    }
    snprintf(why, 8448, "no file (%s and %s do not exist)", user, path);
    path[0] = 0;
    return 0;
}

/* Read the whole file (NUL-terminated, malloc'd). 0, or -1 with err. */
static int read_file(const char *path, char **out, size_t *len, struct stat *st, char *err,
                     size_t ecap)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        gp_cc_set_err(err, ecap,
                      "cannot read the configuration file %s: %s; fix its permissions or "
                      "set GPUPOOL_CONFIG to another file",
                      path, strerror(errno));
        return -1;
    }
    if (fstat(fileno(f), st) != 0 || !S_ISREG(st->st_mode)) {
        gp_cc_set_err(err, ecap, "the configuration file %s is not a regular file", path);
        fclose(f);
        return -1;
    }
    if (st->st_size > MAX_FILE_SIZE) {
        gp_cc_set_err(err, ecap,
                      "the configuration file %s is larger than %d bytes; is it the right "
                      "file?",
                      path, MAX_FILE_SIZE);
        fclose(f);
        return -1;
    }
    char *buf = malloc((size_t)st->st_size + 1);
    if (!buf) {
        gp_cc_set_err(err, ecap, "out of memory reading %s", path);
        fclose(f);
        return -1;
    }
    size_t n = fread(buf, 1, (size_t)st->st_size, f);
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        gp_cc_set_err(err, ecap,
                      "cannot read the configuration file %s: %s; fix its permissions or "
                      "set GPUPOOL_CONFIG to another file",
                      path, strerror(EIO));
        free(buf);
        return -1;
    }
    if (memchr(buf, 0, n)) {
        gp_cc_set_err(err, ecap,
                      "the configuration file %s holds a NUL byte: it must be a text file", path);
        free(buf);
        return -1;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

/* The folder of path after symlinks are resolved (relative paths in the file start there). 0,
 * or -1 with err. */
static int file_folder(const char *path, char *dir, size_t cap, char *err, size_t ecap)
{
    char *real = realpath(path, NULL);
    if (!real) {
        gp_cc_set_err(err, ecap, "cannot resolve the configuration file %s: %s", path,
                      strerror(errno));
        return -1;
    }
    char *slash = strrchr(real, '/');
    if (slash == real)
        slash[1] = 0; /* a file in / */
    else if (slash)
        *slash = 0;
    int k = snprintf(dir, cap, "%s", real);
    free(real);
    if (k < 0 || (size_t)k >= cap) {
        gp_cc_set_err(err, ecap, "the folder of the configuration file %s is longer than %zu bytes",
                      path, cap - 1);
        return -1;
    }
    return 0;
}

/* 1 if path lies under the home folder (both resolved when they exist). */
static int under_home(const char *path)
{
    char home[4096], rhome[PATH_MAX], rpath[PATH_MAX];
    gp_cc_home_dir(home, sizeof home);
    if (!*home)
        return 0;
    const char *h = realpath(home, rhome) ? rhome : home;
    const char *p = realpath(path, rpath) ? rpath : path;
    size_t hl = strlen(h);
    while (hl > 1 && h[hl - 1] == '/')
        hl--;
    return hl > 1 && strncmp(p, h, hl) == 0 && p[hl] == '/';
}

/* The mode warning: a file under the home folder holding a token, readable by others. */
static void check_mode(const char *path, const struct stat *st, const file_settings *fs)
{
    if (!fs->holds_token || !(st->st_mode & 044) || !under_home(path))
        return;
    gp_cc_warn("%s holds a token and is readable by other users (mode %04o): chmod 600 %s", path,
               (unsigned)(st->st_mode & 07777), path);
}

/* =================================================================== the loader == */

static int load(gp_client_config *cfg, file_settings *fs, char *err, size_t ecap)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->connect_timeout = 10;
    cfg->probe_timeout = 2;
    cfg->gpus = 1;

    char path[4096];
    int found = find_file(path, sizeof path, cfg->file_reason, err, ecap);
    if (found < 0)
        return -1;
    if (found) {
        char *text;
        size_t len;
        struct stat st;
        if (read_file(path, &text, &len, &st, err, ecap) != 0)
            return -1;
        int rc = file_folder(path, fs->dir, sizeof fs->dir, err, ecap);
        if (rc == 0)
            rc = gp_cc_parse_file(path, text, len, fs, err, ecap);
        free(text);
        if (rc != 0)
            return -1;
        snprintf(cfg->file, sizeof cfg->file, "%s", path);
        check_mode(path, &st, fs);
        if (fs->has_connect_timeout)
            cfg->connect_timeout = fs->connect_timeout;
        if (fs->has_probe_timeout)
            cfg->probe_timeout = fs->probe_timeout;
        snprintf(cfg->gpu, sizeof cfg->gpu, "%s", fs->gpu);
        snprintf(cfg->model, sizeof cfg->model, "%s", fs->model);
        cfg->min_memory = fs->min_memory;
        if (fs->gpus)
            cfg->gpus = fs->gpus;
        cfg->memory = fs->memory;
        cfg->spread = fs->spread;
        cfg->spread_copy = fs->spread_copy;
        cfg->keep_gpu = fs->keep_gpu;
        cfg->compression = fs->compression;
        memcpy(cfg->source, fs->src, sizeof cfg->source);
    }
    return gp_cc_apply_environment(cfg, fs, err, ecap);
}

int gp_client_config_load_with(gp_client_config *cfg, const gp_config_hooks *with, char *err,
                               size_t errcap)
{
    file_settings *fs = calloc(1, sizeof *fs);
    if (!fs) {
        gp_cc_set_err(err, errcap, "out of memory reading the gpupool configuration");
        return -1;
    }
    fs->tls = 1; /* TLS unless the file or GPUPOOL_TLS says otherwise */
    const gp_config_hooks *outer = gp_cc_hooks;
    gp_cc_hooks = with;
    int rc = load(cfg, fs, err, errcap);
    gp_cc_hooks = outer;
    free(fs);
    return rc;
}

int gp_client_config_load(gp_client_config *cfg, char *err, size_t errcap)
{
    return gp_client_config_load_with(cfg, NULL, err, errcap);
}
