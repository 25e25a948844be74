/* The engines, chosen at create by (device, mode): adding one is its
 * folder, its declaration and its line in fr_engines[]. */
#include "engines/engine.h"

extern const fr_engine_t fr_engine_cpu_ll;  /* engines/cpu_ll/ */
extern const fr_engine_t fr_engine_cuda_ll; /* engines/cuda_ll/ */
extern const fr_engine_t fr_engine_cpu_ht;  /* engines/cpu_ht/ */
extern const fr_engine_t fr_engine_cuda_ht; /* engines/cuda_ht/ */

static const fr_engine_t *const fr_engines[] = {
    &fr_engine_cpu_ll,
    &fr_engine_cuda_ll,
    &fr_engine_cpu_ht,
    &fr_engine_cuda_ht,
};

const fr_engine_t *fr_engine_find(ferry_device_t device, ferry_mode_t mode)
{
    for (size_t i = 0; i < sizeof(fr_engines) / sizeof(fr_engines[0]); i++)
        if (fr_engines[i]->device == device && fr_engines[i]->mode == mode)
            return fr_engines[i];
    return NULL;
}
