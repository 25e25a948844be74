/*
 * Multi-process test of the libfabric transport (src/transport/fabric/).
 *
 *   test_fabric [-n ranks] [-r rounds] [-m max_bytes] [-b burst] [-s seed]
 *               [-L] [-F] [-M]
 *
 * Launches `ranks` copies of itself (fr_launch_local). Every rank registers
 * two receive regions and two send regions (sets A/B, alternating by round)
 * and, each round:
 *  - scatters one slice to every rank, itself included, with a length drawn
 *    from (round, sender, receiver) in 0..max_bytes (0 and max included), a
 *    random source and destination shift, and an immediate encoding (kind,
 *    round, sender); every fifth round goes through write_imm instead;
 *  - waits for one RX per sender and its own TX completions, then checks
 *    each slice byte for byte against a pattern of (sender, round, receiver)
 *    and that the bytes around it still hold the poison (nothing written
 *    outside the slice), and poisons the slice again;
 *  - runs barrier() (zero-byte writes with immediate to all) and counts
 *    them.
 * Before the rounds it checks that out-of-bounds slices and bad indices are
 * FERRY_ERR_INVALID and post nothing; after them, a burst of small writes
 * with no polling in between (every other round of it one write_batch to
 * all peers, FI_MORE on all but its last) drives the provider into
 * -FI_EAGAIN so that the transport's queue is used. Scatters and batches
 * carry FI_MORE where the transmit queue has room (counted; the rounds'
 * scatters must have).
 *
 * -F: FI_PROVIDER names no usable provider: open() must fail with
 * FERRY_ERR_FABRIC naming fi_getinfo (and clean up, for the sanitizers).
 * -M: even ranks use tcp and odd ranks shm (the test sets FI_PROVIDER per
 * rank): open() must fail on every rank with FERRY_ERR_FABRIC naming the
 * provider mismatch.
 * -L: ranks 0 and 1 also measure one-way latency (half round trip) of
 * write_imm ping-pong at a few sizes.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>

#include "bootstrap/bootstrap.h"
#include "core/log.h"
#include "harness.h"
#include "launch.h"
#include "transport/transport.h"

#define SHIFT_MAX 4096u /* random offset inside a slot */
#define GUARD 64u       /* poison checked after a slice */
#define POISON 0xA5

enum { K_DATA = 0, K_BAR = 1, K_BURST = 2, K_OOB = 3 };

static uint32_t imm_make(int kind, int round, int sender)
{
    return ((uint32_t)kind << 30) | (((uint32_t)round & 0x3fff) << 16) |
           ((uint32_t)sender & 0xffff);
}
static int imm_kind(uint32_t imm) { return (int)(imm >> 30); }
static int imm_round(uint32_t imm) { return (int)((imm >> 16) & 0x3fff); }
static int imm_sender(uint32_t imm) { return (int)(imm & 0xffff); }

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t g_seed; /* -s: varies lengths, shifts and patterns */

static uint64_t key3(int round, int sender, int receiver, uint64_t salt)
{
    return mix(g_seed ^ ((uint64_t)(uint32_t)round << 40) ^
               ((uint64_t)(uint32_t)sender << 20) ^ (uint64_t)receiver ^
               (salt << 60));
}

static size_t g_max = 1u << 20;

static size_t slice_len(int round, int s, int r)
{
    uint64_t h = key3(round, s, r, 1);
    switch (h & 7) {
    case 0: return 0;
    case 1: return g_max;
    case 2: return (size_t)((h >> 8) % 64); /* small */
    default: return (size_t)((h >> 8) % (g_max + 1));
    }
}
static size_t dst_shift(int round, int s, int r)
{
    return (size_t)(key3(round, s, r, 2) % SHIFT_MAX);
}
static size_t src_shift(int round, int s, int r)
{
    return (size_t)(key3(round, s, r, 3) % SHIFT_MAX);
}

