/*
 * Fault injection (FERRY_FAULT_*, tests) around any transport: an ops
 * table whose instance wraps another transport's instance and holds back
 * arrivals (FR_CQE_RX) or this rank's own posts, releasing them after a
 * delay and jitter, in random order when asked. fr_transport_open applies
 * it when a setting is on, so every transport gets it.
 */
#ifndef FR_FAULT_H
#define FR_FAULT_H

#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Is any injection asked for (FERRY_FAULT_DELAY_US, _JITTER_US, _REORDER
 * or _POSTS)? The seed alone changes nothing. */
int fr_fault_on(void);

/* Open `inner` (nic, flags as its open op takes them) behind the
 * injector; call the instance through fr_transport_fault. */
int fr_fault_open(const fr_transport_ops_t *inner, fr_boot_t *boot, int nic,
                  int flags, fr_transport_t **t, fr_err_t *err);

/* The wrapper's ops. Its open op refuses (an instance needs the inner
 * transport fr_fault_open is given), and so does fence_probe (a property
 * of the inner transport: ask fr_transport_find(name)). */
extern const fr_transport_ops_t fr_transport_fault;

#ifdef __cplusplus
}
#endif

#endif
