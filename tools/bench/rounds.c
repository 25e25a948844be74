/*
 * ferry-bench's rounds: ferry's dispatch and combine, each timed between
 * barriers and verified, then (under mpirun) the same round through the MPI
 * baseline. With --device cuda and --no-check the rounds run back to back
 * on the GPU instead.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef FERRY_HAVE_MPI
#include <mpi.h>
#endif
#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "bench.h"

double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* Dispatch bytes this rank sends to other ranks: one record per (token
 * of its share, remote rank). */
static double dispatch_bytes(const fw_spec_t *s, const fw_input_t *in, int K, int El, int me,
                             size_t rec)
{
    double bytes = 0;
    int t0, t1;
    fw_share(s, in->T, me, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const int64_t *row = in->idx + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            if (row[k] < 0 || row[k] / El == me)
                continue;
            int first = 1;
            for (int j = 0; j < k && first; j++)
                first = !(row[j] >= 0 && row[j] / El == row[k] / El);
            bytes += first ? (double)rec : 0;
        }
    }
    return bytes;
}

/* Line the ranks up before a timed phase (MPI's barrier when MPI runs the
 * job: the same one the baseline gets). */
static int bench_barrier(ferry_comm_t comm, int have_base)
{
#ifdef FERRY_HAVE_MPI
    if (have_base)
        return MPI_Barrier(MPI_COMM_WORLD) == MPI_SUCCESS ? FERRY_OK : FERRY_ERR_PEER;
#endif
    (void)have_base;
    return ferry_comm_barrier(comm);
}

/* The argument blocks of one round's four calls. */
typedef struct round_io {
    ferry_dispatch_in_t din;
    ferry_dispatch_out_t dout;
    ferry_combine_in_t cin;
    ferry_combine_out_t cout;
} round_io_t;

/* Round `it`'s inputs, and the buffers its calls use: the host's, or with
 * --device cuda the GPU's (the inputs copied over first). */
static const char *prepare_round(bench_t *b, int it, round_io_t *io)
{
    if (b->o->fp8 == 2) { /* alternate the contexts: the dtype changes */
        b->ep = b->eps[it & 1];
        b->lay = b->lays[it & 1];
        b->s.fp8 = it & 1;
    }
    fw_generate(&b->s, (uint64_t)it + 1, b->me, &b->in);
    io->din = (ferry_dispatch_in_t){.size = sizeof(io->din), .num_tokens = b->in.T,
                                    .x = b->in.x, .topk_idx = b->in.idx,
                                    .x_global_scale = b->s.nvfp4 ? &b->s.gs : NULL};
    io->dout = (ferry_dispatch_out_t){.size = sizeof(io->dout), .expert_x = b->ex,
                                      .expert_x_scales = b->exs_raw ? b->exs_raw : b->exs,
                                      .expert_num_tokens = b->cnt,
                                      .expert_src_rank = b->sr,
                                      .expert_src_token = b->st};
    io->cin = (ferry_combine_in_t){.size = sizeof(io->cin), .expert_y = b->ey};
    io->cout = (ferry_combine_out_t){.size = sizeof(io->cout), .topk_weights = b->in.w,
                                     .out = b->out};
    if (!b->dv.on)
        return NULL;
    dev_t_ *dv = &b->dv;
    if (dev_inputs(dv, &b->s, &b->in) != 0)
        return "copy to GPU";
    io->din.x = dv->x;
    io->din.topk_idx = dv->idx;
    io->din.x_global_scale = b->s.nvfp4 ? (const float *)dv->gs : NULL;
    io->din.stream = io->dout.stream = io->cin.stream = io->cout.stream = dv->stream;
    io->dout.expert_x = dv->ex;
    io->dout.expert_x_scales = dv->exs;
    io->dout.expert_num_tokens = dv->cnt;
    io->dout.expert_src_rank = dv->sr;
    io->dout.expert_src_token = dv->st;
    io->cin.expert_y = dv->ey;
    io->cout.topk_weights = dv->w;
    io->cout.out = dv->out;
    return NULL;
}

/* One operation as engines call it (ferry_dispatch / ferry_combine: one
 * launch on GPU ranks), or with --split as its two halves. */
static int bench_dispatch(bench_t *b, const ferry_dispatch_in_t *in,
                          const ferry_dispatch_out_t *out, uint64_t *round)
{
    if (!b->o->split)
        return ferry_dispatch(b->ep, in, out, round);
    int rc = ferry_dispatch_send(b->ep, in, round);
    return rc ? rc : ferry_dispatch_recv(b->ep, *round, out);
}

