/*
 * TCP bootstrap internals, shared by tcp.c (init, allgather and close entry
 * points), tcp_io.c (deadline-bound socket I/O), tcp_auth.c (the start-up
 * handshake's MACs and rank 0's pending connections), tcp_root_init.c and
 * tcp_root.c (rank 0, the rendezvous server: start-up, then collectives and
 * close), tcp_leaf.c (every other rank) and tcp_watch.c (the watcher
 * thread). Private.
 *
 * Every socket is non-blocking and every wait is a poll() with a deadline.
 * Frames are {u32 type, u32 len} + payload (boot_int.h). A collective holds
 * b->mu from start to end; the watcher thread only try-locks it, polls with
 * timeout 0, and sleeps outside it, so it never takes a collective's frame:
 * it consumes only DEAD, BYE and BYE_ACK frames found at the head of a
 * stream, and uses MSG_PEEK and POLLRDHUP to tell a closed socket from
 * pending data.
 */
#ifndef FR_BOOT_TCP_H
#define FR_BOOT_TCP_H

#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "boot_int.h"

#define FR_WATCH_PERIOD_MS 25
#define FR_RETRY_MS 50
#define FR_SHORT_SEND_MS 1000 /* DEAD/ABORT/BYE_ACK notices */
#define FR_MAX_PENDING 64     /* accepted sockets not yet authenticated */

/* Outcome of a deadline-bound send or receive. */
enum {
    FR_IO_OK = 0,
    FR_IO_TIMEOUT = 1,
    FR_IO_EOF = 2,
    FR_IO_ERR = 3,
    FR_IO_FORGED = 4 /* a sealed frame's tag did not match */
};

/* What fr_boot_peek found at the head of a stream. */
enum {
    FR_PEEK_NONE = 0,
    FR_PEEK_EOF = 1,
    FR_PEEK_PARTIAL = 2,
    FR_PEEK_FRAME = 3
};

/* tcp_io.c: time and raw I/O. */
int fr_boot_left_ms(int64_t deadline);
int fr_boot_wait_fd(int fd, short ev, int64_t deadline);
/* Send p1, p2, p3 (any of them empty) as one stream before deadline. */
int fr_boot_sendv3(int fd, const void *p1, size_t l1, const void *p2,
                   size_t l2, const void *p3, size_t l3, int64_t deadline,
                   size_t *moved);
int fr_boot_send_frame(int fd, uint32_t type, const void *p1, size_t l1,
                       const void *p2, size_t l2, int64_t deadline,
                       size_t *moved);
int fr_boot_recv_all(int fd, void *buf, size_t n, int64_t deadline,
                     size_t *got);
int fr_boot_discard(int fd, size_t n, int64_t deadline);
int fr_boot_peek(int fd, void *buf, size_t want);
void fr_boot_set_nodelay(int fd);
void fr_boot_close_fd(int *fd);
void fr_boot_fmt_ranks(char *buf, size_t cap, const int *ranks, int n);
const char *fr_boot_io_str(int io);
/* The uid of the local process at the other end of TCP socket fd (found in
 * /proc/net/tcp), or -1 when it is not on this host or cannot be told. */
long fr_boot_peer_uid(int fd);

/* tcp.c: dead ranks. */
void fr_boot_record_dead(fr_boot_t *b, int r);
int fr_boot_err_dead(fr_boot_t *b, fr_err_t *err);

/* tcp_seal.c: sealed frames, {type, len} + payload encrypted + tag. */
#define FR_SEAL_TAG_LEN 32
/* Both directions' keys of a connection whose handshake used nonces nr
 * (the root's) and nl (the rank's) under the job key; root: this end is
 * the root. */
void fr_boot_seal_keys(fr_seal_t *s, const unsigned char *key,
                       const unsigned char *nr, const unsigned char *nl,
                       int root);
void fr_boot_seal_wipe(fr_seal_t *s);
/* The whole wire frame into out (room for 8 + len + FR_SEAL_TAG_LEN);
 * its length. Spends a frame number. */
size_t fr_boot_seal_frame(fr_seal_t *s, uint32_t type, const void *p,
                          size_t len, unsigned char *out);
/* Send a sealed frame of p1[l1] then p2[l2]; the frame number is spent
 * only when some of it left (*moved > 0). */
int fr_boot_seal_send(fr_conn_t *c, uint32_t type, const void *p1, size_t l1,
                      const void *p2, size_t l2, int64_t deadline,
                      size_t *moved);
/* An ALL payload sealed once for every rank: the u64 seq in the clear,
 * then the array under the group key with the seq as nonce. */
typedef struct fr_sealed_all {
    unsigned char *body;
    size_t len;
    unsigned char digest[FR_SHA256_LEN];
} fr_sealed_all_t;
int fr_boot_seal_all(const fr_hmac_key_t *group, uint64_t seq,
                     const void *data, size_t n, fr_sealed_all_t *a);
