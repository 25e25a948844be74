/*
 * CUDA kernels of dispatch and combine: twins of src/engines/cpu_ll/, sharing
 * the record layout (core/layout.h) and number formats (core/quant.h).
 *
 *   dispatch_send = route (1 block: count, deduplicate, scan per rank)
 *                 + pack (quantise, store records into the peer's slice or
 *                   the fabric send region; the last block to finish writes
 *                   the slice headers and publishes)
 *   dispatch_recv = count (one block per sender: wait for its flag, place
 *                   records per local expert with warp ballots)
 *                 + place (copy tokens to expert_x)
 *   combine_send  = rows of each source rank, one contiguous run, then
 *                   publish (last block)
 *   combine_recv  = wait for all flags, fp32 weighted sum, bf16 out
 *
 * Ordering: data stores, then __threadfence_system() in every block, then
 * an atomic count of finished blocks; the last block writes headers, fences
 * and publishes the epoch with st.release.sys. Receivers poll with
 * ld.acquire.sys. Waits are bounded by %globaltimer: on expiry the kernel
 * writes an error word in host-mapped memory and returns (never traps);
 * every later kernel sees the word and returns at once.
 *
 * Epochs live on the device (per buffer set, advanced by route), so the
 * calls can be captured in a CUDA graph and replayed.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "core/config.h"
#include "core/log.h"
#include "core/quant.h"
#include "engines/cuda_ll/cuda_ll.h"
#include "runtime/cuda_mem.h"

#define FR_CU_THREADS 256
#define FR_CU_ROUTE_THREADS 1024

/* error word (host-mapped): [0] status, [1] rank, [2] what, [3] detail */
enum { FR_CU_WHAT_DISPATCH = 1, FR_CU_WHAT_COMBINE = 2, FR_CU_WHAT_INPUT = 3,
       FR_CU_WHAT_RECORD = 4, FR_CU_WHAT_NTOK = 5 };

typedef struct fr_cu_args {
    fr_layout_t L;
    int rank, N;
    uint8_t *seg;            /* own segment (device pointer) */
    uint8_t **peer;          /* [N] where to store for peer d (self/IPC) */
    uint8_t *send;           /* fabric send region (device pointer) or NULL */
    const int *path;         /* [N] */
    const int *gidx;         /* [N] index among fabric peers */
    int nfabric;
    fr_slice_t *slices;      /* host-mapped [2][2][nfabric] */
    fr_proxy_ring_t *ring;   /* host-mapped */
    unsigned long long *epoch; /* [2] per set */
    int32_t *ntok;           /* [2] */
    int32_t *rec_idx;        /* [2][T][N] */
    int32_t *pair_base;      /* [2][T][N] */
    int32_t *comb_pos;       /* [2][T][K] */
    int32_t *cnt, *npairs, *comb_off; /* [2][N] */
    int32_t *cnt_se;         /* [2][N][El] */
    int32_t *local_slot;     /* [2][N][T*kmax] */
    int32_t *pair_row;       /* [2][N*T*kmax] */
    int32_t *pair_off;       /* [2][N+1] */
    int32_t *scomb_off;      /* [2][N] */
    unsigned int *done;      /* [2 phase][2 set] finished-block counters */
    int *dflag;              /* device copy of err[0]: what kernels poll */
    volatile int *err;       /* host-mapped [4]: what the host reads */
    unsigned long long timeout_ns;
} fr_cu_args_t;

struct fr_cuda_ep {
    fr_cu_args_t a;
    int device, nblocks;
    int host_seg;            /* segment is pinned host memory (fabric) */
    void *dev_seg, *dev_send, *dev_ring, *dev_slices; /* their GPU views */
    void *dmem;              /* one device allocation for the tables */
    uint8_t **peer_host;     /* [N] IPC-opened pointers to close */
    int *err_host;
    void *err_dev;
    const void *y[FR_NSETS];     /* own expert_y, read in place by recv */
};

/* ---------------------------------------------------------------------- */
/* device helpers                                                         */

__device__ __forceinline__ unsigned long long fr_ld_acquire(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void fr_st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long fr_globaltimer(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Errors: the first one wins a CAS on the device flag, then is copied to
 * host-mapped memory (details first, status last). Kernels poll only the
 * device flag: reads of host memory cross PCIe, and thousands of them cost
 * hundreds of microseconds. */
__device__ void fr_cu_fail(const fr_cu_args_t &A, int status, int rank, int what,
                           int detail)
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

__device__ __forceinline__ bool fr_cu_failed(const fr_cu_args_t &A)
{
    return *(volatile int *)A.dflag != 0;
}

/* Wait until flag == epoch; false (error word set) on timeout. */
__device__ bool fr_cu_wait_flag(const fr_cu_args_t &A, const unsigned long long *flag,
                                unsigned long long epoch, int sender, int what)
{
    unsigned long long t0 = fr_globaltimer();
    unsigned int n = 0;
    for (;;) {
        unsigned long long v = fr_ld_acquire(flag);
        if (v == epoch)
            return true;
        if (v > epoch) {
            fr_cu_fail(A, FERRY_ERR_PROTOCOL, sender, what, (int)v);
            return false;
        }
        if ((++n & 255) == 0) {
            if (fr_cu_failed(A))
                return false;
            if (fr_globaltimer() - t0 > A.timeout_ns) {
                fr_cu_fail(A, FERRY_ERR_TIMEOUT, sender, what, 0);
                return false;
            }
        }
    }
}

/* Exclusive block scan of one int per thread (blockDim <= 1024). */
__device__ int fr_block_scan(int v, int *total)
{
    __shared__ int warp_sum[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        warp_sum[w] = x;
    __syncthreads();
    if (w == 0) {
        int nw = (blockDim.x + 31) >> 5;
        int s = lane < nw ? warp_sum[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o)
                s += y;
        }
        if (lane < nw)
            warp_sum[lane] = s; /* inclusive */
    }
    __syncthreads();
    int before = (w > 0 ? warp_sum[w - 1] : 0) + x - v;
    *total = warp_sum[((blockDim.x + 31) >> 5) - 1];
    __syncthreads();
    return before;
}

/* Four bf16 values (two packed words, low half first) times inv, as four
 * e4m3 codes in one word (lowest byte first). */
__device__ __forceinline__ uint32_t fr_cu_e4m3x4(uint32_t lo, uint32_t hi, float inv)
{
    return (uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(lo & 0xffff)) * inv) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(lo >> 16)) * inv) << 8) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(hi & 0xffff)) * inv) << 16) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(hi >> 16)) * inv) << 24);
}

