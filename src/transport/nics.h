/*
 * NICs and peer groups over any transport: one transport instance per NIC
 * of this rank, peers sharded across them, memory registered on each and
 * its descriptors exchanged, one peer group per NIC. Used by the EP and by
 * put-with-signal.
 *
 * A pair of ranks (a, b) talks over NIC (a + b) mod K when both have it,
 * else over NIC 0, so both sides agree without another exchange. Opening
 * NIC k is collective: a rank without it still takes part.
 *
 * "NIC" here is an endpoint: a rank may open R endpoints per interface
 * (fr_nics_open_eps), endpoint v = r * K + k going over interface k of K,
 * so that R proxy threads each own one endpoint per interface (r: the
 * thread, src/proxy/). Peers are sharded over the R * K endpoints as
 * above; where a pair lacks its endpoint's interface, it takes the same
 * thread's endpoint on interface 0, else endpoint 0.
 */
#ifndef FR_NICS_H
#define FR_NICS_H

#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_MAX_NICS 8        /* endpoints */
#define FR_MAX_NIC_IFACES 2  /* interfaces opened by default (FERRY_NICS_PER_RANK 0) */

typedef struct fr_nics {
    const fr_transport_ops_t *ops;
    int n;                           /* NIC indices (endpoints) opened */
    int ifaces;                      /* interfaces: endpoint v is on v % ifaces */
    int N, rank;
    fr_transport_t *tp[FR_MAX_NICS];
    int *nic_of;                     /* [N] NIC each rank is reached through */
    int quiet;                       /* set after fr_nics_open: fr_nics_groups
                                        logs no line per group */
} fr_nics_t;

/* A region registered on every NIC this rank has. desc (remote regions
 * only): [n][N] every rank's descriptor per NIC (zero where absent). */
typedef struct fr_nic_region {
    fr_mr_t *mr[FR_MAX_NICS];
    fr_mr_desc_t *desc;
} fr_nic_region_t;

/* Per NIC, the group of the given peers reached through it; idx[k][i] is
 * the position in the caller's peer list of group k's member i. */
typedef struct fr_nic_groups {
    fr_group_t *g[FR_MAX_NICS];
    int n[FR_MAX_NICS];
    int *idx[FR_MAX_NICS];
} fr_nic_groups_t;

/* Open `want` NICs (0: as many as the node has, up to FR_MAX_NIC_IFACES)
 * of transport `name` with FR_TP_OPEN_* flags. Collective. */
int fr_nics_open(fr_nics_t *x, fr_boot_t *boot, const char *name, long want,
                 int flags, fr_err_t *err);
/* fr_nics_open with `rails` endpoints per interface (0 or 1: one; the
 * total capped at FR_MAX_NICS, fewer interfaces then). Collective,
 * `rails` the same on every rank. */
int fr_nics_open_eps(fr_nics_t *x, fr_boot_t *boot, const char *name, long want, int rails,
                     int flags, fr_err_t *err);
/* Register [p, p+len) on every NIC this rank has; remote_write: peers
 * write into it, and every rank's descriptors are exchanged (collective). */
int fr_nics_reg(fr_nics_t *x, fr_boot_t *boot, void *p, size_t len,
                int remote_write, fr_nic_region_t *r, fr_err_t *err);
/* fr_nics_reg for memory of CUDA device `device` (-1: host memory); the
 * NICs must have been opened with FR_TP_OPEN_HMEM. */
int fr_nics_reg_dev(fr_nics_t *x, fr_boot_t *boot, void *p, size_t len,
                    int remote_write, int device, fr_nic_region_t *r,
                    fr_err_t *err);
void fr_nics_dereg(fr_nics_t *x, fr_nic_region_t *r);
/* Groups of peers[0..npeers) sharded by NIC: writes go from `src` to each
 * peer's `dst` (a region registered with remote_write). */
int fr_nics_groups(fr_nics_t *x, const int *peers, int npeers,
                   const fr_nic_region_t *src, const fr_nic_region_t *dst,
                   fr_nic_groups_t *g, fr_err_t *err);
void fr_nics_groups_destroy(fr_nics_t *x, fr_nic_groups_t *g);
/* For each of the npeers peers of the caller's list, the NIC whose group
 * holds it (nic[p]) and its place in that group (pos[p]); peers in no
 * group are left as they are. */
void fr_nics_groups_places(const fr_nics_t *x, const fr_nic_groups_t *g, int npeers, int *nic,
                           int *pos);
void fr_nics_close(fr_nics_t *x);

/* The NIC's interface name, for logs. */
static inline const char *fr_nics_iface(const fr_nics_t *x, int rank)
{
    return x->ops->iface(x->tp[x->nic_of[rank]]);
}

#ifdef __cplusplus
}
#endif

#endif
