/*
 * Dispatch of the CUDA low-latency engine: a send part and a receive part,
 * one launch for both (fr_cu_dispatch, behind ferry_dispatch) or one each
 * (fr_cu_dispatch_send, fr_cu_dispatch_recv, behind dispatch_send / dispatch_recv).
 *
 * Send (a grid of blocks, each owning a contiguous run of tokens):
 *   1. every block counts, per destination rank, the records (distinct
 *      (token, rank)) and pairs ((token, expert)) over all tokens and over
 *      the tokens before its own (warps over tokens, lanes over ranks);
 *      sums commute, so every block gets the same exact numbers and no
 *      block waits for another;
 *   2. the block's tokens, a token per thread, get their record index and
 *      first pair per destination (warp ballots, a scan over the warps;
 *      the wire format of core/layout.h: records in token order);
 *   3. a thread per own (token, k) checks it, writes its record header and
 *      combine position, and lists the token's records (dst_rec);
 *   4. all warps quantise and store: a warp takes 512 channels of one
 *      token (16 per lane, two 16-byte loads, amax over the 8 lanes of a
 *      128-channel block, hardware e4m3 conversion) and stores them with
 *      16-byte stores into every record of the token;
 *   5. IPC path: block 0 writes the slice headers and every block adds its
 *      share to each destination's flag (cuda_ll_dev.cuh, fr_cu_arrive);
 *      fabric path: per destination a counter of finished blocks, the lane
 *      that finishes one fills its slice, the last rings the proxy.
 *
 * Receive (block y owning local experts y, y + G, ...): for each sender in
 *   rank order, one lane waits for its flag; per chunk of records (one per
 *   thread) warp ballots and a scan over the warps give every (record, own
 *   expert) its row (rows of an expert ordered by sender, then token, as
 *   the CPU engine orders them), and the whole block copies the tokens
 *   there. Blocks never wait for each other.
 */
#include "engines/cuda_ll/cuda_ll_dev.cuh"

/* FR_CU_TRACE: block 0 prints its phase times (SM cycles) for epoch 41 */
#ifdef FR_CU_TRACE
#define FR_TR_DECL long long tr_[8]; int ntr_ = 0
#define FR_TR() do { if (threadIdx.x == 0 && ntr_ < 8) tr_[ntr_++] = clock64(); } while (0)
#define FR_TR_PRINT(name, ep) do { if (threadIdx.x == 0 && blockIdx.x == 0 && (ep) == 41) { \
    printf("%s rank %d:", name, A.rank); for (int i_ = 1; i_ < ntr_; i_++) printf(" %lld", tr_[i_] - tr_[i_ - 1]); printf("\n"); } } while (0)
#else
#define FR_TR_DECL
#define FR_TR() do { } while (0)
#define FR_TR_PRINT(name, ep) do { } while (0)
#endif

typedef struct fr_dr_out {
    uint8_t *ex;
    float *exs;
    int32_t *counts, *src_rank, *src_token;
} fr_dr_out_t;

#define FR_DS_THREADS 512
#define FR_DR_THREADS 512

static __device__ __forceinline__ uint8_t *fr_cu_dslice(const fr_cu_args_t &A, int set, int d)
{
    if (A.path[d] == FR_PATH_FABRIC)
        return A.send + fr_off_dsend(&A.L, set, d);
    return A.peer[d] + fr_off_drecv(&A.L, set, A.rank);
}

/* Step 1. sh: [0,N) records before `start`, [N,2N) pairs before, [2N,3N)
 * records in all, [3N,4N) pairs in all. A lane holds one token's row (all
 * K loads in flight at once); per destination, ballots count the records
 * and warp sums the pairs. Indices outside 0..E-1 count nowhere (step 3
 * reports them). */
static __device__ void fr_ds_count(const fr_cu_args_t &A, const int64_t *idx, int T,
                                   int start, int32_t *sh, int32_t *hself, int32_t *hall)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int t0 = w * 32; t0 < T; t0 += nw * 32) {
        int t = t0 + lane;
        int ek[FR_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            ek[k] = k < K && t < T ? (int)idx[(size_t)t * K + k] : -1;
        bool before = t < start;
        if (hself) {
            /* own experts, in place: per expert, the own pairs before
             * `start` (hself) and in all (hall). A repeated expert (an
             * input error, reported by fr_ds_pair) counts twice here and
             * in fr_ds_self alike; rows past the capacity are dropped. */
            int lo = A.rank * El;
#pragma unroll
            for (int k = 0; k < FR_MAX_TOPK; k++) {
                unsigned int le = (unsigned int)(ek[k] - lo);
                if (ek[k] < 0 || le >= (unsigned int)El)
                    continue;
                if (before)
                    atomicAdd(&hself[le], 1);
                atomicAdd(&hall[le], 1);
            }
        }
        for (int d = 0; d < N; d++) {
            int lo = d * El, hi = lo + El, np = 0;
#pragma unroll
            for (int k = 0; k < FR_MAX_TOPK; k++)
                np += ek[k] >= lo && ek[k] < hi;
            unsigned int has = __ballot_sync(0xffffffffu, np > 0);
            if (!has)
                continue;
            unsigned int hb = __ballot_sync(0xffffffffu, np > 0 && before);
            int sp = __reduce_add_sync(0xffffffffu, np);
            int sb = __reduce_add_sync(0xffffffffu, before ? np : 0);
            if (lane == 0) {
                atomicAdd(&sh[d], __popc(hb));
                atomicAdd(&sh[N + d], sb);
                atomicAdd(&sh[2 * N + d], __popc(has));
                atomicAdd(&sh[3 * N + d], sp);
            }
        }
    }
}

/* Exclusive scan of pairs per destination: each destination's first row
 * in this rank's combine region. Warp 0. */
static __device__ void fr_ds_comb_off(int N, const int32_t *tp, int32_t *co)
{
    int lane = threadIdx.x & 31, carry = 0;
    for (int d0 = 0; d0 < N; d0 += 32) {
        int d = d0 + lane, v = d < N ? tp[d] : 0, x = v;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o)
                x += y;
        }
        if (d < N)
            co[d] = carry + x - v;
        carry += __shfl_sync(0xffffffffu, x, 31);
    }
}

