#include "workload.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/quant.h"

static uint64_t fw_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t fw_hash(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return fw_mix(fw_mix(fw_mix(fw_mix(a) ^ b) ^ c) ^ d);
}

/* Uniform double in [0, 1). */
static double fw_unit(uint64_t h) { return (double)(h >> 11) * (1.0 / 9007199254740992.0); }

typedef struct fw_rng {
    uint64_t s;
} fw_rng_t;

static uint64_t fw_next(fw_rng_t *r) { return fw_mix(r->s++); }

int fw_input_alloc(const fw_spec_t *s, fw_input_t *in)
{
    size_t T = (size_t)(s->T > 0 ? s->T : 1);
    in->T = 0;
    in->x = calloc(T * (size_t)s->H, sizeof(uint16_t));
    in->idx = calloc(T * (size_t)s->K, sizeof(int64_t));
    in->w = calloc(T * (size_t)s->K, sizeof(float));
    return (in->x && in->idx && in->w) ? 0 : -1;
}

void fw_input_free(fw_input_t *in)
{
    free(in->x);
    free(in->idx);
    free(in->w);
    memset(in, 0, sizeof(*in));
}

/* Whose inputs `rank` holds: its own, or its DP group's first rank's. */
static int fw_gen_rank(const fw_spec_t *s, int rank)
{
    return s->dp > 1 ? rank - rank % s->dp : rank;
}

void fw_share(const fw_spec_t *s, int T, int rank, int *lo, int *hi)
{
    int G = s->dp > 1 ? s->dp : 1, m = rank % G;
    *lo = (int)((long long)T * m / G);
    *hi = (int)((long long)T * (m + 1) / G);
}

int fw_num_tokens(const fw_spec_t *s, uint64_t round, int rank)
{
    if (s->masked && s->masked[rank])
        return 0;
    rank = fw_gen_rank(s, rank);
    if (!s->vary_tokens)
        return s->T;
    uint64_t h = fw_hash(s->seed, round, (uint64_t)rank, 0x7070);
    if (fw_unit(h) < s->empty_p)
        return 0;
    return (int)(fw_mix(h) % (uint64_t)(s->T + 1));
}

/* Zipf-skewed experts: expert popularity order is a per-round permutation;
 * P(i-th most popular) ~ 1/(i+1)^s. Sampling by inverse CDF. */
static int fw_pick(const fw_spec_t *s, const double *cdf, const int *perm,
                   fw_rng_t *rng)
{
    if (s->zipf_s <= 0)
        return (int)(fw_next(rng) % (uint64_t)s->E);
    double u = fw_unit(fw_next(rng));
    int lo = 0, hi = s->E - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (cdf[mid] < u)
            lo = mid + 1;
        else
            hi = mid;
    }
    return perm[lo];
}

/* Node-limited routing: gpick distinct groups of the `groups`, then K
 * distinct experts among the experts of those groups, uniformly. */
static void fw_groups_row(const fw_spec_t *s, fw_rng_t *rng, int64_t *row)
{
    int per = s->E / s->groups, G = s->gpick, grp[64];
    for (int g = 0; g < G && g < 64; g++) {
        int dup;
        do {
            grp[g] = (int)(fw_next(rng) % (uint64_t)s->groups);
            dup = 0;
            for (int j = 0; j < g; j++)
                dup |= grp[j] == grp[g];
        } while (dup);
    }
    int pool = (G < 64 ? G : 64) * per;
    for (int k = 0; k < s->K; k++) {
        int e, dup;
        do {
            int i = (int)(fw_next(rng) % (uint64_t)pool);
            e = grp[i / per] * per + i % per;
            dup = 0;
            for (int j = 0; j < k; j++)
                dup |= row[j] == e;
        } while (dup);
        row[k] = e;
    }
}

