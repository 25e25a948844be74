/*
 * Dispatch and combine on CUDA ranks: one kernel each, one block per
 * channel (the config's num_sms), stream-ordered (the launchers return
 * without waiting). Channel c owns a contiguous range of every rank's
 * tokens, so its rows at a destination are one contiguous run and block c
 * of every rank only ever waits for block c of its peers.
 *
 * A block has two roles of W warps (W = 8, or 16 above 8 ranks): senders
 * and receivers. The W warps of a role are split among its rings: the
 * senders' N - 1 peer rings, the receivers' N - 1 peer rings and the own
 * tokens (a group each: at N = 2, 8 warps send, 4 receive, 4 copy the own
 * tokens; at N = 8 one warp per ring), so every warp moves data whatever
 * N. Above 16 ranks a role has more rings than warps: each warp then
 * serves several alone and waits on none of them ("a warp serving many
 * rings" below). A group works in lockstep steps: its leader
 * (lane 0 of its first warp) publishes the previous step's counter and
 * waits, a named barrier (one per group) hands the outcome to the group,
 * the warps copy the step's records round robin, and the next step's
 * barrier orders their stores before the leader's fence and release
 * store. Nothing else is shared, so a group waits on its own ring only.
 * Rows move through the bulk copy engine (the TMA) in the kernels of up
 * to 8 ranks without forwarding, where the device has their shared memory
 * (fr_cuht_ep.tma: every dispatch row, the combine's senders; lane 0 of a
 * warp streams a row through its shared memory stages, and a sender
 * waits for those writes and fences them
 * before its group's barrier, so the leader's release still covers them).
 * Elsewhere, and in the combine's sums, copies keep 8 (4 in the sums over
 * two ranks) 16-byte loads per lane in flight (runtime/cuda_sync.cuh).
 *
 * dispatch  senders (c, d):  this channel's tokens that go to d, in token
 *                            order (the route's rtok), as records
 *                            (core/ht_rec.h: token, local expert ids,
 *                            weights, route number, dtype; the row; fp8
 *                            scales) into ring (c, this rank) of d's
 *                            segment, FR_CUHT_STEP records per warp a step;
 *                            room: d's head, polled here; a step's tail
 *                            goes out while the next step is copied, or
 *                            before the leader waits.
 *                            The own tokens go straight from x to their
 *                            rows (a receiver group): no ring, no counters.
 *           receivers (c, s): the leader polls the tail of ring (c, s)
 *                            here; the records are copied to recv_x row
 *                            rbase[s][c] + i and checked (token, route,
 *                            dtype, expert ids) before their fields are
 *                            used; the head goes back into s's segment.
 * combine   senders (c, s):  rows rbase[s][c].. of y (and the slot weights)
 *                            back into ring (c, this rank) of s's segment
 *                            (none for s = this rank).
 *           receivers:       the role merges the channel's rings in token
 *                            order, in batches of half a ring (at most
 *                            FR_CUHT_CBATCH tokens): one thread per peer
 *                            waits until the batch's records are in, the
 *                            warps sum each token's rows (own rows straight
 *                            from y) in ascending rank order in fp32 and
 *                            round once to bf16 (bit for bit the CPU
 *                            engine's result), the heads go back. A sender
 *                            step plus a batch fit a ring, so a sender
 *                            waiting for room and a batch waiting for its
 *                            records cannot block each other.
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
/* 0: the copy engine's kernels never taken (fr_cuht_tma_prep), the warp
 * copies everywhere: a build to compare against */
#ifndef FR_CUHT_TMA
#define FR_CUHT_TMA 1
#endif
#define FR_CUHT_FSUM 4 /* a forwarder's combine: vectors of each row in flight per lane */

/* Pointers of one dispatch or combine call (device memory). */
typedef struct fr_cuht_io {
    const uint8_t *x;        /* dispatch: [T][rowb]; combine: y [num_recv][2H] */
    const float *xs;         /* [T][nsc] scales (fp8): scale q of token t at
                                t * xs0 + q * xs1 */
    long long xs0, xs1;
    const float *w;          /* dispatch: topk_weights [T][K]; combine: [num_recv][K] */
    uint8_t *rx;             /* dispatch: recv_x; combine: out [T][2H] */
    float *rxs;
    int32_t *ridx;           /* dispatch: recv_topk_idx, int32 ... */
    long long *ridx64;       /* ... or int64 (at most one of the two) */
    float *rw;               /* dispatch: recv_topk_weights; combine: out topk_weights */
    int32_t *rsr, *rst;
    int fp8;
    int wsum;                /* combine: rw slot k summed over the token's ranks */
    const int4 *bias[2];     /* combine: [T][2H] bf16 each, or NULL: added before rounding */
    int slots;               /* combine: FERRY_HT_SUM_SLOTS (the biases first, then
                                the rows by their highest slot) */
} fr_cuht_io_t;

/* Entry i of recv_topk_idx, in the dtype the caller gave (or none). */
static __device__ __forceinline__ void fr_cuht_put_idx(const fr_cuht_io_t &io, size_t i, int v)
{
    if (io.ridx)
        io.ridx[i] = v;
    else if (io.ridx64)
        io.ridx64[i] = v;
}

/* A ring's group of warps (a sender or receiver group of one ring, see
 * the top): P warps, this warp's place j in it, the named barrier they
 * share (none when P = 1: the warp's own) and two shared words through
 * which the group's leader (lane 0 of warp 0) tells every warp what it
 * waited for. Each word is written by the leader between the two
 * barriers of a step and read after the second, so every warp reads the
 * same value. */
typedef struct fr_cuht_grp {
    int j, P, bar;
    volatile int *ok;
    volatile int *lim;
} fr_cuht_grp_t;

static __device__ __forceinline__ void fr_cuht_gbar(const fr_cuht_grp_t &g)
{
    if (g.P > 1)
        fr_bar_sync(g.bar, g.P * 32);
    else
        __syncwarp();
}

static __device__ __forceinline__ bool fr_cuht_lead(const fr_cuht_grp_t &g)
{
    return g.j == 0 && (threadIdx.x & 31) == 0;
}

/* ---------------------------------------------------------------------- */
/* senders (dispatch and combine)                                         */

/* What the records and rows of a role look like, read from the geometry
 * once per role and passed to the per-record helpers (fr_cuht_put,
 * fr_cuht_self, fr_cuht_take). Read inside them, through the reference
 * to the geometry, the dispatch kernel was 7-8% slower at 2 and 8 ranks
 * than with the fields read once before the loops (docs/benchmarks.md). */
typedef struct fr_cuht_fmt {
    size_t rowb;  /* row bytes: H, or 2H (bf16, and every combine row) */
    size_t hdr;   /* record header bytes before the row */
    size_t woff;  /* dispatch: where the weights start in the header */
    int nsc;      /* fp8 scales per row (dispatch), else 0 */
    int K, El, me, T;
} fr_cuht_fmt_t;

static __device__ __forceinline__ fr_cuht_fmt_t fr_cuht_fmt(const fr_cuht_geo_t &G,
                                                            const fr_cuht_io_t &io, bool comb)
{
    fr_cuht_fmt_t F;
    F.rowb = !comb && io.fp8 ? (size_t)G.H : 2 * (size_t)G.H;
    F.nsc = !comb && io.fp8 ? G.H / 128 : 0;
    F.hdr = comb ? G.chdr : G.dhdr;
    F.woff = fr_ht_woff(G.K);
    F.K = G.K;
    F.El = G.El;
    F.me = G.rank;
    F.T = G.T;
    return F;
}

/* Record i of a sender's run into slot `rec` of the ring at d (the whole
 * warp):
 *   dispatch: the channel's i-th token to d (tok_of[i]) as core/ht_rec.h's
 *             record: token, flags, d's local expert ids and weights, the
 *             row, the fp8 scales
 *   combine:  row row0 + i of y with its K weights, after its place among
 *             the channel's rows and the route number (both checked) */
template <bool COMB, int U, int TW = 0>
static __device__ __forceinline__ void fr_cuht_put(const fr_cuht_fmt_t &F,
                                                   const fr_cuht_rdev_t &R,
                                                   const fr_cuht_io_t &io, int d, int i,
                                                   int row0, const int32_t *tok_of,
                                                   uint8_t *rec, int32_t flags,
                                                   const int *nl)
{
    int lane = threadIdx.x & 31, K = F.K, El = F.El, nsc = F.nsc;
    size_t rowb = F.rowb, hdr = F.hdr;
    const uint8_t *src;
    if (COMB) {
        size_t row = (size_t)row0 + (size_t)i;
        if (lane == 0) {
            ((int32_t *)rec)[0] = i; /* its place among the channel's rows: checked */
            ((uint32_t *)rec)[1] = R.id;
        }
        if (lane < K)
            ((float *)(rec + 8))[lane] = io.w ? io.w[row * K + lane] : 0.f;
        src = io.x + row * rowb;
    } else {
        int tok = tok_of[i];
        size_t woff = F.woff;
        if (lane == 0) {
            ((int32_t *)rec)[0] = tok;
            ((int32_t *)rec)[1] = flags;
        }
        if (lane < K) {
            /* d's local expert ids; a node-level record for a forwarder d
             * (nl set): ids relative to d's node (local index x El +
             * local expert) */
            int e = R.idx[(size_t)tok * K + lane], le = -1;
            if (e >= 0 && !nl && e / El == d)
                le = e % El;
            else if (e >= 0 && nl && (nl[e / El] >> 16) == (nl[d] >> 16))
                le = (nl[e / El] & 0xffff) * El + e % El;
            ((int16_t *)(rec + 8))[lane] = (int16_t)le;
            ((float *)(rec + woff))[lane] = le >= 0 && io.w ? io.w[(size_t)tok * K + lane] : 0.f;
        }
        for (int q = lane; q < nsc; q += 32)
            ((float *)(rec + hdr + rowb))[q] = io.xs[tok * io.xs0 + q * io.xs1];
        src = io.x + (size_t)tok * rowb;
    }
    fr_warp_copy<U, false, (TW > 0)>(TW, rec + hdr, src, rowb);
}

/* Sender group of ring (c, this rank) at peer d: n records, in steps of up
 * to S (S <= ring: the leader waits for room for the whole step, then the
 * group's warps write its records round robin). A step's tail goes out
 * after the barrier that ends its copies (system fence, release store by
 * the leader): while the next step is copied, or before the leader
 * waits, so a waiting group has published everything it wrote.
 *   dispatch: record i is the channel's i-th token to d (route's rtok)
 *   combine:  record i is row rbase[d][c] + i of y with its K weights */
