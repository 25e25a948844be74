/*
 * libfabric transport: FI_EP_RDM, RMA writes with 32-bit remote CQ data.
 *
 * Facts this relies on (see shared/FABRIC.md):
 *  - mr_mode is read back from fi_getinfo and honoured (tcp answers 0:
 *    offsets and requested keys; shm may answer FI_MR_VIRT_ADDR).
 *  - Bad writes fail silently on tcp and shm, so every slice is checked
 *    against the registered lengths before anything is posted.
 *  - Progress is manual: poll() must be called on both sides.
 *
 * Posting: scatter/barrier/write_imm never block. A post that meets
 * -FI_EAGAIN, and every post behind it, waits in a FIFO inside the transport
 * and is retried in order from poll(). A post that fails for any other
 * reason is not reported by the posting call (other slices of the same call
 * may already be on the wire); it comes back from poll() as one FR_CQE_ERR
 * with its peer and ctx. So every slice of a call that returned FERRY_OK
 * yields exactly one completion: FR_CQE_TX or FR_CQE_ERR. A call that
 * returns an error (FERRY_ERR_INVALID for bad bounds or index) posted
 * nothing.
 *
 * Zero-byte writes: tcp;ofi_rxm and shm both accept fi_writedata with len 0
 * and deliver the remote CQ data, to other ranks and to self (checked by
 * tests/mp/test_fabric). They are posted as real zero-byte writes.
 *
 * Threading: one thread at a time per transport (the proxy's); nothing here
 * takes a lock.
 *
 * Per-post state lives in fr_fab_op_t taken from a pool that grows in chunks
 * (no allocation per post once warm).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/mman.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "../core/log.h"
#include "transport.h"
#include "../core/config.h"

#define FR_FAB_NAME_MAX 448 /* endpoint name bytes in the exchange block */
#define FR_FAB_PROV_MAX 56  /* provider name bytes in the exchange block */
#define FR_FAB_POOL_CHUNK 256
#define FR_FAB_CQ_BATCH 64

typedef struct fr_fab_op {
    struct fi_context2 fictx; /* first: for providers with FI_CONTEXT(2) */
    struct fr_fab_op *next;   /* freelist, FIFO or error list */
    uint64_t ctx;
    const void *buf;
    size_t len;
    void *desc;
    uint64_t raddr;
    uint64_t key;
    fi_addr_t addr;
    uint32_t imm;
    int peer;
    int err;        /* libfabric status of a failed post (error list) */
    int fence;      /* post with FI_FENCE (nicfence signals) */
} fr_fab_op_t;

/* Fault injection: things held back until `at` (an arrival's immediate,
 * or a post), released oldest first or in random order. */
typedef struct fr_fab_held {
    uint64_t at;
    uint32_t imm;      /* arrivals */
    fr_fab_op_t *op;   /* posts */
} fr_fab_held_t;
typedef struct fr_fab_hq {
    fr_fab_held_t *v;
    int n, cap;
    long total, reordered; /* held; released ahead of an older one */
} fr_fab_hq_t;

typedef struct fr_fab_chunk {
    struct fr_fab_chunk *next;
    fr_fab_op_t ops[FR_FAB_POOL_CHUNK];
} fr_fab_chunk_t;

struct fr_mr {
    struct fr_mr *prev, *next; /* live list, freed at close */
    struct fid_mr *mr;
    void *buf;
    size_t len;
    void *desc;
    uint64_t key;
};

typedef struct fr_fab_peer {
    fi_addr_t addr;
    int rank;
    uint64_t rbase; /* remote base (VA or 0) */
    uint64_t rkey;
    uint64_t rlen;
} fr_fab_peer_t;

struct fr_group {
    struct fr_group *prev, *next; /* live list, freed at close */
    int npeers;
    char *sbuf; /* local source region */
    uint64_t slen;
    void *sdesc;
    fr_fab_peer_t *peers;
};

/* One rank's contribution to the address exchange (fixed size). */
typedef struct fr_fab_block {
    uint32_t namelen;
    uint32_t pad;
    char prov[FR_FAB_PROV_MAX];
    char name[FR_FAB_NAME_MAX];
} fr_fab_block_t;

struct fr_transport {
    int rank, size;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_ep *ep;
    struct fid_cq *cq;
    struct fid_av *av;
    fi_addr_t *addrs; /* by rank */
    uint64_t mr_mode;
    uint64_t next_key; /* requested keys when not FI_MR_PROV_KEY */
    char prov[FR_FAB_PROV_MAX];

    fr_fab_chunk_t *chunks;
    fr_fab_op_t *free_ops;
    long nfree;
    fr_fab_op_t *q_head, *q_tail; /* posts waiting after -FI_EAGAIN */
    fr_fab_op_t *e_head, *e_tail; /* posts that failed, to report */
    long inflight;                /* posted, not yet completed */
    long nqueued;
    long nerrors;
    long nwaited; /* posts that met -FI_EAGAIN (statistics) */

    struct fr_mr *mrs;
    struct fr_group *groups;
    int nic;             /* index among this rank's NICs */
    int absent;          /* this rank has no NIC of that index */
    char *present;       /* [size]: which ranks opened this NIC */
    char iface[64];      /* domain (interface) name */

    /* fault injection (FERRY_FAULT_*): arrivals held back, then released
     * after a delay and jitter, in random order when asked */
    long f_delay_ns, f_jitter_ns;
    int f_reorder;
    uint64_t f_rng;
    fr_fab_hq_t arrivals;
    /* FERRY_FAULT_POSTS: this rank's own posts held back the same way */
    int f_posts;
    fr_fab_hq_t posts;
    int fence_caps; /* opened with FI_FENCE in caps */
};

