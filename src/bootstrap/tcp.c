/*
 * TCP bootstrap: a star of connections to rank 0.
 *
 * Every socket is non-blocking and every wait is a poll() with a deadline.
 * Frames are {u32 type, u32 len} + payload (boot_int.h). A collective holds
 * b->mu from start to end; the watcher thread only try-locks it, polls with
 * timeout 0, and sleeps outside it, so it never takes a collective's frame:
 * it consumes only DEAD, BYE and BYE_ACK frames found at the head of a
 * stream, and uses MSG_PEEK and POLLRDHUP to tell a closed socket from
 * pending data.
 */
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "boot_int.h"

#define FR_WATCH_PERIOD_MS 25
#define FR_RETRY_MS 50
#define FR_SHORT_SEND_MS 1000 /* DEAD/ABORT/BYE_ACK notices */
#define FR_MAX_PENDING 64     /* accepted sockets still owing a HELLO */

enum { IO_OK = 0, IO_TIMEOUT = 1, IO_EOF = 2, IO_ERR = 3 };

/* ---------------------------------------------------------------------- */
/* Time and raw I/O                                                        */
/* ---------------------------------------------------------------------- */

int64_t fr_boot_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void fr_boot_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int fr_left_ms(int64_t deadline)
{
    int64_t r = deadline - fr_boot_now_ms();
    if (r < 0)
        return 0;
    return r > INT_MAX ? INT_MAX : (int)r;
}

/* Wait for ev on fd. Returns revents (>0), 0 on deadline, -1 on error. */
static int fr_wait_fd(int fd, short ev, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = ev, .revents = 0};
        int n = poll(&p, 1, fr_left_ms(deadline));
        if (n > 0)
            return p.revents;
        if (n == 0) {
            if (fr_boot_now_ms() >= deadline)
                return 0;
            continue;
        }
        if (errno != EINTR)
            return -1;
    }
}

static int fr_errno_is_gone(int e)
{
    return e == EPIPE || e == ECONNRESET || e == ENOTCONN || e == ECONNABORTED;
}

/* Send every byte of iov before deadline. *moved: bytes that left. */
static int fr_sendv(int fd, struct iovec *iov, int iovcnt, int64_t deadline,
                    size_t *moved)
{
    size_t done = 0;
    while (iovcnt > 0) {
        if (iov->iov_len == 0) {
            iov++;
            iovcnt--;
            continue;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)iovcnt;
        ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            size_t left = (size_t)n;
            done += left;
            while (left > 0) {
                if (left >= iov->iov_len) {
                    left -= iov->iov_len;
                    iov->iov_len = 0;
                    iov++;
                    iovcnt--;
                } else {
                    iov->iov_base = (char *)iov->iov_base + left;
                    iov->iov_len -= left;
                    left = 0;
                }
            }
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = fr_wait_fd(fd, POLLOUT, deadline);
            if (r == 0) {
                if (moved)
                    *moved = done;
                return IO_TIMEOUT;
            }
            if (r < 0) {
                if (moved)
                    *moved = done;
                return IO_ERR;
            }
            continue;
        }
        if (moved)
            *moved = done;
        return (n < 0 && fr_errno_is_gone(errno)) ? IO_EOF : IO_ERR;
    }
    if (moved)
        *moved = done;
    return IO_OK;
}

static int fr_send_frame(int fd, uint32_t type, const void *p1, size_t l1,
                         const void *p2, size_t l2, int64_t deadline,
                         size_t *moved)
{
    fr_frame_hdr_t h = {type, (uint32_t)(l1 + l2)};
    struct iovec iov[3] = {{&h, sizeof(h)},
                           {(void *)(uintptr_t)p1, l1},
                           {(void *)(uintptr_t)p2, l2}};
    return fr_sendv(fd, iov, 3, deadline, moved);
}

/* Receive exactly n bytes. *got: bytes received (for partial frames). */
static int fr_recv_all(int fd, void *buf, size_t n, int64_t deadline,
                       size_t *got)
{
    size_t done = 0;
    int rc = IO_OK;
    while (done < n) {
        ssize_t k = recv(fd, (char *)buf + done, n - done, MSG_DONTWAIT);
        if (k > 0) {
            done += (size_t)k;
            continue;
        }
        if (k == 0) {
            rc = IO_EOF;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = fr_wait_fd(fd, POLLIN, deadline);
            if (r == 0) {
                rc = IO_TIMEOUT;
                break;
            }
            if (r < 0) {
                rc = IO_ERR;
                break;
            }
            continue;
        }
        rc = fr_errno_is_gone(errno) ? IO_EOF : IO_ERR;
        break;
    }
    if (got)
        *got = done;
    return rc;
}

static int fr_discard(int fd, size_t n, int64_t deadline)
{
    char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof(buf) ? n : sizeof(buf);
        int rc = fr_recv_all(fd, buf, k, deadline, NULL);
        if (rc != IO_OK)
            return rc;
        n -= k;
    }
    return IO_OK;
}

enum { PEEK_NONE = 0, PEEK_EOF = 1, PEEK_PARTIAL = 2, PEEK_FRAME = 3 };

/* What waits at the head of fd, without consuming it. want: bytes to peek
 * into buf (>= a header); PEEK_FRAME means all of them are there. */
static int fr_peek(int fd, void *buf, size_t want)
{
    ssize_t n;
    do {
        n = recv(fd, buf, want, MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n == 0)
        return PEEK_EOF;
    if (n < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK) ? PEEK_NONE
                                                         : PEEK_EOF;
    return (size_t)n < want ? PEEK_PARTIAL : PEEK_FRAME;
}

static void fr_set_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void fr_close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* "3,5,7" (or "3" with singular=1), cut short with ",..." when long. */
static void fr_fmt_ranks(char *buf, size_t cap, const int *ranks, int n)
{
    size_t off = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        int w = snprintf(buf + off, cap - off, "%s%d", i ? "," : "",
                         ranks[i]);
        if (w < 0 || (size_t)w >= cap - off || off + (size_t)w + 8 >= cap) {
            snprintf(buf + off, cap - off, ",...");
            return;
        }
        off += (size_t)w;
    }
}

