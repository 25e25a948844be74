/*
 * Jobs of one user that meet, or fail to meet, on one rendezvous port
 * without FERRY_SECRET (the key file's job id), and how fast and how
 * clearly a rank that cannot take part fails:
 *
 *   test_jobs shell      the repro of two jobs started from one bash, no
 *                        FERRY_JOB_ID: job A's ranks 0-2, job B's rank 3,
 *                        job A's rank 3, job B's ranks 0-2. No rank gets
 *                        another job's data: every rank fails at once,
 *                        naming the port and FERRY_JOB_ID
 *   test_jobs shell_ids  the same with FERRY_JOB_ID=a and =b: each job runs
 *                        whole or fails on every rank naming the port, and
 *                        one of them runs
 *   test_jobs twice      (ranks forked by this program) two processes of
 *                        one job id claim rank 1 of 3 before rank 2 comes:
 *                        all three fail at once, rank 0 naming both pids
 *   test_jobs late       job X has met and is running; a rank 1, then a
 *                        rank 0, of job Y come to the port: both fail at
 *                        once, naming the port's running job (its rank 0's
 *                        pid and job id); X runs whole
 *   test_jobs keydir     rank 2 has another FERRY_KEY_DIR: it fails at
 *                        once saying rank 0's key file is not in its
 *                        folder, and rank 0 (then rank 1) at once naming
 *                        rank 2 and why, well within the bootstrap timeout
 *   test_jobs otherjob   rank 2 has another FERRY_JOB_ID: it fails at once
 *                        naming the port's other job; rank 0 fails at its
 *                        timeout saying that a rank 2 of another job came
 *                        and left (with its pid), not that it "did not
 *                        connect"
 *   test_jobs stale      a key file of this job's name whose creator's pid
 *                        now belongs to another live process (this one,
 *                        with another start time): it is stale, rank 0
 *                        replaces it and the job runs
 */
#include <sys/stat.h>

#include "bootstrap/boot_int.h"
#include "bootstrap/hmac.h"
#include "boot_ranks.h"
#include "harness.h"

static char self[512];

