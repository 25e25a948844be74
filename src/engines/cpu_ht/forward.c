/*
 * Forwarding through one rank per node (cpu_ht.h, "Forwarding"): the
 * forwarder's side of dispatch (node-level records landed from a remote
 * source, written into its node's destinations' rings, or into its own
 * rows), the destinations' side of combine (rows of remote sources into
 * the forwarders' rings) and the forwarder's sums sent back.
 *
 * Order: a destination writes the rows of the sources one forwarder
 * serves in ascending source order, each source's in its row order; the
 * forwarder sums them in the same order (sources ascending, a source's
 * tokens in the order they were forwarded), so each ring is read in the
 * order it is written. A forwarder that waits for a sender's credits
 * stops taking from its rings, which stalls only the writers of later
 * rows of the same ring; the chain of waits runs down the source ranks,
 * so it cannot close on itself (docs/architecture.md).
 */
#include <stdlib.h>
#include <string.h>

#include "core/quant.h"
#include "engines/cpu_ht/cpu_ht.h"

int fr_ht_fwd_setup(ferry_ep_t ep, fr_err_t *err)
{
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    fr_ht_fwd_t *fw = &st->fwd;
    int N = ep->N, El = ep->L.El, LF = 0;
    for (int b = 0; b < ep->nnodes; b++) {
        int n = ep->node_off[b + 1] - ep->node_off[b];
        LF = n > LF ? n : LF;
    }
    ep->forward = 0;
    if (ep->fwd_req == FERRY_FORWARD_OFF || ep->nnodes < 2 || LF < 2) {
        if (ep->fwd_req == FERRY_FORWARD_ON)
            FR_LOG_INFO(FR_SUB_INIT, "forward = on: nothing to forward (%d node%s, at most "
                        "%d rank%s each)", ep->nnodes, ep->nnodes == 1 ? "" : "s", LF,
                        LF == 1 ? "" : "s");
        return FERRY_OK;
    }
    if (LF > 256) {
        if (ep->fwd_req == FERRY_FORWARD_ON)
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                          "forward = on: a node of %d ranks (at most 256 forward)", LF);
        FR_LOG_INFO(FR_SUB_INIT, "forwarding off: a node of %d ranks (at most 256)", LF);
        return FERRY_OK;
    }
    /* node-relative expert ids travel as int16 */
    if ((int64_t)LF * El > 32767) {
        if (ep->fwd_req == FERRY_FORWARD_ON)
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                          "forward = on: a node of %d ranks holds %d experts, at most 32767 "
                          "forward (node-relative expert ids are 16-bit)", LF, LF * El);
        FR_LOG_INFO(FR_SUB_INIT, "forwarding off: a node of %d ranks holds %d experts (at "
                    "most 32767)", LF, LF * El);
        return FERRY_OK;
    }
    int me = ep->rank;
    fw->me_node = ep->node_of[me];
    fw->L = ep->node_off[fw->me_node + 1] - ep->node_off[fw->me_node];
    fw->fsrc = malloc(sizeof(int) * (size_t)N);
    fw->ftx = calloc((size_t)N * (size_t)fw->L, sizeof(uint64_t));
    fw->fctx = calloc((size_t)fw->L, sizeof(uint64_t));
    fw->fcrx = calloc((size_t)fw->L, sizeof(uint64_t));
    fw->ctb = malloc(sizeof(int) * ((size_t)N + (size_t)ep->nnodes));
    if (!fw->fsrc || !fw->ftx || !fw->fctx || !fw->fcrx || !fw->ctb)
        return FR_ERR(err, FERRY_ERR_NOMEM, "forwarding tables");
    fw->nfsrc = 0;
    for (int s = 0; s < N; s++)
        if (fr_ep_fwd_by(ep, s, me))
            fw->fsrc[fw->nfsrc++] = s;
    /* combine: nodes in order; this node's ranks one by one, every other
     * node's sum as one row */
    fw->nctb = 0;
    for (int b = 0; b < ep->nnodes; b++) {
        if (b != fw->me_node) {
            fw->ctb[fw->nctb++] = -(b + 1);
            continue;
        }
        for (int i = ep->node_off[b]; i < ep->node_off[b + 1]; i++)
            fw->ctb[fw->nctb++] = ep->node_ranks[i];
    }
    fr_ht_layout_fwd(&st->H, LF);
    ep->forward = 1;
    FR_LOG_INFO(FR_SUB_INIT, "forwarding through one rank per node: %d nodes, this rank "
                "forwards for %d source%s", ep->nnodes, fw->nfsrc, fw->nfsrc == 1 ? "" : "s");
    return FERRY_OK;
}

