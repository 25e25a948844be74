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
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ferry_signal.h"
#include "core/config.h"
#include "core/ep.h"
#include "core/log.h"
#include "runtime/cuda_mem.h"
#include "signal/signal.h"

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

    /* memory (host addresses; d_* for kernels on a CUDA context) */
    uint8_t *heap;
    uint64_t *signals;
    ferry_sig_ring_t *ring;
    void *d_heap, *d_signals, *d_ring;
    unsigned long long *d_reserve;
    int *errword, *d_errword;
    uint8_t *mbox, *outbox;
    size_t mbox_bytes;

    /* transport */
    const fr_transport_ops_t *ops;
    fr_transport_t *tp;
    fr_mr_t *mr_heap, *mr_mbox, *mr_out;
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
    int async_status, async_peer;
    char async_msg[FR_ERRMSG_LEN];
    uint64_t n_puts, n_sigs, n_sig_writes, n_credits, n_held; /* statistics */
};

static int fr_sig_fail(ferry_sig_t s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fr_sig_fail(ferry_sig_t s, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err.msg, sizeof(s->err.msg), fmt, ap);
    va_end(ap);
    FR_LOG_DEBUG(FR_SUB_SIG, "%s", s->err.msg);
    return code;
}

static void fr_sig_async(ferry_sig_t s, int code, int peer, const char *fmt,
                         ...) __attribute__((format(printf, 4, 5)));
static void fr_sig_async(ferry_sig_t s, int code, int peer, const char *fmt,
                         ...)
{
    if (__atomic_load_n(&s->async_status, __ATOMIC_ACQUIRE) != FERRY_OK)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->async_msg, sizeof(s->async_msg), fmt, ap);
    va_end(ap);
    s->async_peer = peer;
    __atomic_store_n(&s->async_status, code, __ATOMIC_RELEASE);
    FR_LOG_WARN(FR_SUB_SIG, "%s", s->async_msg);
}

const char *ferry_sig_mode_name(int mode)
{
    switch (mode) {
    case FERRY_SIG_MODE_FENCE: return "fence";
    case FERRY_SIG_MODE_GROUPED: return "grouped";
    case FERRY_SIG_MODE_NICFENCE: return "nicfence";
    case FERRY_SIG_MODE_COUNTED: return "counted";
    default: return "?";
    }
}

int fr_sig_parse_mode(const char *s)
{
    for (int m = FERRY_SIG_MODE_FENCE; m <= FERRY_SIG_MODE_COUNTED; m++)
        if (strcmp(s, ferry_sig_mode_name(m)) == 0)
            return m;
    return -1;
}

/* ------------------------------------------------------------------ */
/* request checks (shared with the proxy, which re-checks the ring)     */
/* ------------------------------------------------------------------ */

int fr_sig_check_req(int nranks, uint64_t heap_bytes, uint32_t nsig,
                     int peer, uint64_t dst_off, uint64_t src_off,
                     uint64_t len, uint32_t sig_index, uint32_t op,
                     fr_err_t *err)
{
    if (peer < 0 || peer >= nranks)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: peer %d is not a rank in [0, %d)", peer, nranks);
    if (src_off > heap_bytes || len > heap_bytes - src_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: src_off %llu + len %llu is outside the heap of "
                      "%llu bytes",
                      (unsigned long long)src_off, (unsigned long long)len,
                      (unsigned long long)heap_bytes);
    if (dst_off > heap_bytes || len > heap_bytes - dst_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: dst_off %llu + len %llu is outside the heap of "
                      "%llu bytes",
                      (unsigned long long)dst_off, (unsigned long long)len,
                      (unsigned long long)heap_bytes);
    if (sig_index != FERRY_SIG_NONE && sig_index >= nsig)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: sig_index %u is not in [0, %u) (num_signals) or "
                      "FERRY_SIG_NONE",
                      sig_index, nsig);
    if (op != FERRY_SIG_SET && op != FERRY_SIG_ADD)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: op %u is neither FERRY_SIG_SET nor FERRY_SIG_ADD",
                      op);
    if (sig_index == FERRY_SIG_NONE && len == 0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: len 0 and sig_index FERRY_SIG_NONE: nothing to "
                      "do");
    return FERRY_OK;
}

int fr_sig_check_config(int nranks, const ferry_sig_config_t *c, fr_err_t *err)
{
    if (!c)
        return FR_ERR(err, FERRY_ERR_INVALID, "config: NULL");
    if (c->size != sizeof(*c))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: size %zu, expected %zu (start from "
                      "FERRY_SIG_CONFIG_INIT)",
                      c->size, sizeof(*c));
    if (c->magic != FERRY_SIG_CONFIG_MAGIC)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: magic 0x%08x is not FERRY_SIG_CONFIG_MAGIC "
                      "(start from FERRY_SIG_CONFIG_INIT)",
                      c->magic);
    if (c->version / 100 != FERRY_VERSION_CODE / 100)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: version %u from a header of another minor "
                      "version than this library's %u",
                      c->version, FERRY_VERSION_CODE);
    if (c->heap_bytes == 0 || c->heap_bytes > (1ull << 40))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: heap_bytes %llu is not in [1, 2^40]",
                      (unsigned long long)c->heap_bytes);
    if (c->num_signals == 0 || c->num_signals > (1u << 24))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: num_signals %u is not in [1, 2^24]",
                      c->num_signals);
    if ((int)c->mode < FERRY_SIG_MODE_DEFAULT ||
        (int)c->mode > FERRY_SIG_MODE_COUNTED)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: mode %d is not a ferry_sig_mode_t", (int)c->mode);
    if (c->device != FERRY_DEVICE_CPU && c->device != FERRY_DEVICE_CUDA)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: device %d is neither CPU nor CUDA",
                      (int)c->device);
    if (nranks > FR_SIG_MAX_RANKS)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "put-with-signal supports up to %d ranks, not %d",
                      FR_SIG_MAX_RANKS, nranks);
    return FERRY_OK;
}

/* ------------------------------------------------------------------ */
/* proxy: sender side                                                   */
/* ------------------------------------------------------------------ */

