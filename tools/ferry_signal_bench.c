/*
 * ferry-signal-bench: put-with-signal throughput per ordering strategy,
 * side by side with plain puts, in one run.
 *
 * Every rank sends P logical peers M transfers each (default 12 x 8 = 96 in
 * flight per rank); logical peer p is rank (me + 1 + p % (N-1)) % N, with
 * its own destination tiles. A round: fill the tiles (untimed), barrier,
 * then timed: queue every put (each with ADD 1 on the sender's word at the
 * receiver, or none for `put`), wait until every incoming transfer is
 * covered (the words reach their counts; for `put`, the landed-put counts),
 * quiet. Then every incoming tile is compared with the round's pattern
 * (#wrong: bytes that differ). Throughput is all ranks' bytes over the
 * slowest rank's round time; `vs_put` is the median throughput over the
 * plain puts' median, measured in the same run.
 *
 * With --device cuda the puts are queued from a kernel (a warp per tile,
 * ferry_signal_device.cuh), the signal waits run in a kernel and the check
 * is a kernel; --fill-in-kernel makes the putting warp write its tile first
 * (the data path of a real producer kernel).
 */
#include <getopt.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "ferry_signal.h"
#include "launch.h"
#include "opt.h"
#include "signal_kernels.h"

#define TOOL "ferry-signal-bench"
#define MAX_ROUNDS 1000000000L     /* --iters, --warmup: their sum an int */
#define MAX_TILES (1L << 24)       /* --peers x --per-peer: transfers a round */
#define MAX_SIZE 1099511627776.0   /* --sizes: 2^40 bytes, the largest heap */

#ifndef FERRY_HAVE_CUDA
/* without CUDA the GPU side answers "unsupported" */
int fsb_cuda_prepare(const ferry_sig_device_t *d, int nxfer, const int *dst,
                     const uint64_t *src_off, const uint64_t *dst_off,
                     uint64_t len, int nin, const uint64_t *in_off,
                     const int *in_src, const int *in_t, fsb_cuda_t **out,
                     char *why, size_t whylen)
{
    (void)d; (void)nxfer; (void)dst; (void)src_off; (void)dst_off; (void)len;
    (void)nin; (void)in_off; (void)in_src; (void)in_t;
    *out = NULL;
    snprintf(why, whylen, "this build has no CUDA");
    return FERRY_ERR_UNSUPPORTED;
}
int fsb_cuda_fill(fsb_cuda_t *h, uint32_t r, char *w, size_t l) { (void)h; (void)r; (void)w; (void)l; return FERRY_ERR_UNSUPPORTED; }
int fsb_cuda_put(fsb_cuda_t *h, uint32_t r, int s, int f, const uint64_t *x, char *w, size_t l) { (void)h; (void)r; (void)s; (void)f; (void)x; (void)w; (void)l; return FERRY_ERR_UNSUPPORTED; }
int fsb_cuda_check(fsb_cuda_t *h, uint32_t r, uint64_t *x, char *w, size_t l) { (void)h; (void)r; (void)x; (void)w; (void)l; return FERRY_ERR_UNSUPPORTED; }
void fsb_cuda_free(fsb_cuda_t *h) { (void)h; }
#endif

typedef struct opts {
    int ranks, peers, per_peer, iters, warmup, check, cuda, fill_in_kernel;
    char sizes[256], modes[128];
} opts_t;

