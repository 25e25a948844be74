/*
 * libFuzzer target: decoding a received dispatch slice. The first bytes
 * pick a layout (ranks, experts, top-k, hidden, tokens, dtype); the rest is
 * what a peer wrote. fr_slice_check must reject anything malformed; when it
 * accepts, walking the records the way dispatch_recv does must stay inside
 * the slice and inside expert_x, with the pair count it promised.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"
#include "core/layout.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8)
        return 0;
    int N = 1 + data[0] % 8;
    int El = 1 + data[1] % 8;
    int K = 1 + data[2] % 16;
    int H = 128 * (1 + data[3] % 2);
    int T = 1 + data[4] % 12;
    int fp8 = data[5] & 1;
    int sender = data[6] % N;
    uint64_t epoch = 1 + data[7] % 4;
    if (K > N * El)
        K = N * El;
    fr_layout_t L;
    fr_layout_init(&L, N, 0, N * El, K, H, T, fp8);
    uint8_t *slice = calloc(1, L.dslice);
    size_t m = size - 8 < L.dslice ? size - 8 : L.dslice;
    memcpy(slice, data + 8, m);
    fr_err_t err;
    err.msg[0] = 0;
    int rc = fr_slice_check(&L, slice, sender, epoch, &err);
    if (rc != FERRY_OK) {
        if (rc != FERRY_ERR_PROTOCOL || err.msg[0] == 0)
            abort();
        free(slice);
        return 0;
    }
    const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)slice;
    uint32_t pairs = 0;
    int32_t *fill = calloc((size_t)L.El, sizeof(int32_t));
    for (uint32_t i = 0; i < h->count; i++) {
        uint64_t off = fr_off_record(&L, i);
        if (off + L.rec_bytes > L.dslice)
            abort();
        const fr_rec_hdr_t *r = (const fr_rec_hdr_t *)(slice + off);
        if (r->pair != pairs)
            abort();
        for (int j = 0; j < r->nexp; j++) {
            if (r->le[j] >= L.El)
                abort();
            if ((uint64_t)++fill[r->le[j]] > L.cap)
                abort();
        }
        pairs += r->nexp;
    }
    if (pairs != h->npairs || (uint64_t)h->comb_off + pairs > L.crows)
        abort();
    free(fill);
    free(slice);
    return 0;
}
