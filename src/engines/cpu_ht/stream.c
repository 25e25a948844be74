/*
 * Dispatch and combine through the rings. One progress loop per call:
 * fill every destination's ring as far as its head allows (publishing the
 * tail every chunk), drain the sources' rings into the output (publishing
 * the head), until this rank's rows are all sent and all received.
 *
 * Dispatch drains sources in any order: a row's place is fixed by the
 * route. Combine sums a token's rows in ascending rank order (fp32, one
 * rounding), so it drains destination rings strictly in rank order; this
 * cannot deadlock because every rank keeps filling its own sends while it
 * waits: rank 0's rows are drained first everywhere, then rank 1's, and
 * so on.
 */
#include <stdlib.h>
#include <string.h>

#include "core/quant.h"
#include "engines/cpu_ht/cpu_ht.h"

#define FR_HT_CHUNK 8 /* records between tail publications */


static int fr_ht_call_init(fr_ht_call_t *c, ferry_ep_t ep, ferry_route_t route, int fp8)
{
    memset(c, 0, sizeof(*c));
    c->ep = ep;
    c->route = route;
    c->p = (fr_ht_route_t *)route->priv;
    c->h = &fr_cpu_ht(ep)->H;
    c->fp8 = fp8;
    c->rowb = fp8 ? (size_t)c->h->H : 2 * (size_t)c->h->H;
    c->nsc = fp8 ? (size_t)(c->h->H / 128) : 0;
    c->done_tx = calloc((size_t)ep->N, sizeof(int32_t));
    c->done_rx = calloc((size_t)ep->N, sizeof(int32_t));
    c->need = calloc((size_t)ep->N, 1);
    c->busy_rank = ep->rank;
    if (!c->done_tx || !c->done_rx || !c->need || fr_ht_fwd_call_init(c) != FERRY_OK) {
        free(c->done_tx);
        free(c->done_rx);
        free(c->need);
        fr_ht_fwd_call_end(c);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "call state");
    }
    return FERRY_OK;
}

static void fr_ht_call_end(fr_ht_call_t *c)
{
    free(c->done_tx);
    free(c->done_rx);
    free(c->need);
    fr_ht_fwd_call_end(c);
}

/* Which peers this rank still needs: rows to send there (tx: per-peer
 * totals in tx_off) or rows to take from there (rx_off). */
static void fr_ht_need(fr_ht_call_t *c, const int32_t *tx_off, const int32_t *rx_off)
{
    for (int r = 0; r < c->ep->N; r++)
        c->need[r] = c->done_tx[r] < tx_off[r + 1] - tx_off[r] ||
                     c->done_rx[r] < rx_off[r + 1] - rx_off[r];
    c->need[c->ep->rank] = 0;
}

/* With forwarding: a remote node's ranks are reached through its
 * forwarder, so only this node's ranks and the forwarders count. */
static void fr_ht_need_all(fr_ht_call_t *c, int combine)
{
    ferry_ep_t ep = c->ep;
    if (!ep->forward) {
        if (combine)
            fr_ht_need(c, c->p->src_off, c->p->dst_off);
        else
            fr_ht_need(c, c->p->dst_off, c->p->src_off);
        return;
    }
    const fr_ht_route_t *p = c->p;
    int me = ep->rank, mn = ep->node_of[me];
    memset(c->need, 0, (size_t)ep->N);
    for (int r = 0; r < ep->N; r++) {
        if (ep->node_of[r] != mn)
            continue;
        int ntx = combine ? p->src_off[r + 1] - p->src_off[r] : p->dst_off[r + 1] - p->dst_off[r];
        int nrx = combine ? p->dst_off[r + 1] - p->dst_off[r] : p->src_off[r + 1] - p->src_off[r];
        c->need[r] = c->done_tx[r] < ntx || c->done_rx[r] < nrx;
    }
    for (int b = 0; b < ep->nnodes; b++) {
        if (b == mn)
            continue;
        int f = fr_ep_fwd_of(ep, me, b), n = p->nd_off[b + 1] - p->nd_off[b];
        if (combine ? c->done_rx[f] < n : c->done_tx[f] < n) {
            c->need[f] = 1; /* and the node's ranks it waits for */
            for (int x = ep->node_off[b]; x < ep->node_off[b + 1]; x++) {
                int d = ep->node_ranks[x];
                if (p->dst_off[d + 1] > p->dst_off[d])
                    c->need[d] = 1;
            }
        }
    }
    fr_ht_fwd_need(c, combine);
}

