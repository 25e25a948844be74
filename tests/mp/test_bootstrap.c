/*
 * TCP bootstrap, self-launched with fr_launch_local.
 *
 *   test_bootstrap -n N                      allgathers, barrier, close
 *   test_bootstrap -n N --kill R [--watch]   rank R dies after the first
 *                                            allgather; the others must see
 *                                            FERRY_ERR_PEER naming R (with
 *                                            --watch they first wait for the
 *                                            watcher to report it)
 *   test_bootstrap -n N --absent R           rank R never starts: the root
 *                                            fails with FERRY_ERR_BOOTSTRAP
 *                                            naming R, the others fail too
 *   test_bootstrap -n N --stall R            rank R is late for the second
 *                                            allgather: FERRY_ERR_TIMEOUT
 *                                            naming R everywhere, then a
 *                                            clean close
 *
 * The parent also checks the callback flavour with a fake allgather.
 *
 * Each rank exits 0 when everything it saw was as expected. The parent
 * passes when every rank exited 0, except the killed one (signal 9).
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "core/config.h"
#include "core/err.h"
#include "harness.h"
#include "launch.h"

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static unsigned char pattern(int rank, int iter, size_t i)
{
    return (unsigned char)(rank * 131 + (int)(i * 7) + iter * 29 +
                           (int)(i >> 8) + (int)(i >> 16));
}

/* One allgather of len bytes; returns its status, checks the data. */
static int gather_check(fr_boot_t *b, size_t len, int iter, int in_place,
                        fr_err_t *err)
{
    int rank = fr_boot_rank(b), size = fr_boot_size(b);
    unsigned char *out = malloc(len * (size_t)size + 1);
    unsigned char *in = in_place ? out + (size_t)rank * len : malloc(len + 1);
    if (!out || !in) {
        CHECK(0, "out of memory");
        exit(2);
    }
    memset(out, 0xEE, len * (size_t)size);
    for (size_t i = 0; i < len; i++)
        in[i] = pattern(rank, iter, i);
    int rc = fr_boot_allgather(b, in, out, len, err);
    if (rc == FERRY_OK) {
        for (int r = 0; r < size; r++) {
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < len; i++)
                if (out[(size_t)r * len + i] != pattern(r, iter, i) && !bad++)
                    first = i;
            CHECK(bad == 0,
                  "rank %d: allgather of %zu bytes (iter %d): %zu wrong bytes "
                  "from rank %d, first at %zu",
                  rank, len, iter, bad, r, first);
        }
    }
    if (!in_place)
        free(in);
    free(out);
    return rc;
}