/* Set (value) or unset (NULL) variable name for the ranks started next. */
static void env_for_ranks(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

/* The outcome of the ranks of one job whose logs are in dir. */
typedef struct job_out {
    int st[4];
    char e[4][700];
    int nok, named;
} job_out_t;

static void job_read(const char *dir, int n, job_out_t *o, const char *want)
{
    char ps[16], save[64];
    snprintf(save, sizeof(save), "%s", logdir);
    snprintf(logdir, sizeof(logdir), "%s", dir);
    snprintf(ps, sizeof(ps), ":%d", port);
    o->nok = o->named = 0;
    for (int r = 0; r < n; r++) {
        char s[700];
        slurp("err", r, s, sizeof(s));
        o->st[r] = -1;
        snprintf(o->e[r], sizeof(o->e[r]), "%s", s);
        if (sscanf(s, "%d", &o->st[r]) != 1)
            o->st[r] = -99;
        o->nok += o->st[r] == 0;
        o->named += o->st[r] != 0 && strstr(s, ps) &&
                    (!want || strstr(s, want));
        printf("%s rank %d: %s", dir, r, s[0] ? s : "(no status)\n");
        CHECK(strstr(s, "WRONG DATA") == NULL,
              "%s rank %d got another job's data: %s", dir, r, s);
    }
    snprintf(logdir, sizeof(logdir), "%s", save);
}

/* From one bash: job A's ranks 0-2 (tag 1), B's rank 3 (tag 2), A's rank
 * 3, B's ranks 0-2; ida/idb: their FERRY_JOB_ID, or NULL. */
static void shell_jobs(const char *ida, const char *idb, job_out_t *a,
                       job_out_t *b, int64_t *took)
{
    char da[96], db[96], script[4096];
    snprintf(da, sizeof(da), "%s/a", logdir);
    snprintf(db, sizeof(db), "%s/b", logdir);
    mkdir(da, 0700);
    mkdir(db, 0700);
    static const int order[8][2] = {{0, 0}, {0, 1}, {0, 2}, {1, 3},
                                    {0, 3}, {1, 0}, {1, 1}, {1, 2}};
    size_t off = (size_t)snprintf(script, sizeof(script),
                                  "export FERRY_WORLD_SIZE=4 "
                                  "FERRY_ROOT=127.0.0.1:%d\n"
                                  "unset FERRY_SECRET FERRY_JOB_ID\n",
                                  port);
    for (int k = 0; k < 8; k++) {
        int j = order[k][0], r = order[k][1];
        const char *id = j ? idb : ida;
        char idset[64] = "";
        if (id)
            snprintf(idset, sizeof(idset), "FERRY_JOB_ID=%s ", id);
        off += (size_t)snprintf(script + off, sizeof(script) - off,
                                "%sFERRY_RANK=%d '%s' rank '%s' %d "
                                "2>'%s/rank.%d.log' &\n",
                                idset, r, self, j ? db : da, j + 1,
                                j ? db : da, r);
    }
    snprintf(script + off, sizeof(script) - off, "wait\n");
    int64_t t0 = now_ms();
    fflush(stdout);
    pid_t sh = fork();
    if (sh == 0) {
        execl("/bin/bash", "bash", "-c", script, (char *)NULL);
        _exit(127);
    }
    int st;
    wait_ranks(&sh, 1, &st, 30000);
    *took = now_ms() - t0;
    CHECK(st == 0, "the shell exited %d", st);
    job_read(da, 4, a, NULL);
    job_read(db, 4, b, NULL);
}

static int mode_shell(void)
{
    job_out_t a, b;
    int64_t took;
    shell_jobs(NULL, NULL, &a, &b, &took);
    job_out_t *jobs[2] = {&a, &b};
    for (int j = 0; j < 2; j++)
        for (int r = 0; r < 4; r++)
            CHECK(jobs[j]->st[r] != 0 && strstr(jobs[j]->e[r], "FERRY_JOB_ID") &&
                      strstr(jobs[j]->e[r], "bash"),
                  "job %c rank %d: want a failure naming the port, the "
                  "shell and FERRY_JOB_ID: %s",
                  'A' + j, r, jobs[j]->e[r]);
    CHECK(a.named == 4 && b.named == 4,
          "%d and %d ranks of jobs A and B named port %d", a.named, b.named,
          port);
    CHECK(took < 2 * BTMO_MS, "the ranks took %lld ms to fail",
          (long long)took);
    printf("every rank of both jobs failed in %lld ms\n", (long long)took);
    return fr_test_result();
}

static int mode_shell_ids(void)
{
    job_out_t a, b;
    int64_t took;
    /* A job that has met holds the port for 2 s, so that the two jobs
     * overlap however fast the first one would run: without it job A can
     * finish before job B's rank 0 comes, and then B runs whole too. */
    setenv("FR_TEST_HOLD_MS", "2000", 1);
    shell_jobs("a", "b", &a, &b, &took);
    unsetenv("FR_TEST_HOLD_MS");
    CHECK(a.nok == 0 || a.nok == 4, "job A ran on %d of its 4 ranks", a.nok);
    CHECK(b.nok == 0 || b.nok == 4, "job B ran on %d of its 4 ranks", b.nok);
    CHECK(a.nok == 4 || a.named == 4, "job A failed, %d ranks naming port %d",
          a.named, port);
    CHECK(b.nok == 4 || b.named == 4, "job B failed, %d ranks naming port %d",
          b.named, port);
    CHECK(a.nok + b.nok == 4, "%d ranks ran, want one whole job",
          a.nok + b.nok);
    return fr_test_result();
}

/* Rank 1 claimed twice while rank 2 is still to come. */
static int mode_twice(void)
{
    env_for_ranks("FERRY_JOB_ID", "twice");
    pid_t pids[3];
    int st[3];
    char e[3][700];
    int64_t t0 = now_ms();
    pids[0] = start_rank(0, 3, NULL);
    pids[1] = start_rank(1, 3, NULL);
    usleep(300000);
    char save[64], dir[64];
    snprintf(save, sizeof(save), "%s", logdir);
    snprintf(dir, sizeof(dir), "%.50s/second", logdir);
    mkdir(dir, 0700);
    snprintf(logdir, sizeof(logdir), "%s", dir);
    pids[2] = start_rank(1, 3, NULL); /* its files: <logdir>/second */
    snprintf(logdir, sizeof(logdir), "%s", save);
    wait_ranks(pids, 3, st, BTMO_MS + 8000);
    int64_t took = now_ms() - t0;
    slurp("err", 0, e[0], sizeof(e[0]));
    slurp("err", 1, e[1], sizeof(e[1]));
    snprintf(logdir, sizeof(logdir), "%s", dir);
    slurp("err", 1, e[2], sizeof(e[2]));
    snprintf(logdir, sizeof(logdir), "%s", save);
    char p1[32], p2[32];
    snprintf(p1, sizeof(p1), "pid %d", (int)pids[1]);
    snprintf(p2, sizeof(p2), "pid %d", (int)pids[2]);
    for (int k = 0; k < 3; k++) {
        printf("process %d: %d %s", k, st[k], e[k]);
        CHECK(st[k] == 1, "process %d exited %d, want a failure: %s", k,
              st[k], e[k]);
    }
    CHECK(strstr(e[0], "claim rank 1") && strstr(e[0], p1) &&
              strstr(e[0], p2) && strstr(e[0], "FERRY_JOB_ID"),
          "rank 0 does not name both claims of rank 1 (%s, %s): %s", p1, p2,
          e[0]);
    CHECK(took < BTMO_MS, "the ranks took %lld ms to fail", (long long)took);
    return fr_test_result();
}

/* Wait until <logdir>/rank.R.met exists (limit ms); 1 when it does. */
static int wait_met(int r, int limit)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/rank.%d.met", logdir, r);
    for (int64_t until = now_ms() + limit; now_ms() < until;) {
        if (access(path, F_OK) == 0)
            return 1;
        usleep(10000);
    }
    return 0;
}