static void fill(uint8_t *p, size_t len, uint64_t seed)
{
    uint64_t x = seed | 1;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, 8);
    }
    if (i < len) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, len - i);
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ */

typedef struct ctx {
    const fr_transport_ops_t *ops;
    fr_transport_t *t;
    int rank, n, rounds;
    size_t slot; /* bytes per peer slot */
    uint8_t *recv[2], *send[2];
    fr_mr_t *rmr[2], *smr[2];
    fr_group_t *g[2];
    uint8_t *scratch;
    /* per round parity: what arrived */
    int data_cnt[2], bar_cnt[2];
    char *data_seen[2], *bar_seen[2];
    int tx_data[2], tx_bar[2];
    long burst_rx, burst_tx;
    long total_bar_rx, total_bar_tx, total_rx, total_tx;
    double bytes_out;
    int failed;
} ctx_t;

static int g_cur_round;

static void on_cqe(ctx_t *c, const fr_cqe_t *e)
{
    if (e->kind == FR_CQE_RX) {
        c->total_rx++;
        int k = imm_kind(e->imm), r = imm_round(e->imm), s = imm_sender(e->imm);
        int cur = g_cur_round & 0x3fff;
        if (s >= c->n || k == K_OOB || (k != K_BURST && r != cur &&
                                        r != ((cur + 1) & 0x3fff))) {
            CHECK(0, "rank %d round %d: unexpected immediate 0x%08x "
                     "(kind %d round %d sender %d)",
                  c->rank, g_cur_round, e->imm, k, r, s);
            c->failed = 1;
            return;
        }
        int par = r & 1;
        if (k == K_DATA) {
            CHECK(!c->data_seen[par][s], "rank %d: duplicate data imm 0x%08x",
                  c->rank, e->imm);
            c->data_seen[par][s] = 1;
            c->data_cnt[par]++;
        } else if (k == K_BAR) {
            CHECK(!c->bar_seen[par][s], "rank %d: duplicate barrier 0x%08x",
                  c->rank, e->imm);
            c->bar_seen[par][s] = 1;
            c->bar_cnt[par]++;
            c->total_bar_rx++;
        } else {
            c->burst_rx++;
        }
    } else if (e->kind == FR_CQE_TX) {
        c->total_tx++;
        int k = (int)(e->ctx & 0xff);
        int r = (int)(e->ctx >> 8);
        CHECK(e->peer >= 0 && e->peer < c->n, "rank %d: TX peer %d", c->rank,
              e->peer);
        if (k == K_BURST) {
            c->burst_tx++;
            return;
        }
        CHECK(r == g_cur_round, "rank %d: TX of round %d during round %d",
              c->rank, r, g_cur_round);
        if (k == K_DATA)
            c->tx_data[r & 1]++;
        else if (k == K_BAR) {
            c->tx_bar[r & 1]++;
            c->total_bar_tx++;
        } else
            CHECK(0, "rank %d: TX with ctx 0x%llx", c->rank,
                  (unsigned long long)e->ctx);
    } else {
        CHECK(0, "rank %d: completion error: status %d peer %d ctx 0x%llx",
              c->rank, e->status, e->peer, (unsigned long long)e->ctx);
        c->failed = 1;
    }
}

static double g_deadline_s = 60.0;

/* Poll until *a >= want (and *b >= wantb when b). */
static int wait_for(ctx_t *c, const char *what, int *a, int want, int *b,
                    int wantb)
{
    fr_cqe_t cq[32];
    fr_err_t err = {{0}};
    double t0 = now_s();
    while (*a < want || (b && *b < wantb)) {
        int got = c->ops->poll(c->t, cq, 32, &err);
        if (got < 0) {
            CHECK(0, "rank %d: poll: %d %s", c->rank, got, err.msg);
            return -1;
        }
        for (int i = 0; i < got; i++)
            on_cqe(c, &cq[i]);
        if (c->failed) {
            fprintf(stderr, "rank %d: last error: %s\n", c->rank, err.msg);
            return -1;
        }
        if (got == 0)
            sched_yield();
        if (now_s() - t0 > g_deadline_s) {
            CHECK(0, "rank %d round %d: timed out waiting for %s: %d/%d, "
                     "%d/%d, pending %d",
                  c->rank, g_cur_round, what, *a, want, b ? *b : 0, wantb,
                  c->ops->pending(c->t));
            return -1;
        }
    }
    return 0;
}

