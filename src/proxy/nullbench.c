/*
 * The proxy alone (proxy.h: fr_proxy_bench_null): one process, its proxy
 * threads (FERRY_PROXY_THREADS, a null NIC each, peer g on NIC g mod the
 * threads), `peers` simulated fabric peers behind the null transport
 * (transport/null/), which completes every write at once and answers it
 * with the peer's arrival. The calling thread plays a CPU rank whose
 * every peer is on the fabric path: per phase it fills a slice per peer
 * and pushes one request per peer (as engines/cpu_ll does), then waits
 * for every peer's flag and for its writes' completions. With `gpu` it
 * plays a GPU rank: a kernel fills the slices and rings a doorbell per
 * peer in host-mapped memory, which the proxy scans (as for the CUDA
 * low-latency engine) while the calling thread watches the words and
 * stamps when each rang (ep->ready_ts: the delay's start); with `bells`
 * the calling thread rings those doorbells itself, stamped (the same
 * scan, where there is no GPU). No bytes move,
 * no other process runs: what the rounds cost is the proxy's and the
 * request ring's own work, and the EP's counters (ep/stats.h) say where
 * it went.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "proxy/nullbench_cuda.h"
#include "proxy/proxy.h"
#include "runtime/cuda_mem.h"

/* A GPU rank (fr_proxy_bench_t.gpu): the slices and doorbells in pinned
 * host memory mapped into the GPU, as the low-latency engine keeps them
 * for its proxy, and a kernel per phase ringing every peer's doorbell. */
typedef struct nb_gpu {
    void *sl_dev, *ready_dev, *stream;
} nb_gpu_t;

static int nb_gpu_setup(ferry_ep_t ep, int peers, nb_gpu_t *g, fr_err_t *err)
{
    size_t n = 2 * FR_NSETS * (size_t)peers;
    void *h = NULL;
    ep->cfg.device = FERRY_DEVICE_CUDA; /* the proxy idles as for GPU producers */
    int rc = fr_cuda_host_alloc(n * sizeof(fr_slice_t), &h, &g->sl_dev, err);
    ep->slices = (fr_slice_t *)h;
    if (rc == FERRY_OK) {
        rc = fr_cuda_host_alloc(n * sizeof(uint64_t), &h, &g->ready_dev, err);
        ep->ready = (uint64_t *)h;
    }
    if (rc == FERRY_OK && fr_nb_cuda_stream(&g->stream) != FERRY_OK)
        rc = FR_ERR(err, FERRY_ERR_SYSTEM, "null bench: a CUDA stream");
    return rc;
}

static void nb_gpu_free(ferry_ep_t ep, nb_gpu_t *g)
{
    fr_nb_cuda_stream_free(g->stream);
    fr_cuda_host_free(ep->slices);
    fr_cuda_host_free(ep->ready);
    ep->slices = NULL; /* the engine's own (proxy.h) */
    ep->ready = NULL;
}

/* The parts of an EP the proxy reads, for `peers` fabric peers (rank 0
 * is this one). */
