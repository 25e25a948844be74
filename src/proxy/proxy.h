/* The EP's proxy thread (proxy.c): owns the fabric for one rank. */
#ifndef FR_PROXY_H
#define FR_PROXY_H

#include "ep/ep.h"

#ifdef __cplusplus
extern "C" {
#endif

int fr_proxy_start(ferry_ep_t ep);
int fr_proxy_stop(ferry_ep_t ep); /* -1: left running (fr_proxy_join) */
/* Ask the proxy to post (phase, set)'s slices: to every fabric peer
 * (peer < 0), or to fabric peer `peer` (its index in ep->slices) alone. */
int fr_proxy_submit(ferry_ep_t ep, int phase, int set, uint64_t epoch, int peer);
/* Wait until the proxy has no writes in flight from `set` (bounded). */
int fr_proxy_wait_set(ferry_ep_t ep, int set);

#ifdef __cplusplus
}
#endif

#endif