void fr_ht_fwd_free(ferry_ep_t ep)
{
    fr_ht_fwd_t *fw = &fr_cpu_ht(ep)->fwd;
    free(fw->fsrc);
    free(fw->ftx);
    free(fw->fctx);
    free(fw->fcrx);
    free(fw->ctb);
    memset(fw, 0, sizeof(*fw));
}

int fr_ht_fwd_call_init(fr_ht_call_t *c)
{
    ferry_ep_t ep = c->ep;
    if (!ep->forward)
        return FERRY_OK;
    size_t N = (size_t)ep->N;
    c->fw_done = calloc(N, sizeof(int32_t));
    c->fw_self = calloc(N, sizeof(int32_t));
    c->fw_fill = calloc(N, sizeof(int32_t));
    c->fw_cur = calloc((size_t)fr_cpu_ht(ep)->fwd.L, sizeof(int32_t));
    c->fw_cnt = calloc(N * (size_t)fr_cpu_ht(ep)->fwd.L, sizeof(int32_t));
    c->fw_acc = malloc(sizeof(float) * (size_t)c->h->H);
    if (!c->fw_done || !c->fw_self || !c->fw_fill || !c->fw_cur || !c->fw_cnt || !c->fw_acc)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "call state");
    return FERRY_OK;
}

void fr_ht_fwd_call_end(fr_ht_call_t *c)
{
    free(c->fw_done);
    free(c->fw_self);
    free(c->fw_fill);
    free(c->fw_cur);
    free(c->fw_cnt);
    free(c->fw_acc);
}

/* Rows of source s at this rank. */
static int fr_ht_rows_from(const fr_ht_call_t *c, int s)
{
    return c->p->src_off[s + 1] - c->p->src_off[s];
}

/* The ranks of this node (local indices, L <= 256) that node-relative
 * expert ids le[K] name; 0 when they name none. */
static int fr_ht_fwd_mask(const int16_t *le, int K, int El, uint64_t tmask[4])
{
    int any = 0;
    memset(tmask, 0, 4 * sizeof(uint64_t));
    for (int k = 0; k < K; k++)
        if (le[k] >= 0)
            any = 1, tmask[(le[k] / El) >> 6] |= 1ull << ((le[k] / El) & 63);
    return any;
}

static int fr_ht_fwd_in(const uint64_t tmask[4], int l)
{
    return (int)(tmask[l >> 6] >> (l & 63) & 1);
}

/* ---------------------------------------------------------------- dispatch */

/* Node-level record `hd` (checked) of source s: to each local destination
 * (own rows directly), if every one has room. 1: passed on, 0: no room. */
