/*
 * pending.c: the errors a program learns late. A fire-and-forget call's failure, and a notice
 * the server sends during the session, become the pending error that the next synchronising
 * call returns (as the driver reports an asynchronous error at the next sync); sticky codes
 * (700-719, 999: the context is broken) are returned from then on. A notice's text is printed
 * once per distinct text; informational codes (gp_code_is_info) are printed every time and
 * never recorded.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "shim.h"
#include "shim_core.h"

/* Process-wide, whatever the number of connections (a lease spread over servers has one per
 * part): the next synchronising call reports an asynchronous failure of any part, as the driver
 * reports one of any device's work, and a notice's text is printed once whichever server sent
 * it. */
static atomic_int pending_error;
static pthread_mutex_t notice_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t notice_seen[512];
static size_t notice_count;

/* The context is broken: the error stays (as the driver's does). */
static int is_sticky(int code)
{
    return (code >= 700 && code <= 719) || code == 999;
}

CUresult gp_cu_result(int32_t r)
{
    return r >= 100000 || r < 0 ? CUDA_ERROR_UNKNOWN : r;
}

void gp_pending_record(int32_t code)
{
    if (code == 0)
        return;
    int expected = 0;
    atomic_compare_exchange_strong(&pending_error, &expected, (int)gp_cu_result(code));
}

CUresult gp_take_pending_error(void)
{
    int v = atomic_load(&pending_error);
    if (v == 0 || is_sticky(v))
        return v;
    atomic_compare_exchange_strong(&pending_error, &v, 0);
    return v;
}

void gp_pending_notice(const uint8_t *body, size_t len)
{
    gp_notice m;
    if (gp_notice_decode(body, len, &m) != 0)
        return;
    if (gp_code_is_info(m.code)) { /* status, not an error: every one is news */
        if (m.text_len)
            gp_log_info("%.*s", (int)m.text_len, m.text);
        return;
    }
    /* FNV-1a of the text: print each distinct text once. A full table only stops remembering:
     * texts it has no room for are still printed (show stays 1), never silenced. */
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < m.text_len; i++)
        h = (h ^ (uint8_t)m.text[i]) * 1099511628211ull;
    int show = 1;
    pthread_mutex_lock(&notice_lock);
    for (size_t i = 0; i < notice_count; i++)
        if (notice_seen[i] == h)
            show = 0;
    if (show && notice_count < sizeof notice_seen / sizeof notice_seen[0])
        notice_seen[notice_count++] = h;
    pthread_mutex_unlock(&notice_lock);
    if (show && m.text_len)
        gp_log_error("%.*s", (int)m.text_len, m.text);
    gp_pending_record(m.code);
}
