/*
 * The high-throughput calls: routes, dispatch and combine on a context
 * created with FERRY_MODE_HIGH_THROUGHPUT. Arguments are checked here,
 * before anything is shared; then the engine.
 */
#include "api/api.h"
#include "core/ht_rec.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The HT argument structs are versioned by size: the current size or
 * more, or exactly the size before `stream` was added (stream is then
 * NULL); anything else is refused. */
#define FR_HT_SIZE_OK(have, type) \
    ((have) >= sizeof(type) || (have) == offsetof(type, stream))

/* A usable context in high-throughput mode. */
static int fr_ht_usable(ferry_ep_t ep, const char *call)
{
    int rc = fr_ep_usable(ep);
    if (rc)
        return rc;
    if (!ep->eng->route_create)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "%s: this context is in low-latency mode; create it with "
                          "mode = FERRY_MODE_HIGH_THROUGHPUT", call);
    return FERRY_OK;
}

int fr_check_route_args(const fr_layout_t *L, const ferry_route_in_t *in, int groupT,
                        fr_err_t *err)
{
    if (!FR_HT_SIZE_OK(in->size, ferry_route_in_t) &&
        in->size != offsetof(ferry_route_in_t, max_recv))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "in->size = %zu: set it to sizeof(ferry_route_in_t)", in->size);
    int T = in->num_tokens, Tmax = groupT > 0 ? groupT : L->T;
    if (T < 0 || T > Tmax)
        return FR_ERR(err, FERRY_ERR_INVALID, "num_tokens = %d: must be 0..max_tokens (%d)",
                      T, Tmax);
    if (T > 0 && !in->topk_idx)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk_idx: NULL pointer");
    if (in->expert_alignment < 0 || in->expert_alignment > (1 << 20))
        return FR_ERR(err, FERRY_ERR_INVALID, "expert_alignment = %d: must be 0..%d",
                      in->expert_alignment, 1 << 20);
    if (in->size >= sizeof(ferry_route_in_t) && in->max_recv < 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "max_recv = %d: must be 0 (exact route) or "
                      "the bound on rows received", in->max_recv);
    /* topk_idx's values are checked by the engine, as part of the
     * collective route (a bad one fails every rank's route_create, naming
     * the rank, and leaves the context usable) */
    return FERRY_OK;
}

int ferry_route_create(ferry_ep_t ep, const ferry_route_in_t *in, ferry_route_t *route)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_ht_usable(ep, "route_create");
    if (rc)
        return rc;
    if (!in)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "in: NULL pointer");
    if (!route)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "route: NULL pointer");
    *route = NULL;
    fr_err_t aerr;
    if ((rc = fr_check_route_args(&ep->L, in, ep->dp.G > 1 ? ep->dp.T : 0, &aerr)))
        return fr_ep_fail(ep, rc, "%s", aerr.msg);
    ferry_route_in_t cur; /* the engine sees the current struct */
    fr_args_current(&cur, sizeof(cur), in);
    int gT = cur.num_tokens, glo = 0, ghi = gT;
    if (ep->dp.G > 1) { /* this member's share of the group's tokens */
        fr_dp_share(gT, ep->dp.G, ep->dp.m, &glo, &ghi);
        cur.num_tokens = ghi - glo;
        if (cur.topk_idx)
            cur.topk_idx += (size_t)glo * (size_t)ep->L.K;
    }
    ferry_route_t r = calloc(1, sizeof(*r));
    if (!r)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "route");
    r->ep = ep;
    r->bound = cur.max_recv;
    r->gT = gT;
    r->glo = glo;
    rc = fr_check_stream(ep, cur.stream, "in->stream");
    if (rc == FERRY_OK)
        rc = ep->eng->route_create(ep, &cur, r);
    if (rc) {
        free(r);
        return rc;
    }
    *route = r;
    return FERRY_OK;
}

