/*
 * The round calls: a usable context, the round in the expected state,
 * arguments checked before any shared state is touched; then the engine.
 */
#include "api/api.h"

#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "core/logfmt.h"
#include "core/log.h"
#include "runtime/cuda_mem.h"

int fr_ep_usable(ferry_ep_t ep)
{
    if (!ep->failed && ep->eng->check(ep) != FERRY_OK)
        return ep->failed ? ep->failed : FERRY_ERR_INVALID;
    if (!ep->failed && fr_dp_check(ep) != FERRY_OK)
        return ep->failed ? ep->failed : FERRY_ERR_INVALID;
    if (!ep->failed)
        return FERRY_OK;
    /* the cause kept when the status became sticky: ep->err.msg holds the
     * last call's message, the very buffer this call writes */
    if (!ep->cause.msg[0])
        fr_ep_set_failed(ep, ep->failed);
    return fr_ep_fail(ep, ep->failed,
                      "the EP context failed earlier and cannot be used: %.400s",
                      ep->cause.msg);
}

/* A stream the context can run on. Where a fabric provider copies into
 * GPU memory with cudaMemcpy on the legacy default stream (shm with
 * FI_HMEM), a kernel waiting on a stream that waits for the legacy stream
 * would hold back the very copies it waits for. */
int fr_check_stream(ferry_ep_t ep, void *stream, const char *name)
{
    if (ep->rx_flush != FR_RX_FLUSH_COPIES)
        return FERRY_OK;
    int nb = fr_cuda_stream_nonblocking(stream);
    if (nb >= 1)
        return FERRY_OK;
    if (nb < 0)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s: not a CUDA stream of this device "
                          "(cudaStreamGetFlags failed)", name);
    return fr_ep_fail(ep, FERRY_ERR_INVALID,
                      "%s: the fabric provider copies into this rank's GPU memory on the CUDA "
                      "legacy default stream, so calls need a stream created with "
                      "cudaStreamNonBlocking (or set FERRY_FABRIC_HMEM=off)", name);
}

/* The round calls belong to the low-latency mode. */
static int fr_ll_only(ferry_ep_t ep, const char *call)
{
    if (ep->eng->route_create)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "%s: this context is in high-throughput mode: use "
                          "ferry_route_create, ferry_ht_dispatch and ferry_ht_combine",
                          call);
    return FERRY_OK;
}

static int fr_round_get(ferry_ep_t ep, uint64_t round, int want_state,
                        const char *call, fr_round_t **r)
{
    if (round == 0 || round >= ep->next_epoch + 1)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "%s: round = %llu was not returned by "
                          "ferry_dispatch_send", call,
                          (unsigned long long)round);
    fr_round_t *x = &ep->rounds[round % FR_NSETS];
    if (x->epoch != round)
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "%s: round %llu has already finished", call,
                          (unsigned long long)round);
    if (x->state != want_state) {
        static const char *names[] = {"finished", "dispatch_send",
                                      "dispatch_recv", "combine_send"};
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "%s: round %llu is after %s; calls go "
                          "dispatch_send, dispatch_recv, combine_send, "
                          "combine_recv", call, (unsigned long long)round,
                          names[x->state]);
    }
    *r = x;
    return FERRY_OK;
}

