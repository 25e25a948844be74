/*
 * The CPU high-throughput engine's table, layout, setup and free, and its
 * wait. Setup makes the rank's segment (notify area and rings, sized by
 * ring_tokens, not by max_tokens) and maps the node's peers'.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engines/cpu_ht/cpu_ht.h"

static uint64_t fr_ht_align(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

void fr_ht_layout_init(fr_ht_layout_t *h, int N, int El, int K, int H, int RT)
{
    memset(h, 0, sizeof(*h));
    RT = (RT + FR_HT_CHUNK - 1) / FR_HT_CHUNK * FR_HT_CHUNK; /* whole chunks */
    h->N = N;
    h->El = El;
    h->K = K;
    h->H = H;
    h->RT = RT;
    h->notify_entry = fr_ht_align(16 + 4ull * El, FR_HT_LINE);
    h->off_notify = 4096;
    /* dispatch record: token, flags, le[K] (int16), w[K]; then the row
     * (bf16, or fp8 plus its scales: never more than the bf16 row plus
     * the scales) */
    h->dhdr = fr_ht_dhdr_bytes(K);
    h->drec = fr_ht_align(h->dhdr + 2ull * H + 4ull * ((H + 127) / 128), 16);
    h->chdr = fr_ht_align(4ull * K, 16);
    h->crec = fr_ht_align(h->chdr + 2ull * H, 16);
    h->dring = 2 * FR_HT_LINE + (uint64_t)RT * h->drec;
    h->cring = 2 * FR_HT_LINE + (uint64_t)RT * h->crec;
    h->off_dring = fr_ht_align(h->off_notify + 2ull * N * h->notify_entry, 4096);
    h->off_cring = fr_ht_align(h->off_dring + (uint64_t)N * h->dring, 4096);
    h->seg_bytes = fr_ht_align(h->off_cring + (uint64_t)N * h->cring, 4096);
    /* staging per fabric peer: its dispatch and combine rings, and a
     * notify entry per route parity (one may still be in flight) */
    h->stage = fr_ht_align((uint64_t)RT * (h->drec + h->crec) + 2 * h->notify_entry, 4096);
}

/* Forwarding: LF combine rings after the others (alike on every rank: LF
 * is the largest node's size). */
void fr_ht_layout_fwd(fr_ht_layout_t *h, int LF)
{
    h->LF = LF;
    /* notify entries carry, to a forwarder, the tokens for each rank of
     * its node (16 + 4 El + 4 LF bytes) */
    h->notify_entry = fr_ht_align(16 + 4ull * h->El + 4ull * LF, FR_HT_LINE);
    h->off_dring = fr_ht_align(h->off_notify + 2ull * h->N * h->notify_entry, 4096);
    h->off_cring = fr_ht_align(h->off_dring + (uint64_t)h->N * h->dring, 4096);
    h->stage = fr_ht_align((uint64_t)h->RT * (h->drec + h->crec) + 2 * h->notify_entry, 4096);
    h->off_fcring = fr_ht_align(h->off_cring + (uint64_t)h->N * h->cring, 4096);
    h->seg_bytes = fr_ht_align(h->off_fcring + (uint64_t)LF * h->cring, 4096);
}

int fr_ht_idle(ferry_ep_t ep, uint64_t *iter, uint64_t *last_check, uint64_t progress_ns,
               int rank, const char *what, const uint8_t *need)
{
    fr_backoff(iter, ep->spin);
    uint64_t now = fr_now_ns();
    if (now - *last_check < 2000000ull)
        return FERRY_OK;
    *last_check = now;
    /* a rank that died fails the call only if this rank still needs it:
     * one that finished its part may have exited */
    int dead = fr_boot_dead_rank(ep->comm->boot);
    if (dead >= 0 && dead < ep->N && (!need || need[dead]))
        return fr_ep_fail(ep, FERRY_ERR_PEER, "%s: rank %d died", what, dead);
    for (int s = 0; s < ep->N; s++) {
        if (ep->path[s] != FR_PATH_SHM || (need && !need[s]))
            continue;
        pid_t pid = ep->comm->peers[s].pid;
        if (kill(pid, 0) != 0 && errno == ESRCH)
            return fr_ep_fail(ep, FERRY_ERR_PEER, "%s: rank %d (pid %d) died", what, s,
                              (int)pid);
    }
    if (now - progress_ns > (uint64_t)ep->timeout_ms * 1000000ull)
        return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                          "%s: no progress with rank %d for %ld ms (FERRY_TIMEOUT_MS)",
                          what, rank, ep->timeout_ms);
    return FERRY_OK;
}

