/*
 * The proxy: one thread per rank that owns the fabric transport.
 *
 * The rank thread (or the GPU send kernel) packs a phase's slices into
 * the send region, fills one fr_slice_t per fabric peer and rings the
 * doorbell by pushing {phase, set, epoch, peer} into a single-producer
 * ring: one request for every peer (the scatter), or one per peer as soon
 * as that peer's slice is packed (a single write), so that writes start
 * while later peers are still being packed. GPU ranks, whose many blocks
 * would contend for one ring, ring a doorbell word per (phase, set, peer)
 * instead (ep->ready: the epoch whose slice is packed), which the proxy
 * scans. The proxy posts, then polls completions:
 *   RX  immediate (phase, epoch low bits, sender): the write, header
 *       included, has landed; the proxy publishes it by storing the full
 *       epoch into the same flag word a shared-memory peer would have
 *       written (release order), so receivers wait the same way on every
 *       path. Where a NIC writes GPU memory that its kernels do not see in
 *       order, the batch's writes are flushed first; where the provider
 *       copies into GPU memory with cudaMemcpy (shm), which can return
 *       before a device-to-device copy is done, those copies are waited
 *       for first (ep->rx_flush).
 *       Completions are counted per (phase, set, sender), order-free.
 *   TX  a local write finished: the set's send slices may be reused.
 *   ERR a failed write: recorded as the EP's asynchronous error.
 * Idle, it yields, then sleeps up to FERRY_PROXY_IDLE_US.
 *
 * FERRY_PROXY_THREADS = T runs T such threads, the EP having opened T
 * endpoints per interface (transport/nics.h): thread j owns endpoints
 * [j * K, (j + 1) * K) of K interfaces, so the peers sharded onto them, their
 * requests (a ring per thread: the rank thread pushes a peer's request
 * into its owner's ring, a request for every peer into every ring), their
 * doorbell words and their completions. A sender's writes all arrive on
 * one endpoint, so its flags have one writer. Each thread keeps its own
 * counters (ep->st for thread 0), merged when read and at stop.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/config.h"
#include "ep/hmem.h"
#include "proxy/proxy.h"
#include "core/log.h"

static void fr_proxy_async_fail(ferry_ep_t ep, int code, int peer,
                                const char *msg)
{
    fr_ep_async_fail(ep, code, peer, "%s", msg);
}

static void fr_proxy_rx(ferry_ep_t ep, fr_proxy_th_t *th, uint32_t imm)
{
    const fr_layout_t *L = &ep->L;
    int phase = fr_imm_phase(imm), sender = fr_imm_sender(imm);
    uint32_t e12 = fr_imm_epoch(imm);
    char msg[200];
    if (phase > FR_PH_COMBINE || sender >= ep->N ||
        ep->path[sender] != FR_PATH_FABRIC) {
        snprintf(msg, sizeof(msg),
                 "unexpected immediate 0x%08x (phase %d, sender %d)", imm,
                 phase, sender);
        fr_proxy_async_fail(ep, FERRY_ERR_PROTOCOL, sender, msg);
        return;
    }
    /* Both sets see epochs advance by two; reconstruct the full epoch. */
    int set = (int)(e12 & 1);
    uint64_t *last = &ep->flag_last[((size_t)phase * FR_NSETS + set) * ep->N +
                                    sender];
    uint64_t want = *last ? *last + 2 : (set ? 1 : 2);
    if ((want & ((1u << FR_IMM_EPOCH_BITS) - 1)) != e12) {
        snprintf(msg, sizeof(msg),
                 "rank %d sent %s for round ...%u, expected round %llu",
                 sender, phase ? "combine" : "dispatch", e12,
                 (unsigned long long)want);
        fr_proxy_async_fail(ep, FERRY_ERR_PROTOCOL, sender, msg);
        return;
    }
    *last = want;
    fr_stat_add(&th->st->rx, 1); /* before the flag: whoever saw it sees the count */
    __atomic_store_n(fr_flag_ptr(L, ep->flags, phase, set, sender), want,
                     __ATOMIC_RELEASE);
    fr_doorbell_ring(ep->flags);
    fr_proxy_t *p = &ep->proxy;
    if (p->stats && ++p->rx_seen[phase][set] == ep->nfabric) { /* one thread (start) */
        p->rx_seen[phase][set] = 0;
        if (p->t_pick[phase][set])
            fr_hist_add(&p->xfer[phase], fr_now_ns() - p->t_pick[phase][set]);
        p->t_pick[phase][set] = 0;
    }
}

