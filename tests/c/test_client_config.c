/*
 * test_client_config: the client configuration (client/common/client_config.c): which file is
 * read, the TOML subset (good files, and every refusal with FILE:LINE), the environment on top
 * of the file key by key, per-server tokens and TLS files, the short form, `~/` and relative
 * paths, and the warnings (unknown keys and tables, a token file readable by others).
 *
 * Runs in a fresh temporary folder with HOME pointed into it; every GPUPOOL_* variable is
 * cleared first. Warnings go to stderr (gp_log_*): they are captured and checked.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_config.h"
#include "gp_test.h"

extern char **environ;

static gp_client_config *cfg;
static char err[4096];
static char captured[16384];
static char root[4096], home[4200];
static char rroot[4096], rhome[4200]; /* the same with symlinks resolved (TMPDIR may have some) */

/* ------------------------------------------------------------------------------- helpers */

static void clear_env(void)
{
    for (;;) {
        char name[256] = "";
        for (char **e = environ; *e; e++) {
            if (strncmp(*e, "GPUPOOL_", 8) == 0 || strncmp(*e, "XDG_CONFIG_HOME=", 16) == 0) {
                const char *eq = strchr(*e, '=');
                size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
                if (n < sizeof name) {
                    memcpy(name, *e, n);
                    name[n] = 0;
                }
                break;
            }
        }
        if (!*name)
            return;
        CHECK_EQ(unsetenv(name), 0);
    }
}

static void set(const char *name, const char *value)
{
    if (value)
        CHECK_EQ(setenv(name, value, 1), 0);
    else
        CHECK_EQ(unsetenv(name), 0);
}

static void mkdirs(const char *path)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = 0;
        if (mkdir(p, 0700) != 0 && errno != EEXIST)
            fprintf(stderr, "mkdir %s: %s\n", p, strerror(errno));
        *s = '/';
    }
    if (mkdir(p, 0700) != 0 && errno != EEXIST)
        fprintf(stderr, "mkdir %s: %s\n", p, strerror(errno));
}

/* Write text to path (its folders made) with the given mode. */
static void write_file(const char *path, const char *text, mode_t mode)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) {
        *slash = 0;
        mkdirs(dir);
    }
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f)
        return;
    CHECK_EQ(fwrite(text, 1, strlen(text), f), strlen(text));
    CHECK_EQ(fclose(f), 0);
    CHECK_EQ(chmod(path, mode), 0);
}

/* gp_client_config_load with stderr captured into `captured`. */
static int load(void)
{
    fflush(stderr);
    int saved = dup(2);
    FILE *tmp = tmpfile();
    CHECK(saved >= 0 && tmp != NULL);
    if (saved < 0 || !tmp)
        return -2;
    CHECK(dup2(fileno(tmp), 2) >= 0);
    err[0] = 0;
    int rc = gp_client_config_load(cfg, err, sizeof err);
    CHECK(dup2(saved, 2) >= 0);
    CHECK_EQ(close(saved), 0);
    rewind(tmp);
    size_t n = fread(captured, 1, sizeof captured - 1, tmp);
    captured[n] = 0;
    CHECK_EQ(fclose(tmp), 0);
    return rc;
}

static int line_count(const char *text)
{
    int n = 0;
    for (; *text; text++)
        n += *text == '\n';
    return n;
}

#define LOAD_OK()                                                                                  \
    do {                                                                                           \
        int rc_ = load();                                                                          \
        if (rc_ != 0)                                                                              \
            fprintf(stderr, "%s:%d: load failed: %s\n", __FILE__, __LINE__, err);                  \
        CHECK_EQ(rc_, 0);                                                                          \
    } while (0)

