/*
 * Put-with-signal: checks of a config and of one request (the host-side
 * put, the proxy re-checking every ring request and the fuzzer share
 * them), and the strategies' names.
 */
#include <string.h>

#include "ferry_signal.h"
#include "signal/sig_int.h"
#include "signal/signal.h"

const char *ferry_sig_mode_name(int mode)
{
    switch (mode) {
    case FERRY_SIG_MODE_FENCE: return "fence";
    case FERRY_SIG_MODE_GROUPED: return "grouped";
    case FERRY_SIG_MODE_NICFENCE: return "nicfence";
    case FERRY_SIG_MODE_COUNTED: return "counted";
    default: return "?";
    }
}

int fr_sig_parse_mode(const char *s)
{
    for (int m = FERRY_SIG_MODE_FENCE; m <= FERRY_SIG_MODE_COUNTED; m++)
        if (strcmp(s, ferry_sig_mode_name(m)) == 0)
            return m;
    return -1;
}

int fr_sig_check_req(int nranks, uint64_t heap_bytes, uint32_t nsig,
                     int peer, uint64_t dst_off, uint64_t src_off,
                     uint64_t len, uint32_t sig_index, uint32_t op,
                     fr_err_t *err)
{
    if (peer < 0 || peer >= nranks)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: peer %d is not a rank in [0, %d)", peer, nranks);
    if (src_off > heap_bytes || len > heap_bytes - src_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: src_off %llu + len %llu is outside the heap of "
                      "%llu bytes",
                      (unsigned long long)src_off, (unsigned long long)len,
                      (unsigned long long)heap_bytes);
    if (dst_off > heap_bytes || len > heap_bytes - dst_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: dst_off %llu + len %llu is outside the heap of "
                      "%llu bytes",
                      (unsigned long long)dst_off, (unsigned long long)len,
                      (unsigned long long)heap_bytes);
    if (sig_index != FERRY_SIG_NONE && sig_index >= nsig)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: sig_index %u is not in [0, %u) (num_signals) or "
                      "FERRY_SIG_NONE",
                      sig_index, nsig);
    if (op != FERRY_SIG_SET && op != FERRY_SIG_ADD)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: op %u is neither FERRY_SIG_SET nor FERRY_SIG_ADD",
                      op);
    if (sig_index == FERRY_SIG_NONE && len == 0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "put: len 0 and sig_index FERRY_SIG_NONE: nothing to "
                      "do");
    return FERRY_OK;
}

int fr_sig_check_config(int nranks, const ferry_sig_config_t *c, fr_err_t *err)
{
    if (!c)
        return FR_ERR(err, FERRY_ERR_INVALID, "config: NULL");
    if (c->size != sizeof(*c))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: size %zu, expected %zu (start from "
                      "FERRY_SIG_CONFIG_INIT)",
                      c->size, sizeof(*c));
    if (c->magic != FERRY_SIG_CONFIG_MAGIC)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: magic 0x%08x is not FERRY_SIG_CONFIG_MAGIC "
                      "(start from FERRY_SIG_CONFIG_INIT)",
                      c->magic);
    if (c->version / 100 != FERRY_VERSION_CODE / 100)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: version %u from a header of another minor "
                      "version than this library's %u",
                      c->version, FERRY_VERSION_CODE);
    if (c->heap_bytes == 0 || c->heap_bytes > (1ull << 40))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: heap_bytes %llu is not in [1, 2^40]",
                      (unsigned long long)c->heap_bytes);
    if (c->num_signals == 0 || c->num_signals > (1u << 24))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: num_signals %u is not in [1, 2^24]",
                      c->num_signals);
    if ((int)c->mode < FERRY_SIG_MODE_DEFAULT ||
        (int)c->mode > FERRY_SIG_MODE_COUNTED)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: mode %d is not a ferry_sig_mode_t",
                      (int)c->mode);
    if (c->device != FERRY_DEVICE_CPU && c->device != FERRY_DEVICE_CUDA)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: device %d is neither CPU nor CUDA",
                      (int)c->device);
    if (nranks > FR_SIG_MAX_RANKS)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "put-with-signal supports up to %d ranks, not %d",
                      FR_SIG_MAX_RANKS, nranks);
    return FERRY_OK;
}
