/*
 * Routes on CUDA ranks: kernels on the caller's stream, then one host
 * synchronisation (the caller must learn num_recv to size recv_x), except
 * for a bounded route (max_recv): its counts stay on the device, and stream
 * order alone orders its kernels and the route's calls (one stream per
 * context for routes and their calls: see ferry.h).
 *
 *   layout (a block per channel): topk_idx checked and copied as int32,
 *          per token the distinct ranks it goes to (ascending) and its
 *          place among the channel's tokens to each of them (token order)
 *          with the inverse (the channel's i-th token to each rank), per
 *          (rank, channel) the token count, per (rank, local expert) the
 *          row count (atomics).
 *   notify (one block: without forwarding the last layout block to finish,
 *          in the same launch, fr_cuht_route1): this rank's counts stored
 *          into every peer's notify entry [route parity][this rank], then
 *          the route number with a
 *          release at system scope; then every source's entry here waited
 *          for (relaxed polls, one acquire, bounded by the timeout naming
 *          the source), checked, and laid out: rows from source s, channel
 *          c start at rbase[s][c] (by source rank, then token, as the CPU
 *          engine lays them out); num_recv and the local experts' counts
 *          go to host-mapped memory.
 *
 * Two entries per source (route number parity) are enough, as in the CPU
 * engine: a rank stores route k+2's counts only after its route k+1
 * finished (host synchronisation), which needed every rank's route k+1
 * counts, which each rank stored after its route k had finished.
 *
 * A bad topk_idx (out of range, or an expert twice in a token) does not
 * leave peers waiting: the rank stores -1 tokens in its entries, every
 * rank's route_create fails with FERRY_ERR_INVALID naming it, and the
 * context stays usable (route numbers advanced everywhere alike).
 */
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engines/cuda_ht/cuda_ht_dev.cuh"

#define FR_RL_THREADS 256
/* The bad-entry word: 0 before any (zeroed with the per-expert counts
 * before it, in one memset), else INT_MAX - (t * K + k) of the first bad
 * entry (the largest, atomicMax). */
#define FR_CUHT_NOBAD 0
#define FR_RN_THREADS 256

#define FR_RL_WARPS (FR_RL_THREADS / 32)

/* FR_CU_TRACE (a tracing build): the route kernels' phases for routes 41
 * to 48, from the GPU's global timer (one clock for every rank of a GPU):
 * "RT <ns> r<rank> <route> <event>"; block 0's start, and the last
 * block's (the one that runs notify) start, end of layout and each notify
 * phase. */
#ifdef FR_CU_TRACE
#define FR_RT_AT(G, id, ev, t)                                                            \
    do {                                                                                  \
        if (threadIdx.x == 0 && (id) >= 41 && (id) <= 48)                                 \
            printf("RT %llu r%d %llu %s\n", (unsigned long long)(t), (G).rank,            \
                   (unsigned long long)(id), ev);                                         \
    } while (0)
#define FR_RT(G, id, ev) FR_RT_AT(G, id, ev, fr_sys_timer())
#else
#define FR_RT(G, id, ev) do { } while (0)
#endif

/* A block per channel, its tokens in chunks of FR_RL_THREADS (a thread
 * each): the token's distinct destination ranks, ascending; then its place
 * among the channel's tokens to each of them, in token order, from a
 * bitmap per warp and rank (bit l: lane l's token goes there) and the
 * running count per rank, so the work per token is O(K + warps) whatever
 * the number of ranks. */
/* With forwarding it runs twice: by rank (kmap NULL: idx, dcnt, bad and
 * the counts notify sends; dst, dpos and rtok NULL), then by key (kmap:
 * an expert's rank to the rank its records go to, kord the order of
 * sums; dst, dpos, rtok and ccnt for the senders and the combine; idx,
 * dcnt and bad NULL). */