template <bool COMB, int U, int TW = 0>
static __device__ void fr_cuht_send(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                    const fr_cuht_io_t &io, int c, int d, int S,
                                    const fr_cuht_grp_t &g)
{
    const fr_cuht_geo_t &G = A.G;
    if (COMB && fr_cuht_fwd_here(A, d)) /* its rows go with the forwarded sums */
        return;
    const fr_cuht_fmt_t F = fr_cuht_fmt(G, io, COMB);
    int C = G.C;
    bool lead = fr_cuht_lead(g);
    int n = COMB ? R.rcnt[(size_t)d * C + c] : R.ccnt[(size_t)d * C + c];
    const int *nl = !COMB && G.fwd && (A.fw.nl[d] >> 16) != A.fw.node ? A.fw.nl : NULL;
    int row0 = COMB ? R.rbase[(size_t)d * C + c] : 0;
    const int32_t *tok_of = R.rtok + (size_t)d * R.T + fr_cuht_chan_lo(R.T, C, c);
    unsigned long long RT = (unsigned long long)G.RT, recb = COMB ? G.crec : G.drec;
    int what = COMB ? FR_CUHT_WHAT_COMBINE : FR_CUHT_WHAT_DISPATCH;
    uint8_t *ring = fr_cuht_wring(A, d, COMB, c);
    unsigned long long *tailw = fr_cuht_wctr(A, d, COMB ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, c);
    const unsigned long long *headw = fr_cuht_rctr(A, d, COMB ? FR_CUHT_CHEAD : FR_CUHT_DHEAD, c);
    unsigned long long *mine = fr_cuht_my_ctr(A, COMB ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, c, d);
    unsigned long long sent0 = *mine;
    /* never more than RT records outstanding: d's head is at least this */
    unsigned long long head = sent0 > RT ? sent0 - RT : 0;
    int32_t flags = fr_ht_flags(io.fp8, R.id);
    unsigned long long pub = sent0; /* the leader's */
    for (int i0 = 0; i0 < n; i0 += S) {
        int m = n - i0 < S ? n - i0 : S;
        unsigned long long sent = sent0 + (unsigned long long)i0;
        if (TW)
            fr_tma_flush(); /* the copy engine's writes, before the leader publishes */
        fr_cuht_gbar(g); /* the previous step's records are written */
        if (lead) {
            int ok = !fr_cuht_failed(A);
            if (ok && sent + (unsigned long long)m - head > RT) {
                if (sent > pub) { /* what is written can be taken meanwhile */
                    fr_cuht_publish(tailw, sent);
                    pub = sent;
                }
                ok = fr_cuht_wait_ge(A, headw, sent + (unsigned long long)m - RT, d, what,
                                     &head, COMB);
                if (ok && head > sent) {
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d, FR_CUHT_WHAT_OVERRUN,
                                 (int)(head - sent));
                    ok = 0;
                }
            }
            *g.ok = ok;
        }
        fr_cuht_gbar(g);
        if (!*g.ok) /* the group leaves together */
            return;
        if (lead && sent > pub) { /* the previous step's tail, while the others copy */
            fr_cuht_publish(tailw, sent);
            pub = sent;
        }
        for (int k = g.j; k < m; k += g.P)
            fr_cuht_put<COMB, U, TW>(F, R, io, d, i0 + k, row0, tok_of,
                                     ring + ((sent + (unsigned long long)k) % RT) * recb,
                                     flags, nl);
    }
    if (TW)
        fr_tma_flush();
    fr_cuht_gbar(g);
    if (lead) {
        if (n > 0 && !fr_cuht_failed(A))
            fr_cuht_publish(tailw, sent0 + (unsigned long long)n);
        *mine = sent0 + (unsigned long long)n;
    }
}

/* ---------------------------------------------------------------------- */
/* dispatch                                                               */

/* The own token `tok` straight from x into row `row` (no ring, no
 * counters; the whole warp): the same values a receiver would write. */
template <int U, int TW = 0>
static __device__ __forceinline__ void fr_cuht_self(const fr_cuht_fmt_t &F,
                                                    const fr_cuht_rdev_t &R,
                                                    const fr_cuht_io_t &io, int tok, size_t row)
{
    int lane = threadIdx.x & 31, K = F.K, El = F.El, me = F.me, nsc = F.nsc;
    size_t rowb = F.rowb;
    fr_warp_copy<U, false, (TW > 0)>(TW, io.rx + row * rowb, io.x + (size_t)tok * rowb, rowb);
    for (int q = lane; q < nsc; q += 32)
        io.rxs[row * nsc + q] = io.xs[tok * io.xs0 + q * io.xs1];
    if (lane < K) {
        int e = R.idx[(size_t)tok * K + lane];
        bool loc = e >= 0 && e / El == me;
        fr_cuht_put_idx(io, row * K + lane, loc ? e % El : -1);
        if (io.rw)
            io.rw[row * K + lane] = loc && io.w ? io.w[(size_t)tok * K + lane] : 0.f;
    }
    if (lane == 0 && io.rsr)
        io.rsr[row] = me;
    if (lane == 0 && io.rst)
        io.rst[row] = tok;
}

/* The own tokens of channel c: the group's warps take them round robin,
 * nothing to wait for. */
template <int U, int TW = 0>
static __device__ void fr_cuht_dself(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c, const fr_cuht_grp_t &g)
{
    const fr_cuht_fmt_t F = fr_cuht_fmt(A.G, io, false);
    int C = A.G.C, me = A.G.rank;
    int n = R.ccnt[(size_t)me * C + c], row0 = R.rbase[(size_t)me * C + c];
    const int32_t *tok_of = R.rtok + (size_t)me * R.T + fr_cuht_chan_lo(R.T, C, c);
    for (int i = g.j; i < n; i += g.P)
        fr_cuht_self<U, TW>(F, R, io, tok_of[i], (size_t)row0 + (size_t)i);
}

/* A dispatch record's header against what this call expects (a token
 * below T, this route's number, this dtype): 0, or what is wrong
 * (FR_CUHT_WHAT_RECORD, _ORDER, _DTYPE). Receivers and forwarders alike. */
static __device__ __forceinline__ int fr_cuht_hdr_bad(int tok, int flags, int T, unsigned id,
                                                      int fp8)
{
    if (tok < 0 || tok >= T)
        return FR_CUHT_WHAT_RECORD;
    if (((unsigned)flags >> 8 & 0xffu) != (id & 0xffu))
        return FR_CUHT_WHAT_ORDER;
    if ((flags & 1) != fp8)
        return FR_CUHT_WHAT_DTYPE;
    return 0;
}

/* A record of ring (c, s) here, at `rec`, into row `row` (the whole warp):
 * its header is loaded with the row and checked before any of its fields
 * is used; a bad one fails the context, naming s (its outputs are then
 * not valid), and gives false. The header is loaded once and broadcast,
 * so every lane takes the same branch even if the record were being
 * rewritten (a split warp would deadlock at a group's barrier, with no
 * timeout). */
template <int U, int TW = 0>
static __device__ __forceinline__ bool fr_cuht_take(const fr_cuht_args_t &A,
                                                    const fr_cuht_fmt_t &F,
                                                    const fr_cuht_rdev_t &R,
                                                    const fr_cuht_io_t &io, int s, size_t row,
                                                    const uint8_t *rec)
{
    int lane = threadIdx.x & 31, K = F.K, El = F.El, nsc = F.nsc;
    size_t rowb = F.rowb, woff = F.woff, dhdr = F.hdr;
    int tok = __shfl_sync(FR_FULL, __ldcg((const int32_t *)rec), 0);
    int flags = __shfl_sync(FR_FULL, __ldcg((const int32_t *)rec + 1), 0);
    int le = lane < K ? __ldcg((const short *)(rec + 8) + lane) : -1;
    float w = lane < K ? __ldcg((const float *)(rec + woff) + lane) : 0.f;
    fr_warp_copy<U, true, (TW > 0)>(TW, io.rx + row * rowb, rec + dhdr, rowb);
    for (int q = lane; q < nsc; q += 32)
        io.rxs[row * nsc + q] = __ldcg((const float *)(rec + dhdr + rowb) + q);
    bool badle = __any_sync(FR_FULL, le < -1 || le >= El);
    int what = fr_cuht_hdr_bad(tok, flags, F.T, R.id, io.fp8);
    if (!what && badle)
        what = FR_CUHT_WHAT_RECORD;
    if (what) {
        int detail = what == FR_CUHT_WHAT_ORDER   ? (int)((unsigned)flags >> 8 & 0xffu)
                     : what == FR_CUHT_WHAT_DTYPE ? flags & 1
                                                  : tok;
        if (lane == 0)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, what, detail);
        return false;
    }
    if (lane < K)
        fr_cuht_put_idx(io, row * K + lane, le);
    if (lane < K && io.rw)
        io.rw[row * K + lane] = w;
    if (lane == 0 && io.rsr)
        io.rsr[row] = s;
    if (lane == 0 && io.rst)
        io.rst[row] = tok;
    return true;
}

/* Receiver group of ring (c, s) here: this call's n records, in steps of
 * what the tail shows (at most S): the leader waits for the tail, the
 * warps take the step's records round robin; a step's head goes out
 * after the barrier that ends its copies, while the next step is copied
 * or before the leader waits. A record's
 * header is loaded with its row, checked before any of its fields is
 * used (a bad one fails the context, whose outputs are then not valid). */
