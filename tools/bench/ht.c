/*
 * ferry-bench --mode ht: the high-throughput calls on the same workload.
 * Per round: route (count exchange) + dispatch timed as "dispatch",
 * combine as "combine", each between barriers. Checked exactly: every
 * rank regenerates every rank's inputs, so it knows which rows arrive, in
 * which order (source rank, then token), with which bytes, slots and
 * weights; the experts' partial row for a token on rank d is
 * bf16(sum over d's slots of w_k f_e(x)) (fp32, k order), computed the
 * same way by whoever needs it, so combine's output (partials summed in
 * rank order in fp32, rounded once) is compared bit for bit.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "core/quant.h"

typedef struct ht_io {
    size_t rows;                 /* capacity of the receive buffers */
    uint8_t *q;                  /* [T][H] fp8 of x (--dtype fp8) */
    float *qs;
    uint8_t *rx;                 /* [rows][row bytes] */
    float *rxs, *rw;
    int32_t *ridx, *rsr, *rst;
    uint16_t *y, *out, *tmp16;
    float *acc, *f, *sc;
    uint8_t *row;
    fw_input_t other;            /* another rank's inputs, regenerated */
} ht_io_t;

static int ht_grow(ht_io_t *io, const fw_spec_t *s, size_t rows)
{
    if (rows <= io->rows && io->rx)
        return 0;
    size_t H = (size_t)s->H, K = (size_t)s->K;
    free(io->rx);
    free(io->rxs);
    free(io->rw);
    free(io->ridx);
    free(io->rsr);
    free(io->rst);
    free(io->y);
    io->rows = rows + rows / 4 + 16;
    io->rx = malloc(io->rows * 2 * H);
    io->rxs = malloc(io->rows * (H / 128 + 1) * sizeof(float));
    io->rw = malloc(io->rows * K * sizeof(float));
    io->ridx = malloc(io->rows * K * sizeof(int32_t));
    io->rsr = malloc(io->rows * sizeof(int32_t));
    io->rst = malloc(io->rows * sizeof(int32_t));
    io->y = malloc(io->rows * H * 2);
    return io->rx && io->rxs && io->rw && io->ridx && io->rsr && io->rst && io->y ? 0 : -1;
}

/* A token's row as dispatched: bf16 x, or its fp8 quantisation. */
static void ht_row(const fw_spec_t *s, const fw_input_t *in, int t, uint8_t *q, float *qs)
{
    const uint16_t *x = in->x + (size_t)t * s->H;
    if (!s->fp8) {
        memcpy(q, x, 2 * (size_t)s->H);
        return;
    }
    for (int b = 0; b < s->H / 128; b++)
        fr_quant_block(x + b * 128, q + b * 128, qs + b);
}

/* The partial row rank d returns for token t of `in`: bf16 of the sum over
 * d's slots of w_k f_e(x), in fp32, in k order. */
static void ht_partial(const fw_spec_t *s, const fw_input_t *in, int t, int d, ht_io_t *io,
                       uint16_t *y)
{
    int H = s->H, K = s->K, El = s->E / s->N;
    ht_row(s, in, t, io->row, io->sc);
    fw_row_to_f32(s, io->row, io->sc, io->f);
    float *acc = io->acc;
    memset(acc, 0, sizeof(float) * (size_t)H);
    for (int k = 0; k < K; k++) {
        int64_t e = in->idx[(size_t)t * K + k];
        if (e < 0 || e / El != d)
            continue;
        fw_expert_row(s, (int)e, io->f, io->tmp16);
        float w = in->w[(size_t)t * K + k];
        for (int h = 0; h < H; h++)
            acc[h] += w * fr_bf16_to_f32(io->tmp16[h]);
    }
    for (int h = 0; h < H; h++)
        y[h] = fr_f32_to_bf16(acc[h]);
}

static int ht_goes(const fw_spec_t *s, const fw_input_t *in, int t, int d)
{
    int El = s->E / s->N;
    for (int k = 0; k < s->K; k++) {
        int64_t e = in->idx[(size_t)t * s->K + k];
        if (e >= 0 && e / El == d)
            return 1;
    }
    return 0;
}