#define FR_FAB_GOLDEN 0x9e3779b97f4a7c15ull

/* splitmix64's finaliser */
static uint64_t fab_mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t fab_rand(fr_transport_t *t)
{
    return fab_mix(t->f_rng += FR_FAB_GOLDEN);
}

static uint64_t fab_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Hold an arrival's immediate or a post back until now + delay + jitter;
 * 0 when it cannot be held. */
static int fab_hq_push(fr_transport_t *t, fr_fab_hq_t *q, uint32_t imm,
                       fr_fab_op_t *op)
{
    if (q->n == q->cap) {
        int cap = q->cap ? 2 * q->cap : 64;
        void *p = realloc(q->v, sizeof(*q->v) * (size_t)cap);
        if (!p)
            return 0;
        q->v = p;
        q->cap = cap;
    }
    uint64_t at = fab_now() + (uint64_t)t->f_delay_ns;
    if (t->f_jitter_ns > 0)
        at += fab_rand(t) % (uint64_t)(t->f_jitter_ns + 1);
    q->v[q->n++] = (fr_fab_held_t){at, imm, op};
    q->total++;
    return 1;
}

/* Take an item due by `now`: the oldest, or (f_reorder) a random one of
 * those due. 0: none is due. */
static int fab_hq_pop(fr_transport_t *t, fr_fab_hq_t *q, uint64_t now,
                      fr_fab_held_t *out)
{
    int pick = -1, seen = 0;
    for (int i = 0; i < q->n; i++) {
        if (q->v[i].at > now)
            continue;
        seen++;
        if (pick < 0 || (t->f_reorder && fab_rand(t) % (uint64_t)seen == 0))
            pick = i;
        if (!t->f_reorder)
            break;
    }
    if (pick < 0)
        return 0;
    q->reordered += pick > 0; /* an older one is still held */
    *out = q->v[pick];
    memmove(&q->v[pick], &q->v[pick + 1],
            sizeof(*q->v) * (size_t)(q->n - pick - 1));
    q->n--;
    return 1;
}