template <int U, int TW = 0>
static __device__ void fr_cuht_drecv(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c, int s, int S,
                                     const fr_cuht_grp_t &g)
{
    const fr_cuht_geo_t &G = A.G;
    if (fr_cuht_fwd_here(A, s)) /* a forward block passes them on (fr_cuht_dfwd) */
        return;
    const fr_cuht_fmt_t F = fr_cuht_fmt(G, io, false);
    int C = G.C;
    bool lead = fr_cuht_lead(g);
    unsigned long long RT = (unsigned long long)G.RT;
    int n = R.rcnt[(size_t)s * C + c], row0 = R.rbase[(size_t)s * C + c];
    const uint8_t *ring = A.seg + fr_cuht_off_ring(G, 0, c, s);
    const unsigned long long *tailw = fr_cuht_rctr(A, s, FR_CUHT_DTAIL, c);
    unsigned long long *headw = fr_cuht_wctr(A, s, FR_CUHT_DHEAD, c);
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_DHEAD, c, s);
    unsigned long long start = *mine, tail = start;
    int taken = 0, pub = 0; /* pub: the leader's */
    while (taken < n) {
        fr_cuht_gbar(g); /* the previous step's records are copied */
        if (lead) {
            int ok = !fr_cuht_failed(A);
            if (ok && tail <= start + (unsigned long long)taken) {
                if (taken > pub) { /* what is taken can be refilled meanwhile */
                    fr_cuht_publish(headw, start + (unsigned long long)taken);
                    pub = taken;
                }
                ok = fr_cuht_wait_ge(A, tailw, start + (unsigned long long)taken + 1, s,
                                     FR_CUHT_WHAT_DISPATCH, &tail, true);
                if (ok && tail > start + (unsigned long long)pub + RT) { /* more than fits */
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_OVERRUN,
                                 (int)(tail - start - (unsigned long long)pub - RT));
                    ok = 0;
                }
            }
            unsigned long long av = tail - start;
            int lim = av < (unsigned long long)n ? (int)av : n;
            *g.lim = lim < taken + S ? lim : taken + S;
            *g.ok = ok;
        }
        fr_cuht_gbar(g);
        if (!*g.ok)
            return;
        if (lead && taken > pub) { /* the previous step's head, while the others copy */
            fr_cuht_publish(headw, start + (unsigned long long)taken);
            pub = taken;
        }
        int lim = *g.lim;
        for (int k = taken + g.j; k < lim; k += g.P) /* the leader sees a failure
                                                          at the next step */
            if (!fr_cuht_take<U, TW>(A, F, R, io, s, (size_t)row0 + (size_t)k,
                                 ring + ((start + (unsigned long long)k) % RT) * G.drec))
                break;
        taken = lim;
    }
    fr_cuht_gbar(g);
    if (lead) {
        if (n > pub && !fr_cuht_failed(A))
            fr_cuht_publish(headw, start + (unsigned long long)n);
        *mine = start + (unsigned long long)n;
    }
}

/* ---------------------------------------------------------------------- */
/* a warp serving many rings                                              */

/* Where a role has more rings than warps (above W + 1 ranks), each warp
 * serves rings w, w + W, w + 2W, ... alone (a group of one warp): the
 * state of the i-th ring of its list lives in lane i % 32, register slot
 * i / 32 (FR_CUHT_RPL slots: 64 rings a warp, 1024 ranks at W = 16). The
 * warp never waits on one ring: each pass polls the counters of the rings
 * that cannot move a full step, moves a step of up to S records on every
 * ring that can (a whole-warp copy per record), publishes that ring's
 * counter at once (system fence, release store), and goes round again.
 * So no ring waits while another the warp serves could move: blocking
 * waits on several rings in one warp could form a cycle across ranks. A
 * pass that moves nothing counts towards the timeout, which names the
 * peer of the warp's first unfinished ring. Every decision is the warp's
 * (ballots, broadcasts), so its lanes leave together. */

/* The rank of the warp's first unfinished ring (peer[] of the slots whose
 * rings have records left, `left`), for a timeout's message. */
static __device__ __forceinline__ int fr_cuht_many_first(const int *peer, const bool *left)
{
#pragma unroll
    for (int q = 0; q < FR_CUHT_RPL; q++) {
        unsigned int b = __ballot_sync(FR_FULL, left[q]);
        if (b)
            return __shfl_sync(FR_FULL, peer[q], __ffs(b) - 1);
    }
    return -1;
}

/* The warp's stop check, every 16th busy pass and every 64th idle one:
 * true when it must leave, the context having failed, or this warp
 * having moved nothing for the timeout (t0: its last progress), which it
 * reports (`what`, naming the peer of its first unfinished ring; src:
 * a source's rings, fr_cuht_wait_ge says how they are named). */
static __device__ __forceinline__ bool fr_cuht_many_stop(const fr_cuht_args_t &A, bool moved,
                                                         unsigned int *pass,
                                                         unsigned long long *t0,
                                                         const int *peer, const bool *left,
                                                         int what, bool src)
{
    int stop = 0;
    if (moved)
        *t0 = fr_sys_timer();
    if ((++*pass & (moved ? 15u : 63u)) != 0)
        return false;
    if ((threadIdx.x & 31) == 0)
        stop = fr_cuht_failed(A) ? 1 : !moved && fr_sys_timer() - *t0 > A.timeout_ns ? 2 : 0;
    stop = __shfl_sync(FR_FULL, stop, 0);
    if (stop == 2) {
        int who = fr_cuht_many_first(peer, left);
        if ((threadIdx.x & 31) == 0)
            fr_cuht_fail(A, FERRY_ERR_TIMEOUT, who, what, src ? FR_CUHT_VIA : 0);
    }
    return stop != 0;
}

/* Sender warp w of W over rings (c, this rank) at d = me + 1 + r for
 * r = w, w + W, ... < N - 1 (records as fr_cuht_send's). */
template <bool COMB, int U>
static __device__ void fr_cuht_send_many(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                         const fr_cuht_io_t &io, int c, int w, int W, int S)
{
    const fr_cuht_geo_t &G = A.G;
    const fr_cuht_fmt_t F = fr_cuht_fmt(G, io, COMB);
    int lane = threadIdx.x & 31, N = G.N, me = G.rank, C = G.C;
    int kind = COMB ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, hkind = COMB ? FR_CUHT_CHEAD : FR_CUHT_DHEAD;
    int what = COMB ? FR_CUHT_WHAT_COMBINE : FR_CUHT_WHAT_DISPATCH;
    unsigned long long RT = (unsigned long long)G.RT, recb = COMB ? G.crec : G.drec;
    int32_t flags = fr_ht_flags(io.fp8, R.id);
    int d[FR_CUHT_RPL], n[FR_CUHT_RPL], done[FR_CUHT_RPL];
    unsigned long long st[FR_CUHT_RPL], head[FR_CUHT_RPL];
#pragma unroll
    for (int q = 0; q < FR_CUHT_RPL; q++) {
        int r = w + W * (lane + 32 * q);
        d[q] = -1;
        n[q] = done[q] = 0;
        st[q] = head[q] = 0;
        if (r < N - 1 && !(COMB && fr_cuht_fwd_here(A, (me + 1 + r) % N))) {
            d[q] = (me + 1 + r) % N;
            n[q] = COMB ? R.rcnt[(size_t)d[q] * C + c] : R.ccnt[(size_t)d[q] * C + c];
            st[q] = *fr_cuht_my_ctr(A, kind, c, d[q]);
            /* never more than RT records outstanding: d's head is at least this */
            head[q] = st[q] > RT ? st[q] - RT : 0;
        }
    }
    unsigned long long t0 = fr_sys_timer();
    unsigned int pass = 0;
    for (;;) {
        int m[FR_CUHT_RPL];
        bool left[FR_CUHT_RPL], bad = false, any = false;
#pragma unroll
        for (int q = 0; q < FR_CUHT_RPL; q++) {
            int rem = n[q] - done[q];
            m[q] = 0;
            left[q] = rem > 0;
            if (rem <= 0)
                continue;
            any = true;
            unsigned long long sent = st[q] + (unsigned long long)done[q];
            int want = rem < S ? rem : S;
            if (sent + (unsigned long long)want - head[q] > RT) { /* less than a step fits */
                const unsigned long long *hw = fr_cuht_rctr(A, d[q], hkind, c);
                if (fr_sys_ld_relaxed(hw) > head[q]) {
                    unsigned long long h = fr_sys_ld_acquire(hw);
                    if (h > sent) { /* taken more than was sent */
                        fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d[q], FR_CUHT_WHAT_OVERRUN,
                                     (int)(h - sent));
                        bad = true;
                    }
                    head[q] = h;
                }
            }
            long long room = (long long)RT - (long long)(sent - head[q]);
            m[q] = room < want ? (room > 0 ? (int)room : 0) : want;
        }
        __syncwarp(); /* the lanes' acquires before any lane rewrites those slots */
        if (__any_sync(FR_FULL, bad))
            return;
        if (!__any_sync(FR_FULL, any))
            break;
        bool moved = false;
#pragma unroll
        for (int q = 0; q < FR_CUHT_RPL; q++) {
            unsigned int ready = __ballot_sync(FR_FULL, m[q] > 0);
            while (ready) {
                int L = __ffs(ready) - 1;
                ready &= ready - 1;
                int dd = __shfl_sync(FR_FULL, d[q], L), mm = __shfl_sync(FR_FULL, m[q], L);
                int i0 = __shfl_sync(FR_FULL, done[q], L);
                unsigned long long sent =
                    __shfl_sync(FR_FULL, st[q], L) + (unsigned long long)i0;
                uint8_t *ring = fr_cuht_wring(A, dd, COMB, c);
                int row0 = COMB ? R.rbase[(size_t)dd * C + c] : 0;
                const int32_t *tok_of = R.rtok + (size_t)dd * R.T + fr_cuht_chan_lo(R.T, C, c);
                const int *nl =
                    !COMB && G.fwd && (A.fw.nl[dd] >> 16) != A.fw.node ? A.fw.nl : NULL;
                for (int k = 0; k < mm; k++)
                    fr_cuht_put<COMB, U>(F, R, io, dd, i0 + k, row0, tok_of,
                                         ring + ((sent + (unsigned long long)k) % RT) * recb,
                                         flags, nl);
                __syncwarp(); /* the step's records before its tail */
                if (lane == L) {
                    done[q] += mm;
                    fr_cuht_publish(fr_cuht_wctr(A, dd, kind, c),
                                    sent + (unsigned long long)mm);
                }
                moved = true;
            }
        }
        if (fr_cuht_many_stop(A, moved, &pass, &t0, d, left, what, COMB))
            return;
    }
#pragma unroll
    for (int q = 0; q < FR_CUHT_RPL; q++)
        if (d[q] >= 0)
            *fr_cuht_my_ctr(A, kind, c, d[q]) = st[q] + (unsigned long long)n[q];
}

/* Receiver warp w of W over the dispatch rings (c, s) here from
 * s = me - 1 - r for r = w, w + W, ... < N - 1, and the own tokens for
 * r = N - 1 (records and rows as fr_cuht_drecv's and fr_cuht_dself's). */
