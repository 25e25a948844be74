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