static int fr_ht_fwd_one(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s,
                         const fr_ht_dhdr_copy_t *hd, const uint8_t *rec, int16_t *keep)
{
    ferry_ep_t ep = c->ep;
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    const fr_ht_layout_t *h = c->h;
    fr_ht_fwd_t *fw = &st->fwd;
    int K = h->K, El = h->El, me = ep->rank, base = ep->node_off[fw->me_node];
    uint64_t tmask[4]; /* the local indices this token goes to */
    if (!fr_ht_fwd_mask(hd->le, K, El, tmask))
        return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                          "ht_dispatch: rank %d forwards token %d through this rank to no "
                          "rank of its node", s, hd->token);
    for (int l = 0; l < fw->L; l++) {
        if (!fr_ht_fwd_in(tmask, l))
            continue;
        /* never more records for a rank than the source's counts said
         * (which that rank took as its own): a confused source fails
         * here, naming it, instead of shifting the rank's rows */
        if (c->fw_cnt[(size_t)s * fw->L + l] >= c->p->fwd_cnt[(size_t)s * h->LF + l])
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "ht_dispatch: rank %d forwards more tokens for rank %d through "
                              "this rank than its counts said (%d)", s,
                              ep->node_ranks[base + l], c->p->fwd_cnt[(size_t)s * h->LF + l]);
        int d = ep->node_ranks[base + l];
        if (d == me)
            continue;
        uint8_t *ring = fr_ht_dring(h, ep->peer_seg[d], s);
        uint64_t head = __atomic_load_n(fr_ht_head(ring), __ATOMIC_ACQUIRE);
        uint64_t sent = fw->ftx[(size_t)s * fw->L + l];
        if (fr_ht_ring_check(c, "ht_dispatch (forwarding)", d, 0, head, sent) != FERRY_OK)
            return FERRY_ERR_PROTOCOL;
        if (sent - head >= (uint64_t)h->RT)
            return 0;
    }
    memcpy(keep, hd->le, sizeof(int16_t) * (size_t)K);
    uint8_t hdr[512] __attribute__((aligned(16)));
    for (int l = 0; l < fw->L; l++) {
        if (!fr_ht_fwd_in(tmask, l))
            continue;
        c->fw_cnt[(size_t)s * fw->L + l]++;
        int d = ep->node_ranks[base + l];
        /* the record as the sender would have written it to d */
        fr_ht_dhdr_t *dh = (fr_ht_dhdr_t *)hdr;
        int16_t *le = (int16_t *)(hdr + sizeof(*dh));
        float *w = (float *)(hdr + fr_ht_woff(K));
        dh->token = hd->token;
        dh->flags = hd->flags;
        for (int k = 0; k < K; k++) {
            int on = hd->le[k] >= 0 && hd->le[k] / El == l;
            le[k] = (int16_t)(on ? hd->le[k] % El : -1);
            w[k] = on ? hd->w[k] : 0.f;
        }
        const uint8_t *data = rec + h->dhdr;
        if (d == me) {
            if (c->done_rx[s] >= fr_ht_rows_from(c, s))
                return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                  "ht_dispatch: rank %d forwards more rows here than its "
                                  "counts said (%d)", s, fr_ht_rows_from(c, s));
            fr_ht_put_row(c, out, s, c->p->src_off[s] + c->done_rx[s]++, hd->token, le, w, data,
                          (const float *)(data + c->rowb), NULL);
            continue;
        }
        uint8_t *ring = fr_ht_dring(h, ep->peer_seg[d], s);
        uint64_t *sent = &fw->ftx[(size_t)s * fw->L + l];
        uint8_t *slot = fr_ht_slot(ring, *sent, h->RT, h->drec);
        memcpy(slot, hdr, h->dhdr);
        memcpy(slot + h->dhdr, data, c->rowb + c->nsc * sizeof(float));
        ++*sent;
        __atomic_store_n(fr_ht_tail(ring), *sent, __ATOMIC_RELEASE);
    }
    return 1;
}

int fr_ht_fwd_dispatch(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int *left)
{
    ferry_ep_t ep = c->ep;
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    fr_ht_fab_t *f = &st->fab;
    const fr_ht_layout_t *h = c->h;
    fr_ht_fwd_t *fw = &st->fwd;
    int moved = 0, K = h->K;
    for (int i = 0; i < fw->nfsrc; i++) {
        int s = fw->fsrc[i];
        int n = c->p->fwd_off[s + 1] - c->p->fwd_off[s];
        uint8_t *ring = fr_ht_dring(h, ep->seg, s);
        while (c->fw_done[s] < n) {
            size_t w = (size_t)(f->d_take[s] % (uint64_t)f->W);
            if (!f->d_landed[(size_t)s * f->W + w])
                break;
            int j = c->fw_done[s] % FR_HT_CHUNK, start = c->fw_done[s] - j;
            int m = n - start < FR_HT_CHUNK ? n - start : FR_HT_CHUNK;
            const uint8_t *rec = ring + 2 * FR_HT_LINE + (w * FR_HT_CHUNK + (size_t)j) * h->drec;
            fr_ht_dhdr_copy_t hd;
            fr_err_t err;
            int rc = fr_ht_dhdr_check(rec, K, ep->L.T, fw->L * h->El, c->fp8, c->route->id, s,
                                      &hd, &err);
            if (rc != FERRY_OK)
                return fr_ep_fail(ep, rc, "ht_dispatch: %s", err.msg);
            rc = fr_ht_fwd_one(c, out, s, &hd, rec,
                               c->p->fle + (size_t)(c->p->fwd_off[s] + c->fw_done[s]) * K);
            if (rc < 0)
                return rc;
            if (rc == 0) {
                c->busy_rank = s;
                break;
            }
            moved = 1;
            if (++c->fw_done[s] - start < m)
                continue;
            f->d_landed[(size_t)s * f->W + w] = 0; /* the chunk is passed on */
            f->d_take[s]++;
            rc = fr_ht_post(ep, s, 0, 0, 0, fr_ht_imm(FR_HT_IMM_DCREDIT, ep->rank, f->d_take[s]),
                            1);
            if (rc != FERRY_OK)
                return rc;
        }
        if (c->fw_done[s] < n) {
            *left = 1;
            c->busy_rank = s;
        } else if (n > 0 && c->fw_cnt[(size_t)s * fw->L] >= 0) {
            /* all passed on: exactly what the counts said, rank by rank */
            for (int l = 0; l < fw->L; l++)
                if (c->fw_cnt[(size_t)s * fw->L + l] != c->p->fwd_cnt[(size_t)s * h->LF + l])
                    return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                      "ht_dispatch: rank %d forwarded %d tokens for rank %d "
                                      "through this rank, its counts said %d", s,
                                      c->fw_cnt[(size_t)s * fw->L + l],
                                      ep->node_ranks[ep->node_off[fw->me_node] + l],
                                      c->p->fwd_cnt[(size_t)s * h->LF + l]);
            c->fw_cnt[(size_t)s * fw->L] = -1; /* checked */
        }
    }
    return moved;
}

