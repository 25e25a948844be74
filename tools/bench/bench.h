/*
 * ferry-bench internals: the options, what one rank carries through a run,
 * and the pieces that live outside tools/ferry_bench.c (the MPI baseline,
 * the GPU buffers, the rounds and the result table).
 */
#ifndef FERRY_BENCH_H
#define FERRY_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ferry.h"
#include "workload.h"

typedef struct opts {
    int ranks, experts, topk, hidden, tokens, iters, warmup;
    int fp8, check, vary, sms;
    int ht, ring;  /* --mode ht, --ring */
    int graph;     /* --graph: rounds replayed from one CUDA graph */
    int split;     /* --split: send and receive as two calls */
    int round_scale; /* --round-scale: fp8 scales rounded up to powers of two */
    int scales;      /* --scales: expert_x_scales layout (ferry_scales_layout_t) */
    int nodes;       /* --nodes: ranks split into this many nodes (FERRY_NODE_ID) */
    int hosts;       /* --hosts: this many simulated hosts (FERRY_HOST_NAME) */
    int stats;       /* --stats: the fabric path's counters in the row */
    int peers;       /* --transport null: simulated peers */
    int forward;     /* --forward: config.forward (ferry_forward_t) */
    int groups, gpick; /* --routing groups:G:M */
    int dp;          /* --dp: config.dp_size (DP groups) */
    double zipf, mask, empty;
    uint64_t seed;
    const char *transport, *device, *json, *launcher, *routing, *gpu;
    int quiet;
    /* --tokens A,B,C: a sweep, one row each (tokens is the current one) */
    int ntoks, toks[32];
    int sweep_i;           /* the row being run (0: the first: header, new files) */
    const char *csv;       /* --csv FILE: the rows as CSV, a header line first */
} opts_t;

/* --device cuda: inputs are copied to the GPU before a round and outputs
 * back after it, outside the timed calls (device.c). */
typedef struct dev {
    int on;
    void *stream;
    void *x, *idx, *w, *out, *ex, *exs, *cnt, *sr, *st, *ey;
    void *gs; /* NVFP4: the encode scale, one float */
} dev_t_;

/* Make this rank's GPU current: gpu "auto" (the local rank modulo the
 * visible GPUs) or an index. */
int dev_bind(const char *gpu, int rank, int *chosen);
int dev_init(dev_t_ *d, const fw_spec_t *s, const ferry_ep_layout_t *lay);
/* The current CUDA device's name ("" without one). */
void dev_name(char *buf, size_t len);
int dev_inputs(dev_t_ *d, const fw_spec_t *s, const fw_input_t *in);
/* whole_scales: expert_x_scales is not in rows (copied whole) */
int dev_dispatch_out(dev_t_ *d, const ferry_ep_layout_t *lay, uint8_t *ex,
                     float *exs, int whole_scales, int32_t *cnt, int32_t *sr, int32_t *st_);
int dev_expert_y(dev_t_ *d, const ferry_ep_layout_t *lay, const int32_t *cnt,
                 const uint16_t *ey, int H);
int dev_out(dev_t_ *d, uint16_t *out, int T, int H);
void dev_free(dev_t_ *d);

#ifdef FERRY_HAVE_MPI
/* The MPI baseline: counts, then one copy per (token, expert), and back
 * (baseline.c). */
typedef struct base {
    int N, me, El;
    size_t item; /* bytes per item: token, expert, payload, scales */
    size_t pay;
    int *scnt, *rcnt, *sdsp, *rdsp, *sb, *rb, *sbd, *rbd;
    uint8_t *sbuf, *rbuf;
    int32_t *item_pos; /* [T*K]: index in the return buffer, or -1 */
    int32_t *rrow;     /* received item -> expert row */
    uint8_t *ybuf_s, *ybuf_r;
    uint8_t *q;
    float *qs;
    int nrecv;
} base_t;

int base_init(base_t *b, const fw_spec_t *s);
void base_free(base_t *b);
void base_dispatch(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                   uint8_t *ex, float *exs, int32_t *cnt, int32_t *sr,
                   int32_t *st, size_t cap);
