/* Per-rank verdict files for multi-process tests: each rank writes "ok"
 * (or why not) to DIR/rank.<r>; the launching parent reads them all. Under
 * an outside launcher (FERRY_RANK set, e.g. tests/cluster.sh) DIR is
 * $FERRY_TEST_DIR and the outside script reads them. */
#ifndef FR_TEST_VERDICTS_H
#define FR_TEST_VERDICTS_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry.h"
#include "launch.h"

static char fr_vd_dir[256];

/* Pick and create the folder; returns 1 under an outside launcher. */
static inline int fr_vd_init(const char *tag)
{
    int outside = getenv("FERRY_RANK") != NULL;
    if (outside && getenv("FERRY_TEST_DIR")) {
        snprintf(fr_vd_dir, sizeof(fr_vd_dir), "%s", getenv("FERRY_TEST_DIR"));
        mkdir(fr_vd_dir, 0700);
        return outside;
    }
    /* a new folder: one named by the pid alone may be left over from a
     * process of the same pid, with its ranks' verdicts in it (a victim's
     * stale "ok" failed a kill test) */
    snprintf(fr_vd_dir, sizeof(fr_vd_dir), "/tmp/ferry-test-%s-%d-XXXXXX", tag,
             (int)getpid());
    if (!mkdtemp(fr_vd_dir)) {
        snprintf(fr_vd_dir, sizeof(fr_vd_dir), "/tmp/ferry-test-%s-%d", tag, (int)getpid());
        mkdir(fr_vd_dir, 0700);
    }
    return outside;
}

static inline void verdict(int rank, const char *what)
{
    char p[300];
    snprintf(p, sizeof(p), "%s/rank.%d", fr_vd_dir, rank);
    FILE *f = fopen(p, "w");
    if (f) {
        fprintf(f, "%s\n", what);
        fclose(f);
    }
}

/* The parent: every rank said "ok", except `victim` (-1: none), which must
 * have said nothing, and the launcher's status says so (SIGKILL with a
 * victim, else 0). Removes the files and the folder, prints
 * "<test> <mode>: launcher status S, passed|FAILED"; 1 when bad. */
static inline int fr_vd_collect(const char *test, const char *mode, int n,
                                int victim, int launcher_status)
{
    int bad = 0;
    for (int r = 0; r < n; r++) {
        char p[300], v[32] = "missing";
        snprintf(p, sizeof(p), "%s/rank.%d", fr_vd_dir, r);
        FILE *f = fopen(p, "r");
        if (f) {
            if (!fgets(v, sizeof(v), f))
                snprintf(v, sizeof(v), "empty");
            fclose(f);
            unlink(p);
        }
        v[strcspn(v, "\n")] = 0;
        if (r == victim ? strcmp(v, "missing") != 0 : strcmp(v, "ok") != 0) {
            fprintf(stderr, "rank %d: verdict %s\n", r, v);
            bad = 1;
        }
    }
    rmdir(fr_vd_dir);
    /* with a victim, it and only it died */
    bad |= victim >= 0 ? launcher_status != 128 + SIGKILL
                       : launcher_status != 0;
    printf("%s %s: launcher status %d, %s\n", test, mode, launcher_status,
           bad ? "FAILED" : "passed");
    return bad;
}

/* The start every self-launching test shares: launch n ranks here (unless
 * an outside launcher did), let the parent collect the verdicts (victim:
 * the rank that must die, or -1) and give each rank its communicator.
 * Returns 1 in a rank, with *comm set; else 0 and *status is what main
 * returns (the parent's verdict, or 1 when the communicator failed). */
static inline int fr_vd_start(const char *tag, const char *test, const char *mode, int n,
                              int victim, ferry_comm_t *comm, int *status)
{
    int outside = fr_vd_init(tag);
    int is_child = outside;
    fr_err_t err = {{0}};
    int rc = outside ? 0 : fr_launch_local(n, &is_child, &err);
    if (!is_child) {
        *status = fr_vd_collect(test, mode, n, victim, rc);
        return 0;
    }
    char ebuf[512];
    *comm = NULL;
    if (ferry_comm_init_env(comm, ebuf, sizeof(ebuf)) != FERRY_OK) {
        fprintf(stderr, "comm: %s\n", ebuf);
        *status = 1;
        return 0;
    }
    return 1;
}

#endif
