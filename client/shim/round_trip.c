/*
 * round_trip.c: wait until the worker has handled every frame sent before, with a ping and its
 * reply (replies come in order). A session frame, so the connection's to send rather than an
 * api_<group>.c's (tests/test_worker_dispatch_gen.py); used where the driver's call has taken
 * effect on the device when it returns and another process may rely on that at once (the record
 * of a CUDA IPC event, api_event.c).
 */
#include "shim.h"
#include "shim_core.h"

CUresult gp_round_trip(void)
{
    gp_ping m = {.token = 0};
    GP_FRAME(buf, len, gp_ping, &m);
    if (!buf)
        return CUDA_ERROR_OUT_OF_MEMORY;
    gp_reply rep;
    CUresult r = gp_request(buf, len, NULL, 0, NULL, 0, &rep);
    GP_FRAME_FREE(buf);
    gp_reply_free(&rep);
    return r == CUDA_SUCCESS ? r : gp_cu_result(r);
}