template <int U>
static __device__ void fr_cuht_drecv_many(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                          const fr_cuht_io_t &io, int c, int w, int W, int S)
{
    const fr_cuht_geo_t &G = A.G;
    const fr_cuht_fmt_t F = fr_cuht_fmt(G, io, false);
    int lane = threadIdx.x & 31, N = G.N, me = G.rank, C = G.C;
    unsigned long long RT = (unsigned long long)G.RT;
    int s[FR_CUHT_RPL], n[FR_CUHT_RPL], taken[FR_CUHT_RPL];
    unsigned long long st[FR_CUHT_RPL], tail[FR_CUHT_RPL];
#pragma unroll
    for (int q = 0; q < FR_CUHT_RPL; q++) {
        int r = w + W * (lane + 32 * q);
        s[q] = -1;
        n[q] = taken[q] = 0;
        st[q] = tail[q] = 0;
        if (r < N && !(r < N - 1 && fr_cuht_fwd_here(A, (me + N - 1 - r) % N))) {
            s[q] = r == N - 1 ? me : (me + N - 1 - r) % N;
            n[q] = r == N - 1 ? R.ccnt[(size_t)me * C + c] : R.rcnt[(size_t)s[q] * C + c];
            if (r < N - 1)
                st[q] = tail[q] = *fr_cuht_my_ctr(A, FR_CUHT_DHEAD, c, s[q]);
        }
    }
    unsigned long long t0 = fr_sys_timer();
    unsigned int pass = 0;
    for (;;) {
        int m[FR_CUHT_RPL];
        bool left[FR_CUHT_RPL], bad = false, any = false;
#pragma unroll
        for (int q = 0; q < FR_CUHT_RPL; q++) {
            int rem = n[q] - taken[q];
            m[q] = 0;
            left[q] = rem > 0;
            if (rem <= 0)
                continue;
            any = true;
            if (s[q] == me) { /* the own tokens: nothing to wait for */
                m[q] = rem < S ? rem : S;
                continue;
            }
            unsigned long long at = st[q] + (unsigned long long)taken[q];
            if (tail[q] <= at) { /* nothing in: poll */
                const unsigned long long *tw = fr_cuht_rctr(A, s[q], FR_CUHT_DTAIL, c);
                if (fr_sys_ld_relaxed(tw) > tail[q]) {
                    tail[q] = fr_sys_ld_acquire(tw);
                    if (tail[q] > at + RT) { /* more than fits */
                        fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s[q], FR_CUHT_WHAT_OVERRUN,
                                     (int)(tail[q] - at - RT));
                        bad = true;
                    }
                }
            }
            /* this call's records only: a fast sender's next call may be in */
            unsigned long long have = tail[q] - st[q];
            int lim = have < (unsigned long long)n[q] ? (int)have : n[q];
            int av = lim - taken[q];
            m[q] = av < S ? (av > 0 ? av : 0) : S;
        }
        __syncwarp(); /* the lanes' acquires before any lane reads those records */
        if (__any_sync(FR_FULL, bad))
            return;
        if (!__any_sync(FR_FULL, any))
            break;
        bool moved = false;
#pragma unroll
        for (int q = 0; q < FR_CUHT_RPL; q++) {
            unsigned int ready = __ballot_sync(FR_FULL, m[q] > 0);
            while (ready) {
                int L = __ffs(ready) - 1;
                ready &= ready - 1;
                int ss = __shfl_sync(FR_FULL, s[q], L), mm = __shfl_sync(FR_FULL, m[q], L);
                int i0 = __shfl_sync(FR_FULL, taken[q], L);
                unsigned long long at =
                    __shfl_sync(FR_FULL, st[q], L) + (unsigned long long)i0;
                size_t row0 = (size_t)R.rbase[(size_t)ss * C + c] + (size_t)i0;
                if (ss == me) {
                    const int32_t *tok_of =
                        R.rtok + (size_t)me * R.T + fr_cuht_chan_lo(R.T, C, c) + i0;
                    for (int k = 0; k < mm; k++)
                        fr_cuht_self<U>(F, R, io, tok_of[k], row0 + (size_t)k);
                } else {
                    const uint8_t *ring = A.seg + fr_cuht_off_ring(G, 0, c, ss);
                    for (int k = 0; k < mm; k++)
                        if (!fr_cuht_take<U>(A, F, R, io, ss, row0 + (size_t)k,
                                             ring + ((at + (unsigned long long)k) % RT) *
                                                        G.drec))
                            return; /* every lane: the header was broadcast */
                }
                __syncwarp(); /* the step's copies before its head */
                if (lane == L) {
                    taken[q] += mm;
                    if (ss != me)
                        fr_cuht_publish(fr_cuht_wctr(A, ss, FR_CUHT_DHEAD, c),
                                        at + (unsigned long long)mm);
                }
                moved = true;
            }
        }
        if (fr_cuht_many_stop(A, moved, &pass, &t0, s, left, FR_CUHT_WHAT_DISPATCH, true))
            return;
    }
#pragma unroll
    for (int q = 0; q < FR_CUHT_RPL; q++)
        if (s[q] >= 0 && s[q] != me)
            *fr_cuht_my_ctr(A, FR_CUHT_DHEAD, c, s[q]) = st[q] + (unsigned long long)n[q];
}

/* ---------------------------------------------------------------------- */
/* forwarding through one rank per node                                   */

/* A forward block's warps wait on one ring of one source at a time, and
 * take the sources forwarded here one after the other, in ascending
 * order (every rank of the node writes its combine rows for them in that
 * order): each wait is for data or room that moves without this warp
 * (a source's senders and a destination's receivers serve their own
 * rings), so no wait closes a cycle. */

/* The warp's stop check while it polls: true when it must leave (the
 * context failed, or nothing moved for the timeout, which it reports
 * naming `who`). */
static __device__ __forceinline__ bool fr_cuht_fwd_stop(const fr_cuht_args_t &A,
                                                        unsigned int *pass,
                                                        unsigned long long t0, int who, int what)
{
    if ((++*pass & 63u) != 0)
        return false;
    int stop = 0;
    if ((threadIdx.x & 31) == 0) {
        stop = fr_cuht_failed(A) ? 1 : fr_sys_timer() - t0 > A.timeout_ns ? 2 : 0;
        if (stop == 2)
            fr_cuht_fail(A, FERRY_ERR_TIMEOUT, who, what, 0);
    }
    return __shfl_sync(FR_FULL, stop, 0) != 0;
}

/* Every lane with a word w (its rank of the node's) waits until *w
 * reaches want, *seen its last value; a value above lim is a protocol
 * error naming that rank. false when the warp must leave. */
static __device__ bool fr_cuht_fwd_wait(const fr_cuht_args_t &A, const unsigned long long *w,
                                        unsigned long long want, unsigned long long lim,
                                        unsigned long long *seen, int what)
{
    int lane = threadIdx.x & 31;
    unsigned long long t0 = fr_sys_timer();
    unsigned int pass = 0;
    for (;;) {
        bool need = w && *seen < want;
        int over = 0;
        if (need && fr_sys_ld_relaxed(w) > *seen) {
            unsigned long long v = fr_sys_ld_acquire(w);
            over = v > lim;
            *seen = v;
            need = v < want;
        }
        unsigned ob = __ballot_sync(FR_FULL, over);
        if (ob) {
            if (lane == __ffs(ob) - 1)
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, A.fw.nrank[lane], FR_CUHT_WHAT_OVERRUN, 0);
            return false;
        }
        unsigned nb = __ballot_sync(FR_FULL, need);
        if (!nb)
            return true;
        if (fr_cuht_fwd_stop(A, &pass, t0, A.fw.nrank[__ffs(nb) - 1], what))
            return false;
    }
}

/* The step's records' masks of this node's ranks (lane k < m: record k's
 * node-relative ids at ids[k * K], or -1 from the record when `rec` is
 * set, checked), and per local index j (lane j) how many of them go
 * there. false after a bad record, which fails the context naming s. */
static __device__ __forceinline__ bool fr_cuht_fwd_masks(const fr_cuht_args_t &A, int s, int m,
                                                         int K, int El, int L,
                                                         const int16_t *ids, unsigned *mask,
                                                         int *cnt)
{
    int lane = threadIdx.x & 31, bad = 0;
    unsigned mk = 0;
    if (lane < m) {
        for (int k = 0; k < K; k++) {
            int e = ids[(size_t)lane * K + k];
            if (e < -1 || e >= L * El)
                bad = 1;
            else if (e >= 0)
                mk |= 1u << (e / El);
        }
        bad |= mk == 0; /* a record forwarded to no rank */
    }
    unsigned bm = __ballot_sync(FR_FULL, bad);
    if (bm) {
        if (lane == __ffs(bm) - 1)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_RECORD, -1);
        return false;
    }
    int n = 0;
    for (int j = 0; j < L; j++) {
        unsigned b = __ballot_sync(FR_FULL, (mk >> j) & 1u);
        if (lane == j)
            n = __popc(b);
    }
    *mask = mk;
    *cnt = n;
    return true;
}

/* Dispatch (one warp of a forward block): source s's node-level records of
 * channel c, which land in ring (c, s) here over the fabric, passed on in
 * order: into ring (c, s) of each rank of this node that holds one of the
 * token's experts (that rank's expert ids and weights, as s would have
 * written them), and for this rank straight into its rows. Each step
 * takes what landed (at most 32 records, at most a ring), once every
 * destination ring has room for the step's records to it; the
 * node-relative ids are kept for the combine (R.fids). Lane j < L keeps
 * the node's rank j: records forwarded into its ring, its head seen. */
