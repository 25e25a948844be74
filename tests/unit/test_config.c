/*
 * The time settings' range (FERRY_TIMEOUT_MS, FERRY_BOOTSTRAP_TIMEOUT_MS,
 * FERRY_BOOTSTRAP_AUTH_MS: 1 ms to a week): a value outside it, or not a
 * number, is refused by the calls that start a job, naming the variable
 * and the range, so no deadline is computed from it (0 and -1 timed out at
 * once, 9223372036854775 overflowed into a wait that never ended); a
 * caller that reads it anyway gets it clamped. One rank, no sockets.
 *
 *   test_config
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "ferry.h"
#include "ferry_signal.h"
#include "harness.h"

static const char *vars[] = {"FERRY_TIMEOUT_MS", "FERRY_BOOTSTRAP_TIMEOUT_MS",
                             "FERRY_BOOTSTRAP_AUTH_MS"};
#define NVARS (int)(sizeof(vars) / sizeof(vars[0]))

/* refused: each of these, for each variable */
static const char *bad[] = {"0", "-1", "9223372036854775", "9223372036854775807",
                            "99999999999999999999", "-9223372036854775808", "604800001",
                            "12x", "x"};
#define NBAD (int)(sizeof(bad) / sizeof(bad[0]))

static int fake_allgather(const void *in, void *out, size_t len, void *ctx)
{
    (void)ctx;
    memcpy(out, in, len);
    return 0;
}

/* The communicator, from the environment and over a caller's allgather. */
static void test_comm(void)
{
    for (int v = 0; v < NVARS; v++)
        for (int i = 0; i < NBAD; i++) {
            setenv(vars[v], bad[i], 1);
            ferry_comm_t comm = NULL;
            char eb[256] = "", want[128];
            snprintf(want, sizeof(want), "%s=%s: ", vars[v], bad[i]);
            int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
            CHECK(rc == FERRY_ERR_INVALID && !comm && strstr(eb, want) &&
                      strstr(eb, "must be 1..604800000 ms"),
                  "%s=%s: comm from the environment: rc %d, '%s'", vars[v], bad[i], rc, eb);
            if (comm)
                ferry_comm_destroy(comm);
            comm = NULL;
            eb[0] = 0;
            rc = ferry_comm_init_allgather(0, 1, fake_allgather, NULL, &comm, eb, sizeof(eb));
            CHECK(rc == FERRY_ERR_INVALID && !comm && strstr(eb, want),
                  "%s=%s: comm over an allgather: rc %d, '%s'", vars[v], bad[i], rc, eb);
            if (comm)
                ferry_comm_destroy(comm);
            unsetenv(vars[v]);
        }
    /* the ends of the range are taken */
    static const char *good[] = {"1", "604800000", "+30000"};
    for (int v = 0; v < NVARS; v++)
        for (int i = 0; i < 3; i++) {
            setenv(vars[v], good[i], 1);
            ferry_comm_t comm = NULL;
            char eb[256] = "";
            int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
            CHECK(rc == FERRY_OK, "%s=%s: %s", vars[v], good[i], eb);
            if (comm)
                ferry_comm_destroy(comm);
            unsetenv(vars[v]);
        }
}

/* Set after the communicator: ferry_ep_create and ferry_sig_create refuse
 * it (on every rank: the check is part of their exchange). */
static void test_create(void)
{
    ferry_comm_t comm = NULL;
    char eb[256] = "";
    int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
    CHECK(rc == FERRY_OK, "comm: %s", eb);
    if (rc != FERRY_OK)
        return;
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = 4;
    cfg.topk = 2;
    cfg.hidden = 128;
    cfg.max_tokens = 8;
    ferry_sig_config_t scfg = FERRY_SIG_CONFIG_INIT;
    scfg.heap_bytes = 1 << 16;
    scfg.num_signals = 16;
    for (int i = 0; i < NBAD; i++) {
        setenv("FERRY_TIMEOUT_MS", bad[i], 1);
        char want[128];
        snprintf(want, sizeof(want), "FERRY_TIMEOUT_MS=%s: ", bad[i]);
        ferry_ep_t ep = NULL;
        rc = ferry_ep_create(comm, &cfg, &ep);
        CHECK(rc == FERRY_ERR_INVALID && !ep && strstr(ferry_comm_last_error(comm), want),
              "ep create, FERRY_TIMEOUT_MS=%s: rc %d, '%s'", bad[i], rc,
              ferry_comm_last_error(comm));
        if (ep)
            ferry_ep_destroy(ep);
        ferry_sig_t s = NULL;
        rc = ferry_sig_create(comm, &scfg, &s);
        CHECK(rc == FERRY_ERR_INVALID && !s && strstr(ferry_comm_last_error(comm), want),
              "sig create, FERRY_TIMEOUT_MS=%s: rc %d, '%s'", bad[i], rc,
              ferry_comm_last_error(comm));
        if (s)
            ferry_sig_destroy(s);
    }
    unsetenv("FERRY_TIMEOUT_MS");
    ferry_ep_t ep = NULL;
    rc = ferry_ep_create(comm, &cfg, &ep);
    CHECK(rc == FERRY_OK, "ep create with the default: %s", ferry_comm_last_error(comm));
    if (ep)
        ferry_ep_destroy(ep);
    ferry_comm_destroy(comm);
}

