/*
 * Dispatch and combine on CUDA ranks: one kernel each, one block per
 * channel (the config's num_sms), stream-ordered (the launchers return
 * without waiting). Channel c owns a contiguous range of every rank's
 * tokens, so its rows at a destination are one contiguous run and block c
 * of every rank only ever waits for block c of its peers.
 *
 * A block has two groups of W warps (W = 8, or 16 above 8 ranks): warp i
 * of the first sends to one peer, warp i of the second receives from one
 * (each ring has one writer warp and one reader warp; with a warp per
 * peer nobody waits on a ring while another ring it serves could move).
 *
 * dispatch  sender (c, d):   this channel's tokens that go to d, in token
 *                            order, as records (core/ht_rec.h: token, local
 *                            expert ids, weights, route number, dtype; the
 *                            row with 16-byte stores; fp8 scales) into
 *                            ring (c, this rank) of d's segment; the tail
 *                            published every FR_CUHT_CHUNK records and
 *                            before waiting for room (release, system
 *                            scope); room: d's head, polled here.
 *           receiver (c, s): lane 0 polls the tail of ring (c, s) here; the
 *                            records are checked (token, route, dtype,
 *                            expert ids) before use and copied to recv_x
 *                            row rbase[s][c] + i and the optional outputs;
 *                            the head is published back into s's segment.
 * combine   sender (c, s):   rows rbase[s][c].. of y (and the slot weights)
 *                            back into ring (c, this rank) of s's segment.
 *           receivers:       the group merges the channel's rings in token
 *                            order, in batches of up to min(ring, 32)
 *                            tokens: one thread per peer waits until the
 *                            batch's records are in, the warps sum each
 *                            token's rows in ascending rank order in fp32
 *                            and round once to bf16 (bit for bit the CPU
 *                            engine's result), the heads go back.
 *
 * Counters are cumulative (cuda_ht_dev.cuh), so calls follow each other
 * with no reset and no barrier; a receiver takes exactly the records of
 * this call (counts from the route), never more. Every wait is bounded by
 * FERRY_TIMEOUT_MS (the error word names the rank); after any failure the
 * context's kernels return at once.
 */
#include <stdint.h>

#include "engines/cuda_ht/cuda_ht_dev.cuh"

#define FR_FULL 0xffffffffu

/* Pointers of one dispatch or combine call (device memory). */
typedef struct fr_cuht_io {
    const uint8_t *x;        /* dispatch: [T][rowb]; combine: y [num_recv][2H] */
    const float *xs;         /* [T][nsc] scales (fp8) */
    const float *w;          /* dispatch: topk_weights [T][K]; combine: [num_recv][K] */
    uint8_t *rx;             /* dispatch: recv_x; combine: out [T][2H] */
    float *rxs;
    int32_t *ridx;
    float *rw;               /* dispatch: recv_topk_weights; combine: out topk_weights */
    int32_t *rsr, *rst;
    int fp8;
} fr_cuht_io_t;

/* Wait (lane 0) until the counter reaches `target`; the warp learns the
 * value seen, or returns false after a failure. */
static __device__ __forceinline__ bool fr_cuht_warp_wait(const fr_cuht_args_t &A,
                                                         const unsigned long long *w,
                                                         unsigned long long target, int rank,
                                                         int what, unsigned long long *seen)
{
    int ok = 1;
    unsigned long long v = *seen;
    if ((threadIdx.x & 31) == 0)
        ok = fr_cuht_wait_ge(A, w, target, rank, what, &v);
    ok = __shfl_sync(FR_FULL, ok, 0);
    *seen = __shfl_sync(FR_FULL, v, 0);
    return ok != 0;
}

/* ---------------------------------------------------------------------- */
/* dispatch                                                               */

