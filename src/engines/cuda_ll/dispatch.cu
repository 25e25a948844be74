/*
 * Dispatch of the CUDA low-latency engine: a send part and a receive part,
 * one kernel (ferry::dispatch) run as one launch for both (behind
 * ferry_dispatch) or launched once per part (behind dispatch_send /
 * dispatch_recv).
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
 *      that finishes one fills its slice and rings that peer's doorbell.
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
    long long *wait_cost; /* optional [N]: block 0's wait per sender, clock64 cycles */
    int32_t *stats;       /* optional [El]: counts added (recv_stats) */
} fr_dr_out_t;

/* threads per block of ferry::dispatch, whichever parts a launch runs */
#define FR_DS_THREADS 512

static __device__ __forceinline__ uint8_t *fr_cu_dslice(const fr_cu_args_t &A, int set, int d)
{
    if (A.path[d] == FR_PATH_FABRIC)
        return A.send + fr_off_dsend(&A.L, set, d);
    return A.peer[d] + fr_off_drecv(&A.L, set, A.rank);
}

/* Of a token's experts ek[], how many are on the rank owning [lo, lo + El). */
static __device__ __forceinline__ int fr_ds_np(const int *ek, int lo, int El)
{
    int np = 0;
#pragma unroll
    for (int k = 0; k < FR_MAX_TOPK; k++)
        np += ek[k] >= lo && ek[k] < lo + El;
    return np;
}

/* Expert e as the send part sees it: -1 when it lives on a masked rank
 * (mk: the mask in shared memory); an index outside 0..E-1 stays as it is
 * (reported by fr_ds_pair). MK false (no rank masked, the kernel's usual
 * path): e itself, at no cost in the per-slot loops. */
template <bool MK>
static __device__ __forceinline__ int fr_ds_cut(int e, const int32_t *mk, int El, int E)
{
    return MK && e >= 0 && e < E && mk[e / El] ? -1 : e;
}

/* Token t's experts into ek[] (-1 past K or past T); 16-byte loads when
 * the rows allow (K even, idx 16-byte aligned). */
static __device__ __forceinline__ void fr_ds_row(const int64_t *idx, int t, int T, int K,
                                                 bool v16, int *ek)
{
    const int64_t *row = idx + (size_t)t * K;
    if (v16) {
#pragma unroll
        for (int j = 0; j < FR_MAX_TOPK / 2; j++) {
            longlong2 v = 2 * j < K && t < T ? ((const longlong2 *)row)[j]
                                             : make_longlong2(-1, -1);
            ek[2 * j] = (int)v.x;
            ek[2 * j + 1] = (int)v.y;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < FR_MAX_TOPK; k++)
        ek[k] = k < K && t < T ? (int)row[k] : -1;
}

/* Step 1. sh: [0,N) records before `start`, [N,2N) pairs before, [2N,3N)
 * records in all, [3N,4N) pairs in all. A lane holds one token's row (all
 * K loads in flight at once); per destination, ballots count the records
 * and warp sums the pairs. Indices outside 0..E-1 count nowhere (step 3
 * reports them). */
template <bool MK>
static __device__ void fr_ds_count(const fr_cu_args_t &A, const int64_t *idx, int T,
                                   int start, int32_t *sh, int32_t *hb, int32_t *hall,
                                   const int32_t *mk, int *en, bool pre)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    bool v16 = K % 2 == 0 && ((uintptr_t)idx & 15) == 0;
    /* the next group's rows are loaded while this one is counted; the
     * first group's in the prologue already when T was known (pre) */
    int ek[FR_MAX_TOPK];
    if (!pre)
        fr_ds_row(idx, w * 32 + lane, T, K, v16, en);
    for (int t0 = w * 32; t0 < T; t0 += nw * 32) {
        int t = t0 + lane;
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            ek[k] = fr_ds_cut<MK>(en[k], mk, El, L.E);
        fr_ds_row(idx, t + nw * 32, T, K, v16, en);
        bool before = t < start;
        /* per expert, this rank's pairs before `start` (hb) and from it
         * on (hall, made the total by fr_ds_count_total): rows of a
         * peer's expert follow this rank's tokens in order. One atomic
         * per pair. A repeated expert (an input error, reported by
         * fr_ds_pair) counts twice here and in fr_ds_rank alike. */
        int32_t *h = before ? hb : hall;
#pragma unroll
        for (int k = 0; k < FR_MAX_TOPK; k++)
            if (ek[k] >= 0 && ek[k] < L.E)
                atomicAdd(&h[ek[k]], 1);
        for (int d = 0; d < N; d++) {
            int np = fr_ds_np(ek, d * El, El);
            unsigned int has = __ballot_sync(0xffffffffu, np > 0);
            if (!has)
                continue;
            unsigned int hbal = __ballot_sync(0xffffffffu, np > 0 && before);
            int sp = __reduce_add_sync(0xffffffffu, np);
            int sb = __reduce_add_sync(0xffffffffu, before ? np : 0);
            if (lane == 0) {
                atomicAdd(&sh[d], __popc(hbal));
                atomicAdd(&sh[N + d], sb);
                atomicAdd(&sh[2 * N + d], __popc(has));
                atomicAdd(&sh[3 * N + d], sp);
            }
        }
    }
}

/* After fr_ds_count (and a barrier): hall[e] += hb[e], the rank's pairs
 * of expert e in all. */
static __device__ __forceinline__ void fr_ds_count_total(int E, const int32_t *hb, int32_t *hall)
{
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hall[e] += hb[e];
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
/* Blocks of at most 32 tokens (decode: T up to 32 x the grid) keep their
 * tokens' record index and first pair per destination in shared memory
 * ([N][32] each, after the mask) up to this many ranks, else in rec_idx /
 * pair_base. */
#define FR_DS_SMALL_N 64
static __host__ __device__ size_t fr_ds_smem(int N, int E)
{
    return (sizeof(uint8_t *) + sizeof(int32_t) * 6) * (size_t)N +
           2 * sizeof(int32_t) * FR_DS_GROUP * (FR_DS_THREADS / 32) +
           2 * sizeof(int32_t) * (size_t)E + /* hb, hall; then the mask [N] */
           (N <= FR_DS_SMALL_N ? 2 * sizeof(int32_t) * 32 * (size_t)N : 0);
}

/* Step 2 for a block of at most 32 tokens: warp 0 alone, a token per
 * lane, no block barrier. Per destination, the record index from a
 * ballot and the first pair from the lanes before (a ballot per bit of
 * the lane's pair count: independent, where a shuffle scan is a chain),
 * from the counts of the tokens before `start` (sh[0, 2N)). Into sri /
 * spb [d][lane] when given (shared memory), else rec_idx / pair_base. */
template <bool MK>
static __device__ void fr_ds_index_warp(const fr_cu_args_t &A, int set, const int64_t *idx,
                                        int start, int end, const int32_t *sh,
                                        const int32_t *mk, int32_t *sri, int32_t *spb)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El, lane = threadIdx.x & 31, t = start + lane;
    unsigned int lt = (1u << lane) - 1;
    int ek[FR_MAX_TOPK];
    fr_ds_row(idx, t, end, K, K % 2 == 0 && ((uintptr_t)idx & 15) == 0, ek);
#pragma unroll
    for (int k = 0; k < FR_MAX_TOPK; k++)
        ek[k] = fr_ds_cut<MK>(ek[k], mk, El, L.E);
    for (int d = 0; d < N; d++) {
        int np = fr_ds_np(ek, d * El, El); /* 0..FR_MAX_TOPK: 5 bits */
        unsigned int bal = __ballot_sync(0xffffffffu, np > 0);
        int before = 0;
#pragma unroll
        for (int b = 0; b < 5; b++)
            before += __popc(__ballot_sync(0xffffffffu, (np >> b) & 1) & lt) << b;
        if (t >= end)
            continue;
        int ri = np ? sh[d] + __popc(bal & lt) : -1, pb = sh[N + d] + before;
        if (sri) {
            sri[d * 32 + lane] = ri;
            spb[d * 32 + lane] = pb;
        } else {
            size_t at = ((size_t)set * L.T + t) * N + d;
            A.rec_idx[at] = ri;
            A.pair_base[at] = pb;
        }
    }
}