int fr_check_dispatch_args(const fr_layout_t *L, const ferry_dispatch_in_t *in,
                           int on_gpu, fr_err_t *err)
{
    if (in->size < sizeof(*in))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "in->size = %zu: set it to sizeof(ferry_dispatch_in_t)",
                      in->size);
    int T = in->num_tokens;
    if (on_gpu && in->num_tokens_dev)
        T = L->T; /* read on the device; checked there */
    if (T < 0 || T > L->T)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "num_tokens = %d: must be 0..max_tokens (%d)", T, L->T);
    if (T > 0 && !in->x)
        return FR_ERR(err, FERRY_ERR_INVALID, "x: NULL pointer");
    if (T > 0 && !in->topk_idx)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk_idx: NULL pointer");
    if (in->x_scales && !L->fp8)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_scales given but the dispatch dtype is bf16");
    if (L->nvfp4 && in->x_scales)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_scales given but the dispatch dtype is nvfp4 (pass bf16 x and "
                      "x_global_scale: ferry quantises)");
    if (!L->nvfp4 && in->x_global_scale)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_global_scale given but the dispatch dtype is %s (it is NVFP4's "
                      "encode scale)", L->fp8 ? "fp8" : "bf16");
    if (L->nvfp4 && !in->x_global_scale)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_global_scale: NULL pointer (dispatch dtype nvfp4: the encode scale, "
                      "the same on every rank)");
    if (L->nvfp4 && !on_gpu && !(*in->x_global_scale > 0.f && *in->x_global_scale < 3.4e38f))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_global_scale = %g: must be finite and > 0", (double)*in->x_global_scale);
    if (in->x_scales && L->sfmt == FERRY_SCALES_UE8M0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_scales given with scales_layout = FERRY_SCALES_UE8M0: UE8M0 holds "
                      "powers of two only, which the caller's scales need not be (pass bf16 x "
                      "and let fp8_round_scale quantise)");
    return FERRY_OK; /* topk_idx's values: the engines check them within the round */
}

/* DP groups: `in` (the group's tokens) checked against the group's
 * max_tokens and made this member's share in `share`; *in then points
 * there. */
static int fr_dp_share_in(ferry_ep_t ep, const ferry_dispatch_in_t **in,
                          ferry_dispatch_in_t *share)
{
    const ferry_dispatch_in_t *a = *in;
    if (ep->dp.G <= 1 || a->size < sizeof(*a))
        return FERRY_OK; /* the size is refused by the checks that follow */
    if (a->num_tokens_dev)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "num_tokens_dev: not with dp_size = %d (the group's tokens are split "
                          "on the host: pass num_tokens)", ep->dp.G);
    int T = a->num_tokens, lo, hi;
    if (T < 0 || T > ep->dp.T)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "num_tokens = %d: must be 0..max_tokens (%d)",
                          T, ep->dp.T);
    fr_dp_share(T, ep->dp.G, ep->dp.m, &lo, &hi);
    size_t xrow = (a->x_scales ? 1 : 2) * (size_t)ep->L.H;
    *share = *a;
    share->num_tokens = hi - lo;
    share->x = a->x ? (const uint8_t *)a->x + (size_t)lo * xrow : NULL;
    share->x_scales = a->x_scales ? a->x_scales + (size_t)lo * (size_t)(ep->L.H / 128) : NULL;
    share->topk_idx = a->topk_idx ? a->topk_idx + (size_t)lo * (size_t)ep->L.K : NULL;
    *in = share;
    return FERRY_OK;
}

/* dispatch_send's checks and the round slot it would take; nothing is
 * changed (fr_send_take does it once every check has passed). With DP
 * groups, *in becomes this member's share (in `share`). */
static int fr_send_begin(ferry_ep_t ep, const ferry_dispatch_in_t **inp,
                         ferry_dispatch_in_t *share, const void *round, const char *call,
                         fr_round_t **out)
{
    int rc = fr_ep_usable(ep);
    if (rc || (rc = fr_ll_only(ep, call)))
        return rc;
    if (!*inp)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "in: NULL pointer");
    if (!round)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "round: NULL pointer");
    if ((rc = fr_dp_share_in(ep, inp, share)))
        return rc;
    const ferry_dispatch_in_t *in = *inp;
    int on_gpu = ep->cfg.device == FERRY_DEVICE_CUDA;
    fr_err_t aerr;
    rc = fr_check_dispatch_args(&ep->L, in, on_gpu, &aerr);
    if (rc)
        return fr_ep_fail(ep, rc, "%s", aerr.msg);
    if ((rc = fr_check_stream(ep, in->stream, "in->stream")))
        return rc;
    uint64_t epoch = ep->next_epoch + 1;
    fr_round_t *r = &ep->rounds[epoch % FR_NSETS];
    if (r->state != FR_ROUND_FREE)
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "%s: rounds %llu and %llu are both in "
                          "flight; finish round %llu with combine_recv first", call,
                          (unsigned long long)r->epoch,
                          (unsigned long long)(epoch - 1),
                          (unsigned long long)r->epoch);
    if (ep->proxy.running && !on_gpu) {
        rc = fr_proxy_wait_set(ep, (int)(epoch % FR_NSETS));
        if (rc)
            return rc;
    }
    *out = r;
    return FERRY_OK;
}