/* n writes of `bytes` in all for set `set` counted before they are posted
 * (a write that landed at a peer has been counted here), or with
 * negative values uncounted when not posted. */
static void fr_proxy_count(ferry_ep_t ep, fr_proxy_th_t *th, int set, int64_t n, int64_t bytes)
{
    fr_stat_add(&th->st->writes, (uint64_t)n);
    fr_stat_add(&th->st->bytes, (uint64_t)bytes);
    __atomic_add_fetch(&th->inflight[set], n, __ATOMIC_ACQ_REL);
}

/* A scatter request (peer1 0): one write per fabric peer of this
 * thread's NICs, a scatter per NIC. */
static int fr_proxy_post(ferry_ep_t ep, fr_proxy_th_t *th, const fr_proxy_req_t *q)
{
    if (ep->proxy.stats) /* the phase's request */
        ep->proxy.t_pick[q->phase & 1][q->set & 1] = fr_now_ns();
    fr_err_t err = {{0}};
    const fr_slice_t *sl =
        ep->slices + ((size_t)q->phase * FR_NSETS + q->set) * ep->nfabric;
    for (int k = th->k0; k < th->k1; k++) { /* its NICs */
        int n = ep->groups.n[k];
        if (n == 0)
            continue;
        /* this NIC's peers' slices, in its group's order */
        uint64_t bytes = 0;
        for (int i = 0; i < n; i++) {
            th->gslices[i] = sl[ep->groups.idx[k][i]];
            bytes += th->gslices[i].len;
        }
        fr_proxy_count(ep, th, q->set, n, (int64_t)bytes);
        int rc = ep->nics.ops->scatter(ep->nics.tp[k], ep->groups.g[k], th->gslices,
                                     (uint64_t)q->set, &err);
        if (rc != FERRY_OK) { /* a failed scatter posted nothing: uncounted */
            fr_proxy_count(ep, th, q->set, -n, -(int64_t)bytes);
            fr_proxy_async_fail(ep, rc, -1, err.msg);
            return rc;
        }
    }
    return FERRY_OK;
}

/* Where a write's delay starts: the ringer's stamp tr where there is
 * one (counted as stamped), else `other`. */
static uint64_t fr_proxy_bell(fr_proxy_th_t *th, uint64_t tr, uint64_t t1, uint64_t other)
{
    if (tr == 0 || tr > t1)
        return other;
    fr_stat_add(&th->st->stamped, 1);
    return tr;
}

/* Doorbell word i's stamp for `epoch` (ep->ready_ts: the benchmarks'
 * ringer, or a thread watching the words, records when it rang), as
 * early as `seen` (a watcher may look after the proxy): 1 and *ts, else
 * 0 (none yet) or -1 (a later epoch's: this one will not come). */
static int fr_proxy_stamp(ferry_ep_t ep, size_t i, uint64_t epoch, uint64_t seen, uint64_t *ts)
{
    uint64_t e = __atomic_load_n(&ep->ready_ts[2 * i], __ATOMIC_ACQUIRE);
    if (e != epoch)
        return e > epoch ? -1 : 0;
    *ts = ep->ready_ts[2 * i + 1] < seen ? ep->ready_ts[2 * i + 1] : seen;
    return 1;
}

/* The delays waiting for their stamps: counted from the stamp once it is
 * there, from the previous pass's start (an upper bound) once it cannot
 * come, is 100 us late, or `all` (the thread stops). */