static int fifo_push(fr_sig_fifo_t *f, const fr_sig_item_t *it)
{
    if (f->tail - f->head == f->cap) {
        uint32_t cap = f->cap ? 2 * f->cap : 64;
        fr_sig_item_t *v = malloc(sizeof(*v) * cap);
        if (!v)
            return -1;
        for (uint32_t i = 0; i < f->tail - f->head; i++)
            v[i] = f->v[(f->head + i) & (f->cap - 1)];
        free(f->v);
        f->tail -= f->head;
        f->head = 0;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->tail++ & (f->cap - 1)] = *it;
    return 0;
}

static inline int fifo_empty(const fr_sig_fifo_t *f) { return f->head == f->tail; }
static inline fr_sig_item_t *fifo_front(fr_sig_fifo_t *f)
{
    return &f->v[f->head & (f->cap - 1)];
}

static void fr_sig_activate(ferry_sig_t s, int d)
{
    if (!s->dst[d].active) {
        s->dst[d].active = 1;
        s->act[s->nact++] = d;
    }
}

/* Apply a signal to this rank's word (only the proxy writes them). */
static void fr_sig_apply(ferry_sig_t s, uint32_t idx, uint32_t op,
                         uint64_t value)
{
    if (op == FERRY_SIG_ADD)
        __atomic_fetch_add(&s->signals[idx], value, __ATOMIC_RELEASE);
    else
        __atomic_store_n(&s->signals[idx], value, __ATOMIC_RELEASE);
}

static int fr_sig_post_put(ferry_sig_t s, int d, const fr_sig_item_t *it)
{
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t seq = D->put_posted;
    fr_slice_t sl = {it->src_off, it->dst_off, it->len,
                     fr_sig_imm(FR_SIGK_PUT, s->rank, seq)};
    fr_err_t err = {{0}};
    int rc = s->ops->write_imm(s->tp, s->g_heap, s->gidx[d], &sl,
                               fr_sig_ctx(FR_SIGK_PUT, d, seq), &err);
    if (rc != FERRY_OK) {
        fr_sig_async(s, rc, d, "put to rank %d: %s", d, err.msg);
        return rc;
    }
    D->put_posted++;
    s->inflight++;
    s->n_puts++;
    return FERRY_OK;
}

/* Write record #seq for destination d into its outbox slot. */
static void fr_sig_fill_record(ferry_sig_t s, int d, uint64_t seq,
                               const fr_sig_item_t *it)
{
    uint32_t slot = (uint32_t)(seq % FR_SIG_MBOX);
    fr_sig_rec_t *r = (fr_sig_rec_t *)(s->outbox +
                                       ((size_t)d * FR_SIG_MBOX + slot) *
                                           FR_SIG_REC);
    r->value = it->value;
    r->count = s->mode == FERRY_SIG_MODE_COUNTED ? it->thr : 0;
    r->sig_index = it->sig_index;
    r->op = it->op;
    r->batch = 1;
}

/* Post records #sig_issued .. #sig_issued+n-1 (filled, in consecutive
 * mailbox slots) to destination d as one write; the immediate names the
 * last, which says how many the write holds. */
static int fr_sig_post_records(ferry_sig_t s, int d, uint32_t n)
{
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t first = D->sig_issued, last = first + n - 1;
    uint32_t slot = (uint32_t)(first % FR_SIG_MBOX);
    size_t out_off = ((size_t)d * FR_SIG_MBOX + slot) * FR_SIG_REC;
    ((fr_sig_rec_t *)(s->outbox + out_off) + (n - 1))->batch = n;
    fr_slice_t sl = {out_off,
                     ((size_t)s->rank * FR_SIG_MBOX + slot) * FR_SIG_REC,
                     (uint64_t)n * FR_SIG_REC,
                     fr_sig_imm(FR_SIGK_SIG, s->rank, last)};
    fr_err_t err = {{0}};
    uint64_t ctx = fr_sig_ctx(FR_SIGK_SIG, d, last);
    int rc = s->mode == FERRY_SIG_MODE_NICFENCE
                 ? s->ops->write_fence(s->tp, s->g_mbox, s->gidx[d], &sl, ctx,
                                       &err)
                 : s->ops->write_imm(s->tp, s->g_mbox, s->gidx[d], &sl, ctx,
                                     &err);
    if (rc != FERRY_OK) {
        fr_sig_async(s, rc, d, "signal to rank %d: %s", d, err.msg);
        return rc;
    }
    D->sig_issued += n;
    s->inflight++;
    s->n_sigs += n;
    s->n_sig_writes++;
    return FERRY_OK;
}

/* Can destination d's next record go out now, behind `ahead` records
 * already taken for the same write? */
static int fr_sig_record_ready(ferry_sig_t s, int d, const fr_sig_item_t *it,
                               uint32_t ahead)
{
    fr_sig_dst_t *D = &s->dst[d];
    if (D->sig_issued + ahead - D->credit >= FR_SIG_MBOX)
        return 0; /* the receiver has not consumed enough records yet */
    switch (s->mode) {
    case FERRY_SIG_MODE_GROUPED:
        return D->put_done >= it->thr;
    case FERRY_SIG_MODE_FENCE:
        return s->inflight == 0;
    default: /* counted, nicfence: the covered puts must be posted */
        return D->put_posted >= it->thr;
    }
}

/* Post what destination d's queues allow. */
static void fr_sig_progress_dst(ferry_sig_t s, int d)
{
    fr_sig_dst_t *D = &s->dst[d];
    while (!fifo_empty(&D->puts) && D->put_posted - D->put_done < FR_SIG_TXWIN) {
        if (fr_sig_post_put(s, d, fifo_front(&D->puts)) != FERRY_OK)
            return;
        D->puts.head++;
        s->queued--;
    }
    /* every record that may go now, in as few writes as the mailbox's
     * wrap allows */
    for (;;) {
        uint32_t n = 0;
        while (n < FR_SIG_BATCH && !fifo_empty(&D->sigs) &&
               (n == 0 || (D->sig_issued + n) % FR_SIG_MBOX != 0) &&
               fr_sig_record_ready(s, d, fifo_front(&D->sigs), n)) {
            fr_sig_fill_record(s, d, D->sig_issued + n, fifo_front(&D->sigs));
            D->sigs.head++;
            s->queued--;
            n++;
        }
        if (n == 0 || fr_sig_post_records(s, d, n) != FERRY_OK)
            return;
    }
}

