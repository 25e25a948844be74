/*
 * A low-latency round on CPU ranks through the installed library: each
 * rank dispatches its tokens to the experts their top-k names, runs every
 * local expert as "multiply by (1 + global expert id)", combines with
 * weights that do not sum to 1, and checks every output value against the
 * same arithmetic done here. Prints "#wrong N" and exits 1 when N > 0.
 *
 * Build against an installed prefix:
 *   cc hello_ep.c $(pkg-config --cflags --libs ferry) -o hello_ep
 * or with CMake: find_package(ferry) and target_link_libraries(... ferry::ferry).
 * Run one rank (FERRY_RANK=0 FERRY_WORLD_SIZE=1 ./hello_ep), or several
 * under mpirun / srun / torchrun (ferry_comm_init_env reads their
 * variables).
 */
#include <ferry.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { E = 12, K = 2, H = 128, T = 16 }; /* E divides among 1, 2, 3, 4 or 6 ranks */

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define CHECK(call)                                                            \
    do {                                                                       \
        int rc_ = (call);                                                      \
        if (rc_ != FERRY_OK) {                                                 \
            fprintf(stderr, "%s: %s (%s)\n", #call, ferry_strerror(rc_),       \
                    ep ? ferry_ep_last_error(ep) : ferry_comm_last_error(comm)); \
            return 2;                                                          \
        }                                                                      \
    } while (0)

int main(void)
{
    char err[512] = "";
    ferry_comm_t comm;
    ferry_ep_t ep = NULL;
    if (ferry_comm_init_env(&comm, err, sizeof err) != FERRY_OK) {
        fprintf(stderr, "ferry_comm_init_env: %s\n", err);
        return 2;
    }
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = E;
    cfg.topk = K;
    cfg.hidden = H;
    cfg.max_tokens = T;
    CHECK(ferry_ep_create(comm, &cfg, &ep));
    ferry_ep_layout_t lay = {.size = sizeof lay};
    CHECK(ferry_ep_get_layout(ep, &lay));
    int rank = lay.rank, El = lay.num_local_experts;

    uint16_t *x = malloc(sizeof(uint16_t) * T * H);
    int64_t *idx = malloc(sizeof(int64_t) * T * K);
    float *w = malloc(sizeof(float) * T * K);
    uint16_t *ex = malloc(lay.expert_x_bytes), *ey = malloc(lay.expert_y_bytes);
    uint16_t *out = malloc(sizeof(uint16_t) * T * H);
    int32_t *counts = malloc(sizeof(int32_t) * El);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++)
            x[t * H + h] = to_bf16((float)((rank * 7 + t * 3 + h) % 11) - 5);
        idx[t * K] = (t + rank) % E;
        idx[t * K + 1] = t % 3 == 0 ? -1 : (t * 5 + 1 + rank) % E; /* masked slots */
        for (int k = 0; k < K; k++)
            w[t * K + k] = 0.25f + 0.5f * (float)k; /* sums to 1 only by chance */
        if (idx[t * K + 1] == idx[t * K])
            idx[t * K + 1] = -1;
    }

    uint64_t round;
    ferry_dispatch_in_t din = {.size = sizeof din, .num_tokens = T, .x = x, .topk_idx = idx};
    ferry_dispatch_out_t dout = {.size = sizeof dout, .expert_x = ex,
                                 .expert_num_tokens = counts};
    CHECK(ferry_dispatch(ep, &din, &dout, &round));
    /* the local experts: row * (1 + global expert id) */
    for (int le = 0; le < El; le++)
        for (int r = 0; r < counts[le]; r++)
            for (int h = 0; h < H; h++) {
                size_t i = ((size_t)le * lay.expert_capacity + r) * H + h;
                ey[i] = to_bf16(from_bf16(ex[i]) * (float)(1 + rank * El + le));
            }
    ferry_combine_in_t cin = {.size = sizeof cin, .expert_y = ey};
    ferry_combine_out_t cout = {.size = sizeof cout, .topk_weights = w, .out = out};
    CHECK(ferry_combine(ep, round, &cin, &cout));

    long wrong = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            float want = 0;
            for (int k = 0; k < K; k++)
                if (idx[t * K + k] >= 0)
                    want += w[t * K + k] * from_bf16(to_bf16(
                                from_bf16(x[t * H + h]) * (float)(1 + idx[t * K + k])));
            float got = from_bf16(out[t * H + h]);
            wrong += fabsf(got - want) > fabsf(want) / 128 + 1e-3f;
        }
    printf("rank %d of %d: %d tokens, %d local experts, #wrong %ld\n", rank, lay.num_ranks,
           T, El, wrong);
    CHECK(ferry_ep_destroy(ep));
    ep = NULL;
    ferry_comm_destroy(comm);
    free(x), free(idx), free(w), free(ex), free(ey), free(out), free(counts);
    return wrong ? 1 : 0;
}
