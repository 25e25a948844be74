/*
 * The CUDA high-throughput engine's fabric thread (protocol in fab.h and
 * docs/architecture.md, "GPU ranks across nodes").
 *
 * Immediate (32 bits): kind << 29 | source rank << (29 - S) | channel <<
 * (22 - S) | value, S = bits(N) (fab.h: the format follows from N and the
 * ring, the same on every rank; 4 bits at N <= 16, 10 at 1024). Records:
 * value = lap << 2R | first slot << R | (count - 1), R = bits(RT), a
 * run of slots that does not wrap, lap the parity of its position over
 * the ring's size; runs may land in any order, so the receiver marks
 * slots and counts the ring's tail only over slots landed in order, and
 * a run whose lap is not the one its slots are due in (a stale or
 * repeated write) is a protocol error, as is a tail past the room this
 * rank gave back.
 * Heads: value = how far the head moved (sums commute, so credits may
 * land in any order). Notify: channel = the route number's parity, value
 * = its low 22 - S bits (the receiver knows the number: each parity's
 * advance by 2).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "core/log.h"
#include "engines/cuda_ht/fab.h"
#include "ep/hmem.h"
#include "runtime/rt.h"


/* Bits to hold 0 .. n - 1 (at least 1). */
static unsigned fr_fab_bits(unsigned long n)
{
    unsigned b = 1;
    while ((1ul << b) < n)
        b++;
    return b;
}

int fr_cuht_fab_fmt(int N, int RT, fr_cuht_fab_fmt_t *fmt, char *why, size_t whylen)
{
    unsigned sb = fr_fab_bits((unsigned long)N), rb = fr_fab_bits((unsigned long)RT);
    unsigned used = 3 + sb + FR_CUHT_FAB_CBITS;
    if (used + 2 * rb + 1 > 32 || RT > FR_CUHT_FAB_RT_MAX) {
        int most = used + 3 > 32 ? 0 : 1 << ((32 - used - 1) / 2);
        most = most < FR_CUHT_FAB_RT_MAX ? most : FR_CUHT_FAB_RT_MAX;
        if (why)
            snprintf(why, whylen, "%d ranks with rings of %d records (a 32-bit immediate holds "
                     "the source rank, the channel and a run of slots: at most %d records a "
                     "ring at %d ranks)", N, RT, most, N);
        return -1;
    }
    fmt->sbits = sb;
    fmt->rbits = rb;
    fmt->vbits = 32 - used;
    return 0;
}

static uint32_t fr_fab_vmax(const fr_cuht_fab_t *f)
{
    return (1u << f->fmt.vbits) - 1u;
}

uint32_t fr_cuht_fab_imm(const fr_cuht_fab_fmt_t *fmt, int kind, int src, int c, uint32_t val)
{
    unsigned vb = fmt->vbits;
    return (uint32_t)kind << 29 | (uint32_t)src << (vb + FR_CUHT_FAB_CBITS) |
           (uint32_t)c << vb | val;
}

static uint32_t fr_fab_imm(const fr_cuht_fab_t *f, int kind, int src, int c, uint32_t val)
{
    return fr_cuht_fab_imm(&f->fmt, kind, src, c, val);
}

/* The context's asynchronous error (the next call reports it), and the
 * kernels' abort word, so that none keeps waiting for data this thread
 * will not deliver. */
static void fr_fab_fail(ferry_ep_t ep, fr_cuht_fab_t *f, int code, int peer, const char *fmt,
                        ...) __attribute__((format(printf, 5, 6)));
