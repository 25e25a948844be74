/*
 * The null transport: for benchmarks of the proxy alone, never chosen by
 * default (only opened by its name, "null"; the EP's paths always open
 * "fabric"). It moves no bytes and talks to nobody. A write is checked
 * against the registered lengths as the fabric transport checks it, then
 * completes at once: poll() returns its local completion (FR_CQE_TX with
 * the ctx) and an arrival standing for the peer's answer, the immediate
 * with its sender field set to that peer (a low-latency immediate: phase,
 * epoch, sender), as if every peer wrote back to this rank in the same
 * phase and round. So one process can drive a proxy with any number of
 * simulated peers and measure ferry's own cost per write, without a
 * provider's copies or other processes. What lands is nothing: results
 * built on it cannot be verified.
 *
 * open() exchanges nothing (boot may be NULL); has_peer() is 1 for every
 * rank. Threading: one thread at a time per instance.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"
#include "transport/transport.h"

struct fr_transport {
    fr_cqe_t *q;        /* completions waiting for poll: a growing ring */
    size_t head, n, cap;
    long inflight;      /* writes whose TX completion is still queued */
};

struct fr_mr {
    uint64_t len;
};

struct fr_group {
    int npeers;
    uint64_t slen;
    int *rank;
    uint64_t *rlen;
};

static int nul_open(fr_boot_t *boot, int nic, int flags, fr_transport_t **t, fr_err_t *err)
{
    *t = calloc(1, sizeof(**t));
    if (!*t)
        return FR_ERR(err, FERRY_ERR_NOMEM, "null transport");
    return FERRY_OK;
}

static int nul_reg(fr_transport_t *t, void *ptr, size_t len, int remote_write, fr_mr_t **mr,
                   fr_mr_desc_t *desc, fr_err_t *err)
{
    *mr = calloc(1, sizeof(**mr));
    if (!*mr)
        return FR_ERR(err, FERRY_ERR_NOMEM, "null transport: registration");
    (*mr)->len = len;
    if (desc)
        *desc = (fr_mr_desc_t){.base = 0, .key = 0, .len = len};
    return FERRY_OK;
}

static int nul_reg_dev(fr_transport_t *t, void *ptr, size_t len, int remote_write, int device,
                       fr_mr_t **mr, fr_mr_desc_t *desc, fr_err_t *err)
{
    if (device >= 0)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "null transport: no device memory");
    return nul_reg(t, ptr, len, remote_write, mr, desc, err);
}

static void nul_dereg(fr_transport_t *t, fr_mr_t *mr) { free(mr); }

static int nul_group_create(fr_transport_t *t, const int *peers, int npeers, fr_mr_t *src,
                            const fr_mr_desc_t *remote, fr_group_t **g, fr_err_t *err)
{
    fr_group_t *x = calloc(1, sizeof(*x));
    int n = npeers > 0 ? npeers : 1;
    if (x) {
        x->rank = calloc((size_t)n, sizeof(int));
        x->rlen = calloc((size_t)n, sizeof(uint64_t));
    }
    if (!x || !x->rank || !x->rlen) {
        if (x) {
            free(x->rank);
            free(x->rlen);
        }
        free(x);
        return FR_ERR(err, FERRY_ERR_NOMEM, "null transport: group of %d", npeers);
    }
    x->npeers = npeers;
    x->slen = src ? src->len : 0;
    for (int i = 0; i < npeers; i++) {
        x->rank[i] = peers[i];
        x->rlen[i] = remote[i].len;
    }
    *g = x;
    return FERRY_OK;
}

static void nul_group_destroy(fr_transport_t *t, fr_group_t *g)
{
    if (!g)
        return;
    free(g->rank);
    free(g->rlen);
    free(g);
}

/* Room for m more completions (grown before a call posts any write, so
 * a call never fails halfway through its writes). */
static int nul_room(fr_transport_t *t, size_t m)
{
    if (t->n + m > t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 1024;
        while (cap < t->n + m)
            cap *= 2;
        fr_cqe_t *q = malloc(cap * sizeof(*q));
        if (!q)
            return -1;
        for (size_t i = 0; i < t->n; i++)
            q[i] = t->q[(t->head + i) % t->cap];
        free(t->q);
        t->q = q;
        t->head = 0;
        t->cap = cap;
    }
    return 0;
}

static int nul_push(fr_transport_t *t, fr_cqe_t c)
{
    if (nul_room(t, 1) != 0)
        return -1;
    t->q[(t->head + t->n++) % t->cap] = c;
    return 0;
}

/* Write i's checks: the index and the bounds, as the fabric transport
 * checks them. */
static int nul_check(const fr_group_t *g, int i, const fr_slice_t *s, fr_err_t *err)
{
    if (i < 0 || i >= g->npeers)
        return FR_ERR(err, FERRY_ERR_INVALID, "null: peer index %d of %d", i, g->npeers);
    return fr_slice_in_bounds("null", i, g->rank[i], s, g->slen, g->rlen[i], err);
}

/* A checked write: its local completion and the simulated peer's
 * arrival. */
