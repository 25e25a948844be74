/* Kernels of ferry-signal-bench (tools/signal_kernels.cu). */
#ifndef FSB_KERNELS_H
#define FSB_KERNELS_H

#include <stdint.h>

#include "ferry_signal.h"

#ifdef __CUDACC__
#define FSB_HD __host__ __device__
#else
#define FSB_HD
#endif

/* The byte pattern of tile t of `sender` in `round` (host and device). */
static FSB_HD inline unsigned char fsb_pat(int sender, int t, uint32_t round,
                                           uint64_t j)
{
    uint32_t k = (uint32_t)sender * 2654435761u ^ (uint32_t)t * 40503u ^
                 round * 69069u;
    return (unsigned char)((k >> ((j & 3) * 8)) ^ (j * 131u) ^ (j >> 9));
}

#ifdef __cplusplus
extern "C" {
#endif

/* The GPU side of the benchmark. Tile t (of nxfer) lives at src_off[t] in
 * this rank's heap and goes to rank dst[t] at dst_off[t]; incoming tile i
 * (of nin) sits at in_off[i], sent by in_src[i] as its tile in_t[i]. */
typedef struct fsb_cuda fsb_cuda_t;
int fsb_cuda_prepare(const ferry_sig_device_t *d, int nxfer, const int *dst,
                     const uint64_t *src_off, const uint64_t *dst_off,
                     uint64_t len, int nin, const uint64_t *in_off,
                     const int *in_src, const int *in_t, fsb_cuda_t **out,
                     char *why, size_t whylen);
/* Write this round's tiles (a kernel; warp per tile). */
int fsb_cuda_fill(fsb_cuda_t *h, uint32_t round, char *why, size_t whylen);
/* A kernel puts every tile (a warp per tile; with fill, the warp first
 * writes it), with ADD 1 on word `rank` at the destination when signal;
 * then, when signal, a kernel waits until word s >= want[s] for every
 * sender s. Synchronous. */
int fsb_cuda_put(fsb_cuda_t *h, uint32_t round, int signal, int fill,
                 const uint64_t *want, char *why, size_t whylen);
/* Compare every incoming tile with this round's pattern in a kernel
 * (volatile loads of the mapped heap); *wrong: bytes that differ. */
int fsb_cuda_check(fsb_cuda_t *h, uint32_t round, uint64_t *wrong, char *why,
                   size_t whylen);
void fsb_cuda_free(fsb_cuda_t *h);
/* A kernel makes one bad call: which 0-5 a ferry_sig_dev_put with a bad
 * peer (nranks, -1), source range, destination range, signal word or op;
 * 6 a ferry_sig_dev_wait on a word that does not exist. *kernel_rc: what
 * the call returned. Used by tests/mp/test_signal (kernel_args). */
#define FSB_BAD_CALLS 7
int fsb_cuda_bad_call(const ferry_sig_device_t *d, int which, int *kernel_rc,
                      char *why, size_t whylen);

#ifdef __cplusplus
}
#endif

#endif
