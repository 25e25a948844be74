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

#ifdef __cplusplus
}
#endif

#endif
