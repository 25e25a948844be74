/*
 * libfabric transport: the op pool and posting (scatter, barrier,
 * write_imm, write_fence).
 *
 * Posting never blocks. A post that meets -FI_EAGAIN, and every post
 * behind it, waits in a FIFO inside the transport and is retried in order
 * from poll(). A post that fails for any other reason is not reported by
 * the posting call (other slices of the same call may already be on the
 * wire); it comes back from poll() as one FR_CQE_ERR with its peer and
 * ctx. So every slice of a call that returned FERRY_OK yields exactly one
 * completion: FR_CQE_TX or FR_CQE_ERR. A call that returns an error
 * (FERRY_ERR_INVALID for bad bounds or index) posted nothing.
 *
 * Batches (write_batch, scatter): every write but the last carries FI_MORE, which
 * lets a provider ring the NIC once for the batch, but only while nothing
 * is queued and the whole batch fits the provider's transmit queue beside
 * what is in flight: a held write then never waits behind a queue that
 * only its own doorbell could drain. A write queued after -FI_EAGAIN
 * loses FI_MORE, so the retry that posts it rings for what came before.
 * A batch's last write that fails outright (not -FI_EAGAIN) leaves the
 * writes held before it to the next post's doorbell: its error
 * completion fails the EP (the proxy's asynchronous error), which
 * nothing then waits on.
 *
 * Zero-byte writes: tcp;ofi_rxm, shm, sockets and udp;ofi_rxd accept
 * fi_writedata with len 0 and deliver the remote CQ data, to other ranks
 * and to self (checked by tests/mp/test_fabric). They are posted as real
 * zero-byte writes.
 */
#include <stdlib.h>
#include <sys/uio.h>

#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "runtime/rt.h"
#include "transport/fabric/fab_int.h"

/* ------------------------------------------------------------------ */
/* op pool and lists                                                   */
/* ------------------------------------------------------------------ */

static int fab_pool_grow(fr_transport_t *t)
{
    fr_fab_chunk_t *c = calloc(1, sizeof(*c));
    if (!c)
        return -1;
    c->next = t->chunks;
    t->chunks = c;
    uintptr_t lo = (uintptr_t)&c->ops[0],
              hi = (uintptr_t)&c->ops[FR_FAB_POOL_CHUNK];
    if (!t->pool_lo || lo < t->pool_lo)
        t->pool_lo = lo;
    if (hi > t->pool_hi)
        t->pool_hi = hi;
    for (int i = FR_FAB_POOL_CHUNK - 1; i >= 0; i--) {
        c->ops[i].next = t->free_ops;
        t->free_ops = &c->ops[i];
    }
    t->nfree += FR_FAB_POOL_CHUNK;
    return 0;
}

void fab_pool_free(fr_transport_t *t)
{
    while (t->chunks) {
        fr_fab_chunk_t *c = t->chunks;
        t->chunks = c->next;
        free(c);
    }
    t->free_ops = NULL;
    t->nfree = 0;
    t->pool_lo = t->pool_hi = 0;
}

static fr_fab_op_t *fab_op_get(fr_transport_t *t)
{
    if (!t->free_ops && fab_pool_grow(t) != 0)
        return NULL;
    fr_fab_op_t *op = t->free_ops;
    t->free_ops = op->next;
    t->nfree--;
    op->next = NULL;
    op->state = FR_FAB_OP_HELD;
    return op;
}

void fab_op_put(fr_transport_t *t, fr_fab_op_t *op)
{
    op->state = FR_FAB_OP_FREE;
    op->next = t->free_ops;
    t->free_ops = op;
    t->nfree++;
}