/* Take one ring request. 0: taken; 1: not now (fence mode must drain). */
static int fr_sig_take(ferry_sig_t s, const ferry_sig_req_t *q)
{
    fr_err_t err = {{0}};
    if (fr_sig_check_req(s->N, s->heap_bytes, s->nsig, q->peer, q->dst_off,
                         q->src_off, q->len, q->sig_index, q->op,
                         &err) != FERRY_OK) {
        fr_sig_async(s, FERRY_ERR_INVALID, s->rank, "request from a %s: %s",
                     s->cuda ? "kernel" : "thread", err.msg);
        return 0;
    }
    int d = q->peer;
    int has_put = q->len > 0, has_sig = q->sig_index != FERRY_SIG_NONE;
    if (d == s->rank) {
        /* to itself: the proxy copies, then applies; order is kept */
        if (has_put) {
            memmove(s->heap + q->dst_off, s->heap + q->src_off, q->len);
            __atomic_store_n(&s->src[d].landed, s->src[d].landed + 1,
                             __ATOMIC_RELEASE);
        }
        if (has_sig) {
            __atomic_thread_fence(__ATOMIC_RELEASE);
            fr_sig_apply(s, q->sig_index, q->op, q->value);
        }
        return 0;
    }
    fr_sig_dst_t *D = &s->dst[d];
    fr_sig_item_t it = {q->src_off, q->dst_off, q->len, q->value, 0,
                        q->sig_index, q->op};
    if (s->mode == FERRY_SIG_MODE_FENCE) {
        /* the naive proxy: in ring order, a record waits for the drain and
         * nothing else is taken meanwhile */
        if (has_put && D->put_posted - D->put_done >= FR_SIG_TXWIN)
            return 1;
        if (has_put) {
            D->put_issued++;
            if (fr_sig_post_put(s, d, &it) != FERRY_OK)
                return 0;
        }
        if (has_sig) {
            it.thr = D->put_issued;
            s->fence_wait = 1;
            s->fence_dst = d;
            s->fence_item = it;
        }
        return 0;
    }
    if (has_put) {
        D->put_issued++;
        if (fifo_push(&D->puts, &it) != 0)
            goto nomem;
        s->queued++;
    }
    if (has_sig) {
        it.thr = D->put_issued;
        if (fifo_push(&D->sigs, &it) != 0)
            goto nomem;
        s->queued++;
    }
    /* posted after this pass over the ring: a destination's puts, then
     * its records in as few writes as they allow */
    fr_sig_activate(s, d);
    return 0;
nomem:
    fr_sig_async(s, FERRY_ERR_NOMEM, s->rank,
                 "proxy: out of memory queueing requests for rank %d", d);
    return 0;
}

/* ------------------------------------------------------------------ */
/* proxy: receiver side                                                 */
/* ------------------------------------------------------------------ */

static void fr_sig_send_credit(ferry_sig_t s, int from)
{
    fr_sig_src_t *S = &s->src[from];
    fr_slice_t sl = {0, 0, 0, fr_sig_imm(FR_SIGK_CREDIT, s->rank, S->next_apply)};
    fr_err_t err = {{0}};
    int rc = s->ops->write_imm(s->tp, s->g_mbox, s->gidx[from], &sl,
                               fr_sig_ctx(FR_SIGK_CREDIT, from, 0), &err);
    if (rc != FERRY_OK) {
        fr_sig_async(s, rc, from, "credit to rank %d: %s", from, err.msg);
        return;
    }
    S->credit_sent = S->next_apply;
    s->n_credits++;
}

/* Apply sender `from`'s records in order, each once the puts it covers
 * have landed. */
static void fr_sig_apply_ready(ferry_sig_t s, int from)
{
    fr_sig_src_t *S = &s->src[from];
    for (;;) {
        uint32_t slot = (uint32_t)(S->next_apply % FR_SIG_MBOX);
        if (!S->ready[slot])
            break;
        const fr_sig_rec_t *r =
            (const fr_sig_rec_t *)(s->mbox +
                                   ((size_t)from * FR_SIG_MBOX + slot) *
                                       FR_SIG_REC);
        if (r->count > S->landed) {
            s->n_held++;
            break;
        }
        if (r->sig_index >= s->nsig || r->op > FERRY_SIG_ADD) {
            fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                         "rank %d sent a signal record for word %u, op %u "
                         "(%u words here)",
                         from, r->sig_index, r->op, s->nsig);
            return;
        }
        fr_sig_apply(s, r->sig_index, r->op, r->value);
        S->ready[slot] = 0;
        S->next_apply++;
    }
    if (S->next_apply - S->credit_sent >= FR_SIG_MBOX / 4)
        fr_sig_send_credit(s, from);
}

