/*
 * The EP's receive segment on the host (CPU engines): created in POSIX
 * shared memory, its name exchanged, the same-node peers' segments mapped;
 * and undone. Sized by ep->L.seg_bytes, which the engine sets first.
 */
#include "ep/ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* What each rank tells the others. */
typedef struct fr_seg_hello {
    int32_t status;
    char seg_name[96];
} fr_seg_hello_t;

int fr_ep_segments(ferry_ep_t ep, char tag, int status, fr_err_t *err)
{
    int N = ep->N, me = ep->rank;
    fr_seg_hello_t mine, *all = calloc((size_t)N, sizeof(*all));
    memset(&mine, 0, sizeof(mine));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "segment names");
    mine.status = status;
    /* what ranks of an earlier job that was killed left */
    fr_shm_sweep_dead();
    if (status == FERRY_OK) {
        /* the name the sweeps know (runtime/rt.h), after shm_open's '/' */
        mine.seg_name[0] = '/';
        if (fr_shm_name(mine.seg_name + 1, sizeof(mine.seg_name) - 1, FR_SHM_EP, "%c%d-%llx",
                        tag, me, (unsigned long long)fr_now_ns()) < 0)
            mine.status = FR_ERR(err, FERRY_ERR_INTERNAL, "segment name too long");
    }
    if (mine.status == FERRY_OK) {
        snprintf(ep->seg_name, sizeof(ep->seg_name), "%s", mine.seg_name);
        mine.status = fr_shm_create(ep->seg_name, ep->L.seg_bytes, &ep->seg, err);
    }
    /* Everyone learns everyone's status, so a rank that failed fails
     * everyone at once instead of leaving them waiting. */
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK && mine.status != FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to create its EP context (%s)",
                        i, ferry_strerror(all[i].status));
    ep->peer_seg[me] = ep->seg;
    for (int i = 0; i < N && rc == FERRY_OK; i++) {
        all[i].seg_name[sizeof(all[i].seg_name) - 1] = 0;
        if (ep->path[i] == FR_PATH_SHM)
            rc = fr_shm_map(all[i].seg_name, ep->L.seg_bytes, &ep->peer_seg[i], err);
    }
    free(all);
    return rc;
}

void fr_ep_segments_close(ferry_ep_t ep)
{
    if (ep->peer_seg)
        for (int i = 0; i < ep->N; i++)
            if (ep->peer_seg[i] && ep->peer_seg[i] != ep->seg)
                fr_shm_unmap(ep->peer_seg[i], ep->L.seg_bytes);
    if (ep->seg) {
        fr_shm_unmap(ep->seg, ep->L.seg_bytes);
        if (ep->seg_name[0])
            fr_shm_unlink(ep->seg_name);
    }
    ep->seg = NULL;
}
