/*
 * CUDA-rank tests (self-launching; exit 77 = skipped, with the reason).
 *   test_cuda_ep -n N graph     dispatch and combine captured once as CUDA
 *                               graphs and replayed with new inputs and a
 *                               token count read from device memory (the
 *                               send/recv calls, then the one-launch
 *                               ferry_dispatch/ferry_combine)
 *   test_cuda_ep -n 2 timeout   rank 1 never sends: rank 0 gets
 *                               FERRY_ERR_TIMEOUT naming rank 1 within
 *                               FERRY_TIMEOUT_MS + 2 s, and its CUDA context
 *                               still works afterwards
 *   test_cuda_ep -n N kill      rank 1 dies after the context is made: the
 *                               other ranks' round fails naming rank 1
 *                               (FERRY_ERR_PEER or _TIMEOUT) in the same time
 *   test_cuda_ep -n N twin      CUDA kernels against the CPU twins on the
 *                               same inputs (fp8 and bf16; the one-launch
 *                               ferry_dispatch/ferry_combine)
 *   test_cuda_ep -n 1 badidx    ferry_dispatch/ferry_combine refuse a NULL
 *                               out and two streams, then run a good round;
 *                               an expert index out of range found on the
 *                               GPU comes back as FERRY_ERR_INVALID and
 *                               leaves the context failed
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "harness.h"
#include "launch.h"
#include "workload.h"

#ifndef FERRY_HAVE_CUDA
int main(void)
{
    printf("skipped: this build has no CUDA (nvcc was not found)\n");
    return 77;
}
#else
#include <cuda_runtime_api.h>

#define CU(call)                                                               \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,      \
                    cudaGetErrorString(e_));                                   \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

typedef struct bufs {
    void *x, *idx, *w, *out, *ex, *exs, *cnt, *sr, *st, *ey, *ntok;
    uint8_t *hex;
    float *hexs;
    int32_t *hcnt, *hsr, *hst;
    uint16_t *hey, *hout;
} bufs_t;

static void bufs_init(bufs_t *b, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    size_t T = (size_t)s->T, El = (size_t)lay->num_local_experts, cap = (size_t)lay->expert_capacity;
    CU(cudaMalloc(&b->x, T * s->H * 2));
    CU(cudaMalloc(&b->idx, T * s->K * 8));
    CU(cudaMalloc(&b->w, T * s->K * 4));
    CU(cudaMalloc(&b->out, T * s->H * 2));
    CU(cudaMalloc(&b->ex, lay->expert_x_bytes + 16));
    CU(cudaMalloc(&b->exs, lay->expert_scales_bytes + 16));
    CU(cudaMalloc(&b->cnt, El * 4));
    CU(cudaMalloc(&b->sr, El * cap * 4));
    CU(cudaMalloc(&b->st, El * cap * 4));
    CU(cudaMalloc(&b->ey, lay->expert_y_bytes + 16));
    CU(cudaMalloc(&b->ntok, 4));
    b->hex = malloc(lay->expert_x_bytes + 16);
    b->hexs = malloc(lay->expert_scales_bytes + 16);
    b->hcnt = malloc(El * 4);
    b->hsr = malloc(El * cap * 4);
    b->hst = malloc(El * cap * 4);
    b->hey = calloc(lay->expert_y_bytes / 2 + 8, 2);
    b->hout = malloc(T * s->H * 2 + 16);
}

/* An EP for a workload spec (num_sms 0: the default); NULL, with a failed
 * CHECK, when create fails. */
static ferry_ep_t spec_ep(ferry_comm_t comm, const fw_spec_t *s,
                          ferry_device_t dev, int num_sms)
{
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = s->E;
    cfg.topk = s->K;
    cfg.hidden = s->H;
    cfg.max_tokens = s->T;
    cfg.dispatch_dtype = s->fp8 ? FERRY_DTYPE_FP8_E4M3 : FERRY_DTYPE_BF16;
    cfg.device = dev;
    cfg.num_sms = num_sms;
    cfg.dp_size = s->dp;
    ferry_ep_t ep = NULL;
    int rc = ferry_ep_create(comm, &cfg, &ep);
    CHECK(rc == FERRY_OK, "%s create: %s", dev == FERRY_DEVICE_CUDA ? "gpu" : "cpu",
          ferry_comm_last_error(comm));
    return rc == FERRY_OK ? ep : NULL;
}

