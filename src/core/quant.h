/*
 * Number formats shared by the CPU and CUDA kernels.
 *  bf16: raw uint16_t bits; float -> bf16 rounds to nearest even.
 *  fp8 e4m3 (OCP "fn" flavour): bias 7, max 448, no infinities, 0x7f/0xff
 *  are NaN; encoding rounds to nearest even and saturates to +-448.
 * Block scaling (DeepSeek-V3): per 128 channels, scale = amax / 448 and
 * q = e4m3(x * (448 / amax)); an all-zero block gets scale 1.
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
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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

FR_HD uint8_t fr_f32_to_e4m3(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return (uint8_t)(sign | 0x7f); /* NaN */
    if (u >= 0x43e00000u)
        return (uint8_t)(sign | 0x7e); /* >= 448 (and inf): saturate */
    if (u < 0x3c800000u) {             /* below 2^-6: subnormal, step 2^-9 */
        float a;
        memcpy(&a, &u, 4);
        a *= 512.0f; /* exact */
        uint32_t m = (uint32_t)a;
        float frac = a - (float)m;
        if (frac > 0.5f || (frac == 0.5f && (m & 1)))
            m++;
        return (uint8_t)(sign | m); /* m == 8 is 2^-6, the first normal */
    }
    uint32_t r = (((u >> 23) - 127 + 7) << 23) | (u & 0x7fffffu);
    r += 0x7ffffu + ((r >> 20) & 1u);
    r >>= 20;
    if (r > 0x7e)
        r = 0x7e;
    return (uint8_t)(sign | r);
}

/* Scale and its inverse for a block whose largest magnitude is amax. */
FR_HD float fr_fp8_scale(float amax) { return amax > 0.f ? amax / FR_FP8_MAX : 1.f; }
FR_HD float fr_fp8_inv_scale(float amax) { return amax > 0.f ? FR_FP8_MAX / amax : 1.f; }

#endif