/* A warp quantises 128-channel block b of a bf16 row: lane gets channels
 * [4 lane, 4 lane + 4) packed as four e4m3 codes, and the block's scale. */
__device__ __forceinline__ uint32_t fr_cu_quant4(const uint16_t *xrow, int b, int lane,
                                                 float *scale)
{
    uint2 v = ((const uint2 *)xrow)[b * 32 + lane];
    uint16_t e0 = (uint16_t)(v.x & 0xffff), e1 = (uint16_t)(v.x >> 16);
    uint16_t e2 = (uint16_t)(v.y & 0xffff), e3 = (uint16_t)(v.y >> 16);
    /* finite magnitudes only: Inf and NaN stay local (quant.h) */
    uint16_t m = fr_bf16_finite_mag(e0), m1 = fr_bf16_finite_mag(e1);
    uint16_t m2 = fr_bf16_finite_mag(e2), m3 = fr_bf16_finite_mag(e3);
    m = m1 > m ? m1 : m;
    m = m2 > m ? m2 : m;
    m = m3 > m ? m3 : m;
    for (int o = 16; o; o >>= 1) {
        uint16_t y = (uint16_t)__shfl_xor_sync(0xffffffffu, m, o);
        m = y > m ? y : m;
    }
    float amax = fr_bf16_to_f32(m), inv = fr_fp8_inv_scale(amax);
    *scale = fr_fp8_scale(amax);
    return fr_cu_e4m3x4(v.x, v.y, inv);
}

/* One warp copies a row: every lane keeps 4 16-byte loads in flight. */
__device__ __forceinline__ void fr_warp_copy(uint8_t *dst, const uint8_t *src, size_t bytes)
{
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    int lane = threadIdx.x & 31;
    size_t n = bytes / 16, i = (size_t)lane;
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

/* Publish (phase, set) to peer d: flag for self/IPC, a slice for the proxy
 * otherwise (the ring push happens once, after all peers). */
__device__ void fr_cu_publish(const fr_cu_args_t &A, int phase, int set, int d,
                              unsigned long long epoch, uint64_t src_off,
                              uint64_t dst_off, uint64_t len)
{
    if (A.path[d] == FR_PATH_FABRIC) {
        fr_slice_t *s = A.slices + ((size_t)phase * FR_NSETS + set) * A.nfabric + A.gidx[d];
        s->src_off = src_off;
        s->dst_off = dst_off;
        s->len = len;
        s->imm = fr_imm_make(phase, epoch, A.rank);
    } else {
        fr_st_release((unsigned long long *)(A.peer[d] + fr_off_flag(&A.L, phase, set, A.rank)),
                      epoch);
    }
}

__device__ void fr_cu_ring(const fr_cu_args_t &A, int phase, int set,
                           unsigned long long epoch)
{
    fr_proxy_ring_t *rg = A.ring;
    volatile unsigned long long *head = (volatile unsigned long long *)&rg->head;
    unsigned long long tail = *(volatile unsigned long long *)&rg->tail;
    unsigned long long t0 = fr_globaltimer();
    while (tail - *head >= FR_PROXY_RING) {
        if (fr_globaltimer() - t0 > A.timeout_ns) {
            fr_cu_fail(A, FERRY_ERR_TIMEOUT, A.rank, phase + 1, -1);
            return;
        }
    }
    fr_proxy_req_t *q = &rg->req[tail % FR_PROXY_RING];
    q->phase = phase;
    q->set = set;
    q->epoch = epoch;
    __threadfence_system();
    fr_st_release((unsigned long long *)&rg->tail, tail + 1);
}

/* ---------------------------------------------------------------------- */
/* dispatch_send                                                          */

__global__ void __launch_bounds__(FR_CU_ROUTE_THREADS)
fr_cu_route(fr_cu_args_t A, int set, const int64_t *idx, int T_host,
            const int32_t *T_dev)
{
    const fr_layout_t &L = A.L;
    __shared__ int s_T, s_bad;
    int N = A.N, K = L.K, El = L.El;
    if (threadIdx.x == 0) {
        int T = T_dev ? *T_dev : T_host;
        s_bad = 0;
        if (T < 0 || T > L.T) {
            fr_cu_fail(A, FERRY_ERR_INVALID, A.rank, FR_CU_WHAT_NTOK, T);
            s_bad = 1;
        }
        s_T = T;
        A.ntok[set] = T;
        A.epoch[set] += 2; /* set 1: 1, 3, 5...; set 0: 2, 4, 6... */
    }
    __syncthreads();
    if (s_bad)
        return;
    int T = s_T;
    int32_t *rec_idx = A.rec_idx + (size_t)set * L.T * N;
    int32_t *pbase = A.pair_base + (size_t)set * L.T * N;
    int32_t *cpos = A.comb_pos + (size_t)set * L.T * K;
    /* validate: -1 or 0..E-1, no repeats */
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        const int64_t *row = idx + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k];
            bool bad = e < -1 || e >= L.E;
            for (int j = 0; j < k && !bad && e >= 0; j++)
                bad = row[j] == e;
            if (bad) {
                fr_cu_fail(A, FERRY_ERR_INVALID, A.rank, FR_CU_WHAT_INPUT, t * K + k);
                s_bad = 1;
            }
        }
    }
    __syncthreads();
    if (s_bad)
        return;
    /* per destination: exclusive scans of "token goes there" and of its
     * pair count, in token order */
    int running_rec = 0, running_pairs = 0; /* thread 0 keeps the totals */
    for (int d = 0; d < N; d++) {
        int carry_rec = 0, carry_pairs = 0;
        for (int base = 0; base < T; base += blockDim.x) {
            int t = base + threadIdx.x;
            int has = 0, np = 0;
            if (t < T) {
                const int64_t *row = idx + (size_t)t * K;
                for (int k = 0; k < K; k++)
                    if (row[k] >= 0 && row[k] / El == d)
                        np++;
                has = np > 0;
            }
            int tot_h, tot_p;
            int ph = fr_block_scan(has, &tot_h);
            int pp = fr_block_scan(np, &tot_p);
            if (t < T) {
                rec_idx[(size_t)t * N + d] = has ? carry_rec + ph : -1;
                pbase[(size_t)t * N + d] = carry_pairs + pp;
            }
            carry_rec += tot_h;
            carry_pairs += tot_p;
        }
        if (threadIdx.x == 0) {
            A.cnt[set * N + d] = carry_rec;
            A.npairs[set * N + d] = carry_pairs;
            A.comb_off[set * N + d] = running_pairs;
            running_rec += carry_rec;
            running_pairs += carry_pairs;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        const int64_t *row = idx + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            int64_t e = row[k];
            if (e < 0) {
                cpos[(size_t)t * K + k] = -1;
                continue;
            }
            int d = (int)(e / El), before = 0;
            for (int j = 0; j < k; j++)
                before += row[j] >= 0 && row[j] / El == d;
            cpos[(size_t)t * K + k] = A.comb_off[set * N + d] +
                                      pbase[(size_t)t * N + d] + before;
        }
    }
}

