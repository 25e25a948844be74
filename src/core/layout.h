/*
 * The record layout and every offset of ferry's buffers, written once and
 * shared by the CPU and CUDA kernels and the proxy.
 *
 * Receive segment of one rank (shared memory; registered with the fabric):
 *
 *   [header 4 KB]
 *   [flags]      u64 flag[phase 2][set 2][sender N], one per 64 B line;
 *                a flag holds the epoch of the last slice that landed.
 *   [dispatch]   [set 2][sender N][dslice]
 *                dslice = slice header (64 B) + the sender's rows per
 *                         local expert (u32 [El], padded to 64 B) + T records
 *                record = header (12 + 2*kmax B, then u32 pos[kmax]: the
 *                         record's row among the sender's rows of each of
 *                         its experts; padded to 16)
 *                         + token (H B fp8 | 2H B bf16) + scales (H/128 fp32)
 *                (the CPU engine leaves the rows per expert and pos unset)
 *   [combine]    [set 2][T*K slots][cslot B]   one row per (token, k):
 *                bf16 rows 2H apart, LogFMT rows cslot apart (a set's part
 *                is T*K*cslot bytes either way); each expert rank writes
 *                one contiguous run of rows at the offset this rank named
 *                in its dispatch slice header.
 *
 * Send region (only with fabric peers; registered, never shared):
 *   [dispatch]   [set 2][dest N][dslice]
 *   [combine]    [set 2][N*T*kmax slots][cslot B] (rows as above)
 *
 * Immediate data (32 bits, EFA's size): phase 2 | epoch low 12 | sender 18.
 */
#ifndef FR_LAYOUT_H
#define FR_LAYOUT_H

#include <stdint.h>
#include <string.h>

#include "hd.h"
#include "err.h"

#define FR_PH_DISPATCH 0
#define FR_PH_COMBINE 1
#define FR_NSETS 2
#define FR_SEG_HDR 4096u
#define FR_FLAG_STRIDE 64u
/* In the segment header: a doorbell sequence word senders bump after
 * publishing flags, and the number of threads sleeping on it (CPU ranks
 * sleep in futex waits instead of spinning when cores are shared). */
#define FR_SEG_OFF_BELL 64u
#define FR_SEG_OFF_SLEEPERS 128u
#define FR_SLICE_HDR 64u
#define FR_SLICE_MAGIC 0x46525331u /* "FRS1" */
/* a round's slice from a rank whose topk_idx was bad: no records;
 * reserved[0] is the bad entry's t * K + k (the CPU engine's) */
#define FR_SLICE_BAD 0x46525358u /* "FRSX" */
#define FR_MAX_TOPK 16
#define FR_IMM_SENDER_BITS 18
#define FR_IMM_EPOCH_BITS 12
#define FR_MAX_RANKS (1 << FR_IMM_SENDER_BITS)
/* expert_x_scales of an NVFP4 dispatch: the 128 x 4 block-scaled layout
 * of grouped NVFP4 GEMMs (fr_scl_at) */
#define FR_SFMT_NVFP4 16

typedef struct fr_layout {
    int N, rank;     /* world size, this rank */
    int E, El, K, H; /* experts, local experts, top-k, hidden */
    int T;           /* max tokens per rank */
    int fp8;         /* dispatch dtype is fp8 e4m3 */
    int nvfp4;       /* dispatch dtype is NVFP4 (e2m1 pairs, e4m3 scales
                        per 16 channels: nscales words of 4 scale bytes) */
    int kmax;        /* most experts of one rank one token can pick */
    int sfmt;        /* expert_x_scales layout (ferry_scales_layout_t, or
                        FR_SFMT_NVFP4) */
    uint32_t tok_bytes, nscales, rec_hdr, rec_bytes;
    uint32_t rec_pos;   /* offset of pos[kmax] in a record header */
    uint32_t slice_hdr; /* slice header + rows per local expert */
    uint64_t dslice;  /* bytes of one dispatch slice */
    uint64_t crow;    /* bytes of one combine row (2H) */
    uint64_t cslot;   /* bytes a combine row takes in the regions: 2H, or
                         with LogFMT possible (H % 512 == 0) room for its
                         largest row and a fabric run's offset table
                         (2H + H/32 + 32; core/logfmt.h) */
    uint64_t crows;   /* combine rows per set in the receive segment (T*K) */
    uint64_t cap;     /* rows per local expert in expert_x (N*T) */
    uint64_t off_flags, off_drecv, off_crecv, seg_bytes;
    uint64_t send_crows; /* combine rows per set in the send region */
    uint64_t off_dsend, off_csend, send_bytes;
} fr_layout_t;

/* 64-byte header at the start of every dispatch slice. */
typedef struct fr_slice_hdr {
    uint32_t magic;
    uint32_t sender;
    uint64_t epoch;
    uint32_t count;    /* records that follow */
    uint32_t npairs;   /* (token, expert) pairs among them */
    uint32_t comb_off; /* first row of the sender's combine region for replies */
    uint32_t reserved[9];
} fr_slice_hdr_t;