static void fr_proxy_pend(ferry_ep_t ep, fr_proxy_th_t *th, int all)
{
    uint64_t now = all ? 0 : fr_now_ns(), ts = 0;
    int n = 0;
    for (int k = 0; k < th->npend; k++) {
        fr_proxy_pend_t *w = &th->pend[k];
        int got = fr_proxy_stamp(ep, w->i, w->epoch, w->seen, &ts);
        if (got == 0 && !all && now - w->t1 < 100000) {
            th->pend[n++] = *w; /* not yet */
            continue;
        }
        fr_hist_add(&th->st->d2p, w->t1 - fr_proxy_bell(th, got > 0 ? ts : 0, w->t1, w->bell));
    }
    th->npend = n;
}

/* The delay of request q, posted at t1: from its ringer's stamp (in the
 * request, or beside its doorbell word, else later: fr_proxy_pend), else
 * from `bell`. */
static void fr_proxy_delay(ferry_ep_t ep, fr_proxy_th_t *th, const fr_proxy_req_t *q,
                           uint64_t t1, uint64_t seen, uint64_t bell)
{
    uint64_t tr = q->t_ring;
    if (!tr && ep->ready_ts) {
        size_t i = ((size_t)q->phase * FR_NSETS + (size_t)q->set) * (size_t)ep->nfabric +
                   (size_t)(q->peer1 - 1);
        int got = fr_proxy_stamp(ep, i, q->epoch, seen, &tr);
        if (got == 0 && th->npend < th->nscan) {
            th->pend[th->npend++] = (fr_proxy_pend_t){i, q->epoch, t1, seen, bell};
            return;
        }
        tr = got > 0 ? tr : 0;
    }
    fr_hist_add(&th->st->d2p, t1 - fr_proxy_bell(th, tr, t1, bell));
}

/* Post scatter request q and count it: the time since *t (the previous
 * post's end, or when the request was noticed) as posting, and the delay
 * from its doorbell (stamped by the producer, else noticed) to now. */
static int fr_proxy_take(ferry_ep_t ep, fr_proxy_th_t *th, const fr_proxy_req_t *q,
                         uint64_t noticed, uint64_t *t)
{
    int rc = fr_proxy_post(ep, th, q);
    uint64_t t1 = fr_now_ns();
    fr_ep_stats_t *st = th->st;
    fr_stat_add(&st->post_ns, t1 - *t);
    fr_stat_add(&st->requests, 1);
    fr_hist_add(&st->d2p, t1 - fr_proxy_bell(th, q->t_ring, t1, noticed));
    fr_hist_add(&st->s2p, t1 - noticed);
    *t = t1;
    return rc;
}

/* Post one batch of n writes (th->bidx: group places, th->bsl: slices)
 * on NIC k for set `set`: one write_batch call, else (a transport
 * without it, or a batch of one) write_imm each.
 * Returns the status; a failure is the EP's asynchronous error. */
static int fr_proxy_batch(ferry_ep_t ep, fr_proxy_th_t *th, int k, int set, int n)
{
    fr_err_t err = {{0}};
    uint64_t bytes = 0;
    for (int b = 0; b < n; b++)
        bytes += th->bsl[b].len;
    fr_proxy_count(ep, th, set, n, (int64_t)bytes);
    const fr_transport_ops_t *ops = ep->nics.ops;
    int rc = FERRY_OK, posted = 0;
    if (ops->write_batch && n > 1) { /* a single write: write_imm */
        rc = ops->write_batch(ep->nics.tp[k], ep->groups.g[k], th->bidx, th->bsl, n,
                              (uint64_t)set, &err);
        posted = rc == FERRY_OK ? n : 0; /* all or none */
    } else {
        for (; posted < n && rc == FERRY_OK; posted += rc == FERRY_OK)
            rc = ops->write_imm(ep->nics.tp[k], ep->groups.g[k], th->bidx[posted],
                                &th->bsl[posted], (uint64_t)set, &err);
    }
    if (rc != FERRY_OK) { /* the ones not posted: uncounted */
        uint64_t left = 0;
        for (int b = posted; b < n; b++)
            left += th->bsl[b].len;
        fr_proxy_count(ep, th, set, -(int64_t)(n - posted), -(int64_t)left);
        fr_proxy_async_fail(ep, rc, -1, err.msg);
    }
    return rc;
}

