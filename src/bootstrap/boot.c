/* Bootstrap handle: flavour dispatch, the callback flavour and the
 * single-rank case. The TCP flavour lives in tcp.c and tcp_*.c. */
#include <stdlib.h>
#include <string.h>

#include "../core/log.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "boot_int.h"

int fr_boot_init_callback(int rank, int size, ferry_allgather_fn fn, void *ctx,
                          fr_boot_t **boot, fr_err_t *err)
{
    if (!boot)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_init_callback: boot "
                                              "is NULL");
    *boot = NULL;
    if (!fn)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "allgather callback is NULL");
    if (size < 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "nranks=%d: must be at least 1",
                      size);
    if (rank < 0 || rank >= size)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "rank=%d is out of range for nranks=%d", rank, size);
    fr_boot_t *b = calloc(1, sizeof(*b));
    if (!b)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    b->kind = FR_BOOT_CALLBACK;
    b->rank = rank;
    b->size = size;
    b->fn = fn;
    b->ctx = ctx;
    b->dead = -1;
    *boot = b;
    FR_LOG_INFO(FR_SUB_BOOT, "bootstrap over the caller's allgather: rank %d "
                             "of %d", rank, size);
    return FERRY_OK;
}

int fr_boot_rank(const fr_boot_t *b) { return b ? b->rank : -1; }
int fr_boot_size(const fr_boot_t *b) { return b ? b->size : 0; }

int fr_boot_allgather(fr_boot_t *b, const void *in, void *out, size_t len,
                      fr_err_t *err)
{
    if (!b)
        return FR_ERR(err, FERRY_ERR_INVALID, "allgather: bootstrap is NULL");
    if (len > 0 && (!in || !out))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "allgather: %s is NULL with len=%zu", in ? "out" : "in",
                      len);
    /* Frames carry a u32 length: [size][len] plus a sequence number. */
    if (b->kind == FR_BOOT_TCP && len > (UINT32_MAX - 64) / (size_t)b->size)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "allgather: len=%zu times %d ranks is too large", len,
                      b->size);
    switch (b->kind) {
    case FR_BOOT_SINGLE:
        if (len && out != in)
            memmove(out, in, len);
        return FERRY_OK;
    case FR_BOOT_CALLBACK: {
        int rc = b->fn(in, out, len, b->ctx);
        if (rc != 0)
            return FR_ERR(err, FERRY_ERR_PEER,
                          "the caller's allgather returned %d (len=%zu)", rc,
                          len);
        return FERRY_OK;
    }
    case FR_BOOT_TCP:
        return fr_boot_tcp_allgather(b, in, out, len, err);
    default:
        return FR_ERR(err, FERRY_ERR_INTERNAL, "bootstrap kind %d", b->kind);
    }
}

int fr_boot_barrier(fr_boot_t *b, fr_err_t *err)
{
    if (!b)
        return FR_ERR(err, FERRY_ERR_INVALID, "barrier: bootstrap is NULL");
    unsigned char one = 1;
    unsigned char *all = malloc((size_t)b->size);
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "barrier: out of memory");
    int rc = fr_boot_allgather(b, &one, all, 1, err);
    free(all);
    return rc;
}

int fr_boot_dead_rank(const fr_boot_t *b)
{
    if (!b || b->kind != FR_BOOT_TCP)
        return -1;
    return __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE);
}

static int fr_boot_dead_rank_within(const fr_boot_t *b, int ms)
{
    if (!b || b->kind != FR_BOOT_TCP)
        return -1;
    int64_t until = fr_boot_now_ms() + ms;
    for (;;) {
        int dead = fr_boot_dead_rank(b);
        if (dead >= 0 || fr_boot_now_ms() >= until)
            return dead;
        fr_boot_sleep_ms(5);
    }
}

int fr_boot_blame(const fr_boot_t *b, int status)
{
    return status == FERRY_ERR_FABRIC
               ? fr_boot_dead_rank_within(b, FR_BOOT_DEATH_GRACE_MS)
               : -1;
}

int fr_boot_local_ipv4(const fr_boot_t *b, char *buf, size_t len)
{
    if (!b || b->kind != FR_BOOT_TCP || !b->conns || !buf || len < 16)
        return -1;
    for (int i = 0; i < b->nconns; i++) {
        if (b->conns[i].fd < 0 || b->conns[i].state != FR_CONN_LIVE)
            continue;
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        if (getsockname(b->conns[i].fd, (struct sockaddr *)&sa, &sl) != 0 ||
            sa.sin_family != AF_INET)
            continue;
        if (!inet_ntop(AF_INET, &sa.sin_addr, buf, (socklen_t)len))
            continue;
        return 0;
    }
    return -1;
}

int fr_boot_close(fr_boot_t *b, fr_err_t *err)
{
    if (!b)
        return FERRY_OK;
    if (b->kind == FR_BOOT_TCP)
        return fr_boot_tcp_close(b, err); /* frees b */
    FR_LOG_INFO(FR_SUB_BOOT, "bootstrap closed (rank %d of %d)", b->rank,
                b->size);
    free(b);
    return FERRY_OK;
}