static __device__ void fr_cuht_dsend(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c, int d)
{
    const fr_cuht_geo_t &G = A.G;
    int lane = threadIdx.x & 31, K = G.K, El = G.El, me = G.rank;
    int t0 = fr_cuht_chan_lo(R.T, G.C, c), t1 = fr_cuht_chan_lo(R.T, G.C, c + 1);
    size_t rowb = io.fp8 ? (size_t)G.H : 2 * (size_t)G.H;
    int nsc = io.fp8 ? G.H / 128 : 0;
    unsigned long long RT = (unsigned long long)G.RT;
    uint8_t *ring = A.peer[d] + fr_cuht_off_ring(G, 0, c, me);
    unsigned long long *tailw =
        (unsigned long long *)(A.peer[d] + fr_cuht_off_ctr(G, FR_CUHT_DTAIL, c, me));
    const unsigned long long *headw =
        (const unsigned long long *)(A.seg + fr_cuht_off_ctr(G, FR_CUHT_DHEAD, c, d));
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_DTAIL, c, d);
    unsigned long long sent = *mine, pub = sent;
    /* never more than RT records outstanding: d's head is at least this */
    unsigned long long head = sent > RT ? sent - RT : 0;
    int32_t flags = fr_ht_flags(io.fp8, R.id);
    size_t woff = fr_ht_woff(K);
    for (int base = t0; base < t1; base += 32) {
        int t = base + lane;
        unsigned int bal = __ballot_sync(FR_FULL, t < t1 && (R.mask[t] >> d & 1u));
        while (bal) {
            int tok = base + __ffs(bal) - 1;
            bal &= bal - 1;
            if (sent - head >= RT) {
                if (sent > pub) { /* what is written can be taken meanwhile */
                    fr_cuht_publish(tailw, sent);
                    pub = sent;
                }
                if (!fr_cuht_warp_wait(A, headw, sent - RT + 1, d, FR_CUHT_WHAT_DISPATCH, &head))
                    return;
                if (head > sent) {
                    if (lane == 0)
                        fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d, FR_CUHT_WHAT_OVERRUN,
                                     (int)(head - sent));
                    return;
                }
            }
            uint8_t *rec = ring + (sent % RT) * G.drec;
            if (lane == 0) {
                ((int32_t *)rec)[0] = tok;
                ((int32_t *)rec)[1] = flags;
            }
            if (lane < K) {
                int e = R.idx[(size_t)tok * K + lane];
                bool loc = e >= 0 && e / El == d;
                ((int16_t *)(rec + 8))[lane] = (int16_t)(loc ? e % El : -1);
                ((float *)(rec + woff))[lane] = loc && io.w ? io.w[(size_t)tok * K + lane] : 0.f;
            }
            fr_warp_copy16(rec + G.dhdr, io.x + (size_t)tok * rowb, rowb);
            for (int j = lane; j < nsc; j += 32)
                ((float *)(rec + G.dhdr + rowb))[j] = io.xs[(size_t)tok * nsc + j];
            sent++;
            if (sent - pub >= FR_CUHT_CHUNK) {
                fr_cuht_publish(tailw, sent);
                pub = sent;
            }
        }
        if (__any_sync(FR_FULL, fr_cuht_failed(A))) /* the warp leaves together */
            return;
    }
    if (sent > pub)
        fr_cuht_publish(tailw, sent);
    if (lane == 0)
        *mine = sent;
}