static __device__ __forceinline__ void
fr_cuht_layout_c(const fr_cuht_args_t &A, int T, const int64_t *topk, const int *kmap,
                 const int *kord, int32_t *idx, int32_t *dst, int32_t *dpos, int32_t *rtok,
                 int32_t *ccnt, int32_t *dcnt, int32_t *bad, int c)
{
    const fr_cuht_geo_t &G = A.G;
    int N = G.N, K = G.K, El = G.El;
    int t0 = fr_cuht_chan_lo(T, G.C, c), t1 = fr_cuht_chan_lo(T, G.C, c + 1);
    __shared__ int run[FR_CUHT_MAX_RANKS];
    __shared__ unsigned int bits[FR_RL_WARPS][FR_CUHT_MAX_RANKS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < N; i += blockDim.x)
        run[i] = 0;
    for (int i = threadIdx.x; i < FR_RL_WARPS * N; i += blockDim.x)
        bits[i / N][i % N] = 0;
    __syncthreads();
    for (int base = t0; base < t1; base += blockDim.x) {
        int t = base + (int)threadIdx.x, nd = 0;
        int dl[FR_MAX_TOPK];
        if (t < t1) {
            const int64_t *row = topk + (size_t)t * K;
            for (int k = 0; k < K; k++) {
                int64_t e = row[k];
                bool ok = e >= -1 && e < G.E;
                for (int j = 0; j < k && ok && e >= 0; j++)
                    ok = row[j] != e;
                if (!ok) {
                    if (bad)
                        atomicMax(bad, INT_MAX - (t * K + k));
                    e = -1;
                }
                if (idx)
                    idx[(size_t)t * K + k] = (int32_t)e;
                if (e < 0)
                    continue;
                int d = (int)(e / El), j = nd;
                if (dcnt)
                    atomicAdd(&dcnt[(size_t)d * El + (int)(e % El)], 1);
                if (kmap)
                    d = kmap[d];
                bool dup = false;
                for (int q = 0; q < nd; q++)
                    dup = dup || dl[q] == d;
                if (dup)
                    continue;
                /* kept ascending (by kord with forwarding) */
                for (; j > 0 && (kord ? kord[dl[j - 1]] > kord[d] : dl[j - 1] > d); j--)
                    dl[j] = dl[j - 1];
                dl[j] = d;
                nd++;
            }
            for (int k = 0; dst && k < K; k++)
                dst[(size_t)t * K + k] = k < nd ? dl[k] : -1;
        }
        for (int k = 0; k < nd; k++)
            atomicOr(&bits[warp][dl[k]], 1u << lane);
        __syncthreads();
        /* place among the channel's tokens to d: the tokens to d before
         * this chunk, in earlier warps of it, in lower lanes of this warp */
        for (int k = 0; k < nd; k++) {
            int d = dl[k], pos = run[d];
            for (int w = 0; w < warp; w++)
                pos += __popc(bits[w][d]);
            pos += __popc(bits[warp][d] & ((1u << lane) - 1u));
            if (dpos)
                dpos[(size_t)t * K + k] = pos;
            if (rtok)
                rtok[(size_t)d * T + t0 + pos] = t;
        }
        __syncthreads();
        /* the chunk's last token to d adds the chunk's count */
        for (int k = 0; k < nd; k++) {
            int d = dl[k], tot = 0;
            bool last = (bits[warp][d] >> lane) == 1u;
            for (int w = 0; w < FR_RL_WARPS; w++) {
                tot += __popc(bits[w][d]);
                last = last && (w <= warp || bits[w][d] == 0);
            }
            if (last)
                run[d] += tot;
        }
        __syncthreads();
        for (int k = 0; k < nd; k++)
            bits[warp][dl[k]] = 0;
        __syncthreads();
    }
    for (int i = threadIdx.x; i < N; i += blockDim.x)
        ccnt[(size_t)i * G.C + c] = run[i];
}

__global__ void __launch_bounds__(FR_RL_THREADS)
fr_cuht_layout(fr_cuht_args_t A, int T, const int64_t *topk, const int *kmap, const int *kord,
               int32_t *idx, int32_t *dst, int32_t *dpos, int32_t *rtok, int32_t *ccnt,
               int32_t *dcnt, int32_t *bad)
{
    fr_cuht_layout_c(A, T, topk, kmap, kord, idx, dst, dpos, rtok, ccnt, dcnt, bad,
                     blockIdx.x);
}

/* A warp (every lane calls it) checks a source's C counts v and lays them
 * out: each at least 0 (exactly 0 where zero_only), at most bound less the
 * counts before it; cnt[i] = v[i], base[i] = the sum before i. Lanes take
 * 32 counts at a time and scan them, so the loads are in flight together.
 * Returns the sum, or -1 after failing the context with source s and
 * index what + i of the first bad count (as a loop stopping there would:
 * the prefixes before it are exact, each checked count being at most what
 * is left). */
static __device__ __forceinline__ int
fr_warp_prefix_check(const int32_t *v, int C, int bound, bool zero_only, int32_t *cnt,
                     int32_t *base, const fr_cuht_args_t &A, int s, int what)
{
    int lane = threadIdx.x & 31, sum = 0;
    for (int c0 = 0; c0 < C; c0 += 32) {
        int i = c0 + lane;
        int x = i < C ? __ldcg(v + i) : 0;
        unsigned int inc = fr_warp_incl_scan((unsigned int)x); /* past a bad count: wraps */
        /* exact up to the first bad count; past it, wrapped (unused) */
        int before = (int)((unsigned int)sum + (inc - (unsigned int)x));
        bool bad = i < C && (x < 0 || (zero_only && x > 0) ||
                             (long long)x > (long long)bound - before);
        unsigned int m = __ballot_sync(0xffffffffu, bad);
        if (m) {
            if (lane == 0)
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS,
                             what + c0 + __ffs((int)m) - 1);
            return -1;
        }
        if (i < C) {
            cnt[i] = x;
            base[i] = before;
        }
        sum = __shfl_sync(0xffffffffu, sum + (int)inc, 31);
    }
    return sum;
}

/* Where notify's results go: the host-mapped result of an exact route, or
 * (bounded) the route's own words and the caller's optional outputs. */
typedef struct fr_cuht_nout {
    fr_cuht_res_t *res;           /* exact route, else NULL */
    int bound;                    /* max_recv of a bounded route */
    int align;                    /* expert_alignment */
    unsigned long long *idw;      /* the route's number */
    int32_t *nrecv;               /* the route's row count */
    int32_t *nrecv_out, *ecnt_out; /* the caller's, or NULL */
} fr_cuht_nout_t;

/* ccnt: this rank's tokens per (rank, channel); with forwarding kcnt its
 * records per (key, channel), which a remote key (a forwarder) learns as
 * fc[C], and fcnt / fbase the records per (source, channel) that come
 * here to be forwarded, and the first of each. */
