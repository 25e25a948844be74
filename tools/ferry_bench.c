/*
 * ferry-bench: dispatch + combine, verified every round, timed side by side
 * with the two-phase MPI exchange users write today.
 *
 * With no launcher around it starts its own ranks: through mpirun when it
 * is installed (so the MPI baseline runs in the same job), else by forking.
 * Under mpirun, torchrun or srun it uses their ranks.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef FERRY_HAVE_MPI
#include <mpi.h>
#endif
#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/quant.h"
#include "ferry.h"
#include "launch.h"
#include "workload.h"

typedef struct opts {
    int ranks, experts, topk, hidden, tokens, iters, warmup;
    int fp8, check, vary, sms;
    double zipf, mask, empty;
    uint64_t seed;
    const char *transport, *device, *json, *launcher, *routing;
    int quiet;
} opts_t;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry-bench [options]\n"
            "  -n, --ranks N        ranks to start (default 8; ignored under a launcher)\n"
            "      --experts E      global experts (default 256)\n"
            "      --topk K         experts per token (default 8)\n"
            "      --hidden H       hidden size (default 7168)\n"
            "      --tokens T       tokens per rank per round (default 128)\n"
            "      --dtype fp8|bf16|mixed  dispatch dtype (default fp8; mixed: a bf16 and\n"
            "                       an fp8 context, alternating every round)\n"
            "      --routing uniform|zipf:S   expert choice (default uniform)\n"
            "      --mask P         probability a top-k slot is -1 (default 0)\n"
            "      --vary-tokens    token count per rank and round random in 0..T\n"
            "      --empty P        with --vary-tokens: probability of 0 tokens\n"
            "      --iters N        timed rounds (default 20)\n"
            "      --warmup N       untimed rounds first (default 3)\n"
            "      --seed S         workload seed (default 1)\n"
            "      --transport auto|fabric   sets FERRY_TRANSPORT for the run\n"
            "      --device cpu|cuda\n"
            "      --sms N          CUDA: blocks the copy kernels use (default 16)\n"
            "      --launcher auto|mpirun|fork   how to start ranks (default auto)\n"
            "      --no-check       skip verification (prints #wrong as n/a)\n"
            "      --json FILE      write the result row as JSON\n"
            "  -q, --quiet          no header line\n");
}

static int parse(int argc, char **argv, opts_t *o)
{
    static struct option lo[] = {
        {"ranks", 1, 0, 'n'},   {"experts", 1, 0, 'E'},  {"topk", 1, 0, 'K'},
        {"hidden", 1, 0, 'H'},  {"tokens", 1, 0, 'T'},   {"dtype", 1, 0, 'd'},
        {"routing", 1, 0, 'r'}, {"mask", 1, 0, 'm'},     {"vary-tokens", 0, 0, 'v'},
        {"empty", 1, 0, 'z'},   {"iters", 1, 0, 'i'},    {"warmup", 1, 0, 'w'},
        {"seed", 1, 0, 's'},    {"transport", 1, 0, 't'}, {"device", 1, 0, 'D'},
        {"launcher", 1, 0, 'L'}, {"no-check", 0, 0, 'C'}, {"json", 1, 0, 'j'},
        {"quiet", 0, 0, 'q'},   {"help", 0, 0, 'h'},     {"sms", 1, 0, 'S'},
        {0, 0, 0, 0}};
    *o = (opts_t){.ranks = 8, .experts = 256, .topk = 8, .hidden = 7168,
                  .tokens = 128, .iters = 20, .warmup = 3, .fp8 = 1,
                  .check = 1, .seed = 1, .transport = NULL, .device = "cpu",
                  .launcher = "auto", .routing = "uniform"};
    int c;
    while ((c = getopt_long(argc, argv, "n:qh", lo, NULL)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'n': o->ranks = (int)strtol(optarg, &end, 10); break;
        case 'E': o->experts = (int)strtol(optarg, &end, 10); break;
        case 'K': o->topk = (int)strtol(optarg, &end, 10); break;
        case 'H': o->hidden = (int)strtol(optarg, &end, 10); break;
        case 'T': o->tokens = (int)strtol(optarg, &end, 10); break;
        case 'i': o->iters = (int)strtol(optarg, &end, 10); break;
        case 'w': o->warmup = (int)strtol(optarg, &end, 10); break;
        case 's': o->seed = strtoull(optarg, &end, 10); break;
        case 'm': o->mask = strtod(optarg, &end); break;
        case 'z': o->empty = strtod(optarg, &end); break;
        case 'v': o->vary = 1; break;
        case 'S': o->sms = (int)strtol(optarg, &end, 10); break;
        case 'C': o->check = 0; break;
        case 'q': o->quiet = 1; break;
        case 'j': o->json = optarg; break;
        case 'L': o->launcher = optarg; break;
        case 'D': o->device = optarg; break;
        case 't': o->transport = optarg; break;
        case 'd':
            if (strcmp(optarg, "fp8") == 0)
                o->fp8 = 1;
            else if (strcmp(optarg, "bf16") == 0)
                o->fp8 = 0;
            else if (strcmp(optarg, "mixed") == 0)
                o->fp8 = 2; /* two contexts, bf16 and fp8, alternating */
            else {
                fprintf(stderr, "ferry-bench: --dtype %s: use fp8 or bf16\n", optarg);
                return -1;
            }
            break;
        case 'r':
            o->routing = optarg;
            if (strcmp(optarg, "uniform") == 0)
                o->zipf = 0;
            else if (strncmp(optarg, "zipf:", 5) == 0 &&
                     (o->zipf = strtod(optarg + 5, &end)) > 0 && *end == 0)
                end = NULL;
            else {
                fprintf(stderr, "ferry-bench: --routing %s: use uniform or zipf:S (S > 0)\n",
                        optarg);
                return -1;
            }
            break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
        if (end && *end) {
            fprintf(stderr, "ferry-bench: bad number '%s'\n", optarg);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "ferry-bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (o->iters < 1 || o->warmup < 0 || o->ranks < 1 || o->tokens < 0) {
        fprintf(stderr, "ferry-bench: --iters >= 1, --warmup >= 0, --ranks >= 1, --tokens >= 0\n");
        return -1;
    }
    return 0;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double p)
{
    if (n == 0)
        return NAN;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    int i = (int)ceil(p * n) - 1;
    if (i < 0)
        i = 0;
    if (i >= n)
        i = n - 1;
    return v[i];
}

