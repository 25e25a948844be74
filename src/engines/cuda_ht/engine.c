/* The CUDA high-throughput engine's table (kernels and launchers in the
 * .cu files, or the stubs of a build without nvcc in stub.c). */
#include "engines/cuda_ht/cuda_ht.h"

const fr_engine_t fr_engine_cuda_ht = {
    .size = sizeof(fr_engine_t),
    .name = "cuda_ht",
    .device = FERRY_DEVICE_CUDA,
    .mode = FERRY_MODE_HIGH_THROUGHPUT,
    .setup = fr_cuht_setup,
    .free = fr_cuht_free,
    /* no round calls: the API refuses them on this mode (api/round.c) */
    .sync = fr_cuht_sync,
    .check = fr_cuht_check,
    .route_create = fr_cuht_route_create,
    .route_free = fr_cuht_route_free,
    .ht_dispatch = fr_cuht_dispatch,
    .ht_combine = fr_cuht_combine,
    /* peers on the fabric path: from GPU memory registered with the
     * provider where every rank can (fab.c), else through host copies
     * (engines/staged) */
    .fabric_engine = &fr_engine_staged_ht,
    .fabric_native = fr_cuht_fabric_native,
    .fabric_up = fr_cuht_fabric_up,
};
