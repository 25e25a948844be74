/*
 * The CPU high-throughput engine: routes (a collective count exchange,
 * exact sizes), and dispatch/combine streamed through bounded rings, one
 * per (source, destination) pair in the destination's shared segment.
 *
 * Segment of each rank (POSIX shared memory, mapped by its node's peers):
 *
 *   [4 KB header: doorbell]
 *   [notify]  [2 parity][N sources] { epoch, tokens, per-local-expert counts }
 *   [dispatch rings] [N sources] { tail line, head line, ring_tokens records }
 *   [combine rings]  [N sources] { tail line, head line, ring_tokens rows }
 *
 * A ring's tail (records written, cumulative over the context's life) is
 * stored by the source into the destination's segment with a release
 * store; its head (records consumed) by the destination, read by the
 * source with an acquire load. Counters never reset, so a call never
 * clears anything and calls follow each other without barriers.
 */
#ifndef FR_CPU_HT_H
#define FR_CPU_HT_H

#include "core/ht_rec.h"
#include "engines/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_HT_RING_DEFAULT 256
#define FR_HT_LINE 64
#define FR_HT_CHUNK 8 /* records per publication (shm) and per write (fabric) */

typedef struct fr_ht_layout {
    int N, El, K, H, RT;
    uint64_t notify_entry;   /* bytes of one notify entry */
    uint64_t off_notify;
    uint64_t dhdr, drec;     /* dispatch record: header, whole record */
    uint64_t chdr, crec;     /* combine record */
    uint64_t dring, cring;   /* bytes of one ring (2 lines + records) */
    uint64_t off_dring, off_cring;
    int LF;                  /* forwarding: combine rings from the forwarder's
                                node (the largest node's size; 0: none) */
    uint64_t off_fcring;     /* [LF] combine rings, one per rank of the node */
    uint64_t seg_bytes;
    uint64_t stage;          /* send region bytes per fabric peer */
} fr_ht_layout_t;

/* Peers on the fabric path (fabric.c): rows go as writes of one chunk
 * (up to FR_HT_CHUNK records at chunk-aligned slots of the peer's ring)
 * with a 32-bit immediate: kind << 29 | source rank << 16 | chunk number
 * (low 16 bits). The receiver marks the chunk landed when the immediate
 * arrives (the data is visible then; writes may land out of order), takes
 * chunks in order, and returns credits (cumulative chunks taken) as
 * zero-byte writes. Counts of a route go as one write of the notify
 * entry. A call returns once its chunk and count writes have completed
 * locally; credit writes complete during later calls (fr_ht_fab_drain). */
enum { FR_HT_IMM_NOTIFY = 1, FR_HT_IMM_DATA = 2, FR_HT_IMM_DCREDIT = 3,
       FR_HT_IMM_COMB = 4, FR_HT_IMM_CCREDIT = 5 };

typedef struct fr_ht_fab {
    int W;                   /* chunks per ring */
    int *gmem;               /* [N] member index in the peer's NIC group (-1: none yet) */
    uint64_t *d_post, *d_credit, *d_take;   /* dispatch chunks: posted to, */
    uint64_t *c_post, *c_credit, *c_take;   /* consumed by, taken from peer */
    uint8_t *d_landed, *c_landed;           /* [N][W] */
    uint32_t *notify_seen;   /* [2 parity][N] route number (low 16 bits) + 1 whose
                                counts landed */
    long pending;            /* chunk and count writes posted and not completed */
    int32_t *pending_to;     /* [N] of them per destination */
    long credits_out;        /* credit writes posted and not completed */
} fr_ht_fab_t;

/* A failure after shared state was touched: the context cannot go on
 * (the message is already set). */
static inline int fr_ht_fatal(ferry_ep_t ep, int rc)
{
    if (!ep->failed)
        fr_ep_set_failed(ep, rc ? rc : FERRY_ERR_INTERNAL);
    return ep->failed;
}

/* The engine's part of a route (route->priv); its notify parity is
 * route->id & 1. */
