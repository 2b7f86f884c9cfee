/*
 * info_decode.c: an info reply of this protocol version, of a newer 1.x (its added fields
 * ignored), or of an older 1.x from 1.3 on (it ends before the fields added since: read as
 * empty), as client/gpupool/wire/info.py's decode_reply does. Without the last case a client
 * upgraded before its servers would take every older server's reply, refusals included, for
 * garbage ("is the port right?") and pick none of them.
 */
#include <string.h>

#include "info_client.h"

/* The fields appended to the info reply since 1.3, by the minor version that added them, as the
 * number of bytes their empty values encode to. */
static const struct {
    uint16_t since;
    size_t zeros;
} appended[] = {
    {4, 8},  /* an empty fingerprint and an empty fleet_servers */
    {7, 12}, /* empty shared_gpus, share_views and lease_gpus */
};

int gp_info_reply_decode_any(uint8_t *body, size_t len, gp_info_reply *r)
{
    int rc = gp_info_reply_decode(body, len, r);
    if (rc == 0)
        return 0;
    if (rc == GP_PROTO_ETRAILING && r->major == GP_PROTO_MAJOR && r->minor > GP_PROTO_MINOR)
        return 0;
    size_t n_appended = sizeof appended / sizeof appended[0];
    for (size_t n = 0; n < n_appended; n++) {
        size_t extra = 0;
        for (size_t k = n; k < n_appended; k++)
            extra += appended[k].zeros;
        memset(body + len, 0, extra); /* within GP_INFO_APPENDED_MAX, the caller's spare room */
        gp_info_reply older;
        if (gp_info_reply_decode(body, len + extra, &older) == 0 && older.major == GP_PROTO_MAJOR &&
            older.minor < appended[n].since) {
            *r = older;
            return 0;
        }
    }
    return -1;
}