static const char *fr_io_str(int io)
{
    switch (io) {
    case IO_TIMEOUT: return "timed out";
    case IO_EOF: return "connection closed";
    default: return "socket error";
    }
}

/* ---------------------------------------------------------------------- */
/* Dead ranks                                                              */
/* ---------------------------------------------------------------------- */

static void fr_record_dead(fr_boot_t *b, int r)
{
    int expect = -1;
    if (__atomic_compare_exchange_n(&b->dead, &expect, r, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
        FR_LOG_WARN(FR_SUB_BOOT, "rank %d died (connection closed)", r);
}

/* Root: rank r's socket closed without goodbye. Tell everyone else. */
static void fr_root_mark_dead(fr_boot_t *b, int r)
{
    if (b->conns[r].state != FR_CONN_LIVE)
        return;
    b->conns[r].state = FR_CONN_DEAD;
    fr_record_dead(b, r);
    int32_t who = r;
    for (int k = 1; k < b->size; k++) {
        fr_conn_t *c = &b->conns[k];
        if (k == r || (c->state != FR_CONN_LIVE && c->state != FR_CONN_BYE))
            continue;
        size_t moved = 0;
        int io = fr_send_frame(c->fd, FR_MSG_DEAD, &who, sizeof(who), NULL, 0,
                               fr_boot_now_ms() + FR_SHORT_SEND_MS, &moved);
        if (io == IO_TIMEOUT && moved > 0)
            c->state = FR_CONN_DESYNC;
    }
}

/* Non-root: the root's socket closed without goodbye. */
static void fr_leaf_mark_root_dead(fr_boot_t *b)
{
    if (b->conns[0].state != FR_CONN_LIVE)
        return;
    b->conns[0].state = FR_CONN_DEAD;
    fr_record_dead(b, 0);
}

/* Root: send ABORT(code, msg) to every live rank (best effort). */
static void fr_root_abort_all(fr_boot_t *b, int code, const char *msg)
{
    int32_t c32 = code;
    char buf[FR_ERRMSG_LEN + 8];
    memcpy(buf, &c32, 4);
    size_t ml = strlen(msg);
    if (ml > FR_ERRMSG_LEN)
        ml = FR_ERRMSG_LEN;
    memcpy(buf + 4, msg, ml);
    for (int k = 1; k < b->size; k++) {
        fr_conn_t *c = &b->conns[k];
        if (c->state != FR_CONN_LIVE)
            continue;
        size_t moved = 0;
        int io = fr_send_frame(c->fd, FR_MSG_ABORT, buf, 4 + ml, NULL, 0,
                               fr_boot_now_ms() + FR_SHORT_SEND_MS, &moved);
        if (io == IO_TIMEOUT && moved > 0)
            c->state = FR_CONN_DESYNC;
    }
}

/* Read an ABORT payload of plen bytes: status and text. */
static int fr_read_abort(int fd, uint32_t plen, int64_t deadline, int *code,
                         char *text, size_t cap)
{
    int32_t c32 = FERRY_ERR_BOOTSTRAP;
    text[0] = '\0';
    if (plen < 4)
        return fr_discard(fd, plen, deadline);
    int io = fr_recv_all(fd, &c32, 4, deadline, NULL);
    if (io != IO_OK)
        return io;
    plen -= 4;
    size_t take = plen < cap - 1 ? plen : cap - 1;
    io = fr_recv_all(fd, text, take, deadline, NULL);
    if (io != IO_OK)
        return io;
    text[take] = '\0';
    *code = c32 < 0 ? c32 : FERRY_ERR_BOOTSTRAP;
    return fr_discard(fd, plen - take, deadline);
}

/* ---------------------------------------------------------------------- */
/* Watcher                                                                 */
/* ---------------------------------------------------------------------- */

static void fr_watch_root(fr_boot_t *b)
{
    struct pollfd pf[256];
    int who[256];
    for (int base = 1; base < b->size; base += 256) {
        int n = 0;
        for (int r = base; r < b->size && r < base + 256; r++)
            if (b->conns[r].state == FR_CONN_LIVE) {
                pf[n].fd = b->conns[r].fd;
                pf[n].events = POLLIN | POLLRDHUP;
                pf[n].revents = 0;
                who[n++] = r;
            }
        if (n == 0 || poll(pf, (nfds_t)n, 0) <= 0)
            continue;
        for (int i = 0; i < n; i++) {
            int r = who[i];
            short ev = pf[i].revents;
            if (!ev || b->conns[r].state != FR_CONN_LIVE)
                continue;
            int closed = (ev & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
            fr_frame_hdr_t h;
            int k = fr_peek(b->conns[r].fd, &h, sizeof(h));
            if (k == PEEK_EOF) {
                fr_root_mark_dead(b, r);
            } else if (k == PEEK_FRAME && h.type == FR_MSG_BYE && h.len == 0) {
                /* An early goodbye: the rank is in fr_boot_close. */
                if (recv(b->conns[r].fd, &h, sizeof(h), MSG_DONTWAIT) ==
                    (ssize_t)sizeof(h)) {
                    b->conns[r].state = FR_CONN_BYE;
                    FR_LOG_INFO(FR_SUB_BOOT, "rank %d said goodbye", r);
                }
            } else if (k != PEEK_NONE && closed) {
                /* Closed behind unread data that is not a goodbye. */
                fr_root_mark_dead(b, r);
            }
        }
    }
}

static void fr_watch_leaf(fr_boot_t *b)
{
    fr_conn_t *c = &b->conns[0];
    for (int iter = 0; iter < 8 && c->state == FR_CONN_LIVE; iter++) {
        struct pollfd pf = {.fd = c->fd, .events = POLLIN | POLLRDHUP};
        if (poll(&pf, 1, 0) <= 0 || !pf.revents)
            return;
        int closed = (pf.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
        unsigned char buf[sizeof(fr_frame_hdr_t) + 4];
        fr_frame_hdr_t h;
        int k = fr_peek(c->fd, buf, sizeof(buf));
        if (k == PEEK_EOF) {
            fr_leaf_mark_root_dead(b);
            return;
        }
        if (k == PEEK_NONE)
            return;
        if (k == PEEK_FRAME) {
            memcpy(&h, buf, sizeof(h));
            if ((h.type == FR_MSG_DEAD || h.type == FR_MSG_BYE_ACK) &&
                h.len == 4) {
                int32_t r;
                memcpy(&r, buf + sizeof(h), 4);
                if (recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT) !=
                    (ssize_t)sizeof(buf)) {
                    c->state = FR_CONN_DESYNC;
                    return;
                }
                if (r >= 0 && r < b->size)
                    fr_record_dead(b, r);
                if (h.type == FR_MSG_BYE_ACK) {
                    c->state = FR_CONN_BYE;
                    FR_LOG_INFO(FR_SUB_BOOT, "root said goodbye");
                    return;
                }
                continue;
            }
        }
        /* A collective's frame (or a partial one): leave it. Behind a
         * closed socket it will never be answered: the root is gone. */
        if (closed)
            fr_leaf_mark_root_dead(b);
        return;
    }
}

static void *fr_watcher_main(void *arg)
{
    fr_boot_t *b = arg;
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        if (pthread_mutex_trylock(&b->mu) == 0) {
            if (b->rank == 0)
                fr_watch_root(b);
            else
                fr_watch_leaf(b);
            pthread_mutex_unlock(&b->mu);
        }
        fr_boot_sleep_ms(FR_WATCH_PERIOD_MS);
    }
    return NULL;
}

/* ---------------------------------------------------------------------- */
/* Init                                                                    */
/* ---------------------------------------------------------------------- */

static int fr_root_init(fr_boot_t *b, const fr_boot_env_t *env,
                        long timeout_ms, int64_t deadline, fr_err_t *err)
{
    int lfd = -1, rc = FERRY_OK;
    int pend[FR_MAX_PENDING];
    int npend = 0, arrived = 0;
    char notes[256] = "";
    snprintf(b->root_addr, sizeof(b->root_addr), "0.0.0.0:%d",
             env->root_port);

    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)env->root_port);
    lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket: %s", strerror(errno));
    int one = 1;
    (void)setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    for (;;) {
        if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            break;
        int e = errno;
        if (e != EADDRINUSE || fr_boot_now_ms() >= deadline) {
            rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                        "rank 0 cannot listen on %s: %s (set FERRY_ROOT to a "
                        "free port)",
                        b->root_addr, strerror(e));
            goto out;
        }
        fr_boot_sleep_ms(FR_RETRY_MS);
    }
    if (listen(lfd, b->size < 1024 ? b->size : 1024) != 0) {
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP, "listen on %s: %s",
                    b->root_addr, strerror(errno));
        goto out;
    }
    FR_LOG_INFO(FR_SUB_BOOT, "root listening on %s for %d ranks",
                b->root_addr, b->size - 1);

    while (arrived < b->size - 1) {
        struct pollfd pf[1 + FR_MAX_PENDING];
        pf[0].fd = lfd;
        pf[0].events = POLLIN;
        pf[0].revents = 0;
        for (int i = 0; i < npend; i++) {
            pf[1 + i].fd = pend[i];
            pf[1 + i].events = POLLIN;
            pf[1 + i].revents = 0;
        }
        int n = poll(pf, (nfds_t)(1 + npend), fr_left_ms(deadline));
        if (n < 0 && errno != EINTR) {
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "poll: %s", strerror(errno));
            goto out;
        }
        if (n <= 0) {
            if (fr_boot_now_ms() >= deadline)
                break;
            continue;
        }
        /* Hellos first (pf indexes pend as it was). */
        for (int i = npend - 1; i >= 0; i--) {
            if (!pf[1 + i].revents)
                continue;
            int fd = pend[i];
            pend[i] = pend[--npend];
            fr_frame_hdr_t h;
            fr_hello_t hi;
            memset(&hi, 0, sizeof(hi));
            int64_t dl = fr_boot_now_ms() + 1000;
            if (dl > deadline)
                dl = deadline;
            int io = fr_recv_all(fd, &h, sizeof(h), dl, NULL);
            if (io == IO_OK && h.type == FR_MSG_HELLO && h.len == sizeof(hi))
                io = fr_recv_all(fd, &hi, sizeof(hi), dl, NULL);
            else if (io == IO_OK)
                io = IO_ERR;
            if (io != IO_OK || hi.magic != FR_BOOT_MAGIC) {
                FR_LOG_WARN(FR_SUB_BOOT, "root: dropped a connection that "
                                         "sent no ferry hello (%s)",
                            io == IO_OK ? "bad magic" : fr_io_str(io));
                close(fd);
                continue;
            }
            char why[200] = "";
            if (hi.version != FR_BOOT_WIRE_VERSION)
                snprintf(why, sizeof(why),
                         "rank %d speaks bootstrap version %u, root %u",
                         (int)hi.rank, hi.version, FR_BOOT_WIRE_VERSION);
            else if (hi.size != b->size)
                snprintf(why, sizeof(why),
                         "rank %d (pid %d) has world size %d, root has %d",
                         (int)hi.rank, (int)hi.pid, (int)hi.size, b->size);
            else if (hi.rank <= 0 || hi.rank >= b->size)
                snprintf(why, sizeof(why), "a peer claims rank %d of %d",
                         (int)hi.rank, b->size);
            else if (b->conns[hi.rank].state != FR_CONN_NONE)
                snprintf(why, sizeof(why),
                         "rank %d connected twice (pid %d, then pid %d)",
                         (int)hi.rank, b->conns[hi.rank].pid, (int)hi.pid);
            if (why[0]) {
                FR_LOG_WARN(FR_SUB_BOOT, "root rejected a peer: %s", why);
                int32_t c32 = FERRY_ERR_BOOTSTRAP;
                char msg[240];
                memcpy(msg, &c32, 4);
                size_t wl = strlen(why);
                memcpy(msg + 4, why, wl);
                (void)fr_send_frame(fd, FR_MSG_ABORT, msg, 4 + wl, NULL, 0,
                                    fr_boot_now_ms() + 200, NULL);
                close(fd);
                size_t nl = strlen(notes);
                if (nl + 4 < sizeof(notes))
                    snprintf(notes + nl, sizeof(notes) - nl, "; rejected: %s",
                             why);
                continue;
            }
            b->conns[hi.rank].fd = fd;
            b->conns[hi.rank].state = FR_CONN_LIVE;
            b->conns[hi.rank].pid = hi.pid;
            arrived++;
            FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d (pid %d) arrived, %d of %d",
                         (int)hi.rank, (int)hi.pid, arrived, b->size - 1);
        }
        if (pf[0].revents) {
            for (;;) {
                int fd = accept4(lfd, NULL, NULL,
                                 SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0)
                    break;
                if (npend == FR_MAX_PENDING) {
                    close(fd);
                    continue;
                }
                fr_set_nodelay(fd);
                pend[npend++] = fd;
            }
        }
    }

    if (arrived < b->size - 1) {
        int *miss = malloc(sizeof(int) * (size_t)b->size);
        int nm = 0;
        char list[160] = "?";
        if (miss) {
            for (int r = 1; r < b->size; r++)
                if (b->conns[r].state == FR_CONN_NONE)
                    miss[nm++] = r;
            fr_fmt_ranks(list, sizeof(list), miss, nm);
        }
        free(miss);
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                    "%s %s of %d did not connect to %s within %ld ms%s",
                    nm == 1 ? "rank" : "ranks", list, b->size, b->root_addr,
                    timeout_ms, notes);
        const char *m = err ? err->msg : "timeout";
        fr_root_abort_all(b, FERRY_ERR_BOOTSTRAP, m);
        /* Late arrivals whose hello is not read yet hear it too. */
        int32_t c32 = FERRY_ERR_BOOTSTRAP;
        size_t ml = strlen(m);
        for (int i = 0; i < npend; i++)
            (void)fr_send_frame(pend[i], FR_MSG_ABORT, &c32, 4, m, ml,
                                fr_boot_now_ms() + 100, NULL);
        goto out;
    }
    for (int r = 1; r < b->size; r++) {
        int io = fr_send_frame(b->conns[r].fd, FR_MSG_READY, NULL, 0, NULL, 0,
                               fr_boot_now_ms() + FR_SHORT_SEND_MS, NULL);
        if (io != IO_OK) {
            b->conns[r].state = FR_CONN_DEAD;
            rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                        "rank %d left during the bootstrap at %s (%s)", r,
                        b->root_addr, fr_io_str(io));
            fr_root_abort_all(b, FERRY_ERR_BOOTSTRAP, err ? err->msg : "");
            goto out;
        }
    }