/* Step 2, all threads over the own tokens [start, end), a token per
 * thread: for each group of FR_DS_GROUP destinations, warp ballots and
 * sums count the records and pairs per (destination, warp), a thread per
 * destination turns them into first indices (running from the counts of
 * the tokens before `start`, sh[0, 2N)), and every token gets its record
 * index and first pair there (the wire format: records in token order).
 * A thread per destination walking the tokens one by one was a chain of
 * dependent loads as long as the block's tokens. */
#define FR_DS_GROUP 64
static __host__ __device__ size_t fr_ds_smem(int N)
{
    return (sizeof(uint8_t *) + sizeof(int32_t) * 5) * (size_t)N +
           2 * sizeof(int32_t) * FR_DS_GROUP * (FR_DS_THREADS / 32);
}

/* Own experts written in place (the one-launch kernel, self on the IPC
 * path, E_local up to FR_DS_DIRECT_MAX): hself[E_local] and hall[E_local]
 * after fr_ds_smem's part. */
#define FR_DS_DIRECT_MAX 4096
static __host__ __device__ size_t fr_ds_smem_direct(int N, int El, int G)
{
    return fr_ds_smem(N) + 2 * sizeof(int32_t) * (size_t)El;
}

static __device__ void fr_ds_index(const fr_cu_args_t &A, int set, const int64_t *idx,
                                   int start, int end, int32_t *sh, int32_t *cw)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int32_t *pw = cw + FR_DS_GROUP * nw;
    int32_t *rec_idx = A.rec_idx + (size_t)set * L.T * N;
    int32_t *pbase = A.pair_base + (size_t)set * L.T * N;
    unsigned int lt = (1u << lane) - 1;
    for (int c0 = start; c0 < end; c0 += blockDim.x) {
        int t = c0 + (int)threadIdx.x;
        int ek[FR_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            ek[k] = k < K && t < end ? (int)idx[(size_t)t * K + k] : -1;
        for (int d0 = 0; d0 < N; d0 += FR_DS_GROUP) {
            int dn = min(FR_DS_GROUP, N - d0);
            for (int dd = 0; dd < dn; dd++) {
                int lo = (d0 + dd) * El, np = 0;
#pragma unroll
                for (int k = 0; k < FR_MAX_TOPK; k++)
                    np += ek[k] >= lo && ek[k] < lo + El;
                unsigned int bal = __ballot_sync(0xffffffffu, np > 0);
                int sp = __reduce_add_sync(0xffffffffu, np);
                if (lane == 0) {
                    cw[dd * nw + w] = __popc(bal);
                    pw[dd * nw + w] = sp;
                }
            }
            __syncthreads();
            for (int dd = threadIdx.x; dd < dn; dd += blockDim.x) {
                int br = sh[d0 + dd], bp = sh[N + d0 + dd];
                for (int w2 = 0; w2 < nw; w2++) {
                    int r = cw[dd * nw + w2], q = pw[dd * nw + w2];
                    cw[dd * nw + w2] = br;
                    pw[dd * nw + w2] = bp;
                    br += r;
                    bp += q;
                }
                sh[d0 + dd] = br;
                sh[N + d0 + dd] = bp;
            }
            __syncthreads();
            for (int dd = 0; dd < dn; dd++) {
                int lo = (d0 + dd) * El, np = 0;
#pragma unroll
                for (int k = 0; k < FR_MAX_TOPK; k++)
                    np += ek[k] >= lo && ek[k] < lo + El;
                unsigned int bal = __ballot_sync(0xffffffffu, np > 0);
                int x = np; /* pairs of the lanes before this one */
                for (int o = 1; o < 32; o <<= 1) {
                    int v = __shfl_up_sync(0xffffffffu, x, o);
                    if (lane >= o)
                        x += v;
                }
                if (t < end) {
                    size_t at = (size_t)t * N + d0 + dd;
                    rec_idx[at] = np ? cw[dd * nw + w] + __popc(bal & lt) : -1;
                    pbase[at] = pw[dd * nw + w] + x - np;
                }
            }
            __syncthreads(); /* cw, pw are reused by the next group */
        }
    }
}

/* Step 3: a thread per own (token, k): check the slot, write its combine
 * position, and when k is the token's first expert on its rank, the
 * record header; dst_rec slot k is that record (else NULL). */
static __device__ void fr_ds_pair(const fr_cu_args_t &A, int set, const int64_t *idx, int t,
                                  int k, const int32_t *co, uint8_t *const *sbase, int *s_bad,
                                  bool direct)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El;
    /* the whole row at once (loads in flight together, fixed indices) */
    const int64_t *row = idx + (size_t)t * K;
    int64_t r[FR_MAX_TOPK], e = -1;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++) {
        r[j] = j < K ? row[j] : -1;
        e = j == k ? r[j] : e;
    }
    uint8_t **dr = A.dst_rec + ((size_t)set * L.T + t) * K + k;
    float **ds = A.dst_scl + ((size_t)set * L.T + t) * K + k;
    int32_t *cpos = A.comb_pos + ((size_t)set * L.T + t) * K + k;
    bool bad = e < -1 || e >= L.E;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++)
        bad = bad || (j < k && e >= 0 && r[j] == e);
    /* an own expert written in place: fr_ds_self owns the slot */
    bool mine = direct && e >= (int64_t)A.rank * El && e < (int64_t)(A.rank + 1) * El;
    if (!mine) {
        *dr = NULL;
        *ds = NULL;
    }
    if (bad) {
        fr_cu_fail(A, FERRY_ERR_INVALID, A.rank, FR_CU_WHAT_INPUT, t * K + k);
        *s_bad = 1;
    }
    if (bad || e < 0) {
        *cpos = -1;
        return;
    }
    int d = (int)e / El, before = 0;
    int64_t lo = (int64_t)d * El, hi = lo + El;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++)
        before += j < k && r[j] >= lo && r[j] < hi;
    size_t at = ((size_t)set * L.T + t) * N + d;
    int pb = A.pair_base[at], ri = A.rec_idx[at];
    *cpos = co[d] + pb + before;
    if (before || mine)
        return;
    uint8_t *rec = sbase[d] + fr_off_record(&L, (uint32_t)ri);
    fr_rec_hdr_t *h = (fr_rec_hdr_t *)rec;
    uint16_t n = 0;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++)
        if (j >= k && r[j] >= lo && r[j] < hi)
            h->le[n++] = (uint16_t)(r[j] - lo);
    h->token = (uint32_t)t;
    h->pair = (uint32_t)pb;
    h->nexp = n;
    h->reserved = 0;
    *dr = rec + L.rec_hdr;
    *ds = (float *)(rec + L.rec_hdr + L.tok_bytes);
}