/* Post a run of per-peer requests th->rq[0..n), all of one (phase, set):
 * one batch per NIC (write_batch: one provider doorbell where it allows,
 * one share of ferry's bookkeeping). Counted as posting from *t to each
 * batch's return, and each request's delay from its doorbell (stamped by
 * the producer in the request or beside the word, else `bell`) and from
 * when the proxy saw it (`seen`) to that return. */
static int fr_proxy_run(ferry_ep_t ep, fr_proxy_th_t *th, int n, uint64_t bell, uint64_t seen,
                        uint64_t *t)
{
    fr_proxy_t *p = &ep->proxy;
    if (n == 0)
        return FERRY_OK;
    int nf = ep->nfabric, phase = th->rq[0].phase, set = th->rq[0].set;
    const fr_slice_t *sl = ep->slices + ((size_t)phase * FR_NSETS + set) * nf;
    for (int r = 0; r < n; r++)
        if (th->rq[r].peer1 < 1 || th->rq[r].peer1 > nf || th->rq[r].phase < 0 ||
            th->rq[r].phase > 1 || th->rq[r].set < 0 || th->rq[r].set >= FR_NSETS ||
            p->gnic[th->rq[r].peer1 - 1] < th->k0 || p->gnic[th->rq[r].peer1 - 1] >= th->k1) {
            char msg[160]; /* not a peer, not one of this thread's NICs, or no slice */
            snprintf(msg, sizeof(msg),
                     "proxy thread %d: request for fabric peer %d of %d, phase %d, set %d",
                     th->j, th->rq[r].peer1 - 1, nf, th->rq[r].phase, th->rq[r].set);
            fr_proxy_async_fail(ep, FERRY_ERR_INTERNAL, -1, msg);
            return FERRY_ERR_INTERNAL;
        }
    if (p->stats && p->t_pick[phase & 1][set & 1] == 0)
        p->t_pick[phase & 1][set & 1] = *t; /* the phase's first write */
    for (int k = th->k0; k < th->k1; k++) { /* its NICs */
        int m = 0;
        for (int r = 0; r < n; r++) {
            int g = th->rq[r].peer1 - 1;
            if (p->gnic[g] != k)
                continue;
            th->bidx[m] = p->gpos[g];
            th->bsl[m] = sl[g];
            th->bq[m++] = r;
        }
        if (m == 0)
            continue;
        int rc = fr_proxy_batch(ep, th, k, set, m);
        uint64_t t1 = fr_now_ns();
        fr_stat_add(&th->st->post_ns, t1 - *t);
        fr_stat_add(&th->st->requests, (uint64_t)m);
        for (int b = 0; b < m; b++) {
            fr_proxy_delay(ep, th, &th->rq[th->bq[b]], t1, seen, bell);
            fr_hist_add(&th->st->s2p, t1 - seen);
        }
        *t = t1;
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

/* A scan's run, its words read: posted with now as when the proxy saw
 * them (after every read of them: the lower bound's start) and, for the
 * pass's first run, as posting's start. */
static int fr_proxy_scan_run(ferry_ep_t ep, fr_proxy_th_t *th, int n, uint64_t bell,
                             uint64_t *t)
{
    uint64_t seen = fr_now_ns();
    if (*t == 0)
        *t = seen;
    return fr_proxy_run(ep, th, n, bell, seen, t);
}

/* Per-peer doorbells (GPU ranks): post peer g's write of (phase, set) as
 * soon as its slice is packed, while the kernel packs the next peers. A
 * pass reads every doorbell word of this thread's peers first, then posts
 * the rung ones, a run per (phase, set) (fr_proxy_run). The delay counted
 * for each write runs from when the word rang, where a stamp beside it
 * says (ep->ready_ts), else from the start of the previous pass, the
 * latest time its doorbell was still seen unrung (so an upper bound,
 * which includes a nap of an idle proxy), to its batch's post returning; the
 * one from its run's words read to that return is a lower bound (s2p).
 * Returns whether anything was posted. */
static int fr_proxy_scan_ready(ferry_ep_t ep, fr_proxy_th_t *th)
{
    fr_proxy_t *p = &ep->proxy;
    int nf = ep->nfabric, n = 0;
    uint64_t prev = th->t_scan;
    th->t_scan = fr_now_ns();
    uint64_t bell = prev ? prev : th->t_scan, t = 0;
    /* th->scan ascends: the words of one (phase, set) come together; a
     * run goes out once its words are read (fr_proxy_scan_run) */
    for (int x = 0; x < th->nscan; x++) {
        int i = th->scan[x];
        uint64_t v = __atomic_load_n(&ep->ready[i], __ATOMIC_ACQUIRE);
        if (v == p->ready_seen[i])
            continue;
        p->ready_seen[i] = v;
        fr_proxy_req_t q = {.phase = i / (FR_NSETS * nf), .set = (i / nf) % FR_NSETS,
                            .epoch = v, .peer1 = i % nf + 1};
        if (n > 0 && (q.phase != th->rq[0].phase || q.set != th->rq[0].set)) {
            if (fr_proxy_scan_run(ep, th, n, bell, &t) != FERRY_OK)
                return 1; /* the failure is the EP's asynchronous error now */
            n = 0;
        }
        th->rq[n++] = q;
    }
    if (n > 0)
        fr_proxy_scan_run(ep, th, n, bell, &t);
    return t != 0;
}

/* The requests pushed into this thread's ring: per-peer ones in runs of
 * one (phase, set) (fr_proxy_run), a scatter request alone, in order.
 * Returns whether there were any. */
static int fr_proxy_take_ring(ferry_ep_t ep, fr_proxy_th_t *th)
{
    fr_proxy_ring_t *rg = th->ring;
    uint64_t tail = __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE);
    if (rg->head >= tail)
        return 0;
    uint64_t noticed = fr_now_ns(), t = noticed, h = rg->head;
    int n = 0;
    /* the head moves past a request only once it is posted (counted in
     * th->inflight): a rank waiting for its set to drain (an empty ring and
     * nothing in flight) never misses a request held in a run */
    while (h < tail) {
        fr_proxy_req_t q = rg->req[h % FR_PROXY_RING];
        if (n > 0 && (q.peer1 == 0 || q.phase != th->rq[0].phase || q.set != th->rq[0].set)) {
            fr_proxy_run(ep, th, n, noticed, noticed, &t);
            n = 0;
            __atomic_store_n(&rg->head, h, __ATOMIC_RELEASE);
        }
        if (q.peer1 == 0) {
            fr_proxy_take(ep, th, &q, noticed, &t);
            __atomic_store_n(&rg->head, h + 1, __ATOMIC_RELEASE);
        } else {
            th->rq[n++] = q;
        }
        h++;
    }
    fr_proxy_run(ep, th, n, noticed, noticed, &t);
    __atomic_store_n(&rg->head, h, __ATOMIC_RELEASE);
    return 1;
}

/* Arrivals of this batch: make their bytes visible to the GPU's kernels
 * once, before any of their flags is published. A NIC writing GPU memory
 * directly (GPUDirect RDMA) whose writes the GPU does not order: flush
 * them. A provider that copied them with cudaMemcpy on this process's
 * legacy default stream (shm): wait for that stream. */
static void fr_proxy_flush(ferry_ep_t ep, const fr_cqe_t *cqe, int n)
{
    const char *what = "";
    if (fr_ep_rx_visible(ep, cqe, n, &what) != 0)
        fr_ep_async_fail(ep, FERRY_ERR_SYSTEM, -1, "%s failed", what);
}

/* Hand out one poll's completions (err: the poll's message, for errors). */
static void fr_proxy_completions(ferry_ep_t ep, fr_proxy_th_t *th, const fr_cqe_t *cqe,
                                 int n, const fr_err_t *errp)
{
    const char *why = errp->msg;
    int64_t done[FR_NSETS] = {0}; /* TX completions per set: one update each */
    for (int i = 0; i < n; i++) {
        if (cqe[i].kind != FR_CQE_RX && cqe[i].kind != FR_CQE_RXERR)
            fr_stat_add(&th->st->tx, 1);
        switch (cqe[i].kind) {
        case FR_CQE_RX:
            fr_proxy_rx(ep, th, cqe[i].imm);
            break;
        case FR_CQE_TX:
            done[cqe[i].ctx % FR_NSETS]++;
            break;
        default: { /* the rank thread blames a dead rank (fr_ep_async_check) */
            char msg[FR_ERRMSG_LEN];
            int who;
            int st = fr_cqe_failure(&cqe[i], -1, NULL, "proxy", why, &who, msg, sizeof(msg));
            if (cqe[i].kind == FR_CQE_ERR)
                __atomic_sub_fetch(&th->inflight[cqe[i].ctx % FR_NSETS], 1, __ATOMIC_ACQ_REL);
            fr_proxy_async_fail(ep, st, who, msg);
        }
        }
    }
    for (int s = 0; s < FR_NSETS; s++)
        if (done[s])
            __atomic_sub_fetch(&th->inflight[s], done[s], __ATOMIC_ACQ_REL);
}

static void *fr_proxy_main(void *arg)
{
    fr_proxy_th_t *th = arg;
    ferry_ep_t ep = th->ep;
    fr_proxy_t *p = &ep->proxy;
    fr_log_set_rank(ep->rank);
    long idle_us = fr_proxy_idle_us(ep->cfg.device == FERRY_DEVICE_CUDA);
    fr_cqe_t cqe[64];
    uint64_t idle = 0;
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        int work = 0;
        work = fr_proxy_take_ring(ep, th);
        /* doorbells rung while a batch was posted go out before the
         * completions are handled (a few passes at most: the arrivals
         * of this phase wait behind them) */
        for (int pass = 0; p->ready_seen && pass < 4 && fr_proxy_scan_ready(ep, th); pass++)
            work = 1;
        if (work) /* the provider's share, -FI_EAGAIN */
            fr_ep_stats_tp_nics(ep, th->st, th->k0, th->k1);
        fr_err_t err = {{0}};
        int n = 0;
        uint64_t t_poll = fr_now_ns();
        for (int k = th->k0; k < th->k1 && n < 48; k++) {
            int got = ep->nics.ops->poll(ep->nics.tp[k], cqe + n, 64 - n, &err);
            if (got < 0) {
                fr_proxy_async_fail(ep, got, -1, err.msg);
                got = 0;
            }
            n += got;
        }
        fr_proxy_flush(ep, cqe, n);
        fr_proxy_completions(ep, th, cqe, n, &err);
        if (n > 0) {
            fr_stat_add(&th->st->polls, 1);
            fr_stat_add(&th->st->poll_ns, fr_now_ns() - t_poll);
        }
        if (th->npend > 0)
            fr_proxy_pend(ep, th, 0);
        if (work || n > 0) {
            idle = 0;
            continue;
        }
        fr_proxy_idle(&idle, idle_us);
    }
    fr_proxy_pend(ep, th, 1);
    return NULL;
}

