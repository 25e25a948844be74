/*
 * Forwarding through one rank per node: who forwards what, from the node
 * tables alone, so that every rank computes the same plan (fr_ep_fwd_of
 * in ep.h names the forwarder). The CUDA high-throughput engine lays out
 * its segments and peer tables from it; tests/unit/test_fwd.c checks
 * that the ranks' views agree.
 */
#include "ep/ep.h"

void fr_ep_fwd_sizes(const ferry_ep_t ep, int *NL, int *NF)
{
    *NL = *NF = 0;
    for (int b = 0; b < ep->nnodes; b++) {
        int sz = ep->node_off[b + 1] - ep->node_off[b];
        *NL = sz > *NL ? sz : *NL;
    }
    for (int f = 0; f < ep->N; f++) {
        int n = 0;
        for (int s = 0; s < ep->N; s++)
            n += fr_ep_fwd_by(ep, s, f);
        *NF = n > *NF ? n : *NF;
    }
}

int fr_ep_fwd_slot(const ferry_ep_t ep, int s, int f)
{
    if (!fr_ep_fwd_by(ep, s, f))
        return -1;
    int slot = 0;
    for (int x = 0; x < s; x++)
        slot += fr_ep_fwd_by(ep, x, f);
    return slot;
}

int fr_ep_fwd_view(const ferry_ep_t ep, int me, fr_fwd_view_t *v)
{
    int N = ep->N, node = ep->node_of[me], nf = 0, ord = 0;
    for (int r = 0; r < N; r++) {
        v->fslot[r] = -1;
        if (fr_ep_fwd_by(ep, r, me)) {
            v->fslot[r] = nf;
            v->fl[nf++] = r;
        }
        v->key[r] = ep->node_of[r] == node ? r : fr_ep_fwd_of(ep, me, ep->node_of[r]);
        v->via[r] = ep->node_of[r] == node ? r : fr_ep_fwd_of(ep, r, node);
    }
    for (int b = 0; b < ep->nnodes; b++) /* sums by node, then rank */
        for (int i = ep->node_off[b]; i < ep->node_off[b + 1]; i++)
            v->kord[ep->node_ranks[i]] = ord++;
    return nf;
}
