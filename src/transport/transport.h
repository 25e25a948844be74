/*
 * Transport ops table: the proxy's TransferEngine.
 *
 * Operations (DESIGN section 4): scatter one registered source region to a
 * registered peer group (one slice and one immediate per peer), barrier over
 * a group, and a single write with immediate. Groups hold per-peer request
 * templates (address, remote key, descriptors) prepared once at setup; a call
 * only patches offsets and lengths.
 *
 * Completions are counted by the caller; the transport never orders them.
 * Immediate data is 32 bits (what EFA carries).
 */
#ifndef FR_TRANSPORT_H
#define FR_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "../bootstrap/bootstrap.h"
#include "../core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_transport fr_transport_t;
typedef struct fr_mr fr_mr_t;
typedef struct fr_group fr_group_t;

/* What a peer needs to write into a registered region (exchanged at setup). */
typedef struct fr_mr_desc {
    uint64_t base; /* address to add offsets to (0 when the provider uses
                      offsets, i.e. mr_mode without FI_MR_VIRT_ADDR) */
    uint64_t key;
    uint64_t len;
} fr_mr_desc_t;

typedef struct fr_slice {
    uint64_t src_off; /* offset in the group's source region */
    uint64_t dst_off; /* offset in the peer's destination region */
    uint64_t len;     /* bytes; 0 still sends the immediate */
    uint32_t imm;     /* remote completion data */
} fr_slice_t;

enum fr_cqe_kind {
    FR_CQE_TX = 1,  /* a write this rank posted completed locally */
    FR_CQE_RX = 2,  /* a peer's write with immediate landed here */
    FR_CQE_ERR = 3, /* an operation failed; status/peer say which */
    FR_CQE_RXERR = 4 /* a peer's write into this rank failed (shm: the
                      * writer died mid-copy); the writer is unknown */
};

typedef struct fr_cqe {
    int kind;
    uint32_t imm;  /* RX: the immediate */
    int peer;      /* TX/ERR: the destination rank when known, else -1 */
    int status;    /* ERR: a FERRY_ERR_* code */
    uint64_t ctx;  /* TX/ERR: the ctx passed when posting */
} fr_cqe_t;

/* A failed completion (FR_CQE_ERR: a write this rank posted to rank
 * `to`, -1: the completion's peer; FR_CQE_RXERR: a peer's write into this
 * rank, writer unknown) as a status, the rank to blame (*rank, -1: none)
 * and a message starting with `who`: with `boot`, a rank the bootstrap
 * knows died comes first (FERRY_ERR_PEER; fr_boot_blame may wait briefly
 * for the watcher); else the completion's status, or FERRY_ERR_FABRIC.
 * `why` (NULL or "": none) is the poll's message. Returns the status. */
int fr_cqe_failure(const fr_cqe_t *c, int to, const fr_boot_t *boot, const char *who,
                   const char *why, int *rank, char *msg, size_t len);

/* What a transport counts about its own posting (the stats op). */
typedef struct fr_tp_stats {
    uint64_t prov_ns;    /* ns inside the provider's post calls
                            (fi_writedata, fi_writemsg) made when posting */
    uint64_t retry_ns;   /* ns inside those calls retrying queued posts
                            (from poll) */
    uint64_t prov_calls; /* those calls */
    uint64_t eagain;     /* of them, the ones that returned -FI_EAGAIN
                            (the post was queued and retried from poll) */
    uint64_t more;       /* writes posted with FI_MORE (write_batch: the
                            provider may hold them for the batch's last) */
} fr_tp_stats_t;

enum { FR_TP_OPEN_FENCE = 1, FR_TP_OPEN_DELIVERY = 2, FR_TP_OPEN_HMEM = 4 };

/* What hmem_probe found: the provider an endpoint opened without
 * FR_TP_OPEN_HMEM would use, and whether it registers CUDA memory. */
typedef struct fr_tp_hmem {
    int ok;            /* the provider offers FI_HMEM for RDM RMA writes */
    int copies;        /* it moves device memory with CUDA copies (shm,
                          tcp: nothing to flush), not NIC DMA */
    char prov[48];     /* its name */
    char why[384];     /* how it was chosen, or why not */
} fr_tp_hmem_t;

