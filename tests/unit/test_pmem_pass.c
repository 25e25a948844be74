/*
 * The vmm exchange of GPU peer memory (ep/pmem.h) against other local
 * processes, on CPU ranks: two forked ranks pass each other a memfd
 * holding "rank i" through fr_pmem_pass, with a stand-in for the CUDA
 * import that reads it. A stranger (this process, or a child turned into
 * user nobody when run as root) meddles first. One mode per run:
 *
 *   ok          nobody meddles
 *   no_fd       a connection claims rank 1 and sends no descriptor
 *   no_fd_ns    the same while rank 1 is in another pid namespace (so its
 *               pid cannot be checked and the message is read)
 *   idle        a connection that sends nothing (rank 1 in another pid
 *               namespace)
 *   idle_late   three such, and rank 1 sends only after 2 s: each is
 *               closed after its read time (1 s), not held to the timeout
 *   other_pid   a descriptor claiming rank 1 from another pid
 *   other_uid   a descriptor claiming rank 1 from user nobody (root only)
 *   two_fds     messages with two and with sixteen descriptors (rank 1 in
 *               another pid namespace): refused, none left open
 *   crowd       all of the above at once, before rank 1 sends
 *   squat       the names the listener used to take (pid, pid namespace,
 *               counter) bound by a stranger first
 *   listener_pid, listener_uid (root only)
 *               rank 1's announced name held by a stranger of another
 *               pid or uid: the sender must not pass its descriptor
 *
 * A stranger must not fail the exchange: it succeeds, quickly, taking
 * rank 1's own descriptor and leaving no descriptor open.
 */
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry.h"
#include "harness.h"
#include "ep/pmem.h"
#include "runtime/rt.h"

#define TMO 4000L    /* the exchange's timeout (ms) */
#define NOBODY 65534 /* the stranger of another uid */

typedef struct result {
    int rc;
    long ms;
    int fds_before, fds_after;
    char msg[FR_ERRMSG_LEN];
} result_t;

static int g_peer; /* the rank whose descriptor the stand-in expects */

static long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static int memfd_text(const char *text)
{
    int f = memfd_create("pmem-test", MFD_CLOEXEC);
    if (f >= 0 && write(f, text, strlen(text) + 1) != (ssize_t)strlen(text) + 1) {
        close(f);
        f = -1;
    }
    return f;
}

/* The import's stand-in: the descriptor must hold "rank <peer>". */
static int take(int kind, int device, const uint8_t *blob, int fd, size_t size, fr_pmem_t *m,
                fr_err_t *err)
{
    (void)device, (void)blob;
    char got[32] = "", want[32];
    snprintf(want, sizeof(want), "rank %d", g_peer);
    ssize_t n = pread(fd, got, sizeof(got) - 1, 0);
    close(fd);
    memset(m, 0, sizeof(*m));
    if (n <= 0 || strcmp(got, want) != 0)
        return FR_ERR(err, FERRY_ERR_PROTOCOL, "took a descriptor holding \"%s\", not \"%s\"",
                      got, want);
    m->kind = kind;
    m->own = -1;
    m->size = size;
    return FERRY_OK;
}

/* A rank: listens, announces itself to the test (c), takes the table of
 * announcements, and on 'g' runs the exchange and reports it. */
static int rank_main(int rank, int c, long tmo)
{
    fr_err_t err;
    fr_fdx_t x = {-1, ""};
    fr_pmem_msg_t m, all[2];
    memset(&m, 0, sizeof(m));
    m.kind = FR_PMEM_VMM;
    m.size = 4096;
    m.pid = (long)getpid();
    m.pidns = fr_pidns();
    char go;
    if (read(c, &go, 1) != 1) /* the squat mode binds names first */
        return 2;
    m.status = fr_pmem_listen(&x, &m, 1, &err);
    if (m.status != FERRY_OK)
        snprintf(m.sock, sizeof(m.sock), "%.47s", err.msg);
    if (write(c, &m, sizeof(m)) != sizeof(m) || m.status != FERRY_OK)
        return 3;
    if (read(c, all, sizeof(all)) != sizeof(all) || read(c, &go, 1) != 1)
        return 4;
    if (go != 'g') {
        fr_fdx_close(&x);
        return 0;
    }
    char text[32];
    snprintf(text, sizeof(text), "rank %d", rank);
    int fd = memfd_text(text);
    int path[2] = {FR_PATH_SHM, FR_PATH_SHM};
    path[rank] = FR_PATH_SELF;
    struct ferry_ep ep;
    memset(&ep, 0, sizeof(ep));
    ep.N = 2;
    ep.rank = rank;
    ep.timeout_ms = tmo;
    ep.path = path;
    fr_pmem_t peers[2];
    memset(peers, 0, sizeof(peers));
    fr_pmem_pass_t p = {&x, fd, all, 0, 2, 0, take};
    g_peer = 1 - rank;
    result_t r;
    memset(&r, 0, sizeof(r));
    r.fds_before = count_fds();
    long t0 = now_ms();
    r.rc = fr_pmem_pass(&ep, &p, peers, &err);
    r.ms = now_ms() - t0;
    r.fds_after = count_fds();
    if (r.rc != FERRY_OK)
        snprintf(r.msg, sizeof(r.msg), "%s", err.msg);
    close(fd);
    fr_fdx_close(&x);
    return write(c, &r, sizeof(r)) == sizeof(r) ? 0 : 5;
}

