/* The CUDA high-throughput engine's fabric thread (engines/cuda_ht/fab.c),
 * on the CPU: two ranks in one process, each with its thread, over a fake
 * transport that lands writes in random order and late (a write's bytes
 * are copied only when it lands, so a sender that reused a slot too soon
 * or a tail counted before its slots landed shows as wrong records).
 * This test plays the kernels: it writes records into the outboxes and
 * stores tails, heads and route numbers into the host-mapped words, and
 * reads what the threads deliver, in both directions (dispatch rings
 * 0 -> 1, combine rings 1 -> 0), across many ring wraps, with notify
 * entries of six routes. With a fault, the transport misbehaves once
 * records flow and the receiving thread must fail the context with a
 * protocol error naming the sender, and set the kernels' abort word:
 *   badimm  an immediate of no kind reaches rank 1
 *   dup     a run of records lands twice at rank 1
 *   credit  rank 0 gets back credits for records it never sent
 * The immediates' format follows from the ranks and the ring (fab.h); a
 * third argument N lays the segments out for N ranks (the two threads
 * are ranks 0 and 1 of them), so the format's wide source field runs too.
 * Usage: test_htfab [seed [none|badimm|dup|credit [N]]] */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engines/cuda_ht/fab.h"
#include "harness.h"
#include "runtime/rt.h"

enum { NR = 2, C = 3, RT = 8, REC = 64, M = 2000, NOTIFY_ROUTES = 6, MAXQ = 4096 };
static int GN = NR; /* the ranks the segments are laid out for */
static fr_cuht_fab_fmt_t FMT; /* the immediates' format for GN ranks, rings of RT */

typedef struct fake_w {
    int to, from;
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
    uint32_t imm;
    uint64_t ctx;
} fake_w_t;

static struct {
    pthread_mutex_t mu;
    fake_w_t q[MAXQ];      /* posted, not landed */
    int nq;
    fr_cqe_t cq[NR][MAXQ]; /* completions per rank */
    int ncq[NR];
    uint64_t rng;
    uint8_t *seg[NR], *send[NR];
    long landed, posted;
    int fault;   /* 0 none, 1 badimm, 2 dup, 3 credit: armed once landed > 50 */
    int faulted;
} W = {.mu = PTHREAD_MUTEX_INITIALIZER};

enum { F_NONE, F_BADIMM, F_DUP, F_CREDIT };

typedef struct fake_tp {
    int rank;
} fake_tp_t;
static fake_tp_t tps[NR] = {{0}, {1}};

static uint64_t rnd(void)
{
    W.rng ^= W.rng << 13;
    W.rng ^= W.rng >> 7;
    W.rng ^= W.rng << 17;
    return W.rng;
}

static int fake_write_imm(fr_transport_t *t, fr_group_t *g, int index, const fr_slice_t *sl,
                          uint64_t ctx, fr_err_t *err)
{
    (void)g;
    (void)index;
    (void)err;
    int r = ((fake_tp_t *)t)->rank;
    pthread_mutex_lock(&W.mu);
    int ok = W.nq < MAXQ;
    if (ok) {
        fake_w_t *w = &W.q[W.nq++];
        w->from = r;
        w->to = 1 - r;
        w->src = W.send[r] + sl->src_off;
        w->dst = W.seg[1 - r] + sl->dst_off;
        w->len = sl->len;
        w->imm = sl->imm;
        w->ctx = ctx;
        W.posted++;
    }
    pthread_mutex_unlock(&W.mu);
    return ok ? FERRY_OK : FERRY_ERR_NOMEM;
}

/* Land some writes to rank r, any of them (reordered), then hand out r's
 * completions in random order too. */
