/* GPU memory on the fabric path: the policy both CUDA engines follow. */
#ifndef FR_EP_HMEM_H
#define FR_EP_HMEM_H

#include "ep/ep.h"
#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FERRY_FABRIC_HMEM with the fabric's provider: may this rank's fabric
 * regions be memory of CUDA `device`? *want: what the setting asks (1 on,
 * 0 auto, -1 off); h->ok: yes or no, h->why why; *order: how NIC writes
 * become visible (fr_cuda_gdr_order; 0 when the provider copies). Only
 * FERRY_ERR_INVALID (a bad setting) fails. The caller still registers its
 * region on trial (fr_ep_hmem_trial). Local, no communication. */
int fr_ep_hmem_policy(int device, int *want, fr_tp_hmem_t *h, int *order, fr_err_t *err);
/* Register [p, p + len) of `device` on trial: h->ok (and h->why) updated,
 * returned. */
int fr_ep_hmem_trial(int device, void *p, size_t len, fr_tp_hmem_t *h);
/* The FR_RX_FLUSH_* that arrivals in such memory need. */
int fr_ep_rx_flush_kind(const fr_tp_hmem_t *h, int order);
/* Completions cqe[0..n) were polled: when any is a peer's write landing
 * here, make the landed bytes visible to the GPU's kernels as
 * ep->rx_flush says (a NIC's writes flushed, a copying provider's CUDA
 * copies waited for), once for the batch, before any word or flag about
 * them is stored. 0, or -1 with *what naming the step that failed. */
int fr_ep_rx_visible(ferry_ep_t ep, const fr_cqe_t *cqe, int n, const char **what);

#ifdef __cplusplus
}
#endif

#endif
