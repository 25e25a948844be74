/*
 * Calls queued ahead of the GPU, bounded. Where a thread of this rank moves
 * GPU memory with CUDA calls (a copying provider's copies or the GPUDirect
 * flush: ep->rx_flush), those calls share the CUDA context with the rank's
 * own queue; a host thread far ahead of its GPU blocks inside a launch once
 * CUDA's queue is full while the thread's copy waits behind it, and both
 * wait for each other (docs/architecture.md, "Fabric"). So, in that mode,
 * an engine records an event after each combine (fr_ahead_mark) and waits
 * before a dispatch until the combine n calls back has run
 * (fr_ahead_wait). Nothing is recorded or waited for while the stream
 * captures a graph (a graph is one launch, whatever it holds). The low-
 * latency and high-throughput CUDA engines both use it.
 */
#ifndef FR_EP_AHEAD_H
#define FR_EP_AHEAD_H

#include <stdint.h>

#include "ep/ep.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_AHEAD_MAX 8

typedef struct fr_ahead {
    int n;                       /* slots in use; 0: the mode is off */
    void *ev[FR_AHEAD_MAX];      /* event after combine k, at k % n */
    uint64_t seen[FR_AHEAD_MAX]; /* k + 1 of the combine recorded there (0: none) */
} fr_ahead_t;

/* n events (1..FR_AHEAD_MAX) on the current device when ep->rx_flush says
 * a thread makes CUDA calls, none otherwise. */
int fr_ahead_init(ferry_ep_t ep, fr_ahead_t *a, int n, fr_err_t *err);
void fr_ahead_free(fr_ahead_t *a);
/* Before call k (the engine's count of combines so far, or its round):
 * wait on the host until the combine recorded in k's slot has run. Past
 * (ranks + 2) x the timeout plus a second (beyond what the kernels' own
 * waits can take, so that their error, naming the rank, comes first),
 * fails naming a dead rank, or with FERRY_ERR_TIMEOUT. check (may be NULL)
 * is the engine's error check, polled while waiting. */
int fr_ahead_wait(ferry_ep_t ep, fr_ahead_t *a, uint64_t k, void *stream, const char *call,
                  int (*check)(ferry_ep_t ep));
/* After combine k was launched on `stream` and its launch checked (a
 * failed record clears CUDA's last error). */
void fr_ahead_mark(fr_ahead_t *a, uint64_t k, void *stream);

#ifdef __cplusplus
}
#endif

#endif
