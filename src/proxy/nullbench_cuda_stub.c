/* Builds without nvcc: the null bench has no GPU rank. */
#ifndef FERRY_HAVE_CUDA
#include "ferry.h"
#include "proxy/nullbench_cuda.h"

int fr_nb_cuda_ring(void *sl, void *ready, int nf, uint64_t len, uint32_t imm, uint64_t e,
                    void *stream)
{
    (void)sl, (void)ready, (void)nf, (void)len, (void)imm, (void)e, (void)stream;
    return FERRY_ERR_UNSUPPORTED;
}
int fr_nb_cuda_stream(void **stream)
{
    *stream = 0;
    return FERRY_ERR_UNSUPPORTED;
}
void fr_nb_cuda_stream_free(void *stream) { (void)stream; }
#endif