/* Own experts in place, warp 0 over the block's (token, k) pairs in
 * order, 32 at a time (the next 32's loads in flight): an own expert's
 * pair takes the next row of that expert after the own pairs before it
 * (hself, from fr_ds_count; lanes holding the same expert in lane order)
 * and points the token's slot k there; the row map for combine and the
 * sources go with it. Rows of an expert: own tokens first, in token
 * order. */
static __device__ void fr_ds_self(const fr_cu_args_t &A, int set, const int64_t *idx, int start,
                                  int end, int32_t *hself, const fr_dr_out_t &o)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El, lane = threadIdx.x & 31;
    int64_t lo = (int64_t)A.rank * El;
    int32_t *prow = A.pair_row + (size_t)set * L.send_crows + (size_t)A.rank * L.T * L.kmax;
    int n = (end - start) * K, pmax = (int)(L.T * L.kmax);
    unsigned int lt = (1u << lane) - 1;
    const int64_t *base = idx + (size_t)start * K;
    const int32_t *pbase = A.pair_base + (size_t)set * L.T * N + A.rank;
    bool whole = 32 % K == 0; /* a token's slots in one pass: lanes below k hold them */
    int f = lane;
    int64_t e = f < n ? base[f] : -1;
    int pb = f < n ? pbase[(size_t)(start + f / K) * N] : 0;
    for (int f0 = 0; f0 < n; f0 += 32, f += 32) {
        /* the next pairs' loads in flight while this pass works */
        int64_t en = f + 32 < n ? base[f + 32] : -1;
        int pbn = f + 32 < n ? pbase[(size_t)(start + (f + 32) / K) * N] : 0;
        int t = start + f / K, k = f - (t - start) * K;
        bool in = f < n && e >= lo && e < lo + El;
        unsigned int inb = __ballot_sync(0xffffffffu, in);
        /* own slots of the token before k */
        int before = 0;
        if (whole)
            before = __popc(inb & lt & ~((1u << (lane - k)) - 1));
        else if (in)
            for (int j = 0; j < k; j++) {
                int64_t ej = idx[(size_t)t * K + j];
                before += ej >= lo && ej < lo + El;
            }
        unsigned long long key = in ? (unsigned long long)e : ~0ull - lane;
        unsigned int m = __match_any_sync(0xffffffffu, key);
        int le = (int)(e - lo), pos = in ? hself[le] + __popc(m & lt) : 0;
        __syncwarp();
        if (in && 31 - __clz(m) == lane) /* the expert's last lane moves it on */
            hself[le] += __popc(m);
        __syncwarp();
        if (in) {
            size_t at = ((size_t)set * L.T + t) * K + k;
            bool fits = pos < (int)L.cap;
            size_t row = (size_t)le * L.cap + pos;
            A.dst_rec[at] = fits ? o.ex + row * L.tok_bytes : NULL;
            A.dst_scl[at] = fits && o.exs ? o.exs + row * L.nscales : NULL;
            if (pb + before < pmax)
                prow[pb + before] = fits ? (int32_t)row : -1;
            if (fits && o.src_rank)
                o.src_rank[row] = A.rank;
            if (fits && o.src_token)
                o.src_token[row] = t;
        }
        e = en;
        pb = pbn;
    }
}

/* Quantise 16 channels per lane (a 128-channel block per 8 lanes: amax
 * over the group, hardware e4m3 conversion) and store them, with the
 * block's scale, into every record of the token. */
static __device__ __forceinline__ void fr_ds_qstore(const fr_cu_args_t &A, uint8_t *mine,
                                                    float *msc, uint4 v0, uint4 v1, bool on,
                                                    int g)
{
    uint32_t wv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    uint16_t m = 0;
    for (int i = 0; i < 8; i++) {
        uint16_t a = fr_bf16_finite_mag((uint16_t)(wv[i] & 0xffff));
        uint16_t b = fr_bf16_finite_mag((uint16_t)(wv[i] >> 16));
        m = a > m ? a : m;
        m = b > m ? b : m;
    }
    for (int o = 4; o; o >>= 1) {
        uint16_t y = (uint16_t)__shfl_xor_sync(0xffffffffu, m, o, 8);
        m = y > m ? y : m;
    }
    float amax = fr_bf16_to_f32(m), inv = fr_fp8_inv_scale(amax);
    uint4 q = make_uint4(fr_cu_e4m3x4(wv[0], wv[1], inv), fr_cu_e4m3x4(wv[2], wv[3], inv),
                         fr_cu_e4m3x4(wv[4], wv[5], inv), fr_cu_e4m3x4(wv[6], wv[7], inv));
    float sc = fr_fp8_scale(amax);
    /* lane i holds the token's slot i (where its data goes, or NULL) */
    for (int i = 0; i < A.kd; i++) {
        uint8_t *p = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, i);
        float *ps = (float *)__shfl_sync(0xffffffffu, (unsigned long long)msc, i);
        if (!p || !on)
            continue;
        ((uint4 *)p)[g] = q;
        if ((g & 7) == 0)
            ps[g >> 3] = sc;
    }
}

/* Step 4, one warp-task: 512 channels (quantised) or 512 bytes (copied) of
 * token t, chunk c, to every place of the token (lane i holds slot i). */
