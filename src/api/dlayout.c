/*
 * ferry_dispatch_layout: a routing's layout on its own (DeepEP's
 * get_dispatch_layout), no context. Arguments checked here, then the host
 * loop or the CUDA kernel.
 */
#include "api/api.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "core/layout.h"
#include "engines/cpu_ht/cpu_ht.h"
#include "engines/cuda_ht/cuda_ht.h"

static int fr_dl_check(const ferry_layout_args_t *a, fr_err_t *err)
{
    if (!a)
        return FR_ERR(err, FERRY_ERR_INVALID, "args: NULL pointer");
    size_t first = offsetof(ferry_layout_args_t, ranks_per_node); /* the first version's */
    if (a->size < first || (a->size > first && a->size < sizeof(*a)))
        return FR_ERR(err, FERRY_ERR_INVALID, "args->size = %zu: set it to "
                      "sizeof(ferry_layout_args_t) (%zu)", a->size, sizeof(*a));
    int rpn = a->size >= sizeof(*a) ? a->ranks_per_node : 0;
    if (rpn < 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "ranks_per_node = %d: must be >= 0 (0: no "
                      "per-node counts)", rpn);
    if (rpn > 0 && !a->tokens_per_node)
        return FR_ERR(err, FERRY_ERR_INVALID, "tokens_per_node: NULL pointer "
                      "(ranks_per_node = %d)", rpn);
    if (a->device != FERRY_DEVICE_CPU && a->device != FERRY_DEVICE_CUDA)
        return FR_ERR(err, FERRY_ERR_INVALID, "device = %d: unknown", (int)a->device);
    if (a->num_tokens < 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "num_tokens = %d: must be >= 0", a->num_tokens);
    if (a->topk < 1 || a->topk > FR_MAX_TOPK)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk = %d: must be 1..%d", a->topk,
                      FR_MAX_TOPK);
    if (a->num_ranks < 1 || a->num_ranks > FR_MAX_RANKS)
        return FR_ERR(err, FERRY_ERR_INVALID, "num_ranks = %d: must be 1..%d", a->num_ranks,
                      FR_MAX_RANKS);
    if (a->num_experts < 1 || a->num_experts % a->num_ranks)
        return FR_ERR(err, FERRY_ERR_INVALID, "num_experts = %d: must be a positive "
                      "multiple of num_ranks (%d)", a->num_experts, a->num_ranks);
    if (!a->tokens_per_rank)
        return FR_ERR(err, FERRY_ERR_INVALID, "tokens_per_rank: NULL pointer");
    if (!a->tokens_per_expert)
        return FR_ERR(err, FERRY_ERR_INVALID, "tokens_per_expert: NULL pointer");
    if (a->num_tokens > 0 && !a->topk_idx)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk_idx: NULL pointer (num_tokens = %d)",
                      a->num_tokens);
    if (a->num_tokens > 0 && !a->token_in_rank)
        return FR_ERR(err, FERRY_ERR_INVALID, "token_in_rank: NULL pointer (num_tokens = %d)",
                      a->num_tokens);
    return FERRY_OK;
}

int ferry_dispatch_layout(const ferry_layout_args_t *args, char *errbuf, size_t errlen)
{
    fr_err_t err = {{0}};
    int rc = fr_dl_check(args, &err);
    if (rc == FERRY_OK) {
        /* the fields past an older caller's struct read as 0 */
        ferry_layout_args_t a = {0};
        memcpy(&a, args, args->size < sizeof(a) ? args->size : sizeof(a));
        a.size = sizeof(a);
        rc = a.device == FERRY_DEVICE_CPU ? fr_cpuht_dispatch_layout(&a)
                                          : fr_cuht_dispatch_layout(&a, &err);
    }
    if (errbuf && errlen)
        snprintf(errbuf, errlen, "%s", rc == FERRY_OK ? "" : err.msg);
    return rc;
}