/* The received rows against every source's regenerated inputs. */
static long ht_check_dispatch(bench_t *b, uint64_t round, ht_io_t *io, int n)
{
    const fw_spec_t *s = &b->s;
    int El = s->E / s->N, K = s->K;
    size_t rb = s->fp8 ? (size_t)s->H : 2 * (size_t)s->H, ns = s->fp8 ? (size_t)s->H / 128 : 0;
    long wrong = 0;
    int i = 0;
    uint8_t *row = io->row;
    float *sc = io->sc;
    for (int src = 0; src < s->N; src++) {
        fw_generate(s, round, src, &io->other);
        for (int t = 0; t < io->other.T; t++) {
            if (!ht_goes(s, &io->other, t, b->me))
                continue;
            int bad = i >= n || io->rsr[i] != src || io->rst[i] != t;
            if (!bad) {
                ht_row(s, &io->other, t, row, sc);
                bad = memcmp(io->rx + (size_t)i * rb, row, rb) != 0 ||
                      (ns && memcmp(io->rxs + (size_t)i * ns, sc, ns * sizeof(float)) != 0);
                for (int k = 0; k < K && !bad; k++) {
                    int64_t e = io->other.idx[(size_t)t * K + k];
                    int local = e >= 0 && e / El == b->me;
                    bad = io->ridx[(size_t)i * K + k] != (local ? (int32_t)(e % El) : -1) ||
                          io->rw[(size_t)i * K + k] !=
                              (local ? io->other.w[(size_t)t * K + k] : 0.f);
                }
            }
            if (bad && wrong++ < 3)
                fprintf(stderr, "ferry-bench: rank %d round %llu: row %d (from rank %d "
                        "token %d) wrong\n", b->me, (unsigned long long)round, i, src, t);
            i++;
        }
    }
    return wrong + (i != n ? labs((long)(i - n)) : 0);
}

/* This rank's tokens: partials of every rank they went to, in rank order. */
static long ht_check_combine(bench_t *b, ht_io_t *io)
{
    const fw_spec_t *s = &b->s;
    int H = s->H, T = b->in.T;
    long wrong = 0;
    float *sum = malloc(sizeof(float) * (size_t)H);
    uint16_t *part = malloc(2 * (size_t)H);
    for (int t = 0; t < T; t++) {
        memset(sum, 0, sizeof(float) * (size_t)H);
        for (int d = 0; d < s->N; d++) {
            if (!ht_goes(s, &b->in, t, d))
                continue;
            ht_partial(s, &b->in, t, d, io, part);
            for (int h = 0; h < H; h++)
                sum[h] += fr_bf16_to_f32(part[h]);
        }
        int bad = 0;
        for (int h = 0; h < H && !bad; h++)
            bad = io->out[(size_t)t * H + h] != fr_f32_to_bf16(sum[h]);
        if (bad && wrong++ < 3)
            fprintf(stderr, "ferry-bench: rank %d: combined token %d wrong\n", b->me, t);
    }
    free(sum);
    free(part);
    return wrong;
}

