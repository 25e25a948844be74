/*
 * CPU twins of the combine kernels.
 *
 * combine_send: for every source rank s, the rows of expert_y holding s's
 * (token, expert) pairs, in the order s sent them, go as one contiguous run
 * to rows [comb_off_s, comb_off_s + pairs_s) of s's combine region: stored
 * directly (self, shared memory; then the flag is published, release) or
 * packed for one fabric write that the proxy is asked to post at once.
 *
 * With signals (the overlapped combine, fr_cpu_combine_signalled): the rows
 * go by expert_y row, each signal's once it reads signal_value; a local
 * peer's flag once its last row is stored, a fabric peer's write once its
 * last row is packed.
 *
 * With LogFMT (cin.format): each row encoded as it is stored (core/logfmt.h),
 * to a local peer at its slot (cslot bytes apart, only the row's bytes
 * written), to a fabric peer packed: an offset table of the run's rows,
 * then the rows back to back, so the write carries the encoded bytes.
 *
 * combine_recv: wait for every rank's flag; out[t] = sum_k w[t][k] * y,
 * accumulated in fp32 in k order, rounded once to bf16.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engines/cpu_ll/cpu_ll.h"
#include "core/logfmt.h"
#include "core/quant.h"
#include "runtime/rt.h"


/* ---------------------------------------------------------------------- */
/* LogFMT on the host: log2 and exp2 correctly rounded to float (through
 * double), every multiply-add fused, as core/logfmt.h describes. */

static float fr_lg2(float x)
{
    return (float)log2((double)x);
}
static float fr_ex2(float x)
{
    return (float)exp2((double)x);
}

/* A division's logs from its amax, amin; ok: LogFMT may cast it. */
static int fr_lf_logs(float amax, float amin, float *la, float *lm)
{
    *la = fr_lg2(amax);
    *lm = fmaxf(fr_lg2(amin), *la - FR_LF_CLIP);
    return *la < 0.f && *lm < *la;
}

/* Row y (H bf16, H % 512 == 0) as LogFMT at dst; returns its bytes (a
 * multiple of 16). */
static uint32_t fr_lf_encode(uint8_t *dst, const uint16_t *y, int H)
{
    int C = fr_lf_chunk(H), dpc = C / FR_LF_DIV;
    uint32_t off = fr_lf_meta(H);
    for (int c = 0; c < H / C; c++) {
        float la[8], lm[8];
        int cast = 1;
        for (int j = 0; j < dpc; j++) {
            int d = c * dpc + j;
            float amax = 0.f, amin = INFINITY;
            for (int i = 0; i < FR_LF_DIV; i++) {
                float v = fr_bf16_to_f32((uint16_t)(y[d * FR_LF_DIV + i] & 0x7fffu));
                amax = v > amax ? v : amax; /* NaN ignored */
                amin = v < amin ? v : amin;
            }
            uint16_t m[2] = {fr_f32_to_bf16(amax), fr_f32_to_bf16(amin)};
            memcpy(dst + 4 * d, m, 4);
            cast &= fr_lf_logs(amax, amin, &la[j], &lm[j]);
        }
        const uint16_t *yc = y + (size_t)c * C;
        if (!cast) {
            memcpy(dst + off, yc, 2 * (size_t)C);
            off += fr_lf_chunk_bytes(C, 0);
            continue;
        }
        for (int j = 0; j < dpc; j++) {
            float step = (la[j] - lm[j]) / FR_LF_STEPS, inv = 1.f / step;
            float half = (1.f + fr_ex2(step)) * 0.5f;
            float fused = fmaf(-lm[j], inv, fmaf(-fr_lg2(half), inv, 2.f));
            for (int g = 0; g < FR_LF_DIV / FR_LF_GROUP; g++) {
                const uint16_t *yg = yc + j * FR_LF_DIV + g * FR_LF_GROUP;
                uint32_t e[16], signs = 0, w[5];
                for (int m = 0; m < 16; m++) {
                    float t = fmaf(fr_lg2(fr_bf16_to_f32((uint16_t)(yg[m] & 0x7fffu))), inv, fused);
                    t = fmaxf(t, 0.f); /* NaN: 0 */
                    e[m] = t < 511.f ? (uint32_t)t : 511u;
                    signs |= (uint32_t)(yg[m] >> 15) << m;
                }
                fr_lf_pack(w, e, signs);
                memcpy(dst + off + (size_t)((j * FR_LF_DIV + g * FR_LF_GROUP) / 16) * 20, w, 20);
            }
        }
        off += fr_lf_chunk_bytes(C, 1);
    }
    return off;
}

