/*
 * Deterministic workloads and their verification, shared by ferry-bench and
 * the tests. Every rank can regenerate every rank's inputs for any round
 * from the seed, so each receiver checks exactly what it got:
 *  - which tokens reached each local expert, in which order (low-latency
 *    mode: sources from the receiver on, wrapping, then token order), byte
 *    for byte (fp8: the bytes and scales the reference quantiser gives);
 *  - combine against an fp64 reference of sum_k w * f_e(x), where f_e is a
 *    different affine map per expert and the weights do not sum to 1.
 * Routing changes every round (uniform or Zipf-skewed), slots may be
 * masked (-1), and token counts may vary per rank and round, 0 included.
 */
#ifndef FW_WORKLOAD_H
#define FW_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

typedef struct fw_spec {
    int N, E, K, H, T;
    int fp8;
    int round_scale; /* fp8 scales rounded up to powers of two */
    int nvfp4;       /* NVFP4 dispatch (fp8 0) with encode scale gs, the
                        same on every rank */
    float gs;
    double zipf_s;   /* 0: uniform routing; > 0: Zipf exponent */
    int groups, gpick; /* > 0: experts in `groups` groups, each token picks
                          `gpick` of them at random and its K experts
                          among theirs (node-limited, as DeepSeek-V3) */
    double mask_p;   /* probability a (token, k) slot is -1 */
    int vary_tokens; /* token count per (rank, round) random in 0..T */
    double empty_p;  /* with vary_tokens: probability of zero tokens */
    uint64_t seed;
    /* [N] or NULL: ranks masked (ferry_ep_mask_rank) as the receiver sees
     * them: they send no tokens, and slots whose expert lives on one are
     * -1 (the routing is generated as without the mask, then cut) */
    const int32_t *masked;
    /* DP groups (config.dp_size; 0 or 1: none): the members of a group
     * (consecutive ranks) hold the same inputs, those of its first rank,
     * and each sends its share, fw_share */
    int dp;
} fw_spec_t;

/* Everything one rank passes in one round (owned buffers). */
typedef struct fw_input {
    int T;
    uint16_t *x;     /* [T][H] bf16 */
    int64_t *idx;    /* [T][K] */
    float *w;        /* [T][K] */
} fw_input_t;

int fw_input_alloc(const fw_spec_t *s, fw_input_t *in);
void fw_input_free(fw_input_t *in);

int fw_num_tokens(const fw_spec_t *s, uint64_t round, int rank);
/* The tokens [lo, hi) of its inputs (T of them) that `rank` sends: all of
 * them, or with DP groups its share, tokens [m T / G, (m + 1) T / G) for
 * member m of G (ferry.h, dp_size). */
void fw_share(const fw_spec_t *s, int T, int rank, int *lo, int *hi);
/* Fill in for (round, rank); in->T is set. */
void fw_generate(const fw_spec_t *s, uint64_t round, int rank, fw_input_t *in);
/* Routing only (cheap), for counting. */
void fw_generate_idx(const fw_spec_t *s, uint64_t round, int rank, int T,
                     int64_t *idx);

/* The expert transform of global expert e applied to one row. */
void fw_expert_row(const fw_spec_t *s, int e, const float *x, uint16_t *y);

/* Dequantised row as the expert sees it (bf16 or fp8 * scale). */
void fw_row_to_f32(const fw_spec_t *s, const void *row, const float *scales,
                   float *out);

/* Run every local expert of `rank` on its received rows. */
void fw_run_experts(const fw_spec_t *s, int rank, const void *expert_x,
                    const float *expert_scales, const int32_t *counts,
                    size_t cap, uint16_t *expert_y);

/* Check one rank's dispatch output; returns the number of wrong rows
 * (counts that differ count as one wrong row per missing/extra token).
 * Prints up to `verbose` diagnostics to stderr. */
long fw_check_dispatch(const fw_spec_t *s, uint64_t round, int rank,
                       const void *expert_x, const float *expert_scales,
                       const int32_t *counts, const int32_t *src_rank,
                       const int32_t *src_token, size_t cap, int verbose);

/* Check one rank's combine output against the fp64 reference; returns the
 * number of wrong tokens. Tolerance: |out - ref| <= 2^-8 |ref| (one bf16
 * rounding) + 1e-5 * sum_k |w_k y_k| (fp32 accumulation). */
long fw_check_combine(const fw_spec_t *s, uint64_t round, int rank,
                      const fw_input_t *in, const uint16_t *out, int verbose);

/* expert_x_scales written in layout `layout` (ferry_scales_layout_t: 1
 * columns, float [El][ns][cap]; 2 UE8M0, int32 [El][ns/4][cap] of exponent
 * bytes; FW_SCALES_NVFP4, the 128 x 4 swizzle of 4-byte words) copied into
 * rows (float [El][cap][ns]), the first counts[e] rows of each expert, so
 * the row checks read them. */
void fw_scales_to_rows(int layout, const void *src, float *rows, size_t El, size_t cap,
                       size_t ns, const int32_t *counts);

/* Bytes of one dispatched row / scales (what ferry moves per record). */
size_t fw_token_bytes(const fw_spec_t *s);
/* Scale words per row: fp8 one float per 128 channels, NVFP4 one word of
 * four e4m3 bytes per 64 channels. */
size_t fw_num_scales(const fw_spec_t *s);

/* The expert_x_scales layout of an NVFP4 dispatch for fw_scales_to_rows
 * (ferry.h, FERRY_DTYPE_NVFP4). */
#define FW_SCALES_NVFP4 16

#endif
