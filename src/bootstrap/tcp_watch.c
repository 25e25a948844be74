/*
 * The TCP bootstrap's watcher thread: every FR_WATCH_PERIOD_MS it try-locks
 * the handle and, with polls of timeout 0, looks at the head of each stream.
 * A socket closed without goodbye names a dead rank (the root also tells
 * every other rank); goodbyes (BYE, BYE_ACK) and DEAD notices found there
 * are consumed, and any collective's frame is left for the collective.
 * At the root it also turns away connections to the port that come after
 * the rendezvous.
 */
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../core/log.h"
#include "tcp.h"

/* A frame at the head of peer r's stream failed its integrity check: the
 * stream is unusable, and the next collective says why. */
static void fr_watch_forged(fr_boot_t *b, fr_conn_t *c, int r)
{
    c->state = FR_CONN_DESYNC;
    if (b->broken_rc == FERRY_OK) {
        b->broken_rc = FERRY_ERR_PROTOCOL;
        snprintf(b->broken_msg, sizeof(b->broken_msg),
                 "a frame from %s %d (%s) failed its integrity check: the "
                 "connection was tampered with",
                 r == 0 && b->rank != 0 ? "the root, rank" : "rank", r,
                 c->peer);
    }
    FR_LOG_WARN(FR_SUB_BOOT, "%s", b->broken_msg);
}

/* Connections to the root's port once its rendezvous is over: each hears
 * why it is turned away (a plain ABORT in place of the challenge, so that
 * a rank of another job, or a late one, fails at once saying so), then is
 * closed. A few per period, never waiting on one. */
static void fr_watch_late(fr_boot_t *b)
{
    if (b->lfd < 0)
        return;
    char msg[4 + sizeof(b->late_msg)];
    int32_t code = FERRY_ERR_BOOTSTRAP;
    size_t ml = strlen(b->late_msg);
    memcpy(msg, &code, 4);
    memcpy(msg + 4, b->late_msg, ml);
    for (int k = 0; k < 16; k++) {
        int fd = accept4(b->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;
        fr_frame_hdr_t h = {FR_MSG_ABORT, (uint32_t)(4 + ml)};
        struct iovec iov[2] = {{&h, sizeof(h)}, {msg, 4 + ml}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        (void)!sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        close(fd);
    }
}

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
            fr_conn_t *c = &b->conns[r];
            unsigned char buf[sizeof(fr_frame_hdr_t) + FR_SEAL_TAG_LEN] = {0};
            fr_frame_hdr_t h;
            int k = fr_boot_peek(c->fd, buf, sizeof(buf));
            memcpy(&h, buf, sizeof(h));
            if (k == FR_PEEK_EOF) {
                fr_boot_root_mark_dead(b, r);
            } else if (k == FR_PEEK_FRAME && h.type == FR_MSG_BYE &&
                       h.len == 0) {
                /* An early goodbye: the rank is in fr_boot_close. */
                if (fr_boot_open_mem(&c->seal, buf, NULL, 0) != FR_IO_OK) {
                    fr_watch_forged(b, c, r);
                } else if (recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT) ==
                           (ssize_t)sizeof(buf)) {
                    c->state = FR_CONN_BYE;
                    FR_LOG_INFO(FR_SUB_BOOT, "rank %d said goodbye", r);
                } else {
                    c->state = FR_CONN_DESYNC;
                }
            } else if (k != FR_PEEK_NONE && closed) {
                /* Closed behind unread data that is not a goodbye. */
                fr_boot_root_mark_dead(b, r);
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
        unsigned char buf[sizeof(fr_frame_hdr_t) + 4 + FR_SEAL_TAG_LEN] = {0};
        fr_frame_hdr_t h;
        int k = fr_boot_peek(c->fd, buf, sizeof(buf));
        if (k == FR_PEEK_EOF) {
            fr_boot_leaf_mark_root_dead(b);
            return;
        }
        if (k == FR_PEEK_NONE)
            return;
        memcpy(&h, buf, sizeof(h));
        if (k == FR_PEEK_FRAME &&
            (h.type == FR_MSG_DEAD || h.type == FR_MSG_BYE_ACK) &&
            h.len == 4) {
            int32_t r;
            if (fr_boot_open_mem(&c->seal, buf, &r, 4) != FR_IO_OK) {
                fr_watch_forged(b, c, 0);
                return;
            }
            if (recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT) !=
                (ssize_t)sizeof(buf)) {
                c->state = FR_CONN_DESYNC;
                return;
            }
            if (r >= 0 && r < b->size)
                fr_boot_record_dead(b, r);
            if (h.type == FR_MSG_BYE_ACK) {
                c->state = FR_CONN_BYE;
                FR_LOG_INFO(FR_SUB_BOOT, "root said goodbye");
                return;
            }
            continue;
        }
        /* A collective's frame (or a partial one): leave it. Behind a
         * closed socket it will never be answered: the root is gone. */
        if (closed)
            fr_boot_leaf_mark_root_dead(b);
        return;
    }
}

void *fr_boot_watcher_main(void *arg)
{
    fr_boot_t *b = arg;
    while (!__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) {
        if (b->rank == 0) /* the listener is the watcher's alone */
            fr_watch_late(b);
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
