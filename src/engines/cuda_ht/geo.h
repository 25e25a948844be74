/*
 * The CUDA high-throughput engine's geometry, shared by its kernels
 * (cuda_ht_dev.cuh) and its fabric thread (fab.c): the segment every rank
 * holds and, for peers on the fabric path, the outbox the kernels write
 * instead of the peer's segment and the host-mapped words beside it.
 */
#ifndef FR_CUHT_GEO_H
#define FR_CUHT_GEO_H

#include "core/hd.h"

#define FR_CUHT_LINE 64

enum { FR_CUHT_DTAIL = 0, FR_CUHT_DHEAD = 1, FR_CUHT_CTAIL = 2, FR_CUHT_CHEAD = 3 };

/* Geometry of every segment (the same on every rank). Peers on the
 * fabric path (fabric.c) add, per such peer g, an outbox of ob_bytes in
 * this rank's GPU memory: a notify area laid out as a segment's [0,
 * off_ctr), then dispatch rings [C][RT] at ob_drec and combine rings
 * [C][RT] at ob_crec (ring (c, this rank) of the peer's segment, here);
 * and hdr_bytes (= off_drec: a segment's notify entries and counters) of
 * host-mapped words twice: what this rank stores for g (out, the proxy
 * reads and forwards it) and, once for all fabric peers, what they stored
 * for this rank (in, the proxy writes it as their writes land). */
typedef struct fr_cuht_geo {
    int N, rank, E, El, K, H, T;  /* T: max_tokens */
    int C, RT;                    /* channels, records per ring */
    unsigned long long notify_entry, off_notify, off_ctr, off_drec, off_crec, seg_bytes;
    unsigned long long dhdr, drec, chdr, crec;
    unsigned long long ob_drec, ob_crec, ob_bytes, hdr_bytes;
    /* forwarding through one rank per node (fwd = 1; docs/architecture.md):
     * NL ranks in the largest node, NF remote sources a rank forwards for
     * at most; in every segment the forwarded dispatch heads [C][N][NL]
     * and combine tails [C][N][NL] (a line each, stored by the node's
     * destinations) and the forwarded combine rings [C][NF][NL][RT] */
    int fwd, NL, NF;
    unsigned long long off_fhead, off_fctail, off_fcring;
} fr_cuht_geo_t;

/* Byte offsets in a segment. */
FR_HD unsigned long long fr_cuht_geo_notify(const fr_cuht_geo_t *G, int parity, int src)
{
    return G->off_notify + ((unsigned long long)parity * G->N + src) * G->notify_entry;
}
FR_HD unsigned long long fr_cuht_geo_ctr(const fr_cuht_geo_t *G, int kind, int c, int r)
{
    return G->off_ctr + (((unsigned long long)kind * G->C + c) * G->N + r) * FR_CUHT_LINE;
}
/* Ring (c, r) of a segment: `combine` 0 dispatch, 1 combine. */
FR_HD unsigned long long fr_cuht_geo_ring(const fr_cuht_geo_t *G, int combine, int c, int r)
{
    unsigned long long rec = combine ? G->crec : G->drec;
    return (combine ? G->off_crec : G->off_drec) +
           ((unsigned long long)c * G->N + r) * (unsigned long long)G->RT * rec;
}
/* Forwarding: the line of (channel c, remote source s, local index j). */
FR_HD unsigned long long fr_cuht_geo_fline(const fr_cuht_geo_t *G, int combine, int c, int s,
                                           int j)
{
    return (combine ? G->off_fctail : G->off_fhead) +
           (((unsigned long long)c * G->N + s) * G->NL + j) * FR_CUHT_LINE;
}
/* Forwarding: the combine ring at a forwarder where its node's rank of
 * local index j writes the rows of the forwarder's slot-th remote source. */
FR_HD unsigned long long fr_cuht_geo_fcring(const fr_cuht_geo_t *G, int c, int slot, int j)
{
    return G->off_fcring +
           (((unsigned long long)c * G->NF + slot) * G->NL + j) * G->RT * G->crec;
}
/* Ring c in an outbox. */
FR_HD unsigned long long fr_cuht_geo_obring(const fr_cuht_geo_t *G, int combine, int c)
{
    return combine ? G->ob_crec + (unsigned long long)c * G->RT * G->crec
                   : G->ob_drec + (unsigned long long)c * G->RT * G->drec;
}

#endif
