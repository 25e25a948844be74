/*
 * High-throughput mode across processes (self-launching): routes
 * (ferry_route_create / _counts / _destroy), ferry_ht_dispatch and
 * ferry_ht_combine on CPU ranks (config.mode = FERRY_MODE_HIGH_THROUGHPUT).
 *   test_ht -n N basic          several configurations (bf16, fp8 passed
 *                               through; H 128, 256, 7168; K 1..16, K > E/N
 *                               too; uniform and Zipf routing; masked slots;
 *                               ranks without tokens; a token with every
 *                               slot -1; expert_alignment 1 and 16), three
 *                               back-to-back rounds each, every output exact
 *   test_ht -n N chunk [T] [R]  up to T tokens per rank (default 16384)
 *                               through rings of R tokens (default 8),
 *                               everything checked; the shared segment does
 *                               not grow with max_tokens
 *   test_ht -n N reuse          one route for several dispatches and
 *                               combines, two routes alive at once, fp8
 *                               forward with a bf16 backward, and the adjoint
 *                               identity sum <C(y), g> = sum <y, D(g)>
 *   test_ht -n N args           bad arguments (FERRY_ERR_INVALID, the message
 *                               naming them), low-latency calls on a
 *                               high-throughput EP and the reverse
 *   test_ht -n N kill R         rank R dies right before the dispatch of
 *                               round 3; every other rank fails naming R
 *                               within FERRY_TIMEOUT_MS + 2 s (above 16
 *                               ranks, K = 16 < N: in the dispatch or,
 *                               for a rank that receives nothing from R,
 *                               the combine)
 * With --device cuda (after -n N) the same modes run on CUDA ranks (GPU
 * rank % visible GPUs): every input is copied to device memory, every
 * output (poison and guard included) back after ferry_ep_sync, and the same
 * exact checks run; the test prints "skipped: ..." and exits 77 where no GPU
 * is usable.
 * Every rank regenerates every rank's inputs from a seed (splitmix64) and
 * checks its own outputs exactly against a reference it computes itself.
 * Output buffers are poisoned and guarded: unwritten rows and writes past
 * the end are caught. Each rank writes its verdict to $DIR/rank.<r>; the
 * parent reads them.
 */
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/quant.h"
#include "ferry.h"
#include "harness.h"
#include "launch.h"
#include "verdicts.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#endif

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---------------------------------------------------------------------- */
/* Deterministic data: splitmix64 streams keyed by what they describe      */
/* ---------------------------------------------------------------------- */

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t sm_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double sm_unit(uint64_t *s)
{
    return (double)(sm_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static uint64_t hkey(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return mix64(mix64(mix64(mix64(a) ^ b) ^ c) ^ d);
}


/* Equal bf16 values; +0 and -0 count as equal (a sum may start from +0). */
static int bf_same(uint16_t a, uint16_t b)
{
    return a == b || ((a | b) & 0x7fff) == 0;
}

/* What the values of one data set look like. */
enum {
    K_BITS = 0, /* any bit pattern (dispatch only moves bytes) */
    K_FIN = 1,  /* finite bf16, 2^-20..2^21 in magnitude, either sign: fp32
                   sums of three or more depend on their order */
    K_INT = 2,  /* small integers -4..4 (sums and products exact) */
    K_ORD = 3   /* +-2^20 exactly (a third) or 2^-6..2^0 with any mantissa:
                   a small value added before two bigs cancel is lost, so
                   a sum's bf16 rounding tells the order apart */
};

typedef struct data {
    uint64_t tag; /* which data set */
    int kind;     /* K_* */
    int fp8;      /* dispatch x as fp8 bytes with scales */
} data_t;

static uint16_t gen_bf16(uint64_t *s, int kind)
{
    uint64_t r = sm_next(s);
    if (kind == K_BITS)
        return (uint16_t)r;
    if (kind == K_INT)
        return fr_f32_to_bf16((float)((int)(r % 9) - 4));
    if (kind == K_ORD)
        return (r >> 12) % 3 == 0
                   ? (uint16_t)((r >> 20 & 1 ? 0x8000 : 0) | (127 + 20) << 7)
                   : (uint16_t)((r >> 20 & 1 ? 0x8000 : 0) |
                                (uint16_t)(127 - 6 + (r >> 8) % 7) << 7 | (r & 0x7f));
    uint16_t sign = (r >> 20) & 1 ? 0x8000 : 0;
    uint16_t ex = (uint16_t)(107 + (r >> 8) % 41);
    return (uint16_t)(sign | ex << 7 | (r & 0x7f));
}

/* A float exactly as generated (K_INT: integers, else multiples of 2^-10). */
static float gen_float(uint64_t r, int kind)
{
    if (kind == K_INT)
        return (float)((int)(r % 9) - 4);
    return (float)((int64_t)(r % 200001) - 100000) / 1024.0f;
}

/* ---------------------------------------------------------------------- */
/* Configurations and routing                                             */
/* ---------------------------------------------------------------------- */

typedef struct spec {
    const char *name;
    int N, E, K, H, T;  /* T: max_tokens */
    int fp8;            /* the EP's dispatch_dtype is fp8 (H % 128 == 0) */
    int align;          /* expert_alignment */
    int ring;           /* config.ring_tokens (0: the default) */
    double zipf;        /* 0: uniform routing, else the Zipf exponent */
    double mask_p;      /* probability a slot is -1 */
    double empty_p;     /* probability a rank has no tokens in a round */
    int tmin;           /* fewest tokens of a rank that has some */
    int zero_rank;      /* this rank never has tokens (-1: none) */
    int spread;         /* every token to every rank (K >= N), all T */
    uint64_t seed;
} spec_t;

/* Tokens of rank r for routing key rk. */
static int gen_ntok(const spec_t *c, uint64_t rk, int r)
{
    if (r == c->zero_rank)
        return 0;
    if (c->spread)
        return c->T;
    uint64_t st = hkey(c->seed, rk, 0x44, (uint64_t)r);
    if (sm_unit(&st) < c->empty_p)
        return 0;
    if (sm_unit(&st) < 0.3)
        return c->T;
    int lo = c->tmin > 0 ? c->tmin : 1;
    if (lo > c->T)
        lo = c->T;
    return lo + (int)(sm_next(&st) % (uint64_t)(c->T - lo + 1));
}

/* Zipf popularity over a permutation of the experts (the same on every
 * rank for one key), as a cumulative table; NULL for uniform routing. */
static double *zipf_cdf(const spec_t *c, uint64_t rk)
{
    if (c->zipf <= 0)
        return NULL;
    int E = c->E;
    int *perm = malloc(sizeof(int) * (size_t)E);
    double *cdf = malloc(sizeof(double) * (size_t)E);
    uint64_t st = hkey(c->seed, rk, 0x66, 0);
    for (int e = 0; e < E; e++)
        perm[e] = e;
    for (int i = E - 1; i > 0; i--) {
        int j = (int)(sm_next(&st) % (uint64_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    double acc = 0;
    for (int e = 0; e < E; e++) {
        acc += 1.0 / pow(1.0 + perm[e], c->zipf);
        cdf[e] = acc;
    }
    free(perm);
    return cdf;
}

static int used_in(const int64_t *row, int k, int64_t e)
{
    for (int j = 0; j < k; j++)
        if (row[j] == e)
            return 1;
    return 0;
}

/* An expert for slot k that row[0..k) does not hold yet. */
static int64_t pick_expert(const spec_t *c, uint64_t *st, const double *cdf,
                           const int64_t *row, int k)
{
    for (int tries = 0; tries < 32; tries++) {
        int e = 0;
        if (cdf) {
            double u = sm_unit(st) * cdf[c->E - 1];
            while (e < c->E - 1 && cdf[e] <= u)
                e++;
        } else {
            e = (int)(sm_next(st) % (uint64_t)c->E);
        }
        if (!used_in(row, k, e))
            return e;
    }
    int start = (int)(sm_next(st) % (uint64_t)c->E);
    for (int i = 0; i < c->E; i++)
        if (!used_in(row, k, (start + i) % c->E))
            return (start + i) % c->E;
    return -1; /* not reached: K <= E */
}

/* topk_idx of rank r: distinct experts, ~mask_p of the slots -1, one token
 * with every slot -1; with `spread`, slot k goes to rank k % N. */
static void gen_route(const spec_t *c, uint64_t rk, int r, int T, int64_t *idx)
{
    int K = c->K, El = c->E / c->N;
    uint64_t st = hkey(c->seed, rk, 0x55, (uint64_t)r);
    double *cdf = zipf_cdf(c, rk);
    int dead = T >= 2 && !c->spread ? (int)(sm_next(&st) % (uint64_t)T) : -1;
    for (int t = 0; t < T; t++) {
        int64_t *row = idx + (size_t)t * K;
        for (int k = 0; k < K; k++)
            row[k] = c->spread ? (int64_t)(k % c->N) * El + (t + k / c->N) % El
                               : pick_expert(c, &st, cdf, row, k);
        for (int k = 0; k < K && !c->spread; k++)
            if (t == dead || sm_unit(&st) < c->mask_p)
                row[k] = -1;
    }
    free(cdf);
}

/* Dispatch input of rank s, token t. */
static void gen_x(const spec_t *c, const data_t *d, int s, int t, void *row,
                  float *scales)
{
    uint64_t st = hkey(d->tag, 0x11, (uint64_t)s, (uint64_t)t);
    int H = c->H;
    if (d->fp8) {
        uint8_t *b = row;
        for (int h = 0; h < H; h += 8) {
            uint64_t r = sm_next(&st);
            memcpy(b + h, &r, 8);
        }
        for (int j = 0; j < H / 128; j++)
            scales[j] = (float)(1 + sm_next(&st) % 1000) / 64.0f;
    } else {
        uint16_t *v = row;
        for (int h = 0; h < H; h++)
            v[h] = gen_bf16(&st, d->kind);
    }
}

/* Dispatch weight of rank s, token t, slot k. */
static float gen_wt(const data_t *d, int s, int t, int k)
{
    return gen_float(hkey(d->tag, 0x77, (uint64_t)s, (uint64_t)t * 64 + k),
                     d->kind);
}

/* Combine input of rank o for its row of (rank s, token t). */
static void gen_y(const spec_t *c, const data_t *d, int o, int s, int t,
                  uint16_t *row)
{
    uint64_t st = hkey(d->tag, 0x2200 + (uint64_t)o, (uint64_t)s, (uint64_t)t);
    for (int h = 0; h < c->H; h++)
        row[h] = gen_bf16(&st, d->kind == K_BITS ? K_FIN : d->kind);
}

/* Combine weight rank o passes for (rank s, token t, slot k). */
static float gen_cw(const data_t *d, int o, int s, int t, int k)
{
    return gen_float(hkey(d->tag, 0x3300 + (uint64_t)o, (uint64_t)s,
                          (uint64_t)t * 64 + k), d->kind);
}

/* ---------------------------------------------------------------------- */
/* Every rank's routing, and what this rank should receive                */
/* ---------------------------------------------------------------------- */

typedef struct world {
    int N, K, El, me;
    int *T;           /* [N] tokens of every rank */
    int64_t **idx;    /* [N] -> [T][K] routing of every rank */
    int nrecv;        /* rows this rank receives */
    int32_t *rs, *rt; /* [nrecv] their source rank and token, in order */
    int32_t *cnt;     /* [El] rows per local expert, aligned */
} world_t;

static int slot_rank(const world_t *w, int s, int t, int k)
{
    int64_t e = w->idx[s][(size_t)t * w->K + k];
    return e < 0 ? -1 : (int)(e / w->El);
}

static int goes_to(const world_t *w, int s, int t, int o)
{
    for (int k = 0; k < w->K; k++)
        if (slot_rank(w, s, t, k) == o)
            return 1;
    return 0;
}

static size_t nz(size_t n)
{
    return n ? n : 1;
}

/* Rows ordered by source rank, then token; a token once per rank. */
static void world_build(world_t *w, const spec_t *c, uint64_t rk, int me)
{
    memset(w, 0, sizeof(*w));
    w->N = c->N;
    w->K = c->K;
    w->El = c->E / c->N;
    w->me = me;
    w->T = calloc((size_t)w->N, sizeof(int));
    w->idx = calloc((size_t)w->N, sizeof(int64_t *));
    w->cnt = calloc((size_t)w->El, sizeof(int32_t));
    size_t cap = 0;
    for (int s = 0; s < w->N; s++) {
        w->T[s] = gen_ntok(c, rk, s);
        w->idx[s] = malloc(nz((size_t)w->T[s] * w->K * sizeof(int64_t)));
        gen_route(c, rk, s, w->T[s], w->idx[s]);
        cap += (size_t)w->T[s];
    }
    w->rs = malloc(nz(cap) * sizeof(int32_t));
    w->rt = malloc(nz(cap) * sizeof(int32_t));
    for (int s = 0; s < w->N; s++)
        for (int t = 0; t < w->T[s]; t++) {
            if (!goes_to(w, s, t, me))
                continue;
            w->rs[w->nrecv] = s;
            w->rt[w->nrecv++] = t;
            for (int k = 0; k < w->K; k++)
                if (slot_rank(w, s, t, k) == me)
                    w->cnt[w->idx[s][(size_t)t * w->K + k] % w->El]++;
        }
    for (int le = 0; le < w->El && c->align > 1; le++)
        w->cnt[le] = (w->cnt[le] + c->align - 1) / c->align * c->align;
}

static void world_free(world_t *w)
{
    for (int s = 0; s < w->N; s++)
        free(w->idx[s]);
    free(w->idx);
    free(w->T);
    free(w->rs);
    free(w->rt);
    free(w->cnt);
}

/* ---------------------------------------------------------------------- */
/* Buffers: poisoned, with a guard after the end                          */
/* ---------------------------------------------------------------------- */

#define GUARD 64
#define POISON 0xA5

static void *galloc(size_t n)
{
    uint8_t *p = malloc(n + GUARD);
    memset(p, POISON, n + GUARD);
    return p;
}

static int gintact(const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; b && i < GUARD; i++)
        if (b[n + i] != POISON)
            return 0;
    return 1;
}

/* An output (or input) buffer: NULL when not wanted, or when empty and
 * the round passes NULL for empty buffers. */
static void *obuf(size_t n, int want, int null0)
{
    if (!want || (n == 0 && null0))
        return NULL;
    return galloc(n);
}

/* ---------------------------------------------------------------------- */
/* --device cuda: device copies of the host buffers                       */
/* ---------------------------------------------------------------------- */

static int g_cuda; /* the EPs are CUDA contexts */
/* FERRY_TEST_NB_STREAM=1 on CUDA contexts: every call on one stream made
 * with cudaStreamNonBlocking (what a context needs when its fabric
 * provider copies on the legacy default stream), else the legacy one */
static void *nb_stream(void)
{
    static void *made;
#ifdef FERRY_HAVE_CUDA
    static int tried;
    const char *e = getenv("FERRY_TEST_NB_STREAM");
    if (!tried && g_cuda && e && strcmp(e, "1") == 0) {
        cudaStream_t st;
        if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
            fprintf(stderr, "test_ht: FERRY_TEST_NB_STREAM=1: no stream\n");
            exit(2);
        }
        made = st;
    }
    tried = 1;
#endif
    return made;
}
/* bounded routes (mode "bounded"): max_recv = num_recv + g_extra, outputs
 * of max_recv rows; -1: exact routes */
static int g_extra = -1;

#ifdef FERRY_HAVE_CUDA
/* A device copy of host buffer h of n bytes plus its guard (poison
 * included), or NULL for NULL. */
static void *dcopy(const void *h, size_t n)
{
    if (!h)
        return NULL;
    void *d = NULL;
    if (cudaMalloc(&d, n + GUARD) != cudaSuccess ||
        cudaMemcpy(d, h, n + GUARD, cudaMemcpyHostToDevice) != cudaSuccess ||
        /* a pageable copy's DMA can outlive cudaMemcpy; the kernels run
         * on a non-blocking stream that does not wait for it */
        cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc/cudaMemcpy of %zu bytes: %s\n", n + GUARD,
                cudaGetErrorString(cudaGetLastError()));
        exit(1);
    }
    return d;
}

/* Back into h (n bytes and the guard: writes past the end show), then
 * the device copy is freed. */
static void dback(void *h, void *d, size_t n)
{
    if (!d)
        return;
    if (h && cudaMemcpy(h, d, n + GUARD, cudaMemcpyDeviceToHost) != cudaSuccess) {
        fprintf(stderr, "cudaMemcpy back: %s\n", cudaGetErrorString(cudaGetLastError()));
        exit(1);
    }
    cudaFree(d);
}

/* This rank's GPU (rank % visible GPUs). */
static void dpick(int me)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0)
        cudaSetDevice(me % n);
}