int ferry_route_counts(ferry_route_t route, int *num_recv, int32_t *expert_counts)
{
    if (!route)
        return FERRY_ERR_INVALID;
    if (expert_counts && route->bound > 0)
        return fr_ep_fail(route->ep, FERRY_ERR_STATE,
                          "route_counts: expert_counts of a bounded route (max_recv %d) are "
                          "written to its expert_counts_out", route->bound);
    if (num_recv)
        *num_recv = fr_route_rows(route);
    if (expert_counts)
        memcpy(expert_counts, route->ecnt, sizeof(int32_t) * (size_t)route->ep->L.El);
    return FERRY_OK;
}

int ferry_route_destroy(ferry_route_t route)
{
    if (!route)
        return FERRY_ERR_INVALID;
    route->ep->eng->route_free(route);
    free(route);
    return FERRY_OK;
}

/* Common start of dispatch and combine: context, mode, route, structs
 * (`in` of in_need bytes, or exactly one of in_old, a list ending with 0:
 * the sizes before `stream` and before later fields). */
static int fr_ht_call(ferry_ep_t ep, ferry_route_t route, const void *in, size_t in_need,
                      const size_t *in_old, const char *in_type, const void *out,
                      size_t out_need, const size_t *out_old, const char *out_type,
                      const char *call)
{
    int rc = fr_ht_usable(ep, call);
    if (rc)
        return rc;
    if (!route)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "route: NULL pointer");
    if (route->ep != ep)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "route: made on another context");
    if (!in)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "in: NULL pointer");
    if (!out)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out: NULL pointer");
    size_t have = *(const size_t *)in;
    if (!fr_args_size_taken(have, in_need, in_old))
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "in->size = %zu: set it to sizeof(%s)",
                          *(const size_t *)in, in_type);
    if (!fr_args_size_taken(*(const size_t *)out, out_need, out_old))
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out->size = %zu: set it to sizeof(%s)",
                          *(const size_t *)out, out_type);
    return FERRY_OK;
}

int ferry_ht_dispatch(ferry_ep_t ep, ferry_route_t route, const ferry_ht_dispatch_in_t *in,
                      const ferry_ht_dispatch_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_ht_call(ep, route, in, sizeof(*in),
                        (const size_t[]){offsetof(ferry_ht_dispatch_in_t, stream),
                                         offsetof(ferry_ht_dispatch_in_t, x_scales_stride),
                                         0},
                        "ferry_ht_dispatch_in_t", out, sizeof(*out),
                        (const size_t[]){offsetof(ferry_ht_dispatch_out_t, recv_topk_idx_i64),
                                         0},
                        "ferry_ht_dispatch_out_t", "ht_dispatch");
    if (rc)
        return rc;
    ferry_ht_dispatch_in_t cur; /* the engine sees the current structs */
    fr_args_current(&cur, sizeof(cur), in);
    in = &cur;
    ferry_ht_dispatch_out_t ocur;
    fr_args_current(&ocur, sizeof(ocur), out);
    out = &ocur;
    if (out->recv_topk_idx && out->recv_topk_idx_i64)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "recv_topk_idx and recv_topk_idx_i64: both given (at most one)");
    if (route->gT > 0 && !in->x)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "x: NULL pointer");
    if (in->x_scales && ep->L.H % 128 != 0)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "x_scales: fp8 rows need hidden to be a multiple of 128 "
                          "(hidden = %d)", ep->L.H);
    if (cur.x_scales_stride[0] == 0 && cur.x_scales_stride[1] == 0) {
        cur.x_scales_stride[0] = ep->L.H / 128; /* row-major */
        cur.x_scales_stride[1] = 1;
    } else if (in->x_scales) {
        int64_t s0 = cur.x_scales_stride[0], s1 = cur.x_scales_stride[1];
        if (s0 < 1 || s1 < 1)
            return fr_ep_fail(ep, FERRY_ERR_INVALID,
                              "x_scales_stride = {%lld, %lld}: both at least 1 (or both 0: "
                              "row-major)", (long long)s0, (long long)s1);
        if (fr_ht_scales_span(route->T, ep->L.H / 128, s0, s1) < 0)
            return fr_ep_fail(ep, FERRY_ERR_INVALID,
                              "x_scales_stride = {%lld, %lld}: the scales would span more "
                              "than 2^63 bytes", (long long)s0, (long long)s1);
    }
    if (route->glo > 0) { /* DP groups: this member's share of the group's rows */
        size_t lo = (size_t)route->glo;
        cur.x = (const uint8_t *)cur.x + lo * (cur.x_scales ? 1 : 2) * (size_t)ep->L.H;
        if (cur.x_scales)
            cur.x_scales += lo * (size_t)cur.x_scales_stride[0];
        if (cur.topk_weights)
            cur.topk_weights += lo * (size_t)ep->L.K;
    }
    int rows = fr_route_rows(route);
    if (rows > 0 && !out->recv_x)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "recv_x: NULL pointer (%d rows arrive)",
                          rows);
    if (rows > 0 && in->x_scales && !out->recv_x_scales)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "recv_x_scales: NULL pointer (x is fp8: x_scales given)");
    if (out->recv_topk_weights && !in->topk_weights)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "recv_topk_weights: given, but in->topk_weights is NULL");
    if ((rc = fr_check_stream(ep, in->stream, "in->stream")))
        return rc;
    return ep->eng->ht_dispatch(ep, route, in, out);
}

