/*
 * Forwarding's plan (src/ep/fwd.c), which every rank computes alone and
 * the GPU protocol relies on agreeing: a source's forwarder for a node (its
 * key) is who that node's ranks expect to serve the source (via); a
 * destination's slot for a remote source at its forwarder is that
 * forwarder's own place for it; the order of sums is the same everywhere
 * (by node, then rank); sizes (largest node, most sources forwarded by
 * one rank). Nodes equal, uneven, interleaved in rank order, of one rank,
 * and 1024 ranks as 128 x 8.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep/ep.h"
#include "harness.h"

/* ep's node tables from a node id per rank (the order create.c makes
 * them: nodes numbered by their lowest rank, ranks in rank order) */
static void nodes(struct ferry_ep *ep, int N, const int *id)
{
    ep->N = N;
    ep->node_of = calloc((size_t)N, sizeof(int));
    ep->node_lidx = calloc((size_t)N, sizeof(int));
    ep->node_off = calloc((size_t)N + 1, sizeof(int));
    ep->node_ranks = calloc((size_t)N, sizeof(int));
    ep->nnodes = 0;
    for (int i = 0; i < N; i++) {
        int j = 0;
        while (j < i && id[j] != id[i])
            j++;
        ep->node_of[i] = j < i ? ep->node_of[j] : ep->nnodes++;
    }
    for (int i = 0; i < N; i++)
        ep->node_lidx[i] = ep->node_off[ep->node_of[i] + 1]++;
    for (int b = 0; b < ep->nnodes; b++)
        ep->node_off[b + 1] += ep->node_off[b];
    for (int i = 0; i < N; i++)
        ep->node_ranks[ep->node_off[ep->node_of[i]] + ep->node_lidx[i]] = i;
}

static void unnodes(struct ferry_ep *ep)
{
    free(ep->node_of);
    free(ep->node_lidx);
    free(ep->node_off);
    free(ep->node_ranks);
}

/* Every rank's view, checked against the others'. */
static void check(const char *name, int N, const int *id, int want_nl, int want_nf)
{
    struct ferry_ep e;
    memset(&e, 0, sizeof(e));
    nodes(&e, N, id);
    int NL, NF;
    fr_ep_fwd_sizes(&e, &NL, &NF);
    CHECK(want_nl < 0 || NL == want_nl, "%s: largest node %d, want %d", name, NL, want_nl);
    CHECK(want_nf < 0 || NF == want_nf, "%s: most sources forwarded %d, want %d", name, NF,
          want_nf);
    int *m = malloc(sizeof(int) * 5 * (size_t)N * (size_t)N), *nf = calloc((size_t)N, sizeof(int));
    fr_fwd_view_t *v = calloc((size_t)N, sizeof(*v));
    int maxnf = 0, bad = 0;
    for (int me = 0; me < N; me++) {
        int *b = m + (size_t)me * 5 * N;
        v[me] = (fr_fwd_view_t){b, b + N, b + 2 * N, b + 3 * N, b + 4 * N};
        nf[me] = fr_ep_fwd_view(&e, me, &v[me]);
        maxnf = nf[me] > maxnf ? nf[me] : maxnf;
    }
    CHECK(maxnf == NF, "%s: views forward at most %d sources, sizes say %d", name, maxnf, NF);
    for (int me = 0; me < N && !bad; me++) {
        const fr_fwd_view_t *x = &v[me];
        for (int i = 0; i < nf[me]; i++) /* ascending, and fslot its inverse */
            bad |= x->fslot[x->fl[i]] != i || (i > 0 && x->fl[i] <= x->fl[i - 1]);
        for (int r = 0; r < N && !bad; r++) {
            int same = e.node_of[r] == e.node_of[me];
            /* keys and vias live in r's node, and are r there */
            bad |= e.node_of[x->key[r]] != e.node_of[r] || (same && x->key[r] != r);
            bad |= e.node_of[x->via[r]] != e.node_of[me] || (same && x->via[r] != r);
            /* the source's forwarder for this node is who serves it here,
             * and that rank's list has it at the slot a destination uses */
            if (!same) {
                int f = x->via[r];
                bad |= v[r].key[me] != f;
                bad |= v[f].fslot[r] < 0 || v[f].fslot[r] != fr_ep_fwd_slot(&e, r, f);
                bad |= v[f].fslot[r] >= NF;
            }
            bad |= same && x->fslot[r] != -1;
            /* one order of sums, by node then rank */
            bad |= x->kord[r] != v[0].kord[r];
            for (int q = 0; me == 0 && q < N && !bad; q++) /* rank 0's; the others equal it */
                if (e.node_of[q] < e.node_of[r] || (e.node_of[q] == e.node_of[r] && q < r))
                    bad |= x->kord[q] >= x->kord[r];
            if (bad)
                CHECK(0, "%s: rank %d's view of rank %d disagrees (key %d, via %d, fslot %d)",
                      name, me, r, x->key[r], x->via[r], x->fslot[r]);
        }
    }
    free(v);
    free(nf);
    free(m);
    unnodes(&e);
}

int main(void)
{
    int id[1024];
    for (int i = 0; i < 32; i++)
        id[i] = i / 8;
    check("4 x 8", 32, id, 8, 3);
    int un[] = {0, 0, 0, 1, 1};
    check("3 + 2", 5, un, 3, -1);
    for (int i = 0; i < 12; i++)
        id[i] = i % 3; /* nodes interleaved in rank order */
    check("3 x 4 interleaved", 12, id, 4, 2);
    int odd[] = {0, 1, 1, 1, 1, 1, 2, 2};
    check("1 + 5 + 2", 8, odd, 5, -1);
    for (int i = 0; i < 16; i++)
        id[i] = 0;
    check("one node", 16, id, 16, 0);
    for (int i = 0; i < 1024; i++)
        id[i] = i / 8;
    check("128 x 8", 1024, id, 8, 127);
    if (fr_test_result() == 0)
        printf("fwd: every rank's view of forwarding agrees (keys, who serves a source, "
               "slots, order of sums) at 4 x 8, 3 + 2, interleaved nodes, 1 + 5 + 2, one "
               "node, 128 x 8\n");
    return fr_test_result();
}
