/*
 * TCP bootstrap, rank 0's rendezvous: listen on the root port, accept
 * connections and read each one's hello (rejecting strangers, version or
 * world-size mismatches and duplicate ranks, and telling them why), then
 * answer READY to every rank, or ABORT naming the ranks that did not come
 * within the bootstrap timeout.
 */
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../core/log.h"
#include "tcp.h"

/* Bind the root's port (waiting out EADDRINUSE until deadline) and listen;
 * *lfd is the socket, to close, whatever the outcome. */
static int fr_root_listen(fr_boot_t *b, const fr_boot_env_t *env,
                          int64_t deadline, int *lfd, fr_err_t *err)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)env->root_port);
    *lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (*lfd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket: %s", strerror(errno));
    int one = 1;
    (void)setsockopt(*lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    for (;;) {
        if (bind(*lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            break;
        int e = errno;
        if (e != EADDRINUSE || fr_boot_now_ms() >= deadline)
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                          "rank 0 cannot listen on %s: %s (set FERRY_ROOT to "
                          "a free port)",
                          b->root_addr, strerror(e));
        fr_boot_sleep_ms(FR_RETRY_MS);
    }
    if (listen(*lfd, b->size < 1024 ? b->size : 1024) != 0)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP, "listen on %s: %s",
                      b->root_addr, strerror(errno));
    FR_LOG_INFO(FR_SUB_BOOT, "root listening on %s for %d ranks",
                b->root_addr, b->size - 1);
    return FERRY_OK;
}

/* Why the root refuses a well-formed hello (why[0] == '\0': it does not). */
static void fr_root_check_hello(const fr_boot_t *b, const fr_hello_t *hi,
                                char *why, size_t cap)
{
    why[0] = '\0';
    if (hi->version != FR_BOOT_WIRE_VERSION)
        snprintf(why, cap, "rank %d speaks bootstrap version %u, root %u",
                 (int)hi->rank, hi->version, FR_BOOT_WIRE_VERSION);
    else if (hi->size != b->size)
        snprintf(why, cap, "rank %d (pid %d) has world size %d, root has %d",
                 (int)hi->rank, (int)hi->pid, (int)hi->size, b->size);
    else if (hi->rank <= 0 || hi->rank >= b->size)
        snprintf(why, cap, "a peer claims rank %d of %d", (int)hi->rank,
                 b->size);
    else if (b->conns[hi->rank].state != FR_CONN_NONE)
        snprintf(why, cap, "rank %d connected twice (pid %d, then pid %d)",
                 (int)hi->rank, b->conns[hi->rank].pid, (int)hi->pid);
}

/* Read the hello on an accepted socket fd: the rank it names arrives
 * (*arrived grows), or fd is dropped (closed; a rejection is noted in
 * notes, and told to the peer). */
static void fr_root_hello(fr_boot_t *b, int fd, int64_t deadline,
                          int *arrived, char *notes, size_t ncap)
{
    fr_frame_hdr_t h;
    fr_hello_t hi;
    memset(&hi, 0, sizeof(hi));
    int64_t dl = fr_boot_now_ms() + 1000;
    if (dl > deadline)
        dl = deadline;
    int io = fr_boot_recv_all(fd, &h, sizeof(h), dl, NULL);
    if (io == FR_IO_OK && h.type == FR_MSG_HELLO && h.len == sizeof(hi))
        io = fr_boot_recv_all(fd, &hi, sizeof(hi), dl, NULL);
    else if (io == FR_IO_OK)
        io = FR_IO_ERR;
    if (io != FR_IO_OK || hi.magic != FR_BOOT_MAGIC) {
        FR_LOG_WARN(FR_SUB_BOOT, "root: dropped a connection that "
                                 "sent no ferry hello (%s)",
                    io == FR_IO_OK ? "bad magic" : fr_boot_io_str(io));
        close(fd);
        return;
    }
    char why[200];
    fr_root_check_hello(b, &hi, why, sizeof(why));
    if (why[0]) {
        FR_LOG_WARN(FR_SUB_BOOT, "root rejected a peer: %s", why);
        int32_t c32 = FERRY_ERR_BOOTSTRAP;
        char msg[240];
        memcpy(msg, &c32, 4);
        size_t wl = strlen(why);
        memcpy(msg + 4, why, wl);
        (void)fr_boot_send_frame(fd, FR_MSG_ABORT, msg, 4 + wl, NULL, 0,
                                 fr_boot_now_ms() + 200, NULL);
        close(fd);
        size_t nl = strlen(notes);
        if (nl + 4 < ncap)
            snprintf(notes + nl, ncap - nl, "; rejected: %s", why);
        return;
    }
    b->conns[hi.rank].fd = fd;
    b->conns[hi.rank].state = FR_CONN_LIVE;
    b->conns[hi.rank].pid = hi.pid;
    (*arrived)++;
    FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d (pid %d) arrived, %d of %d",
                 (int)hi.rank, (int)hi.pid, *arrived, b->size - 1);
}