#define CHECK_CONTAINS(hay, needle)                                                                \
    do {                                                                                           \
        if (!strstr((hay), (needle))) {                                                            \
            fprintf(stderr, "%s:%d: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__, (hay),  \
                    (needle));                                                                     \
            gp_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

static void path_in(char *out, size_t cap, const char *base, const char *rel)
{
    int n = snprintf(out, cap, "%s/%s", base, rel);
    CHECK(n > 0 && (size_t)n < cap);
}

/* A fresh case: no GPUPOOL_* variables, no config file found by default (HOME has none). */
static void fresh(void)
{
    clear_env();
    char p[4400];
    path_in(p, sizeof p, home, ".config/gpupool/config.toml");
    unlink(p); /* may not exist */
}

/* --------------------------------------------------------------------------------- cases */

static void test_nothing_configured(void)
{
    fresh();
    LOAD_OK();
    CHECK_EQ(cfg->nservers, 0);
    CHECK(cfg->connect_timeout == 10.0);
    CHECK(cfg->probe_timeout == 2.0);
    CHECK_STR_EQ(cfg->gpu, "");
    CHECK_STR_EQ(cfg->model, "");
    CHECK_EQ(cfg->min_memory, 0);
    CHECK_EQ(cfg->gpus, 1); /* one whole GPU unless asked (issues 37, 32) */
    CHECK_EQ(cfg->memory, 0);
    if (access("/etc/gpupool/config.toml", F_OK) != 0)
        CHECK_STR_EQ(cfg->file, "");
    CHECK_STR_EQ(captured, "");
}

static void test_environment_only(void)
{
    fresh();
    set("GPUPOOL_CONFIG", "none");
    set("GPUPOOL_SERVER", " a.example:1 ,tls://b, [::1]:7071,");
    set("GPUPOOL_TOKEN", "gpt_env");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, "");
    CHECK_EQ(cfg->nservers, 3);
    CHECK_STR_EQ(cfg->servers[0].address, "a.example:1");
    CHECK_STR_EQ(cfg->servers[0].host, "a.example");
    CHECK_STR_EQ(cfg->servers[0].port, "1");
    CHECK_EQ(cfg->servers[0].tls, 1); /* TLS is the default */
    CHECK_STR_EQ(cfg->servers[1].address, "b");
    CHECK_STR_EQ(cfg->servers[1].host, "b");
    CHECK_STR_EQ(cfg->servers[1].port, "7070");
    CHECK_EQ(cfg->servers[1].tls, 1);
    CHECK_STR_EQ(cfg->servers[2].address, "[::1]:7071");
    CHECK_STR_EQ(cfg->servers[2].host, "::1");
    CHECK_STR_EQ(cfg->servers[2].port, "7071");
    for (int i = 0; i < 3; i++) {
        CHECK_STR_EQ(cfg->servers[i].token, "gpt_env");
        CHECK_STR_EQ(cfg->servers[i].tls_ca, "");
    }
    char desc[600];
    gp_server_desc(&cfg->servers[1], desc, sizeof desc);
    CHECK_STR_EQ(desc, "b:7070");
    gp_server_desc(&cfg->servers[2], desc, sizeof desc);
    CHECK_STR_EQ(desc, "[::1]:7071");

    /* the requirements and timeouts, and GPUPOOL_DEVICE as the old name of GPUPOOL_GPU */
    set("GPUPOOL_DEVICE", "GPU-8f3a");
    set("GPUPOOL_GPU_MODEL", " h100 80GB ");
    set("GPUPOOL_MIN_MEMORY", " 40GiB ");
    set("GPUPOOL_CONNECT_TIMEOUT", "3");
    set("GPUPOOL_PROBE_TIMEOUT", "0.5");
    LOAD_OK();
    CHECK_STR_EQ(cfg->gpu, "GPU-8f3a");
    CHECK_STR_EQ(cfg->model, "h100 80GB");
    CHECK_EQ(cfg->min_memory, 40ull << 30);
    CHECK(cfg->connect_timeout == 3.0);
    CHECK(cfg->probe_timeout == 0.5);
    CHECK_STR_EQ(captured, "");
    set("GPUPOOL_GPU", "2");
    LOAD_OK();
    CHECK_STR_EQ(cfg->gpu, "2");
    CHECK_CONTAINS(captured, "GPUPOOL_DEVICE=GPU-8f3a ignored: GPUPOOL_GPU=2 is set");
    CHECK_EQ(line_count(captured), 1);
    set("GPUPOOL_MIN_MEMORY", "40G");
    LOAD_OK();
    CHECK_EQ(cfg->min_memory, 40000000000ull);
}

static void test_environment_errors(void)
{
    static const struct {
        const char *name, *value, *words;
    } cases[] = {
        {"GPUPOOL_TLS", "maybe", "GPUPOOL_TLS=maybe is not understood: use 1 (TLS) or 0"},
        {"GPUPOOL_CONNECT_TIMEOUT", "ten",
         "GPUPOOL_CONNECT_TIMEOUT=ten is not a number of "
         "seconds"},
        {"GPUPOOL_PROBE_TIMEOUT", "-1", "GPUPOOL_PROBE_TIMEOUT=-1 is not a number of seconds"},
        {"GPUPOOL_PROBE_TIMEOUT", "nan", "is not a number of seconds"},
        {"GPUPOOL_PROBE_TIMEOUT", "+5", "GPUPOOL_PROBE_TIMEOUT=+5 is not a number of seconds"},
        {"GPUPOOL_PROBE_TIMEOUT", "1_0", "is not a number of seconds"},
        {"GPUPOOL_PROBE_TIMEOUT", "inf", "is not a number of seconds"},
        {"GPUPOOL_CONNECT_TIMEOUT", "1e3", "GPUPOOL_CONNECT_TIMEOUT=1e3 is not a number"},
        {"GPUPOOL_CONNECT_TIMEOUT", ".5", "is not a number of seconds"},
        {"GPUPOOL_CONNECT_TIMEOUT", "5.", "is not a number of seconds"},
        {"GPUPOOL_SERVER", "a:0", "'a:0' is not a server address"},
        {"GPUPOOL_SERVER", "a:65536", "'a:65536' is not a server address"},
        {"GPUPOOL_SERVER", "a,b c:1", "'b c:1' is not a server address"},
        {"GPUPOOL_TOKEN", "a\x01b", "GPUPOOL_TOKEN contains a control character"},
        {"GPUPOOL_TLS_CA", "a\x7f", "GPUPOOL_TLS_CA contains a control character"},
        {"GPUPOOL_TLS_CERT", "/c.pem", "server ok:1: tls_cert is set but tls_key is not"},
        {"GPUPOOL_SERVER", "a:1,b:", "GPUPOOL_SERVER: 'b:' is not a server address"},
        {"GPUPOOL_SERVER", "a:x", "'a:x' is not a server address"},
        {"GPUPOOL_SERVER", "http://a:1", "'http://a:1' is not a server address"},
        {"GPUPOOL_SERVER", " , ", "names no server"},
        {"GPUPOOL_MIN_MEMORY", "forty", "GPUPOOL_MIN_MEMORY=forty is not a size"},
        {"GPUPOOL_MIN_MEMORY", "-1G", "GPUPOOL_MIN_MEMORY=-1G is not a size"},
        {"GPUPOOL_GPU_MODEL", "A1\n00", "GPUPOOL_GPU_MODEL contains a control character"},
        {"GPUPOOL_GPU_MODEL", "\xff\xfe", "GPUPOOL_GPU_MODEL is not valid UTF-8"},
        {"GPUPOOL_CONFIG", "/nonexistent/gpupool.toml",
         "GPUPOOL_CONFIG=/nonexistent/gpupool.toml: No such file or directory"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fresh();
        set("GPUPOOL_SERVER", "ok:1");
        set(cases[i].name, cases[i].value);
        int rc = load();
        CHECK_EQ(rc, -1);
        CHECK_CONTAINS(err, cases[i].words);
        CHECK(strchr(err, '\n') == NULL || !strcmp(cases[i].name, "GPUPOOL_GPU_MODEL"));
    }
    fresh();
    char longer[300];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = 0;
    set("GPUPOOL_GPU", longer);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, "GPUPOOL_GPU is longer than 255 bytes");
    longer[255] = 0; /* exactly the protocol's limit */
    set("GPUPOOL_GPU", longer);
    LOAD_OK();
    CHECK_EQ(strlen(cfg->gpu), 255);
    set("GPUPOOL_GPU", "\xc3\x9c-GPU"); /* valid UTF-8 is fine */
    LOAD_OK();
    CHECK_STR_EQ(cfg->gpu, "\xc3\x9c-GPU");

    char token[4200];
    memset(token, 't', 4097);
    token[4097] = 0;
    set("GPUPOOL_SERVER", "a:1");
    set("GPUPOOL_TOKEN", token);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, "GPUPOOL_TOKEN is longer than 4096 bytes");
    token[4096] = 0;
    set("GPUPOOL_TOKEN", token);
    LOAD_OK();
    CHECK_EQ(strlen(cfg->servers[0].token), 4096);

    /* 17 servers */
    fresh();
    char list[512] = "";
    for (int i = 0; i < 17; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%sh%d:1", i ? "," : "", i);
    set("GPUPOOL_SERVER", list);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, "more than 16 servers");
}

static const char FULL[] = "# written by hand\n"
                           "token = \"gpt_default\"   # the default token\n"
                           "tls = false\n"
                           "tls_ca = \"ca.pem\"\n"
                           "tls_cert = '~/certs/client.pem'\n"
                           "tls_key = \"~/certs/client.key\"\n"
                           "connect_timeout = 5\n"
                           "probe_timeout = 0.25\n"
                           "\n"
                           "[requirements]\n"
                           "gpu = \"1\"\n"
                           "model = \"H100\"\n"
                           "min_memory = \"40GiB\"\n"
                           "\n"
                           "[[servers]]   # first choice\n"
                           "address = \"gpu1.example.com:7070\"\n"
                           "token = \"gpt_one\"\n"
                           "\n"
                           "[[servers]]\n"
                           "address = \"tls://gpu2:7071\"\n"
                           "tls_ca = \"/etc/ssl/gpu2-ca.pem\"\n"
                           "tls = false # tls:// wins\n"
                           "\n"
                           "  [[ servers ]]\n"
                           "  address = \"gpu3\"\n"
                           "  tls = true\n"
                           "  tls_cert = \"\"\n";

static void test_full_file(void)
{
    fresh();
    char file[4400], ca[4400], cert[4400], key[4400];
    path_in(file, sizeof file, home, ".config/gpupool/config.toml");
    path_in(ca, sizeof ca, rhome, ".config/gpupool/ca.pem");
    path_in(cert, sizeof cert, home, "certs/client.pem");
    path_in(key, sizeof key, home, "certs/client.key");
    write_file(file, FULL, 0600);
    LOAD_OK();
    CHECK_STR_EQ(captured, ""); /* mode 0600: no warning */
    CHECK_STR_EQ(cfg->file, file);
    CHECK(cfg->connect_timeout == 5.0);
    CHECK(cfg->probe_timeout == 0.25);
    CHECK_STR_EQ(cfg->gpu, "1");
    CHECK_STR_EQ(cfg->model, "H100");
    CHECK_EQ(cfg->min_memory, 40ull << 30);
    CHECK_EQ(cfg->nservers, 3);
    const gp_server_config *s = cfg->servers;
    CHECK_STR_EQ(s[0].address, "gpu1.example.com:7070");
    CHECK_STR_EQ(s[0].host, "gpu1.example.com");
    CHECK_STR_EQ(s[0].port, "7070");
    CHECK_STR_EQ(s[0].token, "gpt_one");
    CHECK_EQ(s[0].tls, 0);
    CHECK_STR_EQ(s[0].tls_ca, ca);
    CHECK_STR_EQ(s[0].tls_cert, cert);
    CHECK_STR_EQ(s[0].tls_key, key);
    CHECK_STR_EQ(s[1].address, "gpu2:7071");
    CHECK_STR_EQ(s[1].token, "gpt_default");
    CHECK_EQ(s[1].tls, 1);
    CHECK_STR_EQ(s[1].tls_ca, "/etc/ssl/gpu2-ca.pem");
    CHECK_STR_EQ(s[1].tls_cert, cert);
    CHECK_STR_EQ(s[2].address, "gpu3");
    CHECK_STR_EQ(s[2].port, "7070");
    CHECK_EQ(s[2].tls, 1);
    CHECK_STR_EQ(s[2].tls_cert, cert); /* its own "" is unset: the default */
    CHECK_STR_EQ(s[2].tls_key, key);

    /* XDG_CONFIG_HOME is looked at first; "" counts as unset */
    char xdg[4400], other[4400];
    path_in(xdg, sizeof xdg, root, "xdg");
    path_in(other, sizeof other, xdg, "gpupool/config.toml");
    write_file(other, "servers = ['xdg:1']\n", 0600);
    set("XDG_CONFIG_HOME", xdg);
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, other);
    CHECK_EQ(cfg->nservers, 1);
    CHECK_STR_EQ(cfg->servers[0].address, "xdg:1");
    set("XDG_CONFIG_HOME", "");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, file);
    /* GPUPOOL_CONFIG names the file; "" counts as unset; none reads no file */
    set("GPUPOOL_CONFIG", other);
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, other);
    set("GPUPOOL_CONFIG", "");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, file);
    set("GPUPOOL_CONFIG", "none");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, "");
    CHECK_EQ(cfg->nservers, 0);
}

