/*
 * TCP bootstrap, every rank but 0 (a leaf): dial the root, make it prove it
 * knows the job's key, prove it back in the hello (tcp_auth.c has the
 * MACs), wait for its ACK (dialling again on a close before it), then
 * wait for READY or the root's ABORT; in an allgather send this rank's
 * block and read the root's answer (the whole array, or why not: a dead
 * rank, an abort, the root's goodbye); at close say goodbye and wait for
 * the root's.
 */
#include <errno.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "keyfile.h"
#include "tcp.h"

/* Non-root: the root's socket closed without goodbye. */
void fr_boot_leaf_mark_root_dead(fr_boot_t *b)
{
    if (b->conns[0].state != FR_CONN_LIVE)
        return;
    b->conns[0].state = FR_CONN_DEAD;
    fr_boot_record_dead(b, 0);
}

/* The largest payload of a frame the root sends but ALL: an ABORT. */
#define FR_LEAF_SMALL (4 + FR_ERRMSG_LEN + 64)

/* The payload of sealed frame h from the root into buf (room for cap
 * bytes, plus a '\0' after it). A payload longer than any the root sends
 * is tampering, as is a tag that does not match. */
static int fr_leaf_open_small(fr_conn_t *c, const fr_frame_hdr_t *h,
                              char *buf, size_t cap, int64_t deadline)
{
    if (h->len > cap || h->len > FR_LEAF_SMALL)
        return FR_IO_FORGED;
    int io = fr_boot_open_body(c, h, buf, h->len, NULL, 0, NULL, deadline);
    buf[io == FR_IO_OK ? h->len : 0] = '\0';
    return io;
}

/* An ABORT's payload (opened): its status and text. */
static void fr_parse_abort(const char *pl, uint32_t len, int *code,
                           const char **text)
{
    int32_t c32 = FERRY_ERR_BOOTSTRAP;
    if (len >= 4)
        memcpy(&c32, pl, 4);
    *code = c32 < 0 ? c32 : FERRY_ERR_BOOTSTRAP;
    *text = len >= 4 ? pl + 4 : "";
}

/* A frame from the root failed its integrity check (or could not be one
 * the root sends): the stream is unusable. */
static int fr_leaf_forged(fr_boot_t *b, const char *what, fr_err_t *err)
{
    if (b->conns[0].state == FR_CONN_LIVE)
        b->conns[0].state = FR_CONN_DESYNC;
    return FR_ERR(err, FERRY_ERR_PROTOCOL,
                  "rank %d: %s from root %s failed its integrity check: the "
                  "connection was tampered with (something between this "
                  "rank and the root changed, dropped, reordered or "
                  "repeated a frame)",
                  b->rank, what, b->root_addr);
}

/* Connect once to any address of host:port before deadline. */
static int fr_dial(const char *host, int port, int64_t deadline, int *lasterr,
                   char *gaierr, size_t gcap)
{
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET; /* the root listens on an IPv4 address */
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
            int r = fr_boot_wait_fd(fd, POLLOUT, dl);
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

/* How one try at meeting the root ended, when not with a ferry status. */
enum { FR_TRY_OK = 0, FR_TRY_AGAIN = 1 };

/* The root ended the bootstrap before this rank authenticated, saying
 * text: for a job with a key file, rank 0's failure note says more. */
static int fr_leaf_ended(fr_boot_t *b, const fr_boot_env_t *env,
                         const char *text, int proved, fr_err_t *err)
{
    char failed[FR_ERRMSG_LEN];
    if (!env->has_key && fr_boot_key_failed(env, env->root_host,
                                            env->root_port, failed,
                                            sizeof(failed)))
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP, "rank %d: %s", b->rank,
                      failed);
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP, "root %s ended the bootstrap%s: %s",
                  b->root_addr, proved ? "" : " (before proving itself)",
                  text);
}

/* The root's port answered with an ABORT in place of a challenge: its
 * rendezvous is over, or it is failing. */
static int fr_leaf_turned_away(fr_boot_t *b, const fr_boot_env_t *env,
                               const char *text, fr_err_t *err)
{
    char mine[300];
    if (env->has_key)
        snprintf(mine, sizeof(mine), "if both are one job, check that "
                                     "every rank has the same %s",
                 fr_cfg_name(FR_CFG_SECRET));
    else
        snprintf(mine, sizeof(mine), "this rank's job is '%.160s' (from "
                                     "%s): if both are one job, give every "
                                     "rank the same %s",
                 env->job, env->job_from ? env->job_from : "?",
                 fr_cfg_name(FR_CFG_JOB_ID));
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "rank %d was turned away by the root at %s: %s. Give this "
                  "job another %s port; %s",
                  b->rank, b->root_addr, text, fr_cfg_name(FR_CFG_ROOT),
                  mine);
}