static int bench_combine(bench_t *b, uint64_t round, const ferry_combine_in_t *in,
                         const ferry_combine_out_t *out)
{
    if (!b->o->split)
        return ferry_combine(b->ep, round, in, out);
    int rc = ferry_combine_send(b->ep, round, in);
    return rc ? rc : ferry_combine_recv(b->ep, round, out);
}

/* Ferry's dispatch, timed after a barrier; then the rows are checked and
 * the experts run on them. */
static const char *ferry_dispatch_step(bench_t *b, uint64_t round_id, round_io_t *io,
                                       uint64_t *round, double *us)
{
    if ((b->rc = bench_barrier(b->comm, b->have_base)) != FERRY_OK)
        return "barrier";
    double t0 = now_us();
    b->rc = bench_dispatch(b, &io->din, &io->dout, round);
    if (b->rc == FERRY_OK)
        b->rc = ferry_ep_sync(b->ep, b->dv.stream); /* GPU: wait, then check */
    double t1 = now_us();
    if (b->rc != FERRY_OK)
        return "dispatch";
    if (b->dv.on && dev_dispatch_out(&b->dv, &b->lay, b->ex, b->exs_raw ? b->exs_raw : b->exs,
                                     b->exs_raw != NULL, b->cnt, b->sr, b->st) != 0)
        return "copy from GPU";
    if (b->exs_raw) /* the check and the experts read rows */
        fw_scales_to_rows(b->s.nvfp4 ? FW_SCALES_NVFP4 : b->o->scales, b->exs_raw, b->exs,
                          b->El, b->cap,
                          (size_t)b->lay.num_scales, b->cnt);
    if (b->o->check)
        b->wrong += fw_check_dispatch(&b->s, round_id, b->me, b->ex, b->exs, b->cnt,
                                      b->sr, b->st, b->cap, 3);
    fw_run_experts(&b->s, b->me, b->ex, b->exs, b->cnt, b->cap, b->ey);
    if (b->dv.on && dev_expert_y(&b->dv, &b->lay, b->cnt, b->ey, b->o->hidden) != 0)
        return "copy to GPU";
    *us = t1 - t0;
    return NULL;
}

/* Ferry's combine, timed after a barrier; then the tokens are checked. */
static const char *ferry_combine_step(bench_t *b, uint64_t round_id, uint64_t round,
                                      round_io_t *io, double *us)
{
    if ((b->rc = bench_barrier(b->comm, b->have_base)) != FERRY_OK)
        return "barrier";
    double t2 = now_us();
    b->rc = bench_combine(b, round, &io->cin, &io->cout);
    if (b->rc == FERRY_OK)
        b->rc = ferry_ep_sync(b->ep, b->dv.stream);
    double t3 = now_us();
    if (b->rc != FERRY_OK)
        return "combine";
    if (b->dv.on && dev_out(&b->dv, b->out, b->in.T, b->o->hidden) != 0)
        return "copy from GPU";
    if (b->o->check)
        b->wrong += fw_check_combine(&b->s, round_id, b->me, &b->in, b->out, 3);
    *us = t3 - t2;
    return NULL;
}

/* bytes this rank sent to other ranks this round */
static double round_bytes(const bench_t *b)
{
    double bytes = dispatch_bytes(&b->s, &b->in, b->s.K, (int)b->El, b->me,
                                  b->lay.token_bytes + 4 * (size_t)b->lay.num_scales);
    for (size_t le = 0; le < b->El; le++)
        for (int i = 0; i < b->cnt[le]; i++)
            if (b->sr[le * b->cap + (size_t)i] != b->me)
                bytes += 2.0 * b->o->hidden;
    return bytes;
}

/* The same round through the MPI baseline (under mpirun), checked the same
 * way; its dispatch and combine times, else NAN. */