/* The tables fr_proxy_start allocated (none of them is used after). */
static void fr_proxy_tables_free(fr_proxy_t *p)
{
    for (int j = 0; p->th && j < p->nth; j++) {
        free(p->th[j].gslices);
        free(p->th[j].scan);
        free(p->th[j].rq);
        free(p->th[j].bidx);
        free(p->th[j].bq);
        free(p->th[j].bsl);
        free(p->th[j].pend);
    }
    free(p->th);
    free(p->gnic);
    free(p->gpos);
    free(p->ready_seen);
    free(p->xfer);
    p->th = NULL;
    p->nth = 0;
    p->gnic = p->gpos = NULL;
    p->ready_seen = NULL;
    p->xfer = NULL;
    p->stats = 0;
}

/* Zeroed memory starting a cache line (the ring's and the threads'
 * lines, ep.h); bytes a multiple of 64. */
static void *fr_proxy_zalloc(size_t bytes)
{
    void *m = aligned_alloc(64, bytes);
    if (m)
        memset(m, 0, bytes);
    return m;
}

int fr_proxy_tables(ferry_ep_t ep, fr_err_t *err)
{
    size_t nf = (size_t)(ep->nfabric ? ep->nfabric : 1);
    if (!ep->slices)
        ep->slices = calloc(2 * FR_NSETS * nf, sizeof(fr_slice_t));
    ep->flag_last = calloc(2 * FR_NSETS * (size_t)ep->N, sizeof(uint64_t));
    if (!ep->slices || !ep->flag_last)
        return FR_ERR(err, FERRY_ERR_NOMEM, "proxy tables");
    if (!ep->proxy.ring) {
        if (!ep->ring_mem)
            ep->ring_mem = fr_proxy_zalloc(sizeof(fr_proxy_ring_t));
        if (!ep->ring_mem)
            return FR_ERR(err, FERRY_ERR_NOMEM, "proxy ring");
        ep->proxy.ring = ep->ring_mem;
    }
    return FERRY_OK;
}

