/*
 * CPU twins of the dispatch kernels.
 *
 * dispatch_send: route every token to each rank holding one of its experts,
 * once per rank (deduplicated), quantising bf16 -> fp8 first when asked.
 * Records go straight into the peer's receive slice (self, shared memory:
 * the twin of NVLink stores) or into the send region for the proxy
 * (fabric), destination by destination, fabric peers first. The slice
 * header (count, pairs, where replies go) is written last, then the flag
 * is published with a release store, or the proxy posts the write.
 *
 * dispatch_recv: wait for every sender's flag, validate each slice, lay the
 * tokens out per local expert in (sender, record, k) order, senders taken
 * from this rank on: rank r's rows come from r, r + 1, ..., N - 1, 0, ...,
 * r - 1 (its own tokens first).
 *
 * A masked rank (ep->mask) is sent nothing and waited for never; slots
 * whose expert lives there count as -1.
 */
#include <string.h>

#include "engines/cpu_ll/cpu_ll.h"
#include "core/quant.h"

/* Quantise T tokens of bf16 into fp8 e4m3 with one scale per 128 channels. */
static void fr_quantize_fp8(const fr_layout_t *L, int T, const uint16_t *x,
                            uint8_t *q, float *scales, int round)
{
    int H = L->H, nb = H / FR_FP8_BLOCK;
    for (int t = 0; t < T; t++)
        for (int b = 0; b < nb; b++)
            fr_quant_block_r(x + (size_t)t * H + b * FR_FP8_BLOCK,
                             q + (size_t)t * H + b * FR_FP8_BLOCK,
                             &scales[(size_t)t * nb + b], round);
}

/* Quantise T tokens of bf16 into NVFP4 with encode scale gs: H/2 bytes of
 * codes and H/16 scale bytes per token (the record's nscales words). */
static void fr_quantize_nvfp4(const fr_layout_t *L, int T, const uint16_t *x, float gs,
                              uint8_t *q, uint8_t *scales)
{
    int H = L->H, nb = H / FR_NVFP4_BLOCK;
    for (int t = 0; t < T; t++)
        for (int b = 0; b < nb; b++)
            fr_nvfp4_block(x + (size_t)t * H + b * FR_NVFP4_BLOCK,
                           gs, q + (size_t)t * (H / 2) + b * (FR_NVFP4_BLOCK / 2),
                           scales + (size_t)t * nb + b);
}

/* Is row[k] the first of the token's experts that lives on rank d? */
static inline int fr_first_on_rank(const int64_t *row, int k, int El)
{
    int d = (int)(row[k] / El);
    for (int j = 0; j < k; j++)
        if (row[j] >= 0 && row[j] / El == d)
            return 0;
    return 1;
}

static inline uint8_t *fr_dslice_dst(ferry_ep_t ep, int set, int d)
{
    const fr_layout_t *L = &ep->L;
    if (ep->path[d] == FR_PATH_FABRIC)
        return ep->send + fr_off_dsend(L, set, d);
    return ep->peer_seg[d] + fr_off_drecv(L, set, ep->rank);
}

/* Destination d's records, in token order: a token's first expert on d
 * emits the record, which lists the token's experts there in k order. */
static void fr_pack_dest(ferry_ep_t ep, fr_cpu_round_t *cr, int d, int set,
                         const int64_t *idx, int T, const uint8_t *tok, const float *scales)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    const fr_layout_t *L = &ep->L;
    int K = L->K, El = L->El;
    size_t scale_bytes = scales ? 4ull * L->nscales : 0;
    uint8_t *base = fr_dslice_dst(ep, set, d);
    for (int t = 0; t < T; t++) {
        const int64_t *row = idx + (size_t)t * K;
        int32_t *cp = cr->comb_pos + (size_t)t * K;
        int k = 0;
        while (k < K && (row[k] < 0 || row[k] / El != d))
            k++;
        if (k == K)
            continue;
        uint8_t *rec = base + fr_off_record(L, (uint32_t)c->rec_next[d]++);
        fr_rec_hdr_t *h = (fr_rec_hdr_t *)rec;
        uint16_t n = 0;
        h->pair = (uint32_t)(c->fill[d] - (int32_t)cr->send_off[d]);
        for (int j = k; j < K; j++) {
            if (row[j] < 0 || row[j] / El != d)
                continue;
            h->le[n++] = (uint16_t)(row[j] % El);
            cp[j] = c->fill[d]++;
        }
        h->token = (uint32_t)t;
        h->nexp = n;
        h->reserved = 0;
        memcpy(rec + L->rec_hdr, tok + (size_t)t * L->tok_bytes, L->tok_bytes);
        if (scale_bytes)
            memcpy(rec + L->rec_hdr + L->tok_bytes, scales + (size_t)t * L->nscales,
                   scale_bytes);
    }
}

