/*
 * The rank thread's side of the proxy (proxy.c runs the threads): its
 * requests pushed into the proxy threads' rings, and its waits for a
 * buffer set's writes to drain (the threads' in-flight counts summed).
 */
#include "proxy/proxy.h"
#include "runtime/rt.h"

/* Push a request into one ring (the rank thread is its only producer). */
static int fr_proxy_push(ferry_ep_t ep, fr_proxy_ring_t *rg, int phase, int set,
                         uint64_t epoch, int peer)
{
    uint64_t iter = 0;
    uint64_t deadline = fr_now_ns() + (uint64_t)ep->timeout_ms * 1000000ull;
    while (rg->tail - __atomic_load_n(&rg->head, __ATOMIC_ACQUIRE) >=
           FR_PROXY_RING) {
        fr_backoff(&iter, ep->spin);
        if (fr_now_ns() > deadline)
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "the proxy thread did not take requests for "
                              "%ld ms", ep->timeout_ms);
    }
    fr_proxy_req_t *q = &rg->req[rg->tail % FR_PROXY_RING];
    q->phase = phase;
    q->set = set;
    q->epoch = epoch;
    q->peer1 = peer < 0 ? 0 : peer + 1;
    q->t_ring = fr_now_ns();
    __atomic_store_n(&rg->tail, rg->tail + 1, __ATOMIC_RELEASE);
    return FERRY_OK;
}

int fr_proxy_submit(ferry_ep_t ep, int phase, int set, uint64_t epoch, int peer)
{
    fr_proxy_t *p = &ep->proxy;
    if (p->nth <= 1)
        return fr_proxy_push(ep, p->ring, phase, set, epoch, peer);
    if (peer >= 0) /* the thread that owns the peer's NIC */
        return fr_proxy_push(ep, p->th[fr_proxy_owner(p, peer)].ring, phase, set, epoch, peer);
    for (int j = 0; j < p->nth; j++) { /* every peer: each thread posts to its own */
        int rc = fr_proxy_push(ep, p->th[j].ring, phase, set, epoch, peer);
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

/* Every request ring empty. */
static int fr_proxy_rings_empty(const fr_proxy_t *p)
{
    if (!p->th)
        return __atomic_load_n(&p->ring->head, __ATOMIC_ACQUIRE) ==
               __atomic_load_n(&p->ring->tail, __ATOMIC_ACQUIRE);
    for (int j = 0; j < p->nth; j++) {
        const fr_proxy_ring_t *rg = p->th[j].ring;
        if (__atomic_load_n(&rg->head, __ATOMIC_ACQUIRE) !=
            __atomic_load_n(&rg->tail, __ATOMIC_ACQUIRE))
            return 0;
    }
    return 1;
}

int64_t fr_proxy_in_flight(ferry_ep_t ep, int set)
{
    const fr_proxy_t *p = &ep->proxy;
    int64_t n = 0;
    for (int j = 0; p->th && j < p->nth; j++)
        n += __atomic_load_n(&p->th[j].inflight[set], __ATOMIC_ACQUIRE);
    return n;
}

int fr_proxy_wait_set(ferry_ep_t ep, int set)
{
    fr_proxy_t *p = &ep->proxy;
    uint64_t iter = 0;
    uint64_t deadline = fr_now_ns() + (uint64_t)ep->timeout_ms * 1000000ull;
    while (!fr_proxy_rings_empty(p) || fr_proxy_in_flight(ep, set) > 0) {
        int rc = fr_ep_async_check(ep);
        if (rc != FERRY_OK)
            return rc;
        fr_backoff(&iter, ep->spin);
        int dead = fr_boot_dead_rank(ep->comm->boot);
        if (dead >= 0 && !fr_ep_masked(ep, dead)) /* a masked one is sent nothing */
            return fr_ep_fail(ep, FERRY_ERR_PEER,
                              "writes still in flight when rank %d died", dead);
        if (fr_now_ns() > deadline) {
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "%lld writes of buffer set %d not completed "
                              "after %ld ms",
                              (long long)fr_proxy_in_flight(ep, set), set, ep->timeout_ms);
        }
    }
    return FERRY_OK;
}
