/*
 * TCP bootstrap, rank 0 (the root): the rendezvous server. It listens, takes
 * every rank's hello (rejecting strangers, version or size mismatches and
 * duplicates) and answers READY, or ABORT naming who did not come; in an
 * allgather it collects one block per rank and hands the whole array back;
 * at close it waits for every rank's goodbye and answers it. A rank whose
 * socket closes without goodbye is dead, and every other rank is told.
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

/* ---------------------------------------------------------------------- */
/* Dead ranks and aborts                                                   */
/* ---------------------------------------------------------------------- */

/* Root: rank r's socket closed without goodbye. Tell everyone else. */
void fr_boot_root_mark_dead(fr_boot_t *b, int r)
{
    if (b->conns[r].state != FR_CONN_LIVE)
        return;
    b->conns[r].state = FR_CONN_DEAD;
    fr_boot_record_dead(b, r);
    int32_t who = r;
    for (int k = 1; k < b->size; k++) {
        fr_conn_t *c = &b->conns[k];
        if (k == r || (c->state != FR_CONN_LIVE && c->state != FR_CONN_BYE))
            continue;
        size_t moved = 0;
        int io = fr_boot_send_frame(c->fd, FR_MSG_DEAD, &who, sizeof(who),
                                    NULL, 0,
                                    fr_boot_now_ms() + FR_SHORT_SEND_MS,
                                    &moved);
        if (io == FR_IO_TIMEOUT && moved > 0)
            c->state = FR_CONN_DESYNC;
    }
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
        int io = fr_boot_send_frame(c->fd, FR_MSG_ABORT, buf, 4 + ml, NULL, 0,
                                    fr_boot_now_ms() + FR_SHORT_SEND_MS,
                                    &moved);
        if (io == FR_IO_TIMEOUT && moved > 0)
            c->state = FR_CONN_DESYNC;
    }
}

/* ---------------------------------------------------------------------- */
/* Waiting on the ranks' sockets                                           */
/* ---------------------------------------------------------------------- */

/* How fr_root_poll ended. */
enum {
    FR_POLL_DONE = 0, /* *left reached 0 (left NULL: no rank is live) */
    FR_POLL_STOPPED,  /* take() asked to stop */
    FR_POLL_DIED,     /* a rank closed without goodbye (stop_on_death) */
    FR_POLL_DEADLINE,
    FR_POLL_FAILED    /* poll() failed: errno says why */
};

/* Reads the frame at the head of rank r's stream. 0: go on; else stop. */
typedef int (*fr_root_take_fn)(fr_boot_t *b, int r, int64_t deadline,
                               void *arg);

/* The root's wait on its ranks, shared by the allgather and close: until
 * *left reaches 0 (left NULL: until no rank is live) or the deadline,
 * poll every live rank's socket. A socket closed without goodbye marks its
 * rank dead (and tells the others); anything else at the head of a stream
 * goes to take. stop_on_death: end at the first death instead of going
 * on. pf and who have room for b->size entries. */
static int fr_root_poll(fr_boot_t *b, struct pollfd *pf, int *who,
                        int64_t deadline, const int *left, int stop_on_death,
                        fr_root_take_fn take, void *arg)
{
    for (;;) {
        if (left && *left <= 0)
            return FR_POLL_DONE;
        int n = 0;
        for (int r = 1; r < b->size; r++)
            if (b->conns[r].state == FR_CONN_LIVE) {
                pf[n].fd = b->conns[r].fd;
                pf[n].events = POLLIN | POLLRDHUP;
                pf[n].revents = 0;
                who[n++] = r;
            }
        if (!left && n == 0)
            return FR_POLL_DONE;
        int k = poll(pf, (nfds_t)n, fr_boot_left_ms(deadline));
        if (k < 0 && errno != EINTR)
            return FR_POLL_FAILED;
        if (k <= 0) {
            if (fr_boot_now_ms() >= deadline)
                return FR_POLL_DEADLINE;
            continue;
        }
        for (int i = 0; i < n; i++) {
            int r = who[i];
            fr_conn_t *c = &b->conns[r];
            if (!pf[i].revents || c->state != FR_CONN_LIVE)
                continue;
            fr_frame_hdr_t h;
            int pk = fr_boot_peek(c->fd, &h, sizeof(h));
            if (pk == FR_PEEK_NONE)
                continue;
            if (pk == FR_PEEK_EOF) {
                fr_boot_root_mark_dead(b, r);
                if (stop_on_death)
                    return FR_POLL_DIED;
                continue;
            }
            if (take(b, r, deadline, arg) != 0)
                return FR_POLL_STOPPED;
        }
    }
}

/* ---------------------------------------------------------------------- */
/* Init                                                                    */
/* ---------------------------------------------------------------------- */

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
    fr_root_abort_all(b, FERRY_ERR_BOOTSTRAP, m);
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
            fr_root_abort_all(b, FERRY_ERR_BOOTSTRAP, err ? err->msg : "");
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

