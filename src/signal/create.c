/*
 * Put-with-signal: creating and freeing a context. Every rank checks its
 * config and tells every other its verdict before anything is opened;
 * then each allocates its heap, signal words, ring, mailbox and outbox
 * (host memory mapped for kernels on a CUDA context), opens one NIC of the
 * fabric transport with the ordering the strategy needs, registers the
 * regions and forms the peer groups (transport/nics.h), and starts the
 * proxy thread.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_signal.h"
#include "core/config.h"
#include "core/log.h"
#include "runtime/cuda_mem.h"
#include "runtime/rt.h"
#include "signal/sig_int.h"
#include "signal/signal.h"

/* What every rank tells every other at create. */
typedef struct fr_sig_hello {
    int32_t status;      /* this rank's config check */
    int32_t mode;
    uint64_t heap_bytes;
    uint32_t nsig;
    int32_t fence_ok;
    char why[400];
} fr_sig_hello_t;

void fr_sig_free(ferry_sig_t s)
{
    if (s->running) {
        if (fr_proxy_join(s->thread, &s->stop, FR_PROXY_JOIN_MS,
                          "put-with-signal destroy") != 0)
            return; /* the thread may still touch all of it */
        s->running = 0;
    }
    fr_nics_groups_destroy(&s->nics, &s->groups_heap);
    fr_nics_groups_destroy(&s->nics, &s->groups_mbox);
    fr_nics_dereg(&s->nics, &s->r_heap);
    fr_nics_dereg(&s->nics, &s->r_mbox);
    fr_nics_dereg(&s->nics, &s->r_out);
    fr_nics_close(&s->nics);
    if (s->cuda) {
        fr_cuda_host_free(s->heap);
        fr_cuda_host_free(s->signals);
        fr_cuda_host_free(s->ring);
        fr_cuda_host_free(s->errword);
        fr_cuda_dev_free(s->d_reserve);
    } else {
        free(s->heap);
        free(s->signals);
        free(s->ring);
    }
    free(s->mbox);
    free(s->outbox);
    if (s->dst)
        for (int d = 0; d < s->N; d++) {
            free(s->dst[d].done);
            free(s->dst[d].puts.v);
            free(s->dst[d].sigs.v);
        }
    if (s->src)
        for (int r = 0; r < s->N; r++)
            free(s->src[r].bits);
    free(s->dst);
    free(s->src);
    free(s->act);
    free(s->gidx);
    free(s);
}

/* This rank's verdict on cfg: the config check, the mode (the default
 * resolved from FERRY_SIGNAL_MODE), FI_FENCE for nicfence, CUDA. */
static void fr_sig_hello_fill(int N, const ferry_sig_config_t *cfg,
                              fr_sig_hello_t *mine)
{
    memset(mine, 0, sizeof(*mine));
    fr_err_t e = {{0}};
    mine->status = fr_sig_check_config(N, cfg, &e);
    long tmo;
    if (mine->status == FERRY_OK) /* FERRY_TIMEOUT_MS in range, on every rank */
        mine->status = fr_cfg_long(FR_CFG_TIMEOUT_MS, &tmo, &e);
    if (mine->status == FERRY_OK) {
        int mode = cfg->mode;
        if (mode == FERRY_SIG_MODE_DEFAULT) {
            mode = fr_sig_parse_mode(fr_cfg_str(FR_CFG_SIGNAL_MODE));
            if (mode < 0) {
                mine->status = FR_ERR(&e, FERRY_ERR_INVALID,
                                      "FERRY_SIGNAL_MODE=%s is not one of "
                                      "fence, grouped, nicfence, counted",
                                      fr_cfg_str(FR_CFG_SIGNAL_MODE));
                mode = 0;
            }
        }
        mine->mode = mode;
        mine->heap_bytes = cfg->heap_bytes;
        mine->nsig = cfg->num_signals;
        mine->fence_ok = 1;
        if (mode == FERRY_SIG_MODE_NICFENCE && mine->status == FERRY_OK) {
            const fr_transport_ops_t *fab = fr_transport_find("fabric");
            mine->fence_ok =
                fab && fab->fence_probe(mine->why, sizeof(mine->why));
            if (!mine->fence_ok)
                mine->status = FR_ERR(&e, FERRY_ERR_UNSUPPORTED,
                                      "mode nicfence: %s; use counted or "
                                      "grouped",
                                      mine->why);
        }
        if (mine->status == FERRY_OK && cfg->device == FERRY_DEVICE_CUDA) {
            char why[160];
            if (!ferry_cuda_available(why, sizeof(why)))
                mine->status = FR_ERR(&e, FERRY_ERR_UNSUPPORTED,
                                      "device = CUDA: %s", why);
        }
    }
    if (mine->status != FERRY_OK)
        snprintf(mine->why, sizeof(mine->why), "%.398s", e.msg);
}