static void fr_sig_rx(ferry_sig_t s, uint32_t imm)
{
    int kind = (int)(imm >> 30);
    int from = (int)((imm >> FR_SIG_SEQ_BITS) & 0xfff);
    uint32_t low = imm & FR_SIG_SEQ_MASK;
    if (from >= s->N || from == s->rank || kind > FR_SIGK_CREDIT) {
        fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                     "unexpected immediate 0x%08x (kind %d, sender %d)", imm,
                     kind, from);
        return;
    }
    if (kind == FR_SIGK_PUT) {
        fr_sig_src_t *S = &s->src[from];
        uint64_t seq = S->landed + ((low - (uint32_t)S->landed) & FR_SIG_SEQ_MASK);
        if (seq - S->landed >= FR_SIG_RXWIN) {
            fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                         "rank %d's put #%llu arrived more than %d ahead of "
                         "#%llu",
                         from, (unsigned long long)seq, FR_SIG_RXWIN,
                         (unsigned long long)S->landed);
            return;
        }
        S->bits[(seq % FR_SIG_RXWIN) / 8] |= (uint8_t)(1u << (seq % 8));
        uint64_t l = S->landed;
        while (S->bits[(l % FR_SIG_RXWIN) / 8] & (1u << (l % 8))) {
            S->bits[(l % FR_SIG_RXWIN) / 8] &= (uint8_t)~(1u << (l % 8));
            l++;
        }
        if (l != S->landed) {
            __atomic_store_n(&S->landed, l, __ATOMIC_RELEASE);
            fr_sig_apply_ready(s, from);
        }
    } else if (kind == FR_SIGK_SIG) {
        fr_sig_src_t *S = &s->src[from];
        uint64_t seq = S->next_apply +
                       ((low - (uint32_t)S->next_apply) & FR_SIG_SEQ_MASK);
        /* the write holds records #seq-n+1 .. #seq; its data is here */
        uint64_t n = 0;
        if (seq - S->next_apply < FR_SIG_MBOX)
            n = ((const fr_sig_rec_t *)(s->mbox +
                                        ((size_t)from * FR_SIG_MBOX +
                                         seq % FR_SIG_MBOX) * FR_SIG_REC))
                    ->batch;
        int bad = n < 1 || n > FR_SIG_BATCH || seq - S->next_apply < n - 1 ||
                  (seq - n + 1) % FR_SIG_MBOX > seq % FR_SIG_MBOX;
        for (uint64_t q = seq - n + 1; !bad && q <= seq; q++)
            bad = S->ready[q % FR_SIG_MBOX];
        if (bad) {
            fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                         "rank %d sent signal records #%llu (%llu in the "
                         "write) while #%llu is the next to apply (mailbox "
                         "of %d)",
                         from, (unsigned long long)seq, (unsigned long long)n,
                         (unsigned long long)S->next_apply, FR_SIG_MBOX);
            return;
        }
        for (uint64_t q = seq - n + 1; q <= seq; q++)
            S->ready[q % FR_SIG_MBOX] = 1;
        fr_sig_apply_ready(s, from);
    } else {
        fr_sig_dst_t *D = &s->dst[from];
        uint64_t c = D->credit + ((low - (uint32_t)D->credit) & FR_SIG_SEQ_MASK);
        if (c > D->sig_issued) {
            fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                         "rank %d acknowledged %llu signal records, %llu were "
                         "sent",
                         from, (unsigned long long)c,
                         (unsigned long long)D->sig_issued);
            return;
        }
        D->credit = c;
        if (!fifo_empty(&D->sigs))
            fr_sig_activate(s, from);
    }
}

static void fr_sig_tx_done(ferry_sig_t s, uint64_t ctx)
{
    int kind = (int)(ctx >> 60);
    int d = (int)((ctx >> 32) & 0xfffffff);
    if (kind == FR_SIGK_CREDIT || d >= s->N)
        return;
    s->inflight--;
    if (kind != FR_SIGK_PUT)
        return;
    fr_sig_dst_t *D = &s->dst[d];
    uint64_t seq = D->put_done + (((uint32_t)ctx - (uint32_t)D->put_done) &
                                  0xffffffffu);
    if (seq - D->put_done >= FR_SIG_TXWIN)
        return; /* cannot happen: at most FR_SIG_TXWIN are posted */
    D->done[seq % FR_SIG_TXWIN] = 1;
    while (D->done[D->put_done % FR_SIG_TXWIN]) {
        D->done[D->put_done % FR_SIG_TXWIN] = 0;
        D->put_done++;
    }
    if (!fifo_empty(&D->puts) || !fifo_empty(&D->sigs))
        fr_sig_activate(s, d);
}

/* ------------------------------------------------------------------ */
/* proxy thread                                                         */
/* ------------------------------------------------------------------ */

static void *fr_sig_main(void *arg)
{
    ferry_sig_t s = arg;
    fr_log_set_rank(s->rank);
    long idle_us = fr_proxy_idle_us(s->cuda);
    ferry_sig_ring_t *rg = s->ring;
    fr_cqe_t cqe[64];
    uint64_t idle = 0;
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        int work = 0;
        /* 1. requests */
        for (int n = 0; n < 256 && !s->fence_wait; n++) {
            ferry_sig_req_t *q = &rg->req[rg->head & (FR_SIG_RING - 1)];
            if (__atomic_load_n(&q->seq, __ATOMIC_ACQUIRE) != rg->head + 1)
                break;
            ferry_sig_req_t c = *q;
            if (fr_sig_take(s, &c) != 0)
                break;
            __atomic_store_n(&rg->head, rg->head + 1, __ATOMIC_RELEASE);
            work = 1;
        }
        /* 2. what waited */
        if (s->fence_wait && s->inflight == 0 &&
            fr_sig_record_ready(s, s->fence_dst, &s->fence_item, 0)) {
            s->fence_wait = 0;
            fr_sig_fill_record(s, s->fence_dst,
                               s->dst[s->fence_dst].sig_issued, &s->fence_item);
            fr_sig_post_records(s, s->fence_dst, 1);
            work = 1;
        }
        for (int i = 0; i < s->nact;) {
            int d = s->act[i];
            fr_sig_progress_dst(s, d);
            fr_sig_dst_t *D = &s->dst[d];
            if (fifo_empty(&D->puts) && fifo_empty(&D->sigs)) {
                D->active = 0;
                s->act[i] = s->act[--s->nact];
            } else {
                i++;
            }
        }
        /* 3. completions */
        fr_err_t err = {{0}};
        int n = s->ops->poll(s->tp, cqe, 64, &err);
        if (n < 0) {
            fr_sig_async(s, n, -1, "%s", err.msg);
            n = 0;
        }
        for (int i = 0; i < n; i++) {
            if (cqe[i].kind == FR_CQE_RX) {
                fr_sig_rx(s, cqe[i].imm);
            } else if (cqe[i].kind == FR_CQE_TX) {
                fr_sig_tx_done(s, cqe[i].ctx);
            } else if (cqe[i].kind == FR_CQE_RXERR) {
                fr_sig_async(s, cqe[i].status ? cqe[i].status : FERRY_ERR_FABRIC,
                             -1, "%.480s", err.msg[0] ? err.msg : "fabric error");
            } else {
                fr_sig_tx_done(s, cqe[i].ctx);
                fr_sig_async(s, cqe[i].status ? cqe[i].status : FERRY_ERR_FABRIC,
                             cqe[i].peer, "write to rank %d failed: %.400s",
                             cqe[i].peer, err.msg[0] ? err.msg : "fabric error");
            }
        }
        /* 4. everything taken so far is done? */
        if (s->inflight == 0 && s->queued == 0 && !s->fence_wait)
            __atomic_store_n(&s->settled, rg->head, __ATOMIC_RELEASE);
        if (work || n > 0) {
            idle = 0;
            continue;
        }
        fr_proxy_idle(&idle, idle_us);
    }
    return NULL;
}

