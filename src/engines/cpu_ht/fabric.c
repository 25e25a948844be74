/*
 * The high-throughput engine's fabric path (peers on other hosts, or
 * every peer under FERRY_TRANSPORT=fabric): the rank thread posts writes
 * through the EP's NICs and polls their completions itself (no proxy
 * thread in this mode). Protocol in cpu_ht.h ("Peers on the fabric path").
 */
#include <stdlib.h>
#include <string.h>

#include "engines/cpu_ht/cpu_ht.h"

uint32_t fr_ht_imm(int kind, int src, uint64_t val)
{
    return ((uint32_t)kind << 29) | ((uint32_t)src << 16) | (uint32_t)(val & 0xffffu);
}

/* A cumulative counter advanced to the 16-bit value seen (credits may
 * arrive out of order: only forward moves count). */
static void fr_ht_advance(uint64_t *ctr, uint32_t v16)
{
    uint32_t delta = (v16 - (uint32_t)(*ctr & 0xffffu)) & 0xffffu;
    if (delta != 0 && delta < 0x8000u)
        *ctr += delta;
}

int fr_ht_fab_init(ferry_ep_t ep)
{
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    fr_ht_fab_t *f = &st->fab;
    size_t N = (size_t)ep->N;
    f->W = st->H.RT / FR_HT_CHUNK;
    f->gmem = malloc(N * sizeof(int));
    uint64_t **ctr[] = {&f->d_post, &f->d_credit, &f->d_take, &f->c_post, &f->c_credit,
                        &f->c_take};
    for (size_t i = 0; i < sizeof(ctr) / sizeof(ctr[0]); i++)
        *ctr[i] = calloc(N, sizeof(uint64_t));
    f->d_landed = calloc(N * (size_t)f->W, 1);
    f->c_landed = calloc(N * (size_t)f->W, 1);
    f->notify_seen = calloc(2 * N, sizeof(uint32_t));
    f->pending_to = calloc(N, sizeof(int32_t));
    if (!f->gmem || !f->d_post || !f->d_credit || !f->d_take || !f->c_post ||
        !f->c_credit || !f->c_take || !f->d_landed || !f->c_landed || !f->notify_seen ||
        !f->pending_to)
        return FERRY_ERR_NOMEM;
    for (size_t i = 0; i < N; i++)
        f->gmem[i] = -1;
    return FERRY_OK;
}

void fr_ht_fab_free(ferry_ep_t ep)
{
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    free(f->gmem);
    free(f->d_post);
    free(f->d_credit);
    free(f->d_take);
    free(f->c_post);
    free(f->c_credit);
    free(f->c_take);
    free(f->d_landed);
    free(f->c_landed);
    free(f->notify_seen);
    free(f->pending_to);
    memset(f, 0, sizeof(*f));
}

/* Peer d's member index in the group of its NIC (found once). */
static int fr_ht_member(ferry_ep_t ep, int d)
{
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    if (f->gmem[d] >= 0)
        return f->gmem[d];
    int k = ep->nics.nic_of[d], fi = ep->group_index[d];
    for (int i = 0; i < ep->groups.n[k]; i++)
        if (ep->groups.idx[k][i] == fi)
            return f->gmem[d] = i;
    return -1;
}

/* A completion's ctx: the peer, and FR_HT_CTX_CREDIT for a credit (a
 * write the call does not wait for). */
#define FR_HT_CTX_CREDIT (1ull << 32)

/* One write from the send region to peer d's segment, with immediate.
 * credit: a credit, which the peer needs only in a later call; the call
 * does not wait for its completion (fr_ht_fab_drain). */
