/*
 * Attacks on the TCP rendezvous, from a local process that does not know
 * the job secret. The test starts the ranks itself (FERRY_RANK, _WORLD_SIZE,
 * _ROOT on a free loopback port, FERRY_SECRET), runs the attack around
 * them, and checks the outcome:
 *
 *   test_attack flood        100 idle connections before the ranks: the
 *                            job still succeeds, quickly
 *   test_attack evict        a child opens non-blocking connections as
 *                            fast as it can for 4 s, holding as many as
 *                            its fd limit allows, while the ranks join: the
 *                            root's table overflows and evicts, yet every
 *                            rank gets in (it dials again when dropped
 *                            before the root's ACK) and the job succeeds
 *   test_attack slowloris    12 connections dribbling a partial header: no
 *                            stall of the root, the job succeeds quickly
 *   test_attack garbage      random bytes, an oversized frame, a hello
 *                            before the handshake: dropped, job succeeds
 *   test_attack squat        strangers connect first and claim rank 1 (an
 *                            old-style hello; a handshake with a forged
 *                            MAC): rejected with a WARN naming the peer,
 *                            the real rank 1 gets in, the job succeeds
 *   test_attack wrongsecret  rank 2 has another FERRY_SECRET: it fails
 *                            saying authentication failed; the others fail
 *                            naming rank 2, all within the timeout
 *   test_attack fakeroot     a listener squats the root port: the ranks
 *                            refuse it (authentication failed) and send it
 *                            nothing but their nonce
 *   test_attack keyfile      no FERRY_SECRET, all ranks local: they meet
 *                            through the per-user key file, which is gone
 *                            afterwards
 *   test_attack loopback     FERRY_ROOT=127.0.0.1: the root cannot be
 *                            reached through another local address (exit
 *                            77 when the machine has none)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "core/err.h"
#include "harness.h"

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

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0) {
        perror("bind");
        exit(2);
    }
    close(fd);
    return ntohs(sa.sin_port);
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
static int rank_body(int r)
{
    fr_err_t err = {{0}};
    fr_boot_env_t env;
    fr_boot_t *b = NULL;
    int rc = fr_boot_env_read(&env, &err);
    if (rc == FERRY_OK)
        rc = fr_boot_init_tcp(&env, &b, &err);
    for (int i = 0; rc == FERRY_OK && i < 2; i++) {
        int in = r * 10 + i, out[64];
        rc = fr_boot_allgather(b, &in, out, sizeof(int), &err);
        for (int k = 0; rc == FERRY_OK && k < env.size; k++)
            if (out[k] != k * 10 + i)
                rc = FERRY_ERR_INTERNAL;
    }
    if (b)
        fr_boot_close(b, rc == FERRY_OK ? &err : NULL);
    char path[128];
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

/* Start n ranks (rank 0 first, the rest after `between` ran) and expect
 * all to succeed within limit_ms. */
static void job_ok(int n, void (*between)(void), int limit_ms)
{
    pid_t pids[8];
    int st[8];
    int64_t t0 = now_ms();
    pids[0] = start_rank(0, n, SECRET);
    if (between)
        between();
    for (int r = 1; r < n; r++)
        pids[r] = start_rank(r, n, SECRET);
    wait_ranks(pids, n, st, 20000);
    int64_t took = now_ms() - t0;
    for (int r = 0; r < n; r++) {
        char e[600];
        slurp("err", r, e, sizeof(e));
        CHECK(st[r] == 0, "rank %d exited %d: %s", r, st[r], e);
    }
    CHECK(took <= limit_ms, "the job took %lld ms (limit %d)",
          (long long)took, limit_ms);
    printf("job of %d ranks done in %lld ms\n", n, (long long)took);
}

static int held[160], nheld;

static void open_idle(void)
{
    int fd = dial_wait(5000);
    CHECK(fd >= 0, "root never listened");
    held[nheld++] = fd;
    for (int i = 1; i < 100; i++)
        if ((fd = dial(NULL, port)) >= 0)
            held[nheld++] = fd;
    printf("%d idle connections open\n", nheld);
}

static pid_t flood_pid;
/* A child that opens connections without pause for 4 s, keeping up to its
 * fd limit open (then closing the oldest for each new one). */
