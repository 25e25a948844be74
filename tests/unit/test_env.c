/* fr_boot_env_read: sources in order, root address rules, errors; the job
 * secret (FERRY_SECRET, required when ranks span hosts). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "core/err.h"
#include "harness.h"

static const char *all_vars[] = {
    "FERRY_RANK", "FERRY_WORLD_SIZE", "FERRY_ROOT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "FERRY_SECRET", NULL};

#define SECRET "0123456789abcdef-test-secret"

/* Nothing set but a secret (the address rules apply with or without). */
static void clear_env(void)
{
    for (int i = 0; all_vars[i]; i++)
        unsetenv(all_vars[i]);
    setenv("FERRY_SECRET", SECRET, 1);
}

static void set(const char *k, const char *v) { setenv(k, v, 1); }

static fr_boot_env_t env;
static fr_err_t err;

static int rd(void)
{
    memset(&err, 0, sizeof(err));
    return fr_boot_env_read(&env, &err);
}

/* Expect FERRY_ERR_INVALID with every word of `words` (space separated
 * tokens given as separate args) in the message. */
static void expect_invalid(int line, const char *w1, const char *w2)
{
    int rc = rd();
    if (rc != FERRY_ERR_INVALID) {
        CHECK(rc == FERRY_ERR_INVALID, "line %d: rc %d, want INVALID", line,
              rc);
        return;
    }
    CHECK(w1 == NULL || strstr(err.msg, w1), "line %d: '%s' not in: %s", line,
          w1, err.msg);
    CHECK(w2 == NULL || strstr(err.msg, w2), "line %d: '%s' not in: %s", line,
          w2, err.msg);
}

