/*
 * GPU ranks through a host engine: the high-throughput calls of CUDA ranks
 * whose peers are on the fabric path (other nodes, or FERRY_TRANSPORT=
 * fabric), run by the CPU engine of the same mode on pinned host copies
 * of the caller's device buffers. Every rank of such a context runs the
 * CPU engine's protocol (every rank has fabric peers then), so ranks meet
 * on one wire format; the node's own ranks reach each other through host
 * shared memory, the others through the fabric.
 *
 * Each call copies its device inputs to a pinned staging area on the
 * caller's stream and waits for them, runs the host engine, then copies
 * the outputs back and waits again: the call returns with its outputs in
 * place, like the CPU engine's, and cannot be captured in a CUDA graph
 * (refused, naming the call). It is the fallback that makes GPU ranks
 * work across nodes; the data crosses PCIe twice per call
 * (docs/architecture.md, "High-throughput mode across nodes").
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/ht_rec.h"
#include "core/log.h"
#include "engines/engine.h"
#include "runtime/cuda_mem.h"

typedef struct fr_staged {
    const fr_engine_t *host; /* the CPU engine of the context's mode */
    uint8_t *buf;            /* pinned staging area */
    size_t cap;
} fr_staged_t;

#define FR_STAGE_ALIGN 256
#define FR_STAGE_MAX 12 /* pieces of one call */

/* One call's pieces in the staging area: device pointer (NULL: not
 * given), size, offset. A piece given with no bytes (a rank with no
 * tokens) still gets a host address: NULL or not tells the host engine
 * what the caller passed (x_scales: fp8 or bf16). */
typedef struct fr_stage_plan {
    int n;
    void *dev[FR_STAGE_MAX];
    size_t len[FR_STAGE_MAX], off[FR_STAGE_MAX];
    size_t total;
} fr_stage_plan_t;

static fr_staged_t *fr_staged(ferry_ep_t ep)
{
    return (fr_staged_t *)ep->eng_aux;
}

/* Add a piece (a NULL device pointer: absent, nothing copied); its index. */
static int fr_stage_add(fr_stage_plan_t *p, const void *dev, size_t len)
{
    int i = p->n++;
    p->dev[i] = (void *)(uintptr_t)dev;
    p->len[i] = dev ? len : 0;
    p->off[i] = p->total;
    p->total += (p->len[i] + FR_STAGE_ALIGN - 1) / FR_STAGE_ALIGN * FR_STAGE_ALIGN;
    return i;
}

/* The staging area grown to hold the plan. */
static int fr_stage_fit(ferry_ep_t ep, const fr_stage_plan_t *p)
{
    fr_staged_t *s = fr_staged(ep);
    if (s->buf && p->total <= s->cap)
        return FERRY_OK;
    fr_err_t err = {{0}};
    void *h = NULL, *d = NULL;
    size_t want = p->total + p->total / 4 + FR_STAGE_ALIGN; /* never 0 */
    if (fr_cuda_host_alloc(want, &h, &d, &err) != FERRY_OK)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "staging %zu bytes of host memory: %s", want,
                          err.msg);
    if (s->buf)
        fr_cuda_host_free(s->buf);
    s->buf = (uint8_t *)h;
    s->cap = want;
    return FERRY_OK;
}

/* Piece i's host address in the staging area (NULL for an absent piece). */
static void *fr_stage_host(ferry_ep_t ep, const fr_stage_plan_t *p, int i)
{
    return p->dev[i] ? fr_staged(ep)->buf + p->off[i] : NULL;
}

/* Pieces [lo, hi) copied device -> host (to_host) or host -> device, on
 * `stream`, then waited for. part (optional): how many bytes of each
 * piece to copy (at most its size; the rest of the caller's buffer is not
 * written). */
static int fr_stage_copy(ferry_ep_t ep, const fr_stage_plan_t *p, int lo, int hi, int to_host,
                         void *stream, const size_t *part)
{
    void *dst[FR_STAGE_MAX];
    const void *src[FR_STAGE_MAX];
    size_t len[FR_STAGE_MAX];
    int n = 0;
    for (int i = lo; i < hi; i++) {
        void *h = fr_stage_host(ep, p, i);
        dst[n] = to_host ? h : p->dev[i];
        src[n] = to_host ? (const void *)p->dev[i] : h;
        len[n] = part ? part[i - lo] : p->len[i];
        if (len[n] > p->len[i])
            len[n] = p->len[i];
        n++;
    }
    fr_err_t err = {{0}};
    int rc = fr_cuda_copies(stream, n, dst, src, len, &err);
    return rc ? fr_ep_fail(ep, rc, "%s", err.msg) : FERRY_OK;
}

static int fr_stage_uncaptured(ferry_ep_t ep, void *stream, const char *call)
{
    if (!fr_cuda_capturing(stream))
        return FERRY_OK;
    return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                      "%s: this context's peers are on the fabric path, where GPU ranks' "
                      "high-throughput calls go through host copies and wait for them: they "
                      "cannot be captured in a CUDA graph", call);
}