static int fr_ht_setup(ferry_ep_t ep, fr_err_t *err)
{
    const ferry_ep_config_t *c = &ep->cfg;
    int N = ep->N, rc = FERRY_OK;
    fr_layout_init(&ep->L, N, ep->rank, c->num_experts, c->topk, c->hidden,
                   c->max_tokens, c->dispatch_dtype == FERRY_DTYPE_FP8_E4M3);
    fr_cpu_ht_t *st = calloc(1, sizeof(*st));
    ep->eng_state = st;
    if (!st)
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "engine state");
    if (rc == FERRY_OK && ep->nfabric > 0 && N > 8192)
        rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                    "mode = high throughput over the fabric: at most 8192 ranks");
    if (rc == FERRY_OK && ep->nfabric > 0 && c->ring_tokens / FR_HT_CHUNK > FR_HT_MAX_CHUNKS)
        rc = FR_ERR(err, FERRY_ERR_INVALID,
                    "ring_tokens = %d: at most %d with peers on the fabric path",
                    c->ring_tokens, FR_HT_MAX_CHUNKS * FR_HT_CHUNK);
    if (rc == FERRY_OK) {
        int RT = c->ring_tokens > 0 ? c->ring_tokens : FR_HT_RING_DEFAULT;
        fr_ht_layout_init(&st->H, N, ep->L.El, c->topk, c->hidden, RT);
        rc = fr_ht_fwd_setup(ep, err);
        ep->L.seg_bytes = st->H.seg_bytes; /* what ferry_ep_get_layout reports */
        ep->L.send_bytes = st->H.stage * (uint64_t)ep->nfabric;
        if (rc == FERRY_OK) {
            st->dtx = calloc((size_t)N, sizeof(uint64_t));
            st->drx = calloc((size_t)N, sizeof(uint64_t));
            st->ctx = calloc((size_t)N, sizeof(uint64_t));
            st->crx = calloc((size_t)N, sizeof(uint64_t));
            if (!st->dtx || !st->drx || !st->ctx || !st->crx)
                rc = FR_ERR(err, FERRY_ERR_NOMEM, "ring counters");
        }
        if (rc == FERRY_OK && ep->nfabric > 0) {
            /* staging for writes to fabric peers, registered by create */
            if (posix_memalign((void **)&ep->send, 4096, ep->L.send_bytes) != 0) {
                ep->send = NULL;
                rc = FR_ERR(err, FERRY_ERR_NOMEM, "send region of %llu bytes",
                            (unsigned long long)ep->L.send_bytes);
            } else {
                memset(ep->send, 0, ep->L.send_bytes);
            }
            if (rc == FERRY_OK && fr_ht_fab_init(ep) != FERRY_OK)
                rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric tables");
        }
    }
    return fr_ep_segments(ep, 'h', rc, err);
}

static void fr_ht_free(ferry_ep_t ep)
{
    fr_cpu_ht_t *c = fr_cpu_ht(ep);
    fr_ep_segments_close(ep); /* sized by ep->L.seg_bytes, set in setup */
    free(ep->send);
    ep->send = NULL;
    if (!c)
        return;
    fr_ht_fab_free(ep);
    fr_ht_fwd_free(ep);
    free(c->dtx);
    free(c->drx);
    free(c->ctx);
    free(c->crx);
    free(c->acc);
    free(c->stash);
    free(c);
    ep->eng_state = NULL;
}

static int fr_ht_sync(ferry_ep_t ep, void *stream)
{
    (void)ep;
    (void)stream;
    return FERRY_OK;
}

static int fr_ht_check(ferry_ep_t ep)
{
    (void)ep;
    return FERRY_OK;
}

const fr_engine_t fr_engine_cpu_ht = {
    .size = sizeof(fr_engine_t),
    .name = "cpu_ht",
    .device = FERRY_DEVICE_CPU,
    .mode = FERRY_MODE_HIGH_THROUGHPUT,
    .setup = fr_ht_setup,
    .free = fr_ht_free,
    /* no round calls: the API refuses them on this mode (api/round.c) */
    .sync = fr_ht_sync,
    .check = fr_ht_check,
    .route_create = fr_ht_route_create,
    .route_free = fr_ht_route_free,
    .ht_dispatch = fr_ht_dispatch,
    .ht_combine = fr_ht_combine,
};

/* The fp32 accumulator, zeroed, and the weights output cleared; after
 * its rows one more, not zeroed: *row (fr_ht_call_t.srow). */
float *fr_ht_acc(ferry_ep_t ep, int T, const ferry_ht_combine_out_t *out, float **row)
{
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    size_t H = (size_t)st->H.H, K = (size_t)st->H.K;
    if (st->acc_rows < (size_t)T || !st->acc) {
        free(st->acc);
        st->acc = malloc(sizeof(float) * (((size_t)T + 1) * H + 1));
        st->acc_rows = st->acc ? (size_t)T : 0;
    }
    if (!st->acc)
        return NULL;
    *row = st->acc + st->acc_rows * H;
    memset(st->acc, 0, sizeof(float) * (size_t)T * H);
    if (out->topk_weights)
        memset(out->topk_weights, 0, sizeof(float) * (size_t)T * K);
    return st->acc;
}

/* FERRY_HT_SUM_SLOTS: the rows' store ([T][K][H] bf16, not zeroed) and
 * after it its flags ([T][K] bytes, zeroed): *on. */
uint16_t *fr_ht_stash(ferry_ep_t ep, int T, uint8_t **on)
{
    fr_cpu_ht_t *st = fr_cpu_ht(ep);
    size_t K = (size_t)st->H.K, n = K * (size_t)st->H.H;
    if (st->stash_rows < (size_t)T || !st->stash) {
        free(st->stash);
        st->stash = malloc(sizeof(uint16_t) * (size_t)T * n + (size_t)T * K + 1);
        st->stash_rows = st->stash ? (size_t)T : 0;
    }
    if (!st->stash)
        return NULL;
    *on = (uint8_t *)(st->stash + st->stash_rows * n);
    memset(*on, 0, (size_t)T * K);
    return st->stash;
}