static void fr_fab_fail(ferry_ep_t ep, fr_cuht_fab_t *f, int code, int peer, const char *fmt,
                        ...)
{
    if (f->abort)
        __atomic_store_n(f->abort, code ? code : FERRY_ERR_INTERNAL, __ATOMIC_RELEASE);
    char msg[FR_ERRMSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fr_ep_async_fail(ep, code, peer, "%s", msg);
}

/* The (kind, fabric peer, channel) entry of the [2][nf][C] tables. */
static size_t fr_fab_ix(const fr_cuht_fab_t *f, int k, int g, int c)
{
    return ((size_t)k * (size_t)f->nf + (size_t)g) * (size_t)f->G.C + (size_t)c;
}

int fr_cuht_fab_init(ferry_ep_t ep, fr_cuht_fab_t *f)
{
    size_t nf = (size_t)ep->nfabric, C = (size_t)f->G.C, RT = (size_t)f->G.RT;
    f->nf = ep->nfabric;
    if (fr_cuht_fab_fmt(f->G.N, f->G.RT, &f->fmt, NULL, 0) != 0)
        return FERRY_ERR_INTERNAL; /* refused before: fr_cuht_fabric_native */
    f->gnic = calloc(nf, sizeof(int));
    f->gpos = calloc(nf, sizeof(int));
    uint64_t **t[] = {&f->posted, &f->cred, &f->tail, &f->head};
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
        *t[i] = calloc(2 * nf * C, sizeof(uint64_t));
    f->landed = calloc(2 * nf * C * RT, 1);
    f->nsent = calloc(2 * nf, sizeof(uint64_t));
    f->nlast = calloc(2 * nf, sizeof(uint64_t));
    if (!f->gnic || !f->gpos || !f->posted || !f->cred || !f->tail || !f->head ||
        !f->landed || !f->nsent || !f->nlast)
        return FERRY_ERR_NOMEM;
    fr_nics_groups_places(&ep->nics, &ep->groups, f->nf, f->gnic, f->gpos);
    return FERRY_OK;
}

void fr_cuht_fab_free(fr_cuht_fab_t *f)
{
    free(f->gnic);
    free(f->gpos);
    free(f->posted);
    free(f->cred);
    free(f->tail);
    free(f->head);
    free(f->landed);
    free(f->nsent);
    free(f->nlast);
    free(f->hello);
}

static uint64_t fr_fab_ld(const uint8_t *base, uint64_t off)
{
    return __atomic_load_n((const uint64_t *)(base + off), __ATOMIC_ACQUIRE);
}

static void fr_fab_st(uint8_t *base, uint64_t off, uint64_t v)
{
    __atomic_store_n((uint64_t *)(base + off), v, __ATOMIC_RELEASE);
}

/* One write from the outbox (send region) to fabric peer g's segment. */
static int fr_fab_post(ferry_ep_t ep, fr_cuht_fab_t *f, int g, uint64_t src_off,
                       uint64_t dst_off, uint64_t len, uint32_t imm)
{
    int k = f->gnic[g];
    fr_slice_t sl = {.src_off = src_off, .dst_off = dst_off, .len = len, .imm = imm};
    fr_err_t err = {{0}};
    uint64_t t0 = fr_now_ns(); /* the EP's counters (ep/stats.h) */
    int rc = ep->nics.ops->write_imm(ep->nics.tp[k], ep->groups.g[k], f->gpos[g], &sl,
                                     (uint64_t)g, &err);
    fr_stat_add(&ep->st.post_ns, fr_now_ns() - t0);
    fr_stat_add(&ep->st.requests, 1);
    if (rc != FERRY_OK) {
        fr_fab_fail(ep, f, FERRY_ERR_FABRIC, ep->group_peers[g], "ht: write to rank %d: %s (%s)",
                    ep->group_peers[g], err.msg, ferry_strerror(rc));
        return rc;
    }
    f->pending++;
    fr_stat_add(&ep->st.writes, 1);
    fr_stat_add(&ep->st.bytes, len);
    return FERRY_OK;
}

/* What the kernels stored for fabric peer g since the last pass, sent:
 * new records of every ring (k, c), heads, notify entries. */
static int fr_fab_scan_peer(ferry_ep_t ep, fr_cuht_fab_t *f, int g)
{
    const fr_cuht_geo_t *G = &f->G;
    int C = G->C, me = G->rank, d = ep->group_peers[g], work = 0;
    uint64_t RT = (uint64_t)G->RT;
    const uint8_t *o = f->out + (size_t)g * G->hdr_bytes;
    for (int k = 0; k < 2; k++) {
        uint64_t rec = k ? G->crec : G->drec;
        for (int c = 0; c < C; c++) {
            size_t i = fr_fab_ix(f, k, g, c);
            uint64_t t = fr_fab_ld(o, fr_cuht_geo_ctr(G, k ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, c, me));
            if (t < f->posted[i] || t - f->head[i] > RT) {
                fr_fab_fail(ep, f, FERRY_ERR_INTERNAL, d, "ht: %s ring %d to rank %d: tail %llu "
                            "after %llu posted, %llu taken", k ? "combine" : "dispatch", c, d, (unsigned long long)t,
                            (unsigned long long)f->posted[i], (unsigned long long)f->head[i]);
                return -1;
            }
            while (t > f->posted[i]) {
                uint64_t slot = f->posted[i] % RT, n = t - f->posted[i];
                n = n < RT - slot ? n : RT - slot;
                uint64_t src = (uint64_t)g * G->ob_bytes + fr_cuht_geo_obring(G, k, c) + slot * rec;
                uint64_t dst = fr_cuht_geo_ring(G, k, c, me) + slot * rec;
                unsigned rb = f->fmt.rbits;
                uint32_t v = (uint32_t)((f->posted[i] / RT & 1) << (2 * rb) | slot << rb |
                                        (n - 1));
                if (fr_fab_post(ep, f, g, src, dst, n * rec,
                                fr_fab_imm(f, k ? FR_FAB_CDATA : FR_FAB_DDATA, me, c, v)))
                    return -1;
                f->posted[i] += n;
                work = 1;
            }
            uint64_t h = fr_fab_ld(o, fr_cuht_geo_ctr(G, k ? FR_CUHT_CHEAD : FR_CUHT_DHEAD, c, me));
            if (h > f->cred[i]) {
                uint64_t delta = h - f->cred[i];
                if (delta > fr_fab_vmax(f)) {
                    fr_fab_fail(ep, f, FERRY_ERR_INTERNAL, d, "ht: the head of rank %d's %s "
                                "ring %d here moved by %llu at once", d, k ? "combine" : "dispatch",
                                c, (unsigned long long)delta);
                    return -1;
                }
                if (fr_fab_post(ep, f, g, 0, 0, 0,
                                fr_fab_imm(f, k ? FR_FAB_CHEAD : FR_FAB_DHEAD, me, c,
                                           (uint32_t)delta)))
                    return -1;
                f->cred[i] = h;
                work = 1;
            }
        }
    }
    for (int par = 0; par < 2; par++) {
        uint64_t id = fr_fab_ld(o, fr_cuht_geo_notify(G, par, me));
        uint64_t *sent = &f->nsent[(size_t)g * 2 + (size_t)par];
        if (id <= *sent)
            continue;
        uint64_t off = fr_cuht_geo_notify(G, par, me);
        if (fr_fab_post(ep, f, g, (uint64_t)g * G->ob_bytes + off, off, G->notify_entry,
                        fr_fab_imm(f, FR_FAB_NOTIFY, me, par, (uint32_t)(id & fr_fab_vmax(f)))))
            return -1;
        *sent = id;
        work = 1;
    }
    return work;
}

/* A run of records landed: mark its slots, count the tail over those in
 * order. */
static int fr_fab_land(ferry_ep_t ep, fr_cuht_fab_t *f, int k, int g, int s, int c, uint32_t v)
{
    const fr_cuht_geo_t *G = &f->G;
    unsigned rb = f->fmt.rbits;
    uint64_t RT = (uint64_t)G->RT, rm = (1u << rb) - 1u;
    uint64_t slot = v >> rb & rm, n = (v & rm) + 1, lap = v >> (2 * rb) & 1u;
    size_t i = fr_fab_ix(f, k, g, c);
    uint8_t *L = f->landed + i * RT;
    const char *ring = k ? "combine" : "dispatch";
    if (slot + n > RT) {
        fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d wrote slots %llu..%llu of a ring "
                    "of %llu", s, (unsigned long long)slot, (unsigned long long)(slot + n - 1),
                    (unsigned long long)RT);
        return -1;
    }
    for (uint64_t j = slot; j < slot + n; j++) {
        /* the slot's place at or after the tail, and the lap it is in */
        uint64_t pos = f->tail[i] + (j + RT - f->tail[i] % RT) % RT;
        if ((pos / RT & 1) != lap) {
            fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d wrote slot %llu of its %s "
                        "ring %d here out of turn (a stale or repeated write)", s,
                        (unsigned long long)j, ring, c);
            return -1;
        }
        if (L[j]) {
            fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d wrote slot %llu of its %s "
                        "ring %d here twice before it was taken", s, (unsigned long long)j,
                        ring, c);
            return -1;
        }
        L[j] = 1;
    }
    uint64_t t0 = f->tail[i];
    while (L[f->tail[i] % RT] && f->tail[i] - t0 < RT) {
        L[f->tail[i] % RT] = 0;
        f->tail[i]++;
    }
    if (f->tail[i] > f->cred[i] + RT) { /* the sender had no room for these */
        fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d wrote %llu records of its %s "
                    "ring %d here past the room it was given", s,
                    (unsigned long long)(f->tail[i] - f->cred[i] - RT), ring, c);
        return -1;
    }
    if (f->tail[i] != t0)
        fr_fab_st(f->in, fr_cuht_geo_ctr(G, k ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, c, s), f->tail[i]);
    return 0;
}