/* ---------------------------------------------------------------- dispatch */

/* A dispatch record's header for token t going to rank d. */
static void fr_ht_dhdr_fill(const fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in,
                            int t, int d, int node, uint8_t *rec)
{
    int K = c->h->K, El = c->h->El;
    const int *node_of = c->ep->node_of, *lidx = c->ep->node_lidx;
    const int32_t *row = c->p->idx + (size_t)t * K;
    fr_ht_dhdr_t *hd = (fr_ht_dhdr_t *)rec;
    int16_t *le = (int16_t *)(rec + sizeof(*hd));
    float *w = (float *)(rec + fr_ht_woff(K));
    hd->token = t;
    hd->flags = fr_ht_flags(c->fp8, c->route->id);
    for (int k = 0; k < K; k++) {
        if (node >= 0) { /* node-level: local index x El + local expert */
            int on = row[k] >= 0 && node_of[row[k] / El] == node;
            le[k] = (int16_t)(on ? lidx[row[k] / El] * El + row[k] % El : -1);
            w[k] = on && in->topk_weights ? in->topk_weights[(size_t)t * K + k] : 0.f;
            continue;
        }
        int local = row[k] >= 0 && row[k] / El == d;
        le[k] = (int16_t)(local ? row[k] % El : -1);
        w[k] = local && in->topk_weights ? in->topk_weights[(size_t)t * K + k] : 0.f;
    }
}

/* Token t's nsc scales from the caller's x_scales (its strides) to dst,
 * which may be unaligned (a record's). */
static void fr_ht_scales_of(const fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int t,
                            void *dst)
{
    const float *p = in->x_scales + (size_t)t * (size_t)in->x_scales_stride[0];
    size_t s1 = (size_t)in->x_scales_stride[1];
    if (s1 == 1) {
        memcpy(dst, p, c->nsc * sizeof(float));
        return;
    }
    for (size_t q = 0; q < c->nsc; q++)
        memcpy((uint8_t *)dst + q * sizeof(float), p + q * s1, sizeof(float));
}

/* Row `row` of the outputs from a record's token, local expert ids and
 * weights (this rank's own header, or the checked copy of a received one),
 * its data and scales: a received record's (row-major), else, with in,
 * token `token`'s own (the caller's strides). */
void fr_ht_put_row(const fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int src,
                   int64_t row, int32_t token, const int16_t *le, const float *w,
                   const uint8_t *data, const float *scales, const ferry_ht_dispatch_in_t *in)
{
    int K = c->h->K;
    memcpy((uint8_t *)out->recv_x + row * c->rowb, data, c->rowb);
    if (c->nsc && in)
        fr_ht_scales_of(c, in, token, out->recv_x_scales + row * c->nsc);
    else if (c->nsc)
        memcpy(out->recv_x_scales + row * c->nsc, scales, c->nsc * sizeof(float));
    for (int k = 0; k < K; k++) {
        if (out->recv_topk_idx)
            out->recv_topk_idx[row * K + k] = le[k];
        else if (out->recv_topk_idx_i64)
            out->recv_topk_idx_i64[row * K + k] = le[k];
        if (out->recv_topk_weights)
            out->recv_topk_weights[row * K + k] = w[k];
    }
    if (out->recv_src_rank)
        out->recv_src_rank[row] = src;
    if (out->recv_src_token)
        out->recv_src_token[row] = token;
}

/* A whole dispatch record for token t going to rank d: header, row, scales
 * (shared-memory ring slot or fabric staging). */
