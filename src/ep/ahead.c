/* Calls queued ahead of the GPU, bounded (ahead.h). */
#include "ep/ahead.h"

#include "bootstrap/bootstrap.h"
#include "runtime/cuda_mem.h"
#include "runtime/rt.h"

int fr_ahead_init(ferry_ep_t ep, fr_ahead_t *a, int n, fr_err_t *err)
{
    *a = (fr_ahead_t){0};
    if (ep->rx_flush == FR_RX_FLUSH_NONE)
        return FERRY_OK;
    if (n < 1 || n > FR_AHEAD_MAX)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_ahead_init: n = %d", n);
    for (int i = 0; i < n; i++) {
        int rc = fr_cuda_event_new(&a->ev[i], err);
        if (rc != FERRY_OK) {
            fr_ahead_free(a);
            return rc;
        }
    }
    a->n = n;
    return FERRY_OK;
}

void fr_ahead_free(fr_ahead_t *a)
{
    for (int i = 0; i < FR_AHEAD_MAX; i++)
        fr_cuda_event_free(a->ev[i]);
    *a = (fr_ahead_t){0};
}

int fr_ahead_wait(ferry_ep_t ep, fr_ahead_t *a, uint64_t k, void *stream, const char *call,
                  int (*check)(ferry_ep_t ep))
{
    if (!a->n)
        return FERRY_OK;
    int i = (int)(k % (uint64_t)a->n);
    if (!a->seen[i] || fr_cuda_capturing(stream))
        return FERRY_OK;
    unsigned long long before = (unsigned long long)(a->seen[i] - 1);
    /* at most 30 days, so that in ns it stays within 64 bits at any rank
     * count (FERRY_TIMEOUT_MS is at most a week) */
    long ms = (long)(ep->N + 2) * ep->timeout_ms + 1000;
    if (ms > 30 * 86400000L)
        ms = 30 * 86400000L;
    uint64_t deadline = fr_now_ns() + (uint64_t)ms * 1000000ull, iter = 0;
    for (;;) {
        const char *why = "";
        int done = fr_cuda_event_done(a->ev[i], &why);
        if (done < 0)
            return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "%s: waiting for combine #%llu on the GPU: "
                              "%s", call, before, why);
        int rc = check ? check(ep) : FERRY_OK;
        if (done || rc != FERRY_OK)
            return rc;
        if (fr_now_ns() > deadline) {
            int dead = fr_boot_dead_rank(ep->comm->boot);
            if (dead >= 0 && !fr_ep_masked(ep, dead))
                return fr_ep_fail(ep, FERRY_ERR_PEER, "%s: rank %d died (combine #%llu had "
                                  "not finished on the GPU after %ld ms)", call, dead, before,
                                  ms);
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "%s: combine #%llu had not finished on the GPU after %ld ms "
                              "((ranks + 2) x FERRY_TIMEOUT_MS + 1 s, at most 30 days), though "
                              "no wait on the GPU timed out", call, before, ms);
        }
        fr_backoff(&iter, ep->spin);
    }
}

void fr_ahead_mark(fr_ahead_t *a, uint64_t k, void *stream)
{
    if (!a->n || fr_cuda_capturing(stream))
        return;
    int i = (int)(k % (uint64_t)a->n);
    /* a failed record leaves the bound looser this once (the call's
     * launch was checked before): nothing else changes */
    if (fr_cuda_event_record(a->ev[i], stream) == 0)
        a->seen[i] = k + 1;
}