__device__ __forceinline__ uint8_t *fr_cu_dslice(const fr_cu_args_t &A, int set, int d)
{
    if (A.path[d] == FR_PATH_FABRIC)
        return A.send + fr_off_dsend(&A.L, set, d);
    return A.peer[d] + fr_off_drecv(&A.L, set, A.rank);
}

/* The record of token t in destination d's slice; NULL when the token
 * does not go to d. */
__device__ __forceinline__ uint8_t *fr_cu_rec(const fr_cu_args_t &A, int set, int t, int d)
{
    int ri = A.rec_idx[((size_t)set * A.L.T + t) * A.N + d];
    return ri < 0 ? NULL : fr_cu_dslice(A, set, d) + fr_off_record(&A.L, (uint32_t)ri);
}

/* Record headers of token t: thread i of n handles destinations i, i+n... */
__device__ __forceinline__ void fr_cu_rec_headers(const fr_cu_args_t &A, int set, int t,
                                                  const int64_t *row, int i, int n)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El;
    const int32_t *pbase = A.pair_base + (size_t)set * L.T * N;
    for (int d = i; d < N; d += n) {
        fr_rec_hdr_t *h = (fr_rec_hdr_t *)fr_cu_rec(A, set, t, d);
        if (!h)
            continue;
        uint16_t m = 0;
        for (int k = 0; k < K; k++)
            if (row[k] >= 0 && row[k] / El == d)
                h->le[m++] = (uint16_t)(row[k] % El);
        h->token = (uint32_t)t;
        h->pair = (uint32_t)pbase[(size_t)t * N + d];
        h->nexp = m;
        h->reserved = 0;
    }
}

/* End of a pack kernel: the last block to finish writes the slice headers
 * and publishes (flag stores, or the proxy's doorbell). */
__device__ void fr_cu_pack_finish(const fr_cu_args_t &A, int set)
{
    const fr_layout_t &L = A.L;
    int N = A.N;
    unsigned int *done = A.done + FR_PH_DISPATCH * FR_NSETS + set;
    __shared__ bool last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence_system();
    unsigned long long epoch = A.epoch[set];
    bool ok = !fr_cu_failed(A);
    for (int d = threadIdx.x; d < N && ok; d += blockDim.x) {
        uint8_t *dst = fr_cu_dslice(A, set, d);
        fr_slice_hdr_t *h = (fr_slice_hdr_t *)dst;
        h->magic = FR_SLICE_MAGIC;
        h->sender = (uint32_t)A.rank;
        h->epoch = epoch;
        h->count = (uint32_t)A.cnt[set * N + d];
        h->npairs = (uint32_t)A.npairs[set * N + d];
        h->comb_off = (uint32_t)A.comb_off[set * N + d];
        __threadfence_system();
        fr_cu_publish(A, FR_PH_DISPATCH, set, d, epoch, fr_off_dsend(&L, set, d),
                      fr_off_drecv(&L, set, A.rank),
                      fr_off_record(&L, (uint32_t)A.cnt[set * N + d]));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (ok && A.nfabric > 0) {
            __threadfence_system();
            fr_cu_ring(A, FR_PH_DISPATCH, set, epoch);
        }
        *done = 0;
    }
}

__global__ void __launch_bounds__(FR_CU_THREADS)
fr_cu_pack(fr_cu_args_t A, int set, const uint16_t *x, const float *x_scales,
           const int64_t *idx)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, H = L.H;
    bool quant = L.fp8 && !x_scales;
    __shared__ int s_fail;
    if (threadIdx.x == 0)
        s_fail = fr_cu_failed(A);
    __syncthreads();
    if (!s_fail) {
        int T = A.ntok[set];
        int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        /* a warp per token */
        for (int t = blockIdx.x * nw + (threadIdx.x >> 5); t < T; t += gridDim.x * nw) {
            const int64_t *row = idx + (size_t)t * K;
            /* headers (lane d handles destination d, 32 at a time) */
            fr_cu_rec_headers(A, set, t, row, lane, 32);
            if (quant) {
                /* lane holds channels [4 lane, 4 lane + 4) of each 128-block */
                for (int b = 0; b < H / 128; b++) {
                    float sc;
                    uint32_t q = fr_cu_quant4(x + (size_t)t * H, b, lane, &sc);
                    for (int d = 0; d < N; d++) {
                        uint8_t *rec = fr_cu_rec(A, set, t, d);
                        if (!rec)
                            continue;
                        ((uint32_t *)(rec + L.rec_hdr))[b * 32 + lane] = q;
                        if (lane == 0)
                            ((float *)(rec + L.rec_hdr + L.tok_bytes))[b] = sc;
                    }
                }
            } else {
                const uint8_t *tok = (const uint8_t *)x + (size_t)t * L.tok_bytes;
                const float *scl = x_scales ? x_scales + (size_t)t * L.nscales : NULL;
                for (int d = 0; d < N; d++) {
                    uint8_t *rec = fr_cu_rec(A, set, t, d);
                    if (!rec)
                        continue;
                    fr_warp_copy(rec + L.rec_hdr, tok, L.tok_bytes);
                    for (int i = lane; i < (int)L.nscales; i += 32)
                        ((float *)(rec + L.rec_hdr + L.tok_bytes))[i] = scl[i];
                }
            }
        }
    }
    fr_cu_pack_finish(A, set);
}

/* The same records as fr_cu_pack, a block per token (tokens strided over
 * the grid): every thread quantises 16 channels with two 16-byte loads
 * (8 threads per 128-channel block share its amax through shuffles) and
 * stores its 16 codes with one 16-byte store per destination. Needs x and
 * every record's token 16-byte aligned (the host checks x). */
