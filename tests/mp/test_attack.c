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
 *   test_attack twojobs      two jobs, no FERRY_SECRET, one port, started
 *                            at once by two launchers (three times): they
 *                            never mix; each runs whole or fails on every
 *                            rank naming the port
 *   test_attack keydir       the key folder made first by someone else (open
 *                            to all, a link, a file, another user's): the
 *                            job falls back to the next private place;
 *                            with none, every rank fails at once saying so
 *   test_attack loopback     FERRY_ROOT=127.0.0.1: the root cannot be
 *                            reached through another local address (exit
 *                            77 when the machine has none)
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <sys/stat.h>
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

#include "bootstrap/boot_int.h"
#include "boot_ranks.h"
#include "harness.h"

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
    uint32_t hi[6] = {FR_BOOT_MAGIC, FR_BOOT_WIRE_VERSION, 1, 3, 4242, 0};
    send_frame(fd, 0x101, hi, sizeof(hi));
    held[nheld++] = fd;
}

static char squat_peer[64];
static void squat(void)
{
    /* A: an old-style hello claiming rank 1 at once. */
    int a = dial_wait(5000);
    CHECK(a >= 0, "root never listened");
    uint32_t hi[6] = {FR_BOOT_MAGIC, 1, 1, 3, 4242, 0};
    send_frame(a, 0x101, hi, sizeof(hi));
    held[nheld++] = a;
    /* B: the handshake, with a forged MAC, claiming rank 1. */
    int b = dial(NULL, port);
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    getsockname(b, (struct sockaddr *)&me, &ml);
    snprintf(squat_peer, sizeof(squat_peer), "127.0.0.1:%u",
             (unsigned)ntohs(me.sin_port));
    unsigned char ch[8 + sizeof(fr_challenge_t)], nonce[32] = {1, 2, 3},
        proof[40];
    if (read_for(b, ch, sizeof(ch), 1000) == sizeof(ch)) {
        send_frame(b, 0x10A, nonce, sizeof(nonce));
        (void)read_for(b, proof, sizeof(proof), 1000);
    }
    uint32_t hello[6 + 8] = {FR_BOOT_MAGIC, FR_BOOT_WIRE_VERSION, 1, 3,
                              4243, 0};
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
        unsigned char ch[sizeof(fr_challenge_t)] = {0};
        uint32_t mv[2] = {FR_BOOT_MAGIC, FR_BOOT_WIRE_VERSION};
        memcpy(ch, mv, 8); /* the key from FERRY_SECRET, as the ranks' */
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

/* Key files of the test's port left in folder dir. */
static int key_files_left(const char *dir)
{
    char pre[96];
    snprintf(pre, sizeof(pre), "ferry-%u-127.0.0.1-%d-", (unsigned)geteuid(),
             port);
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strncmp(e->d_name, pre, strlen(pre)) == 0;
    if (d)
        closedir(d);
    return n;
}

/* The key folder a job with this environment uses by default. */
static void default_key_dir(char *dir, size_t cap)
{
    const char *x = getenv("XDG_RUNTIME_DIR"), *t = getenv("TMPDIR");
    if (x && x[0] == '/')
        snprintf(dir, cap, "%s/ferry", x);
    else
        snprintf(dir, cap, "%s/ferry-%u", t && t[0] == '/' ? t : "/tmp",
                 (unsigned)geteuid());
}

/* A job of n ranks without FERRY_SECRET; st: exit statuses, e: messages. */
static void keyfile_job(int n, int *st, char (*e)[700])
{
    pid_t pids[8];
    for (int r = 0; r < n; r++)
        pids[r] = start_rank(r, n, NULL);
    wait_ranks(pids, n, st, 20000);
    for (int r = 0; r < n; r++)
        slurp("err", r, e[r], sizeof(e[r]));
}

static int mode_keyfile(void)
{
    int st[3];
    char e[3][700], dir[300];
    keyfile_job(3, st, e);
    for (int r = 0; r < 3; r++)
        CHECK(st[r] == 0, "rank %d exited %d: %s", r, st[r], e[r]);
    default_key_dir(dir, sizeof(dir));
    CHECK(key_files_left(dir) == 0, "a key file of port %d left in %s", port,
          dir);
    return fr_test_result();
}

/* Two jobs of 4 ranks, no FERRY_SECRET, one port, started at once, each by
 * its own launcher (a process that forks its ranks), twice over: they
 * never mix. Each job either runs whole, or fails on every rank (one of
 * them naming the port), and no rank gets another job's block. */
static int mode_twojobs(void)
{
    char base[64];
    snprintf(base, sizeof(base), "%s", logdir);
    for (int iter = 0; iter < 3; iter++) {
        pid_t launch[2];
        for (int j = 0; j < 2; j++) {
            fflush(stdout);
            launch[j] = fork();
            if (launch[j] != 0)
                continue;
            snprintf(logdir, sizeof(logdir), "%.50s/j%d", base, j);
            mkdir(logdir, 0700);
            job_tag = j + 1;
            pid_t pids[4];
            int st[4];
            for (int r = 0; r < 4; r++)
                pids[r] = start_rank(r, 4, NULL);
            wait_ranks(pids, 4, st, 20000);
            char path[128];
            snprintf(path, sizeof(path), "%s/status", logdir);
            FILE *f = fopen(path, "w");
            for (int r = 0; f && r < 4; r++)
                fprintf(f, "%d\n", st[r]);
            if (f)
                fclose(f);
            _exit(0);
        }
        for (int j = 0; j < 2; j++)
            waitpid(launch[j], NULL, 0);
        int ok_jobs = 0;
        for (int j = 0; j < 2; j++) {
            snprintf(logdir, sizeof(logdir), "%.50s/j%d", base, j);
            int st[4] = {-1, -1, -1, -1}, nok = 0, named = 0;
            char path[128], e[700];
            snprintf(path, sizeof(path), "%s/status", logdir);
            FILE *f = fopen(path, "r");
            for (int r = 0; f && r < 4; r++)
                if (fscanf(f, "%d", &st[r]) != 1)
                    st[r] = -1;
            if (f)
                fclose(f);
            char ps[16];
            snprintf(ps, sizeof(ps), ":%d", port);
            for (int r = 0; r < 4; r++) {
                slurp("err", r, e, sizeof(e));
                printf("round %d job %d rank %d: %d %s", iter, j, r, st[r],
                       e);
                CHECK(strstr(e, "WRONG DATA") == NULL,
                      "job %d rank %d got another job's data: %s", j, r, e);
                CHECK(st[r] == 0 || st[r] == 1, "job %d rank %d exited %d",
                      j, r, st[r]);
                nok += st[r] == 0;
                named += st[r] == 1 && strstr(e, ps) != NULL;
            }
            CHECK(nok == 0 || nok == 4, "round %d: job %d ran on %d of its "
                                        "4 ranks",
                  iter, j, nok);
            CHECK(nok == 4 || named > 0, "round %d: job %d failed without "
                                         "naming port %d",
                  iter, j, port);
            ok_jobs += nok == 4;
        }
        CHECK(ok_jobs >= 1, "round %d: neither job ran", iter);
        snprintf(logdir, sizeof(logdir), "%s", base);
    }
    return fr_test_result();
}

/* Key folders another user could have made first, or that are unusable:
 * the job falls back to the next private place (with a warning naming the
 * bad one), and when there is none every rank fails at once saying why. */
static int mode_keydir(void)
{
    char x[128], t[128], h[128], bad[300], cmd[700], dir[300];
    int st[3];
    char e[3][700];
    snprintf(x, sizeof(x), "%s/xdg", logdir);
    snprintf(t, sizeof(t), "%s/tmp", logdir);
    snprintf(h, sizeof(h), "%s/home", logdir);
    mkdir(x, 0700);
    mkdir(t, 0700);
    mkdir(h, 0700);
    setenv("TMPDIR", t, 1);
    setenv("HOME", h, 1);
    unsetenv("FERRY_KEY_DIR");
    /* The first place ($XDG_RUNTIME_DIR/ferry) open to everyone. */
    setenv("XDG_RUNTIME_DIR", x, 1);
    snprintf(bad, sizeof(bad), "%s/ferry", x);
    mkdir(bad, 0700);
    chmod(bad, 0777);
    keyfile_job(3, st, e);
    for (int r = 0; r < 3; r++)
        CHECK(st[r] == 0, "xdg 0777: rank %d exited %d: %s", r, st[r], e[r]);
    char log[16384];
    slurp("log", 0, log, sizeof(log));
    CHECK(strstr(log, bad) && strstr(log, "not usable"),
          "rank 0 did not warn about %s:\n%s", bad, log);
    /* $TMPDIR/ferry-<uid> made by someone else, in each shape. */
    unsetenv("XDG_RUNTIME_DIR");
    default_key_dir(bad, sizeof(bad));
    const char *shapes[] = {"a folder open to all", "a symbolic link",
                            "a file", "a folder of another user"};
    for (int k = 0; k < 4; k++) {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", bad);
        (void)!system(cmd);
        if (k == 0) {
            mkdir(bad, 0700);
            chmod(bad, 0777);
        } else if (k == 1) {
            (void)!symlink(x, bad);
        } else if (k == 2) {
            close(open(bad, O_WRONLY | O_CREAT, 0600));
        } else {
            if (geteuid() != 0) {
                printf("(not root: no folder of another user made)\n");
                continue;
            }
            mkdir(bad, 0700);
            CHECK(chown(bad, 65534, 65534) == 0, "chown: %s",
                  strerror(errno));
        }
        keyfile_job(3, st, e);
        for (int r = 0; r < 3; r++)
            CHECK(st[r] == 0, "%s: rank %d exited %d: %s", shapes[k], r,
                  st[r], e[r]);
        snprintf(dir, sizeof(dir), "%s/.ferry", h);
        CHECK(key_files_left(dir) == 0, "%s: a key file left in %s",
              shapes[k], dir);
        printf("%s at %s: the job ran, key file in %s\n", shapes[k], bad,
               dir);
    }
    /* No usable place at all: every rank fails at once, saying why. */
    snprintf(cmd, sizeof(cmd), "rm -rf '%s' '%s/.ferry'", bad, h);
    (void)!system(cmd);
    mkdir(bad, 0700);
    chmod(bad, 0777);
    snprintf(dir, sizeof(dir), "%s/.ferry", h);
    close(open(dir, O_WRONLY | O_CREAT, 0600)); /* $HOME/.ferry: a file */
    int64_t t0 = now_ms();
    keyfile_job(3, st, e);
    int64_t took = now_ms() - t0;
    for (int r = 0; r < 3; r++)
        CHECK(st[r] == 1 && strstr(e[r], "no private folder") &&
                  strstr(e[r], bad),
              "no place: rank %d exited %d: %s", r, st[r], e[r]);
    CHECK(took < 2000, "no place: the ranks took %lld ms to fail",
          (long long)took);
    printf("no usable folder: every rank failed in %lld ms: %s",
           (long long)took, e[1]);
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
    } else if (!strcmp(mode, "twojobs")) {
        rc = mode_twojobs();
    } else if (!strcmp(mode, "keydir")) {
        rc = mode_keydir();
    } else if (!strcmp(mode, "loopback")) {
        rc = mode_loopback();
    } else {
        fprintf(stderr, "usage: %s flood|evict|slowloris|garbage|squat|"
                        "wrongsecret|fakeroot|keyfile|twojobs|keydir|loopback\n", argv[0]);
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