/* A cudaMemcpy from pageable host memory can return before its DMA is
 * done, and the context's kernels run on non-blocking streams, which do
 * not wait for it: wait for the legacy stream before they read. */
static cudaError_t h2d_done(void)
{
    return cudaStreamSynchronize(cudaStreamLegacy);
}

/* A round's inputs to the GPU (x, topk_idx and the weights, s->T rows),
 * in place before any kernel reads them. */
static void inputs_to_gpu(const bufs_t *b, const fw_spec_t *s, const fw_input_t *in)
{
    CU(cudaMemcpy(b->x, in->x, (size_t)s->T * s->H * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(b->idx, in->idx, (size_t)s->T * s->K * 8, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(b->w, in->w, (size_t)s->T * s->K * 4, cudaMemcpyHostToDevice));
    CU(h2d_done());
}

static int run_graph(ferry_comm_t comm, int one_call)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    int E = 4 * N, K = 4, H = 256, T = 24;
    fw_spec_t s = {.N = N, .E = E, .K = K, .H = H, .T = T, .fp8 = 1, .zipf_s = 1.2,
                   .mask_p = 0.1, .vary_tokens = 1, .empty_p = 0.2, .seed = 21};
    /* FERRY_TEST_DP=G: DP groups of G, every round the group's T tokens
     * (the split needs T on the host: no num_tokens_dev) */
    int dp = getenv("FERRY_TEST_DP") ? atoi(getenv("FERRY_TEST_DP")) : 0;
    if (dp > 1) {
        s.dp = dp;
        s.vary_tokens = 0;
    }
    ferry_ep_t ep = spec_ep(comm, &s, FERRY_DEVICE_CUDA, 4);
    if (!ep)
        return 1;
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    size_t cap = (size_t)lay.expert_capacity, El = (size_t)lay.num_local_experts;
    bufs_t b;
    bufs_init(&b, &s, &lay);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = dp > 1 ? T : 0, .x = b.x,
                               .topk_idx = b.idx, .stream = st,
                               .num_tokens_dev = dp > 1 ? NULL : b.ntok};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b.ex,
                                 .expert_x_scales = b.exs, .expert_num_tokens = b.cnt,
                                 .expert_src_rank = b.sr, .expert_src_token = b.st,
                                 .stream = st};
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b.ey, .stream = st};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = b.w, .out = b.out,
                                .stream = st};
    if (getenv("FERRY_TEST_STREAM_REFUSED")) {
        /* a provider copying on the legacy stream (shm with GPU memory):
         * the legacy stream is refused, naming the argument, and the
         * context stays usable (the replays below) */
        ferry_dispatch_in_t bad = din;
        bad.stream = NULL;
        uint64_t r0 = 0;
        rc = ferry_dispatch_send(ep, &bad, &r0);
        printf("rank %d: legacy stream: %s: %s\n", me, ferry_strerror(rc), ferry_ep_last_error(ep));
        CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "in->stream"),
              "legacy stream with a copying provider: status %d, want FERRY_ERR_INVALID "
              "naming in->stream", rc);
    }
    /* capture */
    cudaGraph_t g1, g2;
    cudaGraphExec_t x1, x2;
    uint64_t round = 0;
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    if (one_call) {
        rc = ferry_dispatch(ep, &din, &dout, &round);
        CHECK(rc == FERRY_OK, "capture dispatch: %s", ferry_ep_last_error(ep));
    } else {
        rc = ferry_dispatch_send(ep, &din, &round);
        CHECK(rc == FERRY_OK, "capture dispatch_send: %s", ferry_ep_last_error(ep));
        rc = ferry_dispatch_recv(ep, round, &dout);
        CHECK(rc == FERRY_OK, "capture dispatch_recv: %s", ferry_ep_last_error(ep));
    }
    CU(cudaStreamEndCapture(st, &g1));
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    if (one_call) {
        rc = ferry_combine(ep, round, &cin, &cout);
        CHECK(rc == FERRY_OK, "capture combine: %s", ferry_ep_last_error(ep));
    } else {
        rc = ferry_combine_send(ep, round, &cin);
        CHECK(rc == FERRY_OK, "capture combine_send: %s", ferry_ep_last_error(ep));
        rc = ferry_combine_recv(ep, round, &cout);
        CHECK(rc == FERRY_OK, "capture combine_recv: %s", ferry_ep_last_error(ep));
    }
    CU(cudaStreamEndCapture(st, &g2));
    CU(cudaGraphInstantiate(&x1, g1, 0));
    CU(cudaGraphInstantiate(&x2, g2, 0));
    fw_input_t in;
    fw_input_alloc(&s, &in);
    long wrong = 0;
    int replays = 50;
    for (int it = 1; it <= replays; it++) {
        fw_generate(&s, (uint64_t)it, me, &in);
        int32_t nt = in.T;
        CU(cudaMemcpy(b.ntok, &nt, 4, cudaMemcpyHostToDevice));
        inputs_to_gpu(&b, &s, &in);
        CU(cudaGraphLaunch(x1, st));
        rc = ferry_ep_sync(ep, st);
        CHECK(rc == FERRY_OK, "replay %d dispatch: %s", it, ferry_ep_last_error(ep));
        if (rc)
            break;
        CU(cudaMemcpy(b.hcnt, b.cnt, El * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hex, b.ex, lay.expert_x_bytes, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hexs, b.exs, lay.expert_scales_bytes, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hsr, b.sr, El * cap * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hst, b.st, El * cap * 4, cudaMemcpyDeviceToHost));
        wrong += fw_check_dispatch(&s, (uint64_t)it, me, b.hex, b.hexs, b.hcnt, b.hsr,
                                   b.hst, cap, 3);
        fw_run_experts(&s, me, b.hex, b.hexs, b.hcnt, cap, b.hey);
        CU(cudaMemcpy(b.ey, b.hey, lay.expert_y_bytes, cudaMemcpyHostToDevice));
        CU(h2d_done());
        ferry_comm_barrier(comm); /* peers' inputs are in place */
        CU(cudaGraphLaunch(x2, st));
        rc = ferry_ep_sync(ep, st);
        CHECK(rc == FERRY_OK, "replay %d combine: %s", it, ferry_ep_last_error(ep));
        if (rc)
            break;
        CU(cudaMemcpy(b.hout, b.out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
        wrong += fw_check_combine(&s, (uint64_t)it, me, &in, b.hout, 3);
    }
    CHECK(wrong == 0, "%ld wrong after graph replays", wrong);
    printf("rank %d: %d graph replays (%s%s), %ld wrong\n", me, replays,
           one_call ? "ferry_dispatch/ferry_combine" : "send/recv calls",
           dp > 1 ? ", DP groups" : "", wrong);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    return fr_test_result();
}

/* The CUDA kernels against their CPU twins: one CPU context and one CUDA
 * context on the same communicator run the same rounds; dispatch must be
 * byte-identical (rows, scales, counts, sources), combine within one bf16
 * rounding of each other. */
static int run_twin(ferry_comm_t comm, int fp8)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm);
    int E = 8 * N, K = 8, H = 1024, T = 48;
    fw_spec_t s = {.N = N, .E = E, .K = K, .H = H, .T = T, .fp8 = fp8, .zipf_s = 1.2,
                   .mask_p = 0.1, .vary_tokens = 1, .empty_p = 0.2, .seed = 77};
    ferry_ep_t cpu = spec_ep(comm, &s, FERRY_DEVICE_CPU, 0);
    ferry_ep_t gpu = spec_ep(comm, &s, FERRY_DEVICE_CUDA, 8);
    if (!cpu || !gpu)
        return 1;
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(gpu, &lay);
    size_t cap = (size_t)lay.expert_capacity, El = (size_t)lay.num_local_experts;
    bufs_t b;
    bufs_init(&b, &s, &lay);
    uint8_t *cex = calloc(lay.expert_x_bytes + 16, 1);
    float *cexs = calloc(lay.expert_scales_bytes / 4 + 4, 4);
    int32_t *ccnt = calloc(El, 4), *csr = calloc(El * cap, 4), *cst = calloc(El * cap, 4);
    uint16_t *cout_ = calloc((size_t)T * H, 2);
    fw_input_t in;
    fw_input_alloc(&s, &in);
    long bad_disp = 0, bad_comb = 0;
    for (int it = 1; it <= 20; it++) {
        fw_generate(&s, (uint64_t)it, me, &in);
        if (it % 4 == 0 && in.T > 1) {
            /* non-finite inputs: quantised the same way on both (quant.h) */
            uint16_t *x = (uint16_t *)in.x;
            x[5] = 0x7f80;                     /* +Inf */
            x[300] = 0xff80;                   /* -Inf */
            x[(size_t)H + 700] = 0x7fc0;       /* NaN */
        }
        /* CPU twin */
        ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T, .x = in.x,
                                   .topk_idx = in.idx};
        ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = cex,
                                     .expert_x_scales = cexs, .expert_num_tokens = ccnt,
                                     .expert_src_rank = csr, .expert_src_token = cst};
        uint64_t r;
        CHECK_RC(ferry_dispatch(cpu, &din, &dout, &r), FERRY_OK);
        fw_run_experts(&s, me, cex, cexs, ccnt, cap, b.hey);
        ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b.hey};
        ferry_combine_out_t co = {.size = sizeof(co), .topk_weights = in.w, .out = cout_};
        CHECK_RC(ferry_combine(cpu, r, &cin, &co), FERRY_OK);
        /* CUDA kernels on the same inputs */
        inputs_to_gpu(&b, &s, &in);
        ferry_dispatch_in_t gdin = {.size = sizeof(gdin), .num_tokens = in.T, .x = b.x,
                                    .topk_idx = b.idx};
        ferry_dispatch_out_t gdout = {.size = sizeof(gdout), .expert_x = b.ex,
                                      .expert_x_scales = b.exs, .expert_num_tokens = b.cnt,
                                      .expert_src_rank = b.sr, .expert_src_token = b.st};
        CHECK_RC(ferry_dispatch(gpu, &gdin, &gdout, &r), FERRY_OK);
        CHECK_RC(ferry_ep_sync(gpu, NULL), FERRY_OK);
        CU(cudaMemcpy(b.hcnt, b.cnt, El * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hex, b.ex, lay.expert_x_bytes, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hexs, b.exs, lay.expert_scales_bytes, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hsr, b.sr, El * cap * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b.hst, b.st, El * cap * 4, cudaMemcpyDeviceToHost));
        if (memcmp(b.hcnt, ccnt, El * 4) != 0)
            bad_disp++;
        for (size_t le = 0; le < El; le++) {
            size_t n = (size_t)ccnt[le], o = le * cap;
            if (n > cap)
                n = cap;
            if (memcmp(b.hex + o * lay.token_bytes, cex + o * lay.token_bytes, n * lay.token_bytes) ||
                memcmp(b.hexs + o * lay.num_scales, cexs + o * lay.num_scales, n * lay.num_scales * 4) ||
                memcmp(b.hsr + o, csr + o, n * 4) || memcmp(b.hst + o, cst + o, n * 4))
                bad_disp++;
        }
        CU(cudaMemcpy(b.ey, b.hey, lay.expert_y_bytes, cudaMemcpyHostToDevice));
        CU(h2d_done());
        ferry_combine_in_t gcin = {.size = sizeof(gcin), .expert_y = b.ey};
        ferry_combine_out_t gco = {.size = sizeof(gco), .topk_weights = b.w, .out = b.out};
        CHECK_RC(ferry_combine(gpu, r, &gcin, &gco), FERRY_OK);
        CHECK_RC(ferry_ep_sync(gpu, NULL), FERRY_OK);
        CU(cudaMemcpy(b.hout, b.out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < (size_t)in.T * H; i++) {
            /* one bf16 rounding apart, plus fp32 summation-order noise
             * near zero (the GPU contracts multiply-adds into FMAs) */
            uint32_t ug = (uint32_t)b.hout[i] << 16, uc = (uint32_t)cout_[i] << 16;
            float g, c;
            memcpy(&g, &ug, 4);
            memcpy(&c, &uc, 4);
            float m = fabsf(g) > fabsf(c) ? fabsf(g) : fabsf(c);
            if (!(g == c || (isnan(g) && isnan(c)) ||
                  fabsf(g - c) <= m * (1.0f / 128) + 1e-3f)) {
                if (bad_comb++ < 3)
                    fprintf(stderr, "rank %d round %d: out[%zu] gpu 0x%04x cpu 0x%04x\n", me,
                            it, i, b.hout[i], cout_[i]);
            }
        }
    }
    printf("rank %d: %s twin: %ld dispatch mismatches, %ld combine values more than one bf16 rounding apart\n",
           me, fp8 ? "fp8" : "bf16", bad_disp, bad_comb);
    CHECK(bad_disp == 0, "dispatch differs from the CPU twin");
    CHECK(bad_comb == 0, "combine differs from the CPU twin by more than one bf16 ulp");
    ferry_ep_destroy(gpu);
    ferry_ep_destroy(cpu);
    return fr_test_result();
}