/* One rank of job id `id` in subfolder sub, alone: its status, message
 * (e) and how long it took. */
static int lone_rank(const char *sub, const char *id, int r, int n,
                     char *e, size_t cap, int64_t *took)
{
    char save[64], dir[64];
    snprintf(save, sizeof(save), "%s", logdir);
    snprintf(dir, sizeof(dir), "%.50s/%.8s", logdir, sub);
    mkdir(dir, 0700);
    snprintf(logdir, sizeof(logdir), "%s", dir);
    env_for_ranks("FERRY_JOB_ID", id);
    int64_t t0 = now_ms();
    pid_t pid = start_rank(r, n, NULL);
    int st;
    wait_ranks(&pid, 1, &st, BTMO_MS + 5000);
    *took = now_ms() - t0;
    slurp("err", r, e, cap);
    snprintf(logdir, sizeof(logdir), "%s", save);
    printf("%s rank %d: exit %d after %lld ms: %s", sub, r, st,
           (long long)*took, e);
    return st;
}

static int mode_late(void)
{
    env_for_ranks("FERRY_JOB_ID", "x");
    setenv("FR_TEST_HOLD_MS", "4000", 1);
    pid_t pids[2];
    int st[2];
    pids[0] = start_rank(0, 2, NULL);
    pids[1] = start_rank(1, 2, NULL);
    unsetenv("FR_TEST_HOLD_MS");
    CHECK(wait_met(0, 10000) && wait_met(1, 10000), "job X never met");
    char e[700], pid0[64];
    int64_t took;
    snprintf(pid0, sizeof(pid0), "pid %d", (int)pids[0]);
    int s = lone_rank("y1", "y", 1, 2, e, sizeof(e), &took);
    CHECK(s == 1 && strstr(e, "rendezvous has ended") && strstr(e, pid0) &&
              strstr(e, "'ferry:x'") && took < 1500,
          "job Y's rank 1: exit %d after %lld ms, want a quick failure "
          "naming job X (%s, 'ferry:x'): %s",
          s, (long long)took, pid0, e);
    s = lone_rank("y0", "y", 0, 2, e, sizeof(e), &took);
    CHECK(s == 1 && strstr(e, "rendezvous has ended") && strstr(e, pid0) &&
              took < 1500,
          "job Y's rank 0: exit %d after %lld ms, want a quick failure "
          "naming job X (%s): %s",
          s, (long long)took, pid0, e);
    wait_ranks(pids, 2, st, 20000);
    for (int r = 0; r < 2; r++) {
        slurp("err", r, e, sizeof(e));
        CHECK(st[r] == 0, "job X rank %d exited %d: %s", r, st[r], e);
    }
    return fr_test_result();
}