void fr_proxy_tables_release(ferry_ep_t ep)
{
    free(ep->slices);
    free(ep->flag_last);
    free(ep->ring_mem);
    ep->slices = NULL;
    ep->flag_last = NULL;
    ep->ring_mem = NULL;
}

/* Thread j's tables: its NIC endpoints, ring, scatter scratch, counters
 * and the doorbell words of its peers. */
static int fr_proxy_th_init(ferry_ep_t ep, fr_proxy_th_t *th, int j)
{
    fr_proxy_t *p = &ep->proxy;
    int nf = ep->nfabric;
    th->j = j;
    th->ep = ep;
    th->k0 = j * p->per;
    th->k1 = th->k0 + p->per < ep->nics.n ? th->k0 + p->per : ep->nics.n;
    th->ring = j == 0 ? p->ring : &th->own;
    th->st = j == 0 ? &ep->st : &th->mine;
    th->gslices = calloc((size_t)ep->N + 1, sizeof(fr_slice_t));
    size_t words = 2 * FR_NSETS * (size_t)(nf > 0 ? nf : 1);
    /* a run: at most a pass's words, or a ring's requests */
    th->nrq = (int)(words > FR_PROXY_RING ? words : FR_PROXY_RING);
    th->scan = calloc(words, sizeof(int));
    th->rq = calloc((size_t)th->nrq, sizeof(fr_proxy_req_t));
    th->bidx = calloc((size_t)th->nrq, sizeof(int));
    th->bq = calloc((size_t)th->nrq, sizeof(int));
    th->bsl = calloc((size_t)th->nrq, sizeof(fr_slice_t));
    th->pend = calloc(words, sizeof(fr_proxy_pend_t));
    if (!th->gslices || !th->scan || !th->rq || !th->bidx || !th->bq || !th->bsl || !th->pend)
        return -1;
    for (int i = 0; p->ready_seen && i < 2 * FR_NSETS * nf; i++)
        if (fr_proxy_owner(p, i % nf) == j)
            th->scan[th->nscan++] = i;
    return 0;
}