void base_combine(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                  const uint16_t *ey, uint16_t *out, float *acc);
int mpi_allgather_cb(const void *in, void *out, size_t len, void *ctx);
#endif

/* Everything one rank holds through a run. */
typedef struct bench {
    const opts_t *o;
    int have_base; /* MPI runs the job: the baseline runs beside ferry */
    ferry_comm_t comm;
    int me, N;
    fw_spec_t s;
    ferry_ep_config_t cfg;
    ferry_ep_t ep, eps[2]; /* ep, lay: the context of the current round */
    ferry_ep_layout_t lay, lays[2];
    size_t cap, El;
    /* host buffers: expert rows, scales, counts, sources, expert outputs */
    uint8_t *ex;
    float *exs;
    float *exs_raw; /* --scales cols|ue8m0: what dispatch wrote (exs: in rows) */
    int32_t *cnt, *sr, *st;
    uint16_t *ey, *out;
    float *acc;
    fw_input_t in;
    dev_t_ dv;
    /* per timed round (BENCH_COLS): ferry dispatch, combine, base dispatch,
     * combine, bytes; --mode ht: bytes this rank wrote to fabric peers in
     * the dispatch and in the combine (ferry_ep_stats_t.bytes), and the
     * rows the routing sends over the fabric (per destination node when
     * forwarding, else per destination rank), and the route's part of the
     * dispatch time (ferry_route_create with its host wait) */
    double *tm;
    long wrong;
    int fwd;          /* --mode ht: the context forwards (ferry_ep_get_nodes) */
    int nnodes;       /* its nodes, and each rank's (node_of[N]) */
    int32_t *node_of;
    int rc;           /* the last ferry status, reported with a failure */
    const char *fail; /* the step that failed, or NULL */
    double last_progress;
    ferry_ep_stats_t st0[2]; /* --stats: the counters after the warm-up */
#ifdef FERRY_HAVE_MPI
    base_t base;
#endif
} bench_t;

#define BENCH_COLS 9

double now_us(void);

/* rounds.c */
void run_rounds(bench_t *b, int from, int to);

/* A CUDA runtime call in a function returning int: on failure, say which
 * and return -1 (the caller includes cuda_runtime_api.h and stdio.h). */
#ifdef FERRY_HAVE_CUDA
#define DEVCHK(call)                                                           \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            fprintf(stderr, "ferry-bench: %s: %s\n", #call,                    \
                    cudaGetErrorString(e_));                                   \
            return -1;                                                         \
        }                                                                      \
    } while (0)
#endif

#ifdef FERRY_HAVE_CUDA
void run_gpu_rounds(bench_t *b);
#endif

/* ht.c: --mode ht, warm-up and timed rounds */
void run_ht_rounds(bench_t *b);

/* stats.c: --stats (the counters after the warm-up; every rank's summed
 * into the row) and --transport null (the proxy alone: its own run). */
typedef struct pstats {
    double writes, eagain, post_us, prov_us, poll_us; /* all ranks */
    double d2p50, d2p99; /* median of the ranks' p50s, largest p99 */
    double completions, arrivals, batched; /* batched: posted with FI_MORE */
    double s2p50, s2p99; /* seen by the proxy -> posted, as d2p */
    double bells, stamped; /* d2p's samples (timed rounds), and those that
                              start at a stamp of when the doorbell rang */
} pstats_t;
void stats_mark(bench_t *b);
int stats_gather(bench_t *b, pstats_t *ps);
/* table columns and JSON keys (leading ", ") of ps */
void stats_header(void);
void stats_cols(const pstats_t *ps);
void stats_json(FILE *f, const pstats_t *ps);
int run_null(const opts_t *o);

/* report.c: gather every rank's timings, rank 0 prints the row (and the
 * JSON); returns the exit status the results call for. */
int report(bench_t *b);

/* What ran, where and when (the JSON, CSV and header line). */
typedef struct bench_meta {
    char version[32], commit[48], host[256], gpu[256], date[32];
} bench_meta_t;
void bench_meta(const bench_t *b, bench_meta_t *m);

#endif
