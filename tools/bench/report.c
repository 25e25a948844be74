/*
 * ferry-bench's results: every rank's timings gathered to every rank, and
 * rank 0 prints the row (header first unless --quiet) and writes the JSON.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

/* The result row. */
typedef struct summary {
    double dp50, dp99, cp50, cp99; /* ferry dispatch, combine (us) */
    double bd50, bc50;             /* baseline dispatch, combine (us) */
    double bytes;                  /* sent to other ranks, per rank and round */
    double gbs, speed;
    double fab_d, fab_c, fab_rows; /* --mode ht: per call, the largest rank's mean */
    double rp50;                   /* --mode ht: the route's part of the dispatch (us) */
    long wrong; /* all ranks */
} summary_t;

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

/* The row from all ranks' rows (`per` doubles each, the last one the
 * rank's wrong count): a round takes as long as its slowest rank. */
static void summarize(const bench_t *b, const double *all, size_t per, summary_t *r)
{
    const opts_t *o = b->o;
    int N = b->N;
    double *col[5]; /* dispatch, combine, base dispatch, base combine, route */
    static const int src[5] = {0, 1, 2, 3, 8};
    for (int c = 0; c < 5; c++)
        col[c] = calloc((size_t)o->iters, sizeof(double));
    double bytes = 0;
    long twrong = 0;
    for (int rk = 0; rk < N; rk++)
        twrong += (long)all[(size_t)rk * per + per - 1];
    for (int i = 0; i < o->iters; i++) {
        for (int c = 0; c < 5; c++) {
            double m = 0;
            for (int rk = 0; rk < N; rk++) {
                double v = all[(size_t)rk * per + (size_t)i * BENCH_COLS + src[c]];
                m = v > m ? v : m;
            }
            col[c][i] = m;
        }
        for (int rk = 0; rk < N; rk++)
            bytes += all[(size_t)rk * per + (size_t)i * BENCH_COLS + 4];
    }
    bytes /= (double)o->iters * N;
    r->fab_d = r->fab_c = r->fab_rows = 0;
    for (int rk = 0; rk < N; rk++) {
        double f[3] = {0, 0, 0};
        for (int i = 0; i < o->iters; i++)
            for (int c = 0; c < 3; c++)
                f[c] += all[(size_t)rk * per + (size_t)i * BENCH_COLS + 5 + c] / o->iters;
        r->fab_d = f[0] > r->fab_d ? f[0] : r->fab_d;
        r->fab_c = f[1] > r->fab_c ? f[1] : r->fab_c;
        r->fab_rows = f[2] > r->fab_rows ? f[2] : r->fab_rows;
    }
    r->dp50 = pct(col[0], o->iters, 0.5);
    r->dp99 = pct(col[0], o->iters, 0.99);
    r->cp50 = pct(col[1], o->iters, 0.5);
    r->cp99 = pct(col[1], o->iters, 0.99);
    r->rp50 = pct(col[4], o->iters, 0.5);
    r->bd50 = b->have_base ? pct(col[2], o->iters, 0.5) : NAN;
    r->bc50 = b->have_base ? pct(col[3], o->iters, 0.5) : NAN;
    r->bytes = bytes;
    r->gbs = bytes / ((r->dp50 + r->cp50) * 1e-6) / 1e9;
    r->speed = b->have_base ? (r->bd50 + r->bc50) / (r->dp50 + r->cp50) : NAN;
    r->wrong = twrong;
    for (int c = 0; c < 5; c++)
        free(col[c]);
}

static const char *dtype_name(const opts_t *o)
{
    return o->fp8 == 3 ? "nvfp4" : o->fp8 == 2 ? "mixed" : o->fp8 ? "fp8" : "bf16";
}