static void baseline_round(bench_t *b, uint64_t round_id, double *bd, double *bc)
{
    *bd = *bc = NAN;
#ifdef FERRY_HAVE_MPI
    if (!b->have_base)
        return;
    MPI_Barrier(MPI_COMM_WORLD);
    double b0 = now_us();
    base_dispatch(&b->base, &b->s, &b->in, b->ex, b->exs, b->cnt, b->sr, b->st, b->cap);
    double b1 = now_us();
    if (b->o->check)
        b->wrong += fw_check_dispatch(&b->s, round_id, b->me, b->ex, b->exs, b->cnt,
                                      b->sr, b->st, b->cap, 3);
    fw_run_experts(&b->s, b->me, b->ex, b->exs, b->cnt, b->cap, b->ey);
    MPI_Barrier(MPI_COMM_WORLD);
    double b2 = now_us();
    base_combine(&b->base, &b->s, &b->in, b->ey, b->out, b->acc);
    double b3 = now_us();
    if (b->o->check)
        b->wrong += fw_check_combine(&b->s, round_id, b->me, &b->in, b->out, 3);
    *bd = b1 - b0;
    *bc = b3 - b2;
#endif
}

/* One checked round; a timed one leaves its row in b->tm. Returns the step
 * that failed, or NULL. */
static const char *run_round(bench_t *b, int it)
{
    const opts_t *o = b->o;
    uint64_t round_id = (uint64_t)it + 1, round = 0;
    round_io_t io;
    double t[4]; /* ferry dispatch, combine, base dispatch, combine */
    const char *fail;
    if ((fail = prepare_round(b, it, &io)) != NULL ||
        (fail = ferry_dispatch_step(b, round_id, &io, &round, &t[0])) != NULL ||
        (fail = ferry_combine_step(b, round_id, round, &io, &t[1])) != NULL)
        return fail;
    double bytes = round_bytes(b);
    baseline_round(b, round_id, &t[2], &t[3]);
    if (it >= o->warmup) {
        double *r = b->tm + (size_t)(it - o->warmup) * BENCH_COLS;
        memcpy(r, t, sizeof(t));
        r[4] = bytes;
    }
    if (b->me == 0 && now_us() - b->last_progress > 10e6) {
        fprintf(stderr, "ferry-bench: round %d of %d, %ld wrong so far (rank 0)\n",
                it + 1, o->warmup + o->iters, b->wrong);
        b->last_progress = now_us();
    }
    return NULL;
}

void run_rounds(bench_t *b, int from, int to)
{
    for (int it = from; it < to && !b->fail; it++)
        b->fail = run_round(b, it);
}

#ifdef FERRY_HAVE_CUDA
/* Every round queued on the stream (or captured), each bracketed by three
 * events (none when evs is NULL). */
static void gpu_queue_rounds(bench_t *b, cudaEvent_t *evs, int total)
{
    dev_t_ *dv = &b->dv;
    cudaStream_t cst = (cudaStream_t)dv->stream;
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = b->in.T, .x = dv->x,
                               .topk_idx = dv->idx, .stream = dv->stream};
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = dv->ex,
                                 .expert_x_scales = dv->exs, .expert_num_tokens = dv->cnt,
                                 .stream = dv->stream};
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = dv->ey, .stream = dv->stream};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = dv->w, .out = dv->out,
                                .stream = dv->stream};
    for (int it = 0; it < total && !b->fail; it++) {
        uint64_t round = 0;
        if (evs)
            cudaEventRecord(evs[it * 3], cst);
        b->rc = bench_dispatch(b, &din, &dout, &round);
        if (evs)
            cudaEventRecord(evs[it * 3 + 1], cst);
        if (b->rc == FERRY_OK)
            b->rc = bench_combine(b, round, &cin, &cout);
        if (evs)
            cudaEventRecord(evs[it * 3 + 2], cst);
        if (b->rc != FERRY_OK)
            b->fail = "round";
    }
}

/* Payload to other ranks in a round: dispatch records, and (estimated by
 * symmetry) as many combine rows as this rank's remote pairs. */
static double gpu_round_bytes(const bench_t *b)
{
    size_t rec = b->lay.token_bytes + 4 * (size_t)b->lay.num_scales;
    double bytes = dispatch_bytes(&b->s, &b->in, b->s.K, (int)b->El, b->me, rec);
    int t0, t1;
    fw_share(&b->s, b->in.T, b->me, &t0, &t1);
    for (int i = t0 * b->s.K; i < t1 * b->s.K; i++)
        if (b->in.idx[i] >= 0 && b->in.idx[i] / (int)b->El != b->me)
            bytes += 2.0 * b->o->hidden;
    return bytes;
}