static int nb_setup(ferry_ep_t ep, int peers, uint64_t bytes, nb_gpu_t *gpu, int bells,
                    fr_err_t *err)
{
    int N = peers + 1, rc;
    ep->N = N;
    ep->rank = 0;
    ep->nfabric = peers;
    if ((rc = fr_cfg_check(err)) != FERRY_OK || /* as a communicator would */
        (rc = fr_cfg_long(FR_CFG_TIMEOUT_MS, &ep->timeout_ms, err)) != FERRY_OK)
        return rc;
    ep->spin = fr_cfg_int(FR_CFG_SPIN);
    ep->proxy_threads = (int)fr_cfg_int(FR_CFG_PROXY_THREADS);
    if (ep->proxy_threads < 1 || ep->proxy_threads > FR_MAX_NICS)
        return FR_ERR(err, FERRY_ERR_INVALID, "FERRY_PROXY_THREADS=%s: must be 1..%d",
                      fr_cfg_str(FR_CFG_PROXY_THREADS), FR_MAX_NICS);
    ep->fab_device = -1;
    ep->L.N = N;
    ep->L.off_flags = FR_SEG_HDR;
    size_t fbytes = FR_SEG_HDR + 2ull * FR_NSETS * (size_t)N * FR_FLAG_STRIDE;
    ep->flags = calloc(1, fbytes);
    ep->path = calloc((size_t)N, sizeof(int));
    ep->group_peers = calloc((size_t)N, sizeof(int));
    ep->nics.nic_of = calloc((size_t)N, sizeof(int));
    fr_mr_desc_t *remote = calloc((size_t)peers, sizeof(fr_mr_desc_t));
    if (gpu && (rc = nb_gpu_setup(ep, peers, gpu, err)) != FERRY_OK) {
        free(remote);
        return rc;
    }
    if (bells && !gpu) { /* doorbell words in host memory, as a GPU rank's */
        ep->cfg.device = FERRY_DEVICE_CUDA; /* the proxy idles as for GPU producers */
        ep->ready = calloc(2 * FR_NSETS * (size_t)peers, sizeof(uint64_t));
        if (!ep->ready) {
            free(remote);
            return FR_ERR(err, FERRY_ERR_NOMEM, "null bench: doorbells for %d peers", peers);
        }
    }
    if (gpu || bells) { /* when each doorbell rang (proxy.c: the delay's start) */
        ep->ready_ts = calloc(4 * FR_NSETS * (size_t)peers, sizeof(uint64_t));
        if (!ep->ready_ts) {
            free(remote);
            return FR_ERR(err, FERRY_ERR_NOMEM, "null bench: doorbell stamps for %d peers",
                          peers);
        }
    }
    if (!ep->flags || !ep->path || !ep->group_peers || !ep->nics.nic_of || !remote ||
        fr_proxy_tables(ep, err) != FERRY_OK) {
        free(remote);
        return FR_ERR(err, FERRY_ERR_NOMEM, "null bench: tables for %d peers", peers);
    }
    for (int i = 1; i < N; i++) {
        ep->path[i] = FR_PATH_FABRIC;
        ep->group_peers[i - 1] = i;
        remote[i - 1].len = bytes;
    }
    const fr_transport_ops_t *ops = fr_transport_find("null");
    fr_nics_t *x = &ep->nics;
    int T = ep->proxy_threads;
    x->ops = ops;
    x->N = N;
    x->n = T;
    x->ifaces = 1;
    x->quiet = 1;
    if (!ops) {
        free(remote);
        return FR_ERR(err, FERRY_ERR_INTERNAL, "null transport not registered");
    }
    int *members = calloc((size_t)peers, sizeof(int));
    fr_mr_desc_t *rem = calloc((size_t)peers, sizeof(fr_mr_desc_t));
    rc = members && rem ? FERRY_OK : FR_ERR(err, FERRY_ERR_NOMEM, "null bench: groups");
    for (int k = 0; k < T && rc == FERRY_OK; k++) {
        fr_mr_t *src = NULL; /* the null transport's regions hold only a length */
        if ((rc = ops->open(NULL, k, 0, &x->tp[k], err)) != FERRY_OK ||
            (rc = ops->reg(x->tp[k], NULL, bytes, 0, &src, NULL, err)) != FERRY_OK)
            break;
        ep->rsend.mr[k] = src;
        int n = 0;
        for (int g = k; g < peers; g += T) { /* fabric peer g on NIC g mod T */
            members[n] = ep->group_peers[g];
            rem[n] = remote[g];
            n++;
        }
        ep->groups.idx[k] = calloc((size_t)(n > 0 ? n : 1), sizeof(int));
        if (!ep->groups.idx[k]) {
            rc = FR_ERR(err, FERRY_ERR_NOMEM, "null bench: group");
            break;
        }
        for (int i = 0; i < n; i++)
            ep->groups.idx[k][i] = k + i * T;
        ep->groups.n[k] = n;
        if (n > 0)
            rc = ops->group_create(x->tp[k], members, n, src, rem, &ep->groups.g[k], err);
    }
    free(members);
    free(rem);
    free(remote);
    return rc;
}