/* Destination d's slice header, then its flag (local) or its write (the
 * proxy, at once). bad >= 0: this rank's topk_idx entry `bad` (t * K + k)
 * was bad; the slice says so and holds no records. */
static int fr_publish_dest(ferry_ep_t ep, fr_round_t *r, int d, int set, int bad)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    const fr_layout_t *L = &ep->L;
    fr_slice_hdr_t *h = (fr_slice_hdr_t *)fr_dslice_dst(ep, set, d);
    memset(h, 0, sizeof(*h));
    h->sender = (uint32_t)ep->rank;
    h->epoch = r->epoch;
    if (bad >= 0) {
        h->magic = FR_SLICE_BAD;
        h->reserved[0] = (uint32_t)bad;
    } else {
        h->magic = FR_SLICE_MAGIC;
        h->count = (uint32_t)c->cnt_rank[d];
        h->npairs = (uint32_t)c->pairs_rank[d];
        h->comb_off = fr_cpu_round(ep, r)->send_off[d];
    }
    if (ep->path[d] != FR_PATH_FABRIC) {
        __atomic_store_n(fr_flag_ptr(L, ep->peer_seg[d], FR_PH_DISPATCH, set, ep->rank),
                         r->epoch, __ATOMIC_RELEASE);
        fr_doorbell_ring(ep->peer_seg[d]);
        return FERRY_OK;
    }
    int g = ep->group_index[d];
    fr_slice_t *s = ep->slices + ((size_t)FR_PH_DISPATCH * FR_NSETS + set) * ep->nfabric + g;
    s->src_off = fr_off_dsend(L, set, d);
    s->dst_off = fr_off_drecv(L, set, ep->rank);
    s->len = fr_off_record(L, h->count);
    s->imm = fr_imm_make(FR_PH_DISPATCH, r->epoch, ep->rank);
    return fr_proxy_submit(ep, FR_PH_DISPATCH, set, r->epoch, g);
}

