/*
 * Masking a rank (ferry_ep_mask_rank, ferry_ep_mask_query), on CPU ranks
 * or CUDA ranks (self-launching; exit 77 = skipped, with the reason):
 *   test_mask -n N kill V [fp8] [cuda]   rank V dies after round 2; the
 *       others mask it and go on: rounds 3..7 (routing changing every
 *       round, Zipf, masked slots, ranks with no tokens) are checked
 *       against the reference with V masked (no rows from V, slots to V's
 *       experts -1 in the combine), with the argument and state errors of
 *       the mask calls on the way
 *   test_mask -n N leave V [fp8] [cuda]  the same, V alive: it stops after
 *       round 2 and waits in ferry_ep_destroy
 *   test_mask -n N shrink V ...     no one masks V: the contexts have
 *       mask_on_timeout, V dies at the start of round 3 and the survivors'
 *       round 3 completes without it (then rounds 4..7 as above)
 *   test_mask -n N shrink_comb V ... the same, V dying after its round-3
 *       dispatch: its rows are in round 3's dispatch, its replies missing
 *       from the combine (slots on its experts count 0); under
 *       FERRY_TRANSPORT=fabric both expect the create's refusal
 *   test_mask -n N shrink_two V ...  two rounds in flight: V dies between
 *       the dispatches of rounds 3 and 4, both combined after (run_two)
 *   (on CPU ranks, kill, leave and shrink run before round 5 a round in which one
 *   survivor passes a bad topk_idx: bad_round)
 *   test_mask -n 2 graph 0 cuda   a CUDA graph of a round captured with no
 *       rank masked, replayed after masking: FERRY_ERR_STATE saying to
 *       capture again (the kernel without the mask never runs masked)
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry.h"
#include "harness.h"
#include "launch.h"
#include "verdicts.h"
#include "workload.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static int on_gpu;

/* Buffers in the context's memory: host memory, or device memory when
 * on_gpu. */
static void *dalloc(size_t n)
{
#ifdef FERRY_HAVE_CUDA
    if (on_gpu) {
        void *p = NULL;
        if (cudaMalloc(&p, n + 16) != cudaSuccess || cudaMemset(p, 0, n + 16) != cudaSuccess) {
            fprintf(stderr, "cudaMalloc(%zu) failed\n", n);
            exit(1);
        }
        return p;
    }
#endif
    void *p = calloc(n + 16, 1);
    if (!p)
        exit(1);
    return p;
}

static void dfree(void *p)
{
#ifdef FERRY_HAVE_CUDA
    if (on_gpu) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

static void h2d(void *d, const void *h, size_t n)
{
#ifdef FERRY_HAVE_CUDA
    if (on_gpu) {
        if (cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) != cudaSuccess)
            exit(1);
        return;
    }
#endif
    memcpy(d, h, n);
}

static void d2h(void *h, const void *d, size_t n)
{
#ifdef FERRY_HAVE_CUDA
    if (on_gpu) {
        if (cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) != cudaSuccess)
            exit(1);
        return;
    }
#endif
    memcpy(h, d, n);
}

typedef struct mbufs {
    void *x, *idx, *ex, *exs, *cnt, *sr, *st, *ey, *w, *out, *q;
    uint8_t *hex;
    float *hexs;
    int32_t *hcnt, *hsr, *hst, *hq;
    uint16_t *hey, *hout;
} mbufs_t;