typedef struct fr_ht_route {
    int32_t *idx;            /* [T][K] copy of topk_idx (int32) */
    int32_t *dst_off;        /* [N + 1]: tokens per destination, CSR */
    int32_t *dst_tok;        /* tokens going to each destination, in order */
    int32_t *src_off;        /* [N + 1]: first row from each source */
    /* forwarding (forward.c) */
    int32_t *nd_off;         /* [nnodes + 1]: tokens per node, CSR */
    int32_t *nd_tok;         /* tokens with an expert on each node, in order */
    int32_t *fwd_off;        /* [N + 1]: records each source forwards through
                                this rank, CSR into fle */
    int16_t *fle;            /* [fwd_off[N]][K] their node-relative expert ids,
                                kept by a dispatch for the combine */
    int32_t *fwd_cnt;        /* [N][LF] of them, the tokens for each rank of
                                this node (the source's counts) */
    int dispatched;          /* a dispatch on this route completed */
} fr_ht_route_t;

/* Forwarding (forward.c): a token crosses the fabric once per destination
 * node, to the rank of that node with the sender's local index (modulo
 * the node's size), which writes it into its node's destinations' rings
 * through shared memory as if it came from the sender; in combine each
 * destination writes the sender's rows into ring [its local index] of
 * that forwarder (sources in ascending order), which sums a token's rows
 * (its node's ranks in rank order, fp32, one bf16 rounding) and sends one
 * row back. A node-level record is a dispatch record whose expert ids are
 * node-relative: local index x El + local expert. */
typedef struct fr_ht_fwd {
    int me_node, L;          /* this rank's node, its size */
    int *fsrc, nfsrc;        /* remote sources this rank forwards for, ascending */
    uint64_t *ftx;           /* [N][L]: records this rank wrote into ring
                                [s] of its node's rank l */
    uint64_t *fctx;          /* [L]: combine records this rank wrote into
                                ring [its index] of its node's rank l */
    uint64_t *fcrx;          /* [L]: combine records taken from ring [l] */
    int *ctb, nctb;          /* this rank's combine contributors in summing
                                order: a rank of its node (>= 0), or a
                                remote node b as -(b + 1) */
} fr_ht_fwd_t;

typedef struct fr_cpu_ht {
    fr_ht_layout_t H;
    uint64_t routes;         /* routes created (collective, same on all) */
    uint64_t *dtx, *drx;     /* [N] cumulative records sent / consumed */
    uint64_t *ctx, *crx;
    float *acc;              /* combine accumulator [acc_rows][H] */
    size_t acc_rows;
    uint16_t *stash;         /* FERRY_HT_SUM_SLOTS: [stash_rows][K][H] bf16,
                                a token's rows at their highest slots, then
                                [stash_rows][K] bytes: 1 where a row is */
    size_t stash_rows;
    fr_ht_fab_t fab;         /* when peers are on the fabric */
    fr_ht_fwd_t fwd;         /* when ep->forward */
} fr_cpu_ht_t;

static inline fr_cpu_ht_t *fr_cpu_ht(ferry_ep_t ep)
{
    return (fr_cpu_ht_t *)ep->eng_state;
}

/* Byte offsets in a segment. */
static inline uint8_t *fr_ht_notify(const fr_ht_layout_t *h, uint8_t *seg, int parity,
                                    int src)
{
    return seg + h->off_notify + ((uint64_t)parity * h->N + src) * h->notify_entry;
}
static inline uint8_t *fr_ht_dring(const fr_ht_layout_t *h, uint8_t *seg, int src)
{
    return seg + h->off_dring + (uint64_t)src * h->dring;
}
static inline uint8_t *fr_ht_cring(const fr_ht_layout_t *h, uint8_t *seg, int src)
{
    return seg + h->off_cring + (uint64_t)src * h->cring;
}
/* The forwarder's combine ring from the rank of local index l. */
static inline uint8_t *fr_ht_fcring(const fr_ht_layout_t *h, uint8_t *seg, int l)
{
    return seg + h->off_fcring + (uint64_t)l * h->cring;
}
/* A ring's tail and head words, and slot i (cumulative index). */
static inline uint64_t *fr_ht_tail(uint8_t *ring) { return (uint64_t *)ring; }
static inline uint64_t *fr_ht_head(uint8_t *ring) { return (uint64_t *)(ring + FR_HT_LINE); }
/* Chunks per ring on the fabric path: slot numbers travel in 16 bits and
 * credits are compared modulo 2^16. */