/* Read the next plain start-up frame from the root (CHALLENGE, PROOF):
 * want_type with exactly len bytes into p. FR_TRY_AGAIN when the
 * connection closed (why says so); an ABORT or anything unexpected is an
 * error. The root has not proved itself yet: its words are quoted as
 * such. */
static int fr_leaf_expect(fr_boot_t *b, const fr_boot_env_t *env, int fd,
                          uint32_t want_type, void *p, uint32_t len,
                          const char *what, long timeout_ms,
                          int64_t deadline, char *why, size_t wcap,
                          fr_err_t *err)
{
    fr_frame_hdr_t h;
    int io = fr_boot_recv_all(fd, &h, sizeof(h), deadline, NULL);
    if (io == FR_IO_OK && h.type == FR_MSG_ABORT && h.len <= FR_LEAF_SMALL) {
        char pl[FR_LEAF_SMALL + 1];
        io = fr_boot_recv_all(fd, pl, h.len, deadline, NULL);
        if (io == FR_IO_OK) {
            int code;
            const char *text;
            pl[h.len] = '\0';
            fr_parse_abort(pl, h.len, &code, &text);
            if (want_type == FR_MSG_CHALLENGE)
                return fr_leaf_turned_away(b, env, text, err);
            return fr_leaf_ended(b, env, text, 0, err);
        }
    } else if (io == FR_IO_OK && h.type == want_type && h.len == len) {
        io = fr_boot_recv_all(fd, p, len, deadline, NULL);
    } else if (io == FR_IO_OK) {
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: root %s sent frame 0x%x of %u bytes instead "
                      "of the %s: not a ferry root of this version (another "
                      "program on that port?)",
                      b->rank, b->root_addr, h.type, h.len, what);
    }
    if (io == FR_IO_TIMEOUT)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: root %s sent no %s within %ld ms (another "
                      "program on that port, or an older ferry?)",
                      b->rank, b->root_addr, what, timeout_ms);
    if (io != FR_IO_OK) {
        snprintf(why, wcap, "connection closed before the %s (%s)", what,
                 fr_boot_io_str(io));
        return FR_TRY_AGAIN;
    }
    return FR_TRY_OK;
}

/* The next sealed frame from the root, once it has proved itself: want_type
 * with exactly len bytes into p (len <= FR_LEAF_SMALL). An ABORT is the
 * root's word; a frame that fails its check is tampering. again: a close
 * means dial again (FR_TRY_AGAIN, why says so); else it is an error. */
static int fr_leaf_expect_sealed(fr_boot_t *b, const fr_boot_env_t *env,
                                 fr_conn_t *c,
                                 uint32_t want_type, void *p, uint32_t len,
                                 const char *what, int again,
                                 long timeout_ms, int64_t deadline, char *why,
                                 size_t wcap, fr_err_t *err)
{
    fr_frame_hdr_t h;
    char pl[FR_LEAF_SMALL + 1];
    int io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline, NULL);
    int want = io == FR_IO_OK && h.type == want_type && h.len == len;
    if (io == FR_IO_OK && (want || h.type == FR_MSG_ABORT))
        io = fr_leaf_open_small(c, &h, pl, sizeof(pl) - 1, deadline);
    else if (io == FR_IO_OK)
        io = FR_IO_FORGED; /* no root of this version sends it */
    if (io == FR_IO_FORGED)
        return fr_leaf_forged(b, what, err);
    if (io == FR_IO_OK && want) {
        if (len)
            memcpy(p, pl, len);
        fr_boot_wipe(pl, sizeof(pl));
        return FR_TRY_OK;
    }
    if (io == FR_IO_OK) {
        int code;
        const char *text;
        fr_parse_abort(pl, h.len, &code, &text);
        if (again) /* not bound yet: the text is rank 0's fixed one */
            return fr_leaf_ended(b, env, text, 1, err);
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "root %s ended the bootstrap: %s", b->root_addr, text);
    }
    if (io == FR_IO_TIMEOUT)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d reached root %s, but no %s came within %ld ms "
                      "(not every rank arrived?)",
                      b->rank, b->root_addr, what, timeout_ms);
    if (again) {
        snprintf(why, wcap, "connection closed before the %s (%s)", what,
                 fr_boot_io_str(io));
        return FR_TRY_AGAIN;
    }
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "rank %d: root %s closed the connection during the "
                  "bootstrap (%s)",
                  b->rank, b->root_addr, fr_boot_io_str(io));
}

