/*
 * DP groups (config.dp_size): every member of a group holds the group's
 * tokens; each sends its share, and the combine's shares are gathered so
 * that every member ends with every token's result. The gather goes
 * through a region per member in POSIX shared memory (the group is inside
 * one node), mapped by the other members at create:
 *
 *   [0]    ready: the last gather whose rows are in (release store)
 *   [8]    T and whether weights came with the rows, of that gather
 *   [64]   read: the last gather in which this member copied every other
 *          member's rows out
 *   [128]  rows [share][H] bf16, then weights [share][K] float
 *
 * Gather e: wait until every other member has read gather e - 1 (so no
 * one still copies from this region), write the own share, ready = e;
 * then copy each other member's share once its ready is e, read = e.
 * Every member runs the same gathers in the same order (one per combine).
 */
#include "ep/ep.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FR_DP_READY 0
#define FR_DP_T 8
#define FR_DP_W 12
#define FR_DP_READ 64
#define FR_DP_ROWS 128

typedef struct fr_dp_hello {
    int32_t status;
    char name[96];
} fr_dp_hello_t;

static uint64_t *fr_dp_word(uint8_t *region, size_t off)
{
    return (uint64_t *)(region + off);
}

int fr_dp_open(ferry_ep_t ep, fr_err_t *err)
{
    fr_dp_t *d = &ep->dp;
    if (d->G <= 1)
        return FERRY_OK;
    int N = ep->N, me = ep->rank, G = d->G, g0 = me - d->m;
    d->share = (d->T + G - 1) / G;
    d->bytes = FR_DP_ROWS + (size_t)d->share * (2 * (size_t)ep->cfg.hidden +
                                                 4 * (size_t)ep->cfg.topk);
    d->peer = calloc((size_t)G, sizeof(uint8_t *));
    fr_dp_hello_t mine, *all = calloc((size_t)N, sizeof(*all));
    memset(&mine, 0, sizeof(mine));
    if (!d->peer || !all) {
        free(all);
        return FR_ERR(err, FERRY_ERR_NOMEM, "dp_size: region tables");
    }
    mine.name[0] = '/';
    if (fr_shm_name(mine.name + 1, sizeof(mine.name) - 1, FR_SHM_EP, "g%d-%llx", me,
                    (unsigned long long)fr_now_ns()) < 0)
        mine.status = FR_ERR(err, FERRY_ERR_INTERNAL, "dp_size: region name too long");
    if (mine.status == FERRY_OK) {
        snprintf(d->name, sizeof(d->name), "%s", mine.name);
        mine.status = fr_shm_create(d->name, d->bytes, &d->peer[d->m], err);
    }
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK && mine.status != FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to create its DP group region (%s)",
                        i, ferry_strerror(all[i].status));
    for (int j = 0; j < G && rc == FERRY_OK; j++) {
        all[g0 + j].name[sizeof(all[0].name) - 1] = 0;
        if (j != d->m)
            rc = fr_shm_map(all[g0 + j].name, d->bytes, &d->peer[j], err);
    }
    free(all);
    /* every member mapped every region: the names can go */
    if (rc == FERRY_OK)
        rc = fr_boot_barrier(ep->comm->boot, err);
    if (d->name[0])
        fr_shm_unlink(d->name);
    d->name[0] = 0;
    return rc;
}

void fr_dp_close(ferry_ep_t ep)
{
    fr_dp_t *d = &ep->dp;
    if (d->peer)
        for (int j = 0; j < d->G; j++)
            if (d->peer[j])
                fr_shm_unmap(d->peer[j], d->bytes);
    if (d->name[0])
        fr_shm_unlink(d->name);
    free(d->peer);
    d->peer = NULL;
}

/* Wait until member j's word at `off` is at least v: spin, then nap;
 * every 2 ms check for a dead rank and the deadline (both named). */
