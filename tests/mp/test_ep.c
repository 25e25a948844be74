/*
 * EP API tests across processes (self-launching).
 *   test_ep -n N args        bad arguments and call sequences (the one-shot
 *                            forms included; the communicator refused to close
 *                            under an open context)
 *   test_ep -n N kill R P    rank R dies in phase P (dispatch|combine) of
 *                            round 5; every other rank must fail naming R
 *                            within FERRY_TIMEOUT_MS + 1 s
 *   test_ep -n N kill_create R
 *                            rank R dies inside ferry_ep_create while its
 *                            receive segment is in /dev/shm; the others'
 *                            create fails (run under tests/shm_leak_check.sh:
 *                            the launcher must remove the segment)
 * Each rank writes its verdict to $DIR/rank.<r>; the parent reads them.
 */
#include <dirent.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "ep/ep.h"
#include "ferry.h"
#include "harness.h"
#include "runtime/rt.h"
#include "launch.h"
#include "verdicts.h"
#include "workload.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

#define CHECK_MSG(ep, needle)                                                  \
    CHECK(strstr(ferry_ep_last_error(ep), needle) != NULL,                     \
          "message '%s' does not name '%s'", ferry_ep_last_error(ep), needle)

static ferry_ep_t make_ep(ferry_comm_t comm, int E, int K, int H, int T,
                          ferry_dtype_t dt, int *rc)
{
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = E;
    cfg.topk = K;
    cfg.hidden = H;
    cfg.max_tokens = T;
    cfg.dispatch_dtype = dt;
    ferry_ep_t ep = NULL;
    *rc = ferry_ep_create(comm, &cfg, &ep);
    return ep;
}

