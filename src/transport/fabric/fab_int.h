/*
 * Private to the libfabric transport (src/transport/fabric/): the types
 * behind its opaque handles and what its files share. select.c holds the
 * vetted providers, the hints, what an offer must have, and the choice of
 * provider for FI_FENCE; open.c finds the NIC, opens the endpoint and
 * exchanges addresses; mr.c registers memory and builds peer groups;
 * post.c owns the op pool and posting (the -FI_EAGAIN queue); progress.c
 * polls the completion queue and classifies each entry.
 *
 * Facts this relies on (see shared/FABRIC.md):
 *  - mr_mode is read back from fi_getinfo and honoured (tcp answers 0:
 *    offsets and requested keys; shm may answer FI_MR_VIRT_ADDR).
 *  - Bad writes fail silently on tcp and shm, so every slice is checked
 *    against the registered lengths before anything is posted.
 *  - Progress is manual: poll() must be called on both sides.
 *
 * Threading: one thread at a time per transport (the proxy's); nothing here
 * takes a lock.
 */
#ifndef FR_FAB_INT_H
#define FR_FAB_INT_H

#include <stddef.h>
#include <stdint.h>

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include "transport/transport.h"

#define FR_FAB_NAME_MAX 448 /* endpoint name bytes in the exchange block */
#define FR_FAB_PROV_MAX 56  /* provider name bytes in the exchange block */
#define FR_FAB_POOL_CHUNK 256
#define FR_FAB_CQ_BATCH 64

/* Per-post state, taken from a pool that grows in chunks (no allocation
 * per post once warm). */
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
    int more;       /* post with FI_MORE (a batch's write before its last) */
    int state;      /* FR_FAB_OP_*: a completion's op_context is one of
                       ours only when it is in the pool and POSTED */
} fr_fab_op_t;

enum { FR_FAB_OP_FREE = 0, FR_FAB_OP_HELD = 1, FR_FAB_OP_POSTED = 2 };

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
    fr_tp_stats_t st;             /* the stats op's counters */

    struct fr_mr *mrs;
    struct fr_group *groups;
    int nic;             /* index among this rank's NICs */
    int absent;          /* this rank has no NIC of that index */
    char *present;       /* [size]: which ranks opened this NIC */
    char iface[64];      /* domain (interface) name */
    int fence_caps;      /* opened with FI_FENCE in caps */
    int hmem;            /* opened with FI_HMEM in caps: reg_dev works */
    size_t max_msg;      /* the provider's ep_attr->max_msg_size */
    size_t tx_size;      /* the provider's tx_attr->size (0: unknown) */
    uint64_t op_flags;   /* the endpoint's default op flags (tx_attr's,
                            ferry's added): fi_writemsg takes its flags
                            instead of them */
    uintptr_t pool_lo, pool_hi; /* address range of the pool's chunks */
};

/* A provider ferry is tested with (select.c). */
typedef struct fr_fab_vetted {
    const char *name; /* as fi_getinfo names it, e.g. "tcp;ofi_rxm" */
    int autopick;     /* may be chosen with FI_PROVIDER unset (not shm:
                         node-local only) */
    const char *nofence; /* advertises FI_FENCE but ferry must not rely on
                            it: why (NULL: may be used) */
} fr_fab_vetted_t;

/* select.c */
extern const fr_fab_vetted_t fr_fab_vetted[];
extern const int fr_fab_nvetted;
const fr_fab_vetted_t *fab_vetted_find(const char *prov);
struct fi_info *fab_hints(uint64_t caps, const char *prov);
int fab_offer_ok(const struct fi_info *i, uint64_t caps, char *why,
                 size_t len);
int fab_fence_pick(char *prov, size_t plen, char *why, size_t wlen);
int fab_fence_probe(char *why, size_t len);
void fab_hmem_probe(int device, void *ptr, size_t len, fr_tp_hmem_t *out);
int fab_hmem_try(const char *prov, int device, void *ptr, size_t len, char *why,
                 size_t wlen);

/* open.c */
int fab_fail(fr_err_t *err, const char *call, int rc);
void fab_close(fr_transport_t *t);

/* mr.c */
int fab_reg(fr_transport_t *t, void *ptr, size_t len, int remote_write,
            fr_mr_t **mrp, fr_mr_desc_t *desc, fr_err_t *err);
int fab_reg_dev(fr_transport_t *t, void *ptr, size_t len, int remote_write,
                int device, fr_mr_t **mrp, fr_mr_desc_t *desc, fr_err_t *err);
void fab_dereg(fr_transport_t *t, fr_mr_t *m);
int fab_group_create(fr_transport_t *t, const int *peers, int npeers,
                     fr_mr_t *src, const fr_mr_desc_t *remote,
                     fr_group_t **gp, fr_err_t *err);
void fab_group_destroy(fr_transport_t *t, fr_group_t *g);

/* post.c */
void fab_op_put(fr_transport_t *t, fr_fab_op_t *op);
fr_fab_op_t *fab_list_pop(fr_fab_op_t **head, fr_fab_op_t **tail);
void fab_drain_queue(fr_transport_t *t);
void fab_pool_free(fr_transport_t *t);
int fab_scatter(fr_transport_t *t, fr_group_t *g, const fr_slice_t *slices,
                uint64_t ctx, fr_err_t *err);
int fab_barrier(fr_transport_t *t, fr_group_t *g, uint32_t imm,
                uint64_t ctx, fr_err_t *err);
int fab_write_batch(fr_transport_t *t, fr_group_t *g, const int *index,
                    const fr_slice_t *slices, int n, uint64_t ctx, fr_err_t *err);
int fab_write_imm(fr_transport_t *t, fr_group_t *g, int index,
                  const fr_slice_t *slice, uint64_t ctx, fr_err_t *err);
int fab_write_fence(fr_transport_t *t, fr_group_t *g, int index,
                    const fr_slice_t *slice, uint64_t ctx, fr_err_t *err);

/* progress.c */
fr_fab_op_t *fab_op_ours(const fr_transport_t *t, const void *op_context);
int fab_poll(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err);
int fab_pending(fr_transport_t *t);

#endif