void fw_generate_idx(const fw_spec_t *s, uint64_t round, int rank, int T,
                     int64_t *idx)
{
    double *cdf = NULL;
    int *perm = NULL;
    if (s->zipf_s > 0) {
        cdf = malloc(sizeof(double) * (size_t)s->E);
        perm = malloc(sizeof(int) * (size_t)s->E);
        double tot = 0;
        for (int i = 0; i < s->E; i++) {
            tot += 1.0 / pow(i + 1.0, s->zipf_s);
            cdf[i] = tot;
            perm[i] = i;
        }
        for (int i = 0; i < s->E; i++)
            cdf[i] /= tot;
        fw_rng_t pr = {fw_hash(s->seed, round, 0xbeef, 0)}; /* same on all ranks */
        for (int i = s->E - 1; i > 0; i--) {
            int j = (int)(fw_next(&pr) % (uint64_t)(i + 1));
            int t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    fw_rng_t rng = {fw_hash(s->seed, round, (uint64_t)fw_gen_rank(s, rank), 0x1d1d)};
    for (int t = 0; t < T; t++) {
        int64_t *row = idx + (size_t)t * s->K;
        if (s->groups > 0) {
            fw_groups_row(s, &rng, row);
        } else
        for (int k = 0; k < s->K; k++) {
            int e, dup;
            int tries = 0;
            do {
                e = fw_pick(s, cdf, perm, &rng);
                dup = 0;
                for (int j = 0; j < k; j++)
                    dup |= row[j] == e;
                /* heavy skew: fall back to uniform after many collisions */
                if (++tries > 64 && dup)
                    e = (int)(fw_next(&rng) % (uint64_t)s->E);
            } while (dup && tries < 4096);
            row[k] = e;
        }
        for (int k = 0; k < s->K; k++)
            if (s->mask_p > 0 && fw_unit(fw_next(&rng)) < s->mask_p)
                row[k] = -1;
        for (int k = 0; s->masked && k < s->K; k++)
            if (row[k] >= 0 && s->masked[row[k] / (s->E / s->N)])
                row[k] = -1;
    }
    free(cdf);
    free(perm);
}

void fw_generate(const fw_spec_t *s, uint64_t round, int rank, fw_input_t *in)
{
    int T = fw_num_tokens(s, round, rank);
    in->T = T;
    fw_generate_idx(s, round, rank, T, in->idx);
    rank = fw_gen_rank(s, rank);
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < s->H; b += 128) {
            /* a different magnitude per 128-block exercises fp8 scales */
            uint64_t hb = fw_hash(s->seed ^ 0x55, round, (uint64_t)rank,
                                  (uint64_t)t * 1000003u + (uint64_t)b);
            double mag = ldexp(1.0, (int)(hb % 9) - 4);
            int end = b + 128 < s->H ? b + 128 : s->H;
            for (int h = b; h < end; h++) {
                uint64_t hv = fw_mix(hb + (uint64_t)h);
                double v = (fw_unit(hv) * 2.0 - 1.0) * mag;
                in->x[(size_t)t * s->H + h] = fr_f32_to_bf16((float)v);
            }
        }
        for (int k = 0; k < s->K; k++) {
            uint64_t hw = fw_hash(s->seed ^ 0x77, round, (uint64_t)rank,
                                  (uint64_t)t * 64u + (uint64_t)k);
            in->w[(size_t)t * s->K + k] = (float)(0.1 + 0.9 * fw_unit(hw));
        }
    }
}

/* Expert e: y = a_e * x + c_e, a different map for every expert. */
static void fw_expert_coef(int e, float *a, float *c)
{
    *a = 0.5f + (float)(e % 13) * 0.125f;
    *c = (float)((e * 7) % 11 - 5) * 0.0625f;
}

void fw_expert_row(const fw_spec_t *s, int e, const float *x, uint16_t *y)
{
    float a, c;
    fw_expert_coef(e, &a, &c);
    for (int h = 0; h < s->H; h++)
        y[h] = fr_f32_to_bf16(a * x[h] + c);
}

size_t fw_token_bytes(const fw_spec_t *s)
{
    return s->nvfp4 ? (size_t)s->H / 2 : s->fp8 ? (size_t)s->H : 2 * (size_t)s->H;
}

