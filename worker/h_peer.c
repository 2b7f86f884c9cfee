/*
 * h_peer.c: server-to-server copies of a spread lease (issue 37, item 3): links between the
 * workers of two parts, brokered by their gpupoolds (protocol/gpupool.toml, "peer links").
 *
 * Not built yet: every call answers CUDA_ERROR_NOT_SUPPORTED, which the client takes as "copy
 * through the client" (the path it has always used).
 */
#include "worker.h"

static const char not_built[] = "this server's worker does not make server-to-server links yet";

WK_HANDLER(peer_link)
{
    (void)m;
    gp_peer_link_reply r = {0};
    r.code = CUDA_ERROR_NOT_SUPPORTED;
    r.error = not_built;
    r.error_len = (uint32_t)(sizeof not_built - 1);
    WK_REPLY(w, req, gp_peer_link_reply, &r);
}

WK_HANDLER(peer_send)
{
    (void)m;
    gp_peer_send_reply r = {0};
    r.code = CUDA_ERROR_NOT_SUPPORTED;
    r.error = not_built;
    r.error_len = (uint32_t)(sizeof not_built - 1);
    WK_REPLY(w, req, gp_peer_send_reply, &r);
}

WK_HANDLER(peer_recv)
{
    (void)m;
    gp_peer_recv_reply r = {0};
    r.code = CUDA_ERROR_NOT_SUPPORTED;
    r.error = not_built;
    r.error_len = (uint32_t)(sizeof not_built - 1);
    WK_REPLY(w, req, gp_peer_recv_reply, &r);
}

WK_HANDLER(peer_unlink)
{
    (void)w;
    (void)req;
    (void)m;
}