static void start_evict_flood(void)
{
    int fd0 = dial_wait(5000);
    CHECK(fd0 >= 0, "root never listened");
    close(fd0);
    fflush(stdout);
    flood_pid = fork();
    if (flood_pid != 0) {
        usleep(300000); /* the ranks join a flood in full swing */
        return;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max < 16384 ? rl.rlim_max : 16384;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
    }
    size_t cap = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur > 64
                     ? (size_t)rl.rlim_cur - 32
                     : 32;
    int *fds = calloc(cap, sizeof(int));
    if (!fds)
        _exit(1);
    size_t head = 0, n = 0;
    long opened = 0;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int64_t until = now_ms() + 4000;
    while (now_ms() < until) {
        if (n == cap) {
            close(fds[head]);
            head = (head + 1) % cap;
            n--;
        }
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            usleep(100);
            continue;
        }
        (void)connect(fd, (struct sockaddr *)&sa, sizeof(sa));
        fds[(head + n) % cap] = fd;
        n++;
        opened++;
    }
    printf("flood: %ld connections opened\n", opened);
    fflush(stdout);
    _exit(0);
}

static pid_t slow_pid;
static void start_slowloris(void)
{
    int fd0 = dial_wait(5000);
    CHECK(fd0 >= 0, "root never listened");
    close(fd0);
    fflush(stdout);
    slow_pid = fork();
    if (slow_pid != 0)
        return;
    int fds[12];
    for (int i = 0; i < 12; i++)
        fds[i] = dial(NULL, port);
    /* one byte of a header every 150 ms each, for 6 s */
    for (int k = 0; k < 40; k++) {
        for (int i = 0; i < 12; i++)
            if (fds[i] >= 0 && k < 7)
                (void)!send(fds[i], "\x0a", 1, MSG_NOSIGNAL);
        usleep(150000);
    }
    _exit(0);
}

static void send_garbage(void)
{
    int fd = dial_wait(5000);
    CHECK(fd >= 0, "root never listened");
    unsigned char junk[4096];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (unsigned char)(i * 131 + 7);
    (void)!write(fd, junk, sizeof(junk));
    held[nheld++] = fd;
    fd = dial(NULL, port); /* a nonce frame of 1 GB */
    send_head(fd, 0x10A, 1u << 30, junk, sizeof(junk));
    held[nheld++] = fd;
    fd = dial(NULL, port); /* a hello of 4 GB */
    send_head(fd, 0x101, 0xfffffff0u, NULL, 0);
    held[nheld++] = fd;
    fd = dial(NULL, port); /* a hello right away, no handshake */
    uint32_t hi[6] = {0x46524259u, 3, 1, 3, 4242, 0};
    send_frame(fd, 0x101, hi, sizeof(hi));
    held[nheld++] = fd;
}

static char squat_peer[64];
static void squat(void)
{
    /* A: an old-style hello claiming rank 1 at once. */
    int a = dial_wait(5000);
    CHECK(a >= 0, "root never listened");
    uint32_t hi[6] = {0x46524259u, 1, 1, 3, 4242, 0};
    send_frame(a, 0x101, hi, sizeof(hi));
    held[nheld++] = a;
    /* B: the handshake, with a forged MAC, claiming rank 1. */
    int b = dial(NULL, port);
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    getsockname(b, (struct sockaddr *)&me, &ml);
    snprintf(squat_peer, sizeof(squat_peer), "127.0.0.1:%u",
             (unsigned)ntohs(me.sin_port));
    unsigned char ch[48], nonce[32] = {1, 2, 3}, proof[40];
    if (read_for(b, ch, sizeof(ch), 1000) == sizeof(ch)) {
        send_frame(b, 0x10A, nonce, sizeof(nonce));
        (void)read_for(b, proof, sizeof(proof), 1000);
    }
    uint32_t hello[6 + 8] = {0x46524259u, 3, 1, 3, 4243, 0};
    send_frame(b, 0x101, hello, sizeof(hello));
    unsigned char reply[64];
    size_t k = read_for(b, reply, sizeof(reply), 1000);
    uint32_t type = 0;
    if (k >= 4)
        memcpy(&type, reply, 4);
    CHECK(type == 0x103 && k > 12 &&
              memmem(reply, k, "authentication failed", 21) != NULL,
          "the forged hello got %zu bytes of frame 0x%x, want an ABORT "
          "saying authentication failed",
          k, type);
    close(b);
    printf("squatters A and B (%s) sent their claims\n", squat_peer);
}

