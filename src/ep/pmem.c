/*
 * Peer memory for the GPU engines and DP groups (runtime/peer_mem.h):
 * which kind every rank uses (FERRY_PEER_MEM and what each rank's device
 * offers, agreed in one allgather), and the exchange that opens the
 * node's peers' allocations (handles in an allgather; file descriptors
 * over Unix sockets, each sent only to the listener its rank announced
 * and taken only from the rank that announced it).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bootstrap/hmac.h"
#include "core/config.h"
#include "core/log.h"
#include "ep/ep.h"
#include "ep/pmem.h"
#include "runtime/peer_mem.h"
#include "runtime/rt.h"

/* err's message with `what` in front (the message copied first: FR_ERR
 * writes into it). */
static int fr_pmem_wrap(fr_err_t *err, int rc, const char *what, int rank)
{
    char m[FR_ERRMSG_LEN];
    snprintf(m, sizeof(m), "%s", err->msg);
    return FR_ERR(err, rc, "peer memory: %s %d: %s", what, rank, m);
}

typedef struct fr_pmem_vote {
    int status;       /* this rank's set-up so far */
    int kinds;        /* FR_PMEM_* the device offers (and the segment allows) */
    int asked;        /* FERRY_PEER_MEM (0: auto) */
    uint8_t uuid[16]; /* the GPU's */
    char fdkey[96];   /* where its descriptors reach (fr_ep_fdkey) */
    char why[160];    /* why a kind is missing */
} fr_pmem_vote_t;

/* Two ranks of one node whose descriptors cannot reach each other (other
 * kernels, or network namespaces: containers on one host), or -1. */
static int fr_pmem_apart(ferry_ep_t ep, const fr_pmem_vote_t *all, int *other)
{
    for (int i = 0; i < ep->N; i++)
        for (int j = 0; j < i; j++)
            if (ep->node_of && ep->node_of[i] == ep->node_of[j] &&
                strcmp(all[i].fdkey, all[j].fdkey) != 0) {
                *other = j;
                return i;
            }
    return -1;
}

static int fr_pmem_asked(int *kind, fr_err_t *err)
{
    const char *v = fr_cfg_str(FR_CFG_PEER_MEM);
    if (!v || !*v || !strcmp(v, "auto"))
        *kind = 0;
    else if (!strcmp(v, "vmm"))
        *kind = FR_PMEM_VMM;
    else if (!strcmp(v, "fabric"))
        *kind = FR_PMEM_FABRIC;
    else if (!strcmp(v, "legacy"))
        *kind = FR_PMEM_LEGACY;
    else
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "FERRY_PEER_MEM=%s: must be auto, vmm, fabric or legacy", v);
    return FERRY_OK;
}

