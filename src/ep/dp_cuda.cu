/* DP groups on CUDA ranks (see dp_cuda.h and dp.c). */
#include <string.h>

#include <cuda_runtime.h>

#include "ep/dp_cuda.h"
#include "runtime/cuda_mem.h"
#include "runtime/cuda_sync.cuh"

#define FR_DP_BLOCKS 4   /* few: every member's gather spins while it waits, and
                            ranks sharing a GPU must leave SMs for the others */
#define FR_DP_THREADS 256

static __device__ __forceinline__ unsigned long long *fr_dp_word(uint8_t *r, int off)
{
    return (unsigned long long *)(r + off);
}

/* The own gather count + 1: the gather these kernels run. */
static __device__ __forceinline__ unsigned long long fr_dp_next(const fr_dp_cuda_t &g)
{
    return *(volatile unsigned long long *)fr_dp_word(g.peers[g.m], FR_DP_EPOCH) + 1;
}

/* Wait until member j's word at `off` is at least v: false after an
 * error (this one's or an earlier one) or the timeout (naming j). */
static __device__ bool fr_dp_wait(const fr_dp_cuda_t &g, int j, int off, unsigned long long v,
                                  int what)
{
    const unsigned long long *p = fr_dp_word(g.peers[j], off);
    unsigned long long t0 = fr_sys_timer();
    for (unsigned int it = 0;; it++) {
        if (fr_sys_ld_acquire(p) >= v)
            return true;
        if ((it & 255u) == 0) {
            if (fr_cu_err_seen(g))
                return false;
            if (fr_sys_timer() - t0 > (unsigned long long)g.timeout_ns) {
                fr_cu_err_set(g, FERRY_ERR_TIMEOUT, g.g0 + j, what, 0);
                return false;
            }
        }
    }
}

/* Every other member has read the previous gather out of its regions. */
__global__ void fr_dp_begin_k(fr_dp_cuda_t g)
{
    unsigned long long e = fr_dp_next(g);
    for (int j = threadIdx.x; j < g.G; j += blockDim.x)
        if (j != g.m)
            fr_dp_wait(g, j, FR_DP_READ, e - 1, 1);
}

/* The own rows are in (the engine's kernels ran before, on this stream). */
__global__ void fr_dp_publish_k(fr_dp_cuda_t g, int T, int has_w)
{
    uint8_t *mine = g.peers[g.m];
    unsigned long long e = fr_dp_next(g);
    *(volatile int *)(mine + FR_DP_T) = T;
    *(volatile int *)(mine + FR_DP_W) = has_w;
    __threadfence_system();
    fr_sys_st_release(fr_dp_word(mine, FR_DP_READY), e);
}

/* Every member's share into out (and w): the warps of all blocks take a
 * member's rows round robin once that member's rows are in. The last
 * block to finish says this member has read them and counts the gather. */