static int in_launcher(void)
{
    return getenv("FERRY_RANK") || getenv("OMPI_COMM_WORLD_RANK") ||
           getenv("PMI_RANK") || getenv("SLURM_PROCID") ||
           (getenv("RANK") && getenv("WORLD_SIZE"));
}

#ifdef FERRY_HAVE_MPI
static int have_mpirun(void)
{
    const char *path = getenv("PATH");
    if (!path)
        return 0;
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    char *save = NULL;
    for (char *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        char p[4200];
        snprintf(p, sizeof(p), "%s/mpirun", d);
        if (access(p, X_OK) == 0)
            return 1;
    }
    return 0;
}
#endif

/* ---------------------------------------------------------------------- */
/* the MPI baseline: counts, then one copy per (token, expert), and back   */

#ifdef FERRY_HAVE_MPI
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

static int base_init(base_t *b, const fw_spec_t *s)
{
    memset(b, 0, sizeof(*b));
    MPI_Comm_size(MPI_COMM_WORLD, &b->N);
    MPI_Comm_rank(MPI_COMM_WORLD, &b->me);
    b->El = s->E / s->N;
    /* sized for bf16 rows, the larger of the two dtypes */
    b->pay = 2 * (size_t)s->H + (size_t)s->H / 128 * 4 + 16;
    b->item = 8 + b->pay;
    size_t maxi = (size_t)s->T * s->K, maxr = (size_t)s->N * s->T * s->K;
    b->scnt = calloc((size_t)b->N * 8, sizeof(int));
    b->rcnt = b->scnt + b->N;
    b->sdsp = b->rcnt + b->N;
    b->rdsp = b->sdsp + b->N;
    b->sb = b->rdsp + b->N;
    b->rb = b->sb + b->N;
    b->sbd = b->rb + b->N;
    b->rbd = b->sbd + b->N;
    b->sbuf = malloc(maxi * b->item + 1);
    b->rbuf = malloc(maxr * b->item + 1);
    b->item_pos = malloc(sizeof(int32_t) * (maxi + 1));
    b->rrow = malloc(sizeof(int32_t) * (maxr + 1));
    b->ybuf_s = malloc(maxr * 2 * (size_t)s->H + 1);
    b->ybuf_r = malloc(maxi * 2 * (size_t)s->H + 1);
    b->q = malloc((size_t)(s->T + 1) * fw_token_bytes(s));
    memset(b->sbuf, 0, maxi * b->item + 1); /* pre-fault, as for ferry */
    memset(b->rbuf, 0, maxr * b->item + 1);
    memset(b->ybuf_s, 0, maxr * 2 * (size_t)s->H + 1);
    memset(b->ybuf_r, 0, maxi * 2 * (size_t)s->H + 1);
    b->qs = malloc(sizeof(float) * (size_t)(s->T + 1) * (size_t)(s->H / 128 + 1));
    return b->sbuf && b->rbuf && b->ybuf_s && b->ybuf_r ? 0 : -1;
}

static void base_free(base_t *b)
{
    free(b->scnt);
    free(b->sbuf);
    free(b->rbuf);
    free(b->item_pos);
    free(b->rrow);
    free(b->ybuf_s);
    free(b->ybuf_r);
    free(b->q);
    free(b->qs);
}

