/*
 * The fabric path's counters: the histogram's quantiles, the proxy alone
 * over the null transport (src/proxy/nullbench.c: counts consistent with
 * the rounds it ran), and ferry_ep_get_stats's argument checks on a
 * one-rank context (no fabric peer: all zero).
 *
 *   test_stats [peers]   (default 16)
 *   test_stats api       the argument checks alone
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/hist.h"
#include "ferry.h"
#include "harness.h"
#include "proxy/proxy.h"
#include "transport/transport.h"

static void test_hist(void)
{
    fr_hist_t h;
    memset(&h, 0, sizeof(h));
    CHECK(fr_hist_quantile(&h, 0.5) == 0, "empty histogram");
    for (uint64_t v = 1; v < 4000000000ull; v = v * 9 / 8 + 1) {
        int b = fr_hist_bucket(v);
        CHECK(fr_hist_lower(b) <= v && (b == FR_HIST_N - 1 || v < fr_hist_lower(b + 1)),
              "value %llu in bucket %d [%llu, ...)", (unsigned long long)v, b,
              (unsigned long long)fr_hist_lower(b));
    }
    for (int i = 1; i <= 1000; i++)
        fr_hist_add(&h, (uint64_t)i * 1000);
    double p50 = fr_hist_quantile(&h, 0.5), p99 = fr_hist_quantile(&h, 0.99);
    CHECK(h.count == 1000, "count %llu", (unsigned long long)h.count);
    CHECK(p50 > 500000 * 0.9 && p50 < 500000 * 1.1, "p50 %.0f ns, want ~500 us", p50);
    CHECK(p99 > 990000 * 0.9 && p99 < 990000 * 1.1, "p99 %.0f ns, want ~990 us", p99);
}

/* bells: a GPU rank's doorbells, rung by this thread (the proxy's scan
 * and its batches per pass), stamped before (1) or after (2) each rings,
 * else a CPU rank's requests */
static void test_null(int peers, int bells)
{
    int rounds = 20;
    fr_proxy_bench_t b = {.peers = peers, .rounds = rounds, .warmup = 2, .bytes = 1024,
                          .bells = bells};
    int rc = fr_proxy_bench_null(&b);
    CHECK(rc == FERRY_OK, "null bench at %d peers%s: %s", peers, bells ? ", doorbells" : "",
          b.err);
    const ferry_ep_stats_t *s = &b.st;
    uint64_t want = 2ull * (uint64_t)rounds * (uint64_t)peers;
    CHECK(s->writes == want, "writes %llu, want %llu", (unsigned long long)s->writes,
          (unsigned long long)want);
    CHECK(s->completions == s->writes, "completions %llu != writes %llu",
          (unsigned long long)s->completions, (unsigned long long)s->writes);
    CHECK(s->arrivals == s->writes, "arrivals %llu != writes %llu",
          (unsigned long long)s->arrivals, (unsigned long long)s->writes);
    CHECK(s->requests == s->writes && s->doorbells == s->writes,
          "requests %llu, doorbells %llu: one per write", (unsigned long long)s->requests,
          (unsigned long long)s->doorbells);
    /* bells 2: stamps after the writes landed, so the delays wait for them
     * (100 us at most, then counted from the upper bound: how many make it
     * depends on the machine's speed); each still counted once, above */
    if (bells == 2)
        CHECK(s->doorbells_stamped <= s->doorbells, "doorbells stamped late: %llu of %llu",
              (unsigned long long)s->doorbells_stamped, (unsigned long long)s->doorbells);
    else
        CHECK(s->doorbells_stamped == s->doorbells,
              "doorbells stamped %llu of %llu: each delay starts at its ringer's stamp",
              (unsigned long long)s->doorbells_stamped, (unsigned long long)s->doorbells);
    CHECK(s->post_ns > 0 && s->poll_ns > 0 && s->polls > 0, "times: post %llu poll %llu",
          (unsigned long long)s->post_ns, (unsigned long long)s->poll_ns);
    CHECK(s->provider_ns == 0 && s->eagain == 0 && s->batched == 0,
          "null: no provider time, no -FI_EAGAIN, nothing posted with FI_MORE");
    CHECK(s->doorbell_to_post_p50_us > 0 &&
              s->doorbell_to_post_p99_us >= s->doorbell_to_post_p50_us,
          "doorbell to post p50 %.3f p99 %.3f", s->doorbell_to_post_p50_us,
          s->doorbell_to_post_p99_us);
    CHECK(s->seen_to_post_p50_us > 0 &&
              s->seen_to_post_p50_us <= s->doorbell_to_post_p50_us &&
              s->seen_to_post_p99_us <= s->doorbell_to_post_p99_us,
          "seen to post p50 %.3f p99 %.3f: at most the doorbell's %.3f, %.3f",
          s->seen_to_post_p50_us, s->seen_to_post_p99_us, s->doorbell_to_post_p50_us,
          s->doorbell_to_post_p99_us);
    printf("null, %d peers%s: %llu writes, %.3f us per write posting, %.3f polling, doorbell "
           "to post p50 %.1f us p99 %.1f us (seen to post %.1f, %.1f; %llu stamped)\n", peers,
           bells == 2 ? " (doorbells stamped late)" : bells ? " (doorbells)" : "",
           (unsigned long long)s->writes, s->post_ns / 1e3 / (double)s->writes,
           s->poll_ns / 1e3 / (double)s->writes, s->doorbell_to_post_p50_us,
           s->doorbell_to_post_p99_us, s->seen_to_post_p50_us, s->seen_to_post_p99_us,
           (unsigned long long)s->doorbells_stamped);
    fr_proxy_bench_t bad = {.peers = 0, .rounds = 1};
    CHECK(fr_proxy_bench_null(&bad) == FERRY_ERR_INVALID && strstr(bad.err, "peers"),
          "0 peers: %s", bad.err);
    CHECK(fr_transport_find("null") != NULL, "null transport registered");
}

