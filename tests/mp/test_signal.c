/*
 * Multi-process test of put-with-signal (include/ferry_signal.h).
 *
 *   test_signal -n N [-r rounds] [-M transfers] [-m max_bytes] [-s seed]
 *               [-x] MODE [victim]
 *
 * MODE:
 *   stress  every round each rank sends every rank (itself included) a
 *           random number (0..M) of transfers of random size (0..max bytes,
 *           0 = signal only) in a random interleaving across destinations;
 *           each transfer is a put with no signal, with ADD 1 on the
 *           sender's counter word, or with SET of its index on the sender's
 *           index word; the last transfer of a round always signals. The
 *           receiver polls the words and, the moment a signal shows a
 *           transfer covered, checks its bytes against a pattern of (seed,
 *           round, sender, receiver, index) and poisons them again: stale
 *           or missing data fails. The ordering mode comes from
 *           FERRY_SIGNAL_MODE (or -x: every mode in turn, one context
 *           each). Ends checking the landed counts.
 *   args    bad configs and arguments are FERRY_ERR_INVALID naming the
 *           argument; a config differing between ranks fails on all ranks
 *           naming the rank; nicfence where the provider lacks FI_FENCE is
 *           FERRY_ERR_UNSUPPORTED on every rank.
 *   sticky  every write held back 3 s, a quiet times out after 300 ms: a
 *           later put fails with the quiet's message ("failed before: ...").
 *   kill V  rank V dies in round 3 after queueing half its transfers; every
 *           other rank fails naming rank V within FERRY_TIMEOUT_MS + 1 s.
 *   kernel_args  (CUDA builds, a GPU) on a CUDA context, a kernel makes
 *           one bad call each time (bad peer, source or destination range,
 *           signal word, op; a wait on a missing word): the call returns
 *           FERRY_ERR_INVALID in the kernel, the host's next check and
 *           quiet return it naming what was wrong, nothing reaches a peer.
 *
 * Under an outside launcher (FERRY_RANK set, tests/cluster.sh) this process
 * is one rank and writes its verdict to $FERRY_TEST_DIR.
 */
#include <signal.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "ferry_signal.h"
#include "harness.h"
#include "launch.h"
#include "verdicts.h"

static uint64_t g_seed = 1;
static int g_rounds = 20, g_M = 8;
static uint64_t g_max = 65536;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t key(int round, int s, int r, int i, int salt)
{
    return mix(g_seed * 0x100000001b3ull ^ ((uint64_t)round << 44) ^
               ((uint64_t)s << 32) ^ ((uint64_t)r << 20) ^
               ((uint64_t)i << 4) ^ (uint64_t)salt);
}

/* The plan of one round: what s sends r. Both sides compute it. */
enum { OP_NONE = 0, OP_ADD = 1, OP_SET = 2 };
typedef struct xfer {
    uint64_t len;
    int op;
} xfer_t;

static int plan_count(int round, int s, int r)
{
    return (int)(key(round, s, r, 0, 1) % (uint64_t)(g_M + 1));
}

static xfer_t plan_xfer(int round, int s, int r, int i, int n)
{
    xfer_t x;
    uint64_t k = key(round, s, r, i, 2);
    switch (k % 8) { /* a few sizes at the ends of the range */
    case 0: x.len = 0; break;
    case 1: x.len = 1 + (k >> 8) % 64; break;
    case 2: x.len = g_max; break;
    default: x.len = 1 + (k >> 8) % g_max; break;
    }
    int o = (int)((k >> 40) % 3);
    x.op = o == 0 ? OP_NONE : o == 1 ? OP_ADD : OP_SET;
    if (x.len == 0 && x.op == OP_NONE)
        x.op = OP_ADD;
    if (i == n - 1 && x.op == OP_NONE)
        x.op = OP_SET; /* the round ends covered */
    return x;
}

static uint8_t pat(int round, int s, int r, int i, uint64_t j)
{
    uint64_t k = key(round, s, r, i, 3);
    return (uint8_t)(k >> ((j % 7) * 8)) ^ (uint8_t)(j * 131u) ^ (uint8_t)(j >> 8);
}

