/*
 * libFuzzer target: EP configuration and dispatch-argument validation.
 * Input bytes become a config (world size, E, K, H, T, dtype, device) and,
 * when it is accepted, a routing table for dispatch_send's checks. Accepted
 * configurations must give a layout whose regions fit and do not overlap
 * (both modes' layouts); every rejection must come with a message. The
 * routing table also goes through the high-throughput route checks.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "core/layout.h"
#include "engines/cpu_ht/cpu_ht.h"
#include "ep/ep.h"

static uint32_t take(const uint8_t **p, size_t *n, int bytes)
{
    uint32_t v = 0;
    for (int i = 0; i < bytes && *n > 0; i++, (*p)++, (*n)--)
        v |= (uint32_t)(**p) << (8 * i);
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *p = data;
    size_t n = size;
    ferry_ep_config_t c = FERRY_EP_CONFIG_INIT;
    int N = (int)(take(&p, &n, 2) % 300) - 10;
    c.num_experts = (int)take(&p, &n, 2) - 8;
    c.topk = (int)(take(&p, &n, 1)) - 2;
    c.hidden = (int)take(&p, &n, 2) - 16;
    c.max_tokens = (int)(take(&p, &n, 2) % 600) - 4;
    c.dispatch_dtype = (ferry_dtype_t)(take(&p, &n, 1) % 3);
    c.device = (ferry_device_t)(take(&p, &n, 1) % 2 ? 2 : 0);
    if (take(&p, &n, 1) == 0x5a)
        c.magic ^= 1;
    c.mode = (ferry_mode_t)(take(&p, &n, 1) % 3);
    c.ring_tokens = (int)take(&p, &n, 3) - 4;
    fr_err_t err;
    err.msg[0] = 0;
    int rc = fr_ep_check_config(N, &c, &err);
    if (rc != FERRY_OK) {
        if (err.msg[0] == 0 || (rc != FERRY_ERR_INVALID && rc != FERRY_ERR_UNSUPPORTED))
            abort(); /* every rejection says why, with a known code */
        return 0;
    }
    fr_layout_t L;
    fr_layout_init(&L, N, 0, c.num_experts, c.topk, c.hidden, c.max_tokens,
                   c.dispatch_dtype == FERRY_DTYPE_FP8_E4M3);
    if (L.El < 1 || L.kmax < 1 || L.kmax > FR_MAX_TOPK || L.rec_bytes % 16 ||
        fr_off_flag(&L, 1, 1, N - 1) + 8 > L.off_drecv ||
        fr_off_drecv(&L, 1, N - 1) + L.dslice > L.off_crecv ||
        fr_off_crecv(&L, 1, L.crows) > L.seg_bytes ||
        fr_off_dsend(&L, 1, N - 1) + L.dslice > L.off_csend ||
        fr_off_csend(&L, 1, L.send_crows) > L.send_bytes)
        abort();
    if (c.mode == FERRY_MODE_HIGH_THROUGHPUT) {
        fr_ht_layout_t h;
        int RT = c.ring_tokens > 0 ? c.ring_tokens : FR_HT_RING_DEFAULT;
        fr_ht_layout_init(&h, N, L.El, c.topk, c.hidden, RT);
        if (h.RT % FR_HT_CHUNK || h.RT < RT || h.drec % 16 || h.crec % 16 ||
            fr_ht_woff(c.topk) + 4ull * c.topk > h.dhdr ||
            h.dhdr + 2ull * c.hidden + 4ull * ((c.hidden + 127) / 128) > h.drec ||
            h.chdr + 2ull * c.hidden > h.crec || 16 + 4ull * L.El > h.notify_entry ||
            h.off_notify < 4096 || h.off_notify + 2ull * N * h.notify_entry > h.off_dring ||
            h.off_dring + (uint64_t)N * h.dring > h.off_cring ||
            h.off_cring + (uint64_t)N * h.cring > h.seg_bytes ||
            (uint64_t)h.RT * (h.drec + h.crec) + 2 * h.notify_entry > h.stage)
            abort();
    }
    /* dispatch_send's checks on a routing table made of the rest */
    int T = (int)(take(&p, &n, 2) % (uint32_t)(L.T + 3)) - 1;
    size_t cells = (size_t)(T > 0 ? T : 0) * (size_t)L.K;
    if (cells > 4096)
        return 0;
    int64_t *idx = calloc(cells + 1, sizeof(int64_t));
    for (size_t i = 0; i < cells; i++)
        idx[i] = (int64_t)(int16_t)take(&p, &n, 2) % (L.E + 2);
    uint16_t x[8] = {0};
    ferry_dispatch_in_t in = {.size = sizeof(in), .num_tokens = T, .x = x,
                              .topk_idx = idx};
    rc = fr_check_dispatch_args(&L, &in, 0, &err);
    if (rc != FERRY_OK && (rc != FERRY_ERR_INVALID || err.msg[0] == 0))
        abort();
    /* topk_idx's values are the engines' to check (within the round, so
     * that every rank fails alike): accepted exactly when every index is
     * -1 or an expert and none repeats, else the entry named */
    int at = -1;
    fr_err_t terr;
    terr.msg[0] = 0;
    int trc = T > 0 ? fr_check_topk(&L, idx, T, &at, &terr) : FERRY_OK;
    if (trc != FERRY_OK && (trc != FERRY_ERR_INVALID || terr.msg[0] == 0 || at < 0 ||
                            at >= T * L.K))
        abort();
    if (trc != FERRY_OK) { /* the entry named is the first bad one */
        for (int i = 0; i <= at; i++) {
            int64_t e = idx[i];
            int bad = e < -1 || e >= L.E;
            for (int j = i - i % L.K; j < i; j++)
                bad |= e >= 0 && idx[j] == e;
            if (bad != (i == at))
                abort();
        }
    } else {
        for (int t = 0; t < T; t++)
            for (int k = 0; k < L.K; k++) {
                int64_t e = idx[(size_t)t * L.K + k];
                if (e < -1 || e >= L.E)
                    abort();
                for (int j = 0; j < k; j++)
                    if (e >= 0 && idx[(size_t)t * L.K + j] == e)
                        abort();
            }
    }
    /* the route checks accept what dispatch_send's do, whatever topk_idx's
     * values (the route's engine checks those within its exchange, so that
     * every rank fails alike), with an expert_alignment of 0 or more */
    ferry_route_in_t rin = {.size = sizeof(rin), .num_tokens = T, .topk_idx = idx,
                            .expert_alignment = (int)take(&p, &n, 1) - 1};
    fr_err_t err2;
    err2.msg[0] = 0;
    int rc2 = fr_check_route_args(&L, &rin, 0, &err2);
    int in_range = T >= 0 && T <= L.T;
    if ((rc == FERRY_OK && !in_range) ||
        (rc2 == FERRY_OK) != (in_range && rin.expert_alignment >= 0) ||
        (rc2 != FERRY_OK && (rc2 != FERRY_ERR_INVALID || err2.msg[0] == 0)))
        abort();
    free(idx);
    return 0;
}
