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
 *
 * Under mpirun the same round also runs through MPI, the exchange users
 * write without ferry: MPI_Alltoall of per-rank token counts, one
 * MPI_Alltoallv of the rows (each token once per rank, with its slots and
 * weights), and the partial rows back the same way, summed in rank order.
 * Its outputs go through the same checks.
 *
 * --device cuda: inputs go to the GPU before the round and outputs come
 * back after each call, outside the timing; the calls run on one stream
 * and are timed up to ferry_ep_sync on it (route_create synchronises
 * itself).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FERRY_HAVE_MPI
#include <mpi.h>
#endif
#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "bench.h"
#include "core/quant.h"

/* The MPI baseline's counts and buffers (under mpirun). */
typedef struct ht_base {
    int *sc, *rc, *sd, *rd;          /* counts and displacements (rows) */
    int *scb, *rcb, *sdb, *rdb;      /* the same in bytes */
    uint8_t *sbuf, *rbuf;
    size_t scap, rcap;
} ht_base_t;

/* --device cuda: the GPU's copies (inputs [T], outputs [rows]); the
 * calls run on `stream`, timed up to ferry_ep_sync on it. */
typedef struct ht_dev {
    int on;
    void *stream;
    size_t rows;
    void *x, *xs, *w, *idx, *out;         /* [T] */
    void *rx, *rxs, *rw, *ridx, *rsr, *rst, *y; /* [rows] */
} ht_dev_t;

typedef struct ht_io {
    size_t rows;                 /* capacity of the receive buffers */
    uint8_t *q;                  /* [T][H] fp8 of x (--dtype fp8) */
    float *qs;
    uint8_t *rx;                 /* [rows][row bytes] */
    float *rxs, *rw;
    int32_t *ridx, *rsr, *rst;
    uint16_t *y, *out, *tmp16;
    float *acc, *f, *sc;
    float *acc_all;              /* baseline: [T][H] sums */
    uint8_t *row;
    fw_input_t other;            /* another rank's inputs, regenerated */
    ht_base_t base;
    ht_dev_t dv;
} ht_io_t;

#ifdef FERRY_HAVE_CUDA
static int ht_dev_init(ht_dev_t *d, const fw_spec_t *s)
{
    size_t T = (size_t)(s->T > 0 ? s->T : 1), H = (size_t)s->H, K = (size_t)s->K;
    DEVCHK(cudaStreamCreateWithFlags((cudaStream_t *)&d->stream, cudaStreamNonBlocking));
    DEVCHK(cudaMalloc(&d->x, T * H * 2));
    DEVCHK(cudaMalloc(&d->xs, (T * H / 128 + 1) * 4));
    DEVCHK(cudaMalloc(&d->w, T * K * 4));
    DEVCHK(cudaMalloc(&d->idx, T * K * 8));
    DEVCHK(cudaMalloc(&d->out, T * H * 2));
    d->on = 1;
    return 0;
}

static int ht_dev_grow(ht_dev_t *d, const fw_spec_t *s, size_t rows)
{
    if (rows <= d->rows && d->rx)
        return 0;
    size_t H = (size_t)s->H, K = (size_t)s->K;
    void *p[] = {d->rx, d->rxs, d->rw, d->ridx, d->rsr, d->rst, d->y};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        cudaFree(p[i]);
    d->rows = rows + rows / 4 + 16;
    DEVCHK(cudaMalloc(&d->rx, d->rows * 2 * H));
    DEVCHK(cudaMalloc(&d->rxs, d->rows * (H / 128 + 1) * 4));
    DEVCHK(cudaMalloc(&d->rw, d->rows * K * 4));
    DEVCHK(cudaMalloc(&d->ridx, d->rows * K * 4));
    DEVCHK(cudaMalloc(&d->rsr, d->rows * 4));
    DEVCHK(cudaMalloc(&d->rst, d->rows * 4));
    DEVCHK(cudaMalloc(&d->y, d->rows * 2 * H));
    return 0;
}