template <bool MK>
static __device__ void fr_ds_index(const fr_cu_args_t &A, int set, const int64_t *idx,
                                   int start, int end, int32_t *sh, int32_t *cw,
                                   const int32_t *mk)
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
            ek[k] = fr_ds_cut<MK>(k < K && t < end ? (int)idx[(size_t)t * K + k] : -1, mk, El, L.E);
        for (int d0 = 0; d0 < N; d0 += FR_DS_GROUP) {
            int dn = min(FR_DS_GROUP, N - d0);
            for (int dd = 0; dd < dn; dd++) {
                int np = fr_ds_np(ek, (d0 + dd) * El, El);
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
                int np = fr_ds_np(ek, (d0 + dd) * El, El);
                unsigned int bal = __ballot_sync(0xffffffffu, np > 0);
                /* pairs of the lanes up to this one */
                int x = (int)fr_warp_incl_scan((unsigned int)np);
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
template <bool MK>
static __device__ void fr_ds_pair(const fr_cu_args_t &A, int set, const int64_t *idx, int t,
                                  int k, const int32_t *co, uint8_t *const *sbase, int *s_bad,
                                  bool direct, const int32_t *mk, const int32_t *sri,
                                  const int32_t *spb, int start)
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
    uint8_t **ds = A.dst_scl + ((size_t)set * L.T + t) * K + k;
    int32_t *cpos = A.comb_pos + ((size_t)set * L.T + t) * K + k;
    bool bad = e < -1 || e >= L.E;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++)
        bad = bad || (j < k && e >= 0 && r[j] == e);
    /* a masked rank's slot: -1 (its rank's other slots are cut alike, so
     * the record lists and places below, which look at the slot's own
     * rank only, never see one) */
    e = bad ? e : (int64_t)fr_ds_cut<MK>((int)e, mk, El, L.E);
    /* an own expert written in place: fr_ds_rank owns the slot */
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
    int pb = spb ? spb[d * 32 + t - start] : A.pair_base[at];
    int ri = sri ? sri[d * 32 + t - start] : A.rec_idx[at];
    *cpos = (co[d] + pb + before) | (A.mixed && A.path[d] == FR_PATH_SHM ? FR_CPOS_IPC : 0);
    if (before || mine)
        return;
    uint8_t *rec = sbase[d] + fr_off_record(&L, (uint32_t)ri);
    fr_rec_hdr_t *h = (fr_rec_hdr_t *)rec;
    uint16_t n = 0;
#pragma unroll
    for (int j = 0; j < FR_MAX_TOPK; j++)
        if (j >= k && r[j] >= lo && r[j] < hi && n < L.kmax) /* more only with a repeat (reported) */
            h->le[n++] = (uint16_t)(r[j] - lo);
    h->token = (uint32_t)t;
    h->pair = (uint32_t)pb;
    h->nexp = n;
    h->reserved = 0;
    *dr = rec + L.rec_hdr;
    *ds = rec + L.rec_hdr + L.tok_bytes;
}

/* fr_ds_rank's barrier: the warp's alone (solo) or the block's. */
static __device__ __forceinline__ void fr_ds_rank_sync(bool solo)
{
    if (solo)
        __syncwarp();
    else
        __syncthreads();
}

/* fr_ds_rank's s_e lives in fr_ds_index's per-warp counts */
static_assert(2 * FR_DS_GROUP * (FR_DS_THREADS / 32) >= FR_DS_THREADS,
              "fr_ds_rank: s_e does not fit the per-warp counts");

/* Step 3b, the whole block over its (token, k) pairs in order,
 * blockDim.x at a time: a pair's row among this rank's pairs of its
 * expert, in token order: hb (fr_ds_count's pairs before the block) plus
 * the same expert's pairs earlier in the pass (earlier warps' from shared
 * memory, earlier lanes' by a match). Peers' experts: the row goes into
 * the record's pos[] (the receiver places it without a search). Own
 * experts in place (own): the token's slot k points at that row of
 * expert_x, with the combine row map and the sources. solo (the block's
 * pairs fit one warp): warp 0 alone, beside the others' fr_ds_pair, with
 * warp barriers. Ends with a barrier (hb moved on past the pass). */
