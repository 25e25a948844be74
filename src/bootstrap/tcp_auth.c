/*
 * TCP bootstrap authentication: the MACs both sides compute, and rank 0's
 * table of pending connections (accepted, not yet authenticated).
 *
 * Handshake, with K the job key (FERRY_SECRET's digest, or the local key
 * file's bytes; never sent):
 *   root -> rank  CHALLENGE  magic, version, nonce_root        (on accept)
 *   rank -> root  NONCE      nonce_leaf
 *   root -> rank  PROOF      HMAC(K, "ferry-root" | nonce_root | nonce_leaf)
 *   rank          checks the proof (constant time); on a mismatch it says
 *                 AUTH_FAIL and gives up: it sent nothing but a nonce
 *   rank -> root  HELLO      magic, version, rank, size, pid, lib version,
 *                 HMAC(K, "ferry-leaf" | nonce_root | nonce_leaf | fields)
 *   root          checks the MAC (constant time), then binds the rank id
 *   root -> rank  ACK        (empty) the rank id is bound to this connection
 * The challenge also says where the root's key comes from (FERRY_SECRET or
 * a key file, with the job's hash and the run id in that file): a rank
 * that cannot use it (another job, another key folder, no secret) sends
 * NOKEY (its rank, pid, job's hash and error) instead of its nonce and
 * gives up. Rank 0 believes it only from a local process of its own uid:
 * then a rank of its own job that cannot read the key fails the rendezvous
 * at once, and another job's rank is named when the rendezvous times out.
 * A second authenticated claim of a bound rank id means two processes hold
 * this job's key and claim one place (two jobs sharing a job id): the
 * rendezvous fails at once on every rank, naming both pids.
 * The root seals every frame after its PROOF, the rank every frame after
 * its HELLO (tcp_seal.c: keys from K and both nonces), except the root's
 * ABORT to a hello whose MAC is wrong: a rank that sent a true one (and
 * so knows K) treats it as tampering.
 * Until the ACK the root may drop the connection (its authentication time
 * ran out, or a flood evicted it), so a rank that loses it before the ACK
 * dials again from scratch; a bound rank's connection is never dropped.
 * Fresh nonces on both sides make every proof single-use; the labels keep a
 * root's proof from passing as a rank's.
 *
 * The pending table never blocks: every socket is non-blocking, a frame is
 * collected as its bytes come, and each connection has FERRY_BOOTSTRAP_
 * AUTH_MS from its accept to authenticate, after which it is dropped (what
 * it has sent is read first). When the table is full, what the pending
 * connections sent is read, then one is dropped for the new one: the oldest
 * of those that have not sent their nonce yet, else the oldest (a real
 * rank that loses its connection so just dials again). A rank
 * id is bound only by an authenticated hello, so a stranger's claim locks
 * nobody out. Every drop is a WARN naming the peer's address (the first
 * FR_PEND_LOGGED of them; then only counted).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "tcp.h"

#define FR_PEND_LOGGED 16

void fr_boot_mac_root(const unsigned char *key, const unsigned char *nr,
                      const unsigned char *nl, unsigned char *out)
{
    fr_hmac_part_t p[3] = {{"ferry-root", 10},
                           {nr, FR_BOOT_NONCE_LEN},
                           {nl, FR_BOOT_NONCE_LEN}};
    fr_hmac_sha256(key, 32, p, 3, out);
}

void fr_boot_mac_hello(const unsigned char *key, const unsigned char *nr,
                       const unsigned char *nl, const fr_hello_t *hi,
                       unsigned char *out)
{
    fr_hmac_part_t p[4] = {{"ferry-leaf", 10},
                           {nr, FR_BOOT_NONCE_LEN},
                           {nl, FR_BOOT_NONCE_LEN},
                           {hi, offsetof(fr_hello_t, mac)}};
    fr_hmac_sha256(key, 32, p, 4, out);
}

/* Send a whole small frame now, or not at all (a pending peer is never
 * waited for); sealed when seal is given. 0 when all of it left. */
