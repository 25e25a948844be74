/* The parts of peer_mem.h that need no CUDA, built with or without it:
 * the kinds' names and file descriptors between processes of one host
 * (fr_fdx). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

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

/* A message of one int (the tag) with room for one descriptor. */
static void fr_fdx_msg(struct msghdr *m, struct iovec *iov, int *tag, char *cbuf, size_t clen)
{
    memset(cbuf, 0, clen);
    iov->iov_base = tag;
    iov->iov_len = sizeof(*tag);
    memset(m, 0, sizeof(*m));
    m->msg_iov = iov;
    m->msg_iovlen = 1;
    m->msg_control = cbuf;
    m->msg_controllen = clen;
}

int fr_fdx_listen(fr_fdx_t *x, const char *name, int backlog, fr_err_t *err)
{
    struct sockaddr_un a;
    snprintf(x->name, sizeof(x->name), "%s", name);
    socklen_t len = fr_fdx_addr(&a, x->name);
    x->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (x->lfd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket(AF_UNIX): %s", strerror(errno));
    if (bind(x->lfd, (struct sockaddr *)&a, len) != 0 || listen(x->lfd, backlog) != 0) {
        int e = errno;
        close(x->lfd);
        x->lfd = -1;
        return FR_ERR(err, FERRY_ERR_SYSTEM, "Unix socket @%s: %s", x->name, strerror(e));
    }
    return FERRY_OK;
}

int fr_fdx_send(const char *peer_name, int tag, int fd, long timeout_ms, fr_err_t *err)
{
    struct sockaddr_un a;
    socklen_t len = fr_fdx_addr(&a, peer_name);
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
                      "namespace, or not listening)", peer_name, strerror(e));
    }
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov;
    struct msghdr m;
    fr_fdx_msg(&m, &iov, &tag, cbuf, sizeof(cbuf));
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
        return FR_ERR(err, FERRY_ERR_SYSTEM, "sendmsg to @%s: %s", peer_name,
                      n < 0 ? strerror(e) : "short write");
    return FERRY_OK;
}

int fr_fdx_recv(fr_fdx_t *x, long timeout_ms, int *tag, int *fd, pid_t *pid, uid_t *uid,
                fr_err_t *err)
{
    *fd = -1;
    uint64_t end = fr_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    int s = -1;
    for (;;) {
        s = accept4(x->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (s >= 0)
            break;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return FR_ERR(err, FERRY_ERR_SYSTEM, "accept on @%s: %s", x->name, strerror(errno));
        uint64_t now = fr_now_ns();
        if (now >= end)
            return FR_ERR(err, FERRY_ERR_TIMEOUT,
                          "no file descriptor came to @%s within %ld ms", x->name, timeout_ms);
        struct pollfd p = {x->lfd, POLLIN, 0};
        uint64_t ms = (end - now) / 1000000ull + 1;
        (void)poll(&p, 1, ms > 100 ? 100 : (int)ms);
    }
    struct ucred cr;
    socklen_t cl = sizeof(cr);
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
        int e = errno;
        close(s);
        return FR_ERR(err, FERRY_ERR_SYSTEM, "SO_PEERCRED: %s", strerror(e));
    }
    *pid = cr.pid;
    *uid = cr.uid;
    struct pollfd p = {s, POLLIN, 0};
    uint64_t now = fr_now_ns();
    long left = now < end ? (long)((end - now) / 1000000ull) : 0;
    if (poll(&p, 1, (int)(left < 1 ? 1 : left > 60000 ? 60000 : left)) <= 0) {
        close(s);
        return FR_ERR(err, FERRY_ERR_TIMEOUT, "a connection to @%s sent nothing", x->name);
    }
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov;
    struct msghdr m;
    fr_fdx_msg(&m, &iov, tag, cbuf, sizeof(cbuf));
    ssize_t n;
    do
        n = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    int e = errno;
    close(s);
    struct cmsghdr *c = n == (ssize_t)sizeof(*tag) ? CMSG_FIRSTHDR(&m) : NULL;
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int)))
        memcpy(fd, CMSG_DATA(c), sizeof(int));
    if (*fd < 0)
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "a connection to @%s (pid %ld) sent no file descriptor%s%s", x->name,
                      (long)cr.pid, n < 0 ? ": " : "", n < 0 ? strerror(e) : "");
    return FERRY_OK;
}

void fr_fdx_close(fr_fdx_t *x)
{
    if (x->lfd >= 0)
        close(x->lfd);
    x->lfd = -1;
}