static void mbufs_init(mbufs_t *b, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    size_t T = (size_t)s->T, El = (size_t)lay->num_local_experts;
    size_t cap = (size_t)lay->expert_capacity;
    b->x = dalloc(T * s->H * 2);
    b->idx = dalloc(T * s->K * 8);
    b->w = dalloc(T * s->K * 4);
    b->out = dalloc(T * s->H * 2);
    b->ex = dalloc(lay->expert_x_bytes);
    b->exs = dalloc(lay->expert_scales_bytes);
    b->cnt = dalloc(El * 4);
    b->sr = dalloc(El * cap * 4);
    b->st = dalloc(El * cap * 4);
    b->ey = dalloc(lay->expert_y_bytes);
    b->q = dalloc((size_t)s->N * 4);
    b->hex = calloc(lay->expert_x_bytes + 16, 1);
    b->hexs = calloc(lay->expert_scales_bytes + 16, 1);
    b->hcnt = calloc(El + 1, 4);
    b->hsr = calloc(El * cap + 1, 4);
    b->hst = calloc(El * cap + 1, 4);
    b->hey = calloc(lay->expert_y_bytes + 16, 1);
    b->hout = calloc(T * s->H + 1, 2);
    b->hq = calloc((size_t)s->N, 4);
}

static void mbufs_free(mbufs_t *b)
{
    void *d[] = {b->x, b->idx, b->w, b->out, b->ex, b->exs, b->cnt, b->sr, b->st, b->ey, b->q};
    for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
        dfree(d[i]);
    free(b->hex);
    free(b->hexs);
    free(b->hcnt);
    free(b->hsr);
    free(b->hst);
    free(b->hey);
    free(b->hout);
    free(b->hq);
}

/* The mask as ferry_ep_mask_query reports it, against want[N]. */
static void check_query(ferry_ep_t ep, mbufs_t *b, int N, const int32_t *want, int me)
{
    int rc = ferry_ep_mask_query(ep, (int32_t *)b->q, NULL);
    CHECK(rc == FERRY_OK, "rank %d: mask_query: %s", me, ferry_ep_last_error(ep));
    if (on_gpu)
        CHECK(ferry_ep_sync(ep, NULL) == FERRY_OK, "sync after mask_query");
    d2h(b->hq, b->q, (size_t)N * 4);
    for (int i = 0; i < N; i++)
        CHECK(b->hq[i] == want[i], "rank %d: mask_query[%d] = %d, want %d", me, i, b->hq[i],
              want[i]);
}

/* The mask calls' errors, between rounds and inside one. */
static void check_mask_errors(ferry_ep_t ep, int N, int me, int victim)
{
    int rc = ferry_ep_mask_rank(ep, me, 1, NULL);
    CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "this rank"),
          "masking itself: %d %s", rc, ferry_ep_last_error(ep));
    rc = ferry_ep_mask_rank(ep, N, 1, NULL);
    CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "rank = "),
          "rank out of range: %d %s", rc, ferry_ep_last_error(ep));
    rc = ferry_ep_mask_rank(ep, victim, 2, NULL);
    CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "masked = 2"),
          "masked = 2: %d %s", rc, ferry_ep_last_error(ep));
    rc = ferry_ep_mask_query(ep, NULL, NULL);
    CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), "status"),
          "query NULL: %d %s", rc, ferry_ep_last_error(ep));
    /* set and cleared before any round ran with it: allowed */
    CHECK(ferry_ep_mask_rank(ep, victim, 1, NULL) == FERRY_OK, "mask: %s",
          ferry_ep_last_error(ep));
    CHECK(ferry_ep_mask_rank(ep, victim, 0, NULL) == FERRY_OK, "unmask before a round: %s",
          ferry_ep_last_error(ep));
}

/* The dispatch of `round` (this rank's inputs from s) with b's buffers,
 * checked against sd (no row from a rank sd masks), then the experts run;
 * probe >= 0: between its send and its receive, a mask change (of a rank
 * other than probe) is refused as inside a round. */