static int run_args(ferry_comm_t comm)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    /* config errors: every rank fails the same way, nobody hangs */
    ferry_ep_t ep = make_ep(comm, 4 * N + 1, 2, 128, 8, FERRY_DTYPE_BF16, &rc);
    if (N > 1) {
        CHECK(rc == FERRY_ERR_INVALID && ep == NULL, "E not divisible: rc %d", rc);
        CHECK(strstr(ferry_comm_last_error(comm), "num_experts") != NULL,
              "message: %s", ferry_comm_last_error(comm));
    } else if (ep) {
        ferry_ep_destroy(ep);
    }
    if (N > 1) {
        /* FERRY_TRANSPORT set on one rank only: a pair would be shared
         * memory from one side and fabric from the other; every rank
         * refuses at once, naming the variable */
        const char *was = getenv("FERRY_TRANSPORT");
        char keep[32] = "";
        if (was)
            snprintf(keep, sizeof(keep), "%s", was);
        if (me == N - 1)
            setenv("FERRY_TRANSPORT", was && strcmp(was, "fabric") == 0 ? "auto" : "fabric", 1);
        ep = make_ep(comm, 4 * N, 2, 128, 8, FERRY_DTYPE_BF16, &rc);
        CHECK(rc == FERRY_ERR_INVALID && ep == NULL, "FERRY_TRANSPORT differing: rc %d", rc);
        CHECK(strstr(ferry_comm_last_error(comm), "FERRY_TRANSPORT differs") != NULL,
              "message: %s", ferry_comm_last_error(comm));
        if (ep)
            ferry_ep_destroy(ep);
        if (was)
            setenv("FERRY_TRANSPORT", keep, 1);
        else
            unsetenv("FERRY_TRANSPORT");
    }
    ep = make_ep(comm, 4 * N, 17, 128, 8, FERRY_DTYPE_BF16, &rc);
    CHECK(rc == FERRY_ERR_INVALID && !ep, "topk 17: rc %d", rc);
    CHECK(strstr(ferry_comm_last_error(comm), "topk") != NULL, "msg %s", ferry_comm_last_error(comm));
    ep = make_ep(comm, 4 * N, 2, 100, 8, FERRY_DTYPE_FP8_E4M3, &rc);
    CHECK(rc == FERRY_ERR_UNSUPPORTED && !ep, "fp8 H=100: rc %d", rc);
    CHECK(strstr(ferry_comm_last_error(comm), "hidden") != NULL, "msg %s", ferry_comm_last_error(comm));
    ep = make_ep(comm, 4 * N, 2, 100, 0, FERRY_DTYPE_BF16, &rc);
    CHECK(rc == FERRY_ERR_INVALID && !ep, "max_tokens 0: rc %d", rc);
    CHECK_RC(ferry_ep_create(comm, NULL, &ep), FERRY_ERR_INVALID);
    {
        /* a mode no engine has: refused on every rank, naming the field */
        ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
        cfg.num_experts = 4 * N;
        cfg.topk = 2;
        cfg.hidden = 128;
        cfg.max_tokens = 8;
        cfg.mode = (ferry_mode_t)7;
        ep = NULL;
        rc = ferry_ep_create(comm, &cfg, &ep);
        CHECK(rc == FERRY_ERR_UNSUPPORTED && !ep, "mode 7: rc %d", rc);
        CHECK(strstr(ferry_comm_last_error(comm), "mode") != NULL, "msg %s",
              ferry_comm_last_error(comm));
    }
    {
        /* expert_x_scales layouts: refused where they cannot apply, naming
         * the field (unknown; bf16; UE8M0 without powers of two, or with H
         * not a multiple of 512) */
        struct { int layout, dtype, round, H; const char *needle; } bad[] = {
            {3, FERRY_DTYPE_FP8_E4M3, 0, 512, "scales_layout = 3"},
            {FERRY_SCALES_COLS, FERRY_DTYPE_BF16, 0, 512, "scales_layout = 1"},
            {FERRY_SCALES_UE8M0, FERRY_DTYPE_FP8_E4M3, 0, 512, "fp8_round_scale"},
            {FERRY_SCALES_UE8M0, FERRY_DTYPE_FP8_E4M3, 1, 384, "hidden = 384"},
        };
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
            ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
            cfg.num_experts = 4 * N;
            cfg.topk = 2;
            cfg.hidden = bad[i].H;
            cfg.max_tokens = 8;
            cfg.dispatch_dtype = (ferry_dtype_t)bad[i].dtype;
            cfg.fp8_round_scale = bad[i].round;
            cfg.scales_layout = bad[i].layout;
            ep = NULL;
            rc = ferry_ep_create(comm, &cfg, &ep);
            CHECK(rc == FERRY_ERR_INVALID && !ep, "scales case %zu: rc %d", i, rc);
            CHECK(strstr(ferry_comm_last_error(comm), bad[i].needle) != NULL,
                  "scales case %zu: msg %s", i, ferry_comm_last_error(comm));
        }
    }
    {
        /* UE8M0 rows take only the quantiser's power-of-two scales: a
         * caller's x_scales is refused, naming it; the context stays
         * usable for bf16 input (an empty round, every rank) */
        ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
        cfg.num_experts = 4 * N;
        cfg.topk = 2;
        cfg.hidden = 512;
        cfg.max_tokens = 8;
        cfg.dispatch_dtype = FERRY_DTYPE_FP8_E4M3;
        cfg.fp8_round_scale = 1;
        cfg.scales_layout = FERRY_SCALES_UE8M0;
        ferry_ep_t ue = NULL;
        rc = ferry_ep_create(comm, &cfg, &ue);
        CHECK(rc == FERRY_OK && ue, "UE8M0 create: %s", ferry_comm_last_error(comm));
        if (ue) {
            static uint8_t q[512];
            static float qs[4] = {0.3f, 1, 1, 1};
            static int64_t ti[2] = {0, 1};
            ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = 1, .x = q,
                                       .x_scales = qs, .topk_idx = ti};
            uint64_t r = 0;
            CHECK_RC(ferry_dispatch_send(ue, &din, &r), FERRY_ERR_INVALID);
            CHECK_MSG(ue, "x_scales");
            CHECK_RC(ferry_ep_destroy(ue), FERRY_OK);
        }
    }

    /* a good context */
    int E = 4 * N, K = 2, H = 256, T = 8;
    ep = make_ep(comm, E, K, H, T, FERRY_DTYPE_FP8_E4M3, &rc);
    CHECK(rc == FERRY_OK && ep, "create: %s", ferry_comm_last_error(comm));
    if (!ep)
        return 1;
    fw_spec_t s = {.N = N, .E = E, .K = K, .H = H, .T = T, .fp8 = 1, .seed = 5};
    fw_input_t in;
    fw_input_alloc(&s, &in);
    fw_generate(&s, 1, me, &in);
    ferry_ep_layout_t lay = {.size = sizeof(lay), .needs_nonblocking_stream = -1};
    CHECK_RC(ferry_ep_get_layout(ep, &lay), FERRY_OK);
    CHECK(lay.needs_nonblocking_stream == 0, "host memory needs no stream"); /* any stream */
    {   /* a caller built before the field: filled up to host_bytes only */
        ferry_ep_layout_t old = {.size = offsetof(ferry_ep_layout_t, needs_nonblocking_stream),
                                 .needs_nonblocking_stream = -1};
        CHECK_RC(ferry_ep_get_layout(ep, &old), FERRY_OK);
        CHECK(old.host_bytes == lay.host_bytes && old.needs_nonblocking_stream == -1,
              "the old size: filled to host_bytes only");
        old.size = offsetof(ferry_ep_layout_t, host_bytes);
        CHECK_RC(ferry_ep_get_layout(ep, &old), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "layout: size");
    }
    uint8_t *ex = calloc(lay.expert_x_bytes, 1);
    float *exs = calloc(lay.expert_scales_bytes, 1);
    int32_t *cnt = calloc((size_t)lay.num_local_experts, 4);
    uint16_t *ey = calloc(lay.expert_y_bytes, 1);
    uint16_t *out = calloc((size_t)T * H, 2);
    uint64_t round = 0;
    ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = T, .x = in.x,
                               .topk_idx = in.idx};
    ferry_dispatch_in_t bad = din;

    bad.num_tokens = T + 1;
    CHECK_RC(ferry_dispatch_send(ep, &bad, &round), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "num_tokens");
    bad = din;
    bad.num_tokens = -1;
    CHECK_RC(ferry_dispatch_send(ep, &bad, &round), FERRY_ERR_INVALID);
    bad = din;
    bad.x = NULL;
    CHECK_RC(ferry_dispatch_send(ep, &bad, &round), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "x: NULL");
    bad = din;
    bad.topk_idx = NULL;
    CHECK_RC(ferry_dispatch_send(ep, &bad, &round), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "topk_idx");
    CHECK_RC(ferry_dispatch_send(ep, NULL, &round), FERRY_ERR_INVALID);
    CHECK_RC(ferry_dispatch_send(ep, &din, NULL), FERRY_ERR_INVALID);
    /* out of sequence before any round */
    ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = ey};
    CHECK_RC(ferry_combine_send(ep, 1, &cin), FERRY_ERR_INVALID);
    CHECK_RC(ferry_dispatch_recv(ep, 0, NULL), FERRY_ERR_INVALID);

    /* the one-shot form checks both halves before it starts a round */
    ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = ex,
                                 .expert_x_scales = exs, .expert_num_tokens = cnt};
    ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = in.w, .out = out};
    CHECK_RC(ferry_dispatch(ep, &din, NULL, &round), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "out: NULL");
    {
        ferry_dispatch_out_t d0 = dout;
        d0.expert_x = NULL;
        CHECK_RC(ferry_dispatch(ep, &din, &d0, &round), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "expert_x");
        d0 = dout;
        d0.size = 8;
        CHECK_RC(ferry_dispatch(ep, &din, &d0, &round), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "out->size");
    }

    {
        /* a size between the struct before wait_cost and the current one
         * would split the pointer: refused, naming out->size */
        ferry_dispatch_out_t d1 = dout;
        ferry_combine_out_t c1 = cout;
        d1.size = offsetof(ferry_dispatch_out_t, wait_cost) + 4;
        CHECK_RC(ferry_dispatch(ep, &din, &d1, &round), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "out->size");
        c1.size = offsetof(ferry_combine_out_t, wait_cost) + 4;
        CHECK_RC(ferry_combine(ep, 7, &cin, &c1), FERRY_ERR_INVALID);
    }
    /* nothing above consumed a round: a real round still works, and is
     * round 1 */
    round = 0;
    CHECK_RC(ferry_dispatch_send(ep, &din, &round), FERRY_OK);
    CHECK(round == 1, "first round is %llu, want 1", (unsigned long long)round);
    CHECK_RC(ferry_combine_send(ep, round, &cin), FERRY_ERR_STATE); /* before recv */
    CHECK_MSG(ep, "dispatch_send");
    ferry_dispatch_out_t dbad = dout;
    dbad.expert_x_scales = NULL;
    CHECK_RC(ferry_dispatch_recv(ep, round, &dbad), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "expert_x_scales");
    CHECK_RC(ferry_dispatch_recv(ep, round, &dout), FERRY_OK);
    CHECK(fw_check_dispatch(&s, 1, me, ex, exs, cnt, NULL, NULL,
                            (size_t)lay.expert_capacity, 3) == 0, "dispatch wrong");
    /* Deduplication: sender r's slice to this rank holds one record per
     * token with any expert here, and one pair per such (token, expert). */
    {
        int El = E / N;
        int64_t *idx2 = calloc((size_t)T * K, sizeof(int64_t));
        for (int src = 0; src < N; src++) {
            int Ts = fw_num_tokens(&s, 1, src);
            fw_generate_idx(&s, 1, src, Ts, idx2);
            uint32_t want_rec = 0, want_pairs = 0;
            for (int t = 0; t < Ts; t++) {
                int any = 0;
                for (int k = 0; k < K; k++)
                    if (idx2[t * K + k] >= 0 && idx2[t * K + k] / El == me) {
                        any = 1;
                        want_pairs++;
                    }
                want_rec += (uint32_t)any;
            }
            const fr_slice_hdr_t *h = (const fr_slice_hdr_t *)(
                ep->seg + fr_off_drecv(&ep->L, (int)(round % FR_NSETS), src));
            CHECK(h->count == want_rec, "rank %d from %d: %u records, want %u",
                  me, src, h->count, want_rec);
            CHECK(h->npairs == want_pairs, "rank %d from %d: %u pairs, want %u",
                  me, src, h->npairs, want_pairs);
        }
        free(idx2);
    }
    fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
    {
        /* the one-shot combine checks `out` before sending */
        ferry_combine_out_t c0 = cout;
        c0.out = NULL;
        CHECK_RC(ferry_combine(ep, round, &cin, NULL), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "out: NULL");
        CHECK_RC(ferry_combine(ep, round, &cin, &c0), FERRY_ERR_INVALID);
        CHECK_MSG(ep, "out->out");
    }
    CHECK_RC(ferry_combine_send(ep, round, &cin), FERRY_OK);
    ferry_combine_out_t cbad = cout;
    cbad.topk_weights = NULL;
    CHECK_RC(ferry_combine_recv(ep, round, &cbad), FERRY_ERR_INVALID);
    CHECK_MSG(ep, "topk_weights");
    CHECK_RC(ferry_combine_recv(ep, round, &cout), FERRY_OK);
    CHECK(fw_check_combine(&s, 1, me, &in, out, 3) == 0, "combine wrong");
    CHECK_RC(ferry_combine_recv(ep, round, &cout), FERRY_ERR_STATE); /* twice */

    /* two rounds in flight are fine; a third is refused */
    uint64_t r2 = 0, r3 = 0, r4 = 0;
    fw_generate(&s, 2, me, &in);
    CHECK_RC(ferry_dispatch_send(ep, &din, &r2), FERRY_OK);
    CHECK_RC(ferry_dispatch_send(ep, &din, &r3), FERRY_OK);
    CHECK_RC(ferry_dispatch_send(ep, &din, &r4), FERRY_ERR_STATE);
    CHECK_MSG(ep, "in flight");
    /* finish both, second one first for the receive side */
    /* structs of the size before wait_cost are accepted, and the field past
     * their size is never read (a garbage pointer there) */
    ferry_dispatch_out_t dold = dout;
    ferry_combine_out_t cold = cout;
    dold.size = offsetof(ferry_dispatch_out_t, wait_cost);
    dold.wait_cost = (int64_t *)(uintptr_t)8;
    cold.size = offsetof(ferry_combine_out_t, wait_cost);
    cold.wait_cost = (int64_t *)(uintptr_t)8;
    CHECK_RC(ferry_dispatch_recv(ep, r2, &dold), FERRY_OK);
    fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
    CHECK_RC(ferry_combine_send(ep, r2, &cin), FERRY_OK);
    CHECK_RC(ferry_combine_recv(ep, r2, &cold), FERRY_OK);
    CHECK(fw_check_combine(&s, 2, me, &in, out, 3) == 0, "combine r2 wrong");
    {
        /* the one-shot forms take the older sizes too, garbage past them
         * unread: this one with wait_cost and without recv_stats */
        uint64_t r6 = 0;
        fw_generate(&s, 4, me, &in);
        ferry_dispatch_out_t dwc = dout;
        dwc.size = offsetof(ferry_dispatch_out_t, recv_stats);
        dwc.recv_stats = (int32_t *)(uintptr_t)8;
        CHECK_RC(ferry_dispatch(ep, &din, &dwc, &r6), FERRY_OK);
        CHECK(fw_check_dispatch(&s, 4, me, ex, exs, cnt, NULL, NULL,
                                (size_t)lay.expert_capacity, 3) == 0, "dispatch r6 wrong");
        fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
        CHECK_RC(ferry_combine(ep, r6, &cin, &cold), FERRY_OK);
        CHECK(fw_check_combine(&s, 4, me, &in, out, 3) == 0, "combine r6 wrong");
        fw_generate(&s, 2, me, &in); /* the rounds below use round 2's inputs */
    }
    CHECK_RC(ferry_dispatch_recv(ep, r3, &dout), FERRY_OK);
    fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
    CHECK_RC(ferry_combine_send(ep, r3, &cin), FERRY_OK);
    CHECK_RC(ferry_combine_recv(ep, r3, &cout), FERRY_OK);
    CHECK(fw_check_combine(&s, 2, me, &in, out, 3) == 0, "combine r3 wrong");

    {
        /* wait costs: the last rank starts each phase 100 ms late; every
         * other rank's cost for it shows that wait, its own stays small */
        int64_t *dc = calloc((size_t)N, sizeof(int64_t)), *cc = calloc((size_t)N, sizeof(int64_t));
        ferry_dispatch_out_t dw = dout;
        ferry_combine_out_t cw = cout;
        dw.wait_cost = dc;
        cw.wait_cost = cc;
        /* receive stats: added to what is there, never cleared */
        int El = (int)lay.num_local_experts;
        int32_t *rs = malloc(sizeof(int32_t) * (size_t)El);
        for (int le = 0; le < El; le++)
            rs[le] = 5 + le;
        dw.recv_stats = rs;
        int late = N - 1;
        uint64_t r5 = 0;
        fw_generate(&s, 3, me, &in);
        if (me == late)
            usleep(100000);
        CHECK_RC(ferry_dispatch_send(ep, &din, &r5), FERRY_OK);
        CHECK_RC(ferry_dispatch_recv(ep, r5, &dw), FERRY_OK);
        CHECK(fw_check_dispatch(&s, 3, me, ex, exs, cnt, NULL, NULL,
                                (size_t)lay.expert_capacity, 3) == 0, "dispatch r5 wrong");
        for (int le = 0; le < El; le++)
            CHECK(rs[le] == 5 + le + cnt[le], "recv_stats[%d] = %d, want %d + %d", le, rs[le],
                  5 + le, cnt[le]);
        free(rs);
        fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
        if (me == late)
            usleep(100000);
        CHECK_RC(ferry_combine_send(ep, r5, &cin), FERRY_OK);
        CHECK_RC(ferry_combine_recv(ep, r5, &cw), FERRY_OK);
        CHECK(fw_check_combine(&s, 3, me, &in, out, 3) == 0, "combine r5 wrong");
        for (int i = 0; i < N; i++)
            CHECK(dc[i] >= 0 && cc[i] >= 0, "wait costs for rank %d: %lld, %lld", i,
                  (long long)dc[i], (long long)cc[i]);
        if (me != late) {
            CHECK(dc[late] >= 50000000 && cc[late] >= 50000000,
                  "wait costs for the late rank %d: %lld / %lld ns, want >= 50 ms", late,
                  (long long)dc[late], (long long)cc[late]);
            CHECK(dc[me] < dc[late] && cc[me] < cc[late], "own wait costs %lld / %lld ns not "
                  "below the late rank's", (long long)dc[me], (long long)cc[me]);
        }
        printf("rank %d: wait costs (ns) for rank %d: dispatch %lld, combine %lld; own %lld, %lld\n",
               me, late, (long long)dc[late], (long long)cc[late], (long long)dc[me],
               (long long)cc[me]);
        free(dc);
        free(cc);
    }

    {
        /* a bad topk_idx (out of range, an expert twice in a token) takes
         * its round: on every rank, each fails naming the entry; on the
         * last rank alone (split calls, then the one-shot call), it fails
         * naming the entry, its peers' dispatch_recv naming it, and all go
         * on with the next round (a good one, checked) */
        fw_generate(&s, 5, me, &in);
        int64_t saved = in.idx[3];
        const int64_t vals[3] = {E, -2, in.idx[2] >= 0 ? in.idx[2] : 0};
        for (int v = 0; v < 3; v++) {
            int64_t s2 = in.idx[2];
            in.idx[3] = vals[v];
            if (v == 2)
                in.idx[2] = vals[v];
            CHECK_RC(ferry_dispatch_send(ep, &din, &round), FERRY_ERR_INVALID);
            CHECK_MSG(ep, v == 2 ? "repeats" : "topk_idx[1][1]");
            in.idx[2] = s2;
            in.idx[3] = saved;
        }
        int badr = N - 1;
        char want[32];
        snprintf(want, sizeof(want), "rank %d passed", badr);
        for (int rep = 0; rep < 2; rep++) {
            if (me == badr)
                in.idx[3] = E;
            uint64_t rb = 0;
            if (rep == 0) {
                rc = ferry_dispatch_send(ep, &din, &rb);
                if (rc == FERRY_OK)
                    rc = ferry_dispatch_recv(ep, rb, &dout);
            } else {
                rc = ferry_dispatch(ep, &din, &dout, &rb);
            }
            in.idx[3] = saved;
            const char *msg = ferry_ep_last_error(ep);
            CHECK(rc == FERRY_ERR_INVALID &&
                      (me == badr ? strstr(msg, "topk_idx[1][1]") != NULL
                                 : strstr(msg, want) && strstr(msg, "[1][1]")),
                  "rep %d: rank %d with a bad topk_idx on rank %d alone: %s: %s", rep, me, badr,
                  ferry_strerror(rc), msg);
        }
        /* the bad round in flight with a good one, received after it
         * (split calls allow that order; the round's end waits for the
         * set's next round, not in these calls) */
        fw_generate(&s, 6, me, &in);
        saved = in.idx[3];
        uint64_t ra = 0, rn = 0;
        if (me == badr)
            in.idx[3] = E;
        rc = ferry_dispatch_send(ep, &din, &ra);
        in.idx[3] = saved;
        CHECK(rc == (me == badr ? FERRY_ERR_INVALID : FERRY_OK), "in flight: rank %d: %s: %s", me,
              ferry_strerror(rc), ferry_ep_last_error(ep));
        CHECK_RC(ferry_dispatch_send(ep, &din, &rn), FERRY_OK);
        CHECK_RC(ferry_dispatch_recv(ep, rn, &dout), FERRY_OK);
        CHECK(fw_check_dispatch(&s, 6, me, ex, exs, cnt, NULL, NULL,
                                (size_t)lay.expert_capacity, 3) == 0,
              "the dispatch beside a bad round wrong");
        fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
        if (me != badr) {
            rc = ferry_dispatch_recv(ep, ra, &dout);
            CHECK(rc == FERRY_ERR_INVALID && strstr(ferry_ep_last_error(ep), want),
                  "in flight: rank %d's dispatch_recv of the bad round: %s: %s", me,
                  ferry_strerror(rc), ferry_ep_last_error(ep));
        }
        CHECK_RC(ferry_combine_send(ep, rn, &cin), FERRY_OK);
        CHECK_RC(ferry_combine_recv(ep, rn, &cout), FERRY_OK);
        CHECK(fw_check_combine(&s, 6, me, &in, out, 3) == 0, "the combine beside a bad round wrong");
        /* two good rounds in flight; rank 0 reads their combines late,
         * while the last rank, done with both, sends a bad round in the
         * first one's set: nothing of it may reach rank 0 before rank 0
         * saw it (its dispatch of that round) */
        uint64_t q1 = 0, q2 = 0, q3 = 0;
        CHECK_RC(ferry_dispatch_send(ep, &din, &q1), FERRY_OK);
        CHECK_RC(ferry_dispatch_send(ep, &din, &q2), FERRY_OK);
        for (int i = 0; i < 2; i++) {
            CHECK_RC(ferry_dispatch_recv(ep, i ? q2 : q1, &dout), FERRY_OK);
            CHECK(fw_check_dispatch(&s, 6, me, ex, exs, cnt, NULL, NULL,
                                    (size_t)lay.expert_capacity, 3) == 0,
                  "two in flight: dispatch %d wrong", i);
        }
        CHECK_RC(ferry_combine_send(ep, q1, &cin), FERRY_OK);
        CHECK_RC(ferry_combine_send(ep, q2, &cin), FERRY_OK);
        if (me == 0)
            usleep(200000);
        for (int i = 0; i < 2; i++) {
            CHECK_RC(ferry_combine_recv(ep, i ? q2 : q1, &cout), FERRY_OK);
            CHECK(fw_check_combine(&s, 6, me, &in, out, 3) == 0, "two in flight: combine %d wrong",
                  i);
        }
        if (me == badr)
            in.idx[3] = E;
        rc = ferry_dispatch_send(ep, &din, &q3);
        in.idx[3] = saved;
        if (rc == FERRY_OK)
            rc = ferry_dispatch_recv(ep, q3, &dout);
        CHECK(rc == FERRY_ERR_INVALID && (me == badr || strstr(ferry_ep_last_error(ep), want)),
              "after two in flight: rank %d: %s: %s", me, ferry_strerror(rc),
              ferry_ep_last_error(ep));

        fw_generate(&s, 5, me, &in);
        uint64_t rg = 0;
        CHECK_RC(ferry_dispatch(ep, &din, &dout, &rg), FERRY_OK);
        CHECK(fw_check_dispatch(&s, 5, me, ex, exs, cnt, NULL, NULL,
                                (size_t)lay.expert_capacity, 3) == 0,
              "the dispatch after the badr rounds wrong");
        fw_run_experts(&s, me, ex, exs, cnt, (size_t)lay.expert_capacity, ey);
        CHECK_RC(ferry_combine(ep, rg, &cin, &cout), FERRY_OK);
        CHECK(fw_check_combine(&s, 5, me, &in, out, 3) == 0,
              "the combine after the badr rounds wrong");
    }

    /* the communicator is not freed under an open context, and still works */
    CHECK_RC(ferry_comm_destroy(comm), FERRY_ERR_STATE);
    CHECK(strstr(ferry_comm_last_error(comm), "1 EP or put-with-signal context still") != NULL,
          "message: %s", ferry_comm_last_error(comm));
    CHECK_RC(ferry_comm_barrier(comm), FERRY_OK);
    CHECK_RC(ferry_ep_destroy(ep), FERRY_OK);
    free(ex);
    free(exs);
    free(cnt);
    free(ey);
    free(out);
    fw_input_free(&in);
    return fr_test_result();
}

