/* SHA-256 (FIPS 180-2 examples) and HMAC-SHA256 (RFC 4231 test cases 1-4,
 * 6, 7), fed whole and in pieces; the constant-time comparison; random
 * bytes. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "bootstrap/hmac.h"
#include "core/err.h"
#include "harness.h"

static void hex(const unsigned char *p, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", p[i]);
}

static void unhex(const char *s, unsigned char *out, size_t *n)
{
    size_t k = 0;
    for (; s[0] && s[1]; s += 2) {
        unsigned v;
        sscanf(s, "%2x", &v);
        out[k++] = (unsigned char)v;
    }
    *n = k;
}

static void sha_case(const char *msg, const char *want)
{
    unsigned char d[32];
    char got[65];
    fr_sha256(msg, strlen(msg), d);
    hex(d, 32, got);
    CHECK(!strcmp(got, want), "sha256(\"%.20s...\") = %s, want %s", msg, got,
          want);
    /* one byte at a time */
    fr_sha256_t s;
    fr_sha256_init(&s);
    for (size_t i = 0; msg[i]; i++)
        fr_sha256_update(&s, msg + i, 1);
    fr_sha256_final(&s, d);
    hex(d, 32, got);
    CHECK(!strcmp(got, want), "sha256 bytewise = %s, want %s", got, want);
}

static void hmac_case(int tc, const char *key_hex, const char *data_hex,
                      const char *data_txt, const char *want)
{
    unsigned char key[200], data[200], mac[32];
    size_t kl, dl;
    unhex(key_hex, key, &kl);
    if (data_txt) {
        dl = strlen(data_txt);
        memcpy(data, data_txt, dl);
    } else {
        unhex(data_hex, data, &dl);
    }
    fr_hmac_part_t one = {data, dl};
    fr_hmac_sha256(key, kl, &one, 1, mac);
    char got[65];
    hex(mac, 32, got);
    CHECK(!strcmp(got, want), "RFC 4231 case %d: %s, want %s", tc, got, want);
    /* the same message in three parts */
    fr_hmac_part_t three[3] = {{data, dl / 3},
                               {data + dl / 3, dl / 3},
                               {data + 2 * (dl / 3), dl - 2 * (dl / 3)}};
    fr_hmac_sha256(key, kl, three, 3, mac);
    hex(mac, 32, got);
    CHECK(!strcmp(got, want), "RFC 4231 case %d in parts: %s", tc, got);
}

/* The keystream of the sealed bootstrap frames: block i is HMAC(k, nonce |
 * i) (little-endian u64s), computed here by the one-shot HMAC; XOR in
 * pieces at offsets equals XOR at once; a second XOR restores; another
 * nonce gives another stream. The made-ready key MACs as the one-shot. */
static void stream_case(void)
{
    const char *key = "stream-key-0123456789";
    fr_hmac_key_t k;
    fr_hmac_key_init(&k, key, strlen(key));
    unsigned char a[100], b[100], c[100], want[32];
    memset(a, 0, sizeof(a));
    fr_hmac_stream_xor(&k, 7, 0, a, sizeof(a));
    for (uint64_t i = 0; i < 4; i++) {
        unsigned char in[16];
        for (int j = 0; j < 8; j++) {
            in[j] = (unsigned char)((uint64_t)7 >> (8 * j));
            in[8 + j] = (unsigned char)(i >> (8 * j));
        }
        fr_hmac_part_t p = {in, 16};
        fr_hmac_sha256(key, strlen(key), &p, 1, want);
        size_t n = i == 3 ? 4 : 32;
        CHECK(!memcmp(a + 32 * i, want, n), "keystream block %llu differs",
              (unsigned long long)i);
    }
    memset(b, 0, sizeof(b));
    fr_hmac_stream_xor(&k, 7, 0, b, 5);
    fr_hmac_stream_xor(&k, 7, 5, b + 5, 40);
    fr_hmac_stream_xor(&k, 7, 45, b + 45, 55);
    CHECK(!memcmp(a, b, sizeof(a)), "keystream in pieces differs");
    for (size_t i = 0; i < sizeof(c); i++)
        c[i] = (unsigned char)i;
    fr_hmac_stream_xor(&k, 9, 3, c, sizeof(c));
    memset(b, 0, sizeof(b));
    fr_hmac_stream_xor(&k, 8, 0, b, sizeof(b));
    CHECK(memcmp(a, b, sizeof(a)) != 0, "nonces 7 and 8 gave one stream");
    fr_hmac_stream_xor(&k, 9, 3, c, sizeof(c));
    for (size_t i = 0; i < sizeof(c); i++)
        CHECK(c[i] == (unsigned char)i, "byte %zu not restored", i);
    fr_hmac_part_t m = {"message", 7};
    unsigned char m1[32], m2[32];
    fr_hmac_key_mac(&k, &m, 1, m1);
    fr_hmac_sha256(key, strlen(key), &m, 1, m2);
    CHECK(!memcmp(m1, m2, 32), "made-ready key and one-shot HMAC differ");
}

int main(void)
{
    stream_case();
    sha_case("", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    sha_case("abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    sha_case("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
             "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    sha_case("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
             "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu",
             "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");

    char k131[263];
    for (int i = 0; i < 131; i++)
        memcpy(k131 + 2 * i, "aa", 2);
    k131[262] = '\0';
    char d50[101], k20aa[41], k25[51], d50cd[101];
    for (int i = 0; i < 50; i++) {
        memcpy(d50 + 2 * i, "dd", 2);
        memcpy(d50cd + 2 * i, "cd", 2);
    }
    d50[100] = d50cd[100] = '\0';
    for (int i = 0; i < 20; i++)
        memcpy(k20aa + 2 * i, "aa", 2);
    k20aa[40] = '\0';
    for (int i = 0; i < 25; i++)
        sprintf(k25 + 2 * i, "%02x", i + 1);

    hmac_case(1, "0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b", NULL, "Hi There",
              "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    hmac_case(2, "4a656665", NULL, "what do ya want for nothing?",
              "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    hmac_case(3, k20aa, d50, NULL,
              "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
    hmac_case(4, k25, d50cd, NULL,
              "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
    hmac_case(6, k131, NULL,
              "Test Using Larger Than Block-Size Key - Hash Key First",
              "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    hmac_case(7, k131, NULL,
              "This is a test using a larger than block-size key and a larger "
              "than block-size data. The key needs to be hashed before being "
              "used by the HMAC algorithm.",
              "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");

    unsigned char a[32], b[32];
    memset(a, 7, sizeof(a));
    memcpy(b, a, sizeof(b));
    CHECK(fr_boot_ct_equal(a, b, 32), "equal buffers differ");
    b[31] ^= 1;
    CHECK(!fr_boot_ct_equal(a, b, 32), "last byte differs, reported equal");
    b[31] ^= 1;
    b[0] ^= 0x80;
    CHECK(!fr_boot_ct_equal(a, b, 32), "first byte differs, reported equal");

    unsigned char r1[32], r2[32];
    CHECK(fr_boot_random(r1, sizeof(r1)) == 0, "random failed");
    CHECK(fr_boot_random(r2, sizeof(r2)) == 0, "random failed");
    CHECK(memcmp(r1, r2, 32) != 0, "two random draws are equal");
    fr_boot_wipe(r1, sizeof(r1));
    memset(r2, 0, sizeof(r2));
    CHECK(memcmp(r1, r2, 32) == 0, "wipe left bytes");

    printf("test_hmac: %s\n", fr_test_result() ? "FAIL" : "pass");
    return fr_test_result();
}