/* Whether a GPU is usable, asked in a child process: CUDA must not be
 * initialised in the parent before the ranks are forked. 1, or 0 with
 * the reason in why. */
static int dprobe(char *why, size_t len)
{
    int fd[2];
    if (pipe(fd) != 0)
        return snprintf(why, len, "pipe failed"), 0;
    pid_t pid = fork();
    if (pid == 0) {
        char w[256] = "";
        int ok = ferry_cuda_available(w, sizeof(w));
        if (write(fd[1], w, strlen(w) + 1) < 0)
            _exit(2);
        _exit(ok ? 0 : 1);
    }
    close(fd[1]);
    ssize_t got = read(fd[0], why, len - 1);
    why[got > 0 ? got : 0] = 0;
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}
#else
static void *dcopy(const void *h, size_t n) { (void)n; return (void *)h; }
static void dback(void *h, void *d, size_t n) { (void)h; (void)d; (void)n; }
static void dpick(int me) { (void)me; }
static int dprobe(char *why, size_t len)
{
    snprintf(why, len, "this build has no CUDA (nvcc was not found)");
    return 0;
}
#endif

/* ferry_route_create with topk_idx in device memory on a CUDA context
 * (copied there when num_tokens is in range; a bad num_tokens is refused
 * before anything is read). */
static int route_call(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t *rt,
                      int max_tokens, int K)
{
    if (!g_cuda || !in || !in->topk_idx || in->num_tokens < 0 ||
        in->num_tokens > max_tokens) {
        if (!in || in->stream || !nb_stream() || in->size < sizeof(*in))
            return ferry_route_create(ep, in, rt);
        ferry_route_in_t s = *in;
        s.stream = nb_stream();
        return ferry_route_create(ep, &s, rt);
    }
    ferry_route_in_t d = *in;
    size_t n = sizeof(int64_t) * (size_t)in->num_tokens * K;
    int64_t *h = malloc(n + GUARD);
    memcpy(h, in->topk_idx, n);
    memset((uint8_t *)h + n, POISON, GUARD);
    d.topk_idx = dcopy(h, n);
    if (!d.stream)
        d.stream = nb_stream();
    int rc = ferry_route_create(ep, &d, rt);
    /* a bounded route's kernels may still run: freeing topk_idx
     * (cudaFree synchronises the device) while they wait on a fabric
     * provider's CUDA copies would hold those copies back
     * (docs/architecture.md), so the stream is waited for first */
    if (rc == FERRY_OK && d.stream && in->max_recv > 0)
        rc = ferry_ep_sync(ep, d.stream);
    dback(NULL, (void *)d.topk_idx, n);
    free(h);
    return rc;
}

/* Options of one call. */
enum {
    OPT_W = 1,      /* dispatch: in->topk_weights and recv_topk_weights */
    OPT_WIN = 2,    /* dispatch: in->topk_weights only */
    OPT_IDX = 4,    /* dispatch: recv_topk_idx */
    OPT_SRC = 8,    /* dispatch: recv_src_rank, recv_src_token */
    OPT_CW = 16,    /* combine: in->topk_weights and out->topk_weights */
    OPT_CWIN = 32,  /* combine: in->topk_weights only */
    OPT_NULL0 = 64, /* NULL for buffers of zero rows (x, recv_x, y, out) */
    OPT_OLD = 128,  /* in->size of the struct before `stream` was added */
    OPT_OLD2 = 256, /* in->size of the struct before `bias` (combine) or
                       `x_scales_stride` (dispatch) was added */
    OPT_BIAS = 512, /* combine: in->bias[0] and [1] (gen_bias) */
    OPT_SCOL = 1024, /* dispatch, fp8: x_scales column-major, [H/128][T + 3]
                        with NaN in the padding (x_scales_stride {1, T + 3}) */
    OPT_I64 = 2048, /* dispatch, with OPT_IDX: recv_topk_idx as int64
                       (recv_topk_idx_i64), narrowed for the checks */
    OPT_SLOTS = 4096, /* combine: sum_order FERRY_HT_SUM_SLOTS */
    OPT_ALL = OPT_W | OPT_IDX | OPT_SRC | OPT_CW
};

/* ---------------------------------------------------------------------- */
/* EP, route, dispatch and combine with their checks                      */
/* ---------------------------------------------------------------------- */

/* The nodes of the last context made, and whether it forwards: a
 * forwarded node's rows are summed there and rounded once more. */
static int32_t g_node_of[1024];
static int g_fwd, g_nnodes;

/* DP groups for the graph case (FERRY_TEST_DP; 0: none). */
static int g_dp;

static ferry_ep_t ep_make(ferry_comm_t comm, const spec_t *c, int max_tokens,
                          int *rc)
{
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = c->E;
    cfg.topk = c->K;
    cfg.hidden = c->H;
    cfg.max_tokens = max_tokens;
    cfg.dispatch_dtype = c->fp8 ? FERRY_DTYPE_FP8_E4M3 : FERRY_DTYPE_BF16;
    cfg.device = g_cuda ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
    cfg.mode = FERRY_MODE_HIGH_THROUGHPUT;
    cfg.ring_tokens = c->ring;
    cfg.dp_size = g_dp;
    ferry_ep_t ep = NULL;
    *rc = ferry_ep_create(comm, &cfg, &ep);
    CHECK(*rc == FERRY_OK && ep, "rank %d: %s: ferry_ep_create: %s: %s",
          ferry_comm_rank(comm), c->name, ferry_strerror(*rc),
          ferry_comm_last_error(comm));
    if (*rc == FERRY_OK && ferry_comm_size(comm) <= 1024)
        CHECK_RC(ferry_ep_get_nodes(ep, &g_nnodes, g_node_of, &g_fwd), FERRY_OK);
    return *rc == FERRY_OK ? ep : NULL;
}

/* A bounded route: num_recv reads back as the bound, expert counts only
 * through expert_counts_out (checked by route_make). */
static void check_counts_bounded(ferry_route_t rt, const world_t *w, const char *what)
{
    int n = -1, bound = w->nrecv + g_extra;
    int32_t cnt[4];
    CHECK_RC(ferry_route_counts(rt, &n, NULL), FERRY_OK);
    CHECK(n == bound, "rank %d: %s: bounded route: num_recv %d, want max_recv %d", w->me,
          what, n, bound);
    CHECK_RC(ferry_route_counts(rt, &n, cnt), FERRY_ERR_STATE);
}

static void check_counts(ferry_route_t rt, const world_t *w, const char *what)
{
    if (g_extra >= 0) {
        check_counts_bounded(rt, w, what);
        return;
    }
    int n = -1, El = w->El, bad = 0;
    int32_t *cnt = galloc(sizeof(int32_t) * (size_t)El);
    int rc = ferry_route_counts(rt, &n, cnt);
    CHECK(rc == FERRY_OK, "%s: ferry_route_counts: %s", what,
          ferry_strerror(rc));
    CHECK(n == w->nrecv, "rank %d: %s: num_recv %d, want %d", w->me, what, n,
          w->nrecv);
    for (int le = 0; le < El && rc == FERRY_OK; le++)
        if (cnt[le] != w->cnt[le] && bad++ < 3)
            fprintf(stderr, "rank %d: %s: expert_counts[%d] = %d, want %d\n",
                    w->me, what, le, cnt[le], w->cnt[le]);
    CHECK(bad == 0, "rank %d: %s: %d expert counts wrong", w->me, what, bad);
    CHECK(gintact(cnt, sizeof(int32_t) * (size_t)El),
          "%s: expert_counts written past [E_local]", what);
    n = -1;
    rc = ferry_route_counts(rt, &n, NULL); /* expert_counts is optional */
    CHECK(rc == FERRY_OK && n == w->nrecv, "%s: counts without expert_counts: "
          "rc %d, num_recv %d", what, rc, n);
    free(cnt);
}

/* Collective route_create with this rank's routing (topk_idx NULL when it
 * has no tokens); on success the counts are checked. */
