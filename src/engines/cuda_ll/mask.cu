/*
 * Masking ranks on the CUDA low-latency engine: the device copy of the
 * mask, written, pulled into the host view and read (the API layer
 * sequences them: src/api/mask.c).
 */

#include "engines/cuda_ll/cuda_ll_dev.cuh"
#include "ep/hmem.h"
#include "runtime/rt.h"

/* Entry `rank` of the device mask set to v and the count of masked ranks
 * made again: one thread, on the stream (capturable). */
static __global__ void fr_cu_mask_set(int32_t *mask, int N, int rank, int v)
{
    mask[rank] = v;
    int n = 0;
    for (int s = 0; s < N; s++)
        n += mask[s] != 0;
    mask[N] = n;
}

extern "C" int fr_cuda_mask_write(ferry_ep_t ep, int rank, int masked, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    int rc = fr_cuda_check(ep); /* an earlier kernel's error, before anything is queued */
    if (rc)
        return rc;
    fr_cu_mask_set<<<1, 1, 0, (cudaStream_t)stream>>>(c->a.mask, ep->N, rank, masked);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) /* not queued: the API takes its change back */
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "launching ferry_ep_mask_rank's kernel: %s",
                          cudaGetErrorString(e));
    c->masked += masked ? 1 : -1; /* the API calls this only on a change */
    return FERRY_OK;
}

extern "C" int fr_cuda_mask_pull(ferry_ep_t ep, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)stream;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return FERRY_OK; /* no copy inside a capture: the host's view stands */
    }
    int32_t *m = (int32_t *)calloc((size_t)ep->N + 1, sizeof(int32_t));
    if (!m)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "ferry_ep_mask_rank: the mask's copy");
    cudaError_t e = cudaMemcpyAsync(m, c->a.mask, sizeof(int32_t) * ((size_t)ep->N + 1),
                                    cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) {
        free(m);
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "ferry_ep_mask_rank: reading the GPU's mask: %s",
                          cudaGetErrorString(e));
    }
    for (int s = 0; s < ep->N; s++)
        if (m[s] && !ep->mask[s]) { /* masked by a wait that ran out */
            ep->mask[s] = 1;
            ep->mask_since[s] = ep->next_epoch;
        }
    c->masked = m[ep->N];
    free(m);
    return FERRY_OK;
}

extern "C" int fr_cuda_mask_read(ferry_ep_t ep, int32_t *status, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaError_t e = cudaMemcpyAsync(status, c->a.mask, sizeof(int32_t) * (size_t)ep->N,
                                    cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_query: status: not device "
                          "memory of this GPU? (cudaMemcpyAsync: %s)", cudaGetErrorString(e));
    return FERRY_OK;
}