static int mask_dispatch(ferry_ep_t ep, mbufs_t *b, const fw_spec_t *s, const fw_spec_t *sd,
                         const ferry_ep_layout_t *lay, int round, int me, fw_input_t *in,
                         uint64_t *r, int probe)
{
    int N = s->N;
    size_t cap = (size_t)lay->expert_capacity, El = (size_t)lay->num_local_experts;
    fw_generate(s, (uint64_t)round, me, in);
    h2d(b->x, in->x, (size_t)in->T * s->H * 2);
    h2d(b->idx, in->idx, (size_t)in->T * s->K * 8);
    h2d(b->w, in->w, (size_t)in->T * s->K * 4);
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in->T, .x = b->x,
                               .topk_idx = (const int64_t *)b->idx};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b->ex,
                                 .expert_x_scales = s->fp8 ? (float *)b->exs : NULL,
                                 .expert_num_tokens = (int32_t *)b->cnt,
                                 .expert_src_rank = (int32_t *)b->sr,
                                 .expert_src_token = (int32_t *)b->st};
    int rc = ferry_dispatch_send(ep, &din, r);
    if (rc == FERRY_OK && probe >= 0) { /* inside a round: refused, the round goes on */
        int m = ferry_ep_mask_rank(ep, (me + 1) % N == probe ? (me + 2) % N : (me + 1) % N, 1,
                                   NULL);
        CHECK(N < 3 || (m == FERRY_ERR_STATE && strstr(ferry_ep_last_error(ep), "in flight")),
              "mask inside a round: %d %s", m, ferry_ep_last_error(ep));
    }
    if (rc == FERRY_OK)
        rc = ferry_dispatch_recv(ep, *r, &dout);
    if (rc == FERRY_OK && on_gpu)
        rc = ferry_ep_sync(ep, NULL);
    CHECK(rc == FERRY_OK, "rank %d: round %d dispatch: %s", me, round, ferry_ep_last_error(ep));
    if (rc != FERRY_OK)
        return rc;
    d2h(b->hcnt, b->cnt, El * 4);
    d2h(b->hex, b->ex, lay->expert_x_bytes);
    if (s->fp8)
        d2h(b->hexs, b->exs, lay->expert_scales_bytes);
    d2h(b->hsr, b->sr, El * cap * 4);
    d2h(b->hst, b->st, El * cap * 4);
    long bad = fw_check_dispatch(sd, (uint64_t)round, me, b->hex, s->fp8 ? b->hexs : NULL,
                                 b->hcnt, b->hsr, b->hst, cap, 3);
    CHECK(bad == 0, "rank %d: round %d: %ld dispatch rows wrong", me, round, bad);
    for (size_t i = 0; i < El * cap && sd->masked; i++)
        CHECK((size_t)(i % cap) >= (size_t)b->hcnt[i / cap] || b->hsr[i] < 0 ||
                  b->hsr[i] >= N || !sd->masked[b->hsr[i]],
              "rank %d: round %d: a row from masked rank %d", me, round, b->hsr[i]);
    fw_run_experts(s, me, b->hex, s->fp8 ? b->hexs : NULL, b->hcnt, cap, b->hey);
    h2d(b->ey, b->hey, lay->expert_y_bytes);
    return FERRY_OK;
}

/* The combine of round r (this rank's inputs in), checked against the
 * same tokens with sc's cut routing (in_m: scratch). */
static int mask_combine(ferry_ep_t ep, mbufs_t *b, const fw_spec_t *sc, int round, uint64_t r,
                        int me, const fw_input_t *in, fw_input_t *in_m)
{
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b->ey};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = (const float *)b->w,
                                .out = b->out};
    int rc = ferry_combine_send(ep, r, &cin);
    if (rc == FERRY_OK)
        rc = ferry_combine_recv(ep, r, &cout);
    if (rc == FERRY_OK && on_gpu)
        rc = ferry_ep_sync(ep, NULL);
    CHECK(rc == FERRY_OK, "rank %d: round %d combine: %s", me, round, ferry_ep_last_error(ep));
    if (rc != FERRY_OK)
        return rc;
    fw_generate(sc, (uint64_t)round, me, in_m); /* the same tokens, cut routing */
    d2h(b->hout, b->out, (size_t)in->T * sc->H * 2);
    long bad = fw_check_combine(sc, (uint64_t)round, me, in_m, b->hout, 3);
    CHECK(bad == 0, "rank %d: round %d: %ld combined tokens wrong", me, round, bad);
    return FERRY_OK;
}

