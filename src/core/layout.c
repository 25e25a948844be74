/* Record decoding shared by every engine and the fuzzer (see layout.h). */
#include <string.h>

#include "core/layout.h"

int fr_slice_check(const fr_layout_t *L, const uint8_t *slice, int sender,
                   uint64_t epoch, fr_err_t *err)
{
    const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)slice;
    if (h->magic != FR_SLICE_MAGIC)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: bad magic 0x%08x", sender, h->magic);
    if (h->sender != (uint32_t)sender || h->epoch != epoch)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: header says rank %u round %llu, "
                      "expected round %llu", sender, h->sender,
                      (unsigned long long)h->epoch, (unsigned long long)epoch);
    if (h->count > (uint32_t)L->T)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: %u records, at most %d", sender,
                      h->count, L->T);
    if ((uint64_t)h->comb_off + h->npairs > L->crows)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: reply rows %u+%u exceed %llu",
                      sender, h->comb_off, h->npairs,
                      (unsigned long long)L->crows);
    uint32_t pairs = 0, last_token = 0;
    for (uint32_t i = 0; i < h->count; i++) {
        const fr_rec_hdr_t *rh =
            (const fr_rec_hdr_t *)(slice + fr_off_record(L, i));
        if (rh->token >= (uint32_t)L->T || (i > 0 && rh->token <= last_token))
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u has token %u "
                          "(out of range or out of order)", sender, i,
                          rh->token);
        last_token = rh->token;
        if (rh->pair != pairs)
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u starts at pair %u, "
                          "expected %u", sender, i, rh->pair, pairs);
        if (rh->nexp < 1 || rh->nexp > L->kmax)
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "slice from rank %d: record %u lists %u experts "
                          "(1..%d)", sender, i, rh->nexp, L->kmax);
        for (int j = 0; j < rh->nexp; j++) {
            if (rh->le[j] >= (uint32_t)L->El)
                return FR_ERR(err, FERRY_ERR_PROTOCOL,
                              "slice from rank %d: record %u names local "
                              "expert %u of %d", sender, i, rh->le[j], L->El);
            /* a repeat would give one expert more rows than expert_x has */
            for (int j2 = 0; j2 < j; j2++)
                if (rh->le[j2] == rh->le[j])
                    return FR_ERR(err, FERRY_ERR_PROTOCOL,
                                  "slice from rank %d: record %u lists local "
                                  "expert %u twice", sender, i, rh->le[j]);
        }
        pairs += rh->nexp;
    }
    if (pairs != h->npairs)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "slice from rank %d: records hold %u pairs, header "
                      "says %u", sender, pairs, h->npairs);
    return FERRY_OK;
}
