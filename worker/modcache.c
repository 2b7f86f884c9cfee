/*
 * modcache.c: see modcache.h.
 *
 * Layout: <cache-dir>/modules/<namespace>/<hex sha256>, the namespace being 16 hex digits
 * derived from the session's token (wk_modcache_namespace). A file directly in modules/ named
 * by a hash is an entry of the old shared layout: no token owns it, so it is never read, and the
 * first eviction scan removes it.
 *
 * Disk entries are written to a temporary file in the same directory and renamed into place, so
 * a concurrent worker sees either no file or a complete one. Whatever is read back is hashed
 * again: a damaged or foreign file is a cache miss, never a wrong module.
 *
 * Eviction: after the first image a session writes (a miss: the image has just crossed the
 * network), and then after every 1/256 of a token's file limit or 1/16 of its byte limit written
 * (64 images or 256 MiB by default; every image with the tests' small limits), the writer scans
 * the whole disk cache: a scan reads every file's metadata, too much work for each of the
 * hundreds of images a framework loads at its first run, and the cache may go over its limits
 * by that much per worker running at once. First its own namespace is brought under the per-token
 * limits, oldest use first; then, while the whole cache is over the total limits, the oldest
 * entry of the namespace holding the most bytes goes, so a tenant filling its share evicts its
 * own images before anyone else's. "Use" is the file's access time, which a disk hit sets.
 * Workers scanning at the same time may both delete: a file already gone counts as deleted.
 */
#include "modcache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sha256.h"
#include "worker.h"

/* Defaults (docs/configuration.md, "Files"): a token's images up to 4 GiB (four of the largest
 * image accepted), 16 GiB for all; the file counts bound the scan's work when images are tiny. */
static const struct mc_limits DEFAULT_LIMITS = {
    .token_bytes = (uint64_t)4 << 30,
    .token_files = 16384,
    .total_bytes = (uint64_t)16 << 30,
    .total_files = 65536,
    .memory_bytes = (uint64_t)1 << 30,
};

/* Temporary files older than this are left over from a crash. */
#define STALE_TMP_SECONDS 3600

static int mkdir_p(const char *path)
{
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0700) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    /* 0700: images may be proprietary; only the daemon's user (all its workers) reads them. */
    if (mkdir(buf, 0700) != 0 && errno != EEXIST)
        return -1;
    return 0;
}

void wk_modcache_namespace(const char *token, size_t token_len, char out[17])
{
    /* A domain-separated hash: not the digest the token store keeps, and 64 bits say nothing
     * about a token (whose secret part is random) to whoever lists the directory. */
    static const char label[] = "gpupool module cache"; /* hashed with its NUL */
    gp_sha256_ctx ctx;
    uint8_t d[32];
    char hex[65];
    gp_sha256_init(&ctx);
    gp_sha256_update(&ctx, label, sizeof label);
    if (token_len > 0) /* an empty token may come as NULL */
        gp_sha256_update(&ctx, token, token_len);
    gp_sha256_final(&ctx, d);
    gp_sha256_hex(d, hex);
    memcpy(out, hex, 16);
    out[16] = '\0';
}

/* GPUPOOL_WORKER_MODCACHE_LIMITS="TOKEN_BYTES,TOKEN_FILES,TOTAL_BYTES,TOTAL_FILES,MEMORY_BYTES"
 * replaces the defaults (the tests use small ones). */
static void read_limits(struct mc_limits *l)
{
    *l = DEFAULT_LIMITS;
    const char *s = getenv("GPUPOOL_WORKER_MODCACHE_LIMITS");
    if (!s || !*s)
        return;
    uint64_t v[5];
    const char *p = s;
    for (int i = 0; i < 5; i++) {
        char *end = NULL;
        errno = 0;
        unsigned long long x = strtoull(p, &end, 10);
        if (errno != 0 || end == p || *end != (i < 4 ? ',' : '\0') || x == 0) {
            wk_warn("GPUPOOL_WORKER_MODCACHE_LIMITS=%s is not five positive numbers separated by "
                    "commas; using the default limits",
                    s);
            return;
        }
        v[i] = x;
        p = end + 1;
    }
    *l = (struct mc_limits){v[0], v[1], v[2], v[3], v[4]};
}

int wk_modcache_init(struct modcache *c, const char *cache_dir, const char *token, size_t token_len)
{
    memset(c, 0, sizeof *c);
    read_limits(&c->lim);
    wk_modcache_namespace(token, token_len, c->ns);
    size_t n = strlen(cache_dir) + sizeof "/modules";
    c->root = malloc(n);
    c->dir = malloc(n + 17);
    if (!c->root || !c->dir) {
        free(c->root);
        free(c->dir);
        c->root = c->dir = NULL;
        return -1;
    }
    snprintf(c->root, n, "%s/modules", cache_dir);
    snprintf(c->dir, n + 17, "%s/%s", c->root, c->ns);
    if (mkdir_p(c->dir) != 0) {
        wk_warn("module disk cache %s unusable (%s); caching in memory only", c->dir,
                strerror(errno));
        free(c->root);
        free(c->dir);
        c->root = c->dir = NULL;
    }
    return 0;
}