template <int U>
static __device__ __noinline__ void fr_cuht_dfwd(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                    const fr_cuht_io_t &io, int c, int s)
{
    const fr_cuht_geo_t &G = A.G;
    const fr_cuht_fw_t &fw = A.fw;
    const fr_cuht_fmt_t F = fr_cuht_fmt(G, io, false);
    int lane = threadIdx.x & 31, C = G.C, K = F.K, El = F.El, L = fw.L, mj = fw.j, nsc = F.nsc;
    unsigned long long RT = (unsigned long long)G.RT;
    size_t drec = G.drec, hdr = F.hdr, rowb = F.rowb, woff = F.woff;
    int n = R.fcnt[(size_t)s * C + c], nmine = R.rcnt[(size_t)s * C + c];
    size_t row0 = (size_t)R.rbase[(size_t)s * C + c];
    int16_t *ids = R.fids + ((size_t)fw.fslot[s] * G.T + R.fbase[(size_t)s * C + c]) * K;
    const uint8_t *ring = A.seg + fr_cuht_off_ring(G, 0, c, s);
    const unsigned long long *tailw = fr_cuht_rctr(A, s, FR_CUHT_DTAIL, c);
    unsigned long long *headw = fr_cuht_wctr(A, s, FR_CUHT_DHEAD, c);
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_DHEAD, c, s);
    unsigned long long start = *mine, tail = start;
    size_t fi = ((size_t)c * G.N + s) * G.NL;
    unsigned long long sent = 0, head = 0;
    uint8_t *dring = NULL;
    unsigned long long *dtail = NULL;
    const unsigned long long *dhead = NULL;
    if (lane < L && lane != mj) {
        uint8_t *seg = fw.nseg[lane];
        sent = fw.fsent[fi + lane];
        head = sent > RT ? sent - RT : 0; /* never more than a ring outstanding */
        dring = seg + fr_cuht_off_ring(G, 0, c, s);
        dtail = (unsigned long long *)(seg + fr_cuht_off_ctr(G, FR_CUHT_DTAIL, c, s));
        dhead = (const unsigned long long *)(A.seg + fr_cuht_geo_fline(&G, 0, c, s, lane));
    }
    int32_t flags = fr_ht_flags(io.fp8, R.id);
    int taken = 0, own = 0;
    while (taken < n) {
        int ok = 1;
        if (lane == 0 && tail <= start + (unsigned long long)taken) {
            ok = fr_cuht_wait_ge(A, tailw, start + (unsigned long long)taken + 1, s,
                                 FR_CUHT_WHAT_DISPATCH, &tail);
            if (ok && tail > start + (unsigned long long)taken + RT) { /* more than fits */
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_OVERRUN,
                             (int)(tail - start - taken - RT));
                ok = 0;
            }
        }
        __syncwarp(); /* lane 0's acquire before any lane reads the records */
        if (!__shfl_sync(FR_FULL, ok, 0))
            return;
        unsigned long long av = __shfl_sync(FR_FULL, tail, 0) - start - (unsigned long long)taken;
        int m = n - taken;
        m = av < (unsigned long long)m ? (int)av : m;
        m = m < 32 ? m : 32;
        m = (unsigned long long)m < RT ? m : (int)RT;
        /* the records' headers and ids (kept for the combine), checked */
        int bad = 0;
        if (lane < m) {
            const uint8_t *rec = ring + ((start + taken + lane) % RT) * drec;
            bad = fr_cuht_hdr_bad(__ldcg((const int32_t *)rec), __ldcg((const int32_t *)rec + 1),
                                  G.T, R.id, io.fp8);
            for (int k = 0; k < K; k++)
                ids[(size_t)(taken + lane) * K + k] = __ldcg((const short *)(rec + 8) + k);
        }
        unsigned bm = __ballot_sync(FR_FULL, bad != 0);
        if (bm) {
            if (lane == __ffs(bm) - 1)
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, bad, taken + lane);
            return;
        }
        __syncwarp();
        unsigned mask;
        int cnt;
        if (!fr_cuht_fwd_masks(A, s, m, K, El, L, ids + (size_t)taken * K, &mask, &cnt))
            return;
        /* room in every destination ring for its records of the step */
        unsigned long long want = sent + (unsigned long long)cnt > RT ? sent + cnt - RT : 0;
        if (!fr_cuht_fwd_wait(A, dhead, want, sent, &head, FR_CUHT_WHAT_DISPATCH))
            return;
        __syncwarp(); /* the heads' acquires before the slots are rewritten */
        /* the records in order; lane j keeps its destination's next slot */
        unsigned long long at = sent;
        for (int k = 0; k < m; k++) {
            unsigned mk = __shfl_sync(FR_FULL, mask, k);
            const uint8_t *rec = ring + ((start + taken + k) % RT) * drec;
            int tok = __shfl_sync(FR_FULL, __ldcg((const int32_t *)rec), 0);
            int e = lane < K ? ids[(size_t)(taken + k) * K + lane] : -1;
            float w = lane < K ? __ldcg((const float *)(rec + woff) + lane) : 0.f;
            while (mk) {
                int j = __ffs(mk) - 1;
                mk &= mk - 1;
                bool loc = e >= 0 && e / El == j;
                if (j == mj) { /* this rank's row */
                    if (own >= nmine) { /* more than s said (alike in every lane) */
                        if (lane == 0)
                            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS, own);
                        return;
                    }
                    size_t row = row0 + (size_t)own;
                    fr_warp_copy16u<U, true>(io.rx + row * rowb, rec + hdr, rowb);
                    for (int q = lane; q < nsc; q += 32)
                        io.rxs[row * nsc + q] = __ldcg((const float *)(rec + hdr + rowb) + q);
                    if (lane < K)
                        fr_cuht_put_idx(io, row * K + lane, loc ? e % El : -1);
                    if (lane < K && io.rw)
                        io.rw[row * K + lane] = loc ? w : 0.f;
                    if (lane == 0 && io.rsr)
                        io.rsr[row] = s;
                    if (lane == 0 && io.rst)
                        io.rst[row] = tok;
                    own++;
                } else { /* into ring (c, s) of the node's rank j */
                    unsigned long long slot = __shfl_sync(FR_FULL, at, j);
                    uint8_t *dr = (uint8_t *)__shfl_sync(FR_FULL, (unsigned long long)dring, j) +
                                  (slot % RT) * drec;
                    if (lane == 0) {
                        ((int32_t *)dr)[0] = tok;
                        ((int32_t *)dr)[1] = flags;
                    }
                    if (lane < K) {
                        ((int16_t *)(dr + 8))[lane] = (int16_t)(loc ? e % El : -1);
                        ((float *)(dr + woff))[lane] = loc ? w : 0.f;
                    }
                    fr_warp_copy16u<U, true>(dr + hdr, rec + hdr, rowb);
                    for (int q = lane; q < nsc; q += 32)
                        ((float *)(dr + hdr + rowb))[q] =
                            __ldcg((const float *)(rec + hdr + rowb) + q);
                    if (lane == j)
                        at++;
                }
            }
        }
        __syncwarp(); /* the step's records before the tails */
        if (dtail && cnt > 0) {
            sent += (unsigned long long)cnt;
            fr_cuht_publish(dtail, sent);
        }
        taken += m;
        if (lane == 0) /* the node-level slots go back to s */
            fr_cuht_publish(headw, start + (unsigned long long)taken);
    }
    if (own != nmine) { /* s said this rank gets nmine of its rows */
        if (lane == 0)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS, own);
        return;
    }
    if (lane == 0)
        *mine = start + (unsigned long long)n;
    if (dhead)
        fw.fsent[fi + lane] = sent;
}

/* Warps per ring when a role's W warps serve `rings` rings: W / rings
 * each (the rest idle when rings does not divide W). */
template <int W>
static __device__ __forceinline__ int fr_cuht_per_ring(int rings)
{
    return rings < W ? W / rings : 1;
}

/* The sender role serves the N - 1 peer rings (W / (N - 1) warps each;
 * at N = 1 the own tokens). The receiver role serves the N - 1 peer rings
 * and the own tokens (W / N warps each): the own tokens are a local copy,
 * the peers' rings the links. */
template <int W, bool MANY, bool FWD, bool TM = false>
__global__ void __launch_bounds__(2 * W * 32, 1)
fr_cuht_dispatch_k(fr_cuht_args_t A, fr_cuht_rdev_t R, fr_cuht_io_t io)
{
    constexpr int U = W <= 8 ? 8 : 2; /* loads in flight per lane (registers) */
    constexpr int TW = TM && W == 8 && !MANY && !FWD ? 2 * W : 0; /* copy engine's warps */
    R.id = (unsigned int)*R.idp; /* written by the route's notify kernel */
    int warp = threadIdx.x >> 5, N = A.G.N, me = A.G.rank, c = blockIdx.x;
    __shared__ int dead, gok[2][W], glim[2][W];
    if (TW)
        fr_tma_init(TW);
    if (threadIdx.x == 0) {
        dead = fr_cuht_failed(A);
        /* a bounded route's rows must fit its outputs (notify fails the
         * context otherwise; checked again here, where the rows go) */
        if (!dead && R.bound > 0 && *R.nrecv > R.bound) {
            fr_cuht_fail(A, FERRY_ERR_INVALID, R.bound, FR_CUHT_WHAT_BOUND, *R.nrecv);
            dead = 1;
        }
    }
    __syncthreads();
    if (dead) /* the context failed earlier: nothing moves */
        return;
    if (FWD && c >= A.G.C) { /* a forward block: the sources forwarded here */
        for (int i = warp; i < A.fw.nf; i += 2 * W)
            fr_cuht_dfwd<U>(A, R, io, c - A.G.C, A.fw.fl[i]);
        return;
    }
    int role = warp < W ? 0 : 1, rings = role == 0 && N > 1 ? N - 1 : N;
    if (MANY && rings > W) { /* each warp serves several rings, waiting on none */
        int S = FR_CUHT_STEP < A.G.RT ? FR_CUHT_STEP : A.G.RT;
        if (role == 0)
            fr_cuht_send_many<false, U>(A, R, io, c, warp % W, W, S);
        else
            fr_cuht_drecv_many<U>(A, R, io, c, warp % W, W, S);
        return;
    }
    int P = fr_cuht_per_ring<W>(rings), r = (warp % W) / P;
    if (r >= rings)
        return;
    /* named barriers (only when P > 1): senders 1..W/2, receivers
     * W/2+1..W; a receiver group of several warps means N <= W / 2, so
     * W = 8 and ids up to 8 */
    fr_cuht_grp_t g = {(warp % W) % P, P, 1 + role * (W / 2) + r, &gok[role][r],
                       &glim[role][r]};
    if (role == 0 ? N == 1 : r == N - 1) {
        if (role == 0 || N > 1)
            fr_cuht_dself<U, TW>(A, R, io, c, g);
    } else if (role == 0) { /* destinations rotated: not every rank at rank 0 first */
        int S = P * FR_CUHT_STEP < A.G.RT ? P * FR_CUHT_STEP : A.G.RT;
        fr_cuht_send<false, U, TW>(A, R, io, c, (me + 1 + r) % N, S, g);
    } else {
        fr_cuht_drecv<U, TW>(A, R, io, c, (me + N - 1 - r) % N, P * FR_CUHT_STEP, g);
    }
    if (TW) /* the copy engine done with the warp's stages before it ends */
        fr_tma_flush();
}

/* ---------------------------------------------------------------------- */
/* combine                                                                */

/* Eight bf16 of v added to acc in fp32 (the combine's sums). */
static __device__ __forceinline__ void fr_cuht_acc8(float *acc, const int4 &v)
{
    const uint16_t *y = (const uint16_t *)&v;
#pragma unroll
    for (int i = 0; i < 8; i++)
        acc[i] += fr_bf16_to_f32(y[i]);
}

/* acc rounded once to eight bf16. */
static __device__ __forceinline__ int4 fr_cuht_round8(const float *acc)
{
    int4 o;
    uint16_t *ov = (uint16_t *)&o;
#pragma unroll
    for (int i = 0; i < 8; i++)
        ov[i] = fr_f32_to_bf16(acc[i]);
    return o;
}

/* Tokens per combine batch: half a ring (the senders fill the other half
 * meanwhile), at most FR_CUHT_CBATCH. */
static __device__ __forceinline__ int fr_cuht_cbatch(int RT)
{
    return RT >= 2 ? (RT / 2 < FR_CUHT_CBATCH ? RT / 2 : FR_CUHT_CBATCH) : 1;
}