template <bool MK>
static __device__ void fr_ds_rank(const fr_cu_args_t &A, int set, const int64_t *idx, int start,
                                  int end, int32_t *hb, uint8_t *const *sbase,
                                  const fr_dr_out_t &o, bool own, bool solo, int *s_e,
                                  const int32_t *mk,
                                  const int32_t *sri, const int32_t *spb)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, El = L.El, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    /* s_e [FR_DS_THREADS]: the pass's experts (-1: none), in fr_ds_index's
     * per-warp counts (dynamic shared memory, free by now) */
    int32_t *prow = A.pair_row + (size_t)set * L.send_crows + (size_t)A.rank * L.T * L.kmax;
    int n = (end - start) * K, pmax = (int)(L.T * L.kmax);
    unsigned int lt = (1u << lane) - 1;
    const int64_t *base = idx + (size_t)start * K;
    const int32_t *pbase = A.pair_base + (size_t)set * L.T * N;
    const int32_t *ridx = A.rec_idx + (size_t)set * L.T * N;
    bool whole = 32 % K == 0; /* a token's slots in one warp */
    int step = solo ? 32 : (int)blockDim.x;
    for (int f0 = 0; f0 < n; f0 += step) {
        int f = f0 + (int)threadIdx.x;
        int64_t e64 = f < n ? base[f] : -1;
        int t = start + f / K, k = f - (t - start) * K;
        bool ok = f < n && e64 >= 0 && e64 < L.E && fr_ds_cut<MK>((int)e64, mk, El, L.E) >= 0;
        int e = ok ? (int)e64 : -1;
        int d = ok ? e / El : -1;
        int pb = !ok ? 0 : spb ? spb[A.rank * 32 + t - start] : pbase[(size_t)t * N + A.rank];
        s_e[threadIdx.x] = e;
        /* the token's earlier slots on rank d: the pair's place in the
         * record's list */
        int before = 0;
        if (whole) {
            unsigned long long kd = ok ? ((unsigned long long)t << 20) | (unsigned int)d
                                       : ~0ull - lane;
            before = __popc(__match_any_sync(0xffffffffu, kd) & lt);
        } else if (ok) {
            for (int j = 0; j < k; j++) {
                int64_t ej = idx[(size_t)t * K + j];
                before += ej >= (int64_t)d * El && ej < (int64_t)(d + 1) * El;
            }
        }
        unsigned int m = __match_any_sync(0xffffffffu, ok ? (unsigned int)e : ~0u - lane);
        fr_ds_rank_sync(solo);
        int pos = 0;
        if (ok) {
            pos = hb[e] + __popc(m & lt);
            for (int j = 0; j < w * 32; j++) /* the same address warp-wide: broadcasts */
                pos += s_e[j] == e;
        }
        fr_ds_rank_sync(solo);
        if (ok)
            atomicAdd(&hb[e], 1); /* after every pos of the pass was read */
        if (ok && own && d == A.rank) {
            int le = e - A.rank * El;
            size_t at = ((size_t)set * L.T + t) * K + k;
            bool fits = pos < (int)L.cap;
            size_t row = (size_t)le * L.cap + pos;
            A.dst_rec[at] = fits ? o.ex + row * L.tok_bytes : NULL;
            A.dst_scl[at] = fits && o.exs ? fr_cu_scl_own(L, fr_scl_at(&L, o.exs, le, pos))
                                            : NULL;
            if (pb + before < pmax)
                prow[pb + before] = fits ? (int32_t)row : -1;
            if (fits && o.src_rank)
                o.src_rank[row] = A.rank;
            if (fits && o.src_token)
                o.src_token[row] = t;
        } else if (ok) {
            int ri = sri ? sri[d * 32 + t - start] : ridx[(size_t)t * N + d];
            if (ri >= 0 && before < L.kmax)
                ((uint32_t *)(sbase[d] + fr_off_record(&L, (uint32_t)ri) + L.rec_pos))[before] =
                    (uint32_t)pos;
        }
        fr_ds_rank_sync(solo); /* hb and s_e are read by the next pass */
    }
}

/* Quantise 16 channels per lane (a 128-channel block per 8 lanes: amax
 * over the group, hardware e4m3 conversion) and store them, with the
 * block's scale, to every place of the token (records, own rows). */
static __device__ __forceinline__ void fr_ds_qstore(const fr_cu_args_t &A, uint8_t *mine,
                                                    uint8_t *msc, uint4 v0, uint4 v1, bool on,
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
    float amax = fr_bf16_to_f32(m), inv = fr_fp8_inv_scale_r(amax, A.round_scale);
    uint4 q = make_uint4(fr_cu_e4m3x4(wv[0], wv[1], inv), fr_cu_e4m3x4(wv[2], wv[3], inv),
                         fr_cu_e4m3x4(wv[4], wv[5], inv), fr_cu_e4m3x4(wv[6], wv[7], inv));
    float sc = fr_fp8_scale_r(amax, A.round_scale);
    /* lane i holds the token's slot i (where its data goes, or NULL) */
    for (int i = 0; i < A.kd; i++) {
        uint8_t *p = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, i);
        uint8_t *ps = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)msc, i);
        if (!p || !on)
            continue;
        ((uint4 *)p)[g] = q;
        if ((g & 7) == 0)
            fr_cu_scl_put(A.L, ps, g >> 3, sc);
    }
}

/* Step 4, one warp-task: 512 channels (quantised) or 512 bytes (copied) of
 * token t, chunk c, to every place of the token (lane i holds slot i). */
template <bool VEC>
static __device__ __forceinline__ void fr_ds_chunk(const fr_cu_args_t &A, uint8_t *const *dr,
                                                   uint8_t *const *ds, const uint16_t *xrow,
                                                   const float *scl, bool quant, int c)
{
    const fr_layout_t &L = A.L;
    int lane = threadIdx.x & 31, kd = A.kd, g = c * 32 + lane;
    uint8_t *mine = lane < kd ? dr[lane] : NULL;
    uint8_t *msc = lane < kd ? ds[lane] : NULL;
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
        uint8_t *ps = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)msc, i);
        if (p && g < n16)
            ((uint4 *)p)[g] = v;
        if (ps && scl && c == 0)
            for (int q = lane; q < (int)L.nscales; q += 32)
                fr_cu_scl_put(L, ps, q, scl[q]);
    }
}

/* An NVFP4 scale byte g of a token to slot pointer ps (a dst_scl entry):
 * a record's scale bytes in order, or (tagged) an own row's place in the
 * 128 x 4 layout, byte g % 4 of word g / 4 (fr_scl_put). */
static __device__ __forceinline__ void fr_cu_sf_put(uint8_t *ps, int g, uint8_t b)
{
    if ((uintptr_t)ps & 1u)
        ((uint8_t *)((uintptr_t)ps & ~(uintptr_t)1))[512 * (g >> 2) + (g & 3)] = b;
    else
        ps[g] = b;
}

/* Step 4 with the NVFP4 dtype: lane g of a warp-task (512 channels of a
 * token) quantises its 16 channels (one scale block: amax, the e4m3 scale
 * from gs, e2m1 codes, fr_nvfp4_block_r as on CPU ranks; rgs = 1 / gs)
 * and stores 8 code bytes and its scale byte to every place of the token
 * (dr, ds: the token's slot pointers; lane i holds slot i). */
static __device__ __forceinline__ void fr_ds_nvfp4_put(const fr_cu_args_t &A, uint8_t *mine,
                                                       uint8_t *msc, uint4 a, uint4 b,
                                                       float gs, float rgs, bool on, int g)
{
    uint16_t v[16];
    memcpy(v, &a, 16);
    memcpy(v + 8, &b, 16);
    uint8_t q[8], sf;
    fr_nvfp4_block_r(v, gs, rgs, q, &sf);
    uint2 qv;
    memcpy(&qv, q, 8);
    for (int i = 0; i < A.kd; i++) {
        uint8_t *p = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, i);
        uint8_t *ps = (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)msc, i);
        if (!p || !on)
            continue;
        ((uint2 *)p)[g] = qv;
        if (ps)
            fr_cu_sf_put(ps, g, sf);
    }
}

/* One warp-task: token t, chunk c (slot pointers dr, ds). */
template <bool VEC>
static __device__ __forceinline__ void fr_ds_nvfp4(const fr_cu_args_t &A, uint8_t *const *dr,
                                                   uint8_t *const *ds, const uint16_t *xrow,
                                                   float gs, float rgs, int c)
{
    const fr_layout_t &L = A.L;
    int lane = threadIdx.x & 31, kd = A.kd, g = c * 32 + lane;
    uint8_t *mine = lane < kd ? dr[lane] : NULL;
    uint8_t *msc = lane < kd ? ds[lane] : NULL;
    bool on = g < (int)(L.H / 16);
    uint4 a = make_uint4(0, 0, 0, 0), b = a;
    if (on && VEC) {
        a = ((const uint4 *)xrow)[2 * g];
        b = ((const uint4 *)xrow)[2 * g + 1];
    } else if (on) {
        uint16_t v[16];
        for (int i = 0; i < 16; i++)
            v[i] = xrow[16 * g + i];
        memcpy(&a, v, 16);
        memcpy(&b, v + 8, 16);
    }
    fr_ds_nvfp4_put(A, mine, msc, a, b, gs, rgs, on, g);
}

