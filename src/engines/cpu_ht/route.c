/*
 * Routes: from topk_idx, the tokens each destination gets (in token
 * order) and, through one exchange of counts, the rows each source sends
 * here and how many rows each local expert gets. Each rank stores its
 * counts into every destination's notify entry (release on the route's
 * number), then waits for every source's entry in its own segment.
 *
 * Two entries per source (route number parity) are enough: a rank writes
 * route k+2's counts only after its own route k+1 finished, which needed
 * every rank's route k+1 counts, which each rank wrote after it had read
 * route k's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engines/cpu_ht/cpu_ht.h"

void fr_ht_route_free(ferry_route_t route)
{
    fr_ht_route_t *p = route ? (fr_ht_route_t *)route->priv : NULL;
    if (p) {
        free(p->idx);
        free(p->dst_off);
        free(p->dst_tok);
        free(p->src_off);
        free(p->nd_off);
        free(p->nd_tok);
        free(p->fwd_off);
        free(p->fle);
        free(p->fwd_cnt);
        free(p);
    }
    if (route) {
        free(route->ecnt);
        route->priv = NULL;
        route->ecnt = NULL;
    }
}

/* Tokens per destination (CSR, token order) and, per destination, the
 * count of each of its local experts: dcnt[d * El + le]. */
static int fr_ht_route_local(ferry_ep_t ep, const ferry_route_in_t *in, fr_ht_route_t *p,
                             int32_t *dcnt)
{
    int N = ep->N, K = ep->L.K, El = ep->L.El, T = in->num_tokens;
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++)
            p->idx[(size_t)t * K + k] = (int32_t)in->topk_idx[(size_t)t * K + k];
    int32_t *n = calloc((size_t)N + 1, sizeof(int32_t));
    if (!n)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    for (int pass = 0; pass < 2; pass++) {
        for (int t = 0; t < T; t++) {
            const int32_t *row = p->idx + (size_t)t * K;
            for (int k = 0; k < K; k++) {
                if (row[k] < 0)
                    continue;
                int d = row[k] / El, first = 1;
                for (int j = 0; j < k && first; j++)
                    first = !(row[j] >= 0 && row[j] / El == d);
                if (pass == 0) {
                    dcnt[(size_t)d * El + row[k] % El]++;
                    n[d] += first;
                } else if (first) {
                    p->dst_tok[p->dst_off[d] + n[d]++] = t;
                }
            }
        }
        if (pass == 0) {
            p->dst_off[0] = 0;
            for (int d = 0; d < N; d++)
                p->dst_off[d + 1] = p->dst_off[d] + n[d];
            memset(n, 0, sizeof(int32_t) * (size_t)N);
            p->dst_tok = malloc(sizeof(int32_t) * ((size_t)p->dst_off[N] + 1));
            if (!p->dst_tok) {
                free(n);
                return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
            }
        }
    }
    free(n);
    return FERRY_OK;
}

/* Forwarding: the tokens with an expert on each node (CSR, token order). */
static int fr_ht_route_nodes(ferry_ep_t ep, int T, fr_ht_route_t *p)
{
    int M = ep->nnodes, K = ep->L.K, El = ep->L.El;
    p->nd_off = calloc((size_t)M + 1, sizeof(int32_t));
    uint8_t *seen = calloc((size_t)M, 1);
    if (!p->nd_off || !seen) {
        free(seen);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int t = 0; t < T; t++) {
            const int32_t *row = p->idx + (size_t)t * K;
            for (int k = 0; k < K; k++) {
                int b = row[k] >= 0 ? ep->node_of[row[k] / El] : -1;
                if (b < 0 || seen[b])
                    continue;
                seen[b] = 1;
                if (pass == 0)
                    p->nd_off[b + 1]++;
                else
                    p->nd_tok[p->nd_off[b]++] = t;
            }
            for (int k = 0; k < K; k++)
                if (row[k] >= 0)
                    seen[ep->node_of[row[k] / El]] = 0;
        }
        if (pass == 0) {
            for (int b = 0; b < M; b++)
                p->nd_off[b + 1] += p->nd_off[b];
            p->nd_tok = malloc(sizeof(int32_t) * ((size_t)p->nd_off[M] + 1));
            if (!p->nd_tok) {
                free(seen);
                return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
            }
        } else { /* nd_off[b] was advanced to the end of b: shift back */
            for (int b = M; b > 0; b--)
                p->nd_off[b] = p->nd_off[b - 1];
            p->nd_off[0] = 0;
        }
    }
    free(seen);
    return FERRY_OK;
}