typedef struct rank_proc {
    pid_t pid;
    int c;
} rank_proc_t;

static rank_proc_t start_rank(int rank, long tmo)
{
    int sv[2];
    rank_proc_t p = {-1, -1};
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return p;
    p.pid = fork();
    if (p.pid == 0) {
        close(sv[0]);
        _exit(rank_main(rank, sv[1], tmo));
    }
    close(sv[1]);
    p.c = sv[0];
    return p;
}

static int end_rank(rank_proc_t *p)
{
    int st = 0;
    close(p->c);
    waitpid(p->pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static socklen_t addr_of(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    size_t n = strlen(name);
    memcpy(a->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* A stranger's connection to @name (retried while the backlog is full). */
static int stranger_connect(const char *name)
{
    struct sockaddr_un a;
    socklen_t len = addr_of(&a, name);
    long end = now_ms() + TMO + 500;
    for (;;) {
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (s < 0)
            return -1;
        if (connect(s, (struct sockaddr *)&a, len) == 0)
            return s;
        int e = errno;
        close(s);
        if (e != EAGAIN || now_ms() > end)
            return -1;
        usleep(1000);
    }
}

/* The tag 1 and nfd descriptors of "stranger" on connection s: 0 sent,
 * 1 refused by a receiver that closed the connection already, -1 not
 * sent. */
static int stranger_send(int s, int nfd)
{
    int tag = 1, fds[16];
    char cbuf[CMSG_SPACE(sizeof(fds))];
    struct iovec iov = {&tag, sizeof(tag)};
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    memset(cbuf, 0, sizeof(cbuf));
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    for (int i = 0; i < nfd; i++)
        fds[i] = memfd_text("stranger");
    if (nfd > 0) {
        m.msg_control = cbuf;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfd);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfd);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfd);
    }
    ssize_t n = sendmsg(s, &m, MSG_NOSIGNAL);
    int e = errno;
    for (int i = 0; i < nfd; i++)
        close(fds[i]);
    return n == sizeof(tag) ? 0 : n < 0 && (e == EPIPE || e == ECONNRESET) ? 1 : -1;
}

/* Become user nobody (a child's first step). */
static int become_nobody(void)
{
    return setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0 ? 0 : -1;
}

/* A descriptor claiming rank 1 sent to @name by user nobody. */
static int stranger_other_uid(const char *name)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (become_nobody() != 0)
            _exit(2);
        int s = stranger_connect(name);
        _exit(s < 0 ? 3 : stranger_send(s, 1) < 0 ? 4 : 0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* Connections this process holds to the end of a case. */
static int held[16], nheld;

static void hold(int s)
{
    CHECK(s >= 0, "a stranger's connection failed");
    if (s >= 0 && nheld < 16)
        held[nheld++] = s;
}

/* What the stranger does to rank 0's @name before rank 1 sends. */
static void meddle(const char *mode, const char *name)
{
    int crowd = !strcmp(mode, "crowd");
    int s;
    int idle = crowd || !strcmp(mode, "idle_late") ? 3 : !strcmp(mode, "idle");
    for (int i = 0; i < idle; i++)
        hold(stranger_connect(name));
    if (crowd || !strncmp(mode, "no_fd", 5)) {
        hold(s = stranger_connect(name));
        CHECK(s < 0 || stranger_send(s, 0) >= 0, "sending a tag alone");
    }
    if (!strcmp(mode, "other_pid")) {
        hold(s = stranger_connect(name));
        CHECK(s < 0 || stranger_send(s, 1) >= 0, "sending a descriptor");
    }
    if (crowd || !strcmp(mode, "two_fds")) {
        hold(s = stranger_connect(name));
        CHECK(s < 0 || stranger_send(s, 2) >= 0, "sending two descriptors");
        hold(s = stranger_connect(name));
        CHECK(s < 0 || stranger_send(s, 16) >= 0, "sending sixteen descriptors");
    }
    if ((crowd && geteuid() == 0) || !strcmp(mode, "other_uid"))
        CHECK(stranger_other_uid(name) == 0, "user nobody's descriptor was not sent");
}

/* The stranger's connections all closed by the other end. */
static int held_closed(void)
{
    char b;
    for (int i = 0; i < nheld; i++)
        if (recv(held[i], &b, 1, MSG_DONTWAIT) != 0)
            return 0;
    return 1;
}

static void check_result(const char *who, const result_t *r, long within)
{
    CHECK(r->rc == FERRY_OK, "%s: the exchange failed (%s): %s", who, ferry_strerror(r->rc),
          r->msg);
    CHECK(r->ms < within, "%s: the exchange took %ld ms of its %ld", who, r->ms, TMO);
    CHECK(r->fds_after == r->fds_before, "%s: %d descriptors open before, %d after", who,
          r->fds_before, r->fds_after);
}

/* Two ranks exchange while the stranger meddles with rank 0's listener. */
static int run_exchange(const char *mode)
{
    rank_proc_t rk[2] = {start_rank(0, TMO), start_rank(1, TMO)};
    fr_pmem_msg_t m[2], all[2];
    for (int i = 0; i < 2; i++)
        CHECK(write(rk[i].c, "l", 1) == 1 && read(rk[i].c, &m[i], sizeof(m[i])) == sizeof(m[i]),
              "rank %d did not listen", i);
    /* rank 1 "in another pid namespace" for rank 0: its pid unchecked */
    memcpy(all, m, sizeof(all));
    int late = !strcmp(mode, "idle_late");
    if (!strcmp(mode, "no_fd_ns") || !strcmp(mode, "idle") || late ||
        !strcmp(mode, "two_fds") || !strcmp(mode, "crowd") || !strcmp(mode, "other_uid"))
        all[1].pidns ^= 1;
    CHECK(write(rk[0].c, all, sizeof(all)) == sizeof(all), "table to rank 0");
    CHECK(write(rk[1].c, m, sizeof(m)) == sizeof(m), "table to rank 1");
    CHECK(write(rk[0].c, "g", 1) == 1, "go 0"); /* sends, then takes */
    meddle(mode, m[0].sock);
    if (late) {
        usleep((FR_FDX_READ_MS + 1000) * 1000);
        CHECK(held_closed(), "rank 0 still holds connections that sent nothing for %d ms",
              FR_FDX_READ_MS + 1000);
    }
    CHECK(write(rk[1].c, "g", 1) == 1, "go 1");
    result_t r[2];
    for (int i = 0; i < 2; i++) {
        CHECK(read(rk[i].c, &r[i], sizeof(r[i])) == sizeof(r[i]), "rank %d's result", i);
        CHECK(end_rank(&rk[i]) == 0, "rank %d's exit", i);
    }
    check_result("rank 0", &r[0], late ? TMO * 3 / 4 : TMO / 2);
    check_result("rank 1", &r[1], TMO);
    while (nheld > 0)
        close(held[--nheld]);
    if (fr_test_result() == 0)
        printf("%s: rank 0 took rank 1's descriptor in %ld ms (timeout %ld), no descriptor "
               "left open\n", mode, r[0].ms, TMO);
    return fr_test_result();
}

/* A stranger binds the names a rank's listener used to take before the
 * rank listens: the rank still listens. */
static int run_squat(void)
{
    rank_proc_t rk = start_rank(0, TMO);
    fr_fdx_t sq[8];
    fr_err_t err;
    for (int k = 0; k < 8; k++) {
        char name[64];
        snprintf(name, sizeof(name), "ferry-pm-%ld-%llx-%d", (long)rk.pid,
                 (unsigned long long)fr_pidns(), k);
        CHECK_RC(fr_fdx_listen(&sq[k], name, 1, &err), FERRY_OK);
    }
    fr_pmem_msg_t m;
    CHECK(write(rk.c, "l", 1) == 1, "go");
    ssize_t n = read(rk.c, &m, sizeof(m));
    CHECK(n == sizeof(m) && m.status == FERRY_OK, "the rank could not listen: %s",
          n == sizeof(m) ? m.sock : "(no answer)");
    if (n == sizeof(m) && m.status == FERRY_OK) {
        fr_pmem_msg_t all[2] = {m, m};
        CHECK(write(rk.c, all, sizeof(all)) == sizeof(all) && write(rk.c, "q", 1) == 1, "quit");
    }
    end_rank(&rk);
    for (int k = 0; k < 8; k++)
        fr_fdx_close(&sq[k]);
    if (fr_test_result() == 0)
        printf("squat: the 8 names of pid, pid namespace and counter taken first; the rank "
               "listened on @%s\n", m.sock);
    return fr_test_result();
}

/* Descriptors that reached listener lfd (its connections read). */
static int drain(int lfd)
{
    int got = 0, s;
    while ((s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
        int tag;
        char cbuf[CMSG_SPACE(sizeof(int) * 4)];
        struct iovec iov = {&tag, sizeof(tag)};
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
        if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC) > 0)
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                    int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                    for (int i = 0; i < k; i++) {
                        int f;
                        memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                        close(f);
                    }
                    got += k;
                }
        close(s);
    }
    return got;
}