static void fr_send_take(ferry_ep_t ep, fr_round_t *r, const ferry_dispatch_in_t *group,
                         const ferry_dispatch_in_t *in)
{
    r->epoch = ++ep->next_epoch;
    r->T = in->num_tokens;
    r->gT = group->num_tokens;
    r->glo = 0;
    if (ep->dp.G > 1) {
        int hi;
        fr_dp_share(r->gT, ep->dp.G, ep->dp.m, &r->glo, &hi);
    }
}

/* A dispatch_in struct of the size before x_global_scale, as the current
 * one in `cur` (that field NULL); any other size goes on to the checks. */
static const ferry_dispatch_in_t *fr_din_current(const ferry_dispatch_in_t *in,
                                                 ferry_dispatch_in_t *cur)
{
    if (!in || in->size != offsetof(ferry_dispatch_in_t, x_global_scale))
        return in;
    fr_args_current(cur, sizeof(*cur), in);
    return cur;
}

/* The caller's combine_in as the current struct in `cur` (a struct of the
 * size before `signals` has none), its overlap fields checked. */
static int fr_cin_current(ferry_ep_t ep, const ferry_combine_in_t *in, ferry_combine_in_t *cur)
{
    fr_args_current(cur, sizeof(*cur), in);
    if (!cur->expert_y)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "expert_y: NULL pointer");
    if (cur->num_sms < 0)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "num_sms = %d: the most SMs this combine takes, or 0 for the "
                          "context's (%d)", (int)cur->num_sms, ep->cfg.num_sms);
    if (cur->format != FERRY_COMBINE_BF16 && cur->format != FERRY_COMBINE_LOGFMT)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "format = %d: FERRY_COMBINE_BF16 (0) or FERRY_COMBINE_LOGFMT (1)",
                          (int)cur->format);
    if (cur->format == FERRY_COMBINE_LOGFMT) {
        /* at most 64 chunks: the CUDA receive keeps a row's cast chunks in
         * 64 bits (and FR_LF_MAXDIV divisions follow) */
        if (ep->L.H % 512 || ep->L.H / fr_lf_chunk(ep->L.H) > 64)
            return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                              "format = FERRY_COMBINE_LOGFMT: hidden = %d; LogFMT takes a "
                              "multiple of 512, at most 64 chunks (of 1024 channels, or 512 "
                              "where hidden is not a multiple of 1024)", ep->L.H);
        if (!ep->eng->combine_logfmt)
            return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                              "format = FERRY_COMBINE_LOGFMT: the %s engine has no LogFMT "
                              "combine", ep->eng->name);
        if (ep->dp.G > 1)
            return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                              "format = FERRY_COMBINE_LOGFMT: not with DP groups "
                              "(dp_group_size %d)", ep->dp.G);
        if (ep->cfg.device == FERRY_DEVICE_CUDA && ep->nfabric > 0)
            return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                              "format = FERRY_COMBINE_LOGFMT: GPU ranks with peers on the "
                              "fabric path (%d) are not served yet (CPU ranks are; GPU ranks "
                              "of one node are)", ep->nfabric);
    }
    if (!cur->signals) {
        if (cur->sent_rows)
            return fr_ep_fail(ep, FERRY_ERR_INVALID,
                              "sent_rows given without signals (it counts the rows sent "
                              "past their signals)");
        return FERRY_OK;
    }
    if (cur->signal_block < 0)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "signal_block = %d: rows per signal, > 0, or 0 for one signal "
                          "per expert", (int)cur->signal_block);
    if (ep->dp.G > 1)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "signals: the overlapped combine does not run with DP groups "
                          "(dp_group_size %d)", ep->dp.G);
    if (!ep->eng->combine_signals)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED,
                          "signals: the %s engine has no overlapped combine", ep->eng->name);
    return FERRY_OK;
}