out:
    for (int i = 0; i < npend; i++)
        close(pend[i]);
    fr_close_fd(&lfd);
    return rc;
}

/* Connect once to any address of host:port before deadline. */
static int fr_dial(const char *host, int port, int64_t deadline, int *lasterr,
                   char *gaierr, size_t gcap)
{
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET; /* the root listens on INADDR_ANY */
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(host, ps, &hints, &res);
    if (g != 0) {
        snprintf(gaierr, gcap, "%s", gai_strerror(g));
        return -1;
    }
    gaierr[0] = '\0';
    int fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK |
                                       SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            *lasterr = errno;
            continue;
        }
        int ok = 0;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
            ok = 1;
        } else if (errno == EINPROGRESS || errno == EINTR) {
            int64_t dl = fr_boot_now_ms() + 1000;
            if (dl > deadline)
                dl = deadline;
            int r = fr_wait_fd(fd, POLLOUT, dl);
            int soerr = 0;
            socklen_t sl = sizeof(soerr);
            if (r > 0 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) == 0 &&
                soerr == 0)
                ok = 1;
            else
                *lasterr = r == 0 ? ETIMEDOUT : (soerr ? soerr : errno);
        } else {
            *lasterr = errno;
        }
        if (ok) {
            /* Loopback "simultaneous open" can connect a socket to itself
             * when nobody listens yet on an ephemeral port. */
            struct sockaddr_storage me, peer;
            socklen_t ml = sizeof(me), pl = sizeof(peer);
            if (getsockname(fd, (struct sockaddr *)&me, &ml) == 0 &&
                getpeername(fd, (struct sockaddr *)&peer, &pl) == 0 &&
                ml == pl && memcmp(&me, &peer, ml) == 0) {
                ok = 0;
                *lasterr = ECONNREFUSED;
            }
        }
        if (ok)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