static __device__ void fr_cuht_drecv(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c, int s)
{
    const fr_cuht_geo_t &G = A.G;
    int lane = threadIdx.x & 31, K = G.K, El = G.El, C = G.C;
    size_t rowb = io.fp8 ? (size_t)G.H : 2 * (size_t)G.H;
    int nsc = io.fp8 ? G.H / 128 : 0;
    unsigned long long RT = (unsigned long long)G.RT;
    int n = R.rcnt[(size_t)s * C + c], row0 = R.rbase[(size_t)s * C + c];
    const uint8_t *ring = A.seg + fr_cuht_off_ring(G, 0, c, s);
    const unsigned long long *tailw =
        (const unsigned long long *)(A.seg + fr_cuht_off_ctr(G, FR_CUHT_DTAIL, c, s));
    unsigned long long *headw =
        (unsigned long long *)(A.peer[s] + fr_cuht_off_ctr(G, FR_CUHT_DHEAD, c, G.rank));
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_DHEAD, c, s);
    unsigned long long start = *mine, taken = start, end = start + (unsigned long long)n;
    unsigned long long tail = start, pub = start;
    size_t woff = fr_ht_woff(K);
    while (taken < end) {
        if (tail <= taken) {
            if (taken > pub) {
                fr_cuht_publish(headw, taken);
                pub = taken;
            }
            if (!fr_cuht_warp_wait(A, tailw, taken + 1, s, FR_CUHT_WHAT_DISPATCH, &tail))
                return;
            if (tail > pub + RT) { /* more than the ring holds */
                if (lane == 0)
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_OVERRUN,
                                 (int)(tail - pub - RT));
                return;
            }
        }
        unsigned long long lim = tail < end ? tail : end;
        for (; taken < lim; taken++) {
            const uint8_t *rec = ring + (taken % RT) * G.drec;
            /* the header is read once and checked before anything is used */
            int tok = __ldcg((const int32_t *)rec), flags = __ldcg((const int32_t *)rec + 1);
            int le = lane < K ? __ldcg((const short *)(rec + 8) + lane) : -1;
            float w = lane < K ? __ldcg((const float *)(rec + woff) + lane) : 0.f;
            int what = 0, detail = 0;
            if (tok < 0 || tok >= G.T) {
                what = FR_CUHT_WHAT_RECORD;
                detail = tok;
            } else if (((unsigned)flags >> 8 & 0xffu) != (R.id & 0xffu)) {
                what = FR_CUHT_WHAT_ORDER;
                detail = (int)((unsigned)flags >> 8 & 0xffu);
            } else if ((flags & 1) != io.fp8) {
                what = FR_CUHT_WHAT_DTYPE;
                detail = flags & 1;
            } else if (__any_sync(FR_FULL, le < -1 || le >= El)) {
                what = FR_CUHT_WHAT_RECORD;
                detail = tok;
            }
            if (what) {
                if (lane == 0)
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, what, detail);
                return;
            }
            size_t row = (size_t)row0 + (size_t)(taken - start);
            fr_warp_copy16_cg(io.rx + row * rowb, rec + G.dhdr, rowb);
            for (int j = lane; j < nsc; j += 32)
                io.rxs[row * nsc + j] = __ldcg((const float *)(rec + G.dhdr + rowb) + j);
            if (lane < K && io.ridx)
                io.ridx[row * K + lane] = le;
            if (lane < K && io.rw)
                io.rw[row * K + lane] = w;
            if (lane == 0 && io.rsr)
                io.rsr[row] = s;
            if (lane == 0 && io.rst)
                io.rst[row] = tok;
            if (taken + 1 - pub >= FR_CUHT_CHUNK) {
                fr_cuht_publish(headw, taken + 1);
                pub = taken + 1;
            }
        }
    }
    if (taken > pub)
        fr_cuht_publish(headw, taken);
    if (lane == 0)
        *mine = taken;
}

template <int W>
__global__ void __launch_bounds__(2 * W * 32)
fr_cuht_dispatch_k(fr_cuht_args_t A, fr_cuht_rdev_t R, fr_cuht_io_t io)
{
    int warp = threadIdx.x >> 5, N = A.G.N, me = A.G.rank, c = blockIdx.x;
    __shared__ int dead;
    if (threadIdx.x == 0)
        dead = fr_cuht_failed(A);
    __syncthreads();
    if (dead) /* the context failed earlier: nothing moves */
        return;
    if (warp < W) { /* destinations rotated: not every rank at rank 0 first */
        if (warp < N)
            fr_cuht_dsend(A, R, io, c, (me + 1 + warp) % N);
    } else if (warp - W < N) {
        fr_cuht_drecv(A, R, io, c, (me + N - 1 - (warp - W)) % N);
    }
}

/* ---------------------------------------------------------------------- */
/* combine                                                                */