static int route_make(ferry_ep_t ep, const world_t *w, int align,
                      ferry_route_t *rt, const char *what)
{
    int T = w->T[w->me];
    ferry_route_in_t in = {.size = sizeof(in), .num_tokens = T,
                           .topk_idx = T ? w->idx[w->me] : NULL,
                           .expert_alignment = align};
    int32_t *nout = NULL, *eout = NULL;
    size_t eb = sizeof(int32_t) * (size_t)w->El;
    /* bounded: both outputs (device memory on GPUs) written; exact: the
     * same outputs given, and they must stay untouched (they belong to
     * bounded routes) */
    if (g_extra >= 0)
        in.max_recv = w->nrecv + g_extra;
    nout = galloc(sizeof(int32_t));
    eout = galloc(eb);
    in.num_recv_out = g_cuda ? dcopy(nout, sizeof(int32_t)) : nout;
    in.expert_counts_out = g_cuda ? dcopy(eout, eb) : eout;
    *rt = NULL;
    int rc = route_call(ep, &in, rt, T, w->K);
    if (rc == FERRY_OK && g_cuda)
        rc = ferry_ep_sync(ep, NULL); /* a bounded route only enqueued */
    if (g_cuda) {
        dback(nout, in.num_recv_out, sizeof(int32_t));
        dback(eout, in.expert_counts_out, eb);
    }
    if (rc != FERRY_OK) {
        fprintf(stderr, "rank %d: %s: ferry_route_create: %s: %s\n", w->me,
                what, ferry_strerror(rc), ferry_ep_last_error(ep));
        free(nout);
        free(eout);
        return rc;
    }
    CHECK(*rt != NULL, "%s: route_create returned no route", what);
    check_counts(*rt, w, what);
    if (g_extra >= 0) {
        CHECK(*nout == w->nrecv, "rank %d: %s: num_recv_out %d, want %d", w->me, what, *nout,
              w->nrecv);
        int bad = 0;
        for (int le = 0; le < w->El; le++)
            bad += eout[le] != w->cnt[le];
        CHECK(bad == 0, "rank %d: %s: %d of expert_counts_out wrong", w->me, what, bad);
        CHECK(gintact(nout, sizeof(int32_t)) && gintact(eout, eb),
              "rank %d: %s: route outputs written past their end", w->me, what);
    } else {
        int touched = 0;
        for (size_t i = 0; i < sizeof(int32_t) + GUARD; i++)
            touched |= ((const uint8_t *)nout)[i] != POISON;
        for (size_t i = 0; i < eb + GUARD; i++)
            touched |= ((const uint8_t *)eout)[i] != POISON;
        CHECK(!touched, "rank %d: %s: an exact route wrote num_recv_out or expert_counts_out",
              w->me, what);
    }
    free(nout);
    free(eout);
    return rc;
}

typedef struct dres {
    size_t rowb;  /* bytes of a recv_x row */
    int ns, n;    /* scales per row, rows */
    uint8_t *x;
    float *xs, *w;
    int32_t *idx, *sr, *st;
} dres_t;

static void dres_free(dres_t *o)
{
    free(o->x);
    free(o->xs);
    free(o->w);
    free(o->idx);
    free(o->sr);
    free(o->st);
    memset(o, 0, sizeof(*o));
}

/* ferry_ht_dispatch of this rank's data set d; outputs in o. fp8 passes
 * x_scales even without tokens (it says the call's dtype), and weights
 * are passed whenever wanted (recv_topk_weights needs them). */
static int ht_disp(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                   const spec_t *c, const data_t *d, int opts, dres_t *o)
{
    int me = w->me, T = w->T[me], K = w->K, H = c->H;
    int nr = w->nrecv + (g_extra > 0 ? g_extra : 0); /* output rows */
    int null0 = (opts & OPT_NULL0) != 0;
    memset(o, 0, sizeof(*o));
    o->rowb = d->fp8 ? (size_t)H : 2 * (size_t)H;
    o->ns = d->fp8 ? H / 128 : 0;
    o->n = nr;
    size_t sb = sizeof(float) * (size_t)o->ns, wb = sizeof(float) * (size_t)K;
    uint8_t *x = obuf((size_t)T * o->rowb, 1, null0);
    float *xs = obuf((size_t)T * sb, d->fp8, 0);
    float *tw = obuf((size_t)T * wb, (opts & (OPT_W | OPT_WIN)) != 0, 0);
    for (int t = 0; t < T; t++) {
        gen_x(c, d, me, t, x + (size_t)t * o->rowb,
              xs ? xs + (size_t)t * o->ns : NULL);
        for (int k = 0; tw && k < K; k++)
            tw[(size_t)t * K + k] = gen_wt(d, me, t, k);
    }
    o->x = obuf((size_t)nr * o->rowb, 1, null0);
    o->xs = obuf((size_t)nr * sb, d->fp8, null0);
    o->idx = obuf((size_t)nr * K * sizeof(int32_t), (opts & OPT_IDX) != 0,
                  null0);
    o->w = obuf((size_t)nr * wb, (opts & OPT_W) != 0, null0);
    o->sr = obuf((size_t)nr * sizeof(int32_t), (opts & OPT_SRC) != 0, null0);
    o->st = obuf((size_t)nr * sizeof(int32_t), (opts & OPT_SRC) != 0, null0);
    size_t rb = (size_t)nr * o->rowb, rs = (size_t)nr * sb, rk = (size_t)nr * wb;
    size_t r4 = (size_t)nr * sizeof(int32_t);
    ferry_ht_dispatch_in_t in = {
        .size = opts & OPT_OLD    ? offsetof(ferry_ht_dispatch_in_t, stream)
                : opts & OPT_OLD2 ? offsetof(ferry_ht_dispatch_in_t, x_scales_stride)
                                  : sizeof(in),
        .x = x, .x_scales = xs, .topk_weights = tw, .stream = nb_stream()};
    size_t xsn = (size_t)T * o->ns; /* floats of the x_scales passed */
    if ((opts & OPT_SCOL) && xs) { /* the same scales, column-major, padded */
        size_t ld = (size_t)T + 3;
        float *col = galloc(sizeof(float) * ld * (size_t)o->ns); /* dcopy reads its guard */
        for (size_t i = 0; i < ld * (size_t)o->ns; i++)
            col[i] = NAN; /* read by mistake: the rows' scales come out wrong */
        for (int t = 0; t < T; t++)
            for (int q = 0; q < o->ns; q++)
                col[(size_t)q * ld + (size_t)t] = xs[(size_t)t * o->ns + (size_t)q];
        free(xs);
        in.x_scales = xs = col;
        in.x_scales_stride[0] = 1;
        in.x_scales_stride[1] = (int64_t)ld;
        xsn = ld * (size_t)o->ns;
    }
    ferry_ht_dispatch_out_t out = {.size = opts & OPT_OLD
                                               ? offsetof(ferry_ht_dispatch_out_t,
                                                          recv_topk_idx_i64)
                                               : sizeof(out),
                                   .recv_x = o->x,
                                   .recv_x_scales = o->xs,
                                   .recv_topk_idx = o->idx,
                                   .recv_topk_weights = o->w,
                                   .recv_src_rank = o->sr,
                                   .recv_src_token = o->st};
    /* int64 ids: their own buffer, in the int64 slot */
    size_t rk8 = (size_t)nr * K * sizeof(int64_t);
    int64_t *i64 = o->idx && (opts & OPT_I64) ? galloc(rk8) : NULL;
    if (i64) {
        out.recv_topk_idx = NULL;
        out.recv_topk_idx_i64 = i64;
    }
    if (g_cuda) { /* the same buffers, poison and guards, on the device */
        in.x = dcopy(x, (size_t)T * o->rowb);
        in.x_scales = dcopy(xs, xsn * sizeof(float));
        in.topk_weights = dcopy(tw, (size_t)T * wb);
        out.recv_x = dcopy(o->x, rb);
        out.recv_x_scales = dcopy(o->xs, rs);
        out.recv_topk_idx = i64 ? NULL : dcopy(o->idx, rk);
        out.recv_topk_idx_i64 = dcopy(i64, rk8);
        out.recv_topk_weights = dcopy(o->w, rk);
        out.recv_src_rank = dcopy(o->sr, r4);
        out.recv_src_token = dcopy(o->st, r4);
    }
    int rc = ferry_ht_dispatch(ep, rt, &in, &out);
    if (g_cuda) {
        int s2 = ferry_ep_sync(ep, NULL); /* the call only enqueued */
        if (rc == FERRY_OK)
            rc = s2;
        dback(NULL, (void *)in.x, 0);
        dback(NULL, (void *)in.x_scales, 0);
        dback(NULL, (void *)in.topk_weights, 0);
        dback(o->x, out.recv_x, rb);
        dback(o->xs, out.recv_x_scales, rs);
        dback(o->idx, out.recv_topk_idx, rk);
        dback(i64, out.recv_topk_idx_i64, rk8);
        dback(o->w, out.recv_topk_weights, rk);
        dback(o->sr, out.recv_src_rank, r4);
        dback(o->st, out.recv_src_token, r4);
    }
    if (i64) { /* narrowed: an entry not an int32's sign extension, or
                * poison, stays wrong, a broken guard too */
        for (size_t i = 0; i < (size_t)nr * K; i++) {
            int64_t v = i64[i];
            uint64_t pois = 0x0101010101010101ull * POISON;
            if ((uint64_t)v == pois)
                memset(o->idx + i, POISON, sizeof(int32_t));
            else
                o->idx[i] = v == (int32_t)v ? (int32_t)v : INT32_MIN;
        }
        if (!gintact(i64, rk8))
            ((uint8_t *)o->idx)[rk] = (uint8_t)~POISON;
        free(i64);
    }
    free(x);
    free(xs);
    free(tw);
    return rc;
}

/* Wrong parts of one received row, as bits: 1 x, 2 scales, 4 topk_idx,
 * 8 weights, 16 src_rank, 32 src_token. */
static int disp_row_bad(const world_t *w, const spec_t *c, const data_t *d,
                        const dres_t *o, int i, uint8_t *want, float *ws)
{
    int s = w->rs[i], t = w->rt[i], K = w->K, bad = 0;
    gen_x(c, d, s, t, want, ws);
    if (memcmp(o->x + (size_t)i * o->rowb, want, o->rowb) != 0)
        bad |= 1;
    if (o->xs && memcmp(o->xs + (size_t)i * o->ns, ws,
                        sizeof(float) * (size_t)o->ns) != 0)
        bad |= 2;
    for (int k = 0; k < K; k++) {
        int mine = slot_rank(w, s, t, k) == w->me;
        int64_t e = w->idx[s][(size_t)t * K + k];
        int32_t want_idx = mine ? (int32_t)(e % w->El) : -1;
        float want_w = mine ? gen_wt(d, s, t, k) : 0.0f;
        if (o->idx && o->idx[(size_t)i * K + k] != want_idx)
            bad |= 4;
        if (o->w && o->w[(size_t)i * K + k] != want_w)
            bad |= 8;
    }
    if (o->sr && o->sr[i] != s)
        bad |= 16;
    if (o->st && o->st[i] != t)
        bad |= 32;
    return bad;
}

static long check_disp(const world_t *w, const spec_t *c, const data_t *d,
                       const dres_t *o, const char *what)
{
    long bad = 0;
    int K = w->K, n = o->n;
    uint8_t *want = malloc(o->rowb);
    float *ws = malloc(nz(sizeof(float) * (size_t)o->ns));
    for (int i = w->nrecv; i < n; i++) { /* a bounded route's padding */
        int b = 0;
        for (int k = 0; k < K; k++)
            b |= (o->idx && o->idx[(size_t)i * K + k] != -1) ||
                 (o->w && o->w[(size_t)i * K + k] != 0.f);
        b |= (o->sr && o->sr[i] != -1) || (o->st && o->st[i] != -1);
        if (b && bad++ < 3)
            fprintf(stderr, "rank %d: %s: padding row %d (of %d past %d) not -1/0\n", w->me,
                    what, i, n - w->nrecv, w->nrecv);
    }
    for (int i = 0; i < w->nrecv; i++) {
        int b = disp_row_bad(w, c, d, o, i, want, ws);
        if (b && bad++ < 3)
            fprintf(stderr, "rank %d: %s: dispatch row %d (rank %d token %d) "
                    "wrong:%s%s%s%s%s%s\n", w->me, what, i, w->rs[i], w->rt[i],
                    b & 1 ? " recv_x" : "", b & 2 ? " recv_x_scales" : "",
                    b & 4 ? " recv_topk_idx" : "",
                    b & 8 ? " recv_topk_weights" : "",
                    b & 16 ? " recv_src_rank" : "",
                    b & 32 ? " recv_src_token" : "");
    }
    size_t i4 = sizeof(int32_t) * (size_t)n, k4 = i4 * (size_t)K;
    if (!gintact(o->x, (size_t)n * o->rowb) ||
        !gintact(o->xs, sizeof(float) * (size_t)n * o->ns) ||
        !gintact(o->idx, k4) || !gintact(o->w, k4) || !gintact(o->sr, i4) ||
        !gintact(o->st, i4)) {
        fprintf(stderr, "rank %d: %s: dispatch wrote past [num_recv = %d] "
                "rows\n", w->me, what, n);
        bad++;
    }
    free(want);
    free(ws);
    return bad;
}

typedef struct cres {
    uint16_t *out;
    float *w;
    int bias; /* in->bias was given (OPT_BIAS) */
    int slots; /* sum_order FERRY_HT_SUM_SLOTS (OPT_SLOTS) */
} cres_t;

/* Tokens whose slot-order sum differed from the rank-order one (the
 * FERRY_HT_SUM_SLOTS checks could tell the two apart there). */
static long g_order_told, g_slot_calls;

/* Bias b (0 or 1) of rank me's token t, channel h: exact in bf16, values
 * that change the rounding of the rows' sum. */
static uint16_t gen_bias(int b, int me, int t, int h)
{
    float v = (float)(((t * 31 + h * 7 + me * 13 + b * 5) % 17) - 8) * (b ? 0.5f : 0.2f);
    return fr_f32_to_bf16(v);
}

