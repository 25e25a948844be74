/*
 * Put-with-signal: the host-side calls. Producers' puts go into the ring
 * the proxy reads; quiet waits until the proxy has settled everything
 * queued so far; wait polls a signal word; every wait checks the proxy's
 * and kernels' errors and dead ranks on the way. Also the accessors and
 * destroy.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ferry_signal.h"
#include "core/log.h"
#include "runtime/cuda_mem.h"
#include "runtime/rt.h"
#include "signal/sig_int.h"
#include "signal/signal.h"

static int fr_sig_fail(ferry_sig_t s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fr_sig_fail(ferry_sig_t s, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err.msg, sizeof(s->err.msg), fmt, ap);
    va_end(ap);
    FR_LOG_DEBUG(FR_SUB_SIG, "%s", s->err.msg);
    return code;
}

/* A failure that leaves the context unusable: its status, kept with its
 * message for every later call. */
static int fr_sig_stick(ferry_sig_t s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fr_sig_stick(ferry_sig_t s, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err.msg, sizeof(s->err.msg), fmt, ap);
    va_end(ap);
    FR_LOG_DEBUG(FR_SUB_SIG, "%s", s->err.msg);
    if (!s->failed) { /* the first failure is the one every call names */
        memcpy(s->failed_msg, s->err.msg, sizeof(s->failed_msg));
        s->failed = code;
    }
    return code;
}

/* The proxy's error, or a device-side one, or a dead rank. */
static int fr_sig_health(ferry_sig_t s, const char *what)
{
    int st = fr_async_status(&s->async);
    if (st != FERRY_OK) {
        int dead = fr_boot_blame(s->comm->boot, st);
        if (dead >= 0)
            return fr_sig_stick(s, FERRY_ERR_PEER,
                                "%s: rank %d died (%.300s)", what, dead,
                                s->async.msg);
        return fr_sig_stick(s, st, "%s: %s", what, s->async.msg);
    }
    if (s->cuda) {
        int dv = __atomic_load_n((volatile int *)s->errword, __ATOMIC_ACQUIRE);
        if (dv != 0) {
            static const char *const whats[] = {
                "?",
                "ferry_sig_dev_put: peer outside 0..nranks-1",
                "ferry_sig_dev_put: src_off + len beyond the heap",
                "ferry_sig_dev_put: dst_off + len beyond the heap",
                "ferry_sig_dev_put: sig_index >= num_signals",
                "ferry_sig_dev_put: op is neither SET nor ADD",
                "ferry_sig_dev_wait: sig_index >= num_signals",
                "ferry_sig_dev_put: the ring stayed full for 10 s"};
            /* what is stored after the status: give it a moment */
            int w = 0;
            for (int i = 0; i < 1000 && !w; i++)
                w = __atomic_load_n((volatile int *)s->errword + 1,
                                    __ATOMIC_ACQUIRE);
            return fr_sig_stick(
                       s, dv, "%s: a kernel's request was refused: %s (%s)",
                       what,
                       w > 0 && w < (int)(sizeof(whats) / sizeof(whats[0]))
                           ? whats[w]
                           : whats[0],
                       ferry_strerror(dv));
        }
    }
    int dead = fr_boot_dead_rank(s->comm->boot);
    if (dead >= 0)
        return fr_sig_fail(s, FERRY_ERR_PEER, "%s: rank %d died", what, dead);
    return FERRY_OK;
}

int ferry_sig_put(ferry_sig_t s, int peer, uint64_t dst_off, uint64_t src_off,
                  uint64_t len, uint32_t sig_index, ferry_sig_op_t op,
                  uint64_t value)
{
    if (!s)
        return FERRY_ERR_INVALID;
    if (s->cuda)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "put: this context was created with device = "
                           "CUDA; kernels queue its puts "
                           "(ferry_signal_device.cuh)");
    int rc = fr_sig_check_req(s->N, s->heap_bytes, s->nsig, peer, dst_off,
                              src_off, len, sig_index, (uint32_t)op, &s->err);
    if (rc != FERRY_OK)
        return rc;
    if (s->failed)
        return fr_sig_fail(s, s->failed,
                           "put: the context failed before: %.400s",
                           s->failed_msg[0] ? s->failed_msg
                                            : ferry_strerror(s->failed));
    ferry_sig_ring_t *rg = s->ring;
    uint64_t i = __atomic_fetch_add(&rg->tail, 1, __ATOMIC_ACQ_REL);
    uint64_t iter = 0, deadline = 0;
    while (i - __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE) >= FR_SIG_RING) {
        if (!deadline)
            deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
        fr_backoff(&iter, s->spin);
        if ((rc = fr_sig_health(s, "put")) != FERRY_OK)
            return rc;
        if (fr_now_ns() > deadline)
            return fr_sig_stick(
                       s, FERRY_ERR_TIMEOUT,
                       "put: the proxy took no request for %ld ms (ring of "
                       "%d full)",
                       s->timeout_ms, FR_SIG_RING);
    }
    ferry_sig_req_t *q = &rg->req[i & (FR_SIG_RING - 1)];
    q->peer = peer;
    q->sig_index = sig_index;
    q->dst_off = dst_off;
    q->src_off = src_off;
    q->len = len;
    q->value = value;
    q->op = (uint32_t)op;
    __atomic_store_n(&q->seq, i + 1, __ATOMIC_RELEASE);
    return FERRY_OK;
}