/* The header (unless --quiet) and the row, on stdout. */
static void print_table(const bench_t *b, const summary_t *r, const pstats_t *ps)
{
    const opts_t *o = b->o;
    const char *tr = getenv("FERRY_TRANSPORT");
    int head = !o->quiet && o->sweep_i == 0; /* a sweep's rows share one header */
    if (head) {
        bench_meta_t m;
        bench_meta(b, &m);
        printf("# ferry %s%s%s%s, host %s%s%s, %s\n", m.version, m.commit[0] ? " (" : "",
               m.commit, m.commit[0] ? ")" : "", m.host, m.gpu[0] ? ", GPU " : "", m.gpu,
               m.date);
    }
    if (head)
        printf("# ferry-bench: %d ranks (%s), device %s, transport %s%s%s, "
               "routing %s, %d iters after %d warmup, seed %llu%s\n"
               "#%5s %5s %3s %6s %6s %5s %10s %10s %10s %10s %9s %8s %10s %10s %8s %7s\n",
               b->N, b->have_base ? "mpirun" : "launcher", o->device,
               tr ? tr : "auto", getenv("FI_PROVIDER") ? " FI_PROVIDER=" : "",
               getenv("FI_PROVIDER") ? getenv("FI_PROVIDER") : "", o->routing,
               o->iters, o->warmup, (unsigned long long)o->seed,
               b->cfg.device == FERRY_DEVICE_CUDA && !o->check
                   ? (o->graph ? ", GPU rounds replayed back to back from CUDA graphs of 20 "
                                 "rounds with no event inside: disp and comb columns both "
                                 "= round time / 2, no check"
                               : ", GPU rounds back to back, CUDA-event times, no check")
                   : "",
               "ranks", "E",
               "K", "H", "T", "dtype", "disp_p50", "disp_p99", "comb_p50",
               "comb_p99", "MB/rank", "GB/s", "base_disp", "base_comb",
               "speedup", "#wrong");
    if (head && o->dp > 1)
        printf("# --dp %d: MB/rank (and fab_MB) count what a member sends, its share of the "
               "group's tokens: 1/%d of the bytes of every member dispatching them all\n",
               o->dp, o->dp);
    if (head && o->ht)
        printf("#%-4s %12s %12s %12s   (--mode ht: per call, the largest rank's mean: MB "
               "written to fabric peers in dispatch and combine, rows its routing sends "
               "over the fabric%s)\n", "", "fab_MB_disp", "fab_MB_comb", "fab_rows",
               b->fwd ? ", once per node: forwarding" : ", once per rank: no forwarding");
    if (head && ps) {
        printf("#%-4s", "");
        stats_header();
        printf("   (--stats: fabric path, timed rounds, all ranks)\n");
    }
    char wbuf[32];
    if (o->check)
        snprintf(wbuf, sizeof(wbuf), "%ld", r->wrong);
    else
        snprintf(wbuf, sizeof(wbuf), "n/a");
    printf(" %5d %5d %3d %6d %6d %5s %10.1f %10.1f %10.1f %10.1f %9.2f %8.2f %10.1f %10.1f %8.2f %7s\n",
           b->N, o->experts, o->topk, o->hidden, o->tokens, dtype_name(o),
           r->dp50, r->dp99, r->cp50, r->cp99, r->bytes / 1e6, r->gbs, r->bd50, r->bc50,
           r->speed, wbuf);
    if (o->ht)
        printf(" %-4s %12.3f %12.3f %12.1f\n", "", r->fab_d / 1e6, r->fab_c / 1e6, r->fab_rows);
    if (ps) {
        printf(" %-4s", "");
        stats_cols(ps);
        printf("\n");
    }
}

#ifndef FERRY_GIT_COMMIT
#define FERRY_GIT_COMMIT ""
#endif

/* What ran, where and when: the library's version, the commit the
 * benchmark was built at, the host, rank 0's GPU, the time (UTC). */
