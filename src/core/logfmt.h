/*
 * LogFMT-10, DeepEP's low-latency combine format (`use_logfmt`), shared by
 * the CPU and CUDA engines.
 *
 * A row of H bf16 values (H a multiple of 512) goes as
 *   [meta: H/128 x {bf16 amax, bf16 amin} of |x| per 128 channels]
 *   [chunks of C channels (C = 1024, or 512 when H % 1024 != 0), in order]
 * a chunk either cast: 16-channel groups of 20 bytes (a 160-bit
 * little-endian string: channel m's 9-bit code at bits 9m, its sign at bit
 * 144 + m), or raw: its C bf16 values. A chunk is cast when every one of
 * its 128-channel divisions has log2(amax) < 0 and a range
 * (log_amin < log_amax), log_amin = max(log2(amin), log2(amax) - 32);
 * the receiver takes the same decision from the meta. In a cast division,
 * step = (log_amax - log_amin) / 510 and code k >= 1 stands for
 * 2^(log_amin + (k - 1) step), chosen by the linear midpoint between
 * neighbours; code 0 is zero (and values below the first midpoint).
 * Relative error at most (2^step - 1) / (2^step + 1): 2.17% at the
 * 32-octave clip, 0.54% over 8 octaves (bf16: 0.39%).
 */
#ifndef FR_LOGFMT_H
#define FR_LOGFMT_H

#include <stdint.h>

#include "hd.h"

#define FR_LF_DIV 128     /* channels per meta entry */
#define FR_LF_GROUP 16    /* channels per 20-byte group */
#define FR_LF_CLIP 32.0f  /* octaves below amax kept */
#define FR_LF_STEPS 510.0f
#define FR_LF_MAXDIV 512  /* most meta entries: H up to 65536 */

/* Channels per cast decision: 1024, or 512 where H % 1024 != 0. */
FR_HD int fr_lf_chunk(int H)
{
    return H % 1024 == 0 ? 1024 : 512;
}

/* Meta bytes of a row. */
FR_HD uint32_t fr_lf_meta(int H)
{
    return (uint32_t)(H / FR_LF_DIV) * 4u;
}

/* The most bytes a row takes (meta and every chunk raw). */
FR_HD uint64_t fr_lf_row_max(int H)
{
    return 2ull * (uint64_t)H + fr_lf_meta(H);
}

/* Bytes of a chunk of C channels, cast or raw. */
FR_HD uint32_t fr_lf_chunk_bytes(int C, int cast)
{
    return cast ? (uint32_t)C * 10u / 8u : (uint32_t)C * 2u;
}

/* 16 codes (9 bits each) and 16 sign bits (bit m: channel m) into the
 * group's five little-endian words. */
FR_HD void fr_lf_pack(uint32_t w[5], const uint32_t e[16], uint32_t signs)
{
    w[0] = e[0] | e[1] << 9 | e[2] << 18 | e[3] << 27;
    w[1] = e[3] >> 5 | e[4] << 4 | e[5] << 13 | e[6] << 22 | e[7] << 31;
    w[2] = e[7] >> 1 | e[8] << 8 | e[9] << 17 | e[10] << 26;
    w[3] = e[10] >> 6 | e[11] << 3 | e[12] << 12 | e[13] << 21 | e[14] << 30;
    w[4] = e[14] >> 2 | e[15] << 7 | signs << 16;
}

/* Channel m's code in a group's words. */
FR_HD uint32_t fr_lf_code(const uint32_t w[5], int m)
{
    int b = 9 * m, j = b >> 5, o = b & 31;
    uint32_t v = w[j] >> o;
    if (o > 23)
        v |= w[j + 1] << (32 - o);
    return v & 0x1ffu;
}

#endif