typedef struct fr_transport_ops {
    size_t size; /* sizeof(fr_transport_ops_t): new ops go at the end */
    const char *name;
    /* Open this rank's NIC `nic` (0: the one on the rendezvous route; k:
     * the k-th other interface of the same kind that is up) and exchange
     * addresses with all ranks. Collective over boot for every nic index:
     * a rank without that NIC still takes part and gets an instance for
     * which has_peer() is 0 everywhere. flags: FR_TP_OPEN_FENCE (the fence
     * capability, only where fence_probe said yes), FR_TP_OPEN_DELIVERY (a
     * write's local completion means its data is visible at the target).
     * fabric: the provider FI_PROVIDER names when set; with
     * FR_TP_OPEN_FENCE the one fence_probe settles on (never libfabric's
     * default); FR_TP_OPEN_HMEM (any NIC): device memory may be registered
     * (reg_dev), the provider the one hmem_probe names. Callers open
     * through fr_transport_open, not through this op. */
    int (*open)(fr_boot_t *boot, int nic, int flags, fr_transport_t **t,
                fr_err_t *err);
    /* Register memory; remote_write: peers may write into it. */
    int (*reg)(fr_transport_t *t, void *ptr, size_t len, int remote_write,
               fr_mr_t **mr, fr_mr_desc_t *desc, fr_err_t *err);
    void (*dereg)(fr_transport_t *t, fr_mr_t *mr);
    /* A peer group: peers[i] with the remote region remote[i]; src is the
     * local region slices are taken from. */
    int (*group_create)(fr_transport_t *t, const int *peers, int npeers,
                        fr_mr_t *src, const fr_mr_desc_t *remote,
                        fr_group_t **g, fr_err_t *err);
    void (*group_destroy)(fr_transport_t *t, fr_group_t *g);
    /* Post one write per peer (slices[i] for peers[i]); ctx comes back in
     * each TX completion. Never blocks: when the provider is busy, posts
     * are queued inside the transport and retried from poll(). Bounds are
     * checked against the registered lengths (FERRY_ERR_INVALID). */
    int (*scatter)(fr_transport_t *t, fr_group_t *g, const fr_slice_t *slices,
                   uint64_t ctx, fr_err_t *err);
    /* A zero-byte write with immediate to every peer of the group. */
    int (*barrier)(fr_transport_t *t, fr_group_t *g, uint32_t imm,
                   uint64_t ctx, fr_err_t *err);
    /* One write with immediate to group member `index`. */
    int (*write_imm)(fr_transport_t *t, fr_group_t *g, int index,
                     const fr_slice_t *slice, uint64_t ctx, fr_err_t *err);
    /* write_imm to members index[0..n) (slices[i] for index[i]) in one
     * call: all checked before any is posted (an error posts none), then
     * posted in order; where the provider allows, all but the last carry
     * FI_MORE (one doorbell for the batch). NULL: callers post write_imm
     * each. */
    int (*write_batch)(fr_transport_t *t, fr_group_t *g, const int *index,
                       const fr_slice_t *slices, int n, uint64_t ctx, fr_err_t *err);
    /* Drive progress (manual-progress providers need it on both sides) and
     * return up to max completions. Returns the count, or a negative
     * status. */
    int (*poll)(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err);
    /* Operations posted or queued and not yet completed. */
    int (*pending)(fr_transport_t *t);
    void (*close)(fr_transport_t *t);
    /* Provider name actually in use (e.g. "tcp;ofi_rxm", "shm"). */
    const char *(*provider)(fr_transport_t *t);
    /* Both this rank and `rank` opened this NIC. */
    int (*has_peer)(fr_transport_t *t, int rank);
    /* Interface (domain) name, for logs. */
    const char *(*iface)(fr_transport_t *t);
    /* Is there a provider whose FI_FENCE (a write that starts only after
     * every earlier write on the endpoint completed, NIC-side) ferry can
     * use: the one FI_PROVIDER names, else the first of the vetted list
     * that offers it (fabric/select.c)? 0 with the reason in why (each
     * provider considered and why it was passed over). Local, no
     * communication. */
    int (*fence_probe)(char *why, size_t len);
    /* write_imm() carrying the fence flag. */
    int (*write_fence)(fr_transport_t *t, fr_group_t *g, int index,
                       const fr_slice_t *slice, uint64_t ctx, fr_err_t *err);
    /* Would an instance opened with FR_TP_OPEN_HMEM register CUDA device
     * memory? The provider is the one an open without it would choose
     * (FI_PROVIDER, else libfabric's first usable offer): asking for
     * FI_HMEM never changes the provider. With ptr, [ptr, ptr + len) of
     * device `device` is registered on trial (a provider may offer FI_HMEM
     * without CUDA). Local, no communication. */
    void (*hmem_probe)(int device, void *ptr, size_t len, fr_tp_hmem_t *out);
    /* reg() for memory of CUDA device `device` (>= 0, on an instance
     * opened with FR_TP_OPEN_HMEM), or host memory (-1: exactly reg()). */
    int (*reg_dev)(fr_transport_t *t, void *ptr, size_t len, int remote_write,
                   int device, fr_mr_t **mr, fr_mr_desc_t *desc, fr_err_t *err);
    /* The instance's counters so far (cumulative, never reset). Called by
     * the thread that posts and polls (one thread at a time, as the other
     * ops). */
    void (*stats)(fr_transport_t *t, fr_tp_stats_t *out);
} fr_transport_ops_t;

/* Whether slice s of peer i (rank `rank`) stays inside the registered
 * source (slen bytes) and the peer's destination (rlen bytes): FERRY_OK,
 * else FERRY_ERR_INVALID with a message prefixed by `who` (the transport's
 * name). The one bounds check of every transport (registry.c). */
int fr_slice_in_bounds(const char *who, int i, int rank, const fr_slice_t *s,
                       uint64_t slen, uint64_t rlen, fr_err_t *err);

/* The libfabric transport (fabric/); callers find it by name through
 * the registry below. */
/* Transports by name (registry.c: one line per transport). NULL when no
 * transport has that name. */
const fr_transport_ops_t *fr_transport_find(const char *name);
/* Open transport `name` on this rank's NIC `nic` with FR_TP_OPEN_* flags;
 * collective over boot. *ops is what to call the instance through: the
 * transport's own table, or the fault injector's wrapped around it when a
 * FERRY_FAULT_* setting is on (fault.h). */
int fr_transport_open(const char *name, fr_boot_t *boot, int nic, int flags,
                      const fr_transport_ops_t **ops, fr_transport_t **t,
                      fr_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