static int fr_leaf_init(fr_boot_t *b, const fr_boot_env_t *env,
                        long timeout_ms, int64_t deadline, fr_err_t *err)
{
    snprintf(b->root_addr, sizeof(b->root_addr), "%s:%d", env->root_host,
             env->root_port);
    int fd = -1, lasterr = 0, tries = 0;
    char gaierr[128] = "";
    for (;;) {
        tries++;
        fd = fr_dial(env->root_host, env->root_port, deadline, &lasterr,
                     gaierr, sizeof(gaierr));
        if (fd >= 0 || fr_boot_now_ms() >= deadline)
            break;
        fr_boot_sleep_ms(FR_RETRY_MS);
    }
    if (fd < 0) {
        if (gaierr[0])
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                          "rank %d cannot resolve root host '%s' (%s) within "
                          "%ld ms",
                          b->rank, env->root_host, gaierr, timeout_ms);
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d could not connect to root %s within %ld ms "
                      "(%d tries, last error: %s)",
                      b->rank, b->root_addr, timeout_ms, tries,
                      strerror(lasterr));
    }
    fr_set_nodelay(fd);
    b->conns[0].fd = fd;
    b->conns[0].state = FR_CONN_LIVE;

    fr_hello_t hi = {FR_BOOT_MAGIC,   FR_BOOT_WIRE_VERSION, b->rank,
                     b->size,         (int32_t)getpid(),
                     FERRY_VERSION_CODE};
    int io = fr_send_frame(fd, FR_MSG_HELLO, &hi, sizeof(hi), NULL, 0,
                           deadline + 1000, NULL);
    if (io != IO_OK)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: sending hello to root %s failed (%s)", b->rank,
                      b->root_addr, fr_io_str(io));
    FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d connected to %s, waiting for the rest",
                 b->rank, b->root_addr);

    /* The root gives up at its own deadline and says why (ABORT); wait a
     * little longer than ours to hear it. */
    int64_t dl = deadline + 1000;
    fr_frame_hdr_t h;
    io = fr_recv_all(fd, &h, sizeof(h), dl, NULL);
    if (io == IO_OK && h.type == FR_MSG_READY && h.len == 0)
        return FERRY_OK;
    if (io == IO_OK && h.type == FR_MSG_ABORT) {
        int code = FERRY_ERR_BOOTSTRAP;
        char text[FR_ERRMSG_LEN];
        if (fr_read_abort(fd, h.len, dl, &code, text, sizeof(text)) == IO_OK)
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                          "root %s ended the bootstrap: %s", b->root_addr,
                          text);
        io = IO_EOF;
    }
    if (io == IO_TIMEOUT)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d reached root %s, but not every rank arrived "
                      "within %ld ms",
                      b->rank, b->root_addr, timeout_ms);
    if (io == IO_OK)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: unexpected frame 0x%x from root %s (is "
                      "another program on that port?)",
                      b->rank, h.type, b->root_addr);
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "rank %d: root %s closed the connection during the "
                  "bootstrap (%s)",
                  b->rank, b->root_addr, fr_io_str(io));
}