void fr_ht_drec_fill(const fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int t, int d,
                     int node, uint8_t *rec)
{
    fr_ht_dhdr_fill(c, in, t, d, node, rec);
    memcpy(rec + c->h->dhdr, (const uint8_t *)in->x + (size_t)t * c->rowb, c->rowb);
    if (c->nsc)
        fr_ht_scales_of(c, in, t, rec + c->h->dhdr + c->rowb);
}

/* A record from rank s into output row `row`, checked first; FERRY_OK,
 * else the error is set. The slot stays writable by s: its header is used
 * as checked (fr_ht_dhdr_check's copy), the row is copied once. */
int fr_ht_drec_take(const fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s,
                    int64_t row, const uint8_t *rec)
{
    fr_ht_dhdr_copy_t hd;
    fr_err_t err;
    int rc = fr_ht_dhdr_check(rec, c->h->K, c->ep->L.T, c->h->El, c->fp8, c->route->id, s,
                              &hd, &err);
    if (rc != FERRY_OK)
        return fr_ep_fail(c->ep, rc, "ht_dispatch: %s", err.msg);
    fr_ht_put_row(c, out, s, row, hd.token, hd.le, hd.w, rec + c->h->dhdr,
                  (const float *)(rec + c->h->dhdr + c->rowb), NULL);
    return FERRY_OK;
}

/* A combine record: the slot floats of received row `row`, then its y. */
void fr_ht_crec_fill(const fr_ht_call_t *c, const ferry_ht_combine_in_t *in, size_t row,
                     uint8_t *rec)
{
    int K = c->h->K;
    float *w = (float *)rec;
    for (int k = 0; k < K; k++)
        w[k] = in->topk_weights ? in->topk_weights[row * K + k] : 0.f;
    memcpy(rec + c->h->chdr, (const uint8_t *)in->y + row * 2 * c->h->H, 2 * (size_t)c->h->H);
}

/* A ring counter written by the peer: its tail (records it wrote, this
 * rank took `mine`) or its head (records it took, this rank wrote `mine`).
 * A correct peer's counter is never behind what this rank took nor ahead
 * of what it wrote, and at most a ring apart from it; one moved backwards
 * or far forward is a protocol error naming the peer, never a read of
 * slots the peer did not write or a wait until the deadline. */
int fr_ht_ring_check(const fr_ht_call_t *c, const char *what, int peer, int tail, uint64_t v,
                     uint64_t mine)
{
    if ((tail ? v - mine : mine - v) <= (uint64_t)c->h->RT)
        return FERRY_OK;
    return fr_ep_fail(c->ep, FERRY_ERR_PROTOCOL,
                      "%s: rank %d moved the %s of its ring with this rank to %llu (this rank "
                      "%s %llu records, ring of %d)", what, peer, tail ? "tail" : "head",
                      (unsigned long long)v, tail ? "took" : "wrote", (unsigned long long)mine,
                      c->h->RT);
}

/* This rank's own tokens: straight into its rows. */
static void fr_ht_dispatch_self(fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in,
                                const ferry_ht_dispatch_out_t *out)
{
    int me = c->ep->rank;
    uint8_t hdr[512] __attribute__((aligned(16)));
    const fr_ht_route_t *p = c->p;
    for (int i = 0; i < p->dst_off[me + 1] - p->dst_off[me]; i++) {
        int t = p->dst_tok[p->dst_off[me] + i];
        fr_ht_dhdr_fill(c, in, t, me, -1, hdr);
        fr_ht_put_row(c, out, me, p->src_off[me] + i, t,
                      (const int16_t *)(hdr + sizeof(fr_ht_dhdr_t)),
                      (const float *)(hdr + fr_ht_woff(c->h->K)),
                      (const uint8_t *)in->x + (size_t)t * c->rowb,
                      NULL, c->nsc ? in : NULL);
    }
}

