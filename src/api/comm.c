/* Communicators: from the environment or a caller's allgather. */
#include "api/api.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "core/log.h"

static void fr_errbuf(char *buf, size_t len, const char *msg)
{
    if (buf && len)
        snprintf(buf, len, "%s", msg);
}

/* cfg_rc, cfg_err: this rank's settings check, exchanged with the peer
 * table so that a bad setting on one rank fails every rank's init, naming
 * it (a caller's allgather has no deadline: a rank that left before it
 * would hold its peers there for good). */
static int fr_comm_finish(ferry_comm_t c, int cfg_rc, const fr_err_t *cfg_err, fr_err_t *err)
{
    c->rank = fr_boot_rank(c->boot);
    c->size = fr_boot_size(c->boot);
    fr_log_set_rank(c->rank);
    c->peers = calloc((size_t)c->size, sizeof(*c->peers));
    if (!c->peers)
        return FR_ERR(err, FERRY_ERR_NOMEM, "peer table for %d ranks",
                      c->size);
    fr_peer_info_t me;
    memset(&me, 0, sizeof(me));
    const char *node = fr_cfg_str(FR_CFG_NODE_ID), *host = fr_cfg_str(FR_CFG_HOST_NAME);
    me.node_set = node && *node;
    if (node && *node)
        snprintf(me.node, sizeof(me.node), "%s", node);
    else if (host && *host)
        snprintf(me.node, sizeof(me.node), "%s", host);
    else if (gethostname(me.node, sizeof(me.node) - 1) != 0)
        snprintf(me.node, sizeof(me.node), "localhost");
    me.pid = (int32_t)getpid();
    me.rank = c->rank;
    me.cfg_status = cfg_rc;
    int rc = fr_boot_allgather(c->boot, &me, c->peers, sizeof(me), err);
    if (rc != FERRY_OK)
        return rc;
    if (cfg_rc != FERRY_OK)
        return FR_ERR(err, cfg_rc, "%s", cfg_err->msg);
    for (int i = 0; i < c->size; i++)
        if (c->peers[i].cfg_status != FERRY_OK)
            return FR_ERR(err, c->peers[i].cfg_status,
                          "rank %d (pid %d) refused a FERRY_* setting of its environment "
                          "(its error says which): set them alike on every rank",
                          i, (int)c->peers[i].pid);
    c->nnodes = 0;
    for (int i = 0; i < c->size; i++) {
        int seen = 0;
        for (int j = 0; j < i && !seen; j++)
            seen = strcmp(c->peers[i].node, c->peers[j].node) == 0;
        c->nnodes += !seen;
    }
    FR_LOG_INFO(FR_SUB_INIT, "rank %d of %d on node %s (%d nodes)", c->rank,
                c->size, me.node, c->nnodes);
    return FERRY_OK;
}

int ferry_comm_init_env(ferry_comm_t *comm, char *errbuf, size_t errlen)
{
    fr_err_t err = {{0}};
    int rc;
    if (!comm) {
        fr_errbuf(errbuf, errlen, "comm: NULL pointer");
        return FERRY_ERR_INVALID;
    }
    *comm = NULL;
    ferry_comm_t c = calloc(1, sizeof(*c));
    if (!c) {
        fr_errbuf(errbuf, errlen, "out of memory");
        return FERRY_ERR_NOMEM;
    }
    /* the time settings in range before any deadline is computed; the
     * others' check travels in the first exchange */
    fr_err_t cerr = {{0}};
    FR_CHECK_GOTO(fr_cfg_check_time(&err), rc, fail);
    int crc = fr_cfg_check(&cerr);
    fr_boot_env_t env;
    rc = fr_boot_env_read(&env, &err);
    if (rc == FERRY_OK)
        rc = fr_boot_init_tcp(&env, &c->boot, &err);
    fr_boot_env_wipe(&env);
    if (rc != FERRY_OK)
        goto fail;
    FR_CHECK_GOTO(fr_comm_finish(c, crc, &cerr, &err), rc, fail);
    *comm = c;
    return FERRY_OK;
fail:
    fr_errbuf(errbuf, errlen, err.msg);
    if (c->boot)
        fr_boot_close(c->boot, NULL);
    free(c->peers);
    free(c);
    return rc;
}