int fr_ep_pmem_kind(ferry_ep_t ep, int status, int device, const char *legacy_only,
                    int *kind, int *same_gpu, fr_err_t *err)
{
    int N = ep->N, asked = 0, rc;
    fr_pmem_vote_t mine, *all = NULL;
    memset(&mine, 0, sizeof(mine));
    mine.status = status;
    if (mine.status == FERRY_OK)
        mine.status = fr_pmem_asked(&asked, err);
    if (mine.status == FERRY_OK)
        mine.status = fr_cuda_device_uuid(device, mine.uuid, err);
    mine.asked = asked;
    fr_ep_fdkey(mine.fdkey, sizeof(mine.fdkey));
    if (mine.status == FERRY_OK) {
        mine.kinds = fr_pmem_kinds(device, mine.why, sizeof(mine.why));
        if (legacy_only) {
            mine.kinds &= FR_PMEM_LEGACY;
            snprintf(mine.why, sizeof(mine.why), "%s", legacy_only);
        }
        /* the kind that would be used, tried: attributes can offer what
         * the process may not do */
        int want = asked ? asked : ep->pmem_cross ? FR_PMEM_FABRIC : FR_PMEM_VMM;
        if ((mine.kinds & want) && !fr_pmem_usable(want, device, mine.why, sizeof(mine.why)))
            mine.kinds &= ~want;
    }
    all = (fr_pmem_vote_t *)calloc((size_t)N, sizeof(*all));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "peer memory: table for %d ranks", N);
    rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to set up its GPU memory (%s)", i,
                        ferry_strerror(all[i].status));
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].asked != asked)
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "FERRY_PEER_MEM differs between ranks: rank %d has %s, rank %d has %s "
                        "(set it alike on every rank)", ep->rank, fr_pmem_name(asked), i,
                        fr_pmem_name(all[i].asked));
    int common = FR_PMEM_LEGACY | FR_PMEM_VMM | FR_PMEM_FABRIC, first = -1, other = -1;
    for (int i = 0; i < N && rc == FERRY_OK; i++) {
        if ((all[i].kinds & FR_PMEM_VMM) == 0 && first < 0)
            first = i;
        common &= all[i].kinds;
    }
    /* descriptors pass only between processes of one kernel and network
     * namespace: a node whose ranks are not takes another kind */
    int apart = rc == FERRY_OK && !ep->pmem_cross ? fr_pmem_apart(ep, all, &other) : -1;
    if (apart >= 0) {
        common &= ~FR_PMEM_VMM;
        first = apart;
        snprintf(all[apart].why, sizeof(all[apart].why),
                 "vmm: ranks %d and %d of one node are in different network namespaces or "
                 "kernels, which file descriptors do not cross", other, apart);
    }
    if (rc == FERRY_OK && ep->pmem_cross && asked && asked != FR_PMEM_FABRIC)
        rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                    "FERRY_PEER_MEM=%s: the ranks of a node span hosts (an NVLink domain), "
                    "and only fabric handles cross hosts", fr_pmem_name(asked));
    if (rc == FERRY_OK && ep->pmem_cross && !asked) {
        *kind = FR_PMEM_FABRIC;
        for (int i = 0; i < N && rc == FERRY_OK; i++)
            if (!(all[i].kinds & FR_PMEM_FABRIC))
                rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                            "peer memory: the ranks of a node span hosts (an NVLink domain), "
                            "and rank %d cannot share by fabric handle (%s)", i, all[i].why);
    } else if (rc == FERRY_OK) {
        if (asked) {
            *kind = asked;
            if (asked == FR_PMEM_VMM && apart >= 0)
                rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED, "FERRY_PEER_MEM=vmm: %s",
                            all[apart].why + 5);
            for (int i = 0; i < N && rc == FERRY_OK; i++)
                if (!(all[i].kinds & asked))
                    rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                                "FERRY_PEER_MEM=%s: rank %d cannot (%s)", fr_pmem_name(asked), i,
                                all[i].why);
        } else {
            *kind = (common & FR_PMEM_VMM) ? FR_PMEM_VMM : FR_PMEM_LEGACY;
        }
    }
    if (rc == FERRY_OK) {
        int n = 0;
        for (int i = 0; same_gpu && i < N; i++)
            n += memcmp(all[i].uuid, mine.uuid, sizeof(mine.uuid)) == 0;
        if (same_gpu)
            *same_gpu = n < 1 ? 1 : n;
        if (ep->rank == 0) {
            if (*kind == FR_PMEM_LEGACY && !asked && first >= 0)
                FR_LOG_INFO(FR_SUB_INIT, "peer memory: legacy CUDA IPC (FERRY_PEER_MEM=auto; "
                            "rank %d: %s)", first, all[first].why);
            else
                FR_LOG_INFO(FR_SUB_INIT, "peer memory: %s (FERRY_PEER_MEM=%s)",
                            fr_pmem_name(*kind), fr_cfg_str(FR_CFG_PEER_MEM));
        }
    }
    free(all);
    return rc;
}

