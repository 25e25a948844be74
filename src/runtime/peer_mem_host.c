/* The parts of peer_mem.h that need no CUDA, built with or without it:
 * the kinds' names and file descriptors between processes of one host
 * (fr_fdx). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "core/log.h"
#include "runtime/peer_mem.h"
#include "runtime/rt.h"

const char *fr_pmem_name(int kind)
{
    switch (kind) {
    case FR_PMEM_LEGACY:
        return "legacy";
    case FR_PMEM_VMM:
        return "vmm";
    case FR_PMEM_FABRIC:
        return "fabric";
    default:
        return "none";
    }
}

static socklen_t fr_fdx_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof(a->sun_path) - 1)
        n = sizeof(a->sun_path) - 1;
    memcpy(a->sun_path + 1, name, n); /* abstract: sun_path[0] = 0 */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

int fr_fdx_listen(fr_fdx_t *x, const char *name, int backlog, fr_err_t *err)
{
    struct sockaddr_un a;
    snprintf(x->name, sizeof(x->name), "%s", name);
    socklen_t len = fr_fdx_addr(&a, x->name);
    x->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (x->lfd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket(AF_UNIX): %s", strerror(errno));
    /* room beside the peers' for strangers' connections, dropped as they
     * are accepted (fr_fdx_gather) */
    if (bind(x->lfd, (struct sockaddr *)&a, len) != 0 ||
        listen(x->lfd, backlog + FR_FDX_SLOTS) != 0) {
        int e = errno;
        close(x->lfd);
        x->lfd = -1;
        return FR_ERR(err, FERRY_ERR_SYSTEM, "Unix socket @%s: %s", x->name, strerror(e));
    }
    return FERRY_OK;
}

/* Whether the listener behind connected socket s is `to` (SO_PEERCRED
 * holds its credentials as of its listen): this process's uid, and in one
 * pid namespace the announced pid. */
static int fr_fdx_listener_is(int s, const fr_fdx_peer_t *to, fr_err_t *err)
{
    struct ucred cr;
    socklen_t cl = sizeof(cr);
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "SO_PEERCRED on a connection to @%s: %s", to->name,
                      strerror(errno));
    if (cr.uid == geteuid() && (to->pidns != fr_pidns() || (long)cr.pid == to->pid))
        return FERRY_OK;
    return FR_ERR(err, FERRY_ERR_PROTOCOL,
                  "@%s is held by pid %ld of uid %ld, not by pid %ld of uid %ld that announced "
                  "it (the descriptor was not sent)", to->name, (long)cr.pid, (long)cr.uid,
                  to->pid, (long)geteuid());
}

int fr_fdx_send(const fr_fdx_peer_t *to, int tag, int fd, long timeout_ms, fr_err_t *err)
{
    struct sockaddr_un a;
    socklen_t len = fr_fdx_addr(&a, to->name);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket(AF_UNIX): %s", strerror(errno));
    /* a full backlog answers EAGAIN at once: retried until the bound, so a
     * listener that never accepts cannot hold this rank forever */
    uint64_t end = fr_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (connect(s, (struct sockaddr *)&a, len) != 0) {
        int e = errno;
        if ((e == EAGAIN || e == EINTR) && fr_now_ns() < end) {
            usleep(200);
            continue;
        }
        close(s);
        return FR_ERR(err, e == EAGAIN ? FERRY_ERR_TIMEOUT : FERRY_ERR_SYSTEM,
                      "connect to @%s: %s (the peer is on another host, in another network "
                      "namespace, or not listening)", to->name, strerror(e));
    }
    int rc = fr_fdx_listener_is(s, to, err);
    if (rc != FERRY_OK) {
        close(s);
        return rc;
    }
    union {
        char b[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cbuf;
    memset(&cbuf, 0, sizeof(cbuf));
    struct iovec iov = {&tag, sizeof(tag)};
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.b;
    m.msg_controllen = sizeof(cbuf.b);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t n;
    for (;;) {
        n = sendmsg(s, &m, MSG_NOSIGNAL);
        if (n >= 0)
            break;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN && fr_now_ns() < end) {
            usleep(200);
            continue;
        }
        break;
    }
    int e = errno;
    close(s); /* what was sent stays queued for the peer's accept */
    if (n != (ssize_t)sizeof(tag))
        return FR_ERR(err, FERRY_ERR_SYSTEM, "sendmsg to @%s: %s", to->name,
                      n < 0 ? strerror(e) : "short write");
    return FERRY_OK;
}

/* One message of connection s: its tag, and in *fd its descriptor when it
 * carried exactly one and nothing else (-1 otherwise; every descriptor
 * that came is closed but the one returned). 0 when nothing is there yet,
 * 1 when the connection is done with. */
static int fr_fdx_read(int s, int *tag, int *fd)
{
    union {
        char b[CMSG_SPACE(sizeof(int) * FR_FDX_MAXFD)];
        struct cmsghdr align;
    } cbuf;
    struct iovec iov = {tag, sizeof(*tag)};
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = cbuf.b;
    m.msg_controllen = sizeof(cbuf.b);
    *fd = -1;
    ssize_t n = recvmsg(s, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    int nfd = 0;
    for (struct cmsghdr *c = n >= 0 ? CMSG_FIRSTHDR(&m) : NULL; c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
            c->cmsg_len < CMSG_LEN(0))
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++, nfd++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (nfd == 0)
                *fd = f;
            else
                close(f);
        }
    }
    /* more than the buffer held (MSG_CTRUNC: the kernel closed the rest),
     * several, or a short tag: not a peer's */
    if (*fd >= 0 && (n != (ssize_t)sizeof(*tag) || nfd != 1 || (m.msg_flags & MSG_CTRUNC))) {
        close(*fd);
        *fd = -1;
    }
    return 1;
}