static int nul_put(fr_transport_t *t, fr_group_t *g, int i, const fr_slice_t *s, uint64_t ctx,
                   fr_err_t *err)
{
    uint32_t mask = (1u << FR_IMM_SENDER_BITS) - 1;
    fr_cqe_t tx = {.kind = FR_CQE_TX, .peer = g->rank[i], .ctx = ctx};
    fr_cqe_t rx = {.kind = FR_CQE_RX, .imm = (s->imm & ~mask) | ((uint32_t)g->rank[i] & mask),
                   .peer = -1};
    if (nul_push(t, tx) != 0 || nul_push(t, rx) != 0)
        return FR_ERR(err, FERRY_ERR_NOMEM, "null: completion queue");
    t->inflight++;
    return FERRY_OK;
}

static int nul_one(fr_transport_t *t, fr_group_t *g, int i, const fr_slice_t *s, uint64_t ctx,
                   fr_err_t *err)
{
    int rc = nul_check(g, i, s, err);
    return rc != FERRY_OK ? rc : nul_put(t, g, i, s, ctx, err);
}

/* n writes, slices[i] to member index[i] (index NULL: member i): all
 * checked and their completions' room made before any is posted (all
 * posted, or none: scatter, write_batch). */
static int nul_many(fr_transport_t *t, fr_group_t *g, const int *index, const fr_slice_t *slices,
                    int n, uint64_t ctx, fr_err_t *err)
{
    for (int i = 0; i < n; i++) {
        int rc = nul_check(g, index ? index[i] : i, &slices[i], err);
        if (rc != FERRY_OK)
            return rc;
    }
    if (nul_room(t, 2 * (size_t)n) != 0)
        return FR_ERR(err, FERRY_ERR_NOMEM, "null: completion queue");
    for (int i = 0; i < n; i++)
        nul_put(t, g, index ? index[i] : i, &slices[i], ctx, err); /* room made: cannot fail */
    return FERRY_OK;
}

static int nul_scatter(fr_transport_t *t, fr_group_t *g, const fr_slice_t *slices, uint64_t ctx,
                       fr_err_t *err)
{
    return nul_many(t, g, NULL, slices, g->npeers, ctx, err);
}

static int nul_barrier(fr_transport_t *t, fr_group_t *g, uint32_t imm, uint64_t ctx,
                       fr_err_t *err)
{
    for (int i = 0; i < g->npeers; i++) {
        fr_slice_t s = {.imm = imm};
        int rc = nul_one(t, g, i, &s, ctx, err);
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

static int nul_write_imm(fr_transport_t *t, fr_group_t *g, int index, const fr_slice_t *slice,
                         uint64_t ctx, fr_err_t *err)
{
    return nul_one(t, g, index, slice, ctx, err);
}

static int nul_write_batch(fr_transport_t *t, fr_group_t *g, const int *index,
                           const fr_slice_t *slices, int n, uint64_t ctx, fr_err_t *err)
{
    return nul_many(t, g, index, slices, n, ctx, err);
}

static int nul_poll(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err)
{
    int k = 0;
    for (; k < max && t->n > 0; k++) {
        out[k] = t->q[t->head];
        t->head = (t->head + 1) % t->cap;
        t->n--;
        if (out[k].kind == FR_CQE_TX)
            t->inflight--;
    }
    return k;
}

static int nul_pending(fr_transport_t *t) { return (int)t->inflight; }

static void nul_close(fr_transport_t *t)
{
    if (!t)
        return;
    free(t->q);
    free(t);
}

static const char *nul_provider(fr_transport_t *t) { return "null"; }
static int nul_has_peer(fr_transport_t *t, int rank) { return rank >= 0; }
static const char *nul_iface(fr_transport_t *t) { return "null"; }

static int nul_fence_probe(char *why, size_t len)
{
    snprintf(why, len, "null transport: no fence");
    return 0;
}

static void nul_hmem_probe(int device, void *ptr, size_t len, fr_tp_hmem_t *out)
{
    memset(out, 0, sizeof(*out));
    snprintf(out->prov, sizeof(out->prov), "null");
    snprintf(out->why, sizeof(out->why), "null transport: host memory only");
}

/* No provider: nothing is spent inside one. */
static void nul_stats(fr_transport_t *t, fr_tp_stats_t *out) { *out = (fr_tp_stats_t){0}; }

const fr_transport_ops_t fr_transport_null = {
    .size = sizeof(fr_transport_ops_t),
    .name = "null",
    .open = nul_open,
    .reg = nul_reg,
    .dereg = nul_dereg,
    .group_create = nul_group_create,
    .group_destroy = nul_group_destroy,
    .scatter = nul_scatter,
    .barrier = nul_barrier,
    .write_imm = nul_write_imm,
    .write_batch = nul_write_batch,
    .poll = nul_poll,
    .pending = nul_pending,
    .close = nul_close,
    .provider = nul_provider,
    .has_peer = nul_has_peer,
    .iface = nul_iface,
    .fence_probe = nul_fence_probe,
    .write_fence = nul_write_imm,
    .hmem_probe = nul_hmem_probe,
    .reg_dev = nul_reg_dev,
    .stats = nul_stats,
};