static __device__ __forceinline__ void
fr_cuht_notify_b(const fr_cuht_args_t &A, unsigned long long *rseq, const int32_t *ccnt,
                 const int32_t *kcnt, const int32_t *dcnt, const int32_t *bad, int32_t *rcnt,
                 int32_t *rbase, int32_t *fcnt, int32_t *fbase, const fr_cuht_nout_t &o)
{
    const fr_cuht_geo_t &G = A.G;
    /* the route number: counted here, on the device, so that a replayed
     * graph makes a new route each time (every rank runs one notify per
     * route_create, failed or not, so the numbers stay in step) */
    unsigned long long id = *(volatile unsigned long long *)rseq + 1;
    FR_RT(A.G, id, "notify");
    __syncthreads();
    if (threadIdx.x == 0) {
        *rseq = id;
        *o.idw = id;
        if (o.res)
            o.res->id = (unsigned int)id;
    }
    int N = G.N, C = G.C, El = G.El, parity = (int)(id & 1);
    /* __ldcg: in route1 other blocks of this launch wrote these */
    bool isbad = __ldcg(bad) != FR_CUHT_NOBAD;
    fr_cuht_res_t *res = o.res;
    __shared__ int ok;
    /* this rank's counts into every peer's entry, then the route number */
    for (int d = 0; d < N; d++) {
        uint8_t *e = fr_cuht_wnot(A, d, parity);
        int32_t *cc = (int32_t *)(e + 16), *ec = cc + C;
        for (int i = threadIdx.x; i < C; i += blockDim.x)
            cc[i] = isbad ? 0 : __ldcg(&ccnt[(size_t)d * C + i]);
        for (int i = threadIdx.x; i < El; i += blockDim.x)
            ec[i] = isbad ? 0 : __ldcg(&dcnt[(size_t)d * El + i]);
        if (G.fwd) { /* a remote key forwards these */
            bool key = A.fw.key[d] == d && (A.fw.nl[d] >> 16) != A.fw.node;
            for (int i = threadIdx.x; i < C; i += blockDim.x)
                ec[El + i] = isbad || !key ? 0 : kcnt[(size_t)d * C + i];
        }
    }
    /* each destination's token count: a warp per destination, its lanes
     * over the channels (loads in flight together, not one after another) */
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int d = warp; d < N; d += nwarps) {
        int n = 0;
        for (int i = lane; i < C; i += 32)
            n += __ldcg(&ccnt[(size_t)d * C + i]);
        n = __reduce_add_sync(0xffffffffu, n);
        if (lane == 0) {
            uint8_t *e = fr_cuht_wnot(A, d, parity);
            ((int32_t *)(e + 8))[0] = isbad ? -1 : n;
            ((int32_t *)(e + 8))[1] = 0;
        }
    }
    __syncthreads();
    FR_RT(A.G, id, "stored");
    if (threadIdx.x == 0) {
        ok = !fr_cuht_failed(A);
        /* every thread's stores, ordered by the barrier; the fence makes
         * each relaxed store of the route number below a release (one
         * system fence, not one per peer) */
        __threadfence_system();
        for (int d = 0; d < N && ok; d++)
            fr_sys_st_relaxed(fr_cuht_wnotid(A, d, parity), id);
    }
    __syncthreads();
    FR_RT(A.G, id, "published");
    if (!ok)
        return;
    /* every source's entry here: a thread per source polls */
    for (int s = threadIdx.x; s < N; s += blockDim.x) {
        const unsigned long long *w = fr_cuht_rnotid(A, s, parity);
        unsigned long long t0 = fr_sys_timer(), v;
        unsigned int n = 0;
        for (;;) {
            v = fr_sys_ld_relaxed(w);
            if (v == id && fr_sys_ld_acquire(w) == id)
                break;
            if (v > id) { /* a route this rank has not created */
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_ROUTE, (int)v);
                break;
            }
            if ((++n & 255) == 0) {
                if (fr_cuht_failed(A))
                    break;
                if (fr_sys_timer() - t0 > A.timeout_ns) {
                    fr_cuht_fail(A, FERRY_ERR_TIMEOUT, s, FR_CUHT_WHAT_ROUTE, 0);
                    break;
                }
            }
        }
    }
    __syncthreads();
    FR_RT(A.G, id, "peers");
    if (threadIdx.x == 0)
        ok = !fr_cuht_failed(A);
    __syncthreads();
    if (!ok)
        return;
    /* counts checked before use (a warp per source, its lanes over the
     * channels: a scan, so that the loads are in flight together); rows
     * by source rank, then channel: each source's channels laid out from
     * 0, then shifted by the rows of the sources before it. The polling
     * thread's acquire and the barrier order these loads after the
     * source's stores; __ldcg reads them through L2 (peers wrote them
     * while this kernel ran). */
    __shared__ int stot[FR_CUHT_MAX_RANKS], sraw[FR_CUHT_MAX_RANKS];
    __shared__ int sbad;
    if (threadIdx.x == 0)
        sbad = INT_MAX;
    __syncthreads();
    for (int s = warp; s < N; s += nwarps) {
        const uint8_t *e = A.seg + fr_cuht_off_notify(G, parity, s);
        /* lane 0's load for the whole warp: every lane takes the same
         * branches below (a peer rewriting its entry, e.g. after a
         * timeout, must not split the warp before its full-mask scans) */
        int n = __shfl_sync(0xffffffffu, __ldcg((const int32_t *)(e + 8)), 0);
        const int32_t *cc = (const int32_t *)(e + 16);
        if (lane == 0) {
            stot[s] = 0;
            sraw[s] = n;
        }
        if (n == -1) {
            if (lane == 0)
                atomicMin(&sbad, s);
            n = 0;
        }
        if (n < 0 || n > G.T) {
            if (lane == 0)
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS, n);
            continue;
        }
        int sum = fr_warp_prefix_check(cc, C, n, 0, &rcnt[(size_t)s * C], &rbase[(size_t)s * C],
                                       A, s, 0);
        if (sum >= 0 && sum != n && lane == 0)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS, sum);
        if (lane == 0)
            stot[s] = n;
        if (G.fwd) /* records to forward: only from the sources forwarded here */
            fr_warp_prefix_check(cc + C + El, C, G.T, A.fw.fslot[s] < 0,
                                 &fcnt[(size_t)s * C], &fbase[(size_t)s * C], A, s, C + El);
    }
    __syncthreads();
    if (warp == 0) {
        /* exclusive prefix (each source's first row): warp 0 scans 32
         * sources at a time */
        int total = fr_warp_excl_scan(stot, stot, N);
        if (lane == 0) {
            ok = !fr_cuht_failed(A);
            int badr = sbad == INT_MAX ? -1 : sbad;
            *o.nrecv = total;
            if (res) {
                res->num_recv = total;
                res->bad_rank = badr;
            } else if (ok && badr >= 0) { /* bounded: nobody reads res */
                fr_cuht_fail(A, FERRY_ERR_INVALID, badr, FR_CUHT_WHAT_BADIDX, 0);
                ok = 0;
            } else if (ok && total > o.bound) {
                fr_cuht_fail(A, FERRY_ERR_INVALID, o.bound, FR_CUHT_WHAT_BOUND, total);
                ok = 0;
            }
            if (ok && o.nrecv_out)
                *o.nrecv_out = total;
        }
    }
    __syncthreads();
    FR_RT(A.G, id, "checked");
    if (!ok)
        return;
    for (int i = threadIdx.x; i < N * C; i += blockDim.x)
        rbase[i] += stot[i / C];
    for (int le = threadIdx.x; le < El; le += blockDim.x) {
        /* no branch on a loaded value inside the loop: the loads go out
         * together; the first bad source is named, as a loop stopping
         * there would */
        int sum = 0, first = -1;
        for (int s = 0; s < N; s++) {
            const uint8_t *e = A.seg + fr_cuht_off_notify(G, parity, s);
            int n = sraw[s];
            int v = __ldcg((const int32_t *)(e + 16) + C + le);
            bool b = v < 0 || v > (n < 0 ? 0 : n);
            first = first < 0 && b ? s : first;
            sum += first < 0 ? v : 0;
        }
        if (first >= 0)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, first, FR_CUHT_WHAT_COUNTS, C + le);
        if (res)
            res->ecnt[le] = sum;
        if (o.ecnt_out)
            o.ecnt_out[le] = o.align > 1 ? (sum + o.align - 1) / o.align * o.align : sum;
    }
    if (res) { /* the host polls this: stored after every other result */
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            res->done = 1;
        }
    }
    FR_RT(A.G, id, "done");
}

