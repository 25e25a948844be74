/* Put-with-signal internals shared with the tests and the fuzzer. */
#ifndef FR_SIGNAL_H
#define FR_SIGNAL_H

#include <stdint.h>

#include "ferry_signal.h"
#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks of a config and of one request (the proxy re-checks every request
 * it takes from the ring, kernels' included). */
int fr_sig_check_config(int nranks, const ferry_sig_config_t *c, fr_err_t *err);
int fr_sig_check_req(int nranks, uint64_t heap_bytes, uint32_t nsig, int peer,
                     uint64_t dst_off, uint64_t src_off, uint64_t len,
                     uint32_t sig_index, uint32_t op, fr_err_t *err);
/* "fence" -> FERRY_SIG_MODE_FENCE, ...; -1 if unknown. */
int fr_sig_parse_mode(const char *s);

#ifdef __cplusplus
}
#endif

#endif
