/*
 * Engines: the kernels and buffers of one (device, mode) pair behind one
 * table. The API layer sequences rounds and checks arguments, then calls
 * the engine chosen at create; an engine keeps its private state in
 * ep->eng_state and sets up the EP's shared buffers (receive segment, peer
 * mappings, send region) in setup. Adding an engine is its folder plus one
 * line in registry.c.
 */
#ifndef FR_ENGINE_H
#define FR_ENGINE_H

#include "ep/ep.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_engine {
    size_t size;         /* sizeof(fr_engine_t): new ops go at the end */
    const char *name;    /* "cpu_ll", "cuda_ll" */
    ferry_device_t device;
    ferry_mode_t mode;
    /* Collective, after the paths are chosen: fill ep->L, allocate the
     * receive segment (ep->seg), map the peers' (ep->peer_seg[i] for self
     * and shm peers), the send region when ep->nfabric > 0 (ep->send) and,
     * where the engine produces them on the device, ep->slices and
     * ep->ring_mem. A rank that fails before the engine's own exchange
     * still joins it with its status, so every rank fails at once. */
    int (*setup)(ferry_ep_t ep, fr_err_t *err);
    /* Free what setup made (also after a failed setup). */
    void (*free)(ferry_ep_t ep);
    /* The round calls (NULL in high-throughput engines: the API refuses
     * them before reaching the engine). */
    int (*dispatch_send)(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_in_t *in);
    int (*dispatch_recv)(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_out_t *out);
    int (*combine_send)(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in);
    int (*combine_recv)(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_out_t *out);
    /* Wait for the work queued on `stream` (NULL: all); FERRY_OK or the
     * error the device reported. */
    int (*sync)(ferry_ep_t ep, void *stream);
    /* An error the device reported asynchronously, turned into the EP's
     * error (FERRY_OK when none). */
    int (*check)(ferry_ep_t ep);
    /* High-throughput mode (NULL in low-latency engines). route_create is
     * collective and fills the route's common fields and its priv. */
    int (*route_create)(ferry_ep_t ep, const ferry_route_in_t *in,
                        ferry_route_t route);
    void (*route_free)(ferry_route_t route);
    int (*ht_dispatch)(ferry_ep_t ep, ferry_route_t route,
                       const ferry_ht_dispatch_in_t *in,
                       const ferry_ht_dispatch_out_t *out);
    int (*ht_combine)(ferry_ep_t ep, ferry_route_t route,
                      const ferry_ht_combine_in_t *in,
                      const ferry_ht_combine_out_t *out);
    /* Optional: send and receive as one operation (one kernel launch on a
     * GPU), behind ferry_dispatch and ferry_combine; NULL: the API calls
     * the two halves. in and out share one stream. */
    int (*dispatch)(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in,
                    const ferry_dispatch_out_t *out);
    int (*combine)(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                   const ferry_combine_out_t *out);
    /* The engine that serves instead when this rank has peers on the
     * fabric path (chosen at create, once the paths are known); NULL: this
     * engine serves them itself, or refuses them in setup. */
    const struct fr_engine *fabric_engine;
    /* Optional (NULL: masking refused): the engine's copy of ep->mask,
     * entry `rank` set to `masked` (CUDA: on `stream`), and the mask copied
     * into status [N] (the context's memory kind, on `stream`). ep->mask is
     * already updated when mask_write runs. */
    int (*mask_write)(ferry_ep_t ep, int rank, int masked, void *stream);
    int (*mask_read)(ferry_ep_t ep, int32_t *status, void *stream);
    /* Optional: ep->mask brought up to date with ranks the engine masked
     * itself (mask_on_timeout, on the device), after the work on `stream`;
     * NULL: ep->mask is the mask. */
    int (*mask_pull)(ferry_ep_t ep, void *stream);
    /* Optional, for an engine with a fabric_engine: may this engine serve
     * the context's fabric peers itself after all (*native = 1; it may set
     * ep->fab_device and ep->rx_flush for its setup), or does
     * fabric_engine serve instead (0)? Collective over every rank (each
     * has fabric peers then), the same answer on every rank. */
    int (*fabric_native)(ferry_ep_t ep, int *native, fr_err_t *err);
    /* Optional: called once the NICs are open, the segment and the send
     * region registered and the peer groups made (an engine that drives
     * the fabric from a thread of its own starts it here). */
    int (*fabric_up)(ferry_ep_t ep, fr_err_t *err);
    /* Whether combine_send (and combine) honour ferry_combine_in_t's
     * signals (the overlapped combine); 0: the API refuses them. */
    int combine_signals;
    /* Whether the combine takes FERRY_COMBINE_LOGFMT rows. */
    int combine_logfmt;
} fr_engine_t;

/* GPU ranks through a host engine (engines/staged): the CPU engine of the
 * same mode runs the protocol on pinned host copies of the device
 * buffers. The CUDA high-throughput engine's fabric_engine. */
extern const fr_engine_t fr_engine_staged_ht;

/* A route (public handle ferry_route_t): what the API layer checks
 * against, and the engine's own part. */
struct ferry_route {
    ferry_ep_t ep;
    uint64_t id;         /* 1, 2, 3... per context, the same on every rank */
    int T;               /* this rank's tokens */
    int gT, glo;         /* DP groups: the group's tokens, this member's first */
    int num_recv;        /* rows this rank receives (a bounded route on
                            CUDA ranks: not known on the host, 0) */
    int bound;           /* max_recv of a bounded route, else 0 */
    int32_t *ecnt;       /* [E_local] rows per local expert, padded */
    void *priv;          /* the engine's */
};

/* The rows a route's dispatch outputs hold: the bound of a bounded route,
 * else the rows received. */
static inline int fr_route_rows(const struct ferry_route *route)
{
    return route->bound > 0 ? route->bound : route->num_recv;
}

/* The engine for (device, mode); NULL when there is none. */
const fr_engine_t *fr_engine_find(ferry_device_t device, ferry_mode_t mode);

#ifdef __cplusplus
}
#endif

#endif