int ferry_dispatch_send(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                        uint64_t *round)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    ferry_dispatch_in_t in_cur;
    in = fr_din_current(in, &in_cur);
    fr_round_t *r = NULL;
    const ferry_dispatch_in_t *group = in;
    ferry_dispatch_in_t share;
    int rc = fr_send_begin(ep, &in, &share, round, "dispatch_send", &r);
    if (rc)
        return rc;
    fr_send_take(ep, r, group, in);
    rc = ep->eng->dispatch_send(ep, r, in);
    if (rc)
        return rc;
    r->state = FR_ROUND_SENT;
    *round = r->epoch;
    return FERRY_OK;
}

/* An argument struct of at least `need` bytes (its first field is its
 * size), named `name` in the message. */
static int fr_check_args_size(ferry_ep_t ep, const void *args, size_t need, const char *name,
                              const char *type)
{
    if (!args)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s: NULL pointer", name);
    size_t have = *(const size_t *)args;
    if (have < need)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s->size = %zu: set it to sizeof(%s)", name,
                          have, type);
    return FERRY_OK;
}

/* Common start of the calls on an existing round: a usable context, the
 * round in the expected state, an argument struct of at least `need`
 * bytes (its first field is its size). */
static int fr_round_call(ferry_ep_t ep, uint64_t round, int state,
                         const char *call, const void *args, size_t need,
                         const char *args_name, const char *type,
                         fr_round_t **r)
{
    int rc = fr_ep_usable(ep);
    if (rc || (rc = fr_ll_only(ep, call)))
        return rc;
    if ((rc = fr_round_get(ep, round, state, call, r)))
        return rc;
    return fr_check_args_size(ep, args, need, args_name, type);
}

void fr_args_current(void *cur, size_t cur_size, const void *args)
{
    size_t have = *(const size_t *)args;
    memset(cur, 0, cur_size);
    memcpy(cur, args, have < cur_size ? have : cur_size);
    *(size_t *)cur = cur_size;
}

int fr_args_size_taken(size_t have, size_t cur, const size_t *old)
{
    if (have >= cur)
        return 1;
    for (; *old; old++)
        if (have == *old)
            return 1;
    return 0;
}

/* The output structs as the engines see them: the caller's (checked as at
 * least `old` bytes) copied into `cur`, the current layout, fields it is
 * too old to have zeroed. Its size must be the current one (or larger),
 * or exactly `old`, the size before wait_cost, or `old2` (when not 0), the
 * size before the field after it: anything between would split a
 * pointer. */
#define FR_DOUT_MIN offsetof(ferry_dispatch_out_t, wait_cost)
#define FR_DOUT_WC offsetof(ferry_dispatch_out_t, recv_stats)
#define FR_COUT_MIN offsetof(ferry_combine_out_t, wait_cost)
#define FR_CIN_MIN offsetof(ferry_combine_in_t, signals)
static int fr_out_current(ferry_ep_t ep, const void *out, size_t old, size_t old2, void *cur,
                          size_t cur_size, const char *type)
{
    size_t have = *(const size_t *)out;
    if (!fr_args_size_taken(have, cur_size, (const size_t[]){old, old2, 0}))
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out->size = %zu: set it to sizeof(%s)", have,
                          type);
    fr_args_current(cur, cur_size, out);
    return FERRY_OK;
}