static int fr_pend_send(int fd, fr_seal_t *seal, uint32_t type, const void *p,
                        size_t len)
{
    unsigned char buf[sizeof(fr_frame_hdr_t) + 256 + FR_SEAL_TAG_LEN];
    fr_frame_hdr_t h = {type, (uint32_t)len};
    if (len > 256)
        len = 256;
    size_t n;
    if (seal) {
        n = fr_boot_seal_frame(seal, type, p, len, buf);
    } else {
        memcpy(buf, &h, sizeof(h));
        if (len)
            memcpy(buf + sizeof(h), p, len);
        n = sizeof(h) + len;
    }
    ssize_t k;
    do {
        k = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (k < 0 && errno == EINTR);
    return k == (ssize_t)n ? 0 : -1;
}

/* ABORT with text to a pending peer, best effort, without waiting: sealed
 * once its keys exist, unless plain is asked. */
static void fr_pend_tell(fr_pend_t *p, int plain, const char *text)
{
    char msg[4 + 200];
    int32_t c32 = FERRY_ERR_BOOTSTRAP;
    size_t tl = strlen(text);
    if (tl > 200)
        tl = 200;
    memcpy(msg, &c32, 4);
    memcpy(msg + 4, text, tl);
    (void)fr_pend_send(p->fd, p->seal.on && !plain ? &p->seal : NULL,
                       FR_MSG_ABORT, msg, 4 + tl);
}

static void fr_meet_note(fr_meet_t *m, const char *fmt, ...)
{
    size_t nl = strlen(m->notes);
    if (nl + 16 >= sizeof(m->notes))
        return;
    snprintf(m->notes + nl, sizeof(m->notes) - nl, "; ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->notes + nl + 2, sizeof(m->notes) - nl - 2, fmt, ap);
    va_end(ap);
}

/* Close pending connection i (and forget it), saying why in the log. */
static void fr_pend_drop(fr_meet_t *m, int i, const char *fmt, ...)
{
    fr_pend_t *p = &m->pend[i];
    if (m->nlogged < FR_PEND_LOGGED) {
        char why[200];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, sizeof(why), fmt, ap);
        va_end(ap);
        m->nlogged++;
        FR_LOG_WARN(FR_SUB_BOOT, "root: dropped connection from %s: %s%s",
                    p->peer, why,
                    m->nlogged == FR_PEND_LOGGED
                        ? " (further drops are only counted)"
                        : "");
    } else {
        m->nquiet++;
    }
    close(p->fd);
    fr_boot_seal_wipe(&p->seal);
    m->pend[i] = m->pend[--m->npend];
}

void fr_boot_pend_close_all(fr_meet_t *m, const char *abort_text)
{
    for (int i = 0; i < m->npend; i++) {
        if (abort_text)
            fr_pend_tell(&m->pend[i], 0, abort_text);
        close(m->pend[i].fd);
        fr_boot_seal_wipe(&m->pend[i].seal);
    }
    m->npend = 0;
    if (m->nquiet)
        FR_LOG_WARN(FR_SUB_BOOT, "root: %d more unauthenticated connections "
                                 "were dropped",
                    m->nquiet);
    m->nquiet = 0;
}

/* Read what every pending connection has sent (from the end: a drop moves
 * the last entry, already read, into the hole). */
static void fr_pend_read_all(fr_meet_t *m)
{
    for (int i = m->npend - 1; i >= 0; i--)
        if (i < m->npend)
            fr_boot_pend_input(m, i);
}

/* The table is full: drop one for a new connection. Those still owing
 * their nonce go first (a flood of idle connections), then the oldest. */
static void fr_pend_evict(fr_meet_t *m)
{
    int old = -1;
    for (int pass = 0; pass < 2 && old < 0; pass++)
        for (int i = 0; i < m->npend; i++)
            if ((pass || (m->pend[i].stage == FR_MSG_NONCE &&
                          m->pend[i].have == 0)) &&
                (old < 0 || m->pend[i].since < m->pend[old].since))
                old = i;
    fr_pend_drop(m, old, "%d connections pending: the oldest %sgoes",
                 FR_MAX_PENDING,
                 m->pend[old].stage == FR_MSG_NONCE ? "without a nonce " : "");
}

/* Accept waiting connections and challenge them: at most a quarter of the
 * table per call, so that a connection outlives a few rounds of poll()
 * even in a flood. */
void fr_boot_pend_accept(fr_meet_t *m)
{
    int read = 0;
    for (int k = 0; k < FR_MAX_PENDING / 4; k++) {
        if (m->npend == FR_MAX_PENDING && !read) {
            fr_pend_read_all(m); /* a nonce or hello that came is kept */
            read = 1;
        }
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        int fd = accept4(m->lfd, (struct sockaddr *)&sa, &sl,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            break;
        if (m->npend == FR_MAX_PENDING)
            fr_pend_evict(m);
        fr_pend_t *p = &m->pend[m->npend];
        memset(p, 0, sizeof(*p));
        p->fd = fd;
        p->since = fr_boot_now_ms();
        p->deadline = p->since + m->auth_ms;
        p->stage = FR_MSG_NONCE;
        char ip[INET_ADDRSTRLEN] = "?";
        if (sa.sin_family == AF_INET)
            inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
        snprintf(p->peer, sizeof(p->peer), "%s:%u", ip,
                 (unsigned)ntohs(sa.sin_port));
        m->npend++;
        fr_boot_set_nodelay(fd);
        fr_challenge_t ch = m->ch;
        if (fr_boot_random(p->nr, sizeof(p->nr)) != 0) {
            fr_pend_drop(m, m->npend - 1, "no random bytes: %s",
                         strerror(errno));
            continue;
        }
        memcpy(ch.nonce, p->nr, sizeof(ch.nonce));
        if (fr_pend_send(fd, NULL, FR_MSG_CHALLENGE, &ch, sizeof(ch)) != 0)
            fr_pend_drop(m, m->npend - 1, "could not send the challenge");
    }
}

/* Why the root refuses an authenticated hello (why[0] == '\0': it does
 * not). */
static void fr_root_check_hello(const fr_boot_t *b, const fr_hello_t *hi,
                                char *why, size_t cap)
{
    why[0] = '\0';
    if (hi->size != b->size)
        snprintf(why, cap, "rank %d (pid %d) has world size %d, root has %d",
                 (int)hi->rank, (int)hi->pid, (int)hi->size, b->size);
    else if (hi->rank <= 0 || hi->rank >= b->size)
        snprintf(why, cap, "a peer claims rank %d of %d", (int)hi->rank,
                 b->size);
}

/* A second process proved this job's key and claimed bound rank r: two
 * jobs share it. The rendezvous fails on every rank, naming both. */
static void fr_pend_twice(fr_meet_t *m, int i, const fr_hello_t *hi)
{
    fr_boot_t *b = m->b;
    const fr_boot_env_t *env = m->env;
    fr_pend_t *p = &m->pend[i];
    char why[200], shared[260];
    snprintf(why, sizeof(why), "rank %d of this job was claimed twice",
             (int)hi->rank);
    fr_pend_tell(p, 0, why);
    if (env->has_key)
        snprintf(shared, sizeof(shared), "one %s",
                 fr_cfg_name(FR_CFG_SECRET));
    else
        snprintf(shared, sizeof(shared), "the job id '%.200s' (from %s)",
                 env->job, env->job_from ? env->job_from : "?");
    if (m->rc == FERRY_OK)
        m->rc = FR_ERR(
            m->err, FERRY_ERR_BOOTSTRAP,
            "two processes that hold this job's key claim rank %d at %s "
            "(pid %d from %s, then pid %d from %s): two jobs share %s on "
            "one port, and their ranks would take each other's places. "
            "Give each job its own %s (or %s), or its own %s port",
            (int)hi->rank, b->root_addr, b->conns[hi->rank].pid,
            b->conns[hi->rank].peer, (int)hi->pid, p->peer, shared,
            fr_cfg_name(FR_CFG_JOB_ID), fr_cfg_name(FR_CFG_SECRET),
            fr_cfg_name(FR_CFG_ROOT));
    fr_pend_drop(m, i, "rank %d claimed twice (pid %d, then pid %d)",
                 (int)hi->rank, b->conns[hi->rank].pid, (int)hi->pid);
}

/* A NOKEY from pending connection i: a rank that cannot use this root's
 * key is leaving. Believed only from a local process of this uid. */
static void fr_pend_nokey(fr_meet_t *m, int i)
{
    fr_boot_t *b = m->b;
    fr_pend_t *p = &m->pend[i];
    fr_nokey_t nk;
    memcpy(&nk, p->buf + sizeof(fr_frame_hdr_t), sizeof(nk));
    nk.text[sizeof(nk.text) - 1] = '\0';
    nk.job_id[sizeof(nk.job_id) - 1] = '\0';
    if (fr_boot_peer_uid(p->fd) != (long)geteuid()) {
        fr_meet_note(m, "a peer at %s said it cannot use the key (not "
                        "believed: not a local process of this user)",
                     p->peer);
        fr_pend_drop(m, i, "it says it cannot use the key (not believed: "
                           "not a local process of uid %u)",
                     (unsigned)geteuid());
        return;
    }
    int ours = m->ch.keysrc == FR_KEYSRC_FILE &&
               !memcmp(nk.job, m->ch.job, sizeof(nk.job)) &&
               nk.size == b->size && nk.rank > 0 && nk.rank < b->size &&
               b->conns[nk.rank].state == FR_CONN_NONE;
    if (ours && m->rc == FERRY_OK)
        m->rc = FR_ERR(m->err, FERRY_ERR_BOOTSTRAP,
                       "rank %d of this job (pid %d, %s) reached %s but "
                       "cannot use the job's key: %s",
                       (int)nk.rank, (int)nk.pid, p->peer, b->root_addr,
                       nk.text);
    else if (!ours && m->ch.keysrc == FR_KEYSRC_FILE)
        fr_meet_note(m, "a rank %d of %d (pid %d) of job '%s' reached this "
                        "root and left (this job is '%.80s'): give every "
                        "rank of one job the same %s",
                     (int)nk.rank, (int)nk.size, (int)nk.pid, nk.job_id,
                     m->env->job, fr_cfg_name(FR_CFG_JOB_ID));
    else if (!ours)
        fr_meet_note(m, "a rank %d of %d (pid %d) without %s reached this "
                        "root and left: give every rank the same %s",
                     (int)nk.rank, (int)nk.size, (int)nk.pid,
                     fr_cfg_name(FR_CFG_SECRET), fr_cfg_name(FR_CFG_SECRET));
    fr_pend_drop(m, i, "rank %d (pid %d) cannot use the key: %s",
                 (int)nk.rank, (int)nk.pid, nk.text);
}

/* A whole HELLO from pending connection i: check it, bind the rank. */
static void fr_pend_hello(fr_meet_t *m, int i)
{
    fr_boot_t *b = m->b;
    fr_pend_t *p = &m->pend[i];
    fr_hello_t hi;
    unsigned char want[FR_BOOT_MAC_LEN];
    memcpy(&hi, p->buf + sizeof(fr_frame_hdr_t), sizeof(hi));
    fr_boot_mac_hello(b->key, p->nr, p->nl, &hi, want);
    if (hi.magic != FR_BOOT_MAGIC || hi.version != FR_BOOT_WIRE_VERSION ||
        !fr_boot_ct_equal(hi.mac, want, sizeof(want))) {
        fr_pend_tell(p, 1, "authentication failed");
        fr_meet_note(m, "a peer at %s failed authentication", p->peer);
        fr_pend_drop(m, i, "authentication failed (it claims rank %d)",
                     (int)hi.rank);
        return;
    }
    char why[200];
    if (hi.size == b->size && hi.rank > 0 && hi.rank < b->size &&
        b->conns[hi.rank].state != FR_CONN_NONE) {
        fr_pend_twice(m, i, &hi);
        return;
    }
    fr_root_check_hello(b, &hi, why, sizeof(why));
    if (why[0]) {
        fr_pend_tell(p, 0, why);
        fr_meet_note(m, "rejected: %s", why);
        fr_pend_drop(m, i, "%s", why);
        return;
    }
    /* The send buffer is empty (the rank read the proof before it could
     * send the hello): the ACK leaves now, or the connection is gone. */
    if (fr_pend_send(p->fd, &p->seal, FR_MSG_ACK, NULL, 0) != 0) {
        fr_pend_drop(m, i, "rank %d left before its ack", (int)hi.rank);
        return;
    }
    fr_conn_t *c = &b->conns[hi.rank];
    c->fd = p->fd;
    c->state = FR_CONN_LIVE;
    c->pid = hi.pid;
    c->seal = p->seal;
    snprintf(c->peer, sizeof(c->peer), "%s", p->peer);
    fr_boot_seal_wipe(&p->seal);
    m->arrived++;
    FR_LOG_DEBUG(FR_SUB_BOOT, "rank %d (pid %d, %s) authenticated, %d of %d",
                 (int)hi.rank, (int)hi.pid, p->peer, m->arrived, b->size - 1);
    m->pend[i] = m->pend[--m->npend];
}

/* A whole frame is in pend[i].buf: act on it. */
static void fr_pend_frame(fr_meet_t *m, int i)
{
    fr_pend_t *p = &m->pend[i];
    fr_frame_hdr_t h;
    memcpy(&h, p->buf, sizeof(h));
    if (h.type == FR_MSG_AUTH_FAIL) {
        fr_meet_note(m, "a peer at %s did not accept the root's proof (a "
                        "rank with another FERRY_SECRET?)",
                     p->peer);
        fr_pend_drop(m, i, "it did not accept the root's proof (another "
                           "FERRY_SECRET?)");
    } else if (h.type == FR_MSG_NOKEY) {
        fr_pend_nokey(m, i);
    } else if (h.type == FR_MSG_NONCE) {
        unsigned char proof[FR_BOOT_MAC_LEN];
        memcpy(p->nl, p->buf + sizeof(h), sizeof(p->nl));
        fr_boot_mac_root(m->b->key, p->nr, p->nl, proof);
        p->stage = FR_MSG_HELLO;
        p->have = 0;
        int sent = fr_pend_send(p->fd, NULL, FR_MSG_PROOF, proof,
                                sizeof(proof));
        fr_boot_seal_keys(&p->seal, m->b->key, p->nr, p->nl, 1);
        if (sent != 0)
            fr_pend_drop(m, i, "could not send the proof");
    } else {
        fr_pend_hello(m, i);
    }
}

/* The payload length the header in pend[i].buf must carry, or -1. */
static long fr_pend_want(const fr_pend_t *p)
{
    fr_frame_hdr_t h;
    memcpy(&h, p->buf, sizeof(h));
    if (p->stage == FR_MSG_NONCE && h.type == FR_MSG_NONCE &&
        h.len == FR_BOOT_NONCE_LEN)
        return (long)h.len;
    if (p->stage == FR_MSG_NONCE && h.type == FR_MSG_NOKEY &&
        h.len == sizeof(fr_nokey_t))
        return (long)h.len;
    if (p->stage == FR_MSG_HELLO && h.type == FR_MSG_HELLO &&
        h.len == sizeof(fr_hello_t))
        return (long)h.len;
    if (h.type == FR_MSG_AUTH_FAIL && h.len == 0)
        return 0;
    return -1;
}

/* Data (or a close) on pending connection i: take what is there. */
void fr_boot_pend_input(fr_meet_t *m, int i)
{
    for (;;) {
        fr_pend_t *p = &m->pend[i];
        size_t hl = sizeof(fr_frame_hdr_t);
        long want = p->have < hl ? 0 : fr_pend_want(p);
        if (want < 0) {
            fr_frame_hdr_t h;
            memcpy(&h, p->buf, sizeof(h));
            fr_pend_drop(m, i, "it sent frame 0x%x of %u bytes while "
                               "owing the %s (not a ferry rank of this "
                               "version)",
                         h.type, h.len,
                         p->stage == FR_MSG_NONCE ? "nonce" : "hello");
            return;
        }
        size_t need = hl + (size_t)want;
        if (p->have == need) {
            fr_pend_frame(m, i);
            return; /* one frame per wake-up; poll says if there is more */
        }
        ssize_t n = recv(p->fd, p->buf + p->have, need - p->have,
                         MSG_DONTWAIT);
        if (n > 0) {
            p->have += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        fr_pend_drop(m, i, "closed before authenticating (%s)",
                     n == 0 ? "end of stream" : strerror(errno));
        return;
    }
}

int64_t fr_boot_pend_expire(fr_meet_t *m)
{
    int64_t now = fr_boot_now_ms(), next = INT64_MAX;
    for (int i = m->npend - 1; i >= 0; i--) {
        if (i >= m->npend)
            continue;
        if (m->pend[i].deadline <= now) {
            /* What already came first: a hello that arrived in time binds
             * its rank rather than being dropped unread. */
            int fd = m->pend[i].fd;
            fr_boot_pend_input(m, i);
            if (i >= m->npend || m->pend[i].fd != fd)
                continue;
            if (m->pend[i].deadline <= now) {
                fr_pend_drop(m, i, "no authentication within %ld ms (%zu "
                                   "bytes of a frame received)",
                             m->auth_ms, m->pend[i].have);
                continue;
            }
        }
        if (m->pend[i].deadline < next)
            next = m->pend[i].deadline;
    }
    return next;
}