int fr_ht_post(ferry_ep_t ep, int d, uint64_t src_off, uint64_t dst_off, uint64_t len,
               uint32_t imm, int credit)
{
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    int k = ep->nics.nic_of[d], i = fr_ht_member(ep, d);
    if (i < 0)
        return fr_ep_fail(ep, FERRY_ERR_INTERNAL, "ht: rank %d is in no NIC group", d);
    fr_slice_t sl = {.src_off = src_off, .dst_off = dst_off, .len = len, .imm = imm};
    fr_err_t err;
    uint64_t ctx = (uint64_t)d | (credit ? FR_HT_CTX_CREDIT : 0);
    uint64_t t0 = fr_now_ns(); /* the EP's counters (ep/stats.h) */
    int rc = ep->nics.ops->write_imm(ep->nics.tp[k], ep->groups.g[k], i, &sl, ctx, &err);
    fr_stat_add(&ep->st.post_ns, fr_now_ns() - t0);
    fr_stat_add(&ep->st.requests, 1);
    if (rc != FERRY_OK) /* shared state is ahead of the peer now: fatal */
        return fr_ep_fail(ep, FERRY_ERR_FABRIC, "ht: write to rank %d: %s (%s)", d, err.msg,
                          ferry_strerror(rc));
    fr_stat_add(&ep->st.writes, 1);
    fr_stat_add(&ep->st.bytes, len);
    if (credit) {
        f->credits_out++;
    } else {
        f->pending++;
        f->pending_to[d]++;
    }
    return FERRY_OK;
}

/* What an immediate says: a chunk landed, credits came back, counts
 * landed. */
static int fr_ht_on_imm(ferry_ep_t ep, uint32_t imm)
{
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    int kind = (int)(imm >> 29), s = (int)((imm >> 16) & 0x1fffu);
    uint32_t v = imm & 0xffffu;
    if (s >= ep->N || ep->path[s] != FR_PATH_FABRIC)
        return fr_ep_fail(ep, FERRY_ERR_PROTOCOL, "ht: immediate 0x%08x names rank %d", imm, s);
    size_t w = (size_t)s * f->W;
    if (ep->forward && kind != FR_HT_IMM_NOTIFY) {
        /* forwarding: records and their credits flow between a rank and
         * its forwarders only; sums and theirs back the other way */
        int me = ep->rank, mn = ep->node_of[me];
        int i_fwd_s = fr_ep_fwd_of(ep, s, mn) == me;            /* s sends through me */
        int s_fwd_me = fr_ep_fwd_of(ep, me, ep->node_of[s]) == s; /* I send through s */
        int ok = kind == FR_HT_IMM_DATA || kind == FR_HT_IMM_CCREDIT ? i_fwd_s : s_fwd_me;
        if (!ok)
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "ht: immediate 0x%08x from rank %d, which %s", imm, s,
                              kind == FR_HT_IMM_DATA || kind == FR_HT_IMM_CCREDIT
                                  ? "does not forward through this rank"
                                  : "does not forward for this rank");
    }
    switch (kind) {
    case FR_HT_IMM_NOTIFY: f->notify_seen[(size_t)(v & 1) * ep->N + s] = v + 1; break;
    case FR_HT_IMM_DATA: /* v: the chunk's slot in the ring */
    case FR_HT_IMM_COMB:
        if (v >= (uint32_t)f->W)
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL, "ht: chunk slot %u from rank %d (ring of %d)",
                              v, s, f->W);
        (kind == FR_HT_IMM_DATA ? f->d_landed : f->c_landed)[w + v] = 1;
        break;
    case FR_HT_IMM_DCREDIT: /* never for chunks this rank did not post */
    case FR_HT_IMM_CCREDIT: {
        uint64_t *credit = kind == FR_HT_IMM_DCREDIT ? &f->d_credit[s] : &f->c_credit[s];
        uint64_t posted = kind == FR_HT_IMM_DCREDIT ? f->d_post[s] : f->c_post[s];
        fr_ht_advance(credit, v);
        if (*credit > posted)
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "ht: rank %d returned credits for %llu chunks, %llu were sent",
                              s, (unsigned long long)*credit, (unsigned long long)posted);
        break;
    }
    default:
        return fr_ep_fail(ep, FERRY_ERR_PROTOCOL, "ht: immediate 0x%08x from rank %d", imm, s);
    }
    return FERRY_OK;
}