static void test_environment_over_file(void)
{
    fresh();
    char file[4400], ca[4400], cert[4400];
    path_in(file, sizeof file, home, ".config/gpupool/config.toml");
    path_in(ca, sizeof ca, rhome, ".config/gpupool/ca.pem");
    path_in(cert, sizeof cert, home, "certs/client.pem");
    write_file(file, FULL, 0600);

    /* GPUPOOL_SERVER replaces the list; an entry of the file keeps its token and TLS */
    set("GPUPOOL_SERVER", "gpu2:7071, other:9, GPU1.example.com");
    LOAD_OK();
    CHECK_EQ(cfg->nservers, 3);
    const gp_server_config *s = cfg->servers;
    CHECK_STR_EQ(s[0].address, "gpu2:7071");
    CHECK_EQ(s[0].tls, 1); /* the file's tls:// */
    CHECK_STR_EQ(s[0].tls_ca, "/etc/ssl/gpu2-ca.pem");
    CHECK_STR_EQ(s[0].token, "gpt_default");
    CHECK_STR_EQ(s[1].address, "other:9");
    CHECK_EQ(s[1].tls, 0);
    CHECK_STR_EQ(s[1].token, "gpt_default");
    CHECK_STR_EQ(s[1].tls_ca, ca);
    CHECK_STR_EQ(s[2].address, "GPU1.example.com"); /* as written; port 7070 like the file's */
    CHECK_STR_EQ(s[2].token, "gpt_one");
    CHECK_EQ(s[2].tls, 0);
    /* a tls:// in GPUPOOL_SERVER turns TLS on for that one */
    set("GPUPOOL_SERVER", "tls://other:9,gpu3");
    LOAD_OK();
    CHECK_EQ(cfg->servers[0].tls, 1);
    CHECK_STR_EQ(cfg->servers[0].address, "other:9");
    CHECK_EQ(cfg->servers[1].tls, 1);             /* the file's tls = true */
    CHECK_STR_EQ(cfg->servers[1].tls_cert, cert); /* its tls_cert = "" is unset */
    /* "" counts as unset */
    set("GPUPOOL_SERVER", "");
    set("GPUPOOL_TOKEN", "");
    set("GPUPOOL_TLS", "");
    LOAD_OK();
    CHECK_EQ(cfg->nservers, 3);
    CHECK_STR_EQ(cfg->servers[0].token, "gpt_one");
    CHECK_EQ(cfg->servers[2].tls, 1);

    /* GPUPOOL_TOKEN and the TLS variables apply to every server */
    set("GPUPOOL_TOKEN", "gpt_env");
    set("GPUPOOL_TLS_CA", "~/env-ca.pem");
    set("GPUPOOL_TLS_CERT", "relative.pem"); /* the environment's paths are the caller's */
    set("GPUPOOL_TLS", "0");
    LOAD_OK();
    char env_ca[4400];
    path_in(env_ca, sizeof env_ca, home, "env-ca.pem");
    for (int i = 0; i < 3; i++) {
        CHECK_STR_EQ(cfg->servers[i].token, "gpt_env");
        CHECK_STR_EQ(cfg->servers[i].tls_ca, env_ca);
        CHECK_STR_EQ(cfg->servers[i].tls_cert, "relative.pem");
    }
    CHECK_EQ(cfg->servers[0].tls, 0);
    CHECK_EQ(cfg->servers[1].tls, 1); /* tls:// stays TLS */
    CHECK_EQ(cfg->servers[2].tls, 0); /* tls = true yields to GPUPOOL_TLS=0 */
    set("GPUPOOL_TLS", "yes");
    LOAD_OK();
    for (int i = 0; i < 3; i++)
        CHECK_EQ(cfg->servers[i].tls, 1);

    /* the requirements and timeouts, key by key */
    set("GPUPOOL_GPU_MODEL", "A100");
    set("GPUPOOL_PROBE_TIMEOUT", "7");
    LOAD_OK();
    CHECK_STR_EQ(cfg->model, "A100");
    CHECK_STR_EQ(cfg->gpu, "1");            /* from the file */
    CHECK_EQ(cfg->min_memory, 40ull << 30); /* from the file */
    CHECK(cfg->probe_timeout == 7.0);
    CHECK(cfg->connect_timeout == 5.0);
    set("GPUPOOL_MIN_MEMORY", "0");
    set("GPUPOOL_DEVICE", "GPU-ab");
    LOAD_OK();
    CHECK_EQ(cfg->min_memory, 0);
    CHECK_STR_EQ(cfg->gpu, "GPU-ab");
}

