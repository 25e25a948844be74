/*
 * DP groups on CUDA ranks (dp.c's protocol in GPU memory): each member's
 * region is device memory shared with its group through CUDA IPC, and the
 * gather runs as kernels on the call's stream, the gather count kept on
 * the device (a captured CUDA graph replays it). Without CUDA
 * (dp_cuda_stub.c) every call answers FERRY_ERR_UNSUPPORTED.
 *
 * Region (the same offsets as dp.c's): [0] ready, [8] T, [12] weights
 * given, [64] read, [72] gathers done (device epoch), [80] blocks done in
 * the running gather, [128] rows, then weights.
 */
#ifndef FR_DP_CUDA_H
#define FR_DP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_DP_READY 0
#define FR_DP_T 8
#define FR_DP_W 12
#define FR_DP_READ 64
#define FR_DP_EPOCH 72
#define FR_DP_DONE 80
#define FR_DP_ROWS 128

/* What the kernels need: the members' regions (a device array), this
 * member's index, sizes, and the error words (host-mapped: [0] status,
 * [1] the rank, [2] what, [3] detail; device flag first). */
typedef struct fr_dp_cuda {
    uint8_t **peers;        /* device array [G] */
    int G, m, g0;           /* members, this one's index, the group's first rank */
    int H, K, share;
    long long timeout_ns;
    int *dflag;             /* device: set by the first error */
    volatile int *err;      /* host-mapped [4] */
    int *err_host;          /* the same words as the host reads them */
} fr_dp_cuda_t;

/* The device array of the members' regions and the error words. */
int fr_dp_cuda_tables(fr_dp_cuda_t *g, uint8_t *const *regions, fr_err_t *err);
void fr_dp_cuda_tables_free(fr_dp_cuda_t *g);

/* Before the engine writes this member's rows into its region: wait until
 * every other member has read the previous gather (a kernel on stream). */
int fr_dp_cuda_begin(const fr_dp_cuda_t *g, void *stream, fr_err_t *err);
/* After it: publish the own rows (T, weights given), then copy every
 * member's share into out ([T][H] bf16) and w ([T][K], may be NULL). */
int fr_dp_cuda_gather(const fr_dp_cuda_t *g, void *out, float *w, int T, void *stream,
                      fr_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
