/* Builds without nvcc: the CUDA device is reported as unsupported. */
#ifndef FERRY_HAVE_CUDA
#include <stdio.h>

#include "engines/cuda_ll/cuda_ll.h"

int ferry_cuda_available(char *why, size_t len)
{
    if (why && len)
        snprintf(why, len, "this build of ferry has no CUDA kernels (nvcc was "
                           "not found when it was built)");
    return 0;
}
int fr_cuda_setup(ferry_ep_t ep, fr_err_t *err)
{
    (void)ep;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_cuda_free(ferry_ep_t ep) { (void)ep; }
int fr_cuda_dispatch_send(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in)
{
    (void)r; (void)in;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_dispatch_recv(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_out_t *out)
{
    (void)r; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_combine_send(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in)
{
    (void)r; (void)in;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_combine_recv(ferry_ep_t ep, fr_round_t *r, const ferry_combine_out_t *out)
{
    (void)r; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_dispatch(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in,
                     const ferry_dispatch_out_t *out)
{
    (void)r; (void)in; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_combine(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                    const ferry_combine_out_t *out)
{
    (void)r; (void)in; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_mask_write(ferry_ep_t ep, int rank, int masked, void *stream)
{
    (void)rank; (void)masked; (void)stream;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_mask_read(ferry_ep_t ep, int32_t *status, void *stream)
{
    (void)status; (void)stream;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_mask_pull(ferry_ep_t ep, void *stream)
{
    (void)stream;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuda_check(ferry_ep_t ep) { (void)ep; return FERRY_OK; }
int fr_cuda_sync(ferry_ep_t ep, void *stream) { (void)ep; (void)stream; return FERRY_OK; }
#endif