template <bool VEC>
static __device__ __forceinline__ void fr_ds_chunk(const fr_cu_args_t &A, uint8_t *const *dr,
                                                   float *const *ds, const uint16_t *xrow,
                                                   const float *scl, bool quant, int c)
{
    const fr_layout_t &L = A.L;
    int lane = threadIdx.x & 31, kd = A.kd, g = c * 32 + lane;
    uint8_t *mine = lane < kd ? dr[lane] : NULL;
    float *msc = lane < kd ? ds[lane] : NULL;
    if (quant) {
        bool on = g < (int)(L.H / 16);
        uint32_t wv[8];
        if (VEC) {
            uint4 v0 = on ? ((const uint4 *)xrow)[2 * g] : make_uint4(0, 0, 0, 0);
            uint4 v1 = on ? ((const uint4 *)xrow)[2 * g + 1] : make_uint4(0, 0, 0, 0);
            wv[0] = v0.x, wv[1] = v0.y, wv[2] = v0.z, wv[3] = v0.w;
            wv[4] = v1.x, wv[5] = v1.y, wv[6] = v1.z, wv[7] = v1.w;
        } else {
            for (int i = 0; i < 8; i++)
                wv[i] = on ? (uint32_t)xrow[16 * g + 2 * i] |
                                 ((uint32_t)xrow[16 * g + 2 * i + 1] << 16)
                           : 0u;
        }
        /* a chunk past the row is idle as a whole group of 8 lanes (H is
         * a multiple of 128) */
        fr_ds_qstore(A, mine, msc, make_uint4(wv[0], wv[1], wv[2], wv[3]),
                     make_uint4(wv[4], wv[5], wv[6], wv[7]), on, g);
        return;
    }
    int n16 = (int)(L.tok_bytes / 16);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (g < n16) {
        if (VEC) {
            v = ((const uint4 *)xrow)[g];
        } else {
            uint32_t b[4];
            const uint8_t *s = (const uint8_t *)xrow + 16 * (size_t)g;
            for (int i = 0; i < 4; i++)
                b[i] = (uint32_t)s[4 * i] | ((uint32_t)s[4 * i + 1] << 8) |
                       ((uint32_t)s[4 * i + 2] << 16) | ((uint32_t)s[4 * i + 3] << 24);
            v = make_uint4(b[0], b[1], b[2], b[3]);
        }
    }
    for (int i = 0; i < kd; i++) {
        uint8_t *p = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, i);
        float *ps = (float *)__shfl_sync(0xffffffffu, (unsigned long long)msc, i);
        if (p && g < n16)
            ((uint4 *)p)[g] = v;
        if (ps && scl && c == 0)
            for (int q = lane; q < (int)L.nscales; q += 32)
                ps[q] = scl[q];
    }
}

/* Step 4 for two warp-tasks at once (bf16 input quantised, 16-byte
 * aligned): both tasks' loads are in flight before either is converted. */
static __device__ __forceinline__ void fr_ds_quant2(const fr_cu_args_t &A, int set,
                                                    const uint16_t *x, int start, int chunks,
                                                    int j0, int j1)
{
    const fr_layout_t &L = A.L;
    int lane = threadIdx.x & 31;
    int t0 = start + j0 / chunks, c0 = j0 % chunks, t1 = start + j1 / chunks, c1 = j1 % chunks;
    int g0 = c0 * 32 + lane, g1 = c1 * 32 + lane, hg = (int)(L.H / 16);
    const uint4 *r0 = (const uint4 *)(x + (size_t)t0 * L.H);
    const uint4 *r1 = (const uint4 *)(x + (size_t)t1 * L.H);
    uint4 z = make_uint4(0, 0, 0, 0);
    size_t a0i = ((size_t)set * L.T + t0) * A.kd + lane, a1i = ((size_t)set * L.T + t1) * A.kd + lane;
    uint8_t *m0 = lane < A.kd ? A.dst_rec[a0i] : NULL, *m1 = lane < A.kd ? A.dst_rec[a1i] : NULL;
    float *s0 = lane < A.kd ? A.dst_scl[a0i] : NULL, *s1 = lane < A.kd ? A.dst_scl[a1i] : NULL;
    uint4 a0 = g0 < hg ? r0[2 * g0] : z, a1 = g0 < hg ? r0[2 * g0 + 1] : z;
    uint4 b0 = g1 < hg ? r1[2 * g1] : z, b1 = g1 < hg ? r1[2 * g1 + 1] : z;
    fr_ds_qstore(A, m0, s0, a0, a1, g0 < hg, g0);
    fr_ds_qstore(A, m1, s1, b0, b1, g1 < hg, g1);
}

/* Step 5: this block is done with every destination; whoever finishes one
 * publishes it, whoever publishes the last rings the proxy. */
static __device__ void fr_ds_finish(const fr_cu_args_t &A, int set, unsigned long long epoch,
                                    const int32_t *sh, uint8_t *const *sbase)
{
    const fr_layout_t &L = A.L;
    int N = A.N;
    /* every thread's stores before its fence, all fences before the
     * counts */
    __threadfence_system();
    __syncthreads();
    for (int d = threadIdx.x; d < N; d += blockDim.x) {
        unsigned int *dd = A.ddone + (size_t)set * N + d;
        if (atomicAdd(dd, 1u) != gridDim.x - 1)
            continue;
        __threadfence_system();
        *dd = 0;
        int cnt = sh[2 * N + d], np = sh[3 * N + d], co = sh[4 * N + d];
        if (!fr_cu_failed(A)) {
            fr_slice_hdr_t *h = (fr_slice_hdr_t *)sbase[d];
            h->magic = FR_SLICE_MAGIC;
            h->sender = (uint32_t)A.rank;
            h->epoch = epoch;
            h->count = (uint32_t)cnt;
            h->npairs = (uint32_t)np;
            h->comb_off = (uint32_t)co;
            __threadfence_system();
            fr_cu_publish(A, FR_PH_DISPATCH, set, d, epoch, fr_off_dsend(&L, set, d),
                          fr_off_drecv(&L, set, A.rank), fr_off_record(&L, (uint32_t)cnt));
        }
        if (atomicAdd(A.dpub + set, 1u) == (unsigned)N - 1) {
            A.dpub[set] = 0;
            A.epoch[set] = epoch;
            if (!fr_cu_failed(A) && A.nfabric > 0) {
                __threadfence_system();
                fr_cu_ring(A, FR_PH_DISPATCH, set, epoch);
            }
        }
    }
}