__global__ void __launch_bounds__(FR_RN_THREADS)
fr_cuht_notify(fr_cuht_args_t A, unsigned long long *rseq, const int32_t *ccnt,
               const int32_t *kcnt, const int32_t *dcnt, const int32_t *bad, int32_t *rcnt,
               int32_t *rbase, int32_t *fcnt, int32_t *fbase, fr_cuht_nout_t o)
{
    fr_cuht_notify_b(A, rseq, ccnt, kcnt, dcnt, bad, rcnt, rbase, fcnt, fbase, o);
}

/* Without forwarding, layout and notify in one launch: a block per
 * channel lays out its tokens; the last block to finish (a counter in the
 * context, left at zero for the next route: routes are stream-ordered)
 * runs notify, then zeroes the per-expert counts the blocks added into
 * (and, for a bounded route, the bad-entry word; an exact route's is read
 * by the host after a failure, which then zeroes it with a memset before
 * the block's next use), so that the next route on these tables needs no
 * memset before it. */
__global__ void __launch_bounds__(FR_RL_THREADS)
fr_cuht_route1(fr_cuht_args_t A, int T, const int64_t *topk, int32_t *idx, int32_t *dst,
               int32_t *dpos, int32_t *rtok, int32_t *ccnt, int32_t *dcnt, int32_t *bad,
               unsigned int *last_ctr, unsigned long long *rseq, int32_t *rcnt, int32_t *rbase,
               fr_cuht_nout_t o)
{
#ifdef FR_CU_TRACE /* this route's number (notify counts it) and the block's start */
    unsigned long long rid = *(volatile unsigned long long *)rseq + 1, tr0 = fr_sys_timer();
    if (blockIdx.x == 0)
        FR_RT_AT(A.G, rid, "block0", tr0);
#endif
    fr_cuht_layout_c(A, T, topk, NULL, NULL, idx, dst, dpos, rtok, ccnt, dcnt, bad,
                     blockIdx.x);
    __shared__ int last;
    __threadfence(); /* this block's tables before its count */
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(last_ctr, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence(); /* every block's tables after their counts */
#ifdef FR_CU_TRACE
    FR_RT_AT(A.G, rid, "last-block-start", tr0);
    FR_RT(A.G, rid, "layout");
#endif
    if (threadIdx.x == 0)
        *last_ctr = 0;
    fr_cuht_notify_b(A, rseq, ccnt, NULL, dcnt, bad, rcnt, rbase, NULL, NULL, o);
    __syncthreads(); /* notify read the counts (or returned early, all threads alike) */
    const fr_cuht_geo_t &G = A.G;
    for (int i = threadIdx.x; i < G.N * G.El; i += blockDim.x)
        dcnt[i] = 0;
    if (threadIdx.x == 0 && !o.res)
        *bad = FR_CUHT_NOBAD;
}

/* A bounded route's rows past the real count: padding. */
static __global__ void fr_cuht_pad(const int32_t *nrecv, int bound, int K, int32_t *ridx,
                                   long long *ridx64, float *rw, int32_t *rsr, int32_t *rst)
{
    int n = *nrecv;
    for (int row = n + (int)(blockIdx.x * blockDim.x + threadIdx.x); row < bound;
         row += (int)(gridDim.x * blockDim.x)) {
        for (int k = 0; k < K; k++) {
            if (ridx)
                ridx[(size_t)row * K + k] = -1;
            else if (ridx64)
                ridx64[(size_t)row * K + k] = -1;
            if (rw)
                rw[(size_t)row * K + k] = 0.f;
        }
        if (rsr)
            rsr[row] = -1;
        if (rst)
            rst[row] = -1;
    }
}

/* ---------------------------------------------------------------------- */
/* host side                                                              */

extern "C" void fr_cuht_route_free(ferry_route_t route)
{
    fr_cuht_route_t *p = route ? (fr_cuht_route_t *)route->priv : NULL;
    if (p && p->slot >= 0) {
        /* pooled tables: reused by a later bounded route, after this one's
         * kernels on the stream (no synchronisation: capturable); never
         * when a graph replays into them */
        if (!p->captured)
            fr_cuht(route->ep)->pool_used[p->slot] = 0;
    } else if (p) {
        /* kept for a later route, reused once the event after its last
         * call has passed: no wait here (a cudaFree would wait for the
         * device) */
        struct fr_cuht_ep *c = fr_cuht(route->ep);
        fr_cuht_spare_t *sp = (fr_cuht_spare_t *)calloc(1, sizeof(*sp));
        if (sp && p->mem) {
            sp->mem = p->mem;
            sp->size = p->size;
            sp->done = p->done;
            sp->dirty = p->dirty;
            sp->next = c->spare;
            c->spare = sp;
        } else {
            free(sp); /* out of host memory: the block is lost until exit */
        }
        free(p);
    }
    if (route) {
        free(route->ecnt);
        route->priv = NULL;
        route->ecnt = NULL;
    }
}

/* The route's device tables in one allocation. */
static int fr_cuht_route_mem(ferry_ep_t ep, fr_cuht_route_t *p, int T, int32_t **ccnt,
                             int32_t **dcnt)
{
    const fr_cuht_geo_t *G = &fr_cuht(ep)->a.G;
    /* tokens rounded up to a power of two (at least 256, at most
     * max_tokens): few block sizes, so that spare blocks are reused */
    int t2 = 256;
    while (t2 < T)
        t2 *= 2;
    T = t2 < G->T ? t2 : G->T;
    size_t N = (size_t)G->N, C = (size_t)G->C, t = (size_t)T, K = (size_t)G->K;
    /* with forwarding also: the counts by rank (ccnt is by key), the
     * records to forward and their first index, their expert ids */
    size_t nf = G->fwd ? 1 : 0, fids = nf * 2 * (size_t)G->NF * (size_t)G->T * K;
    /* the tables whose sizes do not depend on T first: the per-expert
     * counts and the bad-entry word (zeroed by route1, p->dirty) then lie
     * at the same offsets in every block, whichever route used it */
    size_t sz[] = {4 * N * C, 4 * N * (size_t)G->El, 4 * N * C, 4 * N * C, 16,
                   4 * t * K, 4 * t * K, 4 * t * K, 4 * N * t, 16,
                   nf * 4 * N * C, nf * 4 * N * C, nf * 4 * N * C, fids};
    size_t off[14], tot = 0;
    for (int i = 0; i < 14; i++) {
        off[i] = tot;
        tot += (sz[i] + 255) & ~(size_t)255;
    }
    struct fr_cuht_ep *c = fr_cuht(ep);
    cudaError_t e = cudaSuccess;
    p->mem = NULL;
    /* a spare block big enough whose last call has run, else a new one
     * with its event */
    for (fr_cuht_spare_t **q = &c->spare; *q; q = &(*q)->next) {
        fr_cuht_spare_t *sp = *q;
        if (sp->size >= tot && cudaEventQuery(sp->done) == cudaSuccess) {
            p->mem = sp->mem;
            p->size = sp->size;
            p->done = sp->done;
            p->dirty = sp->dirty;
            *q = sp->next;
            free(sp);
            break;
        }
    }
    (void)cudaGetLastError(); /* a query's cudaErrorNotReady */
    if (!p->mem && (e = cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming)) ==
                       cudaSuccess) {
        e = cudaMalloc(&p->mem, tot);
        p->size = tot;
        p->dirty = 1; /* never zeroed */
        if (e != cudaSuccess) {
            cudaEventDestroy(p->done);
            p->done = NULL;
        }
    }
    if (!p->mem || e != cudaSuccess) {
        p->mem = NULL;
        (void)cudaGetLastError();
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables: cudaMalloc of %zu bytes: %s",
                          tot, cudaGetErrorString(e));
    }
    uint8_t *b = (uint8_t *)p->mem;
    *ccnt = (int32_t *)(b + off[0]);
    p->r.ccnt = *ccnt;
    *dcnt = (int32_t *)(b + off[1]);
    p->r.rcnt = (const int32_t *)(b + off[2]);
    p->r.rbase = (const int32_t *)(b + off[3]);
    p->bad = (int32_t *)(b + off[4]);
    p->r.idx = (const int32_t *)(b + off[5]);
    p->r.dst = (const int32_t *)(b + off[6]);
    p->r.dpos = (const int32_t *)(b + off[7]);
    p->r.rtok = (const int32_t *)(b + off[8]);
    p->r.idp = (const unsigned long long *)(b + off[9]);
    p->r.nrecv = (const int32_t *)(b + off[9] + 8);
    p->ccnt = *ccnt;
    p->dcnt = *dcnt;
    p->rcc = G->fwd ? (int32_t *)(b + off[10]) : p->ccnt;
    p->r.fcnt = G->fwd ? (const int32_t *)(b + off[11]) : NULL;
    p->r.fbase = G->fwd ? (const int32_t *)(b + off[12]) : NULL;
    p->r.fids = G->fwd ? (int16_t *)(b + off[13]) : NULL;
    return FERRY_OK;
}