/* Fill destination d's ring as far as it has room; 1 if anything moved. */
static int fr_ht_dispatch_tx(fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int d)
{
    fr_cpu_ht_t *st = fr_cpu_ht(c->ep);
    const fr_ht_layout_t *h = c->h;
    const fr_ht_route_t *p = c->p;
    int n = p->dst_off[d + 1] - p->dst_off[d], moved = 0;
    uint8_t *ring = fr_ht_dring(h, c->ep->peer_seg[d], c->ep->rank);
    uint64_t head = __atomic_load_n(fr_ht_head(ring), __ATOMIC_ACQUIRE);
    if (fr_ht_ring_check(c, "ht_dispatch", d, 0, head, st->dtx[d]) != FERRY_OK)
        return FERRY_ERR_PROTOCOL;
    while (c->done_tx[d] < n && st->dtx[d] - head < (uint64_t)h->RT) {
        int t = p->dst_tok[p->dst_off[d] + c->done_tx[d]];
        fr_ht_drec_fill(c, in, t, d, -1, fr_ht_slot(ring, st->dtx[d], h->RT, h->drec));
        st->dtx[d]++;
        c->done_tx[d]++;
        if (++moved % FR_HT_CHUNK == 0)
            __atomic_store_n(fr_ht_tail(ring), st->dtx[d], __ATOMIC_RELEASE);
    }
    if (moved)
        __atomic_store_n(fr_ht_tail(ring), st->dtx[d], __ATOMIC_RELEASE);
    return moved > 0;
}

/* Drain source s's ring into its rows; 1 if anything moved. */
static int fr_ht_dispatch_rx(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s)
{
    fr_cpu_ht_t *st = fr_cpu_ht(c->ep);
    const fr_ht_layout_t *h = c->h;
    int n = c->p->src_off[s + 1] - c->p->src_off[s], moved = 0;
    uint8_t *ring = fr_ht_dring(h, c->ep->seg, s);
    uint64_t tail = __atomic_load_n(fr_ht_tail(ring), __ATOMIC_ACQUIRE);
    /* the ring's writer: s, or its forwarder on this node */
    int wr = c->ep->forward && c->ep->path[s] == FR_PATH_FABRIC
                 ? fr_ep_fwd_of(c->ep, s, c->ep->node_of[c->ep->rank])
                 : s;
    if (fr_ht_ring_check(c, "ht_dispatch", wr, 1, tail, st->drx[s]) != FERRY_OK)
        return -1;
    while (c->done_rx[s] < n && st->drx[s] < tail) {
        if (fr_ht_drec_take(c, out, s, c->p->src_off[s] + c->done_rx[s],
                            fr_ht_slot(ring, st->drx[s], h->RT, h->drec)) != FERRY_OK)
            return -1;
        st->drx[s]++;
        c->done_rx[s]++;
        if (++moved % FR_HT_CHUNK == 0)
            __atomic_store_n(fr_ht_head(ring), st->drx[s], __ATOMIC_RELEASE);
    }
    if (moved)
        __atomic_store_n(fr_ht_head(ring), st->drx[s], __ATOMIC_RELEASE);
    return moved;
}

/* A bounded route's rows past the real count: padding (recv_topk_idx -1,
 * weights 0, source rank and token -1; recv_x not written). */
static void fr_ht_pad_rows(ferry_route_t route, const ferry_ht_dispatch_out_t *out, int K)
{
    for (int row = route->num_recv; row < route->bound; row++) {
        for (int k = 0; k < K; k++) {
            if (out->recv_topk_idx)
                out->recv_topk_idx[(size_t)row * K + k] = -1;
            else if (out->recv_topk_idx_i64)
                out->recv_topk_idx_i64[(size_t)row * K + k] = -1;
            if (out->recv_topk_weights)
                out->recv_topk_weights[(size_t)row * K + k] = 0.f;
        }
        if (out->recv_src_rank)
            out->recv_src_rank[row] = -1;
        if (out->recv_src_token)
            out->recv_src_token[row] = -1;
    }
}

/* One pass of a dispatch: fill the destinations' rings (a remote node's
 * through its forwarder when forwarding), drain the sources' (a remote
 * source's from the ring its forwarder fills), pass on what this rank
 * forwards. 1 if anything moved; *left when work remains. */