/* The index of a peer still due that tag names, or -1. */
static int fr_fdx_due(const fr_fdx_peer_t *peers, int n, const char *got, int tag)
{
    for (int i = 0; i < n; i++)
        if (peers[i].tag == tag && !got[i])
            return i;
    return -1;
}

/* Whether a connection of `cr` may be a peer still due: this process's
 * uid, and a due peer's pid (or a due peer in another pid namespace). */
static int fr_fdx_welcome(const fr_fdx_peer_t *peers, int n, const char *got,
                          unsigned long long ns, const struct ucred *cr)
{
    if (cr->uid != geteuid())
        return 0;
    for (int i = 0; i < n; i++)
        if (!got[i] && (peers[i].pidns != ns || peers[i].pid == (long)cr->pid))
            return 1;
    return 0;
}

/* A gather's state: connections being read and the ones dropped. */
typedef struct fr_fdx_gath {
    const fr_fdx_t *x;
    const fr_fdx_peer_t *peers;
    int n, left;
    char *got;
    unsigned long long ns; /* this process's pid namespace */
    struct {
        int s;
        long pid;
        uint64_t end; /* read by then, or dropped */
    } c[FR_FDX_SLOTS];
    int nc;
    int dropped;
    char why[160]; /* the first dropped connection */
} fr_fdx_gath_t;

static void fr_fdx_drop(fr_fdx_gath_t *g, long pid, long uid, const char *what)
{
    if (g->dropped++ == 0) {
        snprintf(g->why, sizeof(g->why), "pid %ld uid %ld %s", pid, uid, what);
        FR_LOG_WARN(FR_SUB_INIT, "@%s: dropped a connection that is not a peer's (%s); "
                    "later ones are dropped silently", g->x->name, g->why);
    }
}

/* Accept what waits (a bounded number per call, so a flood of strangers
 * does not starve the connections being read), dropping at once who
 * cannot be a peer due. */
