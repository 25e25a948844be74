/* Builds without nvcc: no peer memory (peer_mem.h). */
#ifndef FERRY_HAVE_CUDA
#include <string.h>
#include <unistd.h>

#include "runtime/peer_mem.h"

int fr_cuda_device_current(int *device, fr_err_t *err)
{
    *device = -1;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_cuda_device_uuid(int device, uint8_t uuid[16], fr_err_t *err)
{
    (void)device;
    memset(uuid, 0, 16);
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_cuda_nvlink_domain(int device, uint8_t cluster[16], unsigned *clique, char *why,
                          size_t whylen)
{
    (void)device;
    memset(cluster, 0, 16);
    *clique = 0;
    if (why && whylen)
        strncpy(why, "this build has no CUDA", whylen - 1), why[whylen - 1] = 0;
    return -1;
}
int fr_pmem_kinds(int device, char *why, size_t whylen)
{
    (void)device;
    if (why && whylen)
        strncpy(why, "this build has no CUDA", whylen - 1), why[whylen - 1] = 0;
    return 0;
}
int fr_pmem_try(int kind, int device, fr_err_t *err)
{
    (void)kind, (void)device;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_pmem_usable(int kind, int device, char *why, size_t whylen)
{
    return fr_pmem_kinds(device, why, whylen) & kind;
}
int fr_pmem_alloc(int kind, int device, size_t bytes, fr_pmem_t *m, fr_err_t *err)
{
    (void)kind, (void)device, (void)bytes;
    memset(m, 0, sizeof(*m));
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_pmem_export(const fr_pmem_t *m, uint8_t blob[FR_PMEM_BLOB], int *fd, fr_err_t *err)
{
    (void)m, (void)blob;
    *fd = -1;
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
int fr_pmem_open(int kind, int device, const uint8_t *blob, int fd, size_t size, fr_pmem_t *m,
                 fr_err_t *err)
{
    (void)kind, (void)device, (void)blob, (void)size;
    if (fd >= 0)
        close(fd);
    memset(m, 0, sizeof(*m));
    return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: this build has no CUDA kernels");
}
void fr_pmem_close(fr_pmem_t *m)
{
    if (m)
        memset(m, 0, sizeof(*m));
}
#endif