/* Start of every record; le[nexp] lists the local experts, in k order.
 * pair: how many (token, expert) pairs of this slice precede the record,
 * so a receiver can place records in parallel without a scan. */
typedef struct fr_rec_hdr {
    uint32_t token;
    uint32_t pair;
    uint16_t nexp;
    uint16_t reserved;
    uint16_t le[];
} fr_rec_hdr_t;
#define FR_REC_HDR_FIXED 12u

FR_HD uint64_t fr_align(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Fill every derived size; the caller validated the config. dtype:
 * ferry_dtype_t (0 bf16, 1 fp8, 2 NVFP4). */
FR_HD void fr_layout_init(fr_layout_t *L, int N, int rank, int E, int K, int H,
                          int T, int dtype)
{
    int fp8 = dtype == 1, nvfp4 = dtype == 2;
    L->N = N;
    L->rank = rank;
    L->E = E;
    L->El = E / N;
    L->K = K;
    L->H = H;
    L->T = T;
    L->fp8 = fp8;
    L->nvfp4 = nvfp4;
    L->sfmt = nvfp4 ? FR_SFMT_NVFP4 : FERRY_SCALES_ROWS;
    L->kmax = K < L->El ? K : L->El;
    L->tok_bytes = (uint32_t)(nvfp4 ? H / 2 : fp8 ? H : 2 * H);
    L->nscales = (uint32_t)(nvfp4 ? H / 64 : fp8 ? H / 128 : 0);
    L->rec_pos = (uint32_t)fr_align(FR_REC_HDR_FIXED + 2 * (uint64_t)L->kmax, 4);
    L->rec_hdr = (uint32_t)fr_align(L->rec_pos + 4 * (uint64_t)L->kmax, 16);
    L->slice_hdr = (uint32_t)fr_align(FR_SLICE_HDR + 4 * (uint64_t)L->El, 64);
    L->rec_bytes = (uint32_t)fr_align(
        L->rec_hdr + L->tok_bytes + 4ull * L->nscales, 16);
    L->dslice = L->slice_hdr + (uint64_t)T * L->rec_bytes;
    L->crow = 2ull * H;
    L->cslot = H % 512 == 0 ? 2ull * H + (uint64_t)H / 32 + 32 : L->crow;
    L->crows = (uint64_t)T * K;
    L->cap = (uint64_t)N * T;
    L->off_flags = FR_SEG_HDR;
    L->off_drecv = fr_align(L->off_flags +
                                2ull * FR_NSETS * N * FR_FLAG_STRIDE, 4096);
    L->off_crecv = fr_align(L->off_drecv + (uint64_t)FR_NSETS * N * L->dslice,
                            4096);
    L->seg_bytes = fr_align(L->off_crecv + FR_NSETS * L->crows * L->cslot,
                            4096);
    L->send_crows = (uint64_t)N * T * L->kmax;
    L->off_dsend = 0;
    L->off_csend = fr_align((uint64_t)FR_NSETS * N * L->dslice, 4096);
    L->send_bytes = fr_align(L->off_csend +
                                 FR_NSETS * L->send_crows * L->cslot, 4096);
}

FR_HD uint64_t fr_off_flag(const fr_layout_t *L, int phase, int set, int sender)
{
    return L->off_flags +
           (((uint64_t)phase * FR_NSETS + set) * L->N + sender) * FR_FLAG_STRIDE;
}
/* Slice `sender` writes into this rank's dispatch receive area. */
FR_HD uint64_t fr_off_drecv(const fr_layout_t *L, int set, int sender)
{
    return L->off_drecv + ((uint64_t)set * L->N + sender) * L->dslice;
}
/* Row `row` of a combine region, rows of `stride` bytes (crow, or cslot
 * for LogFMT rows); each set's part holds crows slots of cslot bytes. */
FR_HD uint64_t fr_off_crecv_st(const fr_layout_t *L, int set, uint64_t row, uint64_t stride)
{
    return L->off_crecv + (uint64_t)set * L->crows * L->cslot + row * stride;
}
FR_HD uint64_t fr_off_crecv(const fr_layout_t *L, int set, uint64_t row)
{
    return fr_off_crecv_st(L, set, row, L->crow);
}
FR_HD uint64_t fr_off_dsend(const fr_layout_t *L, int set, int dest)
{
    return L->off_dsend + ((uint64_t)set * L->N + dest) * L->dslice;
}
FR_HD uint64_t fr_off_csend_st(const fr_layout_t *L, int set, uint64_t row, uint64_t stride)
{
    return L->off_csend + (uint64_t)set * L->send_crows * L->cslot + row * stride;
}
FR_HD uint64_t fr_off_csend(const fr_layout_t *L, int set, uint64_t row)
{
    return fr_off_csend_st(L, set, row, L->crow);
}
FR_HD uint64_t fr_off_record(const fr_layout_t *L, uint32_t i)
{
    return L->slice_hdr + (uint64_t)i * L->rec_bytes;
}

FR_HD uint32_t fr_imm_make(int phase, uint64_t epoch, int sender)
{
    return ((uint32_t)phase << 30) |
           ((uint32_t)(epoch & ((1u << FR_IMM_EPOCH_BITS) - 1))
            << FR_IMM_SENDER_BITS) |
           ((uint32_t)sender & ((1u << FR_IMM_SENDER_BITS) - 1));
}
FR_HD int fr_imm_phase(uint32_t imm) { return (int)(imm >> 30); }
FR_HD uint32_t fr_imm_epoch(uint32_t imm)
{
    return (imm >> FR_IMM_SENDER_BITS) & ((1u << FR_IMM_EPOCH_BITS) - 1);
}
FR_HD int fr_imm_sender(uint32_t imm)
{
    return (int)(imm & ((1u << FR_IMM_SENDER_BITS) - 1));
}

/* Record decoding, shared by the engines and the fuzzer (layout.c):
 * validate one received slice. Its sender can still write it: every field
 * is read once and what was checked is what fr_slice_check_hdr returns in
 * *hdr (the caller uses that, never the slice's header again); fields a
 * caller reads from the records again must be bounded again there. */
#ifdef __cplusplus
extern "C" {
#endif
int fr_slice_check(const fr_layout_t *L, const uint8_t *slice, int sender,
                   uint64_t epoch, fr_err_t *err);
int fr_slice_check_hdr(const fr_layout_t *L, const uint8_t *slice, int sender,
                       uint64_t epoch, fr_slice_hdr_t *hdr, fr_err_t *err);
/* topk_idx [T][K] in host memory: every entry -1 or an expert, none
 * repeated in a row (FERRY_ERR_INVALID naming the first bad entry, and
 * *at = its t * K + k when at is not NULL). */
int fr_check_topk(const fr_layout_t *L, const int64_t *idx, int T, int *at, fr_err_t *err);

#ifdef __cplusplus
}
#endif

/* Where a received row's scales go in expert_x_scales (the layout
 * config.scales_layout names, ferry.h): fr_scl_at is scale 0 of local
 * expert le's row pos from the buffer's base (fr_scl_row: of expert_x row
 * le * cap + pos), fr_scl_put stores scale q of it there. */
FR_HD uint8_t *fr_scl_at(const fr_layout_t *L, void *base, uint64_t le, uint64_t pos)
{
    uint8_t *b = (uint8_t *)base;
    if (L->sfmt == FR_SFMT_NVFP4) /* word q of row pos: fr_scl_put */
        return b + 4 * (le * fr_align(L->cap, 128) * L->nscales +
                        pos / 128 * 128 * L->nscales + pos % 32 * 4 + pos % 128 / 32);
    if (L->sfmt == FERRY_SCALES_COLS)
        return b + 4 * (le * L->nscales * L->cap + pos);
    if (L->sfmt == FERRY_SCALES_UE8M0)
        return b + 4 * (le * (L->nscales / 4) * L->cap + pos);
    return b + 4 * (le * L->cap + pos) * L->nscales;
}

/* Bytes of expert_x_scales: every layout holds El x cap rows of nscales
 * words (UE8M0: bytes), NVFP4's with cap rounded up to 128. */
FR_HD uint64_t fr_scl_bytes(const fr_layout_t *L)
{
    if (L->sfmt == FR_SFMT_NVFP4)
        return 4ull * L->El * fr_align(L->cap, 128) * L->nscales;
    return (uint64_t)L->El * L->cap * L->nscales * (L->sfmt == FERRY_SCALES_UE8M0 ? 1 : 4);
}

/* rows index expert_x's int32 row space (expert_x_scales is sized by it) */
FR_HD uint8_t *fr_scl_row(const fr_layout_t *L, void *base, uint32_t row)
{
    if (L->sfmt == FERRY_SCALES_ROWS) /* no division */
        return (uint8_t *)base + 4 * (uint64_t)row * L->nscales;
    uint32_t cap = (uint32_t)L->cap, le = row / cap;
    return fr_scl_at(L, base, le, row - le * cap);
}

FR_HD void fr_scl_put(const fr_layout_t *L, uint8_t *p, uint32_t q, float v)
{
    if (L->sfmt == FR_SFMT_NVFP4) {
        p += 512 * (uint64_t)q; /* v: the bits of scale bytes 4q..4q+3 */
    } else if (L->sfmt == FERRY_SCALES_COLS) {
        p += 4 * (uint64_t)q * L->cap;
    } else if (L->sfmt == FERRY_SCALES_UE8M0) {
        uint32_t u;
        memcpy(&u, &v, 4);
        /* a positive power of two: its exponent byte is the whole value */
        p[4 * (uint64_t)(q >> 2) * L->cap + (q & 3)] = (uint8_t)(u >> 23);
        return;
    } else {
        p += 4 * (uint64_t)q;
    }
    memcpy(p, &v, 4);
}

#endif
