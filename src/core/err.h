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
