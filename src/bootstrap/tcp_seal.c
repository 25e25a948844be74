/*
 * Sealed bootstrap frames: every frame after the handshake, both ways.
 *
 * Keys. The handshake (tcp_auth.c) leaves both ends with the job key K and
 * both nonces; from them each connection gets its own session key
 *     S = HMAC(K, "ferry-session" | nonce_root | nonce_leaf)
 * and, per direction d (root to rank, rank to root), a tag key
 * HMAC(S, d | " tag") and a keystream key HMAC(S, d | " enc").
 *
 * A frame is {u32 type, u32 len} (in the clear), then the len bytes of
 * payload encrypted, then a 32-byte tag:
 *     payload ^= HMAC(enc, n | i) for its 32-byte blocks i
 *     tag = HMAC(tag key, n | header | SHA-256(encrypted payload))
 * where n counts the frames sent that way on the connection, from 0. The
 * receiver checks the tag against the number it expects next before it
 * uses a byte: a relay can pass frames on, but one it changes, drops,
 * reorders, repeats or moves to another connection fails the check, and
 * the receiving rank stops with an error naming the peer.
 *
 * ALL frames (the root's answer to an allgather, the same array for every
 * rank) carry the allgather's number in the clear and the array encrypted
 * once under a group key that the root drew at random and sent to every
 * rank in its sealed READY (nonce: the allgather's number), so the root
 * encrypts and hashes the array once, not once per rank; each rank's tag
 * is still its own connection's.
 *
 * What a relay still sees: frame types, lengths and timing.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "tcp.h"

static void fr_seal_derive(fr_hmac_key_t *out, const unsigned char *s,
                           const char *label)
{
    unsigned char k[FR_SHA256_LEN];
    fr_hmac_part_t p = {label, strlen(label)};
    fr_hmac_sha256(s, FR_SHA256_LEN, &p, 1, k);
    fr_hmac_key_init(out, k, sizeof(k));
    fr_boot_wipe(k, sizeof(k));
}

void fr_boot_seal_keys(fr_seal_t *s, const unsigned char *key,
                       const unsigned char *nr, const unsigned char *nl,
                       int root)
{
    unsigned char sk[FR_SHA256_LEN];
    fr_hmac_part_t p[3] = {{"ferry-session", 13},
                           {nr, FR_BOOT_NONCE_LEN},
                           {nl, FR_BOOT_NONCE_LEN}};
    fr_hmac_sha256(key, 32, p, 3, sk);
    fr_seal_dir_t *down = root ? &s->tx : &s->rx; /* root to rank */
    fr_seal_dir_t *up = root ? &s->rx : &s->tx;   /* rank to root */
    fr_seal_derive(&down->mac, sk, "root-to-rank tag");
    fr_seal_derive(&down->enc, sk, "root-to-rank enc");
    fr_seal_derive(&up->mac, sk, "rank-to-root tag");
    fr_seal_derive(&up->enc, sk, "rank-to-root enc");
    down->n = up->n = 0;
    s->on = 1;
    fr_boot_wipe(sk, sizeof(sk));
}

void fr_boot_seal_wipe(fr_seal_t *s)
{
    fr_boot_wipe(s, sizeof(*s));
}

/* The tag of frame number n with header h and payload digest dg. */
static void fr_seal_tag(const fr_hmac_key_t *k, uint64_t n,
                        const fr_frame_hdr_t *h, const unsigned char *dg,
                        unsigned char *tag)
{
    unsigned char nb[8];
    for (int i = 0; i < 8; i++)
        nb[i] = (unsigned char)(n >> (8 * i));
    fr_hmac_part_t p[3] = {{nb, 8}, {h, sizeof(*h)}, {dg, FR_SHA256_LEN}};
    fr_hmac_key_mac(k, p, 3, tag);
}

size_t fr_boot_seal_frame(fr_seal_t *s, uint32_t type, const void *p,
                          size_t len, unsigned char *out)
{
    fr_frame_hdr_t h = {type, (uint32_t)len};
    unsigned char dg[FR_SHA256_LEN];
    memcpy(out, &h, sizeof(h));
    if (len)
        memcpy(out + sizeof(h), p, len);
    fr_hmac_stream_xor(&s->tx.enc, s->tx.n, 0, out + sizeof(h), len);
    fr_sha256(out + sizeof(h), len, dg);
    fr_seal_tag(&s->tx.mac, s->tx.n, &h, dg, out + sizeof(h) + len);
    s->tx.n++;
    return sizeof(h) + len + FR_SEAL_TAG_LEN;
}

/* Send a sealed frame in up to three pieces; the frame number it spent
 * goes back when none of it left. */
static int fr_seal_push(fr_conn_t *c, const void *p1, size_t l1,
                        const void *p2, size_t l2, const void *p3, size_t l3,
                        int64_t deadline, size_t *moved)
{
    size_t m = 0;
    int io = fr_boot_sendv3(c->fd, p1, l1, p2, l2, p3, l3, deadline, &m);
    if (m == 0 && io != FR_IO_OK)
        c->seal.tx.n--;
    if (moved)
        *moved = m;
    return io;
}

