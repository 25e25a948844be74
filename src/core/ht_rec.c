/*
 * High-throughput mode: checking a dispatch record header read from a
 * ring its sender can still write (core/ht_rec.h).
 */
#include <string.h>

#include "core/ht_rec.h"

int64_t fr_ht_scales_span(int64_t T, int64_t S, int64_t s0, int64_t s1)
{
    int64_t a, b, span, bytes;
    if (__builtin_mul_overflow(T > 0 ? T - 1 : 0, s0, &a) ||
        __builtin_mul_overflow(S - 1, s1, &b) || __builtin_add_overflow(a, b, &span) ||
        __builtin_add_overflow(span, 1, &span) || __builtin_mul_overflow(span, 4, &bytes))
        return -1;
    return span;
}

int fr_ht_dhdr_check(const uint8_t *rec, int K, int T, int El, int fp8, uint64_t route_id,
                     int sender, fr_ht_dhdr_copy_t *hd, fr_err_t *err)
{
    /* one read per field (volatile: the compiler may not read the slot
     * again in place of the copy) */
    const volatile int32_t *vh = (const volatile int32_t *)rec;
    const volatile int16_t *vle = (const volatile int16_t *)(rec + sizeof(fr_ht_dhdr_t));
    const volatile float *vw = (const volatile float *)(rec + fr_ht_woff(K));
    if (K < 1 || K > FR_HT_MAX_K)
        return FR_ERR(err, FERRY_ERR_INTERNAL, "ht record of %d slots (1..%d)", K,
                      FR_HT_MAX_K);
    memset(hd, 0, sizeof(*hd));
    hd->token = vh[0];
    hd->flags = vh[1];
    int bad = hd->token < 0 || hd->token >= T;
    for (int k = 0; k < K; k++) {
        hd->le[k] = vle[k];
        hd->w[k] = vw[k];
        bad |= hd->le[k] < -1 || hd->le[k] >= El;
    }
    if (bad)
        return FR_ERR(err, FERRY_ERR_PROTOCOL, "malformed record from rank %d (token %d)",
                      sender, hd->token);
    if ((hd->flags & 1) != (fp8 ? 1 : 0))
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "rank %d sends %s rows, this rank expects %s (every rank passes "
                      "x_scales, or none does)", sender, hd->flags & 1 ? "fp8" : "bf16",
                      fp8 ? "fp8" : "bf16");
    if (((uint32_t)hd->flags >> 8 & 0xffu) != (uint32_t)(route_id & 0xffu))
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "rank %d dispatches on route %u, this rank on route %u (every rank "
                      "must use the same routes in the same order)", sender,
                      (unsigned)((uint32_t)hd->flags >> 8 & 0xffu),
                      (unsigned)(route_id & 0xffu));
    return FERRY_OK;
}