size_t fw_num_scales(const fw_spec_t *s)
{
    return s->nvfp4 ? (size_t)s->H / 64 : s->fp8 ? (size_t)s->H / 128 : 0;
}

/* e2m1 magnitudes by code (ferry.h, FERRY_DTYPE_NVFP4), for the
 * reference encoder below */
static const float fw_e2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

/* e4m3 values by code, from the library's own decoder (the same floats,
 * a table lookup in the reference's hottest loop) */
static float fw_e4m3_tab[256];
static pthread_once_t fw_e4m3_once = PTHREAD_ONCE_INIT;

static void fw_e4m3_fill(void)
{
    for (int c = 0; c < 256; c++)
        fw_e4m3_tab[c] = fr_e4m3_to_f32((uint8_t)c);
}

void fw_row_to_f32(const fw_spec_t *s, const void *row, const float *scales,
                   float *out)
{
    if (s->nvfp4) { /* code * scale / gs; scale bytes in the words */
        const uint8_t *q = row, *sb = (const uint8_t *)scales;
        for (int h = 0; h < s->H; h++)
            out[h] = fr_e2m1_to_f32((uint8_t)((q[h / 2] >> (h % 2 * 4)) & 15)) *
                     fr_e4m3_to_f32(sb[h / 16]) / s->gs;
    } else if (s->fp8) {
        const uint8_t *q = row;
        pthread_once(&fw_e4m3_once, fw_e4m3_fill);
        for (int h = 0; h < s->H; h++)
            out[h] = fw_e4m3_tab[q[h]] * scales[h / 128];
    } else {
        const uint16_t *b = row;
        for (int h = 0; h < s->H; h++)
            out[h] = fr_bf16_to_f32(b[h]);
    }
}

void fw_run_experts(const fw_spec_t *s, int rank, const void *expert_x,
                    const float *expert_scales, const int32_t *counts,
                    size_t cap, uint16_t *expert_y)
{
    int El = s->E / s->N;
    size_t tb = fw_token_bytes(s), ns = fw_num_scales(s);
    float *tmp = malloc(sizeof(float) * (size_t)s->H);
    for (int le = 0; le < El; le++) {
        /* a count past the capacity is reported by the check, never
         * followed past the buffers */
        size_t n = counts[le] < 0 ? 0 : (size_t)counts[le];
        n = n > cap ? cap : n;
        for (size_t i = 0; i < n; i++) {
            size_t row = (size_t)le * cap + i;
            fw_row_to_f32(s, (const uint8_t *)expert_x + row * tb,
                          expert_scales ? expert_scales + row * ns : NULL, tmp);
            fw_expert_row(s, rank * El + le, tmp, expert_y + row * (size_t)s->H);
        }
    }
    free(tmp);
}

/* e2m1 code of v: the nearest magnitude, a tie to the even code, the sign
 * kept; NaN 7 (ferry.h). Written apart from the library's thresholds. */
static uint8_t fw_e2m1_code(float v)
{
    uint8_t sign = signbit(v) ? 8 : 0;
    float a = fabsf(v);
    if (isnan(a))
        return (uint8_t)(sign | 7);
    int best = 0;
    for (int c = 1; c < 8; c++) {
        float d = fabsf(a - fw_e2m1[c]), db = fabsf(a - fw_e2m1[best]);
        if (d < db || (d == db && c % 2 == 0))
            best = c;
    }
    return (uint8_t)(sign | best);
}