static int fr_ht_dispatch_pass(fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in,
                               const ferry_ht_dispatch_out_t *out, int *left, int *rc)
{
    ferry_ep_t ep = c->ep;
    const fr_ht_route_t *p = c->p;
    int N = ep->N, me = ep->rank, moved = 0, fwd = ep->forward;
    int mn = ep->node_of[me];
    for (int i = 1; i < N && *rc == FERRY_OK; i++) { /* rotated: not all at rank 0 */
        int d = (me + i) % N, m, n;
        if (fwd && ep->node_of[d] != mn) {
            /* one stream per remote node, to its forwarder, from the
             * node's first rank in this rotation */
            int b = ep->node_of[d];
            if (fr_ep_fwd_of(ep, me, b) != d)
                continue;
            m = fr_ht_fab_dispatch_tx(c, in, d, b);
            n = p->nd_off[b + 1] - p->nd_off[b];
        } else {
            m = ep->path[d] == FR_PATH_FABRIC ? fr_ht_fab_dispatch_tx(c, in, d, -1)
                                              : fr_ht_dispatch_tx(c, in, d);
            n = p->dst_off[d + 1] - p->dst_off[d];
        }
        if (m < 0)
            *rc = fr_ht_fatal(ep, m);
        moved |= m > 0;
        if (c->done_tx[d] < n) {
            *left = 1;
            c->busy_rank = d;
        }
    }
    if (fwd && *rc == FERRY_OK) {
        int m = fr_ht_fwd_dispatch(c, out, left);
        if (m < 0)
            *rc = fr_ht_fatal(ep, m);
        moved |= m > 0;
    }
    for (int i = 1; i < N && *rc == FERRY_OK; i++) {
        int s = (me + N - i) % N, m;
        int remote = ep->path[s] == FR_PATH_FABRIC;
        if (fwd && ep->node_of[s] != mn) /* through the forwarder's ring */
            m = fr_ep_fwd_of(ep, s, mn) == me ? 0 : fr_ht_dispatch_rx(c, out, s);
        else
            m = remote ? fr_ht_fab_dispatch_rx(c, out, s) : fr_ht_dispatch_rx(c, out, s);
        if (m < 0 || ep->failed)
            *rc = fr_ht_fatal(ep, FERRY_ERR_PROTOCOL);
        moved |= m > 0;
        if (c->done_rx[s] < p->src_off[s + 1] - p->src_off[s]) {
            *left = 1;
            c->busy_rank = s;
        }
    }
    return moved;
}

int fr_ht_dispatch(ferry_ep_t ep, ferry_route_t route, const ferry_ht_dispatch_in_t *in,
                   const ferry_ht_dispatch_out_t *out)
{
    fr_ht_call_t c;
    int rc = fr_ht_call_init(&c, ep, route, in->x_scales != NULL);
    if (rc != FERRY_OK)
        return rc;
    fr_ht_dispatch_self(&c, in, out);
    uint64_t iter = 0, check = fr_now_ns(), progress = check;
    for (;;) {
        int left = 0;
        if (ep->nfabric && (rc = fr_ht_fab_poll(ep)) != FERRY_OK)
            break;
        int moved = fr_ht_dispatch_pass(&c, in, out, &left, &rc);
        if (rc != FERRY_OK || !left)
            break;
        if (moved) {
            iter = 0;
            progress = fr_now_ns();
            continue;
        }
        fr_ht_need_all(&c, 0);
        rc = fr_ht_idle(ep, &iter, &check, progress, c.busy_rank, "ht_dispatch", c.need);
        if (rc != FERRY_OK)
            break;
    }
    if (rc == FERRY_OK && ep->nfabric)
        rc = fr_ht_fab_drain(ep);
    if (rc == FERRY_OK) {
        fr_ht_pad_rows(route, out, ep->L.K);
        c.p->dispatched = 1; /* the forwarder's expert ids are kept */
    }
    fr_ht_call_end(&c);
    return rc;
}

/* ---------------------------------------------------------------- combine */

