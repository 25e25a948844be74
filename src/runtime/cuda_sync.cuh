/*
 * Device-side helpers for kernels that talk to peers through memory:
 * 64-bit loads and stores with acquire/release at system scope (flags
 * read by other GPUs over NVLink or by the host), the global timer for
 * bounded waits, and a warp-wide 16-byte copy. Shared by the CUDA
 * engines that include it (the low-latency engine keeps its own copies in
 * engines/cuda_ll/cuda_ll_dev.cuh for now).
 */
#ifndef FR_CUDA_SYNC_CUH
#define FR_CUDA_SYNC_CUH

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

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

static __device__ __forceinline__ unsigned long long fr_sys_timer(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One warp copies `bytes` (a multiple of 16; both ends 16-byte aligned):
 * every lane keeps up to 4 16-byte loads in flight. */
static __device__ __forceinline__ void fr_warp_copy16(uint8_t *dst, const uint8_t *src,
                                                      size_t bytes)
{
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    size_t n = bytes / 16, i = (size_t)(threadIdx.x & 31);
    for (; i + 96 < n; i += 128) {
        int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
        d[i] = a;
        d[i + 32] = b;
        d[i + 64] = c;
        d[i + 96] = e;
    }
    for (; i < n; i += 32)
        d[i] = s[i];
}

/* The same, reading through L2 only (ld.global.cg): for memory other GPUs
 * write while the kernel runs (rings), which the L1 does not see. */
static __device__ __forceinline__ void fr_warp_copy16_cg(uint8_t *dst, const uint8_t *src,
                                                         size_t bytes)
{
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    size_t n = bytes / 16, i = (size_t)(threadIdx.x & 31);
    for (; i + 96 < n; i += 128) {
        int4 a = __ldcg(s + i), b = __ldcg(s + i + 32), c = __ldcg(s + i + 64),
             e = __ldcg(s + i + 96);
        d[i] = a;
        d[i + 32] = b;
        d[i + 64] = c;
        d[i + 96] = e;
    }
    for (; i < n; i += 32)
        d[i] = __ldcg(s + i);
}

/* A barrier of the `nthreads` threads (whole warps) that call it with
 * the same id (1..15; 0 is __syncthreads). */
static __device__ __forceinline__ void fr_bar_sync(int id, int nthreads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

#endif
