/* The null bench's GPU rank (nullbench.c): a kernel rings the doorbells. */
#include <cuda_runtime.h>

#include "ferry.h"
#include "core/layout.h"
#include "proxy/nullbench_cuda.h"
#include "runtime/cuda_sync.cuh"
#include "transport/transport.h"

/* As the low-latency engine publishes a peer on the fabric path
 * (fr_cu_publish): the slice, a system fence, the doorbell with release;
 * a thread per peer. */
static __global__ void fr_nb_ring_k(fr_slice_t *sl, unsigned long long *ready, int nf,
                                    unsigned long long len, unsigned imm,
                                    unsigned long long e)
{
    for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < nf; g += gridDim.x * blockDim.x) {
        sl[g].src_off = 0;
        sl[g].dst_off = 0;
        sl[g].len = len;
        sl[g].imm = imm;
        __threadfence_system();
        fr_sys_st_release(ready + g, e);
    }
}

int fr_nb_cuda_ring(void *sl, void *ready, int nf, uint64_t len, uint32_t imm, uint64_t e,
                    void *stream)
{
    fr_nb_ring_k<<<1, 256, 0, (cudaStream_t)stream>>>((fr_slice_t *)sl,
                                                      (unsigned long long *)ready, nf, len, imm,
                                                      e);
    cudaError_t r = cudaGetLastError();
    return r == cudaSuccess ? FERRY_OK : FERRY_ERR_SYSTEM;
}

int fr_nb_cuda_stream(void **stream)
{
    cudaStream_t s = NULL;
    cudaError_t r = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = s;
    if (r != cudaSuccess)
        (void)cudaGetLastError();
    return r == cudaSuccess ? FERRY_OK : FERRY_ERR_SYSTEM;
}

void fr_nb_cuda_stream_free(void *stream)
{
    if (stream) {
        cudaStreamSynchronize((cudaStream_t)stream);
        cudaStreamDestroy((cudaStream_t)stream);
    }
}
