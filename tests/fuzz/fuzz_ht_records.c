/*
 * libFuzzer target: decoding a high-throughput dispatch record header.
 * The first bytes pick top-k, max tokens, local experts, dtype and the
 * route's number; the rest is what a peer wrote into the ring slot.
 * fr_ht_dhdr_check must reject anything malformed with a protocol error
 * naming the sender; when it accepts, the copy it hands back must hold
 * exactly the slot's fields, all in bounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/ht_rec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 6)
        return 0;
    int K = 1 + data[0] % FR_HT_MAX_K;
    int T = 1 + data[1] % 64;
    int El = 1 + data[2] % 32;
    int fp8 = data[3] & 1;
    uint64_t route = (uint64_t)data[4] | (uint64_t)data[5] << 8;
    size_t bytes = fr_ht_dhdr_bytes(K);
    uint8_t *rec = calloc(1, bytes);
    memcpy(rec, data + 6, size - 6 < bytes ? size - 6 : bytes);
    fr_ht_dhdr_copy_t hd;
    fr_err_t err;
    err.msg[0] = 0;
    int rc = fr_ht_dhdr_check(rec, K, T, El, fp8, route, 5, &hd, &err);
    if (rc != FERRY_OK) {
        if (rc != FERRY_ERR_PROTOCOL || !strstr(err.msg, "rank 5"))
            abort();
        free(rec);
        return 0;
    }
    const fr_ht_dhdr_t *h = (const fr_ht_dhdr_t *)rec;
    if (hd.token != h->token || hd.flags != h->flags || hd.token < 0 || hd.token >= T ||
        (hd.flags & 1) != fp8 || ((uint32_t)hd.flags >> 8 & 0xffu) != (route & 0xffu))
        abort();
    const int16_t *le = (const int16_t *)(rec + sizeof(*h));
    const float *w = (const float *)(rec + fr_ht_woff(K));
    for (int k = 0; k < K; k++)
        if (hd.le[k] != le[k] || hd.le[k] < -1 || hd.le[k] >= El ||
            memcmp(&hd.w[k], &w[k], sizeof(float)) != 0)
            abort();
    free(rec);
    return 0;
}