int main(void)
{
    /* Nothing set. */
    clear_env();
    expect_invalid(__LINE__, "FERRY_RANK", "FERRY_WORLD_SIZE");

    /* FERRY_* with FERRY_ROOT. */
    clear_env();
    set("FERRY_RANK", "1");
    set("FERRY_WORLD_SIZE", "4");
    set("FERRY_ROOT", "node7:1234");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.rank == 1 && env.size == 4, "%d/%d", env.rank, env.size);
    CHECK(!strcmp(env.root_host, "node7") && env.root_port == 1234, "%s:%d",
          env.root_host, env.root_port);
    CHECK(!strcmp(env.source, "FERRY"), "%s", env.source);

    /* FERRY beats OMPI, torchrun and Slurm; FERRY_ROOT beats MASTER_ADDR. */
    set("OMPI_COMM_WORLD_RANK", "3");
    set("OMPI_COMM_WORLD_SIZE", "8");
    set("RANK", "5");
    set("WORLD_SIZE", "6");
    set("SLURM_PROCID", "0");
    set("SLURM_NTASKS", "2");
    set("MASTER_ADDR", "10.1.1.1");
    set("MASTER_PORT", "29500");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.rank == 1 && env.size == 4 && !strcmp(env.source, "FERRY") &&
              env.root_port == 1234,
          "%s %d/%d port %d", env.source, env.rank, env.size, env.root_port);

    /* OMPI next; MASTER_ADDR:MASTER_PORT+1 when no FERRY_ROOT. */
    unsetenv("FERRY_RANK");
    unsetenv("FERRY_WORLD_SIZE");
    unsetenv("FERRY_ROOT");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.rank == 3 && env.size == 8 && !strcmp(env.source, "OMPI"),
          "%s %d/%d", env.source, env.rank, env.size);
    CHECK(!strcmp(env.root_host, "10.1.1.1") && env.root_port == 29501,
          "%s:%d", env.root_host, env.root_port);

    /* torchrun next. */
    unsetenv("OMPI_COMM_WORLD_RANK");
    unsetenv("OMPI_COMM_WORLD_SIZE");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.rank == 5 && env.size == 6 && !strcmp(env.source, "torchrun"),
          "%s %d/%d", env.source, env.rank, env.size);

    /* Slurm last; an empty value counts as unset. */
    set("RANK", "");
    unsetenv("WORLD_SIZE");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.rank == 0 && env.size == 2 && !strcmp(env.source, "slurm"),
          "%s %d/%d", env.source, env.rank, env.size);

    /* Local jobs: 127.0.0.1 and a port from the job id. */
    clear_env();
    set("OMPI_COMM_WORLD_RANK", "1");
    set("OMPI_COMM_WORLD_SIZE", "4");
    set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
    set("PMIX_NAMESPACE", "prterun-host-1234@1");
    CHECK_RC(rd(), FERRY_OK);
    int p1 = env.root_port;
    /* below the kernel's ephemeral range, where no outgoing connection
     * can hold it */
    int plo = fr_boot_ephemeral_lo() > 12000 ? 10000 : 20000;
    int phi = fr_boot_ephemeral_lo() > 12000 ? fr_boot_ephemeral_lo() - 1 : 59999;
    CHECK(!strcmp(env.root_host, "127.0.0.1"), "%s", env.root_host);
    CHECK(p1 >= plo && p1 <= phi, "port %d, not in %d..%d", p1, plo, phi);
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.root_port == p1, "port not stable: %d then %d", p1,
          env.root_port);
    set("PMIX_NAMESPACE", "prterun-host-1235@1");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.root_port != p1 && env.root_port >= plo && env.root_port <= phi,
          "another job, port %d (first %d)", env.root_port, p1);
    unsetenv("PMIX_NAMESPACE");
    set("OMPI_MCA_ess_base_jobid", "4242");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.root_port >= plo && env.root_port <= phi, "port %d", env.root_port);
    /* No job id to derive from: ask for FERRY_ROOT. */
    unsetenv("OMPI_MCA_ess_base_jobid");
    expect_invalid(__LINE__, "FERRY_ROOT", NULL);
    /* Not all local: ask for FERRY_ROOT. */
    set("PMIX_NAMESPACE", "x");
    set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
    expect_invalid(__LINE__, "FERRY_ROOT", NULL);

    /* Slurm, one node. */
    clear_env();
    set("SLURM_PROCID", "2");
    set("SLURM_NTASKS", "3");
    set("SLURM_JOB_ID", "777");
    set("SLURM_STEP_ID", "0");
    expect_invalid(__LINE__, "FERRY_ROOT", NULL);
    set("SLURM_STEP_NUM_NODES", "1");
    CHECK_RC(rd(), FERRY_OK);
    p1 = env.root_port;
    CHECK(!strcmp(env.root_host, "127.0.0.1") && p1 >= 20000 && p1 <= 59999,
          "%s:%d", env.root_host, p1);
    set("SLURM_STEP_ID", "1");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.root_port != p1, "step 1 has the port of step 0 (%d)", p1);
    unsetenv("SLURM_STEP_NUM_NODES");
    set("SLURM_NTASKS_PER_NODE", "3");
    CHECK_RC(rd(), FERRY_OK);

    /* One rank alone needs no job id. */
    clear_env();
    set("FERRY_RANK", "0");
    set("FERRY_WORLD_SIZE", "1");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.size == 1 && env.root_port >= 1 && env.root_port <= 65535,
          "size %d port %d", env.size, env.root_port);

    /* IPv6 literal. */
    set("FERRY_ROOT", "[::1]:4000");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(!strcmp(env.root_host, "::1") && env.root_port == 4000, "%s:%d",
          env.root_host, env.root_port);

    /* Malformed values name the variable and the value. */
    clear_env();
    set("FERRY_RANK", "abc");
    set("FERRY_WORLD_SIZE", "4");
    expect_invalid(__LINE__, "FERRY_RANK", "abc");
    set("FERRY_RANK", "4");
    expect_invalid(__LINE__, "FERRY_RANK=4", "FERRY_WORLD_SIZE=4");
    set("FERRY_RANK", "-1");
    expect_invalid(__LINE__, "FERRY_RANK=-1", NULL);
    set("FERRY_RANK", "0");
    set("FERRY_WORLD_SIZE", "0");
    expect_invalid(__LINE__, "FERRY_WORLD_SIZE=0", NULL);
    set("FERRY_WORLD_SIZE", "2x");
    expect_invalid(__LINE__, "FERRY_WORLD_SIZE", "2x");
    set("FERRY_WORLD_SIZE", "99999999999999");
    expect_invalid(__LINE__, "FERRY_WORLD_SIZE", "99999999999999");
    unsetenv("FERRY_WORLD_SIZE");
    expect_invalid(__LINE__, "FERRY_RANK", "FERRY_WORLD_SIZE");
    set("FERRY_WORLD_SIZE", "2");
    set("FERRY_ROOT", "hostonly");
    expect_invalid(__LINE__, "FERRY_ROOT", "hostonly");
    set("FERRY_ROOT", "host:0");
    expect_invalid(__LINE__, "FERRY_ROOT", "host:0");
    set("FERRY_ROOT", "host:65536");
    expect_invalid(__LINE__, "FERRY_ROOT", "65536");
    set("FERRY_ROOT", "host:12ab");
    expect_invalid(__LINE__, "FERRY_ROOT", "12ab");
    set("FERRY_ROOT", ":123");
    expect_invalid(__LINE__, "FERRY_ROOT", ":123");
    set("FERRY_ROOT", "host:65535");
    CHECK_RC(rd(), FERRY_OK);
    unsetenv("FERRY_ROOT");
    set("MASTER_ADDR", "10.0.0.2");
    set("MASTER_PORT", "65535");
    expect_invalid(__LINE__, "MASTER_PORT=65535", NULL);
    set("MASTER_PORT", "x1");
    expect_invalid(__LINE__, "MASTER_PORT", "x1");
    unsetenv("MASTER_PORT");
    expect_invalid(__LINE__, "MASTER_PORT", NULL);
    set("MASTER_PORT", "29500");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.root_port == 29501, "port %d", env.root_port);

    /* OMPI with only half of the pair. */
    clear_env();
    set("OMPI_COMM_WORLD_SIZE", "2");
    expect_invalid(__LINE__, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");

    CHECK_RC(fr_boot_env_read(NULL, &err), FERRY_ERR_INVALID);

    /* The secret: its digest, never the text; required across hosts. */
    clear_env();
    set("FERRY_RANK", "1");
    set("FERRY_WORLD_SIZE", "4");
    set("FERRY_ROOT", "10.0.0.7:1234");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.has_key && !env.local, "has_key %d local %d", env.has_key,
          env.local);
    CHECK(memmem(&env, sizeof(env), SECRET, 8) == NULL,
          "the secret's text is in the env struct");
    unsigned char k1[32];
    memcpy(k1, env.key, 32);
    fr_boot_env_wipe(&env);
    CHECK(!env.has_key && env.key[0] == 0 && env.key[31] == 0, "not wiped");
    set("FERRY_SECRET", SECRET "x");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(memcmp(k1, env.key, 32) != 0, "two secrets, one key");
    unsetenv("FERRY_SECRET");
    expect_invalid(__LINE__, "FERRY_SECRET", "mpirun -x FERRY_SECRET");
    set("FERRY_SECRET", "qwzqwz");
    expect_invalid(__LINE__, "FERRY_SECRET", "too short");
    CHECK(strstr(err.msg, "qwzqwz") == NULL, "message shows the value: %s",
          err.msg);
    /* Local jobs need none: a loopback root, or the launcher says so. */
    unsetenv("FERRY_SECRET");
    set("FERRY_ROOT", "127.0.0.1:1234");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.local && !env.has_key, "local %d has_key %d", env.local,
          env.has_key);
    set("FERRY_ROOT", "localhost:1234");
    CHECK_RC(rd(), FERRY_OK);
    set("FERRY_ROOT", "[::1]:1234");
    CHECK_RC(rd(), FERRY_OK);
    set("FERRY_ROOT", "node7:1234");
    set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
    CHECK_RC(rd(), FERRY_OK);
    CHECK(env.local, "OMPI says all 4 ranks are local");
    unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    unsetenv("FERRY_ROOT");
    unsetenv("FERRY_RANK");
    unsetenv("FERRY_WORLD_SIZE");
    set("RANK", "1");
    set("WORLD_SIZE", "4");
    set("MASTER_ADDR", "10.0.0.2");
    set("MASTER_PORT", "29500");
    expect_invalid(__LINE__, "FERRY_SECRET", NULL);
    set("MASTER_ADDR", "127.0.0.1");
    CHECK_RC(rd(), FERRY_OK);

    clear_env();
    printf("test_env: %s\n", fr_test_result() ? "FAIL" : "pass");
    return fr_test_result();
}
