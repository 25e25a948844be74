/*
 * Number formats shared by the CPU and CUDA kernels.
 *  bf16: raw uint16_t bits; float -> bf16 rounds to nearest even.
 *  fp8 e4m3 (OCP "fn" flavour): bias 7, max 448, no infinities, 0x7f/0xff
 *  are NaN (encoding gives 0x7f, as cvt.rn.satfinite does); encoding rounds to nearest even and saturates to +-448.
 * Block scaling (DeepSeek-V3): per 128 channels, scale = amax / 448 and
 * q = e4m3(x * (448 / amax)); an all-zero block gets scale 1.
 * Non-finite inputs saturate and stay local: amax is taken over the finite
 * channels only, so the rest of the block quantises exactly as without
 * them; +-Inf becomes +-448 (the block's largest finite magnitude once
 * scaled back), NaN stays NaN (code 0x7f).
 */
#ifndef FR_QUANT_H
#define FR_QUANT_H

#include <stdint.h>
#include <string.h>

#include "hd.h"

#define FR_FP8_BLOCK 128
#define FR_FP8_MAX 448.0f

FR_HD float fr_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

FR_HD uint16_t fr_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t nan = (uint32_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

FR_HD float fr_e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80) << 24;
    uint32_t e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 15 && m == 7) {
        uint32_t nan = 0x7fc00000u | sign;
        memcpy(&v, &nan, 4);
        return v;
    }
    if (e == 0) {
        v = (float)m * (1.0f / 512.0f);
    } else {
        uint32_t u = ((e - 7 + 127) << 23) | (m << 20);
        memcpy(&v, &u, 4);
    }
    return sign ? -v : v;
}

/* Branch-free so that loops over rows vectorise. */
FR_HD uint8_t fr_f32_to_e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t isnan_ = a > 0x7f800000u;
    /* normal range: round the mantissa to 3 bits (ties to even), rebias */
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    uint32_t nrm = (r >> 20) - ((127u - 7u) << 3);
    /* below 2^-6: multiples of 2^-9, rounded to nearest even integer by the
     * 1.5 * 2^23 trick (exact: |f| * 512 < 8) */
    float af;
    memcpy(&af, &a, 4);
    float m = (af * 512.0f + 12582912.0f) - 12582912.0f;
    uint32_t sub = (uint32_t)m;
    uint32_t v = a < 0x3c800000u ? sub : nrm;
    v = a >= 0x43e00000u ? 0x7eu : v; /* >= 448 and inf saturate */
    v = v > 0x7eu ? 0x7eu : v;
    /* NaN: 0x7f whatever its sign, as the hardware conversion gives it */
    return isnan_ ? (uint8_t)0x7fu : (uint8_t)(sign | v);
}

/* Scale and its inverse for a block whose largest magnitude is amax. */
FR_HD float fr_fp8_scale(float amax) { return amax > 0.f ? amax / FR_FP8_MAX : 1.f; }
FR_HD float fr_fp8_inv_scale(float amax) { return amax > 0.f ? FR_FP8_MAX / amax : 1.f; }

/* With round (DeepEP's round_scale): amax / 448 rounded up to a power of
 * two, at least 2^-126, so the scale is exactly its exponent byte (UE8M0)
 * and its inverse is exact. Bit operations: the same on CPU and GPU. */
FR_HD float fr_fp8_scale_r(float amax, int round)
{
    float s = fr_fp8_scale(amax);
    if (!round)
        return s;
    uint32_t u;
    memcpy(&u, &s, 4);
    u = u < 0x00800000u ? 0x00800000u : u;
    u = (u & 0x007fffffu) ? (u & 0x7f800000u) + 0x00800000u : u;
    memcpy(&s, &u, 4);
    return s;
}
FR_HD float fr_fp8_inv_scale_r(float amax, int round)
{
    return round ? 1.f / fr_fp8_scale_r(amax, 1) : fr_fp8_inv_scale(amax);
}


/* Magnitude bits of a bf16 value, 0 for Inf and NaN (they do not count
 * towards a block's amax). */
FR_HD uint16_t fr_bf16_finite_mag(uint16_t x)
{
    uint16_t v = (uint16_t)(x & 0x7fffu);
    return v < 0x7f80u ? v : (uint16_t)0;
}

/* Largest finite magnitude of n bf16 values (integer compare: bf16
 * magnitudes order like their bit patterns). */
FR_HD float fr_bf16_amax(const uint16_t *x, int n)
{
    uint16_t m = 0;
    for (int i = 0; i < n; i++) {
        uint16_t v = fr_bf16_finite_mag(x[i]);
        m = v > m ? v : m;
    }
    return fr_bf16_to_f32(m);
}