/* ------------------------------------------------------------------ */
/* create / destroy                                                     */
/* ------------------------------------------------------------------ */

/* What every rank tells every other at create. */
typedef struct fr_sig_hello {
    int32_t status;      /* this rank's config check */
    int32_t mode;
    uint64_t heap_bytes;
    uint32_t nsig;
    int32_t fence_ok;
    char why[192];
} fr_sig_hello_t;

typedef struct fr_sig_keys {
    fr_mr_desc_t heap, mbox;
} fr_sig_keys_t;

static void fr_sig_free(ferry_sig_t s)
{
    if (s->running) {
        if (fr_proxy_join(s->thread, &s->stop, FR_PROXY_JOIN_MS,
                          "put-with-signal destroy") != 0)
            return; /* the thread may still touch all of it */
        s->running = 0;
    }
    if (s->tp) {
        if (s->g_heap)
            s->ops->group_destroy(s->tp, s->g_heap);
        if (s->g_mbox)
            s->ops->group_destroy(s->tp, s->g_mbox);
        if (s->mr_heap)
            s->ops->dereg(s->tp, s->mr_heap);
        if (s->mr_mbox)
            s->ops->dereg(s->tp, s->mr_mbox);
        if (s->mr_out)
            s->ops->dereg(s->tp, s->mr_out);
        s->ops->close(s->tp);
    }
    if (s->cuda) {
        fr_cuda_host_free(s->heap);
        fr_cuda_host_free(s->signals);
        fr_cuda_host_free(s->ring);
        fr_cuda_host_free(s->errword);
        fr_cuda_dev_free(s->d_reserve);
    } else {
        free(s->heap);
        free(s->signals);
        free(s->ring);
    }
    free(s->mbox);
    free(s->outbox);
    if (s->dst)
        for (int d = 0; d < s->N; d++) {
            free(s->dst[d].done);
            free(s->dst[d].puts.v);
            free(s->dst[d].sigs.v);
        }
    if (s->src)
        for (int r = 0; r < s->N; r++)
            free(s->src[r].bits);
    free(s->dst);
    free(s->src);
    free(s->act);
    free(s->gidx);
    free(s);
}

static void *fr_sig_pages(size_t bytes)
{
    size_t n = (bytes + 4095) & ~(size_t)4095;
    void *p = aligned_alloc(4096, n);
    if (p)
        memset(p, 0, n);
    return p;
}