/* CPU ranks, V masked: a round in which rank badr alone passes a bad
 * topk_idx (one token, entry [0][1] out of range; the others no tokens).
 * Its dispatch_send fails naming the entry, every other survivor's
 * dispatch_recv naming badr, nobody waits on V, and the next rounds (the
 * caller's, checked) go on. */
static void bad_round(ferry_ep_t ep, mbufs_t *b, const fw_spec_t *s, int me, int badr)
{
    int64_t row[16];
    static uint16_t xv[256];
    for (int k = 0; k < s->K && k < 16; k++)
        row[k] = -1;
    row[1] = s->E;
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = me == badr, .x = xv,
                               .topk_idx = row};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b->ex,
                                 .expert_x_scales = s->fp8 ? (float *)b->exs : NULL,
                                 .expert_num_tokens = (int32_t *)b->cnt};
    uint64_t r = 0;
    int rc = ferry_dispatch_send(ep, &din, &r);
    if (rc == FERRY_OK)
        rc = ferry_dispatch_recv(ep, r, &dout);
    char want[32];
    snprintf(want, sizeof(want), "rank %d passed", badr);
    const char *msg = ferry_ep_last_error(ep);
    CHECK(rc == FERRY_ERR_INVALID &&
              strstr(msg, me == badr ? "topk_idx[0][1]" : want) != NULL,
          "rank %d: a bad topk_idx on rank %d, a rank masked: %s: %s", me, badr,
          ferry_strerror(rc), msg);
}

/* The context of spec s (CPU or CUDA ranks), mask_on_timeout as asked. */
static ferry_ep_config_t mask_cfg(const fw_spec_t *s, int mask_on_timeout)
{
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = s->E;
    cfg.topk = s->K;
    cfg.hidden = s->H;
    cfg.max_tokens = s->T;
    cfg.dispatch_dtype = s->fp8 ? FERRY_DTYPE_FP8_E4M3 : FERRY_DTYPE_BF16;
    cfg.device = on_gpu ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
    cfg.mask_on_timeout = mask_on_timeout;
    return cfg;
}

/* shrink: 0 the survivors mask V themselves; 1 V dies at the start of
 * round 3 and 2 after its round-3 dispatch, found by the context's
 * mask_on_timeout */
