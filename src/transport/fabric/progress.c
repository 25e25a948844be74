/*
 * libfabric transport: progress and completions. poll() retries posts
 * queued after -FI_EAGAIN, reports posts that failed outright, and reads
 * the completion queue, sorting each entry into a local write completing
 * (FR_CQE_TX), a peer's write with immediate landing (FR_CQE_RX), or an
 * error: one of our posts (FR_CQE_ERR, with its peer and ctx) or an
 * incoming write whose writer is unknown (FR_CQE_RXERR). Progress is
 * manual, so poll() must be called on both sides of a write.
 *
 * Classifying an entry (fi_cq(3)): op_context is the context given at
 * post for a local completion and undefined for a remote one; flags name
 * the operation (FI_RMA | FI_WRITE: ours; FI_RMA | FI_REMOTE_WRITE: a
 * peer's) and FI_REMOTE_CQ_DATA says data is valid. The flag alone does
 * not tell the two apart: sockets sets FI_REMOTE_CQ_DATA (and the data) on
 * the writer's own completion of fi_writedata. So first the context: an
 * entry whose op_context is an op of this transport's pool that is posted
 * (an address inside one of the pool's chunks, on an op boundary; never
 * dereferenced before that is known) is our write completing, unless
 * its flags say FI_REMOTE_WRITE. Otherwise the flags: FI_REMOTE_CQ_DATA is
 * an arrival; anything else is an entry ferry cannot place and is
 * reported as an error rather than guessed at.
 */
#include <string.h>

#include <rdma/fi_errno.h>
#include <rdma/fi_eq.h>

#include "transport/fabric/fab_int.h"

/* Posts that failed outright, in order, as FR_CQE_ERR. */
static int fab_poll_failed(fr_transport_t *t, fr_cqe_t *out, int max,
                           fr_err_t *err)
{
    int n = 0;
    while (n < max && t->e_head) {
        fr_fab_op_t *op = fab_list_pop(&t->e_head, &t->e_tail);
        t->nerrors--;
        out[n].kind = FR_CQE_ERR;
        out[n].imm = op->imm;
        out[n].peer = op->peer;
        out[n].status = FERRY_ERR_FABRIC;
        out[n].ctx = op->ctx;
        n++;
        FR_ERR(err, FERRY_ERR_FABRIC,
               "fabric: fi_writedata of %zu bytes to rank %d failed: %s (%d)",
               op->len, op->peer, fi_strerror(-op->err), op->err);
        fab_op_put(t, op);
    }
    return n;
}

/* The completion queue has an error entry (-FI_EAVAIL): read it into *c.
 * 0: done; 1: nothing there after all; < 0: fi_cq_readerr failed. */
static int fab_poll_error(fr_transport_t *t, fr_cqe_t *c, fr_err_t *err)
{
    struct fi_cq_err_entry ee;
    memset(&ee, 0, sizeof(ee));
    ssize_t r = fi_cq_readerr(t->cq, &ee, 0);
    if (r == -FI_EAGAIN)
        return 1;
    if (r < 0)
        return fab_fail(err, "fi_cq_readerr", (int)r);
    char buf[256];
    const char *s = fi_cq_strerror(t->cq, ee.prov_errno, ee.err_data, buf,
                                   sizeof(buf));
    c->kind = FR_CQE_RXERR; /* not one of our posts */
    c->imm = 0;
    c->status = FERRY_ERR_FABRIC;
    c->peer = -1;
    c->ctx = 0;
    fr_fab_op_t *op = fab_op_ours(t, ee.op_context);
    if (op && !(ee.flags & FI_REMOTE_WRITE)) {
        c->kind = FR_CQE_ERR;
        c->peer = op->peer;
        c->ctx = op->ctx;
        c->imm = op->imm;
        t->inflight--;
        fab_op_put(t, op);
    }
    if (c->kind == FR_CQE_ERR)
        FR_ERR(err, FERRY_ERR_FABRIC,
               "fabric: completion error (write to rank %d): %s (%d), "
               "provider: %s (%d)",
               c->peer, fi_strerror(ee.err), ee.err, s ? s : "?",
               ee.prov_errno);
    else
        FR_ERR(err, FERRY_ERR_FABRIC,
               "fabric: completion error on an incoming %s (writer "
               "unknown): %s (%d), provider: %s (%d)",
               (ee.flags & FI_REMOTE_WRITE) ? "write" : "operation",
               fi_strerror(ee.err), ee.err, s ? s : "?", ee.prov_errno);
    return 0;
}

