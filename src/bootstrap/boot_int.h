/* Bootstrap internals shared by boot.c and the TCP flavour (tcp*.c).
 * Private. */
#ifndef FR_BOOT_INT_H
#define FR_BOOT_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "bootstrap.h"
#include "hmac.h"

enum fr_boot_kind { FR_BOOT_SINGLE = 1, FR_BOOT_TCP = 2, FR_BOOT_CALLBACK = 3 };

/* State of one TCP connection (root: one per rank; others: one to root). */
enum fr_conn_state {
    FR_CONN_NONE = 0,   /* never connected (root's slot 0, failed init) */
    FR_CONN_LIVE = 1,
    FR_CONN_DEAD = 2,   /* closed without goodbye */
    FR_CONN_BYE = 3,    /* said goodbye (BYE, or BYE_ACK from the root) */
    FR_CONN_DESYNC = 4  /* a frame was cut by a deadline: stream unusable */
};

/* One direction of a sealed connection (tcp_seal.c): the key of the
 * frames' tags, the key of their keystream, and how many frames went. */
typedef struct fr_seal_dir {
    fr_hmac_key_t mac, enc;
    uint64_t n;
} fr_seal_dir_t;

/* Both directions; on = 0 until the handshake made the keys. */
typedef struct fr_seal {
    int on;
    fr_seal_dir_t tx, rx;
} fr_seal_t;

typedef struct fr_conn {
    int fd;
    int state;
    int pid;
    char peer[64];   /* the other end's "ip:port", for messages */
    fr_seal_t seal;  /* every frame after the hello is sealed */
} fr_conn_t;

/* Wire frames: {u32 type, u32 len} then len bytes of payload. Start-up
 * (tcp_auth.c): CHALLENGE, NONCE, PROOF, HELLO, ACK, then READY or ABORT.
 * Once the root sent its proof (on its side) and the rank checked it (on
 * the rank's), every frame is sealed (tcp_seal.c): the payload encrypted,
 * then a 32-byte tag after it. */
enum fr_frame_type {
    FR_MSG_HELLO = 0x101,   /* rank -> root: fr_hello_t, with its MAC */
    FR_MSG_READY = 0x102,   /* root -> rank: everyone arrived; group key */
    FR_MSG_ABORT = 0x103,   /* root -> rank: i32 status, then text */
    FR_MSG_DATA = 0x104,    /* rank -> root: u64 seq, block */
    FR_MSG_ALL = 0x105,     /* root -> rank: u64 seq, [size][len] */
    FR_MSG_DEAD = 0x106,    /* root -> rank: i32 rank that died */
    FR_MSG_BYE = 0x107,     /* rank -> root: goodbye */
    FR_MSG_BYE_ACK = 0x108, /* root -> rank: i32 dead rank or -1 */
    FR_MSG_CHALLENGE = 0x109, /* root -> rank, on accept: fr_challenge_t */
    FR_MSG_NONCE = 0x10A,   /* rank -> root: its nonce (32 bytes) */
    FR_MSG_PROOF = 0x10B,   /* root -> rank: MAC of both nonces (32 bytes) */
    FR_MSG_AUTH_FAIL = 0x10C, /* rank -> root: the root's proof was wrong */
    FR_MSG_ACK = 0x10D,     /* root -> rank: hello verified, rank id bound */
    FR_MSG_NOKEY = 0x10E    /* rank -> root, instead of its nonce: it cannot
                               use the root's key (fr_nokey_t), and leaves */
};

#define FR_BOOT_MAGIC 0x46524259u /* "FRBY" */
#define FR_BOOT_WIRE_VERSION 5u
#define FR_BOOT_NONCE_LEN 32
#define FR_BOOT_MAC_LEN 32

#define FR_BOOT_JOB_HASH_LEN 8
#define FR_BOOT_RUN_LEN 16

/* Where the root's key comes from (fr_challenge_t.keysrc). */
enum { FR_KEYSRC_SECRET = 0, FR_KEYSRC_FILE = 1 };

/* Sent in the clear on accept: besides the nonce, what a rank needs to
 * tell at once whether it can use this root's key (a stranger can forge
 * it, but can only make the rank fail, as a squatter can anyway): the
 * key's source, and for a key file the job's hash (as in the file's name),
 * the run id rank 0 drew for this rendezvous (also in the file) and its
 * pid. */
typedef struct fr_challenge {
    uint32_t magic;
    uint32_t version;
    unsigned char nonce[FR_BOOT_NONCE_LEN];
    uint32_t keysrc;
    int32_t root_pid;
    unsigned char job[FR_BOOT_JOB_HASH_LEN];
    unsigned char run[FR_BOOT_RUN_LEN];
} fr_challenge_t;

/* A rank that cannot use the root's key says so before it leaves, so that
 * rank 0 need not wait for it: rank 0 acts on it only when the peer is a
 * local process of its own uid (tcp_io.c fr_boot_peer_uid). */
#define FR_NOKEY_TEXT 240
typedef struct fr_nokey {
    int32_t rank;
    int32_t size;
    int32_t pid;
    unsigned char job[FR_BOOT_JOB_HASH_LEN];
    char job_id[72];          /* its job's id, cut short ('\0'-terminated) */
    char text[FR_NOKEY_TEXT]; /* its error, '\0'-terminated */
} fr_nokey_t;

typedef struct fr_frame_hdr {
    uint32_t type;
    uint32_t len;
} fr_frame_hdr_t;

typedef struct fr_hello {
    uint32_t magic;
    uint32_t version;
    int32_t rank;
    int32_t size;
    int32_t pid;
    uint32_t lib_version;
    unsigned char mac[FR_BOOT_MAC_LEN]; /* over the fields above: tcp_auth.c */
} fr_hello_t;

struct fr_boot {
    int kind;
    int rank;
    int size;

    /* callback */
    ferry_allgather_fn fn;
    void *ctx;

    /* tcp */
    fr_conn_t *conns;        /* root: [size] by rank; others: [1], the root */
    int nconns;
    char root_addr[300];     /* "host:port" as dialled / bound */
    uint64_t seq;            /* collectives so far */
    int dead;                /* first rank known dead, -1; atomic */
    int broken_rc;           /* FERRY_OK, or why collectives now fail */
    char broken_msg[FR_ERRMSG_LEN];
    pthread_mutex_t mu;      /* sockets: collectives, watcher, close */
    pthread_t watcher;
    int watcher_on;
    int stop;                /* atomic: watcher should exit */
    unsigned char key[32];   /* job key, during start-up only (then wiped) */
    int lfd;                 /* root: its listening socket, kept after the
                                rendezvous so that a late rank hears why
                                (tcp_watch.c); -1 */
    char late_msg[300];      /* root: what a late connection is told */
    fr_hmac_key_t group;     /* keystream key of ALL frames (from READY) */
};

/* tcp.c */
int fr_boot_tcp_allgather(fr_boot_t *b, const void *in, void *out, size_t len,
                          fr_err_t *err);
int fr_boot_tcp_close(fr_boot_t *b, fr_err_t *err);

#endif