__global__ void __launch_bounds__(FR_CU_THREADS)
fr_cu_pack_block(fr_cu_args_t A, int set, const uint16_t *x, const float *x_scales,
                 const int64_t *idx)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, H = L.H;
    bool quant = L.fp8 && !x_scales;
    __shared__ int s_fail;
    if (threadIdx.x == 0)
        s_fail = fr_cu_failed(A);
    __syncthreads();
    if (!s_fail) {
        int T = A.ntok[set];
        for (int t = blockIdx.x; t < T; t += gridDim.x) {
            const int64_t *row = idx + (size_t)t * K;
            fr_cu_rec_headers(A, set, t, row, threadIdx.x, blockDim.x);
            if (quant) {
                const uint4 *xr = (const uint4 *)(x + (size_t)t * H);
                /* the whole block takes the same number of steps, so every
                 * lane reaches the shuffles; a lane past the row idles in
                 * a group of 8 that is idle as a whole (H/16 is a multiple
                 * of 8) */
                for (int base = 0; base < H / 16; base += blockDim.x) {
                    int c = base + threadIdx.x;
                    bool on = c < H / 16;
                    uint4 v0 = on ? xr[2 * c] : make_uint4(0, 0, 0, 0);
                    uint4 v1 = on ? xr[2 * c + 1] : make_uint4(0, 0, 0, 0);
                    uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
                    uint16_t m = 0;
                    for (int i = 0; i < 8; i++) {
                        uint16_t a = fr_bf16_finite_mag((uint16_t)(w[i] & 0xffff));
                        uint16_t b2 = fr_bf16_finite_mag((uint16_t)(w[i] >> 16));
                        m = a > m ? a : m;
                        m = b2 > m ? b2 : m;
                    }
                    /* the 8 threads of this 128-channel block (c / 8) are
                     * 8 consecutive lanes of one warp (blockDim is a
                     * multiple of 32) */
                    for (int o = 4; o; o >>= 1) {
                        uint16_t y = (uint16_t)__shfl_xor_sync(0xffffffffu, m, o, 8);
                        m = y > m ? y : m;
                    }
                    float amax = fr_bf16_to_f32(m), inv = fr_fp8_inv_scale(amax);
                    uint4 qv = make_uint4(fr_cu_e4m3x4(w[0], w[1], inv),
                                          fr_cu_e4m3x4(w[2], w[3], inv),
                                          fr_cu_e4m3x4(w[4], w[5], inv),
                                          fr_cu_e4m3x4(w[6], w[7], inv));
                    float sc = fr_fp8_scale(amax);
                    for (int d = 0; d < N && on; d++) {
                        uint8_t *rec = fr_cu_rec(A, set, t, d);
                        if (!rec)
                            continue;
                        ((uint4 *)(rec + L.rec_hdr))[c] = qv;
                        if ((c & 7) == 0)
                            ((float *)(rec + L.rec_hdr + L.tok_bytes))[c >> 3] = sc;
                    }
                }
            } else {
                const uint4 *tok = (const uint4 *)((const uint8_t *)x + (size_t)t * L.tok_bytes);
                const float *scl = x_scales ? x_scales + (size_t)t * L.nscales : NULL;
                int n16 = (int)(L.tok_bytes / 16);
                for (int c = threadIdx.x; c < n16; c += blockDim.x) {
                    uint4 v = tok[c];
                    for (int d = 0; d < N; d++) {
                        uint8_t *rec = fr_cu_rec(A, set, t, d);
                        if (rec)
                            ((uint4 *)(rec + L.rec_hdr))[c] = v;
                    }
                }
                for (int i = threadIdx.x; scl && i < (int)L.nscales; i += blockDim.x) {
                    float v = scl[i];
                    for (int d = 0; d < N; d++) {
                        uint8_t *rec = fr_cu_rec(A, set, t, d);
                        if (rec)
                            ((float *)(rec + L.rec_hdr + L.tok_bytes))[i] = v;
                    }
                }
            }
        }
    }
    fr_cu_pack_finish(A, set);
}

/* ---------------------------------------------------------------------- */
/* dispatch_recv                                                          */

/* One block per sender: wait, validate the header, and give every (record,
 * expert) its slot among this sender's rows for that expert (warp ballots,
 * record order). */
__global__ void __launch_bounds__(1024)
fr_cu_recv_count(fr_cu_args_t A, int set)
{
    const fr_layout_t &L = A.L;
    int s = blockIdx.x, El = L.El, kmax = L.kmax;
    __shared__ int ok;
    __shared__ unsigned long long epoch;
    if (threadIdx.x == 0) {
        ok = 0;
        epoch = A.epoch[set];
        if (!fr_cu_failed(A) &&
            fr_cu_wait_flag(A, (const unsigned long long *)(A.seg + fr_off_flag(&L, FR_PH_DISPATCH, set, s)),
                            epoch, s, FR_CU_WHAT_DISPATCH)) {
            const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)(A.seg + fr_off_drecv(&L, set, s));
            if (h->magic != FR_SLICE_MAGIC || h->sender != (uint32_t)s ||
                h->epoch != epoch || h->count > (uint32_t)L.T ||
                (uint64_t)h->comb_off + h->npairs > L.crows)
                fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, -1);
            else
                ok = 1;
        }
    }
    __syncthreads();
    if (!ok)
        return;
    const uint8_t *slice = A.seg + fr_off_drecv(&L, set, s);
    const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)slice;
    int count = (int)h->count;
    int32_t *cse = A.cnt_se + ((size_t)set * A.N + s) * El;
    int32_t *lslot = A.local_slot + ((size_t)set * A.N + s) * (size_t)L.T * kmax;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    /* validate records (one thread each, first block of the sender) */
    for (int i = threadIdx.x; i < count && blockIdx.y == 0; i += blockDim.x) {
        const fr_rec_hdr_t *r = (const fr_rec_hdr_t *)(slice + fr_off_record(&L, (uint32_t)i));
        bool bad = r->token >= (uint32_t)L.T || r->nexp < 1 || r->nexp > kmax ||
                   r->pair + r->nexp > h->npairs;
        for (int j = 0; j < r->nexp && !bad; j++) {
            bad = r->le[j] >= El;
            for (int j2 = 0; j2 < j && !bad; j2++)
                bad = r->le[j2] == r->le[j]; /* would overflow expert_x */
        }
        if (bad)
            fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, i);
    }
    __syncthreads();
    if (fr_cu_failed(A))
        return;
    /* A block per (sender, local expert): the records are cut into one
     * segment per warp; pass 1 counts the expert's pairs per segment
     * (ballots), a scan over warps gives each segment's first slot, pass 2
     * writes every pair's slot. Headers are read as 16-byte vectors. */
    __shared__ int wcount[32];
    int seg = (count + nw - 1) / nw, lo = w * seg, hi = min(count, lo + seg);
    for (int le = blockIdx.y; le < El; le += gridDim.y) {
        for (int pass = 0; pass < 2; pass++) {
            int running = pass ? wcount[w] : 0;
            for (int base = lo; base < hi; base += 32) {
                int i = base + lane, j_found = -1;
                uint32_t pair = 0;
                if (i < hi) {
                    const uint4 *v = (const uint4 *)(slice + fr_off_record(&L, (uint32_t)i));
                    uint4 h0 = v[0];
                    int nexp = (int)(h0.z & 0xffff);
                    pair = h0.y;
                    /* le[] starts at byte 12: h0.w holds le[0], le[1] */
                    uint16_t les[FR_MAX_TOPK];
                    les[0] = (uint16_t)(h0.w & 0xffff);
                    les[1] = (uint16_t)(h0.w >> 16);
                    if (nexp > 2) {
                        uint4 h1 = v[1];
                        uint32_t ws[4] = {h1.x, h1.y, h1.z, h1.w};
                        for (int q = 0; q < 8; q++)
                            les[2 + q] = (uint16_t)(ws[q / 2] >> (16 * (q & 1)));
                        if (nexp > 10) {
                            uint4 h2 = v[2];
                            uint32_t ws2[4] = {h2.x, h2.y, h2.z, h2.w};
                            for (int q = 0; q < 6; q++)
                                les[10 + q] = (uint16_t)(ws2[q / 2] >> (16 * (q & 1)));
                        }
                    }
                    for (int j = 0; j < nexp && j < FR_MAX_TOPK; j++)
                        if (les[j] == le)
                            j_found = j;
                }
                unsigned int m = __ballot_sync(0xffffffffu, j_found >= 0);
                if (pass && j_found >= 0)
                    lslot[pair + j_found] = running + __popc(m & ((1u << lane) - 1));
                running += __popc(m);
            }
            if (!pass) {
                if (lane == 0)
                    wcount[w] = running;
                __syncthreads();
                if (threadIdx.x == 0) {
                    int acc = 0;
                    for (int q = 0; q < nw; q++) {
                        int c = wcount[q];
                        wcount[q] = acc;
                        acc += c;
                    }
                    cse[le] = acc;
                }
                __syncthreads();
            }
        }
        __syncthreads();
    }
}