/* An immediate that landed here (after the batch's flush). */
static int fr_fab_rx(ferry_ep_t ep, fr_cuht_fab_t *f, uint32_t imm)
{
    const fr_cuht_geo_t *G = &f->G;
    unsigned vb = f->fmt.vbits;
    int kind = (int)(imm >> 29);
    int s = (int)(imm >> (vb + FR_CUHT_FAB_CBITS) & ((1u << f->fmt.sbits) - 1u));
    int c = (int)(imm >> vb & ((1u << FR_CUHT_FAB_CBITS) - 1u));
    uint32_t v = imm & fr_fab_vmax(f);
    int g = s < ep->N ? ep->group_index[s] : -1;
    if (kind == FR_FAB_HELLO && g >= 0 && f->hello) {
        f->hello[g] = 1;
        return 0;
    }
    if (g < 0 || kind < FR_FAB_DDATA || kind > FR_FAB_NOTIFY ||
        (kind == FR_FAB_NOTIFY ? c > 1 : c >= G->C)) {
        fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: unexpected immediate 0x%08x (rank %d)",
                    imm, s);
        return -1;
    }
    if (kind == FR_FAB_DDATA || kind == FR_FAB_CDATA)
        return fr_fab_land(ep, f, kind == FR_FAB_CDATA, g, s, c, v);
    if (kind == FR_FAB_NOTIFY) {
        uint64_t *last = &f->nlast[(size_t)g * 2 + (size_t)c];
        uint64_t want = *last ? *last + 2 : (c ? 1 : 2);
        if ((want & fr_fab_vmax(f)) != v) {
            fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d sent the counts of route %u, "
                        "this rank expects route %llu next (every rank creates the same routes "
                        "in the same order)", s, v, (unsigned long long)want);
            return -1;
        }
        *last = want;
        fr_fab_st(f->in, fr_cuht_geo_notify(G, c, s), want);
        return 0;
    }
    int k = kind == FR_FAB_CHEAD;
    size_t i = fr_fab_ix(f, k, g, c);
    f->head[i] += v;
    if (f->head[i] > f->posted[i]) {
        fr_fab_fail(ep, f, FERRY_ERR_PROTOCOL, s, "ht: rank %d took %llu records of %s ring "
                    "%d, %llu were sent", s, (unsigned long long)f->head[i], k ? "combine" : "dispatch", c,
                    (unsigned long long)f->posted[i]);
        return -1;
    }
    fr_fab_st(f->in, fr_cuht_geo_ctr(G, k ? FR_CUHT_CHEAD : FR_CUHT_DHEAD, c, s), f->head[i]);
    return 0;
}