/* Store this rank's counts into every destination's notify entry (a
 * write with immediate for fabric peers); p NULL: a bad topk_idx here
 * (dcnt all zero). */
static int fr_ht_notify_all(ferry_ep_t ep, const fr_ht_route_t *p, const int32_t *dcnt,
                            uint64_t id)
{
    const fr_ht_layout_t *h = &fr_cpu_ht(ep)->H;
    int El = h->El, rc = FERRY_OK;
    uint8_t *tmp = ep->nfabric ? calloc(1, h->notify_entry) : NULL;
    if (ep->nfabric && !tmp)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    for (int d = 0; d < ep->N && rc == FERRY_OK; d++) {
        int fab = ep->path[d] == FR_PATH_FABRIC;
        uint8_t *e = fab ? tmp : fr_ht_notify(h, ep->peer_seg[d], (int)(id & 1), ep->rank);
        /* p NULL: this rank's topk_idx was bad, -1 tokens and nothing else */
        *(int32_t *)(e + 8) = p ? p->dst_off[d + 1] - p->dst_off[d] : -1;
        /* forwarding: the node-level records d passes on for this rank */
        int b = ep->node_of[d];
        int fwd = p && ep->forward && fr_ep_fwd_by(ep, ep->rank, d);
        *(int32_t *)(e + 12) = fwd ? p->nd_off[b + 1] - p->nd_off[b] : 0;
        /* ... and the tokens for each rank of d's node, which d checks */
        int32_t *pl = (int32_t *)(e + 16 + 4 * (size_t)El);
        for (int l = 0; l < h->LF; l++) {
            int n = ep->node_off[b + 1] - ep->node_off[b], r = ep->node_ranks[ep->node_off[b] + l];
            pl[l] = fwd && l < n ? p->dst_off[r + 1] - p->dst_off[r] : 0;
        }
        memcpy(e + 16, dcnt + (size_t)d * El, sizeof(int32_t) * (size_t)El);
        __atomic_store_n((uint64_t *)e, id, __ATOMIC_RELEASE);
        if (fab)
            rc = fr_ht_fab_notify(ep, d, e, id);
    }
    free(tmp);
    return rc;
}

/* Wait for every source's counts; rows per source and per local expert.
 * Every source's entry is read, also after one that says its topk_idx was
 * bad (-1 tokens): *bad_rank is then the lowest such source (else -1). */