static int mode_wrongsecret(void)
{
    pid_t pids[3];
    int st[3];
    int64_t t0 = now_ms();
    pids[0] = start_rank(0, 3, SECRET);
    pids[1] = start_rank(1, 3, SECRET);
    pids[2] = start_rank(2, 3, SECRET "-but-another");
    wait_ranks(pids, 3, st, BTMO_MS + 8000);
    int64_t took = now_ms() - t0;
    char e[3][600];
    for (int r = 0; r < 3; r++) {
        slurp("err", r, e[r], sizeof(e[r]));
        CHECK(st[r] == 1, "rank %d exited %d (%s), want a failure", r, st[r],
              e[r]);
        fprintf(stderr, "rank %d: %s", r, e[r]);
    }
    CHECK(strstr(e[2], "authentication failed"),
          "rank 2 does not say authentication failed: %s", e[2]);
    CHECK(strstr(e[0], "rank 2 of 3"), "rank 0 does not name rank 2: %s",
          e[0]);
    CHECK(strstr(e[0], "failed authentication") ||
              strstr(e[0], "did not accept the root's proof"),
          "rank 0 does not mention the failed authentication: %s", e[0]);
    CHECK(strstr(e[1], "rank 2"), "rank 1 does not name rank 2: %s", e[1]);
    CHECK(took <= BTMO_MS + 4000, "the failure took %lld ms",
          (long long)took);
    return fr_test_result();
}

static int mode_fakeroot(void)
{
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(lfd, 16) != 0) {
        perror("fake root");
        return 2;
    }
    pid_t pids[3] = {0, 0, 0};
    int st[3];
    pids[1] = start_rank(1, 3, SECRET);
    pids[2] = start_rank(2, 3, SECRET);
    for (int c = 0; c < 2; c++) {
        struct pollfd p = {.fd = lfd, .events = POLLIN};
        CHECK(poll(&p, 1, 5000) == 1, "no rank connected to the fake root");
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0)
            break;
        /* A challenge that looks right; then a proof made up. */
        unsigned char ch[40] = {0};
        uint32_t mv[2] = {0x46524259u, 3};
        memcpy(ch, mv, 8);
        send_frame(fd, 0x109, ch, sizeof(ch));
        unsigned char got[4096];
        size_t k = read_for(fd, got, 40, 3000);
        uint32_t h[2] = {0, 0};
        memcpy(h, got, k >= 8 ? 8 : 0);
        CHECK(k == 40 && h[0] == 0x10A && h[1] == 32,
              "connection %d: %zu bytes of frame 0x%x before the proof, "
              "want only a nonce", c, k, h[0]);
        unsigned char proof[32];
        memset(proof, 0x5a, sizeof(proof));
        send_frame(fd, 0x10B, proof, sizeof(proof));
        /* Nothing but an AUTH_FAIL notice may follow, then the close. */
        k = read_for(fd, got, sizeof(got), 3000);
        memcpy(h, got, k >= 8 ? 8 : 0);
        CHECK(k == 0 || (k == 8 && h[0] == 0x10C && h[1] == 0),
              "connection %d: the rank sent %zu more bytes (frame 0x%x) to "
              "a root that failed its proof",
              c, k, h[0]);
        close(fd);
    }
    wait_ranks(pids, 3, st, BTMO_MS + 5000);
    for (int r = 1; r < 3; r++) {
        char e[600];
        slurp("err", r, e, sizeof(e));
        CHECK(st[r] == 1 && strstr(e, "authentication failed"),
              "rank %d exited %d: %s", r, st[r], e);
        fprintf(stderr, "rank %d: %s", r, e);
    }
    close(lfd);
    return fr_test_result();
}

static int mode_keyfile(void)
{
    pid_t pids[3];
    int st[3];
    for (int r = 0; r < 3; r++)
        pids[r] = start_rank(r, 3, NULL);
    wait_ranks(pids, 3, st, 20000);
    for (int r = 0; r < 3; r++) {
        char e[600];
        slurp("err", r, e, sizeof(e));
        CHECK(st[r] == 0, "rank %d exited %d: %s", r, st[r], e);
    }
    char path[512];
    const char *x = getenv("XDG_RUNTIME_DIR");
    if (x && x[0] == '/')
        snprintf(path, sizeof(path), "%s/ferry/ferry-%u-127.0.0.1-%d.key", x,
                 (unsigned)geteuid(), port);
    else
        snprintf(path, sizeof(path), "/tmp/ferry-%u/ferry-%u-127.0.0.1-%d.key",
                 (unsigned)geteuid(), (unsigned)geteuid(), port);
    CHECK(access(path, F_OK) != 0, "key file %s left behind", path);
    return fr_test_result();
}