#define POISON 0x5A
#define W_CNT(s) (2u * (uint32_t)(s))
#define W_IDX(s) (2u * (uint32_t)(s) + 1u)

/* Heap: [0, N*M*max) inbox slots [sender][i]; then outbox [dest][i]. */
static uint64_t in_off(int s, int i) { return ((uint64_t)s * g_M + i) * g_max; }
static uint64_t out_off(int N, int d, int i)
{
    return ((uint64_t)N * g_M + (uint64_t)d * g_M + i) * g_max;
}

typedef struct rx_state {
    uint64_t cnt_base, idx_base; /* word values at the round's start */
    int covered;                 /* transfers checked this round */
} rx_state_t;

/* Check transfers of s newly covered by what the words say now. */
static int rx_check(ferry_sig_t sig, uint8_t *heap, int round, int s, int me,
                    rx_state_t *st, int n, long *nchecked)
{
    uint64_t cnt = ferry_sig_read(sig, W_CNT(s)) - st->cnt_base;
    uint64_t idx = ferry_sig_read(sig, W_IDX(s));
    /* covered: the last SET index this round, or the cnt-th ADD */
    int upto = 0;
    if (idx > st->idx_base) /* SET values are (round << 16) + i + 1 */
        upto = (int)(idx - ((uint64_t)round << 16));
    uint64_t adds = 0;
    for (int i = 0; i < n && adds < cnt; i++)
        if (plan_xfer(round, s, me, i, n).op == OP_ADD && ++adds == cnt &&
            i + 1 > upto)
            upto = i + 1;
    if (upto > n) {
        CHECK(0, "round %d: signals from rank %d cover %d transfers, %d were "
                 "sent", round, s, upto, n);
        return -1;
    }
    for (int i = st->covered; i < upto; i++) {
        xfer_t x = plan_xfer(round, s, me, i, n);
        uint8_t *p = heap + in_off(s, i);
        uint64_t bad = x.len;
        uint8_t got = 0;
        for (uint64_t j = 0; j < x.len; j++)
            if ((got = p[j]) != pat(round, s, me, i, j)) {
                bad = j;
                break;
            }
        if (bad != x.len) {
            CHECK(0, "round %d: transfer %d from rank %d (%llu bytes) seen "
                     "covered by a signal, byte %llu is 0x%02x, want 0x%02x%s",
                  round, i, s, (unsigned long long)x.len,
                  (unsigned long long)bad, got, pat(round, s, me, i, bad),
                  got == POISON ? " (not landed)" : " (stale)");
            return -1;
        }
        memset(p, POISON, x.len);
        (*nchecked)++;
    }
    if (upto > st->covered)
        st->covered = upto;
    return 0;
}