/* Step 5 on the IPC path: block 0 writes the slice headers (every block
 * has the exact counts), then every block adds its share to every
 * destination's flag; the last block to finish advances the set's epoch
 * (read by the next kernels). */
static __device__ void fr_ds_finish_ipc(const fr_cu_args_t &A, int set,
                                        unsigned long long epoch, const int32_t *sh,
                                        uint8_t *const *sbase)
{
    int N = A.N;
    if (blockIdx.x == 0)
        for (int d = threadIdx.x; d < N; d += blockDim.x) {
            fr_slice_hdr_t *h = (fr_slice_hdr_t *)sbase[d];
            h->magic = FR_SLICE_MAGIC;
            h->sender = (uint32_t)A.rank;
            h->epoch = epoch;
            h->count = (uint32_t)sh[2 * N + d];
            h->npairs = (uint32_t)sh[3 * N + d];
            h->comb_off = (uint32_t)sh[4 * N + d];
        }
    fr_cu_arrive(A, FR_PH_DISPATCH, set); /* barrier first, then thread 0 */
    if (threadIdx.x == 0 && atomicAdd(A.dpub + set, 1u) == gridDim.x - 1) {
        A.dpub[set] = 0;
        A.epoch[set] = epoch;
    }
}

/* The send part; returns this round's epoch (the same in every thread). */
template <bool VEC>
static __device__ __forceinline__ unsigned long long
fr_ds_run(const fr_cu_args_t &A, int set, const uint16_t *x, const float *x_scales,
          const int64_t *idx, int T_host, const int32_t *T_dev, const fr_dr_out_t *od)
{
    extern __shared__ uint8_t *sbase[]; /* fr_ds_smem: [N] slice bases, int32 [5][N], counts */
    const fr_layout_t &L = A.L;
    int N = A.N;
    int32_t *sh = (int32_t *)(sbase + N); /* fr_ds_count's, then comb_off */
    /* od: own experts' rows written in place (fr_ds_smem_direct) */
    int32_t *hself = od ? sh + 5 * N + 2 * FR_DS_GROUP * (FR_DS_THREADS / 32) : NULL;
    int32_t *hall = od ? hself + L.El : NULL;
    __shared__ int s_T, s_bad;
    __shared__ unsigned long long s_epoch;
    if (threadIdx.x == 0) {
        int T = T_dev ? *T_dev : T_host;
        s_bad = fr_cu_failed(A);
        if (T < 0 || T > L.T) {
            fr_cu_fail(A, FERRY_ERR_INVALID, A.rank, FR_CU_WHAT_NTOK, T);
            s_bad = 1;
        }
        s_T = T;
        s_epoch = A.epoch[set] + 2; /* set 1: 1, 3, 5...; set 0: 2, 4, 6... */
    }
    for (int i = threadIdx.x; i < 5 * N; i += blockDim.x)
        sh[i] = 0;
    for (int i = threadIdx.x; od && i < 2 * (int)L.El; i += blockDim.x)
        hself[i] = 0; /* and hall */
    for (int d = threadIdx.x; d < N; d += blockDim.x)
        sbase[d] = fr_cu_dslice(A, set, d);
    __syncthreads();
    unsigned long long epoch = s_epoch;
    if (s_bad)
        return epoch;
    int T = s_T, per = (T + gridDim.x - 1) / gridDim.x;
    int start = min(T, (int)blockIdx.x * per), end = min(T, start + per);
    FR_TR_DECL;
    FR_TR();
    fr_ds_count(A, idx, T, start, sh, hself, hall);
    __syncthreads();
    for (int le = blockIdx.x + threadIdx.x * gridDim.x; od && le < (int)L.El;
         le += blockDim.x * gridDim.x)
        A.self_run[set * L.El + le] = min(hall[le], (int)L.cap);
    if (threadIdx.x < 32)
        fr_ds_comb_off(N, sh + 3 * N, sh + 4 * N);
    FR_TR();
    fr_ds_index(A, set, idx, start, end, sh, sh + 5 * N);
    __syncthreads();
    FR_TR();
    if (blockIdx.x == 0) {
        for (int d = threadIdx.x; d < N; d += blockDim.x) {
            A.cnt[set * N + d] = sh[2 * N + d];
            A.npairs[set * N + d] = sh[3 * N + d];
            A.comb_off[set * N + d] = sh[4 * N + d];
        }
        if (threadIdx.x == 0)
            A.ntok[set] = T;
        if (od && threadIdx.x == 0)
            A.pair_n[set * N + A.rank] = sh[3 * N + A.rank];
    }
    if (od && threadIdx.x < 32)
        fr_ds_self(A, set, idx, start, end, hself, *od);
    for (int i = threadIdx.x; i < (end - start) * L.K; i += blockDim.x)
        fr_ds_pair(A, set, idx, start + i / L.K, i % L.K, sh + 4 * N, sbase, &s_bad, od != NULL);
    __syncthreads();
    FR_TR();
    bool quant = L.fp8 && !x_scales;
    int chunks = quant ? (int)((L.H + 511) / 512) : (int)((L.tok_bytes + 511) / 512);
    int w = threadIdx.x >> 5, nw = blockDim.x >> 5, ntask = (end - start) * chunks;
    int j = w;
    if (VEC && quant)
        for (; j + nw < ntask && !s_bad; j += 2 * nw)
            fr_ds_quant2(A, set, x, start, chunks, j, j + nw);
    for (; j < ntask && !s_bad; j += nw) {
        int t = start + j / chunks, c = j % chunks;
        const uint16_t *xrow = quant ? x + (size_t)t * L.H
                                     : (const uint16_t *)((const uint8_t *)x + (size_t)t * L.tok_bytes);
        fr_ds_chunk<VEC>(A, A.dst_rec + ((size_t)set * L.T + t) * A.kd,
                         A.dst_scl + ((size_t)set * L.T + t) * A.kd, xrow,
                         x_scales ? x_scales + (size_t)t * L.nscales : NULL, quant, c);
    }
    FR_TR();
    if (A.nfabric > 0)
        fr_ds_finish(A, set, s_epoch, sh, sbase);
    else
        fr_ds_finish_ipc(A, set, s_epoch, sh, sbase);
    FR_TR();
    FR_TR_PRINT("dsend count,index,token,pack,finish", epoch);
    return epoch;
}