/* Completions of every NIC: own writes done, peers' writes landed (their
 * bytes made visible to the GPU once per batch, before any word). */
static int fr_fab_poll(ferry_ep_t ep, fr_cuht_fab_t *f)
{
    fr_cqe_t cqe[64];
    int n = 0;
    fr_err_t err = {{0}};
    uint64_t t0 = fr_now_ns();
    for (int k = 0; k < ep->nics.n && n < 48; k++) {
        int got = ep->nics.ops->poll(ep->nics.tp[k], cqe + n, 64 - n, &err);
        if (got < 0) {
            fr_fab_fail(ep, f, got, -1, "ht: polling NIC %d (%s): %s", k,
                        ep->nics.ops->iface(ep->nics.tp[k]), err.msg);
            return -1;
        }
        n += got;
    }
    const char *what = "";
    if (n > 0 && fr_ep_rx_visible(ep, cqe, n, &what) != 0) {
        fr_fab_fail(ep, f, FERRY_ERR_SYSTEM, -1, "ht: %s failed", what);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (cqe[i].kind == FR_CQE_TX || cqe[i].kind == FR_CQE_ERR) {
            f->pending--;
            fr_stat_add(&ep->st.tx, 1);
        } else if (cqe[i].kind == FR_CQE_RX) {
            fr_stat_add(&ep->st.rx, 1);
        }
        if (cqe[i].kind == FR_CQE_RX) {
            if (fr_fab_rx(ep, f, cqe[i].imm))
                return -1;
        } else if (cqe[i].kind != FR_CQE_TX) {
            char msg[FR_ERRMSG_LEN];
            int who, to = cqe[i].ctx < (uint64_t)f->nf ? ep->group_peers[cqe[i].ctx] : -1;
            int st = fr_cqe_failure(&cqe[i], to, ep->comm->boot, "ht", NULL, &who, msg,
                                    sizeof(msg));
            fr_fab_fail(ep, f, st, who, "%s", msg);
            return -1;
        }
    }
    if (n > 0) {
        fr_stat_add(&ep->st.polls, 1);
        fr_stat_add(&ep->st.poll_ns, fr_now_ns() - t0);
        fr_ep_stats_tp(ep); /* the provider's share, -FI_EAGAIN */
    }
    return n > 0;
}