static void fr_tcp_free(fr_boot_t *b)
{
    if (b->conns)
        for (int i = 0; i < b->nconns; i++)
            fr_close_fd(&b->conns[i].fd);
    free(b->conns);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

int fr_boot_init_tcp(const fr_boot_env_t *env, fr_boot_t **boot, fr_err_t *err)
{
    if (!boot)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_init_tcp: boot is NULL");
    *boot = NULL;
    if (!env)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_init_tcp: env is NULL");
    if (env->size < 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "world size %d: must be at "
                                              "least 1", env->size);
    if (env->rank < 0 || env->rank >= env->size)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "rank %d is out of range for world size %d", env->rank,
                      env->size);
    if (env->size > 1 && (env->root_port < 1 || env->root_port > 65535))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "root port %d is not in 1..65535", env->root_port);
    fr_log_set_rank(env->rank);

    fr_boot_t *b = calloc(1, sizeof(*b));
    if (!b)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    b->rank = env->rank;
    b->size = env->size;
    b->dead = -1;
    if (env->size == 1) {
        b->kind = FR_BOOT_SINGLE;
        *boot = b;
        FR_LOG_INFO(FR_SUB_BOOT, "bootstrap: single rank, no sockets");
        return FERRY_OK;
    }
    b->kind = FR_BOOT_TCP;
    pthread_mutex_init(&b->mu, NULL);
    b->nconns = b->rank == 0 ? b->size : 1;
    b->conns = calloc((size_t)b->nconns, sizeof(fr_conn_t));
    if (!b->conns) {
        fr_tcp_free(b);
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    }
    for (int i = 0; i < b->nconns; i++)
        b->conns[i].fd = -1;

    long timeout_ms = fr_cfg_int(FR_CFG_BOOTSTRAP_TIMEOUT_MS);
    if (timeout_ms < 1)
        timeout_ms = 1;
    int64_t t0 = fr_boot_now_ms();
    int64_t deadline = t0 + timeout_ms;
    int rc = b->rank == 0 ? fr_root_init(b, env, timeout_ms, deadline, err)
                          : fr_leaf_init(b, env, timeout_ms, deadline, err);
    if (rc != FERRY_OK) {
        FR_LOG_WARN(FR_SUB_BOOT, "bootstrap failed: %s",
                    err ? err->msg : ferry_strerror(rc));
        fr_tcp_free(b);
        return rc;
    }
    int e = pthread_create(&b->watcher, NULL, fr_watcher_main, b);
    if (e != 0) {
        fr_tcp_free(b);
        return FR_ERR(err, FERRY_ERR_SYSTEM,
                      "cannot start the bootstrap watcher thread: %s",
                      strerror(e));
    }
    b->watcher_on = 1;
    FR_LOG_INFO(FR_SUB_BOOT, "bootstrap ready: rank %d of %d via %s in %lld ms",
                b->rank, b->size, b->root_addr,
                (long long)(fr_boot_now_ms() - t0));
    *boot = b;
    return FERRY_OK;
}

/* ---------------------------------------------------------------------- */
/* Allgather                                                               */
/* ---------------------------------------------------------------------- */

static int fr_err_dead(fr_boot_t *b, fr_err_t *err)
{
    return FR_ERR(err, FERRY_ERR_PEER, "rank %d died (connection closed)",
                  __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE));
}