template <bool VEC>
__global__ void __launch_bounds__(FR_DS_THREADS, 2)
fr_cu_dispatch_send(fr_cu_args_t A, int set, const uint16_t *x, const float *x_scales,
            const int64_t *idx, int T_host, const int32_t *T_dev)
{
    fr_ds_run<VEC>(A, set, x, x_scales, idx, T_host, T_dev, NULL);
}

/* ---------------------------------------------------------------------- */
/* dispatch_recv                                                          */

/* Wait for sender s and check its slice header (one thread). */
static __device__ bool fr_dr_wait(const fr_cu_args_t &A, int set, int s,
                                  unsigned long long epoch)
{
    const fr_layout_t &L = A.L;
    if (fr_cu_failed(A) ||
        !fr_cu_wait_flag(A, (const unsigned long long *)(A.seg + fr_off_flag(&L, FR_PH_DISPATCH, set, s)),
                         fr_cu_target(A, epoch), s, FR_CU_WHAT_DISPATCH))
        return false;
    const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)(A.seg + fr_off_drecv(&L, set, s));
    if (h->magic != FR_SLICE_MAGIC || h->sender != (uint32_t)s || h->epoch != epoch ||
        h->count > (uint32_t)L.T || h->npairs > (uint64_t)L.T * L.kmax ||
        (uint64_t)h->comb_off + h->npairs > L.crows) {
        fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, -1);
        return false;
    }
    return true;
}

/* A (record, own expert) found in a chunk of a sender's records: its row. */
typedef struct fr_dr_item {
    int32_t i, row, j, pair, token;
} fr_dr_item_t;
#define FR_DR_ITEMS 1024 /* items per chunk */
#define FR_DR_GROUP 64   /* own experts ranked together */

/* Records per chunk: one record per thread, and every record has at most
 * min(nmine, kmax) items. */
static __host__ __device__ int fr_dr_chunk(int nmine, int kmax, int threads)
{
    int per = nmine < kmax ? nmine : kmax;
    int c = FR_DR_ITEMS / (per < 1 ? 1 : per);
    return c < threads ? c : threads;
}

/* Dynamic shared memory of the receive part: run[] (rounded up to 4), the
 * per-(expert, warp) counts, then the item list. */
static __host__ __device__ size_t fr_dr_smem(int El, int G)
{
    int nmax = (El + G - 1) / G;
    return sizeof(int32_t) * (size_t)((nmax + 3) & ~3) +
           sizeof(int32_t) * FR_DR_GROUP * (FR_DR_THREADS / 32) +
           sizeof(fr_dr_item_t) * FR_DR_ITEMS;
}

/* Finding, all warps over the records of a chunk [c0, c1) (a record per
 * thread): for each group of up to FR_DR_GROUP own experts (le = y + m G),
 * a ballot per warp counts the records holding le, a thread per expert
 * turns the warps' counts into first rows (records in order: warp, then
 * lane), and every holding lane adds its item with row run[m] + the
 * records before it. Rows of an expert come in record order, as the CPU
 * engine orders them. */
