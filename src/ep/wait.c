/*
 * The EP runtime's waits and failure rule: an EP fails with a sticky
 * status; a wait on flags ends in data, a deadline naming the ranks that
 * did not arrive, a dead rank, or the proxy's asynchronous error.
 */
#include "ep/ep.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "core/log.h"

int fr_ep_fail(ferry_ep_t ep, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ep->err.msg, sizeof(ep->err.msg), fmt, ap);
    va_end(ap);
    if (code == FERRY_ERR_TIMEOUT || code == FERRY_ERR_PEER ||
        code == FERRY_ERR_PROTOCOL || code == FERRY_ERR_FABRIC ||
        code == FERRY_ERR_SYSTEM || code == FERRY_ERR_INTERNAL)
        fr_ep_set_failed(ep, code);
    FR_LOG_INFO(FR_SUB_EP, "%s: %s", ferry_strerror(code), ep->err.msg);
    return code;
}

void fr_ep_set_failed(ferry_ep_t ep, int code)
{
    if (!ep->failed || !ep->cause.msg[0])
        snprintf(ep->cause.msg, sizeof(ep->cause.msg), "%s",
                 ep->err.msg[0] ? ep->err.msg : ferry_strerror(code));
    ep->failed = code;
}

int fr_ep_fail_gpu_wait(ferry_ep_t ep, const char *call, int rank)
{
    int dead = fr_boot_dead_rank(ep->comm->boot);
    if (dead >= 0 && fr_ep_masked(ep, dead))
        dead = -1; /* masked: never waited for, so not the one missing */
    int st = fr_async_status(&ep->async);
    if (dead < 0 && st != FERRY_OK)
        dead = fr_boot_blame(ep->comm->boot, st);
    if (dead >= 0)
        return fr_ep_fail(ep, FERRY_ERR_PEER, "%s: rank %d died (the GPU had no data from "
                          "rank %d after %ld ms)", call, dead, rank, ep->timeout_ms);
    if (st != FERRY_OK)
        return fr_ep_fail(ep, st, "%s: %.300s (the GPU had no data from rank %d after %ld ms)",
                          call, ep->async.msg, rank, ep->timeout_ms);
    return fr_ep_fail(ep, FERRY_ERR_TIMEOUT, "%s: no data from rank %d after %ld ms "
                      "(FERRY_TIMEOUT_MS; checked on the GPU)", call, rank, ep->timeout_ms);
}

/* mask_on_timeout: rank s, gone in round `epoch` (why), masked instead of
 * failing the wait; the wait goes on for the others. */
static void fr_mask_gone(ferry_ep_t ep, int s, uint64_t epoch, const char *what, const char *why)
{
    ep->mask[s] = 1;
    ep->mask_since[s] = epoch;
    FR_LOG_WARN(FR_SUB_EP, "%s round %llu: rank %d %s: masked from now on (mask_on_timeout)",
                what, (unsigned long long)epoch, s, why);
}

/* Senders below *next that have arrived are skipped; returns 1 when all
 * have, -1 on a protocol violation (message set), else 0. */
static int fr_scan_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                         int *next, const char *what)
{
    const fr_layout_t *L = &ep->L;
    while (*next < ep->N) {
        if (fr_ep_masked(ep, *next)) { /* never waited for */
            (*next)++;
            continue;
        }
        uint64_t v = __atomic_load_n(fr_flag_ptr(L, ep->flags, phase, set, *next),
                                     __ATOMIC_ACQUIRE);
        if (v == epoch) {
            (*next)++;
            continue;
        }
        if (v > epoch) {
            fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                       "%s round %llu: rank %d is at round %llu (two rounds "
                       "ahead is impossible)", what, (unsigned long long)epoch,
                       *next, (unsigned long long)v);
            return -1;
        }
        return 0;
    }
    return 1;
}

/* Wait costs: each sender not seen yet whose flag is up now was seen at
 * `now` (seen[s]: 1 + ns after the wait's start; 0 not yet). */
static void fr_cost_sweep(ferry_ep_t ep, int phase, int set, uint64_t epoch, uint64_t start,
                          uint64_t *seen)
{
    uint64_t now = 0;
    for (int s = 0; s < ep->N; s++) {
        if (seen[s] || fr_ep_masked(ep, s) || __atomic_load_n(fr_flag_ptr(&ep->L, ep->flags, phase, set, s),
                                       __ATOMIC_ACQUIRE) != epoch)
            continue;
        if (!now)
            now = fr_now_ns();
        seen[s] = 1 + (now - start);
    }
}

static int fr_wait_flags_loop(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                              const char *what, int64_t *cost, uint64_t *seen_at,
                              uint64_t start);

/* Spin briefly; then sleep on the doorbell (a futex in this rank's
 * segment) so ranks sharing cores do not starve each other; every 2 ms
 * check for dead peers, proxy errors and the deadline. With wait costs,
 * when each sender was first seen is kept (only then: a table per call). */
int fr_wait_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                  const char *what, int64_t *cost)
{
    uint64_t start = fr_now_ns(), *seen_at = NULL;
    if (cost && !(seen_at = calloc((size_t)ep->N, sizeof(uint64_t))))
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "%s: wait costs of %d ranks", what, ep->N);
    int rc = fr_wait_flags_loop(ep, phase, set, epoch, what, cost, seen_at, start);
    free(seen_at);
    return rc;
}