static int fr_staged_setup(ferry_ep_t ep, fr_err_t *err)
{
    fr_staged_t *s = (fr_staged_t *)calloc(1, sizeof(*s));
    if (!s)
        return FR_ERR(err, FERRY_ERR_NOMEM, "staging state");
    s->host = fr_engine_find(FERRY_DEVICE_CPU, ep->cfg.mode);
    ep->eng_aux = s;
    if (!s->host)
        return FR_ERR(err, FERRY_ERR_INTERNAL, "no host engine for mode %d", (int)ep->cfg.mode);
    FR_LOG_INFO(FR_SUB_INIT, "GPU rank with peers on the fabric path: high-throughput calls "
                "staged through pinned host memory, run by engine %s", s->host->name);
    return s->host->setup(ep, err);
}

static void fr_staged_free(ferry_ep_t ep)
{
    fr_staged_t *s = fr_staged(ep);
    if (!s)
        return;
    if (s->host)
        s->host->free(ep);
    if (s->buf)
        fr_cuda_host_free(s->buf);
    free(s);
    ep->eng_aux = NULL;
}

static int fr_staged_check(ferry_ep_t ep)
{
    return fr_staged(ep)->host->check(ep);
}

static int fr_staged_sync(ferry_ep_t ep, void *stream)
{
    fr_err_t err = {{0}};
    int rc = fr_cuda_copies(stream, 0, NULL, NULL, NULL, &err); /* waits for the stream */
    if (rc)
        return fr_ep_fail(ep, rc, "%s", err.msg);
    return fr_staged_check(ep);
}

static int fr_staged_route_create(ferry_ep_t ep, const ferry_route_in_t *in,
                                  ferry_route_t route)
{
    int rc = fr_stage_uncaptured(ep, in->stream, "route_create");
    if (rc)
        return rc;
    const fr_layout_t *L = &ep->L;
    fr_stage_plan_t p = {0};
    int T = in->num_tokens;
    int ii = fr_stage_add(&p, in->topk_idx, (size_t)T * L->K * sizeof(int64_t));
    /* a bounded route's counts go to the caller's device memory; an exact
     * route leaves them alone (as the GPU engine does) */
    int bounded = in->max_recv > 0;
    int io = fr_stage_add(&p, bounded ? in->num_recv_out : NULL, sizeof(int32_t));
    int ic = fr_stage_add(&p, bounded ? in->expert_counts_out : NULL,
                          (size_t)L->El * sizeof(int32_t));
    if ((rc = fr_stage_fit(ep, &p)) || (rc = fr_stage_copy(ep, &p, ii, ii + 1, 1, in->stream,
                                                          NULL)))
        return rc;
    ferry_route_in_t h = *in;
    h.topk_idx = (const int64_t *)fr_stage_host(ep, &p, ii);
    h.num_recv_out = (int32_t *)fr_stage_host(ep, &p, io);
    h.expert_counts_out = (int32_t *)fr_stage_host(ep, &p, ic);
    h.stream = NULL;
    /* topk_idx's values: checked by the host engine within the exchange */
    if ((rc = fr_staged(ep)->host->route_create(ep, &h, route)))
        return rc;
    return fr_stage_copy(ep, &p, io, ic + 1, 0, in->stream, NULL);
}

static void fr_staged_route_free(ferry_route_t route)
{
    fr_staged(route->ep)->host->route_free(route);
}