/* The receiving group's batch for a channel of ntok tokens: at most
 * fr_cuht_cbatch (a batch's records of one peer fit its ring), and at
 * most half the channel (8 tokens at least), so that the sums of one
 * batch overlap the peers' sends of the next: as one batch (2 ranks, 64
 * tokens a channel) nothing is summed until every record is in, and the
 * combine took 3% longer (docs/benchmarks.md). */
static __device__ __forceinline__ int fr_cuht_crecv_batch(int RT, int ntok)
{
    int B = fr_cuht_cbatch(RT), half = (ntok + 1) / 2;
    half = half < FR_CUHT_CBATCH_MIN ? FR_CUHT_CBATCH_MIN : half;
    return half < B ? half : B;
}

/* The receiving group (W warps, named barrier 15): the channel's own
 * tokens in batches; per batch, the records of each peer it needs are
 * waited for (one thread per peer), summed, and their ring slots handed
 * back. The own rank's rows are read straight from y. NMAX: the most
 * ranks of the kernel (its per-peer shared arrays; 16 outside the
 * many-rank kernels, whose 1024 would take 24 KB of shared memory, and
 * of L1 with it, from every kernel). */
template <int W, int U, int NMAX>
static __device__ void fr_cuht_crecv(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                     const fr_cuht_io_t &io, int c)
{
    const fr_cuht_geo_t &G = A.G;
    int N = G.N, K = G.K, El = G.El, H = G.H, C = G.C, me = G.rank;
    int tid = threadIdx.x - W * 32, gw = tid >> 5, lane = threadIdx.x & 31;
    int t0 = fr_cuht_chan_lo(R.T, C, c), t1 = fr_cuht_chan_lo(R.T, C, c + 1);
    unsigned long long RT = (unsigned long long)G.RT;
    size_t self0 = (size_t)R.rbase[(size_t)me * C + c]; /* own rows of y */
    /* the rings' geometry read once, not through G inside the loops
     * (fr_cuht_fmt_t says why): ring (c, d) starts at cring0 + d * ringb */
    size_t crec = G.crec, chdr = G.chdr, ringb = (size_t)G.RT * G.crec;
    const uint8_t *cring0 = A.seg + fr_cuht_off_ring(G, 1, c, 0);
    /* per peer d: its ring's first record of this call (sbase), the tail
     * seen, the records the batches so far need (a token's place + 1) and
     * the head published, both counted from sbase */
    __shared__ unsigned long long sbase[NMAX], stail[NMAX];
    __shared__ int sneed[NMAX], sgot[NMAX], spub[NMAX];
    __shared__ const int4 *sptr[W][FR_MAX_TOPK]; /* a token's rows, by rank */
    /* failures seen while waiting, and while summing: two words, each
     * read only after the barrier that ends its phase and written again
     * only after the next barrier, so every warp reads the same value */
    __shared__ int wok, sok;
    for (int d = tid; d < N; d += W * 32) {
        sbase[d] = *fr_cuht_my_ctr(A, FR_CUHT_CHEAD, c, d);
        stail[d] = sbase[d];
        sneed[d] = 0;
        spub[d] = 0;
    }
    if (tid == 0)
        wok = sok = 1;
    int B = fr_cuht_crecv_batch(G.RT, t1 - t0);
    int H8 = H / 8;
    /* what the batch at b0 needs of each peer: its last token's place + 1,
     * raised in sneed (monotonic) by the warps, for the first batch here
     * and for each next one beside the sums of the one before (no barrier
     * of its own: the waits copy sneed to sgot, which the thread that
     * waits on a peer alone reads and publishes from) */
    auto need = [&](int b0) {
        int nb = t1 - b0 < B ? t1 - b0 : B;
        for (int j = gw; j < nb; j += W) {
            int t = b0 + j, d = lane < K ? R.dst[(size_t)t * K + lane] : -1;
            if (d >= 0 && d != me)
                atomicMax(&sneed[d], R.dpos[(size_t)t * K + lane] + 1);
        }
    };
    fr_bar_sync(15, W * 32); /* sneed cleared */
    need(t0);
    fr_bar_sync(15, W * 32);
    for (int b0 = t0; b0 < t1; b0 += B) {
        int nb = t1 - b0 < B ? t1 - b0 : B;
        for (int d = tid; d < N; d += W * 32) { /* a thread per peer waits */
            sgot[d] = sneed[d];
            unsigned long long want = sbase[d] + (unsigned long long)sgot[d], v = stail[d];
            if (d == me || v >= want)
                continue;
            if (!fr_cuht_wait_ge(A, fr_cuht_rctr(A, d, FR_CUHT_CTAIL, c), want, d,
                                 FR_CUHT_WHAT_COMBINE, &v)) {
                wok = 0;
            } else if (v > sbase[d] + (unsigned long long)spub[d] + RT) {
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, d, FR_CUHT_WHAT_OVERRUN,
                             (int)(v - sbase[d] - spub[d] - RT));
                wok = 0;
            }
            stail[d] = v;
        }
        fr_bar_sync(15, W * 32);
        if (!wok)
            return;
        for (int j = gw; j < nb; j += W) {
            int t = b0 + j;
            /* lane k: the token's k-th rank (ascending), its row and header */
            int dk = lane < K ? R.dst[(size_t)t * K + lane] : -1;
            /* the place loaded beside the rank, not after it: one
             * latency less per token */
            int pk = lane < K ? R.dpos[(size_t)t * K + lane] : -1;
            const uint8_t *hrec = NULL;
            const int4 *dp = NULL;
            int pos = -1, hpos = 0;
            unsigned int hid = 0;
            if (dk >= 0) {
                pos = pk;
                if (dk == me) {
                    dp = (const int4 *)(io.x + (self0 + (size_t)pos) * 2 * (size_t)H);
                } else {
                    hrec = cring0 + (size_t)dk * ringb +
                           ((sbase[dk] + (unsigned long long)pos) % RT) * crec;
                    hpos = __ldcg((const int32_t *)hrec);
                    hid = __ldcg((const uint32_t *)hrec + 1);
                    dp = (const int4 *)(hrec + chdr);
                }
            }
            unsigned int pres = __ballot_sync(FR_FULL, dp != NULL);
            if (dp) /* the ranks are lanes 0.. np - 1 */
                sptr[gw][lane] = dp;
            __syncwarp();
            int np = __popc(pres);
            if (io.slots) { /* uniform */
                /* FERRY_HT_SUM_SLOTS: the rows reordered by the highest slot
                 * each contributor holds. Lane k: slot k's contributor ek
                 * (the key dk is given in) and whether k is its highest
                 * slot; the top lanes, ascending, take their rows' places */
                int e = lane < K ? R.idx[(size_t)t * K + lane] : -1;
                int ek = e < 0 ? -1 : G.fwd ? A.fw.key[e / El] : e / El;
                unsigned int same = __match_any_sync(FR_FULL, ek);
                bool top = ek >= 0 && 31 - __clz(same) == lane;
                unsigned int tops = __ballot_sync(FR_FULL, top);
                const int4 *mine = NULL;
                for (int q = 0; q < np; q++) {
                    int dq = __shfl_sync(FR_FULL, dk, q);
                    unsigned long long pq = __shfl_sync(
                        FR_FULL, (unsigned long long)(uintptr_t)dp, q);
                    if (top && dq == ek)
                        mine = (const int4 *)(uintptr_t)pq;
                }
                /* every contributor found (the route makes both from the
                 * same slots; else the rank order stays) */
                bool whole = __popc(tops) == np && __all_sync(FR_FULL, !top || mine);
                __syncwarp();
                if (whole && top)
                    sptr[gw][__popc(tops & ((1u << lane) - 1u))] = mine;
                __syncwarp();
            }
            /* 8 channels a vector, U vectors per lane, two ranks' loads in
             * flight together: fp32 sum in ascending rank order, one
             * rounding (what the CPU engine computes) */
            for (int h = lane; h < H8; h += 32 * U) {
                float acc[U][8];
#pragma unroll
                for (int u = 0; u < U; u++)
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[u][i] = 0.f;
                /* FERRY_HT_SUM_SLOTS: the biases before the rows */
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    if (!io.slots || !io.bias[b])
                        continue;
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        if (h + 32 * u < H8)
                            fr_cuht_acc8(acc[u], __ldg(io.bias[b] + (size_t)t * H8 + h + 32 * u));
                    }
                }
                for (int q = 0; q < np; q += 2) {
                    bool two = q + 1 < np;
                    const int4 *p0 = sptr[gw][q], *p1 = two ? sptr[gw][q + 1] : p0;
                    int4 v0[U], v1[U];
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        if (h + 32 * u < H8) {
                            v0[u] = __ldcg(p0 + h + 32 * u);
                            v1[u] = two ? __ldcg(p1 + h + 32 * u) : make_int4(0, 0, 0, 0);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        if (h + 32 * u < H8) {
                            fr_cuht_acc8(acc[u], v0[u]);
                            if (two)
                                fr_cuht_acc8(acc[u], v1[u]);
                        }
                    }
                }
                /* else the bias after the rows, before the one rounding */
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    if (io.slots || !io.bias[b])
                        continue;
#pragma unroll
                    for (int u = 0; u < U; u++) {
                        if (h + 32 * u < H8)
                            fr_cuht_acc8(acc[u], __ldg(io.bias[b] + (size_t)t * H8 + h + 32 * u));
                    }
                }
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (h + 32 * u < H8)
                        ((int4 *)(io.rx + (size_t)t * 2 * H))[h + 32 * u] =
                            fr_cuht_round8(acc[u]);
            }
            /* the headers (loaded before the sum) checked before their
             * weights are used */
            unsigned int badm = __ballot_sync(FR_FULL, hrec && (hpos != pos || hid != R.id));
            if (badm) {
                if (lane == __ffs(badm) - 1)
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, dk,
                                 hid != R.id ? FR_CUHT_WHAT_ORDER : FR_CUHT_WHAT_RECORD,
                                 hid != R.id ? (int)hid : pos);
                sok = 0;
                break;
            }
            if (io.rw) { /* uniform: every lane takes part in the shuffles */
                /* lane k < K: slot k of the rows' weights; lane q < np
                 * holds the token's q-th rank (dk), its place (pos) and
                 * record (hrec), handed over by shuffles rather than read
                 * again from the route */
                int e = lane < K && !io.wsum ? R.idx[(size_t)t * K + lane] : -1;
                int ek = e < 0 ? -1 : G.fwd ? A.fw.key[e / El] : e / El;
                float w = 0.f;
                for (int q = 0; q < np; q++) {
                    int dq = __shfl_sync(FR_FULL, dk, q), pq = __shfl_sync(FR_FULL, pos, q);
                    const uint8_t *hq = (const uint8_t *)__shfl_sync(
                        FR_FULL, (unsigned long long)(uintptr_t)hrec, q);
                    if (lane < K && (io.wsum || dq == ek)) {
                        float v = dq == me ? (io.w ? io.w[(self0 + (size_t)pq) * K + lane] : 0.f)
                                           : __ldcg((const float *)(hq + 8) + lane);
                        w = io.wsum ? w + v : v; /* every rank's row in rank order, or
                                                    the row of expert lane's rank */
                    }
                }
                if (lane < K)
                    io.rw[(size_t)t * K + lane] = w;
            }
            __syncwarp(); /* sptr is rewritten for the next token */
        }
        if (b0 + B < t1)
            need(b0 + B);
        fr_bar_sync(15, W * 32);
        if (!sok)
            return;
        for (int d = tid; d < N; d += W * 32) { /* the batch's slots go back */
            if (d != me && sgot[d] > spub[d]) {
                fr_cuht_publish(fr_cuht_wctr(A, d, FR_CUHT_CHEAD, c),
                                sbase[d] + (unsigned long long)sgot[d]);
                spub[d] = sgot[d];
            }
        }
    }
    for (int d = tid; d < N; d += W * 32)
        if (d != me)
            *fr_cuht_my_ctr(A, FR_CUHT_CHEAD, c, d) =
                sbase[d] + (unsigned long long)R.ccnt[(size_t)d * C + c];
}