/* This rank cannot use the root's key (err says why): tell the root, so
 * that it need not wait for this rank, and leave. */
static int fr_leaf_nokey(fr_boot_t *b, const fr_boot_env_t *env, int fd,
                         int rc, fr_err_t *err)
{
    fr_nokey_t nk;
    memset(&nk, 0, sizeof(nk));
    nk.rank = b->rank;
    nk.size = b->size;
    nk.pid = (int32_t)getpid();
    fr_boot_key_job_hash(env, nk.job);
    snprintf(nk.job_id, sizeof(nk.job_id), "%.71s", env->job);
    snprintf(nk.text, sizeof(nk.text), "%.239s", err ? err->msg : "");
    (void)fr_boot_send_frame(fd, FR_MSG_NOKEY, &nk, sizeof(nk), NULL, 0,
                             fr_boot_now_ms() + 100, NULL);
    return rc;
}

/* The job's key as the root's challenge ch says it comes: this rank's
 * secret, or the root's key file for this run. */
static int fr_leaf_key(fr_boot_t *b, const fr_boot_env_t *env, int fd,
                       const fr_challenge_t *ch, fr_err_t *err)
{
    if (env->has_key && ch->keysrc == FR_KEYSRC_FILE)
        return fr_leaf_nokey(
            b, env, fd,
            FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                   "rank %d has %s, but root %s (pid %d) has none (it uses "
                   "a key file): give every rank the same %s",
                   b->rank, fr_cfg_name(FR_CFG_SECRET), b->root_addr,
                   (int)ch->root_pid, fr_cfg_name(FR_CFG_SECRET)),
            err);
    if (env->has_key)
        return FERRY_OK;
    /* The key file is named by the address the root bound: the one this
     * socket reached. */
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    char ip[INET_ADDRSTRLEN] = "0.0.0.0";
    if (getpeername(fd, (struct sockaddr *)&sa, &sl) == 0)
        inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
    int rc = fr_boot_key_load(env, ip, env->root_port, ch, b->key, err);
    return rc == FERRY_OK ? rc : fr_leaf_nokey(b, env, fd, rc, err);
}

/* Both proofs on a connected socket, then the hello: the root proves it
 * knows the key before this rank sends anything but a nonce. Then the
 * connection's seal is made, and the ACK must come sealed. */