/* A job of three ranks whose rank 2 gets variable name = value; the time
 * until all ended. */
static int64_t odd_rank_job(const char *name, const char *value, int *st,
                            char (*e)[700], pid_t *pids)
{
    int64_t t0 = now_ms();
    pids[0] = start_rank(0, 3, NULL);
    pids[1] = start_rank(1, 3, NULL);
    char *was = getenv(name) ? strdup(getenv(name)) : NULL;
    setenv(name, value, 1);
    pids[2] = start_rank(2, 3, NULL);
    env_for_ranks(name, was);
    free(was);
    wait_ranks(pids, 3, st, BTMO_MS + 8000);
    int64_t took = now_ms() - t0;
    for (int r = 0; r < 3; r++) {
        slurp("err", r, e[r], sizeof(e[r]));
        printf("rank %d: exit %d: %s", r, st[r], e[r]);
        CHECK(st[r] == 1, "rank %d exited %d, want a failure", r, st[r]);
    }
    return took;
}

static int mode_keydir(void)
{
    char d1[96], d2[96];
    snprintf(d1, sizeof(d1), "%s/keys1", logdir);
    snprintf(d2, sizeof(d2), "%s/keys2", logdir);
    mkdir(d1, 0700);
    mkdir(d2, 0700);
    env_for_ranks("FERRY_JOB_ID", "kd");
    env_for_ranks("FERRY_KEY_DIR", d1);
    int st[3];
    char e[3][700];
    pid_t pids[3];
    int64_t took = odd_rank_job("FERRY_KEY_DIR", d2, st, e, pids);
    CHECK(strstr(e[2], "not in this rank's key folder") &&
              strstr(e[2], d2) && strstr(e[2], "FERRY_KEY_DIR"),
          "rank 2 does not say rank 0's key file is not in %s: %s", d2, e[2]);
    CHECK(strstr(e[0], "rank 2 of this job") &&
              strstr(e[0], "key folder"),
          "rank 0 does not name rank 2 and its key folder: %s", e[0]);
    CHECK(strstr(e[1], "rank 2"), "rank 1 does not name rank 2: %s", e[1]);
    CHECK(took < BTMO_MS / 2, "the ranks took %lld ms to fail (bootstrap "
                              "timeout %d ms)",
          (long long)took, BTMO_MS);
    return fr_test_result();
}

static int mode_otherjob(void)
{
    env_for_ranks("FERRY_JOB_ID", "mine");
    int st[3];
    char e[3][700], p2[32];
    pid_t pids[3];
    int64_t took = odd_rank_job("FERRY_JOB_ID", "theirs", st, e, pids);
    snprintf(p2, sizeof(p2), "pid %d", (int)pids[2]);
    CHECK(strstr(e[2], "another ferry job") && strstr(e[2], "FERRY_JOB_ID"),
          "rank 2 does not name the port's other job: %s", e[2]);
    CHECK(strstr(e[0], "rank 2 of 3") && strstr(e[0], p2) &&
              strstr(e[0], "reached this root and left") &&
              strstr(e[0], "ferry:theirs"),
          "rank 0 does not say that rank 2 (%s, job 'ferry:theirs') came "
          "and left: %s",
          p2, e[0]);
    printf("took %lld ms\n", (long long)took);
    return fr_test_result();
}