/* ---------------------------------------------------------------- combine */

int fr_ht_fwd_combine_tx(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int *left)
{
    ferry_ep_t ep = c->ep;
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    const fr_ht_layout_t *h = c->h;
    fr_ht_fwd_t *fw = &st->fwd;
    int me = ep->rank, mine = ep->node_lidx[me], moved = 0;
    for (int l = 0; l < fw->L; l++) {
        int f = ep->node_ranks[ep->node_off[fw->me_node] + l];
        if (f == me)
            continue; /* this rank's own rows are summed in place */
        uint8_t *ring = fr_ht_fcring(h, ep->peer_seg[f], mine);
        uint64_t head = __atomic_load_n(fr_ht_head(ring), __ATOMIC_ACQUIRE);
        uint64_t *sent = &fw->fctx[l];
        if (fr_ht_ring_check(c, "ht_combine (forwarding)", f, 0, head, *sent) != FERRY_OK)
            return FERRY_ERR_PROTOCOL;
        /* the remote sources f forwards for, ascending */
        for (int s = c->fw_cur[l]; s < ep->N; s = ++c->fw_cur[l]) {
            if (!fr_ep_fwd_by(ep, s, f))
                continue;
            int n = fr_ht_rows_from(c, s), wrote = 0;
            while (c->done_tx[s] < n && *sent - head < (uint64_t)h->RT) {
                fr_ht_crec_fill(c, in, (size_t)c->p->src_off[s] + (size_t)c->done_tx[s],
                                fr_ht_slot(ring, *sent, h->RT, h->crec));
                ++*sent;
                c->done_tx[s]++;
                if (++wrote % FR_HT_CHUNK == 0)
                    __atomic_store_n(fr_ht_tail(ring), *sent, __ATOMIC_RELEASE);
            }
            if (wrote)
                __atomic_store_n(fr_ht_tail(ring), *sent, __ATOMIC_RELEASE);
            moved |= wrote > 0;
            if (c->done_tx[s] < n) {
                *left = 1;
                c->busy_rank = f;
                break;
            }
        }
    }
    return moved;
}

/* Forwarder: token j of source s (node-relative ids le): are all its
 * rows here? Then sum them (local ranks in order) into c->fw_acc and the
 * slot floats into w, take them, and return 1. */
static int fr_ht_fwd_sum_one(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int s,
                             const int16_t *le, float *w)
{
    ferry_ep_t ep = c->ep;
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    const fr_ht_layout_t *h = c->h;
    fr_ht_fwd_t *fw = &st->fwd;
    int K = h->K, El = h->El, H = h->H, me = ep->rank, mine = ep->node_lidx[me];
    int base = ep->node_off[fw->me_node];
    uint64_t tmask[4];
    fr_ht_fwd_mask(le, K, El, tmask);
    for (int l = 0; l < fw->L; l++) { /* every row in? */
        if (!fr_ht_fwd_in(tmask, l) || l == mine)
            continue;
        uint8_t *ring = fr_ht_fcring(h, ep->seg, l);
        uint64_t tail = __atomic_load_n(fr_ht_tail(ring), __ATOMIC_ACQUIRE);
        if (fr_ht_ring_check(c, "ht_combine (forwarding)", ep->node_ranks[base + l], 1, tail,
                             fw->fcrx[l]) != FERRY_OK)
            return FERRY_ERR_PROTOCOL;
        if (tail == fw->fcrx[l]) {
            c->busy_rank = ep->node_ranks[base + l];
            return 0;
        }
    }
    memset(c->fw_acc, 0, sizeof(float) * (size_t)H);
    memset(w, 0, sizeof(float) * (size_t)K);
    for (int l = 0; l < fw->L; l++) {
        if (!fr_ht_fwd_in(tmask, l))
            continue;
        const uint16_t *y;
        const float *wl;
        uint8_t *ring = NULL;
        if (l == mine) {
            size_t row = (size_t)c->p->src_off[s] + (size_t)c->fw_self[s]++;
            y = (const uint16_t *)in->y + row * H;
            wl = in->topk_weights ? in->topk_weights + row * K : NULL;
        } else {
            ring = fr_ht_fcring(h, ep->seg, l);
            const uint8_t *rec = fr_ht_slot(ring, fw->fcrx[l], h->RT, h->crec);
            y = (const uint16_t *)(rec + h->chdr);
            wl = (const float *)rec;
        }
        for (int i = 0; i < H; i++)
            c->fw_acc[i] += fr_bf16_to_f32(y[i]);
        for (int k = 0; k < K && wl; k++)
            if (c->wsum)
                w[k] += wl[k];
            else if (le[k] >= 0 && le[k] / El == l)
                w[k] = wl[k];
        if (ring) {
            fw->fcrx[l]++;
            __atomic_store_n(fr_ht_head(ring), fw->fcrx[l], __ATOMIC_RELEASE);
        }
    }
    return 1;
}

