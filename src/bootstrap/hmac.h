/*
 * Small cryptographic helpers of the bootstrap's authentication: SHA-256
 * (FIPS 180-4), HMAC-SHA256 (RFC 2104), a constant-time comparison, random
 * bytes from the kernel (getrandom, else /dev/urandom) and a wipe that the
 * compiler keeps; a key made ready once for many HMACs, and a keystream of
 * HMAC-SHA256 in counter mode (HMAC as the pseudo-random function) that
 * seals the bootstrap's frames (tcp_seal.c).
 */
#ifndef FR_BOOT_HMAC_H
#define FR_BOOT_HMAC_H

#include <stddef.h>
#include <stdint.h>

#define FR_SHA256_LEN 32

typedef struct fr_sha256 {
    uint32_t h[8];
    uint64_t bytes;      /* message length so far */
    unsigned char buf[64];
    size_t nbuf;
} fr_sha256_t;

void fr_sha256_init(fr_sha256_t *s);
void fr_sha256_update(fr_sha256_t *s, const void *p, size_t n);
void fr_sha256_final(fr_sha256_t *s, unsigned char out[FR_SHA256_LEN]);
void fr_sha256(const void *p, size_t n, unsigned char out[FR_SHA256_LEN]);

/* HMAC-SHA256 over the concatenation of nparts buffers. */
typedef struct fr_hmac_part {
    const void *p;
    size_t n;
} fr_hmac_part_t;
void fr_hmac_sha256(const void *key, size_t klen, const fr_hmac_part_t *parts,
                    int nparts, unsigned char out[FR_SHA256_LEN]);

/* An HMAC-SHA256 key made ready once: the hash states after the inner and
 * outer pads, so each MAC costs only its message and one more block. */
typedef struct fr_hmac_key {
    fr_sha256_t in, out;
} fr_hmac_key_t;
void fr_hmac_key_init(fr_hmac_key_t *k, const void *key, size_t klen);
void fr_hmac_key_mac(const fr_hmac_key_t *k, const fr_hmac_part_t *parts,
                     int nparts, unsigned char out[FR_SHA256_LEN]);

/* XOR the n bytes at p with the keystream whose block i (32 bytes) is
 * HMAC(k, nonce | i), both as little-endian u64, starting at byte off of
 * the stream. Encrypts and decrypts alike; a (key, nonce) pair must never
 * serve two messages. */
void fr_hmac_stream_xor(const fr_hmac_key_t *k, uint64_t nonce, uint64_t off,
                        void *p, size_t n);

/* 1 when a and b hold the same n bytes; time depends on n only. */
int fr_boot_ct_equal(const void *a, const void *b, size_t n);

/* n random bytes from the kernel; 0, or -1 with errno set. */
int fr_boot_random(void *buf, size_t n);

/* Zero n bytes at p in a way the compiler does not drop. */
void fr_boot_wipe(void *p, size_t n);

#endif