/* Rank 1 stays silent (kill 0) or dies (kill 1) after the context is
 * made; rank 0's round fails within the timeout naming rank 1. */
static int run_timeout(ferry_comm_t comm, int kill)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    fw_spec_t s = {.N = N, .E = 2 * N, .K = 2, .H = 128, .T = 8, .seed = 3};
    ferry_ep_t ep = spec_ep(comm, &s, FERRY_DEVICE_CUDA, 0);
    if (!ep)
        return 1;
    long timeout = strtol(getenv("FERRY_TIMEOUT_MS") ? getenv("FERRY_TIMEOUT_MS") : "30000", NULL, 10);
    if (kill) {
        ferry_comm_barrier(comm); /* every context made */
        if (me == 1)
            _exit(0); /* no destroy, no goodbye */
    } else if (me == 1) {
        /* stay alive but silent until rank 0 is done */
        ferry_comm_barrier(comm);
        ferry_ep_destroy(ep);
        return 0;
    }
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    bufs_t b;
    bufs_init(&b, &s, &lay);
    fw_input_t in;
    fw_input_alloc(&s, &in);
    fw_generate(&s, 1, me, &in);
    inputs_to_gpu(&b, &s, &in);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T, .x = b.x,
                               .topk_idx = b.idx, .stream = st};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b.ex,
                                 .expert_num_tokens = b.cnt, .stream = st};
    uint64_t round;
    double t0 = now_ms();
    rc = ferry_dispatch_send(ep, &din, &round);
    CHECK(rc == FERRY_OK, "send: %s", ferry_ep_last_error(ep));
    rc = ferry_dispatch_recv(ep, round, &dout);
    if (rc == FERRY_OK)
        rc = ferry_ep_sync(ep, st);
    double dt = now_ms() - t0;
    printf("rank 0: %s after %.0f ms: %s\n", ferry_strerror(rc), dt, ferry_ep_last_error(ep));
    if (kill)
        CHECK(rc == FERRY_ERR_TIMEOUT || rc == FERRY_ERR_PEER,
              "status %d, want FERRY_ERR_PEER or FERRY_ERR_TIMEOUT", rc);
    else
        CHECK(rc == FERRY_ERR_TIMEOUT, "status %d, want FERRY_ERR_TIMEOUT", rc);
    CHECK(strstr(ferry_ep_last_error(ep), "rank 1") != NULL, "message names rank 1");
    CHECK(dt <= timeout + 2000.0, "%.0f ms > timeout + 2 s", dt);
    /* the CUDA context survived: a plain copy still works */
    int v = 7, back = 0;
    CHECK(cudaMemcpy(b.ntok, &v, 4, cudaMemcpyHostToDevice) == cudaSuccess, "context dead");
    CHECK(cudaMemcpy(&back, b.ntok, 4, cudaMemcpyDeviceToHost) == cudaSuccess && back == 7,
          "context dead");
    if (!kill)
        ferry_comm_barrier(comm);
    ferry_ep_destroy(ep);
    return fr_test_result();
}