int fr_cpu_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_in_t *in)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, K = L->K, El = L->El, T = in->num_tokens;
    int set = (int)(r->epoch % FR_NSETS);
    const int64_t *idx = in->topk_idx;
    int rc0 = fr_cpu_settle(ep, r); /* this set's last round, if it was left */
    if (rc0)
        return rc0;

    /* A bad topk_idx (out of range, an expert twice in a token) is found
     * here, once the round has its number: every rank gets a slice saying
     * so, and each fails its dispatch_recv naming the lowest such rank, so
     * that all leave the round alike and go on with the next one. */
    fr_err_t bad;
    int at = -1; /* DP groups: checked from the group's first token, so
                    that entries are named as the caller passed them */
    if (T > 0 && fr_check_topk(L, idx - (size_t)r->glo * K, r->glo + T, &at, &bad) != FERRY_OK) {
        for (int d = 0; d < N; d++) {
            if (fr_ep_masked(ep, d))
                continue;
            int rc = fr_publish_dest(ep, r, d, set, at);
            if (rc)
                return rc;
        }
        int rc = fr_cpu_leave(ep, r, 0);
        if (rc)
            return rc;
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "%s (round %llu: every other rank's dispatch_recv of it fails naming "
                          "the lowest rank with a bad topk_idx; the context goes on)", bad.msg,
                          (unsigned long long)r->epoch);
    }

    /* Token bytes and scales: as given, or quantised here. */
    const uint8_t *tok = (const uint8_t *)in->x;
    const float *scales = in->x_scales;
    if (L->fp8 && !in->x_scales && T > 0) {
        fr_quantize_fp8(L, T, (const uint16_t *)in->x, c->qbuf, c->qscales,
                        ep->cfg.fp8_round_scale);
        tok = c->qbuf;
        scales = c->qscales;
    } else if (L->nvfp4 && T > 0) { /* scales: nscales words of 4 bytes */
        fr_quantize_nvfp4(L, T, (const uint16_t *)in->x, *in->x_global_scale, c->qbuf,
                          (uint8_t *)c->qscales);
        tok = c->qbuf;
        scales = c->qscales;
    }

    /* Count records and (token, expert) pairs per destination rank. */
    int32_t *cnt = c->cnt_rank, *pairs = c->pairs_rank, *fill = c->fill;
    memset(cnt, 0, sizeof(int32_t) * (size_t)N);
    memset(pairs, 0, sizeof(int32_t) * (size_t)N);
    for (int t = 0; t < T; t++) {
        const int64_t *row = idx + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            if (row[k] < 0 || fr_ep_masked(ep, (int)(row[k] / El)))
                continue; /* a masked rank's slots count as -1 */
            int d = (int)(row[k] / El);
            cnt[d] += fr_first_on_rank(row, k, El);
            pairs[d]++;
        }
    }
    /* Replies for rank d land in rows [send_off[d], send_off[d + 1]) of
     * this rank's combine region (kept per round: the combine zeroes a
     * masked rank's); fill[] counts pairs handed out so far. */
    uint32_t off = 0;
    int32_t *rec_next = c->rec_next;
    for (int d = 0; d < N; d++) {
        cr->send_off[d] = off;
        fill[d] = (int32_t)off;
        off += (uint32_t)pairs[d];
        rec_next[d] = 0;
    }
    cr->send_off[N] = off;

    /* Pack records: token-major, so each destination's records are in
     * token order; a record lists the token's local experts in k order. */
    for (int i = 0; i < T * K; i++)
        cr->comb_pos[i] = -1;
    /* Destination by destination, fabric peers first: a fabric peer's
     * slice goes to the proxy as soon as it is packed (its write starts
     * while the next is packed); local peers get direct stores and their
     * flag. A destination's records are in token order either way. */
    for (int pass = 0; pass < 2; pass++)
        for (int d = 0; d < N; d++) {
            int fabric = ep->path[d] == FR_PATH_FABRIC;
            if (fabric != (pass == 0) || fr_ep_masked(ep, d))
                continue; /* a masked rank gets nothing, its slots stay -1 */
            fr_pack_dest(ep, cr, d, set, idx, T, tok, scales);
            int rc = fr_publish_dest(ep, r, d, set, -1);
            if (rc)
                return rc;
        }
    return FERRY_OK;
}