/* acc[i] = fma(decoded row[i], w, acc[i]) for a LogFMT row at src, at
 * most `room` bytes long; -1 when its meta says it is longer. */
static int fr_lf_accumulate(float *acc, float w, const uint8_t *src, uint64_t room, int H)
{
    int C = fr_lf_chunk(H), dpc = C / FR_LF_DIV, nc = H / C;
    float la[FR_LF_MAXDIV], lm[FR_LF_MAXDIV];
    uint8_t cast[FR_LF_MAXDIV / 4];
    uint64_t len = fr_lf_meta(H);
    if (len > room)
        return -1;
    for (int c = 0; c < nc; c++) {
        cast[c] = 1;
        for (int j = 0; j < dpc; j++) {
            int d = c * dpc + j;
            uint16_t m[2];
            memcpy(m, src + 4 * d, 4);
            float amax = fr_bf16_to_f32(m[0]), amin = fr_bf16_to_f32(m[1]);
            cast[c] &= fr_lf_logs(amax, amin, &la[d], &lm[d]);
        }
        len += fr_lf_chunk_bytes(C, cast[c]);
    }
    if (len > room)
        return -1;
    uint64_t off = fr_lf_meta(H);
    for (int c = 0; c < nc; c++) {
        float *ac = acc + (size_t)c * C;
        if (!cast[c]) {
            for (int i = 0; i < C; i++) {
                uint16_t b;
                memcpy(&b, src + off + 2 * (size_t)i, 2);
                ac[i] = fmaf(fr_bf16_to_f32(b), w, ac[i]);
            }
            off += fr_lf_chunk_bytes(C, 0);
            continue;
        }
        for (int j = 0; j < dpc; j++) {
            int d = c * dpc + j;
            float step = (la[d] - lm[d]) / FR_LF_STEPS;
            for (int g = 0; g < FR_LF_DIV / FR_LF_GROUP; g++) {
                int ch = j * FR_LF_DIV + g * FR_LF_GROUP;
                uint32_t wd[5];
                memcpy(wd, src + off + (size_t)(ch / 16) * 20, 20);
                for (int m = 0; m < 16; m++) {
                    uint32_t e = fr_lf_code(wd, m);
                    float v = e ? fr_ex2(fmaf((float)(e - 1), step, lm[d])) : 0.f;
                    v = (wd[4] >> (16 + m)) & 1u ? -v : v;
                    ac[ch + m] = fmaf(v, w, ac[ch + m]);
                }
            }
        }
        off += fr_lf_chunk_bytes(C, 1);
    }
    return 0;
}

/* Where one sender's rows go in a combine_send: its area (first slot, or
 * for a packed run the offset table), and for a packed run the bytes of
 * rows so far. */
typedef struct fr_cw {
    uint8_t *area;
    uint32_t np, used;
    int lf, packed;
} fr_cw_t;

static uint32_t fr_cw_table(uint32_t np)
{
    return (uint32_t)fr_align(4ull * np, 16);
}