static void test_short_form_and_values(void)
{
    fresh();
    char file[4400];
    path_in(file, sizeof file, root, "short/config.toml");
    write_file(file,
               "servers = [  # in order of preference\r\n"
               "  \"a:7070\",\r\n"
               "  # a comment inside\r\n"
               "  'tls://b:7070',\r\n"
               "]\r\n"
               "token = \"q\\\"b\\\\s\\u00e9\\n\\t\"\r\n"
               "tls_ca = 'C:\\no\\escapes'\r\n"
               "connect_timeout = 1_000\r\n"
               "probe_timeout = 1.5e1\r\n"
               "[requirements]\r\n"
               "gpu = 3\r\n"
               "min_memory = 17179869184\r\n"
               "model = \"\"\r\n",
               0644); /* not under HOME: no warning */
    set("GPUPOOL_CONFIG", file);
    LOAD_OK();
    CHECK_STR_EQ(captured, "");
    CHECK_EQ(cfg->nservers, 2);
    CHECK_STR_EQ(cfg->servers[0].address, "a:7070");
    CHECK_EQ(cfg->servers[0].tls, 1); /* TLS is the default */
    CHECK_STR_EQ(cfg->servers[1].address, "b:7070");
    CHECK_EQ(cfg->servers[1].tls, 1);
    CHECK_STR_EQ(cfg->servers[1].token, "q\"b\\s\xc3\xa9"); /* "\n\t" at the end: blanks */
    char ca[4400];
    path_in(ca, sizeof ca, rroot, "short/C:\\no\\escapes");
    CHECK_STR_EQ(cfg->servers[0].tls_ca, ca); /* relative: in the file's folder */
    CHECK(cfg->connect_timeout == 1000.0);
    CHECK(cfg->probe_timeout == 15.0);
    CHECK_STR_EQ(cfg->gpu, "3");
    CHECK_EQ(cfg->min_memory, 17179869184ull);
    CHECK_STR_EQ(cfg->model, "");

    /* a relative GPUPOOL_CONFIG: paths relative to its folder, resolved */
    char cwd[4096];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    CHECK_EQ(chdir(root), 0);
    set("GPUPOOL_CONFIG", "short/config.toml");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, "short/config.toml");
    CHECK_STR_EQ(cfg->servers[0].tls_ca, ca);
    CHECK_EQ(chdir(cwd), 0);
}

