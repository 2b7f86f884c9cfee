/*
 * client_config_hooks.c: the hooks of the configuration load running on this thread (an
 * environment block, a warning sink, a visitor of the file's headers and values), which every
 * unit of the reader uses; set by gp_client_config_load_with (client_config.c) for the duration
 * of the call. The base of the reader's units: it calls none of them.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_config_internal.h"
#include "gp_log.h"

_Thread_local const gp_config_hooks *gp_cc_hooks;

const char *gp_cc_getenv(const char *name)
{
    if (!gp_cc_hooks || !gp_cc_hooks->envp)
        return getenv(name);
    size_t n = strlen(name);
    for (char *const *e = gp_cc_hooks->envp; *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=')
            return *e + n + 1;
    return NULL;
}

void gp_cc_warn(const char *fmt, ...)
{
    char line[8448];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (gp_cc_hooks && gp_cc_hooks->warn)
        gp_cc_hooks->warn(gp_cc_hooks->ctx, line);
    else
        gp_log_info("%s", line);
}

void gp_cc_visit(int kind, const char *key, const char *text)
{
    if (gp_cc_hooks && gp_cc_hooks->visit)
        gp_cc_hooks->visit(gp_cc_hooks->ctx, kind, key, text);
}