static int fr_check_dispatch_out(ferry_ep_t ep, const ferry_dispatch_out_t *out)
{
    if (!out->expert_x)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "expert_x: NULL pointer");
    if (!out->expert_num_tokens)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "expert_num_tokens: NULL pointer");
    if ((ep->L.fp8 || ep->L.nvfp4) && !out->expert_x_scales)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "expert_x_scales: NULL pointer (%s dispatch)",
                          ep->L.nvfp4 ? "nvfp4" : "fp8");
    return fr_check_stream(ep, out->stream, "out->stream");
}

int ferry_dispatch_recv(ferry_ep_t ep, uint64_t round,
                        const ferry_dispatch_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_SENT, "dispatch_recv", out, FR_DOUT_MIN, "out",
                           "ferry_dispatch_out_t", &r);
    ferry_dispatch_out_t cur;
    if (rc ||
        (rc = fr_out_current(ep, out, FR_DOUT_MIN, FR_DOUT_WC, &cur, sizeof(cur),
                             "ferry_dispatch_out_t")) ||
        (rc = fr_check_dispatch_out(ep, &cur)))
        return rc;
    rc = ep->eng->dispatch_recv(ep, r, &cur);
    if (rc)
        return rc;
    r->state = FR_ROUND_RECVD;
    return FERRY_OK;
}

int ferry_combine_send(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_in_t *in)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_RECVD, "combine_send", in, FR_CIN_MIN, "in",
                           "ferry_combine_in_t", &r);
    ferry_combine_in_t cur;
    if (rc || (rc = fr_cin_current(ep, in, &cur)))
        return rc;
    in = &cur;
    if ((rc = fr_check_stream(ep, in->stream, "in->stream")))
        return rc;
    rc = ep->eng->combine_send(ep, r, in);
    if (rc)
        return rc;
    r->state = FR_ROUND_COMBINED;
    return FERRY_OK;
}

/* Checks the caller's `out` (the group's tokens, r->gT); with DP groups
 * `cur` becomes this member's rows of it. */
static int fr_check_combine_out(ferry_ep_t ep, const fr_round_t *r, ferry_combine_out_t *cur)
{
    if (r->gT > 0 && !cur->out)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out->out: NULL pointer");
    if (r->gT > 0 && !cur->topk_weights)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "topk_weights: NULL pointer");
    if (ep->dp.G > 1 && r->gT > 0) { /* the weights are an input: this member's rows */
        float *none;
        fr_dp_target(ep, cur->out, NULL, r->glo, &cur->out, &none);
        cur->topk_weights += (size_t)r->glo * (size_t)ep->L.K;
    }
    return fr_check_stream(ep, cur->stream, "out->stream");
}

/* DP groups: the engine's combine between these two (begin: CUDA, wait
 * until the members have read the previous gather from this member's
 * region; combined: every member's rows into out). */
static int fr_dp_combining(ferry_ep_t ep, void *stream, const char *call)
{
    return ep->dp.G > 1 ? fr_dp_begin(ep, stream, call) : FERRY_OK;
}

static int fr_dp_combined(ferry_ep_t ep, const fr_round_t *r, const ferry_combine_out_t *out,
                          void *stream, const char *call)
{
    if (ep->dp.G <= 1)
        return FERRY_OK;
    return fr_dp_gather(ep, out->out, NULL, r->gT, stream, call);
}

int ferry_combine_recv(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_COMBINED, "combine_recv", out, FR_COUT_MIN, "out",
                           "ferry_combine_out_t", &r);
    ferry_combine_out_t cur;
    if (rc ||
        (rc = fr_out_current(ep, out, FR_COUT_MIN, 0, &cur, sizeof(cur), "ferry_combine_out_t")) ||
        (rc = fr_check_combine_out(ep, r, &cur)) ||
        (rc = fr_dp_combining(ep, cur.stream, "combine_recv")))
        return rc;
    rc = ep->eng->combine_recv(ep, r, &cur);
    if (rc)
        return rc;
    r->state = FR_ROUND_FREE;
    return fr_dp_combined(ep, r, out, cur.stream, "combine_recv");
}

