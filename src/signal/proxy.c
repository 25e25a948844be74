/*
 * Put-with-signal: the proxy thread, sender side. It takes requests from
 * the ring (re-checking each), queues them per destination (or, in fence
 * mode, posts in ring order and holds a record until nothing is in
 * flight), posts puts within each destination's window and records in as
 * few mailbox writes as credits and the strategy allow, and counts local
 * completions. Arrivals go to rx.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "runtime/rt.h"
#include "signal/sig_int.h"
#include "signal/signal.h"

static int fr_sig_fifo_push(fr_sig_fifo_t *f, const fr_sig_item_t *it)
{
    if (f->tail - f->head == f->cap) {
        uint32_t cap = f->cap ? 2 * f->cap : 64;
        fr_sig_item_t *v = malloc(sizeof(*v) * cap);
        if (!v)
            return -1;
        for (uint32_t i = 0; i < f->tail - f->head; i++)
            v[i] = f->v[(f->head + i) & (f->cap - 1)];
        free(f->v);
        f->tail -= f->head;
        f->head = 0;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->tail++ & (f->cap - 1)] = *it;
    return 0;
}

static int fr_sig_post_put(ferry_sig_t s, int d, const fr_sig_item_t *it)
{
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t seq = D->put_posted;
    fr_slice_t sl = {it->src_off, it->dst_off, it->len,
                     fr_sig_imm(FR_SIGK_PUT, s->rank, seq)};
    fr_err_t err = {{0}};
    int rc = s->ops->write_imm(s->tp, s->g_heap, s->gidx[d], &sl,
                               fr_sig_ctx(FR_SIGK_PUT, d, seq), &err);
    if (rc != FERRY_OK) {
        fr_sig_async(s, rc, d, "put to rank %d: %s", d, err.msg);
        return rc;
    }
    D->put_posted++;
    s->inflight++;
    s->n_puts++;
    return FERRY_OK;
}

/* Write record #seq for destination d into its outbox slot. */
static void fr_sig_fill_record(ferry_sig_t s, int d, uint64_t seq,
                               const fr_sig_item_t *it)
{
    uint32_t slot = (uint32_t)(seq % FR_SIG_MBOX);
    fr_sig_rec_t *r = (fr_sig_rec_t *)(s->outbox +
                                       ((size_t)d * FR_SIG_MBOX + slot) *
                                           FR_SIG_REC);
    r->value = it->value;
    r->count = s->mode == FERRY_SIG_MODE_COUNTED ? it->thr : 0;
    r->sig_index = it->sig_index;
    r->op = it->op;
    r->batch = 1;
}

/* Post records #sig_issued .. #sig_issued+n-1 (filled, in consecutive
 * mailbox slots) to destination d as one write; the immediate names the
 * last, which says how many the write holds. */
static int fr_sig_post_records(ferry_sig_t s, int d, uint32_t n)
{
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t first = D->sig_issued, last = first + n - 1;
    uint32_t slot = (uint32_t)(first % FR_SIG_MBOX);
    size_t out_off = ((size_t)d * FR_SIG_MBOX + slot) * FR_SIG_REC;
    ((fr_sig_rec_t *)(s->outbox + out_off) + (n - 1))->batch = n;
    fr_slice_t sl = {out_off,
                     ((size_t)s->rank * FR_SIG_MBOX + slot) * FR_SIG_REC,
                     (uint64_t)n * FR_SIG_REC,
                     fr_sig_imm(FR_SIGK_SIG, s->rank, last)};
    fr_err_t err = {{0}};
    uint64_t ctx = fr_sig_ctx(FR_SIGK_SIG, d, last);
    int rc = s->mode == FERRY_SIG_MODE_NICFENCE
                 ? s->ops->write_fence(s->tp, s->g_mbox, s->gidx[d], &sl, ctx,
                                       &err)
                 : s->ops->write_imm(s->tp, s->g_mbox, s->gidx[d], &sl, ctx,
                                     &err);
    if (rc != FERRY_OK) {
        fr_sig_async(s, rc, d, "signal to rank %d: %s", d, err.msg);
        return rc;
    }
    D->sig_issued += n;
    s->inflight++;
    s->n_sigs += n;
    s->n_sig_writes++;
    return FERRY_OK;
}

/* Can destination d's next record go out now, behind `ahead` records
 * already taken for the same write? */
