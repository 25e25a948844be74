/* Layout offsets, immediates and slice validation (record decoding). */
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"
#include "core/layout.h"
#include "harness.h"

static void check_shape(int N, int E, int K, int H, int T, int fp8)
{
    fr_layout_t L;
    fr_layout_init(&L, N, 0, E, K, H, T, fp8);
    CHECK(L.El == E / N, "El");
    CHECK(L.kmax == (K < E / N ? K : E / N), "kmax %d", L.kmax);
    CHECK(L.rec_hdr % 16 == 0 && L.rec_hdr >= FR_REC_HDR_FIXED + 2 * (uint32_t)L.kmax, "rec_hdr %u", L.rec_hdr);
    /* pos[kmax] (u32, 4-aligned) after le[kmax], inside the header */
    CHECK(L.rec_pos % 4 == 0 && L.rec_pos >= FR_REC_HDR_FIXED + 2 * (uint32_t)L.kmax, "rec_pos %u", L.rec_pos);
    CHECK(L.rec_hdr >= L.rec_pos + 4 * (uint32_t)L.kmax, "pos past the record header");
    /* the sender's rows per local expert (u32 [El]) between the slice
     * header and the first record, records 16-aligned */
    CHECK(L.slice_hdr % 64 == 0 && L.slice_hdr >= FR_SLICE_HDR + 4 * (uint32_t)L.El, "slice_hdr %u", L.slice_hdr);
    CHECK(fr_off_record(&L, 0) == L.slice_hdr, "first record");
    CHECK(L.dslice == L.slice_hdr + (uint64_t)T * L.rec_bytes, "dslice");
    CHECK(L.rec_bytes % 16 == 0, "rec_bytes %u", L.rec_bytes);
    CHECK(L.rec_bytes >= L.rec_hdr + L.tok_bytes + 4 * L.nscales, "record too small");
    CHECK(L.tok_bytes == (uint32_t)(fp8 ? H : 2 * H), "tok_bytes");
    CHECK(L.nscales == (uint32_t)(fp8 ? H / 128 : 0), "nscales");
    /* regions in order, no overlap */
    CHECK(fr_off_flag(&L, 1, 1, N - 1) + 8 <= L.off_drecv, "flags overlap dispatch");
    CHECK(fr_off_drecv(&L, 1, N - 1) + L.dslice <= L.off_crecv, "dispatch overlaps combine");
    CHECK(fr_off_crecv(&L, 1, L.crows - 1) + L.crow <= L.seg_bytes, "combine past end");
    CHECK(fr_off_drecv(&L, 0, 1) - fr_off_drecv(&L, 0, 0) == L.dslice, "slice stride");
    CHECK(fr_off_dsend(&L, 1, N - 1) + L.dslice <= L.off_csend, "send dispatch overlaps");
    CHECK(fr_off_csend(&L, 1, L.send_crows - 1) + L.crow <= L.send_bytes, "send combine past end");
    CHECK(L.off_drecv % 64 == 0 && L.off_crecv % 64 == 0, "alignment");
    CHECK(fr_off_record(&L, (uint32_t)T) <= L.dslice, "records fit");
    CHECK(L.crows == (uint64_t)T * K, "combine rows T*K");
}

static void check_imm(void)
{
    int senders[] = {0, 1, 7, 1000, FR_MAX_RANKS - 1};
    uint64_t epochs[] = {1, 2, 4095, 4096, 4097, 123456789};
    for (int ph = 0; ph < 4; ph++)
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 6; j++) {
                uint32_t imm = fr_imm_make(ph, epochs[j], senders[i]);
                CHECK(fr_imm_phase(imm) == ph, "phase");
                CHECK(fr_imm_sender(imm) == senders[i], "sender %d", senders[i]);
                CHECK(fr_imm_epoch(imm) == (epochs[j] & 4095), "epoch");
            }
}

/* Build a valid slice by hand, then break each field. */
static void check_slice(void)
{
    fr_layout_t L;
    fr_layout_init(&L, 4, 0, 16, 4, 128, 8, 1); /* El 4, kmax 4 */
    uint8_t *buf = calloc(1, L.dslice);
    fr_slice_hdr_t *h = (fr_slice_hdr_t *)buf;
    h->magic = FR_SLICE_MAGIC;
    h->sender = 2;
    h->epoch = 7;
    h->count = 3;
    h->comb_off = 5;
    uint32_t toks[3] = {0, 3, 7};
    int nexp[3] = {1, 2, 4};
    uint32_t pairs = 0;
    for (int i = 0; i < 3; i++) {
        fr_rec_hdr_t *r = (fr_rec_hdr_t *)(buf + fr_off_record(&L, (uint32_t)i));
        r->token = toks[i];
        r->pair = pairs;
        r->nexp = (uint16_t)nexp[i];
        for (int j = 0; j < nexp[i]; j++)
            r->le[j] = (uint16_t)j;
        pairs += (uint32_t)nexp[i];
    }
    h->npairs = pairs;
    fr_err_t err;
    CHECK_RC(fr_slice_check(&L, buf, 2, 7, &err), FERRY_OK);
    CHECK_RC(fr_slice_check(&L, buf, 1, 7, &err), FERRY_ERR_PROTOCOL);
    CHECK_RC(fr_slice_check(&L, buf, 2, 9, &err), FERRY_ERR_PROTOCOL);
    uint8_t *c = malloc(L.dslice);
#define MUTATE(stmt)                                                           \
    do {                                                                       \
        memcpy(c, buf, L.dslice);                                              \
        fr_slice_hdr_t *hh = (fr_slice_hdr_t *)c;                              \
        fr_rec_hdr_t *r1 = (fr_rec_hdr_t *)(c + fr_off_record(&L, 1));         \
        (void)hh;                                                              \
        (void)r1;                                                              \
        stmt;                                                                  \
        CHECK(fr_slice_check(&L, c, 2, 7, &err) == FERRY_ERR_PROTOCOL,         \
              "mutation '%s' accepted", #stmt);                                \
    } while (0)
    MUTATE(hh->magic ^= 1);
    MUTATE(hh->count = 9);
    MUTATE(hh->npairs = pairs + 1);
    MUTATE(hh->comb_off = (uint32_t)L.crows);
    MUTATE(r1->token = 8);
    MUTATE(r1->token = 0);          /* out of order */
    MUTATE(r1->nexp = 0);
    MUTATE(r1->nexp = 5);
    MUTATE(r1->le[1] = 4);
    MUTATE(r1->pair = 0);
    MUTATE(r1->le[1] = r1->le[0]); /* found by fuzz_records */
#undef MUTATE
    free(c);
    free(buf);
}

int main(void)
{
    check_shape(8, 256, 8, 7168, 128, 1);   /* DeepSeek-V3 */
    check_shape(8, 384, 8, 7168, 128, 0);   /* Kimi-K2 */
    check_shape(5, 20, 8, 2048, 33, 1);     /* K > El */
    check_shape(4, 128, 4, 2880, 7, 0);     /* GPT-OSS */
    check_shape(8, 8, 2, 4096, 64, 1);      /* Mixtral, one expert per rank */
    check_shape(1, 16, 16, 8, 1, 0);
    check_imm();
    check_slice();
    printf("test_layout: %d failures\n", fr_test_failures);
    return fr_test_result();
}