int ferry_sig_quiet(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    uint64_t target;
    int rc;
    if (s->cuda) {
        fr_err_t e = {{0}};
        if ((rc = fr_cuda_dev_read(s->d_reserve, &target, &e)) != FERRY_OK)
            return fr_sig_fail(s, rc, "quiet: %s", e.msg);
    } else {
        target = __atomic_load_n(&s->ring->tail, __ATOMIC_ACQUIRE);
    }
    uint64_t iter = 0;
    uint64_t deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
    while (__atomic_load_n(&s->settled, __ATOMIC_ACQUIRE) < target) {
        if ((rc = fr_sig_health(s, "quiet")) != FERRY_OK)
            return rc;
        fr_backoff(&iter, s->spin);
        if (fr_now_ns() > deadline)
            return fr_sig_stick(
                       s, FERRY_ERR_TIMEOUT,
                       "quiet: %llu of %llu requests done after %ld ms "
                       "(%lld writes in flight)",
                       (unsigned long long)__atomic_load_n(&s->settled,
                                                           __ATOMIC_ACQUIRE),
                       (unsigned long long)target, s->timeout_ms,
                       (long long)__atomic_load_n(&s->inflight,
                                                  __ATOMIC_RELAXED));
    }
    return fr_sig_health(s, "quiet");
}

int ferry_sig_wait(ferry_sig_t s, uint32_t idx, ferry_sig_cmp_t cmp,
                   uint64_t value, uint64_t *seen)
{
    if (!s)
        return FERRY_ERR_INVALID;
    if (idx >= s->nsig)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "wait: sig_index %u is not in [0, %u)", idx,
                           s->nsig);
    if (cmp != FERRY_SIG_CMP_GE && cmp != FERRY_SIG_CMP_EQ)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "wait: cmp %d is neither GE nor EQ", (int)cmp);
    uint64_t iter = 0, v = 0, deadline = 0;
    int rc;
    for (;;) {
        v = __atomic_load_n(&s->signals[idx], __ATOMIC_ACQUIRE);
        if (cmp == FERRY_SIG_CMP_GE ? v >= value : v == value)
            break;
        if ((iter & 63) == 0) {
            if (!deadline)
                deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
            if ((rc = fr_sig_health(s, "wait")) != FERRY_OK) {
                if (seen)
                    *seen = v;
                return rc;
            }
            if (fr_now_ns() > deadline) {
                if (seen)
                    *seen = v;
                return fr_sig_fail(s, FERRY_ERR_TIMEOUT,
                                   "wait: signal %u is %llu after %ld ms, "
                                   "waited for %s %llu",
                                   idx, (unsigned long long)v, s->timeout_ms,
                                   cmp == FERRY_SIG_CMP_GE ? ">=" : "==",
                                   (unsigned long long)value);
            }
        }
        fr_backoff(&iter, s->spin);
    }
    if (seen)
        *seen = v;
    return FERRY_OK;
}

int ferry_sig_check(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    return fr_sig_health(s, "check");
}

uint64_t ferry_sig_read(ferry_sig_t s, uint32_t idx)
{
    if (!s || idx >= s->nsig)
        return 0;
    return __atomic_load_n(&s->signals[idx], __ATOMIC_ACQUIRE);
}

int ferry_sig_landed(ferry_sig_t s, int peer, uint64_t *count)
{
    if (!s || !count)
        return FERRY_ERR_INVALID;
    if (peer < 0 || peer >= s->N)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "landed: peer %d is not a rank in [0, %d)", peer,
                           s->N);
    *count = __atomic_load_n(&s->src[peer].landed, __ATOMIC_ACQUIRE);
    return FERRY_OK;
}

ferry_sig_mode_t ferry_sig_mode(ferry_sig_t s)
{
    return s ? (ferry_sig_mode_t)s->mode : FERRY_SIG_MODE_DEFAULT;
}

void *ferry_sig_heap(ferry_sig_t s) { return s ? s->heap : NULL; }

const char *ferry_sig_last_error(ferry_sig_t s)
{
    return s ? s->err.msg : "sig: NULL handle";
}

int ferry_sig_device(ferry_sig_t s, ferry_sig_device_t *out)
{
    if (!s || !out)
        return FERRY_ERR_INVALID;
    if (!s->cuda)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "device: this context was created with device = "
                           "CPU");
    memset(out, 0, sizeof(*out));
    out->ring = s->d_ring;
    out->reserve = s->d_reserve;
    out->heap = s->d_heap;
    out->signals = s->d_signals;
    out->error = s->d_errword;
    out->rank = s->rank;
    out->nranks = s->N;
    out->ring_slots = FR_SIG_RING;
    out->num_signals = s->nsig;
    out->heap_bytes = s->heap_bytes;
    return FERRY_OK;
}

int ferry_sig_destroy(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    int rc = FERRY_OK;
    if (!s->failed)
        rc = ferry_sig_quiet(s);
    /* Nobody tears down memory a peer may still write into (a peer's
     * credits and records for ours included). */
    if (rc == FERRY_OK && fr_boot_dead_rank(s->comm->boot) < 0) {
        fr_err_t err = {{0}};
        int b = fr_boot_barrier(s->comm->boot, &err);
        if (b != FERRY_OK)
            rc = b;
    }
    FR_LOG_INFO(FR_SUB_SIG,
                "put-with-signal: %llu puts, %llu signal records in %llu "
                "writes, %llu credits sent; times a record waited for its "
                "puts: %llu",
                (unsigned long long)s->n_puts, (unsigned long long)s->n_sigs,
                (unsigned long long)s->n_sig_writes,
                (unsigned long long)s->n_credits,
                (unsigned long long)s->n_held);
    ferry_comm_t comm = s->comm;
    fr_sig_free(s);
    __atomic_sub_fetch(&comm->users, 1, __ATOMIC_ACQ_REL);
    return rc;
}