static int run_rank(int kill_rank, int watch, int absent_rank,
                    int stall_rank)
{
    fr_err_t err = {{0}};
    fr_boot_env_t env;
    int rc = fr_boot_env_read(&env, &err);
    CHECK(rc == FERRY_OK, "env: %s", err.msg);
    if (rc != FERRY_OK)
        return fr_test_result();
    CHECK(strcmp(env.source, "FERRY") == 0, "source %s", env.source);
    if (env.rank == absent_rank)
        _exit(0); /* never shows up */

    long tmo = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    long btmo = fr_cfg_int(FR_CFG_BOOTSTRAP_TIMEOUT_MS);
    fr_boot_t *b = NULL;
    int64_t t0 = now_ms();
    rc = fr_boot_init_tcp(&env, &b, &err);
    int64_t took = now_ms() - t0;

    if (absent_rank >= 0) {
        char want[64];
        snprintf(want, sizeof(want), "%d of %d", absent_rank, env.size);
        CHECK(rc == FERRY_ERR_BOOTSTRAP, "rank %d: init returned %d (%s)",
              env.rank, rc, err.msg);
        CHECK(b == NULL, "handle set on failure");
        CHECK(strstr(err.msg, want) != NULL,
              "rank %d: message does not name rank %d: %s", env.rank,
              absent_rank, err.msg);
        if (env.rank == 0)
            CHECK(took >= btmo - 50 && took <= btmo + 1000,
                  "root gave up after %lld ms, timeout %ld",
                  (long long)took, btmo);
        else
            CHECK(strstr(err.msg, "127.0.0.1:") != NULL,
                  "rank %d: message does not name the root: %s", env.rank,
                  err.msg);
        CHECK(took <= btmo + 2000, "rank %d failed after %lld ms",
              env.rank, (long long)took);
        fprintf(stderr, "rank %d: init failed as expected after %lld ms: %s\n",
                env.rank, (long long)took, err.msg);
        return fr_test_result();
    }

    CHECK(rc == FERRY_OK, "rank %d: init: %s", env.rank, err.msg);
    if (rc != FERRY_OK)
        return fr_test_result();
    CHECK(fr_boot_rank(b) == env.rank && fr_boot_size(b) == env.size,
          "rank/size %d/%d", fr_boot_rank(b), fr_boot_size(b));
    CHECK(fr_boot_dead_rank(b) == -1, "dead rank %d at start",
          fr_boot_dead_rank(b));

    static const size_t lens[] = {1, 4096, 1 << 20, 0, 4096, 1 << 20};
    for (int it = 0; it < (int)(sizeof(lens) / sizeof(lens[0])); it++) {
        if (kill_rank >= 0 && it == 1) {
            if (env.rank == kill_rank) {
                fflush(stderr);
                raise(SIGKILL);
            }
            int64_t k0 = now_ms();
            if (watch) {
                while (fr_boot_dead_rank(b) < 0 && now_ms() - k0 < tmo + 1000)
                    usleep(5000);
                int64_t seen = now_ms() - k0;
                CHECK(fr_boot_dead_rank(b) == kill_rank,
                      "rank %d: watcher reports dead rank %d, want %d",
                      env.rank, fr_boot_dead_rank(b), kill_rank);
                CHECK(seen <= tmo + 1000, "watcher took %lld ms",
                      (long long)seen);
                fprintf(stderr, "rank %d: watcher saw rank %d die in %lld ms\n",
                        env.rank, fr_boot_dead_rank(b), (long long)seen);
            }
            rc = gather_check(b, lens[it], it, 0, &err);
            int64_t took2 = now_ms() - k0;
            char want[64];
            snprintf(want, sizeof(want), "rank %d died", kill_rank);
            CHECK(rc == FERRY_ERR_PEER, "rank %d: allgather after the kill "
                  "returned %d (%s)", env.rank, rc, err.msg);
            CHECK(strstr(err.msg, want) != NULL,
                  "rank %d: message does not say '%s': %s", env.rank, want,
                  err.msg);
            CHECK(fr_boot_dead_rank(b) == kill_rank, "dead rank %d, want %d",
                  fr_boot_dead_rank(b), kill_rank);
            CHECK(took2 <= tmo + 1000, "rank %d: failure took %lld ms",
                  env.rank, (long long)took2);
            fprintf(stderr, "rank %d: allgather failed after %lld ms: %s\n",
                    env.rank, (long long)took2, err.msg);
            /* Later calls fail at once. */
            int64_t k1 = now_ms();
            CHECK_RC(fr_boot_barrier(b, &err), FERRY_ERR_PEER);
            CHECK(now_ms() - k1 < 500, "barrier after the death took %lld ms",
                  (long long)(now_ms() - k1));
            k1 = now_ms();
            rc = fr_boot_close(b, &err);
            int64_t took3 = now_ms() - k1;
            CHECK(rc == FERRY_ERR_PEER && strstr(err.msg, want),
                  "rank %d: close returned %d (%s)", env.rank, rc, err.msg);
            CHECK(took3 <= tmo + 1000, "close took %lld ms", (long long)took3);
            fprintf(stderr, "rank %d: closed in %lld ms: %s\n", env.rank,
                    (long long)took3, err.msg);
            return fr_test_result();
        }
        if (stall_rank >= 0 && it == 1) {
            /* Rank stall_rank comes FERRY_TIMEOUT_MS + 500 ms late. */
            char want[64];
            snprintf(want, sizeof(want), "rank %d of %d had not sent",
                     stall_rank, env.size);
            if (env.rank == stall_rank)
                usleep((useconds_t)(tmo + 500) * 1000);
            int64_t s0 = now_ms();
            rc = gather_check(b, lens[it], it, 0, &err);
            int64_t took2 = now_ms() - s0;
            CHECK(rc == FERRY_ERR_TIMEOUT && strstr(err.msg, want),
                  "rank %d: late allgather returned %d (%s), want TIMEOUT "
                  "with '%s'", env.rank, rc, err.msg, want);
            if (env.rank != stall_rank)
                CHECK(took2 >= tmo - 50 && took2 <= tmo + 1000,
                      "rank %d: timed out after %lld ms, deadline %ld",
                      env.rank, (long long)took2, tmo);
            fprintf(stderr, "rank %d: allgather failed after %lld ms: %s\n",
                    env.rank, (long long)took2, err.msg);
            CHECK(fr_boot_dead_rank(b) == -1, "dead rank %d",
                  fr_boot_dead_rank(b));
            CHECK_RC(fr_boot_barrier(b, &err), FERRY_ERR_TIMEOUT);
            rc = fr_boot_close(b, &err);
            CHECK(rc == FERRY_OK, "rank %d: close after a timeout: %d %s",
                  env.rank, rc, err.msg);
            return fr_test_result();
        }
        rc = gather_check(b, lens[it], it, it == 4, &err);
        CHECK(rc == FERRY_OK, "rank %d: allgather %d (%zu bytes): %s",
              env.rank, it, lens[it], err.msg);
        if (rc != FERRY_OK)
            break;
    }
    for (int i = 0; i < 3; i++) {
        rc = fr_boot_barrier(b, &err);
        CHECK(rc == FERRY_OK, "rank %d: barrier: %s", env.rank, err.msg);
    }
    CHECK(fr_boot_dead_rank(b) == -1, "dead rank %d", fr_boot_dead_rank(b));
    /* Uneven arrival at close: the root must wait for the late ones. */
    if (env.rank == env.size - 1)
        usleep(200 * 1000);
    rc = fr_boot_close(b, &err);
    CHECK(rc == FERRY_OK, "rank %d: close: %s", env.rank, err.msg);
    return fr_test_result();
}

