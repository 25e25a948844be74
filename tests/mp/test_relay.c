/*
 * A relay in the middle of the rendezvous: the test squats the root's port
 * before the job (SO_REUSEADDR), accepts ranks 1..3, closes its listener
 * so that the real rank 0 binds, then connects to it once per rank and
 * forwards every frame both ways, parsing the streams (two plain frames
 * each way, then sealed frames: header, payload, 32-byte tag). It passes
 * the handshake on untouched, as a relay can, and then:
 *
 *   test_relay pass         changes nothing: the job succeeds through it
 *   test_relay tamper_down  flips a byte of the first allgather's answer
 *                           to rank 3: rank 3 fails saying the connection
 *                           was tampered with
 *   test_relay tamper_up    flips a byte of rank 2's first block: rank 0
 *                           fails naming rank 2 and its address, and tells
 *                           the others
 *   test_relay replay       sends rank 3 the first answer twice: rank 3
 *                           fails in the second allgather, tampered
 *   test_relay swap         gives rank 3 rank 2's copy of the first answer
 *                           (same array, another connection): rank 3 fails,
 *                           tampered
 *
 * In every mode no rank may finish with wrong data ("WRONG DATA"), and
 * the ranks end within the bootstrap timeout.
 */
#include "boot_ranks.h"
#include "bootstrap/boot_int.h"
#include "harness.h"

#undef SECRET
#define SECRET "relay-test-secret-0123456789abcdef"
#define N 4
#define TAG 32 /* FR_SEAL_TAG_LEN */

enum { M_PASS, M_TAMPER_DOWN, M_TAMPER_UP, M_REPLAY, M_SWAP };
static int mode;

/* One direction of one relayed connection. */
typedef struct stream {
    int from, to;
    unsigned char buf[1 << 16];
    size_t have;
    int frames;  /* whole frames forwarded (plain ones included) */
    int down;    /* root to rank */
    int pair;    /* its pair's index */
} stream_t;

typedef struct pair {
    stream_t up, down;
    int rank;    /* from the hello; -1 until then */
    int tag;     /* bytes of tag after a sealed payload (by the version in
                    the challenge: none before version 4) */
    int closed;
} pair_t;

static pair_t pairs[N];
static unsigned char saved[4096]; /* rank 2's first answer (swap) */
static size_t nsaved;

static void put(int fd, const void *p, size_t n)
{
    const unsigned char *q = p;
    while (n > 0) {
        ssize_t k = send(fd, q, n, MSG_NOSIGNAL);
        if (k <= 0)
            return;
        q += k;
        n -= (size_t)k;
    }
}

/* Act on the whole frames in s; 1 when one must wait (swap's hold). */
static int forward(pair_t *p, stream_t *s)
{
    for (;;) {
        if (s->have < 8)
            return 0;
        uint32_t h[2];
        memcpy(h, s->buf, 8);
        if (s->down && s->frames == 0 && h[0] == FR_MSG_CHALLENGE &&
            s->have >= 16) {
            uint32_t v;
            memcpy(&v, s->buf + 12, 4);
            p->tag = v >= 4 ? TAG : 0;
        }
        int sealed = s->frames >= 2;
        size_t len = 8 + h[1] + (sealed ? (size_t)p->tag : 0);
        if (len > sizeof(s->buf)) {
            fprintf(stderr, "relay: frame of %zu bytes\n", len);
            exit(3);
        }
        if (s->have < len)
            return 0;
        int idx = s->frames - 2; /* sealed frame number */
        if (!s->down && s->frames == 1 && h[0] == FR_MSG_HELLO) {
            int32_t r;
            memcpy(&r, s->buf + 8 + 8, 4);
            p->rank = r;
        }
        int send_it = 1, twice = 0;
        if (s->down && idx == 2 && p->rank == 3) {
            if (mode == M_TAMPER_DOWN)
                s->buf[8 + 8 + 4] ^= 0x01; /* rank 1's int of round 0 */
            if (mode == M_REPLAY)
                twice = 1;
            if (mode == M_SWAP) {
                if (!nsaved)
                    return 1; /* rank 2's copy first */
                put(s->to, saved, nsaved);
                send_it = 0;
            }
        }
        if (s->down && idx == 2 && p->rank == 2 && len <= sizeof(saved)) {
            memcpy(saved, s->buf, len);
            nsaved = len;
        }
        if (!s->down && idx == 0 && p->rank == 2 && mode == M_TAMPER_UP)
            s->buf[8 + 8] ^= 0x01; /* its block, past the seq */
        if (send_it)
            put(s->to, s->buf, len);
        if (twice)
            put(s->to, s->buf, len);
        s->frames++;
        memmove(s->buf, s->buf + len, s->have - len);
        s->have -= len;
    }
}

