/*
 * One token's part of a routing's layout (ferry_dispatch_layout), shared
 * by the CPU code and the CUDA kernel: its valid experts and the distinct
 * ranks they live on.
 */
#ifndef FR_DLAYOUT_H
#define FR_DLAYOUT_H

#include <stdint.h>

#include "hd.h"

/* Of row[0..K): whether slot k names an expert (0..E-1; anything else
 * counts nowhere), and the distinct ranks (E/N = El experts each) of the
 * valid slots in first-seen order into d[], returning how many. */
FR_HD int fr_dl_ranks(const int64_t *row, int K, int E, int El, int *d)
{
    int n = 0;
    for (int k = 0; k < K; k++) {
        int64_t e = row[k];
        if (e < 0 || e >= E)
            continue;
        int r = (int)e / El, seen = 0;
        for (int j = 0; j < n; j++)
            seen |= d[j] == r;
        if (!seen)
            d[n++] = r;
    }
    return n;
}

/* The distinct nodes (blocks of rpn consecutive ranks) of the n ranks
 * d[] into b[], returning how many. */
FR_HD int fr_dl_nodes(const int *d, int n, int rpn, int *b)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        int x = d[i] / rpn, seen = 0;
        for (int j = 0; j < m; j++)
            seen |= b[j] == x;
        if (!seen)
            b[m++] = x;
    }
    return m;
}

#endif
