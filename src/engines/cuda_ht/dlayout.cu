/*
 * ferry_dispatch_layout on the GPU: a thread per token, shared-memory
 * histograms per block (experts, then ranks) added to the outputs once per
 * block, the token's row of token_in_rank written whole. Up to 4096
 * tokens one block that stores its counters (one launch); beyond, a
 * memset and a kernel of several blocks that add theirs, on the caller's
 * stream.
 */
#include "core/dlayout.h"
#include "engines/cuda_ht/cuda_ht.h"

#include <cuda_runtime.h>

#define FR_DL_THREADS 256
#define FR_DL_MAX_BLOCKS 132
/* up to this many tokens, one block of FR_DL_ONE_THREADS (4 tokens a
 * thread) and no memset */
#define FR_DL_ONE_TOKENS 4096
#define FR_DL_ONE_THREADS 1024

/* use_smem: the E + N counters fit shared memory; else global atomics.
 * ONE: a single block of THREADS, which stores its counters whole (no
 * memset before it); else blocks add theirs to zeroed outputs. */
template <int THREADS, bool ONE>
static __global__ void __launch_bounds__(THREADS)
fr_cuht_dlayout(const int64_t *idx, int T, int K, int E, int N, int32_t *per_rank,
                int32_t *per_expert, uint8_t *in_rank, int rpn, int M, int32_t *per_node,
                bool use_smem)
{
    extern __shared__ int32_t fr_dl_sm[];
    int32_t *he = use_smem ? fr_dl_sm : per_expert;
    int32_t *hr = use_smem ? fr_dl_sm + E : per_rank;
    int32_t *hn = use_smem ? fr_dl_sm + E + N : per_node;
    if (use_smem) {
        for (int i = threadIdx.x; i < E + N + M; i += blockDim.x)
            fr_dl_sm[i] = 0;
        __syncthreads();
    }
    int El = E / N;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        int64_t row[FR_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            row[k] = k < K ? idx[(size_t)t * K + k] : -1;
        int d[FR_MAX_TOPK];
        int n = fr_dl_ranks(row, K, E, El, d);
        uint8_t *ir = in_rank + (size_t)t * N;
        for (int r = 0; r < N; r++)
            ir[r] = 0;
        for (int i = 0; i < n; i++) {
            ir[d[i]] = 1;
            atomicAdd(&hr[d[i]], 1);
        }
        if (M > 0) {
            int b[FR_MAX_TOPK];
            int nb = fr_dl_nodes(d, n, rpn, b);
            for (int i = 0; i < nb; i++)
                atomicAdd(&hn[b[i]], 1);
        }
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            if (k < K && row[k] >= 0 && row[k] < E)
                atomicAdd(&he[row[k]], 1);
    }
    if (!use_smem)
        return;
    __syncthreads();
    for (int i = threadIdx.x; i < E + N + M; i += blockDim.x) {
        int32_t *o = i < E ? &per_expert[i] : i < E + N ? &per_rank[i - E] : &per_node[i - E - N];
        if (ONE)
            *o = fr_dl_sm[i];
        else if (fr_dl_sm[i])
            atomicAdd(o, fr_dl_sm[i]);
    }
}

extern "C" int fr_cuht_dispatch_layout(const ferry_layout_args_t *a, fr_err_t *err)
{
    cudaStream_t st = (cudaStream_t)a->stream;
    int T = a->num_tokens, E = a->num_experts, N = a->num_ranks, rpn = a->ranks_per_node;
    int M = rpn > 0 ? (N + rpn - 1) / rpn : 0;
    /* the counters start from zero (kernels only add): one memset where
     * they lie back to back (per rank, per expert, per node), as the
     * Python binding allocates them, else one each */
    int32_t *r = a->tokens_per_rank, *e = a->tokens_per_expert, *nd = a->tokens_per_node;
    size_t smem = sizeof(int32_t) * ((size_t)E + (size_t)N + (size_t)M);
    bool use_smem = smem <= 48 * 1024;
    cudaError_t ce;
    if (use_smem && T <= FR_DL_ONE_TOKENS) {
        /* one block stores every counter (zeros too): no memset, one
         * launch; up to FR_DL_ONE_TOKENS a block is as fast as many */
        fr_cuht_dlayout<FR_DL_ONE_THREADS, true><<<1, FR_DL_ONE_THREADS, smem, st>>>(
            a->topk_idx, T, a->topk, E, N, r, e, a->token_in_rank, rpn, M, nd, true);
        ce = cudaGetLastError();
        if (ce != cudaSuccess)
            return FR_ERR(err, FERRY_ERR_SYSTEM, "ferry_dispatch_layout: kernel launch: %s",
                          cudaGetErrorString(ce));
        return FERRY_OK;
    }
    bool one = e == r + N && (M == 0 || nd == e + E);
    ce = cudaMemsetAsync(r, 0, sizeof(int32_t) * (size_t)(one ? N + E + M : N), st);
    if (ce == cudaSuccess && !one)
        ce = cudaMemsetAsync(e, 0, sizeof(int32_t) * (size_t)E, st);
    if (ce == cudaSuccess && !one && M > 0)
        ce = cudaMemsetAsync(nd, 0, sizeof(int32_t) * (size_t)M, st);
    if (ce != cudaSuccess)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "ferry_dispatch_layout: cudaMemsetAsync: %s",
                      cudaGetErrorString(ce));
    if (T == 0)
        return FERRY_OK;
    int blocks = (T + FR_DL_THREADS - 1) / FR_DL_THREADS;
    blocks = blocks < FR_DL_MAX_BLOCKS ? blocks : FR_DL_MAX_BLOCKS;
    fr_cuht_dlayout<FR_DL_THREADS, false><<<blocks, FR_DL_THREADS, use_smem ? smem : 0, st>>>(
        a->topk_idx, T, a->topk, E, N, a->tokens_per_rank, a->tokens_per_expert,
        a->token_in_rank, rpn, M, a->tokens_per_node, use_smem);
    ce = cudaGetLastError();
    if (ce != cudaSuccess)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "ferry_dispatch_layout: kernel launch: %s",
                      cudaGetErrorString(ce));
    return FERRY_OK;
}

extern "C" int fr_cuht_load_dlayout(void)
{
    cudaFuncAttributes fa;
    return cudaFuncGetAttributes(&fa, fr_cuht_dlayout<FR_DL_THREADS, false>) != cudaSuccess ||
           cudaFuncGetAttributes(&fa, fr_cuht_dlayout<FR_DL_ONE_THREADS, true>) != cudaSuccess;
}
