/*
 * libfabric transport: memory registration and peer groups. A region is
 * registered with the access its use needs and its key and base handed
 * back for the peers; a group holds per-peer write templates (address,
 * remote base, key, registered length) prepared once, so that a post only
 * adds offsets. Both live on lists of the transport and are freed at close.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include <rdma/fi_errno.h>

#include "core/log.h"
#include "transport/fabric/fab_int.h"

int fab_reg(fr_transport_t *t, void *ptr, size_t len, int remote_write,
            fr_mr_t **mrp, fr_mr_desc_t *desc, fr_err_t *err)
{
    return fab_reg_dev(t, ptr, len, remote_write, -1, mrp, desc, err);
}

/* fi_mr_reg for host memory; device memory through fi_mr_regattr with
 * the CUDA interface, the device ordinal and FI_HMEM_DEVICE_ONLY (FI_HMEM
 * endpoints only). */
static int fab_mr_open(struct fid_domain *dom, void *ptr, size_t len, uint64_t access,
                       uint64_t req_key, int device, struct fid_mr **mr)
{
    if (device < 0)
        return fi_mr_reg(dom, ptr, len, access, 0, req_key, 0, mr, NULL);
    struct iovec iov = {ptr, len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = req_key;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = device;
    /* cudaMalloc memory: device only (shm then moves it by CUDA IPC, one
     * device copy, instead of staging it through its host bounce buffers) */
    return fi_mr_regattr(dom, &attr, FI_HMEM_DEVICE_ONLY, mr);
}

int fab_reg_dev(fr_transport_t *t, void *ptr, size_t len, int remote_write,
                int device, fr_mr_t **mrp, fr_mr_desc_t *desc, fr_err_t *err)
{
    *mrp = NULL;
    if (device >= 0 && !t->hmem)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: registering device memory (GPU %d) on an endpoint opened "
                      "without FI_HMEM", device);
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
    int frc = fab_mr_open(t->domain, ptr, len, access, req_key, device, &m->mr);
    if (frc) {
        free(m);
        return FR_ERR(err, FERRY_ERR_FABRIC,
                      "fabric: %s(%p, %zu bytes%s) failed: %s (%d)",
                      device < 0 ? "fi_mr_reg" : "fi_mr_regattr", ptr, len,
                      device < 0 ? "" : ", FI_HMEM_CUDA", fi_strerror(-frc), frc);
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
    /* libfabric 2.x gives no key to a region peers cannot access (a send
     * region): none is needed */
    if (m->key == FI_KEY_NOTAVAIL && !remote_write)
        m->key = 0;
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

/* Can provider `prov` register `len` bytes at `ptr`, memory of CUDA device
 * `device`? A domain of its own, opened and closed here: an offer of
 * FI_HMEM alone does not say so (a libfabric built without CUDA may still
 * offer it, for host memory). 0 with the reason in why. */
int fab_hmem_try(const char *prov, int device, void *ptr, size_t len, char *why,
                 size_t wlen)
{
    struct fi_info *hints = fab_hints(FI_HMEM, prov), *list = NULL, *pick = NULL;
    struct fid_fabric *fab = NULL;
    struct fid_domain *dom = NULL;
    struct fid_mr *mr = NULL;
    int ok = 0, frc;
    const char *step = "fi_getinfo";
    char r[160];
    if (!hints) {
        snprintf(why, wlen, "out of memory");
        return 0;
    }
    if ((frc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list)) == 0) {
        for (struct fi_info *i = list; i && !pick; i = i->next)
            if (fab_offer_ok(i, FI_HMEM, r, sizeof(r)))
                pick = i;
        frc = pick ? 0 : -FI_ENODATA;
    }
    if (frc == 0 && (step = "fi_fabric", frc = fi_fabric(pick->fabric_attr, &fab, NULL)) == 0 &&
        (step = "fi_domain", frc = fi_domain(fab, pick, &dom, NULL)) == 0) {
        step = "fi_mr_regattr(FI_HMEM_CUDA)"; /* as fab_reg_dev registers */
        frc = fab_mr_open(dom, ptr, len, FI_REMOTE_WRITE | FI_WRITE, 1, device, &mr);
        ok = frc == 0;
    }
    if (!ok)
        snprintf(why, wlen, "%s: %s (%d)", step, fi_strerror(-frc), frc);
    if (mr)
        fi_close(&mr->fid);
    if (dom)
        fi_close(&dom->fid);
    if (fab)
        fi_close(&fab->fid);
    if (list)
        fi_freeinfo(list);
    fi_freeinfo(hints);
    return ok;
}