int fr_boot_seal_send_all(fr_conn_t *c, const fr_sealed_all_t *a,
                          int64_t deadline, size_t *moved);
/* The payload of the sealed frame whose header h was just read: into
 * d1[n1] then d2[n2] (n1 + n2 == h->len), or discarded when d1 is NULL;
 * then its tag. FR_IO_FORGED: the tag does not match (what landed in d1
 * and d2 is garbage). group: an ALL payload (d1: its 8-byte seq). */
int fr_boot_open_body(fr_conn_t *c, const fr_frame_hdr_t *h, void *d1,
                      size_t n1, void *d2, size_t n2,
                      const fr_hmac_key_t *group, int64_t deadline);
/* A whole sealed frame already in memory (header, payload, tag): its
 * payload opened into out (n bytes, the header's length). */
int fr_boot_open_mem(fr_seal_t *s, const unsigned char *frame, void *out,
                     size_t n);

/* tcp_auth.c: the MACs (key: 32 bytes; out: FR_BOOT_MAC_LEN). */
void fr_boot_mac_root(const unsigned char *key, const unsigned char *nr,
                      const unsigned char *nl, unsigned char *out);
void fr_boot_mac_hello(const unsigned char *key, const unsigned char *nr,
                       const unsigned char *nl, const fr_hello_t *hi,
                       unsigned char *out);

/* tcp_auth.c: rank 0's connections that have not authenticated yet. */
typedef struct fr_pend {
    int fd;
    uint32_t stage;         /* the frame owed: FR_MSG_NONCE, FR_MSG_HELLO */
    int64_t since, deadline;
    unsigned char nr[FR_BOOT_NONCE_LEN], nl[FR_BOOT_NONCE_LEN];
    /* the owed frame: a hello, or a NOKEY (the larger) */
    unsigned char buf[sizeof(fr_frame_hdr_t) + sizeof(fr_nokey_t)];
    size_t have;            /* bytes of the owed frame in buf */
    char peer[64];          /* "ip:port" */
    fr_seal_t seal;         /* on once the proof went: later frames sealed */
} fr_pend_t;

typedef struct fr_meet {
    fr_boot_t *b;
    const fr_boot_env_t *env;
    const struct fr_keyfile *kf; /* the key file, for a failure note */
    int lfd;
    long auth_ms;           /* FERRY_BOOTSTRAP_AUTH_MS */
    fr_challenge_t ch;      /* what every challenge says but its nonce */
    fr_pend_t pend[FR_MAX_PENDING];
    int npend;
    int arrived;            /* ranks bound */
    int nlogged, nquiet;    /* drops logged one by one, and the rest */
    int rc;                 /* FERRY_OK, or why the rendezvous fails now */
    fr_err_t *err;          /* rc's message */
    char notes[512];        /* for the no-show message */
} fr_meet_t;

void fr_boot_pend_accept(fr_meet_t *m);
void fr_boot_pend_input(fr_meet_t *m, int i);
/* Drop connections past their deadline; the next deadline (INT64_MAX). */
int64_t fr_boot_pend_expire(fr_meet_t *m);
/* Close them all (telling each abort_text unless NULL). */
void fr_boot_pend_close_all(fr_meet_t *m, const char *abort_text);

/* tcp_root.c */
void fr_boot_root_mark_dead(fr_boot_t *b, int r);
void fr_boot_root_abort_all(fr_boot_t *b, int code, const char *msg);
int fr_boot_root_allgather(fr_boot_t *b, const void *in, void *out,
                           size_t len, long tmo, int64_t deadline,
                           fr_err_t *err);
int fr_boot_root_close(fr_boot_t *b, long tmo, int64_t deadline,
                       fr_err_t *err);

/* tcp_root_init.c */
int fr_boot_root_init(fr_boot_t *b, const fr_boot_env_t *env, long timeout_ms,
                      int64_t deadline, fr_err_t *err);

/* tcp_leaf.c */
void fr_boot_leaf_mark_root_dead(fr_boot_t *b);
int fr_boot_leaf_init(fr_boot_t *b, const fr_boot_env_t *env, long timeout_ms,
                      int64_t deadline, fr_err_t *err);
int fr_boot_leaf_allgather(fr_boot_t *b, const void *in, void *out,
                           size_t len, long tmo, int64_t deadline,
                           fr_err_t *err);
int fr_boot_leaf_close(fr_boot_t *b, long tmo, int64_t deadline,
                       fr_err_t *err);

/* tcp_watch.c: the watcher thread's body (arg: the fr_boot_t). */
void *fr_boot_watcher_main(void *arg);

#endif
