/*
 * Small CUDA helpers for C code (put-with-signal, the proxy, the API, the
 * staged engine): pinned host memory mapped into the GPU, a device word, a
 * device-to-host read, the GPUDirect RDMA write flush, waiting for a
 * provider's copies, stream queries, copies through host memory. Without
 * CUDA (cuda_mem_stub.c) they answer FERRY_ERR_UNSUPPORTED (or "no").
 */
#ifndef FR_CUDA_MEM_H
#define FR_CUDA_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Zeroed pinned host memory, mapped: *host for the CPU, *dev for kernels. */
int fr_cuda_host_alloc(size_t bytes, void **host, void **dev, fr_err_t *err);
void fr_cuda_host_free(void *host);
/* A zeroed 64-bit word in device memory. */
int fr_cuda_dev_word(unsigned long long **dev, fr_err_t *err);
void fr_cuda_dev_free(void *dev);
/* Read a 64-bit device word (synchronous). */
int fr_cuda_dev_read(const unsigned long long *dev, uint64_t *val,
                     fr_err_t *err);

/* GPUDirect RDMA: how a NIC's writes into memory of `device` become
 * visible to the device's own kernels: 0 in order (nothing to do), 1 after
 * a flush from the host (fr_cuda_gdr_flush), -1 neither (the device neither
 * orders them nor offers a host flush: GPU memory is not safe to receive
 * into). */
int fr_cuda_gdr_order(int device);
/* Flush the NIC writes into memory of `device` so far (the calling thread
 * is bound to the device at its first call). 0 on success. */
int fr_cuda_gdr_flush(int device);
/* Wait for the copies a provider issued on the CUDA legacy default stream
 * of this process (shm's cudaMemcpy into GPU memory returns before a
 * device-to-device copy is done). 0 on success. */
int fr_cuda_copies_wait(int device);
/* 1: `stream` does not wait for the legacy default stream (created with
 * cudaStreamNonBlocking); 0: it does (the legacy stream, the per-thread
 * default stream, or a blocking stream); 2: it is capturing a graph (which
 * runs on whatever stream launches it: not known here); -1: not a
 * stream. */
int fr_cuda_stream_nonblocking(void *stream);
/* Copies (any direction, cudaMemcpyDefault) queued on `stream` (NULL: the
 * legacy default stream), then the stream waited for: FERRY_OK or
 * FERRY_ERR_SYSTEM with the message in err. n copies of pairs dst[i],
 * src[i], len[i] (a zero length is skipped). */
int fr_cuda_copies(void *stream, int n, void *const *dst, const void *const *src,
                   const size_t *len, fr_err_t *err);
/* 1 when `stream` is capturing a CUDA graph, else 0. */
int fr_cuda_capturing(void *stream);

/* An event without timing on the current device: FERRY_OK, or an error
 * with the message in err. */
int fr_cuda_event_new(void **ev, fr_err_t *err);
void fr_cuda_event_free(void *ev);
/* Record ev on `stream`: 0 on success (CUDA's last error cleared else). */
int fr_cuda_event_record(void *ev, void *stream);
/* 1: everything before ev has run; 0: not yet (CUDA's "not ready" is
 * cleared, so it does not fail a later launch check); -1: an error, its
 * text in *why. */
int fr_cuda_event_done(void *ev, const char **why);

#ifdef __cplusplus
}
#endif

#endif