/* Rank 1's announced name held by a stranger (this process, or user
 * nobody): rank 0 must not send it its descriptor. */
static int run_listener(int other_uid)
{
    char name[40];
    snprintf(name, sizeof(name), "ferry-test-pm-squat-%ld", (long)getpid());
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
    pid_t who = getpid(), sp = -1;
    fr_err_t err;
    fr_fdx_t sq = {-1, ""};
    if (other_uid) { /* the listener: user nobody, reporting what reached it */
        sp = fork();
        if (sp == 0) {
            close(sv[0]);
            char c = 0;
            int got = -1;
            if (become_nobody() == 0 && fr_fdx_listen(&sq, name, 4, &err) == FERRY_OK &&
                write(sv[1], "l", 1) == 1 && read(sv[1], &c, 1) == 1)
                got = drain(sq.lfd);
            _exit(write(sv[1], &got, sizeof(got)) == sizeof(got) ? 0 : 1);
        }
        who = sp;
        char c;
        CHECK(read(sv[0], &c, 1) == 1, "user nobody did not listen");
    } else {
        CHECK_RC(fr_fdx_listen(&sq, name, 4, &err), FERRY_OK);
    }
    rank_proc_t rk[2] = {start_rank(0, 1000), start_rank(1, 1000)};
    fr_pmem_msg_t m[2];
    for (int i = 0; i < 2; i++)
        CHECK(write(rk[i].c, "l", 1) == 1 && read(rk[i].c, &m[i], sizeof(m[i])) == sizeof(m[i]),
              "rank %d did not listen", i);
    fr_pmem_msg_t all[2] = {m[0], m[1]};
    snprintf(all[1].sock, sizeof(all[1].sock), "%s", name);
    if (other_uid)
        all[1].pid = (long)sp; /* only the uid differs */
    CHECK(write(rk[0].c, all, sizeof(all)) == sizeof(all) && write(rk[0].c, "g", 1) == 1,
          "go 0");
    CHECK(write(rk[1].c, m, sizeof(m)) == sizeof(m) && write(rk[1].c, "q", 1) == 1, "quit 1");
    result_t r;
    CHECK(read(rk[0].c, &r, sizeof(r)) == sizeof(r), "rank 0's result");
    for (int i = 0; i < 2; i++)
        CHECK(end_rank(&rk[i]) == 0, "rank %d's exit", i);
    int got = -1;
    if (other_uid) {
        CHECK(write(sv[0], "d", 1) == 1 && read(sv[0], &got, sizeof(got)) == sizeof(got),
              "user nobody's report");
        waitpid(sp, NULL, 0);
    } else {
        got = drain(sq.lfd);
        fr_fdx_close(&sq);
    }
    close(sv[0]);
    close(sv[1]);
    CHECK(got == 0, "the stranger (pid %ld) received %d descriptors", (long)who, got);
    CHECK(r.rc != FERRY_OK && strstr(r.msg, "rank 1"), "rank 0: %s: %s", ferry_strerror(r.rc),
          r.msg);
    if (fr_test_result() == 0)
        printf("listener_%s: the stranger received nothing; rank 0: %s\n",
               other_uid ? "uid" : "pid", r.msg);
    return fr_test_result();
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "ok";
    setvbuf(stdout, NULL, _IONBF, 0);
    if ((!strcmp(mode, "other_uid") || !strcmp(mode, "listener_uid")) && geteuid() != 0) {
        printf("%s needs root (a stranger of another uid is a child that becomes user "
               "nobody)\n", mode);
        return 77;
    }
    if (!strcmp(mode, "squat"))
        return run_squat();
    if (!strcmp(mode, "listener_pid") || !strcmp(mode, "listener_uid"))
        return run_listener(!strcmp(mode, "listener_uid"));
    const char *modes[] = {"ok",        "no_fd",     "no_fd_ns", "idle", "idle_late",
                           "other_pid", "other_uid", "two_fds",  "crowd"};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
        if (!strcmp(mode, modes[i]))
            return run_exchange(mode);
    fprintf(stderr, "mode: unknown \"%s\"\n", mode);
    return 2;
}