/* Reference quantisation of one bf16 row (same formula as the library). */
static void fw_quant_row(const fw_spec_t *s, const uint16_t *x, uint8_t *q,
                         float *scales)
{
    if (s->nvfp4) {
        uint8_t *sb = (uint8_t *)scales;
        for (int b = 0; b < s->H / 16; b++) {
            float amax = 0;
            for (int i = 0; i < 16; i++) {
                float v = fabsf(fr_bf16_to_f32(x[b * 16 + i]));
                amax = isfinite(v) && v > amax ? v : amax;
            }
            sb[b] = fr_f32_to_e4m3(s->gs * (amax * (1.0f / 6.0f)));
            float sq = fr_e4m3_to_f32(sb[b]);
            float inv = sq != 0.f ? 1.0f / (sq * (1.0f / s->gs)) : 0.f;
            for (int i = 0; i < 16; i += 2)
                q[(b * 16 + i) / 2] = (uint8_t)(
                    fw_e2m1_code(fr_bf16_to_f32(x[b * 16 + i]) * inv) |
                    fw_e2m1_code(fr_bf16_to_f32(x[b * 16 + i + 1]) * inv) << 4);
        }
        return;
    }
    for (int b = 0; b < s->H / 128; b++) {
        float amax = 0;
        for (int i = 0; i < 128; i++) {
            float v = fabsf(fr_bf16_to_f32(x[b * 128 + i]));
            amax = isfinite(v) && v > amax ? v : amax; /* finite only */
        }
        float inv = fr_fp8_inv_scale_r(amax, s->round_scale);
        for (int i = 0; i < 128; i++)
            q[b * 128 + i] = fr_f32_to_e4m3(fr_bf16_to_f32(x[b * 128 + i]) * inv);
        scales[b] = fr_fp8_scale_r(amax, s->round_scale);
    }
}

long fw_check_dispatch(const fw_spec_t *s, uint64_t round, int rank,
                       const void *expert_x, const float *expert_scales,
                       const int32_t *counts, const int32_t *src_rank,
                       const int32_t *src_token, size_t cap, int verbose)
{
    int El = s->E / s->N, lo = rank * El;
    size_t tb = fw_token_bytes(s), ns = fw_num_scales(s);
    long wrong = 0;
    int32_t *fill = calloc((size_t)El, sizeof(int32_t));
    fw_input_t in;
    fw_input_alloc(s, &in);
    uint8_t *q = malloc(tb);
    float *sc = malloc(sizeof(float) * (ns + 1));
    /* rows of each expert: sources from this rank on, wrapping (rank,
     * rank + 1, ..., N - 1, 0, ..., rank - 1), each in token order */
    for (int i = 0; i < s->N; i++) {
        int src = (rank + i) % s->N;
        fw_generate(s, round, src, &in);
        int t0, t1;
        fw_share(s, in.T, src, &t0, &t1);
        for (int t = t0; t < t1; t++) {
            for (int k = 0; k < s->K; k++) {
                int64_t e = in.idx[(size_t)t * s->K + k];
                if (e < lo || e >= lo + El)
                    continue;
                int le = (int)(e - lo);
                int32_t slot = fill[le]++;
                if (slot >= counts[le]) {
                    wrong++;
                    continue;
                }
                size_t row = (size_t)le * cap + (size_t)slot;
                const uint16_t *xs = in.x + (size_t)t * s->H;
                int bad = 0;
                if (src_rank && src_rank[row] != src)
                    bad = 1;
                if (src_token && src_token[row] != t - t0) /* its index in the share */
                    bad = 2;
                const uint8_t *got = (const uint8_t *)expert_x + row * tb;
                if (!bad && (s->fp8 || s->nvfp4)) {
                    fw_quant_row(s, xs, q, sc);
                    if (memcmp(got, q, tb) != 0)
                        bad = 3;
                    else if (memcmp(expert_scales + row * ns, sc,
                                    ns * sizeof(float)) != 0)
                        bad = 4;
                } else if (!bad && memcmp(got, xs, tb) != 0) {
                    bad = 3;
                }
                if (bad) {
                    wrong++;
                    if (verbose-- > 0)
                        fprintf(stderr,
                                "rank %d round %llu: expert %d slot %d should "
                                "hold token %d of rank %d; %s differ "
                                "(got rank %d token %d)\n",
                                rank, (unsigned long long)round, le, slot, t,
                                src,
                                bad == 1 ? "source ranks"
                                : bad == 2 ? "source tokens"
                                : bad == 3 ? "bytes" : "scales",
                                src_rank ? src_rank[row] : -1,
                                src_token ? src_token[row] : -1);
                }
            }
        }
    }
    for (int le = 0; le < El; le++) {
        if (fill[le] != counts[le]) {
            long d = labs((long)fill[le] - (long)counts[le]);
            wrong += fill[le] < counts[le] ? d : 0;
            if (verbose-- > 0)
                fprintf(stderr,
                        "rank %d round %llu: expert %d received %d tokens, "
                        "expected %d\n",
                        rank, (unsigned long long)round, le, counts[le],
                        fill[le]);
        }
    }
    free(q);
    free(sc);
    free(fill);
    fw_input_free(&in);
    return wrong;
}

