/* CUDA memory helpers (see cuda_mem.h). */
#include <string.h>

#include <cuda_runtime.h>

#include "runtime/cuda_mem.h"

static int fr_cuda_fail(fr_err_t *err, const char *what, cudaError_t e)
{
    return FR_ERR(err, e == cudaErrorMemoryAllocation ? FERRY_ERR_NOMEM
                                                      : FERRY_ERR_SYSTEM,
                  "%s: %s (%s)", what, cudaGetErrorString(e),
                  cudaGetErrorName(e));
}

int fr_cuda_host_alloc(size_t bytes, void **host, void **dev, fr_err_t *err)
{
    *host = *dev = NULL;
    cudaError_t e = cudaHostAlloc(host, bytes, cudaHostAllocMapped |
                                                   cudaHostAllocPortable);
    if (e != cudaSuccess) {
        *host = NULL;
        return fr_cuda_fail(err, "cudaHostAlloc", e);
    }
    memset(*host, 0, bytes);
    e = cudaHostGetDevicePointer(dev, *host, 0);
    if (e != cudaSuccess) {
        cudaFreeHost(*host);
        *host = *dev = NULL;
        return fr_cuda_fail(err, "cudaHostGetDevicePointer", e);
    }
    return FERRY_OK;
}

void fr_cuda_host_free(void *host)
{
    if (host)
        cudaFreeHost(host);
}

int fr_cuda_dev_word(unsigned long long **dev, fr_err_t *err)
{
    cudaError_t e = cudaMalloc((void **)dev, sizeof(**dev));
    if (e != cudaSuccess) {
        *dev = NULL;
        return fr_cuda_fail(err, "cudaMalloc", e);
    }
    e = cudaMemset(*dev, 0, sizeof(**dev));
    if (e != cudaSuccess) {
        cudaFree(*dev);
        *dev = NULL;
        return fr_cuda_fail(err, "cudaMemset", e);
    }
    return FERRY_OK;
}

void fr_cuda_dev_free(void *dev)
{
    if (dev)
        cudaFree(dev);
}

int fr_cuda_dev_read(const unsigned long long *dev, uint64_t *val,
                     fr_err_t *err)
{
    unsigned long long v = 0;
    cudaError_t e = cudaMemcpy(&v, dev, sizeof(v), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess)
        return fr_cuda_fail(err, "cudaMemcpy (device word)", e);
    *val = v;
    return FERRY_OK;
}

int fr_cuda_gdr_order(int device)
{
    int order = 0, opts = 0;
    if (cudaDeviceGetAttribute(&order, cudaDevAttrGPUDirectRDMAWritesOrdering, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&opts, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device) !=
            cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    if (order >= (int)cudaGPUDirectRDMAWritesOrderingOwner)
        return 0;
    return (opts & (int)cudaFlushGPUDirectRDMAWritesOptionHost) != 0 ? 1 : -1;
}

/* Bind the calling thread to `device` once (the proxy thread's calls). */
static int fr_cuda_bind(int device)
{
    static __thread int bound = -1;
    if (bound != device) {
        if (cudaSetDevice(device) != cudaSuccess)
            return -1;
        bound = device;
    }
    return 0;
}

int fr_cuda_gdr_flush(int device)
{
    if (fr_cuda_bind(device) != 0)
        return -1;
    return cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                              cudaFlushGPUDirectRDMAWritesToOwner) ==
                   cudaSuccess
               ? 0
               : -1;
}

int fr_cuda_copies_wait(int device)
{
    if (fr_cuda_bind(device) != 0)
        return -1;
    return cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess ? 0 : -1;
}

/* 1: `stream` is capturing a graph, 0: not, -1: the query failed. */
static int fr_cuda_capture_status(void *stream)
{
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing((cudaStream_t)stream, &cs) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return cs != cudaStreamCaptureStatusNone;
}

int fr_cuda_stream_nonblocking(void *stream)
{
    unsigned int flags = 0;
    if (!stream || stream == (void *)cudaStreamLegacy)
        return 0;
    if (stream == (void *)cudaStreamPerThread)
        return 0; /* it synchronizes with the legacy stream (CUDA's rules) */
    int cap = fr_cuda_capture_status(stream);
    if (cap != 0)
        return cap < 0 ? -1 : 2; /* captured: the graph runs where it is launched */
    if (cudaStreamGetFlags((cudaStream_t)stream, &flags) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return (flags & cudaStreamNonBlocking) != 0;
}

int fr_cuda_copies(void *stream, int n, void *const *dst, const void *const *src,
                   const size_t *len, fr_err_t *err)
{
    cudaStream_t st = (cudaStream_t)stream;
    for (int i = 0; i < n; i++) {
        if (!len[i])
            continue;
        cudaError_t e = cudaMemcpyAsync(dst[i], src[i], len[i], cudaMemcpyDefault, st);
        if (e != cudaSuccess) {
            cudaGetLastError();
            cudaStreamSynchronize(st); /* the copies queued so far */
            return FR_ERR(err, FERRY_ERR_SYSTEM, "cudaMemcpyAsync of %zu bytes: %s", len[i],
                          cudaGetErrorString(e));
        }
    }
    cudaError_t e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return FR_ERR(err, FERRY_ERR_SYSTEM, "cudaStreamSynchronize: %s", cudaGetErrorString(e));
    }
    return FERRY_OK;
}

int fr_cuda_capturing(void *stream)
{
    return fr_cuda_capture_status(stream) == 1;
}

int fr_cuda_event_new(void **ev, fr_err_t *err)
{
    cudaEvent_t e;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) {
        cudaGetLastError();
        *ev = NULL;
        return FR_ERR(err, FERRY_ERR_SYSTEM, "cudaEventCreate: %s", cudaGetErrorString(r));
    }
    *ev = (void *)e;
    return FERRY_OK;
}

void fr_cuda_event_free(void *ev)
{
    if (ev)
        cudaEventDestroy((cudaEvent_t)ev);
}

int fr_cuda_event_record(void *ev, void *stream)
{
    if (cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream) == cudaSuccess)
        return 0;
    cudaGetLastError();
    return -1;
}

int fr_cuda_event_done(void *ev, const char **why)
{
    cudaError_t r = cudaEventQuery((cudaEvent_t)ev);
    if (r == cudaSuccess)
        return 1;
    cudaGetLastError(); /* "not ready" is kept as the last error otherwise */
    if (r == cudaErrorNotReady)
        return 0;
    *why = cudaGetErrorString(r);
    return -1;
}