static int fr_root_allgather(fr_boot_t *b, const void *in, void *out,
                             size_t len, long tmo, int64_t deadline,
                             fr_err_t *err)
{
    int size = b->size, rc = FERRY_OK, nleft = 0, notify = 1;
    uint64_t seq = b->seq;
    unsigned char *got = calloc((size_t)size, 1);
    struct pollfd *pf = calloc((size_t)size, sizeof(*pf));
    int *who = calloc((size_t)size, sizeof(int));
    if (!got || !pf || !who) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "allgather: out of memory");
        goto out;
    }
    if (len && out != in)
        memmove(out, in, len);
    got[0] = 1;
    for (int r = 1; r < size; r++) {
        int st = b->conns[r].state;
        if (st == FR_CONN_DEAD) {
            rc = fr_err_dead(b, err);
            notify = 0;
            goto out;
        }
        if (st != FR_CONN_LIVE) {
            rc = FR_ERR(err, FERRY_ERR_PEER,
                        "rank %d has left the bootstrap (%s)", r,
                        st == FR_CONN_BYE ? "it called close"
                                          : "its stream broke earlier");
            goto out;
        }
        nleft++;
    }
    while (nleft > 0) {
        int n = 0;
        for (int r = 1; r < size; r++)
            if (b->conns[r].state == FR_CONN_LIVE) {
                pf[n].fd = b->conns[r].fd;
                pf[n].events = POLLIN | POLLRDHUP;
                pf[n].revents = 0;
                who[n++] = r;
            }
        int k = poll(pf, (nfds_t)n, fr_left_ms(deadline));
        if (k < 0 && errno != EINTR) {
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "poll: %s", strerror(errno));
            goto out;
        }
        if (k <= 0) {
            if (fr_boot_now_ms() < deadline)
                continue;
            int nm = 0;
            for (int r = 1; r < size; r++)
                if (!got[r])
                    who[nm++] = r;
            char list[160];
            fr_fmt_ranks(list, sizeof(list), who, nm);
            rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                        "allgather #%llu timed out after %ld ms: %s %s of %d "
                        "had not sent their data",
                        (unsigned long long)seq, tmo,
                        nm == 1 ? "rank" : "ranks", list, size);
            goto out;
        }
        for (int i = 0; i < n; i++) {
            int r = who[i];
            fr_conn_t *c = &b->conns[r];
            if (!pf[i].revents || c->state != FR_CONN_LIVE)
                continue;
            fr_frame_hdr_t h;
            int pk = fr_peek(c->fd, &h, sizeof(h));
            if (pk == PEEK_NONE)
                continue;
            if (pk == PEEK_EOF) {
                fr_root_mark_dead(b, r);
                rc = fr_err_dead(b, err);
                notify = 0;
                goto out;
            }
            size_t moved = 0;
            int io = fr_recv_all(c->fd, &h, sizeof(h), deadline, &moved);
            if (io == IO_OK && h.type == FR_MSG_DATA && !got[r] &&
                h.len == 8 + len) {
                uint64_t s;
                io = fr_recv_all(c->fd, &s, 8, deadline, NULL);
                if (io == IO_OK)
                    io = fr_recv_all(c->fd, (char *)out + (size_t)r * len, len,
                                     deadline, NULL);
                if (io == IO_OK && s != seq) {
                    rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                                "rank %d is in allgather #%llu, rank 0 in "
                                "#%llu (collectives called out of step)",
                                r, (unsigned long long)s,
                                (unsigned long long)seq);
                    goto out;
                }
                if (io == IO_OK) {
                    got[r] = 1;
                    nleft--;
                    continue;
                }
            } else if (io == IO_OK) {
                /* Not a block for this allgather: skip it and fail. */
                io = fr_discard(c->fd, h.len, deadline);
                if (io == IO_OK) {
                    if (h.type == FR_MSG_BYE) {
                        c->state = FR_CONN_BYE;
                        rc = FR_ERR(err, FERRY_ERR_PEER,
                                    "rank %d called close during allgather "
                                    "#%llu",
                                    r, (unsigned long long)seq);
                    } else if (h.type == FR_MSG_DATA && !got[r]) {
                        rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                                    "allgather #%llu: rank %d passed %u "
                                    "bytes, rank 0 passed %zu",
                                    (unsigned long long)seq, r,
                                    h.len >= 8 ? h.len - 8 : 0, len);
                    } else {
                        rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                                    "allgather #%llu: unexpected frame 0x%x "
                                    "(%u bytes) from rank %d",
                                    (unsigned long long)seq, h.type, h.len, r);
                    }
                    goto out;
                }
            }
            /* io failed in the middle of a frame. */
            if (io == IO_TIMEOUT) {
                c->state = FR_CONN_DESYNC;
                rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                            "allgather #%llu timed out after %ld ms while "
                            "receiving from rank %d",
                            (unsigned long long)seq, tmo, r);
                goto out;
            }
            fr_root_mark_dead(b, r);
            rc = fr_err_dead(b, err);
            notify = 0;
            goto out;
        }
    }
    /* Everyone's block is in: hand out the whole array. */
    for (int r = 1; r < size; r++) {
        fr_conn_t *c = &b->conns[r];
        if (c->state != FR_CONN_LIVE)
            continue;
        size_t moved = 0;
        int io = fr_send_frame(c->fd, FR_MSG_ALL, &seq, 8, out,
                               (size_t)size * len, deadline, &moved);
        if (io == IO_OK)
            continue;
        if (io == IO_TIMEOUT) {
            c->state = FR_CONN_DESYNC;
            if (rc == FERRY_OK)
                rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                            "allgather #%llu timed out after %ld ms while "
                            "sending to rank %d",
                            (unsigned long long)seq, tmo, r);
        } else {
            fr_root_mark_dead(b, r);
            if (rc == FERRY_OK)
                rc = fr_err_dead(b, err);
        }
    }
    notify = 0; /* the others got their answer */
out:
    if (rc != FERRY_OK && notify)
        fr_root_abort_all(b, rc, err ? err->msg : ferry_strerror(rc));
    free(got);
    free(pf);
    free(who);
    return rc;
}