/* Release held arrivals that are due. */
static int fab_release(fr_transport_t *t, fr_cqe_t *out, int max)
{
    int n = 0;
    uint64_t now = fab_now();
    fr_fab_held_t h;
    while (n < max && fab_hq_pop(t, &t->arrivals, now, &h)) {
        out[n].kind = FR_CQE_RX;
        out[n].imm = h.imm;
        out[n].peer = -1;
        out[n].status = FERRY_OK;
        out[n].ctx = 0;
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------ */
/* op pool and lists                                                   */
/* ------------------------------------------------------------------ */

static int fab_pool_grow(fr_transport_t *t)
{
    fr_fab_chunk_t *c = calloc(1, sizeof(*c));
    if (!c)
        return -1;
    c->next = t->chunks;
    t->chunks = c;
    for (int i = FR_FAB_POOL_CHUNK - 1; i >= 0; i--) {
        c->ops[i].next = t->free_ops;
        t->free_ops = &c->ops[i];
    }
    t->nfree += FR_FAB_POOL_CHUNK;
    return 0;
}

static fr_fab_op_t *fab_op_get(fr_transport_t *t)
{
    if (!t->free_ops && fab_pool_grow(t) != 0)
        return NULL;
    fr_fab_op_t *op = t->free_ops;
    t->free_ops = op->next;
    t->nfree--;
    op->next = NULL;
    return op;
}

static void fab_op_put(fr_transport_t *t, fr_fab_op_t *op)
{
    op->next = t->free_ops;
    t->free_ops = op;
    t->nfree++;
}

static void fab_list_push(fr_fab_op_t **head, fr_fab_op_t **tail,
                          fr_fab_op_t *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static fr_fab_op_t *fab_list_pop(fr_fab_op_t **head, fr_fab_op_t **tail)
{
    fr_fab_op_t *op = *head;
    if (op) {
        *head = op->next;
        if (!*head)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

/* ------------------------------------------------------------------ */
/* posting                                                             */
/* ------------------------------------------------------------------ */

static ssize_t fab_post(fr_transport_t *t, fr_fab_op_t *op)
{
    if (op->fence) {
        struct iovec iov = {(void *)op->buf, op->len};
        struct fi_rma_iov rma = {op->raddr, op->len, op->key};
        struct fi_msg_rma msg = {&iov, &op->desc, 1, op->addr, &rma, 1,
                                 op, op->imm};
        return fi_writemsg(t->ep, &msg,
                           FI_FENCE | FI_REMOTE_CQ_DATA | FI_COMPLETION);
    }
    return fi_writedata(t->ep, op->buf, op->len, op->desc, op->imm, op->addr,
                        op->raddr, op->key, op);
}

static void fab_submit_now(fr_transport_t *t, fr_fab_op_t *op);

/* Post held posts that are due. */
static void fab_release_posts(fr_transport_t *t)
{
    uint64_t now = fab_now();
    fr_fab_held_t h;
    while (fab_hq_pop(t, &t->posts, now, &h))
        fab_submit_now(t, h.op);
}

/* Post op (unless the fault injector holds it back first). */
static void fab_submit(fr_transport_t *t, fr_fab_op_t *op)
{
    if (t->f_posts && fab_hq_push(t, &t->posts, 0, op))
        return;
    fab_submit_now(t, op);
}

/* Post op, or queue it behind earlier queued posts, or (hard failure) put
 * it on the error list for poll() to report. */
static void fab_submit_now(fr_transport_t *t, fr_fab_op_t *op)
{
    if (!t->q_head) {
        ssize_t rc = fab_post(t, op);
        if (rc == 0) {
            t->inflight++;
            return;
        }
        if (rc != -FI_EAGAIN) {
            op->err = (int)rc;
            fab_list_push(&t->e_head, &t->e_tail, op);
            t->nerrors++;
            return;
        }
    }
    fab_list_push(&t->q_head, &t->q_tail, op);
    t->nqueued++;
    t->nwaited++;
}

/* Retry queued posts in order; stop at the first -FI_EAGAIN. */
static void fab_drain_queue(fr_transport_t *t)
{
    while (t->q_head) {
        fr_fab_op_t *op = t->q_head;
        ssize_t rc = fab_post(t, op);
        if (rc == -FI_EAGAIN)
            return;
        fab_list_pop(&t->q_head, &t->q_tail);
        t->nqueued--;
        if (rc == 0) {
            t->inflight++;
        } else {
            op->err = (int)rc;
            fab_list_push(&t->e_head, &t->e_tail, op);
            t->nerrors++;
        }
    }
}

static int fab_check_slice(const fr_group_t *g, int i, const fr_slice_t *s,
                           fr_err_t *err)
{
    const fr_fab_peer_t *p = &g->peers[i];
    if (s->src_off > g->slen || s->len > g->slen - s->src_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: slice %d (rank %d): source [%llu, +%llu) "
                      "outside the registered %llu bytes",
                      i, p->rank, (unsigned long long)s->src_off,
                      (unsigned long long)s->len,
                      (unsigned long long)g->slen);
    if (s->dst_off > p->rlen || s->len > p->rlen - s->dst_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: slice %d (rank %d): destination [%llu, +%llu) "
                      "outside the peer's registered %llu bytes",
                      i, p->rank, (unsigned long long)s->dst_off,
                      (unsigned long long)s->len,
                      (unsigned long long)p->rlen);
    return FERRY_OK;
}

static int fab_add(fr_transport_t *t, fr_group_t *g, int i,
                   const fr_slice_t *s, uint64_t ctx, int fence, fr_err_t *err)
{
    fr_fab_op_t *op = fab_op_get(t);
    if (!op)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory for a post");
    const fr_fab_peer_t *p = &g->peers[i];
    op->ctx = ctx;
    op->buf = g->sbuf + s->src_off;
    op->len = (size_t)s->len;
    op->desc = g->sdesc;
    op->raddr = p->rbase + s->dst_off;
    op->key = p->rkey;
    op->addr = p->addr;
    op->imm = s->imm;
    op->peer = p->rank;
    op->err = 0;
    op->fence = fence;
    fab_submit(t, op);
    return FERRY_OK;
}

/* Reserve n ops up front so that a call posts all of its slices or none. */
static int fab_reserve(fr_transport_t *t, int n, fr_err_t *err)
{
    while (t->nfree < n)
        if (fab_pool_grow(t) != 0)
            return FR_ERR(err, FERRY_ERR_NOMEM,
                          "fabric: out of memory for %d posts", n);
    return FERRY_OK;
}

/* ------------------------------------------------------------------ */
/* ops                                                                 */
/* ------------------------------------------------------------------ */

static void fab_close(fr_transport_t *t);

static int fab_fail(fr_err_t *err, const char *call, int rc)
{
    return FR_ERR(err, FERRY_ERR_FABRIC, "fabric: %s failed: %s (%d)", call,
                  fi_strerror(rc < 0 ? -rc : rc), rc);
}

/* Is interface `name` up with a carrier (getifaddrs flags)? Unknown
 * names (not a network interface, e.g. an RDMA device) count as up. */
static int fab_iface_up(const char *name)
{
    struct ifaddrs *ifs = NULL, *i;
    int found = 0, up = 0;
    if (getifaddrs(&ifs) != 0)
        return 1;
    for (i = ifs; i; i = i->ifa_next)
        if (i->ifa_name && strcmp(i->ifa_name, name) == 0) {
            found = 1;
            up |= (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
        }
    freeifaddrs(ifs);
    return !found || up;
}

static int fab_is_loopback(const struct fi_info *i)
{
    return i->addr_format == FI_SOCKADDR_IN && i->src_addr &&
           (ntohl(((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr) >> 24) == 127;
}

/* The shm provider names an endpoint's /dev/shm region after the pid in
 * its default address ("fi_shm://<pid>" -> "<pid>:<uid>:<index>") and
 * refuses (fi_enable: EBUSY) when a region of that name exists and the pid
 * written in it is alive. A rank killed with SIGKILL leaves its region
 * behind; once pids wrap, a new rank with that pid cannot open an endpoint.
 * Ours are named "ferry.<pid>.<random>" instead: never reused, and the
 * launcher removes a dead rank's regions by the pid prefix. */
static int fab_shm_name(struct fi_info *info)
{
    if (info->addr_format != FI_ADDR_STR)
        return 0;
    static uint64_t seq;
    uint64_t x = fab_mix(fab_now() ^ ((uint64_t)getpid() << 40) ^
                         (++seq * FR_FAB_GOLDEN));
    char name[96];
    int len = snprintf(name, sizeof(name), "fi_shm://" FR_FAB_SHM_PREFIX
                       "%d.%016llx", (int)getpid(), (unsigned long long)x);
    char *copy = strdup(name);
    if (!copy)
        return -1;
    free(info->src_addr);
    info->src_addr = copy;
    info->src_addrlen = (size_t)len + 1;
    return 0;
}

int fr_fab_shm_sweep(int pid)
{
    char pre[48];
    int plen = snprintf(pre, sizeof(pre), FR_FAB_SHM_PREFIX "%d.", pid);
    DIR *d = opendir("/dev/shm");
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, pre, (size_t)plen) == 0 &&
            shm_unlink(e->d_name) == 0)
            n++;
    closedir(d);
    return n;
}

static int fab_open_nic(fr_boot_t *boot, int nic, fr_transport_t **tp,
                        fr_err_t *err);
static int fab_open_caps(fr_boot_t *boot, int nic, uint64_t caps,
                         uint64_t op_flags, fr_transport_t **tp,
                         fr_err_t *err);
static int fab_exchange_absent(fr_boot_t *boot, fr_transport_t *t,
                               fr_transport_t **tp, fr_err_t *err);

static int fab_open(fr_boot_t *boot, fr_transport_t **tp, fr_err_t *err)
{
    return fab_open_nic(boot, 0, tp, err);
}

static int fab_open_nic(fr_boot_t *boot, int nic, fr_transport_t **tp,
                        fr_err_t *err)
{
    return fab_open_caps(boot, nic, 0, 0, tp, err);
}

static int fab_open_flags(fr_boot_t *boot, int flags, fr_transport_t **tp,
                          fr_err_t *err)
{
    int rc = fab_open_caps(boot, 0, (flags & FR_TP_OPEN_FENCE) ? FI_FENCE : 0,
                           (flags & FR_TP_OPEN_DELIVERY) ? FI_DELIVERY_COMPLETE
                                                         : 0,
                           tp, err);
    if (rc == FERRY_OK && (flags & FR_TP_OPEN_FENCE))
        (*tp)->fence_caps = 1;
    return rc;
}

/* The hints every endpoint asks with (RDM, RMA writes, every memory
 * registration mode ferry can handle) plus `caps`; a plain FI_PROVIDER
 * name is passed as a hint too, while lists ("a,b") and exclusions ("^a")
 * are left to libfabric's own reading of it. NULL when out of memory. */
static struct fi_info *fab_hints(uint64_t caps)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR |
                                  FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT;
    const char *envprov = getenv("FI_PROVIDER");
    if (envprov && *envprov && !strpbrk(envprov, ",^")) {
        hints->fabric_attr->prov_name = strdup(envprov);
        if (!hints->fabric_attr->prov_name) {
            fi_freeinfo(hints);
            return NULL;
        }
    }
    return hints;
}

/* Does the provider FI_PROVIDER names (or the default one) advertise
 * FI_FENCE for RDM RMA endpoints? Local check, no communication. */
static int fab_fence_probe(char *why, size_t len)
{
    struct fi_info *hints = fab_hints(FI_FENCE), *list = NULL;
    if (!hints) {
        snprintf(why, len, "out of memory");
        return 0;
    }
    const char *envprov = getenv("FI_PROVIDER");
    int frc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
    int ok = 0;
    for (struct fi_info *i = frc ? NULL : list; i && !ok; i = i->next)
        ok = (i->caps & FI_FENCE) && i->domain_attr->cq_data_size >= 4;
    if (!ok)
        snprintf(why, len,
                 "no libfabric provider%s%s advertises FI_FENCE for RDM RMA "
                 "endpoints (tcp, rxm and shm accept the flag and ignore it)",
                 envprov ? " named by FI_PROVIDER=" : "",
                 envprov ? envprov : "");
    if (list)
        fi_freeinfo(list);
    fi_freeinfo(hints);
    return ok;
}

static int fab_open_caps(fr_boot_t *boot, int nic, uint64_t caps,
                         uint64_t op_flags, fr_transport_t **tp,
                         fr_err_t *err)
{
    int rc = FERRY_OK, frc;
    struct fi_info *hints = NULL;
    fr_fab_block_t *blocks = NULL;
    *tp = NULL;

    fr_transport_t *t = calloc(1, sizeof(*t));
    if (!t)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    t->rank = fr_boot_rank(boot);
    t->size = fr_boot_size(boot);
    t->next_key = 1;
    t->nic = nic;
    t->f_delay_ns = fr_cfg_int(FR_CFG_FAULT_DELAY_US) * 1000;
    t->f_jitter_ns = fr_cfg_int(FR_CFG_FAULT_JITTER_US) * 1000;
    t->f_reorder = fr_cfg_int(FR_CFG_FAULT_REORDER) != 0;
    t->f_posts = fr_cfg_int(FR_CFG_FAULT_POSTS) != 0;
    t->f_rng = (uint64_t)fr_cfg_int(FR_CFG_FAULT_SEED) * 1000003u + (uint64_t)t->rank;
    if (t->f_reorder && !t->f_delay_ns && !t->f_jitter_ns)
        t->f_jitter_ns = 20000; /* something to reorder within */
    if (t->f_delay_ns || t->f_jitter_ns || t->f_reorder)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection on: delay %ld us, jitter %ld us, %s%s",
                    t->f_delay_ns / 1000, t->f_jitter_ns / 1000,
                    t->f_reorder ? "reordered " : "in order",
                    t->f_reorder ? (t->f_posts ? "posts" : "arrivals") : "");

    hints = fab_hints(caps);
    if (!hints) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory for hints");
        goto fail;
    }
    const char *envprov = getenv("FI_PROVIDER");

    struct fi_info *list = NULL;
    frc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
    if (frc) {
        rc = FR_ERR(err, FERRY_ERR_FABRIC,
                    "fabric: fi_getinfo (FI_EP_RDM, FI_RMA, FI_PROVIDER=%s) "
                    "failed: %s (%d)",
                    envprov ? envprov : "(unset)", fi_strerror(-frc), frc);
        goto fail;
    }
    /* First offer that carries at least 32 bits of remote CQ data; among
     * socket-addressed offers (tcp) prefer the interface this rank reached
     * the rendezvous through, which its peers can reach too (on a
     * multi-homed host the first offer may be loopback). */
    char myip[64];
    struct in_addr mine4;
    int have_ip = fr_boot_local_ipv4(boot, myip, sizeof(myip)) == 0 &&
                  inet_pton(AF_INET, myip, &mine4) == 1;
    struct fi_info *first = NULL, *match = NULL;
    for (struct fi_info *i = list; i; i = i->next) {
        if (i->domain_attr->cq_data_size < 4)
            continue;
        if (!first)
            first = i;
        if (have_ip && !match && i->addr_format == FI_SOCKADDR_IN &&
            i->src_addr && i->src_addrlen >= sizeof(struct sockaddr_in) &&
            ((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr == mine4.s_addr)
            match = i;
    }
    /* without the rendezvous address (a caller's allgather), prefer a
     * socket offer that is not loopback: peers may be on other hosts */
    if (!match && first && first->addr_format == FI_SOCKADDR_IN) {
        for (struct fi_info *i = list; i; i = i->next)
            if (i->domain_attr->cq_data_size >= 4 &&
                i->addr_format == FI_SOCKADDR_IN && i->src_addr &&
                (ntohl(((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr) >> 24) != 127) {
                first = i;
                break;
            }
    }
    struct fi_info *nic0 = match ? match : first, *pick = nic0;
    if (nic > 0 && nic0) {
        /* NIC k: the k-th other interface (domain) of the same kind that
         * is up, in the provider's order; none: this rank has no NIC k */
        int k = 0;
        pick = NULL;
        if (!fab_is_loopback(nic0))
            for (struct fi_info *i = list; i && !pick; i = i->next) {
                if (i->domain_attr->cq_data_size < 4 || fab_is_loopback(i) ||
                    i->addr_format != nic0->addr_format ||
                    strcmp(i->domain_attr->name, nic0->domain_attr->name) == 0 ||
                    !fab_iface_up(i->domain_attr->name))
                    continue;
                int dup = 0; /* count each interface once */
                for (struct fi_info *j = list; j != i && !dup; j = j->next)
                    dup = j->domain_attr->cq_data_size >= 4 &&
                          j->addr_format == i->addr_format &&
                          strcmp(j->domain_attr->name, i->domain_attr->name) == 0;
                if (!dup && ++k == nic)
                    pick = i;
            }
    }
    if (pick) {
        t->info = fi_dupinfo(pick);
        if (match && nic == 0)
            FR_LOG_INFO(FR_SUB_NET, "fabric: using the interface of %s "
                        "(the rendezvous route)", myip);
    } else if (nic > 0 && nic0) {
        /* take part in the exchange, with nothing to offer */
        snprintf(t->prov, sizeof(t->prov), "%s", nic0->fabric_attr->prov_name);
        t->absent = 1;
    }
    if (!t->info && !t->absent) {
        rc = FR_ERR(err, FERRY_ERR_FABRIC,
                    "fabric: no provider offers >= 4 bytes of remote CQ data "
                    "(first: %s, cq_data_size %zu)",
                    list->fabric_attr->prov_name,
                    list->domain_attr->cq_data_size);
        fi_freeinfo(list);
        goto fail;
    }
    fi_freeinfo(list);
    fi_freeinfo(hints);
    hints = NULL;
    if (t->absent)
        return fab_exchange_absent(boot, t, tp, err);

    struct fi_info *info = t->info;
    /* e.g. FI_DELIVERY_COMPLETE: a local completion then means the data is
     * visible at the target (what an ordering point waits for) */
    if ((op_flags & FI_DELIVERY_COMPLETE) &&
        (strcmp(info->fabric_attr->prov_name, "shm") == 0 ||
         strncmp(info->fabric_attr->prov_name, "tcp", 3) == 0)) {
        /* tcp (one stream per peer) and shm (one command queue per peer)
         * apply one endpoint's writes to a peer in order, so a local
         * completion already orders what is posted after it; and shm in
         * libfabric 1.17 can leave a FI_DELIVERY_COMPLETE write
         * uncompleted forever */
        op_flags &= ~(uint64_t)FI_DELIVERY_COMPLETE;
        FR_LOG_INFO(FR_SUB_NET, "fabric: %s keeps write order per peer; "
                    "local completions serve as ordering points",
                    info->fabric_attr->prov_name);
    }
    info->tx_attr->op_flags |= op_flags;
    if (strcmp(info->fabric_attr->prov_name, "shm") == 0 &&
        fab_shm_name(info) != 0) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
        goto fail;
    }
    snprintf(t->iface, sizeof(t->iface), "%s", info->domain_attr->name);
    t->mr_mode = info->domain_attr->mr_mode;
    snprintf(t->prov, sizeof(t->prov), "%s", info->fabric_attr->prov_name);
    FR_LOG_INFO(FR_SUB_NET,
                "fabric: provider %s (fabric %s, domain %s), mr_mode 0x%llx"
                "%s%s%s%s%s, cq_data_size %zu, inject_size %zu, "
                "max_msg_size %zu, tx size %zu",
                t->prov, info->fabric_attr->name, info->domain_attr->name,
                (unsigned long long)t->mr_mode,
                (t->mr_mode & FI_MR_LOCAL) ? " LOCAL" : "",
                (t->mr_mode & FI_MR_VIRT_ADDR) ? " VIRT_ADDR" : "",
                (t->mr_mode & FI_MR_ALLOCATED) ? " ALLOCATED" : "",
                (t->mr_mode & FI_MR_PROV_KEY) ? " PROV_KEY" : "",
                (t->mr_mode & FI_MR_ENDPOINT) ? " ENDPOINT" : "",
                info->domain_attr->cq_data_size, info->tx_attr->inject_size,
                info->ep_attr->max_msg_size, info->tx_attr->size);

    if ((frc = fi_fabric(info->fabric_attr, &t->fabric, NULL))) {
        rc = fab_fail(err, "fi_fabric", frc);
        goto fail;
    }
    if ((frc = fi_domain(t->fabric, info, &t->domain, NULL))) {
        rc = fab_fail(err, "fi_domain", frc);
        goto fail;
    }
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.wait_obj = FI_WAIT_NONE;
    if ((frc = fi_cq_open(t->domain, &cqa, &t->cq, NULL))) {
        rc = fab_fail(err, "fi_cq_open", frc);
        goto fail;
    }
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    ava.count = (size_t)t->size;
    if ((frc = fi_av_open(t->domain, &ava, &t->av, NULL))) {
        rc = fab_fail(err, "fi_av_open", frc);
        goto fail;
    }
    if ((frc = fi_endpoint(t->domain, info, &t->ep, NULL))) {
        rc = fab_fail(err, "fi_endpoint", frc);
        goto fail;
    }
    if ((frc = fi_ep_bind(t->ep, &t->cq->fid, FI_TRANSMIT | FI_RECV))) {
        rc = fab_fail(err, "fi_ep_bind(cq)", frc);
        goto fail;
    }
    if ((frc = fi_ep_bind(t->ep, &t->av->fid, 0))) {
        rc = fab_fail(err, "fi_ep_bind(av)", frc);
        goto fail;
    }
    if ((frc = fi_enable(t->ep))) {
        rc = fab_fail(err, "fi_enable", frc);
        goto fail;
    }

    /* Exchange names (and provider names, which must agree). */
    fr_fab_block_t mine;
    memset(&mine, 0, sizeof(mine));
    size_t namelen = sizeof(mine.name);
    if ((frc = fi_getname(&t->ep->fid, mine.name, &namelen))) {
        rc = FR_ERR(err, FERRY_ERR_FABRIC,
                    "fabric: fi_getname failed: %s (%d) (name needs %zu "
                    "bytes, room for %zu)",
                    fi_strerror(-frc), frc, namelen, sizeof(mine.name));
        goto fail;
    }
    mine.namelen = (uint32_t)namelen;
    snprintf(mine.prov, sizeof(mine.prov), "%s", t->prov);
    blocks = calloc((size_t)t->size, sizeof(*blocks));
    t->addrs = calloc((size_t)t->size, sizeof(*t->addrs));
    if (!blocks || !t->addrs) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
        goto fail;
    }
    FR_CHECK_GOTO(fr_boot_allgather(boot, &mine, blocks, sizeof(mine), err),
                  rc, fail);
    t->present = calloc((size_t)t->size, 1);
    if (!t->present) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
        goto fail;
    }
    for (int r = 0; r < t->size; r++) {
        fr_fab_block_t *b = &blocks[r];
        b->prov[sizeof(b->prov) - 1] = '\0';
        if (nic > 0 && b->namelen == 0)
            continue; /* that rank has no NIC of this index */
        t->present[r] = 1;
        if (strcmp(b->prov, t->prov) != 0) {
            rc = FR_ERR(err, FERRY_ERR_FABRIC,
                        "fabric: rank %d uses provider %s but rank %d uses "
                        "%s (set FI_PROVIDER alike on all ranks)",
                        r, b->prov, t->rank, t->prov);
            goto fail;
        }
        if (b->namelen == 0 || b->namelen > sizeof(b->name)) {
            rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                        "fabric: rank %d sent an address of %u bytes", r,
                        b->namelen);
            goto fail;
        }
        /* One at a time: some providers (shm) step through a packed array
         * by string length, not by addrlen. */
        frc = fi_av_insert(t->av, b->name, 1, &t->addrs[r], 0, NULL);
        if (frc != 1) {
            rc = FR_ERR(err, FERRY_ERR_FABRIC,
                        "fabric: fi_av_insert of rank %d failed: %s (%d)", r,
                        fi_strerror(frc < 0 ? -frc : FI_EINVAL), frc);
            goto fail;
        }
    }
    free(blocks);
    *tp = t;
    return FERRY_OK;

fail:
    free(blocks);
    if (hints)
        fi_freeinfo(hints);
    fab_close(t);
    return rc;
}

/* A rank without NIC k still joins NIC k's address exchange. */
static int fab_exchange_absent(fr_boot_t *boot, fr_transport_t *t,
                               fr_transport_t **tp, fr_err_t *err)
{
    fr_fab_block_t mine, *blocks = calloc((size_t)t->size, sizeof(mine));
    memset(&mine, 0, sizeof(mine));
    snprintf(mine.prov, sizeof(mine.prov), "%s", t->prov);
    t->present = calloc((size_t)t->size, 1);
    int rc = blocks && t->present
                 ? fr_boot_allgather(boot, &mine, blocks, sizeof(mine), err)
                 : FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    free(blocks);
    if (rc != FERRY_OK) {
        fab_close(t);
        return rc;
    }
    FR_LOG_INFO(FR_SUB_NET, "fabric: no NIC %d on this rank", t->nic);
    *tp = t;
    return FERRY_OK;
}

static int fab_has_peer(fr_transport_t *t, int rank)
{
    return t && !t->absent && t->present && rank >= 0 && rank < t->size &&
           t->present[rank];
}

static const char *fab_iface(fr_transport_t *t) { return t->iface; }

static int fab_reg(fr_transport_t *t, void *ptr, size_t len, int remote_write,
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

static void fab_dereg(fr_transport_t *t, fr_mr_t *m)
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

static int fab_group_create(fr_transport_t *t, const int *peers, int npeers,
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

static void fab_group_destroy(fr_transport_t *t, fr_group_t *g)
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

static int fab_scatter(fr_transport_t *t, fr_group_t *g,
                       const fr_slice_t *slices, uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!g || (g->npeers > 0 && !slices))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: scatter: group %p, slices %p", (void *)g,
                      (const void *)slices);
    for (int i = 0; i < g->npeers; i++)
        if ((rc = fab_check_slice(g, i, &slices[i], err)) != FERRY_OK)
            return rc;
    if ((rc = fab_reserve(t, g->npeers, err)) != FERRY_OK)
        return rc;
    for (int i = 0; i < g->npeers; i++)
        fab_add(t, g, i, &slices[i], ctx, 0, err);
    return FERRY_OK;
}

static int fab_barrier(fr_transport_t *t, fr_group_t *g, uint32_t imm,
                       uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!g)
        return FR_ERR(err, FERRY_ERR_INVALID, "fabric: barrier: no group");
    if ((rc = fab_reserve(t, g->npeers, err)) != FERRY_OK)
        return rc;
    fr_slice_t s = {0, 0, 0, imm};
    for (int i = 0; i < g->npeers; i++)
        fab_add(t, g, i, &s, ctx, 0, err);
    return FERRY_OK;
}

static int fab_write_imm(fr_transport_t *t, fr_group_t *g, int index,
                         const fr_slice_t *slice, uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!g || !slice || index < 0 || index >= g->npeers)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: write_imm: index %d of a group of %d", index,
                      g ? g->npeers : 0);
    if ((rc = fab_check_slice(g, index, slice, err)) != FERRY_OK)
        return rc;
    return fab_add(t, g, index, slice, ctx, 0, err);
}

