/* The CUDA low-latency engine's table (launchers in dispatch.cu,
 * combine.cu, setup.cu and mask.cu, or the stubs of a build without nvcc
 * in stub.c). */
#include "engines/cuda_ll/cuda_ll.h"

const fr_engine_t fr_engine_cuda_ll = {
    .size = sizeof(fr_engine_t),
    .name = "cuda_ll",
    .device = FERRY_DEVICE_CUDA,
    .mode = FERRY_MODE_LOW_LATENCY,
    .setup = fr_cuda_setup,
    .free = fr_cuda_free,
    .dispatch_send = fr_cuda_dispatch_send,
    .dispatch_recv = fr_cuda_dispatch_recv,
    .combine_send = fr_cuda_combine_send,
    .combine_recv = fr_cuda_combine_recv,
    .combine_signals = 1,
    .combine_logfmt = 1,
    .sync = fr_cuda_sync,
    .check = fr_cuda_check,
    .dispatch = fr_cuda_dispatch,
    .combine = fr_cuda_combine,
    .mask_write = fr_cuda_mask_write,
    .mask_read = fr_cuda_mask_read,
    .mask_pull = fr_cuda_mask_pull,
};