int fr_proxy_start(ferry_ep_t ep)
{
    fr_proxy_t *p = &ep->proxy;
    fr_proxy_ring_t *ring = p->ring;
    memset(p, 0, sizeof(*p));
    p->ring = ring;
    /* threads: FERRY_PROXY_THREADS (ep->proxy_threads); create.c opened
     * that many endpoints per interface (fewer where FR_MAX_NICS caps
     * them), thread j owning the j-th interface-many */
    int want = ep->proxy_threads > 0 ? ep->proxy_threads : 1;
    p->per = ep->nics.ifaces > 0 ? ep->nics.ifaces : (ep->nics.n > 0 ? ep->nics.n : 1);
    int can = ep->nics.n / p->per > 0 ? ep->nics.n / p->per : 1;
    p->nth = want < can ? want : can;
    /* where each fabric peer sits: its NIC, its place in that NIC's group */
    int nf = ep->nfabric > 0 ? ep->nfabric : 1;
    p->gnic = calloc((size_t)nf, sizeof(int));
    p->gpos = calloc((size_t)nf, sizeof(int));
    p->th = fr_proxy_zalloc((size_t)p->nth * sizeof(fr_proxy_th_t));
    if (!p->gnic || !p->gpos || !p->th) {
        fr_proxy_tables_free(p);
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "proxy peer tables");
    }
    fr_nics_groups_places(&ep->nics, &ep->groups, ep->nfabric, p->gnic, p->gpos);
    if (ep->ready) {
        p->ready_seen = calloc(2 * FR_NSETS * (size_t)nf, sizeof(uint64_t));
        if (!p->ready_seen) {
            fr_proxy_tables_free(p);
            return fr_ep_fail(ep, FERRY_ERR_NOMEM, "proxy doorbell table");
        }
    }
    for (int j = 0; j < p->nth; j++)
        if (fr_proxy_th_init(ep, &p->th[j], j) != 0) {
            fr_proxy_tables_free(p);
            return fr_ep_fail(ep, FERRY_ERR_NOMEM, "proxy thread tables");
        }
    /* the transfer lines count arrivals across the fabric peers: one thread */
    if (fr_cfg_str(FR_CFG_PROXY_STATS)[0] && p->nth == 1) {
        p->xfer = calloc(2, sizeof(fr_hist_t));
        p->stats = p->xfer != NULL;
    }
    for (int j = 0; j < p->nth; j++) {
        int e = pthread_create(&p->th[j].thread, NULL, fr_proxy_main, &p->th[j]);
        if (e != 0) {
            char why[64];
            snprintf(why, sizeof(why), "%s", strerror(e));
            __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
            for (int i = 0; i < j; i++)
                pthread_join(p->th[i].thread, NULL);
            fr_proxy_tables_free(p);
            return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "starting proxy thread %d: %s", j, why);
        }
        p->th[j].started = 1;
    }
    if (p->nth > 1)
        FR_LOG_INFO(FR_SUB_PROXY, "%d proxy threads over %d NIC endpoints", p->nth,
                    ep->nics.n);
    p->running = 1;
    return FERRY_OK;
}