static __device__ void fr_cuht_csend(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c, int s)
{
    const fr_cuht_geo_t &G = A.G;
    int lane = threadIdx.x & 31, K = G.K, C = G.C, me = G.rank;
    size_t rowb = 2 * (size_t)G.H;
    unsigned long long RT = (unsigned long long)G.RT;
    int n = R.rcnt[(size_t)s * C + c], row0 = R.rbase[(size_t)s * C + c];
    uint8_t *ring = A.peer[s] + fr_cuht_off_ring(G, 1, c, me);
    unsigned long long *tailw =
        (unsigned long long *)(A.peer[s] + fr_cuht_off_ctr(G, FR_CUHT_CTAIL, c, me));
    const unsigned long long *headw =
        (const unsigned long long *)(A.seg + fr_cuht_off_ctr(G, FR_CUHT_CHEAD, c, s));
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_CTAIL, c, s);
    unsigned long long sent = *mine, pub = sent;
    unsigned long long head = sent > RT ? sent - RT : 0;
    for (int i = 0; i < n; i++) {
        if (sent - head >= RT) {
            if (sent > pub) {
                fr_cuht_publish(tailw, sent);
                pub = sent;
            }
            if (!fr_cuht_warp_wait(A, headw, sent - RT + 1, s, FR_CUHT_WHAT_COMBINE, &head))
                return;
            if (head > sent) {
                if (lane == 0)
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_OVERRUN,
                                 (int)(head - sent));
                return;
            }
        }
        size_t row = (size_t)row0 + (size_t)i;
        uint8_t *rec = ring + (sent % RT) * G.crec;
        if (lane == 0) {
            ((int32_t *)rec)[0] = i; /* its place among the channel's rows: checked */
            ((uint32_t *)rec)[1] = R.id;
        }
        if (lane < K)
            ((float *)(rec + 8))[lane] = io.w ? io.w[row * K + lane] : 0.f;
        fr_warp_copy16(rec + G.chdr, io.x + row * rowb, rowb);
        sent++;
        if (sent - pub >= FR_CUHT_CHUNK) {
            fr_cuht_publish(tailw, sent);
            pub = sent;
        }
        if ((i & 31) == 31 && __any_sync(FR_FULL, fr_cuht_failed(A)))
            return;
    }
    if (sent > pub)
        fr_cuht_publish(tailw, sent);
    if (lane == 0)
        *mine = sent;
}

/* The receiving group (W warps, named barrier 1): the channel's own tokens
 * in batches; per batch, the records of each peer it needs are waited for
 * (one thread per peer), summed, and their ring slots handed back. */
