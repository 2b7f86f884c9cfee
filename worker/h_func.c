/*
 * h_func.c: function and kernel attributes. A function id is either a CUfunction (module) or a
 * CUkernel (library, kind 1): the attribute calls have kernel variants that take the device.
 */
#include "worker.h"

WK_HANDLER(func_get_attribute)
{
    gp_func_get_attribute_reply r = {0};
    struct wk_obj *f = wk_func_get(w, m->func);
    int v = 0;
    if (!f)
        r.result = CUDA_ERROR_INVALID_HANDLE;
    else if (f->kind == 1)
        r.result = DRV(w, cuKernelGetAttribute, &v, m->attribute, f->h, w->devs[wk_cur_device(w)]);
    else
        r.result = DRV(w, cuFuncGetAttribute, &v, m->attribute, f->h);
    r.value = r.result == CUDA_SUCCESS ? v : 0;
    WK_REPLY(w, req, gp_func_get_attribute_reply, &r);
}

WK_HANDLER(func_set_attribute)
{
    gp_func_set_attribute_reply r = {0};
    struct wk_obj *f = wk_func_get(w, m->func);
    if (!f)
        r.result = CUDA_ERROR_INVALID_HANDLE;
    else if (m->attribute == -1 && f->kind == 1)
        r.result = DRV(w, cuKernelSetCacheConfig, f->h, m->value, w->dev);
    else if (m->attribute == -1)
        r.result = DRV(w, cuFuncSetCacheConfig, f->h, m->value);
    else if (f->kind == 1)
        r.result =
            DRV(w, cuKernelSetAttribute, m->attribute, m->value, f->h, w->devs[wk_cur_device(w)]);
    else
        r.result = DRV(w, cuFuncSetAttribute, f->h, m->attribute, m->value);
    WK_REPLY(w, req, gp_func_set_attribute_reply, &r);
}
