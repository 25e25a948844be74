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
    int n = fr_shm_sweep_dead("ferry-", '-');
    CHECK(n >= 1, "swept %d", n);
    CHECK(!exists(dead), "%s left behind", dead);
    CHECK(exists(live), "%s of a live process removed", live);
    CHECK(exists(other), "%s of another prefix removed", other);
    CHECK(exists(elsewhere), "%s of another pid namespace removed", elsewhere);
    fr_shm_unlink(elsewhere);
    fr_shm_unlink(live);
    fr_shm_unlink(other);
    fr_shm_unlink(dead);
    printf("test_shm: %d failures\n", fr_test_failures);
    return fr_test_result();
}