/* One round; a timed one leaves its row in b->tm. */
static const char *ht_round(bench_t *b, ht_io_t *io, int it)
{
    const fw_spec_t *s = &b->s;
    uint64_t round = (uint64_t)it + 1;
    size_t ns = s->fp8 ? (size_t)s->H / 128 : 0;
    fw_generate(s, round, b->me, &b->in);
    for (int t = 0; t < b->in.T && s->fp8; t++)
        ht_row(s, &b->in, t, io->q + (size_t)t * s->H, io->qs + (size_t)t * ns);
    ferry_route_in_t rin = {.size = sizeof(rin), .num_tokens = b->in.T,
                            .topk_idx = b->in.idx};
    ferry_route_t route = NULL;
    int n = 0;
    if ((b->rc = ferry_comm_barrier(b->comm)) != FERRY_OK)
        return "barrier";
    double t0 = now_us();
    if ((b->rc = ferry_route_create(b->ep, &rin, &route)) != FERRY_OK)
        return "route_create";
    ferry_route_counts(route, &n, NULL);
    double t1 = now_us();
    if (ht_grow(io, s, (size_t)n) != 0)
        return "memory";
    ferry_ht_dispatch_in_t din = {.size = sizeof(din), .topk_weights = b->in.w,
                                  .x = s->fp8 ? (const void *)io->q : (const void *)b->in.x,
                                  .x_scales = s->fp8 ? io->qs : NULL};
    ferry_ht_dispatch_out_t dout = {.size = sizeof(dout), .recv_x = io->rx,
                                    .recv_x_scales = s->fp8 ? io->rxs : NULL,
                                    .recv_topk_idx = io->ridx, .recv_topk_weights = io->rw,
                                    .recv_src_rank = io->rsr, .recv_src_token = io->rst};
    double t2 = now_us();
    b->rc = ferry_ht_dispatch(b->ep, route, &din, &dout);
    double t3 = now_us();
    if (b->rc != FERRY_OK)
        return "ht_dispatch";
    if (b->o->check)
        b->wrong += ht_check_dispatch(b, round, io, n);
    for (int i = 0, src = -1; i < n; i++) { /* the experts: a partial row per row */
        if (io->rsr[i] != src) /* rows come by source: regenerate once each */
            fw_generate(s, round, src = io->rsr[i], &io->other);
        ht_partial(s, &io->other, io->rst[i], b->me, io, io->y + (size_t)i * s->H);
    }
    ferry_ht_combine_in_t cin = {.size = sizeof(cin), .y = io->y};
    ferry_ht_combine_out_t cout = {.size = sizeof(cout), .out = io->out};
    if ((b->rc = ferry_comm_barrier(b->comm)) != FERRY_OK)
        return "barrier";
    double t4 = now_us();
    b->rc = ferry_ht_combine(b->ep, route, &cin, &cout);
    double t5 = now_us();
    ferry_route_destroy(route);
    if (b->rc != FERRY_OK)
        return "ht_combine";
    if (b->o->check)
        b->wrong += ht_check_combine(b, io);
    if (it >= b->o->warmup) {
        double *r = b->tm + (size_t)(it - b->o->warmup) * 5;
        r[0] = (t1 - t0) + (t3 - t2);
        r[1] = t5 - t4;
        r[2] = r[3] = NAN;
        /* rows this rank sent to other ranks, both ways */
        double rb = (double)(s->fp8 ? s->H + 4 * ns : 2 * (size_t)s->H), bytes = 0;
        for (int t = 0; t < b->in.T; t++)
            for (int d = 0; d < s->N; d++)
                if (d != b->me && ht_goes(s, &b->in, t, d))
                    bytes += rb + 2.0 * s->H;
        r[4] = bytes;
    }
    return NULL;
}

void run_ht_rounds(bench_t *b)
{
    const fw_spec_t *s = &b->s;
    ht_io_t io;
    memset(&io, 0, sizeof(io));
    size_t T = (size_t)(s->T > 0 ? s->T : 1), H = (size_t)s->H;
    io.q = malloc(T * H + 1);
    io.qs = malloc((T * H / 128 + 1) * sizeof(float));
    io.out = malloc(T * H * 2 + 2);
    io.acc = malloc(H * sizeof(float));
    io.f = malloc(H * sizeof(float));
    io.tmp16 = malloc(H * 2);
    io.row = malloc(H * 2);
    io.sc = malloc((H / 128 + 1) * sizeof(float));
    if (!io.q || !io.qs || !io.out || !io.acc || !io.f || !io.tmp16 || !io.row || !io.sc ||
        fw_input_alloc(s, &io.other) != 0 || fw_input_alloc(s, &b->in) != 0) {
        b->fail = "memory";
        return;
    }
    int total = b->o->warmup + b->o->iters;
    for (int it = 0; it < total && !b->fail; it++) {
        b->fail = ht_round(b, &io, it);
        if (b->me == 0 && now_us() - b->last_progress > 10e6) {
            fprintf(stderr, "ferry-bench: round %d of %d, %ld wrong so far (rank 0)\n",
                    it + 1, total, b->wrong);
            b->last_progress = now_us();
        }
    }
    free(io.q);
    free(io.qs);
    free(io.out);
    free(io.acc);
    free(io.f);
    free(io.tmp16);
    free(io.row);
    free(io.sc);
    free(io.rx);
    free(io.rxs);
    free(io.rw);
    free(io.ridx);
    free(io.rsr);
    free(io.rst);
    free(io.y);
    fw_input_free(&io.other);
}