static void drop_entry(struct modcache *c, struct mc_entry *e)
{
    c->mem_bytes -= e->len;
    free(e->data);
    free(e);
}

/* Found entries move to the front: the memory cache drops its least recently used. */
static struct mc_entry *find_mem(struct modcache *c, const uint8_t sha[32])
{
    for (struct mc_entry **pp = &c->head; *pp; pp = &(*pp)->next) {
        struct mc_entry *e = *pp;
        if (memcmp(e->sha, sha, 32) != 0)
            continue;
        *pp = e->next;
        e->next = c->head;
        c->head = e;
        return e;
    }
    return NULL;
}

/* Keeps the memory cache within its limit, never dropping the newest entry (the caller's). The
 * dropped images stay on disk. */
static void trim_mem(struct modcache *c)
{
    if (!c->head || c->mem_bytes <= c->lim.memory_bytes)
        return;
    size_t kept = c->head->len;
    struct mc_entry *prev = c->head;
    while (prev->next && kept + prev->next->len <= c->lim.memory_bytes) {
        kept += prev->next->len;
        prev = prev->next;
    }
    struct mc_entry *e = prev->next;
    prev->next = NULL;
    while (e) {
        struct mc_entry *next = e->next;
        drop_entry(c, e);
        e = next;
    }
}

static struct mc_entry *insert(struct modcache *c, const uint8_t sha[32], uint8_t *data, size_t len)
{
    struct mc_entry *e = malloc(sizeof *e);
    if (!e) {
        free(data);
        return NULL;
    }
    memcpy(e->sha, sha, 32);
    e->data = data;
    e->len = len;
    e->next = c->head;
    c->head = e;
    c->mem_bytes += len;
    trim_mem(c);
    return e;
}

static void path_of(const struct modcache *c, const uint8_t sha[32], char *out, size_t cap)
{
    char hex[65];
    gp_sha256_hex(sha, hex);
    snprintf(out, cap, "%s/%s", c->dir, hex);
}

/* The whole file, or NULL. Its access time is set to now: the eviction's "last used". */
static uint8_t *read_file(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return NULL; /* absent: the ordinary miss */
    uint8_t *data = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
        (uint64_t)st.st_size > WK_MAX_IMAGE)
        goto out;
    size_t n = (size_t)st.st_size;
    data = malloc(n + 1);
    if (!data)
        goto out;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, data + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            free(data);
            data = NULL;
            goto out;
        }
        got += (size_t)r;
    }
    data[n] = '\0';
    *len = n;
    const struct timespec use[2] = {{.tv_nsec = UTIME_NOW}, {.tv_nsec = UTIME_OMIT}};
    if (futimens(fd, use) != 0) /* only the eviction order suffers */
        wk_warn("marking %s used: %s", path, strerror(errno));
out:
    if (close(fd) != 0)
        wk_warn("closing %s: %s", path, strerror(errno));
    return data;
}

const struct mc_entry *wk_modcache_get(struct modcache *c, const uint8_t sha[32],
                                       uint64_t expected_size)
{
    struct mc_entry *e = find_mem(c, sha);
    if (e || !c->dir)
        return e;
    char path[4200];
    path_of(c, sha, path, sizeof path);
    size_t len = 0;
    uint8_t *data = read_file(path, &len);
    if (!data)
        return NULL;
    uint8_t got[32];
    gp_sha256(data, len, got);
    if (memcmp(got, sha, 32) != 0 || (expected_size != 0 && expected_size != len)) {
        wk_warn("cached module %s does not match its name; ignoring it", path);
        free(data);
        return NULL;
    }
    return insert(c, sha, data, len);
}

/* ---- eviction ----------------------------------------------------------------------------- */

struct ev_file {
    uint32_t ns; /* index into ev.ns */
    struct timespec used;
    uint64_t bytes;
    char name[65];
};

struct ev_ns {
    char name[17];
    uint64_t bytes, files;
    size_t cur, end; /* its files, oldest first, in ev.files[cur..end) after sorting */
};

struct ev {
    int root_fd;
    struct ev_file *files;
    size_t nfiles, capfiles;
    struct ev_ns *ns;
    size_t nns, capns;
    uint64_t bytes, removed_old;
};

static int is_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    }
    return s[n] == '\0';
}