/* Blocks (s, y): sender s's records y, y + gridDim.y, ...: copy each token
 * to its rows of expert_x. */
__global__ void __launch_bounds__(FR_CU_THREADS)
fr_cu_recv_place(fr_cu_args_t A, int set, uint8_t *ex, float *exs,
                 int32_t *counts, int32_t *src_rank, int32_t *src_token)
{
    extern __shared__ int32_t sbase[]; /* [El] */
    const fr_layout_t &L = A.L;
    int s = blockIdx.x, El = L.El, N = A.N;
    __shared__ int s_fail;
    if (threadIdx.x == 0)
        s_fail = fr_cu_failed(A);
    __syncthreads();
    if (s_fail)
        return;
    const int32_t *cse = A.cnt_se + (size_t)set * N * El;
    for (int le = threadIdx.x; le < El; le += blockDim.x) {
        int b = 0;
        for (int s2 = 0; s2 < s; s2++)
            b += cse[(size_t)s2 * El + le];
        sbase[le] = b;
        if (s == N - 1 && blockIdx.y == 0)
            counts[le] = b + cse[(size_t)s * El + le];
    }
    __shared__ int poff;
    if (threadIdx.x == 0) {
        int p = 0;
        for (int s2 = 0; s2 < s; s2++)
            p += ((const fr_slice_hdr_t *)(A.seg + fr_off_drecv(&L, set, s2)))->npairs;
        poff = p;
        if (blockIdx.y == 0) {
            const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)(A.seg + fr_off_drecv(&L, set, s));
            A.pair_off[set * (N + 1) + s] = p;
            A.scomb_off[set * N + s] = (int32_t)h->comb_off;
            if (s == N - 1)
                A.pair_off[set * (N + 1) + N] = p + (int)h->npairs;
        }
    }
    __syncthreads();
    const uint8_t *slice = A.seg + fr_off_drecv(&L, set, s);
    int count = (int)((const fr_slice_hdr_t *)slice)->count;
    const int32_t *lslot = A.local_slot + ((size_t)set * N + s) * (size_t)L.T * L.kmax;
    int32_t *prow = A.pair_row + (size_t)set * L.send_crows;
    int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int i = blockIdx.y * nw + (threadIdx.x >> 5); i < count; i += gridDim.y * nw) {
        const uint8_t *rec = slice + fr_off_record(&L, (uint32_t)i);
        const fr_rec_hdr_t *r = (const fr_rec_hdr_t *)rec;
        /* own records too are copied from the segment: re-quantising x
         * here measured slower than the copy (4-byte stores per lane) */
        const uint8_t *src = rec + L.rec_hdr;
        const float *srcs = (const float *)(rec + L.rec_hdr + L.tok_bytes);
        for (int j = 0; j < r->nexp; j++) {
            int le = r->le[j];
            size_t row = (size_t)le * L.cap + sbase[le] + lslot[r->pair + j];
            fr_warp_copy(ex + row * L.tok_bytes, src, L.tok_bytes);
            for (int c = lane; c < (int)L.nscales; c += 32)
                exs[row * L.nscales + c] = srcs[c];
            if (lane == 0) {
                if (src_rank)
                    src_rank[row] = s;
                if (src_token)
                    src_token[row] = (int32_t)r->token;
                prow[poff + r->pair + j] = (int32_t)row;
            }
        }
    }
}

/* ---------------------------------------------------------------------- */
/* combine                                                                */

__global__ void __launch_bounds__(FR_CU_THREADS)
fr_cu_combine_send(fr_cu_args_t A, int set, const uint8_t *y)
{
    const fr_layout_t &L = A.L;
    int s = blockIdx.x, N = A.N;
    unsigned int *done = A.done + FR_PH_COMBINE * FR_NSETS + set;
    const int32_t *poff = A.pair_off + set * (N + 1);
    __shared__ int s_fail;
    if (threadIdx.x == 0)
        s_fail = fr_cu_failed(A);
    __syncthreads();
    if (!s_fail && s != A.rank) { /* own rows are read in place */
        int p0 = poff[s], np = poff[s + 1] - p0;
        const int32_t *rows = A.pair_row + (size_t)set * L.send_crows + p0;
        uint8_t *dst = A.path[s] == FR_PATH_FABRIC
                           ? A.send + fr_off_csend(&L, set, (uint64_t)p0)
                           : A.peer[s] + fr_off_crecv(&L, set, (uint64_t)A.scomb_off[set * N + s]);
        int nw = blockDim.x >> 5;
        for (int p = blockIdx.y * nw + (threadIdx.x >> 5); p < np; p += gridDim.y * nw)
            fr_warp_copy(dst + (size_t)p * L.crow, y + (size_t)rows[p] * L.crow, L.crow);
    }
    __shared__ bool last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence_system();
    unsigned long long epoch = A.epoch[set];
    bool ok = !fr_cu_failed(A);
    for (int d = threadIdx.x; d < N && ok; d += blockDim.x) {
        int p0 = poff[d], np = poff[d + 1] - p0;
        fr_cu_publish(A, FR_PH_COMBINE, set, d, epoch, fr_off_csend(&L, set, (uint64_t)p0),
                      fr_off_crecv(&L, set, (uint64_t)A.scomb_off[set * N + d]),
                      (uint64_t)np * L.crow);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (ok && A.nfabric > 0) {
            __threadfence_system();
            fr_cu_ring(A, FR_PH_COMBINE, set, epoch);
        }
        *done = 0;
    }
}

