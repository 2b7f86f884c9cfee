/*
 * driver.c: dlopen() the driver library and resolve the entry point table (driver.h).
 */
#include "driver.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* POSIX guarantees that a function pointer survives a round trip through void * (dlsym relies on
 * it); we store what dlsym returns into the typed fields by copying the pointer's bytes. */
_Static_assert(sizeof(void *) == sizeof(void (*)(void)), "function pointers must fit void *");

struct sym_entry {
    int required;
    size_t offset;     /* of the field in struct gp_driver */
    const char *names; /* space-separated candidates */
};

static const struct sym_entry g_syms[] = {
#define GP_DRIVER_ENTRY(req_, name_, params_, syms_)                                               \
    {req_, offsetof(struct gp_driver, name_), syms_},
    GP_DRIVER_FUNCS(GP_DRIVER_ENTRY)
#undef GP_DRIVER_ENTRY
};

/* First candidate name in `names` that the library exports, or NULL. */
static void *lookup(void *lib, const char *names)
{
    char name[128];
    const char *p = names;
    while (*p) {
        size_t n = strcspn(p, " ");
        if (n > 0 && n < sizeof name) {
            memcpy(name, p, n);
            name[n] = '\0';
            dlerror(); /* clear, so that a NULL result is told apart from an error */
            void *sym = dlsym(lib, name);
            if (sym && !dlerror())
                return sym;
        }
        p += n;
        while (*p == ' ')
            p++;
    }
    return NULL;
}

int wk_driver_load(struct gp_driver *d, const char *path, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    /* RTLD_NOW: a library with unresolvable dependencies fails here, with a message, instead of
     * in the middle of the session. RTLD_LOCAL: its symbols must not satisfy other lookups. */
    d->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!d->lib) {
        const char *why = dlerror();
        snprintf(err, errlen, "cannot load the driver %s: %s", path, why ? why : "unknown error");
        return -1;
    }
    for (size_t i = 0; i < sizeof g_syms / sizeof g_syms[0]; i++) {
        void *sym = lookup(d->lib, g_syms[i].names);
        if (!sym && g_syms[i].required) {
            snprintf(err, errlen, "the driver %s lacks the required entry point %s", path,
                     g_syms[i].names);
            return -1;
        }
        memcpy((char *)d + g_syms[i].offset, &sym, sizeof sym);
    }
    void *detail = lookup(d->lib, "gpupoolSimLastErrorDetail");
    memcpy(&d->sim_last_error_detail, &detail, sizeof detail);
    /* GPUPOOL_WORKER_STAGED_COPIES=1 keeps the simulated device on the staging path that a real
     * driver takes (the tests use it to cover that path without a GPU). */
    const char *staged = getenv("GPUPOOL_WORKER_STAGED_COPIES");
    void *host_ptr =
        staged && strcmp(staged, "1") == 0 ? NULL : lookup(d->lib, "gpupoolSimHostPointer");
    memcpy(&d->sim_host_pointer, &host_ptr, sizeof host_ptr);
    return 0;
}
