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

static char fr_vd_dir[256];

/* Pick and create the folder; returns 1 under an outside launcher. */
static inline int fr_vd_init(const char *tag)
{
    int outside = getenv("FERRY_RANK") != NULL;
    if (outside && getenv("FERRY_TEST_DIR"))
        snprintf(fr_vd_dir, sizeof(fr_vd_dir), "%s", getenv("FERRY_TEST_DIR"));
    else
        snprintf(fr_vd_dir, sizeof(fr_vd_dir), "/tmp/ferry-test-%s-%d", tag,
                 (int)getpid());
    mkdir(fr_vd_dir, 0700);
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

#endif
