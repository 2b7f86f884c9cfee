/*
 * modcache.c: see modcache.h.
 *
 * Disk entries are written to a temporary file in the same directory and renamed into place, so
 * a concurrent worker sees either no file or a complete one. Whatever is read back is hashed
 * again: a damaged or foreign file is a cache miss, never a wrong module.
 */
#include "modcache.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sha256.h"
#include "worker.h"

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

int wk_modcache_init(struct modcache *c, const char *cache_dir)
{
    memset(c, 0, sizeof *c);
    size_t n = strlen(cache_dir) + sizeof "/modules";
    c->dir = malloc(n);
    if (!c->dir)
        return -1;
    snprintf(c->dir, n, "%s/modules", cache_dir);
    if (mkdir_p(c->dir) != 0) {
        wk_warn("module disk cache %s unusable (%s); caching in memory only", c->dir,
                strerror(errno));
        free(c->dir);
        c->dir = NULL;
    }
    return 0;
}

static struct mc_entry *find_mem(struct modcache *c, const uint8_t sha[32])
{
    for (struct mc_entry *e = c->head; e; e = e->next) {
        if (memcmp(e->sha, sha, 32) == 0)
            return e;
    }
    return NULL;
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
    return e;
}

static void path_of(const struct modcache *c, const uint8_t sha[32], char *out, size_t cap)
{
    char hex[65];
    gp_sha256_hex(sha, hex);
    snprintf(out, cap, "%s/%s", c->dir, hex);
}

/* The whole file, or NULL. */
static uint8_t *read_file(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
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

static void write_disk(struct modcache *c, const struct mc_entry *e)
{
    char path[4200], tmp[4300];
    path_of(c, e->sha, path, sizeof path);
    /* Written even when a file exists: we only get here after a miss, so an existing file
     * failed its check (or was stored a moment ago by another worker: same bytes). */
    snprintf(tmp, sizeof tmp, "%s/.tmp-%ld-%u", c->dir, (long)getpid(), c->tmp_seq++);
    /* No fsync: after a crash a truncated file only fails its hash check and is replaced. */
    if (wk_write_file_atomic(tmp, path, e->data, e->len, 0) != 0)
        wk_warn("cannot store module cache file %s: %s", path, strerror(errno));
}

const struct mc_entry *wk_modcache_put(struct modcache *c, const uint8_t sha[32], uint8_t *data,
                                       size_t len)
{
    struct mc_entry *e = find_mem(c, sha);
    if (e) {
        /* Same hash, same bytes, and already on disk: every memory entry was either read from
         * the disk cache or written there when it was inserted below. */
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
    free(c->dir);
    memset(c, 0, sizeof *c);
}