static int verify_round(ctx_t *c, int round)
{
    int par = round & 1;
    uint8_t *rb = c->recv[par];
    int bad = 0;
    for (int s = 0; s < c->n; s++) {
        uint8_t *slot = rb + (size_t)s * c->slot;
        size_t len = slice_len(round, s, c->rank);
        size_t sh = dst_shift(round, s, c->rank);
        for (size_t i = 0; i < sh; i++)
            if (slot[i] != POISON) {
                CHECK(0, "rank %d round %d from %d: byte %zu before the "
                         "slice changed",
                      c->rank, round, s, i);
                bad = 1;
                break;
            }
        size_t gend = sh + len + GUARD;
        if (gend > c->slot)
            gend = c->slot;
        for (size_t i = sh + len; i < gend; i++)
            if (slot[i] != POISON) {
                CHECK(0, "rank %d round %d from %d: byte %zu after the "
                         "slice (len %zu) changed",
                      c->rank, round, s, i - sh, len);
                bad = 1;
                break;
            }
        fill(c->scratch, len, key3(round, s, c->rank, 0));
        if (memcmp(slot + sh, c->scratch, len) != 0) {
            size_t i = 0;
            while (i < len && slot[sh + i] == c->scratch[i])
                i++;
            CHECK(0, "rank %d round %d from %d: slice of %zu bytes differs "
                     "at %zu (got 0x%02x want 0x%02x)",
                  c->rank, round, s, len, i, slot[sh + i], c->scratch[i]);
            bad = 1;
        }
        memset(slot, POISON, gend);
    }
    return bad ? -1 : 0;
}

static int oob_checks(ctx_t *c)
{
    fr_err_t err = {{0}};
    int n = c->n;
    fr_slice_t *sl = calloc((size_t)n, sizeof(*sl));
    size_t rlen = (size_t)n * c->slot;
    int before = c->ops->pending(c->t);
    uint32_t imm = imm_make(K_OOB, 0, c->rank);
    for (int i = 0; i < n; i++)
        sl[i] = (fr_slice_t){0, 0, 8, imm};

    /* destination one byte past the end, on the last peer */
    sl[n - 1].dst_off = rlen - 7;
    CHECK_RC(c->ops->scatter(c->t, c->g[0], sl, 0x99, &err), FERRY_ERR_INVALID);
    CHECK(strstr(err.msg, "destination") != NULL, "message: %s", err.msg);
    /* offset past the end with len 0 */
    sl[n - 1] = (fr_slice_t){0, rlen + 1, 0, imm};
    CHECK_RC(c->ops->scatter(c->t, c->g[0], sl, 0x99, &err), FERRY_ERR_INVALID);
    /* wrap-around */
    sl[n - 1] = (fr_slice_t){0, UINT64_MAX - 3, 8, imm};
    CHECK_RC(c->ops->scatter(c->t, c->g[0], sl, 0x99, &err), FERRY_ERR_INVALID);
    /* source past the end, on the first peer */
    sl[n - 1] = (fr_slice_t){0, 0, 8, imm};
    sl[0].src_off = rlen - 4;
    CHECK_RC(c->ops->scatter(c->t, c->g[0], sl, 0x99, &err), FERRY_ERR_INVALID);
    CHECK(strstr(err.msg, "source") != NULL, "message: %s", err.msg);
    sl[0] = (fr_slice_t){0, 0, rlen + 1, imm};
    CHECK_RC(c->ops->write_imm(c->t, c->g[0], 0, &sl[0], 0x99, &err),
             FERRY_ERR_INVALID);
    sl[0] = (fr_slice_t){0, 0, 8, imm};
    CHECK_RC(c->ops->write_imm(c->t, c->g[0], n, &sl[0], 0x99, &err),
             FERRY_ERR_INVALID);
    CHECK_RC(c->ops->write_imm(c->t, c->g[0], -1, &sl[0], 0x99, &err),
             FERRY_ERR_INVALID);
    CHECK(c->ops->pending(c->t) == before, "pending %d after rejected posts, "
                                           "was %d",
          c->ops->pending(c->t), before);
    free(sl);
    return 0;
}