/* The relay's loop over every pair, until all are closed or 20 s. */
static void relay_run(int n)
{
    int64_t until = now_ms() + 20000;
    while (now_ms() < until) {
        struct pollfd pf[2 * N];
        stream_t *who[2 * N];
        int k = 0, open = 0, held = 0;
        for (int i = 0; i < n; i++) {
            if (pairs[i].closed)
                continue;
            open++;
            stream_t *ss[2] = {&pairs[i].up, &pairs[i].down};
            for (int j = 0; j < 2; j++) {
                pf[k].fd = ss[j]->from;
                pf[k].events = POLLIN;
                pf[k].revents = 0;
                who[k++] = ss[j];
            }
        }
        if (!open)
            return;
        for (int i = 0; i < n; i++)
            if (!pairs[i].closed)
                held |= forward(&pairs[i], &pairs[i].down);
        if (poll(pf, (nfds_t)k, held ? 5 : 100) <= 0)
            continue;
        for (int j = 0; j < k; j++) {
            if (!pf[j].revents)
                continue;
            stream_t *s = who[j];
            pair_t *p = &pairs[s->pair];
            if (p->closed)
                continue;
            ssize_t r = recv(s->from, s->buf + s->have,
                             sizeof(s->buf) - s->have, 0);
            if (r <= 0) {
                /* One end left: so does the other. */
                close(p->up.from);
                close(p->down.from);
                p->closed = 1;
                continue;
            }
            s->have += (size_t)r;
            (void)forward(p, s);
        }
    }
}

static int run(void)
{
    /* The ranks first (they dial until someone listens), so that they do
     * not inherit the squatter's listener. */
    pid_t pids[N] = {0};
    int st[N], acc[N];
    for (int r = 1; r < N; r++)
        pids[r] = start_rank(r, N, SECRET);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(lfd, 16) != 0) {
        perror("relay listen");
        return 2;
    }
    for (int i = 0; i < N - 1; i++) {
        struct pollfd p = {.fd = lfd, .events = POLLIN};
        CHECK(poll(&p, 1, 5000) == 1, "rank %d of 3 never came", i + 1);
        acc[i] = accept(lfd, NULL, NULL);
    }
    close(lfd); /* the real rank 0 may bind now */
    fflush(stdout);
    pid_t relay = fork();
    if (relay == 0) {
        for (int i = 0; i < N - 1; i++) {
            int rfd = dial_wait(5000);
            if (rfd < 0)
                _exit(4);
            pairs[i].rank = -1;
            pairs[i].up = (stream_t){.from = acc[i], .to = rfd, .pair = i};
            pairs[i].down =
                (stream_t){.from = rfd, .to = acc[i], .down = 1, .pair = i};
        }
        relay_run(N - 1);
        _exit(0);
    }
    for (int i = 0; i < N - 1; i++)
        close(acc[i]);
    int64_t t0 = now_ms();
    pids[0] = start_rank(0, N, SECRET);
    wait_ranks(pids, N, st, 20000);
    int64_t took = now_ms() - t0;
    kill(relay, SIGKILL);
    waitpid(relay, NULL, 0);

    char e[N][700];
    for (int r = 0; r < N; r++) {
        slurp("err", r, e[r], sizeof(e[r]));
        fprintf(stderr, "rank %d exited %d: %s", r, st[r], e[r]);
        CHECK(strstr(e[r], "WRONG DATA") == NULL, "rank %d took altered "
                                                  "data: %s", r, e[r]);
        CHECK(st[r] == 0 || st[r] == 1, "rank %d exited %d", r, st[r]);
    }
    CHECK(took < 12000, "the ranks took %lld ms", (long long)took);
    switch (mode) {
    case M_PASS:
        for (int r = 0; r < N; r++)
            CHECK(st[r] == 0, "rank %d failed through a passive relay: %s", r,
                  e[r]);
        break;
    case M_TAMPER_UP:
        CHECK(st[0] == 1 && strstr(e[0], "rank 2 (127.0.0.1:") &&
                  strstr(e[0], "tampered with"),
              "rank 0 does not name rank 2 and its address as tampered "
              "with: %s", e[0]);
        for (int r = 1; r < N; r++)
            CHECK(st[r] == 1 && strstr(e[r], "tampered with"),
                  "rank %d does not fail saying so: %s", r, e[r]);
        break;
    default:
        CHECK(st[3] == 1 && strstr(e[3], "tampered with") &&
                  strstr(e[3], "127.0.0.1:"),
              "rank 3 does not fail naming the root's address as tampered "
              "with: %s", e[3]);
        break;
    }
    return fr_test_result();
}

int main(int argc, char **argv)
{
    static const char *names[] = {"pass", "tamper_down", "tamper_up",
                                  "replay", "swap"};
    mode = -1;
    for (int i = 0; argc > 1 && i < 5; i++)
        if (!strcmp(argv[1], names[i]))
            mode = i;
    if (mode < 0) {
        fprintf(stderr, "usage: %s pass|tamper_down|tamper_up|replay|swap\n",
                argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (!mkdtemp(logdir)) {
        perror("mkdtemp");
        return 2;
    }
    port = free_port();
    setenv("FERRY_BOOTSTRAP_TIMEOUT_MS", "5000", 0);
    setenv("FERRY_TIMEOUT_MS", "5000", 0);
    int rc = run();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", logdir);
    (void)!system(cmd);
    printf("test_relay %s: %s\n", argv[1], rc ? "FAIL" : "pass");
    return rc;
}