extern "C" int fr_cuht_pool_init(ferry_ep_t ep)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    int32_t *cc, *dc;
    for (int i = 0; i < FR_CUHT_POOL; i++) {
        fr_cuht_route_t *p = (fr_cuht_route_t *)calloc(1, sizeof(*p));
        if (!p)
            return fr_ep_fail(ep, FERRY_ERR_NOMEM, "bounded route tables");
        c->pool[i] = p;
        p->slot = i;
        int rc = fr_cuht_route_mem(ep, p, c->a.G.T, &cc, &dc);
        if (rc != FERRY_OK)
            return rc;
    }
    /* spare blocks for exact routes, made now: a route made while the
     * previous one's calls run takes one instead of a cudaMalloc, which
     * can wait for the device (CUDA's implicit synchronisation) while
     * those calls wait for this thread's peers */
    for (int i = 0; i < FR_CUHT_SPARES; i++) {
        fr_cuht_route_t tmp;
        memset(&tmp, 0, sizeof(tmp));
        fr_cuht_spare_t *sp = (fr_cuht_spare_t *)calloc(1, sizeof(*sp));
        int rc = sp ? fr_cuht_route_mem(ep, &tmp, c->a.G.T, &cc, &dc)
                    : fr_ep_fail(ep, FERRY_ERR_NOMEM, "spare route tables");
        if (rc != FERRY_OK) {
            free(sp);
            return rc;
        }
        sp->mem = tmp.mem;
        sp->size = tmp.size;
        sp->done = tmp.done; /* never recorded: ready */
        sp->dirty = 1;
        sp->next = c->spare;
        c->spare = sp;
    }
    return FERRY_OK;
}

