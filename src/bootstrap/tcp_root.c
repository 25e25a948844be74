/*
 * TCP bootstrap, rank 0 (the root) once every rank has arrived (the
 * rendezvous itself: tcp_root_init.c). In an allgather it collects one
 * block per rank and hands the whole array back; at close it waits for
 * every rank's goodbye and answers it. Both wait on the ranks' sockets
 * through one poll loop, in which a rank whose socket closes without
 * goodbye is dead, and every other rank is told.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        int io = fr_boot_seal_send(c, FR_MSG_DEAD, &who, sizeof(who), NULL, 0,
                                   fr_boot_now_ms() + FR_SHORT_SEND_MS,
                                   &moved);
        if (io == FR_IO_TIMEOUT && moved > 0)
            c->state = FR_CONN_DESYNC;
    }
}

/* Root: send ABORT(code, msg) to every live rank (best effort). */
void fr_boot_root_abort_all(fr_boot_t *b, int code, const char *msg)
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
        int io = fr_boot_seal_send(c, FR_MSG_ABORT, buf, 4 + ml, NULL, 0,
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

/* Rank r's frame failed its integrity check: what it sends is unusable
 * from now on (the bootstrap is marked broken by the caller); what rank 0
 * sends it still arrives, so it hears the ABORT that follows. */
static int fr_root_forged(fr_boot_t *b, int r, const char *when,
                          fr_err_t *err)
{
    fr_conn_t *c = &b->conns[r];
    return FR_ERR(err, FERRY_ERR_PROTOCOL,
                  "%s: a frame from rank %d (%s) failed its integrity check: "
                  "the connection was tampered with (something between that "
                  "rank and rank 0 changed, dropped, reordered or repeated a "
                  "frame)",
                  when, r, c->peer);
}

/* Rank r's frame during an allgather: its block, else the reason to fail. */
static int fr_root_take_block(fr_boot_t *b, int r, int64_t deadline,
                              void *arg)
{
    fr_root_gather_t *g = arg;
    fr_err_t *err = g->err;
    fr_conn_t *c = &b->conns[r];
    fr_frame_hdr_t h;
    size_t moved = 0;
    char when[64];
    snprintf(when, sizeof(when), "allgather #%llu",
             (unsigned long long)g->seq);
    int io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline, &moved);
    if (io == FR_IO_OK && h.type == FR_MSG_DATA && !g->got[r] &&
        h.len == 8 + g->len) {
        uint64_t s;
        io = fr_boot_open_body(c, &h, &s, 8,
                               (char *)g->out + (size_t)r * g->len, g->len,
                               NULL, deadline);
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
        /* Not a block for this allgather: skip it (checked) and fail. */
        io = fr_boot_open_body(c, &h, NULL, 0, NULL, 0, NULL, deadline);
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
    if (io == FR_IO_FORGED) {
        g->rc = fr_root_forged(b, r, when, err);
        return 1;
    }
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
    fr_sealed_all_t all;
    if (fr_boot_seal_all(&b->group, g->seq, g->out, (size_t)b->size * g->len,
                         &all) != 0)
        return FR_ERR(g->err, FERRY_ERR_NOMEM, "allgather #%llu: out of "
                                               "memory for the answer",
                      (unsigned long long)g->seq);
    for (int r = 1; r < b->size; r++) {
        fr_conn_t *c = &b->conns[r];
        if (c->state != FR_CONN_LIVE)
            continue;
        size_t moved = 0;
        int io = fr_boot_seal_send_all(c, &all, deadline, &moved);
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
    free(all.body);
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
        fr_boot_root_abort_all(b, g.rc,
                               err ? err->msg : ferry_strerror(g.rc));
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
        io = fr_boot_open_body(c, &h, NULL, 0, NULL, 0, NULL, deadline);
    if (io == FR_IO_OK && h.type == FR_MSG_BYE)
        c->state = FR_CONN_BYE;
    else if (io == FR_IO_FORGED) {
        fr_err_t e;
        (void)fr_root_forged(b, r, "close", &e);
        FR_LOG_WARN(FR_SUB_BOOT, "%s", e.msg);
    }
    if (io == FR_IO_FORGED || io == FR_IO_TIMEOUT)
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
            (void)fr_boot_seal_send(c, FR_MSG_BYE_ACK, &d, 4, NULL, 0,
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