static int run(ferry_comm_t comm, int victim, int die, int fp8, int shrink)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    fw_spec_t s = {.N = N, .E = 4 * N, .K = 4, .H = 256, .T = 24, .fp8 = fp8,
                   .zipf_s = 0.8, .mask_p = 0.05, .vary_tokens = 1, .empty_p = 0.15,
                   .seed = 77};
    ferry_ep_config_t cfg = mask_cfg(&s, shrink > 0);
    ferry_ep_t ep = NULL;
    const char *tr = getenv("FERRY_TRANSPORT");
    if (shrink && tr && strcmp(tr, "fabric") == 0) {
        /* refused on the fabric path, by every rank alike, naming it */
        rc = ferry_ep_create(comm, &cfg, &ep);
        CHECK(rc == FERRY_ERR_UNSUPPORTED &&
              strstr(ferry_comm_last_error(comm), "mask_on_timeout"),
              "rank %d: mask_on_timeout over the fabric: %s: %s", me, ferry_strerror(rc),
              ferry_comm_last_error(comm));
        if (rc == FERRY_OK)
            ferry_ep_destroy(ep);
        return fr_test_result();
    }
    if ((rc = ferry_ep_create(comm, &cfg, &ep)) != FERRY_OK) {
        fprintf(stderr, "rank %d: create: %s\n", me, ferry_comm_last_error(comm));
        return 1;
    }
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    fw_spec_t sc = s; /* the combine's reference (V's slots cut from round 3 on) */
    mbufs_t b;
    mbufs_init(&b, &s, &lay);
    fw_input_t in, in_m;
    fw_input_alloc(&s, &in);
    fw_input_alloc(&s, &in_m);
    int32_t *mask = calloc((size_t)N, sizeof(int32_t)), *none = calloc((size_t)N, 4);
    fw_spec_t sm = s; /* the reference: V masked from round 3 on */
    for (int round_i = 1; round_i <= 7; round_i++) {
        if (round_i == 3 && shrink) {
            if (me == victim && shrink == 1) {
                usleep(300 * 1000); /* round 2's writes land first */
                raise(SIGKILL);
            }
            mask[victim] = 1; /* what the survivors' contexts will find */
            sc.masked = mask;
            if (shrink == 1)
                sm.masked = mask;
        } else if (round_i == 3) {
            if (me == victim) {
                if (die) {
                    usleep(300 * 1000); /* round 2's writes land first */
                    raise(SIGKILL);
                }
                break; /* leaves: waits in ferry_ep_destroy */
            }
            check_query(ep, &b, N, none, me);
            check_mask_errors(ep, N, me, victim);
            CHECK(ferry_ep_mask_rank(ep, victim, 1, NULL) == FERRY_OK, "mask rank %d: %s",
                  victim, ferry_ep_last_error(ep));
            mask[victim] = 1;
            sm.masked = mask;
            sc.masked = mask;
            check_query(ep, &b, N, mask, me);
        }
        if (round_i == 4 && shrink == 2)
            sm.masked = mask;
        if (round_i == 5 && !on_gpu && s.H <= 256) /* bad_round's x */
            bad_round(ep, &b, &s, me, victim == N - 1 ? N - 2 : N - 1);
        uint64_t r = 0;
        if (mask_dispatch(ep, &b, &s, &sm, &lay, round_i, me, &in, &r,
                          round_i == 4 ? victim : -1))
            break;
        if (round_i == 3 && shrink == 2 && me == victim) {
            usleep(300 * 1000); /* its records land; its replies never come */
            raise(SIGKILL);
        }
        if (mask_combine(ep, &b, &sc, round_i, r, me, &in, &in_m))
            break;
        if (round_i == 3 && shrink)
            check_query(ep, &b, N, mask, me); /* found by the timeout */
        if (round_i == 3) {
            rc = ferry_ep_mask_rank(ep, victim, 0, NULL);
            CHECK(rc == FERRY_ERR_STATE && strstr(ferry_ep_last_error(ep), "out of step"),
                  "unmask after a round: %d %s", rc, ferry_ep_last_error(ep));
        }
    }
    if (me != victim)
        check_query(ep, &b, N, mask, me);
    rc = ferry_ep_destroy(ep);
    if (me != victim && !die)
        CHECK(rc == FERRY_OK, "destroy: %s", ferry_strerror(rc));
    mbufs_free(&b);
    fw_input_free(&in);
    fw_input_free(&in_m);
    free(mask);
    free(none);
    return fr_test_result();
}

/* Two rounds in flight with mask_on_timeout: rounds 3 and 4 are both
 * dispatched before either is combined, and V dies after its round-3
 * dispatch. Round 3: V's rows in, its replies missing (the slots sent to
 * it count 0); round 4: nothing from V (masked by the wait), its slots 0;
 * then rounds 5 and 6 without it. */