__global__ void __launch_bounds__(FR_CU_THREADS)
fr_cu_combine_recv(fr_cu_args_t A, int set, const float *w, uint16_t *out,
                   const uint8_t *self_y)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, H = L.H;
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ok = !fr_cu_failed(A);
        unsigned long long epoch = A.epoch[set];
        for (int s = 0; s < N && ok; s++)
            ok = fr_cu_wait_flag(A, (const unsigned long long *)(A.seg + fr_off_flag(&L, FR_PH_COMBINE, set, s)),
                                 epoch, s, FR_CU_WHAT_COMBINE);
    }
    __syncthreads();
    if (!ok)
        return;
    int T = A.ntok[set];
    const int32_t *cpos = A.comb_pos + (size_t)set * L.T * K;
    /* pairs this rank sent itself: rows [cs, cs + ns) of its combine region
     * were never copied; they are expert_y rows pair_row[ps + pos - cs] */
    int cs = A.comb_off[set * N + A.rank], ns = A.npairs[set * N + A.rank];
    int ps = A.pair_off[set * (N + 1) + A.rank];
    const int32_t *prow = A.pair_row + (size_t)set * L.send_crows;
    __shared__ const uint8_t *srow[FR_MAX_TOPK];
    __shared__ float sw[FR_MAX_TOPK];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        /* the token's K rows and weights, once per block */
        if (threadIdx.x < K) {
            int k = threadIdx.x, pos = cpos[(size_t)t * K + k];
            srow[k] = pos < 0 ? NULL
                      : pos >= cs && pos < cs + ns
                          ? self_y + (size_t)prow[ps + pos - cs] * L.crow
                          : A.seg + fr_off_crecv(&L, set, (uint64_t)pos);
            sw[k] = w[(size_t)t * K + k];
        }
        __syncthreads();
        for (int h0 = threadIdx.x * 8; h0 < H; h0 += blockDim.x * 8) {
            /* all K loads in flight, then the sum in k order */
            int4 v[FR_MAX_TOPK];
#pragma unroll
            for (int k = 0; k < FR_MAX_TOPK; k++)
                if (k < K && srow[k])
                    v[k] = *(const int4 *)(srow[k] + (size_t)h0 * 2);
            float acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = 0.f;
#pragma unroll
            for (int k = 0; k < FR_MAX_TOPK; k++) {
                if (k >= K || !srow[k])
                    continue;
                const uint16_t *yv = (const uint16_t *)&v[k];
                for (int i = 0; i < 8; i++)
                    acc[i] += sw[k] * fr_bf16_to_f32(yv[i]);
            }
            int4 o;
            uint16_t *ov = (uint16_t *)&o;
            for (int i = 0; i < 8; i++)
                ov[i] = fr_f32_to_bf16(acc[i]);
            *(int4 *)(out + (size_t)t * H + h0) = o;
        }
        __syncthreads();
    }
}

/* ---------------------------------------------------------------------- */
/* host side                                                              */

#define FR_CU(call, err, label)                                                \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "%s: %s", #call,                \
                        cudaGetErrorString(e_));                               \
            goto label;                                                        \
        }                                                                      \
    } while (0)

/* A runtime helper's status: on failure, keep it and leave. */
#define FR_CUH(call, label)                                                    \
    do {                                                                       \
        int s_ = (call);                                                       \
        if (s_ != FERRY_OK) {                                                  \
            rc = s_;                                                           \
            goto label;                                                        \
        }                                                                      \
    } while (0)

extern "C" int ferry_cuda_available(char *why, size_t len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (why && len)
            snprintf(why, len, "no CUDA device: %s",
                     e != cudaSuccess ? cudaGetErrorString(e) : "count is 0");
        return 0;
    }
    return 1;
}

typedef struct fr_ipc_msg {
    cudaIpcMemHandle_t h;
    int device;
    int status;        /* this rank's segment set-up */
} fr_ipc_msg_t;

/* This rank's receive segment (device memory, or pinned host memory mapped
 * into the GPU when peers are on the fabric) and what peers need to map it. */
static int fr_cuda_segment(ferry_ep_t ep, struct fr_cuda_ep *c,
                           fr_ipc_msg_t *mine, fr_err_t *err)
{
    int rc = FERRY_OK;
    const fr_layout_t *L = &ep->L;
    FR_CU(cudaGetDevice(&c->device), err, fail);
    mine->device = c->device;
    c->host_seg = ep->nfabric > 0;
    if (ep->nfabric > 0 && ep->nshm > 0)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "CUDA ranks with peers on both the IPC and fabric paths "
                      "are not supported yet");
    if (c->host_seg) {
        /* pinned host memory mapped into the GPU (runtime/cuda_mem.h) */
        void *h;
        size_t nsl = sizeof(fr_slice_t) * 2 * FR_NSETS * (size_t)ep->nfabric;
        FR_CUH(fr_cuda_host_alloc(L->seg_bytes, &h, &c->dev_seg, err), fail);
        ep->seg = (uint8_t *)h;
        FR_CUH(fr_cuda_host_alloc(L->send_bytes, &h, &c->dev_send, err), fail);
        ep->send = (uint8_t *)h;
        FR_CUH(fr_cuda_host_alloc(sizeof(fr_proxy_ring_t), &h, &c->dev_ring, err),
               fail);
        ep->ring_mem = (fr_proxy_ring_t *)h;
        ep->proxy.ring = ep->ring_mem;
        FR_CUH(fr_cuda_host_alloc(nsl, &h, &c->dev_slices, err), fail);
        ep->slices = (fr_slice_t *)h;
    } else {
        FR_CU(cudaMalloc((void **)&ep->seg, L->seg_bytes), err, fail);
        FR_CU(cudaMemset(ep->seg, 0, L->seg_bytes), err, fail);
        FR_CU(cudaIpcGetMemHandle(&mine->h, ep->seg), err, fail);
    }
