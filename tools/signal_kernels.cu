/* Kernels of ferry-signal-bench: puts with signals issued from a kernel,
 * waits and checks in the kernel (see signal_kernels.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "ferry_signal_device.cuh"
#include "signal_kernels.h"

struct fsb_cuda {
    ferry_sig_device_t d;
    int nxfer, nin;
    uint64_t len;
    int *dst, *in_src, *in_t, *timeouts;
    uint64_t *src_off, *dst_off, *in_off, *want;
    unsigned long long *wrong;
};

/* op: 1 fill, 2 put, 3 fill then put */
__global__ void fsb_put_kernel(ferry_sig_device_t d, int nxfer,
                               const int *dst, const uint64_t *src_off,
                               const uint64_t *dst_off, uint64_t len, int op,
                               int signal, uint32_t round)
{
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (warp >= nxfer)
        return;
    if (op & 1) {
        unsigned char *p = d.heap + src_off[warp];
        for (uint64_t j = lane; j < len; j += 32)
            p[j] = fsb_pat(d.rank, warp, round, j);
    }
    if (op & 2)
        ferry_sig_dev_put_warp(&d, dst[warp], dst_off[warp], src_off[warp],
                               len, signal ? (unsigned)d.rank : FERRY_SIG_NONE,
                               FERRY_SIG_ADD, 1);
}

__global__ void fsb_wait_kernel(ferry_sig_device_t d, const uint64_t *want,
                                int *timeouts)
{
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= d.nranks || want[s] == 0)
        return;
    if (ferry_sig_dev_wait(&d, (unsigned)s, want[s], 20000000000ull) != 0)
        atomicAdd(timeouts, 1);
}

__global__ void fsb_check_kernel(ferry_sig_device_t d, const uint64_t *in_off,
                                 const int *in_src, const int *in_t,
                                 uint64_t len, uint32_t round,
                                 unsigned long long *wrong)
{
    int i = blockIdx.x;
    const volatile unsigned char *p = d.heap + in_off[i];
    unsigned long long bad = 0;
    for (uint64_t j = threadIdx.x; j < len; j += blockDim.x)
        bad += p[j] != fsb_pat(in_src[i], in_t[i], round, j);
    if (bad)
        atomicAdd(wrong, bad);
}

static int fsb_err(cudaError_t e, char *why, size_t whylen)
{
    if (e == cudaSuccess)
        return 0;
    snprintf(why, whylen, "CUDA: %s", cudaGetErrorString(e));
    return FERRY_ERR_SYSTEM;
}

#define FSB_CU(call)                                                           \
    do {                                                                       \
        if (e == cudaSuccess)                                                  \
            e = (call);                                                        \
    } while (0)

extern "C" int fsb_cuda_prepare(const ferry_sig_device_t *d, int nxfer,
                                const int *dst, const uint64_t *src_off,
                                const uint64_t *dst_off, uint64_t len,
                                int nin, const uint64_t *in_off,
                                const int *in_src, const int *in_t,
                                fsb_cuda_t **out, char *why, size_t whylen)
{
    fsb_cuda_t *h = (fsb_cuda_t *)calloc(1, sizeof(*h));
    cudaError_t e = cudaSuccess;
    h->d = *d;
    h->nxfer = nxfer;
    h->nin = nin;
    h->len = len;
    size_t nx = nxfer > 0 ? nxfer : 1, ni = nin > 0 ? nin : 1;
    FSB_CU(cudaMalloc(&h->dst, sizeof(int) * nx));
    FSB_CU(cudaMalloc(&h->src_off, sizeof(uint64_t) * nx));
    FSB_CU(cudaMalloc(&h->dst_off, sizeof(uint64_t) * nx));
    FSB_CU(cudaMalloc(&h->want, sizeof(uint64_t) * d->nranks));
    FSB_CU(cudaMalloc(&h->in_off, sizeof(uint64_t) * ni));
    FSB_CU(cudaMalloc(&h->in_src, sizeof(int) * ni));
    FSB_CU(cudaMalloc(&h->in_t, sizeof(int) * ni));
    FSB_CU(cudaMalloc(&h->timeouts, sizeof(int)));
    FSB_CU(cudaMalloc(&h->wrong, sizeof(unsigned long long)));
    if (nxfer > 0) {
        FSB_CU(cudaMemcpy(h->dst, dst, sizeof(int) * nxfer, cudaMemcpyHostToDevice));
        FSB_CU(cudaMemcpy(h->src_off, src_off, sizeof(uint64_t) * nxfer, cudaMemcpyHostToDevice));
        FSB_CU(cudaMemcpy(h->dst_off, dst_off, sizeof(uint64_t) * nxfer, cudaMemcpyHostToDevice));
    }
    if (nin > 0) {
        FSB_CU(cudaMemcpy(h->in_off, in_off, sizeof(uint64_t) * nin, cudaMemcpyHostToDevice));
        FSB_CU(cudaMemcpy(h->in_src, in_src, sizeof(int) * nin, cudaMemcpyHostToDevice));
        FSB_CU(cudaMemcpy(h->in_t, in_t, sizeof(int) * nin, cudaMemcpyHostToDevice));
    }
    *out = h;
    return fsb_err(e, why, whylen);
}