static int run_two(ferry_comm_t comm, int victim, int fp8)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    fw_spec_t s = {.N = N, .E = 4 * N, .K = 4, .H = 256, .T = 24, .fp8 = fp8,
                   .zipf_s = 0.8, .mask_p = 0.05, .vary_tokens = 1, .empty_p = 0.15,
                   .seed = 91};
    ferry_ep_config_t cfg = mask_cfg(&s, 1);
    ferry_ep_t ep = NULL;
    if ((rc = ferry_ep_create(comm, &cfg, &ep)) != FERRY_OK) {
        fprintf(stderr, "rank %d: create: %s\n", me, ferry_comm_last_error(comm));
        return 1;
    }
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    mbufs_t b[2];
    fw_input_t in[2], in_m;
    for (int i = 0; i < 2; i++) {
        mbufs_init(&b[i], &s, &lay);
        fw_input_alloc(&s, &in[i]);
    }
    fw_input_alloc(&s, &in_m);
    int32_t *mask = calloc((size_t)N, sizeof(int32_t));
    mask[victim] = 1;
    fw_spec_t sm = s; /* V gone */
    sm.masked = mask;
    uint64_t r[2];
    for (int round = 1; round <= 6 && !fr_test_failures; round++) {
        if (round == 3) {
            if (mask_dispatch(ep, &b[0], &s, &s, &lay, 3, me, &in[0], &r[0], -1))
                break;
            if (me == victim) {
                usleep(300 * 1000); /* its round-3 records land; nothing more */
                raise(SIGKILL);
            }
            if (mask_dispatch(ep, &b[1], &s, &sm, &lay, 4, me, &in[1], &r[1], -1))
                break;
            mask_combine(ep, &b[0], &sm, 3, r[0], me, &in[0], &in_m);
            mask_combine(ep, &b[1], &sm, 4, r[1], me, &in[1], &in_m);
            round = 4;
            continue;
        }
        const fw_spec_t *ref = round < 3 ? &s : &sm;
        if (mask_dispatch(ep, &b[0], &s, ref, &lay, round, me, &in[0], &r[0], -1))
            break;
        mask_combine(ep, &b[0], ref, round, r[0], me, &in[0], &in_m);
    }
    if (me != victim)
        check_query(ep, &b[0], N, mask, me);
    ferry_ep_destroy(ep);
    for (int i = 0; i < 2; i++) {
        mbufs_free(&b[i]);
        fw_input_free(&in[i]);
    }
    fw_input_free(&in_m);
    free(mask);
    return fr_test_result();
}

#ifdef FERRY_HAVE_CUDA
/* A CUDA graph of a round captured with no rank masked, replayed after
 * each rank masked the other: the round fails (FERRY_ERR_STATE, saying to
 * capture again), on both ranks, without waiting for anyone. */
static int run_graph(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    fw_spec_t s = {.N = N, .E = 4 * N, .K = 4, .H = 256, .T = 16, .seed = 5};
    ferry_ep_config_t cfg = mask_cfg(&s, 0); /* CUDA: graph mode runs with cuda */
    ferry_ep_t ep = NULL;
    if (ferry_ep_create(comm, &cfg, &ep) != FERRY_OK) {
        fprintf(stderr, "rank %d: create: %s\n", me, ferry_comm_last_error(comm));
        return 1;
    }
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    mbufs_t b;
    mbufs_init(&b, &s, &lay);
    fw_input_t in;
    fw_input_alloc(&s, &in);
    fw_generate(&s, 1, me, &in);
    h2d(b.x, in.x, (size_t)in.T * s.H * 2);
    h2d(b.idx, in.idx, (size_t)in.T * s.K * 8);
    h2d(b.w, in.w, (size_t)in.T * s.K * 4);
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T, .x = b.x,
                               .topk_idx = (const int64_t *)b.idx, .stream = st};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = b.ex,
                                 .expert_num_tokens = (int32_t *)b.cnt, .stream = st};
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = b.ey, .stream = st};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = (const float *)b.w,
                                .out = b.out, .stream = st};
    cudaGraph_t g;
    cudaGraphExec_t ge;
    uint64_t r = 0;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
    rc = ferry_dispatch(ep, &din, &dout, &r);
    if (rc == FERRY_OK)
        rc = ferry_combine(ep, r, &cin, &cout);
    CHECK(rc == FERRY_OK, "rank %d: capture: %s", me, ferry_ep_last_error(ep));
    CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess, "end capture");
    CHECK(cudaGraphInstantiate(&ge, g, 0) == cudaSuccess, "instantiate");
    CHECK(cudaGraphLaunch(ge, st) == cudaSuccess, "launch");
    rc = ferry_ep_sync(ep, st);
    CHECK(rc == FERRY_OK, "rank %d: replay before masking: %s", me, ferry_ep_last_error(ep));
    CHECK(ferry_ep_mask_rank(ep, (me + 1) % N, 1, st) == FERRY_OK, "mask: %s",
          ferry_ep_last_error(ep));
    CHECK(cudaGraphLaunch(ge, st) == cudaSuccess, "launch");
    rc = ferry_ep_sync(ep, st);
    CHECK(rc == FERRY_ERR_STATE && strstr(ferry_ep_last_error(ep), "capture the graph again"),
          "rank %d: replay after masking: %s: %s", me, ferry_strerror(rc),
          ferry_ep_last_error(ep));
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    ferry_ep_destroy(ep);
    mbufs_free(&b);
    fw_input_free(&in);
    return fr_test_result();
}
#endif