typedef struct fr_fab_arg {
    ferry_ep_t ep;
    fr_cuht_fab_t *f;
} fr_fab_arg_t;

static void *fr_fab_main(void *arg)
{
    ferry_ep_t ep = ((fr_fab_arg_t *)arg)->ep;
    fr_cuht_fab_t *f = ((fr_fab_arg_t *)arg)->f;
    free(arg);
    fr_log_set_rank(ep->rank);
    long idle_us = fr_proxy_idle_us(1);
    uint64_t idle = 0;
    int failed = 0;
    while (!__atomic_load_n(&ep->proxy.stop, __ATOMIC_ACQUIRE)) {
        int work = 0;
        if (!failed) {
            for (int g = 0; g < f->nf && !failed; g++) {
                int w = fr_fab_scan_peer(ep, f, g);
                failed = w < 0;
                work |= w > 0;
            }
            int p = failed ? 0 : fr_fab_poll(ep, f);
            failed |= p < 0;
            work |= p > 0;
        }
        if (work) {
            idle = 0;
            continue;
        }
        if (f->pending == 0 || failed)
            __atomic_add_fetch(&f->quiet, 1, __ATOMIC_ACQ_REL);
        fr_proxy_idle(&idle, idle_us);
    }
    return NULL;
}

int fr_cuht_fab_start(ferry_ep_t ep, fr_cuht_fab_t *f)
{
    fr_fab_arg_t *a = malloc(sizeof(*a));
    if (!a)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "fabric thread");
    a->ep = ep;
    a->f = f;
    ep->proxy.stop = 0;
    int e = pthread_create(&ep->proxy.thread, NULL, fr_fab_main, a);
    if (e != 0) {
        free(a);
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "starting the fabric thread: %s", strerror(e));
    }
    ep->proxy.running = 1;
    return FERRY_OK;
}