/* Fill source s's combine ring with the rows it sent here. */
static int fr_ht_combine_tx(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int s)
{
    fr_cpu_ht_t *st = fr_cpu_ht(c->ep);
    const fr_ht_layout_t *h = c->h;
    int n = c->p->src_off[s + 1] - c->p->src_off[s], moved = 0;
    uint8_t *ring = fr_ht_cring(h, c->ep->peer_seg[s], c->ep->rank);
    uint64_t head = __atomic_load_n(fr_ht_head(ring), __ATOMIC_ACQUIRE);
    if (fr_ht_ring_check(c, "ht_combine", s, 0, head, st->ctx[s]) != FERRY_OK)
        return FERRY_ERR_PROTOCOL;
    while (c->done_tx[s] < n && st->ctx[s] - head < (uint64_t)h->RT) {
        fr_ht_crec_fill(c, in, (size_t)c->p->src_off[s] + (size_t)c->done_tx[s],
                        fr_ht_slot(ring, st->ctx[s], h->RT, h->crec));
        st->ctx[s]++;
        c->done_tx[s]++;
        if (++moved % FR_HT_CHUNK == 0)
            __atomic_store_n(fr_ht_tail(ring), st->ctx[s], __ATOMIC_RELEASE);
    }
    if (moved)
        __atomic_store_n(fr_ht_tail(ring), st->ctx[s], __ATOMIC_RELEASE);
    return moved > 0;
}

/* Add one row from rank d for token t; slot k's weight from d's experts,
 * or every slot's added (c->wsum; out->topk_weights starts at 0). */
/* Is expert e (>= 0) on rank d, or with node >= 0 on node `node`? */
static inline int fr_ht_slot_of(const fr_ht_call_t *c, int32_t e, int d, int node)
{
    int El = c->h->El;
    return e >= 0 && (node >= 0 ? c->ep->node_of[e / El] == node : e / El == d);
}

void fr_ht_accumulate(fr_ht_call_t *c, const ferry_ht_combine_out_t *out, float *acc,
                      int t, int d, int node, const uint16_t *y, const float *w)
{
    int K = c->h->K, H = c->h->H;
    const int32_t *slots = c->p->idx + (size_t)t * K;
    int hs = -1; /* FERRY_HT_SUM_SLOTS: the highest slot d (node) holds */
    if (c->stash)
        for (int k = 0; k < K; k++)
            if (fr_ht_slot_of(c, slots[k], d, node))
                hs = k;
    if (hs >= 0) { /* kept until the token's every row is in */
        memcpy(c->stash + ((size_t)t * K + (size_t)hs) * H, y, sizeof(uint16_t) * H);
        c->stash_on[(size_t)t * K + (size_t)hs] = 1;
    } else {
        float *a = acc + (size_t)t * H;
        for (int i = 0; i < H; i++)
            a[i] += fr_bf16_to_f32(y[i]);
    }
    if (!out->topk_weights)
        return;
    if (c->wsum) {
        for (int k = 0; k < K; k++)
            out->topk_weights[(size_t)t * K + k] += w ? w[k] : 0.f;
        return;
    }
    for (int k = 0; k < K; k++)
        if (fr_ht_slot_of(c, slots[k], d, node))
            out->topk_weights[(size_t)t * K + k] = w ? w[k] : 0.f;
}

/* Drain destination d's combine ring (rows for this rank's tokens). */
static int fr_ht_combine_rx(fr_ht_call_t *c, const ferry_ht_combine_out_t *out, float *acc,
                            int d)
{
    fr_cpu_ht_t *st = fr_cpu_ht(c->ep);
    const fr_ht_layout_t *h = c->h;
    const fr_ht_route_t *p = c->p;
    int n = p->dst_off[d + 1] - p->dst_off[d], moved = 0;
    uint8_t *ring = fr_ht_cring(h, c->ep->seg, d);
    uint64_t tail = __atomic_load_n(fr_ht_tail(ring), __ATOMIC_ACQUIRE);
    if (fr_ht_ring_check(c, "ht_combine", d, 1, tail, st->crx[d]) != FERRY_OK)
        return FERRY_ERR_PROTOCOL;
    while (c->done_rx[d] < n && st->crx[d] < tail) {
        const uint8_t *rec = fr_ht_slot(ring, st->crx[d], h->RT, h->crec);
        int t = p->dst_tok[p->dst_off[d] + c->done_rx[d]];
        fr_ht_accumulate(c, out, acc, t, d, -1, (const uint16_t *)(rec + h->chdr),
                         (const float *)rec);
        st->crx[d]++;
        c->done_rx[d]++;
        if (++moved % FR_HT_CHUNK == 0)
            __atomic_store_n(fr_ht_head(ring), st->crx[d], __ATOMIC_RELEASE);
    }
    if (moved)
        __atomic_store_n(fr_ht_head(ring), st->crx[d], __ATOMIC_RELEASE);
    return moved > 0;
}