static void nb_free(ferry_ep_t ep)
{
    fr_nics_t *x = &ep->nics;
    for (int k = 0; k < FR_MAX_NICS; k++) {
        if (x->tp[k]) {
            if (ep->groups.g[k])
                x->ops->group_destroy(x->tp[k], ep->groups.g[k]);
            if (ep->rsend.mr[k])
                x->ops->dereg(x->tp[k], ep->rsend.mr[k]);
            x->ops->close(x->tp[k]);
        }
        free(ep->groups.idx[k]);
    }
    free(x->nic_of);
    free(ep->ready_ts);
    free(ep->flags);
    free(ep->path);
    free(ep->group_peers);
    fr_proxy_tables_release(ep);
}

/* Stamp doorbell word i as rung for epoch e at `ns` (beside it:
 * ep->ready_ts, the epoch stored last). */
static void nb_stamp(ferry_ep_t ep, size_t i, uint64_t e, uint64_t ns)
{
    ep->ready_ts[2 * i + 1] = ns;
    __atomic_store_n(&ep->ready_ts[2 * i], e, __ATOMIC_RELEASE);
}

/* A kernel's doorbells [i0, i0 + nf) for epoch e, watched: each stamped
 * when this thread first sees it rung, one look at every word per pass
 * (the stamp is as late as a pass after the word reached host memory;
 * the proxy takes its own first sight where that is earlier). */
static int nb_watch(ferry_ep_t ep, size_t i0, int nf, uint64_t e, fr_err_t *err)
{
    uint64_t deadline = fr_now_ns() + (uint64_t)ep->timeout_ms * 1000000ull;
    for (int left = nf, pass = 0; left > 0; pass++) {
        for (int g = 0; g < nf; g++) {
            size_t i = i0 + (size_t)g;
            if (ep->ready_ts[2 * i] == e ||
                __atomic_load_n(&ep->ready[i], __ATOMIC_ACQUIRE) != e)
                continue;
            nb_stamp(ep, i, e, fr_now_ns());
            left--;
        }
        if (left > 0 && (pass & 1023) == 1023 && fr_now_ns() > deadline)
            return FR_ERR(err, FERRY_ERR_TIMEOUT,
                          "null bench: %d doorbells of round %llu not rung", left,
                          (unsigned long long)e);
    }
    return FERRY_OK;
}

/* One phase of round e: a request per peer (a CPU rank), or a kernel
 * ringing every peer's doorbell (a GPU rank, watched by this thread; with
 * bells this thread rings them, stamped), then every peer's flag and
 * every write's completion. */