static int fr_sig_alloc(ferry_sig_t s, fr_err_t *err)
{
    size_t ring_bytes = sizeof(ferry_sig_ring_t) +
                        sizeof(ferry_sig_req_t) * (FR_SIG_RING - 1);
    size_t sig_bytes = sizeof(uint64_t) * s->nsig;
    if (s->cuda) {
        void *dv;
        int rc;
        if ((rc = fr_cuda_host_alloc(s->heap_bytes, (void **)&s->heap,
                                     &s->d_heap, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(sig_bytes, (void **)&s->signals,
                                     &s->d_signals, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(ring_bytes, (void **)&s->ring,
                                     &s->d_ring, err)) != FERRY_OK ||
            (rc = fr_cuda_host_alloc(2 * sizeof(int), (void **)&s->errword, &dv,
                                     err)) != FERRY_OK ||
            (rc = fr_cuda_dev_word(&s->d_reserve, err)) != FERRY_OK)
            return rc;
        s->d_errword = dv;
    } else {
        s->heap = fr_sig_pages(s->heap_bytes);
        s->signals = fr_sig_pages(sig_bytes);
        s->ring = fr_sig_pages(ring_bytes);
        if (!s->heap || !s->signals || !s->ring)
            return FR_ERR(err, FERRY_ERR_NOMEM,
                          "out of memory for a heap of %llu bytes",
                          (unsigned long long)s->heap_bytes);
    }
    s->mbox_bytes = (size_t)s->N * FR_SIG_MBOX * FR_SIG_REC;
    s->mbox = fr_sig_pages(s->mbox_bytes);
    s->outbox = fr_sig_pages(s->mbox_bytes);
    s->dst = calloc((size_t)s->N, sizeof(*s->dst));
    s->src = calloc((size_t)s->N, sizeof(*s->src));
    s->act = calloc((size_t)s->N, sizeof(*s->act));
    s->gidx = calloc((size_t)s->N, sizeof(*s->gidx));
    if (!s->mbox || !s->outbox || !s->dst || !s->src || !s->act || !s->gidx)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    for (int r = 0; r < s->N; r++) {
        if (r == s->rank)
            continue;
        s->dst[r].done = calloc(FR_SIG_TXWIN, 1);
        s->src[r].bits = calloc(FR_SIG_RXWIN / 8, 1);
        if (!s->dst[r].done || !s->src[r].bits)
            return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory");
    }
    return FERRY_OK;
}

int ferry_sig_create(ferry_comm_t comm, const ferry_sig_config_t *cfg,
                     ferry_sig_t *out)
{
    if (!out)
        return FERRY_ERR_INVALID;
    *out = NULL;
    if (!comm)
        return FERRY_ERR_INVALID;
    fr_err_t *cerr = &comm->err;
    int N = comm->size;
    fr_sig_hello_t mine;
    memset(&mine, 0, sizeof(mine));
    fr_err_t e = {{0}};
    mine.status = fr_sig_check_config(N, cfg, &e);
    if (mine.status == FERRY_OK) {
        int mode = cfg->mode;
        if (mode == FERRY_SIG_MODE_DEFAULT) {
            mode = fr_sig_parse_mode(fr_cfg_str(FR_CFG_SIGNAL_MODE));
            if (mode < 0) {
                mine.status = FR_ERR(&e, FERRY_ERR_INVALID,
                                     "FERRY_SIGNAL_MODE=%s is not one of "
                                     "fence, grouped, nicfence, counted",
                                     fr_cfg_str(FR_CFG_SIGNAL_MODE));
                mode = 0;
            }
        }
        mine.mode = mode;
        mine.heap_bytes = cfg->heap_bytes;
        mine.nsig = cfg->num_signals;
        mine.fence_ok = 1;
        if (mode == FERRY_SIG_MODE_NICFENCE && mine.status == FERRY_OK) {
            mine.fence_ok = fr_transport_find("fabric")->fence_probe(
                mine.why, sizeof(mine.why));
            if (!mine.fence_ok)
                mine.status = FR_ERR(&e, FERRY_ERR_UNSUPPORTED,
                                     "mode nicfence: %s; use counted or "
                                     "grouped",
                                     mine.why);
        }
        if (mine.status == FERRY_OK && cfg->device == FERRY_DEVICE_CUDA) {
            char why[160];
            if (!ferry_cuda_available(why, sizeof(why)))
                mine.status = FR_ERR(&e, FERRY_ERR_UNSUPPORTED,
                                     "device = CUDA: %s", why);
        }
    }
    if (mine.status != FERRY_OK)
        snprintf(mine.why, sizeof(mine.why), "%.190s", e.msg);
    /* Everyone learns everyone's verdict before anyone opens a thing. */
    fr_sig_hello_t *all = calloc((size_t)N, sizeof(*all));
    if (!all)
        return FR_ERR(cerr, FERRY_ERR_NOMEM, "sig create: out of memory");
    int rc = fr_boot_allgather(comm->boot, &mine, all, sizeof(mine), cerr);
    if (rc != FERRY_OK) {
        free(all);
        return rc;
    }
    for (int r = 0; r < N && rc == FERRY_OK; r++) {
        if (all[r].status != FERRY_OK) {
            all[r].why[sizeof(all[r].why) - 1] = '\0';
            rc = FR_ERR(cerr, all[r].status, "sig create: rank %d: %s", r,
                        all[r].why);
        } else if (all[r].mode != all[0].mode ||
                   all[r].heap_bytes != all[0].heap_bytes ||
                   all[r].nsig != all[0].nsig) {
            rc = FR_ERR(cerr, FERRY_ERR_INVALID,
                        "sig create: rank %d asked for mode %s, heap_bytes "
                        "%llu, num_signals %u but rank 0 for %s, %llu, %u",
                        r, ferry_sig_mode_name(all[r].mode),
                        (unsigned long long)all[r].heap_bytes, all[r].nsig,
                        ferry_sig_mode_name(all[0].mode),
                        (unsigned long long)all[0].heap_bytes, all[0].nsig);
        }
    }
    free(all);
    if (rc != FERRY_OK)
        return rc;

    ferry_sig_t s = calloc(1, sizeof(*s));
    if (!s)
        return FR_ERR(cerr, FERRY_ERR_NOMEM, "sig create: out of memory");
    s->comm = comm;
    s->rank = comm->rank;
    s->N = N;
    s->mode = mine.mode;
    s->cuda = cfg->device == FERRY_DEVICE_CUDA;
    s->heap_bytes = cfg->heap_bytes;
    s->nsig = cfg->num_signals;
    s->timeout_ms = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    s->spin = fr_cfg_int(FR_CFG_SPIN);
    fr_err_t err = {{0}};
    fr_sig_keys_t keys, *allkeys = NULL;
    int *peers = NULL;
    fr_mr_desc_t *rheap = NULL, *rmbox = NULL;
    /* A local failure before the exchanges still joins them (with a
     * status), so no rank waits for one that gave up. */
    int lrc = fr_sig_alloc(s, &err);
    int st[2] = {lrc, 0}, *sts = calloc((size_t)N, sizeof(st));
    if (!sts) {
        fr_sig_free(s);
        return FR_ERR(cerr, FERRY_ERR_NOMEM, "sig create: out of memory");
    }
    rc = fr_boot_allgather(comm->boot, st, sts, sizeof(st), &err);
    for (int r = 0; r < N && rc == FERRY_OK; r++)
        if (sts[r * 2] != FERRY_OK)
            rc = r == s->rank ? sts[r * 2]
                              : FR_ERR(&err, FERRY_ERR_PEER,
                                       "rank %d could not allocate its "
                                       "buffers", r);
    free(sts);
    if (rc != FERRY_OK)
        goto fail;
    /* fence and grouped wait for local completions as ordering points:
     * those must mean "visible at the target" (shm completes a small
     * write before the target has it) */
    rc = fr_transport_open("fabric", comm->boot, 0,
                           s->mode == FERRY_SIG_MODE_NICFENCE
                               ? FR_TP_OPEN_FENCE
                               : s->mode == FERRY_SIG_MODE_COUNTED
                                     ? 0
                                     : FR_TP_OPEN_DELIVERY,
                           &s->ops, &s->tp, &err);
    if (rc != FERRY_OK)
        goto fail;
    memset(&keys, 0, sizeof(keys));
    FR_CHECK_GOTO(s->ops->reg(s->tp, s->heap, s->heap_bytes, 1, &s->mr_heap,
                              &keys.heap, &err), rc, fail);
    FR_CHECK_GOTO(s->ops->reg(s->tp, s->mbox, s->mbox_bytes, 1, &s->mr_mbox,
                              &keys.mbox, &err), rc, fail);
    FR_CHECK_GOTO(s->ops->reg(s->tp, s->outbox, s->mbox_bytes, 0, &s->mr_out,
                              NULL, &err), rc, fail);
    allkeys = calloc((size_t)N, sizeof(keys));
    peers = calloc((size_t)N, sizeof(int));
    rheap = calloc((size_t)N, sizeof(*rheap));
    rmbox = calloc((size_t)N, sizeof(*rmbox));
    if (!allkeys || !peers || !rheap || !rmbox) {
        rc = FR_ERR(&err, FERRY_ERR_NOMEM, "out of memory");
        goto fail;
    }
    FR_CHECK_GOTO(fr_boot_allgather(comm->boot, &keys, allkeys, sizeof(keys),
                                    &err), rc, fail);
    int np = 0;
    for (int r = 0; r < N; r++) {
        if (r == s->rank) {
            s->gidx[r] = -1;
            continue;
        }
        s->gidx[r] = np;
        peers[np] = r;
        rheap[np] = allkeys[r].heap;
        rmbox[np] = allkeys[r].mbox;
        np++;
    }
    FR_CHECK_GOTO(s->ops->group_create(s->tp, peers, np, s->mr_heap, rheap,
                                       &s->g_heap, &err), rc, fail);
    FR_CHECK_GOTO(s->ops->group_create(s->tp, peers, np, s->mr_out, rmbox,
                                       &s->g_mbox, &err), rc, fail);
    {
        int e2 = pthread_create(&s->thread, NULL, fr_sig_main, s);
        if (e2 != 0) {
            rc = FR_ERR(&err, FERRY_ERR_SYSTEM,
                        "starting the proxy thread: %s", strerror(e2));
            goto fail;
        }
        s->running = 1;
    }
    /* Nobody writes before every rank's proxy is up. */
    FR_CHECK_GOTO(fr_boot_barrier(comm->boot, &err), rc, fail);
    free(allkeys);
    free(peers);
    free(rheap);
    free(rmbox);
    FR_LOG_INFO(FR_SUB_SIG,
                "put-with-signal: %d ranks, mode %s, heap %llu bytes, %u "
                "signals, provider %s, %s",
                N, ferry_sig_mode_name(s->mode),
                (unsigned long long)s->heap_bytes, s->nsig,
                s->ops->provider(s->tp), s->cuda ? "CUDA" : "CPU");
    *out = s;
    return FERRY_OK;
fail:
    snprintf(cerr->msg, sizeof(cerr->msg), "sig create: %.490s", err.msg);
    free(allkeys);
    free(peers);
    free(rheap);
    free(rmbox);
    fr_sig_free(s);
    return rc;
}

/* ------------------------------------------------------------------ */
/* calls                                                                */
/* ------------------------------------------------------------------ */

/* The proxy's error, or a device-side one, or a dead rank. */
static int fr_sig_health(ferry_sig_t s, const char *what)
{
    int st = __atomic_load_n(&s->async_status, __ATOMIC_ACQUIRE);
    if (st != FERRY_OK) {
        int dead = fr_boot_blame(s->comm->boot, st);
        if (dead >= 0)
            return s->failed = fr_sig_fail(s, FERRY_ERR_PEER,
                                           "%s: rank %d died (%.300s)", what,
                                           dead, s->async_msg);
        return s->failed = fr_sig_fail(s, st, "%s: %s", what, s->async_msg);
    }
    if (s->cuda) {
        int dv = __atomic_load_n((volatile int *)s->errword, __ATOMIC_ACQUIRE);
        if (dv != 0) {
            static const char *const whats[] = {
                "?",
                "ferry_sig_dev_put: peer outside 0..nranks-1",
                "ferry_sig_dev_put: src_off + len beyond the heap",
                "ferry_sig_dev_put: dst_off + len beyond the heap",
                "ferry_sig_dev_put: sig_index >= num_signals",
                "ferry_sig_dev_put: op is neither SET nor ADD",
                "ferry_sig_dev_wait: sig_index >= num_signals",
                "ferry_sig_dev_put: the ring stayed full for 10 s"};
            /* what is stored after the status: give it a moment */
            int w = 0;
            for (int i = 0; i < 1000 && !w; i++)
                w = __atomic_load_n((volatile int *)s->errword + 1,
                                    __ATOMIC_ACQUIRE);
            return s->failed = fr_sig_fail(
                       s, dv, "%s: a kernel's request was refused: %s (%s)",
                       what,
                       w > 0 && w < (int)(sizeof(whats) / sizeof(whats[0]))
                           ? whats[w]
                           : whats[0],
                       ferry_strerror(dv));
        }
    }
    int dead = fr_boot_dead_rank(s->comm->boot);
    if (dead >= 0)
        return fr_sig_fail(s, FERRY_ERR_PEER, "%s: rank %d died", what, dead);
    return FERRY_OK;
}

int ferry_sig_put(ferry_sig_t s, int peer, uint64_t dst_off, uint64_t src_off,
                  uint64_t len, uint32_t sig_index, ferry_sig_op_t op,
                  uint64_t value)
{
    if (!s)
        return FERRY_ERR_INVALID;
    if (s->cuda)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "put: this context was created with device = "
                           "CUDA; kernels queue its puts "
                           "(ferry_signal_device.cuh)");
    int rc = fr_sig_check_req(s->N, s->heap_bytes, s->nsig, peer, dst_off,
                              src_off, len, sig_index, (uint32_t)op, &s->err);
    if (rc != FERRY_OK)
        return rc;
    if (s->failed)
        return fr_sig_fail(s, s->failed, "put: the context failed before: "
                                         "%s", s->async_msg);
    ferry_sig_ring_t *rg = s->ring;
    uint64_t i = __atomic_fetch_add(&rg->tail, 1, __ATOMIC_ACQ_REL);
    uint64_t iter = 0, deadline = 0;
    while (i - __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE) >= FR_SIG_RING) {
        if (!deadline)
            deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
        fr_backoff(&iter, s->spin);
        if ((rc = fr_sig_health(s, "put")) != FERRY_OK)
            return rc;
        if (fr_now_ns() > deadline)
            return s->failed = fr_sig_fail(
                       s, FERRY_ERR_TIMEOUT,
                       "put: the proxy took no request for %ld ms (ring of "
                       "%d full)",
                       s->timeout_ms, FR_SIG_RING);
    }
    ferry_sig_req_t *q = &rg->req[i & (FR_SIG_RING - 1)];
    q->peer = peer;
    q->sig_index = sig_index;
    q->dst_off = dst_off;
    q->src_off = src_off;
    q->len = len;
    q->value = value;
    q->op = (uint32_t)op;
    __atomic_store_n(&q->seq, i + 1, __ATOMIC_RELEASE);
    return FERRY_OK;
}

