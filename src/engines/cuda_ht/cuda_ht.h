/*
 * The CUDA high-throughput engine (ranks of one node, peers' segments
 * mapped through CUDA IPC): set-up, routes, dispatch and combine. Built
 * only when nvcc is present (FERRY_HAVE_CUDA); otherwise stub.c answers
 * FERRY_ERR_UNSUPPORTED.
 */
#ifndef FR_CUDA_HT_H
#define FR_CUDA_HT_H

#include "engines/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Collective: the segment (device memory: notify entries, ring counters,
 * rings), the peers' mapped through CUDA IPC, the device tables; for
 * peers on the fabric path outboxes and host-mapped words (fab.h). */
int fr_cuht_setup(ferry_ep_t ep, fr_err_t *err);
void fr_cuht_free(ferry_ep_t ep);
/* Peers on the fabric path: served here from GPU memory (FI_HMEM), or by
 * the staged engine (engine.h's fabric_native); the thread started once
 * the NICs are up (fabric_up). */
int fr_cuht_fabric_native(ferry_ep_t ep, int *native, fr_err_t *err);
int fr_cuht_fabric_up(ferry_ep_t ep, fr_err_t *err);
/* Wait for `stream` (NULL: the device), then the kernels' error word. */
int fr_cuht_sync(ferry_ep_t ep, void *stream);
/* The kernels' error word (host-mapped), turned into the EP's error. */
int fr_cuht_check(ferry_ep_t ep);

/* Collective: kernels on in->stream, one host synchronisation. */
int fr_cuht_route_create(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t route);
void fr_cuht_route_free(ferry_route_t route);
/* Stream-ordered: enqueue and return. */
int fr_cuht_dispatch(ferry_ep_t ep, ferry_route_t route, const ferry_ht_dispatch_in_t *in,
                     const ferry_ht_dispatch_out_t *out);
int fr_cuht_combine(ferry_ep_t ep, ferry_route_t route, const ferry_ht_combine_in_t *in,
                    const ferry_ht_combine_out_t *out);
/* ferry_dispatch_layout on device memory (arguments checked by the
 * API): a memset and a kernel on a->stream. */
int fr_cuht_dispatch_layout(const ferry_layout_args_t *a, fr_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
