/*
 * ferry put-with-signal from CUDA kernels (see ferry_signal.h).
 *
 *   __global__ void k(ferry_sig_device_t d, ...) {
 *       ... write a tile into d.heap + src_off ...
 *       ferry_sig_dev_put(&d, peer, dst_off, src_off, len, idx,
 *                         FERRY_SIG_ADD, 1);            // one thread
 *       ferry_sig_dev_wait(&d, my_idx, expected, 0);     // any thread
 *   }
 *
 * Any thread may call ferry_sig_dev_put; ferry_sig_dev_put_warp lets a
 * whole warp call it for one request (lane 0 queues it after the warp's
 * stores). The stores a thread (or, for the warp form, the warp) made to
 * the heap before the call are what the put carries.
 *
 * Status codes are ferry's: 0, FERRY_ERR_INVALID (a bad argument; also
 * recorded for the host, see ferry_sig_quiet), FERRY_ERR_TIMEOUT.
 */
#ifndef FERRY_SIGNAL_DEVICE_CUH
#define FERRY_SIGNAL_DEVICE_CUH

#include "ferry_signal.h"

/* Record the first device-side error and what caused it. */
static __device__ __forceinline__ int
ferry_sig_dev_error(const ferry_sig_device_t *d, int status, int what)
{
    if (atomicCAS(d->error, 0, status) == 0) {
        ((volatile int *)d->error)[1] = what;
        __threadfence_system();
    }
    return status;
}

/* Queue one put (+ signal). Spins while the ring is full, at most
 * ~timeout_ns (0: 10 s). */
static __device__ __forceinline__ int
ferry_sig_dev_put(const ferry_sig_device_t *d, int peer,
                  unsigned long long dst_off, unsigned long long src_off,
                  unsigned long long len, unsigned int sig_index, int op,
                  unsigned long long value)
{
    if (peer < 0 || peer >= d->nranks)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID, FERRY_SIG_DEVERR_PEER);
    if (src_off > d->heap_bytes || len > d->heap_bytes - src_off)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID, FERRY_SIG_DEVERR_SRC);
    if (dst_off > d->heap_bytes || len > d->heap_bytes - dst_off)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID, FERRY_SIG_DEVERR_DST);
    if (sig_index != FERRY_SIG_NONE && sig_index >= d->num_signals)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID,
                                   FERRY_SIG_DEVERR_INDEX);
    if (op != FERRY_SIG_SET && op != FERRY_SIG_ADD)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID, FERRY_SIG_DEVERR_OP);
    /* the heap stores this thread made must reach host memory before the
     * proxy can see the request */
    __threadfence_system();
    ferry_sig_ring_t *rg = (ferry_sig_ring_t *)d->ring;
    unsigned long long i = atomicAdd(d->reserve, 1ull);
    unsigned long long t0 = 0;
    while (i - *(volatile unsigned long long *)&rg->head >= d->ring_slots) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (!t0)
            t0 = now;
        else if (now - t0 > 10000000000ull)
            return ferry_sig_dev_error(d, FERRY_ERR_TIMEOUT,
                                       FERRY_SIG_DEVERR_RING_FULL);
    }
    volatile ferry_sig_req_t *q = &rg->req[i & (d->ring_slots - 1)];
    q->peer = peer;
    q->sig_index = sig_index;
    q->dst_off = dst_off;
    q->src_off = src_off;
    q->len = len;
    q->value = value;
    q->op = (unsigned int)op;
    __threadfence_system();
    q->seq = i + 1;
    return 0;
}

/* The warp form: every lane passes the same arguments; lane 0 queues the
 * request after the warp's stores. Returns the status on every lane. */
static __device__ __forceinline__ int
ferry_sig_dev_put_warp(const ferry_sig_device_t *d, int peer,
                       unsigned long long dst_off, unsigned long long src_off,
                       unsigned long long len, unsigned int sig_index, int op,
                       unsigned long long value)
{
    __syncwarp();
    __threadfence_system();
    int rc = 0;
    if ((threadIdx.x & 31) == 0)
        rc = ferry_sig_dev_put(d, peer, dst_off, src_off, len, sig_index, op,
                               value);
    return __shfl_sync(0xffffffffu, rc, 0);
}

static __device__ __forceinline__ unsigned long long
ferry_sig_dev_read(const ferry_sig_device_t *d, unsigned int sig_index)
{
    return *(volatile unsigned long long *)&d->signals[sig_index];
}

/* Wait until signal word sig_index >= value; then the heap bytes the
 * signal covers may be read. timeout_ns 0: 10 s. */
static __device__ __forceinline__ int
ferry_sig_dev_wait(const ferry_sig_device_t *d, unsigned int sig_index,
                   unsigned long long value, unsigned long long timeout_ns)
{
    if (sig_index >= d->num_signals)
        return ferry_sig_dev_error(d, FERRY_ERR_INVALID,
                                   FERRY_SIG_DEVERR_WAIT_INDEX);
    if (!timeout_ns)
        timeout_ns = 10000000000ull;
    unsigned long long t0 = 0;
    while (ferry_sig_dev_read(d, sig_index) < value) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (!t0)
            t0 = now;
        else if (now - t0 > timeout_ns)
            return FERRY_ERR_TIMEOUT;
    }
    __threadfence_system();
    return 0;
}

#endif
