/*
 * Put-with-signal through a proxy (include/ferry_signal.h).
 *
 * Each rank registers three regions with its own fabric endpoint: the heap
 * (peers write puts into it), a mailbox (peers write signal records into
 * it: [sender][slot] of 32 bytes) and an outbox (where this rank builds
 * the records it sends: [destination][slot]). Producers (threads, kernels)
 * queue requests in a ring; one proxy thread per rank posts them and
 * polls completions.
 *
 * Every write carries a 32-bit immediate: kind (2 bits) | sender (12) |
 * payload (18):
 *   PUT     payload = the put's sequence number to that peer (mod 2^18);
 *           the receiver keeps a window of landed puts per sender and
 *           counts the gap-free prefix ("landed").
 *   SIG     payload = the record's sequence number (mod 2^18); its slot in
 *           the mailbox is seq % FR_SIG_MBOX. Records from one sender are
 *           applied in sequence order; a record with count c > 0 waits
 *           until landed >= c (counted mode).
 *   CREDIT  payload = records consumed so far (mod 2^18): the sender may
 *           reuse those mailbox slots.
 * The receiving proxy applies set/add itself, so `add` needs no fabric
 * atomics.
 *
 * Modes differ only in when the sender's proxy posts a record:
 *   fence     when no data write of this rank is in flight (the proxy
 *             takes no new request meanwhile);
 *   grouped   when every put to that destination queued before the signal
 *             has completed locally (other puts keep flowing);
 *   nicfence  at once, after the puts it covers were posted, with FI_FENCE;
 *   counted   at once, carrying the number of puts it covers.
 *
 * This header holds what the files of src/signal/ share: the wire format,
 * the per-destination and per-sender state and the context itself.
 * check.c checks configs and requests; create.c agrees on a config with
 * every rank, allocates, opens the transport and starts the proxy;
 * proxy.c is the proxy thread (ring, posting puts and records, local
 * completions); rx.c handles arrivals (landed-put windows, applying
 * records, credits); api.c the host-side calls and destroy.
 */
#ifndef FR_SIG_INT_H
#define FR_SIG_INT_H

#include <pthread.h>
#include <stdint.h>

#include "ferry_signal.h"
#include "bootstrap/comm.h"
#include "core/err.h"
#include "core/log.h"
#include "transport/nics.h"

#define FR_SIG_RING 4096          /* request slots (power of two) */
#define FR_SIG_MBOX 256           /* mailbox slots per sender */
#define FR_SIG_REC 32             /* bytes per mailbox record */
#define FR_SIG_BATCH 32           /* records per mailbox write, at most */
#define FR_SIG_TXWIN 1024         /* puts in flight per destination */
#define FR_SIG_RXWIN 65536        /* landed-put window per sender */
#define FR_SIG_SEQ_BITS 18
#define FR_SIG_SEQ_MASK ((1u << FR_SIG_SEQ_BITS) - 1)
#define FR_SIG_MAX_RANKS 4096

enum { FR_SIGK_PUT = 0, FR_SIGK_SIG = 1, FR_SIGK_CREDIT = 2 };

static inline uint32_t fr_sig_imm(int kind, int sender, uint64_t payload)
{
    return ((uint32_t)kind << 30) | ((uint32_t)sender << FR_SIG_SEQ_BITS) |
           ((uint32_t)payload & FR_SIG_SEQ_MASK);
}

/* TX completion context: kind | destination | low 32 bits of a sequence. */
static inline uint64_t fr_sig_ctx(int kind, int dst, uint64_t seq)
{
    return ((uint64_t)kind << 60) | ((uint64_t)dst << 32) |
           (seq & 0xffffffffu);
}

/* A mailbox record. */
typedef struct fr_sig_rec {
    uint64_t value;
    uint64_t count; /* counted: puts it covers (0: apply on arrival) */
    uint32_t sig_index;
    uint32_t op;
    uint64_t batch; /* on a write's last record: how many records it holds */
} fr_sig_rec_t;

/* A queued item (put or signal) for one destination. */
typedef struct fr_sig_item {
    uint64_t src_off, dst_off, len, value;
    uint64_t thr; /* signal: puts to this destination queued before it */
    uint32_t sig_index, op;
} fr_sig_item_t;

typedef struct fr_sig_fifo {
    fr_sig_item_t *v;
    uint32_t head, tail, cap; /* cap: power of two */
} fr_sig_fifo_t;