static void fr_cw_put(const fr_layout_t *L, fr_cw_t *w, uint32_t p, const uint8_t *yrow)
{
    if (!w->lf) {
        memcpy(w->area + (size_t)p * L->crow, yrow, L->crow);
    } else if (!w->packed) {
        fr_lf_encode(w->area + (size_t)p * L->cslot, (const uint16_t *)yrow, L->H);
    } else {
        uint32_t off = fr_cw_table(w->np) + w->used;
        w->used += fr_lf_encode(w->area + off, (const uint16_t *)yrow, L->H);
        memcpy(w->area + 4 * (size_t)p, &off, 4);
    }
}

/* Bytes of the sender's area that hold its rows. */
static uint64_t fr_cw_len(const fr_layout_t *L, const fr_cw_t *w)
{
    if (!w->lf)
        return (uint64_t)w->np * L->crow;
    if (!w->packed)
        return (uint64_t)w->np * L->cslot;
    return w->np ? fr_cw_table(w->np) + (uint64_t)w->used : 0;
}

/* Sender s's area this round: rows from `row` (the send region's for a
 * fabric peer, else s's combine region's), stride by format. */
static fr_cw_t fr_cw_of(ferry_ep_t ep, fr_round_t *r, int s, uint64_t row, int lf)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int set = (int)(r->epoch % FR_NSETS), fabric = ep->path[s] == FR_PATH_FABRIC;
    uint64_t st = lf ? L->cslot : L->crow;
    fr_cw_t w;
    w.np = cr->pair_off[s + 1] - cr->pair_off[s];
    w.used = 0;
    w.lf = lf;
    w.packed = lf && fabric;
    w.area = fabric ? ep->send + fr_off_csend_st(L, set, row, st)
                    : ep->peer_seg[s] + fr_off_crecv_st(L, set, cr->comb_off[s], st);
    return w;
}

/* Sender s's rows are all in (w: where they went): a local peer's flag,
 * a fabric peer's write. */
static int fr_cpu_combine_done(ferry_ep_t ep, fr_round_t *r, int s, const fr_cw_t *w)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int set = (int)(r->epoch % FR_NSETS);
    if (ep->path[s] != FR_PATH_FABRIC) {
        __atomic_store_n(fr_flag_ptr(L, ep->peer_seg[s], FR_PH_COMBINE, set, ep->rank),
                         r->epoch, __ATOMIC_RELEASE);
        fr_doorbell_ring(ep->peer_seg[s]);
        return FERRY_OK;
    }
    int g = ep->group_index[s];
    fr_slice_t *sl = ep->slices + ((size_t)FR_PH_COMBINE * FR_NSETS + set) * ep->nfabric + g;
    sl->src_off = (uint64_t)(w->area - ep->send);
    sl->dst_off = fr_off_crecv_st(L, set, cr->comb_off[s], w->lf ? L->cslot : L->crow);
    sl->len = fr_cw_len(L, w);
    sl->imm = fr_imm_make(FR_PH_COMBINE, r->epoch, ep->rank);
    return fr_proxy_submit(ep, FR_PH_COMBINE, set, r->epoch, g);
}

/* The empty combine of round `epoch` (slot r's) to every unmasked peer. */
static int fr_cpu_combine_empty(ferry_ep_t ep, const fr_round_t *r, uint64_t epoch)
{
    fr_round_t old = *r;
    old.epoch = epoch;
    fr_cw_t w = {0};
    w.area = ep->send; /* no rows: a fabric peer's write is empty */
    int rc = FERRY_OK;
    for (int s = 0; s < ep->N && rc == FERRY_OK; s++)
        if (!fr_ep_masked(ep, s))
            rc = fr_cpu_combine_done(ep, &old, s, &w);
    return rc;
}

int fr_cpu_leave(ferry_ep_t ep, fr_round_t *r, int seen_all)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    cr->left = r->epoch;
    cr->left_sent = 0;
    r->state = FR_ROUND_FREE;
    if (!seen_all)
        return FERRY_OK;
    int rc = fr_cpu_combine_empty(ep, r, r->epoch);
    cr->left_sent = rc == FERRY_OK;
    return rc;
}