extern "C" void fr_cuht_pool_free(ferry_ep_t ep)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    for (int i = 0; i < FR_CUHT_POOL; i++) {
        if (!c->pool[i])
            continue;
        if (c->pool[i]->mem)
            cudaFree(c->pool[i]->mem);
        if (c->pool[i]->done)
            cudaEventDestroy(c->pool[i]->done);
        free(c->pool[i]);
        c->pool[i] = NULL;
    }
}

/* After the synchronisation: a bad topk_idx here or at a peer. */
static int fr_cuht_route_bad(ferry_ep_t ep, const ferry_route_in_t *in, fr_cuht_route_t *p,
                             int bad_rank)
{
    int32_t first = FR_CUHT_NOBAD;
    int K = ep->L.K;
    if (cudaMemcpy(&first, p->bad, sizeof(first), cudaMemcpyDeviceToHost) != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "route_create: reading its result: %s",
                          cudaGetErrorString(cudaGetLastError()));
    if (first != FR_CUHT_NOBAD) {
        first = INT_MAX - first; /* the entry's index (FR_CUHT_NOBAD) */
        int64_t v = 0;
        cudaMemcpy(&v, in->topk_idx + first, sizeof(v), cudaMemcpyDeviceToHost);
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "topk_idx[%d][%d] = %lld (checked on the GPU): must be -1 or 0..%d "
                          "and not repeat an expert of its token (no route was made; every "
                          "rank's route_create fails)", first / K, first % K, (long long)v,
                          ep->L.E - 1);
    }
    return fr_ep_fail(ep, FERRY_ERR_INVALID,
                      "route_create: rank %d passed a bad topk_idx (checked on its GPU; no "
                      "route was made)", bad_rank);
}