static int fr_leaf_auth(fr_boot_t *b, const fr_boot_env_t *env, fr_conn_t *c,
                        long timeout_ms, int64_t deadline, char *why,
                        size_t wcap, fr_err_t *err)
{
    int fd = c->fd;
    fr_challenge_t ch;
    int rc = fr_leaf_expect(b, env, fd, FR_MSG_CHALLENGE, &ch, sizeof(ch),
                            "challenge", timeout_ms, deadline, why, wcap,
                            err);
    if (rc != FR_TRY_OK)
        return rc;
    if (ch.magic != FR_BOOT_MAGIC || ch.version != FR_BOOT_WIRE_VERSION)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: root %s is not a ferry root speaking "
                      "bootstrap version %u (magic 0x%x, version %u)",
                      b->rank, b->root_addr, FR_BOOT_WIRE_VERSION, ch.magic,
                      ch.version);
    if ((rc = fr_leaf_key(b, env, fd, &ch, err)) != FERRY_OK)
        return rc;
    unsigned char nl[FR_BOOT_NONCE_LEN], proof[FR_BOOT_MAC_LEN],
        want[FR_BOOT_MAC_LEN];
    if (fr_boot_random(nl, sizeof(nl)) != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "no random bytes: %s",
                      strerror(errno));
    int io = fr_boot_send_frame(fd, FR_MSG_NONCE, nl, sizeof(nl), NULL, 0,
                                deadline, NULL);
    if (io != FR_IO_OK) {
        snprintf(why, wcap, "sending the nonce failed (%s)",
                 fr_boot_io_str(io));
        return FR_TRY_AGAIN;
    }
    rc = fr_leaf_expect(b, env, fd, FR_MSG_PROOF, proof, sizeof(proof),
                        "proof", timeout_ms, deadline, why, wcap, err);
    if (rc != FR_TRY_OK)
        return rc;
    fr_boot_mac_root(b->key, ch.nonce, nl, want);
    if (!fr_boot_ct_equal(proof, want, sizeof(want))) {
        (void)fr_boot_send_frame(fd, FR_MSG_AUTH_FAIL, NULL, 0, NULL, 0,
                                 fr_boot_now_ms() + 100, NULL);
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d: authentication failed: root %s did not prove "
                      "it knows this job's secret (FERRY_SECRET differs "
                      "between ranks, or another program listens on that "
                      "port); no setup data was sent",
                      b->rank, b->root_addr);
    }
    fr_hello_t hi;
    memset(&hi, 0, sizeof(hi));
    hi.magic = FR_BOOT_MAGIC;
    hi.version = FR_BOOT_WIRE_VERSION;
    hi.rank = b->rank;
    hi.size = b->size;
    hi.pid = (int32_t)getpid();
    hi.lib_version = FERRY_VERSION_CODE;
    fr_boot_mac_hello(b->key, ch.nonce, nl, &hi, hi.mac);
    fr_boot_seal_keys(&c->seal, b->key, ch.nonce, nl, 0);
    io = fr_boot_send_frame(fd, FR_MSG_HELLO, &hi, sizeof(hi), NULL, 0,
                            deadline, NULL);
    if (io != FR_IO_OK) {
        snprintf(why, wcap, "sending the hello failed (%s)",
                 fr_boot_io_str(io));
        return FR_TRY_AGAIN;
    }
    /* Until the ACK the root may still drop this connection unread (a
     * flood evicted it, or its authentication time ran out): a close before
     * the ACK means dial again. */
    return fr_leaf_expect_sealed(b, env, c, FR_MSG_ACK, NULL, 0, "ack", 1,
                                 timeout_ms, deadline, why, wcap, err);
}

/* Dial and authenticate until it works, fails for good, or the deadline:
 * a connection the root drops before its ACK (it was too slow, or evicted
 * by a flood of strangers) is simply made again. */
static int fr_leaf_meet(fr_boot_t *b, const fr_boot_env_t *env,
                        long timeout_ms, int64_t deadline, fr_err_t *err)
{
    int lasterr = 0, tries = 0;
    char gaierr[128] = "", why[160] = "";
    fr_conn_t *c = &b->conns[0];
    for (;;) {
        tries++;
        int fd = fr_dial(env->root_host, env->root_port, deadline, &lasterr,
                         gaierr, sizeof(gaierr));
        if (fd >= 0) {
            fr_boot_set_nodelay(fd);
            why[0] = '\0';
            c->fd = fd;
            int rc = fr_leaf_auth(b, env, c, timeout_ms, deadline, why,
                                  sizeof(why), err);
            if (rc == FR_TRY_OK) {
                c->state = FR_CONN_LIVE;
                snprintf(c->peer, sizeof(c->peer), "%.63s", b->root_addr);
                return FERRY_OK;
            }
            fr_boot_close_fd(&c->fd);
            fr_boot_seal_wipe(&c->seal);
            if (rc != FR_TRY_AGAIN)
                return rc;
            FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d: %s; connecting again",
                         b->rank, why);
        }
        /* Nobody listens: has this job's rank 0 already failed? */
        char failed[FR_ERRMSG_LEN];
        if (fd < 0 && !env->has_key &&
            fr_boot_key_failed(env, env->root_host, env->root_port, failed,
                               sizeof(failed)))
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP, "rank %d: %s", b->rank,
                          failed);
        if (fr_boot_now_ms() >= deadline)
            break;
        fr_boot_sleep_ms(FR_RETRY_MS);
    }
    if (why[0])
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d could not meet root %s within %ld ms (%d "
                      "tries, last: %s)",
                      b->rank, b->root_addr, timeout_ms, tries, why);
    if (gaierr[0])
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank %d cannot resolve root host '%s' (%s) within "
                      "%ld ms",
                      b->rank, env->root_host, gaierr, timeout_ms);
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "rank %d could not connect to root %s within %ld ms "
                  "(%d tries, last error: %s)",
                  b->rank, b->root_addr, timeout_ms, tries, strerror(lasterr));
}