static int fab_write_fence(fr_transport_t *t, fr_group_t *g, int index,
                           const fr_slice_t *slice, uint64_t ctx, fr_err_t *err)
{
    int rc;
    if (!t->fence_caps)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "fabric: a fenced write needs an endpoint opened with "
                      "FI_FENCE (open_flags)");
    if (!g || !slice || index < 0 || index >= g->npeers)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fabric: write_fence: index %d of a group of %d", index,
                      g ? g->npeers : 0);
    if ((rc = fab_check_slice(g, index, slice, err)) != FERRY_OK)
        return rc;
    return fab_add(t, g, index, slice, ctx, 1, err);
}

static int fab_poll(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err)
{
    int n = 0;
    if (t->absent)
        return 0;
    if (t->posts.n)
        fab_release_posts(t);
    /* Posts that failed outright, in order. */
    while (n < max && t->e_head) {
        fr_fab_op_t *op = fab_list_pop(&t->e_head, &t->e_tail);
        t->nerrors--;
        out[n].kind = FR_CQE_ERR;
        out[n].imm = op->imm;
        out[n].peer = op->peer;
        out[n].status = FERRY_ERR_FABRIC;
        out[n].ctx = op->ctx;
        n++;
        FR_ERR(err, FERRY_ERR_FABRIC,
               "fabric: fi_writedata of %zu bytes to rank %d failed: %s (%d)",
               op->len, op->peer, fi_strerror(-op->err), op->err);
        fab_op_put(t, op);
    }
    fab_drain_queue(t);

    if (t->arrivals.n)
        n += fab_release(t, out + n, max - n);
    struct fi_cq_data_entry ent[FR_FAB_CQ_BATCH];
    while (n < max) {
        int want = max - n < FR_FAB_CQ_BATCH ? max - n : FR_FAB_CQ_BATCH;
        ssize_t got = fi_cq_read(t->cq, ent, (size_t)want);
        if (got == -FI_EAGAIN)
            break;
        if (got == -FI_EAVAIL) {
            struct fi_cq_err_entry ee;
            memset(&ee, 0, sizeof(ee));
            ssize_t r = fi_cq_readerr(t->cq, &ee, 0);
            if (r == -FI_EAGAIN)
                break;
            if (r < 0)
                return fab_fail(err, "fi_cq_readerr", (int)r);
            char buf[256];
            const char *s = fi_cq_strerror(t->cq, ee.prov_errno, ee.err_data,
                                           buf, sizeof(buf));
            fr_cqe_t *c = &out[n++];
            c->kind = FR_CQE_RXERR; /* not one of our posts */
            c->imm = 0;
            c->status = FERRY_ERR_FABRIC;
            c->peer = -1;
            c->ctx = 0;
            if (ee.op_context && !(ee.flags & FI_REMOTE_WRITE)) {
                fr_fab_op_t *op = ee.op_context;
                c->kind = FR_CQE_ERR;
                c->peer = op->peer;
                c->ctx = op->ctx;
                c->imm = op->imm;
                t->inflight--;
                fab_op_put(t, op);
            }
            if (c->kind == FR_CQE_ERR)
                FR_ERR(err, FERRY_ERR_FABRIC,
                       "fabric: completion error (write to rank %d): %s (%d), "
                       "provider: %s (%d)",
                       c->peer, fi_strerror(ee.err), ee.err, s ? s : "?",
                       ee.prov_errno);
            else
                FR_ERR(err, FERRY_ERR_FABRIC,
                       "fabric: completion error on an incoming %s (writer "
                       "unknown): %s (%d), provider: %s (%d)",
                       (ee.flags & FI_REMOTE_WRITE) ? "write" : "operation",
                       fi_strerror(ee.err), ee.err, s ? s : "?",
                       ee.prov_errno);
            continue;
        }
        if (got < 0)
            return fab_fail(err, "fi_cq_read", (int)got);
        for (ssize_t i = 0; i < got; i++) {
            fr_cqe_t *c = &out[n++];
            if ((ent[i].flags & FI_REMOTE_CQ_DATA) &&
                (t->f_delay_ns || t->f_jitter_ns || t->f_reorder) &&
                !t->f_posts &&
                fab_hq_push(t, &t->arrivals, (uint32_t)ent[i].data, NULL)) {
                n--; /* held back: released by a later poll */
                continue;
            }
            if (ent[i].flags & FI_REMOTE_CQ_DATA) {
                c->kind = FR_CQE_RX;
                c->imm = (uint32_t)ent[i].data;
                c->peer = -1;
                c->status = FERRY_OK;
                c->ctx = 0;
            } else {
                fr_fab_op_t *op = ent[i].op_context;
                c->kind = FR_CQE_TX;
                c->imm = op->imm;
                c->peer = op->peer;
                c->status = FERRY_OK;
                c->ctx = op->ctx;
                t->inflight--;
                fab_op_put(t, op);
            }
        }
        if (got < want)
            break;
    }
    /* Completions may have made room for queued posts. */
    if (t->q_head)
        fab_drain_queue(t);
    return n;
}