int ferry_sig_quiet(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    uint64_t target;
    int rc;
    if (s->cuda) {
        fr_err_t e = {{0}};
        if ((rc = fr_cuda_dev_read(s->d_reserve, &target, &e)) != FERRY_OK)
            return fr_sig_fail(s, rc, "quiet: %s", e.msg);
    } else {
        target = __atomic_load_n(&s->ring->tail, __ATOMIC_ACQUIRE);
    }
    uint64_t iter = 0;
    uint64_t deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
    while (__atomic_load_n(&s->settled, __ATOMIC_ACQUIRE) < target) {
        if ((rc = fr_sig_health(s, "quiet")) != FERRY_OK)
            return rc;
        fr_backoff(&iter, s->spin);
        if (fr_now_ns() > deadline)
            return s->failed = fr_sig_fail(
                       s, FERRY_ERR_TIMEOUT,
                       "quiet: %llu of %llu requests done after %ld ms "
                       "(%lld writes in flight)",
                       (unsigned long long)__atomic_load_n(&s->settled,
                                                           __ATOMIC_ACQUIRE),
                       (unsigned long long)target, s->timeout_ms,
                       (long long)__atomic_load_n(&s->inflight,
                                                  __ATOMIC_RELAXED));
    }
    return fr_sig_health(s, "quiet");
}