/* What fr_pmem_pass's receive hands each descriptor to. */
typedef struct fr_pmem_taker {
    const fr_pmem_pass_t *p;
    const fr_fdx_peer_t *who; /* the peers */
    char *got;                /* per peer: its descriptor came */
    fr_pmem_t *peers;         /* [N] */
    int rc;                   /* the first failure */
    fr_err_t *err;
} fr_pmem_taker_t;

static void fr_pmem_take(void *arg, int i, int fd)
{
    fr_pmem_taker_t *t = (fr_pmem_taker_t *)arg;
    int rank = t->who[i].tag;
    t->got[i] = 1;
    if (t->rc != FERRY_OK) { /* failed already: taken so the sender is done, not opened */
        close(fd);
        return;
    }
    fr_err_t e;
    const fr_pmem_msg_t *a = &t->p->all[rank];
    int r = t->p->open(a->kind, t->p->device, NULL, fd, (size_t)a->size, &t->peers[rank], &e);
    if (r != FERRY_OK) {
        *t->err = e;
        t->rc = fr_pmem_wrap(t->err, r, "opening the memory of rank", rank);
    }
}

/* vmm: send the own descriptor to every peer on the shared-memory path,
 * then take one from each (every send is queued without an accept, so
 * no rank waits for another's order). A descriptor goes only to the
 * listener its rank announced, and is taken only from that rank
 * (runtime/peer_mem.h: fr_fdx). */
int fr_pmem_pass(ferry_ep_t ep, const fr_pmem_pass_t *p, fr_pmem_t *peers, fr_err_t *err)
{
    int N = ep->N, n = 0;
    fr_pmem_taker_t t = {p, NULL, NULL, peers, FERRY_OK, err};
    fr_fdx_peer_t *who = (fr_fdx_peer_t *)calloc(N > 0 ? (size_t)N : 1, sizeof(*who));
    char *got = (char *)calloc(N > 0 ? (size_t)N : 1, 1);
    if (!who || !got) {
        free(who);
        free(got);
        return FR_ERR(err, FERRY_ERR_NOMEM, "peer memory: table for %d ranks", N);
    }
    t.who = who;
    t.got = got;
    for (int i = p->r0; i < p->r1; i++)
        if (ep->path[i] == FR_PATH_SHM)
            who[n++] = (fr_fdx_peer_t){i, p->all[i].pid, p->all[i].pidns, p->all[i].sock};
    fr_err_t e;
    for (int k = 0; k < n; k++) {
        int r = fr_fdx_send(&who[k], ep->rank, p->fd, ep->timeout_ms, &e);
        if (r != FERRY_OK && t.rc == FERRY_OK) {
            *err = e;
            t.rc = fr_pmem_wrap(err, r, "passing this rank's descriptor to rank", who[k].tag);
        }
    }
    int r = fr_fdx_gather(p->x, who, n, ep->timeout_ms, fr_pmem_take, &t, &e);
    if (r != FERRY_OK && t.rc == FERRY_OK) { /* name the first missing */
        int miss = 0;
        while (miss < n - 1 && got[miss])
            miss++;
        *err = e;
        t.rc = fr_pmem_wrap(err, r, "waiting for the descriptor of rank",
                            n > 0 ? who[miss].tag : -1);
    }
    free(who);
    free(got);
    return t.rc;
}

/* The name carries random bytes: a process of another user that could
 * guess it would bind it first (abstract names have no owner). */
int fr_pmem_listen(fr_fdx_t *x, fr_pmem_msg_t *m, int near, fr_err_t *err)
{
    unsigned char r[16];
    if (fr_boot_random(r, sizeof(r)) != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "peer memory: random bytes for a socket name: %s",
                      strerror(errno));
    int k = snprintf(m->sock, sizeof(m->sock), "ferry-pm-");
    for (size_t i = 0; i < sizeof(r); i++)
        k += snprintf(m->sock + k, sizeof(m->sock) - (size_t)k, "%02x", r[i]);
    return fr_fdx_listen(x, m->sock, near, err);
}