int ferry_ep_sync(ferry_ep_t ep, void *stream)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    if (ep->failed)
        return ep->failed;
    int rc = ep->eng->sync(ep, stream);
    return rc ? rc : fr_dp_check(ep);
}

/* The one-shot forms: every check of both halves first (a bad `out` starts
 * no round), then the engine's one-launch operation where it has one, else
 * its send and receive. */
int ferry_dispatch(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                   const ferry_dispatch_out_t *out, uint64_t *round)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    /* every check of both halves before anything starts */
    ferry_dispatch_in_t in_cur;
    in = fr_din_current(in, &in_cur);
    uint64_t rr = 0;
    fr_round_t *r = NULL;
    const ferry_dispatch_in_t *group = in;
    ferry_dispatch_in_t share;
    int rc = fr_send_begin(ep, &in, &share, &rr, "dispatch", &r);
    ferry_dispatch_out_t cur;
    if (rc || (rc = fr_check_args_size(ep, out, FR_DOUT_MIN, "out", "ferry_dispatch_out_t")) ||
        (rc = fr_out_current(ep, out, FR_DOUT_MIN, FR_DOUT_WC, &cur, sizeof(cur),
                             "ferry_dispatch_out_t")) ||
        (rc = fr_check_dispatch_out(ep, &cur)))
        return rc;
    out = &cur;
    if (ep->eng->dispatch && out->stream != in->stream)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "out->stream differs from in->stream: ferry_dispatch runs on one "
                          "stream (use dispatch_send and dispatch_recv for two)");
    fr_send_take(ep, r, group, in);
    if (ep->eng->dispatch) {
        rc = ep->eng->dispatch(ep, r, in, out);
    } else {
        rc = ep->eng->dispatch_send(ep, r, in);
        if (rc == FERRY_OK) {
            r->state = FR_ROUND_SENT;
            rc = ep->eng->dispatch_recv(ep, r, out);
        }
    }
    if (rc)
        return rc;
    r->state = FR_ROUND_RECVD;
    if (round)
        *round = r->epoch;
    return FERRY_OK;
}

int ferry_combine(ferry_ep_t ep, uint64_t round, const ferry_combine_in_t *in,
                  const ferry_combine_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    /* every check of both halves before anything starts */
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_RECVD, "combine", in, FR_CIN_MIN, "in",
                           "ferry_combine_in_t", &r);
    ferry_combine_out_t cur;
    ferry_combine_in_t in_cur;
    if (rc || (rc = fr_cin_current(ep, in, &in_cur)) ||
        (rc = fr_check_args_size(ep, out, FR_COUT_MIN, "out", "ferry_combine_out_t")) ||
        (rc = fr_out_current(ep, out, FR_COUT_MIN, 0, &cur, sizeof(cur), "ferry_combine_out_t")) ||
        (rc = fr_check_combine_out(ep, r, &cur)))
        return rc;
    const ferry_combine_out_t *group = out;
    out = &cur;
    in = &in_cur;
    if ((rc = fr_check_stream(ep, in->stream, "in->stream")))
        return rc;
    if (ep->eng->combine && out->stream != in->stream)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "out->stream differs from in->stream: ferry_combine runs on one "
                          "stream (use combine_send and combine_recv for two)");
    if ((rc = fr_dp_combining(ep, out->stream, "combine")))
        return rc;
    if (ep->eng->combine) {
        rc = ep->eng->combine(ep, r, in, out);
    } else {
        rc = ep->eng->combine_send(ep, r, in);
        if (rc == FERRY_OK) {
            r->state = FR_ROUND_COMBINED;
            rc = ep->eng->combine_recv(ep, r, out);
        }
    }
    if (rc)
        return rc;
    r->state = FR_ROUND_FREE;
    return fr_dp_combined(ep, r, group, out->stream, "combine");
}