/* Callback flavour: a fake "world" of cb_size ranks where every rank
 * contributes the same block. */
static int cb_fail;
static int fake_allgather(const void *in, void *out, size_t len, void *ctx)
{
    int size = *(int *)ctx;
    if (cb_fail)
        return 42;
    for (int r = 0; r < size; r++)
        memcpy((char *)out + (size_t)r * len, in, len);
    return 0;
}

static void check_callback(void)
{
    int size = 3;
    fr_err_t err = {{0}};
    fr_boot_t *b = NULL;
    CHECK_RC(fr_boot_init_callback(1, size, NULL, &size, &b, &err),
             FERRY_ERR_INVALID);
    CHECK_RC(fr_boot_init_callback(3, size, fake_allgather, &size, &b, &err),
             FERRY_ERR_INVALID);
    CHECK(strstr(err.msg, "rank=3"), "message: %s", err.msg);
    CHECK_RC(fr_boot_init_callback(1, size, fake_allgather, &size, &b, &err),
             FERRY_OK);
    if (!b)
        return;
    CHECK(fr_boot_rank(b) == 1 && fr_boot_size(b) == 3, "rank/size");
    uint32_t in = 0xabcd1234u, out[3] = {0};
    CHECK_RC(fr_boot_allgather(b, &in, out, 4, &err), FERRY_OK);
    CHECK(out[0] == in && out[1] == in && out[2] == in, "callback data");
    CHECK_RC(fr_boot_barrier(b, &err), FERRY_OK);
    CHECK(fr_boot_dead_rank(b) == -1, "callback dead rank");
    cb_fail = 1;
    CHECK_RC(fr_boot_allgather(b, &in, out, 4, &err), FERRY_ERR_PEER);
    CHECK(strstr(err.msg, "42"), "message: %s", err.msg);
    CHECK_RC(fr_boot_barrier(b, &err), FERRY_ERR_PEER);
    CHECK_RC(fr_boot_close(b, &err), FERRY_OK);
    CHECK_RC(fr_boot_close(NULL, &err), FERRY_OK);
}

int main(int argc, char **argv)
{
    int n = 0, kill_rank = -1, absent = -1, watch = 0, stall = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n") && i + 1 < argc)
            n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kill") && i + 1 < argc)
            kill_rank = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--absent") && i + 1 < argc)
            absent = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stall") && i + 1 < argc)
            stall = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--watch"))
            watch = 1;
        else {
            fprintf(stderr, "usage: %s -n N [--kill R [--watch]] "
                            "[--absent R] [--stall R]\n", argv[0]);
            return 2;
        }
    }
    if (n < 1 || kill_rank >= n || absent >= n || stall >= n) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    /* Short deadlines so failures show quickly (unless set by the caller). */
    setenv("FERRY_TIMEOUT_MS",
           stall >= 0 ? "2000" : kill_rank >= 0 ? "5000" : "20000", 0);
    check_callback();
    setenv("FERRY_BOOTSTRAP_TIMEOUT_MS", absent >= 0 ? "2000" : "30000", 0);

    int *st = calloc((size_t)n, sizeof(int));
    fr_err_t err = {{0}};
    int is_child = 0;
    int64_t t0 = now_ms();
    int rc = fr_launch_local_ex(n, &is_child, st, &err);
    if (is_child) {
        free(st);
        return run_rank(kill_rank, watch, absent, stall);
    }
    CHECK(rc >= 0, "launch failed: %d %s", rc, err.msg);
    for (int i = 0; i < n; i++) {
        int want = i == kill_rank ? 128 + SIGKILL : 0;
        CHECK(st[i] == want, "rank %d exit status %d, want %d", i, st[i],
              want);
    }
    CHECK(rc == (kill_rank >= 0 ? 128 + SIGKILL : 0),
          "launcher returned %d", rc);
    free(st);
    printf("test_bootstrap -n %d%s%s%s: %s in %lld ms\n", n,
           kill_rank >= 0 ? " --kill" : "", absent >= 0 ? " --absent" : "",
           stall >= 0 ? " --stall" : "",
           fr_test_result() ? "FAIL" : "pass", (long long)(now_ms() - t0));
    return fr_test_result();
}