int fr_boot_leaf_init(fr_boot_t *b, const fr_boot_env_t *env, long timeout_ms,
                      int64_t deadline, fr_err_t *err)
{
    snprintf(b->root_addr, sizeof(b->root_addr), "%s:%d", env->root_host,
             env->root_port);
    int rc = FERRY_OK;
    if (!env->has_key) /* the key folder's trouble, said before dialling */
        rc = fr_boot_key_check_dir(err);
    if (rc == FERRY_OK)
        rc = fr_leaf_meet(b, env, timeout_ms, deadline, err);
    fr_boot_wipe(b->key, sizeof(b->key));
    if (rc != FERRY_OK)
        return rc;
    FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d authenticated with %s, waiting for "
                              "the rest",
                 b->rank, b->root_addr);

    /* The root gives up at its own deadline and says why (ABORT); wait a
     * little longer than ours to hear it. READY carries the group key. */
    unsigned char gk[32];
    char why[160];
    rc = fr_leaf_expect_sealed(b, env, &b->conns[0], FR_MSG_READY, gk, sizeof(gk),
                               "ready", 0, timeout_ms, deadline + 1000, why,
                               sizeof(why), err);
    if (rc != FR_TRY_OK)
        return rc;
    fr_hmac_key_init(&b->group, gk, sizeof(gk));
    fr_boot_wipe(gk, sizeof(gk));
    return FERRY_OK;
}

/* A frame from the root that the caller does not want: opened (its tag
 * checked), then dropped. */
static int fr_leaf_skip(fr_conn_t *c, const fr_frame_hdr_t *h,
                        int64_t deadline)
{
    return fr_boot_open_body(c, h, NULL, 0, NULL, 0, NULL, deadline);
}

/* An allgather's answer from the root, once this rank's block is sent: the
 * whole [size][len] array into out, or why not. */
static int fr_leaf_answer(fr_boot_t *b, void *out, size_t len, long tmo,
                          int64_t deadline, fr_err_t *err)
{
    fr_conn_t *c = &b->conns[0];
    uint64_t seq = b->seq;
    size_t moved;
    int io;
    char pl[FR_LEAF_SMALL + 1];
    /* The root, whose deadline may start a little after ours, names the
     * late ranks in an ABORT: give it a short grace to say so. */
    int64_t grace = tmo / 2 < 1000 ? tmo / 2 : 1000;
    fr_frame_hdr_t h;
    moved = 0;
    io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline + grace, &moved);
    if (io == FR_IO_TIMEOUT && moved == 0)
        return FR_ERR(err, FERRY_ERR_TIMEOUT,
                      "allgather #%llu: rank %d got no answer from root %s "
                      "within %ld ms (a rank has not called it?)",
                      (unsigned long long)seq, b->rank, b->root_addr, tmo);
    deadline += grace;
    if (io != FR_IO_OK)
        goto broken;
    if (h.type == FR_MSG_ALL) {
        size_t want = 8 + (size_t)b->size * len;
        uint64_t s;
        if (h.len != want) {
            io = fr_leaf_skip(c, &h, deadline);
            if (io != FR_IO_OK)
                goto broken;
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "allgather #%llu: root sent %u bytes, rank %d "
                          "expected %zu (ranks passed different sizes?)",
                          (unsigned long long)seq, h.len, b->rank, want);
        }
        io = fr_boot_open_body(c, &h, &s, 8, out, want - 8, &b->group,
                               deadline);
        if (io != FR_IO_OK)
            goto broken;
        if (s != seq)
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "rank %d is in allgather #%llu, root answered "
                          "#%llu",
                          b->rank, (unsigned long long)seq,
                          (unsigned long long)s);
        return FERRY_OK;
    }
    if (h.type != FR_MSG_DEAD && h.type != FR_MSG_ABORT &&
        h.type != FR_MSG_BYE_ACK) {
        io = h.len <= FR_LEAF_SMALL ? fr_leaf_skip(c, &h, deadline)
                                    : FR_IO_FORGED;
        if (io != FR_IO_OK)
            goto broken;
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "allgather #%llu: unexpected frame 0x%x from root",
                      (unsigned long long)seq, h.type);
    }
    io = fr_leaf_open_small(c, &h, pl, sizeof(pl) - 1, deadline);
    if (io != FR_IO_OK)
        goto broken;
    int32_t r = -1;
    if (h.type == FR_MSG_ABORT) {
        int code;
        const char *text;
        fr_parse_abort(pl, h.len, &code, &text);
        return FR_ERR(err, code, "root reports: %s", text);
    }
    if (h.len == 4)
        memcpy(&r, pl, 4);
    if (r >= 0 && r < b->size)
        fr_boot_record_dead(b, r);
    if (h.type == FR_MSG_DEAD)
        return fr_boot_err_dead(b, err);
    c->state = FR_CONN_BYE;
    return FR_ERR(err, FERRY_ERR_PEER,
                  "the root (rank 0) called close during allgather #%llu",
                  (unsigned long long)seq);