static int run_kill(ferry_comm_t comm, int victim, int in_combine)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    int E = 2 * N, K = 2, H = 128, T = 16;
    ferry_ep_t ep = make_ep(comm, E, K, H, T, FERRY_DTYPE_BF16, &rc);
    if (!ep) {
        fprintf(stderr, "rank %d: create: %s\n", me, ferry_comm_last_error(comm));
        return 1;
    }
    fw_spec_t s = {.N = N, .E = E, .K = K, .H = H, .T = T, .seed = 9};
    fw_input_t in;
    fw_input_alloc(&s, &in);
    ferry_ep_layout_t lay = {.size = sizeof(lay)};
    ferry_ep_get_layout(ep, &lay);
    uint8_t *ex = calloc(lay.expert_x_bytes, 1);
    int32_t *cnt = calloc((size_t)lay.num_local_experts, 4);
    uint16_t *ey = calloc(lay.expert_y_bytes, 1);
    uint16_t *out = calloc((size_t)T * H, 2);
    long timeout = strtol(getenv("FERRY_TIMEOUT_MS") ? getenv("FERRY_TIMEOUT_MS") : "30000", NULL, 10);
    for (int round_i = 1; round_i <= 8; round_i++) {
        fw_generate(&s, (uint64_t)round_i, me, &in);
        ferry_dispatch_in_t din = {.size = sizeof(din), .num_tokens = in.T,
                                   .x = in.x, .topk_idx = in.idx};
        ferry_dispatch_out_t dout = {.size = sizeof(dout), .expert_x = ex,
                                     .expert_num_tokens = cnt};
        ferry_combine_in_t cin = {.size = sizeof(cin), .expert_y = ey};
        ferry_combine_out_t cout = {.size = sizeof(cout), .topk_weights = in.w,
                                    .out = out};
        uint64_t r = 0;
        if (round_i == 5 && me == victim && !in_combine)
            raise(SIGKILL);
        double t0 = now_ms();
        rc = ferry_dispatch_send(ep, &din, &r);
        if (rc == FERRY_OK)
            rc = ferry_dispatch_recv(ep, r, &dout);
        if (rc == FERRY_OK) {
            fw_run_experts(&s, me, ex, NULL, cnt, (size_t)lay.expert_capacity, ey);
            if (round_i == 5 && me == victim)
                raise(SIGKILL);
            rc = ferry_combine_send(ep, r, &cin);
            if (rc == FERRY_OK)
                rc = ferry_combine_recv(ep, r, &cout);
        }
        double dt = now_ms() - t0;
        if (rc != FERRY_OK) {
            const char *msg = ferry_ep_last_error(ep);
            char want[32];
            snprintf(want, sizeof(want), "rank %d", victim);
            fprintf(stderr, "rank %d: round %d failed after %.0f ms: %s: %s\n",
                    me, round_i, dt, ferry_strerror(rc), msg);
            /* the victim dies at the start of round 5; writes it posted for
             * round 4 may die with it on the fabric path */
            CHECK(round_i == 5 || round_i == 4,
                  "failed in round %d, victim dies in round 5", round_i);
            CHECK(rc == FERRY_ERR_PEER || rc == FERRY_ERR_TIMEOUT, "status %d", rc);
            CHECK(strstr(msg, want) != NULL, "message does not name %s", want);
            CHECK(dt <= (double)timeout + 1000.0, "took %.0f ms > timeout + 1 s", dt);
            /* the context stays failed, and every later call's message
             * keeps the cause (the dead rank), the prefix once */
            static const char prefix[] = "the EP context failed earlier and cannot be used: ";
            for (int again = 1; again <= 3; again++) {
                int rc2 = again == 2 ? ferry_dispatch(ep, &din, &dout, &r)
                                     : ferry_dispatch_send(ep, &din, &r);
                const char *m2 = ferry_ep_last_error(ep);
                const char *p1 = strstr(m2, prefix);
                CHECK(rc2 == rc, "sticky failure: call %d after it returned %d", again, rc2);
                CHECK(strstr(m2, want) != NULL, "call %d after the failure: message '%s' "
                      "does not name %s", again, m2, want);
                CHECK(p1 != NULL && strstr(p1 + 1, prefix) == NULL,
                      "call %d after the failure: want the prefix once in '%s'", again, m2);
            }
            ferry_ep_destroy(ep);
            ferry_comm_destroy(comm);
            verdict(me, fr_test_failures ? "bad" : "ok");
            free(ex); free(cnt); free(ey); free(out);
            fw_input_free(&in);
            return fr_test_result();
        }
    }
    fprintf(stderr, "rank %d: no error although rank %d died\n", me, victim);
    verdict(me, "no-error");
    return 1;
}