/* ferry_ht_combine: every received row gets rank me's y for (src, token);
 * combine weights are given for every slot, local or not (the others must
 * be ignored). */
static int ht_comb(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                   const spec_t *c, const data_t *d, int opts, cres_t *o)
{
    int me = w->me, T = w->T[me], K = w->K, H = c->H;
    int nr = w->nrecv + (g_extra > 0 ? g_extra : 0); /* rows of y */
    int null0 = (opts & OPT_NULL0) != 0;
    size_t rowb = 2 * (size_t)H, wb = sizeof(float) * (size_t)K;
    uint16_t *y = obuf((size_t)nr * rowb, 1, null0);
    float *gw = obuf((size_t)nr * wb, (opts & (OPT_CW | OPT_CWIN)) != 0, 0);
    for (int i = 0; i < w->nrecv; i++) {
        gen_y(c, d, me, w->rs[i], w->rt[i], y + (size_t)i * H);
        for (int k = 0; gw && k < K; k++)
            gw[(size_t)i * K + k] = gen_cw(d, me, w->rs[i], w->rt[i], k);
    }
    o->out = obuf((size_t)T * rowb, 1, null0);
    o->w = obuf((size_t)T * wb, (opts & OPT_CW) != 0, null0);
    ferry_ht_combine_in_t in = {
        .size = opts & OPT_OLD    ? offsetof(ferry_ht_combine_in_t, stream)
                : opts & OPT_OLD2 ? offsetof(ferry_ht_combine_in_t, bias)
                                  : sizeof(in),
        .y = y, .topk_weights = gw, .stream = nb_stream(),
        .sum_order = opts & OPT_SLOTS ? FERRY_HT_SUM_SLOTS : FERRY_HT_SUM_RANKS};
    o->slots = (opts & OPT_SLOTS) != 0;
    g_slot_calls += o->slots;
    ferry_ht_combine_out_t out = {.size = sizeof(out), .out = o->out,
                                  .topk_weights = o->w};
    uint16_t *bias[2] = {NULL, NULL};
    o->bias = (opts & OPT_BIAS) != 0;
    for (int b = 0; o->bias && b < 2; b++) {
        bias[b] = obuf((size_t)T * rowb, 1, null0);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++)
                bias[b][(size_t)t * H + h] = gen_bias(b, me, t, h);
        in.bias[b] = bias[b];
    }
    if (g_cuda) { /* the same buffers, poison and guards, on the device */
        in.y = dcopy(y, (size_t)nr * rowb);
        in.topk_weights = dcopy(gw, (size_t)nr * wb);
        out.out = dcopy(o->out, (size_t)T * rowb);
        out.topk_weights = dcopy(o->w, (size_t)T * wb);
        for (int b = 0; b < 2; b++)
            in.bias[b] = bias[b] ? dcopy(bias[b], (size_t)T * rowb) : NULL;
    }
    int rc = ferry_ht_combine(ep, rt, &in, &out);
    if (g_cuda) {
        int s2 = ferry_ep_sync(ep, NULL); /* the call only enqueued */
        if (rc == FERRY_OK)
            rc = s2;
        dback(NULL, (void *)in.y, 0);
        dback(NULL, (void *)in.topk_weights, 0);
        dback(o->out, out.out, (size_t)T * rowb);
        dback(o->w, out.topk_weights, (size_t)T * wb);
        for (int b = 0; b < 2; b++)
            dback(NULL, (void *)in.bias[b], 0);
    }
    free(y);
    free(gw);
    free(bias[0]);
    free(bias[1]);
    return rc;
}

/* Slot order (FERRY_HT_SUM_SLOTS) of token t into a[H] (fp32, before
 * the one rounding): the biases, then per slot k the row of the
 * contributor whose highest slot is k (a rank, or with forwarding another
 * node's rows summed there in rank order and rounded). */
static void slot_sum(const world_t *w, const spec_t *c, const data_t *d, const cres_t *o,
                     int t, float *a, float *part, uint16_t *row)
{
    int me = w->me, K = w->K, H = c->H;
    for (int h = 0; h < H; h++)
        a[h] = 0.0f;
    for (int b = 0; o->bias && b < 2; b++)
        for (int h = 0; h < H; h++)
            a[h] += fr_bf16_to_f32(gen_bias(b, me, t, h));
    for (int k = 0; k < K; k++) {
        int r = slot_rank(w, me, t, k), node = -1, last = 1;
        if (r < 0)
            continue;
        if (g_fwd && g_node_of[r] != g_node_of[me])
            node = g_node_of[r];
        for (int k2 = k + 1; k2 < K && last; k2++) {
            int r2 = slot_rank(w, me, t, k2);
            if (r2 >= 0 && (node >= 0 ? g_node_of[r2] == node : r2 == r))
                last = 0;
        }
        if (!last)
            continue;
        if (node < 0) {
            gen_y(c, d, r, me, t, row);
            for (int h = 0; h < H; h++)
                a[h] += fr_bf16_to_f32(row[h]);
            continue;
        }
        for (int h = 0; h < H; h++)
            part[h] = 0.0f;
        for (int q = 0; q < w->N; q++)
            if (g_node_of[q] == node && goes_to(w, me, t, q)) {
                gen_y(c, d, q, me, t, row);
                for (int h = 0; h < H; h++)
                    part[h] += fr_bf16_to_f32(row[h]);
            }
        for (int h = 0; h < H; h++)
            a[h] += fr_bf16_to_f32(fr_f32_to_bf16(part[h]));
    }
}

/* out[t] = bf16(fp32 sum over the ranks t went to, ascending, of their
 * y rows); out->topk_weights[t][k] from the rank of expert k. With
 * forwarding, nodes in order: this node's ranks one by one, another
 * node's rows summed there (fp32, ranks ascending) and rounded to bf16.
 * With o->slots, slot_sum's order instead. */
static long check_comb(const world_t *w, const spec_t *c, const data_t *d,
                       const cres_t *o, const char *what)
{
    int me = w->me, T = w->T[me], H = c->H, K = w->K;
    long bad = 0;
    float *acc = malloc(sizeof(float) * (size_t)H), *part = malloc(sizeof(float) * (size_t)H);
    uint16_t *row = malloc(2 * (size_t)H);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++)
            acc[h] = 0.0f;
        for (int b = 0; b < (g_fwd ? g_nnodes : 1); b++) {
            int sum = g_fwd && b != g_node_of[me];
            for (int h = 0; h < H && sum; h++)
                part[h] = 0.0f;
            for (int r = 0; r < w->N; r++) {
                if (!goes_to(w, me, t, r) || (g_fwd && g_node_of[r] != b))
                    continue;
                gen_y(c, d, r, me, t, row);
                for (int h = 0; h < H; h++)
                    (sum ? part : acc)[h] += fr_bf16_to_f32(row[h]);
            }
            for (int h = 0; h < H && sum; h++)
                acc[h] += fr_bf16_to_f32(fr_f32_to_bf16(part[h]));
        }
        for (int b = 0; o->bias && b < 2; b++) /* after the rows, in order */
            for (int h = 0; h < H; h++)
                acc[h] += fr_bf16_to_f32(gen_bias(b, me, t, h));
        int h = 0, kbad = -1, told = 0;
        const uint16_t *got = o->out + (size_t)t * H;
        if (o->slots) { /* acc (rank order) only tells whether the orders differ */
            float *sa = malloc(sizeof(float) * (size_t)H);
            slot_sum(w, c, d, o, t, sa, part, row);
            for (int i = 0; i < H; i++) {
                told |= !bf_same(fr_f32_to_bf16(sa[i]), fr_f32_to_bf16(acc[i]));
                acc[i] = sa[i];
            }
            free(sa);
            g_order_told += told;
        }
        while (h < H && bf_same(got[h], fr_f32_to_bf16(acc[h])))
            h++;
        for (int k = 0; o->w && k < K && kbad < 0; k++) {
            int r = slot_rank(w, me, t, k);
            float want = r < 0 ? 0.0f : gen_cw(d, r, me, t, k);
            if (o->w[(size_t)t * K + k] != want)
                kbad = k;
        }
        if ((h < H || kbad >= 0) && bad++ < 3)
            fprintf(stderr, "rank %d: %s: combine token %d wrong: out[%d] = "
                    "0x%04x want 0x%04x; topk_weights slot %d\n", me, what, t,
                    h < H ? h : 0, h < H ? got[h] : 0,
                    h < H ? fr_f32_to_bf16(acc[h]) : 0, kbad);
    }
    if (!gintact(o->out, 2 * (size_t)T * H) ||
        !gintact(o->w, sizeof(float) * (size_t)T * K)) {
        fprintf(stderr, "rank %d: %s: combine wrote past [T = %d] rows\n", me,
                what, T);
        bad++;
    }
    free(acc);
    free(part);
    free(row);
    return bad;
}

static int do_disp(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                   const spec_t *c, const data_t *d, int opts, const char *what)
{
    dres_t o;
    int rc = ht_disp(ep, rt, w, c, d, opts, &o);
    CHECK(rc == FERRY_OK, "rank %d: %s: ferry_ht_dispatch: %s: %s", w->me,
          what, ferry_strerror(rc), ferry_ep_last_error(ep));
    if (rc == FERRY_OK) {
        long bad = check_disp(w, c, d, &o, what);
        CHECK(bad == 0, "rank %d: %s: %ld of %d received rows wrong", w->me,
              what, bad, o.n);
    }
    dres_free(&o);
    return rc;
}

static int do_comb(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                   const spec_t *c, const data_t *d, int opts, const char *what)
{
    cres_t o = {NULL, NULL, 0, 0};
    int rc = ht_comb(ep, rt, w, c, d, opts, &o);
    CHECK(rc == FERRY_OK, "rank %d: %s: ferry_ht_combine: %s: %s", w->me,
          what, ferry_strerror(rc), ferry_ep_last_error(ep));
    if (rc == FERRY_OK) {
        long bad = check_comb(w, c, d, &o, what);
        CHECK(bad == 0, "rank %d: %s: %ld of %d tokens wrong", w->me, what,
              bad, w->T[w->me]);
    }
    free(o.out);
    free(o.w);
    return rc;
}

/* One round: a route from key rk, a dispatch and a combine, checked. */
static int do_round(ferry_ep_t ep, const spec_t *c, uint64_t rk, int opts,
                    int me)
{
    char what[160];
    snprintf(what, sizeof(what), "%s, round %llu", c->name,
             (unsigned long long)rk);
    world_t w;
    world_build(&w, c, rk, me);
    ferry_route_t rt = NULL;
    int rc = route_make(ep, &w, c->align, &rt, what);
    CHECK(rc == FERRY_OK, "rank %d: %s: route_create failed", me, what);
    if (rc == FERRY_OK) {
        data_t dx = {hkey(c->seed, rk, 1, 0), K_BITS, c->fp8};
        data_t dy = {hkey(c->seed, rk, 2, 0), K_FIN, 0};
        rc = do_disp(ep, rt, &w, c, &dx, opts, what);
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, c, &dy, opts, what);
        /* odd rounds: the same rows summed again in slot order (DeepEP 2's) */
        data_t dyo = {hkey(c->seed, rk, 3, 0), K_ORD, 0};
        if (rc == FERRY_OK && (rk & 1) && !(opts & (OPT_OLD | OPT_OLD2)))
            rc = do_comb(ep, rt, &w, c, &dyo, opts | OPT_SLOTS | OPT_BIAS, what);
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
    }
    world_free(&w);
    return rc;
}

/* ---------------------------------------------------------------------- */
/* basic                                                                  */
/* ---------------------------------------------------------------------- */

typedef struct basic_cfg {
    const char *name;
    int e_per_rank, K, H, T, fp8, align, ring;
    double zipf, mask_p, empty_p;
    int zero_last; /* the last rank has no tokens (N > 1) */
} basic_cfg_t;

static const basic_cfg_t basic_cfgs[] = {
    {"bf16 H=128 K=4 uniform", 8, 4, 128, 32, 0, 1, 0, 0, 0.05, 0.15, 0},
    {"fp8 H=256 K=8 zipf align 16 ring 8", 8, 8, 256, 24, 1, 16, 8, 1.2, 0.05,
     0.15, 0},
    {"bf16 H=7168 K=6 > E/N=4 ring 4", 4, 6, 7168, 6, 0, 1, 4, 0, 0.05, 0, 1},
    {"bf16 H=256 E=2N K>E/N zipf align 16", 2, 8, 256, 16, 0, 16, 0, 0.8,
     0.05, 0.15, 0},
    {"fp8 H=7168 K=1 align 16", 8, 1, 7168, 4, 1, 16, 0, 0, 0.05, 0.1, 0},
    {"bf16 H=128 K=2 half the ranks empty", 8, 2, 128, 16, 0, 1, 0, 0, 0.05,
     0.5, 0},
    {"bf16 H=128 K=16 zipf align 16 ring 3", 4, 16, 128, 12, 0, 16, 3, 1.0,
     0.05, 0.1, 0},
    {"fp8 H=128 K=3 every rank empty", 8, 3, 128, 8, 1, 1, 0, 0, 0.05, 1.0,
     0},
};

