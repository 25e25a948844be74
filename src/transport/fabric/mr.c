/*
 * libfabric transport: memory registration and peer groups. A region is
 * registered with the access its use needs and its key and base handed
 * back for the peers; a group holds per-peer write templates (address,
 * remote base, key, registered length) prepared once, so that a post only
 * adds offsets. Both live on lists of the transport and are freed at close.
 */
#include <stdint.h>
#include <stdlib.h>

#include <rdma/fi_errno.h>

#include "core/log.h"
#include "transport/fabric/fab_int.h"

int fab_reg(fr_transport_t *t, void *ptr, size_t len, int remote_write,
            fr_mr_t **mrp, fr_mr_desc_t *desc, fr_err_t *err)
{
    *mrp = NULL;
    if (!ptr || len == 0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: registering %p, %zu bytes: need memory", ptr,
                      len);
    fr_mr_t *m = calloc(1, sizeof(*m));
    if (!m)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    /* A remotely writable region may also serve as a source. */
    uint64_t access = remote_write ? (FI_REMOTE_WRITE | FI_WRITE) : FI_WRITE;
    uint64_t req_key = (t->mr_mode & FI_MR_PROV_KEY) ? 0 : t->next_key++;
    int frc = fi_mr_reg(t->domain, ptr, len, access, 0, req_key, 0, &m->mr,
                        NULL);
    if (frc) {
        free(m);
        return FR_ERR(err, FERRY_ERR_FABRIC,
                      "fabric: fi_mr_reg(%p, %zu bytes) failed: %s (%d)", ptr,
                      len, fi_strerror(-frc), frc);
    }
    if (t->mr_mode & FI_MR_ENDPOINT) {
        if ((frc = fi_mr_bind(m->mr, &t->ep->fid, 0)) ||
            (frc = fi_mr_enable(m->mr))) {
            fi_close(&m->mr->fid);
            free(m);
            return fab_fail(err, "fi_mr_bind/fi_mr_enable", frc);
        }
    }
    m->buf = ptr;
    m->len = len;
    m->desc = fi_mr_desc(m->mr);
    m->key = fi_mr_key(m->mr);
    if (m->key == FI_KEY_NOTAVAIL) {
        fi_close(&m->mr->fid);
        free(m);
        return FR_ERR(err, FERRY_ERR_FABRIC,
                      "fabric: fi_mr_key: key not available");
    }
    m->next = t->mrs;
    if (t->mrs)
        t->mrs->prev = m;
    t->mrs = m;
    if (desc) {
        desc->base = (t->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)ptr
                                                    : 0;
        desc->key = m->key;
        desc->len = len;
    }
    *mrp = m;
    return FERRY_OK;
}

void fab_dereg(fr_transport_t *t, fr_mr_t *m)
{
    if (!m)
        return;
    if (m->prev)
        m->prev->next = m->next;
    else
        t->mrs = m->next;
    if (m->next)
        m->next->prev = m->prev;
    int frc = fi_close(&m->mr->fid);
    if (frc)
        FR_LOG_WARN(FR_SUB_NET, "fabric: fi_close(mr) failed: %s (%d)",
                    fi_strerror(-frc), frc);
    free(m);
}

int fab_group_create(fr_transport_t *t, const int *peers, int npeers,
                     fr_mr_t *src, const fr_mr_desc_t *remote,
                     fr_group_t **gp, fr_err_t *err)
{
    *gp = NULL;
    if (npeers < 0 || (npeers > 0 && (!peers || !remote)) || !src)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: group_create: %d peers, peers %p, remote %p, "
                      "src %p",
                      npeers, (const void *)peers, (const void *)remote,
                      (void *)src);
    for (int i = 0; i < npeers; i++)
        if (peers[i] < 0 || peers[i] >= t->size)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "fabric: group_create: peer %d is rank %d, not in "
                          "[0, %d)",
                          i, peers[i], t->size);
    fr_group_t *g = calloc(1, sizeof(*g));
    fr_fab_peer_t *p = calloc(npeers > 0 ? (size_t)npeers : 1, sizeof(*p));
    if (!g || !p) {
        free(g);
        free(p);
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    }
    g->npeers = npeers;
    g->sbuf = src->buf;
    g->slen = src->len;
    g->sdesc = src->desc;
    g->peers = p;
    for (int i = 0; i < npeers; i++) {
        p[i].rank = peers[i];
        p[i].addr = t->addrs[peers[i]];
        p[i].rbase = remote[i].base;
        p[i].rkey = remote[i].key;
        p[i].rlen = remote[i].len;
    }
    g->next = t->groups;
    if (t->groups)
        t->groups->prev = g;
    t->groups = g;
    *gp = g;
    return FERRY_OK;
}

void fab_group_destroy(fr_transport_t *t, fr_group_t *g)
{
    if (!g)
        return;
    if (g->prev)
        g->prev->next = g->next;
    else
        t->groups = g->next;
    if (g->next)
        g->next->prev = g->prev;
    free(g->peers);
    free(g);
}
