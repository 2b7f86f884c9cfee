/*
 * api_link.c: JIT linking (cuLink*), not supported: one line says so once, every call answers
 * CUDA_ERROR_NOT_SUPPORTED, and the line names what works instead: a complete cubin or fatbin,
 * which api_module.c loads. Kept apart from api_module.c, which holds only what is served.
 */
#include <stdatomic.h>

#include "gp_cuda_launch.h"
#include "shim.h"

static CUresult link_unsupported(void)
{
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&said))
        gp_log_error("JIT linking (cuLink*) is not supported by gpupool yet; load a complete "
                     "cubin or fatbin with cuModuleLoadData instead");
    return CUDA_ERROR_NOT_SUPPORTED;
}

GP_EXPORT CUresult cuLinkCreate(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                CUlinkState *stateOut)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options,
                                   void **optionValues, CUlinkState *stateOut)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkAddData(CUlinkState state, CUjitInputType type, void *data, size_t size,
                                 const char *name, unsigned int numOptions, CUjit_option *options,
                                 void **optionValues)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkAddData_v2(CUlinkState state, CUjitInputType type, void *data, size_t size,
                                    const char *name, unsigned int numOptions,
                                    CUjit_option *options, void **optionValues)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkAddFile(CUlinkState state, CUjitInputType type, const char *path,
                                 unsigned int numOptions, CUjit_option *options,
                                 void **optionValues)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkAddFile_v2(CUlinkState state, CUjitInputType type, const char *path,
                                    unsigned int numOptions, CUjit_option *options,
                                    void **optionValues)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkComplete(CUlinkState state, void **cubinOut, size_t *sizeOut)
{
    return link_unsupported();
}
GP_EXPORT CUresult cuLinkDestroy(CUlinkState state)
{
    return link_unsupported();
}