static int run_rounds(ferry_comm_t comm, int mode, int victim)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    ferry_sig_config_t cfg = FERRY_SIG_CONFIG_INIT;
    cfg.heap_bytes = 2ull * N * g_M * g_max;
    cfg.num_signals = 2u * (uint32_t)N + 1;
    cfg.mode = (ferry_sig_mode_t)mode;
    ferry_sig_t sig = NULL;
    rc = ferry_sig_create(comm, &cfg, &sig);
    if (rc != FERRY_OK) {
        fprintf(stderr, "rank %d: create: %s: %s\n", me, ferry_strerror(rc),
                ferry_comm_last_error(comm));
        return 1;
    }
    long timeout = strtol(getenv("FERRY_TIMEOUT_MS") ? getenv("FERRY_TIMEOUT_MS")
                                                     : "30000", NULL, 10);
    uint8_t *heap = ferry_sig_heap(sig);
    memset(heap, POISON, (size_t)N * g_M * g_max);
    /* nobody writes into a heap before its owner poisoned it */
    rc = ferry_comm_barrier(comm);
    CHECK(rc == FERRY_OK, "barrier: %s", ferry_comm_last_error(comm));
    rx_state_t *st = calloc((size_t)N, sizeof(*st));
    int *order = malloc(sizeof(int) * (size_t)N * (g_M + 1));
    int *next = calloc((size_t)N, sizeof(int));
    uint64_t *puts_from = calloc((size_t)N, sizeof(uint64_t));
    long nchecked = 0, nsent = 0;
    double t_start = now_ms();
    for (int round = 1; round <= g_rounds; round++) {
        /* bases were read after the last round's checks, before its
         * barrier: a fast peer may already be sending this round */
        for (int s = 0; s < N; s++)
            st[s].covered = 0;
        /* send: a random interleaving of every destination's transfers */
        int tot = 0;
        for (int d = 0; d < N; d++) {
            next[d] = 0;
            for (int i = 0; i < plan_count(round, me, d); i++)
                order[tot++] = d;
        }
        for (int i = tot - 1; i > 0; i--) {
            int j = (int)(key(round, me, i, 0, 4) % (uint64_t)(i + 1));
            int t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        double t0 = now_ms();
        rc = FERRY_OK;
        for (int k = 0; k < tot && rc == FERRY_OK; k++) {
            if (round == 3 && me == victim && k == tot / 2)
                raise(SIGKILL);
            int d = order[k], i = next[d]++, n = plan_count(round, me, d);
            xfer_t x = plan_xfer(round, me, d, i, n);
            uint8_t *src = heap + out_off(N, d, i);
            for (uint64_t j = 0; j < x.len; j++)
                src[j] = pat(round, me, d, i, j);
            uint32_t w = x.op == OP_ADD ? W_CNT(me)
                         : x.op == OP_SET ? W_IDX(me) : FERRY_SIG_NONE;
            uint64_t v = x.op == OP_SET ? ((uint64_t)round << 16) + (uint64_t)i + 1 : 1;
            rc = ferry_sig_put(sig, d, in_off(me, i), out_off(N, d, i), x.len, w,
                               x.op == OP_SET ? FERRY_SIG_SET : FERRY_SIG_ADD, v);
            nsent++;
        }
        /* receive: check as signals show transfers covered */
        int done = 0;
        while (rc == FERRY_OK && !done) {
            done = 1;
            for (int s = 0; s < N; s++) {
                int n = plan_count(round, s, me);
                if (st[s].covered < n) {
                    if (rx_check(sig, heap, round, s, me, &st[s], n, &nchecked))
                        goto out;
                    if (st[s].covered < n)
                        done = 0;
                }
            }
            if (!done) {
                sched_yield();
                rc = ferry_sig_check(sig); /* errors and deaths */
                if (rc == FERRY_OK && now_ms() - t0 > (double)timeout) {
                    rc = FERRY_ERR_TIMEOUT;
                    CHECK(victim >= 0, "round %d: signals missing after %ld ms",
                          round, timeout);
                    for (int s = 0; s < N; s++)
                        fprintf(stderr, "rank %d: from rank %d: %d of %d covered\n",
                                me, s, st[s].covered, plan_count(round, s, me));
                }
            }
        }
        if (rc == FERRY_OK)
            rc = ferry_sig_quiet(sig);
        for (int s = 0; s < N && rc == FERRY_OK; s++) {
            st[s].cnt_base = ferry_sig_read(sig, W_CNT(s));
            st[s].idx_base = ferry_sig_read(sig, W_IDX(s));
        }
        if (rc == FERRY_OK)
            rc = ferry_comm_barrier(comm);
        double dt = now_ms() - t0;
        if (rc != FERRY_OK) {
            const char *msg = ferry_sig_last_error(sig);
            if (victim < 0) {
                CHECK(0, "round %d: %s: %s", round, ferry_strerror(rc), msg);
                goto out;
            }
            char want[32];
            snprintf(want, sizeof(want), "rank %d", victim);
            fprintf(stderr, "rank %d: round %d failed after %.0f ms: %s: %s\n",
                    me, round, dt, ferry_strerror(rc),
                    rc == FERRY_ERR_PEER || strstr(msg, want) ? msg
                                                              : ferry_comm_last_error(comm));
            CHECK(round == 3, "failed in round %d, the victim dies in round 3", round);
            CHECK(rc == FERRY_ERR_PEER || rc == FERRY_ERR_TIMEOUT ||
                      rc == FERRY_ERR_BOOTSTRAP, "status %d", rc);
            CHECK(strstr(msg, want) || strstr(ferry_comm_last_error(comm), want),
                  "message does not name %s", want);
            CHECK(dt <= (double)timeout + 1000.0, "took %.0f ms > timeout + 1 s", dt);
            ferry_sig_destroy(sig);
            free(st); free(order); free(next); free(puts_from);
            return fr_test_result();
        }
        for (int s = 0; s < N; s++)
            for (int i = 0; i < plan_count(round, s, me); i++)
                puts_from[s] += plan_xfer(round, s, me, i, plan_count(round, s, me)).len > 0;
    }
    if (victim >= 0) {
        CHECK(0, "no error although rank %d died", victim);
        goto out;
    }
    /* every put landed, and is counted without gaps */
    for (int s = 0; s < N; s++) {
        uint64_t got = 0;
        double t0 = now_ms();
        do {
            ferry_sig_landed(sig, s, &got);
        } while (got < puts_from[s] && now_ms() - t0 < 5000 && (sched_yield(), 1));
        CHECK(got == puts_from[s], "landed from rank %d: %llu, want %llu", s,
              (unsigned long long)got, (unsigned long long)puts_from[s]);
    }
    printf("rank %d: mode %s: %d rounds, %ld transfers sent, %ld checked at "
           "signal time, %.0f ms\n",
           me, ferry_sig_mode_name(ferry_sig_mode(sig)), g_rounds, nsent,
           nchecked, now_ms() - t_start);
out:
    CHECK_RC(ferry_sig_destroy(sig), FERRY_OK);
    free(st); free(order); free(next); free(puts_from);
    return fr_test_result();
}

