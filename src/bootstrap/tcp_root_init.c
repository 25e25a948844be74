/*
 * TCP bootstrap, rank 0's rendezvous: listen on the address the root host
 * names (loopback for a local job; FERRY_ROOT_BIND overrides), make the
 * local key file when the job has no FERRY_SECRET, accept connections and
 * authenticate them through the pending table (tcp_auth.c) without ever
 * waiting on one peer, then answer READY to every rank, or ABORT naming the
 * ranks that did not come within the bootstrap timeout (or why the
 * rendezvous cannot succeed, as soon as that is known). The listening
 * socket stays open until close: the port is this job's while it runs, and
 * a rank of another job (or a late one) is told so (tcp_watch.c) instead
 * of finding nobody there.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "keyfile.h"
#include "tcp.h"

/* The address to listen on: FERRY_ROOT_BIND, else the root host's. A root
 * host that resolves to loopback here while ranks span hosts (a host name
 * mapped to 127.0.1.1) means every address: the peers cannot reach
 * loopback. */
static int fr_root_bind_addr(const fr_boot_env_t *env,
                             struct sockaddr_in *sa, fr_err_t *err)
{
    const char *bind_host = fr_cfg_str(FR_CFG_ROOT_BIND);
    int forced = bind_host && bind_host[0];
    if (!forced)
        bind_host = env->root_host;
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)env->root_port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(bind_host, NULL, &hints, &res);
    if (g != 0 || !res)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "rank 0 cannot resolve '%s' (%s) to listen on: set %s "
                      "to an address of this host (or 0.0.0.0)",
                      bind_host, g ? gai_strerror(g) : "no address",
                      fr_cfg_name(forced ? FR_CFG_ROOT_BIND : FR_CFG_ROOT));
    sa->sin_addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
    freeaddrinfo(res);
    if (!forced && !env->local && (ntohl(sa->sin_addr.s_addr) >> 24) == 127) {
        FR_LOG_INFO(FR_SUB_BOOT, "root host '%s' is loopback here but ranks "
                                 "span hosts: listening on every address "
                                 "(set %s to choose one)",
                    bind_host, fr_cfg_name(FR_CFG_ROOT_BIND));
        sa->sin_addr.s_addr = htonl(INADDR_ANY);
    }
    return FERRY_OK;
}

/* The port is in use: when a ferry root whose rendezvous ended holds it,
 * it says so on connect (an ABORT in place of its challenge): that text
 * in why, 1. Else 0 (another program, or a rendezvous under way). */
static int fr_root_probe(const struct sockaddr_in *sa, char *why, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int said = 0;
    int64_t dl = fr_boot_now_ms() + 300;
    if ((connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) == 0 ||
         errno == EINPROGRESS) &&
        fr_boot_wait_fd(fd, POLLOUT, dl) > 0) {
        fr_frame_hdr_t h;
        char pl[FR_ERRMSG_LEN];
        if (fr_boot_recv_all(fd, &h, sizeof(h), dl, NULL) == FR_IO_OK &&
            h.type == FR_MSG_ABORT && h.len > 4 && h.len < sizeof(pl) &&
            fr_boot_recv_all(fd, pl, h.len, dl, NULL) == FR_IO_OK) {
            pl[h.len] = '\0';
            snprintf(why, cap, "%s", pl + 4);
            said = 1;
        }
    }
    close(fd);
    return said;
}

/* Bind the root's address (waiting out EADDRINUSE until deadline) and
 * listen; *lfd is the socket, to close, whatever the outcome. */
static int fr_root_listen(fr_boot_t *b, const fr_boot_env_t *env,
                          int64_t deadline, int *lfd, fr_err_t *err)
{
    struct sockaddr_in sa;
    int rc = fr_root_bind_addr(env, &sa, err);
    if (rc != FERRY_OK)
        return rc;
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
    snprintf(b->root_addr, sizeof(b->root_addr), "%s:%d", ip, env->root_port);
    *lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (*lfd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "socket: %s", strerror(errno));
    int one = 1;
    (void)setsockopt(*lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    for (int64_t probe = 0;;) {
        if (bind(*lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            break;
        int e = errno;
        if (e == EADDRNOTAVAIL)
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                          "rank 0 cannot listen on %s: %s (the root address "
                          "is not on this host; set %s=0.0.0.0 to listen on "
                          "every address)",
                          b->root_addr, strerror(e),
                          fr_cfg_name(FR_CFG_ROOT_BIND));
        /* In use: by another ferry job of this user, fail now (its key
         * file says so); else wait for it to be free. */
        if (e == EADDRINUSE && !env->has_key &&
            (rc = fr_boot_key_port_taken(env, ip, env->root_port, err)) !=
                FERRY_OK)
            return rc;
        char why[FR_ERRMSG_LEN];
        if (e == EADDRINUSE && fr_boot_now_ms() >= probe) {
            if (fr_root_probe(&sa, why, sizeof(why)))
                return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                              "rank 0 cannot listen on %s: %s; give this "
                              "job another %s port",
                              b->root_addr, why, fr_cfg_name(FR_CFG_ROOT));
            probe = fr_boot_now_ms() + 500;
        }
        if (e != EADDRINUSE || fr_boot_now_ms() >= deadline)
            return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                          "rank 0 cannot listen on %s: %s (set FERRY_ROOT to "
                          "a free port)",
                          b->root_addr, strerror(e));
        fr_boot_sleep_ms(FR_RETRY_MS);
    }
    /* A deep backlog: strangers' connections must not crowd out ranks. */
    if (listen(*lfd, 1024) != 0)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP, "listen on %s: %s",
                      b->root_addr, strerror(errno));
    FR_LOG_INFO(FR_SUB_BOOT, "root listening on %s for %d ranks",
                b->root_addr, b->size - 1);
    return FERRY_OK;
}