static int fr_leaf_allgather(fr_boot_t *b, const void *in, void *out,
                             size_t len, long tmo, int64_t deadline,
                             fr_err_t *err)
{
    fr_conn_t *c = &b->conns[0];
    uint64_t seq = b->seq;
    if (c->state == FR_CONN_DEAD)
        return fr_err_dead(b, err);
    if (c->state != FR_CONN_LIVE)
        return FR_ERR(err, FERRY_ERR_PEER,
                      "the root (rank 0) has left the bootstrap (%s)",
                      c->state == FR_CONN_BYE ? "it called close"
                                              : "the stream broke earlier");
    size_t moved = 0;
    int io = fr_send_frame(c->fd, FR_MSG_DATA, &seq, 8, in, len, deadline,
                           &moved);
    if (io == IO_TIMEOUT) {
        if (moved)
            c->state = FR_CONN_DESYNC;
        return FR_ERR(err, FERRY_ERR_TIMEOUT,
                      "allgather #%llu: rank %d could not send to root %s "
                      "within %ld ms",
                      (unsigned long long)seq, b->rank, b->root_addr, tmo);
    }
    if (io != IO_OK) {
        fr_leaf_mark_root_dead(b);
        return fr_err_dead(b, err);
    }
    /* The root, whose deadline may start a little after ours, names the
     * late ranks in an ABORT: give it a short grace to say so. */
    int64_t grace = tmo / 2 < 1000 ? tmo / 2 : 1000;
    for (;;) {
        fr_frame_hdr_t h;
        moved = 0;
        io = fr_recv_all(c->fd, &h, sizeof(h), deadline + grace, &moved);
        if (io == IO_TIMEOUT && moved == 0)
            return FR_ERR(err, FERRY_ERR_TIMEOUT,
                          "allgather #%llu: rank %d got no answer from root "
                          "%s within %ld ms (a rank has not called it?)",
                          (unsigned long long)seq, b->rank, b->root_addr, tmo);
        deadline += grace;
        grace = 0;
        if (io != IO_OK)
            goto broken;
        switch (h.type) {
        case FR_MSG_ALL: {
            if (h.len != 8 + (size_t)b->size * len) {
                io = fr_discard(c->fd, h.len, deadline);
                if (io != IO_OK)
                    goto broken;
                return FR_ERR(err, FERRY_ERR_PROTOCOL,
                              "allgather #%llu: root sent %u bytes, rank %d "
                              "expected %zu (ranks passed different sizes?)",
                              (unsigned long long)seq, h.len, b->rank,
                              8 + (size_t)b->size * len);
            }
            uint64_t s;
            io = fr_recv_all(c->fd, &s, 8, deadline, NULL);
            if (io == IO_OK && s != seq) {
                io = fr_discard(c->fd, h.len - 8, deadline);
                if (io != IO_OK)
                    goto broken;
                return FR_ERR(err, FERRY_ERR_PROTOCOL,
                              "rank %d is in allgather #%llu, root answered "
                              "#%llu",
                              b->rank, (unsigned long long)seq,
                              (unsigned long long)s);
            }
            if (io == IO_OK)
                io = fr_recv_all(c->fd, out, (size_t)b->size * len, deadline,
                                 NULL);
            if (io != IO_OK)
                goto broken;
            return FERRY_OK;
        }
        case FR_MSG_DEAD: {
            int32_t r = -1;
            io = h.len == 4 ? fr_recv_all(c->fd, &r, 4, deadline, NULL)
                            : fr_discard(c->fd, h.len, deadline);
            if (io != IO_OK)
                goto broken;
            if (r >= 0 && r < b->size)
                fr_record_dead(b, r);
            return fr_err_dead(b, err);
        }
        case FR_MSG_ABORT: {
            int code = FERRY_ERR_PEER;
            char text[FR_ERRMSG_LEN];
            io = fr_read_abort(c->fd, h.len, deadline, &code, text,
                               sizeof(text));
            if (io != IO_OK)
                goto broken;
            return FR_ERR(err, code, "root reports: %s", text);
        }
        case FR_MSG_BYE_ACK: {
            int32_t r = -1;
            io = h.len == 4 ? fr_recv_all(c->fd, &r, 4, deadline, NULL)
                            : fr_discard(c->fd, h.len, deadline);
            if (io != IO_OK)
                goto broken;
            c->state = FR_CONN_BYE;
            if (r >= 0 && r < b->size)
                fr_record_dead(b, r);
            return FR_ERR(err, FERRY_ERR_PEER,
                          "the root (rank 0) called close during allgather "
                          "#%llu",
                          (unsigned long long)seq);
        }
        default:
            io = fr_discard(c->fd, h.len, deadline);
            if (io != IO_OK)
                goto broken;
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "allgather #%llu: unexpected frame 0x%x from root",
                          (unsigned long long)seq, h.type);
        }
    }
broken:
    if (io == IO_TIMEOUT) {
        c->state = FR_CONN_DESYNC;
        return FR_ERR(err, FERRY_ERR_TIMEOUT,
                      "allgather #%llu: rank %d timed out after %ld ms in the "
                      "middle of a message from root %s",
                      (unsigned long long)seq, b->rank, tmo, b->root_addr);
    }
    fr_leaf_mark_root_dead(b);
    return fr_err_dead(b, err);
}

int fr_boot_tcp_allgather(fr_boot_t *b, const void *in, void *out, size_t len,
                          fr_err_t *err)
{
    long tmo = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    if (tmo < 1)
        tmo = 1;
    pthread_mutex_lock(&b->mu);
    int rc, fresh = 0;
    b->seq++;
    if (__atomic_load_n(&b->dead, __ATOMIC_ACQUIRE) >= 0) {
        rc = fr_err_dead(b, err);
    } else if (b->broken_rc != FERRY_OK) {
        rc = FR_ERR(err, b->broken_rc,
                    "bootstrap unusable after an earlier failure: %s",
                    b->broken_msg);
    } else {
        int64_t deadline = fr_boot_now_ms() + tmo;
        fr_err_t local;
        fr_err_t *e = err ? err : &local;
        rc = b->rank == 0
                 ? fr_root_allgather(b, in, out, len, tmo, deadline, e)
                 : fr_leaf_allgather(b, in, out, len, tmo, deadline, e);
        fresh = 1;
        if (rc != FERRY_OK && rc != FERRY_ERR_PEER) {
            b->broken_rc = rc;
            snprintf(b->broken_msg, sizeof(b->broken_msg), "%s", e->msg);
        }
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != FERRY_OK && fresh) /* not again for each later call */
        FR_LOG_WARN(FR_SUB_BOOT, "allgather failed: %s",
                    err ? err->msg : ferry_strerror(rc));
    return rc;
}

/* ---------------------------------------------------------------------- */
/* Close                                                                   */
/* ---------------------------------------------------------------------- */

