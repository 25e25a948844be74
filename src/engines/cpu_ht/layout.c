/* ferry_dispatch_layout on the host (the arguments were checked). */
#include <string.h>

#include "core/dlayout.h"
#include "engines/cpu_ht/cpu_ht.h"

int fr_cpuht_dispatch_layout(const ferry_layout_args_t *a)
{
    int T = a->num_tokens, K = a->topk, E = a->num_experts, N = a->num_ranks, El = E / N;
    memset(a->tokens_per_rank, 0, sizeof(int32_t) * (size_t)N);
    memset(a->tokens_per_expert, 0, sizeof(int32_t) * (size_t)E);
    if (T > 0)
        memset(a->token_in_rank, 0, (size_t)T * (size_t)N);
    int rpn = a->ranks_per_node, M = rpn > 0 ? (N + rpn - 1) / rpn : 0;
    if (M > 0)
        memset(a->tokens_per_node, 0, sizeof(int32_t) * (size_t)M);
    for (int t = 0; t < T; t++) {
        const int64_t *row = a->topk_idx + (size_t)t * K;
        int d[FR_MAX_TOPK];
        int n = fr_dl_ranks(row, K, E, El, d);
        for (int i = 0; i < n; i++) {
            a->tokens_per_rank[d[i]]++;
            a->token_in_rank[(size_t)t * N + d[i]] = 1;
        }
        if (M > 0) {
            int b[FR_MAX_TOPK];
            int nb = fr_dl_nodes(d, n, rpn, b);
            for (int i = 0; i < nb; i++)
                a->tokens_per_node[b[i]]++;
        }
        for (int k = 0; k < K; k++)
            if (row[k] >= 0 && row[k] < E)
                a->tokens_per_expert[row[k]]++;
    }
    return FERRY_OK;
}