/* A reader with no error path gets the value clamped into the range. */
static void test_clamp(void)
{
    static const struct {
        const char *v;
        long want;
    } c[] = {{"0", 1},
             {"-1", 1},
             {"9223372036854775", 604800000},
             {"99999999999999999999", 604800000},
             {"604800000", 604800000},
             {"250", 250},
             {"x", 30000}};
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        setenv("FERRY_TIMEOUT_MS", c[i].v, 1);
        long got = fr_cfg_int(FR_CFG_TIMEOUT_MS);
        CHECK(got == c[i].want, "FERRY_TIMEOUT_MS=%s read as %ld, want %ld", c[i].v, got,
              c[i].want);
    }
    unsetenv("FERRY_TIMEOUT_MS");
}

/* The other settings: a number out of its range, or a word not among
 * those taken, is refused by the communicator, naming the variable and
 * what it takes; the values the tests and docs use are taken. */
static void test_others(void)
{
    static const struct { const char *var, *val, *want; } badv[] = {
        {"FERRY_SPIN", "-1", "must be 0..1000000000 polls"},
        {"FERRY_SPIN", "abc", "not a whole number"},
        {"FERRY_NICS_PER_RANK", "4", "must be 0..2"},
        {"FERRY_PROXY_THREADS", "9", "must be 1..8"},
        {"FERRY_PROXY_IDLE_US", "-5", "must be 0..1000000 us"},
        {"FERRY_FAULT_DELAY_US", "99999999999", "must be 0..60000000 us"},
        {"FERRY_FAULT_REORDER", "2", "must be 0..1"},
        {"FERRY_FAULT_SEED", "x", "not a whole number"},
        {"FERRY_SHM_SWEEP", "yes", "not a whole number"},
        {"FERRY_TRANSPORT", "shm", "must be auto or fabric"},
        {"FERRY_FABRIC_HMEM", "maybe", "must be auto, on, off, 1 or 0"},
        {"FERRY_PEER_MEM", "ipc", "must be auto, vmm, fabric or legacy"},
        {"FERRY_HT_FORWARD", "ON", "must be auto, on or off"},
        {"FERRY_SIGNAL_MODE", "fastest", "must be fence, grouped, nicfence or counted"},
        {"FERRY_LOG", "LOUD", "must be NONE, ERROR, WARN, WARNING, INFO, DEBUG or TRACE"},
        {"FERRY_LOG", "INFO,EP", "must be NONE"},
        {"FERRY_LOG_SUBSYS", "BOOT,FOO", "a comma-separated list of INIT, BOOT"},
    };
    for (size_t i = 0; i < sizeof(badv) / sizeof(badv[0]); i++) {
        setenv(badv[i].var, badv[i].val, 1);
        ferry_comm_t comm = NULL;
        char eb[256] = "", want[128];
        snprintf(want, sizeof(want), "%s=%s: ", badv[i].var, badv[i].val);
        int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
        CHECK(rc == FERRY_ERR_INVALID && !comm && strstr(eb, want) && strstr(eb, badv[i].want),
              "%s=%s: rc %d, '%s'", badv[i].var, badv[i].val, rc, eb);
        if (comm)
            ferry_comm_destroy(comm);
        unsetenv(badv[i].var);
    }
    static const struct { const char *var, *val; } good[] = {
        {"FERRY_SPIN", "0"}, {"FERRY_NICS_PER_RANK", "2"}, {"FERRY_PROXY_THREADS", "8"},
        {"FERRY_FAULT_SEED", "12345"}, {"FERRY_TRANSPORT", "fabric"},
        {"FERRY_FABRIC_HMEM", "off"}, {"FERRY_PEER_MEM", "legacy"}, {"FERRY_HT_FORWARD", "off"},
        {"FERRY_SIGNAL_MODE", "grouped"}, {"FERRY_LOG", "none"}, {"FERRY_LOG", " warning"},
        {"FERRY_LOG_SUBSYS", "boot,Net"}, {"FERRY_LOG_SUBSYS", "INIT, BOOT,"},
        {"FERRY_TRANSPORT", ""},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        setenv(good[i].var, good[i].val, 1);
        ferry_comm_t comm = NULL;
        char eb[256] = "";
        int rc = ferry_comm_init_env(&comm, eb, sizeof(eb));
        CHECK(rc == FERRY_OK, "%s=%s: %s", good[i].var, good[i].val, eb);
        if (comm)
            ferry_comm_destroy(comm);
        unsetenv(good[i].var);
    }
    setenv("FERRY_LOG", "NONE", 1);
}

int main(void)
{
    setenv("FERRY_RANK", "0", 1);
    setenv("FERRY_WORLD_SIZE", "1", 1);
    setenv("FERRY_LOG", "NONE", 1);
    test_comm();
    test_create();
    test_clamp();
    test_others();
    printf("test_config: %s\n", fr_test_result() ? "FAIL" : "pass");
    return fr_test_result();
}