/* kill_create: a communicator whose exchanges go through the launched
 * one's; the victim dies right after the first exchange that found its own
 * EP segment in /dev/shm (the exchange of the segment names, inside
 * ferry_ep_create, before the names are unlinked). Every rank is past that
 * exchange, and so past its start-up sweep of dead processes' entries,
 * which would otherwise remove the victim's segment in the launcher's
 * place. */
typedef struct {
    ferry_comm_t comm;
    int victim;
} kc_ctx_t;

static int own_ep_segment(void)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return 0;
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL) {
        long pid;
        uint64_t ns;
        found = fr_shm_owner(e->d_name, &pid, &ns) == FR_SHM_EP && pid == (long)getpid();
    }
    closedir(d);
    return found;
}

static int kc_allgather(const void *in, void *out, size_t len, void *ctx)
{
    kc_ctx_t *c = ctx;
    int rc = ferry_comm_allgather(c->comm, in, out, len);
    if (c->victim && own_ep_segment())
        raise(SIGKILL);
    return rc == FERRY_OK ? 0 : -1;
}

static int run_kill_create(ferry_comm_t comm, int victim)
{
    int N = ferry_comm_size(comm), me = ferry_comm_rank(comm), rc;
    kc_ctx_t ctx = {comm, me == victim};
    ferry_comm_t inner = NULL;
    char ebuf[512];
    rc = ferry_comm_init_allgather(me, N, kc_allgather, &ctx, &inner, ebuf, sizeof(ebuf));
    CHECK(rc == FERRY_OK, "comm over the callback: %s", ebuf);
    if (rc == FERRY_OK) {
        ferry_ep_t ep = make_ep(inner, 2 * N, 2, 128, 16, FERRY_DTYPE_BF16, &rc);
        fprintf(stderr, "rank %d: create: %s: %s\n", me, ferry_strerror(rc),
                ferry_comm_last_error(inner));
        CHECK(rc != FERRY_OK && !ep, "create succeeded although rank %d died in it", victim);
        CHECK(!own_ep_segment(), "rank %d: its own segment left after a failed create", me);
        if (ep)
            ferry_ep_destroy(ep);
        ferry_comm_destroy(inner);
    }
    ferry_comm_destroy(comm);
    verdict(me, fr_test_failures ? "bad" : "ok");
    return fr_test_result();
}

int main(int argc, char **argv)
{
    int n = 2;
    if (argc >= 3 && strcmp(argv[1], "-n") == 0)
        n = atoi(argv[2]);
    const char *mode = argc >= 4 ? argv[3] : "args";
    int victim = argc >= 5 ? atoi(argv[4]) : -1;
    int in_combine = argc >= 6 && strcmp(argv[5], "combine") == 0;
    ferry_comm_t comm = NULL;
    int rc = 0;
    int kill_mode = strcmp(mode, "kill") == 0 || strcmp(mode, "kill_create") == 0;
    if (!fr_vd_start("ep", "test_ep", mode, n, kill_mode ? victim : -1, &comm, &rc))
        return rc;
    int me = ferry_comm_rank(comm);
    if (strcmp(mode, "kill") == 0)
        return run_kill(comm, victim, in_combine);
    if (strcmp(mode, "kill_create") == 0)
        return run_kill_create(comm, victim);
    rc = run_args(comm);
    ferry_comm_destroy(comm);
    verdict(me, rc ? "bad" : "ok");
    return rc;
}