/* The first ncfg basic configurations, an EP each, nopts rounds each (round
 * r with opts[r]), seeds from seed0. */
static int run_cfgs(ferry_comm_t comm, size_t ncfg, const int *opts, int nopts,
                    uint32_t seed0)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc = FERRY_OK;
    for (size_t i = 0; i < ncfg; i++) {
        const basic_cfg_t *b = &basic_cfgs[i];
        spec_t c = {.name = b->name, .N = N, .E = b->e_per_rank * N,
                    .K = b->K, .H = b->H, .T = b->T, .fp8 = b->fp8,
                    .align = b->align, .ring = b->ring, .zipf = b->zipf,
                    .mask_p = b->mask_p, .empty_p = b->empty_p, .tmin = 1,
                    .zero_rank = b->zero_last && N > 1 ? N - 1 : -1,
                    .seed = seed0 + i};
        if (c.K > c.E)
            c.K = c.E;
        ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
        if (!ep)
            return 1;
        for (int r = 0; r < nopts && rc == FERRY_OK; r++)
            rc = do_round(ep, &c, 10 * i + (uint64_t)r + 1, opts[r], me);
        CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
        if (rc != FERRY_OK)
            return 1;
    }
    return FERRY_OK;
}

static int run_basic(ferry_comm_t comm)
{
    /* round 1: every optional output; round 2: none, NULL for empty
     * buffers; round 3: weights in only, sources, int64 ids, NULL for
     * empty, fp8 scales column-major */
    static const int opts[3] = {OPT_ALL, OPT_NULL0,
                                OPT_WIN | OPT_SRC | OPT_CWIN | OPT_NULL0 | OPT_SCOL |
                                    OPT_IDX | OPT_I64};
    if (run_cfgs(comm, sizeof(basic_cfgs) / sizeof(basic_cfgs[0]), opts, 3, 0xba51c000u))
        return 1;
    return fr_test_result();
}

/* ---------------------------------------------------------------------- */
/* bounded                                                                */
/* ---------------------------------------------------------------------- */

/* Bounded routes (max_recv = num_recv + 1..3 per rank): the basic
 * configurations again, outputs of max_recv rows, the padding checked,
 * num_recv_out and expert_counts_out checked; nine routes alive at once
 * (more than the CUDA engine's pool); with one rank, a bound below the
 * real count fails naming max_recv. */
static int run_bounded(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc = FERRY_OK;
    static const int opts[2] = {OPT_ALL, OPT_WIN | OPT_SRC | OPT_CWIN | OPT_IDX | OPT_I64};
    g_extra = 1 + me % 3;
    if (run_cfgs(comm, 4, opts, 2, 0xb0a7d000u))
        return 1;
    { /* more live bounded routes than the CUDA engine's pool (eight): the
       * ninth has tables of its own; the first and the last both work */
        spec_t c = {.name = "nine live routes", .N = N, .E = 4 * N, .K = 4, .H = 256,
                    .T = 16, .align = 1, .mask_p = 0.05, .tmin = 1, .zero_rank = -1,
                    .seed = 0xb0a7d100u};
        ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
        if (!ep)
            return 1;
        world_t w;
        world_build(&w, &c, 7, me);
        ferry_route_t rt[9] = {NULL};
        for (int i = 0; i < 9 && rc == FERRY_OK; i++)
            rc = route_make(ep, &w, 1, &rt[i], "nine live routes");
        data_t dx = {hkey(c.seed, 7, 1, 0), K_BITS, 0};
        if (rc == FERRY_OK)
            rc = do_disp(ep, rt[8], &w, &c, &dx, OPT_ALL, "the ninth live route");
        if (rc == FERRY_OK)
            rc = do_disp(ep, rt[0], &w, &c, &dx, OPT_ALL, "the first live route");
        for (int i = 0; i < 9; i++)
            if (rt[i])
                CHECK_RC(ferry_route_destroy(rt[i]), FERRY_OK);
        world_free(&w);
        CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
        if (rc != FERRY_OK)
            return 1;
    }
    if (N == 1) { /* more rows than the bound: an error naming max_recv */
        spec_t c = {.name = "bound too small", .N = 1, .E = 8, .K = 4, .H = 128, .T = 16,
                    .align = 1, .tmin = 16, .zero_rank = -1, .seed = 0xb0a7d0ffu};
        world_t w;
        world_build(&w, &c, 1, me);
        ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
        if (!ep)
            return 1;
        ferry_route_in_t in = {.size = sizeof(in), .num_tokens = w.T[0], .topk_idx = w.idx[0],
                               .max_recv = w.nrecv - 1};
        ferry_route_t rt = NULL;
        rc = route_call(ep, &in, &rt, c.T, c.K);
        if (rc == FERRY_OK && g_cuda)
            rc = ferry_ep_sync(ep, NULL); /* found on the GPU */
        printf("bound %d for %d rows: %s: %s\n", in.max_recv, w.nrecv, ferry_strerror(rc),
               ferry_ep_last_error(ep));
        CHECK(rc == FERRY_ERR_INVALID, "bound below the rows: status %d, want "
              "FERRY_ERR_INVALID", rc);
        CHECK(strstr(ferry_ep_last_error(ep), "max_recv") != NULL,
              "the message names max_recv: %s", ferry_ep_last_error(ep));
        if (rt)
            ferry_route_destroy(rt);
        ferry_ep_destroy(ep);
        world_free(&w);
    }
    g_extra = -1;
    return fr_test_result();
}

/* ---------------------------------------------------------------------- */
/* graph (CUDA)                                                           */
/* ---------------------------------------------------------------------- */