void bench_meta(const bench_t *b, bench_meta_t *m)
{
    memset(m, 0, sizeof(*m));
    snprintf(m->version, sizeof(m->version), "%s", ferry_version_string());
    snprintf(m->commit, sizeof(m->commit), "%s", FERRY_GIT_COMMIT);
    gethostname(m->host, sizeof(m->host) - 1);
    if (strcmp(b->o->device, "cuda") == 0)
        dev_name(m->gpu, sizeof(m->gpu));
    time_t now = time(NULL);
    strftime(m->date, sizeof(m->date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
}

/* --json FILE: the row as one JSON object (a sweep: one per line, JSON
 * Lines); 1 if the file cannot be written. */
static int write_json(const bench_t *b, const summary_t *r, const pstats_t *ps)
{
    const opts_t *o = b->o;
    const char *tr = getenv("FERRY_TRANSPORT");
    FILE *f = fopen(o->json, o->sweep_i == 0 ? "w" : "a");
    if (!f) {
        fprintf(stderr, "ferry-bench: --json %s: %s\n", o->json, strerror(errno));
        return 1;
    }
    bench_meta_t m;
    bench_meta(b, &m);
    fprintf(f, "{\"ferry_version\": \"%s\", \"commit\": \"%s\", \"host\": \"%s\", "
            "\"gpu\": \"%s\", \"date\": \"%s\", ", m.version, m.commit, m.host, m.gpu,
            m.date);
    fprintf(f,
            "\"ranks\": %d, \"experts\": %d, \"topk\": %d, \"hidden\": %d, "
            "\"tokens\": %d, \"dtype\": \"%s\", \"routing\": \"%s\", "
            "\"transport\": \"%s\", \"device\": \"%s\", \"iters\": %d, "
            "\"dispatch_p50_us\": %.3f, \"dispatch_p99_us\": %.3f, "
            "\"combine_p50_us\": %.3f, \"combine_p99_us\": %.3f, "
            "\"bytes_per_rank\": %.0f, \"gbps\": %.4f, "
            "\"baseline_dispatch_p50_us\": %.3f, \"baseline_combine_p50_us\": %.3f, "
            "\"speedup\": %.4f, \"wrong\": %ld, \"checked\": %s, \"nodes\": %d",
            b->N, o->experts, o->topk, o->hidden, o->tokens, dtype_name(o),
            o->routing, tr ? tr : "auto", o->device, o->iters, r->dp50, r->dp99, r->cp50,
            r->cp99, r->bytes, r->gbs, b->have_base ? r->bd50 : -1.0,
            b->have_base ? r->bc50 : -1.0, b->have_base ? r->speed : -1.0, r->wrong,
            o->check ? "true" : "false", b->nnodes);
    if (o->ht)
        fprintf(f, ", \"forward\": %s, \"fabric_bytes_dispatch\": %.0f, "
                "\"fabric_bytes_combine\": %.0f, \"fabric_rows\": %.1f, "
                "\"route_p50_us\": %.3f",
                b->fwd ? "true" : "false", r->fab_d, r->fab_c, r->fab_rows, r->rp50);
    if (ps)
        stats_json(f, ps);
    fprintf(f, "}\n");
    fclose(f);
    return 0;
}

/* --csv FILE: the row as CSV (the first row of a run writes the header
 * line); 1 if the file cannot be written. */
static int write_csv(const bench_t *b, const summary_t *r)
{
    const opts_t *o = b->o;
    const char *tr = getenv("FERRY_TRANSPORT");
    FILE *f = fopen(o->csv, o->sweep_i == 0 ? "w" : "a");
    if (!f) {
        fprintf(stderr, "ferry-bench: --csv %s: %s\n", o->csv, strerror(errno));
        return 1;
    }
    bench_meta_t m;
    bench_meta(b, &m);
    if (o->sweep_i == 0)
        fprintf(f, "ferry_version,commit,host,gpu,date,ranks,experts,topk,hidden,tokens,dtype,"
                   "routing,transport,device,mode,iters,dispatch_p50_us,dispatch_p99_us,"
                   "combine_p50_us,combine_p99_us,bytes_per_rank,gbps,"
                   "baseline_dispatch_p50_us,baseline_combine_p50_us,speedup,wrong,"
                   "fabric_bytes_dispatch,fabric_bytes_combine\n");
    fprintf(f, "%s,%s,%s,\"%s\",%s,%d,%d,%d,%d,%d,%s,%s,%s,%s,%s,%d,%.3f,%.3f,%.3f,%.3f,%.0f,"
               "%.4f,%.3f,%.3f,%.4f,%ld,%.0f,%.0f\n",
            m.version, m.commit, m.host, m.gpu, m.date, b->N, o->experts, o->topk, o->hidden,
            o->tokens, dtype_name(o), o->routing, tr ? tr : "auto", o->device, o->ht ? "ht" : "ll",
            o->iters, r->dp50, r->dp99, r->cp50, r->cp99, r->bytes, r->gbs,
            b->have_base ? r->bd50 : -1.0, b->have_base ? r->bc50 : -1.0,
            b->have_base ? r->speed : -1.0, r->wrong, o->ht ? r->fab_d : 0.0,
            o->ht ? r->fab_c : 0.0);
    fclose(f);
    return 0;
}

int report(bench_t *b)
{
    const opts_t *o = b->o;
    /* Gather every rank's timings; a round takes as long as its slowest
     * rank. */
    size_t per = (size_t)o->iters * BENCH_COLS + 1;
    double *mine = calloc(per, sizeof(double));
    double *all = calloc(per * (size_t)b->N, sizeof(double));
    memcpy(mine, b->tm, sizeof(double) * (size_t)o->iters * BENCH_COLS);
    mine[per - 1] = (double)b->wrong;
    int status = 0;
    pstats_t ps;
    if (o->stats && stats_gather(b, &ps) != 0) {
        fprintf(stderr, "ferry-bench: rank %d: gathering the counters failed\n", b->me);
        status = 1;
    }
    const pstats_t *psp = o->stats && status == 0 ? &ps : NULL;
    if (status != 0) {
        /* said above */
    } else if (ferry_comm_allgather(b->comm, mine, all, per * sizeof(double)) != FERRY_OK) {
        fprintf(stderr, "ferry-bench: rank %d: gathering results: %s\n", b->me,
                ferry_comm_last_error(b->comm));
        status = 1;
    } else if (b->me == 0) {
        summary_t r;
        summarize(b, all, per, &r);
        print_table(b, &r, psp);
        if (o->json && write_json(b, &r, psp) != 0)
            status = 1;
        if (o->csv && write_csv(b, &r) != 0)
            status = 1;
        if (r.wrong > 0) {
            fprintf(stderr, "ferry-bench: %ld wrong results\n", r.wrong);
            status = 1;
        }
    }
    free(mine);
    free(all);
    return status;
}