int fr_cpu_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_out_t *out)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, set = (int)(r->epoch % FR_NSETS);
    int rc = fr_wait_flags(ep, FR_PH_DISPATCH, set, r->epoch, "dispatch", out->wait_cost);
    if (rc)
        return rc;
    int32_t *efill = c->expert_fill;
    memset(efill, 0, sizeof(int32_t) * (size_t)L->El);
    uint8_t *ex = (uint8_t *)out->expert_x;
    /* a rank whose topk_idx was bad (the lowest): nobody runs the round */
    for (int s = 0; s < N; s++) {
        const volatile fr_slice_hdr_t *vh =
            (const volatile fr_slice_hdr_t *)(ep->seg + fr_off_drecv(L, set, s));
        if (fr_ep_masked(ep, s) || vh->magic != FR_SLICE_BAD || vh->sender != (uint32_t)s ||
            vh->epoch != r->epoch)
            continue;
        uint32_t at = vh->reserved[0];
        if ((rc = fr_cpu_leave(ep, r, 1)))
            return rc;
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "dispatch round %llu: rank %d passed a bad topk_idx (its entry "
                          "[%u][%u]); no rank ran this round, and the context goes on",
                          (unsigned long long)r->epoch, s, at / (uint32_t)L->K,
                          at % (uint32_t)L->K);
    }
    /* Check every slice, and give each sender its run of pairs in the row
     * map (by sender, record, k; combine_send walks it per sender). The
     * slices stay writable by their senders: the headers are used as
     * checked (fr_slice_check_hdr's copy), and what the placing loop reads
     * from the records again is bounded again there, so a slice rewritten
     * after its check is a protocol error, never a write past a buffer. */
    uint32_t np = 0, *cnt = c->rcount;
    for (int s = 0; s < N; s++) {
        const uint8_t *slice = ep->seg + fr_off_drecv(L, set, s);
        fr_err_t err;
        fr_slice_hdr_t h;
        cr->pair_off[s] = np;
        if (fr_ep_masked(ep, s)) { /* nothing from a masked rank */
            cr->comb_off[s] = 0;
            cnt[s] = 0;
            continue;
        }
        rc = fr_slice_check_hdr(L, slice, s, r->epoch, &h, &err);
        if (rc)
            return fr_ep_fail(ep, rc, "dispatch round %llu: %s",
                              (unsigned long long)r->epoch, err.msg);
        cr->comb_off[s] = h.comb_off;
        cnt[s] = h.count;
        np += h.npairs; /* the records held npairs pairs when checked */
    }
    cr->pair_off[N] = np;
    /* Rows of each local expert: senders from this rank on, wrapping
     * (rank, rank + 1, ..., N - 1, 0, ..., rank - 1), each in record
     * (token) order, then k order. */
    for (int q = 0; q < N; q++) {
        int s = (ep->rank + q) % N;
        const uint8_t *slice = ep->seg + fr_off_drecv(L, set, s);
        uint32_t p = cr->pair_off[s], pend = cr->pair_off[s + 1];
        for (uint32_t i = 0; i < cnt[s]; i++) {
            const uint8_t *rec = slice + fr_off_record(L, i);
            const volatile fr_rec_hdr_t *rh = (const volatile fr_rec_hdr_t *)rec;
            uint32_t nexp = rh->nexp, token = rh->token;
            for (uint32_t j = 0; j < nexp; j++) {
                uint32_t le = rh->le[j];
                if (nexp > (uint32_t)L->kmax || le >= (uint32_t)L->El || p >= pend ||
                    (uint64_t)efill[le] >= L->cap)
                    return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                                      "dispatch round %llu: slice from rank %d: record %u "
                                      "changed after it was checked",
                                      (unsigned long long)r->epoch, s, i);
                int32_t slot = efill[le]++;
                size_t row = (size_t)le * L->cap + (size_t)slot;
                memcpy(ex + row * L->tok_bytes, rec + L->rec_hdr,
                       L->tok_bytes);
                if (L->nscales) {
                    uint8_t *ps = fr_scl_at(L, out->expert_x_scales, le, (uint64_t)slot);
                    const uint8_t *src = rec + L->rec_hdr + L->tok_bytes;
                    for (uint32_t j2 = 0; j2 < L->nscales; j2++) {
                        float v;
                        memcpy(&v, src + 4 * j2, 4);
                        fr_scl_put(L, ps, j2, v);
                    }
                }
                if (out->expert_src_rank)
                    out->expert_src_rank[row] = s;
                if (out->expert_src_token)
                    out->expert_src_token[row] = (int32_t)token;
                cr->pair_row[p++] = (int32_t)row;
            }
        }
        if (p != pend)
            return fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                              "dispatch round %llu: slice from rank %d changed after it was "
                              "checked (%u pairs, %u when checked)",
                              (unsigned long long)r->epoch, s, p - cr->pair_off[s],
                              pend - cr->pair_off[s]);
    }
    memcpy(out->expert_num_tokens, efill, sizeof(int32_t) * (size_t)L->El);
    if (out->recv_stats)
        for (int64_t le = 0; le < L->El; le++)
            out->recv_stats[le] += efill[le];
    return FERRY_OK;
}
