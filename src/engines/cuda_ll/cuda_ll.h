/*
 * The CUDA low-latency engine: launchers of the dispatch/combine kernels
 * and the device state behind them (setup.cu, combine.cu, mask.cu), its table (engine.c).
 * Built only when nvcc is present (FERRY_HAVE_CUDA); otherwise stub.c
 * answers FERRY_ERR_UNSUPPORTED.
 */
#ifndef FR_CUDA_API_H
#define FR_CUDA_API_H

#include "engines/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lay out the buffers (ep->L), allocate the receive segment (device memory for self/IPC peers, pinned
 * host memory mapped into the GPU when peers are on the fabric), map the
 * peers' segments (CUDA IPC) and the device tables. Collective. */
int fr_cuda_setup(ferry_ep_t ep, fr_err_t *err);
void fr_cuda_free(ferry_ep_t ep);

int fr_cuda_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                          const ferry_dispatch_in_t *in);
int fr_cuda_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                          const ferry_dispatch_out_t *out);
int fr_cuda_combine_send(ferry_ep_t ep, fr_round_t *r,
                         const ferry_combine_in_t *in);
int fr_cuda_combine_recv(ferry_ep_t ep, fr_round_t *r,
                         const ferry_combine_out_t *out);

/* Send and receive in one launch (ferry_dispatch, ferry_combine). */
int fr_cuda_dispatch(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *in,
                     const ferry_dispatch_out_t *out);
int fr_cuda_combine(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                    const ferry_combine_out_t *out);

/* The device mask (ferry_ep_mask_rank / _query), on the stream. */
int fr_cuda_mask_write(ferry_ep_t ep, int rank, int masked, void *stream);
int fr_cuda_mask_read(ferry_ep_t ep, int32_t *status, void *stream);
/* The GPU's mask into ep->mask (ranks its waits masked), after the work on
 * `stream` (waits for it; skipped while the stream is being captured). */
int fr_cuda_mask_pull(ferry_ep_t ep, void *stream);

/* Error a kernel reported (host-mapped word), turned into the EP's error. */
int fr_cuda_check(ferry_ep_t ep);
int fr_cuda_sync(ferry_ep_t ep, void *stream);

#ifdef __cplusplus
}
#endif

#endif