#ifdef FERRY_HAVE_CUDA
#include "../../tools/signal_kernels.h"

static int run_kernel_args(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm);
    static const char *const named[FSB_BAD_CALLS] = {
        "peer outside", "peer outside", "src_off", "dst_off",
        "put: sig_index", "op is neither", "ferry_sig_dev_wait: sig_index"};
    for (int w = 0; w < FSB_BAD_CALLS; w++) {
        ferry_sig_config_t c = FERRY_SIG_CONFIG_INIT;
        c.heap_bytes = 4096;
        c.num_signals = 4;
        c.device = FERRY_DEVICE_CUDA;
        ferry_sig_t sig = NULL;
        int rc = ferry_sig_create(comm, &c, &sig);
        CHECK(rc == FERRY_OK, "create: %s", ferry_comm_last_error(comm));
        if (rc != FERRY_OK)
            return fr_test_result();
        ferry_sig_device_t dev;
        CHECK_RC(ferry_sig_device(sig, &dev), FERRY_OK);
        int krc = 0;
        char why[256] = "";
        rc = fsb_cuda_bad_call(&dev, w, &krc, why, sizeof(why));
        CHECK(rc == 0, "call %d: kernel: %s", w, why);
        CHECK(krc == FERRY_ERR_INVALID, "call %d: the kernel got %d", w, krc);
        rc = ferry_sig_check(sig);
        CHECK(rc == FERRY_ERR_INVALID &&
                  strstr(ferry_sig_last_error(sig), named[w]) &&
                  strstr(ferry_sig_last_error(sig), "kernel"),
              "call %d: check %d '%s' (want '%s')", w, rc,
              ferry_sig_last_error(sig), named[w]);
        CHECK_RC(ferry_sig_quiet(sig), FERRY_ERR_INVALID);
        if (me == 0 && w == 0)
            printf("kernel's bad call reported: %s\n", ferry_sig_last_error(sig));
        /* nothing went out: no rank saw a put from any rank */
        CHECK_RC(ferry_comm_barrier(comm), FERRY_OK);
        for (int s = 0; s < N; s++) {
            uint64_t got = 1;
            CHECK_RC(ferry_sig_landed(sig, s, &got), FERRY_OK);
            CHECK(got == 0, "call %d: %llu puts from rank %d landed", w,
                  (unsigned long long)got, s);
        }
        ferry_sig_destroy(sig);
    }
    if (me == 0)
        printf("%d bad calls from kernels refused and named\n", FSB_BAD_CALLS);
    return fr_test_result();
}
#endif

