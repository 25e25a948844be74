/* Builds without nvcc: DP groups on CUDA ranks answer FERRY_ERR_UNSUPPORTED. */
#ifndef FERRY_HAVE_CUDA
#include "ep/dp_cuda.h"

static int fr_dp_cuda_none(fr_err_t *err)
{
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}

int fr_dp_cuda_tables(fr_dp_cuda_t *g, uint8_t *const *regions, fr_err_t *err)
{
    (void)g;
    (void)regions;
    return fr_dp_cuda_none(err);
}
void fr_dp_cuda_tables_free(fr_dp_cuda_t *g) { (void)g; }
int fr_dp_cuda_begin(const fr_dp_cuda_t *g, void *stream, fr_err_t *err)
{
    (void)g;
    (void)stream;
    return fr_dp_cuda_none(err);
}
int fr_dp_cuda_gather(const fr_dp_cuda_t *g, void *out, float *w, int T, void *stream,
                      fr_err_t *err)
{
    (void)g;
    (void)out;
    (void)w;
    (void)T;
    (void)stream;
    return fr_dp_cuda_none(err);
}
#endif