/* Wait costs on the GPU: the last rank starts each phase 100 ms late;
 * every other rank's cost for it (SM clock cycles, at least 1 GHz) shows
 * that wait, and its cost for itself stays below it. One-launch dispatch,
 * two-launch combine (the receive parts are the same code either way). */
static int run_waitcost(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    fw_spec_t s = {.N = N, .E = 4 * N, .K = 3, .H = 256, .T = 16, .fp8 = 1, .seed = 9};
    ferry_ep_t ep = spec_ep(comm, &s, FERRY_DEVICE_CUDA, 4);
    if (!ep)
        return 1;
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    bufs_t b;
    bufs_init(&b, &s, &lay);
    fw_input_t in;
    fw_input_alloc(&s, &in);
    fw_generate(&s, 1, me, &in);
    inputs_to_gpu(&b, &s, &in);
    int64_t *dc = NULL, *cc = NULL;
    CU(cudaMalloc((void **)&dc, (size_t)N * 8));
    CU(cudaMalloc((void **)&cc, (size_t)N * 8));
    CU(cudaMemset(dc, 0, (size_t)N * 8));
    CU(cudaMemset(cc, 0, (size_t)N * 8));
    CU(h2d_done()); /* the memsets too: the kernels' stream does not wait for them */
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T, .x = b.x,
                               .topk_idx = b.idx, .stream = st};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b.ex,
                                 .expert_x_scales = b.exs, .expert_num_tokens = b.cnt,
                                 .stream = st, .wait_cost = dc};
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b.ey, .stream = st};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = b.w, .out = b.out,
                                .stream = st, .wait_cost = cc};
    int late = N - 1;
    uint64_t round = 0;
    if (me == late)
        usleep(100000);
    rc = ferry_dispatch(ep, &din, &dout, &round);
    if (rc == FERRY_OK)
        rc = ferry_ep_sync(ep, st);
    CHECK(rc == FERRY_OK, "dispatch: %s", ferry_ep_last_error(ep));
    size_t cap = (size_t)lay.expert_capacity, El = (size_t)lay.num_local_experts;
    CU(cudaMemcpy(b.hcnt, b.cnt, El * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(b.hex, b.ex, lay.expert_x_bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(b.hexs, b.exs, lay.expert_scales_bytes, cudaMemcpyDeviceToHost));
    long wrong = fw_check_dispatch(&s, 1, me, b.hex, b.hexs, b.hcnt, NULL, NULL, cap, 3);
    fw_run_experts(&s, me, b.hex, b.hexs, b.hcnt, cap, b.hey);
    CU(cudaMemcpy(b.ey, b.hey, lay.expert_y_bytes, cudaMemcpyHostToDevice));
    CU(h2d_done());
    if (me == late)
        usleep(100000);
    rc = ferry_combine_send(ep, round, &cin);
    if (rc == FERRY_OK)
        rc = ferry_combine_recv(ep, round, &cout);
    if (rc == FERRY_OK)
        rc = ferry_ep_sync(ep, st);
    CHECK(rc == FERRY_OK, "combine: %s", ferry_ep_last_error(ep));
    CU(cudaMemcpy(b.hout, b.out, (size_t)s.T * s.H * 2, cudaMemcpyDeviceToHost));
    wrong += fw_check_combine(&s, 1, me, &in, b.hout, 3);
    CHECK(wrong == 0, "%ld wrong", wrong);
    int64_t hd[64], hc[64];
    int n = N < 64 ? N : 64;
    CU(cudaMemcpy(hd, dc, (size_t)n * 8, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hc, cc, (size_t)n * 8, cudaMemcpyDeviceToHost));
    printf("rank %d: wait cycles for rank %d: dispatch %lld, combine %lld; own %lld, %lld\n",
           me, late, (long long)hd[late % 64], (long long)hc[late % 64],
           (long long)hd[me % 64], (long long)hc[me % 64]);
    for (int i = 0; i < n; i++)
        CHECK(hd[i] >= 0 && hc[i] >= 0, "negative wait cost for rank %d", i);
    if (me != late && late < 64) {
        CHECK(hd[late] >= 50000000 && hc[late] >= 50000000,
              "wait cycles for the late rank: %lld / %lld, want >= 5e7 (100 ms)",
              (long long)hd[late], (long long)hc[late]);
        CHECK(hd[me] < hd[late] && hc[me] < hc[late], "own wait cycles not below the late rank's");
        CHECK(hc[me] > 0, "combine: own wait not recorded");
    }
    cudaFree(dc);
    cudaFree(cc);
    ferry_ep_destroy(ep);
    return fr_test_result();
}

static int run_badidx(ferry_comm_t comm)
{
    int rc;
    fw_spec_t s = {.N = 1, .E = 8, .K = 2, .H = 128, .T = 8, .seed = 4};
    ferry_ep_t ep = spec_ep(comm, &s, FERRY_DEVICE_CUDA, 0);
    if (!ep)
        return 1;
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    bufs_t b;
    bufs_init(&b, &s, &lay);
    fw_input_t in;
    fw_input_alloc(&s, &in);
    fw_generate(&s, 1, 0, &in);
    inputs_to_gpu(&b, &s, &in);
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = s.T, .x = b.x, .topk_idx = b.idx};
    uint64_t round;
    /* the one-launch calls' own checks, then a good round on the same context */
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b.ex,
                                 .expert_x_scales = b.exs, .expert_num_tokens = b.cnt,
                                 .stream = st};
    CHECK_RC(ferry_dispatch(ep, &din, NULL, &round), FERRY_ERR_INVALID);
    CHECK(strstr(ferry_ep_last_error(ep), "out") != NULL, "message names out: %s",
          ferry_ep_last_error(ep));
    CHECK_RC(ferry_dispatch(ep, &din, &dout, &round), FERRY_ERR_INVALID);
    CHECK(strstr(ferry_ep_last_error(ep), "out->stream") != NULL, "message names out->stream: %s",
          ferry_ep_last_error(ep));
    dout.stream = NULL;
    CHECK_RC(ferry_dispatch(ep, &din, &dout, &round), FERRY_OK);
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b.ey, .stream = st};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = b.w, .out = b.out};
    CHECK_RC(ferry_combine(ep, round, &cin, &cout), FERRY_ERR_INVALID);
    CHECK(strstr(ferry_ep_last_error(ep), "out->stream") != NULL, "message names out->stream: %s",
          ferry_ep_last_error(ep));
    cin.stream = NULL;
    CHECK_RC(ferry_combine(ep, round, &cin, NULL), FERRY_ERR_INVALID);
    CHECK_RC(ferry_combine(ep, round, &cin, &cout), FERRY_OK);
    CHECK_RC(ferry_ep_sync(ep, NULL), FERRY_OK);
    cudaStreamDestroy(st);
    in.idx[5] = 8; /* out of range */
    CU(cudaMemcpy(b.idx, in.idx, (size_t)s.T * s.K * 8, cudaMemcpyHostToDevice));
    CU(h2d_done());
    rc = ferry_dispatch_send(ep, &din, &round);
    if (rc == FERRY_OK)
        rc = ferry_ep_sync(ep, NULL);
    printf("bad index: %s: %s\n", ferry_strerror(rc), ferry_ep_last_error(ep));
    CHECK(rc == FERRY_ERR_INVALID, "status %d, want FERRY_ERR_INVALID", rc);
    CHECK(strstr(ferry_ep_last_error(ep), "topk_idx") != NULL &&
              strstr(ferry_ep_last_error(ep), "the context is failed") != NULL,
          "message names topk_idx and says the context is failed");
    /* the kernels stop at the error word: every later call says so */
    in.idx[5] = 0;
    CU(cudaMemcpy(b.idx, in.idx, (size_t)s.T * s.K * 8, cudaMemcpyHostToDevice));
    CU(h2d_done());
    rc = ferry_dispatch_send(ep, &din, &round);
    CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "cannot be used"),
          "the call after: %s: %s", ferry_strerror(rc), ferry_ep_last_error(ep));
    ferry_ep_destroy(ep);
    return fr_test_result();
}

