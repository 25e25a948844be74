/*
 * ferry-bench's MPI baseline: the two-phase exchange users write today.
 * Counts first (MPI_Alltoall), then one copy per (token, expert) through
 * MPI_Alltoallv, and the expert outputs back the same way.
 */
#ifdef FERRY_HAVE_MPI
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "core/quant.h"

int base_init(base_t *b, const fw_spec_t *s)
{
    memset(b, 0, sizeof(*b));
    MPI_Comm_size(MPI_COMM_WORLD, &b->N);
    MPI_Comm_rank(MPI_COMM_WORLD, &b->me);
    b->El = s->E / s->N;
    /* sized for bf16 rows, the larger of the two dtypes */
    b->pay = 2 * (size_t)s->H + (size_t)s->H / 128 * 4 + 16;
    b->item = 8 + b->pay;
    size_t maxi = (size_t)s->T * s->K, maxr = (size_t)s->N * s->T * s->K;
    b->scnt = calloc((size_t)b->N * 8, sizeof(int));
    b->rcnt = b->scnt + b->N;
    b->sdsp = b->rcnt + b->N;
    b->rdsp = b->sdsp + b->N;
    b->sb = b->rdsp + b->N;
    b->rb = b->sb + b->N;
    b->sbd = b->rb + b->N;
    b->rbd = b->sbd + b->N;
    b->sbuf = malloc(maxi * b->item + 1);
    b->rbuf = malloc(maxr * b->item + 1);
    b->item_pos = malloc(sizeof(int32_t) * (maxi + 1));
    b->rrow = malloc(sizeof(int32_t) * (maxr + 1));
    b->ybuf_s = malloc(maxr * 2 * (size_t)s->H + 1);
    b->ybuf_r = malloc(maxi * 2 * (size_t)s->H + 1);
    b->q = malloc((size_t)(s->T + 1) * fw_token_bytes(s));
    memset(b->sbuf, 0, maxi * b->item + 1); /* pre-fault, as for ferry */
    memset(b->rbuf, 0, maxr * b->item + 1);
    memset(b->ybuf_s, 0, maxr * 2 * (size_t)s->H + 1);
    memset(b->ybuf_r, 0, maxi * 2 * (size_t)s->H + 1);
    b->qs = malloc(sizeof(float) * (size_t)(s->T + 1) * (size_t)(s->H / 128 + 1));
    return b->sbuf && b->rbuf && b->ybuf_s && b->ybuf_r ? 0 : -1;
}

void base_free(base_t *b)
{
    free(b->scnt);
    free(b->sbuf);
    free(b->rbuf);
    free(b->item_pos);
    free(b->rrow);
    free(b->ybuf_s);
    free(b->ybuf_r);
    free(b->q);
    free(b->qs);
}