int fr_cpu_settle(ferry_ep_t ep, fr_round_t *r)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    uint64_t e = cr->left;
    if (e == 0)
        return FERRY_OK;
    int set = (int)(e % FR_NSETS), rc = FERRY_OK;
    cr->left = 0; /* whatever follows: a failure here is the context's */
    if (!cr->left_sent) {
        rc = fr_wait_flags(ep, FR_PH_DISPATCH, set, e,
                           "dispatch (of a round left for a bad topk_idx)", NULL);
        if (rc == FERRY_OK)
            rc = fr_cpu_combine_empty(ep, r, e);
    }
    if (rc == FERRY_OK)
        rc = fr_wait_flags(ep, FR_PH_COMBINE, set, e,
                           "combine (of a round left for a bad topk_idx)", NULL);
    return rc;
}

/* Wait until *sig == want (acquire), spinning, then napping 20 us; the
 * context's timeout ends it (FERRY_ERR_TIMEOUT naming the expert). */
static int fr_cpu_signal_wait(ferry_ep_t ep, fr_round_t *r, const uint32_t *sig, uint32_t want,
                              int e, int64_t idx)
{
    uint64_t deadline = 0;
    for (uint64_t n = 0;; n++) {
        if (__atomic_load_n(sig, __ATOMIC_ACQUIRE) == want)
            return FERRY_OK;
        if (n < 256) {
            fr_cpu_relax();
            continue;
        }
        uint64_t now = fr_now_ns();
        if (!deadline)
            deadline = now + (uint64_t)ep->timeout_ms * 1000000ull;
        else if (now > deadline)
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "combine round %llu: local expert %d's signal (signals[%lld]) "
                              "is %u after %ld ms, waiting for %u: the computation writing "
                              "expert_y never raised it",
                              (unsigned long long)r->epoch, e, (long long)idx,
                              __atomic_load_n(sig, __ATOMIC_RELAXED), ep->timeout_ms, want);
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* combine_send with signals: every sender's pairs by expert_y row, so the
 * rows of one signal go together once it is raised (rows of a signal
 * nobody gets are not waited for). */
static int fr_cpu_combine_signalled(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                                    int lf)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, El = (int)L->El;
    int64_t cap = (int64_t)L->cap, nrow = (int64_t)El * cap;
    int64_t bs = in->signal_block > 0 ? in->signal_block : cap;
    int64_t nb = (cap + bs - 1) / bs;
    const uint8_t *y = (const uint8_t *)in->expert_y;
    int32_t *pair_of = malloc(sizeof(int32_t) * (size_t)nrow); /* row -> pair, -1 */
    int32_t *src_of = malloc(sizeof(int32_t) * (size_t)nrow);  /* row -> sender */
    uint32_t *left = malloc(sizeof(uint32_t) * (size_t)N);     /* rows to go */
    fr_cw_t *cw = malloc(sizeof(fr_cw_t) * (size_t)N);
    if (!pair_of || !src_of || !left || !cw) {
        free(pair_of), free(src_of), free(left), free(cw);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "combine_send: row maps of %lld rows",
                          (long long)nrow);
    }
    for (int64_t i = 0; i < nrow; i++)
        pair_of[i] = -1;
    int rc = FERRY_OK;
    uint64_t packed = 0; /* rows before each fabric peer's in the send region */
    for (int s = 0; s < N; s++) {
        left[s] = 0;
        if (fr_ep_masked(ep, s))
            continue; /* a masked rank sent nothing and gets nothing */
        uint32_t p0 = cr->pair_off[s], np = cr->pair_off[s + 1] - p0;
        for (uint32_t p = p0; p < p0 + np; p++) {
            int32_t row = cr->pair_row[p];
            pair_of[row] = (int32_t)(p - p0);
            src_of[row] = s;
        }
        left[s] = np;
        cw[s] = fr_cw_of(ep, r, s, packed, lf);
        if (ep->path[s] == FR_PATH_FABRIC)
            packed += np;
        if (np == 0 && (rc = fr_cpu_combine_done(ep, r, s, &cw[s])))
            goto out;
    }
    for (int e = 0; e < El; e++)
        for (int64_t b = 0; b < nb; b++) {
            int64_t r0 = e * cap + b * bs, r1 = e * cap + (b + 1) * bs;
            r1 = r1 < (e + 1) * cap ? r1 : (e + 1) * cap;
            int32_t nrows = 0;
            for (int64_t row = r0; row < r1; row++)
                nrows += pair_of[row] >= 0;
            if (nrows == 0)
                continue;
            int64_t idx = (int64_t)e * nb + b;
            if ((rc = fr_cpu_signal_wait(ep, r, in->signals + idx, in->signal_value, e, idx)))
                goto out;
            for (int64_t row = r0; row < r1; row++) {
                if (pair_of[row] < 0)
                    continue;
                int s = src_of[row];
                fr_cw_put(L, &cw[s], (uint32_t)pair_of[row], y + (size_t)row * L->crow);
                if (--left[s] == 0 && (rc = fr_cpu_combine_done(ep, r, s, &cw[s])))
                    goto out;
            }
            if (in->sent_rows)
                __atomic_add_fetch(in->sent_rows + e, nrows, __ATOMIC_RELEASE);
        }
