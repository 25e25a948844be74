/*
 * File descriptors passed between processes of one host (the vmm kind of
 * peer memory, runtime/peer_mem.h: fr_fdx): every process sends before
 * any accepts; each descriptor arrives with its sender's tag, pid and uid
 * and still refers to the sender's file; a listener nobody sends to times
 * out naming itself; sending to a name nobody listens on is an error
 * naming it.
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ferry.h"
#include "harness.h"
#include "runtime/peer_mem.h"

#define P 4

static void name_of(char *b, size_t n, int i)
{
    snprintf(b, n, "ferry-test-fdx-%d-%d", (int)getpgrp(), i);
}

/* Process i: a memfd holding "rank i" sent to every other, then one from
 * each received and read. Exit 0 when all is right. */
static int child(int i, int go_fd)
{
    fr_err_t err;
    fr_fdx_t x;
    char me[64];
    name_of(me, sizeof(me), i);
    if (fr_fdx_listen(&x, me, P, &err) != FERRY_OK) {
        fprintf(stderr, "listen: %s\n", err.msg);
        return 1;
    }
    char c;
    if (write(go_fd, "r", 1) != 1) /* listening */
        return 2;
    /* the parent lets every process go once all listen */
    int f = memfd_create("fdx", 0);
    char text[32];
    snprintf(text, sizeof(text), "rank %d", i);
    if (f < 0 || write(f, text, strlen(text) + 1) != (ssize_t)strlen(text) + 1)
        return 3;
    if (read(go_fd, &c, 1) != 1)
        return 4;
    for (int j = 0; j < P; j++) {
        char peer[64];
        name_of(peer, sizeof(peer), j);
        if (j != i && fr_fdx_send(peer, i, f, 10000, &err) != FERRY_OK) {
            fprintf(stderr, "send %d->%d: %s\n", i, j, err.msg);
            return 5;
        }
    }
    close(f);
    int seen = 0;
    for (int k = 0; k < P - 1; k++) {
        int tag = -1, g = -1;
        pid_t pid;
        uid_t uid;
        if (fr_fdx_recv(&x, 10000, &tag, &g, &pid, &uid, &err) != FERRY_OK) {
            fprintf(stderr, "recv at %d: %s\n", i, err.msg);
            return 6;
        }
        char got[32] = "", want[32];
        snprintf(want, sizeof(want), "rank %d", tag);
        if (tag < 0 || tag >= P || tag == i || (seen & (1 << tag)) || uid != getuid() ||
            pid <= 0 || pread(g, got, sizeof(got), 0) <= 0 || strcmp(got, want) != 0) {
            fprintf(stderr, "at %d: tag %d pid %d: read \"%s\"\n", i, tag, (int)pid, got);
            return 7;
        }
        seen |= 1 << tag;
        close(g);
    }
    fr_fdx_close(&x);
    return 0;
}

int main(void)
{
    fr_err_t err;
    setpgid(0, 0);
    int sv[P][2];
    pid_t pid[P];
    for (int i = 0; i < P; i++) {
        CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv[i]) == 0, "socketpair");
        pid[i] = fork();
        if (pid[i] == 0) {
            close(sv[i][0]);
            _exit(child(i, sv[i][1]));
        }
        close(sv[i][1]);
    }
    char c;
    for (int i = 0; i < P; i++)
        CHECK(read(sv[i][0], &c, 1) == 1, "process %d did not listen", i);
    for (int i = 0; i < P; i++)
        CHECK(write(sv[i][0], "g", 1) == 1, "go %d", i);
    for (int i = 0; i < P; i++) {
        int st = 0;
        waitpid(pid[i], &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "process %d: status %d", i, st);
        close(sv[i][0]);
    }
    /* a listener nobody sends to: a timeout naming it */
    fr_fdx_t x;
    char me[64];
    name_of(me, sizeof(me), 99);
    CHECK_RC(fr_fdx_listen(&x, me, 1, &err), FERRY_OK);
    int tag, f;
    pid_t p;
    uid_t u;
    CHECK_RC(fr_fdx_recv(&x, 50, &tag, &f, &p, &u, &err), FERRY_ERR_TIMEOUT);
    CHECK(strstr(err.msg, me) != NULL, "msg: %s", err.msg);
    /* the same name twice: refused */
    fr_fdx_t y;
    CHECK_RC(fr_fdx_listen(&y, me, 1, &err), FERRY_ERR_SYSTEM);
    fr_fdx_close(&x);
    /* nobody listening there */
    CHECK_RC(fr_fdx_send(me, 0, 0, 100, &err), FERRY_ERR_SYSTEM);
    CHECK(strstr(err.msg, me) != NULL, "msg: %s", err.msg);
    if (fr_test_result() == 0)
        printf("fdpass: %d processes passed descriptors to each other before accepting; "
               "timeout, busy name and no listener refused by name\n", P);
    return fr_test_result();
}
