/* Minimal test harness: CHECK records a failure and goes on; the test's
 * main returns fr_test_result(). */
#ifndef FR_TEST_HARNESS_H
#define FR_TEST_HARNESS_H

#include <stdio.h>
#include <stdlib.h>

static int fr_test_failures;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fr_test_failures++;                                                \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__,   \
                    #cond);                                                    \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
        }                                                                      \
    } while (0)

#define CHECK_RC(call, want)                                                   \
    do {                                                                       \
        int rc_ = (call);                                                      \
        CHECK(rc_ == (want), "%s returned %d (%s), want %d", #call, rc_,       \
              ferry_strerror(rc_), (int)(want));                               \
    } while (0)

static inline int fr_test_result(void) { return fr_test_failures ? 1 : 0; }

#endif