static void usage(void)
{
    fprintf(stderr,
            "usage: ferry-signal-bench [options]\n"
            "  -n, --ranks N          ranks to start (default 4; ignored under a launcher)\n"
            "  -P, --peers P          logical peers per rank (default 12)\n"
            "  -M, --per-peer M       transfers per peer per round (default 8)\n"
            "  -s, --sizes LIST       bytes per transfer, K/M suffixes (default 4K,16K,64K,256K,1M,4M)\n"
            "  -m, --modes LIST       put,fence,grouped,counted,nicfence (default: all but\n"
            "                         nicfence, which is added where the provider has FI_FENCE)\n"
            "  -i, --iters N          timed rounds per row (default 20)\n"
            "  -w, --warmup N         untimed rounds first (default 3)\n"
            "      --no-check         skip the byte check (#wrong prints -)\n"
            "      --device cpu|cuda  who queues the puts (default cpu)\n"
            "      --fill-in-kernel   cuda: the putting warp writes its tile first\n"
            "Environment: FI_PROVIDER (tcp, shm, ...), FERRY_TIMEOUT_MS, FERRY_FAULT_*.\n");
}

static int parse(int argc, char **argv, opts_t *o)
{
    static struct option lo[] = {
        {"ranks", 1, 0, 'n'}, {"peers", 1, 0, 'P'}, {"per-peer", 1, 0, 'M'},
        {"sizes", 1, 0, 's'}, {"modes", 1, 0, 'm'}, {"iters", 1, 0, 'i'},
        {"warmup", 1, 0, 'w'}, {"no-check", 0, 0, 'C'}, {"device", 1, 0, 'd'},
        {"fill-in-kernel", 0, 0, 'F'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    *o = (opts_t){.ranks = 4, .peers = 12, .per_peer = 8, .iters = 20,
                  .warmup = 3, .check = 1};
    snprintf(o->sizes, sizeof(o->sizes), "4K,16K,64K,256K,1M,4M");
    o->modes[0] = 0;
    int c, bad = 0;
    while ((c = getopt_long(argc, argv, "n:P:M:s:m:i:w:h", lo, NULL)) != -1) {
        /* whole numbers in range, else refused naming the option */
        switch (c) {
        case 'n': bad = fr_opt_int(TOOL, "ranks", optarg, 2, FR_LAUNCH_MAX, &o->ranks); break;
        case 'P': bad = fr_opt_int(TOOL, "peers", optarg, 1, MAX_TILES, &o->peers); break;
        case 'M': bad = fr_opt_int(TOOL, "per-peer", optarg, 1, MAX_TILES, &o->per_peer); break;
        case 's': snprintf(o->sizes, sizeof(o->sizes), "%s", optarg); break;
        case 'm': snprintf(o->modes, sizeof(o->modes), "%s", optarg); break;
        case 'i': bad = fr_opt_int(TOOL, "iters", optarg, 1, MAX_ROUNDS, &o->iters); break;
        case 'w': bad = fr_opt_int(TOOL, "warmup", optarg, 0, MAX_ROUNDS, &o->warmup); break;
        case 'C': o->check = 0; break;
        case 'd':
            if (strcmp(optarg, "cuda") == 0)
                o->cuda = 1;
            else if (strcmp(optarg, "cpu") != 0) {
                fprintf(stderr, "ferry-signal-bench: --device %s: use cpu or cuda\n", optarg);
                return -1;
            }
            break;
        case 'F': o->fill_in_kernel = 1; break;
        default: usage(); return -1;
        }
        if (bad)
            return -1;
    }
    if ((long)o->peers * o->per_peer > MAX_TILES) {
        fprintf(stderr, TOOL ": --peers %d x --per-peer %d: at most %ld transfers per round\n",
                o->peers, o->per_peer, MAX_TILES);
        return -1;
    }
    return 0;
}

static int parse_sizes(const char *s, uint64_t *v, int max)
{
    int n = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < max; t = strtok_r(NULL, ",", &save)) {
        char *end;
        double x = strtod(t, &end);
        if (*end == 'K' || *end == 'k') x *= 1024;
        else if (*end == 'M' || *end == 'm') x *= 1024 * 1024;
        else if (*end) return -1;
        if (end == t || !(x >= 1 && x <= MAX_SIZE) || (end[0] && end[1])) return -1;
        v[n++] = (uint64_t)x;
    }
    return n;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int in_launcher(void)
{
    return getenv("FERRY_RANK") || getenv("OMPI_COMM_WORLD_RANK") ||
           getenv("PMI_RANK") || getenv("SLURM_PROCID") ||
           (getenv("RANK") && getenv("WORLD_SIZE"));
}

typedef struct plan {
    int nx, nin;
    int *dst, *in_src, *in_t;
    uint64_t *src_off, *dst_off, *in_off;
    uint64_t *in_count; /* [N] transfers from each sender per round */
} plan_t;

/* Tiles: sources [0, P*M) then inbox [sender][j][m] for the j-th logical
 * peer of that sender that is this rank. */
static void make_plan(int N, int me, int P, int M, uint64_t len, plan_t *pl)
{
    int pin = (P + N - 2) / (N - 1); /* most logical peers one rank gets */
    pl->nx = P * M;
    pl->dst = calloc((size_t)pl->nx, sizeof(int));
    pl->src_off = calloc((size_t)pl->nx, sizeof(uint64_t));
    pl->dst_off = calloc((size_t)pl->nx, sizeof(uint64_t));
    pl->in_src = calloc((size_t)N * pin * M, sizeof(int));
    pl->in_t = calloc((size_t)N * pin * M, sizeof(int));
    pl->in_off = calloc((size_t)N * pin * M, sizeof(uint64_t));
    pl->in_count = calloc((size_t)N, sizeof(uint64_t));
    uint64_t inbox = (uint64_t)P * M * len;
    /* tile t = p*M + m, queued in order m-major (below) */
    for (int p = 0; p < P; p++) {
        int d = (me + 1 + p % (N - 1)) % N, j = p / (N - 1);
        for (int m = 0; m < M; m++) {
            int t = p * M + m;
            pl->dst[t] = d;
            pl->src_off[t] = (uint64_t)t * len;
            pl->dst_off[t] = inbox + (((uint64_t)me * pin + j) * M + m) * len;
        }
    }
    pl->nin = 0;
    for (int s = 0; s < N; s++) {
        if (s == me)
            continue;
        for (int p = 0; p < P; p++) {
            if ((s + 1 + p % (N - 1)) % N != me)
                continue;
            int j = p / (N - 1);
            for (int m = 0; m < M; m++) {
                pl->in_src[pl->nin] = s;
                pl->in_t[pl->nin] = p * M + m;
                pl->in_off[pl->nin] = inbox + (((uint64_t)s * pin + j) * M + m) * len;
                pl->nin++;
                pl->in_count[s]++;
            }
        }
    }
}

static void free_plan(plan_t *pl)
{
    free(pl->dst); free(pl->src_off); free(pl->dst_off); free(pl->in_src);
    free(pl->in_t); free(pl->in_off); free(pl->in_count);
}

static uint64_t heap_for(int N, int P, int M, uint64_t len)
{
    int pin = (P + N - 2) / (N - 1);
    return ((uint64_t)P * M + (uint64_t)N * pin * M) * len;
}

int main(int argc, char **argv)
{
    opts_t o;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse(argc, argv, &o) != 0)
        return 2;
    uint64_t sizes[32];
    int nsizes = parse_sizes(o.sizes, sizes, 32);
    if (nsizes <= 0) {
        fprintf(stderr, TOOL ": --sizes %s: a list like 4K,16K,1M, each 1..%.0f bytes\n",
                o.sizes, MAX_SIZE);
        return 2;
    }
    if (!in_launcher()) {
        int is_child = 0;
        fr_err_t err = {{0}};
        int rc = fr_launch_local(o.ranks, &is_child, &err);
        if (!is_child) {
            if (rc < 0)
                fprintf(stderr, "ferry-signal-bench: %s\n", err.msg);
            return rc == 0 ? 0 : 1;
        }
    }
    char ebuf[512];
    ferry_comm_t comm = NULL;
    int rc = ferry_comm_init_env(&comm, ebuf, sizeof(ebuf));
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-signal-bench: communicator: %s: %s\n", ferry_strerror(rc), ebuf);
        return 1;
    }
    int me = ferry_comm_rank(comm), N = ferry_comm_size(comm);
    if (N < 2) {
        fprintf(stderr, "ferry-signal-bench: needs at least 2 ranks\n");
        return 2;
    }
    /* modes: the list given, or all but nicfence (added if it opens) */
    int modes[8], nmodes = 0, try_nicfence = 0;
    {
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", o.modes[0] ? o.modes : "put,fence,grouped,counted");
        try_nicfence = !o.modes[0];
        char *save = NULL;
        for (char *t = strtok_r(buf, ",", &save); t && nmodes < 8; t = strtok_r(NULL, ",", &save)) {
            int m = strcmp(t, "put") == 0 ? 0
                    : strcmp(t, "fence") == 0 ? FERRY_SIG_MODE_FENCE
                    : strcmp(t, "grouped") == 0 ? FERRY_SIG_MODE_GROUPED
                    : strcmp(t, "counted") == 0 ? FERRY_SIG_MODE_COUNTED
                    : strcmp(t, "nicfence") == 0 ? FERRY_SIG_MODE_NICFENCE : -1;
            if (m < 0) {
                fprintf(stderr, "ferry-signal-bench: --modes: unknown mode %s\n", t);
                return 2;
            }
            modes[nmodes++] = m;
        }
        if (try_nicfence)
            modes[nmodes++] = FERRY_SIG_MODE_NICFENCE;
    }
    uint64_t maxlen = 0;
    for (int i = 0; i < nsizes; i++)
        maxlen = sizes[i] > maxlen ? sizes[i] : maxlen;
    /* results[mode][size]: median and p99 round time, GB/s, wrong */
    double med[8][32], p99[8][32];
    int have[8] = {0};
    int put_idx = -1;
    double *tl = calloc((size_t)o.iters, sizeof(double));
    double *all = calloc((size_t)N, sizeof(double));
    if (me == 0)
        printf("# ferry-signal-bench: %d ranks, %d peers x %d transfers = %d in "
               "flight per rank, device %s%s, %d rounds per row (+%d warm-up)\n",
               N, o.peers, o.per_peer, o.peers * o.per_peer, o.cuda ? "cuda" : "cpu",
               o.cuda && o.fill_in_kernel ? " (tiles written by the putting warp)" : "",
               o.iters, o.warmup);
    int failed = 0;
    for (int mi = 0; mi < nmodes && !failed; mi++) {
        int mode = modes[mi], signal = mode != 0;
        if (!signal)
            put_idx = mi;
        ferry_sig_config_t cfg = FERRY_SIG_CONFIG_INIT;
        cfg.heap_bytes = heap_for(N, o.peers, o.per_peer, maxlen);
        cfg.num_signals = (uint32_t)N;
        cfg.mode = signal ? (ferry_sig_mode_t)mode : FERRY_SIG_MODE_COUNTED;
        cfg.device = o.cuda ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
        ferry_sig_t sig = NULL;
        rc = ferry_sig_create(comm, &cfg, &sig);
        if (rc == FERRY_ERR_UNSUPPORTED && mode == FERRY_SIG_MODE_NICFENCE) {
            if (me == 0)
                printf("# nicfence: not run: %s\n", ferry_comm_last_error(comm));
            continue;
        }
        if (rc != FERRY_OK) {
            fprintf(stderr, "rank %d: create (%s): %s: %s\n", me,
                    signal ? ferry_sig_mode_name(mode) : "put", ferry_strerror(rc),
                    ferry_comm_last_error(comm));
            failed = 1;
            break;
        }
        have[mi] = 1;
        ferry_sig_device_t dev;
        if (o.cuda)
            ferry_sig_device(sig, &dev);
        uint8_t *heap = ferry_sig_heap(sig);
        uint64_t *cum = calloc((size_t)N, sizeof(uint64_t)); /* expected so far */
        uint64_t *want = calloc((size_t)N, sizeof(uint64_t));
        for (int si = 0; si < nsizes && !failed; si++) {
            uint64_t len = sizes[si];
            plan_t pl;
            make_plan(N, me, o.peers, o.per_peer, len, &pl);
            fsb_cuda_t *gh = NULL;
            char why[256] = "";
            if (o.cuda && (rc = fsb_cuda_prepare(&dev, pl.nx, pl.dst, pl.src_off, pl.dst_off,
                                                 len, pl.nin, pl.in_off, pl.in_src, pl.in_t,
                                                 &gh, why, sizeof(why))) != 0) {
                fprintf(stderr, "rank %d: %s\n", me, why);
                failed = 1;
                break;
            }
            uint64_t wrong = 0;
            int nt = 0;
            for (int it = 0; it < o.warmup + o.iters && !failed; it++) {
                uint32_t round = (uint32_t)(mi * 100000 + si * 1000 + it + 1);
                int fill_now = o.check || it == 0;
                if (fill_now && !(o.cuda && o.fill_in_kernel)) {
                    if (o.cuda) {
                        rc = fsb_cuda_fill(gh, round, why, sizeof(why));
                    } else {
                        for (int t = 0; t < pl.nx; t++) {
                            uint8_t *p = heap + pl.src_off[t];
                            for (uint64_t j = 0; j < len; j++)
                                p[j] = fsb_pat(me, t, round, j);
                        }
                    }
                }
                for (int s = 0; s < N; s++)
                    want[s] = cum[s] += pl.in_count[s];
                if (rc == FERRY_OK)
                    rc = ferry_comm_barrier(comm);
                double t0 = now_us();
                if (rc == FERRY_OK && o.cuda) {
                    rc = fsb_cuda_put(gh, round, signal, fill_now && o.fill_in_kernel,
                                      want, why, sizeof(why));
                } else if (rc == FERRY_OK) {
                    for (int m = 0; m < o.per_peer && rc == FERRY_OK; m++)
                        for (int p = 0; p < o.peers && rc == FERRY_OK; p++) {
                            int t = p * o.per_peer + m;
                            rc = ferry_sig_put(sig, pl.dst[t], pl.dst_off[t], pl.src_off[t],
                                               len, signal ? (uint32_t)me : FERRY_SIG_NONE,
                                               FERRY_SIG_ADD, 1);
                        }
                }
                if (rc == FERRY_OK && !o.cuda) {
                    /* done when every sender's word (plain puts: its landed
                     * count) reaches its count; the same loop for all */
                    uint64_t got = 0;
                    double tw = now_us();
                    for (int s = 0; s < N && rc == FERRY_OK; s++) {
                        for (;;) {
                            if (signal)
                                got = ferry_sig_read(sig, (uint32_t)s);
                            else
                                ferry_sig_landed(sig, s, &got);
                            if (got >= want[s] || pl.in_count[s] == 0)
                                break;
                            if ((rc = ferry_sig_check(sig)) != FERRY_OK)
                                break;
                            if (now_us() - tw > 60e6) {
                                rc = FERRY_ERR_TIMEOUT;
                                snprintf(why, sizeof(why), "rank %d's transfers "
                                         "not covered after 60 s", s);
                                break;
                            }
                            sched_yield();
                        }
                    }
                } else if (rc == FERRY_OK && !signal) {
                    /* cuda, plain puts: the landed counts, as above */
                    uint64_t got = 0;
                    for (int s = 0; s < N && rc == FERRY_OK; s++)
                        while (ferry_sig_landed(sig, s, &got) == FERRY_OK && got < want[s] &&
                               (rc = ferry_sig_check(sig)) == FERRY_OK)
                            sched_yield();
                }
                if (rc == FERRY_OK)
                    rc = ferry_sig_quiet(sig);
                double dt = now_us() - t0;
                if (rc != FERRY_OK) {
                    fprintf(stderr, "rank %d: %s, %llu bytes, round %d: %s: %s\n", me,
                            signal ? ferry_sig_mode_name(mode) : "put",
                            (unsigned long long)len, it, ferry_strerror(rc),
                            why[0] ? why : ferry_sig_last_error(sig));
                    failed = 1;
                    break;
                }
                if (o.check) {
                    uint64_t w = 0;
                    if (o.cuda) {
                        if (fsb_cuda_check(gh, round, &w, why, sizeof(why)) != 0) {
                            fprintf(stderr, "rank %d: check: %s\n", me, why);
                            failed = 1;
                        }
                    } else {
                        for (int i = 0; i < pl.nin; i++) {
                            const uint8_t *p = heap + pl.in_off[i];
                            for (uint64_t j = 0; j < len; j++)
                                w += p[j] != fsb_pat(pl.in_src[i], pl.in_t[i], round, j);
                        }
                    }
                    wrong += w;
                }
                /* the slowest rank's time counts */
                ferry_comm_allgather(comm, &dt, all, sizeof(double));
                double mx = 0;
                for (int r = 0; r < N; r++)
                    mx = all[r] > mx ? all[r] : mx;
                if (it >= o.warmup)
                    tl[nt++] = mx;
            }
            fsb_cuda_free(gh);
            free_plan(&pl);
            if (failed)
                break;
            uint64_t wall = 0;
            ferry_comm_allgather(comm, &wrong, all, sizeof(uint64_t));
            for (int r = 0; r < N; r++)
                wall += ((uint64_t *)all)[r];
            qsort(tl, (size_t)nt, sizeof(double), cmpd);
            med[mi][si] = tl[nt / 2];
            p99[mi][si] = tl[(int)(0.99 * (nt - 1) + 0.5)];
            if (me == 0) {
                double bytes = (double)N * o.peers * o.per_peer * (double)len;
                double ratio = put_idx >= 0 && have[put_idx] && put_idx != mi
                                   ? med[put_idx][si] / med[mi][si] : -1;
                char rs[32] = "-";
                if (ratio >= 0)
                    snprintf(rs, sizeof(rs), "%.0f%%", 100 * ratio);
                char ws[32] = "-";
                if (o.check)
                    snprintf(ws, sizeof(ws), "%llu", (unsigned long long)wall);
                printf("%-9s %9llu  p50 %10.1f us  p99 %10.1f us  %8.3f GB/s  vs_put %5s  #wrong %s\n",
                       signal ? ferry_sig_mode_name(mode) : "put", (unsigned long long)len,
                       med[mi][si], p99[mi][si], bytes / med[mi][si] / 1e3, rs, ws);
            }
            if (wall)
                failed = 1;
        }
        free(cum);
        free(want);
        int d = ferry_sig_destroy(sig);
        if (d != FERRY_OK && !failed) {
            fprintf(stderr, "rank %d: destroy: %s\n", me, ferry_strerror(d));
            failed = 1;
        }
    }
    if (me == 0 && put_idx >= 0 && !failed) {
        printf("# summary: median throughput as a fraction of plain puts (same run)\n");
        printf("# %9s", "size");
        for (int mi = 0; mi < nmodes; mi++)
            if (have[mi] && mi != put_idx)
                printf(" %9s", ferry_sig_mode_name(modes[mi]));
        printf("\n");
        for (int si = 0; si < nsizes; si++) {
            printf("# %9llu", (unsigned long long)sizes[si]);
            for (int mi = 0; mi < nmodes; mi++)
                if (have[mi] && mi != put_idx)
                    printf(" %8.0f%%", 100 * med[put_idx][si] / med[mi][si]);
            printf("\n");
        }
    }
    free(tl);
    free(all);
    ferry_comm_destroy(comm);
    return failed;
}