/* The timed rounds' rows from the events. */
static void gpu_read_times(bench_t *b, cudaEvent_t *evs, int total)
{
    const opts_t *o = b->o;
    for (int it = o->warmup; it < total && !b->fail; it++) {
        float a = 0, b2 = 0;
        cudaEventElapsedTime(&a, evs[it * 3], evs[it * 3 + 1]);
        cudaEventElapsedTime(&b2, evs[it * 3 + 1], evs[it * 3 + 2]);
        double *r = b->tm + (size_t)(it - o->warmup) * BENCH_COLS;
        r[0] = a * 1000.0;
        r[1] = b2 * 1000.0;
        r[2] = r[3] = NAN;
        r[4] = gpu_round_bytes(b);
    }
}

/* --graph: FR_GRAPH_ROUNDS rounds captured once as one CUDA graph with no
 * event inside (an event between kernels costs microseconds, tens of them
 * with many processes on one GPU under MPS), replayed back to back with
 * events only between replays. A row's dispatch and combine columns both
 * hold its replay's mean time per operation (round / 2). */
#define FR_GRAPH_ROUNDS 20
static void gpu_graph_rounds(bench_t *b)
{
    const opts_t *o = b->o;
    cudaStream_t cst = (cudaStream_t)b->dv.stream;
    int G = o->iters < FR_GRAPH_ROUNDS ? o->iters : FR_GRAPH_ROUNDS;
    int warm = (o->warmup + G - 1) / G, reps = (o->iters + G - 1) / G;
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    cudaEvent_t *evs = calloc((size_t)reps + 1, sizeof(cudaEvent_t));
    for (int i = 0; i <= reps; i++)
        cudaEventCreate(&evs[i]);
    if (cudaStreamBeginCapture(cst, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        b->fail = "cudaStreamBeginCapture";
    if (!b->fail) {
        gpu_queue_rounds(b, NULL, G);
        if (cudaStreamEndCapture(cst, &g) != cudaSuccess && !b->fail)
            b->fail = "cudaStreamEndCapture";
    }
    if (!b->fail && cudaGraphInstantiate(&x, g, 0) != cudaSuccess)
        b->fail = "cudaGraphInstantiate";
    if (!b->fail)
        bench_barrier(b->comm, b->have_base);
    for (int i = 0; i < warm + reps && !b->fail; i++) {
        if (i >= warm)
            cudaEventRecord(evs[i - warm], cst);
        if (cudaGraphLaunch(x, cst) != cudaSuccess)
            b->fail = "cudaGraphLaunch";
    }
    if (!b->fail)
        cudaEventRecord(evs[reps], cst);
    if (x && cudaStreamSynchronize(cst) != cudaSuccess && !b->fail)
        b->fail = "round";
    for (int it = 0; it < o->iters && !b->fail; it++) {
        float ms = 0;
        int rep = it / G;
        cudaEventElapsedTime(&ms, evs[rep], evs[rep + 1]);
        double *r = b->tm + (size_t)it * BENCH_COLS;
        r[0] = r[1] = ms * 1000.0 / G / 2;
        r[2] = r[3] = NAN;
        r[4] = gpu_round_bytes(b);
    }
    for (int i = 0; i <= reps; i++)
        cudaEventDestroy(evs[i]);
    free(evs);
    if (x)
        cudaGraphExecDestroy(x);
    if (g)
        cudaGraphDestroy(g);
}

/* GPU ranks without checking: rounds back to back on the stream, timed
 * with CUDA events (no host barrier or copies between rounds, so the
 * ranks stay in step the way an inference engine runs them). */
void run_gpu_rounds(bench_t *b)
{
    int total = b->o->warmup + b->o->iters;
    cudaEvent_t *evs = calloc((size_t)total * 3, sizeof(cudaEvent_t));
    for (int i = 0; i < total * 3; i++)
        cudaEventCreate(&evs[i]);
    fw_generate(&b->s, 1, b->me, &b->in);
    if (dev_inputs(&b->dv, &b->s, &b->in) != 0)
        b->fail = "copy to GPU";
    if (b->o->graph && !b->fail) {
        gpu_graph_rounds(b);
    } else if (!b->fail) {
        bench_barrier(b->comm, b->have_base);
        gpu_queue_rounds(b, evs, total);
    }
    if (!b->fail && ferry_ep_sync(b->ep, b->dv.stream) != FERRY_OK)
        b->fail = "round";
    if (!b->o->graph)
        gpu_read_times(b, evs, total);
    for (int i = 0; i < total * 3; i++)
        cudaEventDestroy(evs[i]);
    free(evs);
    if (b->fail)
        b->rc = ferry_ep_sync(b->ep, b->dv.stream);
}
#endif