static __device__ void fr_dr_find(const fr_cu_args_t &A, int s, const uint8_t *slice, int c0,
                                  int c1, int npairs, int nmine, int32_t *run, int32_t *cw,
                                  fr_dr_item_t *list, int *nlist)
{
    const fr_layout_t &L = A.L;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int y = blockIdx.x, G = gridDim.x;
    int i = c0 + (int)threadIdx.x, nexp = 0;
    uint32_t tk = 0, pr = 0, wd[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (i < c1) {
        /* the whole header at once: token, pair, nexp, le[0..15] */
        const uint4 *rec = (const uint4 *)(slice + fr_off_record(&L, (uint32_t)i));
        uint4 h0 = rec[0];
        uint4 h1 = L.rec_hdr > 16 ? rec[1] : make_uint4(0, 0, 0, 0);
        uint4 h2 = L.rec_hdr > 32 ? rec[2] : make_uint4(0, 0, 0, 0);
        nexp = (int)(h0.z & 0xffff);
        tk = h0.x;
        pr = h0.y;
        /* what indexing needs; the rest is checked by block 0 */
        if (nexp < 1 || nexp > (int)L.kmax || pr + (uint32_t)nexp > (uint32_t)npairs ||
            tk >= (uint32_t)L.T) {
            fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, i);
            nexp = 0;
        }
        wd[0] = h0.w, wd[1] = h1.x, wd[2] = h1.y, wd[3] = h1.z;
        wd[4] = h1.w, wd[5] = h2.x, wd[6] = h2.y, wd[7] = h2.z;
        /* one block (record i mod G) checks the experts fully: in range
         * and none repeated (a repeated one would leave a pair rowless) */
        if (i % min(G, (int)L.El) == y) { /* blocks past E_local do not get here */
            bool bad = false;
#pragma unroll
            for (int j = 0; j < FR_MAX_TOPK; j++) {
                uint32_t v = (wd[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                bad = bad || (j < nexp && v >= L.El);
#pragma unroll
                for (int j2 = 0; j2 < j; j2++)
                    bad = bad || (j < nexp && v == ((wd[j2 >> 1] >> (16 * (j2 & 1))) & 0xffffu));
            }
            if (bad)
                fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, i);
        }
    }
    for (int m0 = 0; m0 < nmine; m0 += FR_DR_GROUP) {
        int mn = min(FR_DR_GROUP, nmine - m0);
        for (int m = 0; m < mn; m++) {
            int le = y + (m0 + m) * G, jf = -1;
#pragma unroll
            for (int j = 0; j < FR_MAX_TOPK; j++) {
                uint32_t v = (wd[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                jf = j < nexp && v == (uint32_t)le ? j : jf;
            }
            unsigned int bal = __ballot_sync(0xffffffffu, jf >= 0);
            if (lane == 0)
                cw[m * nw + w] = __popc(bal);
        }
        __syncthreads();
        for (int m = threadIdx.x; m < mn; m += blockDim.x) {
            int base = run[m0 + m];
            for (int w2 = 0; w2 < nw; w2++) {
                int c = cw[m * nw + w2];
                cw[m * nw + w2] = base;
                base += c;
            }
            run[m0 + m] = base;
        }
        __syncthreads();
        for (int m = 0; m < mn; m++) {
            int le = y + (m0 + m) * G, jf = -1;
#pragma unroll
            for (int j = 0; j < FR_MAX_TOPK; j++) {
                uint32_t v = (wd[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                jf = j < nexp && v == (uint32_t)le ? j : jf;
            }
            unsigned int bal = __ballot_sync(0xffffffffu, jf >= 0);
            if (!bal)
                continue;
            int pos = 0, below = __popc(bal & ((1u << lane) - 1));
            if (lane == 0)
                pos = atomicAdd(nlist, __popc(bal));
            pos = __shfl_sync(0xffffffffu, pos, 0);
            if (jf >= 0) {
                /* a row past the capacity (only after an input error a
                 * sender reported) is dropped */
                int r = cw[m * nw + w] + below;
                fr_dr_item_t it = {i, r < (int)L.cap ? (int32_t)((size_t)le * L.cap + r) : -1,
                                   jf, (int32_t)pr, (int32_t)tk};
                list[pos + below] = it;
            }
        }
        __syncthreads(); /* cw is reused by the next group */
    }
}

/* Copying, the whole block over (item, 16 bytes) pairs: every thread keeps
 * FR_DR_UNROLL loads in flight (a warp per item left most of the block
 * idle and every item a chain of dependent loads); then the scales, the
 * sources and the combine map. */
#define FR_DR_UNROLL 4
static __device__ void fr_dr_copy(const fr_cu_args_t &A, int set, int s, const uint8_t *slice,
                                  const fr_dr_item_t *list, int n, const fr_dr_out_t &o)
{
    const fr_layout_t &L = A.L;
    int n16 = (int)(L.tok_bytes / 16), tot = n * n16, step = blockDim.x * FR_DR_UNROLL;
    for (int b0 = threadIdx.x; b0 < tot; b0 += step) {
        int4 v[FR_DR_UNROLL];
        int4 *d[FR_DR_UNROLL];
#pragma unroll
        for (int u = 0; u < FR_DR_UNROLL; u++) {
            int f = b0 + u * (int)blockDim.x;
            d[u] = NULL;
            if (f < tot) {
                int e = f / n16, c = f - e * n16;
                fr_dr_item_t it = list[e];
                if (it.row >= 0) {
                    v[u] = ((const int4 *)(slice + fr_off_record(&L, (uint32_t)it.i) + L.rec_hdr))[c];
                    d[u] = (int4 *)(o.ex + (size_t)it.row * L.tok_bytes) + c;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < FR_DR_UNROLL; u++)
            if (d[u])
                *d[u] = v[u];
    }
    int ns = (int)L.nscales;
    for (int f = threadIdx.x; f < n * ns; f += blockDim.x) {
        int e = f / ns, c = f - e * ns;
        fr_dr_item_t it = list[e];
        if (it.row < 0)
            continue;
        const float *rs = (const float *)(slice + fr_off_record(&L, (uint32_t)it.i) +
                                          L.rec_hdr + L.tok_bytes);
        o.exs[(size_t)it.row * ns + c] = rs[c];
    }
    int32_t *prow = A.pair_row + (size_t)set * L.send_crows + (size_t)s * L.T * L.kmax;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        fr_dr_item_t it = list[e];
        if (it.row >= 0 && o.src_rank)
            o.src_rank[it.row] = s;
        if (it.row >= 0 && o.src_token)
            o.src_token[it.row] = it.token;
        prow[it.pair + it.j] = it.row;
    }
}

/* The receive part, for the round of `epoch`. Senders in the order of
 * the rows: this rank, then rank + 1, ... (mod N). direct: the send part
 * of this kernel wrote this rank's own tokens in place (self_run rows per
 * own expert). Blocks past the experts (a grid larger than E_local, in
 * the one-launch kernel) have nothing to do. */
static __device__ __forceinline__ void fr_dr_run(const fr_cu_args_t &A, int set,
                                                 const fr_dr_out_t &o,
                                                 unsigned long long epoch, bool direct)
{
    extern __shared__ int32_t run[]; /* fr_dr_smem: run[nmine], counts, items */
    const fr_layout_t &L = A.L;
    int N = A.N, y = blockIdx.x, G = gridDim.x;
    if (y >= (int)L.El || (direct && fr_cu_failed(A)))
        return;
    int nmine = ((int)L.El - y + G - 1) / G; /* experts y, y + G, ... */
    int nmax = ((int)L.El + G - 1) / G, chunk = fr_dr_chunk(nmax, (int)L.kmax, blockDim.x);
    int32_t *cw = run + ((nmax + 3) & ~3);
    fr_dr_item_t *list = (fr_dr_item_t *)(cw + FR_DR_GROUP * (FR_DR_THREADS / 32));
    __shared__ int s_ok, s_count, s_np, s_nlist;
    __shared__ unsigned long long s_epoch;
    if (threadIdx.x == 0) {
        s_epoch = epoch;
        s_nlist = 0;
    }
    for (int i = threadIdx.x; i < nmine; i += blockDim.x)
        run[i] = direct ? A.self_run[set * L.El + y + i * G] : 0;
    FR_TR_DECL;
    FR_TR();
    for (int si = direct ? 1 : 0; si < N; si++) {
        int s = A.rank + si < N ? A.rank + si : A.rank + si - N;
        __syncthreads(); /* everyone has read the previous sender's s_count, s_np */
        if (threadIdx.x == 0) {
            s_ok = fr_dr_wait(A, set, s, s_epoch);
            const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)(A.seg + fr_off_drecv(&L, set, s));
            s_count = s_ok ? (int)h->count : 0;
            s_np = s_ok ? (int)h->npairs : 0;
            if (s_ok && y == 0) {
                A.pair_n[set * N + s] = s_np;
                A.scomb_off[set * N + s] = (int32_t)h->comb_off;
            }
        }
        __syncthreads();
        if (si == 0 || (direct && si == 1))
            FR_TR();
        if (!s_ok)
            return;
        int count = s_count, np = s_np;
        const uint8_t *slice = A.seg + fr_off_drecv(&L, set, s);
        for (int c0 = 0; c0 < count; c0 += chunk) {
            int c1 = min(count, c0 + chunk);
            fr_dr_find(A, s, slice, c0, c1, np, nmine, run, cw, list, &s_nlist);
            __syncthreads();
            if (si == (int)direct && c0 == 0)
                FR_TR();
            fr_dr_copy(A, set, s, slice, list, s_nlist, o);
            __syncthreads();
            if (si == (int)direct && c0 == 0)
                FR_TR();
            if (threadIdx.x == 0)
                s_nlist = 0;
            __syncthreads();
        }
    }
    for (int m = threadIdx.x; m < nmine; m += blockDim.x)
        o.counts[y + m * G] = run[m];
    FR_TR();
    FR_TR_PRINT("drecv wait0,find0,copy0,rest", s_epoch);
}

__global__ void __launch_bounds__(FR_DR_THREADS, 2)
fr_cu_dispatch_recv(fr_cu_args_t A, int set, fr_dr_out_t o)
{
    fr_dr_run(A, set, o, A.epoch[set], false);
}

/* Both parts in one launch: every block sends its tokens, then receives
 * its experts. The grid must be resident at once (blocks wait for the
 * other blocks' sends): the launcher caps it at what the GPU holds. */
template <bool VEC>
__global__ void __launch_bounds__(FR_DS_THREADS, 2)
fr_cu_dispatch(fr_cu_args_t A, int set, const uint16_t *x, const float *x_scales,
               const int64_t *idx, int T_host, const int32_t *T_dev, fr_dr_out_t o,
               bool direct)
{
    unsigned long long epoch =
        fr_ds_run<VEC>(A, set, x, x_scales, idx, T_host, T_dev, direct ? &o : NULL);
    __syncthreads(); /* the shared memory changes hands */
    fr_dr_run(A, set, o, epoch, direct);
}

/* ---------------------------------------------------------------------- */
/* launchers                                                              */

extern "C" int fr_cuda_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    int blocks = c->nblocks < ep->L.T ? c->nblocks : ep->L.T;
    blocks = blocks < 1 ? 1 : blocks;
    size_t smem = fr_ds_smem(ep->N);
    bool vec = ((uintptr_t)in->x & 15) == 0 && ((uintptr_t)in->x_scales & 3) == 0;
    if (vec)
        fr_cu_dispatch_send<true><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, (const uint16_t *)in->x, in->x_scales, in->topk_idx, in->num_tokens,
            in->num_tokens_dev);
    else
        fr_cu_dispatch_send<false><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, (const uint16_t *)in->x, in->x_scales, in->topk_idx, in->num_tokens,
            in->num_tokens_dev);
    return fr_cuda_launch_check(ep, "dispatch_send");
}

extern "C" int fr_cuda_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)out->stream;
    int set = (int)(r->epoch % FR_NSETS);
    /* a block per group of local experts; blocks that wait for peers hold
     * SMs, so never more than num_sms of them */
    int blocks = c->nblocks < (int)ep->L.El ? c->nblocks : (int)ep->L.El;
    blocks = blocks < 1 ? 1 : blocks;
    size_t smem = fr_dr_smem((int)ep->L.El, blocks);
    fr_dr_out_t o = {(uint8_t *)out->expert_x, out->expert_x_scales, out->expert_num_tokens,
                     out->expert_src_rank, out->expert_src_token};
    fr_cu_dispatch_recv<<<blocks, FR_DR_THREADS, smem, st>>>(c->a, set, o);
    return fr_cuda_launch_check(ep, "dispatch_recv");
}

