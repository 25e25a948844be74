/* NIC sharding and peer groups over any transport (see nics.h). */
#include "transport/nics.h"

#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "runtime/rt.h"

int fr_nics_open(fr_nics_t *x, fr_boot_t *boot, const char *name, long want,
                 int flags, fr_err_t *err)
{
    return fr_nics_open_eps(x, boot, name, want, 0, flags, err);
}

/* the settings' ranges (src/core/config.c) name these limits */
_Static_assert(FR_MAX_NIC_IFACES == 2, "FERRY_NICS_PER_RANK's range is 0..2 in core/config.c");
_Static_assert(FR_MAX_NICS == 8, "FERRY_PROXY_THREADS's range is 1..8 in core/config.c");

int fr_nics_open_eps(fr_nics_t *x, fr_boot_t *boot, const char *name, long want, int rails,
                     int flags, fr_err_t *err)
{
    memset(x, 0, sizeof(*x));
    /* libfabric shm regions of ranks of an earlier, killed job (their
     * launcher could not remove them), once per process */
    static int swept;
    if (!__atomic_exchange_n(&swept, 1, __ATOMIC_ACQ_REL))
        fr_shm_sweep_dead();
    x->N = fr_boot_size(boot);
    x->rank = fr_boot_rank(boot);
    int K = want > 0 ? (int)(want < FR_MAX_NIC_IFACES ? want : FR_MAX_NIC_IFACES)
                     : FR_MAX_NIC_IFACES;
    int R = rails > 1 ? rails : 1;
    if (R > FR_MAX_NICS)
        R = FR_MAX_NICS;
    while (R * K > FR_MAX_NICS) /* rails before interfaces */
        K--;
    int E = R * K;
    x->ifaces = K;
    x->nic_of = calloc((size_t)x->N, sizeof(int));
    if (!x->nic_of)
        return FR_ERR(err, FERRY_ERR_NOMEM, "NIC tables");
    for (int k = 0; k < E; k++) { /* endpoint k over interface k mod K */
        int rc = fr_transport_open(name, boot, k % K, flags, &x->ops, &x->tp[k],
                                   err);
        if (rc != FERRY_OK)
            return rc;
        x->n = k + 1;
    }
    for (int i = 0; i < x->N; i++) {
        int k = (x->rank + i) % E;
        if (!x->ops->has_peer(x->tp[k], i)) /* the same rail on interface 0 */
            k = k / K * K;
        x->nic_of[i] = x->ops->has_peer(x->tp[k], i) ? k : 0;
    }
    return FERRY_OK;
}

int fr_nics_reg(fr_nics_t *x, fr_boot_t *boot, void *p, size_t len,
                int remote_write, fr_nic_region_t *r, fr_err_t *err)
{
    return fr_nics_reg_dev(x, boot, p, len, remote_write, -1, r, err);
}

int fr_nics_reg_dev(fr_nics_t *x, fr_boot_t *boot, void *p, size_t len,
                    int remote_write, int device, fr_nic_region_t *r,
                    fr_err_t *err)
{
    memset(r, 0, sizeof(*r));
    if (remote_write) {
        r->desc = calloc((size_t)x->n * x->N, sizeof(*r->desc));
        if (!r->desc)
            return FR_ERR(err, FERRY_ERR_NOMEM, "descriptor tables");
    }
    for (int k = 0; k < x->n; k++) {
        fr_mr_desc_t mine;
        memset(&mine, 0, sizeof(mine));
        int rc = FERRY_OK;
        if (x->ops->has_peer(x->tp[k], x->rank))
            rc = x->ops->reg_dev(x->tp[k], p, len, remote_write, device,
                                 &r->mr[k], &mine, err);
        if (!remote_write) {
            if (rc != FERRY_OK)
                return rc;
            continue;
        }
        /* a rank that failed still joins the exchange (len 0 says so), so
         * that every rank fails here instead of waiting for it */
        if (rc != FERRY_OK)
            memset(&mine, 0, sizeof(mine));
        fr_err_t e2 = {{0}};
        int rc2 = fr_boot_allgather(boot, &mine, r->desc + (size_t)k * x->N,
                                    sizeof(mine), rc != FERRY_OK ? &e2 : err);
        if (rc != FERRY_OK)
            return rc;
        if (rc2 != FERRY_OK)
            return rc2;
        for (int i = 0; i < x->N; i++)
            if (i != x->rank && x->ops->has_peer(x->tp[k], i) &&
                r->desc[(size_t)k * x->N + i].len == 0)
                return FR_ERR(err, FERRY_ERR_FABRIC,
                              "rank %d could not register its receive region "
                              "with the fabric (its log says why)", i);
    }
    return FERRY_OK;
}

void fr_nics_dereg(fr_nics_t *x, fr_nic_region_t *r)
{
    for (int k = 0; k < FR_MAX_NICS; k++)
        if (r->mr[k])
            x->ops->dereg(x->tp[k], r->mr[k]);
    free(r->desc);
    memset(r, 0, sizeof(*r));
}

int fr_nics_groups(fr_nics_t *x, const int *peers, int npeers,
                   const fr_nic_region_t *src, const fr_nic_region_t *dst,
                   fr_nic_groups_t *g, fr_err_t *err)
{
    memset(g, 0, sizeof(*g));
    int *members = calloc((size_t)npeers + 1, sizeof(int));
    fr_mr_desc_t *remote = calloc((size_t)npeers + 1, sizeof(*remote));
    int rc = members && remote ? FERRY_OK
                               : FR_ERR(err, FERRY_ERR_NOMEM, "group tables");
    for (int k = 0; rc == FERRY_OK && k < x->n; k++) {
        g->idx[k] = calloc((size_t)npeers + 1, sizeof(int));
        if (!g->idx[k]) {
            rc = FR_ERR(err, FERRY_ERR_NOMEM, "group tables");
            break;
        }
        int n = 0;
        for (int i = 0; i < npeers; i++) {
            int p = peers[i];
            if (x->nic_of[p] != k)
                continue;
            g->idx[k][n] = i;
            members[n] = p;
            remote[n] = dst->desc[(size_t)k * x->N + p];
            n++;
        }
        g->n[k] = n;
        if (n == 0)
            continue;
        rc = x->ops->group_create(x->tp[k], members, n, src->mr[k], remote,
                                  &g->g[k], err);
        if (rc == FERRY_OK && !x->quiet)
            FR_LOG_INFO(FR_SUB_INIT, "NIC %d (%s): %d fabric peers", k,
                        x->ops->iface(x->tp[k]), n);
    }
    free(members);
    free(remote);
    return rc;
}

void fr_nics_groups_destroy(fr_nics_t *x, fr_nic_groups_t *g)
{
    for (int k = 0; k < FR_MAX_NICS; k++) {
        if (g->g[k])
            x->ops->group_destroy(x->tp[k], g->g[k]);
        free(g->idx[k]);
    }
    memset(g, 0, sizeof(*g));
}

void fr_nics_groups_places(const fr_nics_t *x, const fr_nic_groups_t *g, int npeers, int *nic,
                           int *pos)
{
    for (int k = 0; k < x->n; k++)
        for (int i = 0; i < g->n[k]; i++) {
            int p = g->idx[k][i];
            if (p >= 0 && p < npeers) {
                nic[p] = k;
                pos[p] = i;
            }
        }
}

void fr_nics_close(fr_nics_t *x)
{
    for (int k = 0; k < FR_MAX_NICS; k++)
        if (x->tp[k])
            x->ops->close(x->tp[k]);
    free(x->nic_of);
    memset(x, 0, sizeof(*x));
}