int ferry_comm_init_allgather(int rank, int nranks, ferry_allgather_fn fn,
                              void *ctx, ferry_comm_t *comm, char *errbuf,
                              size_t errlen)
{
    fr_err_t err = {{0}};
    int rc;
    if (!comm || !fn) {
        fr_errbuf(errbuf, errlen, comm ? "fn: NULL pointer" : "comm: NULL pointer");
        return FERRY_ERR_INVALID;
    }
    *comm = NULL;
    if (nranks < 1 || nranks > FR_MAX_RANKS || rank < 0 || rank >= nranks) {
        snprintf(err.msg, sizeof(err.msg),
                 "rank %d / nranks %d: need 0 <= rank < nranks <= %d", rank,
                 nranks, FR_MAX_RANKS);
        fr_errbuf(errbuf, errlen, err.msg);
        return FERRY_ERR_INVALID;
    }
    ferry_comm_t c = calloc(1, sizeof(*c));
    if (!c) {
        fr_errbuf(errbuf, errlen, "out of memory");
        return FERRY_ERR_NOMEM;
    }
    fr_err_t cerr = {{0}};
    int crc = fr_cfg_check(&cerr); /* told to every rank by the first exchange */
    FR_CHECK_GOTO(fr_boot_init_callback(rank, nranks, fn, ctx, &c->boot, &err),
                  rc, fail);
    FR_CHECK_GOTO(fr_comm_finish(c, crc, &cerr, &err), rc, fail);
    *comm = c;
    return FERRY_OK;
fail:
    fr_errbuf(errbuf, errlen, err.msg);
    if (c->boot)
        fr_boot_close(c->boot, NULL);
    free(c->peers);
    free(c);
    return rc;
}

int ferry_comm_rank(ferry_comm_t comm) { return comm ? comm->rank : -1; }
int ferry_comm_size(ferry_comm_t comm) { return comm ? comm->size : -1; }
const char *ferry_comm_last_error(ferry_comm_t comm)
{
    return comm ? comm->err.msg : "comm: NULL handle";
}

int ferry_comm_allgather(ferry_comm_t comm, const void *in, void *out,
                         size_t len)
{
    if (!comm)
        return FERRY_ERR_INVALID;
    if ((!in || !out) && len)
        return FR_ERR(&comm->err, FERRY_ERR_INVALID, "%s: NULL pointer",
                      in ? "out" : "in");
    return fr_boot_allgather(comm->boot, in, out, len, &comm->err);
}

int ferry_comm_barrier(ferry_comm_t comm)
{
    if (!comm)
        return FERRY_ERR_INVALID;
    return fr_boot_barrier(comm->boot, &comm->err);
}

int ferry_comm_destroy(ferry_comm_t comm)
{
    if (!comm)
        return FERRY_ERR_INVALID;
    int users = __atomic_load_n(&comm->users, __ATOMIC_ACQUIRE);
    if (users > 0)
        return FR_ERR(&comm->err, FERRY_ERR_STATE,
                      "ferry_comm_destroy: %d EP or put-with-signal context%s still "
                      "use%s this communicator: destroy %s first (nothing was freed)",
                      users, users == 1 ? "" : "s", users == 1 ? "s" : "",
                      users == 1 ? "it" : "them");
    int rc = fr_boot_close(comm->boot, &comm->err);
    if (rc != FERRY_OK)
        FR_LOG_INFO(FR_SUB_BOOT, "close: %s", comm->err.msg);
    free(comm->peers);
    free(comm);
    return rc;
}