static void base_dispatch(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                          uint8_t *ex, float *exs, int32_t *cnt, int32_t *sr,
                          int32_t *st, size_t cap)
{
    int N = b->N, K = s->K, El = b->El, T = in->T;
    size_t tb = fw_token_bytes(s), ns = s->fp8 ? (size_t)s->H / 128 : 0;
    b->pay = tb + 4 * ns;
    b->item = 8 + b->pay;
    const uint8_t *tok = (const uint8_t *)in->x;
    const float *scl = NULL;
    if (s->fp8) {
        /* the same quantiser ferry uses */
        for (int t = 0; t < T; t++)
            for (int bl = 0; bl < s->H / 128; bl++)
                fr_quant_block(in->x + (size_t)t * s->H + bl * 128,
                               b->q + (size_t)t * s->H + bl * 128,
                               &b->qs[(size_t)t * ns + bl]);
        tok = b->q;
        scl = b->qs;
    }
    memset(b->scnt, 0, sizeof(int) * (size_t)N);
    for (int i = 0; i < T * K; i++)
        if (in->idx[i] >= 0)
            b->scnt[in->idx[i] / El]++;
    int off = 0;
    for (int d = 0; d < N; d++) {
        b->sdsp[d] = off;
        off += b->scnt[d];
    }
    int *fill = b->sb; /* temporary */
    memcpy(fill, b->sdsp, sizeof(int) * (size_t)N);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int64_t e = in->idx[(size_t)t * K + k];
            b->item_pos[t * K + k] = -1;
            if (e < 0)
                continue;
            int d = (int)(e / El), pos = fill[d]++;
            uint8_t *it = b->sbuf + (size_t)pos * b->item;
            int32_t meta[2] = {t, (int32_t)(e % El)};
            memcpy(it, meta, 8);
            memcpy(it + 8, tok + (size_t)t * tb, tb);
            if (ns)
                memcpy(it + 8 + tb, scl + (size_t)t * ns, ns * 4);
            b->item_pos[t * K + k] = pos;
        }
    MPI_Alltoall(b->scnt, 1, MPI_INT, b->rcnt, 1, MPI_INT, MPI_COMM_WORLD);
    int roff = 0;
    for (int d = 0; d < N; d++) {
        b->rdsp[d] = roff;
        roff += b->rcnt[d];
        b->sb[d] = b->scnt[d] * (int)b->item;
        b->sbd[d] = b->sdsp[d] * (int)b->item;
        b->rb[d] = b->rcnt[d] * (int)b->item;
        b->rbd[d] = b->rdsp[d] * (int)b->item;
    }
    b->nrecv = roff;
    MPI_Alltoallv(b->sbuf, b->sb, b->sbd, MPI_BYTE, b->rbuf, b->rb, b->rbd,
                  MPI_BYTE, MPI_COMM_WORLD);
    /* lay out per local expert, ordered by source rank then token */
    memset(cnt, 0, sizeof(int32_t) * (size_t)El);
    for (int src = 0; src < N; src++)
        for (int j = b->rdsp[src]; j < b->rdsp[src] + b->rcnt[src]; j++) {
            const uint8_t *it = b->rbuf + (size_t)j * b->item;
            int32_t meta[2];
            memcpy(meta, it, 8);
            int le = meta[1];
            size_t row = (size_t)le * cap + (size_t)cnt[le]++;
            memcpy(ex + row * tb, it + 8, tb);
            if (ns)
                memcpy(exs + row * ns, it + 8 + tb, ns * 4);
            sr[row] = src;
            st[row] = meta[0];
            b->rrow[j] = (int32_t)row;
        }
}

static void base_combine(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                         const uint16_t *ey, uint16_t *out, float *acc)
{
    int N = b->N, K = s->K, H = s->H;
    size_t rowb = 2 * (size_t)H;
    for (int j = 0; j < b->nrecv; j++)
        memcpy(b->ybuf_s + (size_t)j * rowb, ey + (size_t)b->rrow[j] * H, rowb);
    for (int d = 0; d < N; d++) {
        b->sb[d] = b->rcnt[d] * (int)rowb;
        b->sbd[d] = b->rdsp[d] * (int)rowb;
        b->rb[d] = b->scnt[d] * (int)rowb;
        b->rbd[d] = b->sdsp[d] * (int)rowb;
    }
    MPI_Alltoallv(b->ybuf_s, b->sb, b->sbd, MPI_BYTE, b->ybuf_r, b->rb, b->rbd,
                  MPI_BYTE, MPI_COMM_WORLD);
    for (int t = 0; t < in->T; t++) {
        memset(acc, 0, sizeof(float) * (size_t)H);
        for (int k = 0; k < K; k++) {
            int p = b->item_pos[t * K + k];
            if (p < 0)
                continue;
            const uint16_t *y = (const uint16_t *)(b->ybuf_r + (size_t)p * rowb);
            fr_axpy_bf16(acc, in->w[(size_t)t * K + k], y, H);
        }
        fr_row_to_bf16(acc, out + (size_t)t * H, H);
    }
}

static int mpi_allgather_cb(const void *in, void *out, size_t len, void *ctx)
{
    (void)ctx;
    return MPI_Allgather(in, (int)len, MPI_BYTE, out, (int)len, MPI_BYTE,
                         MPI_COMM_WORLD) == MPI_SUCCESS ? 0 : -1;
}
#endif

/* ---------------------------------------------------------------------- */

/* Dispatch bytes this rank sends to other ranks: one record per (token,
 * remote rank). */
