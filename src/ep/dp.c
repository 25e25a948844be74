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
 *
 * CUDA ranks (dp_cuda.cu): the regions are device memory shared through
 * CUDA IPC, the engine's combine writes the own rows straight into the
 * own region, and the same steps run as kernels on the call's stream,
 * the gather count kept on the GPU so that a captured graph replays it.
 */
#include "ep/ep.h"
#include "runtime/peer_mem.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* What each rank tells the others at create: its region's shm name (CPU
 * ranks; CUDA ranks share theirs as peer memory, ep/pmem.c). */
typedef struct fr_dp_hello {
    int32_t status;
    char name[96];
} fr_dp_hello_t;

static uint64_t *fr_dp_word(uint8_t *region, size_t off)
{
    return (uint64_t *)(region + off);
}

/* CUDA ranks: this member's region in device memory, of the kind of peer
 * memory every rank agrees on, and the members' opened (collective). */
static int fr_dp_cuda_regions(ferry_ep_t ep, fr_err_t *err)
{
    fr_dp_t *d = &ep->dp;
    int N = ep->N, g0 = ep->rank - d->m, dev = -1, kind = 0, rc;
    fr_pmem_t own;
    memset(&own, 0, sizeof(own));
    int st = fr_cuda_device_current(&dev, err);
    d->pm = (fr_pmem_t *)calloc((size_t)N, sizeof(fr_pmem_t));
    if (st == FERRY_OK && !d->pm)
        st = FR_ERR(err, FERRY_ERR_NOMEM, "dp_size: region tables");
    if ((rc = fr_ep_pmem_kind(ep, st, dev, NULL, &kind, NULL, err)) != FERRY_OK)
        return rc;
    st = fr_pmem_alloc(kind, dev, d->bytes, &own, err);
    if (st != FERRY_OK) {
        char m[FR_ERRMSG_LEN];
        snprintf(m, sizeof(m), "%s", err->msg);
        st = FR_ERR(err, st, "dp_size: the group region: %s", m);
    }
    rc = fr_ep_pmem_share(ep, st, &own, g0, g0 + d->G, d->pm, err);
    d->pm[ep->rank] = own;
    if (rc != FERRY_OK)
        return rc;
    for (int j = 0; j < d->G; j++)
        d->peer[j] = (uint8_t *)d->pm[g0 + j].ptr;
    return FERRY_OK;
}

/* CPU ranks: this member's region in POSIX shared memory, named to the
 * others in an allgather, and the members' mapped (collective). */
static int fr_dp_shm_regions(ferry_ep_t ep, fr_err_t *err)
{
    fr_dp_t *d = &ep->dp;
    int N = ep->N, me = ep->rank, g0 = me - d->m;
    fr_dp_hello_t mine, *all = calloc((size_t)N, sizeof(*all));
    memset(&mine, 0, sizeof(mine));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "dp_size: region tables");
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
    for (int j = 0; j < d->G && rc == FERRY_OK; j++) {
        all[g0 + j].name[sizeof(all[0].name) - 1] = 0;
        if (j != d->m)
            rc = fr_shm_map(all[g0 + j].name, d->bytes, &d->peer[j], err);
    }
    free(all);
    return rc;
}

int fr_dp_open(ferry_ep_t ep, fr_err_t *err)
{
    fr_dp_t *d = &ep->dp;
    if (d->G <= 1)
        return FERRY_OK;
    int G = d->G;
    d->share = (d->T + G - 1) / G;
    d->bytes = FR_DP_ROWS + (size_t)d->share * (2 * (size_t)ep->cfg.hidden +
                                                 4 * (size_t)ep->cfg.topk);
    d->cuda = ep->cfg.device == FERRY_DEVICE_CUDA;
    d->peer = calloc((size_t)G, sizeof(uint8_t *));
    if (!d->peer)
        return FR_ERR(err, FERRY_ERR_NOMEM, "dp_size: region tables");
    int rc = d->cuda ? fr_dp_cuda_regions(ep, err) : fr_dp_shm_regions(ep, err);
    if (rc == FERRY_OK && d->cuda) {
        d->cu.G = G;
        d->cu.m = d->m;
        d->cu.g0 = ep->rank - d->m;
        d->cu.H = ep->cfg.hidden;
        d->cu.K = ep->cfg.topk;
        d->cu.share = d->share;
        d->cu.timeout_ns = (long long)ep->timeout_ms * 1000000ll;
        rc = fr_dp_cuda_tables(&d->cu, d->peer, err);
    }
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
    if (d->cuda)
        fr_dp_cuda_tables_free(&d->cu);
    if (d->pm) /* CUDA ranks: the own region and the members' */
        for (int i = 0; i < ep->N; i++)
            fr_pmem_close(&d->pm[i]);
    free(d->pm);
    d->pm = NULL;
    if (d->peer && !d->cuda)
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

void fr_dp_target(ferry_ep_t ep, void *out, float *w, int lo, void **tout, float **tw)
{
    fr_dp_t *d = &ep->dp;
    if (d->cuda) {
        uint8_t *rows = d->peer[d->m] + FR_DP_ROWS;
        *tout = rows;
        *tw = w ? (float *)(rows + (size_t)d->share * 2 * (size_t)ep->cfg.hidden) : NULL;
        return;
    }
    *tout = out ? (uint8_t *)out + (size_t)lo * 2 * (size_t)ep->cfg.hidden : NULL;
    *tw = w ? w + (size_t)lo * (size_t)ep->cfg.topk : NULL;
}

int fr_dp_begin(ferry_ep_t ep, void *stream, const char *what)
{
    fr_err_t err;
    if (!ep->dp.cuda || fr_dp_cuda_begin(&ep->dp.cu, stream, &err) == FERRY_OK)
        return FERRY_OK;
    return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "%s: %s", what, err.msg);
}

int fr_dp_check(ferry_ep_t ep)
{
    fr_dp_t *d = &ep->dp;
    if (!d->cuda || !d->cu.err_host || !__atomic_load_n(&d->cu.err_host[0], __ATOMIC_ACQUIRE))
        return FERRY_OK;
    int st = d->cu.err_host[0], rank = d->cu.err_host[1], what = d->cu.err_host[2];
    int detail = d->cu.err_host[3];
    if (what == 3)
        return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                          "combine: DP group member rank %d passed %d tokens, this rank a "
                          "different count: members call with the same arguments", rank, detail);
    if (what == 4)
        return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                          "combine: DP group member rank %d gave no topk_weights where this "
                          "rank did: members call with the same arguments", rank);
    int dead = fr_boot_dead_rank(ep->comm->boot);
    if (dead >= 0)
        return fr_ep_fail(ep, FERRY_ERR_PEER, "combine: rank %d died (the GPU waited for DP "
                          "group member rank %d)", dead, rank);
    return fr_ep_fail(ep, st, "combine: DP group member rank %d did not %s after %ld ms "
                      "(FERRY_TIMEOUT_MS; checked on the GPU)", rank,
                      what == 1 ? "read the previous gather" : "write its share",
                      ep->timeout_ms);
}

int fr_dp_gather(ferry_ep_t ep, void *out, float *w, int T, void *stream, const char *what)
{
    fr_dp_t *d = &ep->dp;
    if (d->cuda) {
        fr_err_t err;
        if (fr_dp_cuda_gather(&d->cu, out, w, T, stream, &err) == FERRY_OK)
            return FERRY_OK;
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "%s: %s", what, err.msg);
    }
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