#define FR_HT_MAX_CHUNKS 32767

static inline uint8_t *fr_ht_slot(uint8_t *ring, uint64_t i, int RT, uint64_t rec)
{
    return ring + 2 * FR_HT_LINE + (i % (uint64_t)RT) * rec;
}

/* One dispatch or combine call in progress (stream.c, fabric.c). */
typedef struct fr_ht_call {
    ferry_ep_t ep;
    ferry_route_t route;
    fr_ht_route_t *p;
    const fr_ht_layout_t *h;
    int fp8;
    size_t rowb, nsc;            /* row bytes, scales per row */
    int32_t *done_tx, *done_rx;  /* [N] per peer, this call */
    uint8_t *need;               /* [N] peers this rank still needs */
    int busy_rank;               /* the peer we last waited on */
    int wsum;                    /* combine: weights summed over ranks */
    uint16_t *stash;             /* combine, FERRY_HT_SUM_SLOTS: rows kept
                                    [T][K][H] until all are in (else NULL) */
    uint8_t *stash_on;           /* [T][K]: 1 where stash holds a row (the
                                    other slots add nothing) */
    float *srow;                 /* combine, FERRY_HT_SUM_SLOTS: a token's sum
                                    [H] (the row after the accumulator's) */
    /* forwarding */
    int32_t *fw_done;            /* [N] forwarder: records of source s passed on
                                    (dispatch), its tokens summed (combine) */
    int32_t *fw_self;            /* [N] forwarder, combine: own rows of s used */
    int32_t *fw_fill;            /* [N] forwarder, combine: records in the chunk
                                    being filled for s */
    int32_t *fw_cur;             /* [L] destination, combine: place in the list
                                    of sources of its node's rank l */
    int32_t *fw_cnt;             /* [N][L] forwarder, dispatch: records of s
                                    passed to this node's rank l */
    float *fw_acc;               /* [H] forwarder, combine: one token's sum */
} fr_ht_call_t;

/* Record helpers shared by the shared-memory and fabric paths (stream.c). */
/* d: destination rank, or with node >= 0 the forwarder of node `node`
 * (a node-level record) */
void fr_ht_drec_fill(const fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int t, int d,
                     int node, uint8_t *rec);
int fr_ht_drec_take(const fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s,
                    int64_t row, const uint8_t *rec);
void fr_ht_crec_fill(const fr_ht_call_t *c, const ferry_ht_combine_in_t *in, size_t row,
                     uint8_t *rec);
/* Output row `row` from a record's token, local expert ids and weights,
 * data and scales (a received record's), or with `in` token `token`'s own
 * scales from the caller's strides. */
void fr_ht_put_row(const fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int src,
                   int64_t row, int32_t token, const int16_t *le, const float *w,
                   const uint8_t *data, const float *scales, const ferry_ht_dispatch_in_t *in);
/* A ring counter v written by `peer` (its tail when `tail`, else its head)
 * against this rank's own count `mine`: FERRY_OK, or a protocol error
 * naming the peer when no correct peer could have written it. */
int fr_ht_ring_check(const fr_ht_call_t *c, const char *what, int peer, int tail, uint64_t v,
                     uint64_t mine);
/* The combine's scratch (engine.c): the fp32 accumulator [T][H], zeroed,
 * with the weights output cleared, and a row after it (*row); with
 * FERRY_HT_SUM_SLOTS the rows' store and its zeroed flags (*on). */
float *fr_ht_acc(ferry_ep_t ep, int T, const ferry_ht_combine_out_t *out, float **row);
uint16_t *fr_ht_stash(ferry_ep_t ep, int T, uint8_t **on);
/* A row from rank d, or (node >= 0) the summed row of node `node`. */
void fr_ht_accumulate(fr_ht_call_t *c, const ferry_ht_combine_out_t *out, float *acc, int t,
                      int d, int node, const uint16_t *y, const float *w);