/* Accept and authenticate until every rank arrived or the deadline passed.
 * Waits only in poll(), woken by the next event or the nearest deadline. */
static int fr_root_meet(fr_meet_t *m, int64_t deadline, fr_err_t *err)
{
    fr_boot_t *b = m->b;
    while (m->arrived < b->size - 1 && m->rc == FERRY_OK) {
        int64_t next = fr_boot_pend_expire(m);
        if (next > deadline)
            next = deadline;
        struct pollfd pf[1 + FR_MAX_PENDING];
        pf[0].fd = m->lfd;
        pf[0].events = POLLIN;
        pf[0].revents = 0;
        for (int i = 0; i < m->npend; i++) {
            pf[1 + i].fd = m->pend[i].fd;
            pf[1 + i].events = POLLIN | POLLRDHUP;
            pf[1 + i].revents = 0;
        }
        int np = m->npend;
        int n = poll(pf, (nfds_t)(1 + np), fr_boot_left_ms(next));
        if (n < 0 && errno != EINTR)
            return FR_ERR(err, FERRY_ERR_SYSTEM, "poll: %s", strerror(errno));
        if (n <= 0) {
            if (fr_boot_now_ms() >= deadline)
                break;
            continue;
        }
        /* Pending peers first, from the end: a drop moves the last entry
         * (already seen) into the hole. */
        for (int i = np - 1; i >= 0; i--)
            if (pf[1 + i].revents && i < m->npend &&
                m->pend[i].fd == pf[1 + i].fd)
                fr_boot_pend_input(m, i);
        if (pf[0].revents && m->rc == FERRY_OK)
            fr_boot_pend_accept(m);
    }
    (void)err;
    return m->rc;
}

/* The rendezvous cannot succeed (m->rc, its message in err): tell the
 * ranks bound so far, and those still authenticating a fixed text. */
static int fr_root_fail_now(fr_meet_t *m, fr_err_t *err)
{
    fr_boot_key_note_failure(m->kf, err ? err->msg : "");
    fr_boot_root_abort_all(m->b, m->rc, err ? err->msg : "");
    fr_boot_pend_close_all(m, "the rendezvous failed before this "
                              "connection authenticated");
    return m->rc;
}

/* Not every rank arrived in time: fail naming them, and tell the ranks that
 * did why (connections not yet authenticated hear only that it ended). */
static int fr_root_no_show(fr_meet_t *m, long timeout_ms, fr_err_t *err)
{
    fr_boot_t *b = m->b;
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
                    "%s %s of %d did not join the rendezvous at %s within "
                    "%ld ms%s",
                    nm == 1 ? "rank" : "ranks", list, b->size, b->root_addr,
                    timeout_ms, m->notes);
    const char *msg = err ? err->msg : "timeout";
    fr_boot_key_note_failure(m->kf, msg); /* before anyone hears it */
    fr_boot_root_abort_all(b, FERRY_ERR_BOOTSTRAP, msg);
    /* Connections still authenticating may be strangers: a fixed text,
     * without the job's size, ranks or addresses (and without a wait). */
    fr_boot_pend_close_all(m, "the rendezvous timed out before this "
                              "connection authenticated");
    return rc;
}

/* Everyone arrived: READY to each rank, with the key of the ALL frames'
 * keystream (tcp_seal.c), drawn now. */