#ifdef FERRY_HAVE_CUDA
#define GCU(x)                                                                 \
    do {                                                                       \
        cudaError_t e_ = (x);                                                  \
        CHECK(e_ == cudaSuccess, "%s: %s", #x, cudaGetErrorString(e_));        \
        if (e_ != cudaSuccess)                                                 \
            return 1;                                                          \
    } while (0)

/* One bounded round (route_create, ht_dispatch, ht_combine with the
 * received rows as y: an identity expert, route_destroy) captured once in
 * a CUDA graph on a non-blocking stream, then replayed with new topk_idx,
 * x and weights copied into the same buffers; every replay's outputs are
 * checked: rows, padding, num_recv_out, and out[t] = bf16(m x[t]) for a
 * token that went to m ranks. */
static int run_graph(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc = FERRY_OK;
    spec_t c = {.name = "graph", .N = N, .E = 8 * N, .K = 4, .H = 256, .T = 32,
                .align = 1, .zipf = 0.8, .mask_p = 0.1, .tmin = 32, .zero_rank = -1,
                .seed = 0x6a0f0000u};
    int T = c.T, K = c.K, H = c.H, bound = N * T;
    /* FERRY_TEST_DP=G: DP groups of G; every member passes the inputs of
     * its group's first rank, and its combine must hold every token's
     * result (the dispatch rows are each member's share: not checked
     * row by row here, the combine checks them) */
    int dp = getenv("FERRY_TEST_DP") ? atoi(getenv("FERRY_TEST_DP")) : 0;
    int src = dp > 1 ? me - me % dp : me;
    g_dp = dp;
    ferry_ep_t ep = ep_make(comm, &c, T, &rc);
    g_dp = 0;
    if (!ep)
        return 1;
    void *idx_d, *x_d, *w_d, *rx_d, *ridx_d, *rw_d, *rsr_d, *rst_d, *out_d, *n_d;
    GCU(cudaMalloc(&idx_d, (size_t)T * K * 8));
    GCU(cudaMalloc(&x_d, (size_t)T * H * 2));
    GCU(cudaMalloc(&w_d, (size_t)T * K * 4));
    GCU(cudaMalloc(&rx_d, (size_t)bound * H * 2));
    GCU(cudaMalloc(&ridx_d, (size_t)bound * K * 4));
    GCU(cudaMalloc(&rw_d, (size_t)bound * K * 4));
    GCU(cudaMalloc(&rsr_d, (size_t)bound * 4));
    GCU(cudaMalloc(&rst_d, (size_t)bound * 4));
    GCU(cudaMalloc(&out_d, (size_t)T * H * 2));
    GCU(cudaMalloc(&n_d, 4));
    cudaStream_t st;
    GCU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ferry_route_in_t rin = {.size = sizeof(rin), .num_tokens = T, .topk_idx = idx_d,
                            .stream = st, .max_recv = bound, .num_recv_out = n_d};
    ferry_ht_dispatch_in_t din = {.size = sizeof(din), .x = x_d, .topk_weights = w_d,
                                  .stream = st};
    ferry_ht_dispatch_out_t dout = {.size = sizeof(dout), .recv_x = rx_d,
                                    .recv_topk_idx = ridx_d, .recv_topk_weights = rw_d,
                                    .recv_src_rank = rsr_d, .recv_src_token = rst_d};
    ferry_ht_combine_in_t cin = {.size = sizeof(cin), .y = rx_d, .stream = st};
    ferry_ht_combine_out_t cout = {.size = sizeof(cout), .out = out_d};
    /* the whole round in one graph: nothing allocated, nothing waited for */
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    ferry_route_t rt = NULL;
    GCU(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    int r1 = ferry_route_create(ep, &rin, &rt);
    int r2 = r1 ? r1 : ferry_ht_dispatch(ep, rt, &din, &dout);
    int r3 = r2 ? r2 : ferry_ht_combine(ep, rt, &cin, &cout);
    if (rt)
        ferry_route_destroy(rt);
    cudaError_t ce = cudaStreamEndCapture(st, &g);
    CHECK(r3 == FERRY_OK, "rank %d: a call failed while captured: %s: %s", me,
          ferry_strerror(r3), ferry_ep_last_error(ep));
    GCU(ce);
    GCU(cudaGraphInstantiate(&ge, g, 0));
    size_t xb = (size_t)T * H * 2, rb = (size_t)bound * H * 2;
    uint16_t *x = malloc(xb), *rx = malloc(rb), *out = malloc(xb);
    float *wt = malloc((size_t)T * K * 4), *rw = malloc((size_t)bound * K * 4);
    int32_t *ridx = malloc((size_t)bound * K * 4), *rsr = malloc((size_t)bound * 4),
            *rst = malloc((size_t)bound * 4), nrecv = -1;
    uint8_t *want = malloc(2 * (size_t)H);
    for (int r = 1; r <= 4 && fr_test_result() == 0; r++) {
        world_t w;
        world_build(&w, &c, 100 + (uint64_t)r, me);
        data_t dx = {hkey(c.seed, 100 + (uint64_t)r, 1, 0), K_FIN, 0};
        for (int t = 0; t < T; t++) {
            gen_x(&c, &dx, src, t, x + (size_t)t * H, NULL);
            for (int k = 0; k < K; k++)
                wt[(size_t)t * K + k] = gen_wt(&dx, src, t, k);
        }
        GCU(cudaMemcpyAsync(idx_d, w.idx[src], (size_t)T * K * 8, cudaMemcpyHostToDevice, st));
        GCU(cudaMemcpyAsync(x_d, x, xb, cudaMemcpyHostToDevice, st));
        GCU(cudaMemcpyAsync(w_d, wt, (size_t)T * K * 4, cudaMemcpyHostToDevice, st));
        GCU(cudaGraphLaunch(ge, st));
        GCU(cudaStreamSynchronize(st));
        rc = ferry_ep_sync(ep, st);
        CHECK(rc == FERRY_OK, "rank %d: replay %d: %s: %s", me, r, ferry_strerror(rc),
              ferry_ep_last_error(ep));
        GCU(cudaMemcpy(&nrecv, n_d, 4, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(rx, rx_d, rb, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(ridx, ridx_d, (size_t)bound * K * 4, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(rw, rw_d, (size_t)bound * K * 4, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(rsr, rsr_d, (size_t)bound * 4, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(rst, rst_d, (size_t)bound * 4, cudaMemcpyDeviceToHost));
        GCU(cudaMemcpy(out, out_d, xb, cudaMemcpyDeviceToHost));
        CHECK(dp > 1 || nrecv == w.nrecv, "rank %d: replay %d: num_recv_out %d, want %d",
              me, r, nrecv, w.nrecv);
        dres_t o = {.rowb = 2 * (size_t)H, .ns = 0, .n = bound, .x = (uint8_t *)rx, .w = rw,
                    .idx = ridx, .sr = rsr, .st = rst};
        long bad = 0;
        for (int i = 0; dp <= 1 && i < w.nrecv && i < bound; i++)
            bad += disp_row_bad(&w, &c, &dx, &o, i, want, NULL) != 0;
        for (int i = w.nrecv; dp <= 1 && i < bound; i++)
            bad += rsr[i] != -1 || rst[i] != -1 || ridx[(size_t)i * K] != -1 ||
                   rw[(size_t)i * K] != 0.f;
        CHECK(bad == 0, "rank %d: replay %d: %ld of %d dispatch rows wrong", me, r, bad,
              bound);
        long cbad = 0;
        for (int t = 0; t < T; t++) {
            int m = 0;
            for (int d = 0; d < N; d++)
                m += goes_to(&w, src, t, d);
            for (int h = 0; h < H; h++) {
                uint16_t xv = x[(size_t)t * H + h];
                uint16_t wv = m ? fr_f32_to_bf16((float)m * fr_bf16_to_f32(xv)) : 0;
                if (!bf_same(out[(size_t)t * H + h], wv)) {
                    cbad++;
                    break;
                }
            }
        }
        CHECK(cbad == 0, "rank %d: replay %d: %ld of %d combined tokens wrong", me, r, cbad,
              T);
        if (me == 0)
            printf("replay %d: %d rows here (bound %d), %s\n", r, nrecv, bound,
                   dp > 1 ? "DP groups: every token's combine checked on every member"
                          : "dispatch and combine checked");
        world_free(&w);
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    void *bufs[] = {idx_d, x_d, w_d, rx_d, ridx_d, rw_d, rsr_d, rst_d, out_d, n_d};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        cudaFree(bufs[i]);
    free(x);
    free(rx);
    free(out);
    free(wt);
    free(rw);
    free(ridx);
    free(rsr);
    free(rst);
    free(want);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    return fr_test_result();
}
#else
static int run_graph(ferry_comm_t comm)
{
    (void)comm;
    CHECK(0, "graph: this build has no CUDA");
    return fr_test_result();
}
#endif

/* ---------------------------------------------------------------------- */
/* chunk                                                                  */
/* ---------------------------------------------------------------------- */

/* The shared segment is rings, not rows: the same for max_tokens 1024 and
 * 16384 (and far below N x max_tokens rows). */
static int check_shm_flat(ferry_comm_t comm, const spec_t *c, int big)
{
    size_t shm[2] = {0, 0};
    int tok[2] = {1024, big}, rc = FERRY_OK;
    for (int i = 0; i < 2; i++) {
        ferry_ep_t ep = ep_make(comm, c, tok[i], &rc);
        if (!ep)
            return rc;
        ferry_ep_layout_t lay = {.size = sizeof(lay)};
        CHECK_RC(ferry_ep_get_layout(ep, &lay), FERRY_OK);
        shm[i] = lay.shm_bytes;
        CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    }
    int me = ferry_comm_rank(comm);
    if (me == 0)
        fprintf(stderr, "ring_tokens %d: shm_bytes %zu (max_tokens 1024), %zu "
                "(max_tokens %d)\n", c->ring, shm[0], shm[1], big);
    CHECK(shm[0] == shm[1], "rank %d: shm_bytes grows with max_tokens: %zu "
          "for 1024, %zu for %d", me, shm[0], shm[1], big);
    size_t rows = (size_t)c->N * (size_t)big * 2 * (size_t)c->H;
    CHECK(shm[1] < rows, "rank %d: shm_bytes %zu holds every token (%zu)", me,
          shm[1], rows);
    CHECK(c->N == 1 || shm[1] > 0, "rank %d: shm_bytes 0 with %d ranks", me,
          c->N);
    return FERRY_OK;
}

static int run_chunk(ferry_comm_t comm, int T, int ring)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    spec_t a = {.name = "chunk bf16 H=64 K=3 uniform", .N = N, .E = 4 * N,
                .K = 3, .H = 64, .T = T, .ring = ring, .align = 1,
                .mask_p = 0.05, .tmin = T / 2, .zero_rank = -1,
                .seed = 0xc4c4c4u};
    if ((rc = check_shm_flat(comm, &a, T > 16384 ? T : 16384)) != FERRY_OK)
        return 1;
    ferry_ep_t ep = ep_make(comm, &a, T, &rc);
    if (!ep)
        return 1;
    rc = do_round(ep, &a, 1, OPT_ALL, me);
    if (rc == FERRY_OK)
        rc = do_round(ep, &a, 2, OPT_SRC | OPT_NULL0, me);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    if (rc != FERRY_OK)
        return 1;
    spec_t b = a;
    b.name = "chunk fp8 H=128 K=2 zipf align 16, last rank empty";
    b.fp8 = 1;
    b.H = 128;
    b.K = 2;
    b.zipf = 1.5;
    b.align = 16;
    b.zero_rank = N > 1 ? N - 1 : -1;
    ep = ep_make(comm, &b, T, &rc);
    if (!ep)
        return 1;
    rc = do_round(ep, &b, 3, OPT_ALL, me);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    return rc != FERRY_OK ? 1 : fr_test_result();
}

/* ---------------------------------------------------------------------- */
/* reuse                                                                  */
/* ---------------------------------------------------------------------- */

/* Two routes alive at once, used alternately for dispatches and combines
 * with new data each time; then one replaced while the other lives on. */
static int reuse_routes(ferry_ep_t ep, const spec_t *c, int me)
{
    /* route slot (0 or 1), combine?, options; a slot of -1 replaces route
     * 0 with a new one */
    static const int steps[][3] = {
        {0, 0, OPT_ALL}, {1, 0, OPT_ALL}, {0, 1, OPT_CW}, {0, 0, OPT_IDX},
        {1, 1, OPT_CWIN}, {0, 1, 0}, {1, 1, OPT_CW}, {1, 0, OPT_W | OPT_SRC},
        {-1, 0, 0},
        {0, 0, OPT_ALL}, {1, 1, OPT_CW}, {1, 0, OPT_ALL}, {0, 1, OPT_CW},
        {0, 0, OPT_NULL0}, {0, 1, OPT_NULL0},
    };
    world_t w[2];
    ferry_route_t rt[2] = {NULL, NULL};
    int rc = FERRY_OK;
    char what[2][64];
    for (int i = 0; i < 2; i++) {
        world_build(&w[i], c, 101 + (uint64_t)i, me);
        snprintf(what[i], sizeof(what[i]), "reuse, route %d", i + 1);
        if (rc == FERRY_OK)
            rc = route_make(ep, &w[i], c->align, &rt[i], what[i]);
    }
    size_t nsteps = sizeof(steps) / sizeof(steps[0]);
    for (size_t s = 0; rc == FERRY_OK && s < nsteps; s++) {
        int i = steps[s][0];
        if (i < 0) {
            CHECK_RC(ferry_route_destroy(rt[0]), FERRY_OK);
            rt[0] = NULL;
            world_free(&w[0]);
            world_build(&w[0], c, 103, me);
            snprintf(what[0], sizeof(what[0]), "reuse, route 3");
            rc = route_make(ep, &w[0], c->align, &rt[0], what[0]);
            continue;
        }
        data_t d = {hkey(c->seed, 200 + s, 0, 0), steps[s][1] ? K_FIN : K_BITS,
                    0};
        if (steps[s][1])
            rc = do_comb(ep, rt[i], &w[i], c, &d, steps[s][2], what[i]);
        else
            rc = do_disp(ep, rt[i], &w[i], c, &d, steps[s][2], what[i]);
    }
    CHECK(rc == FERRY_OK, "rank %d: reuse steps failed", me);
    for (int i = 0; i < 2; i++) {
        if (rt[i])
            CHECK_RC(ferry_route_destroy(rt[i]), FERRY_OK);
        world_free(&w[i]);
    }
    return rc;
}

/* Local parts of the adjoint identity: a = <C(y), g> + <C(gw), w> over
 * own tokens, b = <y, D(g)> + <gw, D(w)> over received rows, and the sums
 * of their terms' magnitudes. */
static void adjoint_parts(const world_t *w, const spec_t *c, const data_t *dg,
                          const data_t *dy, const dres_t *D, const cres_t *C,
                          double v[4])
{
    int me = w->me, H = c->H, K = w->K;
    uint16_t *row = malloc(2 * (size_t)H);
    for (int t = 0; t < w->T[me]; t++) {
        gen_x(c, dg, me, t, row, NULL);
        for (int h = 0; h < H; h++) {
            double p = (double)fr_bf16_to_f32(C->out[(size_t)t * H + h]) * fr_bf16_to_f32(row[h]);
            v[0] += p;
            v[2] += fabs(p);
        }
        for (int k = 0; k < K; k++) {
            double p = (double)C->w[(size_t)t * K + k] * gen_wt(dg, me, t, k);
            v[0] += p;
            v[2] += fabs(p);
        }
    }
    const uint16_t *rx = (const uint16_t *)D->x;
    for (int i = 0; i < w->nrecv; i++) {
        gen_y(c, dy, me, w->rs[i], w->rt[i], row);
        for (int h = 0; h < H; h++) {
            double p = (double)fr_bf16_to_f32(row[h]) * fr_bf16_to_f32(rx[(size_t)i * H + h]);
            v[1] += p;
            v[3] += fabs(p);
        }
        for (int k = 0; k < K; k++) {
            double p = (double)gen_cw(dy, me, w->rs[i], w->rt[i], k) *
                       D->w[(size_t)i * K + k];
            v[1] += p;
            v[3] += fabs(p);
        }
    }
    free(row);
}

/* Backward identities on one route (bf16 dispatch D, combine C): summed
 * over ranks, <C(y), g> = <y, D(g)>, weights riding along. K_INT data:
 * exact; K_FIN: within one bf16 rounding of the combine. */
static int check_adjoint(ferry_comm_t comm, ferry_ep_t ep, ferry_route_t rt,
                         const world_t *w, const spec_t *c, int kind,
                         uint64_t tag)
{
    int N = w->N, me = w->me;
    data_t dg = {tag, kind, 0}, dy = {tag + 1, kind, 0};
    dres_t D;
    cres_t C = {NULL, NULL, 0, 0};
    int rc = ht_disp(ep, rt, w, c, &dg, OPT_W, &D);
    CHECK(rc == FERRY_OK, "adjoint dispatch: %s", ferry_ep_last_error(ep));
    if (rc == FERRY_OK) {
        CHECK(check_disp(w, c, &dg, &D, "adjoint") == 0,
              "adjoint dispatch wrong");
        rc = ht_comb(ep, rt, w, c, &dy, OPT_CW, &C);
        CHECK(rc == FERRY_OK, "adjoint combine: %s", ferry_ep_last_error(ep));
    }
    if (rc == FERRY_OK) {
        CHECK(check_comb(w, c, &dy, &C, "adjoint") == 0,
              "adjoint combine wrong");
        double v[4] = {0, 0, 0, 0}, sum[4] = {0, 0, 0, 0};
        adjoint_parts(w, c, &dg, &dy, &D, &C, v);
        double *all = calloc((size_t)N * 4, sizeof(double));
        CHECK_RC(ferry_comm_allgather(comm, v, all, sizeof(v)), FERRY_OK);
        for (int r = 0; r < N * 4; r++)
            sum[r % 4] += all[r];
        free(all);
        double tol = kind == K_INT ? 0.0 : (sum[2] + sum[3]) / 128.0;
        CHECK(fabs(sum[0] - sum[1]) <= tol, "rank %d: adjoint (%s data): "
              "sum <C(y), g> = %.17g, sum <y, D(g)> = %.17g, tolerance %.3g",
              me, kind == K_INT ? "integer" : "random", sum[0], sum[1], tol);
    }
    dres_free(&D);
    free(C.out);
    free(C.w);
    return rc;
}

/* fp8 forward (x passed through with scales), then the backward on the
 * same route in bf16: a dispatch of the output's gradient and a combine
 * of recv_x's gradient; then the adjoint identities there. */
static int reuse_fp8_backward(ferry_comm_t comm, const spec_t *c, int me)
{
    int rc;
    ferry_ep_t ep = ep_make(comm, c, c->T, &rc);
    if (!ep)
        return rc;
    world_t w;
    world_build(&w, c, 301, me);
    ferry_route_t rt = NULL;
    rc = route_make(ep, &w, c->align, &rt, "fp8 forward");
    CHECK(rc == FERRY_OK, "rank %d: fp8 route_create failed", me);
    if (rc == FERRY_OK) {
        data_t fx = {hkey(c->seed, 301, 1, 0), K_BITS, 1};
        data_t fy = {hkey(c->seed, 301, 2, 0), K_FIN, 0};
        data_t gy = {hkey(c->seed, 301, 3, 0), K_FIN, 0};
        data_t gx = {hkey(c->seed, 301, 4, 0), K_FIN, 0};
        rc = do_disp(ep, rt, &w, c, &fx, OPT_ALL, "fp8 forward dispatch");
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, c, &fy, OPT_ALL, "fp8 forward combine");
        if (rc == FERRY_OK)
            rc = do_disp(ep, rt, &w, c, &gy, OPT_IDX | OPT_SRC,
                         "bf16 backward dispatch on an fp8 EP");
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, c, &gx, OPT_CW,
                         "bf16 backward combine on an fp8 EP");
        if (rc == FERRY_OK)
            rc = check_adjoint(comm, ep, rt, &w, c, K_INT, 0xadd1);
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
    }
    world_free(&w);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    return rc;
}

static int run_reuse(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    spec_t c = {.name = "reuse", .N = N, .E = 4 * N, .K = 4, .H = 256,
                .T = 64, .align = 1, .mask_p = 0.05, .empty_p = 0.1,
                .tmin = 1, .zero_rank = -1, .seed = 0x5e5e5eu};
    ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
    if (!ep)
        return 1;
    rc = reuse_routes(ep, &c, me);
    for (int i = 0; i < 3 && rc == FERRY_OK; i++) {
        /* adjoint on routes of their own, a round with empty ranks too */
        spec_t a = c;
        a.name = "adjoint";
        a.align = i == 1 ? 16 : 1;
        a.zipf = i == 2 ? 1.2 : 0;
        world_t w;
        world_build(&w, &a, 401 + (uint64_t)i, me);
        ferry_route_t rt = NULL;
        rc = route_make(ep, &w, a.align, &rt, "adjoint");
        CHECK(rc == FERRY_OK, "rank %d: adjoint route_create failed", me);
        uint64_t tag = 0xad00 + 16 * (uint64_t)i;
        if (rc == FERRY_OK)
            rc = check_adjoint(comm, ep, rt, &w, &a, K_INT, tag);
        if (rc == FERRY_OK)
            rc = check_adjoint(comm, ep, rt, &w, &a, K_FIN, tag + 8);
        if (rt)
            CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
        world_free(&w);
    }
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    if (rc != FERRY_OK)
        return 1;
    spec_t f = c;
    f.name = "reuse fp8";
    f.fp8 = 1;
    f.zipf = 1.0;
    f.align = 16;
    rc = reuse_fp8_backward(comm, &f, me);
    return rc != FERRY_OK ? 1 : fr_test_result();
}

/* ---------------------------------------------------------------------- */
/* args                                                                   */
/* ---------------------------------------------------------------------- */

static int is_ident(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
           (ch >= '0' && ch <= '9') || ch == '_';
}

/* msg names `word` as a whole identifier ("x" in "in->x: NULL", not in
 * "recv_x"). */
static int names(const char *msg, const char *word)
{
    size_t n = strlen(word);
    for (const char *p = msg; (p = strstr(p, word)) != NULL; p++)
        if ((p == msg || !is_ident(p[-1])) && !is_ident(p[n]))
            return 1;
    return 0;
}

#define CHECK_NAMES(ep, word)                                                  \
    CHECK(names(ferry_ep_last_error(ep), word),                                \
          "message '%s' does not name '%s'", ferry_ep_last_error(ep), word)

/* A call that must fail with FERRY_ERR_INVALID naming `word`. */
#define CHECK_BAD(ep, call, word)                                              \
    do {                                                                       \
        CHECK_RC(call, FERRY_ERR_INVALID);                                     \
        CHECK_NAMES(ep, word);                                                 \
    } while (0)

static int mentions_ht(const char *msg)
{
    return strcasestr(msg, "high-throughput") ||
           strcasestr(msg, "high throughput") ||
           strstr(msg, "ferry_ht_dispatch");
}

/* ferry_route_create on a low-latency EP: refused naming the mode. */
static void args_route_on_ll(ferry_comm_t comm, const spec_t *c,
                             const world_t *w)
{
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = c->E;
    cfg.topk = c->K;
    cfg.hidden = c->H;
    cfg.max_tokens = c->T;
    cfg.device = g_cuda ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
    ferry_ep_t ep = NULL;
    int rc = ferry_ep_create(comm, &cfg, &ep);
    CHECK(rc == FERRY_OK && ep, "low-latency create: %s",
          ferry_comm_last_error(comm));
    if (!ep)
        return;
    ferry_route_in_t in = {.size = sizeof(in), .num_tokens = w->T[w->me],
                           .topk_idx = w->idx[w->me], .expert_alignment = 1};
    ferry_route_t rt = NULL;
    rc = ferry_route_create(ep, &in, &rt);
    CHECK(rc == FERRY_ERR_INVALID || rc == FERRY_ERR_UNSUPPORTED,
          "route_create on a low-latency EP: rc %d (%s)", rc,
          ferry_strerror(rc));
    CHECK(strstr(ferry_ep_last_error(ep), "mode") != NULL,
          "message '%s' does not name 'mode'", ferry_ep_last_error(ep));
    if (rc == FERRY_OK && rt)
        ferry_route_destroy(rt);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
}

/* Low-latency calls on a high-throughput EP point to ferry_ht_dispatch. */
static void args_ll_on_ht(ferry_ep_t ep, const world_t *w, const spec_t *c)
{
    uint16_t *x = calloc((size_t)c->T * c->H, 2);
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = w->T[w->me],
                               .x = x, .topk_idx = w->idx[w->me]};
    uint64_t round = 0;
    int rc = ferry_dispatch_send(ep, &din, &round);
    CHECK(rc == FERRY_ERR_UNSUPPORTED || rc == FERRY_ERR_INVALID,
          "ferry_dispatch_send on a high-throughput EP: rc %d (%s)", rc,
          ferry_strerror(rc));
    CHECK(mentions_ht(ferry_ep_last_error(ep)), "message '%s' does not "
          "mention high-throughput or ferry_ht_dispatch",
          ferry_ep_last_error(ep));
    free(x);
}

/* Every rank passes the same bad field in each step: argument checks are
 * local, so nobody enters the exchange and nobody waits. */
static void args_route(ferry_ep_t ep, const world_t *w, const spec_t *c)
{
    int me = w->me, K = w->K;
    int64_t *idx = w->idx[me];
    ferry_route_in_t good = {.size = sizeof(good), .num_tokens = w->T[me],
                             .topk_idx = idx, .expert_alignment = 1}, in;
    ferry_route_t rt = NULL;
    CHECK_RC(ferry_route_create(NULL, &good, &rt), FERRY_ERR_INVALID);
    CHECK_BAD(ep, ferry_route_create(ep, NULL, &rt), "in");
    CHECK_BAD(ep, ferry_route_create(ep, &good, NULL), "route");
    in = good;
    in.size = sizeof(in) - 1;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "size");
    in.size = 0;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "size");
    in.size = offsetof(ferry_route_in_t, stream); /* an older ferry.h: taken */
    int rc = route_call(ep, &in, &rt, c->T, K);
    CHECK(rc == FERRY_OK, "route_create with the size before `stream`: %s: %s",
          ferry_strerror(rc), ferry_ep_last_error(ep));
    if (rc == FERRY_OK)
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
    rt = NULL;
    in = good;
    in.num_tokens = -1;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "num_tokens");
    in.num_tokens = c->T + 1;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "num_tokens");
    in = good;
    in.topk_idx = NULL;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "topk_idx");
    in = good;
    in.expert_alignment = -1;
    CHECK_BAD(ep, route_call(ep, &in, &rt, c->T, K), "expert_alignment");
    int64_t saved = idx[K + 1];
    idx[K + 1] = -2;
    CHECK_BAD(ep, route_call(ep, &good, &rt, c->T, K), "topk_idx");
    idx[K + 1] = c->E;
    CHECK_BAD(ep, route_call(ep, &good, &rt, c->T, K), "topk_idx");
    idx[K + 1] = idx[K]; /* token 1 names one expert twice */
    CHECK_BAD(ep, route_call(ep, &good, &rt, c->T, K), "topk_idx");
    idx[K + 1] = saved;
    /* a bad topk_idx on the last rank alone: every rank's route_create
     * fails, the others' naming it, and the context goes on (the good
     * route after these, in run_args) */
    int bad = w->N - 1;
    for (int rep = 0; rep < 2; rep++) {
        if (me == bad)
            idx[K + 1] = rep ? idx[K] : c->E;
        rc = route_call(ep, &good, &rt, c->T, K);
        idx[K + 1] = saved;
        char want[32];
        snprintf(want, sizeof(want), "rank %d", bad);
        const char *msg = ferry_ep_last_error(ep);
        CHECK(rc == FERRY_ERR_INVALID && strstr(msg, "topk_idx") &&
                  (me == bad || strstr(msg, want)),
              "rank %d: route_create with a bad topk_idx on rank %d alone: %s: %s", me, bad,
              ferry_strerror(rc), msg);
        if (rc == FERRY_OK)
            CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
        rt = NULL;
    }
    int nrecv = 0;
    CHECK_RC(ferry_route_counts(NULL, &nrecv, NULL), FERRY_ERR_INVALID);
}

