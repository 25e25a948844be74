/*
 * Ranks of a bootstrap-only job for the rendezvous' attack tests
 * (test_attack.c, test_relay.c): each rank meets, runs two allgathers of
 * job-tagged ints (a block from another job or another round is "WRONG
 * DATA"), closes, and leaves its status and message in
 * <logdir>/rank.R.err and its log in <logdir>/rank.R.log (and, once it has
 * met the others, an empty <logdir>/rank.R.met; with FR_TEST_HOLD_MS set
 * it then waits that long before its allgathers).
 */
#ifndef FR_TEST_BOOT_RANKS_H
#define FR_TEST_BOOT_RANKS_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "core/err.h"

/* Each program uses some of these. */
#pragma GCC diagnostic ignored "-Wunused-function"

#define SECRET "attack-test-secret-0123456789abcdef"
#define BTMO_MS 3000

static int port;
static char logdir[64] = "/tmp/ferry-attack-XXXXXX";

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The port of the tests' jobs: fr_boot_free_port's, below the ephemeral
 * range, since a test keeps its port for seconds across rounds. */
static int free_port(void)
{
    int p = 0, e = fr_boot_free_port(&p);
    if (e != 0) {
        fprintf(stderr, "no free loopback port: %s\n", strerror(e));
        exit(2);
    }
    return p;
}

/* A TCP connection to addr:port (NULL: loopback), -1 on failure. */
static int dial(const char *addr, int p)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)p)};
    inet_pton(AF_INET, addr ? addr : "127.0.0.1", &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Connect to the root port, retrying until it listens (limit ms). */
static int dial_wait(int limit_ms)
{
    int64_t until = now_ms() + limit_ms;
    for (;;) {
        int fd = dial(NULL, port);
        if (fd >= 0 || now_ms() >= until)
            return fd;
        usleep(10000);
    }
}

/* Read up to n bytes within ms; returns bytes read (stops at EOF). */
static size_t read_for(int fd, void *buf, size_t n, int ms)
{
    size_t got = 0;
    int64_t until = now_ms() + ms;
    while (got < n) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)(until - now_ms());
        if (left <= 0 || poll(&p, 1, left) <= 0)
            break;
        ssize_t k = recv(fd, (char *)buf + got, n - got, 0);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    return got;
}

/* A frame header announcing len bytes; then the first n of them from p. */
static void send_head(int fd, uint32_t type, uint32_t len, const void *p,
                      size_t n)
{
    uint32_t h[2] = {type, len};
    (void)!write(fd, h, 8);
    if (n)
        (void)!write(fd, p, n);
}

static void send_frame(int fd, uint32_t type, const void *p, uint32_t len)
{
    send_head(fd, type, len, p, len);
}

/* One rank: meet, two allgathers, close. Exit status 0 when fine; the
 * error text goes to <logdir>/rank.R.err. */
static int job_tag; /* a job's blocks: tag * 1000 + rank * 10 + round */

static int rank_body(int r)
{
    fr_err_t err = {{0}};
    fr_boot_env_t env;
    fr_boot_t *b = NULL;
    int rc = fr_boot_env_read(&env, &err);
    if (rc == FERRY_OK)
        rc = fr_boot_init_tcp(&env, &b, &err);
    char path[128];
    if (rc == FERRY_OK) { /* met: <logdir>/rank.R.met; then hold a while */
        snprintf(path, sizeof(path), "%s/rank.%d.met", logdir, r);
        FILE *m = fopen(path, "w");
        if (m)
            fclose(m);
        const char *hold = getenv("FR_TEST_HOLD_MS");
        if (hold)
            usleep((useconds_t)atoi(hold) * 1000);
    }
    for (int i = 0; rc == FERRY_OK && i < 2; i++) {
        int in = job_tag * 1000 + r * 10 + i, out[64];
        rc = fr_boot_allgather(b, &in, out, sizeof(int), &err);
        for (int k = 0; rc == FERRY_OK && k < env.size; k++)
            if (out[k] != job_tag * 1000 + k * 10 + i) {
                rc = FR_ERR(&err, FERRY_ERR_INTERNAL,
                            "WRONG DATA: allgather %d gave %d from rank %d, "
                            "want %d",
                            i, out[k], k, job_tag * 1000 + k * 10 + i);
                break;
            }
    }
    if (b)
        fr_boot_close(b, rc == FERRY_OK ? &err : NULL);
    snprintf(path, sizeof(path), "%s/rank.%d.err", logdir, r);
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "%d %s\n", rc, rc == FERRY_OK ? "ok" : err.msg);
        fclose(f);
    }
    return rc == FERRY_OK ? 0 : 1;
}

/* Fork rank r of n; its stderr goes to <logdir>/rank.R.log. */
static pid_t start_rank(int r, int n, const char *secret)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    char v[64], path[128];
    snprintf(v, sizeof(v), "%d", r);
    setenv("FERRY_RANK", v, 1);
    snprintf(v, sizeof(v), "%d", n);
    setenv("FERRY_WORLD_SIZE", v, 1);
    snprintf(v, sizeof(v), "127.0.0.1:%d", port);
    setenv("FERRY_ROOT", v, 1);
    if (secret)
        setenv("FERRY_SECRET", secret, 1);
    else
        unsetenv("FERRY_SECRET");
    snprintf(path, sizeof(path), "%s/rank.%d.log", logdir, r);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
    }
    _exit(rank_body(r));
}

/* Wait for the ranks (killing them after limit_ms); st[r]: exit status. */
static void wait_ranks(pid_t *pids, int n, int *st, int limit_ms)
{
    int64_t until = now_ms() + limit_ms;
    for (int r = 0; r < n; r++) {
        st[r] = -1;
        if (pids[r] <= 0)
            continue;
        int s;
        while (waitpid(pids[r], &s, WNOHANG) == 0) {
            if (now_ms() >= until) {
                kill(pids[r], SIGKILL);
                waitpid(pids[r], &s, 0);
                fprintf(stderr, "rank %d hung: killed\n", r);
                s = 124 << 8;
                break;
            }
            usleep(10000);
        }
        st[r] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
    }
}

static void slurp(const char *name, int r, char *buf, size_t cap)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/rank.%d.%s", logdir, r, name);
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    size_t k = fread(buf, 1, cap - 1, f);
    buf[k] = '\0';
    fclose(f);
}

#endif
