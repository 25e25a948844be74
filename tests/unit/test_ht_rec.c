/* High-throughput dispatch records (core/ht_rec.h): fr_ht_dhdr_check
 * accepts a well-formed header, rejects each broken field naming the
 * sender, and hands back a copy that stays as checked while the sender
 * rewrites the slot. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/ht_rec.h"
#include "harness.h"

enum { K = 4, T = 16, EL = 8, SENDER = 3 };
static const uint64_t ROUTE = 0x1234;

/* A record for token 5: slots 0 and 2 on this rank (experts 7 and 0). */
static void fill(uint8_t *rec)
{
    memset(rec, 0, fr_ht_dhdr_bytes(K));
    fr_ht_dhdr_t *h = (fr_ht_dhdr_t *)rec;
    int16_t *le = (int16_t *)(rec + sizeof(*h));
    float *w = (float *)(rec + fr_ht_woff(K));
    h->token = 5;
    h->flags = fr_ht_flags(1, ROUTE);
    int16_t ids[K] = {7, -1, 0, -1};
    for (int k = 0; k < K; k++) {
        le[k] = ids[k];
        w[k] = ids[k] >= 0 ? 0.25f * (float)(k + 1) : 0.f;
    }
}

static void check_fields(void)
{
    uint8_t rec[256] __attribute__((aligned(16)));
    fr_ht_dhdr_copy_t hd;
    fr_err_t err;
    fill(rec);
    CHECK_RC(fr_ht_dhdr_check(rec, K, T, EL, 1, ROUTE, SENDER, &hd, &err), FERRY_OK);
    CHECK(hd.token == 5 && hd.flags == fr_ht_flags(1, ROUTE), "token %d flags %d", hd.token,
          hd.flags);
    CHECK(hd.le[0] == 7 && hd.le[1] == -1 && hd.le[2] == 0 && hd.le[3] == -1, "le");
    CHECK(hd.w[0] == 0.25f && hd.w[2] == 0.75f && hd.w[1] == 0.f, "w");
    /* the copy is what was checked: rewriting the slot changes nothing */
    ((fr_ht_dhdr_t *)rec)->token = -7;
    ((int16_t *)(rec + sizeof(fr_ht_dhdr_t)))[0] = 999;
    CHECK(hd.token == 5 && hd.le[0] == 7, "copy follows the slot");

    fr_ht_dhdr_t *h = (fr_ht_dhdr_t *)rec;
    int16_t *le = (int16_t *)(rec + sizeof(*h));
#define MUTATE(stmt, fp8)                                                                \
    do {                                                                                 \
        fill(rec);                                                                       \
        stmt;                                                                            \
        err.msg[0] = 0;                                                                  \
        CHECK_RC(fr_ht_dhdr_check(rec, K, T, EL, fp8, ROUTE, SENDER, &hd, &err),         \
                 FERRY_ERR_PROTOCOL);                                                    \
        CHECK(strstr(err.msg, "rank 3") != NULL, "%s: message '%s' names no sender",   \
              #stmt, err.msg);                                                           \
    } while (0)
    MUTATE(h->token = -1, 1);
    MUTATE(h->token = T, 1);
    MUTATE(le[1] = -2, 1);
    MUTATE(le[3] = EL, 1);
    MUTATE(le[0] = INT16_MIN, 1);
    MUTATE((void)0, 0);                                  /* fp8 record, bf16 expected */
    MUTATE(h->flags = fr_ht_flags(1, ROUTE + 1), 1);     /* another route */
#undef MUTATE
    fill(rec);
    h->flags = fr_ht_flags(1, ROUTE + 256); /* the same low 8 bits */
    CHECK_RC(fr_ht_dhdr_check(rec, K, T, EL, 1, ROUTE, SENDER, &hd, &err), FERRY_OK);
}

/* A sender rewriting its slot while this rank checks it: whatever the
 * check accepts, the copy it hands back is within bounds. */
static uint8_t race_rec[256] __attribute__((aligned(16)));
static volatile int race_stop;

static void *rewriter(void *arg)
{
    (void)arg;
    volatile int32_t *tok = (volatile int32_t *)race_rec;
    volatile int16_t *le = (volatile int16_t *)(race_rec + sizeof(fr_ht_dhdr_t));
    for (unsigned i = 0; !race_stop; i++) {
        *tok = i & 1 ? 5 : -5;
        le[0] = i & 2 ? 7 : 0x7fff;
        le[2] = i & 4 ? -1 : -300;
    }
    return NULL;
}

static void check_race(void)
{
    fill(race_rec);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, rewriter, NULL) == 0, "pthread_create");
    long ok = 0;
    for (int i = 0; i < 200000; i++) {
        fr_ht_dhdr_copy_t hd;
        fr_err_t err;
        if (fr_ht_dhdr_check(race_rec, K, T, EL, 1, ROUTE, SENDER, &hd, &err) != FERRY_OK)
            continue;
        ok++;
        int good = hd.token >= 0 && hd.token < T;
        for (int k = 0; k < K; k++)
            good &= hd.le[k] >= -1 && hd.le[k] < EL;
        CHECK(good, "accepted a copy out of bounds (token %d, le %d %d)", hd.token, hd.le[0],
              hd.le[2]);
        if (!good)
            break;
    }
    race_stop = 1;
    pthread_join(th, NULL);
    printf("test_ht_rec: %ld of 200000 checks accepted while rewritten\n", ok);
}

int main(void)
{
    check_fields();
    check_race();
    printf("test_ht_rec: %d failures\n", fr_test_failures);
    return fr_test_result();
}