out:
    free(pair_of), free(src_of), free(left), free(cw);
    return rc;
}

int fr_cpu_combine_send(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    int lf = in->format == FERRY_COMBINE_LOGFMT;
    cr->logfmt = lf;
    if (in->signals)
        return fr_cpu_combine_signalled(ep, r, in, lf);
    const fr_layout_t *L = &ep->L;
    int N = ep->N;
    const uint8_t *y = (const uint8_t *)in->expert_y;
    uint64_t packed = 0; /* rows before each fabric peer's in the send region */
    /* fabric peers first, each handed to the proxy as soon as it is
     * packed (its write starts while the next is packed), then the local
     * peers' direct stores */
    for (int pass = 0; pass < 2; pass++)
        for (int s = 0; s < N; s++) {
            int fabric = ep->path[s] == FR_PATH_FABRIC;
            if (fabric != (pass == 0) || fr_ep_masked(ep, s))
                continue; /* a masked rank sent nothing and gets nothing */
            const int32_t *rows = cr->pair_row + cr->pair_off[s];
            fr_cw_t w = fr_cw_of(ep, r, s, packed, lf);
            for (uint32_t p = 0; p < w.np; p++)
                fr_cw_put(L, &w, p, y + (size_t)rows[p] * L->crow);
            if (fabric)
                packed += w.np;
            int rc = fr_cpu_combine_done(ep, r, s, &w);
            if (rc)
                return rc;
        }
    return FERRY_OK;
}

/* The rows of a LogFMT round: rowp[pos] for each row of this rank's
 * combine region (NULL: a masked sender's), room[pos] the bytes it may
 * take; a fabric sender's offset table checked. */
static int fr_lf_rows(ferry_ep_t ep, fr_round_t *r, const uint8_t **rowp, uint64_t *room)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int set = (int)(r->epoch % FR_NSETS);
    for (int d = 0; d < ep->N; d++) {
        uint32_t r0 = cr->send_off[d], np = cr->send_off[d + 1] - r0;
        const uint8_t *area = ep->seg + fr_off_crecv_st(L, set, r0, L->cslot);
        uint64_t len = (uint64_t)np * L->cslot, tab = fr_cw_table(np);
        int masked = fr_ep_masked(ep, d);
        for (uint32_t i = 0; i < np; i++) {
            if (masked) {
                rowp[r0 + i] = NULL;
                continue;
            }
            if (ep->path[d] != FR_PATH_FABRIC) {
                rowp[r0 + i] = area + (size_t)i * L->cslot;
                room[r0 + i] = L->cslot;
                continue;
            }
            uint32_t off;
            memcpy(&off, area + 4 * (size_t)i, 4);
            if (off < tab || off % 16 || off >= len)
                return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                  "combine round %llu: LogFMT rows from rank %d: row %u at "
                                  "offset %u, outside its %llu bytes (did every rank pass "
                                  "the same combine format?)", (unsigned long long)r->epoch,
                                  d, i, off, (unsigned long long)len);
            rowp[r0 + i] = area + off;
            room[r0 + i] = len - off;
        }
    }
    return FERRY_OK;
}