/* fr_wait_flags' loop (seen_at: [N] when cost is given). */
static int fr_wait_flags_loop(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                              const char *what, int64_t *cost, uint64_t *seen_at,
                              uint64_t start)
{
    const fr_layout_t *L = &ep->L;
    int N = ep->N;
    uint64_t last_check = start;
    uint64_t deadline = start + (uint64_t)ep->timeout_ms * 1000000ull;
    uint64_t iter = 0;
    int next = 0;
    for (;;) {
        int st = fr_scan_flags(ep, phase, set, epoch, &next, what);
        if (cost && st >= 0)
            fr_cost_sweep(ep, phase, set, epoch, start, seen_at);
        if (st > 0) {
            for (int s = 0; cost && s < N; s++)
                if (seen_at[s]) /* 0: masked, never waited for */
                    cost[s] += (int64_t)(seen_at[s] - 1);
            return FERRY_OK;
        }
        if (st < 0)
            return FERRY_ERR_PROTOCOL;
        if (iter < (uint64_t)ep->spin) {
            iter++;
            fr_cpu_relax();
            continue;
        }
        uint64_t now = fr_now_ns();
        if (now - last_check < 2000000ull && now < deadline) {
            uint32_t seen = fr_doorbell_read(ep->flags);
            fr_doorbell_sleepers_add(ep->flags, 1);
            st = fr_scan_flags(ep, phase, set, epoch, &next, what);
            if (st == 0) {
                uint64_t left = deadline - now, nap = 2000000ull;
                fr_doorbell_sleep(ep->flags, seen, left < nap ? left : nap);
            }
            fr_doorbell_sleepers_add(ep->flags, -1);
            continue;
        }
        last_check = now;
        st = fr_async_status(&ep->async);
        if (st != FERRY_OK) {
            int dead = fr_boot_blame(ep->comm->boot, st);
            if (dead >= 0)
                return fr_ep_fail(ep, FERRY_ERR_PEER,
                                  "%s round %llu: rank %d died (%.300s)", what,
                                  (unsigned long long)epoch, dead,
                                  ep->async.msg);
            return fr_ep_fail(ep, st, "%s round %llu: %s", what,
                              (unsigned long long)epoch, ep->async.msg);
        }
        /* a dead rank fails this wait only if its data is still missing:
         * a round it finished can still complete */
        int dead = fr_boot_dead_rank(ep->comm->boot), shrink = ep->cfg.mask_on_timeout;
        if (dead >= 0 && dead < N && !fr_ep_masked(ep, dead) &&
            __atomic_load_n(fr_flag_ptr(L, ep->flags, phase, set, dead),
                            __ATOMIC_ACQUIRE) != epoch) {
            if (!shrink)
                return fr_ep_fail(ep, FERRY_ERR_PEER,
                                  "%s round %llu: rank %d died", what,
                                  (unsigned long long)epoch, dead);
            fr_mask_gone(ep, dead, epoch, what, "died");
        }
        for (int s = next; s < N; s++) {
            if (ep->path[s] != FR_PATH_SHM || fr_ep_masked(ep, s))
                continue;
            pid_t pid = ep->comm->peers[s].pid;
            if (kill(pid, 0) != 0 && errno == ESRCH &&
                __atomic_load_n(fr_flag_ptr(L, ep->flags, phase, set, s),
                                __ATOMIC_ACQUIRE) != epoch) {
                if (!shrink)
                    return fr_ep_fail(ep, FERRY_ERR_PEER,
                                      "%s round %llu: rank %d (pid %d) died", what,
                                      (unsigned long long)epoch, s, (int)pid);
                fr_mask_gone(ep, s, epoch, what, "died");
            }
        }
        if (now >= deadline) {
            char list[256];
            size_t n = 0;
            int missing = 0;
            list[0] = 0;
            for (int s = next; s < N; s++) {
                uint64_t v = __atomic_load_n(
                    fr_flag_ptr(L, ep->flags, phase, set, s), __ATOMIC_ACQUIRE);
                if (v == epoch || fr_ep_masked(ep, s))
                    continue;
                if (shrink && s != ep->rank) { /* never masks itself */
                    fr_mask_gone(ep, s, epoch, what, "sent nothing within FERRY_TIMEOUT_MS");
                    continue;
                }
                missing++;
                if (n < sizeof(list) - 16)
                    n += (size_t)snprintf(list + n, sizeof(list) - n, "%s%d",
                                          missing > 1 ? "," : "", s);
            }
            if (!missing) /* every silent one masked: the scan ends the wait */
                continue;
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "%s round %llu: no data from rank%s %s after "
                              "%ld ms (FERRY_TIMEOUT_MS)",
                              what, (unsigned long long)epoch,
                              missing > 1 ? "s" : "", list, ep->timeout_ms);
        }
    }
}


int fr_ep_async_check(ferry_ep_t ep)
{
    int st = fr_async_status(&ep->async);
    if (st == FERRY_OK)
        return FERRY_OK;
    int dead = fr_boot_blame(ep->comm->boot, st);
    if (dead >= 0)
        return fr_ep_fail(ep, FERRY_ERR_PEER, "rank %d died (%.300s)", dead, ep->async.msg);
    return fr_ep_fail(ep, st, "%s", ep->async.msg);
}