int main(int argc, char **argv)
{
    int n = argc >= 3 ? atoi(argv[2]) : 1;
    const char *mode = argc >= 4 ? argv[3] : "graph";
    /* CUDA must not be initialised before fork: the ranks check. */
    int is_child = 0;
    fr_err_t err = {{0}};
    int rc = fr_launch_local(n, &is_child, &err);
    if (!is_child) {
        if (rc == 77) {
            printf("skipped: no usable GPU (see the ranks' message above)\n");
            return 77;
        }
        printf("test_cuda_ep %s: %s\n", mode, rc == 0 ? "passed" : "FAILED");
        return rc != 0;
    }
    char why[256];
    if (!ferry_cuda_available(why, sizeof(why))) {
        printf("skipped: %s\n", why);
        return 77;
    }
    char ebuf[512];
    ferry_comm_t comm;
    if (ferry_comm_init_env(&comm, ebuf, sizeof(ebuf)) != FERRY_OK) {
        fprintf(stderr, "comm: %s\n", ebuf);
        return 1;
    }
    if (strcmp(mode, "timeout") == 0 || strcmp(mode, "kill") == 0)
        rc = run_timeout(comm, mode[0] == 'k');
    else if (strcmp(mode, "badidx") == 0)
        rc = run_badidx(comm);
    else if (strcmp(mode, "waitcost") == 0)
        rc = run_waitcost(comm);
    else if (strcmp(mode, "twin") == 0)
        rc = run_twin(comm, 1) | run_twin(comm, 0);
    else
        rc = run_graph(comm, 0) | run_graph(comm, 1);
    ferry_comm_destroy(comm);
    return rc;
}
#endif
