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
 * combine_recv: wait for every rank's flag; out[t] = sum_k w[t][k] * y,
 * accumulated in fp32 in k order, rounded once to bf16.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engines/cpu_ll/cpu_ll.h"
#include "core/quant.h"
#include "runtime/rt.h"

/* Sender s's rows are all in: a local peer's flag, a fabric peer's write. */
static int fr_cpu_combine_done(ferry_ep_t ep, fr_round_t *r, int s, uint64_t src_row,
                               uint64_t np)
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
    sl->src_off = fr_off_csend(L, set, src_row);
    sl->dst_off = fr_off_crecv(L, set, cr->comb_off[s]);
    sl->len = np * L->crow;
    sl->imm = fr_imm_make(FR_PH_COMBINE, r->epoch, ep->rank);
    return fr_proxy_submit(ep, FR_PH_COMBINE, set, r->epoch, g);
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
static int fr_cpu_combine_signalled(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, set = (int)(r->epoch % FR_NSETS), El = (int)L->El;
    int64_t cap = (int64_t)L->cap, nrow = (int64_t)El * cap;
    int64_t bs = in->signal_block > 0 ? in->signal_block : cap;
    int64_t nb = (cap + bs - 1) / bs;
    const uint8_t *y = (const uint8_t *)in->expert_y;
    int32_t *pair_of = malloc(sizeof(int32_t) * (size_t)nrow); /* row -> pair, -1 */
    int32_t *src_of = malloc(sizeof(int32_t) * (size_t)nrow);  /* row -> sender */
    uint32_t *left = malloc(sizeof(uint32_t) * (size_t)N * 2); /* rows to go; fabric base */
    if (!pair_of || !src_of || !left) {
        free(pair_of), free(src_of), free(left);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "combine_send: row maps of %lld rows",
                          (long long)nrow);
    }
    uint32_t *fbase = left + N;
    for (int64_t i = 0; i < nrow; i++)
        pair_of[i] = -1;
    int rc = FERRY_OK;
    uint32_t packed = 0;
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
        fbase[s] = packed;
        if (ep->path[s] == FR_PATH_FABRIC)
            packed += np;
        if (np == 0 && (rc = fr_cpu_combine_done(ep, r, s, fbase[s], 0)))
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
                uint32_t p = (uint32_t)pair_of[row];
                int fabric = ep->path[s] == FR_PATH_FABRIC;
                uint8_t *dst = fabric ? ep->send + fr_off_csend(L, set, (uint64_t)fbase[s] + p)
                                      : ep->peer_seg[s] + fr_off_crecv(L, set, cr->comb_off[s] + p);
                memcpy(dst, y + (size_t)row * L->crow, L->crow);
                if (--left[s] == 0 &&
                    (rc = fr_cpu_combine_done(ep, r, s, fbase[s],
                                              cr->pair_off[s + 1] - cr->pair_off[s])))
                    goto out;
            }
            if (in->sent_rows)
                __atomic_add_fetch(in->sent_rows + e, nrows, __ATOMIC_RELEASE);
        }
out:
    free(pair_of), free(src_of), free(left);
    return rc;
}

int fr_cpu_combine_send(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in)
{
    if (in->signals)
        return fr_cpu_combine_signalled(ep, r, in);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, set = (int)(r->epoch % FR_NSETS);
    const uint8_t *y = (const uint8_t *)in->expert_y;
    uint64_t packed = 0; /* rows packed so far in the send region */
    /* fabric peers first, each handed to the proxy as soon as it is
     * packed (its write starts while the next is packed), then the local
     * peers' direct stores */
    for (int pass = 0; pass < 2; pass++)
        for (int s = 0; s < N; s++) {
            int fabric = ep->path[s] == FR_PATH_FABRIC;
            if (fabric != (pass == 0) || fr_ep_masked(ep, s))
                continue; /* a masked rank sent nothing and gets nothing */
            uint32_t p0 = cr->pair_off[s], np = cr->pair_off[s + 1] - p0;
            const int32_t *rows = cr->pair_row + p0;
            uint8_t *dst = fabric ? ep->send + fr_off_csend(L, set, packed)
                                  : ep->peer_seg[s] + fr_off_crecv(L, set, cr->comb_off[s]);
            for (uint32_t p = 0; p < np; p++)
                memcpy(dst + (size_t)p * L->crow, y + (size_t)rows[p] * L->crow, L->crow);
            if (!fabric) {
                __atomic_store_n(fr_flag_ptr(L, ep->peer_seg[s], FR_PH_COMBINE, set, ep->rank),
                                 r->epoch, __ATOMIC_RELEASE);
                fr_doorbell_ring(ep->peer_seg[s]);
                continue;
            }
            int g = ep->group_index[s];
            fr_slice_t *sl =
                ep->slices + ((size_t)FR_PH_COMBINE * FR_NSETS + set) * ep->nfabric + g;
            sl->src_off = fr_off_csend(L, set, packed);
            sl->dst_off = fr_off_crecv(L, set, cr->comb_off[s]);
            sl->len = (uint64_t)np * L->crow;
            sl->imm = fr_imm_make(FR_PH_COMBINE, r->epoch, ep->rank);
            packed += np;
            int rc = fr_proxy_submit(ep, FR_PH_COMBINE, set, r->epoch, g);
            if (rc)
                return rc;
        }
    return FERRY_OK;
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