/* Blanks around values are stripped and an empty value is unset (file and environment); gpu may
 * be an integer; ~/ in GPUPOOL_CONFIG; relative paths from the folder of a symlinked file's
 * target; a client certificate needs its key. */
static void test_blanks_symlinks_and_pairs(void)
{
    fresh();
    char real[4400], link[4400], linkdir[4400], ca[4400];
    path_in(real, sizeof real, root, "real/config.toml");
    path_in(linkdir, sizeof linkdir, root, "link");
    path_in(link, sizeof link, root, "link/config.toml");
    path_in(ca, sizeof ca, rroot, "real/ca.pem");
    write_file(real,
               "token = \"  gpt_d \\t\"\n"
               "tls_ca = \" ca.pem \"\n"
               "[requirements]\n"
               "gpu = 7\n"
               "model = \"\\tA100 \"\n"
               "min_memory = \"  \"\n"
               "[[servers]]\n"
               "address = \"  h:1 \"\n"
               "token = \" \"\n" /* unset: the default token */
               "tls_ca = \"\"\n" /* unset: the default CA */
               "[[servers]]\n"
               "address = \"g\"\n"
               "token = \"\\town\\n\"\n",
               0600);
    mkdirs(linkdir);
    unlink(link); /* may not exist */
    CHECK_EQ(symlink(real, link), 0);
    set("GPUPOOL_CONFIG", link);
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, link);
    CHECK_EQ(cfg->nservers, 2);
    CHECK_STR_EQ(cfg->servers[0].address, "h:1");
    CHECK_STR_EQ(cfg->servers[0].token, "gpt_d");
    CHECK_STR_EQ(cfg->servers[0].tls_ca, ca); /* next to the target, not the link */
    CHECK_STR_EQ(cfg->servers[1].token, "own");
    CHECK_STR_EQ(cfg->gpu, "7");
    CHECK_STR_EQ(cfg->model, "A100");
    CHECK_EQ(cfg->min_memory, 0);

    /* the environment: blanks stripped, blank means unset */
    set("GPUPOOL_CONFIG", " none\t");
    set("GPUPOOL_SERVER", " a:1 ,\tb ");
    set("GPUPOOL_TOKEN", " tok\n");
    set("GPUPOOL_TLS", " on ");
    set("GPUPOOL_CONNECT_TIMEOUT", " 2.5 ");
    set("GPUPOOL_GPU", "   ");
    set("GPUPOOL_DEVICE", " 3 ");
    set("GPUPOOL_MIN_MEMORY", " 1k ");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, "");
    CHECK_EQ(cfg->nservers, 2);
    CHECK_STR_EQ(cfg->servers[1].address, "b");
    CHECK_STR_EQ(cfg->servers[1].token, "tok");
    CHECK_EQ(cfg->servers[1].tls, 1);
    CHECK(cfg->connect_timeout == 2.5);
    CHECK_STR_EQ(cfg->gpu, "3");
    CHECK_EQ(cfg->min_memory, 1000);
    CHECK_STR_EQ(captured, "");

    /* ~/ in GPUPOOL_CONFIG */
    fresh();
    char in_home[4400];
    path_in(in_home, sizeof in_home, home, "conf/config.toml");
    write_file(in_home, "servers = [\"x\"]\n", 0600);
    set("GPUPOOL_CONFIG", "~/conf/config.toml");
    LOAD_OK();
    CHECK_STR_EQ(cfg->file, in_home);
    CHECK_EQ(cfg->nservers, 1);

    /* a client certificate without its key, from the file or the environment */
    write_file(in_home, "tls_cert = \"c.pem\"\nservers = [\"x\"]\n", 0600);
    CHECK_EQ(load(), -1);
    CHECK_STR_EQ(err, "server x: tls_cert is set but tls_key is not: set both (a client "
                      "certificate and its key, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY) or neither");
    set("GPUPOOL_TLS_KEY", "/k.pem");
    LOAD_OK();
    CHECK_STR_EQ(cfg->servers[0].tls_key, "/k.pem");
}