__global__ void __launch_bounds__(FR_DP_THREADS)
fr_dp_gather_k(fr_dp_cuda_t g, uint8_t *out, float *w, int T)
{
    uint8_t *mine = g.peers[g.m];
    unsigned long long e = fr_dp_next(g);
    int lane = threadIdx.x & 31, W = blockDim.x >> 5;
    int gw = blockIdx.x * W + (threadIdx.x >> 5), nw = gridDim.x * W;
    size_t rowb = 2 * (size_t)g.H;
    for (int j = 0; j < g.G; j++) {
        int lo = (int)((long long)T * j / g.G), hi = (int)((long long)T * (j + 1) / g.G);
        if (gw >= hi - lo)
            continue;
        int good = 1;
        if (lane == 0) {
            good = fr_dp_wait(g, j, FR_DP_READY, e, 2);
            const uint8_t *r = g.peers[j];
            int tj = *(volatile const int *)(r + FR_DP_T), wj = *(volatile const int *)(r + FR_DP_W);
            if (good && (tj != T || (w && !wj))) { /* not the same arguments */
                fr_cu_err_set(g, FERRY_ERR_INVALID, g.g0 + j, tj != T ? 3 : 4, tj);
                good = 0;
            }
        }
        if (!__shfl_sync(0xffffffffu, good, 0))
            continue;
        const uint8_t *src = g.peers[j] + FR_DP_ROWS;
        const float *ws = (const float *)(src + (size_t)g.share * rowb);
        for (int k = gw; k < hi - lo; k += nw) {
            fr_warp_copy16u<4, true>(out + (size_t)(lo + k) * rowb, src + (size_t)k * rowb, rowb);
            if (w && lane < g.K)
                w[(size_t)(lo + k) * g.K + lane] = __ldcg(ws + (size_t)k * g.K + lane);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned long long *done = fr_dp_word(mine, FR_DP_DONE);
        if (atomicAdd(done, 1ull) == (unsigned long long)gridDim.x - 1) {
            *done = 0;
            *(volatile unsigned long long *)fr_dp_word(mine, FR_DP_EPOCH) = e;
            __threadfence_system();
            fr_sys_st_release(fr_dp_word(mine, FR_DP_READ), e);
        }
    }
}

static int fr_dp_cu_fail(fr_err_t *err, const char *what, cudaError_t e)
{
    (void)cudaGetLastError();
    return FR_ERR(err, e == cudaErrorMemoryAllocation ? FERRY_ERR_NOMEM : FERRY_ERR_SYSTEM,
                  "dp_size: %s: %s", what, cudaGetErrorString(e));
}

int fr_dp_cuda_tables(fr_dp_cuda_t *g, uint8_t *const *regions, fr_err_t *err)
{
    void *host = NULL, *dev = NULL;
    cudaError_t e = cudaMalloc((void **)&g->peers, sizeof(uint8_t *) * (size_t)g->G);
    if (e == cudaSuccess)
        e = cudaMemcpy(g->peers, regions, sizeof(uint8_t *) * (size_t)g->G,
                       cudaMemcpyHostToDevice);
    if (e == cudaSuccess && (e = cudaMalloc((void **)&g->dflag, sizeof(int))) == cudaSuccess)
        e = cudaMemset(g->dflag, 0, sizeof(int));
    if (e != cudaSuccess)
        return fr_dp_cu_fail(err, "the group's tables", e);
    /* loaded now: a kernel's first launch loads its module, which waits for
     * the kernels running then, one of which may wait for this rank */
    cudaFuncAttributes a;
    if ((e = cudaFuncGetAttributes(&a, fr_dp_begin_k)) != cudaSuccess ||
        (e = cudaFuncGetAttributes(&a, fr_dp_publish_k)) != cudaSuccess ||
        (e = cudaFuncGetAttributes(&a, fr_dp_gather_k)) != cudaSuccess)
        return fr_dp_cu_fail(err, "loading the group's kernels", e);
    int rc = fr_cuda_host_alloc(4 * sizeof(int), &host, &dev, err);
    g->err_host = (int *)host;
    g->err = (volatile int *)dev;
    return rc;
}

void fr_dp_cuda_tables_free(fr_dp_cuda_t *g)
{
    if (g->peers)
        cudaFree(g->peers);
    if (g->dflag)
        cudaFree(g->dflag);
    fr_cuda_host_free(g->err_host);
    g->peers = NULL;
    g->dflag = NULL;
    g->err_host = NULL;
}

static int fr_dp_launched(fr_err_t *err, const char *what)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? FERRY_OK : fr_dp_cu_fail(err, what, e);
}

int fr_dp_cuda_begin(const fr_dp_cuda_t *g, void *stream, fr_err_t *err)
{
    fr_dp_begin_k<<<1, 32, 0, (cudaStream_t)stream>>>(*g);
    return fr_dp_launched(err, "the group's wait kernel");
}

int fr_dp_cuda_gather(const fr_dp_cuda_t *g, void *out, float *w, int T, void *stream,
                      fr_err_t *err)
{
    cudaStream_t s = (cudaStream_t)stream;
    fr_dp_publish_k<<<1, 1, 0, s>>>(*g, T, w != NULL);
    fr_dp_gather_k<<<FR_DP_BLOCKS, FR_DP_THREADS, 0, s>>>(*g, (uint8_t *)out, w, T);
    return fr_dp_launched(err, "the group's gather kernels");
}