static void args_dispatch(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                          const spec_t *c)
{
    int T = w->T[w->me], nr = w->nrecv, K = w->K;
    uint16_t *x = calloc((size_t)T * c->H, 2);
    uint16_t *rx = calloc((size_t)nr * c->H, 2);
    float *rw = calloc((size_t)nr * K, sizeof(float));
    ferry_ht_dispatch_in_t gi = {.size = sizeof(gi), .x = x}, in;
    ferry_ht_dispatch_out_t go = {.size = sizeof(go), .recv_x = rx}, out;
    CHECK_RC(ferry_ht_dispatch(NULL, rt, &gi, &go), FERRY_ERR_INVALID);
    CHECK_BAD(ep, ferry_ht_dispatch(ep, NULL, &gi, &go), "route");
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, NULL, &go), "in");
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &gi, NULL), "out");
    in = gi;
    in.size = sizeof(in) - 1;
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &go), "size");
    out = go;
    out.size = 0;
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &gi, &out), "size");
    in = gi;
    in.x = NULL;
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &go), "x");
    out = go;
    out.recv_x = NULL;
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &gi, &out), "recv_x");
    out = go;
    out.size = sizeof(out) - 4; /* splits recv_topk_idx_i64 */
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &gi, &out), "size");
    out = go; /* ids as int32 and as int64: at most one */
    out.recv_topk_idx = (int32_t *)rw;
    out.recv_topk_idx_i64 = (int64_t *)rw;
    CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &gi, &out), "recv_topk_idx_i64");
    out = go;
    out.recv_topk_weights = rw; /* without in->topk_weights */
    CHECK_RC(ferry_ht_dispatch(ep, rt, &gi, &out), FERRY_ERR_INVALID);
    CHECK(strstr(ferry_ep_last_error(ep), "topk_weights") != NULL,
          "message '%s' does not name topk_weights", ferry_ep_last_error(ep));
    free(x);
    free(rx);
    free(rw);
}

static void args_combine(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                         const spec_t *c)
{
    int T = w->T[w->me], nr = w->nrecv;
    uint16_t *y = calloc((size_t)nr * c->H, 2);
    uint16_t *o = calloc((size_t)T * c->H, 2);
    ferry_ht_combine_in_t gi = {.size = sizeof(gi), .y = y}, in;
    ferry_ht_combine_out_t go = {.size = sizeof(go), .out = o}, out;
    CHECK_RC(ferry_ht_combine(NULL, rt, &gi, &go), FERRY_ERR_INVALID);
    CHECK_BAD(ep, ferry_ht_combine(ep, NULL, &gi, &go), "route");
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, NULL, &go), "in");
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &gi, NULL), "out");
    in = gi;
    in.size = 0;
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &in, &go), "size");
    out = go;
    out.size = sizeof(out) - 1;
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &gi, &out), "size");
    in = gi;
    in.y = NULL;
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &in, &go), "y");
    out = go;
    out.out = NULL;
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &gi, &out), "out");
    in = gi;
    in.sum_order = 2;
    CHECK_BAD(ep, ferry_ht_combine(ep, rt, &in, &go), "sum_order");
    free(y);
    free(o);
}

/* fp8 x (x_scales given) needs recv_x_scales; then a good fp8 dispatch. */
static void args_fp8(ferry_comm_t comm, const spec_t *c0, int me)
{
    spec_t c = *c0;
    c.name = "args fp8";
    c.fp8 = 1;
    int rc;
    ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
    if (!ep)
        return;
    world_t w;
    world_build(&w, &c, 2, me);
    ferry_route_t rt = NULL;
    if (route_make(ep, &w, 1, &rt, "args fp8") == FERRY_OK) {
        int T = w.T[me], nr = w.nrecv;
        uint8_t *x = calloc((size_t)T * c.H, 1);
        uint8_t *rx = calloc((size_t)nr * c.H, 1);
        float *xs = calloc((size_t)T * (c.H / 128), sizeof(float));
        ferry_ht_dispatch_in_t in = {.size = sizeof(in), .x = x,
                                     .x_scales = xs};
        ferry_ht_dispatch_out_t out = {.size = sizeof(out), .recv_x = rx};
        CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &out), "recv_x_scales");
        float *rxs = calloc((size_t)nr * (c.H / 128) + 1, sizeof(float));
        out.recv_x_scales = rxs;
        in.x_scales_stride[0] = 0; /* one of the two 0 */
        in.x_scales_stride[1] = 1;
        CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &out), "x_scales_stride");
        in.x_scales_stride[0] = c.H / 128;
        in.x_scales_stride[1] = -1;
        CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &out), "x_scales_stride");
        if (T > 1 || c.H >= 256) { /* a span past 2^63 bytes */
            in.x_scales_stride[0] = INT64_MAX;
            in.x_scales_stride[1] = INT64_MAX;
            CHECK_BAD(ep, ferry_ht_dispatch(ep, rt, &in, &out), "x_scales_stride");
        }
        free(rxs);
        free(x);
        free(rx);
        free(xs);
        data_t d = {hkey(c.seed, 2, 1, 0), K_BITS, 1};
        do_disp(ep, rt, &w, &c, &d, OPT_ALL, "args fp8 dispatch");
        do_disp(ep, rt, &w, &c, &d, OPT_ALL | OPT_SCOL, "args fp8 dispatch, column-major scales");
        do_disp(ep, rt, &w, &c, &d, OPT_ALL | OPT_OLD2,
                "args fp8 dispatch, struct size before x_scales_stride");
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
    } else {
        CHECK(0, "rank %d: fp8 route_create failed", me);
    }
    world_free(&w);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
}