/* Hand out one poll's completions. */
static int fr_ht_fab_cqes(ferry_ep_t ep, const fr_cqe_t *cqe, int n)
{
    for (int i = 0; i < n; i++) {
        int rc = FERRY_OK;
        fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
        uint64_t to = cqe[i].ctx & ~FR_HT_CTX_CREDIT; /* the peer written to */
        if (cqe[i].kind == FR_CQE_TX || cqe[i].kind == FR_CQE_ERR) {
            if (cqe[i].ctx & FR_HT_CTX_CREDIT) {
                f->credits_out--;
            } else {
                f->pending--;
                if (to < (uint64_t)ep->N)
                    f->pending_to[to]--;
            }
        }
        if (cqe[i].kind == FR_CQE_RX) {
            rc = fr_ht_on_imm(ep, cqe[i].imm);
        } else if (cqe[i].kind != FR_CQE_TX) {
            char msg[FR_ERRMSG_LEN];
            int who;
            int st = fr_cqe_failure(&cqe[i], to < (uint64_t)ep->N ? (int)to : -1,
                                    ep->comm->boot, "ht", NULL, &who, msg, sizeof(msg));
            rc = fr_ep_fail(ep, st == FERRY_ERR_PEER ? st : FERRY_ERR_FABRIC, "%s", msg);
        }
        if (cqe[i].kind == FR_CQE_RX)
            fr_stat_add(&ep->st.rx, 1);
        else if (cqe[i].kind != FR_CQE_RXERR)
            fr_stat_add(&ep->st.tx, 1);
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

int fr_ht_fab_poll(ferry_ep_t ep)
{
    fr_cqe_t cqe[32];
    for (int k = 0; k < ep->nics.n; k++) {
        fr_err_t err;
        uint64_t t0 = fr_now_ns();
        int n = ep->nics.ops->poll(ep->nics.tp[k], cqe, 32, &err);
        if (n < 0)
            return fr_ep_fail(ep, n, "ht: %s", err.msg);
        int rc = fr_ht_fab_cqes(ep, cqe, n);
        if (n > 0) {
            fr_stat_add(&ep->st.polls, 1);
            fr_stat_add(&ep->st.poll_ns, fr_now_ns() - t0);
            fr_ep_stats_tp(ep); /* the provider's share, -FI_EAGAIN */
        }
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

/* The end of a call: wait until the chunk and count writes this rank
 * posted have completed locally (their staging may be rewritten by the
 * next call). Credits are not waited for: with manual progress (sockets,
 * udp;ofi_rxd) a write completes only once the target has progressed it,
 * and a peer that has all it needs from this call may already be outside
 * ferry, polling nothing, until its next call, the one where it needs
 * those credits. A chunk or count write's target is still polling: it
 * waits for that very write. Credits complete during later calls. */
int fr_ht_fab_drain(ferry_ep_t ep)
{
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    uint64_t iter = 0, check = fr_now_ns(), progress = check;
    uint8_t *need = malloc((size_t)ep->N);
    if (!need)
        return fr_ht_fatal(ep, fr_ep_fail(ep, FERRY_ERR_NOMEM, "ht: drain"));
    int rc = FERRY_OK;
    while (f->pending > 0 && rc == FERRY_OK) {
        long before = f->pending;
        rc = fr_ht_fab_poll(ep);
        if (rc == FERRY_OK && f->pending < before) {
            progress = fr_now_ns();
            continue;
        }
        int who = ep->rank; /* the peers our writes still go to */
        for (int r = 0; r < ep->N; r++)
            if ((need[r] = f->pending_to[r] > 0))
                who = r;
        if (rc == FERRY_OK)
            rc = fr_ht_idle(ep, &iter, &check, progress, who, "ht: writes completing", need);
    }
    free(need);
    return rc;
}

int fr_ht_fab_notify(ferry_ep_t ep, int d, const uint8_t *entry, uint64_t id)
{
    const fr_ht_layout_t *h = &fr_cpu_ht(ep)->H;
    uint64_t stage = (uint64_t)ep->group_index[d] * h->stage +
                     (uint64_t)h->RT * (h->drec + h->crec) + (id & 1) * h->notify_entry;
    memcpy(ep->send + stage, entry, h->notify_entry);
    uint64_t dst = h->off_notify + ((id & 1) * (uint64_t)h->N + (uint64_t)ep->rank) *
                                       h->notify_entry;
    return fr_ht_post(ep, d, stage, dst, h->notify_entry,
                      fr_ht_imm(FR_HT_IMM_NOTIFY, ep->rank, id), 0);
}

int fr_ht_fab_notify_landed(ferry_ep_t ep, int s, uint64_t id)
{
    /* per parity: s may already have sent the next route's counts */
    return fr_cpu_ht(ep)->fab.notify_seen[(size_t)(id & 1) * ep->N + s] ==
           (uint32_t)(id & 0xffffu) + 1;
}

/* ---------------------------------------------------------------- dispatch */

int fr_ht_fab_dispatch_tx(fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int d, int node)
{
    ferry_ep_t ep = c->ep;
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    const fr_ht_layout_t *h = c->h;
    const fr_ht_route_t *p = c->p;
    /* the tokens: d's, or (node-level) every token with an expert on node */
    const int32_t *tok = node >= 0 ? p->nd_tok + p->nd_off[node] : p->dst_tok + p->dst_off[d];
    int n = node >= 0 ? p->nd_off[node + 1] - p->nd_off[node] : p->dst_off[d + 1] - p->dst_off[d];
    int moved = 0;
    uint64_t stage = (uint64_t)ep->group_index[d] * h->stage;
    while (c->done_tx[d] < n && f->d_post[d] - f->d_credit[d] < (uint64_t)f->W) {
        int m = n - c->done_tx[d] < FR_HT_CHUNK ? n - c->done_tx[d] : FR_HT_CHUNK;
        uint64_t slot = (f->d_post[d] % (uint64_t)f->W) * FR_HT_CHUNK;
        for (int j = 0; j < m; j++)
            fr_ht_drec_fill(c, in, tok[c->done_tx[d] + j], d, node,
                            ep->send + stage + (slot + (uint64_t)j) * h->drec);
        uint64_t dst = h->off_dring + (uint64_t)ep->rank * h->dring + 2 * FR_HT_LINE +
                       slot * h->drec;
        int rc = fr_ht_post(ep, d, stage + slot * h->drec, dst, (uint64_t)m * h->drec,
                            fr_ht_imm(FR_HT_IMM_DATA, ep->rank, f->d_post[d] % (uint64_t)f->W), 0);
        if (rc != FERRY_OK)
            return rc;
        f->d_post[d]++;
        c->done_tx[d] += m;
        moved = 1;
    }
    return moved;
}

int fr_ht_fab_dispatch_rx(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s)
{
    ferry_ep_t ep = c->ep;
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    const fr_ht_layout_t *h = c->h;
    int n = c->p->src_off[s + 1] - c->p->src_off[s], moved = 0;
    uint8_t *ring = fr_ht_dring(h, ep->seg, s);
    while (c->done_rx[s] < n) {
        size_t w = (size_t)(f->d_take[s] % (uint64_t)f->W);
        if (!f->d_landed[(size_t)s * f->W + w])
            break;
        f->d_landed[(size_t)s * f->W + w] = 0;
        int m = n - c->done_rx[s] < FR_HT_CHUNK ? n - c->done_rx[s] : FR_HT_CHUNK;
        for (int j = 0; j < m; j++) {
            const uint8_t *rec = ring + 2 * FR_HT_LINE + (w * FR_HT_CHUNK + (size_t)j) * h->drec;
            if (fr_ht_drec_take(c, out, s, c->p->src_off[s] + c->done_rx[s] + j, rec) != FERRY_OK)
                return -1;
        }
        c->done_rx[s] += m;
        f->d_take[s]++;
        int rc =
            fr_ht_post(ep, s, 0, 0, 0, fr_ht_imm(FR_HT_IMM_DCREDIT, ep->rank, f->d_take[s]), 1);
        if (rc != FERRY_OK)
            return rc;
        moved = 1;
    }
    return moved;
}

/* ---------------------------------------------------------------- combine */

int fr_ht_fab_combine_tx(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int s)
{
    ferry_ep_t ep = c->ep;
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    const fr_ht_layout_t *h = c->h;
    int n = c->p->src_off[s + 1] - c->p->src_off[s], moved = 0;
    uint64_t stage = (uint64_t)ep->group_index[s] * h->stage + (uint64_t)h->RT * h->drec;
    while (c->done_tx[s] < n && f->c_post[s] - f->c_credit[s] < (uint64_t)f->W) {
        int m = n - c->done_tx[s] < FR_HT_CHUNK ? n - c->done_tx[s] : FR_HT_CHUNK;
        uint64_t slot = (f->c_post[s] % (uint64_t)f->W) * FR_HT_CHUNK;
        for (int j = 0; j < m; j++)
            fr_ht_crec_fill(c, in, (size_t)c->p->src_off[s] + (size_t)c->done_tx[s] + (size_t)j,
                            ep->send + stage + (slot + (uint64_t)j) * h->crec);
        uint64_t dst = h->off_cring + (uint64_t)ep->rank * h->cring + 2 * FR_HT_LINE +
                       slot * h->crec;
        int rc = fr_ht_post(ep, s, stage + slot * h->crec, dst, (uint64_t)m * h->crec,
                            fr_ht_imm(FR_HT_IMM_COMB, ep->rank, f->c_post[s] % (uint64_t)f->W), 0);
        if (rc != FERRY_OK)
            return rc;
        f->c_post[s]++;
        c->done_tx[s] += m;
        moved = 1;
    }
    return moved;
}

int fr_ht_fab_combine_rx(fr_ht_call_t *c, const ferry_ht_combine_out_t *out, float *acc,
                         int d, int node)
{
    ferry_ep_t ep = c->ep;
    fr_ht_fab_t *f = &fr_cpu_ht(ep)->fab;
    const fr_ht_layout_t *h = c->h;
    const fr_ht_route_t *p = c->p;
    const int32_t *tok = node >= 0 ? p->nd_tok + p->nd_off[node] : p->dst_tok + p->dst_off[d];
    int n = node >= 0 ? p->nd_off[node + 1] - p->nd_off[node] : p->dst_off[d + 1] - p->dst_off[d];
    int moved = 0;
    uint8_t *ring = fr_ht_cring(h, ep->seg, d);
    while (c->done_rx[d] < n) {
        size_t w = (size_t)(f->c_take[d] % (uint64_t)f->W);
        if (!f->c_landed[(size_t)d * f->W + w])
            break;
        f->c_landed[(size_t)d * f->W + w] = 0;
        int m = n - c->done_rx[d] < FR_HT_CHUNK ? n - c->done_rx[d] : FR_HT_CHUNK;
        for (int j = 0; j < m; j++) {
            const uint8_t *rec = ring + 2 * FR_HT_LINE + (w * FR_HT_CHUNK + (size_t)j) * h->crec;
            fr_ht_accumulate(c, out, acc, tok[c->done_rx[d] + j], d, node,
                             (const uint16_t *)(rec + h->chdr), (const float *)rec);
        }
        c->done_rx[d] += m;
        f->c_take[d]++;
        int rc =
            fr_ht_post(ep, d, 0, 0, 0, fr_ht_imm(FR_HT_IMM_CCREDIT, ep->rank, f->c_take[d]), 1);
        if (rc != FERRY_OK)
            return rc;
        moved = 1;
    }
    return moved;
}
