/* Record decoding shared by every engine and the fuzzer (see layout.h). */
#include <string.h>

#include "core/layout.h"

int fr_slice_check_hdr(const fr_layout_t *L, const uint8_t *slice, int sender,
                       uint64_t epoch, fr_slice_hdr_t *hdr, fr_err_t *err)
{
    /* one read per field (volatile: the compiler may not read the shared
     * slice again in place of the copy) */
    const volatile fr_slice_hdr_t *vh = (const volatile fr_slice_hdr_t *)slice;
    fr_slice_hdr_t h;
    memset(&h, 0, sizeof(h));
    h.magic = vh->magic;
    h.sender = vh->sender;
    h.epoch = vh->epoch;
    h.count = vh->count;
    h.npairs = vh->npairs;
    h.comb_off = vh->comb_off;
    if (h.magic != FR_SLICE_MAGIC)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: bad magic 0x%08x", sender, h.magic);
    if (h.sender != (uint32_t)sender || h.epoch != epoch)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: header says rank %u round %llu, "
                      "expected round %llu", sender, h.sender,
                      (unsigned long long)h.epoch, (unsigned long long)epoch);
    if (h.count > (uint32_t)L->T)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: %u records, at most %d", sender,
                      h.count, L->T);
    if ((uint64_t)h.comb_off + h.npairs > L->crows)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: reply rows %u+%u exceed %llu",
                      sender, h.comb_off, h.npairs,
                      (unsigned long long)L->crows);
    uint32_t pairs = 0, last_token = 0;
    for (uint32_t i = 0; i < h.count; i++) {
        const volatile fr_rec_hdr_t *rh =
            (const volatile fr_rec_hdr_t *)(slice + fr_off_record(L, i));
        uint32_t token = rh->token, pair = rh->pair, nexp = rh->nexp;
        if (token >= (uint32_t)L->T || (i > 0 && token <= last_token))
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u has token %u "
                          "(out of range or out of order)", sender, i, token);
        last_token = token;
        if (pair != pairs)
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u starts at pair %u, "
                          "expected %u", sender, i, pair, pairs);
        if (nexp < 1 || nexp > (uint32_t)L->kmax)
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u lists %u experts "
                          "(1..%d)", sender, i, nexp, L->kmax);
        uint16_t le[FR_MAX_TOPK];
        for (uint32_t j = 0; j < nexp; j++) {
            le[j] = rh->le[j];
            if (le[j] >= (uint32_t)L->El)
                return FR_ERR(err, FERRY_ERR_PROTOCOL,
                              "slice from rank %d: record %u names local "
                              "expert %u of %d", sender, i, le[j], L->El);
            /* a repeat would give one expert more rows than expert_x has */
            for (uint32_t j2 = 0; j2 < j; j2++)
                if (le[j2] == le[j])
                    return FR_ERR(err, FERRY_ERR_PROTOCOL,
                                  "slice from rank %d: record %u lists local "
                                  "expert %u twice", sender, i, le[j]);
        }
        pairs += nexp;
    }
    if (pairs != h.npairs)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: records hold %u pairs, header "
                      "says %u", sender, pairs, h.npairs);
    if (hdr)
        *hdr = h;
    return FERRY_OK;
}

int fr_slice_check(const fr_layout_t *L, const uint8_t *slice, int sender,
                   uint64_t epoch, fr_err_t *err)
{
    return fr_slice_check_hdr(L, slice, sender, epoch, NULL, err);
}

int fr_check_topk(const fr_layout_t *L, const int64_t *idx, int T, int *at, fr_err_t *err)
{
    for (int t = 0; t < T; t++) {
        const int64_t *row = idx + (size_t)t * L->K;
        for (int k = 0; k < L->K; k++) {
            int64_t e = row[k];
            int j = 0;
            while (j < k && !(e >= 0 && row[j] == e))
                j++;
            if (e >= -1 && e < L->E && j == k)
                continue;
            if (at)
                *at = t * L->K + k;
            if (e >= -1 && e < L->E)
                return FR_ERR(err, FERRY_ERR_INVALID,
                              "topk_idx[%d][%d] = %lld repeats topk_idx[%d][%d]", t, k,
                              (long long)e, t, j);
            return FR_ERR(err, FERRY_ERR_INVALID, "topk_idx[%d][%d] = %lld: must be -1 or 0..%d",
                          t, k, (long long)e, L->E - 1);
        }
    }
    return FERRY_OK;
}