/* Monotonic nanoseconds (the wait's pacing). */
static uint64_t fr_cuht_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* An exact route's one host wait: polls the host-mapped word notify
 * stores last (as DeepEP's host polls its receive counter), never a
 * stream, event or device synchronisation. The event recorded after
 * notify ends the wait where notify returned early (a failure, which the
 * error word then names): it is queried every FR_CUHT_RQ_NS of the wait,
 * not every few polls (a driver call each, which under a profiler or MPS
 * costs the host far more than the load of the word). notify's own waits
 * are bounded by the timeout, and it runs after whatever the stream held
 * before it. */
#define FR_CUHT_RQ_NS 20000ull
static int fr_cuht_route_wait(ferry_ep_t ep, cudaEvent_t after)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    volatile fr_cuht_res_t *res = c->res_host;
    cudaError_t e = cudaSuccess;
    uint64_t t0 = 0, next = 0;
    for (unsigned n = 0; e == cudaSuccess; n++) {
        if (res->done)
            break;
        if ((n & 63) != 63)
            continue;
        uint64_t t = fr_cuht_now_ns();
        if (!t0)
            t0 = t, next = t + FR_CUHT_RQ_NS;
        if (t < next)
            continue;
        next = t + FR_CUHT_RQ_NS;
        e = cudaEventQuery(after);
        if (e == cudaErrorNotReady) {
            e = cudaSuccess;
            if (t - t0 > 100000ull) /* long (100 us): let ranks sharing the cores run */
                sched_yield();
        } else if (e == cudaSuccess) {
            if (!res->done) { /* notify ended early: the error word says why */
                int rc = fr_cuht_check(ep);
                return rc ? rc : fr_ep_fail(ep, FERRY_ERR_INTERNAL, "route_create: "
                                            "notify ended without its counts");
            }
            break;
        }
    }
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "route_create: %s", cudaGetErrorString(e));
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the counts after the flag */
    return fr_cuht_check(ep);
}

/* A route's kernels on st: without forwarding fr_cuht_route1 alone (after
 * a memset only where the tables are dirty), with it the two layouts and
 * notify after one. */
static void fr_cuht_route_kernels(struct fr_cuht_ep *c, const ferry_route_in_t *in,
                                  fr_cuht_route_t *p, int32_t *ccnt, int32_t *dcnt,
                                  const fr_cuht_nout_t &o, cudaStream_t st)
{
    const fr_cuht_geo_t *G = &c->a.G;
    int T = in->num_tokens, El = G->El;
    /* the per-expert counts and the bad-entry word start from zero:
     * one memset from the first to the second (the tables between,
     * which notify writes whole, zeroed too), unless the last route
     * on these tables was route1's, which left them zero */
    if (p->dirty || G->fwd) {
        if ((uint8_t *)p->bad > (uint8_t *)dcnt)
            cudaMemsetAsync(dcnt, 0, (size_t)((uint8_t *)(p->bad + 1) - (uint8_t *)dcnt),
                            st);
        else {
            cudaMemsetAsync(dcnt, 0, sizeof(int32_t) * (size_t)G->N * El, st);
            cudaMemsetAsync(p->bad, 0, sizeof(int32_t), st);
        }
    }
    /* until route1 has run whole (a failure below, a bad topk_idx
     * whose index the host reads, forwarding's kernels) */
    p->dirty = 1;
    if (!G->fwd) {
        fr_cuht_route1<<<G->C, FR_RL_THREADS, 0, st>>>(
            c->a, T, in->topk_idx, (int32_t *)p->r.idx, (int32_t *)p->r.dst,
            (int32_t *)p->r.dpos, (int32_t *)p->r.rtok, ccnt, dcnt, p->bad, c->rlast,
            c->rseq, (int32_t *)p->r.rcnt, (int32_t *)p->r.rbase, o);
    } else { /* by rank for the counts, by key for the records */
        const fr_cuht_fw_t *fw = &c->a.fw;
        fr_cuht_layout<<<G->C, FR_RL_THREADS, 0, st>>>(
            c->a, T, in->topk_idx, NULL, NULL, (int32_t *)p->r.idx, NULL, NULL, NULL,
            p->rcc, dcnt, p->bad);
        fr_cuht_layout<<<G->C, FR_RL_THREADS, 0, st>>>(
            c->a, T, in->topk_idx, fw->key, fw->kord, NULL, (int32_t *)p->r.dst,
            (int32_t *)p->r.dpos, (int32_t *)p->r.rtok, ccnt, NULL, NULL);
        fr_cuht_notify<<<1, FR_RN_THREADS, 0, st>>>(
            c->a, c->rseq, p->rcc, ccnt, dcnt, p->bad, (int32_t *)p->r.rcnt,
            (int32_t *)p->r.rbase, (int32_t *)p->r.fcnt, (int32_t *)p->r.fbase, o);
    }
}

