/*
 * What a failed completion means, for every thread that polls a
 * transport (the low-latency proxy, the high-throughput engines' fabric
 * paths, put-with-signal): one classification and one message.
 */
#include <stdio.h>

#include "transport/transport.h"

int fr_cqe_failure(const fr_cqe_t *c, int to, const fr_boot_t *boot, const char *who,
                   const char *why, int *rank, char *msg, size_t len)
{
    int st = c->kind == FR_CQE_ERR && c->status ? c->status : FERRY_ERR_FABRIC;
    int dead = boot ? fr_boot_blame(boot, st) : -1;
    const char *sep = why && why[0] ? ": " : "";
    if (!why)
        why = "";
    if (to < 0)
        to = c->peer;
    if (dead >= 0) { /* a peer dying cuts writes to and from it: name it */
        *rank = dead;
        snprintf(msg, len, "%s: rank %d died", who, dead);
        return FERRY_ERR_PEER;
    }
    if (c->kind == FR_CQE_ERR) {
        *rank = to;
        snprintf(msg, len, "%s: a write to rank %d failed (%s)%s%.400s", who, to,
                 ferry_strerror(st), sep, why);
        return st;
    }
    *rank = -1; /* FR_CQE_RXERR: the writer is unknown */
    snprintf(msg, len, "%s: a peer's write into this rank failed (%s)%s%.400s", who,
             ferry_strerror(st), sep, why);
    return st;
}