static int fake_poll(fr_transport_t *t, fr_cqe_t *out, int max, fr_err_t *err)
{
    (void)err;
    int r = ((fake_tp_t *)t)->rank, n = 0;
    pthread_mutex_lock(&W.mu);
    for (int tries = 0; tries < 3 && W.nq > 0; tries++) {
        int i = (int)(rnd() % (uint64_t)W.nq);
        if (W.q[i].to != r || rnd() % 4 == 0)
            continue; /* not yet */
        fake_w_t w = W.q[i];
        W.q[i] = W.q[--W.nq];
        memcpy(w.dst, w.src, w.len);
        W.cq[r][W.ncq[r]++] = (fr_cqe_t){.kind = FR_CQE_RX, .imm = w.imm, .peer = -1};
        int data = (w.imm >> 29) == 1 || (w.imm >> 29) == 2;
        if (!W.faulted && W.landed > 50 && r == 1 && W.fault == F_DUP && data) {
            W.cq[r][W.ncq[r]++] = (fr_cqe_t){.kind = FR_CQE_RX, .imm = w.imm, .peer = -1};
            W.faulted = 1;
        }
        W.cq[w.from][W.ncq[w.from]++] = (fr_cqe_t){.kind = FR_CQE_TX, .ctx = w.ctx, .peer = w.to};
        W.landed++;
    }
    if (!W.faulted && W.landed > 50 && W.fault == F_BADIMM && r == 1) {
        W.cq[r][W.ncq[r]++] = (fr_cqe_t){.kind = FR_CQE_RX, .imm = 7u << 29, .peer = -1};
        W.faulted = 1;
    }
    if (!W.faulted && W.landed > 50 && W.fault == F_CREDIT && r == 0) {
        /* a dispatch head of rank 1 for channel 0, 300 records on */
        uint32_t imm = fr_cuht_fab_imm(&FMT, FR_FAB_DHEAD, 1, 0, 300u);
        W.cq[r][W.ncq[r]++] = (fr_cqe_t){.kind = FR_CQE_RX, .imm = imm, .peer = -1};
        W.faulted = 1;
    }
    while (n < max && W.ncq[r] > 0) {
        int i = (int)(rnd() % (uint64_t)W.ncq[r]);
        out[n++] = W.cq[r][i];
        W.cq[r][i] = W.cq[r][--W.ncq[r]];
    }
    pthread_mutex_unlock(&W.mu);
    return n;
}

static const char *fake_iface(fr_transport_t *t)
{
    (void)t;
    return "fake";
}

static fr_transport_ops_t fake_ops = {.size = sizeof(fr_transport_ops_t), .name = "fake",
                                      .write_imm = fake_write_imm, .poll = fake_poll,
                                      .iface = fake_iface};

static uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static void geo(fr_cuht_geo_t *G, int rank)
{
    memset(G, 0, sizeof(*G));
    G->N = GN;
    G->rank = rank;
    G->C = C;
    G->RT = RT;
    G->notify_entry = 128;
    G->off_ctr = align(2ull * GN * G->notify_entry, 4096);
    G->drec = G->crec = REC;
    G->off_drec = align(G->off_ctr + 4ull * C * GN * FR_CUHT_LINE, 4096);
    G->off_crec = align(G->off_drec + (uint64_t)C * GN * RT * REC, 4096);
    G->seg_bytes = align(G->off_crec + (uint64_t)C * GN * RT * REC, 4096);
    G->ob_drec = G->off_ctr;
    G->ob_crec = align(G->ob_drec + (uint64_t)C * RT * REC, 4096);
    G->ob_bytes = align(G->ob_crec + (uint64_t)C * RT * REC, 4096);
    G->hdr_bytes = G->off_drec;
}

static uint64_t ld(const uint8_t *b, uint64_t off)
{
    return __atomic_load_n((const uint64_t *)(b + off), __ATOMIC_ACQUIRE);
}
static void st(uint8_t *b, uint64_t off, uint64_t v)
{
    __atomic_store_n((uint64_t *)(b + off), v, __ATOMIC_RELEASE);
}

/* A record's bytes: who, which ring, its number. */
static void pat(uint8_t *rec, int k, int c, uint64_t i)
{
    for (int j = 0; j < REC; j++)
        rec[j] = (uint8_t)(k * 131 + c * 31 + (int)(i * 7) + j);
}
static int pat_ok(const uint8_t *rec, int k, int c, uint64_t i)
{
    for (int j = 0; j < REC; j++)
        if (rec[j] != (uint8_t)(k * 131 + c * 31 + (int)(i * 7) + j))
            return 0;
    return 1;
}