/* One 128-channel block: bf16 -> fp8 e4m3 codes and the block's scale
 * (round: rounded up to a power of two, fr_fp8_scale_r). */
FR_HD void fr_quant_block_r(const uint16_t *x, uint8_t *q, float *scale, int round)
{
    float amax = fr_bf16_amax(x, FR_FP8_BLOCK);
    float inv = fr_fp8_inv_scale_r(amax, round);
    for (int i = 0; i < FR_FP8_BLOCK; i++)
        q[i] = fr_f32_to_e4m3(fr_bf16_to_f32(x[i]) * inv);
    *scale = fr_fp8_scale_r(amax, round);
}
FR_HD void fr_quant_block(const uint16_t *x, uint8_t *q, float *scale)
{
    fr_quant_block_r(x, q, scale, 0);
}

/* NVFP4 (ferry.h, FERRY_DTYPE_NVFP4): e2m1 codes (bit 3 sign, then
 * 0, 0.5, 1, 1.5, 2, 3, 4, 6), 16 channels per e4m3 scale. */
#define FR_NVFP4_BLOCK 16

FR_HD float fr_e2m1_to_f32(uint8_t c)
{
    const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    float v = mag[c & 7];
    return (c & 8) ? -v : v;
}

/* Round to nearest, ties to the even code, saturating at 6; the sign is
 * kept (-0.1 gives code 8); NaN gives 7 with its sign. Below 2 the codes
 * step by 0.5, then by 1 up to 4, then by 2: |f| (NaN and past 8 taken as
 * 8) times 2^(1 - e), e the step's octave (0, 1 or 2), rounded to an
 * integer n (ties to even, the 1.5 * 2^23 trick: the product is exact)
 * gives code 2e + n, capped at 7. Integer and multiply-add work only, no
 * chain of compares (exhaustively equal to the compare form over every
 * float: tests/unit/test_quant.c). */
FR_HD uint8_t fr_f32_to_e2m1(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 28) & 8u);
    uint32_t au = u & 0x7fffffffu;
    float a;
    memcpy(&a, &au, 4);
    a = a < 8.0f ? a : 8.0f; /* NaN compares false: 8 */
    memcpy(&au, &a, 4);
    int e = (int)(au >> 23) - 127;
    e = e < 0 ? 0 : e > 2 ? 2 : e;
    uint32_t sb = (uint32_t)(128 - e) << 23; /* 2^(1 - e) */
    float sc, t;
    memcpy(&sc, &sb, 4);
    t = a * sc + 12582912.0f;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    int c = 2 * e + (int)(tb - 0x4b400000u);
    return (uint8_t)(sign | (c > 7 ? 7 : c));
}

/* One 16-channel block with encode scale gs (rgs: 1 / gs, rounded, as
 * fr_nvfp4_block computes it): 8 bytes of codes (channel 2i in the low
 * nibble of byte i) and the scale's e4m3 byte. */
FR_HD void fr_nvfp4_block_r(const uint16_t *x, float gs, float rgs, uint8_t *q, uint8_t *sf)
{
    float amax = fr_bf16_amax(x, FR_NVFP4_BLOCK);
    const float rcp6 = 1.0f / 6.0f;
    uint8_t s = fr_f32_to_e4m3(gs * (amax * rcp6));
    float sq = fr_e4m3_to_f32(s);
    float inv = sq != 0.f ? 1.0f / (sq * rgs) : 0.f;
    for (int i = 0; i < FR_NVFP4_BLOCK / 2; i++)
        q[i] = (uint8_t)(fr_f32_to_e2m1(fr_bf16_to_f32(x[2 * i]) * inv) |
                         fr_f32_to_e2m1(fr_bf16_to_f32(x[2 * i + 1]) * inv) << 4);
    *sf = s;
}

FR_HD void fr_nvfp4_block(const uint16_t *x, float gs, uint8_t *q, uint8_t *sf)
{
    fr_nvfp4_block_r(x, gs, 1.0f / gs, q, sf);
}

/* acc[i] += w * y[i] for a bf16 row. */
FR_HD void fr_axpy_bf16(float *acc, float w, const uint16_t *y, int n)
{
    for (int i = 0; i < n; i++)
        acc[i] += w * fr_bf16_to_f32(y[i]);
}

FR_HD void fr_row_to_bf16(const float *acc, uint16_t *out, int n)
{
    for (int i = 0; i < n; i++)
        out[i] = fr_f32_to_bf16(acc[i]);
}

#endif
