/*
 * gp_graph.h: stream capture and CUDA graphs in the shim (api_graph.c). The capture status of
 * every stream is known here, from the calls this process forwarded, so the frequent questions
 * (cuStreamIsCapturing, cuStreamGetCaptureInfo, the thread's capture mode) cost no round trip.
 */
#ifndef GP_GRAPH_H
#define GP_GRAPH_H

#include <stdint.h>

#include "gp_cuda_more.h"
#include "shim.h"

/* Driver ABI values that gp_cuda.h does not declare (prefixed so they never clash with it). */
enum {
    GP_ERR_ILLEGAL_STATE = 401,
    GP_ERR_CAPTURE_INVALIDATED = 901,
    GP_ERR_CAPTURE_WRONG_THREAD = 908,
};
typedef enum GPstreamCaptureMode {
    GP_CAPTURE_MODE_GLOBAL = 0,
    GP_CAPTURE_MODE_THREAD_LOCAL = 1,
    GP_CAPTURE_MODE_RELAXED = 2,
} GPstreamCaptureMode;

/* Client-chosen handle kinds of graphs and graph execs (shim.h's enum gp_handle_kind). */
#define GP_H_GRAPH ((enum gp_handle_kind)16)
#define GP_H_GRAPH_EXEC ((enum gp_handle_kind)17)

/* The capture status of stream `wire` (a wire id from gp_stream_enter). */
CUstreamCaptureStatus gp_capture_status(uint64_t wire);
/* A synchronising call (cuStreamSynchronize, cuStreamQuery) on stream `wire`: if it is
 * capturing, the capture is invalidated (as by the driver) and 1 is returned; else 0. */
int gp_capture_sync_call(uint64_t wire);
/* A copy between device memory and this process's host memory on stream `wire` (call names the
 * entry point): CUDA_SUCCESS when the stream is not capturing; else the capture is invalidated,
 * one line says why, and CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED is returned. */
CUresult gp_capture_host_copy(uint64_t wire, const char *call);
/* An interprocess event is recorded on stream `wire`: if it is capturing (or, not known as
 * capturing, another stream's capture may have joined it), the graph notes it, so that a launch
 * of it waits for the worker as cuEventRecord of such an event does (api_event.c). */
void gp_capture_note_ipc_event(uint64_t wire);
/* Stream `wire` is being destroyed: forget its capture, if any. */
void gp_capture_forget(uint64_t wire);

#endif /* GP_GRAPH_H */
