/*
 * Put-with-signal: the proxy thread, receiver side. A peer's put moves its
 * window of landed puts (the gap-free prefix the counted mode waits for);
 * a mailbox write marks its records ready, and they are applied in
 * sequence order, each once the puts it covers have landed; consumed
 * records are acknowledged with credits, and a peer's credit lets this
 * rank reuse its slots in that peer's mailbox.
 */
#include <stddef.h>
#include <stdint.h>

#include "signal/sig_int.h"

static void fr_sig_send_credit(ferry_sig_t s, int from)
{
    fr_sig_src_t *S = &s->src[from];
    fr_slice_t sl = {0, 0, 0,
                     fr_sig_imm(FR_SIGK_CREDIT, s->rank, S->next_apply)};
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
        /* the sender can still write its mailbox: each field is read once
         * (volatile) and used as checked */
        const volatile fr_sig_rec_t *r =
            (const volatile fr_sig_rec_t *)(s->mbox +
                                            ((size_t)from * FR_SIG_MBOX + slot) *
                                                FR_SIG_REC);
        uint64_t count = r->count;
        if (count > S->landed) {
            s->n_held++;
            break;
        }
        uint32_t idx = r->sig_index, op = r->op;
        uint64_t value = r->value;
        if (idx >= s->nsig || op > FERRY_SIG_ADD) {
            fr_sig_async(s, FERRY_ERR_PROTOCOL, from,
                         "rank %d sent a signal record for word %u, op %u "
                         "(%u words here)",
                         from, idx, op, s->nsig);
            return;
        }
        fr_sig_apply(s, idx, op, value);
        S->ready[slot] = 0;
        S->next_apply++;
    }
    if (S->next_apply - S->credit_sent >= FR_SIG_MBOX / 4)
        fr_sig_send_credit(s, from);
}

/* A put from `from` landed (low: its sequence number mod 2^18): mark it
 * and move the gap-free prefix. */
static void fr_sig_rx_put(ferry_sig_t s, int from, uint32_t low)
{
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
}

/* A mailbox write from `from` landed (low: its last record's sequence
 * number mod 2^18): check it, mark its records ready. */
static void fr_sig_rx_records(ferry_sig_t s, int from, uint32_t low)
{
    fr_sig_src_t *S = &s->src[from];
    uint64_t seq = S->next_apply +
                   ((low - (uint32_t)S->next_apply) & FR_SIG_SEQ_MASK);
    /* the write holds records #seq-n+1 .. #seq; its data is here */
    uint64_t n = 0;
    if (seq - S->next_apply < FR_SIG_MBOX) /* read once (volatile) */
        n = ((const volatile fr_sig_rec_t *)(s->mbox +
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
}

/* A credit from `from` (low: how many of our records it consumed, mod
 * 2^18): those mailbox slots may be reused. */
static void fr_sig_rx_credit(ferry_sig_t s, int from, uint32_t low)
{
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
    if (!fr_sig_fifo_empty(&D->sigs))
        fr_sig_activate(s, from);
}

void fr_sig_rx(ferry_sig_t s, uint32_t imm)
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
    if (kind == FR_SIGK_PUT)
        fr_sig_rx_put(s, from, low);
    else if (kind == FR_SIGK_SIG)
        fr_sig_rx_records(s, from, low);
    else
        fr_sig_rx_credit(s, from, low);
}