static int mode_loopback(void)
{
    struct ifaddrs *ifs = NULL, *i;
    char other[INET_ADDRSTRLEN] = "";
    getifaddrs(&ifs);
    for (i = ifs; i && !other[0]; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET) {
            struct sockaddr_in *s = (struct sockaddr_in *)i->ifa_addr;
            if ((ntohl(s->sin_addr.s_addr) >> 24) != 127)
                inet_ntop(AF_INET, &s->sin_addr, other, sizeof(other));
        }
    freeifaddrs(ifs);
    if (!other[0]) {
        printf("skipped: no non-loopback IPv4 address on this machine\n");
        return 77;
    }
    pid_t pids[2];
    int st[2];
    pids[0] = start_rank(0, 2, SECRET);
    int fd = dial_wait(5000);
    CHECK(fd >= 0, "root never listened on loopback");
    if (fd >= 0)
        close(fd);
    fd = dial(other, port);
    CHECK(fd < 0, "the root (FERRY_ROOT=127.0.0.1) accepted a connection on "
                  "%s:%d", other, port);
    if (fd >= 0)
        close(fd);
    printf("connect via %s:%d: %s\n", other, port,
           fd < 0 ? strerror(errno) : "accepted");
    pids[1] = start_rank(1, 2, SECRET);
    wait_ranks(pids, 2, st, 20000);
    CHECK(st[0] == 0 && st[1] == 0, "ranks exited %d %d", st[0], st[1]);
    return fr_test_result();
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    signal(SIGPIPE, SIG_IGN);
    if (!mkdtemp(logdir)) {
        perror("mkdtemp");
        return 2;
    }
    port = free_port();
    char v[32];
    snprintf(v, sizeof(v), "%d", BTMO_MS);
    setenv("FERRY_BOOTSTRAP_TIMEOUT_MS", v, 0);
    setenv("FERRY_TIMEOUT_MS", "5000", 0);
    int rc = 0;
    if (!strcmp(mode, "flood")) {
        job_ok(4, open_idle, 2500);
    } else if (!strcmp(mode, "evict")) {
        setenv("FERRY_BOOTSTRAP_TIMEOUT_MS", "8000", 1);
        job_ok(4, start_evict_flood, 15000);
        kill(flood_pid, SIGKILL);
        waitpid(flood_pid, NULL, 0);
        char log[16384];
        slurp("log", 0, log, sizeof(log));
        CHECK(strstr(log, "connections pending") != NULL,
              "the flood never filled the root's table:\n%s", log);
    } else if (!strcmp(mode, "slowloris")) {
        job_ok(4, start_slowloris, 2000);
        kill(slow_pid, SIGKILL);
        waitpid(slow_pid, NULL, 0);
    } else if (!strcmp(mode, "garbage")) {
        job_ok(3, send_garbage, 2500);
    } else if (!strcmp(mode, "squat")) {
        job_ok(3, squat, 4000);
        char log[16384];
        slurp("log", 0, log, sizeof(log));
        CHECK(strstr(log, "authentication failed") && squat_peer[0] &&
                  strstr(log, squat_peer),
              "rank 0 logged no WARN naming the forger %s:\n%s", squat_peer,
              log);
        CHECK(strstr(log, SECRET) == NULL, "the log shows the secret");
    } else if (!strcmp(mode, "wrongsecret")) {
        rc = mode_wrongsecret();
    } else if (!strcmp(mode, "fakeroot")) {
        rc = mode_fakeroot();
    } else if (!strcmp(mode, "keyfile")) {
        rc = mode_keyfile();
    } else if (!strcmp(mode, "loopback")) {
        rc = mode_loopback();
    } else {
        fprintf(stderr, "usage: %s flood|evict|slowloris|garbage|squat|"
                        "wrongsecret|fakeroot|keyfile|loopback\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < nheld; i++)
        close(held[i]);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", logdir);
    (void)!system(cmd);
    if (rc == 77)
        return 77;
    printf("test_attack %s: %s\n", mode, fr_test_result() ? "FAIL" : "pass");
    return fr_test_result();
}