void base_dispatch(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                   uint8_t *ex, float *exs, int32_t *cnt, int32_t *sr,
                   int32_t *st, size_t cap)
{
    int N = b->N, K = s->K, El = b->El, T = in->T;
    size_t tb = fw_token_bytes(s), ns = s->fp8 ? (size_t)s->H / 128 : 0;
    b->pay = tb + 4 * ns;
    b->item = 8 + b->pay;
    const uint8_t *tok = (const uint8_t *)in->x;
    const float *scl = NULL;
    if (s->fp8) {
        /* the same quantiser ferry uses */
        for (int t = 0; t < T; t++)
            for (int bl = 0; bl < s->H / 128; bl++)
                fr_quant_block_r(in->x + (size_t)t * s->H + bl * 128,
                                 b->q + (size_t)t * s->H + bl * 128,
                                 &b->qs[(size_t)t * ns + bl], s->round_scale);
        tok = b->q;
        scl = b->qs;
    }
    memset(b->scnt, 0, sizeof(int) * (size_t)N);
    for (int i = 0; i < T * K; i++)
        if (in->idx[i] >= 0)
            b->scnt[in->idx[i] / El]++;
    int off = 0;
    for (int d = 0; d < N; d++) {
        b->sdsp[d] = off;
        off += b->scnt[d];
    }
    int *fill = b->sb; /* temporary */
    memcpy(fill, b->sdsp, sizeof(int) * (size_t)N);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            int64_t e = in->idx[(size_t)t * K + k];
            b->item_pos[t * K + k] = -1;
            if (e < 0)
                continue;
            int d = (int)(e / El), pos = fill[d]++;
            uint8_t *it = b->sbuf + (size_t)pos * b->item;
            int32_t meta[2] = {t, (int32_t)(e % El)};
            memcpy(it, meta, 8);
            memcpy(it + 8, tok + (size_t)t * tb, tb);
            if (ns)
                memcpy(it + 8 + tb, scl + (size_t)t * ns, ns * 4);
            b->item_pos[t * K + k] = pos;
        }
    MPI_Alltoall(b->scnt, 1, MPI_INT, b->rcnt, 1, MPI_INT, MPI_COMM_WORLD);
    int roff = 0;
    for (int d = 0; d < N; d++) {
        b->rdsp[d] = roff;
        roff += b->rcnt[d];
        b->sb[d] = b->scnt[d] * (int)b->item;
        b->sbd[d] = b->sdsp[d] * (int)b->item;
        b->rb[d] = b->rcnt[d] * (int)b->item;
        b->rbd[d] = b->rdsp[d] * (int)b->item;
    }
    b->nrecv = roff;
    MPI_Alltoallv(b->sbuf, b->sb, b->sbd, MPI_BYTE, b->rbuf, b->rb, b->rbd,
                  MPI_BYTE, MPI_COMM_WORLD);
    /* lay out per local expert as ferry's low-latency mode does: sources
     * from this rank on, wrapping (me, me + 1, ..., N - 1, 0, ..., me - 1),
     * each in token order */
    memset(cnt, 0, sizeof(int32_t) * (size_t)El);
    for (int i = 0; i < N; i++) {
        int src = (b->me + i) % N;
        for (int j = b->rdsp[src]; j < b->rdsp[src] + b->rcnt[src]; j++) {
            const uint8_t *it = b->rbuf + (size_t)j * b->item;
            int32_t meta[2];
            memcpy(meta, it, 8);
            int le = meta[1];
            size_t row = (size_t)le * cap + (size_t)cnt[le]++;
            memcpy(ex + row * tb, it + 8, tb);
            if (ns)
                memcpy(exs + row * ns, it + 8 + tb, ns * 4);
            sr[row] = src;
            st[row] = meta[0];
            b->rrow[j] = (int32_t)row;
        }
    }
}

void base_combine(base_t *b, const fw_spec_t *s, const fw_input_t *in,
                  const uint16_t *ey, uint16_t *out, float *acc)
{
    int N = b->N, K = s->K, H = s->H;
    size_t rowb = 2 * (size_t)H;
    for (int j = 0; j < b->nrecv; j++)
        memcpy(b->ybuf_s + (size_t)j * rowb, ey + (size_t)b->rrow[j] * H, rowb);
    for (int d = 0; d < N; d++) {
        b->sb[d] = b->rcnt[d] * (int)rowb;
        b->sbd[d] = b->rdsp[d] * (int)rowb;
        b->rb[d] = b->scnt[d] * (int)rowb;
        b->rbd[d] = b->sdsp[d] * (int)rowb;
    }
    MPI_Alltoallv(b->ybuf_s, b->sb, b->sbd, MPI_BYTE, b->ybuf_r, b->rb, b->rbd,
                  MPI_BYTE, MPI_COMM_WORLD);
    for (int t = 0; t < in->T; t++) {
        memset(acc, 0, sizeof(float) * (size_t)H);
        for (int k = 0; k < K; k++) {
            int p = b->item_pos[t * K + k];
            if (p < 0)
                continue;
            const uint16_t *y = (const uint16_t *)(b->ybuf_r + (size_t)p * rowb);
            fr_axpy_bf16(acc, in->w[(size_t)t * K + k], y, H);
        }
        fr_row_to_bf16(acc, out + (size_t)t * H, H);
    }
}

int mpi_allgather_cb(const void *in, void *out, size_t len, void *ctx)
{
    (void)ctx;
    return MPI_Allgather(in, (int)len, MPI_BYTE, out, (int)len, MPI_BYTE,
                         MPI_COMM_WORLD) == MPI_SUCCESS ? 0 : -1;
}
#endif