static int fr_sig_record_ready(ferry_sig_t s, int d, const fr_sig_item_t *it,
                               uint32_t ahead)
{
    fr_sig_dst_t *D = &s->dst[d];
    if (D->sig_issued + ahead - D->credit >= FR_SIG_MBOX)
        return 0; /* the receiver has not consumed enough records yet */
    switch (s->mode) {
    case FERRY_SIG_MODE_GROUPED:
        return D->put_done >= it->thr;
    case FERRY_SIG_MODE_FENCE:
        return s->inflight == 0;
    default: /* counted, nicfence: the covered puts must be posted */
        return D->put_posted >= it->thr;
    }
}

/* Post what destination d's queues allow. */
static void fr_sig_progress_dst(ferry_sig_t s, int d)
{
    fr_sig_dst_t *D = &s->dst[d];
    while (!fr_sig_fifo_empty(&D->puts) &&
           D->put_posted - D->put_done < FR_SIG_TXWIN) {
        if (fr_sig_post_put(s, d, fr_sig_fifo_front(&D->puts)) != FERRY_OK)
            return;
        D->puts.head++;
        s->queued--;
    }
    /* every record that may go now, in as few writes as the mailbox's
     * wrap allows */
    for (;;) {
        uint32_t n = 0;
        while (n < FR_SIG_BATCH && !fr_sig_fifo_empty(&D->sigs) &&
               (n == 0 || (D->sig_issued + n) % FR_SIG_MBOX != 0) &&
               fr_sig_record_ready(s, d, fr_sig_fifo_front(&D->sigs), n)) {
            fr_sig_fill_record(s, d, D->sig_issued + n,
                               fr_sig_fifo_front(&D->sigs));
            D->sigs.head++;
            s->queued--;
            n++;
        }
        if (n == 0 || fr_sig_post_records(s, d, n) != FERRY_OK)
            return;
    }
}

/* Take one ring request. 0: taken; 1: not now (fence mode must drain). */
static int fr_sig_take(ferry_sig_t s, const ferry_sig_req_t *q)
{
    fr_err_t err = {{0}};
    if (fr_sig_check_req(s->N, s->heap_bytes, s->nsig, q->peer, q->dst_off,
                         q->src_off, q->len, q->sig_index, q->op,
                         &err) != FERRY_OK) {
        fr_sig_async(s, FERRY_ERR_INVALID, s->rank, "request from a %s: %s",
                     s->cuda ? "kernel" : "thread", err.msg);
        return 0;
    }
    int d = q->peer;
    int has_put = q->len > 0, has_sig = q->sig_index != FERRY_SIG_NONE;
    if (d == s->rank) {
        /* to itself: the proxy copies, then applies; order is kept */
        if (has_put) {
            memmove(s->heap + q->dst_off, s->heap + q->src_off, q->len);
            __atomic_store_n(&s->src[d].landed, s->src[d].landed + 1,
                             __ATOMIC_RELEASE);
        }
        if (has_sig) {
            __atomic_thread_fence(__ATOMIC_RELEASE);
            fr_sig_apply(s, q->sig_index, q->op, q->value);
        }
        return 0;
    }
    fr_sig_dst_t *D = &s->dst[d];
    fr_sig_item_t it = {q->src_off, q->dst_off, q->len, q->value, 0,
                        q->sig_index, q->op};
    if (s->mode == FERRY_SIG_MODE_FENCE) {
        /* the naive proxy: in ring order, a record waits for the drain and
         * nothing else is taken meanwhile */
        if (has_put && D->put_posted - D->put_done >= FR_SIG_TXWIN)
            return 1;
        if (has_put) {
            D->put_issued++;
            if (fr_sig_post_put(s, d, &it) != FERRY_OK)
                return 0;
        }
        if (has_sig) {
            it.thr = D->put_issued;
            s->fence_wait = 1;
            s->fence_dst = d;
            s->fence_item = it;
        }
        return 0;
    }
    if (has_put) {
        D->put_issued++;
        if (fr_sig_fifo_push(&D->puts, &it) != 0)
            goto nomem;
        s->queued++;
    }
    if (has_sig) {
        it.thr = D->put_issued;
        if (fr_sig_fifo_push(&D->sigs, &it) != 0)
            goto nomem;
        s->queued++;
    }
    /* posted after this pass over the ring: a destination's puts, then
     * its records in as few writes as they allow */
    fr_sig_activate(s, d);
    return 0;
nomem:
    fr_sig_async(s, FERRY_ERR_NOMEM, s->rank,
                 "proxy: out of memory queueing requests for rank %d", d);
    return 0;
}