static int fr_ht_notify_wait(ferry_ep_t ep, ferry_route_t route, fr_ht_route_t *p,
                             int align, int *bad_rank)
{
    const fr_ht_layout_t *h = &fr_cpu_ht(ep)->H;
    int N = ep->N, El = h->El;
    uint64_t iter = 0, check = fr_now_ns(), progress = check;
    size_t nn = (size_t)(N > 0 ? N : 1);
    uint8_t *need = malloc(nn); /* sources whose counts are missing */
    if (!need)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    memset(need, 1, nn);
    p->src_off[0] = 0;
    for (int s = 0; s < N; s++) {
        const uint8_t *e = fr_ht_notify(h, ep->seg, (int)(route->id & 1), s);
        int fab = ep->path[s] == FR_PATH_FABRIC;
        for (;;) {
            int rc = fab ? fr_ht_fab_poll(ep) : FERRY_OK;
            if (rc != FERRY_OK) {
                free(need);
                return rc;
            }
            uint64_t v = !fab || fr_ht_fab_notify_landed(ep, s, route->id)
                             ? __atomic_load_n((const uint64_t *)e, __ATOMIC_ACQUIRE)
                             : 0;
            if (v == route->id)
                break;
            rc = v > route->id
                         ? fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                      "route_create %llu: rank %d is at route %llu",
                                      (unsigned long long)route->id, s, (unsigned long long)v)
                         : fr_ht_idle(ep, &iter, &check, progress, s,
                                      "route_create (count exchange)", need);
            if (rc != FERRY_OK) {
                free(need);
                return rc;
            }
        }
        progress = fr_now_ns();
        need[s] = 0;
        /* the entry stays writable by s: each count is read once (volatile)
         * and used as checked */
        int32_t n = *(const volatile int32_t *)(e + 8);
        const volatile int32_t *c = (const volatile int32_t *)(e + 16);
        if (n == -1) { /* s's topk_idx was bad: no route is made */
            if (*bad_rank < 0)
                *bad_rank = s;
            p->src_off[s + 1] = p->src_off[s];
            if (p->fwd_off)
                p->fwd_off[s + 1] = p->fwd_off[s];
            continue;
        }
        if (n < 0 || n > ep->L.T) {
            free(need);
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "route_create: rank %d sends %d tokens (max_tokens %d)", s, n,
                              ep->L.T);
        }
        p->src_off[s + 1] = p->src_off[s] + n;
        /* forwarding: records s sends here to pass on (only where this
         * rank is s's forwarder) */
        int32_t nf = *(const volatile int32_t *)(e + 12);
        int fwd_me = ep->forward && fr_ep_fwd_by(ep, s, ep->rank);
        if (nf < 0 || nf > ep->L.T || (nf && !fwd_me)) {
            free(need);
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "route_create: rank %d forwards %d tokens through this rank%s", s,
                              nf, fwd_me ? "" : ", which is not its forwarder");
        }
        if (p->fwd_off) {
            p->fwd_off[s + 1] = p->fwd_off[s] + nf;
            /* each forwarded token goes to one rank of this node or more */
            const volatile int32_t *pl = (const volatile int32_t *)(e + 16 + 4 * (size_t)El);
            int32_t most = 0, sum = 0, L = ep->node_off[ep->node_of[ep->rank] + 1] -
                                          ep->node_off[ep->node_of[ep->rank]];
            for (int l = 0; l < h->LF; l++) {
                int32_t v = pl[l];
                p->fwd_cnt[(size_t)s * h->LF + l] = v;
                if (v < 0 || v > nf || (l >= L && v)) {
                    most = -1;
                    break;
                }
                most = v > most ? v : most;
                sum += v;
            }
            if (most < 0 || (nf && (sum < nf || most == 0))) {
                free(need);
                return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                  "route_create: rank %d's counts for this node do not add up "
                                  "to the %d tokens it forwards through this rank", s, nf);
            }
        }
        for (int le = 0; le < El; le++) {
            int32_t cl = c[le];
            if (cl < 0 || cl > n || (int64_t)route->ecnt[le] + cl > INT32_MAX / 2) {
                free(need);
                return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                  "route_create: rank %d sends %d rows for local expert %d "
                                  "(of %d tokens)", s, cl, le, n);
            }
            route->ecnt[le] += cl;
        }
    }
    free(need);
    route->num_recv = p->src_off[N];
    if (p->fwd_off && p->fwd_off[N] > 0) {
        p->fle = malloc(sizeof(int16_t) * (size_t)p->fwd_off[N] * (size_t)ep->L.K);
        if (!p->fle)
            return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    }
    if (align > 1)
        for (int le = 0; le < El; le++)
            route->ecnt[le] = (int32_t)(((int64_t)route->ecnt[le] + align - 1) / align * align);
    return FERRY_OK;
}

/* A bounded route: the counts within the caller's bound, and copied out
 * where the caller asked. More rows than max_recv fails the context, as
 * on CUDA ranks (where the GPU finds it after the counts went out). */