/* ---------------------------------------------------------------------- */
/* Allgather                                                               */
/* ---------------------------------------------------------------------- */

/* One allgather at the root, as fr_root_take_block advances it. */
typedef struct fr_root_gather {
    void *out;          /* [size][len] */
    size_t len;
    uint64_t seq;
    long tmo;
    unsigned char *got; /* [size]: rank r's block is in */
    int nleft;          /* blocks still to come */
    int rc;
    int notify;         /* on failure, ABORT to the live ranks */
    fr_err_t *err;
} fr_root_gather_t;

/* Rank r's frame during an allgather: its block, else the reason to fail. */
static int fr_root_take_block(fr_boot_t *b, int r, int64_t deadline,
                              void *arg)
{
    fr_root_gather_t *g = arg;
    fr_err_t *err = g->err;
    fr_conn_t *c = &b->conns[r];
    fr_frame_hdr_t h;
    size_t moved = 0;
    int io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline, &moved);
    if (io == FR_IO_OK && h.type == FR_MSG_DATA && !g->got[r] &&
        h.len == 8 + g->len) {
        uint64_t s;
        io = fr_boot_recv_all(c->fd, &s, 8, deadline, NULL);
        if (io == FR_IO_OK)
            io = fr_boot_recv_all(c->fd, (char *)g->out + (size_t)r * g->len,
                                  g->len, deadline, NULL);
        if (io == FR_IO_OK && s != g->seq) {
            g->rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                           "rank %d is in allgather #%llu, rank 0 in "
                           "#%llu (collectives called out of step)",
                           r, (unsigned long long)s,
                           (unsigned long long)g->seq);
            return 1;
        }
        if (io == FR_IO_OK) {
            g->got[r] = 1;
            g->nleft--;
            return 0;
        }
    } else if (io == FR_IO_OK) {
        /* Not a block for this allgather: skip it and fail. */
        io = fr_boot_discard(c->fd, h.len, deadline);
        if (io == FR_IO_OK) {
            if (h.type == FR_MSG_BYE) {
                c->state = FR_CONN_BYE;
                g->rc = FR_ERR(err, FERRY_ERR_PEER,
                               "rank %d called close during allgather "
                               "#%llu",
                               r, (unsigned long long)g->seq);
            } else if (h.type == FR_MSG_DATA && !g->got[r]) {
                g->rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                               "allgather #%llu: rank %d passed %u "
                               "bytes, rank 0 passed %zu",
                               (unsigned long long)g->seq, r,
                               h.len >= 8 ? h.len - 8 : 0, g->len);
            } else {
                g->rc = FR_ERR(err, FERRY_ERR_PROTOCOL,
                               "allgather #%llu: unexpected frame 0x%x "
                               "(%u bytes) from rank %d",
                               (unsigned long long)g->seq, h.type, h.len, r);
            }
            return 1;
        }
    }
    /* io failed in the middle of a frame. */
    if (io == FR_IO_TIMEOUT) {
        c->state = FR_CONN_DESYNC;
        g->rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                       "allgather #%llu timed out after %ld ms while "
                       "receiving from rank %d",
                       (unsigned long long)g->seq, g->tmo, r);
        return 1;
    }
    fr_boot_root_mark_dead(b, r);
    g->rc = fr_boot_err_dead(b, err);
    g->notify = 0;
    return 1;
}

/* The deadline passed: fail naming the ranks whose block is missing. who:
 * room for b->size ints. */
static int fr_root_gather_late(fr_boot_t *b, const fr_root_gather_t *g,
                               int *who)
{
    int nm = 0;
    for (int r = 1; r < b->size; r++)
        if (!g->got[r])
            who[nm++] = r;
    char list[160];
    fr_boot_fmt_ranks(list, sizeof(list), who, nm);
    return FR_ERR(g->err, FERRY_ERR_TIMEOUT,
                  "allgather #%llu timed out after %ld ms: %s %s of %d "
                  "had not sent their data",
                  (unsigned long long)g->seq, g->tmo,
                  nm == 1 ? "rank" : "ranks", list, b->size);
}

/* Everyone's block is in: hand out the whole array. */
static int fr_root_hand_out(fr_boot_t *b, fr_root_gather_t *g,
                            int64_t deadline)
{
    int rc = FERRY_OK;
    for (int r = 1; r < b->size; r++) {
        fr_conn_t *c = &b->conns[r];
        if (c->state != FR_CONN_LIVE)
            continue;
        size_t moved = 0;
        int io = fr_boot_send_frame(c->fd, FR_MSG_ALL, &g->seq, 8, g->out,
                                    (size_t)b->size * g->len, deadline,
                                    &moved);
        if (io == FR_IO_OK)
            continue;
        if (io == FR_IO_TIMEOUT) {
            c->state = FR_CONN_DESYNC;
            if (rc == FERRY_OK)
                rc = FR_ERR(g->err, FERRY_ERR_TIMEOUT,
                            "allgather #%llu timed out after %ld ms while "
                            "sending to rank %d",
                            (unsigned long long)g->seq, g->tmo, r);
        } else {
            fr_boot_root_mark_dead(b, r);
            if (rc == FERRY_OK)
                rc = fr_boot_err_dead(b, g->err);
        }
    }
    return rc;
}

