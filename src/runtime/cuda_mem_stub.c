/* Builds without nvcc: the CUDA memory helpers answer FERRY_ERR_UNSUPPORTED. */
#ifndef FERRY_HAVE_CUDA
#include "runtime/cuda_mem.h"

int fr_cuda_host_alloc(size_t bytes, void **host, void **dev, fr_err_t *err)
{
    (void)bytes;
    *host = *dev = NULL;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_cuda_host_free(void *host) { (void)host; }
int fr_cuda_dev_word(unsigned long long **dev, fr_err_t *err)
{
    *dev = NULL;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_cuda_dev_free(void *dev) { (void)dev; }
int fr_cuda_dev_read(const unsigned long long *dev, uint64_t *val, fr_err_t *err)
{
    (void)dev; (void)val;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_cuda_gdr_order(int device)
{
    (void)device;
    return -1;
}
int fr_cuda_gdr_flush(int device)
{
    (void)device;
    return -1;
}
int fr_cuda_copies_wait(int device)
{
    (void)device;
    return -1;
}
int fr_cuda_stream_nonblocking(void *stream)
{
    (void)stream;
    return -1;
}
int fr_cuda_copies(void *stream, int n, void *const *dst, const void *const *src,
                   const size_t *len, fr_err_t *err)
{
    (void)stream; (void)n; (void)dst; (void)src; (void)len;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_cuda_capturing(void *stream)
{
    (void)stream;
    return 0;
}
int fr_cuda_event_new(void **ev, fr_err_t *err)
{
    *ev = NULL;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_cuda_event_free(void *ev)
{
    (void)ev;
}
int fr_cuda_event_record(void *ev, void *stream)
{
    (void)ev; (void)stream;
    return -1;
}
int fr_cuda_event_done(void *ev, const char **why)
{
    (void)ev;
    *why = "this build has no CUDA";
    return -1;
}
#endif