void fr_ht_layout_init(fr_ht_layout_t *h, int N, int El, int K, int H, int RT);
void fr_ht_layout_fwd(fr_ht_layout_t *h, int LF);

/* Waiting: spin, yield, then sleep; every 2 ms a dead peer this rank
 * still needs (need[r] != 0; NULL: all) or the deadline (measured from the
 * last progress) ends the call with an error naming the dead rank, or
 * `rank` on the deadline ("what" says for what). FERRY_OK: go on. */
int fr_ht_idle(ferry_ep_t ep, uint64_t *iter, uint64_t *last_check, uint64_t progress_ns,
               int rank, const char *what, const uint8_t *need);

/* fabric.c */
int fr_ht_fab_init(ferry_ep_t ep);                  /* at setup (nfabric > 0) */
void fr_ht_fab_free(ferry_ep_t ep);
int fr_ht_fab_poll(ferry_ep_t ep);                  /* completions; FERRY_OK or failed */
int fr_ht_fab_notify(ferry_ep_t ep, int d, const uint8_t *entry, uint64_t id);
int fr_ht_fab_notify_landed(ferry_ep_t ep, int s, uint64_t id);
/* node >= 0: node-level records of that node to its forwarder d (tx), the
 * node's summed rows from its forwarder d (rx) */
int fr_ht_fab_dispatch_tx(fr_ht_call_t *c, const ferry_ht_dispatch_in_t *in, int d, int node);
int fr_ht_fab_dispatch_rx(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int s);
int fr_ht_fab_combine_tx(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int s);
int fr_ht_fab_combine_rx(fr_ht_call_t *c, const ferry_ht_combine_out_t *out, float *acc,
                         int d, int node);
int fr_ht_post(ferry_ep_t ep, int d, uint64_t src_off, uint64_t dst_off, uint64_t len,
               uint32_t imm, int credit);
uint32_t fr_ht_imm(int kind, int src, uint64_t val);

/* forward.c */
/* The rank of node b that forwards source s's tokens. */
int fr_ht_fwd_setup(ferry_ep_t ep, fr_err_t *err);   /* decides ep->forward */
void fr_ht_fwd_free(ferry_ep_t ep);
int fr_ht_fwd_call_init(fr_ht_call_t *c);
void fr_ht_fwd_call_end(fr_ht_call_t *c);
/* Forwarder, dispatch: pass on what landed from the sources it serves;
 * 1 if anything moved, 0, or < 0 (failed). *left set when work remains. */
int fr_ht_fwd_dispatch(fr_ht_call_t *c, const ferry_ht_dispatch_out_t *out, int *left);
/* Destination, combine: rows of remote sources into their forwarders'
 * rings. Forwarder, combine: sums sent on. Same returns. */
int fr_ht_fwd_combine_tx(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int *left);
int fr_ht_fwd_combine_sum(fr_ht_call_t *c, const ferry_ht_combine_in_t *in, int *left);
/* Peers a forwarding rank still needs (need[] set, busy_rank named). */
void fr_ht_fwd_need(fr_ht_call_t *c, int combine);
int fr_ht_fab_drain(ferry_ep_t ep);                 /* wait for chunk and count writes */

int fr_ht_route_create(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t route);
void fr_ht_route_free(ferry_route_t route);
int fr_ht_dispatch(ferry_ep_t ep, ferry_route_t route, const ferry_ht_dispatch_in_t *in,
                   const ferry_ht_dispatch_out_t *out);
int fr_ht_combine(ferry_ep_t ep, ferry_route_t route, const ferry_ht_combine_in_t *in,
                  const ferry_ht_combine_out_t *out);
/* ferry_dispatch_layout on host memory (arguments checked by the API). */
int fr_cpuht_dispatch_layout(const ferry_layout_args_t *a);

#ifdef __cplusplus
}
#endif

#endif