static int fr_root_ready(fr_boot_t *b, fr_err_t *err)
{
    unsigned char gk[32];
    if (fr_boot_random(gk, sizeof(gk)) != 0) {
        int rc = FR_ERR(err, FERRY_ERR_SYSTEM, "no random bytes: %s",
                        strerror(errno));
        fr_boot_root_abort_all(b, rc, err ? err->msg : "");
        return rc;
    }
    fr_hmac_key_init(&b->group, gk, sizeof(gk));
    for (int r = 1; r < b->size; r++) {
        int io = fr_boot_seal_send(&b->conns[r], FR_MSG_READY, gk,
                                   sizeof(gk), NULL, 0,
                                   fr_boot_now_ms() + FR_SHORT_SEND_MS, NULL);
        if (io != FR_IO_OK) {
            fr_boot_wipe(gk, sizeof(gk));
            b->conns[r].state = FR_CONN_DEAD;
            int rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                            "rank %d left during the bootstrap at %s (%s)", r,
                            b->root_addr, fr_boot_io_str(io));
            fr_boot_root_abort_all(b, FERRY_ERR_BOOTSTRAP,
                                   err ? err->msg : "");
            return rc;
        }
    }
    fr_boot_wipe(gk, sizeof(gk));
    return FERRY_OK;
}

/* What a late connection hears once the rendezvous is over. */
static void fr_root_late_msg(fr_boot_t *b, const fr_boot_env_t *env)
{
    char job[240] = "";
    if (!env->has_key)
        snprintf(job, sizeof(job), ", job '%.200s'", env->job);
    snprintf(b->late_msg, sizeof(b->late_msg),
             "port %.100s is held by a running ferry job whose rendezvous has "
             "ended (its rank 0 is pid %d%s): this rank is of another job, "
             "or came too late",
             b->root_addr, (int)getpid(), job);
}

int fr_boot_root_init(fr_boot_t *b, const fr_boot_env_t *env, long timeout_ms,
                      int64_t deadline, fr_err_t *err)
{
    fr_meet_t *m = calloc(1, sizeof(*m));
    if (!m)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    m->b = b;
    m->env = env;
    m->err = err;
    m->rc = FERRY_OK;
    m->lfd = -1;
    m->ch.magic = FR_BOOT_MAGIC;
    m->ch.version = FR_BOOT_WIRE_VERSION;
    m->ch.keysrc = env->has_key ? FR_KEYSRC_SECRET : FR_KEYSRC_FILE;
    m->ch.root_pid = (int32_t)getpid();
    if (!env->has_key)
        fr_boot_key_job_hash(env, m->ch.job);
    m->auth_ms = fr_cfg_int(FR_CFG_AUTH_MS);
    if (m->auth_ms < 10)
        m->auth_ms = 10;
    fr_keyfile_t keyfile;
    keyfile.path[0] = keyfile.failed[0] = '\0';
    m->kf = &keyfile;
    snprintf(b->root_addr, sizeof(b->root_addr), "%s:%d", env->root_host,
             env->root_port);

    int rc = FERRY_OK;
    if (!env->has_key) /* the key folder's trouble, said before listening */
        rc = fr_boot_key_check_dir(err);
    if (rc == FERRY_OK)
        rc = fr_root_listen(b, env, deadline, &m->lfd, err);
    /* After the bind: a port held by a live job keeps its key file. */
    if (rc == FERRY_OK && !env->has_key) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        char ip[INET_ADDRSTRLEN] = "0.0.0.0";
        if (getsockname(m->lfd, (struct sockaddr *)&sa, &sl) == 0)
            inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
        rc = fr_boot_key_create(env, ip, env->root_port, b->key, m->ch.run,
                                &keyfile, err);
    }
    int met = 0;
    if (rc == FERRY_OK) {
        rc = fr_root_meet(m, deadline, err);
        met = rc == FERRY_OK;
    }
    if (m->rc != FERRY_OK)
        rc = fr_root_fail_now(m, err);
    else if (met && m->arrived < b->size - 1)
        rc = fr_root_no_show(m, timeout_ms, err);
    /* A failure was noted for ranks still to come (fr_root_fail_now,
     * fr_root_no_show) before the key file goes, so that a rank that finds
     * no key file finds the note. */
    if (rc != FERRY_OK && m->rc == FERRY_OK && !met)
        fr_boot_key_note_failure(&keyfile, err ? err->msg : "");
    fr_boot_key_remove(&keyfile); /* every rank has read it, or failed */
    fr_boot_wipe(b->key, sizeof(b->key));
    if (rc == FERRY_OK && met && (rc = fr_root_ready(b, err)) != FERRY_OK)
        fr_boot_key_note_failure(&keyfile, err ? err->msg : "");
    fr_boot_pend_close_all(m, NULL);
    if (rc == FERRY_OK) { /* the port stays this job's until close */
        fr_root_late_msg(b, env);
        b->lfd = m->lfd;
        m->lfd = -1;
    }
    fr_boot_close_fd(&m->lfd);
    free(m);
    return rc;
}