/* Step 4 for two warp-tasks at once (bf16 input quantised, 16-byte
 * aligned): both tasks' loads are in flight before either is converted,
 * to fp8 (fr_ds_qstore) or, NV, to NVFP4 (fr_ds_nvfp4_put with gs, rgs). */
template <bool NV>
static __device__ __forceinline__ void fr_ds_quant2(const fr_cu_args_t &A, int set,
                                                    const uint16_t *x, int start, int chunks,
                                                    int j0, int j1, float gs, float rgs)
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
    uint8_t *s0 = lane < A.kd ? A.dst_scl[a0i] : NULL, *s1 = lane < A.kd ? A.dst_scl[a1i] : NULL;
    uint4 a0 = g0 < hg ? r0[2 * g0] : z, a1 = g0 < hg ? r0[2 * g0 + 1] : z;
    uint4 b0 = g1 < hg ? r1[2 * g1] : z, b1 = g1 < hg ? r1[2 * g1 + 1] : z;
    if (NV) {
        fr_ds_nvfp4_put(A, m0, s0, a0, a1, gs, rgs, g0 < hg, g0);
        fr_ds_nvfp4_put(A, m1, s1, b0, b1, gs, rgs, g1 < hg, g1);
    } else {
        fr_ds_qstore(A, m0, s0, a0, a1, g0 < hg, g0);
        fr_ds_qstore(A, m1, s1, b0, b1, g1 < hg, g1);
    }
}

/* Step 5: this block is done with every destination; whoever finishes one
 * publishes it (on the fabric path: rings that peer's doorbell). */
static __device__ void fr_ds_finish(const fr_cu_args_t &A, int set, unsigned long long epoch,
                                    const int32_t *sh, uint8_t *const *sbase,
                                    const int32_t *hall, const int32_t *mk)
{
    const fr_layout_t &L = A.L;
    int N = A.N;
    /* the block's stores, a barrier, one system fence by thread 0, a
     * barrier, then the counts (threads 0..N-1). Unlike fr_cu_arrive the
     * fence and the adds are not in one thread: what orders them for the
     * proxy is the publishing thread's own system fence after its add saw
     * the grid's count complete (fences order fences), so that fence must
     * stay (or the adds become acq_rel) */
    __syncthreads();
    if (threadIdx.x == 0)
        __threadfence_system();
    __syncthreads();
    for (int d = threadIdx.x; d < N; d += blockDim.x) {
        unsigned int *dd = A.ddone + (size_t)set * N + d;
        if (atomicAdd(dd, 1u) != gridDim.x - 1)
            continue;
        __threadfence_system();
        *dd = 0;
        int cnt = sh[2 * N + d], np = sh[3 * N + d], co = sh[4 * N + d];
        if (!fr_cu_failed(A) && !(mk && mk[d])) { /* a masked rank is sent nothing */
            uint32_t *rows = (uint32_t *)(sbase[d] + FR_SLICE_HDR);
            for (int le = 0; le < L.El; le++)
                rows[le] = (uint32_t)hall[d * L.El + le];
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
        }
    }
}

/* Step 5 on the IPC path: block 0 writes the slice headers and each
 * destination's rows per expert (every block has the exact counts), then
 * every block adds its share to every destination's flag; the last block
 * to finish advances the set's epoch (read by the next kernels). */
static __device__ void fr_ds_finish_ipc(const fr_cu_args_t &A, int set,
                                        unsigned long long epoch, const int32_t *sh,
                                        uint8_t *const *sbase, const int32_t *hall,
                                        const int32_t *mk)
{
    int N = A.N, El = A.L.El;
    /* a masked rank's memory is never written (nor its flag, fr_cu_arrive) */
    if (blockIdx.x == 0)
        for (int i = threadIdx.x; i < N * El; i += blockDim.x)
            if (!mk || !mk[i / El])
                ((uint32_t *)(sbase[i / El] + FR_SLICE_HDR))[i % El] = (uint32_t)hall[i];
    if (blockIdx.x == 0)
        for (int d = threadIdx.x; d < N; d += blockDim.x) {
            if (mk && mk[d])
                continue;
            fr_slice_hdr_t *h = (fr_slice_hdr_t *)sbase[d];
            h->magic = FR_SLICE_MAGIC;
            h->sender = (uint32_t)A.rank;
            h->epoch = epoch;
            h->count = (uint32_t)sh[2 * N + d];
            h->npairs = (uint32_t)sh[3 * N + d];
            h->comb_off = (uint32_t)sh[4 * N + d];
        }
    fr_cu_arrive(A, FR_PH_DISPATCH, set, mk); /* barrier first, then warp 0 */
    if (threadIdx.x == 0 && atomicAdd(A.dpub + set, 1u) == gridDim.x - 1) {
        A.dpub[set] = 0;
        A.epoch[set] = epoch;
    }
}

/* The send part; returns this round's epoch (the same in every thread).
 * MK: some rank is masked (the launcher's choice, from the host's view of
 * the mask): slots on masked ranks cut, nothing sent there. Without MK the
 * mask must be empty; a graph captured before a rank was masked replays
 * kernels without MK, and they fail the round saying so. */