int fr_boot_root_allgather(fr_boot_t *b, const void *in, void *out,
                           size_t len, long tmo, int64_t deadline,
                           fr_err_t *err)
{
    int size = b->size;
    fr_root_gather_t g = {.out = out, .len = len, .seq = b->seq, .tmo = tmo,
                          .rc = FERRY_OK, .notify = 1, .err = err};
    g.got = calloc((size_t)size, 1);
    struct pollfd *pf = calloc((size_t)size, sizeof(*pf));
    int *who = calloc((size_t)size, sizeof(int));
    if (!g.got || !pf || !who) {
        g.rc = FR_ERR(err, FERRY_ERR_NOMEM, "allgather: out of memory");
        goto out;
    }
    if (len && out != in)
        memmove(out, in, len);
    g.got[0] = 1;
    for (int r = 1; r < size; r++) {
        int st = b->conns[r].state;
        if (st == FR_CONN_DEAD) {
            g.rc = fr_boot_err_dead(b, err);
            g.notify = 0;
            goto out;
        }
        if (st != FR_CONN_LIVE) {
            g.rc = FR_ERR(err, FERRY_ERR_PEER,
                          "rank %d has left the bootstrap (%s)", r,
                          st == FR_CONN_BYE ? "it called close"
                                            : "its stream broke earlier");
            goto out;
        }
        g.nleft++;
    }
    switch (fr_root_poll(b, pf, who, deadline, &g.nleft, 1,
                         fr_root_take_block, &g)) {
    case FR_POLL_DONE:
        g.rc = fr_root_hand_out(b, &g, deadline);
        g.notify = 0; /* the others got their answer */
        break;
    case FR_POLL_DIED:
        g.rc = fr_boot_err_dead(b, err);
        g.notify = 0;
        break;
    case FR_POLL_DEADLINE:
        g.rc = fr_root_gather_late(b, &g, who);
        break;
    case FR_POLL_FAILED:
        g.rc = FR_ERR(err, FERRY_ERR_SYSTEM, "poll: %s", strerror(errno));
        break;
    default: /* FR_POLL_STOPPED: g says why */
        break;
    }
out:
    if (g.rc != FERRY_OK && g.notify)
        fr_root_abort_all(b, g.rc, err ? err->msg : ferry_strerror(g.rc));
    free(g.got);
    free(pf);
    free(who);
    return g.rc;
}

/* ---------------------------------------------------------------------- */
/* Close                                                                   */
/* ---------------------------------------------------------------------- */

/* Rank r's frame while the root closes: its goodbye, or a stale collective
 * frame to skip. */
static int fr_root_take_bye(fr_boot_t *b, int r, int64_t deadline, void *arg)
{
    fr_conn_t *c = &b->conns[r];
    fr_frame_hdr_t h;
    int io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline, NULL);
    if (io == FR_IO_OK)
        io = fr_boot_discard(c->fd, h.len, deadline);
    if (io == FR_IO_OK && h.type == FR_MSG_BYE)
        c->state = FR_CONN_BYE;
    else if (io == FR_IO_TIMEOUT)
        c->state = FR_CONN_DESYNC;
    else if (io != FR_IO_OK)
        fr_boot_root_mark_dead(b, r);
    return 0;
}

int fr_boot_root_close(fr_boot_t *b, long tmo, int64_t deadline,
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
    (void)fr_root_poll(b, pf, who, deadline, NULL, 0, fr_root_take_bye, NULL);
    /* Goodbye to everyone still there, with the dead rank if any. */
    int32_t d = __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE);
    int nd = 0, nm = 0;
    int *dead = who, *missing = (int *)pf; /* reuse: size ints each */
    for (int r = 1; r < size; r++) {
        fr_conn_t *c = &b->conns[r];
        if (c->state == FR_CONN_LIVE || c->state == FR_CONN_BYE)
            (void)fr_boot_send_frame(c->fd, FR_MSG_BYE_ACK, &d, 4, NULL, 0,
                                     fr_boot_now_ms() + FR_SHORT_SEND_MS,
                                     NULL);
        if (c->state == FR_CONN_DEAD)
            dead[nd++] = r;
        else if (c->state != FR_CONN_BYE)
            missing[nm++] = r;
    }
    int rc = FERRY_OK;
    char dl[160], ml[160];
    fr_boot_fmt_ranks(dl, sizeof(dl), dead, nd);
    fr_boot_fmt_ranks(ml, sizeof(ml), missing, nm);
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