int main(int argc, char **argv)
{
    W.rng = argc > 1 ? strtoull(argv[1], NULL, 0) | 1 : 0x9e3779b97f4a7c15ull;
    const char *fname = argc > 2 ? argv[2] : "none";
    W.fault = !strcmp(fname, "badimm") ? F_BADIMM : !strcmp(fname, "dup") ? F_DUP
              : !strcmp(fname, "credit") ? F_CREDIT : F_NONE;
    if (W.fault == F_NONE && strcmp(fname, "none") != 0) {
        fprintf(stderr, "test_htfab: fault %s: use none, badimm, dup or credit\n", fname);
        return 2;
    }
    GN = argc > 3 ? atoi(argv[3]) : NR;
    char why[200];
    if (GN < NR || fr_cuht_fab_fmt(GN, RT, &FMT, why, sizeof(why)) != 0) {
        fprintf(stderr, "test_htfab: N = %s: %s\n", argc > 3 ? argv[3] : "", GN < NR ? "at least 2" : why);
        return 2;
    }
    int victim = W.fault == F_CREDIT ? 0 : 1; /* the rank whose thread must fail */
    int abortw[NR] = {0, 0};
    struct ferry_ep *ep[NR];
    fr_cuht_fab_t fab[NR];
    int path[NR][NR], gidx[NR][NR], gpeer[NR], idx0 = 0;
    for (int r = 0; r < NR; r++) {
        ep[r] = calloc(1, sizeof(struct ferry_ep));
        memset(&fab[r], 0, sizeof(fab[r]));
        geo(&fab[r].G, r);
        W.seg[r] = calloc(1, fab[r].G.seg_bytes);
        W.send[r] = calloc(1, fab[r].G.ob_bytes);
        fab[r].out = calloc(1, fab[r].G.hdr_bytes);
        fab[r].in = calloc(1, fab[r].G.hdr_bytes);
        for (int s = 0; s < NR; s++) {
            path[r][s] = s == r ? FR_PATH_SELF : FR_PATH_FABRIC;
            gidx[r][s] = s == r ? -1 : 0;
        }
        gpeer[r] = 1 - r;
        struct ferry_ep *e = ep[r];
        e->N = NR;
        e->rank = r;
        e->nfabric = 1;
        e->path = path[r];
        e->group_index = gidx[r];
        e->group_peers = &gpeer[r];
        e->timeout_ms = 10000;
        e->spin = 100;
        e->rx_flush = FR_RX_FLUSH_NONE;
        e->nics.ops = &fake_ops;
        e->nics.n = 1;
        e->nics.N = NR;
        e->nics.rank = r;
        e->nics.tp[0] = (fr_transport_t *)&tps[r];
        e->groups.n[0] = 1;
        e->groups.idx[0] = &idx0;
        fab[r].abort = &abortw[r];
        CHECK_RC(fr_cuht_fab_init(e, &fab[r]), FERRY_OK);
        CHECK_RC(fr_cuht_fab_start(e, &fab[r]), FERRY_OK);
    }
    /* the "kernels": k = 0 dispatch rings from rank 0 to rank 1, k = 1
     * combine rings from rank 1 to rank 0 */
    uint64_t sent[2][C] = {{0}}, taken[2][C] = {{0}};
    int bad = 0, notified = 0;
    uint64_t t0 = fr_now_ns();
    int done = 0;
    while (!done && fr_now_ns() - t0 < 20000000000ull && !bad &&
           !(W.fault && __atomic_load_n(&abortw[victim], __ATOMIC_ACQUIRE))) {
        done = 1;
        for (int k = 0; k < 2; k++) {
            int src = k ? 1 : 0, dst = 1 - src;
            const fr_cuht_geo_t *Gs = &fab[src].G, *Gd = &fab[dst].G;
            int TAIL = k ? FR_CUHT_CTAIL : FR_CUHT_DTAIL, HEAD = k ? FR_CUHT_CHEAD : FR_CUHT_DHEAD;
            for (int c = 0; c < C; c++) {
                /* sender: as much as the head allows, in steps of 1..5 */
                uint64_t head = ld(fab[src].in, fr_cuht_geo_ctr(Gs, HEAD, c, dst));
                uint64_t want = sent[k][c] + 1 + rnd() % 5;
                want = want > M ? M : want;
                want = want > head + RT ? head + RT : want;
                for (; sent[k][c] < want; sent[k][c]++)
                    pat(W.send[src] + fr_cuht_geo_obring(Gs, k, c) + (sent[k][c] % RT) * REC, k,
                        c, sent[k][c]);
                st(fab[src].out, fr_cuht_geo_ctr(Gs, TAIL, c, src), sent[k][c]);
                /* receiver: what the tail shows, checked, then the head */
                uint64_t tail = ld(fab[dst].in, fr_cuht_geo_ctr(Gd, TAIL, c, src));
                if (tail > sent[k][c] || tail < taken[k][c]) {
                    fprintf(stderr, "k %d c %d: tail %llu, sent %llu, taken %llu\n", k, c,
                            (unsigned long long)tail, (unsigned long long)sent[k][c],
                            (unsigned long long)taken[k][c]);
                    bad++;
                }
                for (; taken[k][c] < tail && !bad; taken[k][c]++) {
                    const uint8_t *rec = W.seg[dst] + fr_cuht_geo_ring(Gd, k, c, src) +
                                         (taken[k][c] % RT) * REC;
                    if (!pat_ok(rec, k, c, taken[k][c])) {
                        fprintf(stderr, "k %d c %d: record %llu wrong\n", k, c,
                                (unsigned long long)taken[k][c]);
                        bad++;
                    }
                }
                if (rnd() % 3) /* heads go back late, in steps */
                    st(fab[dst].out, fr_cuht_geo_ctr(Gd, HEAD, c, dst), taken[k][c]);
                done &= taken[k][c] == M;
            }
        }
        /* notify entries, rank 0 -> 1, one route at a time */
        if (notified < NOTIFY_ROUTES) {
            uint64_t id = (uint64_t)notified + 1;
            int par = (int)(id & 1);
            const fr_cuht_geo_t *G0 = &fab[0].G, *G1 = &fab[1].G;
            if (ld(fab[0].out, fr_cuht_geo_notify(G0, par, 0)) < id) {
                uint8_t *e = W.send[0] + fr_cuht_geo_notify(G0, par, 0);
                memset(e + 8, (int)(0x40 + id), (size_t)G0->notify_entry - 8);
                st(fab[0].out, fr_cuht_geo_notify(G0, par, 0), id);
            }
            uint64_t got = ld(fab[1].in, fr_cuht_geo_notify(G1, par, 0));
            if (got == id) {
                const uint8_t *e = W.seg[1] + fr_cuht_geo_notify(G1, par, 0);
                for (uint64_t j = 8; j < G1->notify_entry; j++)
                    if (e[j] != (uint8_t)(0x40 + id)) {
                        fprintf(stderr, "route %llu: notify byte %llu is %d\n",
                                (unsigned long long)id, (unsigned long long)j, e[j]);
                        bad++;
                        break;
                    }
                notified++;
            } else if (got > id || (got && got != id - 2 && got != id)) {
                fprintf(stderr, "route %llu: rank 1 saw route number %llu\n",
                        (unsigned long long)id, (unsigned long long)got);
                bad++;
            }
            done = 0;
        }
    }
    for (int r = 0; r < NR; r++) {
        __atomic_store_n(&ep[r]->proxy.stop, 1, __ATOMIC_RELEASE);
        pthread_join(ep[r]->proxy.thread, NULL);
        if (W.fault == F_NONE || r != victim)
            CHECK(fr_async_status(&ep[r]->async) == FERRY_OK, "rank %d: the thread failed: %s", r,
                  ep[r]->async.msg);
    }
    CHECK(bad == 0, "%d wrong records or words", bad);
    if (W.fault != F_NONE) {
        const char *want = W.fault == F_BADIMM ? "unexpected immediate"
                           : W.fault == F_DUP  ? "twice before it was taken"
                                               : "were sent";
        struct ferry_ep *e = ep[victim];
        CHECK(W.faulted, "the fault was never injected");
        int st = fr_async_status(&e->async);
        CHECK(st == FERRY_ERR_PROTOCOL, "rank %d: status %d (%s), want a protocol error", victim,
              st, e->async.msg);
        /* a repeated run is caught as marked twice, or, once the tail
         * passed its slots, as out of turn */
        int named = strstr(e->async.msg, want) != NULL ||
                    (W.fault == F_DUP && strstr(e->async.msg, "out of turn") != NULL);
        CHECK(named, "rank %d: message '%s', want '%s'", victim, e->async.msg, want);
        CHECK(W.fault == F_BADIMM || e->async.peer == 1 - victim, "rank %d: blames rank %d, "
              "want %d", victim, e->async.peer, 1 - victim);
        CHECK(abortw[victim] != 0, "rank %d: the kernels' abort word was not set", victim);
        printf("htfab %s: rank %d failed as it should: %s\n", fname, victim, e->async.msg);
        done = 1; /* the flow stopped at the fault */
    }
    CHECK(done, "not everything arrived within 20 s (records %llu/%llu/%llu of %d, routes %d "
          "of %d)", (unsigned long long)taken[0][0], (unsigned long long)taken[1][0],
          (unsigned long long)taken[1][C - 1], M, notified, NOTIFY_ROUTES);
    printf("htfab: %d records per ring, %d rings each way, %ld writes posted, %ld landed "
           "(in random order); %d routes notified\n", M, C, W.posted, W.landed, notified);
    for (int r = 0; r < NR; r++) {
        fr_cuht_fab_free(&fab[r]);
        free(fab[r].out);
        free(fab[r].in);
        free(W.seg[r]);
        free(W.send[r]);
        free(ep[r]);
    }
    return fr_test_result();
}
