/* Internal error reporting: one status code plus a detailed message. */
#ifndef FR_ERR_H
#define FR_ERR_H

#include <stdarg.h>
#include <stddef.h>

#include "ferry.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_ERRMSG_LEN 512

typedef struct fr_err {
    char msg[FR_ERRMSG_LEN];
} fr_err_t;

/* Format a message into e (if not NULL) and return code. */
int fr_err_set(fr_err_t *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FR_ERR(e, code, ...) fr_err_set((e), (code), __VA_ARGS__)

/* An error a helper thread (a proxy, a fabric thread) sets for the calls
 * of the owner's thread to report: the first one set wins. status is
 * FERRY_OK until set; peer and msg are whole once status, read with
 * acquire (fr_async_status), is not. */
typedef struct fr_async_err {
    int status;  /* atomic */
    int claimed; /* atomic: taken by the one writer */
    int peer;    /* the rank blamed, or -1 */
    char msg[FR_ERRMSG_LEN];
} fr_async_err_t;

/* Set a (code, peer, the formatted message) unless another error was set
 * first: 1 when this call set it, else 0. Safe from any thread. */
int fr_async_set(fr_async_err_t *a, int code, int peer, const char *fmt, va_list ap);
/* fr_async_set, and the message logged at WARN under subsystem `sub`
 * (core/log.h) when this call set it. */
int fr_async_fail(fr_async_err_t *a, int sub, int code, int peer, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static inline int fr_async_status(const fr_async_err_t *a)
{
    return __atomic_load_n(&a->status, __ATOMIC_ACQUIRE);
}

/* Evaluate a status-returning call; on error jump to label with rc set. */
#define FR_CHECK_GOTO(call, rc, label)                                         \
    do {                                                                       \
        (rc) = (call);                                                         \
        if ((rc) != FERRY_OK)                                                  \
            goto label;                                                        \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