/* Sender side, per destination. */
typedef struct fr_sig_dst {
    uint64_t put_issued; /* puts accepted */
    uint64_t put_posted; /* handed to the transport */
    uint64_t put_done;   /* gap-free prefix of locally completed puts */
    uint8_t *done;       /* [FR_SIG_TXWIN] completed, beyond put_done */
    uint64_t sig_issued; /* records posted */
    uint64_t credit;     /* records the receiver consumed */
    fr_sig_fifo_t puts, sigs;
    int active;
} fr_sig_dst_t;

/* Receiver side, per sender. */
typedef struct fr_sig_src {
    uint64_t landed;      /* gap-free prefix of landed puts (atomic) */
    uint8_t *bits;        /* [FR_SIG_RXWIN / 8] landed beyond the prefix */
    uint64_t next_apply;  /* next record to apply */
    uint64_t credit_sent; /* records acknowledged */
    uint8_t ready[FR_SIG_MBOX];
} fr_sig_src_t;

struct ferry_sig {
    ferry_comm_t comm;
    int rank, N;
    int mode, cuda;
    uint64_t heap_bytes;
    uint32_t nsig;
    long timeout_ms, spin;
    fr_err_t err;
    int failed;
    char failed_msg[FR_ERRMSG_LEN]; /* why, once failed (fr_sig_stick) */

    /* memory (host addresses; d_* for kernels on a CUDA context) */
    uint8_t *heap;
    uint64_t *signals;
    ferry_sig_ring_t *ring;
    void *d_heap, *d_signals, *d_ring;
    unsigned long long *d_reserve;
    int *errword, *d_errword;
    uint8_t *mbox, *outbox;
    size_t mbox_bytes;

    /* transport: one NIC (transport/nics.h) with the heap and mailbox
     * registered for peers' writes, the outbox as the records' source */
    fr_nics_t nics;
    fr_nic_region_t r_heap, r_mbox, r_out;
    fr_nic_groups_t groups_heap, groups_mbox;
    /* what the proxy calls: NIC 0's instance and groups */
    const fr_transport_ops_t *ops;
    fr_transport_t *tp;
    fr_group_t *g_heap, *g_mbox;
    int *gidx; /* rank -> index in the groups (-1: self) */

    /* proxy */
    pthread_t thread;
    int running, stop;
    fr_sig_dst_t *dst;
    fr_sig_src_t *src;
    int *act;
    int nact;
    int64_t inflight;  /* data writes (puts, records) posted, not completed */
    int64_t queued;    /* items waiting in the per-destination queues */
    int fence_wait;    /* fence: a record waits for the drain */
    int fence_dst;
    fr_sig_item_t fence_item;
    uint64_t settled;  /* atomic: ring requests before it are all done */
    fr_async_err_t async; /* the proxy's error, for the next call */
    uint64_t n_puts, n_sigs, n_sig_writes, n_credits, n_held; /* statistics */
};

static inline int fr_sig_fifo_empty(const fr_sig_fifo_t *f)
{
    return f->head == f->tail;
}

static inline fr_sig_item_t *fr_sig_fifo_front(fr_sig_fifo_t *f)
{
    return &f->v[f->head & (f->cap - 1)];
}

/* Destination d has queued items: the proxy posts them after this pass. */
static inline void fr_sig_activate(ferry_sig_t s, int d)
{
    if (!s->dst[d].active) {
        s->dst[d].active = 1;
        s->act[s->nact++] = d;
    }
}

/* Apply a signal to this rank's word (only the proxy writes them). */
static inline void fr_sig_apply(ferry_sig_t s, uint32_t idx, uint32_t op,
                                uint64_t value)
{
    if (op == FERRY_SIG_ADD)
        __atomic_fetch_add(&s->signals[idx], value, __ATOMIC_RELEASE);
    else
        __atomic_store_n(&s->signals[idx], value, __ATOMIC_RELEASE);
}

/* The proxy's first asynchronous error (later ones are dropped); the
 * host-side calls report it (proxy.c). */
#define fr_sig_async(s, code, peer, ...) \
    fr_async_fail(&(s)->async, FR_SUB_SIG, (code), (peer), __VA_ARGS__)

/* The proxy thread (proxy.c). */
void *fr_sig_main(void *arg);

/* A peer's write with immediate `imm` landed here (rx.c). */
void fr_sig_rx(ferry_sig_t s, uint32_t imm);

/* Stop the proxy and free everything (create.c); when the proxy cannot be
 * stopped, everything it may touch is left behind. */
void fr_sig_free(ferry_sig_t s);

#endif
