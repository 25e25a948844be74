/*
 * Device-side helpers for kernels that talk to peers through memory:
 * 64-bit loads and stores with acquire/release at system scope (flags
 * read by other GPUs over NVLink or by the host), the global timer for
 * bounded waits, warp-wide 16-byte copies with many loads in flight, and
 * named barriers, and the error word. Shared by the CUDA engines.
 */
#ifndef FR_CUDA_SYNC_CUH
#define FR_CUDA_SYNC_CUH

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

static __device__ __forceinline__ unsigned long long fr_sys_ld_acquire(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ unsigned long long fr_sys_ld_relaxed(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void fr_sys_st_release(unsigned long long *p,
                                                         unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* A relaxed store at system scope: a release where a fence precedes it
 * in the same thread (__threadfence_system), one fence for several. */
static __device__ __forceinline__ void fr_sys_st_relaxed(unsigned long long *p,
                                                         unsigned long long v)
{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* The lane's inclusive prefix of x over its warp (every lane calls it;
 * unsigned: a sum past the range wraps). */
static __device__ __forceinline__ unsigned int fr_warp_incl_scan(unsigned int x)
{
    int lane = (int)(threadIdx.x & 31);
    for (int o = 1; o < 32; o <<= 1) {
        unsigned int y = __shfl_up_sync(0xffffffffu, x, o);
        x += lane >= o ? y : 0u;
    }
    return x;
}

/* One warp (every lane calls it): out[i] = in[0] + ... + in[i - 1] for
 * i < n, 32 at a time (out may be in); returns the total in every lane. */
static __device__ __forceinline__ int fr_warp_excl_scan(const int32_t *in, int32_t *out, int n)
{
    int lane = (int)(threadIdx.x & 31), carry = 0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        int i = i0 + lane, v = i < n ? in[i] : 0;
        int x = (int)fr_warp_incl_scan((unsigned int)v);
        if (i < n)
            out[i] = carry + x - v;
        carry += __shfl_sync(0xffffffffu, x, 31);
    }
    return carry;
}

static __device__ __forceinline__ unsigned long long fr_sys_timer(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One warp copies `bytes` (a multiple of 16; both ends 16-byte aligned)
 * with U independent 16-byte loads per lane in flight before their stores
 * (a 14 KB row is 896 vectors: 28 per lane, so U = 8 takes 4 round trips
 * instead of 28). CG: read through L2 only (ld.global.cg), for memory
 * other GPUs write while the kernel runs (rings), which the L1 does not
 * see; otherwise the source must not change during the kernel (read
 * through the read-only path, __ldg). */
template <int U, bool CG>
static __device__ __forceinline__ void fr_warp_copy16u(uint8_t *dst, const uint8_t *src,
                                                       size_t bytes)
{
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    int n = (int)(bytes / 16), i = (int)(threadIdx.x & 31);
    for (; i < n; i += 32 * U) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i + 32 * u < n)
                v[u] = CG ? __ldcg(s + i + 32 * u) : __ldg(s + i + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i + 32 * u < n)
                d[i + 32 * u] = v[u];
    }
}

/* Copies through the bulk copy engine (the TMA, sm_90): lane 0 of a warp
 * moves a row global -> shared -> global in stages of FR_TMA_STAGE bytes,
 * FR_TMA_NS of them per warp, NS - 1 loads in flight while a stage is
 * written out; the registers and the other lanes are free meanwhile.
 * Each warp's stages, its NS mbarriers and its phase word live in the
 * kernel's dynamic shared memory (fr_tma_smem bytes for its warps):
 *   [warps][NS][STAGE] stages | [warps][NS] u64 mbarriers | [warps] u32 phases
 * The rows' writes are asynchronous: fr_tma_flush (lane 0) waits for
 * them and orders them before the generic stores that follow (a counter
 * published to a peer). Both ends 16-byte aligned, bytes a multiple of 16
 * (as fr_warp_copy16u). */
#define FR_TMA_STAGE 4096
#define FR_TMA_NS 3

static inline size_t fr_tma_smem(int warps)
{
    return (size_t)warps * (FR_TMA_NS * (FR_TMA_STAGE + 8) + 4);
}

extern __shared__ __align__(128) uint8_t fr_tma_dyn[];

static __device__ __forceinline__ unsigned long long *fr_tma_bar(int warps, int w)
{
    return (unsigned long long *)(fr_tma_dyn + (size_t)warps * FR_TMA_NS * FR_TMA_STAGE) +
           w * FR_TMA_NS;
}

static __device__ __forceinline__ unsigned int *fr_tma_phase(int warps, int w)
{
    return (unsigned int *)(fr_tma_bar(warps, warps)) + w;
}

/* Every thread of the block, before a __syncthreads: the mbarriers set
 * up (one arrival: lane 0's expect_tx) and the phases cleared. */
static __device__ __forceinline__ void fr_tma_init(int warps)
{
    for (int i = threadIdx.x; i < warps * FR_TMA_NS; i += blockDim.x) {
        uint32_t a = (uint32_t)__cvta_generic_to_shared(fr_tma_bar(warps, 0) + i);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
    }
    for (int i = threadIdx.x; i < warps; i += blockDim.x)
        *fr_tma_phase(warps, i) = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Chunk k's offset into a row of `bytes` and its length (the last one short). */
static __device__ __forceinline__ uint32_t fr_tma_len(size_t bytes, int k)
{
    size_t o = (size_t)k * FR_TMA_STAGE;
    return (uint32_t)(bytes - o < FR_TMA_STAGE ? bytes - o : FR_TMA_STAGE);
}

static __device__ __forceinline__ void fr_tma_load(uint8_t *stage, unsigned long long *bar,
                                                   const uint8_t *src, uint32_t bytes)
{
    uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    uint32_t d = (uint32_t)__cvta_generic_to_shared(stage);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" ::"r"(d), "l"(src), "r"(bytes), "r"(b)
                 : "memory");
}

static __device__ __forceinline__ void fr_tma_wait(unsigned long long *bar, unsigned int parity)
{
    uint32_t b = (uint32_t)__cvta_generic_to_shared(bar);
    asm volatile("{\n\t.reg .pred p;\n"
                 "FR_TMA_WAIT:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
                 "@!p bra FR_TMA_WAIT;\n}" ::"r"(b), "r"(parity)
                 : "memory");
}

static __device__ __forceinline__ void fr_tma_store(uint8_t *dst, const uint8_t *stage,
                                                    uint32_t bytes)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(stage);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(s), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* The whole warp calls it (lane 0 works): `bytes` from src to dst. src
 * may be memory a peer wrote and a barrier made visible (the proxy fence
 * orders that before the copy engine's reads). */
static __device__ __forceinline__ void fr_tma_copy(int warps, uint8_t *dst, const uint8_t *src,
                                                   size_t bytes)
{
    int w = (int)(threadIdx.x >> 5);
    if ((threadIdx.x & 31) == 0) {
        uint8_t *buf = fr_tma_dyn + (size_t)w * FR_TMA_NS * FR_TMA_STAGE;
        unsigned long long *bar = fr_tma_bar(warps, w);
        unsigned int *php = fr_tma_phase(warps, w), ph = *php;
        int n = (int)((bytes + FR_TMA_STAGE - 1) / FR_TMA_STAGE);
        asm volatile("fence.proxy.async.global;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); /* stages free */
        for (int k = 0; k < FR_TMA_NS - 1 && k < n; k++)
            fr_tma_load(buf + (size_t)k * FR_TMA_STAGE, bar + k,
                        src + (size_t)k * FR_TMA_STAGE, fr_tma_len(bytes, k));
        for (int k = 0; k < n; k++) {
            int st = k % FR_TMA_NS;
            fr_tma_wait(bar + st, ph >> st & 1u);
            ph ^= 1u << st;
            fr_tma_store(dst + (size_t)k * FR_TMA_STAGE, buf + (size_t)st * FR_TMA_STAGE,
                         fr_tma_len(bytes, k));
            int kk = k + FR_TMA_NS - 1; /* into the stage stored from at k - 1 */
            if (kk < n) {
                int sk = kk % FR_TMA_NS;
                asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
                fr_tma_load(buf + (size_t)sk * FR_TMA_STAGE, bar + sk,
                            src + (size_t)kk * FR_TMA_STAGE, fr_tma_len(bytes, kk));
            }
        }
        *php = ph;
    }
    __syncwarp();
}

/* The whole warp: its copies' writes done and ordered before the generic
 * stores that follow (a barrier, then a counter's release), and its
 * stages free (before the block ends). */
static __device__ __forceinline__ void fr_tma_flush(void)
{
    if ((threadIdx.x & 31) == 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
}

/* A warp's copy: through the copy engine (TM, a block with fr_tma_init
 * done for `warps` warps) or with U loads in flight per lane. */
template <int U, bool CG, bool TM>
static __device__ __forceinline__ void fr_warp_copy(int warps, uint8_t *dst, const uint8_t *src,
                                                    size_t bytes)
{
    if (TM)
        fr_tma_copy(warps, dst, src, bytes);
    else
        fr_warp_copy16u<U, CG>(dst, src, bytes);
}

/* Host: a CUDA runtime call in a function with an `int rc` and a cleanup
 * label. On failure CUDA's last error is cleared (a later
 * cudaGetLastError, a launch check, must not report it again), rc is
 * FERRY_ERR_SYSTEM with a message naming the call, and control goes to
 * the label. Both GPU engines' set-up code uses it. */
#define FR_CU(call, err, label)                                                \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            (void)cudaGetLastError();                                          \
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "%s: %s", #call,                \
                        cudaGetErrorString(e_));                               \
            goto label;                                                        \
        }                                                                      \
    } while (0)

/* Errors, for an engine's kernel arguments A holding `int *dflag` (device)
 * and `volatile int *err` ([4], host-mapped): the first error wins a CAS
 * on dflag, then is copied to err (details first, status last). Kernels
 * poll only dflag: reads of host memory cross PCIe, and thousands of them
 * cost hundreds of microseconds. */
template <class Args>
static __device__ void fr_cu_err_set(const Args &A, int status, int rank, int what, int detail)
{
    if (atomicCAS(A.dflag, 0, status) == 0) {
        A.err[1] = rank;
        A.err[2] = what;
        A.err[3] = detail;
        __threadfence_system();
        A.err[0] = status;
        __threadfence_system();
    }
}

template <class Args>
static __device__ __forceinline__ bool fr_cu_err_seen(const Args &A)
{
    return *(volatile int *)A.dflag != 0;
}

/* A barrier of the `nthreads` threads (whole warps) that call it with
 * the same id (1..15; 0 is __syncthreads); the non-aligned form, so a
 * warp that just left a branch of one lane need not have reconverged. */
static __device__ __forceinline__ void fr_bar_sync(int id, int nthreads)
{
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

#endif
