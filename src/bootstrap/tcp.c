/*
 * TCP bootstrap: a star of connections to rank 0. This file holds the
 * flavour's entry points (init, allgather, close), which take the handle's
 * lock and pick the root's side (tcp_root.c) or a leaf's (tcp_leaf.c), and
 * the record of the first dead rank that both sides and the watcher
 * (tcp_watch.c) keep. How sockets, frames and the lock are used: tcp.h.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "tcp.h"

void fr_boot_record_dead(fr_boot_t *b, int r)
{
    int expect = -1;
    if (__atomic_compare_exchange_n(&b->dead, &expect, r, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
        FR_LOG_WARN(FR_SUB_BOOT, "rank %d died (connection closed)", r);
}

int fr_boot_err_dead(fr_boot_t *b, fr_err_t *err)
{
    return FR_ERR(err, FERRY_ERR_PEER, "rank %d died (connection closed)",
                  __atomic_load_n(&b->dead, __ATOMIC_ACQUIRE));
}

static void fr_tcp_free(fr_boot_t *b)
{
    if (b->conns)
        for (int i = 0; i < b->nconns; i++)
            fr_boot_close_fd(&b->conns[i].fd);
    fr_boot_close_fd(&b->lfd);
    free(b->conns);
    fr_boot_wipe(b->key, sizeof(b->key));
    pthread_mutex_destroy(&b->mu);
    free(b);
}

int fr_boot_init_tcp(const fr_boot_env_t *env, fr_boot_t **boot, fr_err_t *err)
{
    if (!boot)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_init_tcp: boot is NULL");
    *boot = NULL;
    if (!env)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_init_tcp: env is NULL");
    if (env->size < 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "world size %d: must be at "
                                              "least 1", env->size);
    if (env->rank < 0 || env->rank >= env->size)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "rank %d is out of range for world size %d", env->rank,
                      env->size);
    if (env->size > 1 && (env->root_port < 1 || env->root_port > 65535))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "root port %d is not in 1..65535", env->root_port);
    fr_log_set_rank(env->rank);

    fr_boot_t *b = calloc(1, sizeof(*b));
    if (!b)
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    b->rank = env->rank;
    b->size = env->size;
    b->dead = -1;
    b->lfd = -1;
    if (env->size == 1) {
        b->kind = FR_BOOT_SINGLE;
        *boot = b;
        FR_LOG_INFO(FR_SUB_BOOT, "bootstrap: single rank, no sockets");
        return FERRY_OK;
    }
    b->kind = FR_BOOT_TCP;
    pthread_mutex_init(&b->mu, NULL);
    int rc = fr_boot_env_check_job(env, err);
    if (rc != FERRY_OK) {
        FR_LOG_WARN(FR_SUB_BOOT, "bootstrap refused: %s",
                    err ? err->msg : ferry_strerror(rc));
        fr_tcp_free(b);
        return rc;
    }
    b->nconns = b->rank == 0 ? b->size : 1;
    b->conns = calloc((size_t)b->nconns, sizeof(fr_conn_t));
    if (!b->conns) {
        fr_tcp_free(b);
        return FR_ERR(err, FERRY_ERR_NOMEM, "out of memory for bootstrap");
    }
    for (int i = 0; i < b->nconns; i++)
        b->conns[i].fd = -1;

    if (env->has_key) /* else the root makes a key file, the others read it */
        memcpy(b->key, env->key, sizeof(b->key));
    long timeout_ms = fr_cfg_int(FR_CFG_BOOTSTRAP_TIMEOUT_MS);
    if (timeout_ms < 1)
        timeout_ms = 1;
    int64_t t0 = fr_boot_now_ms();
    int64_t deadline = t0 + timeout_ms;
    rc = b->rank == 0 ? fr_boot_root_init(b, env, timeout_ms, deadline, err)
                      : fr_boot_leaf_init(b, env, timeout_ms, deadline, err);
    if (rc != FERRY_OK) {
        FR_LOG_WARN(FR_SUB_BOOT, "bootstrap failed: %s",
                    err ? err->msg : ferry_strerror(rc));
        fr_tcp_free(b);
        return rc;
    }
    int e = pthread_create(&b->watcher, NULL, fr_boot_watcher_main, b);
    if (e != 0) {
        fr_tcp_free(b);
        return FR_ERR(err, FERRY_ERR_SYSTEM,
                      "cannot start the bootstrap watcher thread: %s",
                      strerror(e));
    }
    b->watcher_on = 1;
    FR_LOG_INFO(FR_SUB_BOOT, "bootstrap ready: rank %d of %d via %s in %lld ms",
                b->rank, b->size, b->root_addr,
                (long long)(fr_boot_now_ms() - t0));
    *boot = b;
    return FERRY_OK;
}

int fr_boot_tcp_allgather(fr_boot_t *b, const void *in, void *out, size_t len,
                          fr_err_t *err)
{
    long tmo = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    if (tmo < 1)
        tmo = 1;
    pthread_mutex_lock(&b->mu);
    int rc, fresh = 0;
    b->seq++;
    if (__atomic_load_n(&b->dead, __ATOMIC_ACQUIRE) >= 0) {
        rc = fr_boot_err_dead(b, err);
    } else if (b->broken_rc != FERRY_OK) {
        rc = FR_ERR(err, b->broken_rc,
                    "bootstrap unusable after an earlier failure: %s",
                    b->broken_msg);
    } else {
        int64_t deadline = fr_boot_now_ms() + tmo;
        fr_err_t local;
        fr_err_t *e = err ? err : &local;
        rc = b->rank == 0
                 ? fr_boot_root_allgather(b, in, out, len, tmo, deadline, e)
                 : fr_boot_leaf_allgather(b, in, out, len, tmo, deadline, e);
        fresh = 1;
        if (rc != FERRY_OK && rc != FERRY_ERR_PEER) {
            b->broken_rc = rc;
            snprintf(b->broken_msg, sizeof(b->broken_msg), "%s", e->msg);
        }
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != FERRY_OK && fresh) /* not again for each later call */
        FR_LOG_WARN(FR_SUB_BOOT, "allgather failed: %s",
                    err ? err->msg : ferry_strerror(rc));
    return rc;
}

int fr_boot_tcp_close(fr_boot_t *b, fr_err_t *err)
{
    if (b->watcher_on) {
        __atomic_store_n(&b->stop, 1, __ATOMIC_RELEASE);
        pthread_join(b->watcher, NULL);
        b->watcher_on = 0;
    }
    long tmo = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    if (tmo < 1)
        tmo = 1;
    int64_t deadline = fr_boot_now_ms() + tmo;
    pthread_mutex_lock(&b->mu);
    int rc = b->rank == 0 ? fr_boot_root_close(b, tmo, deadline, err)
                          : fr_boot_leaf_close(b, tmo, deadline, err);
    pthread_mutex_unlock(&b->mu);
    if (rc == FERRY_OK)
        FR_LOG_INFO(FR_SUB_BOOT, "bootstrap closed (rank %d of %d)", b->rank,
                    b->size);
    else
        FR_LOG_WARN(FR_SUB_BOOT, "bootstrap closed with an error: %s",
                    err ? err->msg : ferry_strerror(rc));
    fr_tcp_free(b);
    return rc;
}