static int nb_phase(ferry_ep_t ep, int phase, uint64_t e, uint64_t bytes, const nb_gpu_t *gpu,
                    int bells, fr_err_t *err)
{
    int set = (int)(e & 1), nf = ep->nfabric;
    size_t i0 = ((size_t)phase * FR_NSETS + set) * nf;
    fr_slice_t *sl = ep->slices + i0;
    if (gpu && fr_nb_cuda_ring((fr_slice_t *)gpu->sl_dev + i0, (uint64_t *)gpu->ready_dev + i0,
                               nf, bytes, fr_imm_make(phase, e, 0), e, gpu->stream) != FERRY_OK)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "null bench: the doorbell kernel did not launch");
    int wrc = gpu ? nb_watch(ep, i0, nf, e, err) : FERRY_OK;
    if (wrc != FERRY_OK)
        return wrc;
    for (int g = 0; !gpu && g < nf; g++) { /* slice, then its doorbell or request */
        sl[g] = (fr_slice_t){.len = bytes, .imm = fr_imm_make(phase, e, 0)};
        if (bells) { /* 2: the time now, its epoch once every write landed */
            if (bells == 1)
                nb_stamp(ep, i0 + g, e, fr_now_ns());
            else
                ep->ready_ts[2 * (i0 + g) + 1] = fr_now_ns();
            __atomic_store_n(&ep->ready[i0 + g], e, __ATOMIC_RELEASE);
            continue;
        }
        int rc = fr_proxy_submit(ep, phase, set, e, g);
        if (rc != FERRY_OK)
            return FR_ERR(err, rc, "%s", ep->err.msg);
    }
    uint64_t iter = 0, deadline = fr_now_ns() + (uint64_t)ep->timeout_ms * 1000000ull;
    for (int s = 1; s <= nf; s++) {
        const uint64_t *f = fr_flag_ptr(&ep->L, ep->flags, phase, set, s);
        while (__atomic_load_n(f, __ATOMIC_ACQUIRE) != e ||
               (s == nf && fr_proxy_in_flight(ep, set) > 0)) {
            if (fr_async_status(&ep->async) != FERRY_OK)
                return FR_ERR(err, fr_async_status(&ep->async), "%s", ep->async.msg);
            if (fr_now_ns() > deadline)
                return FR_ERR(err, FERRY_ERR_TIMEOUT, "null bench: round %llu, peer %d",
                              (unsigned long long)e, s);
            fr_backoff(&iter, ep->spin);
        }
    }
    /* bells 2: the stamps once every write landed, after the proxy posted
     * them all (its delays wait for them: proxy.c) */
    for (int g = 0; !gpu && bells == 2 && g < nf; g++)
        __atomic_store_n(&ep->ready_ts[2 * (i0 + g)], e, __ATOMIC_RELEASE);
    return FERRY_OK;
}

int fr_proxy_bench_null(fr_proxy_bench_t *b)
{
    fr_err_t err = {{0}};
    struct ferry_ep ep;
    memset(&ep, 0, sizeof(ep));
    b->err[0] = 0;
    if (b->peers < 1 || b->peers >= FR_MAX_RANKS || b->rounds < 1 || b->warmup < 0) {
        snprintf(b->err, sizeof(b->err), "null bench: peers 1..%d, rounds >= 1, warmup >= 0",
                 FR_MAX_RANKS - 1);
        return FERRY_ERR_INVALID;
    }
    nb_gpu_t gpu = {0}, *gp = b->gpu ? &gpu : NULL;
    int rc = nb_setup(&ep, b->peers, b->bytes, gp, b->bells, &err);
    if (rc == FERRY_OK && (rc = fr_proxy_start(&ep)) != FERRY_OK)
        snprintf(err.msg, sizeof(err.msg), "%s", ep.err.msg);
    for (int r = 0; rc == FERRY_OK && r < b->warmup + b->rounds; r++) {
        if (r == b->warmup) { /* every write of the warm-up has completed */
            usleep(1000);     /* and the proxy has counted the last poll and
                                 every delay waiting for its stamp (at most
                                 100 us: proxy.c) */
            fr_proxy_stats_clear(&ep);
        }
        uint64_t e = (uint64_t)r + 1, t0 = fr_now_ns();
        if ((rc = nb_phase(&ep, FR_PH_DISPATCH, e, b->bytes, gp, b->bells, &err)) == FERRY_OK)
            rc = nb_phase(&ep, FR_PH_COMBINE, e, b->bytes, gp, b->bells, &err);
        if (rc == FERRY_OK && r >= b->warmup && b->round_us)
            b->round_us[r - b->warmup] = (double)(fr_now_ns() - t0) / 1e3;
    }
    if (ep.proxy.running && fr_proxy_stop(&ep) != 0) {
        snprintf(b->err, sizeof(b->err), "null bench: the proxy thread did not stop");
        return FERRY_ERR_INTERNAL; /* leaked: it may still touch the tables */
    }
    b->st.size = sizeof(b->st);
    fr_ep_stats_tp(&ep);
    fr_ep_stats_get(&ep, &b->st);
    if (rc != FERRY_OK)
        snprintf(b->err, sizeof(b->err), "%s", err.msg);
    if (gp)
        nb_gpu_free(&ep, gp);
    else if (b->bells)
        free(ep.ready);
    nb_free(&ep);
    return rc;
}