static void test_api(void)
{
    ferry_comm_t comm = NULL;
    char eb[256] = "";
    setenv("FERRY_RANK", "0", 1);
    setenv("FERRY_WORLD_SIZE", "1", 1);
    int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
    CHECK(rc == FERRY_OK, "comm: %s", eb);
    if (rc != FERRY_OK)
        return;
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = 4;
    cfg.topk = 2;
    cfg.hidden = 128;
    cfg.max_tokens = 8;
    ferry_ep_t ep = NULL;
    rc = ferry_ep_create(comm, &cfg, &ep);
    CHECK(rc == FERRY_OK, "ep: %s", ferry_comm_last_error(comm));
    if (rc == FERRY_OK) {
        ferry_ep_stats_t st = {.size = sizeof(st)};
        CHECK(ferry_ep_get_stats(NULL, &st) == FERRY_ERR_INVALID, "NULL ep");
        CHECK(ferry_ep_get_stats(ep, NULL) == FERRY_ERR_INVALID &&
                  strstr(ferry_ep_last_error(ep), "stats is NULL"),
              "NULL stats: %s", ferry_ep_last_error(ep));
        ferry_ep_stats_t small = {.size = 8};
        CHECK(ferry_ep_get_stats(ep, &small) == FERRY_ERR_INVALID &&
                  strstr(ferry_ep_last_error(ep), "sizeof(ferry_ep_stats_t)"),
              "size 8: %s", ferry_ep_last_error(ep));
        memset(&st, 0xff, sizeof(st));
        st.size = sizeof(st);
        CHECK(ferry_ep_get_stats(ep, &st) == FERRY_OK, "get: %s", ferry_ep_last_error(ep));
        CHECK(st.size == sizeof(st) && st.writes == 0 && st.arrivals == 0 &&
                  st.completions == 0 && st.doorbells == 0 && st.doorbells_stamped == 0,
              "one rank, no fabric peer: all zero (writes %llu)",
              (unsigned long long)st.writes);
        /* callers built against earlier versions: their fields filled, the
         * rest of the caller's struct untouched */
        size_t older[] = {offsetof(ferry_ep_stats_t, bytes),
                          offsetof(ferry_ep_stats_t, doorbells_stamped)};
        for (int i = 0; i < 2; i++) {
            memset(&st, 0xab, sizeof(st));
            st.size = older[i];
            int orc = ferry_ep_get_stats(ep, &st);
            const unsigned char *tail = (const unsigned char *)&st + older[i];
            int kept = 1;
            for (size_t b = 0; b < sizeof(st) - older[i]; b++)
                kept &= tail[b] == 0xab;
            CHECK(orc == FERRY_OK && st.writes == 0 && st.doorbells == 0 && kept,
                  "size %zu (an earlier version): rc %d, fields past it %s", older[i], orc,
                  kept ? "untouched" : "written");
        }
        /* a size that ends inside a field: that field is left alone too,
         * with those past it; the whole fields before it are written */
        size_t mid[] = {offsetof(ferry_ep_stats_t, bytes) + 4,
                        offsetof(ferry_ep_stats_t, batched) + 1,
                        offsetof(ferry_ep_stats_t, doorbells_stamped) + 7};
        for (int i = 0; i < 3; i++) {
            size_t whole = mid[i] / 8 * 8; /* fields are 8 bytes, after an 8-byte size */
            memset(&st, 0xab, sizeof(st));
            st.size = mid[i];
            int orc = ferry_ep_get_stats(ep, &st);
            const unsigned char *tail = (const unsigned char *)&st + whole;
            int kept = 1;
            for (size_t b = 0; b < sizeof(st) - whole; b++)
                kept &= tail[b] == 0xab;
            CHECK(orc == FERRY_OK && st.writes == 0 && st.doorbells == 0 &&
                      st.size == mid[i] && kept,
                  "size %zu (inside a field): rc %d, the field it ends in and those past it %s",
                  mid[i], orc, kept ? "untouched" : "written");
        }
        ferry_ep_stats_t v0 = {.size = offsetof(ferry_ep_stats_t, bytes) - 8};
        CHECK(ferry_ep_get_stats(ep, &v0) == FERRY_ERR_INVALID,
              "size below the first version's: refused");
        CHECK(ferry_ep_destroy(ep) == FERRY_OK, "destroy");
    }
    ferry_comm_destroy(comm);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "api") == 0) {
        test_api();
        printf("test_stats api: %s\n", fr_test_result() ? "FAIL" : "pass");
        return fr_test_result();
    }
    int peers = argc > 1 ? atoi(argv[1]) : 16;
    test_hist();
    test_null(peers, 0);
    test_null(peers, 1);
    test_null(peers, 2);
    test_api();
    printf("test_stats: %s\n", fr_test_result() ? "FAIL" : "pass");
    return fr_test_result();
}