/* The combine's output from the accumulator (and the stash): one rounding
 * to bf16 of each channel's fp32 sum.
 *   FERRY_HT_SUM_SLOTS: the biases, then the rows by slot (none where a
 *     slot is not a rank's highest: adding its zeros would change nothing,
 *     the sum starting at +0), then acc (anything summed without a slot:
 *     nothing, the route being whole); a token at a time, each step over
 *     the row in srow;
 *   else: acc (the rows in rank order), then the biases. */
static void fr_ht_combine_out(fr_ht_call_t *c, const ferry_ht_combine_in_t *in,
                              const ferry_ht_combine_out_t *out, const float *acc, int T)
{
    size_t H = (size_t)c->h->H, K = (size_t)c->h->K;
    const uint16_t *b0 = in->bias[0], *b1 = in->bias[1];
    uint16_t *o = (uint16_t *)out->out;
    if (!c->stash) {
        for (size_t i = 0; i < (size_t)T * H; i++) {
            float a = acc[i];
            if (b0)
                a += fr_bf16_to_f32(b0[i]);
            if (b1)
                a += fr_bf16_to_f32(b1[i]);
            o[i] = fr_f32_to_bf16(a);
        }
        return;
    }
    for (size_t t = 0; t < (size_t)T; t++) {
        for (size_t i = 0; i < H; i++) {
            float a = 0.f;
            if (b0)
                a += fr_bf16_to_f32(b0[t * H + i]);
            if (b1)
                a += fr_bf16_to_f32(b1[t * H + i]);
            c->srow[i] = a;
        }
        for (size_t k = 0; k < K; k++) {
            if (!c->stash_on[t * K + k])
                continue;
            const uint16_t *r = c->stash + (t * K + k) * H;
            for (size_t i = 0; i < H; i++)
                c->srow[i] += fr_bf16_to_f32(r[i]);
        }
        for (size_t i = 0; i < H; i++)
            o[t * H + i] = fr_f32_to_bf16(c->srow[i] + acc[t * H + i]);
    }
}

/* Combine: send this rank's rows back (a remote source's through its
 * forwarder when forwarding), and as a forwarder the sums. 1 if anything
 * moved; *left when work remains. */
static int fr_ht_combine_send(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int *left,
                              int *rc)
{
    ferry_ep_t ep = c->ep;
    int N = ep->N, me = ep->rank, moved = 0, mn = ep->node_of[me];
    for (int i = 1; i < N && *rc == FERRY_OK; i++) {
        int s = (me + i) % N;
        if (ep->forward && ep->node_of[s] != mn)
            continue; /* fr_ht_fwd_combine_tx */
        int m = ep->path[s] == FR_PATH_FABRIC ? fr_ht_fab_combine_tx(c, in, s)
                                              : fr_ht_combine_tx(c, in, s);
        if (m < 0)
            *rc = fr_ht_fatal(ep, m);
        moved |= m > 0;
        if (c->done_tx[s] < c->p->src_off[s + 1] - c->p->src_off[s]) {
            *left = 1;
            c->busy_rank = s;
        }
    }
    if (ep->forward && *rc == FERRY_OK) {
        int m = fr_ht_fwd_combine_tx(c, in, left);
        if (m >= 0) {
            moved |= m > 0;
            m = fr_ht_fwd_combine_sum(c, in, left);
        }
        if (m < 0)
            *rc = fr_ht_fatal(ep, m);
        moved |= m > 0;
    }
    return moved;
}