static int ht_dev_put(ht_dev_t *d, void *dst, const void *src, size_t n)
{
    if (n)
        DEVCHK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, (cudaStream_t)d->stream));
    return 0;
}

static int ht_dev_get(ht_dev_t *d, void *dst, const void *src, size_t n)
{
    if (n)
        DEVCHK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)d->stream));
    return 0;
}

static int ht_dev_wait(ht_dev_t *d)
{
    DEVCHK(cudaStreamSynchronize((cudaStream_t)d->stream));
    return 0;
}

static void ht_dev_free(ht_dev_t *d)
{
    if (!d->on)
        return;
    void *p[] = {d->x, d->xs, d->w, d->idx, d->out, d->rx, d->rxs, d->rw, d->ridx, d->rsr,
                 d->rst, d->y};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        cudaFree(p[i]);
    cudaStreamDestroy((cudaStream_t)d->stream);
}
#else
static int ht_dev_init(ht_dev_t *d, const fw_spec_t *s)
{
    (void)d; (void)s;
    fprintf(stderr, "ferry-bench: built without CUDA\n");
    return -1;
}
static int ht_dev_grow(ht_dev_t *d, const fw_spec_t *s, size_t rows)
{ (void)d; (void)s; (void)rows; return -1; }
static int ht_dev_put(ht_dev_t *d, void *dst, const void *src, size_t n)
{ (void)d; (void)dst; (void)src; (void)n; return -1; }
static int ht_dev_get(ht_dev_t *d, void *dst, const void *src, size_t n)
{ (void)d; (void)dst; (void)src; (void)n; return -1; }
static int ht_dev_wait(ht_dev_t *d) { (void)d; return -1; }
static void ht_dev_free(ht_dev_t *d) { (void)d; }
#endif

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

/* Token t of `in` as the experts see it (fp8: quantised, then back to
 * fp32) into io->f, for ht_partial: once per token, whatever the ranks it
 * goes to (the reference's largest cost). */
static void ht_token_in(const fw_spec_t *s, const fw_input_t *in, int t, ht_io_t *io)
{
    ht_row(s, in, t, io->row, io->sc);
    fw_row_to_f32(s, io->row, io->sc, io->f);
}

/* The partial row rank d returns for token t of `in` (in io->f:
 * ht_token_in): bf16 of the sum over d's slots of w_k f_e(x), in fp32, in
 * k order. */