extern "C" int fr_cuda_dispatch(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in,
                                const ferry_dispatch_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    bool vec = ((uintptr_t)in->x & 15) == 0 && ((uintptr_t)in->x_scales & 3) == 0;
    /* own tokens straight into own expert rows: self on the IPC path */
    bool direct = !c->host_seg && ep->L.El <= FR_DS_DIRECT_MAX;
    if (c->dgrid == 0) {
        /* Blocks wait for each other: never more than the GPU holds at
         * once, for either variant, with the most shared memory either
         * part can take (a grid of one). */
        size_t worst = fr_dr_smem((int)ep->L.El, 1);
        size_t sw = fr_ds_smem_direct(ep->N, (int)ep->L.El, 1);
        worst = worst > sw ? worst : sw;
        int a = 0, b = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, fr_cu_dispatch<true>, FR_DS_THREADS,
                                                          worst) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, fr_cu_dispatch<false>, FR_DS_THREADS,
                                                          worst) != cudaSuccess) {
            (void)cudaGetLastError();
            a = b = 0;
        }
        c->dgrid = (a < b ? a : b) * c->nsm;
        if (c->dgrid < 1) {
            c->dgrid = -1; /* two launches from now on */
            FR_LOG_INFO(FR_SUB_EP, "dispatch: the one-launch kernel does not fit; "
                                   "sending and receiving in two launches");
        }
    }
    if (c->dgrid < 0) {
        int rc = fr_cuda_dispatch_send(ep, r, in);
        return rc ? rc : fr_cuda_dispatch_recv(ep, r, out);
    }
    int blocks = c->nblocks < c->dgrid ? c->nblocks : c->dgrid;
    size_t ssend = direct ? fr_ds_smem_direct(ep->N, (int)ep->L.El, blocks) : fr_ds_smem(ep->N);
    size_t srecv = fr_dr_smem((int)ep->L.El, blocks);
    size_t smem = ssend > srecv ? ssend : srecv;
    fr_dr_out_t o = {(uint8_t *)out->expert_x, out->expert_x_scales, out->expert_num_tokens,
                     out->expert_src_rank, out->expert_src_token};
    if (vec)
        fr_cu_dispatch<true><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, (const uint16_t *)in->x, in->x_scales, in->topk_idx, in->num_tokens,
            in->num_tokens_dev, o, direct);
    else
        fr_cu_dispatch<false><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, (const uint16_t *)in->x, in->x_scales, in->topk_idx, in->num_tokens,
            in->num_tokens_dev, o, direct);
    return fr_cuda_launch_check(ep, "dispatch");
}