int fr_ht_combine(ferry_ep_t ep, ferry_route_t route, const ferry_ht_combine_in_t *in,
                  const ferry_ht_combine_out_t *out)
{
    fr_ht_call_t c;
    fr_ht_route_t *rp = (fr_ht_route_t *)route->priv;
    if (ep->forward && !rp->dispatched) /* alike on every rank: calls are collective */
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "ht_combine: route %llu has had no ht_dispatch; with forwarding "
                          "between nodes a combine follows a dispatch on its route (the "
                          "forwarders keep what the dispatch routed)",
                          (unsigned long long)route->id);
    int rc = fr_ht_call_init(&c, ep, route, 0);
    if (rc != FERRY_OK)
        return rc;
    c.wsum = in->weights_sum != 0;
    int N = ep->N, me = ep->rank, K = c.h->K, H = c.h->H, T = route->T;
    float *acc = fr_ht_acc(ep, T, out, &c.srow);
    if (!acc) {
        fr_ht_call_end(&c);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "combine accumulator of %d x %d floats", T, H);
    }
    if (in->sum_order == FERRY_HT_SUM_SLOTS && !(c.stash = fr_ht_stash(ep, T, &c.stash_on))) {
        fr_ht_call_end(&c);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM,
                          "combine (sum_order FERRY_HT_SUM_SLOTS): %d x %d x %d bf16 rows", T,
                          K, H);
    }
    /* who to sum, in order: every rank, or with forwarding this node's
     * ranks and every other node's summed row (fr_ht_fwd_t.ctb) */
    const fr_ht_fwd_t *fw = &fr_cpu_ht(ep)->fwd;
    int nct = ep->forward ? fw->nctb : N;
    uint64_t iter = 0, check = fr_now_ns(), progress = check;
    int cur = 0; /* the contributor being drained */
    while (rc == FERRY_OK) {
        int left = 0;
        if (ep->nfabric && (rc = fr_ht_fab_poll(ep)) != FERRY_OK)
            break;
        int moved = fr_ht_combine_send(&c, in, &left, &rc);
        int d = me;
        while (cur < nct && rc == FERRY_OK) {
            int x = ep->forward ? fw->ctb[cur] : cur, node = x < 0 ? -x - 1 : -1;
            d = node >= 0 ? fr_ep_fwd_of(ep, me, node) : x;
            int n = node >= 0 ? c.p->nd_off[node + 1] - c.p->nd_off[node]
                              : c.p->dst_off[d + 1] - c.p->dst_off[d];
            if (d == me) { /* own rows, read in place */
                for (int i = 0; i < n; i++) {
                    size_t row = (size_t)c.p->src_off[me] + (size_t)i;
                    fr_ht_accumulate(&c, out, acc, c.p->dst_tok[c.p->dst_off[me] + i], me, -1,
                                     (const uint16_t *)in->y + row * H,
                                     in->topk_weights ? in->topk_weights + row * K : NULL);
                }
                c.done_rx[me] = n;
            } else {
                int m = ep->path[d] == FR_PATH_FABRIC
                            ? fr_ht_fab_combine_rx(&c, out, acc, d, node)
                            : fr_ht_combine_rx(&c, out, acc, d);
                if (m < 0) {
                    rc = fr_ht_fatal(ep, m);
                    break;
                }
                moved |= m > 0;
            }
            if (c.done_rx[d] < n)
                break;
            cur++;
        }
        if (rc != FERRY_OK)
            break;
        if (cur < nct || left) {
            if (moved) {
                iter = 0;
                progress = fr_now_ns();
                continue;
            }
            fr_ht_need_all(&c, 1);
            rc = fr_ht_idle(ep, &iter, &check, progress, cur < nct ? d : c.busy_rank,
                            "ht_combine", c.need);
            continue;
        }
        break;
    }
    if (rc == FERRY_OK && ep->nfabric)
        rc = fr_ht_fab_drain(ep);
    if (rc == FERRY_OK)
        fr_ht_combine_out(&c, in, out, acc, T);
    fr_ht_call_end(&c);
    return rc;
}