static int fr_staged_dispatch(ferry_ep_t ep, ferry_route_t route,
                              const ferry_ht_dispatch_in_t *in,
                              const ferry_ht_dispatch_out_t *out)
{
    int rc = fr_stage_uncaptured(ep, in->stream, "ht_dispatch");
    if (rc)
        return rc;
    const fr_layout_t *L = &ep->L;
    size_t T = (size_t)route->T, R = (size_t)fr_route_rows(route), K = (size_t)L->K;
    size_t H = (size_t)L->H, S = H / 128, eb = in->x_scales ? 1 : 2;
    fr_stage_plan_t p = {0};
    /* inputs, then outputs (in the struct's order) */
    int ix = fr_stage_add(&p, in->x, T * H * eb);
    /* the scales' span under their strides (the host copy keeps them;
     * ferry_ht_dispatch checked it fits) */
    size_t span = T > 0 && S > 0 ? (size_t)fr_ht_scales_span((int64_t)T, (int64_t)S,
                                                             in->x_scales_stride[0],
                                                             in->x_scales_stride[1])
                                 : 0;
    fr_stage_add(&p, in->x_scales, span * 4);
    int iw = fr_stage_add(&p, in->topk_weights, T * K * 4);
    int ox = fr_stage_add(&p, out->recv_x, R * H * eb);
    fr_stage_add(&p, in->x_scales ? out->recv_x_scales : NULL, R * S * 4);
    /* recv_topk_idx, int32 or int64 (at most one is given) */
    size_t ib = out->recv_topk_idx_i64 ? 8 : 4;
    fr_stage_add(&p, out->recv_topk_idx_i64 ? (void *)out->recv_topk_idx_i64
                                            : (void *)out->recv_topk_idx, R * K * ib);
    fr_stage_add(&p, out->recv_topk_weights, R * K * 4);
    fr_stage_add(&p, out->recv_src_rank, R * 4);
    int oe = fr_stage_add(&p, out->recv_src_token, R * 4);
    if ((rc = fr_stage_fit(ep, &p)) ||
        (rc = fr_stage_copy(ep, &p, ix, iw + 1, 1, in->stream, NULL)))
        return rc;
    ferry_ht_dispatch_in_t hi = *in;
    ferry_ht_dispatch_out_t ho = *out;
    hi.x = fr_stage_host(ep, &p, ix);
    hi.x_scales = (const float *)fr_stage_host(ep, &p, ix + 1);
    hi.topk_weights = (const float *)fr_stage_host(ep, &p, iw);
    hi.stream = NULL;
    ho.recv_x = fr_stage_host(ep, &p, ox);
    ho.recv_x_scales = (float *)fr_stage_host(ep, &p, ox + 1);
    if (out->recv_topk_idx_i64)
        ho.recv_topk_idx_i64 = (int64_t *)fr_stage_host(ep, &p, ox + 2);
    else
        ho.recv_topk_idx = (int32_t *)fr_stage_host(ep, &p, ox + 2);
    ho.recv_topk_weights = (float *)fr_stage_host(ep, &p, ox + 3);
    ho.recv_src_rank = (int32_t *)fr_stage_host(ep, &p, ox + 4);
    ho.recv_src_token = (int32_t *)fr_stage_host(ep, &p, oe);
    if ((rc = fr_staged(ep)->host->ht_dispatch(ep, route, &hi, &ho)))
        return rc;
    /* a bounded route's padding rows: recv_x and its scales not written */
    size_t real = (size_t)route->num_recv < R ? (size_t)route->num_recv : R;
    size_t part[6] = {real * H * eb, real * S * 4, R * K * ib, R * K * 4, R * 4, R * 4};
    return fr_stage_copy(ep, &p, ox, oe + 1, 0, in->stream, part);
}

static int fr_staged_combine(ferry_ep_t ep, ferry_route_t route,
                             const ferry_ht_combine_in_t *in, const ferry_ht_combine_out_t *out)
{
    int rc = fr_stage_uncaptured(ep, in->stream, "ht_combine");
    if (rc)
        return rc;
    const fr_layout_t *L = &ep->L;
    size_t T = (size_t)route->T, R = (size_t)fr_route_rows(route), K = (size_t)L->K;
    size_t H = (size_t)L->H;
    fr_stage_plan_t p = {0};
    int iy = fr_stage_add(&p, in->y, R * H * 2);
    int iw = fr_stage_add(&p, in->topk_weights, R * K * 4);
    int ib0 = fr_stage_add(&p, in->bias[0], T * H * 2);
    int ib1 = fr_stage_add(&p, in->bias[1], T * H * 2);
    int oo = fr_stage_add(&p, out->out, T * H * 2);
    int ow = fr_stage_add(&p, out->topk_weights, T * K * 4);
    if ((rc = fr_stage_fit(ep, &p)) ||
        (rc = fr_stage_copy(ep, &p, iy, ib1 + 1, 1, in->stream, NULL)))
        return rc;
    ferry_ht_combine_in_t hi = *in;
    ferry_ht_combine_out_t ho = *out;
    hi.y = fr_stage_host(ep, &p, iy);
    hi.topk_weights = (const float *)fr_stage_host(ep, &p, iw);
    hi.bias[0] = fr_stage_host(ep, &p, ib0);
    hi.bias[1] = fr_stage_host(ep, &p, ib1);
    hi.stream = NULL;
    ho.out = fr_stage_host(ep, &p, oo);
    ho.topk_weights = (float *)fr_stage_host(ep, &p, ow);
    if ((rc = fr_staged(ep)->host->ht_combine(ep, route, &hi, &ho)))
        return rc;
    return fr_stage_copy(ep, &p, oo, ow + 1, 0, in->stream, NULL);
}

const fr_engine_t fr_engine_staged_ht = {
    .size = sizeof(fr_engine_t),
    .name = "staged_ht",
    .device = FERRY_DEVICE_CUDA,
    .mode = FERRY_MODE_HIGH_THROUGHPUT,
    .setup = fr_staged_setup,
    .free = fr_staged_free,
    .sync = fr_staged_sync,
    .check = fr_staged_check,
    .route_create = fr_staged_route_create,
    .route_free = fr_staged_route_free,
    .ht_dispatch = fr_staged_dispatch,
    .ht_combine = fr_staged_combine,
};