int fr_ep_pmem_share(ferry_ep_t ep, int status, const fr_pmem_t *mine, int r0, int r1,
                     fr_pmem_t *peers, fr_err_t *err)
{
    int N = ep->N, rc = FERRY_OK, fd = -1;
    fr_fdx_t x = {-1, ""};
    fr_pmem_msg_t m, *all = NULL;
    memset(&m, 0, sizeof(m));
    memset(peers, 0, sizeof(*peers) * (size_t)N);
    m.status = status;
    m.kind = mine->kind;
    m.size = mine->size;
    m.pid = (long)getpid();
    m.pidns = fr_pidns();
    if (m.status == FERRY_OK && mine->kind)
        m.status = fr_pmem_export(mine, m.blob, &fd, err);
    int near = 0; /* peers in range on the shared-memory path */
    for (int i = r0; i < r1; i++)
        near += ep->path[i] == FR_PATH_SHM;
    if (m.status == FERRY_OK && mine->kind == FR_PMEM_VMM && near > 0)
        m.status = fr_pmem_listen(&x, &m, near, err);
    all = (fr_pmem_msg_t *)calloc((size_t)N, sizeof(*all));
    if (!all) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "peer memory: table for %d ranks", N);
        goto out; /* the others wait in the allgather until the bootstrap's
                     timeout (an allocation of a few KB failed) */
    }
    rc = fr_boot_allgather(ep->comm->boot, &m, all, sizeof(m), err);
    if (rc == FERRY_OK)
        rc = m.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to set up its GPU segment (%s)", i,
                        ferry_strerror(all[i].status));
        else if (i >= r0 && i < r1 && ep->path[i] == FR_PATH_SHM && all[i].kind != mine->kind)
            rc = FR_ERR(err, FERRY_ERR_INTERNAL, "peer memory: rank %d shares %s, this rank %s",
                        i, fr_pmem_name(all[i].kind), fr_pmem_name(mine->kind));
    if (rc != FERRY_OK)
        goto out;
    if (mine->kind == FR_PMEM_VMM) {
        fr_pmem_pass_t p = {&x, fd, all, r0, r1, mine->device, fr_pmem_open};
        if (near > 0)
            rc = fr_pmem_pass(ep, &p, peers, err);
    } else {
        for (int i = r0; i < r1 && rc == FERRY_OK; i++)
            if (ep->path[i] == FR_PATH_SHM &&
                (rc = fr_pmem_open(mine->kind, mine->device, all[i].blob, -1,
                                   (size_t)all[i].size, &peers[i], err)) != FERRY_OK)
                rc = fr_pmem_wrap(err, rc, "opening the memory of rank", i);
    }
    /* every rank that got here (all of them: the statuses above are
     * common) joins one more exchange of its outcome, so that all return
     * alike: a rank that opened everything does not go on to the next
     * collective while a peer failed (all[] holds the outcome now) */
    {
        fr_err_t e2;
        m.status = rc;
        if (fr_boot_allgather(ep->comm->boot, &m, all, sizeof(m), &e2) != FERRY_OK &&
            rc == FERRY_OK) {
            *err = e2;
            rc = FERRY_ERR_BOOTSTRAP;
        }
        for (int i = 0; i < N && rc == FERRY_OK; i++)
            if (all[i].status != FERRY_OK)
                rc = FR_ERR(err, all[i].status, "rank %d failed to open its peers' memory (%s)",
                            i, ferry_strerror(all[i].status));
    }
out:
    if (rc != FERRY_OK)
        for (int i = 0; i < N; i++)
            fr_pmem_close(&peers[i]);
    if (fd >= 0)
        close(fd);
    fr_fdx_close(&x);
    free(all);
    return rc;
}
