/* Builds without nvcc: the CUDA device is reported as unsupported (create
 * already refuses device = cuda there: ferry_cuda_available is 0). */
#ifndef FERRY_HAVE_CUDA
#include "engines/cuda_ht/cuda_ht.h"

int fr_cuht_setup(ferry_ep_t ep, fr_err_t *err)
{
    (void)ep;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_cuht_free(ferry_ep_t ep) { (void)ep; }
int fr_cuht_fabric_native(ferry_ep_t ep, int *native, fr_err_t *err)
{
    (void)ep;
    (void)err;
    *native = 0;
    return FERRY_OK;
}
int fr_cuht_fabric_up(ferry_ep_t ep, fr_err_t *err)
{
    (void)ep;
    (void)err;
    return FERRY_OK;
}
int fr_cuht_sync(ferry_ep_t ep, void *stream) { (void)ep; (void)stream; return FERRY_OK; }
int fr_cuht_check(ferry_ep_t ep) { (void)ep; return FERRY_OK; }
int fr_cuht_route_create(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t route)
{
    (void)in; (void)route;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
void fr_cuht_route_free(ferry_route_t route) { (void)route; }
int fr_cuht_dispatch_layout(const ferry_layout_args_t *a, fr_err_t *err)
{
    (void)a;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_cuht_dispatch(ferry_ep_t ep, ferry_route_t route, const ferry_ht_dispatch_in_t *in,
                     const ferry_ht_dispatch_out_t *out)
{
    (void)route; (void)in; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
int fr_cuht_combine(ferry_ep_t ep, ferry_route_t route, const ferry_ht_combine_in_t *in,
                    const ferry_ht_combine_out_t *out)
{
    (void)route; (void)in; (void)out;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "no CUDA kernels in this build");
}
#endif