static void test_warnings(void)
{
    fresh();
    char file[4400];
    path_in(file, sizeof file, home, ".config/gpupool/config.toml");
    write_file(file,
               "colour = \"blue\"\n"
               "servers = [\"a:1\"]\n"
               "[requirements]\n"
               "vendor = \"x\"\n"
               "[extra]\n"
               "anything = [\"goes\"]\n"
               "[[more]]\n"
               "x = 1\n",
               0600);
    LOAD_OK();
    CHECK_EQ(cfg->nservers, 1);
    char want[9000];
    snprintf(want, sizeof want, "gpupool: %s:1: unknown setting 'colour' ignored", file);
    CHECK_CONTAINS(captured, want);
    snprintf(want, sizeof want,
             "gpupool: %s:4: unknown setting 'vendor' in [requirements] "
             "ignored",
             file);
    CHECK_CONTAINS(captured, want);
    snprintf(want, sizeof want, "gpupool: %s:5: unknown table [extra] ignored", file);
    CHECK_CONTAINS(captured, want);
    snprintf(want, sizeof want, "gpupool: %s:7: unknown table [[more]] ignored", file);
    CHECK_CONTAINS(captured, want);
    CHECK_EQ(line_count(captured), 4); /* nothing about the keys of unknown tables */

    /* a token readable by others, under HOME: one warning naming the mode and the fix */
    write_file(file, "[[servers]]\naddress = \"a:1\"\ntoken = \"gpt_x\"\n", 0644);
    LOAD_OK();
    snprintf(want, sizeof want,
             "gpupool: %s holds a token and is readable by other users "
             "(mode 0644): chmod 600 %s\n",
             file, file);
    CHECK_STR_EQ(captured, want);
    CHECK_EQ(chmod(file, 0640), 0);
    LOAD_OK();
    CHECK_CONTAINS(captured, "(mode 0640)");
    CHECK_EQ(chmod(file, 0600), 0);
    LOAD_OK();
    CHECK_STR_EQ(captured, "");
    /* no token, no warning */
    write_file(file, "servers = [\"a:1\"]\n", 0644);
    LOAD_OK();
    CHECK_STR_EQ(captured, "");
    /* outside HOME: no warning either (a system file is the admin's business) */
    char outside[4400];
    path_in(outside, sizeof outside, root, "system/config.toml");
    write_file(outside, "token = \"gpt_x\"\n", 0644);
    set("GPUPOOL_CONFIG", outside);
    LOAD_OK();
    CHECK_STR_EQ(captured, "");
}