int ferry_sig_wait(ferry_sig_t s, uint32_t idx, ferry_sig_cmp_t cmp,
                   uint64_t value, uint64_t *seen)
{
    if (!s)
        return FERRY_ERR_INVALID;
    if (idx >= s->nsig)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "wait: sig_index %u is not in [0, %u)", idx,
                           s->nsig);
    if (cmp != FERRY_SIG_CMP_GE && cmp != FERRY_SIG_CMP_EQ)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "wait: cmp %d is neither GE nor EQ", (int)cmp);
    uint64_t iter = 0, v = 0, deadline = 0;
    int rc;
    for (;;) {
        v = __atomic_load_n(&s->signals[idx], __ATOMIC_ACQUIRE);
        if (cmp == FERRY_SIG_CMP_GE ? v >= value : v == value)
            break;
        if ((iter & 63) == 0) {
            if (!deadline)
                deadline = fr_now_ns() + (uint64_t)s->timeout_ms * 1000000ull;
            if ((rc = fr_sig_health(s, "wait")) != FERRY_OK) {
                if (seen)
                    *seen = v;
                return rc;
            }
            if (fr_now_ns() > deadline) {
                if (seen)
                    *seen = v;
                return fr_sig_fail(s, FERRY_ERR_TIMEOUT,
                                   "wait: signal %u is %llu after %ld ms, "
                                   "waited for %s %llu",
                                   idx, (unsigned long long)v, s->timeout_ms,
                                   cmp == FERRY_SIG_CMP_GE ? ">=" : "==",
                                   (unsigned long long)value);
            }
        }
        fr_backoff(&iter, s->spin);
    }
    if (seen)
        *seen = v;
    return FERRY_OK;
}

int ferry_sig_check(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    return fr_sig_health(s, "check");
}

uint64_t ferry_sig_read(ferry_sig_t s, uint32_t idx)
{
    if (!s || idx >= s->nsig)
        return 0;
    return __atomic_load_n(&s->signals[idx], __ATOMIC_ACQUIRE);
}

int ferry_sig_landed(ferry_sig_t s, int peer, uint64_t *count)
{
    if (!s || !count)
        return FERRY_ERR_INVALID;
    if (peer < 0 || peer >= s->N)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "landed: peer %d is not a rank in [0, %d)", peer,
                           s->N);
    *count = __atomic_load_n(&s->src[peer].landed, __ATOMIC_ACQUIRE);
    return FERRY_OK;
}

ferry_sig_mode_t ferry_sig_mode(ferry_sig_t s)
{
    return s ? (ferry_sig_mode_t)s->mode : FERRY_SIG_MODE_DEFAULT;
}

void *ferry_sig_heap(ferry_sig_t s) { return s ? s->heap : NULL; }

const char *ferry_sig_last_error(ferry_sig_t s)
{
    return s ? s->err.msg : "sig: NULL handle";
}

int ferry_sig_device(ferry_sig_t s, ferry_sig_device_t *out)
{
    if (!s || !out)
        return FERRY_ERR_INVALID;
    if (!s->cuda)
        return fr_sig_fail(s, FERRY_ERR_INVALID,
                           "device: this context was created with device = "
                           "CPU");
    memset(out, 0, sizeof(*out));
    out->ring = s->d_ring;
    out->reserve = s->d_reserve;
    out->heap = s->d_heap;
    out->signals = s->d_signals;
    out->error = s->d_errword;
    out->rank = s->rank;
    out->nranks = s->N;
    out->ring_slots = FR_SIG_RING;
    out->num_signals = s->nsig;
    out->heap_bytes = s->heap_bytes;
    return FERRY_OK;
}

int ferry_sig_destroy(ferry_sig_t s)
{
    if (!s)
        return FERRY_ERR_INVALID;
    int rc = FERRY_OK;
    if (!s->failed)
        rc = ferry_sig_quiet(s);
    /* Nobody tears down memory a peer may still write into (a peer's
     * credits and records for ours included). */
    if (rc == FERRY_OK && fr_boot_dead_rank(s->comm->boot) < 0) {
        fr_err_t err = {{0}};
        int b = fr_boot_barrier(s->comm->boot, &err);
        if (b != FERRY_OK)
            rc = b;
    }
    FR_LOG_INFO(FR_SUB_SIG,
                "put-with-signal: %llu puts, %llu signal records in %llu "
                "writes, %llu credits sent; times a record waited for its "
                "puts: %llu",
                (unsigned long long)s->n_puts, (unsigned long long)s->n_sigs,
                (unsigned long long)s->n_sig_writes,
                (unsigned long long)s->n_credits,
                (unsigned long long)s->n_held);
    fr_sig_free(s);
    return rc;
}
