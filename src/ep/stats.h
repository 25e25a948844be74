/*
 * Counters of the thread that drives an EP's fabric path: the
 * low-latency proxy (src/proxy/), the high-throughput CPU engine's
 * fabric calls (engines/cpu_ht/fabric.c) and the CUDA high-throughput
 * fabric thread (engines/cuda_ht/fab.c). One writer at a time (that
 * thread; several proxy threads each keep their own set, read as one),
 * plain counters stored with relaxed atomics so that
 * ferry_ep_get_stats may read them from another thread; a clock read
 * around each post and each poll that returned completions, nothing more.
 */
#ifndef FR_EP_STATS_H
#define FR_EP_STATS_H

#include <stdint.h>

#include "ferry.h"
#include "core/hist.h"
#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_ep_stats {
    uint64_t writes;      /* writes posted (one per peer of a scatter) */
    uint64_t bytes;       /* their payload bytes */
    uint64_t requests;    /* requests taken: ring entries, doorbell words */
    uint64_t post_ns;     /* from taking a request to its post call's return */
    uint64_t tx;          /* local completions of writes (success or error) */
    uint64_t rx;          /* peers' writes landed here */
    uint64_t polls;       /* polls that returned completions */
    uint64_t poll_ns;     /* those polls and the handling of what they returned */
    fr_tp_stats_t tp;     /* the transports' own counters, summed over NICs */
    uint64_t stamped;     /* d2p's samples that start at the ringer's stamp */
    fr_hist_t d2p;        /* doorbell rung -> write posted (ns) */
    fr_hist_t s2p;        /* doorbell first seen by the proxy -> write
                             posted (ns): d2p's lower bound */
} fr_ep_stats_t;

/* *c += v by its only writer, readable from other threads. */
static inline void fr_stat_add(uint64_t *c, uint64_t v)
{
    __atomic_store_n(c, *c + v, __ATOMIC_RELAXED);
}

/* Copy the transports' counters (summed over the EP's NICs) into
 * ep's stats; called by the thread that posts, after posting. */
void fr_ep_stats_tp(ferry_ep_t ep);
/* The same over NICs [k0, k1) into *st (a proxy thread's). */
void fr_ep_stats_tp_nics(ferry_ep_t ep, fr_ep_stats_t *st, int k0, int k1);

/* *dst += *src, every counter and the histogram (src read with relaxed
 * loads: its writer may still add; dst has one writer, the caller). */
void fr_ep_stats_add(fr_ep_stats_t *dst, const fr_ep_stats_t *src);

/* Fill the public struct (fields up to out->size). */
void fr_ep_stats_get(ferry_ep_t ep, ferry_ep_stats_t *out);

/* FERRY_PROXY_STATS: one line on stderr with the counters. */
void fr_ep_stats_print(ferry_ep_t ep);

#ifdef __cplusplus
}
#endif

#endif