template <bool VEC, bool MK>
static __device__ __forceinline__ unsigned long long
fr_ds_run(const fr_cu_args_t &A, int set, const uint16_t *x, const float *x_scales,
          const int64_t *idx, int T_host, const int32_t *T_dev, const fr_dr_out_t &o, bool own)
{
    /* fr_ds_smem: [N] slice bases, int32 [5][N] counts, fr_ds_index's
     * per-warp counts, hb[E], hall[E], the mask [N]. own: own experts' rows
     * written in place into o (the one-launch kernel). */
    extern __shared__ uint8_t *sbase[];
    const fr_layout_t &L = A.L;
    int N = A.N;
    int32_t *sh = (int32_t *)(sbase + N); /* fr_ds_count's, then comb_off */
    int32_t *hb = sh + 5 * N + 2 * FR_DS_GROUP * (FR_DS_THREADS / 32);
    int32_t *hall = hb + L.E, *smask = hall + L.E;
    __shared__ int s_T, s_bad;
    __shared__ unsigned long long s_epoch;
    FR_TR_DECL;
    FR_TR();
    if (threadIdx.x == 0) {
        /* every load first, so they are in flight together (the checks
         * below may call fr_cu_fail, which the later loads waited for) */
        int T = T_dev ? *T_dev : T_host;
        unsigned long long e0 = A.epoch[set];
        int nmask = A.mask[N];
        s_bad = fr_cu_failed(A);
        if (T < 0 || T > L.T) {
            fr_cu_fail(A, FERRY_ERR_INVALID, A.rank, FR_CU_WHAT_NTOK, T);
            s_bad = 1;
        }
        s_T = T;
        s_epoch = e0 + 2; /* set 1: 1, 3, 5...; set 0: 2, 4, 6... */
        if (!MK && nmask) {
            fr_cu_fail(A, FERRY_ERR_STATE, A.rank, FR_CU_WHAT_MASK, nmask);
            s_bad = 1;
        }
    }
    for (int i = threadIdx.x; i < 5 * N; i += blockDim.x)
        sh[i] = 0;
    for (int i = threadIdx.x; i < 2 * L.E; i += blockDim.x)
        hb[i] = 0; /* and hall */
    /* the slice bases (loads of path[] and peer[]) by the warps after
     * thread 0's, so both round trips overlap */
    int i0 = blockDim.x > 32 ? 32 : 0;
    for (int d = (int)threadIdx.x - i0; d >= 0 && d < N; d += (int)blockDim.x - i0) {
        sbase[d] = fr_cu_dslice(A, set, d);
        if (MK)
            smask[d] = A.mask[d];
    }
    /* T known at launch (not num_tokens_dev): the count's first rows are
     * loaded now, beside the loads above (T is checked the same below) */
    int en[FR_MAX_TOPK];
    bool pre = !T_dev && T_host >= 0 && T_host <= (int)L.T;
    if (pre)
        fr_ds_row(idx, (int)threadIdx.x, T_host, L.K, L.K % 2 == 0 && ((uintptr_t)idx & 15) == 0,
                  en);
    __syncthreads();
    const int32_t *mk = MK ? smask : NULL; /* masked ranks' slots cut */
    unsigned long long epoch = s_epoch;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        FR_TL(A, FR_PH_DISPATCH, epoch, "start", A.rank);
    if (s_bad)
        return epoch;
    int T = s_T, per = (T + gridDim.x - 1) / gridDim.x;
    int start = min(T, (int)blockIdx.x * per), end = min(T, start + per);
    FR_TR();
    fr_ds_count<MK>(A, idx, T, start, sh, hb, hall, mk, en, pre);
    __syncthreads();
    fr_ds_count_total(L.E, hb, hall);
    __syncthreads();
    /* every block the same values: its receive part reads them back */
    for (int le = threadIdx.x; own && le < L.El; le += blockDim.x)
        A.self_run[set * L.El + le] = min(hall[A.rank * L.El + le], (int)L.cap);
    if (threadIdx.x < 32) /* each destination's first row in this rank's combine region */
        fr_warp_excl_scan(sh + 3 * N, sh + 4 * N, N);
    FR_TR();
    bool small = end - start <= 32; /* the block's tokens fit warp 0 */
    /* fr_ds_index_warp's, after the mask */
    int32_t *sri = small && N <= FR_DS_SMALL_N ? smask + N : NULL;
    int32_t *spb = sri ? sri + 32 * N : NULL;
    if (!small)
        fr_ds_index<MK>(A, set, idx, start, end, sh, sh + 5 * N, mk);
    else if (threadIdx.x < 32 && start < end) /* no tokens: nothing to index */
        fr_ds_index_warp<MK>(A, set, idx, start, end, sh, mk, sri, spb);
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
        if (own && threadIdx.x == 0) { /* what the receive's own-rank visit would set */
            A.pair_n[set * N + A.rank] = sh[3 * N + A.rank];
            A.scomb_off[set * N + A.rank] = sh[4 * N + A.rank];
        }
    }
    bool solo = (end - start) * L.K <= 32;
    if (!solo || threadIdx.x < 32)
        fr_ds_rank<MK>(A, set, idx, start, end, hb, sbase, o, own, solo, sh + 5 * N, mk, sri, spb);
    /* solo: warp 0 ranks, so the pairs go to the warps after it (in warp
     * 0's lanes they ran after the ranking, in series: 6.0K -> 3.8K SM
     * cycles of block 0 at T=1) */
    int p0 = solo && blockDim.x > 32 ? 32 : 0;
    for (int i = (int)threadIdx.x - p0; i >= 0 && i < (end - start) * L.K;
         i += (int)blockDim.x - p0)
        fr_ds_pair<MK>(A, set, idx, start + i / L.K, i % L.K, sh + 4 * N, sbase, &s_bad,
                       own, mk, sri, spb, start);
    __syncthreads();
    FR_TR();
    /* NVFP4: x_scales carries x_global_scale (ferry_dispatch_in_t) */
    bool nv = L.nvfp4, quant = L.fp8 && !x_scales;
    float gs = nv ? *x_scales : 0.f, rgs = nv ? 1.0f / gs : 0.f;
    int chunks = quant || nv ? (int)((L.H + 511) / 512) : (int)((L.tok_bytes + 511) / 512);
    int w = threadIdx.x >> 5, nw = blockDim.x >> 5, ntask = (end - start) * chunks;
    int j = w;
    if (VEC && quant)
        for (; j + nw < ntask && !s_bad; j += 2 * nw)
            fr_ds_quant2<false>(A, set, x, start, chunks, j, j + nw, 0.f, 0.f);
    if (VEC && nv)
        for (; j + nw < ntask && !s_bad; j += 2 * nw)
            fr_ds_quant2<true>(A, set, x, start, chunks, j, j + nw, gs, rgs);
    for (; j < ntask && !s_bad; j += nw) {
        int t = start + j / chunks, c = j % chunks;
        if (nv) {
            fr_ds_nvfp4<VEC>(A, A.dst_rec + ((size_t)set * L.T + t) * A.kd,
                             A.dst_scl + ((size_t)set * L.T + t) * A.kd, x + (size_t)t * L.H,
                             gs, rgs, c);
            continue;
        }
        const uint16_t *xrow = quant ? x + (size_t)t * L.H
                                     : (const uint16_t *)((const uint8_t *)x + (size_t)t * L.tok_bytes);
        fr_ds_chunk<VEC>(A, A.dst_rec + ((size_t)set * L.T + t) * A.kd,
                         A.dst_scl + ((size_t)set * L.T + t) * A.kd, xrow,
                         x_scales ? x_scales + (size_t)t * L.nscales : NULL, quant, c);
    }
    FR_TR();
    if (A.nfabric > 0)
        fr_ds_finish(A, set, s_epoch, sh, sbase, hall, mk);
    else
        fr_ds_finish_ipc(A, set, s_epoch, sh, sbase, hall, mk);
    FR_TR();
    FR_TR_PRINT("dsend prologue,count,index,token,pack,finish", epoch);
    return epoch;
}

/* ---------------------------------------------------------------------- */
/* dispatch_recv                                                          */

/* Wait for sender s and check its slice header (one thread): 1 ready, 0
 * failed, 2 masked by the wait (mask_on_timeout). */
static __device__ int fr_dr_wait(const fr_cu_args_t &A, int set, int s,
                                 unsigned long long epoch, int *count, int *npairs,
                                 int *comb_off)
{
    const fr_layout_t &L = A.L;
    if (fr_cu_failed(A))
        return 0;
    int w = fr_cu_wait_peer(A, FR_PH_DISPATCH, set, s, epoch, FR_CU_WHAT_DISPATCH);
    if (w != 1)
        return w;
    /* each field read once (a peer can write the header again): what is
     * checked is what is used */
    const volatile fr_slice_hdr_t *h =
        (const volatile fr_slice_hdr_t *)(fr_cu_rseg(A, s) + fr_off_drecv(&L, set, s));
    uint32_t magic = h->magic, sender = h->sender, cnt = h->count, np = h->npairs;
    uint32_t co = h->comb_off;
    unsigned long long ep = h->epoch;
    if (magic != FR_SLICE_MAGIC || sender != (uint32_t)s || ep != epoch ||
        cnt > (uint32_t)L.T || np > (uint64_t)L.T * L.kmax ||
        (uint64_t)co + np > L.crows) {
        fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, -1);
        return 0;
    }
    *count = (int)cnt;
    *npairs = (int)np;
    *comb_off = (int)co;
    return 1;
}