fail:
    return rc;
}

extern "C" int fr_cuda_setup(ferry_ep_t ep, fr_err_t *err)
{
    int rc = FERRY_OK;
    const ferry_ep_config_t *cfg = &ep->cfg;
    fr_layout_init(&ep->L, ep->N, ep->rank, cfg->num_experts, cfg->topk,
                   cfg->hidden, cfg->max_tokens,
                   cfg->dispatch_dtype == FERRY_DTYPE_FP8_E4M3);
    const fr_layout_t *L = &ep->L;
    int N = ep->N;
    fr_ipc_msg_t mine, *all = NULL;
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)calloc(1, sizeof(*c));
    if (!c)
        return FR_ERR(err, FERRY_ERR_NOMEM, "CUDA state");
    ep->eng_state = c;
    /* A rank whose segment failed still joins the exchange with its
     * status, so every rank fails at once. */
    memset(&mine, 0, sizeof(mine));
    mine.status = fr_cuda_segment(ep, c, &mine, err);
    all = (fr_ipc_msg_t *)calloc((size_t)N, sizeof(*all));
    if (!all) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "IPC table");
        goto fail;
    }
    rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status,
                        "rank %d failed to set up its GPU segment (%s)", i,
                        ferry_strerror(all[i].status));
    if (rc != FERRY_OK)
        goto fail;
    c->peer_host = (uint8_t **)calloc((size_t)N, sizeof(uint8_t *));
    for (int i = 0; i < N; i++) {
        if (ep->path[i] == FR_PATH_SELF) {
            c->peer_host[i] = c->host_seg ? NULL : ep->seg;
        } else if (ep->path[i] == FR_PATH_SHM) {
            void *p = NULL;
            FR_CU(cudaIpcOpenMemHandle(&p, all[i].h, cudaIpcMemLazyEnablePeerAccess), err, fail);
            c->peer_host[i] = (uint8_t *)p;
        }
    }
    {
        /* device tables in one allocation */
        size_t T = (size_t)L->T, K = (size_t)L->K, El = (size_t)L->El;
        size_t sz[] = {sizeof(uint8_t *) * N, sizeof(int) * N, sizeof(int) * N,
                       sizeof(unsigned long long) * 2, sizeof(int32_t) * 2,
                       sizeof(int32_t) * 2 * T * N, sizeof(int32_t) * 2 * T * N,
                       sizeof(int32_t) * 2 * T * K, sizeof(int32_t) * 2 * N * 3,
                       sizeof(int32_t) * 2 * N * El,
                       sizeof(int32_t) * 2 * N * T * (size_t)L->kmax,
                       sizeof(int32_t) * 2 * L->send_crows,
                       sizeof(int32_t) * 2 * (N + 1), sizeof(int32_t) * 2 * N,
                       sizeof(unsigned int) * 4, sizeof(int) * 4};
        size_t off[20], tot = 0;
        int n = (int)(sizeof(sz) / sizeof(sz[0]));
        for (int i = 0; i < n; i++) {
            off[i] = tot;
            tot += (sz[i] + 255) & ~(size_t)255;
        }
        FR_CU(cudaMalloc(&c->dmem, tot), err, fail);
        FR_CU(cudaMemset(c->dmem, 0, tot), err, fail);
        uint8_t *b = (uint8_t *)c->dmem;
        fr_cu_args_t *A = &c->a;
        A->L = *L;
        A->rank = ep->rank;
        A->N = N;
        A->peer = (uint8_t **)(b + off[0]);
        A->path = (const int *)(b + off[1]);
        A->gidx = (const int *)(b + off[2]);
        A->epoch = (unsigned long long *)(b + off[3]);
        A->ntok = (int32_t *)(b + off[4]);
        A->rec_idx = (int32_t *)(b + off[5]);
        A->pair_base = (int32_t *)(b + off[6]);
        A->comb_pos = (int32_t *)(b + off[7]);
        A->cnt = (int32_t *)(b + off[8]);
        A->npairs = A->cnt + 2 * N;
        A->comb_off = A->cnt + 4 * N;
        A->cnt_se = (int32_t *)(b + off[9]);
        A->local_slot = (int32_t *)(b + off[10]);
        A->pair_row = (int32_t *)(b + off[11]);
        A->pair_off = (int32_t *)(b + off[12]);
        A->scomb_off = (int32_t *)(b + off[13]);
        A->done = (unsigned int *)(b + off[14]);
        A->dflag = (int *)(b + off[15]);
        unsigned long long ep0[2] = {0ull, ~0ull}; /* set 1 starts at -1 */
        FR_CU(cudaMemcpy(A->epoch, ep0, sizeof(ep0), cudaMemcpyHostToDevice), err, fail);
        FR_CU(cudaMemcpy((void *)A->path, ep->path, sizeof(int) * N, cudaMemcpyHostToDevice), err, fail);
        FR_CU(cudaMemcpy((void *)A->gidx, ep->group_index, sizeof(int) * N, cudaMemcpyHostToDevice), err, fail);
        if (c->host_seg) {
            A->seg = (uint8_t *)c->dev_seg;
            A->send = (uint8_t *)c->dev_send;
            A->ring = (fr_proxy_ring_t *)c->dev_ring;
            A->slices = (fr_slice_t *)c->dev_slices;
            /* self goes through the fabric too when every peer does */
        } else {
            A->seg = ep->seg;
        }
        A->nfabric = ep->nfabric;
        uint8_t **peer = (uint8_t **)calloc((size_t)N, sizeof(uint8_t *));
        for (int i = 0; i < N; i++)
            peer[i] = ep->path[i] == FR_PATH_SELF ? A->seg : c->peer_host[i];
        cudaError_t e1 = cudaMemcpy(A->peer, peer, sizeof(uint8_t *) * N, cudaMemcpyHostToDevice);
        free(peer);
        FR_CU(e1, err, fail);

        void *eh;
        FR_CUH(fr_cuda_host_alloc(sizeof(int) * 4, &eh, &c->err_dev, err), fail);
        c->err_host = (int *)eh;
        A->err = (volatile int *)c->err_dev;
        A->timeout_ns = (unsigned long long)ep->timeout_ms * 1000000ull;
        int nsm = ep->cfg.num_sms > 0 ? ep->cfg.num_sms : 16;
        c->nblocks = nsm;
    }
    free(all);
    return FERRY_OK;