static int fr_ht_route_bounded(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t route)
{
    if (route->num_recv > route->bound)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "route_create: max_recv = %d, but this rank receives %d rows",
                          route->bound, route->num_recv);
    if (in->num_recv_out)
        *in->num_recv_out = route->num_recv;
    if (in->expert_counts_out)
        memcpy(in->expert_counts_out, route->ecnt, sizeof(int32_t) * (size_t)ep->L.El);
    return FERRY_OK;
}

int fr_ht_route_create(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t route)
{
    int N = ep->N, El = ep->L.El, K = ep->L.K, T = in->num_tokens;
    fr_ht_route_t *p = calloc(1, sizeof(*p));
    int32_t *dcnt = calloc((size_t)N * El, sizeof(int32_t));
    route->priv = p;
    route->ecnt = calloc((size_t)El, sizeof(int32_t));
    if (p) {
        p->idx = malloc(sizeof(int32_t) * ((size_t)T * K + 1));
        p->dst_off = calloc((size_t)N + 1, sizeof(int32_t));
        p->src_off = calloc((size_t)N + 1, sizeof(int32_t));
    }
    int rc = FERRY_OK;
    if (!p || !dcnt || !route->ecnt || !p->idx || !p->dst_off || !p->src_off)
        rc = fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    /* the route number advances on every rank even when this one failed
     * locally, so numbers stay in step; peers then time out naming it */
    route->id = ++fr_cpu_ht(ep)->routes;
    route->T = T;
    /* a bad topk_idx (out of range, an expert twice in a token) is found
     * here, not before the exchange: this rank publishes -1 tokens, every
     * rank reads every entry as usual and then fails with
     * FERRY_ERR_INVALID naming the lowest such rank, no route is made,
     * and the numbers stay in step: the context stays usable (as on CUDA
     * ranks, where the route kernel finds it) */
    fr_err_t badmsg = {{0}};
    int isbad = rc == FERRY_OK && T > 0 &&
                fr_check_topk(&ep->L, in->topk_idx, T, NULL, &badmsg) != FERRY_OK;
    int bad_rank = -1;
    if (rc == FERRY_OK && !isbad)
        rc = fr_ht_route_local(ep, in, p, dcnt);
    if (rc == FERRY_OK && !isbad && ep->forward) {
        rc = fr_ht_route_nodes(ep, T, p);
        p->fwd_off = calloc((size_t)N + 1, sizeof(int32_t));
        p->fwd_cnt = calloc((size_t)N * (size_t)fr_cpu_ht(ep)->H.LF, sizeof(int32_t));
        if (rc == FERRY_OK && (!p->fwd_off || !p->fwd_cnt))
            rc = fr_ep_fail(ep, FERRY_ERR_NOMEM, "route tables");
    }
    if (rc == FERRY_OK)
        rc = fr_ht_notify_all(ep, isbad ? NULL : p, dcnt, route->id);
    if (rc == FERRY_OK)
        rc = fr_ht_notify_wait(ep, route, p, in->expert_alignment, &bad_rank);
    if (rc == FERRY_OK && ep->nfabric)
        rc = fr_ht_fab_drain(ep);
    if (rc == FERRY_OK && bad_rank >= 0) { /* no route; the context goes on */
        free(dcnt);
        fr_ht_route_free(route);
        if (isbad)
            return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s (no route was made; every rank's "
                              "route_create fails)", badmsg.msg);
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "route_create: rank %d passed a bad "
                          "topk_idx (no route was made)", bad_rank);
    }
    if (rc == FERRY_OK && route->bound > 0)
        rc = fr_ht_route_bounded(ep, in, route);
    free(dcnt);
    if (rc != FERRY_OK) {
        /* counts may be out already: this context is out of step with its
         * peers, unless nothing was published (a bad argument is checked
         * before, in the API layer) */
        fr_ht_route_free(route);
        fr_ht_fatal(ep, rc);
    }
    return rc;
}