static void test_errors(void)
{
    static const struct {
        const char *text;
        int line;
        const char *words;
    } cases[] = {
        {"[foo.bar]\n", 1, "unsupported table header"},
        {"x = {a = 1}\n", 1, "inline tables ({...}) are not supported"},
        {"\ntoken = \"\"\"abc\"\"\"\n", 2, "multi-line strings"},
        {"token = '''abc'''\n", 1, "multi-line strings"},
        {"token = \"abc\n", 1, "no closing \""},
        {"token = \"a\\qb\"\n", 1, "unsupported escape \\q"},
        {"token = \"a\\u12\"\n", 1, "\\u needs four hex digits"},
        {"token = \"a\\u0000\"\n", 1, "is not a character"},
        {"a.b = 1\n", 1, "dotted keys"},
        {"\"token\" = \"x\"\n", 1, "quoted keys are not supported"},
        {"tls = yes\n", 1, "cannot read the value of tls"},
        {"connect_timeout = 0x10\n", 1, "cannot read the value of connect_timeout"},
        {"connect_timeout = 007\n", 1, "cannot read the value"},
        {"connect_timeout = 1__0\n", 1, "cannot read the value"},
        {"connect_timeout = inf\n", 1, "cannot read the value"},
        {"when = 2024-01-01\n", 1, "cannot read the value of when"},
        {"connect_timeout = -1\n", 1, "connect_timeout must be a number of seconds"},
        {"probe_timeout = \"2\"\n", 1, "probe_timeout must be a number of seconds"},
        {"tls = \"true\"\n", 1, "tls must be true or false"},
        {"token = 5\n", 1, "token must be a string"},
        {"servers = \"a:1\"\n", 1, "servers must be an array of addresses"},
        {"servers = [1, 2]\n", 1, "may only hold strings"},
        {"servers = [\"a\"\n\"b\"]\n", 2, "expected , or ]"},
        {"servers = [\n  \"a\",\n", 3, "has no closing ]"},
        {"servers = [\"a:\"]\n", 1, "'a:' is not a server address"},
        {"servers = [\"a\"]\n[[servers]]\naddress = \"b\"\n", 2, "use one form"},
        {"[[servers]]\ntoken = \"x\"\n[requirements]\n", 1, "has no address"},
        {"[[servers]]\naddress = \"a\"\n\n[[servers]]\ntoken = \"x\"\n", 4, "has no address"},
        {"[servers]\naddress = \"a\"\n", 1, "write [[servers]]"},
        {"[[requirements]]\n", 1, "write [requirements]"},
        {"[requirements]\n[requirements]\n", 2, "appears twice"},
        {"[requirements\n", 1, "no closing ]"},
        {"[[servers]\n", 1, "no closing ]]"},
        {"[[servers]]\naddress = \"tls://\"\n", 2, "is not a server address"},
        {"[[servers]]\naddress = 7070\n", 2, "address must be a server address in quotes"},
        {"token = \"a\" junk\n", 1, "unexpected text after the value"},
        {"[requirements] x\n", 1, "unexpected text after the table header"},
        {"[requirements]\nmin_memory = \"forty\"\n", 2, "min_memory = \"forty\" is not a size"},
        {"[requirements]\nmin_memory = -5\n", 2, "min_memory must be a size"},
        {"[requirements]\ngpu = true\n", 2, "gpu must be a GPU index"},
        {"[requirements]\nmodel = \"a\\tb\"\n", 2, "model contains a control character"},
        {"token = \"a\"\n# x\ntoken = \"b\"\n", 3, "token is set twice"},
        {"token\n", 1, "expected = after token"},
        {"= 3\n", 1, "expected key = value"},
        {"token =\n", 1, "token has no value"},
        {"token = \"\xff\"\n", 1, "not valid UTF-8"},
        {"token = \"a\tb\x01\"\n", 1, "control character inside a string"},
        {"token = \"a\\nb\"\n", 1, "token contains a control character"},
        {"[requirements]\ngpu = -1\n", 2, "gpu must be a GPU index (1 or \"1\")"},
        {"[requirements]\nmin_memory = 9223372036854775808\n", 2, "cannot read the value"},
        {"[[servers]]\naddress = \"h:0\"\n", 2, "'h:0' is not a server address"},
        {"servers = [\"a,b\"]\n", 1, "'a,b' is not a server address"},
        {"[[servers]]\naddress = \"  \"\n", 1, "has no address"},
        {"kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk = 1\n", 1,
         "longer than 63 characters"},
        {"probe_timeout = 1e400\n", 1, "cannot read the value"},
        {"probe_timeout = 1_\n", 1, "cannot read the value"},
    };
    char file[4400];
    path_in(file, sizeof file, root, "bad/config.toml");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fresh();
        write_file(file, cases[i].text, 0600);
        set("GPUPOOL_CONFIG", file);
        int rc = load();
        if (rc != -1)
            fprintf(stderr, "accepted: %s", cases[i].text);
        CHECK_EQ(rc, -1);
        char where[4500];
        snprintf(where, sizeof where, "%s:%d: ", file, cases[i].line);
        if (strncmp(err, where, strlen(where)) != 0)
            fprintf(stderr, "case %zu: \"%s\" does not start with \"%s\"\n", i, err, where);
        CHECK(strncmp(err, where, strlen(where)) == 0);
        CHECK_CONTAINS(err, cases[i].words);
        CHECK(strchr(err, '\n') == NULL);
    }
    /* an unsupported construct says what is supported */
    fresh();
    write_file(file, "x = {a = 1}\n", 0600);
    set("GPUPOOL_CONFIG", file);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, "[requirements] and [[servers]]");

    /* 17 servers */
    char text[4096] = "";
    for (int i = 0; i < 17; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text),
                 "[[servers]]\naddress = \"h%d:1\"\n", i);
    write_file(file, text, 0600);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, ":33: more than 16 servers");

    /* a token of 4097 bytes */
    char big[4200];
    memset(big, 'x', 4097);
    big[4097] = 0;
    char line[4300];
    snprintf(line, sizeof line, "token = \"%s\"\n", big);
    write_file(file, line, 0600);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, ":1: token is longer than 4096 bytes");

    /* a file that is not there, or not a file */
    set("GPUPOOL_CONFIG", root);
    CHECK_EQ(load(), -1);
    CHECK_CONTAINS(err, "is not a regular file");
}

int main(void)
{
    cfg = calloc(1, sizeof *cfg);
    if (!cfg)
        return 2;
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/gpupool-config-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 2;
    }
    snprintf(home, sizeof home, "%s/home", root);
    mkdirs(home);
    if (!realpath(root, rroot)) {
        perror("realpath");
        return 2;
    }
    snprintf(rhome, sizeof rhome, "%s/home", rroot);
    CHECK_EQ(setenv("HOME", home, 1), 0);
    CHECK_EQ(unsetenv("GPUPOOL_LOG"), 0); /* warnings show at the default level */

    test_nothing_configured();
    test_environment_only();
    test_environment_errors();
    test_full_file();
    test_environment_over_file();
    test_short_form_and_values();
    test_blanks_symlinks_and_pairs();
    test_warnings();
    test_errors();

    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", root);
    free(cfg);
    return gp_test_done("test_client_config");
}