static double dispatch_bytes(const fw_input_t *in, int K, int El, int me, size_t rec)
{
    double bytes = 0;
    for (int t = 0; t < in->T; t++) {
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

/* --device cuda: inputs are copied to the GPU before a round and outputs
 * back after it, outside the timed calls. */

typedef struct dev {
    int on;
    void *stream;
    void *x, *idx, *w, *out, *ex, *exs, *cnt, *sr, *st, *ey;
} dev_t_;

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

static int dev_init(dev_t_ *d, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    size_t T = (size_t)(s->T > 0 ? s->T : 1), El = (size_t)lay->num_local_experts;
    size_t cap = (size_t)lay->expert_capacity;
    DEVCHK(cudaStreamCreateWithFlags((cudaStream_t *)&d->stream, cudaStreamNonBlocking));
    DEVCHK(cudaMalloc(&d->x, T * s->H * 2));
    DEVCHK(cudaMalloc(&d->idx, T * s->K * 8));
    DEVCHK(cudaMalloc(&d->w, T * s->K * 4));
    DEVCHK(cudaMalloc(&d->out, T * s->H * 2));
    DEVCHK(cudaMalloc(&d->ex, lay->expert_x_bytes + 16));
    DEVCHK(cudaMalloc(&d->exs, lay->expert_scales_bytes + 16));
    DEVCHK(cudaMalloc(&d->cnt, El * 4));
    DEVCHK(cudaMalloc(&d->sr, El * cap * 4));
    DEVCHK(cudaMalloc(&d->st, El * cap * 4));
    DEVCHK(cudaMalloc(&d->ey, lay->expert_y_bytes + 16));
    d->on = 1;
    return 0;
}

static int dev_inputs(dev_t_ *d, const fw_spec_t *s, const fw_input_t *in)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    DEVCHK(cudaMemcpyAsync(d->x, in->x, (size_t)in->T * s->H * 2, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaMemcpyAsync(d->idx, in->idx, (size_t)in->T * s->K * 8, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaMemcpyAsync(d->w, in->w, (size_t)in->T * s->K * 4, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

/* expert rows back to the host: only the rows each expert filled */
static int dev_dispatch_out(dev_t_ *d, const ferry_ep_layout_t *lay, uint8_t *ex,
                            float *exs, int32_t *cnt, int32_t *sr, int32_t *st_)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    size_t El = (size_t)lay->num_local_experts, cap = (size_t)lay->expert_capacity;
    size_t tb = lay->token_bytes, ns = (size_t)lay->num_scales;
    DEVCHK(cudaMemcpy(cnt, d->cnt, El * 4, cudaMemcpyDeviceToHost));
    for (size_t le = 0; le < El; le++) {
        size_t n = (size_t)cnt[le], o = le * cap;
        if (!n || n > cap)
            continue;
        DEVCHK(cudaMemcpyAsync(ex + o * tb, (uint8_t *)d->ex + o * tb, n * tb, cudaMemcpyDeviceToHost, st));
        if (ns)
            DEVCHK(cudaMemcpyAsync(exs + o * ns, (float *)d->exs + o * ns, n * ns * 4, cudaMemcpyDeviceToHost, st));
        DEVCHK(cudaMemcpyAsync(sr + o, (int32_t *)d->sr + o, n * 4, cudaMemcpyDeviceToHost, st));
        DEVCHK(cudaMemcpyAsync(st_ + o, (int32_t *)d->st + o, n * 4, cudaMemcpyDeviceToHost, st));
    }
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

static int dev_expert_y(dev_t_ *d, const ferry_ep_layout_t *lay, const int32_t *cnt,
                        const uint16_t *ey, int H)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    size_t El = (size_t)lay->num_local_experts, cap = (size_t)lay->expert_capacity;
    size_t rb = 2 * (size_t)H;
    for (size_t le = 0; le < El; le++)
        if (cnt[le] > 0 && (size_t)cnt[le] <= cap)
            DEVCHK(cudaMemcpyAsync((uint8_t *)d->ey + le * cap * rb, ey + le * cap * H,
                                   (size_t)cnt[le] * rb, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

static int dev_out(dev_t_ *d, uint16_t *out, int T, int H)
{
    DEVCHK(cudaMemcpy(out, d->out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    return 0;
}

static void dev_free(dev_t_ *d)
{
    if (!d->on)
        return;
    void *p[] = {d->x, d->idx, d->w, d->out, d->ex, d->exs, d->cnt, d->sr, d->st, d->ey};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        cudaFree(p[i]);
    cudaStreamDestroy((cudaStream_t)d->stream);
}
#else
static int dev_init(dev_t_ *d, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    (void)d; (void)s; (void)lay;
    fprintf(stderr, "ferry-bench: built without CUDA\n");
    return -1;
}
static int dev_inputs(dev_t_ *d, const fw_spec_t *s, const fw_input_t *in)
{ (void)d; (void)s; (void)in; return -1; }
static int dev_dispatch_out(dev_t_ *d, const ferry_ep_layout_t *lay, uint8_t *ex, float *exs,
                            int32_t *cnt, int32_t *sr, int32_t *st_)
{ (void)d; (void)lay; (void)ex; (void)exs; (void)cnt; (void)sr; (void)st_; return -1; }
static int dev_expert_y(dev_t_ *d, const ferry_ep_layout_t *lay, const int32_t *cnt,
                        const uint16_t *ey, int H)
{ (void)d; (void)lay; (void)cnt; (void)ey; (void)H; return -1; }
static int dev_out(dev_t_ *d, uint16_t *out, int T, int H)
{ (void)d; (void)out; (void)T; (void)H; return -1; }
static void dev_free(dev_t_ *d) { (void)d; }
#endif

static int launch(int argc, char **argv, const opts_t *o)
{
    int use_mpi = 0;
#ifdef FERRY_HAVE_MPI
    if (strcmp(o->launcher, "mpirun") == 0 ||
        (strcmp(o->launcher, "auto") == 0 && have_mpirun()))
        use_mpi = 1;
#endif
    if (strcmp(o->launcher, "auto") && strcmp(o->launcher, "mpirun") &&
        strcmp(o->launcher, "fork")) {
        fprintf(stderr, "ferry-bench: --launcher %s: use auto, mpirun or fork\n",
                o->launcher);
        return 2;
    }
    if (o->transport)
        setenv("FERRY_TRANSPORT", o->transport, 1);
    if (use_mpi) {
        /* mpirun starts the ranks; the baseline runs in the same job. */
        char n[16];
        snprintf(n, sizeof(n), "%d", o->ranks);
        char self[4096];
        ssize_t l = readlink("/proc/self/exe", self, sizeof(self) - 1);
        if (l <= 0)
            snprintf(self, sizeof(self), "%s", argv[0]);
        else
            self[l] = 0;
        const char *base[] = {"mpirun", "-n", n, "--oversubscribe",
                              "--bind-to", "none", "--mca", "btl", "self,vader",
                              "--mca", "mpi_yield_when_idle", "1"};
        int nb = (int)(sizeof(base) / sizeof(base[0]));
        char **av = calloc((size_t)(argc + nb + 4), sizeof(char *));
        int k = 0;
        for (int i = 0; i < nb; i++)
            av[k++] = (char *)base[i];
        if (geteuid() == 0)
            av[k++] = "--allow-run-as-root";
        av[k++] = self;
        for (int i = 1; i < argc; i++)
            av[k++] = argv[i];
        av[k] = NULL;
        fflush(stdout);
        execvp("mpirun", av);
        fprintf(stderr, "ferry-bench: exec mpirun: %s\n", strerror(errno));
        return 2;
    }
    int is_child = 0;
    fr_err_t err = {{0}};
    int rc = fr_launch_local(o->ranks, &is_child, &err);
    if (is_child)
        return -1; /* continue as a rank */
    if (rc < 0)
        fprintf(stderr, "ferry-bench: %s\n", err.msg);
    return rc == 0 ? 0 : (rc < 0 ? 2 : rc);
}

int main(int argc, char **argv)
{
    opts_t o;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse(argc, argv, &o) != 0)
        return 2;
    if (strcmp(o.device, "cpu") != 0 && strcmp(o.device, "cuda") != 0) {
        fprintf(stderr, "ferry-bench: --device %s: use cpu or cuda\n", o.device);
        return 2;
    }
    if (!in_launcher()) {
        int rc = launch(argc, argv, &o);
        if (rc >= 0)
            return rc;
    } else if (o.transport) {
        setenv("FERRY_TRANSPORT", o.transport, 1);
    }

    int have_base = 0;
    char errbuf[512] = "";
    ferry_comm_t comm = NULL;
    int rc;
#ifdef FERRY_HAVE_MPI
    if (getenv("OMPI_COMM_WORLD_RANK")) {
        MPI_Init(&argc, &argv);
        int r, n;
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        rc = ferry_comm_init_allgather(r, n, mpi_allgather_cb, NULL, &comm,
                                       errbuf, sizeof(errbuf));
        have_base = 1;
    } else
#endif
        rc = ferry_comm_init_env(&comm, errbuf, sizeof(errbuf));
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: communicator: %s: %s\n", ferry_strerror(rc), errbuf);
        return 1;
    }
    int me = ferry_comm_rank(comm), N = ferry_comm_size(comm);
    fw_spec_t s = {.N = N, .E = o.experts, .K = o.topk, .H = o.hidden,
                   .T = o.tokens, .fp8 = o.fp8, .zipf_s = o.zipf,
                   .mask_p = o.mask, .vary_tokens = o.vary, .empty_p = o.empty,
                   .seed = o.seed};
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = o.experts;
    cfg.topk = o.topk;
    cfg.hidden = o.hidden;
    cfg.max_tokens = o.tokens > 0 ? o.tokens : 1;
    cfg.dispatch_dtype = o.fp8 == 1 ? FERRY_DTYPE_FP8_E4M3 : FERRY_DTYPE_BF16;
    cfg.device = strcmp(o.device, "cuda") == 0 ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
    cfg.num_sms = o.sms;
    if (o.fp8 == 2 && cfg.device == FERRY_DEVICE_CUDA) {
        fprintf(stderr, "ferry-bench: --dtype mixed is for CPU ranks\n");
        return 2;
    }
    s.fp8 = o.fp8 == 1;
    ferry_ep_t ep = NULL, eps[2] = {NULL, NULL};
    rc = ferry_ep_create(comm, &cfg, &ep);
    eps[0] = ep;
    if (rc == FERRY_OK && o.fp8 == 2) {
        cfg.dispatch_dtype = FERRY_DTYPE_FP8_E4M3;
        rc = ferry_ep_create(comm, &cfg, &eps[1]);
    }
    if (rc != FERRY_OK) {
        if (me == 0)
            fprintf(stderr, "ferry-bench: rank %d: ep_create: %s: %s\n", me,
                    ferry_strerror(rc), ferry_comm_last_error(comm));
        ferry_comm_destroy(comm);
#ifdef FERRY_HAVE_MPI
        if (have_base)
            MPI_Finalize();
#endif
        return 1;
    }
    ferry_ep_layout_t lay = {.size = sizeof(lay)}, lays[2];
    ferry_ep_get_layout(ep, &lay);
    lays[0] = lays[1] = lay;
    if (eps[1])
        ferry_ep_get_layout(eps[1], &lays[1]);
    size_t cap = (size_t)lay.expert_capacity, El = (size_t)lay.num_local_experts;
    /* sized for the larger of the contexts (mixed: bf16 rows, fp8 scales) */
    uint8_t *ex = calloc(lay.expert_x_bytes + 1, 1);
    float *exs = calloc(lays[1].expert_scales_bytes + lay.expert_scales_bytes + 4, 1);
    int32_t *cnt = calloc(El, sizeof(int32_t));
    int32_t *sr = calloc(El * cap + 1, sizeof(int32_t));
    int32_t *st = calloc(El * cap + 1, sizeof(int32_t));
    uint16_t *ey = calloc(lay.expert_y_bytes / 2 + 1, 2);
    uint16_t *out = calloc((size_t)cfg.max_tokens * o.hidden + 1, 2);
    float *acc = calloc((size_t)o.hidden, sizeof(float));
    fw_input_t in;
    if (!ex || !exs || !cnt || !sr || !st || !ey || !out || !acc ||
        fw_input_alloc(&s, &in)) {
        fprintf(stderr, "ferry-bench: rank %d: out of memory\n", me);
        return 1;
    }
    /* Touch every page once, as an engine's long-lived tensors would be, so
     * no first-touch page faults land in whichever side runs first. */
    memset(ex, 1, lay.expert_x_bytes);
    memset(exs, 1, lays[1].expert_scales_bytes + lay.expert_scales_bytes);
    memset(ey, 1, lay.expert_y_bytes);
    memset(sr, 1, (El * cap + 1) * sizeof(int32_t));
    memset(st, 1, (El * cap + 1) * sizeof(int32_t));
    dev_t_ dv;
    memset(&dv, 0, sizeof(dv));
    if (cfg.device == FERRY_DEVICE_CUDA && dev_init(&dv, &s, &lay) != 0) {
        fprintf(stderr, "ferry-bench: rank %d: GPU buffers\n", me);
        return 1;
    }
    int total = o.warmup + o.iters;
    /* per iteration: ferry dispatch, combine, base dispatch, combine, bytes */
    double *tm = calloc((size_t)o.iters * 5, sizeof(double));
    long wrong = 0;
    const char *fail = NULL;
#ifdef FERRY_HAVE_MPI
    base_t b;
    if (have_base && base_init(&b, &s) != 0) {
        fprintf(stderr, "ferry-bench: rank %d: out of memory (baseline)\n", me);
        return 1;
    }
#endif
    double last_progress = now_us();
#ifdef FERRY_HAVE_CUDA
    /* GPU ranks without checking: rounds back to back on the stream, timed
     * with CUDA events (no host barrier or copies between rounds, so the
     * ranks stay in step the way an inference engine runs them). */
    if (dv.on && !o.check) {
        cudaEvent_t *evs = calloc((size_t)total * 3, sizeof(cudaEvent_t));
        for (int i = 0; i < total * 3; i++)
            cudaEventCreate(&evs[i]);
        cudaStream_t cst = (cudaStream_t)dv.stream;
        fw_generate(&s, 1, me, &in);
        if (dev_inputs(&dv, &s, &in) != 0)
            fail = "copy to GPU";
        ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T, .x = dv.x,
                                   .topk_idx = dv.idx, .stream = dv.stream};
        ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = dv.ex,
                                     .expert_x_scales = dv.exs, .expert_num_tokens = dv.cnt,
                                     .stream = dv.stream};
        ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = dv.ey, .stream = dv.stream};
        ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = dv.w, .out = dv.out,
                                    .stream = dv.stream};
        bench_barrier(comm, have_base);
        for (int it = 0; it < total && !fail; it++) {
            uint64_t round = 0;
            cudaEventRecord(evs[it * 3], cst);
            rc = ferry_dispatch_send(ep, &din, &round);
            if (rc == FERRY_OK)
                rc = ferry_dispatch_recv(ep, round, &dout);
            cudaEventRecord(evs[it * 3 + 1], cst);
            if (rc == FERRY_OK)
                rc = ferry_combine_send(ep, round, &cin);
            if (rc == FERRY_OK)
                rc = ferry_combine_recv(ep, round, &cout);
            cudaEventRecord(evs[it * 3 + 2], cst);
            if (rc != FERRY_OK)
                fail = "round";
        }
        if (!fail && ferry_ep_sync(ep, dv.stream) != FERRY_OK)
            fail = "round";
        for (int it = o.warmup; it < total && !fail; it++) {
            float a = 0, b2 = 0;
            cudaEventElapsedTime(&a, evs[it * 3], evs[it * 3 + 1]);
            cudaEventElapsedTime(&b2, evs[it * 3 + 1], evs[it * 3 + 2]);
            double *r = tm + (size_t)(it - o.warmup) * 5;
            r[0] = a * 1000.0;
            r[1] = b2 * 1000.0;
            r[2] = r[3] = NAN;
            /* payload to other ranks: dispatch records, and (estimated by
             * symmetry) as many combine rows as this rank's remote pairs */
            size_t rec = lay.token_bytes + 4 * (size_t)lay.num_scales;
            double bytes = dispatch_bytes(&in, s.K, (int)El, me, rec);
            for (int i2 = 0; i2 < in.T * s.K; i2++)
                if (in.idx[i2] >= 0 && in.idx[i2] / (int)El != me)
                    bytes += 2.0 * o.hidden;
            r[4] = bytes;
        }
        for (int i = 0; i < total * 3; i++)
            cudaEventDestroy(evs[i]);
        free(evs);
        total = 0; /* skip the checked loop below */
        if (fail)
            rc = ferry_ep_sync(ep, dv.stream);
    }
#endif
    for (int it = 0; it < total && !fail; it++) {
        uint64_t round_id = (uint64_t)it + 1;
        if (o.fp8 == 2) { /* alternate the contexts: the dtype changes */
            ep = eps[it & 1];
            lay = lays[it & 1];
            s.fp8 = it & 1;
        }
        fw_generate(&s, round_id, me, &in);
        ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T,
                                   .x = in.x, .topk_idx = in.idx};
        ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = ex,
                                     .expert_x_scales = exs,
                                     .expert_num_tokens = cnt,
                                     .expert_src_rank = sr,
                                     .expert_src_token = st};
        ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = ey};
        ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = in.w,
                                    .out = out};
        if (dv.on) {
            if (dev_inputs(&dv, &s, &in) != 0) {
                fail = "copy to GPU";
                break;
            }
            din.x = dv.x;
            din.topk_idx = dv.idx;
            din.stream = dout.stream = cin.stream = cout.stream = dv.stream;
            dout.expert_x = dv.ex;
            dout.expert_x_scales = dv.exs;
            dout.expert_num_tokens = dv.cnt;
            dout.expert_src_rank = dv.sr;
            dout.expert_src_token = dv.st;
            cin.expert_y = dv.ey;
            cout.topk_weights = dv.w;
            cout.out = dv.out;
        }
        uint64_t round = 0;
        if ((rc = bench_barrier(comm, have_base)) != FERRY_OK) {
            fail = "barrier";
            break;
        }
        double t0 = now_us();
        rc = ferry_dispatch_send(ep, &din, &round);
        if (rc == FERRY_OK)
            rc = ferry_dispatch_recv(ep, round, &dout);
        if (rc == FERRY_OK)
            rc = ferry_ep_sync(ep, dv.stream); /* GPU: wait, then check */
        double t1 = now_us();
        if (rc != FERRY_OK) {
            fail = "dispatch";
            break;
        }
        if (dv.on && dev_dispatch_out(&dv, &lay, ex, exs, cnt, sr, st) != 0) {
            fail = "copy from GPU";
            break;
        }
        if (o.check)
            wrong += fw_check_dispatch(&s, round_id, me, ex, exs, cnt, sr, st,
                                       cap, 3);
        fw_run_experts(&s, me, ex, exs, cnt, cap, ey);
        if (dv.on && dev_expert_y(&dv, &lay, cnt, ey, o.hidden) != 0) {
            fail = "copy to GPU";
            break;
        }
        if ((rc = bench_barrier(comm, have_base)) != FERRY_OK) {
            fail = "barrier";
            break;
        }
        double t2 = now_us();
        rc = ferry_combine_send(ep, round, &cin);
        if (rc == FERRY_OK)
            rc = ferry_combine_recv(ep, round, &cout);
        if (rc == FERRY_OK)
            rc = ferry_ep_sync(ep, dv.stream);
        double t3 = now_us();
        if (rc != FERRY_OK) {
            fail = "combine";
            break;
        }
        if (dv.on && dev_out(&dv, out, in.T, o.hidden) != 0) {
            fail = "copy from GPU";
            break;
        }
        if (o.check)
            wrong += fw_check_combine(&s, round_id, me, &in, out, 3);
        /* bytes this rank sent to other ranks this round */
        double bytes = dispatch_bytes(&in, s.K, (int)El, me,
                                      lay.token_bytes + 4 * (size_t)lay.num_scales);
        {
            for (size_t le = 0; le < El; le++)
                for (int i = 0; i < cnt[le]; i++)
                    if (sr[le * cap + (size_t)i] != me)
                        bytes += 2.0 * o.hidden;
        }
        double bd = NAN, bc = NAN;
#ifdef FERRY_HAVE_MPI
        if (have_base) {
            MPI_Barrier(MPI_COMM_WORLD);
            double b0 = now_us();
            base_dispatch(&b, &s, &in, ex, exs, cnt, sr, st, cap);
            double b1 = now_us();
            if (o.check)
                wrong += fw_check_dispatch(&s, round_id, me, ex, exs, cnt, sr,
                                           st, cap, 3);
            fw_run_experts(&s, me, ex, exs, cnt, cap, ey);
            MPI_Barrier(MPI_COMM_WORLD);
            double b2 = now_us();
            base_combine(&b, &s, &in, ey, out, acc);
            double b3 = now_us();
            if (o.check)
                wrong += fw_check_combine(&s, round_id, me, &in, out, 3);
            bd = b1 - b0;
            bc = b3 - b2;
        }
#endif
        if (it >= o.warmup) {
            double *r = tm + (size_t)(it - o.warmup) * 5;
            r[0] = t1 - t0;
            r[1] = t3 - t2;
            r[2] = bd;
            r[3] = bc;
            r[4] = bytes;
        }
        if (me == 0 && now_us() - last_progress > 10e6) {
            fprintf(stderr, "ferry-bench: round %d of %d, %ld wrong so far (rank 0)\n",
                    it + 1, total, wrong);
            last_progress = now_us();
        }
    }
    if (fail) {
        fprintf(stderr, "ferry-bench: rank %d: %s failed: %s: %s\n", me, fail,
                ferry_strerror(rc),
                strcmp(fail, "barrier") == 0 ? ferry_comm_last_error(comm)
                                             : ferry_ep_last_error(ep));
        ferry_ep_destroy(eps[0]);
        if (eps[1])
            ferry_ep_destroy(eps[1]);
        ferry_comm_destroy(comm);
        /* Leave without MPI_Finalize: peers may be gone. */
        _exit(1);
    }

    /* Gather every rank's timings; a round takes as long as its slowest
     * rank. */
    size_t per = (size_t)o.iters * 5 + 1;
    double *mine = calloc(per, sizeof(double));
    double *all = calloc(per * (size_t)N, sizeof(double));
    memcpy(mine, tm, sizeof(double) * (size_t)o.iters * 5);
    mine[per - 1] = (double)wrong;
    rc = ferry_comm_allgather(comm, mine, all, per * sizeof(double));
    int status = 0;
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: rank %d: gathering results: %s\n", me,
                ferry_comm_last_error(comm));
        status = 1;
    } else if (me == 0) {
        double *col[4];
        for (int c = 0; c < 4; c++)
            col[c] = calloc((size_t)o.iters, sizeof(double));
        double bytes = 0;
        long twrong = 0;
        for (int r = 0; r < N; r++)
            twrong += (long)all[(size_t)r * per + per - 1];
        for (int i = 0; i < o.iters; i++) {
            for (int c = 0; c < 4; c++) {
                double m = 0;
                for (int r = 0; r < N; r++) {
                    double v = all[(size_t)r * per + (size_t)i * 5 + c];
                    m = v > m ? v : m;
                }
                col[c][i] = m;
            }
            for (int r = 0; r < N; r++)
                bytes += all[(size_t)r * per + (size_t)i * 5 + 4];
        }
        bytes /= (double)o.iters * N;
        double dp50 = pct(col[0], o.iters, 0.5), dp99 = pct(col[0], o.iters, 0.99);
        double cp50 = pct(col[1], o.iters, 0.5), cp99 = pct(col[1], o.iters, 0.99);
        double bd50 = have_base ? pct(col[2], o.iters, 0.5) : NAN;
        double bc50 = have_base ? pct(col[3], o.iters, 0.5) : NAN;
        double gbs = bytes / ((dp50 + cp50) * 1e-6) / 1e9;
        double speed = have_base ? (bd50 + bc50) / (dp50 + cp50) : NAN;
        const char *tr = getenv("FERRY_TRANSPORT");
        if (!o.quiet)
            printf("# ferry-bench: %d ranks (%s), device %s, transport %s%s%s, "
                   "routing %s, %d iters after %d warmup, seed %llu%s\n"
                   "#%5s %5s %3s %6s %6s %5s %10s %10s %10s %10s %9s %8s %10s %10s %8s %7s\n",
                   N, have_base ? "mpirun" : "launcher", o.device,
                   tr ? tr : "auto", getenv("FI_PROVIDER") ? " FI_PROVIDER=" : "",
                   getenv("FI_PROVIDER") ? getenv("FI_PROVIDER") : "", o.routing,
                   o.iters, o.warmup, (unsigned long long)o.seed,
                   cfg.device == FERRY_DEVICE_CUDA && !o.check
                       ? ", GPU rounds back to back, CUDA-event times, no check"
                       : "",
                   "ranks", "E",
                   "K", "H", "T", "dtype", "disp_p50", "disp_p99", "comb_p50",
                   "comb_p99", "MB/rank", "GB/s", "base_disp", "base_comb",
                   "speedup", "#wrong");
        char wbuf[32];
        if (o.check)
            snprintf(wbuf, sizeof(wbuf), "%ld", twrong);
        else
            snprintf(wbuf, sizeof(wbuf), "n/a");
        printf(" %5d %5d %3d %6d %6d %5s %10.1f %10.1f %10.1f %10.1f %9.2f %8.2f %10.1f %10.1f %8.2f %7s\n",
               N, o.experts, o.topk, o.hidden, o.tokens, o.fp8 == 2 ? "mixed" : o.fp8 ? "fp8" : "bf16",
               dp50, dp99, cp50, cp99, bytes / 1e6, gbs, bd50, bc50, speed, wbuf);
        if (o.json) {
            FILE *f = fopen(o.json, "w");
            if (!f) {
                fprintf(stderr, "ferry-bench: --json %s: %s\n", o.json, strerror(errno));
                status = 1;
            } else {
                fprintf(f,
                        "{\"ranks\": %d, \"experts\": %d, \"topk\": %d, \"hidden\": %d, "
                        "\"tokens\": %d, \"dtype\": \"%s\", \"routing\": \"%s\", "
                        "\"transport\": \"%s\", \"device\": \"%s\", \"iters\": %d, "
                        "\"dispatch_p50_us\": %.3f, \"dispatch_p99_us\": %.3f, "
                        "\"combine_p50_us\": %.3f, \"combine_p99_us\": %.3f, "
                        "\"bytes_per_rank\": %.0f, \"gbps\": %.4f, "
                        "\"baseline_dispatch_p50_us\": %.3f, \"baseline_combine_p50_us\": %.3f, "
                        "\"speedup\": %.4f, \"wrong\": %ld, \"checked\": %s}\n",
                        N, o.experts, o.topk, o.hidden, o.tokens, o.fp8 == 2 ? "mixed" : o.fp8 ? "fp8" : "bf16",
                        o.routing, tr ? tr : "auto", o.device, o.iters, dp50, dp99, cp50,
                        cp99, bytes, gbs, have_base ? bd50 : -1.0, have_base ? bc50 : -1.0,
                        have_base ? speed : -1.0, twrong, o.check ? "true" : "false");
                fclose(f);
            }
        }
        if (twrong > 0) {
            fprintf(stderr, "ferry-bench: %ld wrong results\n", twrong);
            status = 1;
        }
        for (int c = 0; c < 4; c++)
            free(col[c]);
    }
    if (wrong > 0)
        status = 1;
    dev_free(&dv);
    rc = ferry_ep_destroy(eps[0]);
    if (eps[1] && rc == FERRY_OK)
        rc = ferry_ep_destroy(eps[1]);
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: rank %d: ep_destroy: %s\n", me, ferry_strerror(rc));
        status = 1;
    }
    ferry_comm_destroy(comm);
#ifdef FERRY_HAVE_MPI
    if (have_base) {
        base_free(&b);
        MPI_Finalize();
    }
#endif
    free(mine);
    free(all);
    free(tm);
    free(ex);
    free(exs);
    free(cnt);
    free(sr);
    free(st);
    free(ey);
    free(out);
    free(acc);
    fw_input_free(&in);
    return status;
}
