/*
 * CPU twins of the combine kernels.
 *
 * combine_send: for every source rank s, the rows of expert_y holding s's
 * (token, expert) pairs, in the order s sent them, go as one contiguous run
 * to rows [comb_off_s, comb_off_s + pairs_s) of s's combine region: stored
 * directly (self, shared memory; then the flag is published, release) or
 * packed for one fabric write that the proxy is asked to post at once.
 *
 * combine_recv: wait for every rank's flag; out[t] = sum_k w[t][k] * y,
 * accumulated in fp32 in k order, rounded once to bf16.
 */
#include <string.h>

#include "engines/cpu_ll/cpu_ll.h"
#include "core/quant.h"

int fr_cpu_combine_send(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in)
{
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int N = ep->N, set = (int)(r->epoch % FR_NSETS);
    const uint8_t *y = (const uint8_t *)in->expert_y;
    uint64_t packed = 0; /* rows packed so far in the send region */
    /* fabric peers first, each handed to the proxy as soon as it is
     * packed (its write starts while the next is packed), then the local
     * peers' direct stores */
    for (int pass = 0; pass < 2; pass++)
        for (int s = 0; s < N; s++) {
            int fabric = ep->path[s] == FR_PATH_FABRIC;
            if (fabric != (pass == 0) || fr_ep_masked(ep, s))
                continue; /* a masked rank sent nothing and gets nothing */
            uint32_t p0 = cr->pair_off[s], np = cr->pair_off[s + 1] - p0;
            const int32_t *rows = cr->pair_row + p0;
            uint8_t *dst = fabric ? ep->send + fr_off_csend(L, set, packed)
                                  : ep->peer_seg[s] + fr_off_crecv(L, set, cr->comb_off[s]);
            for (uint32_t p = 0; p < np; p++)
                memcpy(dst + (size_t)p * L->crow, y + (size_t)rows[p] * L->crow, L->crow);
            if (!fabric) {
                __atomic_store_n(fr_flag_ptr(L, ep->peer_seg[s], FR_PH_COMBINE, set, ep->rank),
                                 r->epoch, __ATOMIC_RELEASE);
                fr_doorbell_ring(ep->peer_seg[s]);
                continue;
            }
            int g = ep->group_index[s];
            fr_slice_t *sl =
                ep->slices + ((size_t)FR_PH_COMBINE * FR_NSETS + set) * ep->nfabric + g;
            sl->src_off = fr_off_csend(L, set, packed);
            sl->dst_off = fr_off_crecv(L, set, cr->comb_off[s]);
            sl->len = (uint64_t)np * L->crow;
            sl->imm = fr_imm_make(FR_PH_COMBINE, r->epoch, ep->rank);
            packed += np;
            int rc = fr_proxy_submit(ep, FR_PH_COMBINE, set, r->epoch, g);
            if (rc)
                return rc;
        }
    return FERRY_OK;
}

int fr_cpu_combine_recv(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_out_t *out)
{
    fr_cpu_ll_t *c = fr_cpu_state(ep);
    fr_cpu_round_t *cr = fr_cpu_round(ep, r);
    const fr_layout_t *L = &ep->L;
    int set = (int)(r->epoch % FR_NSETS), H = L->H, K = L->K;
    int rc = fr_wait_flags(ep, FR_PH_COMBINE, set, r->epoch, "combine", out->wait_cost);
    if (rc)
        return rc;
    /* a rank masked after this round's dispatch_send (mask_on_timeout)
     * never sent the replies of its rows: they count as 0 */
    for (int d = 0; d < ep->N; d++)
        if (fr_ep_masked(ep, d) && cr->send_off[d + 1] > cr->send_off[d])
            memset(ep->seg + fr_off_crecv(L, set, cr->send_off[d]), 0,
                   (size_t)(cr->send_off[d + 1] - cr->send_off[d]) * L->crow);
    float *acc = c->acc;
    uint16_t *o = (uint16_t *)out->out;
    for (int t = 0; t < r->T; t++) {
        memset(acc, 0, sizeof(float) * (size_t)H);
        const int32_t *cp = cr->comb_pos + (size_t)t * K;
        const float *w = out->topk_weights + (size_t)t * K;
        for (int k = 0; k < K; k++) {
            if (cp[k] < 0)
                continue;
            const uint16_t *yr =
                (const uint16_t *)(ep->seg + fr_off_crecv(L, set, (uint64_t)cp[k]));
            fr_axpy_bf16(acc, w[k], yr, H);
        }
        fr_row_to_bf16(acc, o + (size_t)t * H, H);
    }
    return FERRY_OK;
}