/* Removes a temporary file a crashed writer left (an hour old or more). */
static void remove_stale_tmp(int dir_fd, const char *name, const struct stat *st, time_t now)
{
    if (strncmp(name, ".tmp-", 5) != 0 || !S_ISREG(st->st_mode) ||
        now - st->st_mtime < STALE_TMP_SECONDS)
        return;
    if (unlinkat(dir_fd, name, 0) != 0 && errno != ENOENT)
        wk_warn("cannot remove the stale module cache file %s: %s", name, strerror(errno));
}

static int add_file(struct ev *v, uint32_t ns, const char *name, const struct stat *st)
{
    if (v->nfiles == v->capfiles) {
        size_t cap = v->capfiles ? 2 * v->capfiles : 256;
        struct ev_file *f = realloc(v->files, cap * sizeof *f);
        if (!f)
            return -1;
        v->files = f;
        v->capfiles = cap;
    }
    struct ev_file *f = &v->files[v->nfiles++];
    f->ns = ns;
    f->used = st->st_atim;
    /* What the file really takes on disk, at least its length. */
    uint64_t blocks = (uint64_t)st->st_blocks * 512;
    f->bytes = blocks > (uint64_t)st->st_size ? blocks : (uint64_t)st->st_size;
    memcpy(f->name, name, 65);
    v->ns[ns].bytes += f->bytes;
    v->ns[ns].files++;
    v->bytes += f->bytes;
    return 0;
}

/* One namespace's files. -1: out of memory. */
static int scan_ns(struct ev *v, const char *name, time_t now)
{
    int fd = openat(v->root_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return 0; /* gone, or not a directory of ours */
    DIR *d = fdopendir(fd);
    if (!d) {
        if (close(fd) != 0)
            wk_warn("closing module cache folder %s: %s", name, strerror(errno));
        return 0;
    }
    if (v->nns == v->capns) {
        size_t cap = v->capns ? 2 * v->capns : 16;
        struct ev_ns *ns = realloc(v->ns, cap * sizeof *ns);
        if (!ns) {
            if (closedir(d) != 0)
                wk_warn("closing module cache folder %s: %s", name, strerror(errno));
            return -1;
        }
        v->ns = ns;
        v->capns = cap;
    }
    uint32_t idx = (uint32_t)v->nns++;
    memset(&v->ns[idx], 0, sizeof v->ns[idx]);
    memcpy(v->ns[idx].name, name, 17);
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d)) != NULL) {
        struct stat st;
        if (de->d_name[0] == '.' && (de->d_name[1] == '\0' || strcmp(de->d_name, "..") == 0))
            continue;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            continue; /* removed meanwhile */
        if (is_hex(de->d_name, 64) && S_ISREG(st.st_mode))
            rc = add_file(v, idx, de->d_name, &st);
        else
            remove_stale_tmp(dirfd(d), de->d_name, &st, now);
    }
    if (closedir(d) != 0)
        wk_warn("closing module cache folder %s: %s", name, strerror(errno));
    return rc;
}