/* Is op_context one of this transport's posted ops? Checked by address
 * against the pool's chunks, so a context that is not ours (undefined for
 * remote completions) is never read. */
fr_fab_op_t *fab_op_ours(const fr_transport_t *t, const void *op_context)
{
    uintptr_t a = (uintptr_t)op_context;
    if (!op_context || a < t->pool_lo || a >= t->pool_hi)
        return NULL;
    for (const fr_fab_chunk_t *c = t->chunks; c; c = c->next) {
        uintptr_t lo = (uintptr_t)&c->ops[0];
        if (a < lo || a >= (uintptr_t)&c->ops[FR_FAB_POOL_CHUNK])
            continue;
        if ((a - lo) % sizeof(fr_fab_op_t) != 0)
            return NULL;
        fr_fab_op_t *op = (fr_fab_op_t *)op_context;
        return op->state == FR_FAB_OP_POSTED ? op : NULL;
    }
    return NULL;
}

/* One completion queue entry as an FR_CQE_RX or FR_CQE_TX; an entry that
 * is neither (not our op, no remote CQ data) is an FR_CQE_RXERR. */
static void fab_classify(fr_transport_t *t, const struct fi_cq_data_entry *e,
                         fr_cqe_t *c, fr_err_t *err)
{
    fr_fab_op_t *op = fab_op_ours(t, e->op_context);
    c->peer = -1;
    c->status = FERRY_OK;
    c->ctx = 0;
    c->imm = 0;
    if (op && !(e->flags & FI_REMOTE_WRITE)) {
        c->kind = FR_CQE_TX;
        c->imm = op->imm;
        c->peer = op->peer;
        c->ctx = op->ctx;
        t->inflight--;
        fab_op_put(t, op);
    } else if (e->flags & FI_REMOTE_CQ_DATA) {
        c->kind = FR_CQE_RX;
        c->imm = (uint32_t)e->data;
    } else {
        c->kind = FR_CQE_RXERR;
        c->status = FERRY_ERR_FABRIC;
        FR_ERR(err, FERRY_ERR_FABRIC,
               "fabric: provider %s: a completion that is neither one of "
               "this rank's writes nor a write with remote CQ data "
               "(flags 0x%llx, op_context %p)",
               t->prov, (unsigned long long)e->flags, e->op_context);
    }
}

int fab_poll(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err)
{
    if (t->absent)
        return 0;
    int n = fab_poll_failed(t, out, max, err);
    fab_drain_queue(t);

    struct fi_cq_data_entry ent[FR_FAB_CQ_BATCH];
    while (n < max) {
        int want = max - n < FR_FAB_CQ_BATCH ? max - n : FR_FAB_CQ_BATCH;
        ssize_t got = fi_cq_read(t->cq, ent, (size_t)want);
        if (got == -FI_EAGAIN)
            break;
        if (got == -FI_EAVAIL) {
            int rc = fab_poll_error(t, &out[n], err);
            if (rc < 0)
                return rc;
            if (rc > 0)
                break;
            n++;
            continue;
        }
        if (got < 0)
            return fab_fail(err, "fi_cq_read", (int)got);
        for (ssize_t i = 0; i < got; i++)
            fab_classify(t, &ent[i], &out[n++], err);
        if (got < want)
            break;
    }
    /* Completions may have made room for queued posts. */
    if (t->q_head)
        fab_drain_queue(t);
    return n;
}

int fab_pending(fr_transport_t *t)
{
    long p = t->inflight + t->nqueued + t->nerrors;
    return p > 0x7fffffff ? 0x7fffffff : (int)p;
}