static void ht_partial(const fw_spec_t *s, const fw_input_t *in, int t, int d, ht_io_t *io,
                       uint16_t *y)
{
    int H = s->H, K = s->K, El = s->E / s->N;
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

/* The experts: a partial row per received row, from its source's
 * regenerated inputs (rows come by source: regenerated once each). A row
 * whose source rank or token is out of range (a wrong dispatch) gets a
 * zero row and counts as wrong: the benchmark never indexes with it. */
static void ht_experts(bench_t *b, ht_io_t *io, uint64_t round, int n)
{
    const fw_spec_t *s = &b->s;
    for (int i = 0, src = -1; i < n; i++) {
        uint16_t *y = io->y + (size_t)i * s->H;
        int r = io->rsr[i], t = io->rst[i];
        if (r < 0 || r >= s->N) {
            memset(y, 0, 2 * (size_t)s->H);
            if (b->wrong++ < 3)
                fprintf(stderr, "ferry-bench: rank %d: received row %d names source rank %d\n",
                        b->me, i, r);
            continue;
        }
        if (r != src)
            fw_generate(s, round, src = r, &io->other);
        int t0, t1; /* DP groups: t is an index in the source's share */
        fw_share(s, io->other.T, r, &t0, &t1);
        t += t0;
        if (t < t0 || t >= t1) {
            memset(y, 0, 2 * (size_t)s->H);
            if (b->wrong++ < 3)
                fprintf(stderr, "ferry-bench: rank %d: received row %d names token %d of "
                        "rank %d (it has %d)\n", b->me, i, t - t0, r, t1 - t0);
            continue;
        }
        ht_token_in(s, &io->other, t, io);
        ht_partial(s, &io->other, t, b->me, io, y);
    }
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
        int t0, t1;
        fw_share(s, io->other.T, src, &t0, &t1);
        for (int t = t0; t < t1; t++) {
            if (!ht_goes(s, &io->other, t, b->me))
                continue;
            int bad = i >= n || io->rsr[i] != src || io->rst[i] != t - t0;
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
    int H = s->H, T = b->in.T, nn = b->nnodes, fwd = b->fwd;
    long wrong = 0;
    float *sum = malloc(sizeof(float) * (size_t)H), *nsum = malloc(sizeof(float) * (size_t)H);
    uint16_t *part = malloc(2 * (size_t)H);
    const int32_t *node = b->node_of;
    for (int t = 0; t < T; t++) {
        memset(sum, 0, sizeof(float) * (size_t)H);
        ht_token_in(s, &b->in, t, io);
        /* forwarding: nodes in order, this node's ranks one by one, another
         * node's rows summed there (ranks in order) and rounded once */
        for (int nd = 0; nd < (fwd ? nn : 1); nd++) {
            int own = !fwd || nd == node[b->me];
            memset(nsum, 0, sizeof(float) * (size_t)H);
            for (int d = 0; d < s->N; d++) {
                if (!ht_goes(s, &b->in, t, d) || (fwd && node[d] != nd))
                    continue;
                ht_partial(s, &b->in, t, d, io, part);
                for (int h = 0; h < H; h++)
                    (own ? sum : nsum)[h] += fr_bf16_to_f32(part[h]);
            }
            for (int h = 0; h < H && !own; h++)
                sum[h] += fr_bf16_to_f32(fr_f32_to_bf16(nsum[h]));
        }
        int bad = 0;
        for (int h = 0; h < H && !bad; h++)
            bad = io->out[(size_t)t * H + h] != fr_f32_to_bf16(sum[h]);
        if (bad && wrong++ < 3)
            fprintf(stderr, "ferry-bench: rank %d: combined token %d wrong\n", b->me, t);
    }
    free(sum);
    free(nsum);
    free(part);
    return wrong;
}

#ifdef FERRY_HAVE_MPI
/* Bytes of one row with its header in the baseline's messages. */
static size_t ht_base_item(const fw_spec_t *s)
{
    return 4 + 4 * (size_t)s->K + 4 * (size_t)s->K +
           (s->fp8 ? (size_t)s->H + 4 * (size_t)(s->H / 128) : 2 * (size_t)s->H);
}


static int ht_base_grow(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap && *buf)
        return 0;
    free(*buf);
    *cap = need + need / 4 + 64;
    *buf = malloc(*cap);
    return *buf ? 0 : -1;
}

/* Counts, displacements (and in bytes) from per-rank row counts. */
static void ht_base_disp(int N, const int *c, int *d, int *cb, int *db, size_t item)
{
    for (int r = 0, o = 0; r < N; o += c[r], r++) {
        d[r] = o;
        cb[r] = (int)((size_t)c[r] * item);
        db[r] = (int)((size_t)o * item);
    }
}

/* The baseline's dispatch: rows into io's receive buffers, as ferry's. */
static int ht_base_dispatch(bench_t *b, ht_io_t *io, ht_base_t *m, int *n_out)
{
    const fw_spec_t *s = &b->s;
    int N = s->N, K = s->K, El = s->E / s->N;
    size_t item = ht_base_item(s), rb = s->fp8 ? (size_t)s->H : 2 * (size_t)s->H;
    size_t ns = s->fp8 ? (size_t)s->H / 128 : 0;
    for (int d = 0; d < N; d++) {
        m->sc[d] = 0;
        for (int t = 0; t < b->in.T; t++)
            m->sc[d] += ht_goes(s, &b->in, t, d);
    }
    MPI_Alltoall(m->sc, 1, MPI_INT, m->rc, 1, MPI_INT, MPI_COMM_WORLD);
    ht_base_disp(N, m->sc, m->sd, m->scb, m->sdb, item);
    ht_base_disp(N, m->rc, m->rd, m->rcb, m->rdb, item);
    int nsend = m->sd[N - 1] + m->sc[N - 1], n = m->rd[N - 1] + m->rc[N - 1];
    if (ht_base_grow(&m->sbuf, &m->scap, (size_t)nsend * item) ||
        ht_base_grow(&m->rbuf, &m->rcap, (size_t)n * item) || ht_grow(io, s, (size_t)n))
        return -1;
    uint8_t *p = m->sbuf;
    for (int d = 0; d < N; d++)
        for (int t = 0; t < b->in.T; t++) {
            if (!ht_goes(s, &b->in, t, d))
                continue;
            int32_t *hd = (int32_t *)p;
            float *w = (float *)(p + 4 + 4 * (size_t)K);
            hd[0] = t;
            for (int k = 0; k < K; k++) {
                int64_t e = b->in.idx[(size_t)t * K + k];
                int local = e >= 0 && e / El == d;
                hd[1 + k] = local ? (int32_t)(e % El) : -1;
                w[k] = local ? b->in.w[(size_t)t * K + k] : 0.f;
            }
            uint8_t *row = p + 4 + 8 * (size_t)K;
            if (s->fp8) {
                memcpy(row, io->q + (size_t)t * s->H, rb);
                memcpy(row + rb, io->qs + (size_t)t * ns, 4 * ns);
            } else {
                memcpy(row, b->in.x + (size_t)t * s->H, rb);
            }
            p += item;
        }
    MPI_Alltoallv(m->sbuf, m->scb, m->sdb, MPI_BYTE, m->rbuf, m->rcb, m->rdb, MPI_BYTE,
                  MPI_COMM_WORLD);
    for (int src = 0, i = 0; src < N; src++)
        for (int j = 0; j < m->rc[src]; j++, i++) {
            const uint8_t *q = m->rbuf + (size_t)i * item;
            const int32_t *hd = (const int32_t *)q;
            io->rsr[i] = src;
            io->rst[i] = hd[0];
            memcpy(io->ridx + (size_t)i * K, hd + 1, 4 * (size_t)K);
            memcpy(io->rw + (size_t)i * K, q + 4 + 4 * (size_t)K, 4 * (size_t)K);
            memcpy(io->rx + (size_t)i * rb, q + 4 + 8 * (size_t)K, rb);
            if (ns)
                memcpy(io->rxs + (size_t)i * ns, q + 4 + 8 * (size_t)K + rb, 4 * ns);
        }
    *n_out = n;
    return 0;
}

/* The baseline's combine: partial rows back, summed in rank order. */
static int ht_base_combine(bench_t *b, ht_io_t *io, ht_base_t *m)
{
    const fw_spec_t *s = &b->s;
    int N = s->N, H = s->H;
    size_t row = 2 * (size_t)H;
    /* send back what was received (rc rows per source), receive sc rows per dest */
    ht_base_disp(N, m->rc, m->rd, m->rcb, m->rdb, row);
    ht_base_disp(N, m->sc, m->sd, m->scb, m->sdb, row);
    int nback = m->sd[N - 1] + m->sc[N - 1];
    if (ht_base_grow(&m->sbuf, &m->scap, (size_t)nback * row))
        return -1;
    MPI_Alltoallv(io->y, m->rcb, m->rdb, MPI_BYTE, m->sbuf, m->scb, m->sdb, MPI_BYTE,
                  MPI_COMM_WORLD);
    memset(io->acc_all, 0, sizeof(float) * (size_t)b->in.T * H);
    for (int d = 0; d < N; d++) { /* rank order, as ferry sums */
        const uint16_t *y = (const uint16_t *)(m->sbuf + (size_t)m->sd[d] * row);
        for (int t = 0, j = 0; t < b->in.T; t++) {
            if (!ht_goes(s, &b->in, t, d))
                continue;
            float *a = io->acc_all + (size_t)t * H;
            for (int h = 0; h < H; h++)
                a[h] += fr_bf16_to_f32(y[(size_t)j * H + h]);
            j++;
        }
    }
    for (size_t i = 0; i < (size_t)b->in.T * H; i++)
        io->out[i] = fr_f32_to_bf16(io->acc_all[i]);
    return 0;
}

/* The same round through MPI: its times (us), its outputs checked. */
static const char *ht_base_round(bench_t *b, ht_io_t *io, uint64_t round, double *bd, double *bc)
{
    ht_base_t *m = &io->base;
    int N = b->s.N;
    if (!m->sc) {
        m->sc = calloc((size_t)N * 8, sizeof(int));
        if (!m->sc)
            return "memory";
        m->rc = m->sc + N, m->sd = m->rc + N, m->rd = m->sd + N;
        m->scb = m->rd + N, m->rcb = m->scb + N, m->sdb = m->rcb + N, m->rdb = m->sdb + N;
    }
    int n = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now_us();
    if (ht_base_dispatch(b, io, m, &n) != 0)
        return "memory";
    double t1 = now_us();
    if (b->o->check)
        b->wrong += ht_check_dispatch(b, round, io, n);
    ht_experts(b, io, round, n);
    MPI_Barrier(MPI_COMM_WORLD);
    double t2 = now_us();
    if (ht_base_combine(b, io, m) != 0)
        return "memory";
    double t3 = now_us();
    if (b->o->check)
        b->wrong += ht_check_combine(b, io);
    *bd = t1 - t0;
    *bc = t3 - t2;
    return NULL;
}
#endif

/* --device cuda: this round's inputs onto the GPU (outside the timing). */
static int ht_dev_inputs(bench_t *b, ht_io_t *io)
{
    const fw_spec_t *s = &b->s;
    ht_dev_t *d = &io->dv;
    size_t T = (size_t)b->in.T, H = (size_t)s->H, K = (size_t)s->K;
    if (ht_dev_put(d, d->idx, b->in.idx, T * K * 8) ||
        ht_dev_put(d, d->w, b->in.w, T * K * 4) ||
        ht_dev_put(d, d->x, s->fp8 ? (const void *)io->q : (const void *)b->in.x,
                   s->fp8 ? T * H : T * H * 2) ||
        (s->fp8 && ht_dev_put(d, d->xs, io->qs, T * (H / 128) * 4)))
        return -1;
    return ht_dev_wait(d);
}

/* --device cuda: the dispatch's n rows back to the host. */
static int ht_dev_recv(bench_t *b, ht_io_t *io, int n)
{
    const fw_spec_t *s = &b->s;
    ht_dev_t *d = &io->dv;
    size_t rn = (size_t)n, H = (size_t)s->H, K = (size_t)s->K;
    if (ht_dev_get(d, io->rx, d->rx, rn * (s->fp8 ? H : 2 * H)) ||
        (s->fp8 && ht_dev_get(d, io->rxs, d->rxs, rn * (H / 128) * 4)) ||
        ht_dev_get(d, io->rw, d->rw, rn * K * 4) || ht_dev_get(d, io->ridx, d->ridx, rn * K * 4) ||
        ht_dev_get(d, io->rsr, d->rsr, rn * 4) || ht_dev_get(d, io->rst, d->rst, rn * 4))
        return -1;
    return ht_dev_wait(d);
}

/* Rows this rank's routing sends over the fabric per call: one per
 * (token of its share, other node it reaches) when forwarding, else one
 * per (token, rank on another node it reaches); combine sends as many
 * back. */
static double ht_fabric_rows(const bench_t *b)
{
    const fw_spec_t *s = &b->s;
    const int32_t *node = b->node_of;
    int fwd = b->fwd;
    uint8_t *seen = calloc((size_t)s->N, 1);
    if (!seen)
        return NAN;
    double rows = 0;
    int t0, t1; /* DP groups: its share of the group's tokens */
    fw_share(s, b->in.T, b->me, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        memset(seen, 0, (size_t)s->N);
        for (int d = 0; d < s->N; d++) {
            if (node[d] == node[b->me] || !ht_goes(s, &b->in, t, d))
                continue;
            int key = fwd ? node[d] : d;
            rows += !seen[key];
            seen[key] = 1;
        }
    }
    free(seen);
    return rows;
}

/* One round; a timed one leaves its row in b->tm. */
static const char *ht_round(bench_t *b, ht_io_t *io, int it)
{
    const fw_spec_t *s = &b->s;
    uint64_t round = (uint64_t)it + 1;
    size_t ns = s->fp8 ? (size_t)s->H / 128 : 0;
    int gpu = io->dv.on;
    ht_dev_t *dv = &io->dv;
    /* --no-check without a baseline: every round takes the first round's
     * inputs, rows and expert outputs, already in place (on the GPU, in
     * its buffers), so the host prepares nothing between the timed calls
     * (fp8 at T=4096 took over a second of host work per round) */
    int again = !b->o->check && !b->have_base && it > 0;
    if (!again) {
        fw_generate(s, round, b->me, &b->in);
        for (int t = 0; t < b->in.T && s->fp8; t++)
            ht_row(s, &b->in, t, io->q + (size_t)t * s->H, io->qs + (size_t)t * ns);
        if (gpu && ht_dev_inputs(b, io) != 0)
            return "GPU copies";
    }
    ferry_route_in_t rin = {.size = sizeof(rin), .num_tokens = b->in.T,
                            .topk_idx = gpu ? (const int64_t *)dv->idx : b->in.idx,
                            .stream = dv->stream};
    ferry_route_t route = NULL;
    int n = 0;
    if ((b->rc = ferry_comm_barrier(b->comm)) != FERRY_OK)
        return "barrier";
    double t0 = now_us();
    if ((b->rc = ferry_route_create(b->ep, &rin, &route)) != FERRY_OK)
        return "route_create";
    ferry_route_counts(route, &n, NULL);
    double t1 = now_us();
    if (ht_grow(io, s, (size_t)n) != 0 || (gpu && ht_dev_grow(dv, s, (size_t)n) != 0))
        return "memory";
    ferry_ht_dispatch_in_t din = {.size = sizeof(din), .topk_weights = b->in.w,
                                  .x = s->fp8 ? (const void *)io->q : (const void *)b->in.x,
                                  .x_scales = s->fp8 ? io->qs : NULL};
    ferry_ht_dispatch_out_t dout = {.size = sizeof(dout), .recv_x = io->rx,
                                    .recv_x_scales = s->fp8 ? io->rxs : NULL,
                                    .recv_topk_idx = io->ridx, .recv_topk_weights = io->rw,
                                    .recv_src_rank = io->rsr, .recv_src_token = io->rst};
    if (gpu) {
        din.x = dv->x;
        din.x_scales = s->fp8 ? dv->xs : NULL;
        din.topk_weights = dv->w;
        din.stream = dv->stream;
        dout.recv_x = dv->rx;
        dout.recv_x_scales = s->fp8 ? dv->rxs : NULL;
        dout.recv_topk_idx = dv->ridx;
        dout.recv_topk_weights = dv->rw;
        dout.recv_src_rank = dv->rsr;
        dout.recv_src_token = dv->rst;
    }
    ferry_ep_stats_t f0 = {.size = sizeof(f0)}, f1 = {.size = sizeof(f1)},
                     f2 = {.size = sizeof(f2)};
    ferry_ep_get_stats(b->ep, &f0);
    double t2 = now_us();
    b->rc = ferry_ht_dispatch(b->ep, route, &din, &dout);
    if (b->rc == FERRY_OK && gpu) /* enqueued only: timed until it ran */
        b->rc = ferry_ep_sync(b->ep, dv->stream);
    double t3 = now_us();
    ferry_ep_get_stats(b->ep, &f1);
    if (b->rc != FERRY_OK)
        return "ht_dispatch";
    if (!again && gpu && ht_dev_recv(b, io, n) != 0)
        return "GPU copies";
    if (b->o->check)
        b->wrong += ht_check_dispatch(b, round, io, n);
    if (!again)
        ht_experts(b, io, round, n);
    ferry_ht_combine_in_t cin = {.size = sizeof(cin), .y = io->y};
    ferry_ht_combine_out_t cout = {.size = sizeof(cout), .out = io->out};
    if (gpu) {
        if (!again && (ht_dev_put(dv, dv->y, io->y, (size_t)n * 2 * s->H) || ht_dev_wait(dv)))
            return "GPU copies";
        cin.y = dv->y;
        cin.stream = dv->stream;
        cout.out = dv->out;
    }
    if ((b->rc = ferry_comm_barrier(b->comm)) != FERRY_OK)
        return "barrier";
    double t4 = now_us();
    b->rc = ferry_ht_combine(b->ep, route, &cin, &cout);
    if (b->rc == FERRY_OK && gpu)
        b->rc = ferry_ep_sync(b->ep, dv->stream);
    double t5 = now_us();
    ferry_ep_get_stats(b->ep, &f2);
    ferry_route_destroy(route);
    if (b->rc != FERRY_OK)
        return "ht_combine";
    if (!again && gpu && (ht_dev_get(dv, io->out, dv->out, (size_t)b->in.T * 2 * s->H) ||
                          ht_dev_wait(dv)))
        return "GPU copies";
    if (b->o->check)
        b->wrong += ht_check_combine(b, io);
    double bd = NAN, bc = NAN;
#ifdef FERRY_HAVE_MPI
    const char *f = b->have_base ? ht_base_round(b, io, round, &bd, &bc) : NULL;
    if (f)
        return f;
#endif
    if (it >= b->o->warmup) {
        double *r = b->tm + (size_t)(it - b->o->warmup) * BENCH_COLS;
        r[0] = (t1 - t0) + (t3 - t2);
        r[1] = t5 - t4;
        r[2] = bd;
        r[3] = bc;
        /* rows this rank sent to other ranks, both ways */
        double rb = (double)(s->fp8 ? s->H + 4 * ns : 2 * (size_t)s->H), bytes = 0;
        int lo, hi; /* DP groups: its share */
        fw_share(s, b->in.T, b->me, &lo, &hi);
        for (int t = lo; t < hi; t++)
            for (int d = 0; d < s->N; d++)
                if (d != b->me && ht_goes(s, &b->in, t, d))
                    bytes += rb + 2.0 * s->H;
        r[4] = bytes;
        r[5] = (double)(f1.bytes - f0.bytes);
        r[6] = (double)(f2.bytes - f1.bytes);
        r[7] = ht_fabric_rows(b);
        r[8] = t1 - t0;
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
    io.acc_all = malloc(T * H * sizeof(float) + 4);
    io.sc = malloc((H / 128 + 1) * sizeof(float));
    if (!io.q || !io.qs || !io.out || !io.acc || !io.f || !io.tmp16 || !io.row || !io.sc ||
        !io.acc_all ||
        fw_input_alloc(s, &io.other) != 0 || fw_input_alloc(s, &b->in) != 0) {
        b->fail = "memory";
        return;
    }
    if (b->cfg.device == FERRY_DEVICE_CUDA && ht_dev_init(&io.dv, s) != 0) {
        b->fail = "GPU buffers";
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
    free(io.acc_all);
    free(io.base.sc);
    free(io.base.sbuf);
    free(io.base.rbuf);
    free(io.rx);
    free(io.rxs);
    free(io.rw);
    free(io.ridx);
    free(io.rsr);
    free(io.rst);
    free(io.y);
    ht_dev_free(&io.dv);
    fw_input_free(&io.other);
}