static int run_args(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm);
    ferry_sig_t sig = NULL;
    ferry_sig_config_t c = FERRY_SIG_CONFIG_INIT;
    c.heap_bytes = 4096;
    c.num_signals = 4;
    c.mode = FERRY_SIG_MODE_GROUPED;
    /* bad configs: refused before anything is opened, on every rank */
    struct { const char *what; void (*f)(ferry_sig_config_t *); } bad[] = {
        {"size", NULL}, {"magic", NULL}, {"heap_bytes", NULL},
        {"num_signals", NULL}, {"mode", NULL}, {"device", NULL}};
    for (int b = 0; b < 6; b++) {
        ferry_sig_config_t x = c;
        switch (b) {
        case 0: x.size = 8; break;
        case 1: x.magic = 0; break;
        case 2: x.heap_bytes = 0; break;
        case 3: x.num_signals = 0; break;
        case 4: x.mode = (ferry_sig_mode_t)9; break;
        case 5: x.device = (ferry_device_t)7; break;
        }
        int rc = ferry_sig_create(comm, &x, &sig);
        CHECK(rc == FERRY_ERR_INVALID && sig == NULL, "config %s: %d", bad[b].what, rc);
        CHECK(strstr(ferry_comm_last_error(comm), bad[b].what) != NULL,
              "config %s: message '%s' does not name it", bad[b].what,
              ferry_comm_last_error(comm));
    }
    CHECK_RC(ferry_sig_create(comm, NULL, &sig), FERRY_ERR_INVALID);
    /* a rank asking for something else: every rank fails, naming it */
    if (N > 1) {
        ferry_sig_config_t x = c;
        if (me == N - 1)
            x.heap_bytes = 8192;
        int rc = ferry_sig_create(comm, &x, &sig);
        char want[32];
        snprintf(want, sizeof(want), "rank %d", N - 1);
        CHECK(rc == FERRY_ERR_INVALID, "mismatch: %d", rc);
        CHECK(strstr(ferry_comm_last_error(comm), want) != NULL,
              "mismatch: '%s' does not name %s", ferry_comm_last_error(comm), want);
    }
    /* FERRY_SIGNAL_MODE that names no mode */
    {
        ferry_sig_config_t x = c;
        x.mode = FERRY_SIG_MODE_DEFAULT;
        setenv("FERRY_SIGNAL_MODE", "fastest", 1);
        int rc = ferry_sig_create(comm, &x, &sig);
        CHECK(rc == FERRY_ERR_INVALID &&
                  strstr(ferry_comm_last_error(comm), "FERRY_SIGNAL_MODE"),
              "FERRY_SIGNAL_MODE=fastest: %d '%s'", rc, ferry_comm_last_error(comm));
        unsetenv("FERRY_SIGNAL_MODE");
    }
    /* nicfence: the providers here do not advertise FI_FENCE */
    {
        ferry_sig_config_t x = c;
        x.mode = FERRY_SIG_MODE_NICFENCE;
        int rc = ferry_sig_create(comm, &x, &sig);
        if (rc == FERRY_OK) {
            printf("rank %d: nicfence is supported by this provider\n", me);
            ferry_sig_destroy(sig);
        } else {
            CHECK(rc == FERRY_ERR_UNSUPPORTED &&
                      strstr(ferry_comm_last_error(comm), "FI_FENCE"),
                  "nicfence: %d '%s'", rc, ferry_comm_last_error(comm));
        }
    }
    /* a good context; bad calls name their argument and post nothing */
    int rc = ferry_sig_create(comm, &c, &sig);
    CHECK(rc == FERRY_OK, "create: %s", ferry_comm_last_error(comm));
    if (rc != FERRY_OK)
        return fr_test_result();
    CHECK(ferry_sig_mode(sig) == FERRY_SIG_MODE_GROUPED, "mode");
    struct { int peer; uint64_t dst, src, len; uint32_t idx; int op; const char *what; } calls[] = {
        {-1, 0, 0, 8, 0, 0, "peer"},
        {N, 0, 0, 8, 0, 0, "peer"},
        {0, 4090, 0, 8, 0, 0, "dst_off"},
        {0, 0, 4095, 8, 0, 0, "src_off"},
        {0, 0, UINT64_MAX - 2, 8, 0, 0, "src_off"},
        {0, 0, 0, 8, 4, 0, "sig_index"},
        {0, 0, 0, 8, 0, 2, "op"},
        {0, 0, 0, 0, FERRY_SIG_NONE, 0, "nothing to do"},
    };
    for (size_t i = 0; i < sizeof(calls) / sizeof(calls[0]); i++) {
        rc = ferry_sig_put(sig, calls[i].peer, calls[i].dst, calls[i].src,
                           calls[i].len, calls[i].idx,
                           (ferry_sig_op_t)calls[i].op, 1);
        CHECK(rc == FERRY_ERR_INVALID &&
                  strstr(ferry_sig_last_error(sig), calls[i].what),
              "put case %zu (%s): %d '%s'", i, calls[i].what, rc,
              ferry_sig_last_error(sig));
    }
    uint64_t v;
    CHECK(ferry_sig_wait(sig, 4, FERRY_SIG_CMP_GE, 1, &v) == FERRY_ERR_INVALID &&
              strstr(ferry_sig_last_error(sig), "sig_index"), "wait index");
    CHECK(ferry_sig_wait(sig, 0, (ferry_sig_cmp_t)3, 1, &v) == FERRY_ERR_INVALID &&
              strstr(ferry_sig_last_error(sig), "cmp"), "wait cmp");
    CHECK(ferry_sig_landed(sig, N, &v) == FERRY_ERR_INVALID, "landed peer");
    ferry_sig_device_t dv;
    CHECK(ferry_sig_device(sig, &dv) == FERRY_ERR_INVALID, "device handle of a CPU context");
    /* the context works: a ring to the right and back */
    int right = (me + 1) % N;
    uint8_t *heap = ferry_sig_heap(sig);
    for (int i = 0; i < 64; i++)
        heap[2048 + i] = (uint8_t)(me * 7 + i);
    CHECK_RC(ferry_sig_put(sig, right, 0, 2048, 64, 1, FERRY_SIG_ADD, 5), FERRY_OK);
    CHECK_RC(ferry_sig_wait(sig, 1, FERRY_SIG_CMP_EQ, 5, &v), FERRY_OK);
    int left = (me + N - 1) % N;
    for (int i = 0; i < 64; i++)
        CHECK(heap[i] == (uint8_t)(left * 7 + i), "byte %d from rank %d", i, left);
    CHECK_RC(ferry_sig_quiet(sig), FERRY_OK);
    CHECK_RC(ferry_sig_check(sig), FERRY_OK);
    /* a wait nobody answers ends at the timeout, naming the word */
    setenv("FERRY_TIMEOUT_MS", "200", 1);
    CHECK_RC(ferry_sig_destroy(sig), FERRY_OK);
    rc = ferry_sig_create(comm, &c, &sig);
    CHECK(rc == FERRY_OK, "create: %s", ferry_comm_last_error(comm));
    double t0 = now_ms();
    rc = ferry_sig_wait(sig, 3, FERRY_SIG_CMP_EQ, 7, &v);
    double dt = now_ms() - t0;
    CHECK(rc == FERRY_ERR_TIMEOUT && strstr(ferry_sig_last_error(sig), "signal 3"),
          "unanswered wait: %d '%s'", rc, ferry_sig_last_error(sig));
    CHECK(dt >= 150 && dt < 1500, "unanswered wait took %.0f ms", dt);
    CHECK_RC(ferry_sig_destroy(sig), FERRY_OK);
    CHECK_RC(ferry_sig_destroy(NULL), FERRY_ERR_INVALID);
    return fr_test_result();
}