int fr_ht_fwd_combine_sum(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int *left)
{
    ferry_ep_t ep = c->ep;
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    fr_ht_fab_t *f = &st->fab;
    const fr_ht_layout_t *h = c->h;
    fr_ht_fwd_t *fw = &st->fwd;
    int moved = 0, K = h->K, H = h->H;
    /* sources in ascending order, as the destinations write their rows */
    for (int i = 0; i < fw->nfsrc; i++) {
        int s = fw->fsrc[i];
        int n = c->p->fwd_off[s + 1] - c->p->fwd_off[s];
        uint64_t stage = (uint64_t)ep->group_index[s] * h->stage + (uint64_t)h->RT * h->drec;
        while (c->fw_done[s] < n) {
            int j = c->fw_fill[s];
            if (j == 0 && f->c_post[s] - f->c_credit[s] >= (uint64_t)f->W) {
                c->busy_rank = s; /* no room at s yet */
                break;
            }
            uint64_t slot = (f->c_post[s] % (uint64_t)f->W) * FR_HT_CHUNK;
            uint8_t *rec = ep->send + stage + (slot + (uint64_t)j) * h->crec;
            const int16_t *le = c->p->fle + (size_t)(c->p->fwd_off[s] + c->fw_done[s]) * K;
            int rc = fr_ht_fwd_sum_one(c, in, s, le, (float *)rec);
            if (rc < 0)
                return rc;
            if (rc == 0)
                break;
            uint16_t *y = (uint16_t *)(rec + h->chdr);
            for (int x = 0; x < H; x++)
                y[x] = fr_f32_to_bf16(c->fw_acc[x]);
            moved = 1;
            c->fw_done[s]++;
            if (++c->fw_fill[s] < FR_HT_CHUNK && c->fw_done[s] < n)
                continue;
            uint64_t dst = h->off_cring + (uint64_t)ep->rank * h->cring + 2 * FR_HT_LINE +
                           slot * h->crec;
            rc = fr_ht_post(ep, s, stage + slot * h->crec, dst,
                            (uint64_t)c->fw_fill[s] * h->crec,
                            fr_ht_imm(FR_HT_IMM_COMB, ep->rank, f->c_post[s] % (uint64_t)f->W),
                            0);
            if (rc != FERRY_OK)
                return rc;
            f->c_post[s]++;
            c->fw_fill[s] = 0;
        }
        if (c->fw_done[s] < n) {
            *left = 1;
            break; /* the next source's rows come after this one's */
        }
    }
    return moved;
}

void fr_ht_fwd_need(fr_ht_call_t *c, int combine)
{
    ferry_ep_t ep = c->ep;
    fr_ht_fwd_t *fw = &fr_cpu_ht(ep)->fwd;
    int me = ep->rank;
    /* rows of remote sources come through their forwarder here */
    for (int s = 0; s < ep->N; s++) {
        if (ep->node_of[s] == fw->me_node)
            continue;
        int f = fr_ep_fwd_of(ep, s, fw->me_node);
        int n = fr_ht_rows_from(c, s);
        if (combine ? c->done_tx[s] < n : c->done_rx[s] < n) {
            c->need[s] = 1; /* the source itself, not only its forwarder */
            if (f != me)
                c->need[f] = 1;
        }
    }
    /* a forwarder with work left needs its sources and its node */
    for (int i = 0; i < fw->nfsrc; i++) {
        int s = fw->fsrc[i];
        if (c->fw_done[s] < c->p->fwd_off[s + 1] - c->p->fwd_off[s]) {
            c->need[s] = 1;
            for (int x = ep->node_off[fw->me_node]; x < ep->node_off[fw->me_node + 1]; x++)
                c->need[ep->node_ranks[x]] = 1;
        }
    }
    c->need[me] = 0;
}