/* Combine (one warp of a forward block): for source s's node-level records
 * of channel c, in order (their node-relative ids kept by the dispatch),
 * the rows of this node's ranks that the token went to (this rank's from
 * y, the others' from their rings (c, s) here, each in the order of its
 * rows from s), summed in fp32 in rank order and rounded once, go to s
 * as one combine record: its place among the node-level records, the
 * route, the slot weights of this node's experts (summed over the rows
 * with weights_sum). A step is at most what s's combine takes beside a
 * batch (as a sender's) and at most a batch (what the node's senders
 * leave room for), and waits for its rows. Lane j < L keeps the
 * node's rank j: rows taken from its ring here. */
template <int U>
static __device__ __noinline__ void fr_cuht_cfwd(const fr_cuht_args_t &A, const fr_cuht_rdev_t &R,
                                    const fr_cuht_io_t &io, int c, int s)
{
    const fr_cuht_geo_t &G = A.G;
    const fr_cuht_fw_t &fw = A.fw;
    int lane = threadIdx.x & 31, C = G.C, K = G.K, El = G.El, L = fw.L, mj = fw.j, H = G.H;
    unsigned long long RT = (unsigned long long)G.RT;
    size_t crec = G.crec, chdr = G.chdr;
    int n = R.fcnt[(size_t)s * C + c], nmine = R.rcnt[(size_t)s * C + c];
    size_t row0 = (size_t)R.rbase[(size_t)s * C + c];
    int slot = fw.fslot[s];
    const int16_t *ids = R.fids + ((size_t)slot * G.T + R.fbase[(size_t)s * C + c]) * K;
    uint8_t *oring = fr_cuht_wring(A, s, 1, c);
    unsigned long long *tailw = fr_cuht_wctr(A, s, FR_CUHT_CTAIL, c);
    const unsigned long long *headw = fr_cuht_rctr(A, s, FR_CUHT_CHEAD, c);
    unsigned long long *mine = fr_cuht_my_ctr(A, FR_CUHT_CTAIL, c, s);
    unsigned long long sent0 = *mine, head = sent0 > RT ? sent0 - RT : 0;
    size_t fi = ((size_t)c * G.N + s) * G.NL;
    /* lane j: rows of rank j taken (cumulative; tk0 at this call's start),
     * its tail seen, its ring here, where its head goes */
    unsigned long long tk = 0, tk0 = 0, tl = 0;
    const uint8_t *jring = NULL;
    const unsigned long long *jtail = NULL;
    unsigned long long *jhead = NULL;
    if (lane < L && lane != mj) {
        tk = tk0 = tl = fw.ftake[fi + lane];
        jring = A.seg + fr_cuht_geo_fcring(&G, c, slot, lane);
        jtail = (const unsigned long long *)(A.seg + fr_cuht_geo_fline(&G, 1, c, s, lane));
        jhead = (unsigned long long *)(fw.nseg[lane] + fr_cuht_off_ctr(G, FR_CUHT_CHEAD, c, s));
    }
    /* a step: what s's combine takes beside a batch (as a sender's), and
     * at most a batch of any rank's rows here (whose senders' steps are
     * sized for a batch's need) */
    int B = fr_cuht_cbatch(G.RT), room = G.RT + 1 - B;
    int S = room < B ? room : B, own = 0, H8 = H / 8;
    S = S < 32 ? S : 32;
    for (int i0 = 0; i0 < n;) {
        int m = n - i0 < S ? n - i0 : S;
        unsigned long long sent = sent0 + (unsigned long long)i0;
        int ok = 1;
        if (lane == 0 && sent + (unsigned long long)m - head > RT) { /* room at s */
            ok = fr_cuht_wait_ge(A, headw, sent + (unsigned long long)m - RT, s,
                                 FR_CUHT_WHAT_COMBINE, &head);
            if (ok && head > sent) {
                fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_OVERRUN, (int)(head - sent));
                ok = 0;
            }
        }
        if (!__shfl_sync(FR_FULL, ok, 0))
            return;
        unsigned mask;
        int cnt;
        if (!fr_cuht_fwd_masks(A, s, m, K, El, L, ids + (size_t)i0 * K, &mask, &cnt))
            return;
        /* the step's rows of every rank in (more than the room it was
         * given is a protocol error) */
        if (!fr_cuht_fwd_wait(A, jtail, tk + (unsigned long long)cnt, tk + RT, &tl,
                              FR_CUHT_WHAT_COMBINE))
            return;
        __syncwarp();
        for (int k = 0; k < m; k++) {
            unsigned mk = __shfl_sync(FR_FULL, mask, k);
            int e = lane < K ? ids[(size_t)(i0 + k) * K + lane] : -1;
            /* lane q < np: the q-th row (local index order), checked */
            int np = __popc(mk), bad = 0, jq = 0;
            const uint8_t *rp = NULL;
            const float *wp = NULL;
            {
                unsigned rest = mk;
                for (int q = 0; rest; q++) {
                    int j = __ffs(rest) - 1;
                    rest &= rest - 1;
                    unsigned long long pos = __shfl_sync(FR_FULL, tk, j);
                    unsigned long long p0 = __shfl_sync(FR_FULL, tk0, j);
                    const uint8_t *jr =
                        (const uint8_t *)__shfl_sync(FR_FULL, (unsigned long long)jring, j);
                    if (lane == q) {
                        jq = j;
                        if (j == mj) {
                            if (own >= nmine)
                                bad = FR_CUHT_WHAT_COUNTS;
                            size_t row = row0 + (size_t)own;
                            rp = io.x + row * 2 * (size_t)H;
                            wp = io.w ? io.w + row * K : NULL;
                        } else {
                            const uint8_t *rec = jr + (pos % RT) * crec;
                            if (__ldcg((const int32_t *)rec) != (int)(pos - p0) ||
                                __ldcg((const uint32_t *)rec + 1) != R.id)
                                bad = FR_CUHT_WHAT_RECORD;
                            rp = rec + chdr;
                            wp = (const float *)(rec + 8);
                        }
                    }
                    if (lane == j)
                        tk++;
                }
                if (mk >> mj & 1u)
                    own++;
            }
            unsigned bm = __ballot_sync(FR_FULL, bad != 0);
            if (bm) {
                int j = __shfl_sync(FR_FULL, jq, __ffs(bm) - 1);
                if (lane == 0)
                    fr_cuht_fail(A, FERRY_ERR_PROTOCOL, j == mj ? s : fw.nrank[j],
                                 FR_CUHT_WHAT_RECORD, i0 + k);
                return;
            }
            uint8_t *orec = oring + ((sent + (unsigned long long)k) % RT) * crec;
            /* the rows' pointers through shared memory; then U vectors of
             * each row in flight per lane, rows in rank order, fp32 */
            __shared__ const int4 *fsp[32][32];
            const int4 **sp = fsp[threadIdx.x >> 5];
            if (lane < np)
                sp[lane] = (const int4 *)rp;
            __syncwarp();
            for (int h0 = lane; h0 < H8; h0 += 32 * FR_CUHT_FSUM) {
                float acc[FR_CUHT_FSUM][8];
#pragma unroll
                for (int u = 0; u < FR_CUHT_FSUM; u++)
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[u][i] = 0.f;
                for (int q = 0; q < np; q++) {
                    const int4 *p = sp[q];
                    int4 v[FR_CUHT_FSUM];
#pragma unroll
                    for (int u = 0; u < FR_CUHT_FSUM; u++)
                        if (h0 + 32 * u < H8)
                            v[u] = __ldcg(p + h0 + 32 * u);
#pragma unroll
                    for (int u = 0; u < FR_CUHT_FSUM; u++)
                        if (h0 + 32 * u < H8)
                            fr_cuht_acc8(acc[u], v[u]);
                }
#pragma unroll
                for (int u = 0; u < FR_CUHT_FSUM; u++)
                    if (h0 + 32 * u < H8)
                        ((int4 *)(orec + chdr))[h0 + 32 * u] = fr_cuht_round8(acc[u]);
            }
            /* the slot weights: summed, or the row of the slot's rank */
            float w = 0.f;
            for (int q = 0; q < np; q++) {
                const float *p = (const float *)__shfl_sync(FR_FULL, (unsigned long long)wp, q);
                int j = __shfl_sync(FR_FULL, jq, q);
                float v = p && lane < K ? __ldcg(p + lane) : 0.f;
                if (io.wsum)
                    w += v;
                else if (e >= 0 && e / El == j && p)
                    w = v;
            }
            if (lane == 0) {
                ((int32_t *)orec)[0] = i0 + k; /* its place among the node-level records */
                ((uint32_t *)orec)[1] = R.id;
            }
            if (lane < K)
                ((float *)(orec + 8))[lane] = w;
            __syncwarp(); /* sp is rewritten for the next record */
        }
        __syncwarp(); /* the step's rows read and records written */
        if (jtail && tk > tk0 && cnt > 0) /* the rows' slots go back */
            fr_cuht_publish(jhead, tk);
        i0 += m;
        if (lane == 0)
            fr_cuht_publish(tailw, sent0 + (unsigned long long)i0);
    }
    if (own != nmine) {
        if (lane == 0)
            fr_cuht_fail(A, FERRY_ERR_PROTOCOL, s, FR_CUHT_WHAT_COUNTS, own);
        return;
    }
    if (lane == 0)
        *mine = sent0 + (unsigned long long)n;
    if (jtail)
        fw.ftake[fi + lane] = tk;
}

