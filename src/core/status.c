#include <stdio.h>

#include "err.h"
#include "log.h"

const char *ferry_strerror(int status)
{
    switch (status) {
    case FERRY_OK: return "success";
    case FERRY_ERR_INVALID: return "invalid argument";
    case FERRY_ERR_UNSUPPORTED: return "unsupported";
    case FERRY_ERR_NOMEM: return "out of memory";
    case FERRY_ERR_SYSTEM: return "system call failed";
    case FERRY_ERR_FABRIC: return "fabric error";
    case FERRY_ERR_TIMEOUT: return "timed out waiting for peers";
    case FERRY_ERR_PEER: return "peer failed";
    case FERRY_ERR_PROTOCOL: return "protocol error";
    case FERRY_ERR_STATE: return "call out of sequence";
    case FERRY_ERR_BOOTSTRAP: return "bootstrap failed";
    case FERRY_ERR_INTERNAL: return "internal error";
    default: return "unknown status";
    }
}

int fr_err_set(fr_err_t *e, int code, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}

int fr_async_set(fr_async_err_t *a, int code, int peer, const char *fmt, va_list ap)
{
    int free_ = 0;
    if (!__atomic_compare_exchange_n(&a->claimed, &free_, 1, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return 0;
    vsnprintf(a->msg, sizeof(a->msg), fmt, ap);
    a->peer = peer;
    __atomic_store_n(&a->status, code == FERRY_OK ? FERRY_ERR_INTERNAL : code,
                     __ATOMIC_RELEASE);
    return 1;
}

int fr_async_fail(fr_async_err_t *a, int sub, int code, int peer, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int set = fr_async_set(a, code, peer, fmt, ap);
    va_end(ap);
    if (set)
        FR_LOG_WARN(sub, "%s", a->msg);
    return set;
}