long fw_check_combine(const fw_spec_t *s, uint64_t round, int rank,
                      const fw_input_t *in, const uint16_t *out, int verbose)
{
    long wrong = 0;
    size_t tb = fw_token_bytes(s), ns = fw_num_scales(s);
    float *xf = malloc(sizeof(float) * (size_t)s->H);
    uint16_t *y = malloc(sizeof(uint16_t) * (size_t)s->H);
    double *ref = malloc(sizeof(double) * (size_t)s->H);
    double *mag = malloc(sizeof(double) * (size_t)s->H);
    uint8_t *q = malloc(tb);
    float *sc = malloc(sizeof(float) * (ns + 1));
    (void)round;
    for (int t = 0; t < in->T; t++) {
        const uint16_t *xs = in->x + (size_t)t * s->H;
        if (s->fp8 || s->nvfp4) {
            fw_quant_row(s, xs, q, sc);
            fw_row_to_f32(s, q, sc, xf);
        } else {
            fw_row_to_f32(s, xs, NULL, xf);
        }
        for (int h = 0; h < s->H; h++)
            ref[h] = mag[h] = 0;
        for (int k = 0; k < s->K; k++) {
            int64_t e = in->idx[(size_t)t * s->K + k];
            if (e < 0)
                continue;
            fw_expert_row(s, (int)e, xf, y);
            double w = in->w[(size_t)t * s->K + k];
            for (int h = 0; h < s->H; h++) {
                double term = w * fr_bf16_to_f32(y[h]);
                ref[h] += term;
                mag[h] += fabs(term);
            }
        }
        for (int h = 0; h < s->H; h++) {
            double got = fr_bf16_to_f32(out[(size_t)t * s->H + h]);
            double tol = fabs(ref[h]) * (1.0 / 256.0) + 1e-5 * mag[h] + 1e-30;
            if (!(fabs(got - ref[h]) <= tol)) {
                wrong++;
                if (verbose-- > 0)
                    fprintf(stderr,
                            "rank %d round %llu: combine token %d channel %d: "
                            "got %g, expected %g (tolerance %g)\n",
                            rank, (unsigned long long)round, t, h, got, ref[h],
                            tol);
                break;
            }
        }
    }
    free(xf);
    free(y);
    free(ref);
    free(mag);
    free(q);
    free(sc);
    return wrong;
}

void fw_scales_to_rows(int layout, const void *src, float *rows, size_t El, size_t cap,
                       size_t ns, const int32_t *counts)
{
    const float *cf = (const float *)src;
    const uint8_t *cb = (const uint8_t *)src;
    for (size_t e = 0; e < El; e++) {
        size_t n = counts[e] < 0 ? 0 : (size_t)counts[e];
        for (size_t p = 0; p < n && p < cap; p++)
            for (size_t q = 0; q < ns; q++) {
                float v;
                if (layout == FW_SCALES_NVFP4) { /* ferry.h's byte formula, word q */
                    size_t rm = (cap + 127) / 128;
                    memcpy(&v, cb + e * rm * ns * 512 + p / 128 * ns * 512 + q * 512 +
                                   p % 32 * 16 + p % 128 / 32 * 4, 4);
                } else if (layout == 1) {
                    v = cf[(e * ns + q) * cap + p];
                } else {
                    /* word (e, q / 4, p), byte q % 4: 2^(byte - 127) */
                    uint32_t byte = cb[4 * ((e * (ns / 4) + q / 4) * cap + p) + q % 4];
                    v = ldexpf(1.0f, (int)byte - 127);
                }
                rows[(e * cap + p) * ns + q] = v;
            }
    }
}
