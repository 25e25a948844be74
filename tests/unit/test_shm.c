/*
 * Peer segments: a segment is mapped only when it is this user's, mode
 * 0600 and of the expected size (a segment another local user made, or
 * one anybody may write, is refused); regions of processes that are gone
 * are swept.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry.h"
#include "harness.h"
#include "runtime/rt.h"

static int exists(const char *name)
{
    char path[256];
    snprintf(path, sizeof(path), "/dev/shm/%s", name + (name[0] == '/'));
    return access(path, F_OK) == 0;
}

int main(void)
{
    fr_err_t err;
    char name[96];
    const size_t bytes = 3 * 4096;
    snprintf(name, sizeof(name), "/ferry-test-shm-%d", (int)getpid());
    uint8_t *seg = NULL, *peer = NULL;
    CHECK_RC(fr_shm_create(name, bytes, &seg, &err), FERRY_OK);
    /* ours, 0600, right size: mapped */
    CHECK_RC(fr_shm_map(name, bytes, &peer, &err), FERRY_OK);
    fr_shm_unmap(peer, bytes);
    /* a different size than every rank computed */
    CHECK_RC(fr_shm_map(name, bytes + 4096, &peer, &err), FERRY_ERR_PROTOCOL);
    CHECK(strstr(err.msg, "size") != NULL, "msg: %s", err.msg);
    int fd = shm_open(name, O_RDWR, 0);
    CHECK(fd >= 0, "reopen: %s", strerror(errno));
    /* world-writable: another local user could have planted it */
    CHECK(fchmod(fd, 0666) == 0, "fchmod");
    CHECK_RC(fr_shm_map(name, bytes, &peer, &err), FERRY_ERR_PROTOCOL);
    CHECK(strstr(err.msg, "mode") != NULL, "msg: %s", err.msg);
    CHECK(fchmod(fd, 0600) == 0, "fchmod");
    /* another user's (only root can hand a file over) */
    if (geteuid() == 0) {
        CHECK(fchown(fd, 65534, 65534) == 0, "fchown: %s", strerror(errno));
        CHECK_RC(fr_shm_map(name, bytes, &peer, &err), FERRY_ERR_PROTOCOL);
        CHECK(strstr(err.msg, "another user") != NULL, "msg: %s", err.msg);
        CHECK(fchown(fd, 0, 0) == 0, "fchown back");
    } else {
        printf("test_shm: not root, the other-owner case is not run\n");
    }
    close(fd);
    fr_shm_unmap(seg, bytes);
    fr_shm_unlink(name);

    /* sweep: a dead process's region goes, a live one's stays */
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    waitpid(child, NULL, 0);
    char dead[96], live[96], other[96], elsewhere[96];
    unsigned long long ns = (unsigned long long)fr_pidns();
    CHECK(ns != 0, "no pid namespace id");
    snprintf(dead, sizeof(dead), "/ferry-%d-%llx-r0-test", (int)child, ns);
    snprintf(live, sizeof(live), "/ferry-%d-%llx-r0-test", (int)getpid(), ns);
    snprintf(other, sizeof(other), "/ferryx-%d-%llx-r0-test", (int)child, ns);
    /* made in another pid namespace: its pid means nothing here */
    snprintf(elsewhere, sizeof(elsewhere), "/ferry-%d-%llx-r0-test", (int)child, ns + 1);
    CHECK_RC(fr_shm_create(dead, 4096, &seg, &err), FERRY_OK);
    fr_shm_unmap(seg, 4096);
    CHECK_RC(fr_shm_create(live, 4096, &seg, &err), FERRY_OK);
    fr_shm_unmap(seg, 4096);
    CHECK_RC(fr_shm_create(other, 4096, &seg, &err), FERRY_OK);
    fr_shm_unmap(seg, 4096);
    CHECK_RC(fr_shm_create(elsewhere, 4096, &seg, &err), FERRY_OK);
    fr_shm_unmap(seg, 4096);
    int n = fr_shm_sweep_dead();
    CHECK(n >= 1, "swept %d", n);
    CHECK(!exists(dead), "%s left behind", dead);
    CHECK(exists(live), "%s of a live process removed", live);
    CHECK(exists(other), "%s of another prefix removed", other);
    CHECK(exists(elsewhere), "%s of another pid namespace removed", elsewhere);
    fr_shm_unlink(elsewhere);
    fr_shm_unlink(live);
    fr_shm_unlink(other);
    fr_shm_unlink(dead);

    /* every kind of name a rank makes (fr_shm_name), left by a process that
     * died: read back as its, and the launcher's sweep of that pid removes
     * them all; a live process's stay */
    char made[FR_SHM_NKINDS][96], mine[FR_SHM_NKINDS][96];
    int pipefd[2];
    CHECK(pipe(pipefd) == 0, "pipe");
    child = fork();
    if (child == 0) {
        for (int k = 0; k < FR_SHM_NKINDS; k++) {
            made[k][0] = '/';
            if (fr_shm_name(made[k] + 1, sizeof(made[k]) - 1, (fr_shm_kind_t)k, "test-%d", k) < 0 ||
                fr_shm_create(made[k], 4096, &seg, &err) != FERRY_OK)
                _exit(1);
        }
        _exit(write(pipefd[1], made, sizeof(made)) == (ssize_t)sizeof(made) ? 0 : 1);
    }
    int st = 0;
    waitpid(child, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child made no names");
    CHECK(read(pipefd[0], made, sizeof(made)) == (ssize_t)sizeof(made), "names from the child");
    close(pipefd[0]);
    close(pipefd[1]);
    for (int k = 0; k < FR_SHM_NKINDS; k++) {
        mine[k][0] = '/';
        CHECK(fr_shm_name(mine[k] + 1, sizeof(mine[k]) - 1, (fr_shm_kind_t)k, "test-%d", k) > 0,
              "kind %d: no name", k);
        CHECK_RC(fr_shm_create(mine[k], 4096, &seg, &err), FERRY_OK);
        fr_shm_unmap(seg, 4096);
        long pid = 0;
        uint64_t pns = 0;
        CHECK(fr_shm_owner(made[k] + 1, &pid, &pns) == k && pid == child && pns == ns,
              "%s: read back as kind %d, pid %ld, namespace %llx", made[k],
              fr_shm_owner(made[k] + 1, &pid, &pns), pid, (unsigned long long)pns);
        CHECK(exists(made[k]), "%s was not made", made[k]);
    }
    CHECK(fr_shm_owner("ferryx-12-ab-r0", &(long){0}, &(uint64_t){0}) < 0, "another prefix");
    n = fr_shm_sweep_pid((long)getpid()); /* alive: nothing */
    CHECK(n == 0, "swept %d of a live process", n);
    n = fr_shm_sweep_pid((long)child);
    CHECK(n == FR_SHM_NKINDS, "swept %d of %d", n, FR_SHM_NKINDS);
    for (int k = 0; k < FR_SHM_NKINDS; k++) {
        CHECK(!exists(made[k]), "%s left behind", made[k]);
        CHECK(exists(mine[k]), "%s of a live process removed", mine[k]);
        fr_shm_unlink(mine[k]);
        fr_shm_unlink(made[k]);
    }
    printf("test_shm: %d failures\n", fr_test_failures);
    return fr_test_result();
}