template <int W>
static __device__ void fr_cuht_crecv(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c)
{
    const fr_cuht_geo_t &G = A.G;
    int N = G.N, K = G.K, El = G.El, H = G.H, C = G.C;
    int tid = threadIdx.x - W * 32, gw = tid >> 5, lane = threadIdx.x & 31;
    int t0 = fr_cuht_chan_lo(R.T, C, c), t1 = fr_cuht_chan_lo(R.T, C, c + 1);
    unsigned long long RT = (unsigned long long)G.RT;
    __shared__ unsigned long long sbase[FR_CUHT_MAX_RANKS], stail[FR_CUHT_MAX_RANKS];
    __shared__ int sneed[FR_CUHT_MAX_RANKS], spub[FR_CUHT_MAX_RANKS];
    __shared__ const uint8_t *sring[FR_CUHT_MAX_RANKS];
    /* failures seen while waiting, and while summing: two words, each
     * read only after the barrier that ends its phase and written again
     * only after the next barrier, so every warp reads the same value */
    __shared__ int wok, sok;
    if (tid < N) {
        sbase[tid] = *fr_cuht_my_ctr(A, FR_CUHT_CHEAD, c, tid);
        stail[tid] = sbase[tid];
        sneed[tid] = 0;
        spub[tid] = 0;
        sring[tid] = A.seg + fr_cuht_off_ring(G, 1, c, tid);
    }
    if (tid == 0)
        wok = sok = 1;
    fr_bar_sync(1, W * 32);
    int B = G.RT < 32 ? G.RT : 32; /* a batch's records of one peer fit its ring */
    for (int b0 = t0; b0 < t1; b0 += B) {
        int nb = t1 - b0 < B ? t1 - b0 : B;
        if (tid < N) {
            int d = tid;
            for (int j = nb - 1; j >= 0; j--)
                if (R.mask[b0 + j] >> d & 1u) {
                    sneed[d] = R.tpos[(size_t)(b0 + j) * N + d] + 1;
                    break;
                }
            unsigned long long want = sbase[d] + (unsigned long long)sneed[d], v = stail[d];
            if (stail[d] < want) {
                if (!fr_cuht_wait_ge(A, (const unsigned long long *)(A.seg + fr_cuht_off_ctr(
                                                                        G, FR_CUHT_CTAIL, c, d)),
                                     want, d, FR_CUHT_WHAT_COMBINE, &v)) {
                    wok = 0;
                } else if (v > sbase[d] + (unsigned long long)spub[d] + RT) {
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d, FR_CUHT_WHAT_OVERRUN,
                                 (int)(v - sbase[d] - spub[d] - RT));
                    wok = 0;
                }
                stail[d] = v;
            }
        }
        fr_bar_sync(1, W * 32);
        if (!wok)
            return;
        for (int j = gw; j < nb; j += W) {
            int t = b0 + j;
            unsigned int m = R.mask[t];
            const uint8_t *rec[FR_CUHT_MAX_RANKS];
            int bad = 0;
            for (int d = 0; d < N; d++) {
                rec[d] = NULL;
                if (!(m >> d & 1u))
                    continue;
                int pos = R.tpos[(size_t)t * N + d];
                rec[d] = sring[d] + ((sbase[d] + (unsigned long long)pos) % RT) * G.crec;
                if (lane == 0 && !bad &&
                    (__ldcg((const int32_t *)rec[d]) != pos ||
                     __ldcg((const uint32_t *)rec[d] + 1) != R.id)) {
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d,
                                 __ldcg((const uint32_t *)rec[d] + 1) != R.id
                                     ? FR_CUHT_WHAT_ORDER
                                     : FR_CUHT_WHAT_RECORD,
                                 __ldcg((const uint32_t *)rec[d] + 1) != R.id
                                     ? (int)__ldcg((const uint32_t *)rec[d] + 1)
                                     : pos);
                    bad = 1;
                }
            }
            if (__any_sync(FR_FULL, bad)) {
                sok = 0;
                break;
            }
            /* 8 channels per lane: fp32 sum in ascending rank order, one
             * rounding (what the CPU engine computes) */
            for (int h8 = lane; h8 < H / 8; h8 += 32) {
                float acc[8];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    acc[i] = 0.f;
                for (int d = 0; d < N; d++) {
                    if (!rec[d])
                        continue;
                    int4 v = __ldcg((const int4 *)(rec[d] + G.chdr) + h8);
                    const uint16_t *yv = (const uint16_t *)&v;
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[i] += fr_bf16_to_f32(yv[i]);
                }
                int4 o;
                uint16_t *ov = (uint16_t *)&o;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    ov[i] = fr_f32_to_bf16(acc[i]);
                ((int4 *)(io.rx + (size_t)t * 2 * H))[h8] = o;
            }
            if (io.rw && lane < K) {
                int e = R.idx[(size_t)t * K + lane];
                io.rw[(size_t)t * K + lane] =
                    e >= 0 ? __ldcg((const float *)(rec[e / El] + 8) + lane) : 0.f;
            }
        }
        fr_bar_sync(1, W * 32);
        if (!sok)
            return;
        if (tid < N && sneed[tid] > spub[tid]) { /* the batch's slots go back */
            __threadfence_system();
            fr_sys_st_release((unsigned long long *)(A.peer[tid] +
                                                     fr_cuht_off_ctr(G, FR_CUHT_CHEAD, c, G.rank)),
                              sbase[tid] + (unsigned long long)sneed[tid]);
            spub[tid] = sneed[tid];
        }
    }
    if (tid < N)
        *fr_cuht_my_ctr(A, FR_CUHT_CHEAD, c, tid) =
            sbase[tid] + (unsigned long long)R.ccnt[(size_t)tid * C + c];
}

template <int W>
__global__ void __launch_bounds__(2 * W * 32)
fr_cuht_combine_k(fr_cuht_args_t A, fr_cuht_rdev_t R, fr_cuht_io_t io)
{
    int warp = threadIdx.x >> 5, N = A.G.N, me = A.G.rank, c = blockIdx.x;
    __shared__ int dead;
    if (threadIdx.x == 0)
        dead = fr_cuht_failed(A);
    __syncthreads();
    if (dead)
        return;
    if (warp < W) {
        if (warp < N)
            fr_cuht_csend(A, R, io, c, (me + 1 + warp) % N);
    } else {
        fr_cuht_crecv<W>(A, R, io, c);
    }
}