static int mode_stale(void)
{
    char dir[96], name[256], path[400];
    snprintf(dir, sizeof(dir), "%s/keys", logdir);
    mkdir(dir, 0700);
    env_for_ranks("FERRY_KEY_DIR", dir);
    env_for_ranks("FERRY_JOB_ID", "stale");
    /* The file an earlier rank 0 left, whose pid is this process's now. */
    const char *job = "ferry:stale";
    unsigned char h[FR_SHA256_LEN], buf[224];
    fr_sha256(job, strlen(job), h);
    snprintf(name, sizeof(name),
             "ferry-%u-127.0.0.1-%d-%02x%02x%02x%02x%02x%02x%02x%02x.key",
             (unsigned)geteuid(), port, h[0], h[1], h[2], h[3], h[4], h[5],
             h[6], h[7]);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    memset(buf, 0x5a, 32);
    memset(buf + 32, 0, sizeof(buf) - 32);
    int32_t pid = (int32_t)getpid();
    uint64_t start = 1; /* not this process's start time */
    memcpy(buf + 32, &pid, 4);
    memcpy(buf + 40, &start, 8);
    memcpy(buf + 64, job, strlen(job));
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0 && write(fd, buf, sizeof(buf)) == (ssize_t)sizeof(buf),
          "cannot write %s", path);
    if (fd >= 0)
        close(fd);
    pid_t pids[3];
    int st[3];
    for (int r = 0; r < 3; r++)
        pids[r] = start_rank(r, 3, NULL);
    wait_ranks(pids, 3, st, BTMO_MS + 8000);
    for (int r = 0; r < 3; r++) {
        char e[700];
        slurp("err", r, e, sizeof(e));
        printf("rank %d: exit %d: %s", r, st[r], e);
        CHECK(st[r] == 0, "rank %d exited %d: %s", r, st[r], e);
    }
    CHECK(access(path, F_OK) != 0, "the key file %s is left", path);
    return fr_test_result();
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc == 4 && !strcmp(argv[1], "rank")) { /* one rank of shell_jobs */
        snprintf(logdir, sizeof(logdir), "%s", argv[2]);
        job_tag = atoi(argv[3]);
        const char *r = getenv("FERRY_RANK");
        return rank_body(r ? atoi(r) : -1);
    }
    const char *mode = argc > 1 ? argv[1] : "";
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[n > 0 ? n : 0] = '\0';
    if (!mkdtemp(logdir)) {
        perror("mkdtemp");
        return 2;
    }
    port = free_port();
    char v[32];
    snprintf(v, sizeof(v), "%d", BTMO_MS);
    setenv("FERRY_BOOTSTRAP_TIMEOUT_MS", v, 1);
    setenv("FERRY_TIMEOUT_MS", "5000", 0);
    unsetenv("FERRY_SECRET");
    unsetenv("FERRY_JOB_ID");
    int rc;
    if (!strcmp(mode, "shell"))
        rc = mode_shell();
    else if (!strcmp(mode, "shell_ids"))
        rc = mode_shell_ids();
    else if (!strcmp(mode, "twice"))
        rc = mode_twice();
    else if (!strcmp(mode, "late"))
        rc = mode_late();
    else if (!strcmp(mode, "keydir"))
        rc = mode_keydir();
    else if (!strcmp(mode, "otherjob"))
        rc = mode_otherjob();
    else if (!strcmp(mode, "stale"))
        rc = mode_stale();
    else {
        fprintf(stderr, "usage: %s shell|shell_ids|twice|late|keydir|"
                        "otherjob|stale\n",
                argv[0]);
        return 2;
    }
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", logdir);
    (void)!system(cmd);
    printf("test_jobs %s: %s\n", mode, rc ? "FAIL" : "pass");
    return rc;
}