static int run_rounds(ctx_t *c)
{
    fr_err_t err = {{0}};
    int n = c->n;
    fr_slice_t *sl = calloc((size_t)n, sizeof(*sl));
    double t0 = now_s();
    for (int r = 0; r < c->rounds && !c->failed; r++) {
        g_cur_round = r;
        int par = r & 1;
        uint8_t *sb = c->send[par];
        for (int p = 0; p < n; p++) {
            size_t len = slice_len(r, c->rank, p);
            size_t ssh = src_shift(r, c->rank, p);
            fill(sb + (size_t)p * c->slot + ssh, len, key3(r, c->rank, p, 0));
            sl[p].src_off = (size_t)p * c->slot + ssh;
            sl[p].dst_off = (size_t)c->rank * c->slot + dst_shift(r, c->rank, p);
            sl[p].len = len;
            sl[p].imm = imm_make(K_DATA, r, c->rank);
            c->bytes_out += (double)len;
        }
        uint64_t ctx = ((uint64_t)r << 8) | K_DATA;
        if (r % 5 == 4) {
            for (int p = n - 1; p >= 0; p--)
                CHECK_RC(c->ops->write_imm(c->t, c->g[par], p, &sl[p], ctx,
                                           &err),
                         FERRY_OK);
        } else {
            CHECK_RC(c->ops->scatter(c->t, c->g[par], sl, ctx, &err), FERRY_OK);
        }
        if (wait_for(c, "data", &c->data_cnt[par], n, &c->tx_data[par], n))
            break;
        if (verify_round(c, r))
            c->failed = 1;
        CHECK_RC(c->ops->barrier(c->t, c->g[par], imm_make(K_BAR, r, c->rank),
                                 ((uint64_t)r << 8) | K_BAR, &err),
                 FERRY_OK);
        if (wait_for(c, "barrier", &c->bar_cnt[par], n, &c->tx_bar[par], n))
            break;
        CHECK(c->tx_data[par] == n && c->tx_bar[par] == n,
              "rank %d round %d: %d data TX, %d barrier TX", c->rank, r,
              c->tx_data[par], c->tx_bar[par]);
        /* this parity is next used by round r + 2 */
        c->data_cnt[par] = c->bar_cnt[par] = 0;
        c->tx_data[par] = c->tx_bar[par] = 0;
        memset(c->data_seen[par], 0, (size_t)n);
        memset(c->bar_seen[par], 0, (size_t)n);
    }
    double dt = now_s() - t0;
    free(sl);
    if (c->rank == 0)
        printf("rank 0: %d rounds x %d ranks in %.2f s, %.1f MB sent by "
               "rank 0 (%.0f MB/s incl. checks)\n",
               c->rounds, n, dt, c->bytes_out / 1e6, c->bytes_out / 1e6 / dt);
    return c->failed ? -1 : 0;
}

/* The bootstrap barrier, with this rank's transport progressed meanwhile:
 * manual-progress providers that acknowledge writes (udp;ofi_rxd) complete
 * a peer's writes only while the receiver polls, so a rank that has all
 * it needs keeps polling until everyone has. */