/* Everyone learns everyone's verdict before anyone opens a thing: fails
 * (on every rank) when a rank refused or the ranks disagree. */
static int fr_sig_hello_exchange(ferry_comm_t comm, const fr_sig_hello_t *mine)
{
    fr_err_t *cerr = &comm->err;
    int N = comm->size;
    fr_sig_hello_t *all = calloc((size_t)N, sizeof(*all));
    if (!all)
        return FR_ERR(cerr, FERRY_ERR_NOMEM, "sig create: out of memory");
    int rc = fr_boot_allgather(comm->boot, mine, all, sizeof(*mine), cerr);
    if (rc != FERRY_OK) {
        free(all);
        return rc;
    }
    for (int r = 0; r < N && rc == FERRY_OK; r++) {
        if (all[r].status != FERRY_OK) {
            all[r].why[sizeof(all[r].why) - 1] = '\0';
            rc = FR_ERR(cerr, all[r].status, "sig create: rank %d: %s", r,
                        all[r].why);
        } else if (all[r].mode != all[0].mode ||
                   all[r].heap_bytes != all[0].heap_bytes ||
                   all[r].nsig != all[0].nsig) {
            rc = FR_ERR(cerr, FERRY_ERR_INVALID,
                        "sig create: rank %d asked for mode %s, heap_bytes "
                        "%llu, num_signals %u but rank 0 for %s, %llu, %u",
                        r, ferry_sig_mode_name(all[r].mode),
                        (unsigned long long)all[r].heap_bytes, all[r].nsig,
                        ferry_sig_mode_name(all[0].mode),
                        (unsigned long long)all[0].heap_bytes, all[0].nsig);
        }
    }
    free(all);
    return rc;
}

static void *fr_sig_pages(size_t bytes)
{
    size_t n = (bytes + 4095) & ~(size_t)4095;
    void *p = aligned_alloc(4096, n);
    if (p)
        memset(p, 0, n);
    return p;
}