static int fr_dp_wait(ferry_ep_t ep, int j, size_t off, uint64_t v, const char *what)
{
    fr_dp_t *d = &ep->dp;
    int rank = ep->rank - d->m + j;
    const uint64_t *w = fr_dp_word(d->peer[j], off);
    uint64_t start = fr_now_ns(), last = start;
    uint64_t deadline = start + (uint64_t)ep->timeout_ms * 1000000ull;
    for (long it = 0;; it++) {
        if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= v)
            return FERRY_OK;
        if (it < ep->spin) {
            fr_cpu_relax();
            continue;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
        uint64_t now = fr_now_ns();
        if (now - last < 2000000ull && now < deadline)
            continue;
        last = now;
        int dead = fr_boot_dead_rank(ep->comm->boot);
        if (dead < 0 && kill(ep->comm->peers[rank].pid, 0) != 0 && errno == ESRCH)
            dead = rank;
        if (dead >= 0)
            return fr_ep_fail(ep, FERRY_ERR_PEER, "%s: rank %d died (DP group of rank %d)",
                              what, dead, ep->rank);
        if (now >= deadline)
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "%s: DP group member rank %d did not %s its share after %ld ms "
                              "(FERRY_TIMEOUT_MS)", what, rank,
                              off == FR_DP_READY ? "write" : "read the previous", ep->timeout_ms);
    }
}

int fr_dp_gather(ferry_ep_t ep, void *out, float *w, int T, const char *what)
{
    fr_dp_t *d = &ep->dp;
    int G = d->G, m = d->m, H = ep->cfg.hidden, K = ep->cfg.topk, rc = FERRY_OK;
    size_t rowb = 2 * (size_t)H, wrow = sizeof(float) * (size_t)K;
    uint64_t e = ++d->epoch;
    uint8_t *mine = d->peer[m];
    int lo, hi;
    for (int j = 0; j < G; j++)
        if (j != m && (rc = fr_dp_wait(ep, j, FR_DP_READ, e - 1, what)))
            return rc;
    fr_dp_share(T, G, m, &lo, &hi);
    if (hi > lo)
        memcpy(mine + FR_DP_ROWS, (uint8_t *)out + (size_t)lo * rowb, (size_t)(hi - lo) * rowb);
    if (w && hi > lo)
        memcpy(mine + FR_DP_ROWS + (size_t)d->share * rowb, w + (size_t)lo * K,
               (size_t)(hi - lo) * wrow);
    *(int32_t *)(mine + FR_DP_T) = T;
    *(int32_t *)(mine + FR_DP_W) = w != NULL;
    __atomic_store_n(fr_dp_word(mine, FR_DP_READY), e, __ATOMIC_RELEASE);
    int bad = -1, badT = 0;
    for (int j = 0; j < G && rc == FERRY_OK; j++) {
        if (j == m || (rc = fr_dp_wait(ep, j, FR_DP_READY, e, what)))
            continue;
        const uint8_t *r = d->peer[j];
        int tj = *(const int32_t *)(r + FR_DP_T), wj = *(const int32_t *)(r + FR_DP_W);
        if (tj != T || (w && !wj)) { /* copy nothing of it; the others go on */
            if (bad < 0) {
                bad = j;
                badT = tj;
            }
            continue;
        }
        fr_dp_share(T, G, j, &lo, &hi);
        if (hi == lo)
            continue;
        memcpy((uint8_t *)out + (size_t)lo * rowb, r + FR_DP_ROWS, (size_t)(hi - lo) * rowb);
        if (w)
            memcpy(w + (size_t)lo * K, r + FR_DP_ROWS + (size_t)d->share * rowb,
                   (size_t)(hi - lo) * wrow);
    }
    if (rc)
        return rc; /* a dead member or a timeout: the context has failed */
    __atomic_store_n(fr_dp_word(mine, FR_DP_READ), e, __ATOMIC_RELEASE);
    if (bad >= 0) {
        int rank = ep->rank - m + bad;
        if (badT != T)
            return fr_ep_fail(ep, FERRY_ERR_INVALID,
                              "%s: DP group member rank %d passed %d tokens, this rank %d: "
                              "members call with the same arguments (out is not complete)",
                              what, rank, badT, T);
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "%s: topk_weights given on rank %d, not on DP group member rank %d: "
                          "members call with the same arguments", what, ep->rank, rank);
    }
    return FERRY_OK;
}