static int run_args(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    /* every token to every rank: num_recv > 0 everywhere, so a NULL recv_x
     * is an error on every rank at once */
    spec_t c = {.name = "args", .N = N, .E = 4 * N, .K = N < 2 ? 2 : N,
                .H = 128, .T = 8, .align = 1, .zero_rank = -1, .spread = 1,
                .seed = 0xa165u};
    world_t w;
    world_build(&w, &c, 1, me);
    CHECK(w.nrecv == N * c.T, "rank %d: args routing: %d rows", me, w.nrecv);
    args_route_on_ll(comm, &c, &w);
    ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
    if (!ep) {
        world_free(&w);
        return 1;
    }
    args_ll_on_ht(ep, &w, &c);
    args_route(ep, &w, &c);
    ferry_route_t rt = NULL;
    rc = route_make(ep, &w, 1, &rt, "args");
    CHECK(rc == FERRY_OK, "rank %d: good route_create after bad ones", me);
    if (rc == FERRY_OK && g_fwd) {
        /* forwarding: a combine on a route that had no dispatch is refused
         * on every rank, before anything moves */
        data_t dy0 = {2, K_FIN, 0};
        cres_t C = {NULL, NULL, 0, 0};
        int rc0 = ht_comb(ep, rt, &w, &c, &dy0, 0, &C);
        free(C.out);
        CHECK(rc0 == FERRY_ERR_STATE && strstr(ferry_ep_last_error(ep), "no ht_dispatch"),
              "rank %d: combine before any dispatch with forwarding: %s: %s", me,
              ferry_strerror(rc0), ferry_ep_last_error(ep));
    }
    if (rc == FERRY_OK) {
        args_dispatch(ep, rt, &w, &c);
        /* nothing above broke the context or the route */
        data_t dx = {1, K_BITS, 0}, dy = {2, K_FIN, 0};
        rc = do_disp(ep, rt, &w, &c, &dx, OPT_ALL, "args good dispatch");
        args_combine(ep, rt, &w, &c);
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, &c, &dy, OPT_ALL, "args good combine");
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, &c, &dy, OPT_ALL | OPT_BIAS, "args combine with bias");
        /* DeepEP 2's order: the biases first, then each rank's row at its
         * highest slot */
        data_t dyo = {3, K_ORD, 0};
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, &c, &dyo, OPT_ALL | OPT_SLOTS, "args combine, slot order");
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, &c, &dyo, OPT_ALL | OPT_SLOTS | OPT_BIAS,
                         "args combine with bias, slot order");
        /* structs of an older ferry.h (no stream) are still taken */
        if (rc == FERRY_OK)
            rc = do_disp(ep, rt, &w, &c, &dx, OPT_ALL | OPT_OLD, "args old-size dispatch");
        if (rc == FERRY_OK)
            rc = do_comb(ep, rt, &w, &c, &dy, OPT_ALL | OPT_OLD, "args old-size combine");
        if (rc == FERRY_OK) /* ... and without bias */
            rc = do_comb(ep, rt, &w, &c, &dy, OPT_ALL | OPT_OLD2, "args pre-bias combine");
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
    }
    world_free(&w);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    if (rc == FERRY_OK)
        args_fp8(comm, &c, me);
    return fr_test_result();
}

/* ---------------------------------------------------------------------- */
/* kill                                                                   */
/* ---------------------------------------------------------------------- */

static int g_kill_combine; /* killc: the victim dies after the dispatch */

/* A survivor's failure: round 3, in route_create or dispatch (the victim
 * died between them), PEER or TIMEOUT naming the victim, in time; the
 * context stays failed. */
static void kill_failure(ferry_ep_t ep, ferry_route_t rt, const world_t *w,
                         const spec_t *c, int round, const char *phase, int rc,
                         double dt, int victim)
{
    const char *tenv = getenv("FERRY_TIMEOUT_MS");
    long timeout = strtol(tenv ? tenv : "30000", NULL, 10);
    const char *msg = ferry_ep_last_error(ep);
    char want[32];
    snprintf(want, sizeof(want), "rank %d", victim);
    fprintf(stderr, "rank %d: round %d %s failed after %.0f ms: %s: %s\n",
            w->me, round, phase, dt, ferry_strerror(rc), msg);
    if (g_kill_combine) /* a rank that had all of its dispatch may pass it */
        CHECK(round == 3 && (strcmp(phase, "combine") == 0 ||
                             strcmp(phase, "dispatch") == 0),
              "failed in round %d %s; the victim dies before round 3's combine",
              round, phase);
    else /* with K < N (K is at most 16) a rank may send the victim tokens
          * without receiving any, and learn of its death in the combine */
        CHECK(round == 3 && (strcmp(phase, "dispatch") == 0 ||
                             strcmp(phase, "route_create") == 0 ||
                             (c->K < c->N && strcmp(phase, "combine") == 0)),
              "failed in round %d %s; the victim dies before round 3's dispatch",
              round, phase);
    CHECK(rc == FERRY_ERR_PEER || rc == FERRY_ERR_TIMEOUT, "status %d", rc);
    CHECK(names(msg, want), "message does not name %s", want);
    CHECK(dt <= (double)timeout + 2000.0, "took %.0f ms > timeout + 2 s", dt);
    /* the context stays failed, and every later call's message keeps the
     * cause (the dead rank), the prefix once */
    static const char prefix[] = "the EP context failed earlier and cannot be used: ";
    for (int again = 1; again <= 3; again++) {
        int rc2;
        if (rt) {
            data_t d = {7, K_BITS, 0};
            dres_t o;
            rc2 = ht_disp(ep, rt, w, c, &d, 0, &o);
            dres_free(&o);
        } else {
            ferry_route_t rt2 = NULL;
            rc2 = route_make(ep, w, 1, &rt2, "kill, again");
            if (rt2)
                ferry_route_destroy(rt2);
        }
        const char *m2 = ferry_ep_last_error(ep);
        const char *p1 = strstr(m2, prefix);
        CHECK(rc2 != FERRY_OK, "the context does not stay failed (call %d after)", again);
        CHECK(names(m2, want), "call %d after the failure: message '%s' does not name %s",
              again, m2, want);
        CHECK(p1 != NULL && strstr(p1 + 1, prefix) == NULL,
              "call %d after the failure: want the prefix once in '%s'", again, m2);
    }
}

static int run_kill(ferry_comm_t comm, int victim)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    /* every token to every rank: every survivor waits for the victim */
    spec_t c = {.name = "kill", .N = N, .E = 2 * N, .K = N < 2 ? 2 : N,
                .H = 128, .T = 32, .align = 1, .zero_rank = -1, .spread = 1,
                .seed = 0x4b111u};
    if (c.K > 16)
        c.K = 16;
    ferry_ep_t ep = ep_make(comm, &c, c.T, &rc);
    if (!ep)
        return 1;
    for (int round = 1; round <= 6; round++) {
        world_t w;
        world_build(&w, &c, (uint64_t)round, me);
        ferry_route_t rt = NULL;
        const char *phase = "route_create";
        double t0 = now_ms();
        rc = route_make(ep, &w, 1, &rt, "kill");
        if (rc == FERRY_OK) {
            if (round == 3 && me == victim && !g_kill_combine)
                raise(SIGKILL);
            data_t dx = {hkey(c.seed, (uint64_t)round, 1, 0), K_BITS, 0};
            data_t dy = {hkey(c.seed, (uint64_t)round, 2, 0), K_FIN, 0};
            dres_t D;
            phase = "dispatch";
            t0 = now_ms();
            rc = ht_disp(ep, rt, &w, &c, &dx, OPT_SRC, &D);
            if (rc == FERRY_OK) {
                CHECK(check_disp(&w, &c, &dx, &D, "kill") == 0,
                      "dispatch wrong");
                if (round == 3 && me == victim && g_kill_combine)
                    raise(SIGKILL);
                cres_t C = {NULL, NULL, 0, 0};
                phase = "combine";
                t0 = now_ms();
                rc = ht_comb(ep, rt, &w, &c, &dy, 0, &C);
                if (rc == FERRY_OK)
                    CHECK(check_comb(&w, &c, &dy, &C, "kill") == 0,
                          "combine wrong");
                free(C.out);
            }
            dres_free(&D);
        }
        if (rc != FERRY_OK) {
            kill_failure(ep, rt, &w, &c, round, phase, rc, now_ms() - t0,
                         victim);
            if (rt)
                ferry_route_destroy(rt);
            world_free(&w);
            ferry_ep_destroy(ep);
            ferry_comm_destroy(comm);
            verdict(me, fr_test_failures ? "bad" : "ok");
            return fr_test_result();
        }
        CHECK_RC(ferry_route_destroy(rt), FERRY_OK);
        world_free(&w);
    }
    fprintf(stderr, "rank %d: no error although rank %d died\n", me, victim);
    verdict(me, "no-error");
    return 1;
}

int main(int argc, char **argv)
{
    /* --device cuda (anywhere): taken out of argv */
    for (int i = 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], "--device") != 0)
            continue;
        if (strcmp(argv[i + 1], "cuda") != 0 && strcmp(argv[i + 1], "cpu") != 0) {
            fprintf(stderr, "test_ht: --device %s: use cpu or cuda\n", argv[i + 1]);
            return 2;
        }
        g_cuda = strcmp(argv[i + 1], "cuda") == 0;
        for (int j = i; j + 2 <= argc; j++)
            argv[j] = argv[j + 2];
        argc -= 2;
        break;
    }
    int n = 2;
    if (argc >= 3 && strcmp(argv[1], "-n") == 0)
        n = atoi(argv[2]);
    const char *mode = argc >= 4 ? argv[3] : "basic";
    int arg1 = argc >= 5 ? atoi(argv[4]) : -1;
    int arg2 = argc >= 6 ? atoi(argv[5]) : -1;
    /* kill R: rank R dies between route and dispatch; killc R: between
     * dispatch and combine */
    int is_kill = strcmp(mode, "kill") == 0 || strcmp(mode, "killc") == 0;
    g_kill_combine = strcmp(mode, "killc") == 0;
    if (strcmp(mode, "graph") == 0 && !g_cuda) {
        fprintf(stderr, "test_ht: graph runs with --device cuda\n");
        return 2;
    }
    if (strcmp(mode, "basic") && strcmp(mode, "chunk") &&
        strcmp(mode, "reuse") && strcmp(mode, "args") && strcmp(mode, "bounded") &&
        strcmp(mode, "graph") &&
        (!is_kill || arg1 < 0 || arg1 >= n)) {
        fprintf(stderr, "usage: test_ht -n N [--device cpu|cuda] basic|chunk [T] "
                        "[ring]|reuse|args|bounded|graph|kill R|killc R\n");
        return 2;
    }
    if (g_cuda) {
        char why[256];
        if (!dprobe(why, sizeof(why))) {
            printf("skipped: no usable GPU: %s\n", why);
            return 77;
        }
    }
    ferry_comm_t comm = NULL;
    int rc = 0;
    if (!fr_vd_start("ht", "test_ht", mode, n, is_kill ? arg1 : -1, &comm, &rc))
        return rc;
    int me = ferry_comm_rank(comm);
    if (g_cuda)
        dpick(me);
    if (is_kill)
        return run_kill(comm, arg1);
    if (strcmp(mode, "basic") == 0)
        rc = run_basic(comm);
    else if (strcmp(mode, "chunk") == 0)
        rc = run_chunk(comm, arg1 > 0 ? arg1 : 16384, arg2 > 0 ? arg2 : 8);
    else if (strcmp(mode, "reuse") == 0)
        rc = run_reuse(comm);
    else if (strcmp(mode, "bounded") == 0)
        rc = run_bounded(comm);
    else if (strcmp(mode, "graph") == 0)
        rc = run_graph(comm);
    else
        rc = run_args(comm);
    if (g_slot_calls)
        printf("rank %d: %ld combines in slot order, told from rank order on %ld tokens\n",
               me, g_slot_calls, g_order_told);
    ferry_comm_destroy(comm);
    verdict(me, rc ? "bad" : "ok");
    return rc;
}