extern "C" int fsb_cuda_fill(fsb_cuda_t *h, uint32_t round, char *why,
                             size_t whylen)
{
    cudaError_t e = cudaSuccess;
    if (h->nxfer > 0)
        fsb_put_kernel<<<(h->nxfer * 32 + 255) / 256, 256>>>(
            h->d, h->nxfer, h->dst, h->src_off, h->dst_off, h->len, 1, 0,
            round);
    FSB_CU(cudaGetLastError());
    FSB_CU(cudaDeviceSynchronize());
    return fsb_err(e, why, whylen);
}

extern "C" int fsb_cuda_put(fsb_cuda_t *h, uint32_t round, int signal,
                            int fill, const uint64_t *want, char *why,
                            size_t whylen)
{
    cudaError_t e = cudaSuccess;
    int to = 0;
    FSB_CU(cudaMemcpy(h->want, want, sizeof(uint64_t) * h->d.nranks,
                      cudaMemcpyHostToDevice));
    FSB_CU(cudaMemset(h->timeouts, 0, sizeof(int)));
    if (e == cudaSuccess && h->nxfer > 0)
        fsb_put_kernel<<<(h->nxfer * 32 + 255) / 256, 256>>>(
            h->d, h->nxfer, h->dst, h->src_off, h->dst_off, h->len,
            fill ? 3 : 2, signal, round);
    if (e == cudaSuccess && signal)
        fsb_wait_kernel<<<(h->d.nranks + 127) / 128, 128>>>(h->d, h->want,
                                                              h->timeouts);
    FSB_CU(cudaGetLastError());
    FSB_CU(cudaDeviceSynchronize());
    FSB_CU(cudaMemcpy(&to, h->timeouts, sizeof(int), cudaMemcpyDeviceToHost));
    if (e == cudaSuccess && to) {
        snprintf(why, whylen, "%d signal waits in the kernel timed out", to);
        return FERRY_ERR_TIMEOUT;
    }
    return fsb_err(e, why, whylen);
}

extern "C" int fsb_cuda_check(fsb_cuda_t *h, uint32_t round, uint64_t *wrong,
                              char *why, size_t whylen)
{
    cudaError_t e = cudaSuccess;
    unsigned long long w = 0;
    FSB_CU(cudaMemset(h->wrong, 0, sizeof(w)));
    if (e == cudaSuccess && h->nin > 0)
        fsb_check_kernel<<<h->nin, 256>>>(h->d, h->in_off, h->in_src, h->in_t,
                                          h->len, round, h->wrong);
    FSB_CU(cudaGetLastError());
    FSB_CU(cudaDeviceSynchronize());
    FSB_CU(cudaMemcpy(&w, h->wrong, sizeof(w), cudaMemcpyDeviceToHost));
    *wrong = w;
    return fsb_err(e, why, whylen);
}

extern "C" void fsb_cuda_free(fsb_cuda_t *h)
{
    if (!h)
        return;
    cudaFree(h->dst); cudaFree(h->src_off); cudaFree(h->dst_off);
    cudaFree(h->want); cudaFree(h->in_off); cudaFree(h->in_src);
    cudaFree(h->in_t); cudaFree(h->timeouts); cudaFree(h->wrong);
    free(h);
}

/* One thread makes bad call `which` (see signal_kernels.h). */
__global__ void fsb_bad_kernel(ferry_sig_device_t d, int which, int *rc)
{
    unsigned long long hb = d.heap_bytes;
    int r;
    switch (which) {
    case 0: r = ferry_sig_dev_put(&d, d.nranks, 0, 0, 8, 0, FERRY_SIG_ADD, 1); break;
    case 1: r = ferry_sig_dev_put(&d, -1, 0, 0, 8, 0, FERRY_SIG_ADD, 1); break;
    case 2: r = ferry_sig_dev_put(&d, 0, 0, hb - 4, 8, 0, FERRY_SIG_ADD, 1); break;
    case 3: r = ferry_sig_dev_put(&d, 0, hb, 0, 8, 0, FERRY_SIG_ADD, 1); break;
    case 4: r = ferry_sig_dev_put(&d, 0, 0, 0, 8, d.num_signals, FERRY_SIG_ADD, 1); break;
    case 5: r = ferry_sig_dev_put(&d, 0, 0, 0, 8, 0, 7, 1); break;
    default: r = ferry_sig_dev_wait(&d, d.num_signals, 1, 1000000); break;
    }
    *rc = r;
}

extern "C" int fsb_cuda_bad_call(const ferry_sig_device_t *d, int which,
                                 int *kernel_rc, char *why, size_t whylen)
{
    cudaError_t e = cudaSuccess;
    int *rc = NULL;
    FSB_CU(cudaMalloc(&rc, sizeof(int)));
    if (e == cudaSuccess)
        fsb_bad_kernel<<<1, 1>>>(*d, which, rc);
    FSB_CU(cudaGetLastError());
    FSB_CU(cudaDeviceSynchronize());
    FSB_CU(cudaMemcpy(kernel_rc, rc, sizeof(int), cudaMemcpyDeviceToHost));
    cudaFree(rc);
    return fsb_err(e, why, whylen);
}