static void fab_list_push(fr_fab_op_t **head, fr_fab_op_t **tail,
                          fr_fab_op_t *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

fr_fab_op_t *fab_list_pop(fr_fab_op_t **head, fr_fab_op_t **tail)
{
    fr_fab_op_t *op = *head;
    if (op) {
        *head = op->next;
        if (!*head)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

/* ------------------------------------------------------------------ */
/* posting                                                             */
/* ------------------------------------------------------------------ */

/* The op is marked posted first: from here on a completion may name it.
 * The provider call is timed (two clock reads) for the stats op. A fenced
 * or batched write goes through fi_writemsg, whose flags replace the
 * endpoint's defaults: both take them back (t->op_flags, e.g.
 * FI_DELIVERY_COMPLETE). */
static ssize_t fab_post(fr_transport_t *t, fr_fab_op_t *op, int retry)
{
    op->state = FR_FAB_OP_POSTED;
    ssize_t rc;
    uint64_t t0 = fr_now_ns();
    if (op->fence || op->more) {
        struct iovec iov = {(void *)op->buf, op->len};
        struct fi_rma_iov rma = {op->raddr, op->len, op->key};
        struct fi_msg_rma msg = {&iov, &op->desc, 1, op->addr, &rma, 1,
                                 op, op->imm};
        uint64_t fl = t->op_flags | (op->fence ? FI_FENCE : FI_MORE) | FI_REMOTE_CQ_DATA |
                      FI_COMPLETION;
        rc = fi_writemsg(t->ep, &msg, fl);
        if (rc == 0 && op->more)
            t->st.more++;
    } else {
        rc = fi_writedata(t->ep, op->buf, op->len, op->desc, op->imm, op->addr,
                          op->raddr, op->key, op);
    }
    uint64_t dt = fr_now_ns() - t0;
    if (retry)
        t->st.retry_ns += dt;
    else
        t->st.prov_ns += dt;
    t->st.prov_calls++;
    if (rc == -FI_EAGAIN)
        t->st.eagain++;
    return rc;
}

/* Post op, or queue it behind earlier queued posts, or (hard failure) put
 * it on the error list for poll() to report. */
static void fab_submit(fr_transport_t *t, fr_fab_op_t *op)
{
    if (!t->q_head) {
        ssize_t rc = fab_post(t, op, 0);
        if (rc == 0) {
            t->inflight++;
            return;
        }
        op->state = FR_FAB_OP_HELD;
        if (rc != -FI_EAGAIN) {
            op->err = (int)rc;
            fab_list_push(&t->e_head, &t->e_tail, op);
            t->nerrors++;
            return;
        }
    }
    op->more = 0; /* its retry rings for the batch's writes before it */
    fab_list_push(&t->q_head, &t->q_tail, op);
    t->nqueued++;
    t->nwaited++;
}

/* Retry queued posts in order; stop at the first -FI_EAGAIN. */
void fab_drain_queue(fr_transport_t *t)
{
    while (t->q_head) {
        fr_fab_op_t *op = t->q_head;
        ssize_t rc = fab_post(t, op, 1);
        if (rc == -FI_EAGAIN) {
            op->state = FR_FAB_OP_HELD;
            return;
        }
        fab_list_pop(&t->q_head, &t->q_tail);
        t->nqueued--;
        if (rc == 0) {
            t->inflight++;
        } else {
            op->state = FR_FAB_OP_HELD;
            op->err = (int)rc;
            fab_list_push(&t->e_head, &t->e_tail, op);
            t->nerrors++;
        }
    }
}

static int fab_check_slice(const fr_transport_t *t, const fr_group_t *g,
                           int i, const fr_slice_t *s, fr_err_t *err)
{
    const fr_fab_peer_t *p = &g->peers[i];
    if (s->len > t->max_msg)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "fabric: slice %d (rank %d): a write of %llu bytes is "
                      "over provider %s's max_msg_size of %zu bytes",
                      i, p->rank, (unsigned long long)s->len, t->prov,
                      t->max_msg);
    return fr_slice_in_bounds("fabric", i, p->rank, s, g->slen, p->rlen, err);
}

static int fab_add(fr_transport_t *t, fr_group_t *g, int i,
                   const fr_slice_t *s, uint64_t ctx, int fence, int more, fr_err_t *err)
{
    fr_fab_op_t *op = fab_op_get(t);
    if (!op)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory for a post");
    const fr_fab_peer_t *p = &g->peers[i];
    op->ctx = ctx;
    op->buf = g->sbuf + s->src_off;
    op->len = (size_t)s->len;
    op->desc = g->sdesc;
    op->raddr = p->rbase + s->dst_off;
    op->key = p->rkey;
    op->addr = p->addr;
    op->imm = s->imm;
    op->peer = p->rank;
    op->err = 0;
    op->fence = fence;
    op->more = more;
    fab_submit(t, op);
    return FERRY_OK;
}

/* Whether a batch of n writes may carry FI_MORE (all but its last): only
 * where it cannot meet a full queue (see the top of this file). */
static int fab_batch_more(const fr_transport_t *t, int n)
{
    return n > 1 && !t->q_head && t->tx_size > 0 &&
           (size_t)t->inflight + (size_t)n <= t->tx_size;
}

/* Reserve n ops up front so that a call posts all of its slices or none. */
static int fab_reserve(fr_transport_t *t, int n, fr_err_t *err)
{
    while (t->nfree < n)
        if (fab_pool_grow(t) != 0)
            return FR_ERR(err, FERRY_ERR_NOMEM,
                          "fabric: out of memory for %d posts", n);
    return FERRY_OK;
}

/* ------------------------------------------------------------------ */
/* ops                                                                 */
/* ------------------------------------------------------------------ */

/* n writes, slices[i] to member index[i] (index NULL: member i), all
 * checked before any is posted (scatter, write_batch). A write queued
 * after -FI_EAGAIN drops its FI_MORE (fab_submit). */
static int fab_post_many(fr_transport_t *t, fr_group_t *g, const int *index,
                         const fr_slice_t *slices, int n, uint64_t ctx, fr_err_t *err)
{
    int rc;
    for (int i = 0; i < n; i++) {
        int m = index ? index[i] : i;
        if (m < 0 || m >= g->npeers)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "fabric: write_batch: write %d: index %d of a group of %d", i, m,
                          g->npeers);
        if ((rc = fab_check_slice(t, g, m, &slices[i], err)) != FERRY_OK)
            return rc;
    }
    if ((rc = fab_reserve(t, n, err)) != FERRY_OK)
        return rc;
    int more = fab_batch_more(t, n);
    for (int i = 0; i < n; i++)
        fab_add(t, g, index ? index[i] : i, &slices[i], ctx, 0, more && i < n - 1, err);
    return FERRY_OK;
}

int fab_scatter(fr_transport_t *t, fr_group_t *g, const fr_slice_t *slices,
                uint64_t ctx, fr_err_t *err)
{
    if (!g || (g->npeers > 0 && !slices))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: scatter: group %p, slices %p", (void *)g,
                      (const void *)slices);
    return fab_post_many(t, g, NULL, slices, g->npeers, ctx, err);
}