fail:
    free(all);
    return rc;
}

extern "C" void fr_cuda_free(ferry_ep_t ep)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    if (!c)
        return;
    cudaDeviceSynchronize();
    if (c->peer_host)
        for (int i = 0; i < ep->N; i++)
            if (ep->path && ep->path[i] == FR_PATH_SHM && c->peer_host[i])
                cudaIpcCloseMemHandle(c->peer_host[i]);
    free(c->peer_host);
    if (c->host_seg) {
        fr_cuda_host_free(ep->seg);
        fr_cuda_host_free(ep->send);
        fr_cuda_host_free(ep->ring_mem);
        fr_cuda_host_free(ep->slices);
    } else if (ep->seg) {
        cudaFree(ep->seg);
    }
    ep->seg = NULL;
    ep->send = NULL;
    ep->ring_mem = NULL;
    ep->slices = NULL;
    if (c->dmem)
        cudaFree(c->dmem);
    if (c->err_host)
        fr_cuda_host_free(c->err_host);
    free(c);
    ep->eng_state = NULL;
}

extern "C" int fr_cuda_check(ferry_ep_t ep)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    volatile int *e = (volatile int *)c->err_host;
    int st = e[0];
    if (st == 0)
        return FERRY_OK;
    int rank = e[1], what = e[2], detail = e[3];
    switch (what) {
    case FR_CU_WHAT_INPUT:
        return fr_ep_fail(ep, st,
                          "topk_idx[%d][%d] (checked on the GPU of rank %d): must "
                          "be -1 or 0..%d and not repeat an expert of the token",
                          detail / ep->L.K, detail % ep->L.K, rank, ep->L.E - 1);
    case FR_CU_WHAT_NTOK:
        return fr_ep_fail(ep, st,
                          "num_tokens_dev = %d (read on the GPU of rank %d): must "
                          "be 0..max_tokens (%d)", detail, rank, ep->L.T);
    case FR_CU_WHAT_RECORD:
        return fr_ep_fail(ep, st, "GPU: malformed dispatch slice from rank %d (record %d)",
                          rank, detail);
    default:
        if (st == FERRY_ERR_TIMEOUT)
            return fr_ep_fail(ep, st, "%s: no data from rank %d after %ld ms (FERRY_TIMEOUT_MS)",
                              what == FR_CU_WHAT_COMBINE ? "combine" : "dispatch", rank,
                              ep->timeout_ms);
        return fr_ep_fail(ep, st, "GPU reported %s for rank %d (%d)", ferry_strerror(st),
                          rank, detail);
    }
}

/* Grid of the per-sender copy kernels: a row of blocks per rank, num_sms
 * blocks in all (at least one per rank). */
static dim3 fr_cuda_sender_grid(ferry_ep_t ep)
{
    int gy = (((struct fr_cuda_ep *)ep->eng_state)->nblocks + ep->N - 1) / ep->N;
    return dim3((unsigned)ep->N, (unsigned)(gy < 1 ? 1 : gy));
}

static int fr_cuda_launch_check(ferry_ep_t ep, const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "launching %s: %s", what, cudaGetErrorString(e));
    return fr_cuda_check(ep);
}

extern "C" int fr_cuda_sync(ferry_ep_t ep, void *stream)
{
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream)
                           : cudaDeviceSynchronize();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "cudaStreamSynchronize: %s", cudaGetErrorString(e));
    return fr_cuda_check(ep);
}

extern "C" int fr_cuda_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    fr_cu_route<<<1, FR_CU_ROUTE_THREADS, 0, st>>>(c->a, set, in->topk_idx, in->num_tokens,
                                                     in->num_tokens_dev);
    if (((uintptr_t)in->x & 15) == 0 && ep->L.tok_bytes % 16 == 0 &&
        ep->L.rec_hdr % 16 == 0) {
        /* a block per token, 16-byte accesses */
        int blocks = c->nblocks < ep->L.T ? c->nblocks : ep->L.T;
        fr_cu_pack_block<<<blocks, FR_CU_THREADS, 0, st>>>(
            c->a, set, (const uint16_t *)in->x, in->x_scales, in->topk_idx);
    } else {
        /* a warp per token (x not 16-byte aligned) */
        int wpb = FR_CU_THREADS / 32, need = (ep->L.T + wpb - 1) / wpb;
        int blocks = c->nblocks < need ? c->nblocks : need;
        fr_cu_pack<<<blocks, FR_CU_THREADS, 0, st>>>(c->a, set, (const uint16_t *)in->x,
                                                     in->x_scales, in->topk_idx);
    }
    return fr_cuda_launch_check(ep, "dispatch_send");
}

extern "C" int fr_cuda_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)out->stream;
    int set = (int)(r->epoch % FR_NSETS);
    /* Blocks that wait for peers hold SMs: never launch more than num_sms
     * of them, or ranks sharing a GPU can fill it with waiters while the
     * senders they wait for cannot start. */
    int cy = c->nblocks / ep->N;
    cy = cy < 1 ? 1 : (cy > ep->L.El ? ep->L.El : cy);
    dim3 cgrid((unsigned)ep->N, (unsigned)cy);
    fr_cu_recv_count<<<cgrid, 1024, 0, st>>>(c->a, set);
    dim3 grid = fr_cuda_sender_grid(ep);
    fr_cu_recv_place<<<grid, FR_CU_THREADS, sizeof(int32_t) * ep->L.El, st>>>(
        c->a, set, (uint8_t *)out->expert_x, out->expert_x_scales, out->expert_num_tokens,
        out->expert_src_rank, out->expert_src_token);
    return fr_cuda_launch_check(ep, "dispatch_recv");
}

extern "C" int fr_cuda_combine_send(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    dim3 grid = fr_cuda_sender_grid(ep);
    c->y[set] = in->expert_y;
    fr_cu_combine_send<<<grid, FR_CU_THREADS, 0, st>>>(c->a, set, (const uint8_t *)in->expert_y);
    return fr_cuda_launch_check(ep, "combine_send");
}

extern "C" int fr_cuda_combine_recv(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)out->stream;
    int set = (int)(r->epoch % FR_NSETS);
    int blocks = c->nblocks < ep->L.T ? c->nblocks : ep->L.T;
    fr_cu_combine_recv<<<blocks, FR_CU_THREADS, 0, st>>>(c->a, set, out->topk_weights,
                                                          (uint16_t *)out->out,
                                                          (const uint8_t *)c->y[set]);
    return fr_cuda_launch_check(ep, "combine_recv");
}