/* Heap, signal words, ring (mapped for kernels on a CUDA context). */
static int fr_sig_alloc_shared(ferry_sig_t s, fr_err_t *err)
{
    size_t ring_bytes = sizeof(ferry_sig_ring_t) +
                        sizeof(ferry_sig_req_t) * (FR_SIG_RING - 1);
    size_t sig_bytes = sizeof(uint64_t) * s->nsig;
    if (s->cuda) {
        void *dv;
        int rc;
        if ((rc = fr_cuda_host_alloc(s->heap_bytes, (void **)&s->heap,
                                     &s->d_heap, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(sig_bytes, (void **)&s->signals,
                                     &s->d_signals, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(ring_bytes, (void **)&s->ring,
                                     &s->d_ring, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(2 * sizeof(int), (void **)&s->errword, &dv,
                                     err)) != FERRY_OK ||
            (rc = fr_cuda_dev_word(&s->d_reserve, err)) != FERRY_OK)
            return rc;
        s->d_errword = dv;
    } else {
        s->heap = fr_sig_pages(s->heap_bytes);
        s->signals = fr_sig_pages(sig_bytes);
        s->ring = fr_sig_pages(ring_bytes);
        if (!s->heap || !s->signals || !s->ring)
            return FR_ERR(err, FERRY_ERR_NOMEM,
                          "out of memory for a heap of %llu bytes",
                          (unsigned long long)s->heap_bytes);
    }
    return FERRY_OK;
}

/* Everything else: mailbox, outbox and the proxy's tables. */
static int fr_sig_alloc(ferry_sig_t s, fr_err_t *err)
{
    int rc = fr_sig_alloc_shared(s, err);
    if (rc != FERRY_OK)
        return rc;
    s->mbox_bytes = (size_t)s->N * FR_SIG_MBOX * FR_SIG_REC;
    s->mbox = fr_sig_pages(s->mbox_bytes);
    s->outbox = fr_sig_pages(s->mbox_bytes);
    s->dst = calloc((size_t)s->N, sizeof(*s->dst));
    s->src = calloc((size_t)s->N, sizeof(*s->src));
    s->act = calloc((size_t)s->N, sizeof(*s->act));
    s->gidx = calloc((size_t)s->N, sizeof(*s->gidx));
    if (!s->mbox || !s->outbox || !s->dst || !s->src || !s->act || !s->gidx)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    for (int r = 0; r < s->N; r++) {
        if (r == s->rank)
            continue;
        s->dst[r].done = calloc(FR_SIG_TXWIN, 1);
        s->src[r].bits = calloc(FR_SIG_RXWIN / 8, 1);
        if (!s->dst[r].done || !s->src[r].bits)
            return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    }
    return FERRY_OK;
}

/* A new context from the agreed config (nothing allocated yet). */
static ferry_sig_t fr_sig_new(ferry_comm_t comm, const ferry_sig_config_t *cfg,
                              int mode)
{
    ferry_sig_t s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->comm = comm;
    s->rank = comm->rank;
    s->N = comm->size;
    s->mode = mode;
    s->cuda = cfg->device == FERRY_DEVICE_CUDA;
    s->heap_bytes = cfg->heap_bytes;
    s->nsig = cfg->num_signals;
    fr_cfg_long(FR_CFG_TIMEOUT_MS, &s->timeout_ms, NULL); /* checked in the hello */
    s->spin = fr_cfg_int(FR_CFG_SPIN);
    return s;
}

/* Allocate, then tell every rank how that went. A local failure still
 * joins the exchange (with a status), so no rank waits for one that gave
 * up. */
static int fr_sig_alloc_all(ferry_sig_t s, fr_err_t *err)
{
    int lrc = fr_sig_alloc(s, err);
    int st[2] = {lrc, 0}, *sts = calloc((size_t)s->N, sizeof(st));
    if (!sts)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    int rc = fr_boot_allgather(s->comm->boot, st, sts, sizeof(st), err);
    for (int r = 0; r < s->N && rc == FERRY_OK; r++)
        if (sts[r * 2] != FERRY_OK)
            rc = r == s->rank ? sts[r * 2]
                              : FR_ERR(err, FERRY_ERR_PEER,
                                       "rank %d could not allocate its "
                                       "buffers", r);
    free(sts);
    return rc;
}

/* Open one NIC, register heap and mailbox (peers write into them) and the
 * outbox (records' source), form the heap and mailbox groups of every
 * other rank. Collective. */
static int fr_sig_open_transport(ferry_sig_t s, fr_err_t *err)
{
    fr_boot_t *boot = s->comm->boot;
    /* fence and grouped wait for local completions as ordering points:
     * those must mean "visible at the target" (shm completes a small
     * write before the target has it) */
    int flags = s->mode == FERRY_SIG_MODE_NICFENCE  ? FR_TP_OPEN_FENCE
                : s->mode == FERRY_SIG_MODE_COUNTED ? 0
                                                    : FR_TP_OPEN_DELIVERY;
    int rc = fr_nics_open(&s->nics, boot, "fabric", 1, flags, err);
    if (rc != FERRY_OK)
        return rc;
    s->nics.quiet = 1;
    s->ops = s->nics.ops;
    s->tp = s->nics.tp[0];
    if ((rc = fr_nics_reg(&s->nics, boot, s->heap, s->heap_bytes, 1,
                          &s->r_heap, err)) != FERRY_OK ||
        (rc = fr_nics_reg(&s->nics, boot, s->mbox, s->mbox_bytes, 1,
                          &s->r_mbox, err)) != FERRY_OK ||
        (rc = fr_nics_reg(&s->nics, boot, s->outbox, s->mbox_bytes, 0,
                          &s->r_out, err)) != FERRY_OK)
        return rc;
    int *peers = calloc((size_t)s->N, sizeof(int));
    if (!peers)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    int np = 0;
    for (int r = 0; r < s->N; r++)
        if (r != s->rank)
            peers[np++] = r;
    if ((rc = fr_nics_groups(&s->nics, peers, np, &s->r_heap, &s->r_heap,
                             &s->groups_heap, err)) == FERRY_OK)
        rc = fr_nics_groups(&s->nics, peers, np, &s->r_out, &s->r_mbox,
                            &s->groups_mbox, err);
    if (rc == FERRY_OK) {
        /* one NIC: every peer is in NIC 0's groups, in the same order */
        s->g_heap = s->groups_heap.g[0];
        s->g_mbox = s->groups_mbox.g[0];
        for (int r = 0; r < s->N; r++)
            s->gidx[r] = -1;
        for (int i = 0; i < s->groups_heap.n[0]; i++)
            s->gidx[peers[s->groups_heap.idx[0][i]]] = i;
    }
    free(peers);
    return rc;
}

/* Start the proxy; nobody writes before every rank's proxy is up. */
static int fr_sig_start(ferry_sig_t s, fr_err_t *err)
{
    int e2 = pthread_create(&s->thread, NULL, fr_sig_main, s);
    if (e2 != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "starting the proxy thread: %s",
                      strerror(e2));
    s->running = 1;
    return fr_boot_barrier(s->comm->boot, err);
}

int ferry_sig_create(ferry_comm_t comm, const ferry_sig_config_t *cfg,
                     ferry_sig_t *out)
{
    if (!out)
        return FERRY_ERR_INVALID;
    *out = NULL;
    if (!comm)
        return FERRY_ERR_INVALID;
    fr_err_t *cerr = &comm->err;
    fr_sig_hello_t mine;
    fr_sig_hello_fill(comm->size, cfg, &mine);
    int rc = fr_sig_hello_exchange(comm, &mine);
    if (rc != FERRY_OK)
        return rc;
    ferry_sig_t s = fr_sig_new(comm, cfg, mine.mode);
    if (!s)
        return FR_ERR(cerr, FERRY_ERR_NOMEM, "sig create: out of memory");
    fr_err_t err = {{0}};
    if ((rc = fr_sig_alloc_all(s, &err)) != FERRY_OK ||
        (rc = fr_sig_open_transport(s, &err)) != FERRY_OK ||
        (rc = fr_sig_start(s, &err)) != FERRY_OK) {
        snprintf(cerr->msg, sizeof(cerr->msg), "sig create: %.490s", err.msg);
        fr_sig_free(s);
        return rc;
    }
    FR_LOG_INFO(FR_SUB_SIG,
                "put-with-signal: %d ranks, mode %s, heap %llu bytes, %u "
                "signals, provider %s, %s",
                s->N, ferry_sig_mode_name(s->mode),
                (unsigned long long)s->heap_bytes, s->nsig,
                s->ops->provider(s->tp), s->cuda ? "CUDA" : "CPU");
    *out = s;
    __atomic_add_fetch(&comm->users, 1, __ATOMIC_ACQ_REL);
    return FERRY_OK;
}
