/* fr_async_set (core/err.h): threads that fail one context at once. Each
 * of 8 threads, released together, sets its own error (code, peer and a
 * message of its own, long enough that two writers would interleave);
 * exactly one call must win, and the status, peer and message read after
 * must all be that thread's. Repeated over many rounds; each round also
 * checks that a reader polling the status never sees it set with a
 * message other than the winner's. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/err.h"
#include "harness.h"

#define NT 8
#define ROUNDS 2000

static fr_async_err_t A;
static int go, won[NT], seen_bad;

static int set(int code, int peer, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int r = fr_async_set(&A, code, peer, fmt, ap);
    va_end(ap);
    return r;
}

static void *writer(void *arg)
{
    int t = (int)(long)arg;
    char fill[400];
    memset(fill, 'a' + t, sizeof(fill) - 1);
    fill[sizeof(fill) - 1] = 0;
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
        ;
    won[t] = set(FERRY_ERR_FABRIC + t % 3, t, "thread %d: %s", t, fill);
    return NULL;
}

static void *reader(void *arg)
{
    (void)arg;
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
        ;
    for (;;) {
        if (fr_async_status(&A) != FERRY_OK) {
            int t = A.peer;
            char want[16];
            snprintf(want, sizeof(want), "thread %d: ", t);
            if (t < 0 || t >= NT || strncmp(A.msg, want, strlen(want)) != 0 ||
                strspn(A.msg + strlen(want), (char[]){(char)('a' + t), 0}) != 399)
                seen_bad = 1;
            return NULL;
        }
    }
}

int main(void)
{
    int bad_rounds = 0;
    for (int round = 0; round < ROUNDS; round++) {
        memset(&A, 0, sizeof(A));
        go = 0;
        seen_bad = 0;
        pthread_t th[NT + 1];
        for (int t = 0; t < NT; t++)
            pthread_create(&th[t], NULL, writer, (void *)(long)t);
        pthread_create(&th[NT], NULL, reader, NULL);
        __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
        for (int t = 0; t <= NT; t++)
            pthread_join(th[t], NULL);
        int winners = 0, w = -1;
        for (int t = 0; t < NT; t++)
            if (won[t]) {
                winners++;
                w = t;
            }
        int ok = winners == 1 && !seen_bad && A.peer == w &&
                 fr_async_status(&A) == FERRY_ERR_FABRIC + w % 3;
        if (ok) {
            char want[16];
            snprintf(want, sizeof(want), "thread %d: ", w);
            ok = strncmp(A.msg, want, strlen(want)) == 0 && strlen(A.msg) == strlen(want) + 399;
            for (size_t i = strlen(want); ok && A.msg[i]; i++)
                ok = A.msg[i] == 'a' + w;
        }
        if (!ok && bad_rounds++ < 5)
            fprintf(stderr, "round %d: %d winner(s), reader %s, status %d peer %d msg '%.40s...'\n",
                    round, winners, seen_bad ? "saw a torn error" : "ok", fr_async_status(&A),
                    A.peer, A.msg);
    }
    CHECK(bad_rounds == 0, "%d of %d rounds had no single, whole error", bad_rounds, ROUNDS);
    /* a later error never replaces the first; FERRY_OK is not a status */
    memset(&A, 0, sizeof(A));
    CHECK(set(FERRY_OK, 3, "first") == 1, "the first set must win");
    CHECK(fr_async_status(&A) == FERRY_ERR_INTERNAL, "FERRY_OK set as %d", fr_async_status(&A));
    CHECK(set(FERRY_ERR_PEER, 4, "second") == 0, "a second set must lose");
    CHECK(A.peer == 3 && strcmp(A.msg, "first") == 0, "the first error was replaced: %d '%s'",
          A.peer, A.msg);
    if (!fr_test_failures)
        printf("async: %d rounds of %d threads, one whole error each\n", ROUNDS, NT);
    return fr_test_result();
}
