/*
 * TCP bootstrap socket I/O: the monotonic clock and sleeps behind every
 * deadline, and deadline-bound helpers on non-blocking sockets (wait for an
 * event, send a whole frame, receive or discard exactly n bytes, peek at the
 * head of a stream without consuming it), plus the small formatters the
 * error messages share.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "tcp.h"

int64_t fr_boot_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int fr_boot_ephemeral_lo(void)
{
    int lo = 32768, hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "re");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2 || lo < 1 || lo > 65535)
            lo = 32768;
        fclose(f);
    }
    return lo;
}

/* A port bound (and released) now: a random one in [10000, the ephemeral
 * range's start) while that range starts above 12000, tried 64 times, then
 * the kernel's. */
int fr_boot_free_port(int *port)
{
    int lo = fr_boot_ephemeral_lo();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)ts.tv_nsec;
    int e = 0;
    for (int i = lo > 12000 ? 0 : 64; i <= 64; i++) { /* the last: port 0 */
        int p = 0;
        if (i < 64) {
            seed = seed * 1103515245u + 12345u;
            p = 10000 + (int)((seed >> 8) % (unsigned)(lo - 10000));
        }
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return errno;
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof(sa));
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons((uint16_t)p);
        socklen_t sl = sizeof(sa);
        int ok = bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
                 getsockname(fd, (struct sockaddr *)&sa, &sl) == 0;
        e = ok ? 0 : errno;
        close(fd);
        if (ok) {
            *port = ntohs(sa.sin_port);
            return 0;
        }
    }
    return e ? e : EADDRINUSE;
}

void fr_boot_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

int fr_boot_left_ms(int64_t deadline)
{
    int64_t r = deadline - fr_boot_now_ms();
    if (r < 0)
        return 0;
    return r > INT_MAX ? INT_MAX : (int)r;
}

/* Wait for ev on fd. Returns revents (>0), 0 on deadline, -1 on error. */
int fr_boot_wait_fd(int fd, short ev, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = ev, .revents = 0};
        int n = poll(&p, 1, fr_boot_left_ms(deadline));
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
            int r = fr_boot_wait_fd(fd, POLLOUT, deadline);
            if (r == 0) {
                if (moved)
                    *moved = done;
                return FR_IO_TIMEOUT;
            }
            if (r < 0) {
                if (moved)
                    *moved = done;
                return FR_IO_ERR;
            }
            continue;
        }
        if (moved)
            *moved = done;
        return (n < 0 && fr_errno_is_gone(errno)) ? FR_IO_EOF : FR_IO_ERR;
    }
    if (moved)
        *moved = done;
    return FR_IO_OK;
}

int fr_boot_sendv3(int fd, const void *p1, size_t l1, const void *p2,
                   size_t l2, const void *p3, size_t l3, int64_t deadline,
                   size_t *moved)
{
    struct iovec iov[3] = {{(void *)(uintptr_t)p1, l1},
                           {(void *)(uintptr_t)p2, l2},
                           {(void *)(uintptr_t)p3, l3}};
    return fr_sendv(fd, iov, 3, deadline, moved);
}

int fr_boot_send_frame(int fd, uint32_t type, const void *p1, size_t l1,
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
int fr_boot_recv_all(int fd, void *buf, size_t n, int64_t deadline,
                     size_t *got)
{
    size_t done = 0;
    int rc = FR_IO_OK;
    while (done < n) {
        ssize_t k = recv(fd, (char *)buf + done, n - done, MSG_DONTWAIT);
        if (k > 0) {
            done += (size_t)k;
            continue;
        }
        if (k == 0) {
            rc = FR_IO_EOF;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int r = fr_boot_wait_fd(fd, POLLIN, deadline);
            if (r == 0) {
                rc = FR_IO_TIMEOUT;
                break;
            }
            if (r < 0) {
                rc = FR_IO_ERR;
                break;
            }
            continue;
        }
        rc = fr_errno_is_gone(errno) ? FR_IO_EOF : FR_IO_ERR;
        break;
    }
    if (got)
        *got = done;
    return rc;
}

int fr_boot_discard(int fd, size_t n, int64_t deadline)
{
    char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof(buf) ? n : sizeof(buf);
        int rc = fr_boot_recv_all(fd, buf, k, deadline, NULL);
        if (rc != FR_IO_OK)
            return rc;
        n -= k;
    }
    return FR_IO_OK;
}

/* What waits at the head of fd, without consuming it. want: bytes to peek
 * into buf (>= a header); FR_PEEK_FRAME means all of them are there. */
int fr_boot_peek(int fd, void *buf, size_t want)
{
    ssize_t n;
    do {
        n = recv(fd, buf, want, MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n == 0)
        return FR_PEEK_EOF;
    if (n < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK) ? FR_PEEK_NONE
                                                         : FR_PEEK_EOF;
    return (size_t)n < want ? FR_PEEK_PARTIAL : FR_PEEK_FRAME;
}

void fr_boot_set_nodelay(int fd)
{
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void fr_boot_close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* "3,5,7" (or "3" with singular=1), cut short with ",..." when long. */
void fr_boot_fmt_ranks(char *buf, size_t cap, const int *ranks, int n)
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

const char *fr_boot_io_str(int io)
{
    switch (io) {
    case FR_IO_TIMEOUT: return "timed out";
    case FR_IO_EOF: return "connection closed";
    case FR_IO_FORGED:
        return "a frame failed its integrity check: the connection was "
               "tampered with";
    default: return "socket error";
    }
}

long fr_boot_peer_uid(int fd)
{
    struct sockaddr_in me, peer;
    socklen_t ml = sizeof(me), pl = sizeof(peer);
    if (getsockname(fd, (struct sockaddr *)&me, &ml) != 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &pl) != 0 ||
        me.sin_family != AF_INET || peer.sin_family != AF_INET)
        return -1;
    /* The peer's own socket: its local address is our peer's, its remote
     * ours (addresses as the kernel prints them: the raw 32 bits, then
     * the port). */
    char want_l[32], want_r[32], l[64], r[64], line[512];
    snprintf(want_l, sizeof(want_l), "%08X:%04X",
             (unsigned)peer.sin_addr.s_addr, (unsigned)ntohs(peer.sin_port));
    snprintf(want_r, sizeof(want_r), "%08X:%04X",
             (unsigned)me.sin_addr.s_addr, (unsigned)ntohs(me.sin_port));
    FILE *f = fopen("/proc/net/tcp", "re");
    if (!f)
        return -1;
    long uid = -1;
    while (uid < 0 && fgets(line, sizeof(line), f)) {
        unsigned long u;
        if (sscanf(line, " %*d: %63s %63s %*x %*x:%*x %*x:%*x %*x %lu", l, r,
                   &u) == 3 &&
            !strcasecmp(l, want_l) && !strcasecmp(r, want_r))
            uid = (long)u;
    }
    fclose(f);
    return uid;
}