/* The whole cache: namespaces and their files; old flat entries removed on the way. */
static int scan(struct ev *v)
{
    DIR *d = fdopendir(v->root_fd);
    if (!d)
        return -1;
    time_t now = time(NULL);
    int rc = 0;
    struct dirent *de;
    while (rc == 0 && (de = readdir(d)) != NULL) {
        struct stat st;
        if (de->d_name[0] == '.' && (de->d_name[1] == '\0' || strcmp(de->d_name, "..") == 0))
            continue;
        if (fstatat(v->root_fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            continue;
        if (is_hex(de->d_name, 16) && S_ISDIR(st.st_mode)) {
            rc = scan_ns(v, de->d_name, now);
        } else if (is_hex(de->d_name, 64) && S_ISREG(st.st_mode)) {
            /* The old layout, shared by every token: unreachable now, so removed. */
            if (unlinkat(v->root_fd, de->d_name, 0) == 0)
                v->removed_old++;
            else if (errno != ENOENT)
                wk_warn("cannot remove the old module cache file %s: %s", de->d_name,
                        strerror(errno));
        } else {
            remove_stale_tmp(v->root_fd, de->d_name, &st, now);
        }
    }
    /* closedir closes root_fd too; the deletions need it, so keep a copy. */
    int dup_fd = fcntl(v->root_fd, F_DUPFD_CLOEXEC, 0);
    if (closedir(d) != 0)
        wk_warn("closing the module cache folder: %s", strerror(errno));
    v->root_fd = dup_fd;
    return dup_fd < 0 ? -1 : rc;
}

static int by_ns_then_use(const void *a, const void *b)
{
    const struct ev_file *x = a, *y = b;
    if (x->ns != y->ns)
        return x->ns < y->ns ? -1 : 1;
    if (x->used.tv_sec != y->used.tv_sec)
        return x->used.tv_sec < y->used.tv_sec ? -1 : 1;
    if (x->used.tv_nsec != y->used.tv_nsec)
        return x->used.tv_nsec < y->used.tv_nsec ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Deletes the oldest file of a namespace. */
static void evict_one(struct ev *v, struct ev_ns *ns, uint64_t *total_files)
{
    const struct ev_file *f = &v->files[ns->cur++];
    char rel[17 + 1 + 65];
    snprintf(rel, sizeof rel, "%s/%s", ns->name, f->name);
    if (unlinkat(v->root_fd, rel, 0) != 0 && errno != ENOENT) {
        wk_warn("cannot evict module cache file %s: %s", rel, strerror(errno));
        return; /* counted as still there: the loop moves on to the next file */
    }
    ns->bytes -= f->bytes;
    ns->files--;
    v->bytes -= f->bytes;
    (*total_files)--;
}

static void evict(struct modcache *c)
{
    struct ev v = {0};
    v.root_fd = open(c->root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (v.root_fd < 0 || scan(&v) != 0) {
        wk_warn("cannot scan the module cache %s for eviction: %s", c->root, strerror(errno));
        goto out;
    }
    if (v.removed_old)
        wk_log("module cache: removed %llu image(s) of the old shared layout",
               (unsigned long long)v.removed_old);
    qsort(v.files, v.nfiles, sizeof *v.files, by_ns_then_use);
    for (size_t i = 0; i < v.nfiles; i++) {
        struct ev_ns *ns = &v.ns[v.files[i].ns];
        if (ns->end == 0)
            ns->cur = i;
        ns->end = i + 1;
    }
    uint64_t files = v.nfiles;
    for (size_t i = 0; i < v.nns; i++) {
        struct ev_ns *ns = &v.ns[i];
        if (strcmp(ns->name, c->ns) != 0)
            continue;
        while ((ns->bytes > c->lim.token_bytes || ns->files > c->lim.token_files) &&
               ns->cur < ns->end)
            evict_one(&v, ns, &files);
    }
    while (v.bytes > c->lim.total_bytes || files > c->lim.total_files) {
        struct ev_ns *big = NULL;
        for (size_t i = 0; i < v.nns; i++) {
            struct ev_ns *ns = &v.ns[i];
            if (ns->cur < ns->end && (!big || ns->bytes > big->bytes))
                big = ns;
        }
        if (!big)
            break;
        evict_one(&v, big, &files);
    }
out:
    if (v.root_fd >= 0 && close(v.root_fd) != 0)
        wk_warn("closing the module cache folder: %s", strerror(errno));
    free(v.files);
    free(v.ns);
}

static void write_disk(struct modcache *c, const struct mc_entry *e)
{
    char path[4200], tmp[4300];
    path_of(c, e->sha, path, sizeof path);
    /* Written even when a file exists: we only get here after a miss, so an existing file
     * failed its check (or was stored a moment ago by another worker: same bytes). */
    snprintf(tmp, sizeof tmp, "%s/.tmp-%ld-%u", c->dir, (long)getpid(), c->tmp_seq++);
    /* No fsync: after a crash a truncated file only fails its hash check and is replaced. */
    if (wk_write_file_atomic(tmp, path, e->data, e->len, 0) != 0) {
        wk_warn("cannot store module cache file %s: %s", path, strerror(errno));
        return;
    }
    c->unscanned_files++;
    c->unscanned_bytes += e->len;
    uint64_t every_files = c->lim.token_files / 256 ? c->lim.token_files / 256 : 1;
    if (c->scanned && c->unscanned_files < every_files &&
        c->unscanned_bytes < c->lim.token_bytes / 16)
        return;
    evict(c);
    c->scanned = 1;
    c->unscanned_files = c->unscanned_bytes = 0;
}

const struct mc_entry *wk_modcache_put(struct modcache *c, const uint8_t sha[32], uint8_t *data,
                                       size_t len)
{
    struct mc_entry *e = find_mem(c, sha);
    if (e) {
        /* Same hash, same bytes, and on disk unless evicted since: every memory entry was
         * either read from this namespace or written there when it was inserted below. */
        free(data);
        return e;
    }
    e = insert(c, sha, data, len);
    if (e && c->dir)
        write_disk(c, e);
    return e;
}

void wk_modcache_free(struct modcache *c)
{
    struct mc_entry *e = c->head;
    while (e) {
        struct mc_entry *next = e->next;
        free(e->data);
        free(e);
        e = next;
    }
    free(c->root);
    free(c->dir);
    memset(c, 0, sizeof *c);
}