/* The end of a sender's rows for one expert: its first row b plus the c
 * rows it announced, clamped to the capacity. */
static __device__ __forceinline__ int fr_dr_end(int b, uint32_t c, int cap)
{
    return c > (uint32_t)cap - (uint32_t)b ? cap : b + (int)c;
}

/* Records a block places at once (its records y, y + G, ... of a sender). */
#define FR_DR_RECS 64
/* Senders a block waits for at once, a lane of warp 0 each (a window), and
 * the most local experts whose per-sender row counts a window keeps in
 * shared memory (more: read per sender, as they come). */
#define FR_DR_WIN 32
#define FR_DR_WIN_EL 64

/* Dynamic shared memory of the receive part: per local expert the rows
 * before the current sender (base) and after it (run), then per record of
 * a batch its rows, then (El <= FR_DR_WIN_EL) the window's senders' rows
 * per expert. */
static __host__ __device__ size_t fr_dr_smem(int El)
{
    return 2 * sizeof(int32_t) * (size_t)El +
           sizeof(int32_t) * FR_DR_RECS * (FR_MAX_TOPK + 2) +
           (El <= FR_DR_WIN_EL ? sizeof(int32_t) * FR_DR_WIN * (size_t)El : 0);
}

/* Dynamic shared memory of the one-launch dispatch (its send part, then
 * its receive part, in the same blocks). */
static size_t fr_d_smem(ferry_ep_t ep)
{
    size_t ss = fr_ds_smem(ep->N, ep->L.E), sr = fr_dr_smem((int)ep->L.El);
    return ss > sr ? ss : sr;
}

/* Copying a batch, the whole block over (record, 16 bytes) pairs, every
 * thread with FR_DR_UNROLL loads in flight, each stored to the record's
 * rows; then the scales. */
#define FR_DR_UNROLL 4
static __device__ void fr_dr_copy(const fr_cu_args_t &A, const uint8_t *slice, const int32_t *ri,
                                  const int32_t *rn, const int32_t *rows, int nb,
                                  const fr_dr_out_t &o)
{
    const fr_layout_t &L = A.L;
    int n16 = (int)(L.tok_bytes / 16), tot = nb * n16, step = blockDim.x * FR_DR_UNROLL;
    for (int b0 = threadIdx.x; b0 < tot; b0 += step) {
        int4 v[FR_DR_UNROLL];
#pragma unroll
        for (int u = 0; u < FR_DR_UNROLL; u++) {
            int f = b0 + u * (int)blockDim.x;
            if (f < tot) {
                int q = f / n16, c = f - q * n16;
                v[u] = ((const int4 *)(slice + fr_off_record(&L, (uint32_t)ri[q]) + L.rec_hdr))[c];
            }
        }
#pragma unroll
        for (int u = 0; u < FR_DR_UNROLL; u++) {
            int f = b0 + u * (int)blockDim.x;
            if (f < tot) {
                int q = f / n16, c = f - q * n16;
                for (int j = 0; j < rn[q]; j++) {
                    int row = rows[q * FR_MAX_TOPK + j];
                    if (row >= 0)
                        ((int4 *)(o.ex + (size_t)row * L.tok_bytes))[c] = v[u];
                }
            }
        }
    }
    int ns = (int)L.nscales;
    bool rowwise = L.sfmt == FERRY_SCALES_ROWS;
    for (int f = threadIdx.x; f < nb * ns; f += blockDim.x) {
        /* neighbouring threads: one record's scales (rows), or one scale
         * of neighbouring records (columns, whose rows lie together) */
        int q = rowwise ? f / ns : f % nb, c = rowwise ? f - q * ns : f / nb;
        float v = ((const float *)(slice + fr_off_record(&L, (uint32_t)ri[q]) + L.rec_hdr +
                                   L.tok_bytes))[c];
        for (int j = 0; j < rn[q]; j++) {
            int row = rows[q * FR_MAX_TOPK + j];
            if (row >= 0)
                fr_scl_put(&L, fr_scl_row(&L, o.exs, (uint32_t)row), (uint32_t)c, v);
        }
    }
}

/* The receive part, for the round of `epoch`. Senders in the order of
 * the rows: this rank, then rank + 1, ... (mod N). direct: the send part
 * of this kernel wrote this rank's own tokens in place (self_run rows per
 * own expert). Senders come in windows of FR_DR_WIN: a lane of warp 0 per
 * sender waits for its flag and checks its slice header, and the block
 * reads every window sender's rows per expert (after the header) at once,
 * so the waits and reads of 32 senders overlap instead of following each
 * other (a dependent chain per sender was most of a round's fixed cost at
 * 32 ranks). A thread per expert then gives every window sender its first
 * row per expert at once (a running sum over the window's senders), so a
 * window's senders need no barrier between them (more than FR_DR_WIN_EL
 * experts, or a window of one: per sender as it comes, behind a barrier).
 * Per sender in order, block y takes records y, y + G, ...: a thread per record
 * checks its header and turns the positions the sender wrote (pos[]) into
 * rows, and the whole block copies the records to all their rows. Work
 * follows the records, not the experts, so a popular expert is spread
 * over every block; blocks never wait for each other. */