typedef struct {
    fr_boot_t *boot;
    int rc, done;
    fr_err_t err;
} barrier_arg_t;

static void *barrier_thread(void *p)
{
    barrier_arg_t *a = p;
    a->rc = fr_boot_barrier(a->boot, &a->err);
    __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static int progressing_barrier(ctx_t *c, fr_boot_t *boot, fr_err_t *err)
{
    barrier_arg_t a = {.boot = boot};
    pthread_t th;
    if (pthread_create(&th, NULL, barrier_thread, &a) != 0)
        return fr_boot_barrier(boot, err);
    fr_cqe_t cq[64];
    fr_err_t perr = {{0}};
    while (!__atomic_load_n(&a.done, __ATOMIC_ACQUIRE)) {
        int got = c->ops->poll(c->t, cq, 64, &perr);
        for (int i = 0; i < got; i++)
            on_cqe(c, &cq[i]);
        if (got <= 0)
            sched_yield();
    }
    pthread_join(th, NULL);
    if (a.rc != FERRY_OK)
        *err = a.err;
    return a.rc;
}

/* per_peer writes to every peer, posted without polling: odd rounds as
 * one write_batch to all peers (FI_MORE on all but the last where the
 * transmit queue has room: counted by the stats op), the others one
 * write_imm each */
static int burst(ctx_t *c, int per_peer)
{
    fr_err_t err = {{0}};
    g_cur_round = c->rounds; /* TX ctx checks */
    int maxpend = 0;
    fr_tp_stats_t st0 = {0}, st1 = {0};
    c->ops->stats(c->t, &st0);
    int *idx = calloc((size_t)c->n, sizeof(int));
    fr_slice_t *bs = calloc((size_t)c->n, sizeof(fr_slice_t));
    if (!idx || !bs) {
        free(idx);
        free(bs);
        CHECK(0, "burst: out of memory");
        return -1;
    }
    for (int i = 0; i < per_peer; i++) {
        for (int p = 0; p < c->n; p++) {
            fr_slice_t s = {(size_t)p * c->slot, (size_t)c->rank * c->slot, 8,
                            imm_make(K_BURST, 0, c->rank)};
            idx[p] = p;
            bs[p] = s;
            if (i % 2 == 0 || !c->ops->write_batch)
                CHECK_RC(c->ops->write_imm(c->t, c->g[0], p, &s, K_BURST, &err),
                         FERRY_OK);
        }
        if (i % 2 == 1 && c->ops->write_batch)
            CHECK_RC(c->ops->write_batch(c->t, c->g[0], idx, bs, c->n, K_BURST, &err),
                     FERRY_OK);
        int pd = c->ops->pending(c->t);
        if (pd > maxpend)
            maxpend = pd;
    }
    /* a bad index posts nothing and names itself */
    idx[0] = c->n;
    CHECK(!c->ops->write_batch ||
              (c->ops->write_batch(c->t, c->g[0], idx, bs, c->n, K_BURST, &err) ==
                   FERRY_ERR_INVALID && strstr(err.msg, "index")),
          "write_batch with index %d of %d: %s", c->n, c->n, err.msg);
    free(idx);
    free(bs);
    c->ops->stats(c->t, &st1);
    long want = (long)per_peer * c->n;
    fr_cqe_t cq[64];
    double t0 = now_s();
    while (c->burst_rx < want || c->burst_tx < want) {
        int got = c->ops->poll(c->t, cq, 64, &err);
        if (got < 0) {
            CHECK(0, "poll: %s", err.msg);
            return -1;
        }
        for (int i = 0; i < got; i++)
            on_cqe(c, &cq[i]);
        if (c->failed)
            return -1;
        if (got == 0)
            sched_yield();
        if (now_s() - t0 > g_deadline_s) {
            CHECK(0, "rank %d: burst timed out: rx %ld tx %ld of %ld, "
                     "pending %d",
                  c->rank, c->burst_rx, c->burst_tx, want,
                  c->ops->pending(c->t));
            return -1;
        }
    }
    CHECK(c->ops->pending(c->t) == 0, "rank %d: pending %d after burst",
          c->rank, c->ops->pending(c->t));
    if (c->rank == 0)
        printf("rank 0: burst of %ld writes in %.3f s, max pending %d, %llu with FI_MORE\n",
               want, now_s() - t0, maxpend, (unsigned long long)(st1.more - st0.more));
    return 0;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct lat_state {
    long rx, tx;
} lat_state_t;

static void lat_poll(ctx_t *c, lat_state_t *ls)
{
    fr_cqe_t cq[16];
    fr_err_t err = {{0}};
    int got = c->ops->poll(c->t, cq, 16, &err);
    for (int i = 0; i < got; i++) {
        if (cq[i].kind == FR_CQE_RX)
            ls->rx++;
        else if (cq[i].kind == FR_CQE_TX)
            ls->tx++;
        else
            CHECK(0, "latency: completion %d: %s", cq[i].kind, err.msg);
    }
    if (got <= 0)
        sched_yield();
}

/* Ranks 0 and 1 ping-pong through write_imm into set 0. */
static void latency(ctx_t *c)
{
    if (c->n < 2 || c->rank > 1)
        return;
    static const size_t sizes[] = {0, 64, 4096, 65536, 1u << 20};
    int peer = 1 - c->rank;
    fr_err_t err = {{0}};
    const int iters = 500, warm = 50;
    double *lat = calloc((size_t)iters, sizeof(double));
    lat_state_t ls = {0, 0};
    long sent = 0, round = 0;
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        size_t len = sizes[si] <= g_max ? sizes[si] : g_max;
        fr_slice_t s = {(size_t)peer * c->slot, (size_t)c->rank * c->slot,
                        len, imm_make(K_BURST, 0, c->rank)};
        for (int it = 0; it < iters + warm; it++, round++) {
            double t0 = now_s();
            if (c->rank == 1)
                while (ls.rx < round + 1)
                    lat_poll(c, &ls);
            CHECK_RC(c->ops->write_imm(c->t, c->g[0], peer, &s, K_BURST, &err),
                     FERRY_OK);
            sent++;
            while (ls.tx < sent || (c->rank == 0 && ls.rx < round + 1))
                lat_poll(c, &ls);
            if (it >= warm)
                lat[it - warm] = (now_s() - t0) / 2;
        }
        if (c->rank == 0) {
            qsort(lat, (size_t)iters, sizeof(double), cmp_d);
            printf("latency %s %7zu B: one-way p50 %.1f us, p90 %.1f us "
                   "(%.0f MB/s at p50)\n",
                   c->ops->provider(c->t), len, lat[iters / 2] * 1e6,
                   lat[iters * 9 / 10] * 1e6,
                   (double)len / lat[iters / 2] / 1e6);
        }
    }
    free(lat);
}

/* -S: regions named the way the shm provider names this process's
 * endpoints by default ("<pid>:<uid>:<index>"), left as a killed process
 * whose pid was later reused would leave them (the provider then refuses
 * fi_enable with EBUSY). The transport must not collide with them. */
#define STALE_N 8
static void stale_regions(int make)
{
    for (int k = 0; k < STALE_N; k++) {
        char name[64];
        snprintf(name, sizeof(name), "%d:%d:%d", (int)getpid(), (int)getuid(),
                 k);
        if (!make) {
            shm_unlink(name);
            continue;
        }
        int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
        CHECK(fd >= 0, "shm_open(%s)", name);
        if (fd >= 0) {
            CHECK(ftruncate(fd, 4096) == 0, "ftruncate(%s)", name);
            close(fd);
        }
    }
}

int main(int argc, char **argv)
{
    int stale = 0;
    int n = 2, rounds = 200, burst_n = 2000, lat = 0;
    const char *expect_fail = NULL;
    int mixed = 0;
    int opt;
    while ((opt = getopt(argc, argv, "n:r:m:b:s:LFMS")) != -1) {
        switch (opt) {
        case 'n': n = atoi(optarg); break;
        case 'r': rounds = atoi(optarg); break;
        case 'm': g_max = (size_t)strtoull(optarg, NULL, 0); break;
        case 'b': burst_n = atoi(optarg); break;
        case 's': g_seed = mix(strtoull(optarg, NULL, 0)); break;
        case 'L': lat = 1; break;
        case 'F': expect_fail = "fi_getinfo"; break;
        case 'M': expect_fail = "provider"; mixed = 1; break;
        case 'S': stale = 1; break;
        default:
            fprintf(stderr, "usage: %s [-n ranks] [-r rounds] [-m max_bytes] "
                            "[-b burst] [-s seed] [-L] [-F] [-M] [-S]\n", argv[0]);
            return 2;
        }
    }
    const char *to = getenv("FERRY_TIMEOUT_MS");
    if (to && atol(to) > 0)
        g_deadline_s = (double)atol(to) / 1000.0;

    fr_err_t err = {{0}};
    int is_child = 0;
    int rc = fr_launch_local(n, &is_child, &err);
    if (!is_child) {
        if (rc != 0)
            fprintf(stderr, "test_fabric: launch: %d %s\n", rc, err.msg);
        return rc;
    }
    if (rc != 0) {
        fprintf(stderr, "test_fabric: child launch: %d %s\n", rc, err.msg);
        return 1;
    }

    fr_boot_env_t env;
    fr_boot_t *boot = NULL;
    if (fr_boot_env_read(&env, &err) != FERRY_OK ||
        fr_boot_init_tcp(&env, &boot, &err) != FERRY_OK) {
        fprintf(stderr, "test_fabric: bootstrap: %s\n", err.msg);
        return 1;
    }
    ctx_t c;
    memset(&c, 0, sizeof(c));
    c.rank = fr_boot_rank(boot);
    c.n = fr_boot_size(boot);
    c.rounds = rounds;
    fr_log_set_rank(c.rank);
    CHECK(fr_transport_find("fabric")->size == sizeof(fr_transport_ops_t),
          "ops size");

    if (mixed) /* the test, not the library, picks per-rank providers */
        setenv("FI_PROVIDER", c.rank % 2 ? "shm" : "tcp", 1);
    if (stale)
        stale_regions(1);
    rc = fr_transport_open("fabric", boot, 0, 0, &c.ops, &c.t, &err);
    if (stale)
        stale_regions(0);
    if (expect_fail) {
        CHECK_RC(rc, FERRY_ERR_FABRIC);
        CHECK(strstr(err.msg, expect_fail) != NULL,
              "rank %d: message without \"%s\": %s", c.rank, expect_fail,
              err.msg);
        CHECK(c.t == NULL, "transport handle set on failure");
        if (c.rank == 0)
            printf("open failed as expected: %s\n", err.msg);
        if (rc == FERRY_OK)
            c.ops->close(c.t);
        CHECK_RC(fr_boot_barrier(boot, &err), FERRY_OK);
        CHECK_RC(fr_boot_close(boot, &err), FERRY_OK);
        return fr_test_result();
    }
    CHECK_RC(rc, FERRY_OK);
    if (rc != FERRY_OK) {
        fprintf(stderr, "rank %d: open: %s\n", c.rank, err.msg);
        return 1;
    }
    if (c.rank == 0)
        printf("provider %s, %d ranks, %d rounds, max %zu bytes\n",
               c.ops->provider(c.t), c.n, rounds, g_max);

    c.slot = SHIFT_MAX + g_max + GUARD;
    size_t region = (size_t)c.n * c.slot;
    fr_mr_desc_t mine[2], *all = calloc((size_t)c.n * 2, sizeof(*all));
    c.scratch = malloc(g_max + 1);
    for (int s = 0; s < 2; s++) {
        c.recv[s] = malloc(region);
        c.send[s] = malloc(region);
        memset(c.recv[s], POISON, region);
        memset(c.send[s], 0, region);
        c.data_seen[s] = calloc((size_t)c.n, 1);
        c.bar_seen[s] = calloc((size_t)c.n, 1);
        fr_mr_desc_t sd;
        CHECK_RC(c.ops->reg(c.t, c.recv[s], region, 1, &c.rmr[s], &mine[s],
                            &err),
                 FERRY_OK);
        CHECK_RC(c.ops->reg(c.t, c.send[s], region, 0, &c.smr[s], &sd, &err),
                 FERRY_OK);
        CHECK(mine[s].len == region, "desc len %llu",
              (unsigned long long)mine[s].len);
    }
    CHECK(mine[0].key != mine[1].key, "keys of two regions are equal");
    CHECK_RC(fr_boot_allgather(boot, mine, all, sizeof(mine), &err), FERRY_OK);
    int *peers = calloc((size_t)c.n, sizeof(int));
    fr_mr_desc_t *rem = calloc((size_t)c.n, sizeof(*rem));
    for (int s = 0; s < 2; s++) {
        for (int p = 0; p < c.n; p++) {
            peers[p] = p;
            rem[p] = all[p * 2 + s];
        }
        CHECK_RC(c.ops->group_create(c.t, peers, c.n, c.smr[s], rem, &c.g[s],
                                     &err),
                 FERRY_OK);
    }
    if (fr_test_failures) {
        fprintf(stderr, "rank %d: setup failed: %s\n", c.rank, err.msg);
        return 1;
    }

    oob_checks(&c);
    if (run_rounds(&c) == 0) {
        /* the rounds' scatters start with nothing in flight: all but the
         * last write of each carried FI_MORE (a provider with a transmit
         * queue of at least n) */
        fr_tp_stats_t st = {0};
        c.ops->stats(c.t, &st);
        CHECK(c.n < 2 || st.more > 0, "rank %d: no write of the rounds' scatters carried FI_MORE",
              c.rank);
        CHECK(c.total_bar_rx == (long)rounds * c.n &&
                  c.total_bar_tx == (long)rounds * c.n,
              "rank %d: barriers rx %ld tx %ld, want %ld", c.rank,
              c.total_bar_rx, c.total_bar_tx, (long)rounds * c.n);
        if (burst_n > 0)
            burst(&c, burst_n);
        if (lat && !c.failed) {
            CHECK_RC(fr_boot_barrier(boot, &err), FERRY_OK);
            latency(&c);
        }
    }
    /* Nobody closes its endpoint while a peer may still be writing to it
     * (or waiting for this rank to acknowledge a write). */
    CHECK_RC(progressing_barrier(&c, boot, &err), FERRY_OK);
    CHECK(c.ops->pending(c.t) == 0, "rank %d: pending %d at the end", c.rank,
          c.ops->pending(c.t));
    for (int s = 0; s < 2; s++) {
        c.ops->group_destroy(c.t, c.g[s]);
        c.ops->dereg(c.t, c.rmr[s]);
    }
    /* send regions are left to close() */
    c.ops->close(c.t);
    CHECK_RC(fr_boot_close(boot, &err), FERRY_OK);

    for (int s = 0; s < 2; s++) {
        free(c.recv[s]);
        free(c.send[s]);
        free(c.data_seen[s]);
        free(c.bar_seen[s]);
    }
    free(c.scratch);
    free(all);
    free(peers);
    free(rem);
    if (fr_test_failures)
        fprintf(stderr, "rank %d: %d checks failed\n", c.rank,
                fr_test_failures);
    return fr_test_result();
}