/* combine_recv of a LogFMT round (its flags are in): each row decoded
 * into the token's fp32 sum, fused multiply-adds in k order. */
static int fr_cpu_combine_recv_lf(ferry_ep_t ep, fr_round_t *r, const ferry_combine_out_t *out)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int H = L->H, K = L->K;
    uint32_t nrows = cr->send_off[ep->N];
    const uint8_t **rowp = malloc(sizeof(*rowp) * (nrows ? nrows : 1));
    uint64_t *room = malloc(sizeof(*room) * (nrows ? nrows : 1));
    int rc = rowp && room ? fr_lf_rows(ep, r, rowp, room)
                          : fr_ep_fail(ep, FERRY_ERR_NOMEM, "combine_recv: %u row pointers",
                                       nrows);
    float *acc = c->acc;
    uint16_t *o = (uint16_t *)out->out;
    for (int t = 0; t < r->T && rc == FERRY_OK; t++) {
        memset(acc, 0, sizeof(float) * (size_t)H);
        const int32_t *cp = cr->comb_pos + (size_t)t * K;
        const float *w = out->topk_weights + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            if (cp[k] < 0 || (uint32_t)cp[k] >= nrows || !rowp[cp[k]])
                continue;
            if (fr_lf_accumulate(acc, w[k], rowp[cp[k]], room[cp[k]], H)) {
                rc = fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                "combine round %llu: a LogFMT row (token %d, slot %d) is "
                                "longer than its room (did every rank pass the same "
                                "combine format?)", (unsigned long long)r->epoch, t, k);
                break;
            }
        }
        fr_row_to_bf16(acc, o + (size_t)t * H, H);
    }
    free(rowp);
    free(room);
    return rc;
}

int fr_cpu_combine_recv(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_out_t *out)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int set = (int)(r->epoch % FR_NSETS), H = L->H, K = L->K;
    int rc = fr_wait_flags(ep, FR_PH_COMBINE, set, r->epoch, "combine", out->wait_cost);
    if (rc)
        return rc;
    if (cr->logfmt)
        return fr_cpu_combine_recv_lf(ep, r, out);
    /* a rank masked after this round's dispatch_send (mask_on_timeout)
     * never sent the replies of its rows: they count as 0 */
    for (int d = 0; d < ep->N; d++)
        if (fr_ep_masked(ep, d) && cr->send_off[d + 1] > cr->send_off[d])
            memset(ep->seg + fr_off_crecv(L, set, cr->send_off[d]), 0,
                   (size_t)(cr->send_off[d + 1] - cr->send_off[d]) * L->crow);
    float *acc = c->acc;
    uint16_t *o = (uint16_t *)out->out;
    for (int t = 0; t < r->T; t++) {
        memset(acc, 0, sizeof(float) * (size_t)H);
        const int32_t *cp = cr->comb_pos + (size_t)t * K;
        const float *w = out->topk_weights + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            if (cp[k] < 0)
                continue;
            const uint16_t *yr =
                (const uint16_t *)(ep->seg + fr_off_crecv(L, set, (uint64_t)cp[k]));
            fr_axpy_bf16(acc, w[k], yr, H);
        }
        fr_row_to_bf16(acc, o + (size_t)t * H, H);
    }
    return FERRY_OK;
}