static __device__ __forceinline__ void fr_dr_run(const fr_cu_args_t &A, int set,
                                                 const fr_dr_out_t &o,
                                                 unsigned long long epoch, bool direct)
{
    extern __shared__ int32_t base[]; /* fr_dr_smem: base[El], run[El], batch */
    const fr_layout_t &L = A.L;
    int N = A.N, El = L.El, y = blockIdx.x, G = gridDim.x;
    int32_t *run = base + El;
    int32_t *ri = run + El, *rn = ri + FR_DR_RECS; /* a batch's records, their row counts */
    int32_t *rows = rn + FR_DR_RECS;
    int32_t *wcnt = rows + FR_DR_RECS * FR_MAX_TOPK; /* [FR_DR_WIN][El] when kept */
    bool keep = El <= FR_DR_WIN_EL;
    /* the window: per sender the wait's result, its records and pairs */
    __shared__ int s_ww[FR_DR_WIN], s_wc[FR_DR_WIN], s_wnp[FR_DR_WIN];
    __shared__ int s_ok, s_nmask;
    __shared__ unsigned long long s_epoch;
    if (threadIdx.x == 0) {
        s_epoch = epoch;
        s_nmask = A.mask[N]; /* read once: masks change between rounds */
        s_ok = !(direct && fr_cu_failed(A)); /* one read: the block returns as one */
    }
    __syncthreads();
    if (!s_ok)
        return;
    for (int le = threadIdx.x; le < El; le += blockDim.x)
        run[le] = direct ? A.self_run[set * El + le] : 0;
    FR_TR_DECL;
    FR_TR();
    int first = direct ? 1 : 0;
    bool kept = false; /* the window's counts are in wcnt */
    for (int si = first; si < N; si++) {
        int s = A.rank + si < N ? A.rank + si : A.rank + si - N;
        int l = (si - first) % FR_DR_WIN;
        /* everyone is done with the previous sender (kept: with the
         * previous window; a window's senders need no barrier between
         * them, only their batches do) */
        if (l == 0 || !kept)
            __syncthreads();
        if (l == 0) { /* a new window: senders si .. si + nw - 1 */
            int nw = min(FR_DR_WIN, N - si);
            if (threadIdx.x < nw) {
                int sj = si + threadIdx.x, sl = A.rank + sj < N ? A.rank + sj : A.rank + sj - N;
                int c = 0, np = 0, co = 0;
                long long t0 = clock64();
                /* a masked sender: nothing from it, never waited for */
                int w = s_nmask && A.mask[sl] ? 2 : fr_dr_wait(A, set, sl, s_epoch, &c, &np, &co);
                s_ww[threadIdx.x] = w;
                s_wc[threadIdx.x] = c;
                s_wnp[threadIdx.x] = np;
                if (w != 0 && y == 0) {
                    A.pair_n[set * N + sl] = np;
                    A.scomb_off[set * N + sl] = co;
                    /* from the window's start; a masked one: no cost, as in
                     * the combine */
                    if (o.wait_cost && w != 2)
                        atomicAdd((unsigned long long *)(o.wait_cost + sl),
                                  (unsigned long long)(clock64() - t0));
                }
            }
            __syncthreads();
            /* a window of one sender (the one-launch kernel at 2 ranks, or
             * the last window when N - first is 1 mod 32) reads its counts
             * as they are used; kept is alike in the block */
            kept = keep && nw > 1;
            for (int f = threadIdx.x; kept && f < nw * El; f += blockDim.x) {
                int j = f / El, le = f - j * El;
                int sj = si + j, sl = A.rank + sj < N ? A.rank + sj : A.rank + sj - N;
                wcnt[f] = s_ww[j] == 1 ? ((const int32_t *)(fr_cu_rseg(A, sl) +
                                                            fr_off_drecv(&L, set, sl) +
                                                            FR_SLICE_HDR))[le]
                                       : 0;
            }
            if (kept) {
                __syncthreads();
                /* every window sender's first row per expert at once: a
                 * thread per expert turns the counts into bases (clamped to
                 * the capacity: fr_dr_end); run[] ends at the window's end,
                 * and sender j's rows end at sender j + 1's base */
                for (int le = threadIdx.x; le < El; le += blockDim.x) {
                    int b = run[le];
                    for (int j = 0; j < nw; j++) {
                        uint32_t c = (uint32_t)wcnt[j * El + le];
                        wcnt[j * El + le] = b;
                        b = fr_dr_end(b, c, (int)L.cap);
                    }
                    run[le] = b;
                }
                __syncthreads();
            }
        }
        int w = s_ww[l];
        if (si == first)
            FR_TR();
        if (w == 0)
            return;
        if (w == 2)
            continue;
        int count = s_wc[l], np = s_wnp[l];
        const uint8_t *slice = fr_cu_rseg(A, s) + fr_off_drecv(&L, set, s);
        /* this sender's first row per expert (sb) and its rows' end (se) */
        const int32_t *sb = base, *se = run;
        if (kept) {
            sb = wcnt + l * El;
            se = l + 1 < min(FR_DR_WIN, N - (si - l)) ? sb + El : run;
        } else {
            const uint32_t *srows = (const uint32_t *)(slice + FR_SLICE_HDR);
            for (int le = threadIdx.x; le < El; le += blockDim.x) {
                int b = run[le];
                uint32_t c = srows[le];
                base[le] = b;
                run[le] = fr_dr_end(b, c, (int)L.cap);
            }
            __syncthreads();
        }
        int32_t *prow = A.pair_row + (size_t)set * L.send_crows + (size_t)s * L.T * L.kmax;
        for (int j0 = y; j0 < count; j0 += G * FR_DR_RECS) {
            int nb = min(FR_DR_RECS, (count - j0 + G - 1) / G);
            if (threadIdx.x < nb) {
                /* a record: check its header, its rows from pos[] */
                int q = threadIdx.x, i = j0 + q * G;
                const uint8_t *rec = slice + fr_off_record(&L, (uint32_t)i);
                const fr_rec_hdr_t *h = (const fr_rec_hdr_t *)rec;
                const uint32_t *pos = (const uint32_t *)(rec + L.rec_pos);
                uint32_t tk = h->token, pr = h->pair;
                int nexp = h->nexp;
                bool bad = nexp < 1 || nexp > L.kmax ||
                           (uint64_t)pr + (uint64_t)nexp > (uint64_t)np || tk >= (uint32_t)L.T;
                nexp = bad ? 0 : nexp;
                for (int j = 0; j < nexp; j++) {
                    uint32_t le = h->le[j], p = pos[j];
                    bool dup = false;
                    for (int j2 = 0; j2 < j; j2++)
                        dup = dup || h->le[j2] == le;
                    /* a row inside what the sender said it has for le */
                    bool okj = le < (uint32_t)El && !dup &&
                               p < (uint32_t)(se[le] - sb[le]);
                    bad = bad || !okj;
                    int row = okj ? (int)((size_t)le * L.cap + sb[le] + p) : -1;
                    rows[q * FR_MAX_TOPK + j] = row;
                    prow[pr + j] = row;
                    if (okj && o.src_rank)
                        o.src_rank[row] = s;
                    if (okj && o.src_token)
                        o.src_token[row] = (int32_t)tk;
                }
                if (bad)
                    fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, FR_CU_WHAT_RECORD, i);
                ri[q] = i;
                rn[q] = nexp;
            }
            __syncthreads();
            if (si == (int)direct && j0 == y)
                FR_TR();
            fr_dr_copy(A, slice, ri, rn, rows, nb, o);
            __syncthreads();
            if (si == (int)direct && j0 == y)
                FR_TR();
        }
    }
    /* run[] came from other threads (with no sender left to wait for, as
     * in a world of one, no barrier of the loop ordered them) */
    __syncthreads();
    for (int le = y + threadIdx.x * G; le < El; le += blockDim.x * G) {
        o.counts[le] = run[le];
        if (o.stats) /* one thread per expert in the grid: no atomics */
            o.stats[le] += run[le];
    }
    FR_TR();
    FR_TR_PRINT("drecv wait0,rows0,copy0,rest", s_epoch);
}

/* The dispatch kernel: one for the operation, its parts chosen by
 * `phases` (FR_PART_SEND, FR_PART_RECV or both), so that a split call is the
 * same kernel launched twice, as a profiler or a trace names it. Both
 * parts in one launch: every block sends its tokens, then receives its
 * records. The grid must be resident at once (blocks wait for the other
 * blocks' sends): the launcher caps it at what the GPU holds. The receive
 * alone takes the epoch the send stored (A.epoch[set]). */