static int fr_root_close(fr_boot_t *b, long tmo, int64_t deadline,
                         fr_err_t *err)
{
    int size = b->size;
    struct pollfd *pf = calloc((size_t)size, sizeof(*pf));
    int *who = calloc((size_t)size, sizeof(int));
    if (!pf || !who) {
        free(pf);
        free(who);
        return FR_ERR(err, FERRY_ERR_NOMEM, "close: out of memory");
    }
    /* Wait for every live rank's goodbye; skip stale collective frames. */
    for (;;) {
        int n = 0;
        for (int r = 1; r < size; r++)
            if (b->conns[r].state == FR_CONN_LIVE) {
                pf[n].fd = b->conns[r].fd;
                pf[n].events = POLLIN | POLLRDHUP;
                pf[n].revents = 0;
                who[n++] = r;
            }
        if (n == 0)
            break;
        int k = poll(pf, (nfds_t)n, fr_left_ms(deadline));
        if (k < 0 && errno != EINTR)
            break;
        if (k <= 0) {
            if (fr_boot_now_ms() >= deadline)
                break;
            continue;
        }
        for (int i = 0; i < n; i++) {
            int r = who[i];
            fr_conn_t *c = &b->conns[r];
            if (!pf[i].revents || c->state != FR_CONN_LIVE)
                continue;
            fr_frame_hdr_t h;
            int pk = fr_peek(c->fd, &h, sizeof(h));
            if (pk == PEEK_NONE)
                continue;
            if (pk == PEEK_EOF) {
                fr_root_mark_dead(b, r);
                continue;
            }
            int io = fr_recv_all(c->fd, &h, sizeof(h), deadline, NULL);
            if (io == IO_OK)
                io = fr_discard(c->fd, h.len, deadline);
            if (io == IO_OK && h.type == FR_MSG_BYE)
                c->state = FR_CONN_BYE;
            else if (io == IO_TIMEOUT)
                c->state = FR_CONN_DESYNC;
            else if (io != IO_OK)
                fr_root_mark_dead(b, r);
        }
    }
    /* Goodbye to everyone still there, with the dead rank if any. */
    int32_t d = __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE);
    int nd = 0, nm = 0;
    int *dead = who, *missing = (int *)pf; /* reuse: size ints each */
    for (int r = 1; r < size; r++) {
        fr_conn_t *c = &b->conns[r];
        if (c->state == FR_CONN_LIVE || c->state == FR_CONN_BYE)
            (void)fr_send_frame(c->fd, FR_MSG_BYE_ACK, &d, 4, NULL, 0,
                                fr_boot_now_ms() + FR_SHORT_SEND_MS, NULL);
        if (c->state == FR_CONN_DEAD)
            dead[nd++] = r;
        else if (c->state != FR_CONN_BYE)
            missing[nm++] = r;
    }
    int rc = FERRY_OK;
    char dl[160], ml[160];
    fr_fmt_ranks(dl, sizeof(dl), dead, nd);
    fr_fmt_ranks(ml, sizeof(ml), missing, nm);
    if (nd > 0)
        rc = FR_ERR(err, FERRY_ERR_PEER,
                    "%s %s died (connection closed)%s%s",
                    nd == 1 ? "rank" : "ranks", dl,
                    nm ? "; no goodbye from " : "", nm ? ml : "");
    else if (nm > 0)
        rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                    "close: %s %s did not say goodbye within %ld ms",
                    nm == 1 ? "rank" : "ranks", ml, tmo);
    free(pf);
    free(who);
    return rc;
}

static int fr_leaf_close(fr_boot_t *b, long tmo, int64_t deadline,
                         fr_err_t *err)
{
    fr_conn_t *c = &b->conns[0];
    int rc = FERRY_OK;
    if (c->state == FR_CONN_LIVE) {
        int io = fr_send_frame(c->fd, FR_MSG_BYE, NULL, 0, NULL, 0, deadline,
                               NULL);
        while (io == IO_OK) {
            fr_frame_hdr_t h;
            io = fr_recv_all(c->fd, &h, sizeof(h), deadline, NULL);
            if (io != IO_OK)
                break;
            if ((h.type == FR_MSG_BYE_ACK || h.type == FR_MSG_DEAD) &&
                h.len == 4) {
                int32_t r = -1;
                io = fr_recv_all(c->fd, &r, 4, deadline, NULL);
                if (io == IO_OK && r >= 0 && r < b->size)
                    fr_record_dead(b, r);
                if (io == IO_OK && h.type == FR_MSG_BYE_ACK) {
                    c->state = FR_CONN_BYE;
                    break;
                }
            } else {
                io = fr_discard(c->fd, h.len, deadline); /* stale */
            }
        }
        if (io == IO_TIMEOUT)
            rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                        "close: rank %d got no goodbye from root %s within "
                        "%ld ms",
                        b->rank, b->root_addr, tmo);
        else if (io != IO_OK)
            fr_leaf_mark_root_dead(b);
    }
    if (__atomic_load_n(&b->dead, __ATOMIC_ACQUIRE) >= 0)
        rc = fr_err_dead(b, err);
    return rc;
}

int fr_boot_tcp_close(fr_boot_t *b, fr_err_t *err)
{
    if (b->watcher_on) {
        __atomic_store_n(&b->stop, 1, __ATOMIC_RELEASE);
        pthread_join(b->watcher, NULL);
        b->watcher_on = 0;
    }
    long tmo = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    if (tmo < 1)
        tmo = 1;
    int64_t deadline = fr_boot_now_ms() + tmo;
    pthread_mutex_lock(&b->mu);
    int rc = b->rank == 0 ? fr_root_close(b, tmo, deadline, err)
                          : fr_leaf_close(b, tmo, deadline, err);
    pthread_mutex_unlock(&b->mu);
    if (rc == FERRY_OK)
        FR_LOG_INFO(FR_SUB_BOOT, "bootstrap closed (rank %d of %d)", b->rank,
                    b->size);
    else
        FR_LOG_WARN(FR_SUB_BOOT, "bootstrap closed with an error: %s",
                    err ? err->msg : ferry_strerror(rc));
    fr_tcp_free(b);
    return rc;
}