int fr_proxy_stop(ferry_ep_t ep)
{
    fr_proxy_t *p = &ep->proxy;
    if (!p->running)
        return 0;
    if (!p->th) { /* an engine's own thread in this slot (cuda_ht/fab.c) */
        if (fr_proxy_join(p->thread, &p->stop, FR_PROXY_JOIN_MS, "endpoint destroy") != 0)
            return -1;
        p->running = 0;
        return 0;
    }
    int stuck = 0;
    for (int j = 0; j < p->nth; j++)
        if (p->th[j].started &&
            fr_proxy_join(p->th[j].thread, &p->stop, FR_PROXY_JOIN_MS, "endpoint destroy") != 0)
            stuck = 1;
    if (stuck)
        return -1; /* left running: its tables stay */
    p->running = 0;
    for (int j = 1; j < p->nth; j++) /* stopped: their counters into ep->st */
        fr_ep_stats_add(&ep->st, &p->th[j].mine);
    if (p->stats) {
        for (int ph = 0; ph < 2; ph++) {
            const fr_hist_t *h = &p->xfer[ph];
            if (h->count)
                fprintf(stderr,
                        "ferry proxy stats rank %d: %s: request picked up -> "
                        "last peer's write landed: p50 %.1f us, p99 %.1f us "
                        "(%llu rounds)\n",
                        ep->rank, ph ? "combine" : "dispatch",
                        fr_hist_quantile(h, 0.5) / 1e3, fr_hist_quantile(h, 0.99) / 1e3,
                        (unsigned long long)h->count);
        }
    }
    fr_proxy_tables_free(p);
    return 0;
}

void fr_proxy_stats_clear(ferry_ep_t ep)
{
    memset(&ep->st, 0, sizeof(ep->st));
    for (int j = 1; ep->proxy.th && j < ep->proxy.nth; j++)
        memset(&ep->proxy.th[j].mine, 0, sizeof(ep->proxy.th[j].mine));
}