int fr_cuht_fab_hello(ferry_ep_t ep, fr_cuht_fab_t *f, fr_err_t *err)
{
    const fr_cuht_geo_t *G = &f->G;
    int me = G->rank, got = 0, rc = FERRY_OK;
    f->hello = calloc((size_t)f->nf, 1);
    if (!f->hello)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric hello");
    /* this rank's own notify entry [0][me] at each peer: still zero, as
     * in the outbox, and nobody else writes it */
    uint64_t off = fr_cuht_geo_notify(G, 0, me);
    for (int g = 0; g < f->nf && rc == FERRY_OK; g++)
        rc = fr_fab_post(ep, f, g, (uint64_t)g * G->ob_bytes + off, off, G->notify_entry,
                         fr_fab_imm(f, FR_FAB_HELLO, me, 0, 0));
    if (rc != FERRY_OK)
        return FR_ERR(err, rc, "%s", ep->async.msg);
    uint64_t t0 = fr_now_ns(), lim = (uint64_t)ep->timeout_ms * 1000000ull, iter = 0;
    while (rc == FERRY_OK && (got < f->nf || f->pending > 0)) {
        if (fr_fab_poll(ep, f) < 0) {
            rc = FR_ERR(err, fr_async_status(&ep->async), "%s",
                        ep->async.msg);
            break;
        }
        got = 0;
        for (int g = 0; g < f->nf; g++)
            got += f->hello[g];
        if (fr_now_ns() - t0 > lim) {
            int who = -1;
            for (int g = 0; g < f->nf && who < 0; g++)
                if (!f->hello[g])
                    who = ep->group_peers[g];
            rc = who >= 0 ? FR_ERR(err, FERRY_ERR_TIMEOUT, "cuda_ht: no first write from rank %d "
                                   "after %ld ms (FERRY_TIMEOUT_MS)", who, ep->timeout_ms)
                          : FR_ERR(err, FERRY_ERR_TIMEOUT, "cuda_ht: %ld first writes not "
                                   "completed after %ld ms", f->pending, ep->timeout_ms);
        }
        fr_backoff(&iter, ep->spin);
    }
    return rc;
}

int fr_cuht_fab_quiesce(ferry_ep_t ep, fr_cuht_fab_t *f)
{
    if (!ep->proxy.running)
        return FERRY_OK;
    /* two quiet passes: the second began after this call did */
    unsigned long q0 = __atomic_load_n(&f->quiet, __ATOMIC_ACQUIRE);
    uint64_t t0 = fr_now_ns(), lim = (uint64_t)ep->timeout_ms * 1000000ull, iter = 0;
    while (__atomic_load_n(&f->quiet, __ATOMIC_ACQUIRE) < q0 + 2) {
        if (fr_now_ns() - t0 > lim)
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT, "ht: %ld fabric writes not completed "
                              "after %ld ms", f->pending, ep->timeout_ms);
        fr_backoff(&iter, ep->spin);
    }
    return FERRY_OK;
}
