/*
 * The API layer's private header: the public calls in comm.c, create.c
 * and round.c sit on the EP runtime (ep/), the engines and the proxy.
 * Nothing below this layer includes it.
 */
#ifndef FR_API_H
#define FR_API_H

#include "engines/engine.h"
#include "ep/ep.h"
#include "proxy/proxy.h"

/* Argument checks (also run under the fuzzer). */
int fr_ep_check_config(int nranks, const ferry_ep_config_t *c, fr_err_t *err);
int fr_check_dispatch_args(const fr_layout_t *L, const ferry_dispatch_in_t *in,
                           int on_gpu, fr_err_t *err);
/* An argument struct (first field its size) copied into `cur`, the
 * current layout of `cur_size` bytes: fields past the caller's size
 * zeroed, cur's size set to cur_size. The caller checked the size. */
void fr_args_current(void *cur, size_t cur_size, const void *args);
/* Whether a caller's struct of `have` bytes is one ferry takes: `cur`
 * bytes or more (the current layout), or exactly one of `old` (a list
 * ending with 0), the sizes before fields added later; a size between two
 * of them would split a field. */
int fr_args_size_taken(size_t have, size_t cur, const size_t *old);
/* groupT: DP groups, the group's max_tokens (num_tokens is the group's),
 * else 0. topk_idx's values are the engine's to check, within the route's
 * exchange. */
int fr_check_route_args(const fr_layout_t *L, const ferry_route_in_t *in, int groupT,
                        fr_err_t *err);

/* FERRY_OK when the context can take a call (no earlier failure, no error
 * reported by the device), else its status with the message set. */
int fr_ep_usable(ferry_ep_t ep);
/* A stream the context can run on (round.c): where a fabric provider
 * copies into GPU memory on the legacy default stream, one created with
 * cudaStreamNonBlocking (FERRY_ERR_INVALID naming `name` otherwise). */
int fr_check_stream(ferry_ep_t ep, void *stream, const char *name);

#endif
