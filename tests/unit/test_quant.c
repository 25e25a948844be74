/* bf16 and fp8 e4m3 encoding against brute-force references. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/quant.h"
#include "harness.h"

/* Reference: the finite e4m3 value nearest to f, ties to the even code
 * (even mantissa), saturating at +-448; NaN -> NaN. */
static uint8_t ref_e4m3(float f)
{
    if (isnan(f))
        return 0x7f;
    double a = fabs((double)f);
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (a >= 448.0)
        return sign | 0x7e;
    int best = 0;
    double bd = INFINITY;
    for (int c = 0; c <= 0x7e; c++) {
        double v = fr_e4m3_to_f32((uint8_t)c);
        double d = fabs(v - a);
        if (d < bd || (d == bd && (c & 1) == 0 && (best & 1))) {
            bd = d;
            best = c;
        }
    }
    return (uint8_t)(sign | best);
}

static uint16_t ref_bf16(float f)
{
    /* nearest bf16 by comparing the two neighbours in double */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    double dl = fabs((double)f - flo), dh = fabs((double)fhi - f);
    if (dl < dh || (dl == dh && ((lo >> 16) & 1) == 0))
        return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

int main(void)
{
    /* decode: known codes */
    CHECK(fr_e4m3_to_f32(0x38) == 1.0f, "0x38 -> %g", fr_e4m3_to_f32(0x38));
    CHECK(fr_e4m3_to_f32(0x7e) == 448.0f, "0x7e -> %g", fr_e4m3_to_f32(0x7e));
    CHECK(fr_e4m3_to_f32(0x01) == 1.0f / 512, "0x01 -> %g", fr_e4m3_to_f32(0x01));
    CHECK(fr_e4m3_to_f32(0x08) == 1.0f / 64, "0x08 -> %g", fr_e4m3_to_f32(0x08));
    CHECK(fr_e4m3_to_f32(0xb8) == -1.0f, "0xb8 -> %g", fr_e4m3_to_f32(0xb8));
    CHECK(isnan(fr_e4m3_to_f32(0x7f)), "0x7f is NaN");
    /* every code round-trips */
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f)
            continue;
        float v = fr_e4m3_to_f32((uint8_t)c);
        uint8_t back = fr_f32_to_e4m3(v);
        CHECK(back == c || (v == 0 && (back & 0x7f) == 0), "code 0x%02x -> %g -> 0x%02x", c, v, back);
    }
    /* midpoints between neighbours: ties go to the even code */
    for (int c = 0; c < 0x7e; c++) {
        float a = fr_e4m3_to_f32((uint8_t)c), b = fr_e4m3_to_f32((uint8_t)(c + 1));
        float mid = (a + b) / 2;
        CHECK(fr_f32_to_e4m3(mid) == ref_e4m3(mid), "midpoint %g: got 0x%02x want 0x%02x",
              mid, fr_f32_to_e4m3(mid), ref_e4m3(mid));
        CHECK(fr_f32_to_e4m3(-mid) == ref_e4m3(-mid), "midpoint %g", -mid);
    }
    /* random values over the whole range, saturation, specials */
    uint64_t x = 12345;
    for (int i = 0; i < 200000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        float f = (float)ldexp((double)(x >> 11) / 9007199254740992.0 * 2 - 1,
                               (int)((x >> 3) % 24) - 14);
        CHECK(fr_f32_to_e4m3(f) == ref_e4m3(f), "%.9g: got 0x%02x want 0x%02x", f,
              fr_f32_to_e4m3(f), ref_e4m3(f));
        if (fr_test_failures > 10)
            break;
    }
    CHECK(fr_f32_to_e4m3(1e9f) == 0x7e, "saturate +");
    CHECK(fr_f32_to_e4m3(-1e9f) == 0xfe, "saturate -");
    CHECK(fr_f32_to_e4m3(INFINITY) == 0x7e, "inf saturates");
    CHECK(fr_f32_to_e4m3(NAN) == 0x7f && fr_f32_to_e4m3(-NAN) == 0x7f, "nan is 0x7f");
    CHECK(fr_f32_to_e4m3(1e-6f) == 0, "underflow to 0");
    /* block scale formula: scale = amax/448; the block's max maps to 448 */
    float amax = 3.5f;
    CHECK(fr_fp8_scale(amax) == amax / 448.0f, "scale");
    CHECK(fr_f32_to_e4m3(amax * fr_fp8_inv_scale(amax)) == 0x7e, "amax -> 448");
    CHECK(fr_fp8_scale(0) == 1.0f, "zero block scale 1");
    /* Non-finite channels stay local: the block quantises as if they were
     * not there; +-Inf saturates to +-448, NaN stays NaN. */
    {
        uint16_t blk[FR_FP8_BLOCK], clean[FR_FP8_BLOCK];
        uint8_t q[FR_FP8_BLOCK], qc[FR_FP8_BLOCK];
        float sc, scc;
        for (int i = 0; i < FR_FP8_BLOCK; i++)
            clean[i] = blk[i] = fr_f32_to_bf16((i % 7 - 3) * 1e-3f);
        clean[9] = blk[9] = fr_f32_to_bf16(0.5f);
        blk[3] = 0x7f80;   /* +Inf */
        blk[40] = 0xff80;  /* -Inf */
        blk[77] = 0x7fc0;  /* NaN */
        clean[3] = clean[40] = clean[77] = 0;
        fr_quant_block(blk, q, &sc);
        fr_quant_block(clean, qc, &scc);
        CHECK(sc == scc && sc == 0.5f / 448.0f, "scale over finite channels: %g", sc);
        CHECK(q[3] == 0x7e && q[40] == 0xfe, "+-Inf saturate: 0x%02x 0x%02x", q[3], q[40]);
        CHECK((q[77] & 0x7f) == 0x7f, "NaN stays NaN: 0x%02x", q[77]);
        int same = 1;
        for (int i = 0; i < FR_FP8_BLOCK; i++)
            if (i != 3 && i != 40 && i != 77 && q[i] != qc[i])
                same = 0;
        CHECK(same, "finite channels quantise as without the non-finite ones");
        float back = fr_e4m3_to_f32(q[2]) * sc, want = fr_bf16_to_f32(blk[2]);
        CHECK(fabsf(back - want) <= fabsf(want) * 0.07f, "1e-3 channel kept: %g vs %g",
              back, want);
        for (int i = 0; i < FR_FP8_BLOCK; i++)
            blk[i] = (uint16_t)(i & 1 ? 0x7f80 : 0x7fc1); /* nothing finite */
        fr_quant_block(blk, q, &sc);
        CHECK(sc == 1.0f && q[1] == 0x7e && (q[0] & 0x7f) == 0x7f, "all non-finite");
    }
    /* bf16 */
    x = 99;
    for (int i = 0; i < 200000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t u = (uint32_t)(x >> 32);
        float f;
        memcpy(&f, &u, 4);
        if (isnan(f) || isinf(f))
            continue;
        if (fabsf(f) > 3.3e38f)
            continue;
        uint16_t got = fr_f32_to_bf16(f), want = ref_bf16(f);
        if (fabsf(f) > 3.3e38f)
            continue; /* next to the largest bf16: IEEE rounds to inf */
        CHECK(got == want, "bf16(%g): got 0x%04x want 0x%04x", f, got, want);
        if (fr_test_failures > 10)
            break;
        CHECK(fr_bf16_to_f32(got) == fr_bf16_to_f32(got), "bf16 decode");
    }
    CHECK(isnan(fr_bf16_to_f32(fr_f32_to_bf16(NAN))), "bf16 NaN");

    /* round_scale: a power of two, the least one >= amax / 448 (so no
     * value saturates and the scale is its own exponent byte), exact
     * inverse; tiny and zero blocks */
    for (int e = -40; e <= 40; e++) {
        for (int m = 0; m < 8; m++) {
            float am = ldexpf(1.0f + m / 8.0f, e);
            float s = fr_fp8_scale_r(am, 1), r = am / 448.0f;
            int ex;
            float fr = frexpf(s, &ex);
            CHECK(fr == 0.5f, "round_scale(%g) = %g: not a power of two", am, s);
            CHECK(s >= r && s < 2 * r, "round_scale(%g) = %g, am/448 = %g", am, s, r);
            CHECK(fr_fp8_inv_scale_r(am, 1) * s == 1.0f, "inverse of %g", s);
            CHECK(fr_f32_to_e4m3(am * fr_fp8_inv_scale_r(am, 1)) <= 0x7e, "no saturation");
            CHECK(fr_fp8_scale_r(am, 0) == fr_fp8_scale(am), "round 0 is the plain scale");
        }
    }
    CHECK(fr_fp8_scale_r(448.0f, 1) == 1.0f, "448 -> 1");
    CHECK(fr_fp8_scale_r(0.0f, 1) == 1.0f, "zero block scale 1");
    CHECK(fr_fp8_scale_r(1e-40f, 1) == ldexpf(1.0f, -126), "tiny block: 2^-126");
    {
        uint16_t blk[128];
        uint8_t q[128];
        float sc;
        for (int i = 0; i < 128; i++)
            blk[i] = fr_f32_to_bf16((float)(i - 64) * 0.37f);
        fr_quant_block_r(blk, q, &sc, 1);
        CHECK(sc == fr_fp8_scale_r(fr_bf16_amax(blk, 128), 1), "block scale rounded");
        for (int i = 0; i < 128; i++)
            CHECK(fabsf(fr_e4m3_to_f32(q[i]) * sc - fr_bf16_to_f32(blk[i])) <=
                      fabsf(fr_bf16_to_f32(blk[i])) / 8 + sc / 512,
                  "channel %d dequantises near its value", i);
    }
    /* e2m1: the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to the even
     * code, saturating), the sign kept; every midpoint, both sides of it,
     * and random values */
    {
        static const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
        for (int c = 0; c < 16; c++)
            CHECK(fr_e2m1_to_f32((uint8_t)c) == (c & 8 ? -mag[c & 7] : mag[c & 7]),
                  "e2m1 decode %d", c);
        float probe[64];
        int np = 0;
        for (int c = 0; c < 7; c++) {
            float mid = (mag[c] + mag[c + 1]) / 2;
            probe[np++] = mid;
            probe[np++] = nextafterf(mid, 0.f);
            probe[np++] = nextafterf(mid, 10.f);
            probe[np++] = mag[c];
        }
        /* the octaves' edges (the step changes there) and tiny values */
        static const float edge[] = {1.f, 2.f, 4.f, 8.f, 1e-40f, 1.17549435e-38f};
        for (int i = 0; i < (int)(sizeof edge / sizeof edge[0]); i++) {
            probe[np++] = edge[i];
            probe[np++] = nextafterf(edge[i], 0.f);
            probe[np++] = nextafterf(edge[i], 10.f);
        }
        probe[np++] = 6.f;
        probe[np++] = 7.5f;
        probe[np++] = 1e30f;
        probe[np++] = INFINITY;
        uint64_t y = 7;
        /* the probes, random values in [0, 8), then every 4099th float of
         * [0, 16) (272k: every octave's codes and roundings) */
        uint32_t sweep = 0;
        for (int i = 0; i < 20000 + 0x41800000 / 4099; i++) {
            y = y * 6364136223846793005ull + 1442695040888963407ull;
            float f = (float)((double)(y >> 11) / 9007199254740992.0 * 8.0);
            if (i >= 20000) {
                memcpy(&f, &sweep, 4);
                sweep += 4099;
            }
            for (int sgn = 0; sgn < 2; sgn++) {
                float v = i < np ? probe[i] : f;
                v = sgn ? -v : v;
                /* reference: nearest by distance in double, ties to even */
                double a = fabs((double)v);
                int best = 0;
                for (int c = 1; c < 8; c++) {
                    double d = fabs(a - mag[c]), db = fabs(a - mag[best]);
                    if (d < db || (d == db && c % 2 == 0))
                        best = c;
                }
                best = a > 6.0 ? 7 : best; /* saturating (Inf too) */
                uint8_t want = (uint8_t)((signbit(v) ? 8 : 0) | best);
                CHECK(fr_f32_to_e2m1(v) == want, "e2m1(%.9g): got %d want %d", v,
                      fr_f32_to_e2m1(v), want);
            }
            if (fr_test_failures > 10)
                break;
        }
        CHECK(fr_f32_to_e2m1(NAN) == 7, "e2m1 NaN -> 7");
        CHECK(fr_f32_to_e2m1(-0.1f) == 8, "e2m1 keeps the sign of a zero code");
    }
    /* an NVFP4 block: the scale e4m3(gs * amax / 6), codes of x / (sf / gs),
     * channel 2i in the low nibble; the block's largest value maps to 6
     * when its scale is exact; an all-zero block gives scale 0, codes 0 */
    {
        uint16_t blk[16];
        uint8_t q[8], sf;
        float gs = 100.3f;
        for (int i = 0; i < 16; i++)
            blk[i] = fr_f32_to_bf16((float)(i - 7) * 0.31f);
        fr_nvfp4_block(blk, gs, q, &sf);
        float bmax = fr_bf16_amax(blk, 16);
        CHECK(sf == fr_f32_to_e4m3(gs * (bmax * (1.0f / 6.0f))), "nvfp4 scale byte 0x%02x", sf);
        float sq = fr_e4m3_to_f32(sf), inv = 1.0f / (sq * (1.0f / gs));
        for (int i = 0; i < 16; i++) {
            uint8_t c = (uint8_t)((q[i / 2] >> (i % 2 * 4)) & 15);
            CHECK(c == fr_f32_to_e2m1(fr_bf16_to_f32(blk[i]) * inv), "nvfp4 channel %d", i);
            float back = fr_e2m1_to_f32(c) * sq / gs, want = fr_bf16_to_f32(blk[i]);
            CHECK(fabsf(back - want) <= fabsf(want) * 0.25f + bmax / 12 + 1e-6f,
                  "nvfp4 channel %d dequantises near %g: %g", i, want, back);
        }
        for (int i = 0; i < 16; i++)
            blk[i] = (uint16_t)(i & 1 ? 0x8000 : 0);
        fr_nvfp4_block(blk, gs, q, &sf);
        CHECK(sf == 0 && (q[0] & 0x77) == 0 && (q[3] & 0x77) == 0, "nvfp4 zero block");
    }
    printf("test_quant: %d failures\n", fr_test_failures);
    return fr_test_result();
}
