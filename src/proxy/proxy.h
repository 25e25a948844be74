/* The EP's proxy thread (proxy.c): owns the fabric for one rank. */
#ifndef FR_PROXY_H
#define FR_PROXY_H

#include "ep/ep.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The proxy's tables, made once the fabric peers and their groups are
 * known: the scatter scratch, the slices (unless the engine made them,
 * where its kernels write them), the last flag epochs seen and the
 * doorbell ring (unless the engine has one). */
int fr_proxy_tables(ferry_ep_t ep, fr_err_t *err);
/* Free them (after fr_proxy_stop; an engine's own slices and ring are
 * its to free, and it clears the pointers). */
void fr_proxy_tables_release(ferry_ep_t ep);
int fr_proxy_start(ferry_ep_t ep);
/* The thread that owns fabric peer g: the one owning its NIC endpoint. */
static inline int fr_proxy_owner(const fr_proxy_t *p, int g)
{
    return p->gnic[g] / p->per;
}
int fr_proxy_stop(ferry_ep_t ep); /* -1: left running (fr_proxy_join) */
/* Ask the proxy to post (phase, set)'s slices: to every fabric peer
 * (peer < 0), or to fabric peer `peer` (its index in ep->slices) alone. */
int fr_proxy_submit(ferry_ep_t ep, int phase, int set, uint64_t epoch, int peer);
/* Zero the counters of every proxy thread (ep->st and the others'), with
 * nothing in flight (a benchmark's warm-up done). */
void fr_proxy_stats_clear(ferry_ep_t ep);
/* Writes of `set` in flight, summed over the proxy threads. */
int64_t fr_proxy_in_flight(ferry_ep_t ep, int set);
/* Wait until the proxy has no writes in flight from `set` (bounded). */
int fr_proxy_wait_set(ferry_ep_t ep, int set);

/* The proxy alone, for benchmarks (nullbench.c): a proxy thread driving
 * `peers` simulated fabric peers over the null transport (no bytes move,
 * every write completes at once and is answered by the peer's arrival),
 * fed by the calling thread as a CPU rank feeds it (a request per peer
 * and phase), warmup + rounds rounds of dispatch and combine. */
typedef struct fr_proxy_bench {
    int peers, rounds, warmup;    /* IN */
    int gpu;                      /* IN: a GPU rank's doorbells (a kernel rings them) */
    int bells;                    /* IN, without gpu: the same doorbells rung by the
                                     calling thread in host memory (the GPU rank's
                                     protocol, where there is no GPU), each stamped
                                     before it rings (1), or with the time it
                                     rang once every write landed (2: the proxy's
                                     delays wait for their stamps) */
    uint64_t bytes;               /* IN: each write's length (nothing moves) */
    double *round_us;             /* OUT, optional: [rounds] each timed round */
    ferry_ep_stats_t st;          /* OUT: the proxy's counters, timed rounds */
    char err[FR_ERRMSG_LEN];      /* OUT: why, when not FERRY_OK */
} fr_proxy_bench_t;
int fr_proxy_bench_null(fr_proxy_bench_t *b);

#ifdef __cplusplus
}
#endif

#endif