/* A failure that is not a fabric error (a quiet that timed out: every
 * write is held back for 3 s) leaves the context failed, and a later put
 * says why with the failure's message, not only the status's name. */
static int run_sticky(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm);
    ferry_sig_config_t c = FERRY_SIG_CONFIG_INIT;
    c.heap_bytes = 4096;
    c.num_signals = 4;
    ferry_sig_t sig = NULL;
    setenv("FERRY_FAULT_POSTS", "1", 1);
    setenv("FERRY_FAULT_DELAY_US", "3000000", 1);
    setenv("FERRY_TIMEOUT_MS", "300", 1);
    int rc = ferry_sig_create(comm, &c, &sig);
    setenv("FERRY_TIMEOUT_MS", "10000", 1);
    CHECK(rc == FERRY_OK, "create: %s", ferry_comm_last_error(comm));
    if (rc != FERRY_OK)
        return fr_test_result();
    CHECK_RC(ferry_sig_put(sig, (me + 1) % N, 0, 2048, 64, 1, FERRY_SIG_ADD,
                           1),
             FERRY_OK);
    rc = ferry_sig_quiet(sig);
    char first[600];
    snprintf(first, sizeof(first), "%s", ferry_sig_last_error(sig));
    CHECK(rc == FERRY_ERR_TIMEOUT && strstr(first, "quiet: "),
          "quiet with every write held: %d '%s'", rc, first);
    rc = ferry_sig_put(sig, (me + 1) % N, 0, 2048, 64, 1, FERRY_SIG_ADD, 1);
    const char *then = ferry_sig_last_error(sig);
    printf("rank %d: quiet: %s\nrank %d: then put: %s\n", me, first, me,
           then);
    CHECK(rc == FERRY_ERR_TIMEOUT && strstr(then, "failed before") &&
              strstr(then, first),
          "put after the failed quiet: %d '%s', want the quiet's message "
          "'%s'",
          rc, then, first);
    (void)ferry_sig_destroy(sig);
    return fr_test_result();
}

