/*
 * The fabric driver's counters (stats.h): the transports' share, the
 * public view (ferry_ep_get_stats) and the FERRY_PROXY_STATS line.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "ep/ep.h"
#include "ep/stats.h"

static uint64_t ld(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

void fr_ep_stats_tp(ferry_ep_t ep)
{
    fr_ep_stats_tp_nics(ep, &ep->st, 0, ep->nics.n);
}

void fr_ep_stats_tp_nics(ferry_ep_t ep, fr_ep_stats_t *st, int k0, int k1)
{
    fr_tp_stats_t sum = {0};
    if (!ep->nics.ops || !ep->nics.ops->stats)
        return;
    for (int k = k0; k < k1 && k < ep->nics.n; k++) {
        fr_tp_stats_t s = {0};
        if (!ep->nics.tp[k])
            continue;
        ep->nics.ops->stats(ep->nics.tp[k], &s);
        sum.prov_ns += s.prov_ns;
        sum.retry_ns += s.retry_ns;
        sum.prov_calls += s.prov_calls;
        sum.eagain += s.eagain;
        sum.more += s.more;
    }
    __atomic_store_n(&st->tp.prov_ns, sum.prov_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&st->tp.retry_ns, sum.retry_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&st->tp.prov_calls, sum.prov_calls, __ATOMIC_RELAXED);
    __atomic_store_n(&st->tp.eagain, sum.eagain, __ATOMIC_RELAXED);
    __atomic_store_n(&st->tp.more, sum.more, __ATOMIC_RELAXED);
}

void fr_ep_stats_add(fr_ep_stats_t *dst, const fr_ep_stats_t *src)
{
    uint64_t *d[] = {&dst->writes, &dst->bytes, &dst->requests, &dst->post_ns, &dst->tx,
                     &dst->rx, &dst->polls, &dst->poll_ns, &dst->tp.prov_ns,
                     &dst->tp.retry_ns, &dst->tp.prov_calls, &dst->tp.eagain,
                     &dst->tp.more, &dst->stamped};
    const uint64_t *v[] = {&src->writes, &src->bytes, &src->requests, &src->post_ns, &src->tx,
                           &src->rx, &src->polls, &src->poll_ns, &src->tp.prov_ns,
                           &src->tp.retry_ns, &src->tp.prov_calls, &src->tp.eagain,
                           &src->tp.more, &src->stamped};
    for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++)
        fr_stat_add(d[i], ld(v[i]));
    fr_hist_merge(&dst->d2p, &src->d2p);
    fr_hist_merge(&dst->s2p, &src->s2p);
}

/* The public struct's fields after size, in order: a caller's size that
 * ends inside one leaves that one alone, as those past it (ferry.h). */
#define FR_ST_FIELD(f) {offsetof(ferry_ep_stats_t, f), sizeof(((ferry_ep_stats_t *)0)->f)}
static const struct {
    size_t off, len;
} fr_st_fields[] = {
    FR_ST_FIELD(writes),       FR_ST_FIELD(requests),
    FR_ST_FIELD(completions),  FR_ST_FIELD(arrivals),
    FR_ST_FIELD(eagain),       FR_ST_FIELD(post_ns),
    FR_ST_FIELD(provider_ns),  FR_ST_FIELD(provider_calls),
    FR_ST_FIELD(polls),        FR_ST_FIELD(poll_ns),
    FR_ST_FIELD(retry_ns),     FR_ST_FIELD(doorbells),
    FR_ST_FIELD(doorbell_to_post_p50_us), FR_ST_FIELD(doorbell_to_post_p99_us),
    FR_ST_FIELD(bytes),        FR_ST_FIELD(batched),
    FR_ST_FIELD(seen_to_post_p50_us), FR_ST_FIELD(seen_to_post_p99_us),
    FR_ST_FIELD(doorbells_stamped),
};
#define FR_ST_N (sizeof(fr_st_fields) / sizeof(fr_st_fields[0]))
/* every field listed (each 8 bytes): a new one must be added above */
_Static_assert(sizeof(size_t) + FR_ST_N * 8 == sizeof(ferry_ep_stats_t),
               "ferry_ep_stats_t changed: list its fields in fr_st_fields");

void fr_ep_stats_get(ferry_ep_t ep, ferry_ep_stats_t *out)
{
    /* ep->st, and the counters of proxy threads past the first while they
     * run (merged into ep->st when they stop) */
    const fr_proxy_t *p = &ep->proxy;
    fr_ep_stats_t sum;
    memset(&sum, 0, sizeof(sum));
    for (int j = 0; j < (p->running && p->th ? p->nth : 1); j++)
        fr_ep_stats_add(&sum, j == 0 ? &ep->st : &p->th[j].mine);
    ferry_ep_stats_t s;
    memset(&s, 0, sizeof(s));
    s.size = out->size;
    s.writes = sum.writes;
    s.bytes = sum.bytes;
    s.requests = sum.requests;
    s.completions = sum.tx;
    s.arrivals = sum.rx;
    s.eagain = sum.tp.eagain;
    s.post_ns = sum.post_ns;
    s.provider_ns = sum.tp.prov_ns;
    s.provider_calls = sum.tp.prov_calls;
    s.batched = sum.tp.more;
    s.seen_to_post_p50_us = fr_hist_quantile(&sum.s2p, 0.50) / 1e3;
    s.seen_to_post_p99_us = fr_hist_quantile(&sum.s2p, 0.99) / 1e3;
    s.retry_ns = sum.tp.retry_ns;
    s.polls = sum.polls;
    s.poll_ns = sum.poll_ns;
    s.doorbells = sum.d2p.count;
    s.doorbells_stamped = sum.stamped;
    s.doorbell_to_post_p50_us = fr_hist_quantile(&sum.d2p, 0.50) / 1e3;
    s.doorbell_to_post_p99_us = fr_hist_quantile(&sum.d2p, 0.99) / 1e3;
    for (size_t i = 0; i < FR_ST_N; i++)
        if (fr_st_fields[i].off + fr_st_fields[i].len <= out->size)
            memcpy((char *)out + fr_st_fields[i].off, (const char *)&s + fr_st_fields[i].off,
                   fr_st_fields[i].len);
}

void fr_ep_stats_print(ferry_ep_t ep)
{
    ferry_ep_stats_t s = {.size = sizeof(s)};
    fr_ep_stats_get(ep, &s);
    if (s.writes == 0 && s.arrivals == 0)
        return;
    double w = s.writes ? (double)s.writes : 1;
    double ferry_ns = s.post_ns > s.provider_ns ? (double)(s.post_ns - s.provider_ns) : 0;
    fprintf(stderr,
            "ferry proxy stats rank %d: %llu writes, %llu completions, %llu arrivals, "
            "%llu -FI_EAGAIN; per write: %.2f us posting (%.2f in the provider, %.2f "
            "ferry), %.2f us polling (%.2f retrying posts); doorbell -> posted p50 %.1f us, p99 %.1f us "
            "(%llu doorbells)\n",
            ep->rank, (unsigned long long)s.writes, (unsigned long long)s.completions,
            (unsigned long long)s.arrivals, (unsigned long long)s.eagain,
            s.post_ns / w / 1e3, s.provider_ns / w / 1e3, ferry_ns / w / 1e3,
            s.poll_ns / w / 1e3, s.retry_ns / w / 1e3, s.doorbell_to_post_p50_us, s.doorbell_to_post_p99_us,
            (unsigned long long)s.doorbells);
}