extern "C" int fr_cuht_route_create(ferry_ep_t ep, const ferry_route_in_t *in,
                                    ferry_route_t route)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    const fr_cuht_geo_t *G = &c->a.G;
    int T = in->num_tokens, El = G->El, rc = FERRY_OK, bounded = route->bound > 0;
    cudaStream_t st = (cudaStream_t)in->stream;
    fr_cuht_route_t *p = NULL;
    route->T = T;
    route->ecnt = (int32_t *)calloc((size_t)El + 1, sizeof(int32_t));
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cap) != cudaSuccess)
        (void)cudaGetLastError();
    int capturing = cap == cudaStreamCaptureStatusActive;
    if (bounded) { /* tables from the pool: nothing allocated (capturable) */
        for (int i = 0; i < FR_CUHT_POOL && !p; i++) {
            int k = (c->pool_next + i) % FR_CUHT_POOL;
            if (!c->pool_used[k]) {
                p = c->pool[k];
                c->pool_used[k] = 1;
                c->pool_next = k + 1;
                p->captured = capturing;
                p->dispatched = 0; /* a new route: no dispatch on it yet */
            }
        }
    }
    int pooled = p != NULL;
    if (!p && (p = (fr_cuht_route_t *)calloc(1, sizeof(*p))) != NULL)
        p->slot = -1; /* an exact route, or every pooled slot in use */
    route->priv = p;
    int32_t *ccnt = p ? p->ccnt : NULL, *dcnt = p ? p->dcnt : NULL;
    if (!p || !route->ecnt)
        rc = fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    if (rc == FERRY_OK && !pooled && capturing)
        /* a graph cannot allocate: this rank launches no notify, so its
         * route numbers leave its peers' (they fail naming it) */
        rc = fr_ep_fail(ep, FERRY_ERR_STATE, "route_create: captured in a CUDA graph, but "
                        "%s (bounded routes take their tables from a pool of %d; routes "
                        "captured in graphs keep theirs)",
                        bounded ? "every pooled table is in use" : "not a bounded route "
                        "(max_recv = 0 waits for the counts)", FR_CUHT_POOL);
    if (rc == FERRY_OK && !pooled)
        rc = fr_cuht_route_mem(ep, p, T, &ccnt, &dcnt);
    if (rc == FERRY_OK) {
        p->r.T = T;
        p->r.bound = route->bound;
        fr_cuht_nout_t o;
        memset(&o, 0, sizeof(o));
        o.bound = route->bound;
        o.align = in->expert_alignment;
        o.idw = (unsigned long long *)p->r.idp;
        o.nrecv = (int32_t *)p->r.nrecv;
        if (bounded) {
            o.nrecv_out = in->num_recv_out;
            o.ecnt_out = in->expert_counts_out;
        } else {
            fr_cuht_res_t *res = c->res_host;
            res->num_recv = -1;
            res->bad_rank = -1;
            res->done = 0; /* no notify writes it now: the last exact one was waited for */
            o.res = (fr_cuht_res_t *)c->res_dev;
        }
        fr_cuht_route_kernels(c, in, p, ccnt, dcnt, o, st);
        rc = fr_cuht_launch_check(ep, "route_create");
        fr_cuht_route_used(route, st);
    }
    /* route1 zeroes what it added into, for the next route on these
     * tables (a bounded route's failures fail the context) */
    int clean = rc == FERRY_OK && !G->fwd;
    if (rc == FERRY_OK && bounded) {
        p->dirty = !clean;
        return FERRY_OK; /* counts, bound and topk_idx are checked on the GPU */
    }
    if (rc == FERRY_OK) /* the one host wait: for notify's counts (after it: p->done) */
        rc = fr_cuht_route_wait(ep, p->done);
    if (rc == FERRY_OK) {
        volatile fr_cuht_res_t *res = c->res_host;
        route->id = res->id;
        p->dirty = !clean || res->bad_rank >= 0;
        if (res->bad_rank >= 0) { /* this rank's own entries say -1 too */
            rc = fr_cuht_route_bad(ep, in, p, res->bad_rank);
            fr_cuht_route_free(route);
            return rc; /* the context stays usable */
        }
        route->num_recv = res->num_recv;
        int align = in->expert_alignment;
        for (int le = 0; le < El; le++) {
            int64_t v = res->ecnt[le];
            route->ecnt[le] = (int32_t)(align > 1 ? (v + align - 1) / align * align : v);
        }
        return FERRY_OK;
    }
    fr_cuht_route_free(route);
    if (!ep->failed) /* counts may be out already, or route numbers: out of step */
        fr_ep_set_failed(ep, rc ? rc : FERRY_ERR_INTERNAL);
    return rc;
}

extern "C" void fr_cuht_pad_rows(ferry_route_t route, const ferry_ht_dispatch_out_t *out,
                                 void *stream)
{
    fr_cuht_route_t *p = (fr_cuht_route_t *)route->priv;
    if (route->bound <= 0 || (!out->recv_topk_idx && !out->recv_topk_idx_i64 &&
                              !out->recv_topk_weights &&
                              !out->recv_src_rank && !out->recv_src_token))
        return;
    int blocks = (route->bound + 255) / 256;
    fr_cuht_pad<<<blocks < 64 ? blocks : 64, 256, 0, (cudaStream_t)stream>>>(
        p->r.nrecv, route->bound, route->ep->L.K, out->recv_topk_idx,
        (long long *)out->recv_topk_idx_i64, out->recv_topk_weights, out->recv_src_rank,
        out->recv_src_token);
}

extern "C" int fr_cuht_load_route(void)
{
    cudaFuncAttributes fa;
    return cudaFuncGetAttributes(&fa, fr_cuht_layout) != cudaSuccess ||
           cudaFuncGetAttributes(&fa, fr_cuht_notify) != cudaSuccess ||
           cudaFuncGetAttributes(&fa, fr_cuht_route1) != cudaSuccess ||
           cudaFuncGetAttributes(&fa, fr_cuht_pad) != cudaSuccess;
}

void fr_cuht_route_used(ferry_route_t route, void *stream)
{
    fr_cuht_route_t *p = (fr_cuht_route_t *)route->priv;
    if (p && p->done)
        cudaEventRecord(p->done, (cudaStream_t)stream);
}