static int fab_pending(fr_transport_t *t)
{
    long p = t->inflight + t->nqueued + t->nerrors + t->posts.n;
    return p > 0x7fffffff ? 0x7fffffff : (int)p;
}

static void fab_close_fid(struct fid *f, const char *what)
{
    int frc = fi_close(f);
    if (frc)
        FR_LOG_WARN(FR_SUB_NET, "fabric: fi_close(%s) failed: %s (%d)", what,
                    fi_strerror(-frc), frc);
}

static void fab_close(fr_transport_t *t)
{
    if (!t)
        return;
    FR_LOG_DEBUG(FR_SUB_NET,
                 "fabric: closing with %ld posted and %ld queued writes; "
                 "%ld posts waited for -FI_EAGAIN",
                 t->inflight, t->nqueued, t->nwaited);
    if ((t->f_delay_ns || t->f_jitter_ns || t->f_reorder) && !t->f_posts)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection: held %ld arrivals, delivered %ld ahead "
                    "of an older one", t->arrivals.total,
                    t->arrivals.reordered);
    if (t->f_posts)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection: held %ld posts, posted %ld ahead of an "
                    "older one", t->posts.total, t->posts.reordered);
    for (int i = 0; i < t->posts.n; i++)
        fab_op_put(t, t->posts.v[i].op);
    free(t->posts.v);
    free(t->arrivals.v);
    t->posts = t->arrivals = (fr_fab_hq_t){0};
    free(t->present);
    t->present = NULL;
    while (t->groups)
        fab_group_destroy(t, t->groups);
    while (t->mrs)
        fab_dereg(t, t->mrs);
    if (t->ep)
        fab_close_fid(&t->ep->fid, "ep");
    if (t->av)
        fab_close_fid(&t->av->fid, "av");
    if (t->cq)
        fab_close_fid(&t->cq->fid, "cq");
    if (t->domain)
        fab_close_fid(&t->domain->fid, "domain");
    if (t->fabric)
        fab_close_fid(&t->fabric->fid, "fabric");
    if (t->info)
        fi_freeinfo(t->info);
    while (t->chunks) {
        fr_fab_chunk_t *c = t->chunks;
        t->chunks = c->next;
        free(c);
    }
    free(t->addrs);
    free(t);
}

static const char *fab_provider(fr_transport_t *t) { return t->prov; }

const fr_transport_ops_t fr_transport_fabric = {
    .size = sizeof(fr_transport_ops_t),
    .name = "fabric",
    .open = fab_open,
    .reg = fab_reg,
    .dereg = fab_dereg,
    .group_create = fab_group_create,
    .group_destroy = fab_group_destroy,
    .scatter = fab_scatter,
    .barrier = fab_barrier,
    .write_imm = fab_write_imm,
    .poll = fab_poll,
    .pending = fab_pending,
    .close = fab_close,
    .provider = fab_provider,
    .open_nic = fab_open_nic,
    .has_peer = fab_has_peer,
    .iface = fab_iface,
    .fence_probe = fab_fence_probe,
    .open_flags = fab_open_flags,
    .write_fence = fab_write_fence,
};
