/*
 * High-throughput mode: the dispatch record header, shared by the CPU
 * engine (engines/cpu_ht/) and the CUDA engine (engines/cuda_ht/) so the
 * two cannot drift.
 *
 *   dispatch record = fr_ht_dhdr_t { token, flags }
 *                     int16 le[K]        the token's local expert per slot
 *                                        on the destination (-1: not there)
 *                     float w[K]         at fr_ht_woff(K); 0 where le = -1
 *                     (padded to 16 B: fr_ht_dhdr_bytes(K))
 *                     row (H B fp8 | 2H B bf16), then H/128 fp32 scales
 */
#ifndef FR_HT_REC_H
#define FR_HT_REC_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "hd.h"

/* A record's header on the dispatch ring: the source token, the local
 * expert of each slot (-1: not here), the weights of those slots. */
typedef struct fr_ht_dhdr {
    int32_t token;
    int32_t flags;           /* bit 0: fp8 data with scales; bits 8-15: the
                                route's number (low 8 bits), so ranks calling
                                on different routes fail instead of mixing */
    /* int16 le[K], then float w[K] at fr_ht_woff(K) */
} fr_ht_dhdr_t;

/* Where a dispatch record's weights start (4-byte aligned for odd K). */
FR_HD size_t fr_ht_woff(int K)
{
    return 8 + ((2 * (size_t)K + 3) & ~(size_t)3);
}

/* Bytes of a dispatch record's header, padded so the row is 16-byte
 * aligned. */
FR_HD size_t fr_ht_dhdr_bytes(int K)
{
    return (fr_ht_woff(K) + 4 * (size_t)K + 15) & ~(size_t)15;
}

/* flags of a record: dtype bit and the route's number (low 8 bits) */
FR_HD int32_t fr_ht_flags(int fp8, uint64_t route_id)
{
    return (int32_t)((fp8 ? 1u : 0u) | (uint32_t)((route_id & 0xffu) << 8));
}

/* A dispatch record's header as this rank read it. Its sender can still
 * write the ring slot: fr_ht_dhdr_check reads every field once (volatile)
 * into this copy, checks the copy, and the caller uses only the copy (the
 * row and scales are copied out of the slot once, by the caller). */
#define FR_HT_MAX_K 16 /* top-k of a context, at most (FR_MAX_TOPK) */
typedef struct fr_ht_dhdr_copy {
    int32_t token, flags;
    int16_t le[FR_HT_MAX_K];
    float w[FR_HT_MAX_K];
} fr_ht_dhdr_copy_t;

#ifdef __cplusplus
extern "C" {
#endif
/* Floats that T tokens' S fp8 scales span in x_scales under strides
 * {s0, s1} (scale q of token t at t * s0 + q * s1, both >= 1): (T - 1) s0
 * + (S - 1) s1 + 1, with T - 1 taken as 0 when T is 0; -1 when the span
 * in bytes would not fit an int64. The API checks it, the staged engine
 * copies that much. */
int64_t fr_ht_scales_span(int64_t T, int64_t S, int64_t s0, int64_t s1);

/* Record decoding, shared by the CPU engine and the fuzzer (ht_rec.c):
 * the header of a record from rank `sender` (K slots; tokens below T,
 * local expert ids below El or -1, the dtype bit fp8, the route's number)
 * into *hd. FERRY_OK, or FERRY_ERR_PROTOCOL with a message naming the
 * sender. */
int fr_ht_dhdr_check(const uint8_t *rec, int K, int T, int El, int fp8, uint64_t route_id,
                     int sender, fr_ht_dhdr_copy_t *hd, fr_err_t *err);
#ifdef __cplusplus
}
#endif

#endif