int main(int argc, char **argv)
{
    int n = 3;
    if (argc >= 3 && strcmp(argv[1], "-n") == 0)
        n = atoi(argv[2]);
    const char *mode = argc >= 4 ? argv[3] : "kill";
    int victim = argc >= 5 ? atoi(argv[4]) : 1, fp8 = 0;
    for (int i = 5; i < argc; i++) {
        fp8 |= strcmp(argv[i], "fp8") == 0;
        on_gpu |= strcmp(argv[i], "cuda") == 0;
    }
    int graph = strcmp(mode, "graph") == 0;
    int shrink = strcmp(mode, "shrink") == 0 ? 1 : strcmp(mode, "shrink_comb") == 0 ? 2 : 0;
    int two = strcmp(mode, "shrink_two") == 0;
    shrink = shrink ? shrink : two ? 3 : 0;
    const char *tr = getenv("FERRY_TRANSPORT");
    int refused = shrink && tr && strcmp(tr, "fabric") == 0; /* no one dies */
    int die = strcmp(mode, "kill") == 0 || (shrink && !refused);
    if (!die && !graph && !shrink && strcmp(mode, "leave") != 0) {
        fprintf(stderr, "usage: test_mask -n N kill|leave|shrink|shrink_comb|shrink_two V [fp8] "
                        "[cuda]; "
                        "test_mask -n 2 graph 0 cuda\n");
        return 2;
    }
    if (graph && !on_gpu) {
        printf("skipped: graph mode is for CUDA ranks (add cuda)\n");
        return 77;
    }
    if (victim < 0 || victim >= n || n < 2) {
        fprintf(stderr, "test_mask: victim %d of %d ranks\n", victim, n);
        return 2;
    }
    /* fr_vd_start's steps, with the GPU checked in the ranks: CUDA must
     * not be initialised before fork */
    int outside = fr_vd_init("mask"), is_child = outside;
    fr_err_t err = {{0}};
    int rc = outside ? 0 : fr_launch_local(n, &is_child, &err);
    if (!is_child) {
        if (rc == 77) {
            printf("skipped: no usable GPU (see the ranks' message above)\n");
            return 77;
        }
        return fr_vd_collect("test_mask", refused ? "shrink (refused on the fabric)" : mode, n,
                             die ? victim : -1, rc);
    }
    char why[512];
    if (on_gpu && !ferry_cuda_available(why, sizeof(why))) {
        printf("skipped: %s\n", why);
        return 77;
    }
    ferry_comm_t comm = NULL;
    if (ferry_comm_init_env(&comm, why, sizeof(why)) != FERRY_OK) {
        fprintf(stderr, "comm: %s\n", why);
        return 1;
    }
    int me = ferry_comm_rank(comm);
#ifdef FERRY_HAVE_CUDA
    rc = graph ? run_graph(comm) : two ? run_two(comm, victim, fp8)
                                      : run(comm, victim, die, fp8, shrink);
#else
    rc = two ? run_two(comm, victim, fp8) : run(comm, victim, die, fp8, shrink);
#endif
    ferry_comm_destroy(comm);
    verdict(me, rc ? "bad" : "ok");
    return rc;
}