static void fr_sig_tx_done(ferry_sig_t s, uint64_t ctx)
{
    int kind = (int)(ctx >> 60);
    int d = (int)((ctx >> 32) & 0xfffffff);
    if (kind == FR_SIGK_CREDIT || d >= s->N)
        return;
    s->inflight--;
    if (kind != FR_SIGK_PUT)
        return;
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t seq = D->put_done + (((uint32_t)ctx - (uint32_t)D->put_done) &
                                  0xffffffffu);
    if (seq - D->put_done >= FR_SIG_TXWIN)
        return; /* cannot happen: at most FR_SIG_TXWIN are posted */
    D->done[seq % FR_SIG_TXWIN] = 1;
    while (D->done[D->put_done % FR_SIG_TXWIN]) {
        D->done[D->put_done % FR_SIG_TXWIN] = 0;
        D->put_done++;
    }
    if (!fr_sig_fifo_empty(&D->puts) || !fr_sig_fifo_empty(&D->sigs))
        fr_sig_activate(s, d);
}

/* 1. Take what the ring holds (at most 256 requests a pass; none while a
 * fence record waits). Returns whether it took any. */
static int fr_sig_take_ring(ferry_sig_t s)
{
    ferry_sig_ring_t *rg = s->ring;
    int work = 0;
    for (int n = 0; n < 256 && !s->fence_wait; n++) {
        ferry_sig_req_t *q = &rg->req[rg->head & (FR_SIG_RING - 1)];
        if (__atomic_load_n(&q->seq, __ATOMIC_ACQUIRE) != rg->head + 1)
            break;
        ferry_sig_req_t c = *q;
        if (fr_sig_take(s, &c) != 0)
            break;
        __atomic_store_n(&rg->head, rg->head + 1, __ATOMIC_RELEASE);
        work = 1;
    }
    return work;
}

/* 2. Post what waited: the fence record once drained, then every active
 * destination's queues. Returns whether the fence record went out. */
static int fr_sig_post_waiting(ferry_sig_t s)
{
    int work = 0;
    if (s->fence_wait && s->inflight == 0 &&
        fr_sig_record_ready(s, s->fence_dst, &s->fence_item, 0)) {
        s->fence_wait = 0;
        fr_sig_fill_record(s, s->fence_dst, s->dst[s->fence_dst].sig_issued,
                           &s->fence_item);
        fr_sig_post_records(s, s->fence_dst, 1);
        work = 1;
    }
    for (int i = 0; i < s->nact;) {
        int d = s->act[i];
        fr_sig_progress_dst(s, d);
        fr_sig_dst_t *D = &s->dst[d];
        if (fr_sig_fifo_empty(&D->puts) && fr_sig_fifo_empty(&D->sigs)) {
            D->active = 0;
            s->act[i] = s->act[--s->nact];
        } else {
            i++;
        }
    }
    return work;
}

/* 3. Completions: arrivals, local completions, failures. Returns how many
 * the transport gave. */
static int fr_sig_poll(ferry_sig_t s)
{
    fr_cqe_t cqe[64];
    fr_err_t err = {{0}};
    int n = s->ops->poll(s->tp, cqe, 64, &err);
    if (n < 0) {
        fr_sig_async(s, n, -1, "%s", err.msg);
        n = 0;
    }
    for (int i = 0; i < n; i++) {
        if (cqe[i].kind == FR_CQE_RX) {
            fr_sig_rx(s, cqe[i].imm);
        } else if (cqe[i].kind == FR_CQE_TX) {
            fr_sig_tx_done(s, cqe[i].ctx);
        } else {
            char msg[FR_ERRMSG_LEN];
            int who;
            int st = fr_cqe_failure(&cqe[i], -1, NULL, "signal", err.msg, &who, msg,
                                    sizeof(msg));
            if (cqe[i].kind == FR_CQE_ERR)
                fr_sig_tx_done(s, cqe[i].ctx);
            fr_sig_async(s, st, who, "%s", msg);
        }
    }
    return n;
}

void *fr_sig_main(void *arg)
{
    ferry_sig_t s = arg;
    fr_log_set_rank(s->rank);
    long idle_us = fr_proxy_idle_us(s->cuda);
    uint64_t idle = 0;
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        int work = fr_sig_take_ring(s);
        work |= fr_sig_post_waiting(s);
        int n = fr_sig_poll(s);
        /* 4. everything taken so far is done? */
        if (s->inflight == 0 && s->queued == 0 && !s->fence_wait)
            __atomic_store_n(&s->settled, s->ring->head, __ATOMIC_RELEASE);
        if (work || n > 0) {
            idle = 0;
            continue;
        }
        fr_proxy_idle(&idle, idle_us);
    }
    return NULL;
}