/* ---------------------------------------------------------------------- */
/* host side                                                              */

/* A device pointer the kernels read or write with 16-byte (or 4-byte)
 * accesses. */
static int fr_cuht_aligned(ferry_ep_t ep, const void *p, unsigned a, const char *name,
                           const char *call)
{
    if (((uintptr_t)p & (a - 1)) == 0)
        return FERRY_OK;
    return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s: %s = %p must be %u-byte aligned on a CUDA "
                      "context", call, name, p, a);
}

extern "C" int fr_cuht_dispatch(ferry_ep_t ep, ferry_route_t route,
                                const ferry_ht_dispatch_in_t *in,
                                const ferry_ht_dispatch_out_t *out)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    fr_cuht_route_t *p = (fr_cuht_route_t *)route->priv;
    const char *call = "ht_dispatch";
    int rc;
    if ((rc = fr_cuht_aligned(ep, in->x, 16, "x", call)) ||
        (rc = fr_cuht_aligned(ep, in->x_scales, 4, "x_scales", call)) ||
        (rc = fr_cuht_aligned(ep, in->topk_weights, 4, "topk_weights", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_x, 16, "recv_x", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_x_scales, 4, "recv_x_scales", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_topk_idx, 4, "recv_topk_idx", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_topk_weights, 4, "recv_topk_weights", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_src_rank, 4, "recv_src_rank", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_src_token, 4, "recv_src_token", call)))
        return rc;
    fr_cuht_io_t io;
    memset(&io, 0, sizeof(io));
    io.x = (const uint8_t *)in->x;
    io.xs = in->x_scales;
    io.w = in->topk_weights;
    io.rx = (uint8_t *)out->recv_x;
    io.rxs = out->recv_x_scales;
    io.ridx = out->recv_topk_idx;
    io.rw = out->recv_topk_weights;
    io.rsr = out->recv_src_rank;
    io.rst = out->recv_src_token;
    io.fp8 = in->x_scales != NULL;
    cudaStream_t st = (cudaStream_t)in->stream;
    if (ep->N <= 8)
        fr_cuht_dispatch_k<8><<<c->a.G.C, 2 * 8 * 32, 0, st>>>(c->a, p->r, io);
    else
        fr_cuht_dispatch_k<16><<<c->a.G.C, 2 * 16 * 32, 0, st>>>(c->a, p->r, io);
    return fr_cuht_launch_check(ep, call);
}

extern "C" int fr_cuht_combine(ferry_ep_t ep, ferry_route_t route,
                               const ferry_ht_combine_in_t *in,
                               const ferry_ht_combine_out_t *out)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    fr_cuht_route_t *p = (fr_cuht_route_t *)route->priv;
    const char *call = "ht_combine";
    int rc;
    if ((rc = fr_cuht_aligned(ep, in->y, 16, "y", call)) ||
        (rc = fr_cuht_aligned(ep, in->topk_weights, 4, "topk_weights", call)) ||
        (rc = fr_cuht_aligned(ep, out->out, 16, "out", call)) ||
        (rc = fr_cuht_aligned(ep, out->topk_weights, 4, "out->topk_weights", call)))
        return rc;
    fr_cuht_io_t io;
    memset(&io, 0, sizeof(io));
    io.x = (const uint8_t *)in->y;
    io.w = in->topk_weights;
    io.rx = (uint8_t *)out->out;
    io.rw = out->topk_weights;
    cudaStream_t st = (cudaStream_t)in->stream;
    if (ep->N <= 8)
        fr_cuht_combine_k<8><<<c->a.G.C, 2 * 8 * 32, 0, st>>>(c->a, p->r, io);
    else
        fr_cuht_combine_k<16><<<c->a.G.C, 2 * 16 * 32, 0, st>>>(c->a, p->r, io);
    return fr_cuht_launch_check(ep, call);
}
