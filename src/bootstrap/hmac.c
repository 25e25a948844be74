/*
 * SHA-256 and HMAC-SHA256 for the bootstrap's authentication (checked
 * against the FIPS 180-2 and RFC 4231 vectors by tests/unit/test_hmac.c),
 * with the constant-time comparison, kernel random bytes and wipe that go
 * with them. See hmac.h.
 */
#include "hmac.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

static const uint32_t fr_sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
    0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
    0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define FR_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void fr_sha256_block(uint32_t h[8], const unsigned char *p)
{
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = FR_ROR(w[i - 15], 7) ^ FR_ROR(w[i - 15], 18) ^
                      (w[i - 15] >> 3);
        uint32_t s1 = FR_ROR(w[i - 2], 17) ^ FR_ROR(w[i - 2], 19) ^
                      (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, h, sizeof(v));
    for (int i = 0; i < 64; i++) {
        uint32_t s1 = FR_ROR(v[4], 6) ^ FR_ROR(v[4], 11) ^ FR_ROR(v[4], 25);
        uint32_t ch = (v[4] & v[5]) ^ (~v[4] & v[6]);
        uint32_t t1 = v[7] + s1 + ch + fr_sha_k[i] + w[i];
        uint32_t s0 = FR_ROR(v[0], 2) ^ FR_ROR(v[0], 13) ^ FR_ROR(v[0], 22);
        uint32_t maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
        memmove(v + 1, v, 7 * sizeof(uint32_t));
        v[4] += t1;
        v[0] = t1 + s0 + maj;
    }
    for (int i = 0; i < 8; i++)
        h[i] += v[i];
}

void fr_sha256_init(fr_sha256_t *s)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372,
                                   0xa54ff53a, 0x510e527f, 0x9b05688c,
                                   0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof(iv));
    s->bytes = 0;
    s->nbuf = 0;
}

void fr_sha256_update(fr_sha256_t *s, const void *p, size_t n)
{
    const unsigned char *c = p;
    s->bytes += n;
    while (n > 0) {
        size_t k = 64 - s->nbuf < n ? 64 - s->nbuf : n;
        memcpy(s->buf + s->nbuf, c, k);
        s->nbuf += k;
        c += k;
        n -= k;
        if (s->nbuf == 64) {
            fr_sha256_block(s->h, s->buf);
            s->nbuf = 0;
        }
    }
}

void fr_sha256_final(fr_sha256_t *s, unsigned char out[FR_SHA256_LEN])
{
    uint64_t bits = s->bytes * 8;
    unsigned char pad[72] = {0x80};
    size_t npad = (s->nbuf < 56 ? 56 : 120) - s->nbuf;
    for (int i = 0; i < 8; i++)
        pad[npad + (size_t)i] = (unsigned char)(bits >> (56 - 8 * i));
    fr_sha256_update(s, pad, npad + 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)s->h[i];
    }
    fr_boot_wipe(s, sizeof(*s));
}

void fr_sha256(const void *p, size_t n, unsigned char out[FR_SHA256_LEN])
{
    fr_sha256_t s;
    fr_sha256_init(&s);
    fr_sha256_update(&s, p, n);
    fr_sha256_final(&s, out);
}

void fr_hmac_key_init(fr_hmac_key_t *k, const void *key, size_t klen)
{
    unsigned char k0[64], pad[64];
    memset(k0, 0, sizeof(k0));
    if (klen > 64)
        fr_sha256(key, klen, k0);
    else if (klen > 0)
        memcpy(k0, key, klen);
    for (int i = 0; i < 64; i++)
        pad[i] = k0[i] ^ 0x36;
    fr_sha256_init(&k->in);
    fr_sha256_update(&k->in, pad, 64);
    for (int i = 0; i < 64; i++)
        pad[i] = k0[i] ^ 0x5c;
    fr_sha256_init(&k->out);
    fr_sha256_update(&k->out, pad, 64);
    fr_boot_wipe(k0, sizeof(k0));
    fr_boot_wipe(pad, sizeof(pad));
}

void fr_hmac_key_mac(const fr_hmac_key_t *k, const fr_hmac_part_t *parts,
                     int nparts, unsigned char out[FR_SHA256_LEN])
{
    unsigned char inner[FR_SHA256_LEN];
    fr_sha256_t s = k->in;
    for (int i = 0; i < nparts; i++)
        fr_sha256_update(&s, parts[i].p, parts[i].n);
    fr_sha256_final(&s, inner);
    s = k->out;
    fr_sha256_update(&s, inner, sizeof(inner));
    fr_sha256_final(&s, out);
    fr_boot_wipe(inner, sizeof(inner));
    fr_boot_wipe(&s, sizeof(s));
}

void fr_hmac_sha256(const void *key, size_t klen, const fr_hmac_part_t *parts,
                    int nparts, unsigned char out[FR_SHA256_LEN])
{
    fr_hmac_key_t k;
    fr_hmac_key_init(&k, key, klen);
    fr_hmac_key_mac(&k, parts, nparts, out);
    fr_boot_wipe(&k, sizeof(k));
}

static void fr_put_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

void fr_hmac_stream_xor(const fr_hmac_key_t *k, uint64_t nonce, uint64_t off,
                        void *p, size_t n)
{
    unsigned char *q = p, in[16], ks[FR_SHA256_LEN];
    fr_hmac_part_t part = {in, sizeof(in)};
    fr_put_le64(in, nonce);
    while (n > 0) {
        uint64_t blk = off / FR_SHA256_LEN;
        size_t at = (size_t)(off % FR_SHA256_LEN);
        size_t take = FR_SHA256_LEN - at;
        if (take > n)
            take = n;
        fr_put_le64(in + 8, blk);
        fr_hmac_key_mac(k, &part, 1, ks);
        for (size_t i = 0; i < take; i++)
            q[i] ^= ks[at + i];
        q += take;
        n -= take;
        off += take;
    }
    fr_boot_wipe(ks, sizeof(ks));
}

int fr_boot_ct_equal(const void *a, const void *b, size_t n)
{
    const volatile unsigned char *x = a, *y = b;
    unsigned char d = 0;
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)(x[i] ^ y[i]);
    return d == 0;
}

int fr_boot_random(void *buf, size_t n)
{
    unsigned char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t k = getrandom(p + done, n - done, 0);
        if (k > 0) {
            done += (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        break; /* ENOSYS and the like: fall back to the device */
    }
    if (done == n)
        return 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    while (done < n) {
        ssize_t k = read(fd, p + done, n - done);
        if (k > 0)
            done += (size_t)k;
        else if (!(k < 0 && errno == EINTR))
            break;
    }
    close(fd);
    if (done == n)
        return 0;
    errno = EIO;
    return -1;
}

void fr_boot_wipe(void *p, size_t n)
{
    volatile unsigned char *v = p;
    for (size_t i = 0; i < n; i++)
        v[i] = 0;
}
