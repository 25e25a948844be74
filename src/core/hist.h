/*
 * A fixed log-linear histogram of nanosecond durations: 8 buckets per
 * power of two (each within 12.5% of its neighbours), from 0 up to about
 * 4.3 s (larger values land in the last bucket). Adding is a shift, a
 * few compares and two stores, cheap enough to keep on always. One
 * writer; readers on other threads see each count whole (relaxed loads
 * and stores), a snapshot that may lag by a sample.
 */
#ifndef FR_HIST_H
#define FR_HIST_H

#include <stdint.h>

#define FR_HIST_SUB 8                     /* buckets per power of two */
#define FR_HIST_OCT 30                    /* powers of two: 2^3 .. 2^32 ns */
#define FR_HIST_N (FR_HIST_SUB * FR_HIST_OCT)

typedef struct fr_hist {
    uint64_t count;
    uint32_t n[FR_HIST_N];
} fr_hist_t;

/* Bucket of v ns: values below 8 ns share bucket 0, then 8 per octave. */
static inline int fr_hist_bucket(uint64_t v)
{
    if (v < 2 * FR_HIST_SUB)
        return (int)(v >> 1) < FR_HIST_SUB ? (int)(v >> 1) : FR_HIST_SUB - 1;
    int msb = 63 - __builtin_clzll(v);            /* >= 4 */
    int sub = (int)((v >> (msb - 3)) & (FR_HIST_SUB - 1));
    int b = (msb - 3) * FR_HIST_SUB + sub;
    return b < FR_HIST_N ? b : FR_HIST_N - 1;
}

/* The lower bound (ns) of bucket b. */
static inline uint64_t fr_hist_lower(int b)
{
    if (b < FR_HIST_SUB)
        return (uint64_t)b * 2;
    int oct = b / FR_HIST_SUB + 3, sub = b % FR_HIST_SUB;
    return ((uint64_t)(FR_HIST_SUB + sub)) << (oct - 3);
}

static inline void fr_hist_add(fr_hist_t *h, uint64_t v)
{
    int b = fr_hist_bucket(v);
    __atomic_store_n(&h->n[b], h->n[b] + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&h->count, h->count + 1, __ATOMIC_RELAXED);
}

/* dst += src (relaxed loads of src: its writer may still add; dst has one
 * writer, the caller). */
static inline void fr_hist_merge(fr_hist_t *dst, const fr_hist_t *src)
{
    for (int b = 0; b < FR_HIST_N; b++)
        __atomic_store_n(&dst->n[b], dst->n[b] + __atomic_load_n(&src->n[b], __ATOMIC_RELAXED),
                         __ATOMIC_RELAXED);
    __atomic_store_n(&dst->count, dst->count + __atomic_load_n(&src->count, __ATOMIC_RELAXED),
                     __ATOMIC_RELAXED);
}

/* The q-quantile (0..1) in ns: the middle of the bucket holding it (0
 * when empty). Reads with relaxed loads, so another thread may call it
 * while the writer adds. */
static inline double fr_hist_quantile(const fr_hist_t *h, double q)
{
    uint64_t total = 0;
    for (int b = 0; b < FR_HIST_N; b++)
        total += __atomic_load_n(&h->n[b], __ATOMIC_RELAXED);
    if (total == 0)
        return 0;
    uint64_t want = (uint64_t)(q * (double)(total - 1)) + 1, seen = 0;
    for (int b = 0; b < FR_HIST_N; b++) {
        seen += __atomic_load_n(&h->n[b], __ATOMIC_RELAXED);
        if (seen >= want) {
            uint64_t lo = fr_hist_lower(b);
            uint64_t hi = b + 1 < FR_HIST_N ? fr_hist_lower(b + 1) : lo;
            return 0.5 * (double)(lo + hi);
        }
    }
    return (double)fr_hist_lower(FR_HIST_N - 1);
}

#endif