int fr_boot_seal_send(fr_conn_t *c, uint32_t type, const void *p1, size_t l1,
                      const void *p2, size_t l2, int64_t deadline,
                      size_t *moved)
{
    unsigned char small[512], *buf = small;
    size_t need = sizeof(fr_frame_hdr_t) + l1 + l2 + FR_SEAL_TAG_LEN;
    if (need > sizeof(small) && !(buf = malloc(need))) {
        if (moved)
            *moved = 0;
        return FR_IO_ERR;
    }
    /* The payload gathered behind the header, then sealed in place. */
    unsigned char *pl = buf + sizeof(fr_frame_hdr_t);
    if (l1)
        memcpy(pl, p1, l1);
    if (l2)
        memcpy(pl + l1, p2, l2);
    size_t n = fr_boot_seal_frame(&c->seal, type, pl, l1 + l2, buf);
    int io = fr_seal_push(c, buf, n, NULL, 0, NULL, 0, deadline, moved);
    if (buf != small) {
        fr_boot_wipe(buf, need);
        free(buf);
    }
    return io;
}

int fr_boot_seal_all(const fr_hmac_key_t *group, uint64_t seq,
                     const void *data, size_t n, fr_sealed_all_t *a)
{
    a->len = 8 + n;
    a->body = malloc(a->len);
    if (!a->body)
        return -1;
    memcpy(a->body, &seq, 8);
    if (n)
        memcpy(a->body + 8, data, n);
    fr_hmac_stream_xor(group, seq, 0, a->body + 8, n);
    fr_sha256(a->body, a->len, a->digest);
    return 0;
}

int fr_boot_seal_send_all(fr_conn_t *c, const fr_sealed_all_t *a,
                          int64_t deadline, size_t *moved)
{
    fr_frame_hdr_t h = {FR_MSG_ALL, (uint32_t)a->len};
    unsigned char tag[FR_SEAL_TAG_LEN];
    fr_seal_tag(&c->seal.tx.mac, c->seal.tx.n, &h, a->digest, tag);
    c->seal.tx.n++;
    return fr_seal_push(c, &h, sizeof(h), a->body, a->len, tag, sizeof(tag),
                        deadline, moved);
}

/* Check the tag of frame h whose payload hashed to dg; the frame number
 * advances on a match. */
static int fr_seal_check(fr_seal_t *s, const fr_frame_hdr_t *h,
                         const unsigned char *dg, const unsigned char *tag)
{
    unsigned char want[FR_SEAL_TAG_LEN];
    fr_seal_tag(&s->rx.mac, s->rx.n, h, dg, want);
    if (!fr_boot_ct_equal(want, tag, sizeof(want)))
        return FR_IO_FORGED;
    s->rx.n++;
    return FR_IO_OK;
}

int fr_boot_open_body(fr_conn_t *c, const fr_frame_hdr_t *h, void *d1,
                      size_t n1, void *d2, size_t n2,
                      const fr_hmac_key_t *group, int64_t deadline)
{
    fr_sha256_t sh;
    unsigned char dg[FR_SHA256_LEN], tag[FR_SEAL_TAG_LEN];
    int io = FR_IO_OK;
    fr_sha256_init(&sh);
    if (!d1) { /* discard, hashing as it comes */
        unsigned char tmp[4096];
        size_t left = h->len;
        while (io == FR_IO_OK && left > 0) {
            size_t k = left < sizeof(tmp) ? left : sizeof(tmp);
            io = fr_boot_recv_all(c->fd, tmp, k, deadline, NULL);
            fr_sha256_update(&sh, tmp, k);
            left -= k;
        }
        n1 = n2 = 0;
    } else {
        io = fr_boot_recv_all(c->fd, d1, n1, deadline, NULL);
        if (io == FR_IO_OK && n2)
            io = fr_boot_recv_all(c->fd, d2, n2, deadline, NULL);
        fr_sha256_update(&sh, d1, n1);
        if (n2)
            fr_sha256_update(&sh, d2, n2);
    }
    if (io == FR_IO_OK)
        io = fr_boot_recv_all(c->fd, tag, sizeof(tag), deadline, NULL);
    if (io != FR_IO_OK)
        return io;
    fr_sha256_final(&sh, dg);
    uint64_t n = c->seal.rx.n;
    io = fr_seal_check(&c->seal, h, dg, tag);
    if (io != FR_IO_OK || !d1)
        return io;
    if (group) { /* d1: the seq in the clear; d2: the array */
        uint64_t seq;
        memcpy(&seq, d1, 8);
        fr_hmac_stream_xor(group, seq, 0, d2, n2);
        return FR_IO_OK;
    }
    fr_hmac_stream_xor(&c->seal.rx.enc, n, 0, d1, n1);
    if (n2)
        fr_hmac_stream_xor(&c->seal.rx.enc, n, n1, d2, n2);
    return FR_IO_OK;
}

int fr_boot_open_mem(fr_seal_t *s, const unsigned char *frame, void *out,
                     size_t n)
{
    fr_frame_hdr_t h;
    unsigned char dg[FR_SHA256_LEN];
    memcpy(&h, frame, sizeof(h));
    const unsigned char *pl = frame + sizeof(h);
    fr_sha256(pl, n, dg);
    uint64_t k = s->rx.n;
    if (fr_seal_check(s, &h, dg, pl + n) != FR_IO_OK)
        return FR_IO_FORGED;
    if (n) {
        memcpy(out, pl, n);
        fr_hmac_stream_xor(&s->rx.enc, k, 0, out, n);
    }
    return FR_IO_OK;
}
