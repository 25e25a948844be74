/* ferry_dispatch_layout on the host: bad arguments named; counts checked
 * against a loop written here over Zipf-like, masked, out-of-range and
 * same-rank slots, for several world sizes (with a rank no token picks). */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "harness.h"

static void expect(const ferry_layout_args_t *a, int want, const char *needle)
{
    char msg[512];
    int rc = ferry_dispatch_layout(a, msg, sizeof(msg));
    CHECK(rc == want && strstr(msg, needle), "want %d naming '%s': rc %d, '%s'\n", want,
          needle, rc, msg);
}

static void args(void)
{
    int64_t idx[4] = {0, 1, 2, 3};
    int32_t pr[2], pe[8];
    uint8_t in[4];
    ferry_layout_args_t a = {sizeof(a), FERRY_DEVICE_CPU, 2, 2, 8, 2, idx, pr, pe, in, NULL, 0, NULL};
    expect(&a, FERRY_OK, "");
    ferry_layout_args_t b = a;
    b.size = 8;
    expect(&b, FERRY_ERR_INVALID, "args->size");
    b = a, b.topk = 17;
    expect(&b, FERRY_ERR_INVALID, "topk = 17");
    b = a, b.num_experts = 7;
    expect(&b, FERRY_ERR_INVALID, "num_experts = 7");
    b = a, b.num_ranks = 0;
    expect(&b, FERRY_ERR_INVALID, "num_ranks = 0");
    b = a, b.num_tokens = -1;
    expect(&b, FERRY_ERR_INVALID, "num_tokens = -1");
    b = a, b.topk_idx = NULL;
    expect(&b, FERRY_ERR_INVALID, "topk_idx");
    b = a, b.token_in_rank = NULL;
    expect(&b, FERRY_ERR_INVALID, "token_in_rank");
    b = a, b.tokens_per_expert = NULL;
    expect(&b, FERRY_ERR_INVALID, "tokens_per_expert");
    int32_t pn[2];
    b = a, b.ranks_per_node = 1, b.tokens_per_node = NULL;
    expect(&b, FERRY_ERR_INVALID, "tokens_per_node");
    b = a, b.ranks_per_node = -2, b.tokens_per_node = pn;
    expect(&b, FERRY_ERR_INVALID, "ranks_per_node = -2");
    /* a caller built before the per-node fields: its smaller struct is
     * taken, and nothing past it is read */
    b = a, b.size = offsetof(ferry_layout_args_t, ranks_per_node), b.ranks_per_node = 99;
    expect(&b, FERRY_OK, "");
    b = a, b.size = sizeof(a) - 4;
    expect(&b, FERRY_ERR_INVALID, "args->size");
    b = a, b.device = (ferry_device_t)9;
    expect(&b, FERRY_ERR_INVALID, "device = 9");
    CHECK(ferry_dispatch_layout(NULL, NULL, 0) == FERRY_ERR_INVALID, "NULL args\n");
    b = a, b.num_tokens = 0, b.topk_idx = NULL, b.token_in_rank = NULL;
    memset(pr, 0x55, sizeof(pr));
    expect(&b, FERRY_OK, "");
    CHECK(pr[0] == 0 && pr[1] == 0, "T = 0: counts not zeroed\n");
}

/* rpn: ranks per node (0: no per-node counts asked) */
static void counts(int N, int E, int K, int T, int rpn, unsigned seed)
{
    int El = E / N;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)T * K);
    int32_t *pr = malloc(sizeof(int32_t) * N), *pe = malloc(sizeof(int32_t) * E);
    uint8_t *in = malloc((size_t)T * N);
    srand(seed);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int r = rand() % 100;
            /* skewed: the low experts most; some masked or out of range;
             * the last rank's experts never picked */
            int span = N > 1 ? E - El : E;
            int64_t e = r < 8 ? -1 : r < 10 ? E + r : r < 50 ? rand() % 4 : rand() % span;
            idx[(size_t)t * K + k] = e;
        }
    memset(pr, 0x7f, sizeof(int32_t) * N);
    memset(pe, 0x7f, sizeof(int32_t) * E);
    memset(in, 0x7f, (size_t)T * N);
    int M = rpn > 0 ? (N + rpn - 1) / rpn : 0;
    int32_t *pn = malloc(sizeof(int32_t) * (size_t)(M + 1));
    memset(pn, 0x7f, sizeof(int32_t) * (size_t)(M + 1));
    ferry_layout_args_t a = {sizeof(a), FERRY_DEVICE_CPU, T, K, E, N, idx, pr, pe, in, NULL,
                             rpn, rpn > 0 ? pn : NULL};
    CHECK(ferry_dispatch_layout(&a, NULL, 0) == FERRY_OK, "N=%d: rc\n", N);
    long wrong = 0;
    for (int b = 0; b < M; b++) { /* tokens with an expert on a rank of node b */
        int n = 0;
        for (int t = 0; t < T; t++) {
            int go = 0;
            for (int k = 0; k < K; k++) {
                int64_t e = idx[(size_t)t * K + k];
                go |= e >= 0 && e < E && e / El / rpn == b;
            }
            n += go;
        }
        wrong += pn[b] != n;
    }
    wrong += M > 0 && pn[M] != 0x7f7f7f7f; /* nothing past the last node */
    for (int d = 0; d < N; d++) {
        int n = 0;
        for (int t = 0; t < T; t++) {
            int go = 0;
            for (int k = 0; k < K; k++) {
                int64_t e = idx[(size_t)t * K + k];
                go |= e >= 0 && e < E && e / El == d;
            }
            n += go;
            wrong += in[(size_t)t * N + d] != go;
        }
        wrong += pr[d] != n;
    }
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (size_t i = 0; i < (size_t)T * K; i++)
            n += idx[i] == e;
        wrong += pe[e] != n;
    }
    CHECK(wrong == 0 && (N == 1 || pr[N - 1] == 0), "N=%d E=%d K=%d T=%d: %ld wrong\n", N, E, K, T, wrong);
    free(pn);
    free(idx);
    free(pr);
    free(pe);
    free(in);
}

int main(void)
{
    args();
    counts(1, 16, 4, 50, 0, 1);
    counts(2, 16, 8, 300, 1, 2);
    counts(3, 24, 6, 97, 0, 3);
    counts(8, 256, 8, 1000, 4, 4);
    counts(5, 20, 16, 64, 2, 5);   /* nodes of 2, 2 and 1 */
    counts(32, 256, 8, 500, 8, 6); /* 4 nodes of 8 */
    printf("test_dlayout: %d failures\n", fr_test_failures);
    return fr_test_result();
}
