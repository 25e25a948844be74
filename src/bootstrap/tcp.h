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
enum { FR_IO_OK = 0, FR_IO_TIMEOUT = 1, FR_IO_EOF = 2, FR_IO_ERR = 3 };

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

/* tcp.c: dead ranks. */
void fr_boot_record_dead(fr_boot_t *b, int r);
int fr_boot_err_dead(fr_boot_t *b, fr_err_t *err);

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
    unsigned char buf[sizeof(fr_frame_hdr_t) + sizeof(fr_hello_t)];
    size_t have;            /* bytes of the owed frame in buf */
    char peer[64];          /* "ip:port" */
} fr_pend_t;

typedef struct fr_meet {
    fr_boot_t *b;
    int lfd;
    long auth_ms;           /* FERRY_BOOTSTRAP_AUTH_MS */
    fr_pend_t pend[FR_MAX_PENDING];
    int npend;
    int arrived;            /* ranks bound */
    int nlogged, nquiet;    /* drops logged one by one, and the rest */
    char notes[256];        /* for the no-show message */
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
