/*
 * ferry-bench --stats: the fabric path's counters (ferry_ep_get_stats)
 * over the timed rounds, every rank's summed into the row; and
 * --transport null: the proxy alone in this process, with simulated
 * peers (src/proxy/nullbench.c), whose results cannot be verified.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "proxy/proxy.h"

#define NSTAT 14

static int ep_stats(ferry_ep_t ep, ferry_ep_stats_t *st)
{
    memset(st, 0, sizeof(*st));
    st->size = sizeof(*st);
    return ep ? ferry_ep_get_stats(ep, st) : FERRY_OK;
}

/* The counters after the warm-up. Every rank finished its warm-up rounds
 * first (a barrier: each warm-up write has landed, so it was posted, and
 * counted: the proxy counts a write before posting it) and this rank's
 * writes have all completed, so none of the warm-up's writes counts in
 * the timed rounds (bounded: 200 ms). */
void stats_mark(bench_t *b)
{
    if (b->comm)
        ferry_comm_barrier(b->comm);
    for (int tries = 0; tries < 2000; tries++) {
        int busy = 0;
        for (int i = 0; i < 2; i++) {
            ferry_ep_stats_t s;
            ep_stats(b->eps[i] ? b->eps[i] : (i == 0 ? b->ep : NULL), &s);
            busy |= s.completions < s.writes;
        }
        if (!busy)
            break;
        usleep(100);
    }
    for (int i = 0; i < 2; i++)
        ep_stats(b->eps[i] ? b->eps[i] : (i == 0 ? b->ep : NULL), &b->st0[i]);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Collective: every rank's counters since stats_mark (doorbell quantiles:
 * since create, warm-up included), summed on every rank. */
int stats_gather(bench_t *b, pstats_t *ps)
{
    double mine[NSTAT] = {0};
    /* every rank finished the timed rounds: each of their writes landed,
     * so each was counted (the proxy counts a write before posting it) */
    if (b->comm && ferry_comm_barrier(b->comm) != FERRY_OK)
        return -1;
    for (int i = 0; i < 2; i++) {
        ferry_ep_t ep = b->eps[i] ? b->eps[i] : (i == 0 ? b->ep : NULL);
        ferry_ep_stats_t s, *z = &b->st0[i];
        if (!ep || ep_stats(ep, &s) != FERRY_OK)
            continue;
        mine[0] += (double)(s.writes - z->writes);
        mine[1] += (double)(s.eagain - z->eagain);
        mine[2] += (double)(s.post_ns - z->post_ns) / 1e3;
        mine[3] += (double)(s.provider_ns - z->provider_ns) / 1e3;
        mine[4] += (double)(s.poll_ns - z->poll_ns) / 1e3;
        mine[5] = fmax(mine[5], s.doorbell_to_post_p50_us);
        mine[6] = fmax(mine[6], s.doorbell_to_post_p99_us);
        mine[7] += (double)(s.completions - z->completions);
        mine[8] += (double)(s.arrivals - z->arrivals);
        mine[9] += (double)(s.batched - z->batched);
        mine[10] = fmax(mine[10], s.seen_to_post_p50_us);
        mine[11] = fmax(mine[11], s.seen_to_post_p99_us);
        mine[12] += (double)(s.doorbells - z->doorbells);
        mine[13] += (double)(s.doorbells_stamped - z->doorbells_stamped);
    }
    double *all = calloc((size_t)NSTAT * b->N, sizeof(double));
    double *p50 = calloc(2 * (size_t)b->N, sizeof(double)), *s50 = p50 + b->N;
    if (!all || !p50 ||
        ferry_comm_allgather(b->comm, mine, all, sizeof(mine)) != FERRY_OK) {
        free(all);
        free(p50);
        return -1;
    }
    memset(ps, 0, sizeof(*ps));
    for (int r = 0; r < b->N; r++) {
        const double *v = all + (size_t)r * NSTAT;
        ps->writes += v[0];
        ps->eagain += v[1];
        ps->post_us += v[2];
        ps->prov_us += v[3];
        ps->poll_us += v[4];
        p50[r] = v[5];
        ps->d2p99 = fmax(ps->d2p99, v[6]);
        ps->completions += v[7];
        ps->arrivals += v[8];
        ps->batched += v[9];
        s50[r] = v[10];
        ps->s2p99 = fmax(ps->s2p99, v[11]);
        ps->bells += v[12];
        ps->stamped += v[13];
    }
    qsort(p50, (size_t)b->N, sizeof(double), cmp_d);
    ps->d2p50 = p50[b->N / 2];
    qsort(s50, (size_t)b->N, sizeof(double), cmp_d);
    ps->s2p50 = s50[b->N / 2];
    free(all);
    free(p50);
    return 0;
}

static double per_write(const pstats_t *ps, double us)
{
    return ps->writes > 0 ? us / ps->writes : 0;
}

void stats_header(void)
{
    printf(" %10s %7s %9s %9s %9s %9s %9s %9s", "writes", "eagain", "proxy_us/w", "prov_us/w",
           "ferry_us/w", "poll_us/w", "d2p_p50", "d2p_p99");
}