template <int W, bool MANY, bool FWD, bool TM = false>
__global__ void __launch_bounds__(2 * W * 32, 1)
fr_cuht_combine_k(fr_cuht_args_t A, fr_cuht_rdev_t R, fr_cuht_io_t io)
{
    R.id = (unsigned int)*R.idp; /* written by the route's notify kernel */
    constexpr int U = W <= 8 ? 8 : 2, US = W <= 8 ? 4 : 1;
    constexpr int TW = TM && W == 8 && !MANY && !FWD ? W : 0; /* the senders' */
    int warp = threadIdx.x >> 5, N = A.G.N, me = A.G.rank, c = blockIdx.x;
    __shared__ int dead, gok[W];
    if (TW)
        fr_tma_init(TW);
    if (threadIdx.x == 0)
        dead = fr_cuht_failed(A);
    __syncthreads();
    if (dead)
        return;
    if (FWD && c >= A.G.C) { /* a forward block: the sources forwarded here */
        for (int i = warp; i < A.fw.nf; i += 2 * W)
            fr_cuht_cfwd<U>(A, R, io, c - A.G.C, A.fw.fl[i]);
        return;
    }
    if (MANY && warp < W && N - 1 > W) { /* each warp serves several rings, waiting on none */
        int room = A.G.RT + 1 - fr_cuht_cbatch(A.G.RT);
        fr_cuht_send_many<true, U>(A, R, io, c, warp, W,
                                   FR_CUHT_STEP < room ? FR_CUHT_STEP : room);
    } else if (warp < W) { /* the N - 1 peer rings; own rows: read from y by the receivers */
        int P = N > 1 ? fr_cuht_per_ring<W>(N - 1) : 1, r = warp / P;
        if (r >= N - 1)
            return;
        int s = (me + 1 + r) % N;
        /* barriers 1..W/2 (only when P > 1); the receivers use 15 */
        fr_cuht_grp_t g = {warp % P, P, 1 + r, &gok[r], &gok[r]};
        /* a step and a batch together fit a ring (liveness: see
         * docs/architecture.md) */
        int room = A.G.RT + 1 - fr_cuht_cbatch(A.G.RT);
        int S = P * FR_CUHT_STEP < room ? P * FR_CUHT_STEP : room;
        fr_cuht_send<true, U, TW>(A, R, io, c, s, S, g); /* flushed before it returns */
    } else {
        fr_cuht_crecv<W, US, MANY ? FR_CUHT_MAX_RANKS : 16>(A, R, io, c);
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

/* The dispatch or combine kernel for this context (W = 8 up to 8 ranks,
 * 16 above, warps serving many rings above 16; with forwarding its own
 * instantiations, whose forward blocks follow the channels': the forward
 * code's registers stay out of the others; the fourth: W = 8 with the
 * rows through the copy engine, where the context has it, fr_cuht_ep.tma),
 * launched on st. */
typedef struct fr_cuht_kern {
    const void *f;
    int w; /* W, warps per role: its blocks have 2W warps (its launch bound) */
} fr_cuht_kern_t;
/* an entry from the template's own arguments, so that a launch's block
 * size cannot differ from the instantiation's W */
#define FR_CUHT_K(f, W, ...) {(const void *)f<W, __VA_ARGS__>, W}
static const fr_cuht_kern_t fr_cuht_kern[2][2][4] = {
    {{FR_CUHT_K(fr_cuht_dispatch_k, 8, false, false),
      FR_CUHT_K(fr_cuht_dispatch_k, 16, false, false),
      FR_CUHT_K(fr_cuht_dispatch_k, 16, true, false),
      FR_CUHT_K(fr_cuht_dispatch_k, 8, false, false, true)},
     {FR_CUHT_K(fr_cuht_dispatch_k, 8, false, true),
      FR_CUHT_K(fr_cuht_dispatch_k, 16, false, true),
      FR_CUHT_K(fr_cuht_dispatch_k, 16, true, true),
      FR_CUHT_K(fr_cuht_dispatch_k, 8, false, true)}},
    {{FR_CUHT_K(fr_cuht_combine_k, 8, false, false),
      FR_CUHT_K(fr_cuht_combine_k, 16, false, false),
      FR_CUHT_K(fr_cuht_combine_k, 16, true, false),
      FR_CUHT_K(fr_cuht_combine_k, 8, false, false, true)},
     {FR_CUHT_K(fr_cuht_combine_k, 8, false, true),
      FR_CUHT_K(fr_cuht_combine_k, 16, false, true),
      FR_CUHT_K(fr_cuht_combine_k, 16, true, true),
      FR_CUHT_K(fr_cuht_combine_k, 8, false, true)}}};
#undef FR_CUHT_K

/* The copy engine's dynamic shared memory (its kernels' TW): the
 * dispatch's 2W warps, the combine's W senders, W of the table's column. */
static size_t fr_cuht_tma_bytes(int comb)
{
    int w = fr_cuht_kern[comb][0][3].w;
    return fr_tma_smem(comb ? w : 2 * w);
}

extern "C" int fr_cuht_tma_prep(int device, const char **why)
{
    int optin = 0;
    *why = NULL;
    if (!FR_CUHT_TMA) {
        *why = "built with FR_CUHT_TMA=0";
        return 0;
    }
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        *why = "the device's shared memory per block could not be read";
        return 0;
    }
    for (int comb = 0; comb < 2; comb++) {
        const void *k = fr_cuht_kern[comb][0][3].f;
        cudaFuncAttributes fa;
        size_t b = fr_cuht_tma_bytes(comb);
        if (cudaFuncGetAttributes(&fa, k) != cudaSuccess) {
            (void)cudaGetLastError();
            *why = comb ? "the combine kernel's attributes could not be read"
                        : "the dispatch kernel's attributes could not be read";
            return 0;
        }
        if (b + fa.sharedSizeBytes > (size_t)optin) {
            *why = "the device has too little shared memory per block";
            return 0;
        }
        if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)b) !=
            cudaSuccess) {
            (void)cudaGetLastError();
            *why = comb ? "the combine kernel's shared memory limit could not be raised"
                        : "the dispatch kernel's shared memory limit could not be raised";
            return 0;
        }
    }
    return 1;
}

static void fr_cuht_launch(ferry_ep_t ep, bool comb, fr_cuht_route_t *p, fr_cuht_io_t *io,
                           cudaStream_t st)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    int fwd = c->a.G.fwd ? 1 : 0, w = ep->N <= 8 ? (c->tma ? 3 : 0) : ep->N <= 16 ? 1 : 2;
    void *args[] = {&c->a, &p->r, io};
    size_t smem = w == 3 ? fr_cuht_tma_bytes(comb) : 0; /* limit raised at create */
    const fr_cuht_kern_t *k = &fr_cuht_kern[comb][fwd][w];
    cudaLaunchKernel(k->f, dim3((unsigned)((1 + fwd) * c->a.G.C)), dim3(2 * k->w * 32), args,
                     smem, st);
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
        (rc = fr_cuht_aligned(ep, out->recv_topk_idx_i64, 8, "recv_topk_idx_i64", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_topk_weights, 4, "recv_topk_weights", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_src_rank, 4, "recv_src_rank", call)) ||
        (rc = fr_cuht_aligned(ep, out->recv_src_token, 4, "recv_src_token", call)))
        return rc;
    fr_cuht_io_t io;
    memset(&io, 0, sizeof(io));
    io.x = (const uint8_t *)in->x;
    io.xs = in->x_scales;
    io.xs0 = (long long)in->x_scales_stride[0]; /* set by ferry_ht_dispatch */
    io.xs1 = (long long)in->x_scales_stride[1];
    io.w = in->topk_weights;
    io.rx = (uint8_t *)out->recv_x;
    io.rxs = out->recv_x_scales;
    io.ridx = out->recv_topk_idx;
    io.ridx64 = (long long *)out->recv_topk_idx_i64;
    io.rw = out->recv_topk_weights;
    io.rsr = out->recv_src_rank;
    io.rst = out->recv_src_token;
    io.fp8 = in->x_scales != NULL;
    if ((rc = fr_ahead_wait(ep, &c->ahead, c->ncomb, in->stream, call, fr_cuht_check)))
        return rc;
    cudaStream_t st = (cudaStream_t)in->stream;
    fr_cuht_launch(ep, false, p, &io, st);
    p->dispatched = 1;
    fr_cuht_pad_rows(route, out, in->stream);
    fr_cuht_route_used(route, in->stream);
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
        (rc = fr_cuht_aligned(ep, out->topk_weights, 4, "out->topk_weights", call)) ||
        (rc = fr_cuht_aligned(ep, in->bias[0], 16, "bias[0]", call)) ||
        (rc = fr_cuht_aligned(ep, in->bias[1], 16, "bias[1]", call)))
        return rc;
    fr_cuht_io_t io;
    memset(&io, 0, sizeof(io));
    io.bias[0] = (const int4 *)in->bias[0];
    io.bias[1] = (const int4 *)in->bias[1];
    io.x = (const uint8_t *)in->y;
    io.w = in->topk_weights;
    io.rx = (uint8_t *)out->out;
    io.rw = out->topk_weights;
    io.wsum = in->weights_sum != 0;
    io.slots = in->sum_order == FERRY_HT_SUM_SLOTS;
    if (c->a.G.fwd && !p->dispatched) /* alike on every rank: calls are collective */
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "ht_combine: route %llu has had no ht_dispatch; with forwarding "
                          "between nodes a combine follows a dispatch on its route (the "
                          "forwarders keep what the dispatch routed)",
                          (unsigned long long)route->id);
    cudaStream_t st = (cudaStream_t)in->stream;
    fr_cuht_launch(ep, true, p, &io, st);
    fr_cuht_route_used(route, in->stream);
    rc = fr_cuht_launch_check(ep, call);
    /* after the launch check: a failed record clears CUDA's last error */
    fr_ahead_mark(&c->ahead, c->ncomb++, in->stream);
    return rc;
}

extern "C" int fr_cuht_load_stream(void)
{
    cudaFuncAttributes fa;
    const fr_cuht_kern_t *k = &fr_cuht_kern[0][0][0];
    for (int i = 0; i < 16; i++)
        if (cudaFuncGetAttributes(&fa, k[i].f) != cudaSuccess)
            return 1;
    return 0;
}