/* Accept every waiting connection into pend (beyond FR_MAX_PENDING: close). */
static void fr_root_accept(int lfd, int *pend, int *npend)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            break;
        if (*npend == FR_MAX_PENDING) {
            close(fd);
            continue;
        }
        fr_boot_set_nodelay(fd);
        pend[(*npend)++] = fd;
    }
}

/* Accept and read hellos until every rank arrived or the deadline passed.
 * pend: accepted sockets whose hello is not read yet. */
static int fr_root_meet(fr_boot_t *b, int lfd, int *pend, int *npend,
                        int *arrived, int64_t deadline, char *notes,
                        size_t ncap, fr_err_t *err)
{
    while (*arrived < b->size - 1) {
        struct pollfd pf[1 + FR_MAX_PENDING];
        pf[0].fd = lfd;
        pf[0].events = POLLIN;
        pf[0].revents = 0;
        for (int i = 0; i < *npend; i++) {
            pf[1 + i].fd = pend[i];
            pf[1 + i].events = POLLIN;
            pf[1 + i].revents = 0;
        }
        int n = poll(pf, (nfds_t)(1 + *npend), fr_boot_left_ms(deadline));
        if (n < 0 && errno != EINTR)
            return FR_ERR(err, FERRY_ERR_SYSTEM, "poll: %s", strerror(errno));
        if (n <= 0) {
            if (fr_boot_now_ms() >= deadline)
                break;
            continue;
        }
        /* Hellos first (pf indexes pend as it was). */
        for (int i = *npend - 1; i >= 0; i--) {
            if (!pf[1 + i].revents)
                continue;
            int fd = pend[i];
            pend[i] = pend[--*npend];
            fr_root_hello(b, fd, deadline, arrived, notes, ncap);
        }
        if (pf[0].revents)
            fr_root_accept(lfd, pend, npend);
    }
    return FERRY_OK;
}

/* Not every rank arrived in time: fail naming them, and tell the ranks that
 * did (and those whose hello is still unread) why. */
static int fr_root_no_show(fr_boot_t *b, long timeout_ms, const char *notes,
                           const int *pend, int npend, fr_err_t *err)
{
    int *miss = malloc(sizeof(int) * (size_t)b->size);
    int nm = 0;
    char list[160] = "?";
    if (miss) {
        for (int r = 1; r < b->size; r++)
            if (b->conns[r].state == FR_CONN_NONE)
                miss[nm++] = r;
        fr_boot_fmt_ranks(list, sizeof(list), miss, nm);
    }
    free(miss);
    int rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                    "%s %s of %d did not connect to %s within %ld ms%s",
                    nm == 1 ? "rank" : "ranks", list, b->size, b->root_addr,
                    timeout_ms, notes);
    const char *m = err ? err->msg : "timeout";
    fr_boot_root_abort_all(b, FERRY_ERR_BOOTSTRAP, m);
    /* Late arrivals whose hello is not read yet hear it too. */
    int32_t c32 = FERRY_ERR_BOOTSTRAP;
    size_t ml = strlen(m);
    for (int i = 0; i < npend; i++)
        (void)fr_boot_send_frame(pend[i], FR_MSG_ABORT, &c32, 4, m, ml,
                                 fr_boot_now_ms() + 100, NULL);
    return rc;
}

/* Everyone arrived: READY to each rank. */
static int fr_root_ready(fr_boot_t *b, fr_err_t *err)
{
    for (int r = 1; r < b->size; r++) {
        int io = fr_boot_send_frame(b->conns[r].fd, FR_MSG_READY, NULL, 0,
                                    NULL, 0,
                                    fr_boot_now_ms() + FR_SHORT_SEND_MS, NULL);
        if (io != FR_IO_OK) {
            b->conns[r].state = FR_CONN_DEAD;
            int rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                            "rank %d left during the bootstrap at %s (%s)", r,
                            b->root_addr, fr_boot_io_str(io));
            fr_boot_root_abort_all(b, FERRY_ERR_BOOTSTRAP,
                                   err ? err->msg : "");
            return rc;
        }
    }
    return FERRY_OK;
}

int fr_boot_root_init(fr_boot_t *b, const fr_boot_env_t *env, long timeout_ms,
                      int64_t deadline, fr_err_t *err)
{
    int lfd = -1;
    int pend[FR_MAX_PENDING];
    int npend = 0, arrived = 0;
    char notes[256] = "";
    snprintf(b->root_addr, sizeof(b->root_addr), "0.0.0.0:%d",
             env->root_port);

    int rc = fr_root_listen(b, env, deadline, &lfd, err);
    if (rc == FERRY_OK)
        rc = fr_root_meet(b, lfd, pend, &npend, &arrived, deadline, notes,
                          sizeof(notes), err);
    if (rc == FERRY_OK)
        rc = arrived < b->size - 1
                 ? fr_root_no_show(b, timeout_ms, notes, pend, npend, err)
                 : fr_root_ready(b, err);
    for (int i = 0; i < npend; i++)
        close(pend[i]);
    fr_boot_close_fd(&lfd);
    return rc;
}