void stats_cols(const pstats_t *ps)
{
    double ferry = ps->post_us > ps->prov_us ? ps->post_us - ps->prov_us : 0;
    printf(" %10.0f %7.0f %10.3f %9.3f %10.3f %9.3f %9.1f %9.1f", ps->writes, ps->eagain,
           per_write(ps, ps->post_us + ps->poll_us), per_write(ps, ps->prov_us),
           per_write(ps, ferry), per_write(ps, ps->poll_us), ps->d2p50, ps->d2p99);
}

void stats_json(FILE *f, const pstats_t *ps)
{
    double ferry = ps->post_us > ps->prov_us ? ps->post_us - ps->prov_us : 0;
    fprintf(f,
            ", \"writes\": %.0f, \"completions\": %.0f, \"arrivals\": %.0f, "
            "\"eagain\": %.0f, \"proxy_us_per_write\": %.4f, "
            "\"post_us_per_write\": %.4f, \"provider_us_per_write\": %.4f, "
            "\"ferry_post_us_per_write\": %.4f, \"poll_us_per_write\": %.4f, "
            "\"doorbell_to_post_us_p50\": %.3f, \"doorbell_to_post_us_p99\": %.3f, "
            "\"writes_batched\": %.0f, \"seen_to_post_us_p50\": %.3f, "
            "\"seen_to_post_us_p99\": %.3f, \"doorbells\": %.0f, \"doorbells_stamped\": %.0f",
            ps->writes, ps->completions, ps->arrivals, ps->eagain,
            per_write(ps, ps->post_us + ps->poll_us),
            per_write(ps, ps->post_us), per_write(ps, ps->prov_us), per_write(ps, ferry),
            per_write(ps, ps->poll_us), ps->d2p50, ps->d2p99, ps->batched, ps->s2p50,
            ps->s2p99, ps->bells, ps->stamped);
}

static void null_print(const opts_t *o, const fr_proxy_bench_t *nb, const pstats_t *ps,
                       double p50, double p99)
{
    if (!o->quiet)
        printf("# ferry-bench: the proxy alone, one process, %d simulated fabric peers on the "
               "null transport (writes complete at once, no bytes move: #wrong not checked), "
               "%s, %d rounds after %d warmup\n#%5s %8s %10s %10s",
               nb->peers,
               nb->gpu ? "a kernel ringing a doorbell per peer and phase in host-mapped memory "
                         "as a GPU rank does (this thread stamps when each rang)"
                       : "a request per peer and phase as a CPU rank makes them",
               nb->rounds, nb->warmup, "peers", "bytes", "round_p50", "round_p99");
    if (!o->quiet) {
        stats_header();
        printf(" %7s\n", "#wrong");
    }
    printf(" %5d %8llu %10.1f %10.1f", nb->peers, (unsigned long long)nb->bytes, p50, p99);
    stats_cols(ps);
    printf(" %7s\n", "n/a");
}

int run_null(const opts_t *o)
{
    fr_proxy_bench_t nb = {.peers = o->peers, .rounds = o->iters, .warmup = o->warmup,
                           .bytes = (uint64_t)o->tokens * (uint64_t)o->hidden,
                           .gpu = strcmp(o->device, "cuda") == 0};
    nb.round_us = calloc((size_t)o->iters, sizeof(double));
    if (!nb.round_us)
        return 1;
    int rc = fr_proxy_bench_null(&nb);
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: --transport null: %s (%s)\n", nb.err, ferry_strerror(rc));
        free(nb.round_us);
        return 1;
    }
    const ferry_ep_stats_t *s = &nb.st;
    pstats_t ps = {.writes = (double)s->writes, .eagain = (double)s->eagain,
                   .completions = (double)s->completions, .arrivals = (double)s->arrivals,
                   .post_us = s->post_ns / 1e3, .prov_us = s->provider_ns / 1e3,
                   .poll_us = s->poll_ns / 1e3, .d2p50 = s->doorbell_to_post_p50_us,
                   .d2p99 = s->doorbell_to_post_p99_us, .batched = (double)s->batched,
                   .s2p50 = s->seen_to_post_p50_us, .s2p99 = s->seen_to_post_p99_us,
                   .bells = (double)s->doorbells, .stamped = (double)s->doorbells_stamped};
    qsort(nb.round_us, (size_t)o->iters, sizeof(double), cmp_d);
    double p50 = nb.round_us[(o->iters - 1) / 2];
    double p99 = nb.round_us[(int)ceil(0.99 * o->iters) - 1];
    null_print(o, &nb, &ps, p50, p99);
    fprintf(stderr, "ferry-bench: null transport: nothing is moved or verified; the numbers are "
                    "the proxy's own cost (completions %llu, arrivals %llu)\n",
            (unsigned long long)s->completions, (unsigned long long)s->arrivals);
    if (o->json) {
        FILE *f = fopen(o->json, "w");
        if (!f) {
            fprintf(stderr, "ferry-bench: --json %s: cannot write\n", o->json);
            free(nb.round_us);
            return 1;
        }
        fprintf(f, "{\"transport\": \"null\", \"device\": \"%s\", \"peers\": %d, "
                   "\"bytes\": %llu, \"iters\": %d, "
                   "\"round_p50_us\": %.3f, \"round_p99_us\": %.3f, \"checked\": false, "
                   "\"wrong\": null",
                nb.gpu ? "cuda" : "cpu", nb.peers, (unsigned long long)nb.bytes, o->iters, p50,
                p99);
        stats_json(f, &ps);
        fprintf(f, "}\n");
        fclose(f);
    }
    free(nb.round_us);
    return 0;
}
