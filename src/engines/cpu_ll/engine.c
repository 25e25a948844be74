/*
 * The CPU low-latency engine's table, setup and free: a receive segment in
 * POSIX shared memory, mapped by every peer on the node; a send region in
 * host memory when some peer is on the fabric; scratch and per-set tables.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engines/cpu_ll/cpu_ll.h"

static int fr_cpu_alloc(ferry_ep_t ep, fr_cpu_ll_t *c, fr_err_t *err)
{
    const fr_layout_t *L = &ep->L;
    int N = ep->N;
    for (int s = 0; s < FR_NSETS; s++) {
        fr_cpu_round_t *r = &c->rounds[s];
        r->comb_pos = calloc((size_t)L->T * L->K + 1, sizeof(int32_t));
        r->pair_row = calloc((size_t)L->send_crows + 1, sizeof(int32_t));
        r->pair_off = calloc((size_t)N + 1, sizeof(uint32_t));
        r->comb_off = calloc((size_t)N, sizeof(uint32_t));
        r->send_off = calloc((size_t)N + 1, sizeof(uint32_t));
        if (!r->comb_pos || !r->pair_row || !r->pair_off || !r->comb_off || !r->send_off)
            return FR_ERR(err, FERRY_ERR_NOMEM, "round tables");
    }
    c->qbuf = calloc((size_t)L->T * L->tok_bytes + 1, 1);
    c->qscales = calloc((size_t)L->T * (L->nscales + 1), sizeof(float));
    c->cnt_rank = calloc((size_t)N, sizeof(int32_t));
    c->pairs_rank = calloc((size_t)N, sizeof(int32_t));
    c->fill = calloc((size_t)N, sizeof(int32_t));
    c->rec_next = calloc((size_t)N, sizeof(int32_t));
    c->rcount = calloc((size_t)N, sizeof(uint32_t));
    c->expert_fill = calloc((size_t)L->El, sizeof(int32_t));
    c->acc = calloc((size_t)L->H, sizeof(float));
    if (!c->qbuf || !c->qscales || !c->cnt_rank || !c->pairs_rank ||
        !c->fill || !c->rec_next || !c->rcount || !c->expert_fill ||
        !c->acc)
        return FR_ERR(err, FERRY_ERR_NOMEM, "scratch buffers");
    if (ep->nfabric > 0) {
        if (posix_memalign((void **)&ep->send, 4096, L->send_bytes) != 0) {
            ep->send = NULL;
            return FR_ERR(err, FERRY_ERR_NOMEM, "send region of %llu bytes",
                          (unsigned long long)L->send_bytes);
        }
        memset(ep->send, 0, L->send_bytes);
    }
    return FERRY_OK;
}

static int fr_cpu_setup(ferry_ep_t ep, fr_err_t *err)
{
    const ferry_ep_config_t *c = &ep->cfg;
    fr_layout_init(&ep->L, ep->N, ep->rank, c->num_experts, c->topk,
                   c->hidden, c->max_tokens, (int)c->dispatch_dtype);
    if (!ep->L.nvfp4) /* NVFP4's scales have their own layout */
        ep->L.sfmt = c->scales_layout;
    fr_cpu_ll_t *st = calloc(1, sizeof(*st));
    ep->eng_state = st;
    int rc = st ? fr_cpu_alloc(ep, st, err)
                : FR_ERR(err, FERRY_ERR_NOMEM, "engine state");
    return fr_ep_segments(ep, 'r', rc, err);
}

static void fr_cpu_free(ferry_ep_t ep)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_ep_segments_close(ep);
    free(ep->send);
    ep->send = NULL;
    if (!c)
        return;
    for (int s = 0; s < FR_NSETS; s++) {
        free(c->rounds[s].comb_pos);
        free(c->rounds[s].pair_row);
        free(c->rounds[s].pair_off);
        free(c->rounds[s].comb_off);
        free(c->rounds[s].send_off);
    }
    free(c->qbuf);
    free(c->qscales);
    free(c->cnt_rank);
    free(c->pairs_rank);
    free(c->fill);
    free(c->rec_next);
    free(c->rcount);
    free(c->expert_fill);
    free(c->acc);
    free(c);
    ep->eng_state = NULL;
}

static int fr_cpu_sync(ferry_ep_t ep, void *stream)
{
    (void)ep;
    (void)stream;
    return FERRY_OK;
}

static int fr_cpu_check(ferry_ep_t ep)
{
    (void)ep;
    return FERRY_OK;
}

/* The CPU engine reads ep->mask itself (the API set it already). */
static int fr_cpu_mask_write(ferry_ep_t ep, int rank, int masked, void *stream)
{
    (void)ep;
    (void)rank;
    (void)masked;
    (void)stream;
    return FERRY_OK;
}

static int fr_cpu_mask_read(ferry_ep_t ep, int32_t *status, void *stream)
{
    (void)stream;
    memcpy(status, ep->mask, sizeof(int32_t) * (size_t)ep->N);
    return FERRY_OK;
}

const fr_engine_t fr_engine_cpu_ll = {
    .size = sizeof(fr_engine_t),
    .name = "cpu_ll",
    .device = FERRY_DEVICE_CPU,
    .mode = FERRY_MODE_LOW_LATENCY,
    .setup = fr_cpu_setup,
    .free = fr_cpu_free,
    .dispatch_send = fr_cpu_dispatch_send,
    .dispatch_recv = fr_cpu_dispatch_recv,
    .combine_send = fr_cpu_combine_send,
    .combine_recv = fr_cpu_combine_recv,
    .combine_signals = 1,
    .combine_logfmt = 1,
    .sync = fr_cpu_sync,
    .check = fr_cpu_check,
    .mask_write = fr_cpu_mask_write,
    .mask_read = fr_cpu_mask_read,
};