namespace ferry {
template <bool VEC, bool MK>
__global__ void __launch_bounds__(FR_DS_THREADS, 2)
dispatch(fr_cu_args_t A, int set, const uint16_t *x, const float *x_scales, const int64_t *idx,
         int T_host, const int32_t *T_dev, fr_dr_out_t o, bool direct, int phases)
{
    if (!(phases & FR_PART_SEND)) {
        fr_dr_run(A, set, o, A.epoch[set], false);
        return;
    }
    unsigned long long epoch =
        fr_ds_run<VEC, MK>(A, set, x, x_scales, idx, T_host, T_dev, o, direct);
    if (!(phases & FR_PART_RECV))
        return;
    __syncthreads(); /* the shared memory changes hands */
    fr_dr_run(A, set, o, epoch, direct);
}
} /* namespace ferry */

/* ---------------------------------------------------------------------- */
/* launchers                                                              */

static fr_dr_out_t fr_dr_out_of(const ferry_dispatch_out_t *out)
{
    fr_dr_out_t o = {(uint8_t *)out->expert_x, out->expert_x_scales, out->expert_num_tokens,
                     out->expert_src_rank, out->expert_src_token,
                     (long long *)out->wait_cost, out->recv_stats};
    return o;
}

/* One launch of ferry::dispatch: the send part with its loads vectorised
 * where x allows it (the receive alone takes the vectorised kernel, so a
 * split call launches one kernel twice). */
static void fr_cu_dispatch_launch(int blocks, size_t smem, cudaStream_t st, struct fr_cuda_ep *c,
                                  int set, const ferry_dispatch_in_t *in, fr_dr_out_t o,
                                  bool direct, int phases)
{
    bool vec = !in || (((uintptr_t)in->x & 15) == 0 && ((uintptr_t)in->x_scales & 3) == 0);
    const uint16_t *x = in ? (const uint16_t *)in->x : NULL;
    /* NVFP4 has no x_scales: the kernel's x_scales carries x_global_scale */
    const float *xs = in ? (c->a.L.nvfp4 ? in->x_global_scale : in->x_scales) : NULL;
    const int64_t *idx = in ? in->topk_idx : NULL;
    int T = in ? in->num_tokens : 0;
    const int32_t *Td = in ? in->num_tokens_dev : NULL;
    /* some rank masked, or one may be by a wait (mask_on_timeout): the
     * kernel that cuts (unvectorised) */
    if (c->masked || c->a.mask_on_timeout)
        ferry::dispatch<false, true><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, x, xs, idx, T, Td, o, direct, phases);
    else if (vec)
        ferry::dispatch<true, false><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, x, xs, idx, T, Td, o, direct, phases);
    else
        ferry::dispatch<false, false><<<blocks, FR_DS_THREADS, smem, st>>>(
            c->a, set, x, xs, idx, T, Td, o, direct, phases);
}

extern "C" int fr_cuda_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    int set = (int)(r->epoch % FR_NSETS);
    int rc = fr_ahead_wait(ep, &c->ahead, r->epoch, in->stream, "dispatch_send", fr_cuda_check);
    if (rc != FERRY_OK)
        return rc;
    int blocks = c->nblocks < ep->L.T ? c->nblocks : ep->L.T;
    blocks = blocks < 1 ? 1 : blocks;
    fr_dr_out_t o = {};
    fr_cu_dispatch_launch(blocks, fr_ds_smem(ep->N, ep->L.E), (cudaStream_t)in->stream, c, set,
                          in, o, false, FR_PART_SEND);
    return fr_cuda_launch_check(ep, "dispatch_send");
}

extern "C" int fr_cuda_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                                     const ferry_dispatch_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    int set = (int)(r->epoch % FR_NSETS);
    /* blocks take records in turn; blocks that wait for peers hold SMs,
     * so never more than num_sms of them */
    int blocks = c->nblocks < 1 ? 1 : c->nblocks;
    fr_cu_dispatch_launch(blocks, fr_dr_smem((int)ep->L.El), (cudaStream_t)out->stream, c, set,
                          NULL, fr_dr_out_of(out), false, FR_PART_RECV);
    return fr_cuda_launch_check(ep, "dispatch_recv");
}

extern "C" int fr_cuda_dispatch(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in,
                                const ferry_dispatch_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    int set = (int)(r->epoch % FR_NSETS);
    if (c->dgrid < 0) {
        int rc = fr_cuda_dispatch_send(ep, r, in);
        return rc ? rc : fr_cuda_dispatch_recv(ep, r, out);
    }
    int rc = fr_ahead_wait(ep, &c->ahead, r->epoch, in->stream, "dispatch", fr_cuda_check);
    if (rc != FERRY_OK)
        return rc;
    int blocks = c->nblocks < c->dgrid ? c->nblocks : c->dgrid;
    /* own tokens straight into own expert rows: self on the IPC path */
    fr_cu_dispatch_launch(blocks, fr_d_smem(ep), (cudaStream_t)in->stream, c, set, in,
                          fr_dr_out_of(out), !c->host_seg, FR_PART_SEND | FR_PART_RECV);
    return fr_cuda_launch_check(ep, "dispatch");
}

/* The dispatch kernels loaded and the one-launch grid sized, at set-up
 * (fr_cuda_load_kernels says why). */
extern "C" int fr_cuda_dispatch_load(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    decltype(&ferry::dispatch<true, false>) ks[] = {ferry::dispatch<true, false>,
                                                    ferry::dispatch<false, false>,
                                                    ferry::dispatch<false, true>};
    c->dgrid = fr_cu_grid(c, ks, FR_DS_THREADS, fr_d_smem(ep), "dispatch");
    const void *fs[] = {(const void *)ferry::dispatch<true, false>,
                        (const void *)ferry::dispatch<false, false>,
                        (const void *)ferry::dispatch<false, true>};
    return fr_cu_load(fs, sizeof(fs) / sizeof(fs[0]), "dispatch", err);
}

/* Shared memory of the dispatch kernels above the 48 KB a launch gets by
 * default (many ranks or experts): raised for every dispatch kernel here,
 * at set-up, or refused with the sizes when the GPU offers less. */
extern "C" int fr_cuda_dispatch_init(ferry_ep_t ep, fr_err_t *err)
{
    size_t need = fr_d_smem(ep);
    if (need <= 48 * 1024)
        return FERRY_OK;
    int dev = 0, optin = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return FR_ERR(err, FERRY_ERR_SYSTEM, "dispatch: cannot read the GPU's shared memory size");
    }
    if (need + 1024 > (size_t)optin) /* and the kernels' static shared memory */
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "num_experts %d over %d ranks: the CUDA dispatch needs %zu bytes of shared "
                      "memory per block (a count per expert, slice bases per rank), this GPU "
                      "offers %d",
                      ep->L.E, ep->N, need + 1024, optin);
    cudaError_t e = cudaFuncSetAttribute(ferry::dispatch<true, false>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(ferry::dispatch<false, false>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(ferry::dispatch<false, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return FR_ERR(err, FERRY_ERR_SYSTEM, "dispatch: raising the kernels' shared memory to %zu "
                      "bytes: %s", need, cudaGetErrorString(e));
    }
    return FERRY_OK;
}