int ferry_ht_combine(ferry_ep_t ep, ferry_route_t route, const ferry_ht_combine_in_t *in,
                     const ferry_ht_combine_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_ht_call(ep, route, in, sizeof(*in),
                        (const size_t[]){offsetof(ferry_ht_combine_in_t, stream),
                                         offsetof(ferry_ht_combine_in_t, weights_sum),
                                         offsetof(ferry_ht_combine_in_t, bias),
                                         offsetof(ferry_ht_combine_in_t, sum_order), 0},
                        "ferry_ht_combine_in_t", out, sizeof(*out), (const size_t[]){0},
                        "ferry_ht_combine_out_t",
                        "ht_combine");
    if (rc)
        return rc;
    ferry_ht_combine_in_t cur; /* the engine sees the current struct */
    fr_args_current(&cur, sizeof(cur), in);
    in = &cur;
    if (cur.sum_order != FERRY_HT_SUM_RANKS && cur.sum_order != FERRY_HT_SUM_SLOTS)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "sum_order: %d, expected FERRY_HT_SUM_RANKS (0) or "
                          "FERRY_HT_SUM_SLOTS (1)", cur.sum_order);
    int rows = fr_route_rows(route);
    if (rows > 0 && !in->y)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "y: NULL pointer (%d rows to return)",
                          rows);
    if (route->gT > 0 && !out->out)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out->out: NULL pointer");
    if (route->T == 0) { /* no rows of bias to read */
        cur.bias[0] = cur.bias[1] = NULL;
    }
    if ((rc = fr_check_stream(ep, in->stream, "in->stream")))
        return rc;
    if (ep->dp.G <= 1)
        return ep->eng->ht_combine(ep, route, in, out);
    /* DP groups: this member's rows (where fr_dp_target says), then every
     * member's */
    ferry_ht_combine_out_t share = *out;
    size_t lo = (size_t)route->glo, H = (size_t)ep->L.H;
    fr_dp_target(ep, out->out, out->topk_weights, route->glo, &share.out, &share.topk_weights);
    for (int i = 0; i < 2; i++)
        if (cur.bias[i])
            cur.bias[i] = (const uint8_t *)cur.bias[i] + lo * 2 * H;
    if ((rc = fr_dp_begin(ep, in->stream, "ht_combine")) ||
        (rc = ep->eng->ht_combine(ep, route, in, &share)))
        return rc;
    return fr_dp_gather(ep, out->out, out->topk_weights, route->gT, in->stream, "ht_combine");
}