broken:
    if (io == FR_IO_FORGED)
        return fr_leaf_forged(b, "the answer to an allgather", err);
    if (io == FR_IO_TIMEOUT) {
        c->state = FR_CONN_DESYNC;
        return FR_ERR(err, FERRY_ERR_TIMEOUT,
                      "allgather #%llu: rank %d timed out after %ld ms in the "
                      "middle of a message from root %s",
                      (unsigned long long)seq, b->rank, tmo, b->root_addr);
    }
    fr_boot_leaf_mark_root_dead(b);
    return fr_boot_err_dead(b, err);
}

int fr_boot_leaf_allgather(fr_boot_t *b, const void *in, void *out,
                           size_t len, long tmo, int64_t deadline,
                           fr_err_t *err)
{
    fr_conn_t *c = &b->conns[0];
    uint64_t seq = b->seq;
    if (c->state == FR_CONN_DEAD)
        return fr_boot_err_dead(b, err);
    if (c->state != FR_CONN_LIVE)
        return FR_ERR(err, FERRY_ERR_PEER,
                      "the root (rank 0) has left the bootstrap (%s)",
                      c->state == FR_CONN_BYE ? "it called close"
                                              : "the stream broke earlier");
    size_t moved = 0;
    int io = fr_boot_seal_send(c, FR_MSG_DATA, &seq, 8, in, len, deadline,
                               &moved);
    if (io == FR_IO_TIMEOUT) {
        if (moved)
            c->state = FR_CONN_DESYNC;
        return FR_ERR(err, FERRY_ERR_TIMEOUT,
                      "allgather #%llu: rank %d could not send to root %s "
                      "within %ld ms",
                      (unsigned long long)seq, b->rank, b->root_addr, tmo);
    }
    if (io != FR_IO_OK) {
        fr_boot_leaf_mark_root_dead(b);
        return fr_boot_err_dead(b, err);
    }
    return fr_leaf_answer(b, out, len, tmo, deadline, err);
}

int fr_boot_leaf_close(fr_boot_t *b, long tmo, int64_t deadline,
                       fr_err_t *err)
{
    fr_conn_t *c = &b->conns[0];
    int rc = FERRY_OK;
    if (c->state == FR_CONN_LIVE) {
        int io = fr_boot_seal_send(c, FR_MSG_BYE, NULL, 0, NULL, 0, deadline,
                                   NULL);
        while (io == FR_IO_OK) {
            fr_frame_hdr_t h;
            io = fr_boot_recv_all(c->fd, &h, sizeof(h), deadline, NULL);
            if (io != FR_IO_OK)
                break;
            if ((h.type == FR_MSG_BYE_ACK || h.type == FR_MSG_DEAD) &&
                h.len == 4) {
                int32_t r = -1;
                io = fr_boot_open_body(c, &h, &r, 4, NULL, 0, NULL, deadline);
                if (io == FR_IO_OK && r >= 0 && r < b->size)
                    fr_boot_record_dead(b, r);
                if (io == FR_IO_OK && h.type == FR_MSG_BYE_ACK) {
                    c->state = FR_CONN_BYE;
                    break;
                }
            } else {
                io = fr_leaf_skip(c, &h, deadline); /* stale */
            }
        }
        if (io == FR_IO_FORGED)
            rc = fr_leaf_forged(b, "a frame at close", err);
        else if (io == FR_IO_TIMEOUT)
            rc = FR_ERR(err, FERRY_ERR_TIMEOUT,
                        "close: rank %d got no goodbye from root %s within "
                        "%ld ms",
                        b->rank, b->root_addr, tmo);
        else if (io != FR_IO_OK)
            fr_boot_leaf_mark_root_dead(b);
    }
    if (rc == FERRY_OK && __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE) >= 0)
        rc = fr_boot_err_dead(b, err);
    return rc;
}