int main(int argc, char **argv)
{
    int n = 2, all_modes = 0, opt;
    while ((opt = getopt(argc, argv, "n:r:M:m:s:x")) != -1) {
        switch (opt) {
        case 'n': n = atoi(optarg); break;
        case 'r': g_rounds = atoi(optarg); break;
        case 'M': g_M = atoi(optarg); break;
        case 'm': g_max = strtoull(optarg, NULL, 0); break;
        case 's': g_seed = strtoull(optarg, NULL, 0); break;
        case 'x': all_modes = 1; break;
        default:
            fprintf(stderr, "usage: test_signal -n N [-r rounds] [-M transfers] "
                            "[-m max_bytes] [-s seed] [-x] stress|args|kill V\n");
            return 2;
        }
    }
    const char *mode = optind < argc ? argv[optind] : "stress";
    int victim = optind + 1 < argc ? atoi(argv[optind + 1]) : -1;
    int is_kill = strcmp(mode, "kill") == 0;
#ifndef FERRY_HAVE_CUDA
    if (strcmp(mode, "kernel_args") == 0) {
        printf("skipped: test_signal was built without CUDA\n");
        return 77;
    }
#endif
    ferry_comm_t comm = NULL;
    int rc = 0;
    if (!fr_vd_start("sig", "test_signal", mode, n, is_kill ? victim : -1, &comm, &rc))
        return rc;
    int me = ferry_comm_rank(comm);
    if (strcmp(mode, "args") == 0) {
        rc = run_args(comm);
    } else if (strcmp(mode, "sticky") == 0) {
        rc = run_sticky(comm);
    } else if (strcmp(mode, "kernel_args") == 0) {
#ifdef FERRY_HAVE_CUDA
        rc = run_kernel_args(comm);
#endif
    } else if (strcmp(mode, "stress") == 0 || is_kill) {
        rc = 0;
        if (all_modes) {
            int modes[] = {FERRY_SIG_MODE_FENCE, FERRY_SIG_MODE_GROUPED,
                           FERRY_SIG_MODE_COUNTED};
            for (int m = 0; m < 3 && !rc; m++)
                rc = run_rounds(comm, modes[m], -1);
        } else {
            rc = run_rounds(comm, FERRY_SIG_MODE_DEFAULT, is_kill ? victim : -1);
        }
    } else {
        fprintf(stderr, "test_signal: unknown mode %s\n", mode);
        rc = 2;
    }
    if (is_kill) {
        verdict(me, rc ? "bad" : "ok");
        /* A survivor leaving now would be a second death: the root's exit
         * resets its sockets, and a rank that has not yet read the root's
         * notice of the victim would hear of rank 0 first. Stay past the
         * other survivors' checks (the watcher's grace) before leaving. */
        if (me != victim)
            usleep(600 * 1000);
        _exit(rc); /* the communicator lost a rank; skip the collective */
    }
    ferry_comm_destroy(comm);
    verdict(me, rc ? "bad" : "ok");
    return rc;
}