static int fr_fdx_accept(fr_fdx_gath_t *g, uint64_t now, uint64_t end, fr_err_t *err)
{
    for (int k = 0; k < 4 * FR_FDX_SLOTS && g->nc < FR_FDX_SLOTS; k++) {
        int s = accept4(g->x->lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (s < 0) {
            if (errno == ECONNABORTED || errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return FERRY_OK;
            return FR_ERR(err, FERRY_ERR_SYSTEM, "accept on @%s: %s", g->x->name,
                          strerror(errno));
        }
        struct ucred cr;
        socklen_t cl = sizeof(cr);
        if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
            fr_fdx_drop(g, -1, -1, "(SO_PEERCRED failed)");
            close(s);
        } else if (!fr_fdx_welcome(g->peers, g->n, g->got, g->ns, &cr)) {
            fr_fdx_drop(g, (long)cr.pid, (long)cr.uid, "is no peer this process waits for");
            close(s);
        } else {
            uint64_t e = now + FR_FDX_READ_MS * 1000000ull;
            g->c[g->nc].s = s;
            g->c[g->nc].pid = (long)cr.pid;
            g->c[g->nc].end = e < end ? e : end;
            g->nc++;
        }
    }
    return FERRY_OK;
}

/* Read connection j (ready or past its time): a peer's descriptor goes
 * to take, anything else is dropped. */
static void fr_fdx_serve(fr_fdx_gath_t *g, int j, int ready, uint64_t now, fr_fdx_take_fn take,
                         void *arg)
{
    int tag = -1, fd = -1;
    long pid = g->c[j].pid, uid = (long)geteuid();
    if (ready && !fr_fdx_read(g->c[j].s, &tag, &fd))
        ready = 0;
    if (!ready && now < g->c[j].end)
        return;
    close(g->c[j].s);
    g->c[j] = g->c[--g->nc];
    int i = fd >= 0 ? fr_fdx_due(g->peers, g->n, g->got, tag) : -1;
    if (!ready) {
        fr_fdx_drop(g, pid, uid, "sent nothing in time");
    } else if (fd < 0) {
        fr_fdx_drop(g, pid, uid, "sent no single file descriptor with its tag");
    } else if (i < 0 || (g->peers[i].pidns == g->ns && g->peers[i].pid != pid)) {
        close(fd);
        fr_fdx_drop(g, pid, uid, "sent a descriptor for a tag not due from it");
    } else {
        g->got[i] = 1;
        g->left--;
        take(arg, i, fd);
    }
}

int fr_fdx_gather(fr_fdx_t *x, const fr_fdx_peer_t *peers, int n, long timeout_ms,
                  fr_fdx_take_fn take, void *arg, fr_err_t *err)
{
    fr_fdx_gath_t g;
    memset(&g, 0, sizeof(g));
    g.x = x;
    g.peers = peers;
    g.n = g.left = n;
    g.ns = fr_pidns();
    g.got = (char *)calloc(n > 0 ? (size_t)n : 1, 1);
    if (!g.got)
        return FR_ERR(err, FERRY_ERR_NOMEM, "a table of %d peers", n);
    int rc = FERRY_OK;
    uint64_t end = fr_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (g.left > 0 && rc == FERRY_OK) {
        uint64_t now = fr_now_ns();
        if (now >= end)
            break;
        struct pollfd p[FR_FDX_SLOTS + 1];
        uint64_t wake = end;
        for (int j = 0; j < g.nc; j++) {
            p[j] = (struct pollfd){g.c[j].s, POLLIN, 0};
            wake = g.c[j].end < wake ? g.c[j].end : wake;
        }
        int np = g.nc;
        if (g.nc < FR_FDX_SLOTS) /* a full table takes no more until one frees */
            p[np++] = (struct pollfd){x->lfd, POLLIN, 0};
        uint64_t ms = (wake > now ? wake - now : 0) / 1000000ull + 1;
        int ready = poll(p, (nfds_t)np, ms > 100 ? 100 : (int)ms);
        now = fr_now_ns();
        for (int j = g.nc - 1; j >= 0 && g.left > 0; j--) /* j's slot may take the last's */
            fr_fdx_serve(&g, j, ready > 0 && p[j].revents != 0, now, take, arg);
        if (g.left > 0)
            rc = fr_fdx_accept(&g, now, end, err);
    }
    for (int j = 0; j < g.nc; j++)
        close(g.c[j].s);
    if (rc == FERRY_OK && g.left > 0) {
        int miss = 0;
        while (g.got[miss])
            miss++;
        char more[sizeof(g.why) + 64] = "";
        if (g.dropped)
            snprintf(more, sizeof(more), "; %d other connection%s dropped, the first: %s",
                     g.dropped, g.dropped == 1 ? "" : "s", g.why);
        rc = FR_ERR(err, FERRY_ERR_TIMEOUT, "no file descriptor of tag %d came to @%s within "
                    "%ld ms%s", peers[miss].tag, x->name, timeout_ms, more);
    }
    free(g.got);
    return rc;
}

void fr_fdx_close(fr_fdx_t *x)
{
    if (x->lfd >= 0)
        close(x->lfd);
    x->lfd = -1;
}
