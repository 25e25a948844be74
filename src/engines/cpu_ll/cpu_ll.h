/*
 * The CPU low-latency engine: plain C twins of the CUDA kernels over POSIX
 * shared memory (the stand-in for NVLink peer memory) and the proxy. Its
 * private state: per buffer set, where each pair went, and scratch.
 */
#ifndef FR_CPU_LL_H
#define FR_CPU_LL_H

#include "engines/engine.h"
#include "proxy/proxy.h"

typedef struct fr_cpu_round {
    int32_t *comb_pos;   /* [T][K]: row of my combine region, or -1 */
    /* expert side (filled by dispatch_recv) */
    int32_t *pair_row;   /* [N*T*kmax]: le*cap + slot, by sender (0 first,
                            though rows start at this rank's), record, k */
    uint32_t *pair_off;  /* [N+1]: first pair of each sender */
    uint32_t *comb_off;  /* [N]: where each sender wants its replies */
    /* token side (filled by dispatch_send) */
    uint32_t *send_off;  /* [N+1]: first row of my combine region per
                            destination (its replies land there) */
    int logfmt;          /* this round's combine rows are LogFMT (set by
                            combine_send, read by combine_recv) */
    uint64_t left;       /* a round of this set left for a bad topk_idx (its
                            number; 0: none), whose end the set's next round
                            awaits (fr_cpu_settle) */
    int left_sent;       /* its empty combine went out */
} fr_cpu_round_t;

typedef struct fr_cpu_ll {
    fr_cpu_round_t rounds[FR_NSETS];
    uint8_t *qbuf;       /* [T][tok_bytes] quantised tokens */
    float *qscales;      /* [T][nscales] */
    int32_t *cnt_rank;   /* [N] */
    int32_t *pairs_rank; /* [N] */
    int32_t *fill;       /* [N] */
    int32_t *rec_next;   /* [N] */
    uint32_t *rcount;    /* [N] records per sender, as checked (dispatch_recv) */
    int32_t *expert_fill;/* [El] */
    float *acc;          /* [H] */
} fr_cpu_ll_t;

static inline fr_cpu_ll_t *fr_cpu_state(ferry_ep_t ep)
{
    return (fr_cpu_ll_t *)ep->eng_state;
}
static inline fr_cpu_round_t *fr_cpu_round(ferry_ep_t ep, const fr_round_t *r)
{
    return &fr_cpu_state(ep)->rounds[r->epoch % FR_NSETS];
}

/* Round r is left on every rank alike (a rank's bad topk_idx): no rows
 * move and no combine call comes, so its end is an empty combine from
 * every rank to every rank. fr_cpu_leave: r's slot is free again; its
 * empty combine goes out now when seen_all (this rank saw every peer's
 * dispatch of r: none still reads what its combine flag overwrites), else
 * in fr_cpu_settle. fr_cpu_settle (the set's next round, before it sends
 * anything): that empty combine if not yet out, once every dispatch of
 * the left round arrived, then every peer's awaited, so that no buffer of
 * the set is written while a peer still reads it. The calls themselves
 * never wait on the left round, whatever order the rounds' calls come in. */
int fr_cpu_leave(ferry_ep_t ep, fr_round_t *r, int seen_all);
int fr_cpu_settle(ferry_ep_t ep, fr_round_t *r);

int fr_cpu_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_in_t *in);
int fr_cpu_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_out_t *out);
int fr_cpu_combine_send(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in);
int fr_cpu_combine_recv(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_out_t *out);

#endif
