/*
 * File descriptors passed between processes of one host (the vmm kind of
 * peer memory, runtime/peer_mem.h: fr_fdx): every process sends before
 * any accepts; each descriptor arrives once, from the peer its tag names,
 * and still refers to the sender's file; a listener nobody sends to times
 * out naming itself; sending to a name nobody listens on is an error
 * naming it. (Strangers at either end: test_pmem_pass.)
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
#include "runtime/rt.h"

#define P 4

static void name_of(char *b, size_t n, int i)
{
    snprintf(b, n, "ferry-test-fdx-%d-%d", (int)getpgrp(), i);
}

typedef struct taken {
    int me, seen, bad;
} taken_t;

/* The descriptor of peer i (tag i, or i + 1 past the receiver's own)
 * must hold "rank <tag>" and come once. */
static void take(void *arg, int i, int g)
{
    taken_t *t = (taken_t *)arg;
    int tag = i < t->me ? i : i + 1;
    char got[32] = "", want[32];
    snprintf(want, sizeof(want), "rank %d", tag);
    if ((t->seen & (1 << tag)) || pread(g, got, sizeof(got), 0) <= 0 || strcmp(got, want) != 0) {
        fprintf(stderr, "at %d: from tag %d read \"%s\"\n", t->me, tag, got);
        t->bad++;
    }
    t->seen |= 1 << tag;
    close(g);
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
    pid_t pids[P];
    if (read(go_fd, &c, 1) != 1 || read(go_fd, pids, sizeof(pids)) != sizeof(pids))
        return 4;
    char names[P][64];
    fr_fdx_peer_t peers[P - 1];
    for (int j = 0, k = 0; j < P; j++) {
        name_of(names[j], sizeof(names[j]), j);
        if (j != i)
            peers[k++] = (fr_fdx_peer_t){j, (long)pids[j], fr_pidns(), names[j]};
    }
    for (int k = 0; k < P - 1; k++)
        if (fr_fdx_send(&peers[k], i, f, 10000, &err) != FERRY_OK) {
            fprintf(stderr, "send %d->%d: %s\n", i, peers[k].tag, err.msg);
            return 5;
        }
    close(f);
    taken_t t = {i, 0, 0};
    if (fr_fdx_gather(&x, peers, P - 1, 10000, take, &t, &err) != FERRY_OK) {
        fprintf(stderr, "gather at %d: %s\n", i, err.msg);
        return 6;
    }
    fr_fdx_close(&x);
    return t.bad || t.seen != ((1 << P) - 1) - (1 << i) ? 7 : 0;
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
        CHECK(write(sv[i][0], "g", 1) == 1 && write(sv[i][0], pid, sizeof(pid)) == sizeof(pid),
              "go %d", i);
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
    fr_fdx_peer_t self = {0, (long)getpid(), fr_pidns(), me};
    taken_t t = {P, 0, 0};
    CHECK_RC(fr_fdx_gather(&x, &self, 1, 50, take, &t, &err), FERRY_ERR_TIMEOUT);
    CHECK(strstr(err.msg, me) != NULL, "msg: %s", err.msg);
    /* the same name twice: refused */
    fr_fdx_t y;
    CHECK_RC(fr_fdx_listen(&y, me, 1, &err), FERRY_ERR_SYSTEM);
    fr_fdx_close(&x);
    /* nobody listening there */
    CHECK_RC(fr_fdx_send(&self, 0, 0, 100, &err), FERRY_ERR_SYSTEM);
    CHECK(strstr(err.msg, me) != NULL, "msg: %s", err.msg);
    if (fr_test_result() == 0)
        printf("fdpass: %d processes passed descriptors to each other before accepting; "
               "timeout, busy name and no listener refused by name\n", P);
    return fr_test_result();
}