int fab_barrier(fr_transport_t *t, fr_group_t *g, uint32_t imm, uint64_t ctx,
                fr_err_t *err)
{
    int rc;
    if (!g)
        return FR_ERR(err, FERRY_ERR_INVALID, "fabric: barrier: no group");
    if ((rc = fab_reserve(t, g->npeers, err)) != FERRY_OK)
        return rc;
    fr_slice_t s = {0, 0, 0, imm};
    for (int i = 0; i < g->npeers; i++)
        fab_add(t, g, i, &s, ctx, 0, 0, err);
    return FERRY_OK;
}

int fab_write_imm(fr_transport_t *t, fr_group_t *g, int index,
                  const fr_slice_t *slice, uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!g || !slice || index < 0 || index >= g->npeers)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: write_imm: index %d of a group of %d", index,
                      g ? g->npeers : 0);
    if ((rc = fab_check_slice(t, g, index, slice, err)) != FERRY_OK)
        return rc;
    return fab_add(t, g, index, slice, ctx, 0, 0, err);
}

int fab_write_batch(fr_transport_t *t, fr_group_t *g, const int *index,
                    const fr_slice_t *slices, int n, uint64_t ctx, fr_err_t *err)
{
    if (!g || n < 0 || (n > 0 && (!index || !slices)))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: write_batch: group %p, %d writes, index %p, slices %p",
                      (void *)g, n, (const void *)index, (const void *)slices);
    return fab_post_many(t, g, index, slices, n, ctx, err);
}

int fab_write_fence(fr_transport_t *t, fr_group_t *g, int index,
                    const fr_slice_t *slice, uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!t->fence_caps)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "fabric: a fenced write needs an endpoint opened with "
                      "FI_FENCE (FR_TP_OPEN_FENCE)");
    if (!g || !slice || index < 0 || index >= g->npeers)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: write_fence: index %d of a group of %d", index,
                      g ? g->npeers : 0);
    if ((rc = fab_check_slice(t, g, index, slice, err)) != FERRY_OK)
        return rc;
    return fab_add(t, g, index, slice, ctx, 1, 0, err);
}
