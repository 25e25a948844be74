/* The null bench's GPU rank (nullbench_cuda.cu; without CUDA,
 * nullbench_cuda_stub.c answers FERRY_ERR_UNSUPPORTED). */
#ifndef FR_NULLBENCH_CUDA_H
#define FR_NULLBENCH_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A kernel on `stream` fills the nf slices sl[] (host-mapped, device
 * view) with len and imm and sets each doorbell ready[g] to e (release,
 * system scope), a thread per peer, as the low-latency engine does. */
int fr_nb_cuda_ring(void *sl, void *ready, int nf, uint64_t len, uint32_t imm, uint64_t e,
                    void *stream);
int fr_nb_cuda_stream(void **stream);
void fr_nb_cuda_stream_free(void *stream);

#ifdef __cplusplus
}
#endif

#endif
