/*
 * Masking ranks (low-latency mode): the host's view in ep->mask, the
 * engine's copy written through its table (on the stream, for CUDA).
 */
#include "api/api.h"

#include "core/log.h"

/* Masks change between rounds only: a round reads one mask from its
 * dispatch to its combine. */
static int fr_mask_call(ferry_ep_t ep, const char *call)
{
    int rc = fr_ep_usable(ep);
    if (rc)
        return rc;
    if (ep->eng->route_create || !ep->eng->mask_write || !ep->eng->mask_read)
        return fr_ep_fail(ep, FERRY_ERR_UNSUPPORTED, "%s: the %s engine does not mask ranks "
                          "(low-latency mode only)", call, ep->eng->name);
    return FERRY_OK;
}

int ferry_ep_mask_rank(ferry_ep_t ep, int rank, int masked, void *stream)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_mask_call(ep, "ferry_ep_mask_rank");
    if (rc)
        return rc;
    if (rank < 0 || rank >= ep->N)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_rank: rank = %d: must be "
                          "0..%d", rank, ep->N - 1);
    if (rank == ep->rank)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_rank: rank = %d is this rank "
                          "(a rank masks its peers, never itself)", rank);
    if (masked != 0 && masked != 1)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_rank: masked = %d: must be 0 "
                          "or 1", masked);
    for (int i = 0; i < FR_NSETS; i++)
        if (ep->rounds[i].state != FR_ROUND_FREE)
            return fr_ep_fail(ep, FERRY_ERR_STATE, "ferry_ep_mask_rank: round %llu is in "
                              "flight; masks change between rounds (after combine_recv)",
                              (unsigned long long)ep->rounds[i].epoch);
    if (ep->cfg.mask_on_timeout && ep->eng->mask_pull &&
        (rc = ep->eng->mask_pull(ep, stream)))
        return rc; /* ranks the device's waits masked count as masked here */
    if (ep->mask[rank] == masked)
        return FERRY_OK;
    if (!masked && ep->next_epoch >= ep->mask_since[rank])
        return fr_ep_fail(ep, FERRY_ERR_STATE, "ferry_ep_mask_rank: rank %d has been masked "
                          "since round %llu: this rank skipped its flags since, so the two "
                          "are out of step; create a new context to bring it back", rank,
                          (unsigned long long)ep->mask_since[rank]);
    uint64_t since = ep->mask_since[rank];
    ep->mask[rank] = masked;
    ep->mask_since[rank] = masked ? ep->next_epoch + 1 : 0;
    rc = ep->eng->mask_write(ep, rank, masked, stream);
    if (rc) {
        ep->mask[rank] = !masked;
        ep->mask_since[rank] = since;
        return rc;
    }
    FR_LOG_INFO(FR_SUB_EP, "rank %d %s by rank %d from round %llu", rank,
                masked ? "masked" : "unmasked", ep->rank,
                (unsigned long long)(ep->next_epoch + 1));
    return FERRY_OK;
}

int ferry_ep_mask_query(ferry_ep_t ep, int32_t *status, void *stream)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_mask_call(ep, "ferry_ep_mask_query");
    if (rc)
        return rc;
    if (!status)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_query: status: NULL pointer");
    return ep->eng->mask_read(ep, status, stream);
}
