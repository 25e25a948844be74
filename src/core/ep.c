/* Communicators, EP contexts, argument checks and round sequencing. */
#include "core/ep.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/config.h"
#include "core/log.h"
#include "kernels/cuda/api.h"

int fr_ep_fail(ferry_ep_t ep, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ep->err.msg, sizeof(ep->err.msg), fmt, ap);
    va_end(ap);
    if (code == FERRY_ERR_TIMEOUT || code == FERRY_ERR_PEER ||
        code == FERRY_ERR_PROTOCOL || code == FERRY_ERR_FABRIC ||
        code == FERRY_ERR_SYSTEM || code == FERRY_ERR_INTERNAL)
        ep->failed = code;
    FR_LOG_INFO(FR_SUB_EP, "%s: %s", ferry_strerror(code), ep->err.msg);
    return code;
}

static void fr_errbuf(char *buf, size_t len, const char *msg)
{
    if (buf && len)
        snprintf(buf, len, "%s", msg);
}

/* ---------------------------------------------------------------------- */
/* communicators                                                          */

static int fr_comm_finish(ferry_comm_t c, fr_err_t *err)
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
    const char *node = fr_cfg_str(FR_CFG_NODE_ID);
    if (node && *node)
        snprintf(me.node, sizeof(me.node), "%s", node);
    else if (gethostname(me.node, sizeof(me.node) - 1) != 0)
        snprintf(me.node, sizeof(me.node), "localhost");
    me.pid = (int32_t)getpid();
    me.rank = c->rank;
    int rc = fr_boot_allgather(c->boot, &me, c->peers, sizeof(me), err);
    if (rc != FERRY_OK)
        return rc;
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
    fr_boot_env_t env;
    FR_CHECK_GOTO(fr_boot_env_read(&env, &err), rc, fail);
    FR_CHECK_GOTO(fr_boot_init_tcp(&env, &c->boot, &err), rc, fail);
    FR_CHECK_GOTO(fr_comm_finish(c, &err), rc, fail);
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
    FR_CHECK_GOTO(fr_boot_init_callback(rank, nranks, fn, ctx, &c->boot, &err),
                  rc, fail);
    FR_CHECK_GOTO(fr_comm_finish(c, &err), rc, fail);
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
    int rc = fr_boot_close(comm->boot, &comm->err);
    if (rc != FERRY_OK)
        FR_LOG_INFO(FR_SUB_BOOT, "close: %s", comm->err.msg);
    free(comm->peers);
    free(comm);
    return rc;
}

/* ---------------------------------------------------------------------- */
/* EP create / destroy                                                    */

int fr_ep_check_config(int N, const ferry_ep_config_t *c, fr_err_t *err)
{
    if (!c)
        return FR_ERR(err, FERRY_ERR_INVALID, "config: NULL pointer");
    if (N < 1 || N > FR_MAX_RANKS)
        return FR_ERR(err, FERRY_ERR_INVALID, "world size %d: must be 1..%d",
                      N, FR_MAX_RANKS);
    if (c->size < sizeof(ferry_ep_config_t) || c->magic != FERRY_EP_CONFIG_MAGIC)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "config: not initialised with FERRY_EP_CONFIG_INIT "
                      "(size %zu, magic 0x%x)", c->size, c->magic);
    if (c->num_experts < 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "num_experts = %d: must be >= 1",
                      c->num_experts);
    if (c->num_experts % N != 0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "num_experts = %d is not divisible by the %d ranks",
                      c->num_experts, N);
    if (c->topk < 1 || c->topk > FR_MAX_TOPK)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk = %d: must be 1..%d",
                      c->topk, FR_MAX_TOPK);
    if (c->topk > c->num_experts)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "topk = %d exceeds num_experts = %d", c->topk,
                      c->num_experts);
    if (c->hidden < 1 || c->hidden > (1 << 20))
        return FR_ERR(err, FERRY_ERR_INVALID, "hidden = %d: must be 1..%d",
                      c->hidden, 1 << 20);
    if (c->max_tokens < 1 || c->max_tokens > (1 << 20))
        return FR_ERR(err, FERRY_ERR_INVALID, "max_tokens = %d: must be 1..%d",
                      c->max_tokens, 1 << 20);
    if (c->dispatch_dtype != FERRY_DTYPE_BF16 &&
        c->dispatch_dtype != FERRY_DTYPE_FP8_E4M3)
        return FR_ERR(err, FERRY_ERR_INVALID, "dispatch_dtype = %d: unknown",
                      (int)c->dispatch_dtype);
    if (c->dispatch_dtype == FERRY_DTYPE_FP8_E4M3 && c->hidden % 128 != 0)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "dispatch_dtype fp8 needs hidden to be a multiple of "
                      "128 (hidden = %d); use bf16", c->hidden);
    if ((2 * c->hidden) % 16 != 0)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "hidden = %d: a bf16 row must be a multiple of 16 bytes "
                      "(hidden a multiple of 8)", c->hidden);
    if (c->device == FERRY_DEVICE_CUDA) {
        char why[200];
        if (!ferry_cuda_available(why, sizeof(why)))
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "device = cuda: %s", why);
    }
    if (c->device != FERRY_DEVICE_CPU && c->device != FERRY_DEVICE_CUDA)
        return FR_ERR(err, FERRY_ERR_INVALID, "device = %d: unknown",
                      (int)c->device);
    uint64_t cap = (uint64_t)N * (uint64_t)c->max_tokens;
    if (cap > INT32_MAX || (uint64_t)c->max_tokens * c->topk > INT32_MAX)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "max_tokens = %d x %d ranks is too large",
                      c->max_tokens, N);
    return FERRY_OK;
}

/* What every rank contributes to the create-time exchange. */
typedef struct fr_setup_msg {
    int32_t status;
    int32_t E, K, H, T, dtype, device;
    char seg_name[96];
    fr_mr_desc_t seg_desc;
} fr_setup_msg_t;

static void *fr_zalloc(size_t n)
{
    return calloc(1, n ? n : 1);
}

static void fr_ep_free(ferry_ep_t ep)
{
    if (!ep)
        return;
    if (ep->proxy.running && fr_proxy_stop(ep) != 0) {
        if (ep->seg && ep->seg_name[0])
            fr_shm_unlink(ep->seg_name);
        return; /* the thread may still touch all of it */
    }
    fr_nics_groups_destroy(&ep->nics, &ep->groups);
    if (ep->nics.ops) {
        fr_nics_dereg(&ep->nics, &ep->rseg);
        fr_nics_dereg(&ep->nics, &ep->rsend);
    }
    fr_nics_close(&ep->nics);
    free(ep->gslices);
    if (ep->cuda)
        fr_cuda_free(ep); /* frees and clears seg, send, slices, ring */
    if (ep->peer_seg) {
        for (int i = 0; i < ep->N; i++)
            if (ep->peer_seg[i] && ep->peer_seg[i] != ep->seg)
                fr_shm_unmap(ep->peer_seg[i], ep->L.seg_bytes);
    }
    if (ep->seg) {
        fr_shm_unmap(ep->seg, ep->L.seg_bytes);
        if (ep->seg_name[0])
            fr_shm_unlink(ep->seg_name);
    }
    free(ep->send);
    for (int s = 0; s < FR_NSETS; s++) {
        free(ep->rounds[s].comb_pos);
        free(ep->rounds[s].pair_row);
        free(ep->rounds[s].pair_off);
        free(ep->rounds[s].comb_off);
    }
    free(ep->path);
    free(ep->peer_seg);
    free(ep->group_peers);
    free(ep->group_index);
    free(ep->slices);
    free(ep->flag_last);
    free(ep->ring_mem);
    free(ep->qbuf);
    free(ep->qscales);
    free(ep->cnt_rank);
    free(ep->pairs_rank);
    free(ep->fill);
    free(ep->rec_next);
    free(ep->comb_base);
    free(ep->expert_fill);
    free(ep->acc);
    free(ep);
}

int ferry_ep_create(ferry_comm_t comm, const ferry_ep_config_t *config,
                    ferry_ep_t *out)
{
    if (!out)
        return FERRY_ERR_INVALID;
    *out = NULL;
    if (!comm || !config)
        return FERRY_ERR_INVALID;
    fr_err_t err = {{0}};
    int rc = FERRY_OK;
    int N = comm->size, me = comm->rank;
    ferry_ep_t ep = fr_zalloc(sizeof(*ep));
    fr_setup_msg_t *all = fr_zalloc(sizeof(*all) * (size_t)N);
    if (!ep || !all) {
        free(ep);
        free(all);
        return FERRY_ERR_NOMEM;
    }
    ep->comm = comm;
    ep->N = N;
    ep->rank = me;
    ep->timeout_ms = fr_cfg_int(FR_CFG_TIMEOUT_MS);
    ep->spin = fr_cfg_int(FR_CFG_SPIN);
    fr_setup_msg_t msg;
    memset(&msg, 0, sizeof(msg));
    msg.status = fr_ep_check_config(comm->size, config, &err);
    if (msg.status == FERRY_OK) {
        ep->cfg = *config;
        msg.E = config->num_experts;
        msg.K = config->topk;
        msg.H = config->hidden;
        msg.T = config->max_tokens;
        msg.dtype = config->dispatch_dtype;
        msg.device = config->device;
        fr_layout_init(&ep->L, N, me, msg.E, msg.K, msg.H, msg.T,
                       msg.dtype == FERRY_DTYPE_FP8_E4M3);
        if (config->device == FERRY_DEVICE_CPU) {
            snprintf(msg.seg_name, sizeof(msg.seg_name), "/ferry-%d-r%d-%llx",
                     (int)getpid(), me, (unsigned long long)fr_now_ns());
            snprintf(ep->seg_name, sizeof(ep->seg_name), "%s", msg.seg_name);
            msg.status = fr_shm_create(ep->seg_name, ep->L.seg_bytes,
                                       &ep->seg, &err);
        }
    }
    /* Exchange statuses and configs first, so a rank that failed its own
     * checks fails everyone at once instead of leaving them waiting. */
    FR_CHECK_GOTO(fr_boot_allgather(comm->boot, &msg, all, sizeof(msg), &err),
                  rc, fail);
    if (msg.status != FERRY_OK) {
        rc = msg.status;
        goto fail;
    }
    for (int i = 0; i < N; i++) {
        if (all[i].status != FERRY_OK) {
            rc = FR_ERR(&err, all[i].status,
                        "rank %d failed to create its EP context (%s)", i,
                        ferry_strerror(all[i].status));
            goto fail;
        }
        if (all[i].E != msg.E || all[i].K != msg.K || all[i].H != msg.H ||
            all[i].T != msg.T || all[i].dtype != msg.dtype ||
            all[i].device != msg.device) {
            rc = FR_ERR(&err, FERRY_ERR_INVALID,
                        "config differs between ranks: rank %d has E=%d K=%d "
                        "H=%d T=%d dtype=%d, rank %d has E=%d K=%d H=%d T=%d "
                        "dtype=%d",
                        me, msg.E, msg.K, msg.H, msg.T, msg.dtype, i, all[i].E,
                        all[i].K, all[i].H, all[i].T, all[i].dtype);
            goto fail;
        }
    }

    /* Paths. */
    const fr_layout_t *L = &ep->L;
    const char *tr = fr_cfg_str(FR_CFG_TRANSPORT);
    int force_fabric = strcmp(tr, "fabric") == 0;
    if (!force_fabric && strcmp(tr, "auto") != 0) {
        rc = FR_ERR(&err, FERRY_ERR_INVALID,
                    "FERRY_TRANSPORT=%s: must be auto or fabric", tr);
        goto fail;
    }
    ep->path = fr_zalloc(sizeof(int) * (size_t)N);
    ep->peer_seg = fr_zalloc(sizeof(uint8_t *) * (size_t)N);
    ep->group_index = fr_zalloc(sizeof(int) * (size_t)N);
    ep->group_peers = fr_zalloc(sizeof(int) * (size_t)N);
    if (!ep->path || !ep->peer_seg || !ep->group_index || !ep->group_peers) {
        rc = FR_ERR(&err, FERRY_ERR_NOMEM, "peer tables");
        goto fail;
    }
    for (int i = 0; i < N; i++) {
        ep->group_index[i] = -1;
        if (i == me)
            ep->path[i] = FR_PATH_SELF;
        else if (!force_fabric &&
                 strcmp(comm->peers[i].node, comm->peers[me].node) == 0)
            ep->path[i] = FR_PATH_SHM;
        else
            ep->path[i] = FR_PATH_FABRIC;
        if (ep->path[i] == FR_PATH_FABRIC) {
            ep->group_index[i] = ep->nfabric;
            ep->group_peers[ep->nfabric++] = i;
        } else if (ep->path[i] == FR_PATH_SHM) {
            ep->nshm++;
        }
    }
    if (ep->cfg.device == FERRY_DEVICE_CUDA) {
        /* device segment, CUDA IPC mappings, device tables (collective) */
        FR_CHECK_GOTO(fr_cuda_setup(ep, &err), rc, fail);
    }
    ep->peer_seg[me] = ep->seg;
    for (int i = 0; i < N && !ep->cuda; i++) {
        if (ep->path[i] != FR_PATH_SHM)
            continue;
        FR_CHECK_GOTO(fr_shm_map(all[i].seg_name, L->seg_bytes,
                                 &ep->peer_seg[i], &err),
                      rc, fail);
    }

    /* Fabric: every rank joins when any pair of ranks needs it (the
     * transport's open is collective). */
    int any_fabric = N > 1 && (force_fabric || comm->nnodes > 1);
    if (any_fabric) {
        if (!ep->send) {
            if (posix_memalign((void **)&ep->send, 4096, L->send_bytes) != 0) {
                ep->send = NULL;
                rc = FR_ERR(&err, FERRY_ERR_NOMEM, "send region of %llu bytes",
                            (unsigned long long)L->send_bytes);
                goto fail;
            }
            memset(ep->send, 0, L->send_bytes);
        }
        /* NICs: FERRY_NICS_PER_RANK, or (0) as many as the node has, up to
         * FR_MAX_NICS. Opening NIC k is collective, present or not. */
        FR_CHECK_GOTO(fr_nics_open(&ep->nics, comm->boot, "fabric",
                                   fr_cfg_int(FR_CFG_NICS_PER_RANK), 0, &err),
                      rc, fail);
        FR_CHECK_GOTO(fr_nics_reg(&ep->nics, comm->boot, ep->seg,
                                  L->seg_bytes, 1, &ep->rseg, &err), rc, fail);
        FR_CHECK_GOTO(fr_nics_reg(&ep->nics, comm->boot, ep->send,
                                  L->send_bytes, 0, &ep->rsend, &err), rc, fail);
        FR_CHECK_GOTO(fr_nics_groups(&ep->nics, ep->group_peers, ep->nfabric,
                                     &ep->rsend, &ep->rseg, &ep->groups, &err),
                      rc, fail);
        ep->gslices = fr_zalloc(sizeof(fr_slice_t) * (size_t)(N + 1));
        if (!ep->gslices)
            rc = FR_ERR(&err, FERRY_ERR_NOMEM, "proxy tables");
        if (rc != FERRY_OK)
            goto fail;
        if (!ep->slices)
            ep->slices = fr_zalloc(sizeof(fr_slice_t) * 2 * FR_NSETS *
                                   (size_t)(ep->nfabric ? ep->nfabric : 1));
        ep->flag_last = fr_zalloc(sizeof(uint64_t) * 2 * FR_NSETS * (size_t)N);
        if (!ep->slices || !ep->flag_last) {
            rc = FR_ERR(&err, FERRY_ERR_NOMEM, "proxy tables");
            goto fail;
        }
        if (!ep->proxy.ring) {
            ep->ring_mem = fr_zalloc(sizeof(fr_proxy_ring_t));
            if (!ep->ring_mem) {
                rc = FR_ERR(&err, FERRY_ERR_NOMEM, "proxy ring");
                goto fail;
            }
            ep->proxy.ring = ep->ring_mem;
        }
        FR_CHECK_GOTO(fr_proxy_start(ep), rc, fail_ep);
    }

    /* Round state and scratch. */
    for (int s = 0; s < FR_NSETS; s++) {
        fr_round_t *r = &ep->rounds[s];
        r->comb_pos = fr_zalloc(sizeof(int32_t) * (size_t)L->T * L->K);
        r->pair_row = fr_zalloc(sizeof(int32_t) * (size_t)L->send_crows);
        r->pair_off = fr_zalloc(sizeof(uint32_t) * (size_t)(N + 1));
        r->comb_off = fr_zalloc(sizeof(uint32_t) * (size_t)N);
        if (!r->comb_pos || !r->pair_row || !r->pair_off || !r->comb_off) {
            rc = FR_ERR(&err, FERRY_ERR_NOMEM, "round tables");
            goto fail;
        }
    }
    ep->qbuf = fr_zalloc((size_t)L->T * L->tok_bytes);
    ep->qscales = fr_zalloc(sizeof(float) * (size_t)L->T * (L->nscales + 1));
    ep->cnt_rank = fr_zalloc(sizeof(int32_t) * (size_t)N);
    ep->pairs_rank = fr_zalloc(sizeof(int32_t) * (size_t)N);
    ep->fill = fr_zalloc(sizeof(int32_t) * (size_t)N);
    ep->rec_next = fr_zalloc(sizeof(int32_t) * (size_t)N);
    ep->comb_base = fr_zalloc(sizeof(uint32_t) * (size_t)N);
    ep->expert_fill = fr_zalloc(sizeof(int32_t) * (size_t)L->El);
    ep->acc = fr_zalloc(sizeof(float) * (size_t)L->H);
    if (!ep->qbuf || !ep->qscales || !ep->cnt_rank || !ep->pairs_rank ||
        !ep->fill || !ep->rec_next || !ep->comb_base || !ep->expert_fill || !ep->acc) {
        rc = FR_ERR(&err, FERRY_ERR_NOMEM, "scratch buffers");
        goto fail;
    }
    /* Everyone has mapped everyone: the names can go (nothing is left in
     * /dev/shm if a rank dies later). */
    FR_CHECK_GOTO(fr_boot_barrier(comm->boot, &err), rc, fail);
    if (ep->seg_name[0])
        fr_shm_unlink(ep->seg_name);
    ep->seg_name[0] = 0;
    if (fr_log_enabled(FR_LOG_INFO, FR_SUB_INIT)) {
        for (int i = 0; i < N; i++)
            FR_LOG_INFO(FR_SUB_INIT, "peer %d: path %s%s%s", i,
                        ep->path[i] == FR_PATH_SELF ? "self"
                        : ep->path[i] == FR_PATH_SHM ? "shm"
                        : "fabric",
                        ep->path[i] == FR_PATH_FABRIC ? " via " : "",
                        ep->path[i] == FR_PATH_FABRIC
                            ? fr_nics_iface(&ep->nics, i)
                            : "");
        FR_LOG_INFO(FR_SUB_INIT,
                    "EP E=%d K=%d H=%d T=%d %s: segment %llu B, send %llu B",
                    L->E, L->K, L->H, L->T, L->fp8 ? "fp8" : "bf16",
                    (unsigned long long)L->seg_bytes,
                    (unsigned long long)(ep->send ? L->send_bytes : 0));
    }
    free(all);
    *out = ep;
    return FERRY_OK;
fail_ep:
    snprintf(err.msg, sizeof(err.msg), "%s", ep->err.msg);
fail:
    FR_LOG_INFO(FR_SUB_INIT, "ep_create: %s", err.msg);
    snprintf(ep->err.msg, sizeof(ep->err.msg), "%s", err.msg);
    /* The caller has no handle to read the message from: keep it on the
     * communicator. */
    snprintf(comm->err.msg, sizeof(comm->err.msg), "%s", err.msg);
    free(all);
    fr_ep_free(ep);
    return rc;
}

int ferry_ep_destroy(ferry_ep_t ep)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = FERRY_OK;
    fr_err_t err = {{0}};
    if (ep->cuda && !ep->failed) {
        int c = fr_cuda_sync(ep, NULL);
        if (c != FERRY_OK)
            rc = c;
    }
    if (ep->proxy.running && !ep->failed && !ep->cuda) {
        for (int s = 0; s < FR_NSETS; s++)
            if (fr_proxy_wait_set(ep, s) != FERRY_OK)
                rc = ep->failed ? ep->failed : FERRY_ERR_TIMEOUT;
    }
    /* Nobody tears down memory a peer may still write into. */
    if (!ep->failed) {
        int b = fr_boot_barrier(ep->comm->boot, &err);
        if (b != FERRY_OK && rc == FERRY_OK)
            rc = b;
    }
    fr_ep_free(ep);
    return rc;
}

const char *ferry_ep_last_error(ferry_ep_t ep)
{
    return ep ? ep->err.msg : "ep: NULL handle";
}

int ferry_ep_get_layout(ferry_ep_t ep, ferry_ep_layout_t *lay)
{
    if (!ep || !lay)
        return FERRY_ERR_INVALID;
    if (lay->size < sizeof(*lay))
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "layout: size %zu, expected %zu (set it to "
                          "sizeof(ferry_ep_layout_t))",
                          lay->size, sizeof(*lay));
    const fr_layout_t *L = &ep->L;
    lay->num_ranks = L->N;
    lay->rank = L->rank;
    lay->num_local_experts = L->El;
    lay->expert_capacity = (int)L->cap;
    lay->token_bytes = L->tok_bytes;
    lay->num_scales = (int)L->nscales;
    lay->expert_x_bytes = (size_t)L->El * L->cap * L->tok_bytes;
    lay->expert_scales_bytes = (size_t)L->El * L->cap * L->nscales * 4;
    lay->expert_y_bytes = (size_t)L->El * L->cap * L->crow;
    lay->shm_bytes = L->seg_bytes;
    lay->host_bytes = (ep->send ? L->send_bytes : 0) +
                      (size_t)L->T * (L->tok_bytes + 4 * L->nscales) +
                      FR_NSETS * ((size_t)L->T * L->K * 4 + L->send_crows * 4);
    return FERRY_OK;
}

/* ---------------------------------------------------------------------- */
/* waiting                                                                */

/* Senders below *next that have arrived are skipped; returns 1 when all
 * have, -1 on a protocol violation (message set), else 0. */
static int fr_scan_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                         int *next, const char *what)
{
    const fr_layout_t *L = &ep->L;
    while (*next < ep->N) {
        uint64_t v = __atomic_load_n(fr_flag_ptr(L, ep->seg, phase, set, *next),
                                     __ATOMIC_ACQUIRE);
        if (v == epoch) {
            (*next)++;
            continue;
        }
        if (v > epoch) {
            fr_ep_fail(ep, FERRY_ERR_PROTOCOL,
                       "%s round %llu: rank %d is at round %llu (two rounds "
                       "ahead is impossible)", what, (unsigned long long)epoch,
                       *next, (unsigned long long)v);
            return -1;
        }
        return 0;
    }
    return 1;
}

/* Spin briefly; then sleep on the doorbell (a futex in this rank's
 * segment) so ranks sharing cores do not starve each other; every 2 ms
 * check for dead peers, proxy errors and the deadline. */
int fr_wait_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                  const char *what)
{
    const fr_layout_t *L = &ep->L;
    int N = ep->N;
    uint64_t start = fr_now_ns(), last_check = start;
    uint64_t deadline = start + (uint64_t)ep->timeout_ms * 1000000ull;
    uint64_t iter = 0;
    int next = 0;
    for (;;) {
        int st = fr_scan_flags(ep, phase, set, epoch, &next, what);
        if (st > 0)
            return FERRY_OK;
        if (st < 0)
            return FERRY_ERR_PROTOCOL;
        if (iter < (uint64_t)ep->spin) {
            iter++;
            fr_cpu_relax();
            continue;
        }
        uint64_t now = fr_now_ns();
        if (now - last_check < 2000000ull && now < deadline) {
            uint32_t seen = fr_doorbell_read(ep->seg);
            fr_doorbell_sleepers_add(ep->seg, 1);
            st = fr_scan_flags(ep, phase, set, epoch, &next, what);
            if (st == 0) {
                uint64_t left = deadline - now, nap = 2000000ull;
                fr_doorbell_sleep(ep->seg, seen, left < nap ? left : nap);
            }
            fr_doorbell_sleepers_add(ep->seg, -1);
            continue;
        }
        last_check = now;
        st = __atomic_load_n(&ep->async_status, __ATOMIC_ACQUIRE);
        if (st != FERRY_OK) {
            int dead = fr_boot_blame(ep->comm->boot, st);
            if (dead >= 0)
                return fr_ep_fail(ep, FERRY_ERR_PEER,
                                  "%s round %llu: rank %d died (%.300s)", what,
                                  (unsigned long long)epoch, dead,
                                  ep->async_msg);
            return fr_ep_fail(ep, st, "%s round %llu: %s", what,
                              (unsigned long long)epoch, ep->async_msg);
        }
        /* a dead rank fails this wait only if its data is still missing:
         * a round it finished can still complete */
        int dead = fr_boot_dead_rank(ep->comm->boot);
        if (dead >= 0 && dead < N &&
            __atomic_load_n(fr_flag_ptr(L, ep->seg, phase, set, dead),
                            __ATOMIC_ACQUIRE) != epoch)
            return fr_ep_fail(ep, FERRY_ERR_PEER,
                              "%s round %llu: rank %d died", what,
                              (unsigned long long)epoch, dead);
        for (int s = next; s < N; s++) {
            if (ep->path[s] != FR_PATH_SHM)
                continue;
            pid_t pid = ep->comm->peers[s].pid;
            if (kill(pid, 0) != 0 && errno == ESRCH &&
                __atomic_load_n(fr_flag_ptr(L, ep->seg, phase, set, s),
                                __ATOMIC_ACQUIRE) != epoch)
                return fr_ep_fail(ep, FERRY_ERR_PEER,
                                  "%s round %llu: rank %d (pid %d) died", what,
                                  (unsigned long long)epoch, s, (int)pid);
        }
        if (now >= deadline) {
            char list[256];
            size_t n = 0;
            int missing = 0;
            list[0] = 0;
            for (int s = next; s < N; s++) {
                uint64_t v = __atomic_load_n(
                    fr_flag_ptr(L, ep->seg, phase, set, s), __ATOMIC_ACQUIRE);
                if (v == epoch)
                    continue;
                missing++;
                if (n < sizeof(list) - 16)
                    n += (size_t)snprintf(list + n, sizeof(list) - n, "%s%d",
                                          missing > 1 ? "," : "", s);
            }
            return fr_ep_fail(ep, FERRY_ERR_TIMEOUT,
                              "%s round %llu: no data from rank%s %s after "
                              "%ld ms (FERRY_TIMEOUT_MS)",
                              what, (unsigned long long)epoch,
                              missing > 1 ? "s" : "", list, ep->timeout_ms);
        }
    }
}

/* ---------------------------------------------------------------------- */
/* rounds                                                                 */

static int fr_ep_usable(ferry_ep_t ep)
{
    if (ep->cuda && !ep->failed && fr_cuda_check(ep) != FERRY_OK)
        return ep->failed ? ep->failed : FERRY_ERR_INVALID;
    if (ep->failed)
        return fr_ep_fail(ep, ep->failed,
                          "the EP context failed earlier and cannot be used: "
                          "%.400s", ep->err.msg);
    return FERRY_OK;
}

static int fr_round_get(ferry_ep_t ep, uint64_t round, int want_state,
                        const char *call, fr_round_t **r)
{
    if (round == 0 || round >= ep->next_epoch + 1)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "%s: round = %llu was not returned by "
                          "ferry_dispatch_send", call,
                          (unsigned long long)round);
    fr_round_t *x = &ep->rounds[round % FR_NSETS];
    if (x->epoch != round)
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "%s: round %llu has already finished", call,
                          (unsigned long long)round);
    if (x->state != want_state) {
        static const char *names[] = {"finished", "dispatch_send",
                                      "dispatch_recv", "combine_send"};
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "%s: round %llu is after %s; calls go "
                          "dispatch_send, dispatch_recv, combine_send, "
                          "combine_recv", call, (unsigned long long)round,
                          names[x->state]);
    }
    *r = x;
    return FERRY_OK;
}

int fr_check_dispatch_args(const fr_layout_t *L, const ferry_dispatch_in_t *in,
                           int on_gpu, fr_err_t *err)
{
    if (in->size < sizeof(*in))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "in->size = %zu: set it to sizeof(ferry_dispatch_in_t)",
                      in->size);
    int T = in->num_tokens;
    if (on_gpu && in->num_tokens_dev)
        T = L->T; /* read on the device; checked there */
    if (T < 0 || T > L->T)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "num_tokens = %d: must be 0..max_tokens (%d)", T, L->T);
    if (T > 0 && !in->x)
        return FR_ERR(err, FERRY_ERR_INVALID, "x: NULL pointer");
    if (T > 0 && !in->topk_idx)
        return FR_ERR(err, FERRY_ERR_INVALID, "topk_idx: NULL pointer");
    if (in->x_scales && !L->fp8)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "x_scales given but the dispatch dtype is bf16");
    for (int t = 0; t < T && !on_gpu; t++) {
        const int64_t *row = in->topk_idx + (size_t)t * L->K;
        for (int k = 0; k < L->K; k++) {
            int64_t e = row[k];
            if (e < -1 || e >= L->E)
                return FR_ERR(err, FERRY_ERR_INVALID,
                              "topk_idx[%d][%d] = %lld: must be -1 or 0..%d",
                              t, k, (long long)e, L->E - 1);
            for (int j = 0; j < k && e >= 0; j++)
                if (row[j] == e)
                    return FR_ERR(err, FERRY_ERR_INVALID,
                                  "topk_idx[%d][%d] = %lld repeats "
                                  "topk_idx[%d][%d]", t, k, (long long)e, t, j);
        }
    }
    return FERRY_OK;
}

int ferry_dispatch_send(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                        uint64_t *round)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = fr_ep_usable(ep);
    if (rc)
        return rc;
    const fr_layout_t *L = &ep->L;
    if (!in)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "in: NULL pointer");
    if (!round)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "round: NULL pointer");
    int on_gpu = ep->cuda != NULL;
    {
        fr_err_t aerr;
        rc = fr_check_dispatch_args(L, in, on_gpu, &aerr);
        if (rc)
            return fr_ep_fail(ep, rc, "%s", aerr.msg);
    }
    int T = in->num_tokens;
    uint64_t epoch = ep->next_epoch + 1;
    fr_round_t *r = &ep->rounds[epoch % FR_NSETS];
    if (r->state != FR_ROUND_FREE)
        return fr_ep_fail(ep, FERRY_ERR_STATE,
                          "dispatch_send: rounds %llu and %llu are both in "
                          "flight; finish round %llu with combine_recv first",
                          (unsigned long long)r->epoch,
                          (unsigned long long)(epoch - 1),
                          (unsigned long long)r->epoch);
    if (ep->proxy.running && !on_gpu) {
        rc = fr_proxy_wait_set(ep, (int)(epoch % FR_NSETS));
        if (rc)
            return rc;
    }
    ep->next_epoch = epoch;
    r->epoch = epoch;
    r->T = T;
    rc = on_gpu ? fr_cuda_dispatch_send(ep, r, in)
                : fr_cpu_dispatch_send(ep, r, in);
    if (rc)
        return rc;
    r->state = FR_ROUND_SENT;
    *round = epoch;
    return FERRY_OK;
}

/* Common start of the calls on an existing round: a usable context, the
 * round in the expected state, an argument struct of at least `need`
 * bytes (its first field is its size). */
static int fr_round_call(ferry_ep_t ep, uint64_t round, int state,
                         const char *call, const void *args, size_t need,
                         const char *args_name, const char *type,
                         fr_round_t **r)
{
    int rc = fr_ep_usable(ep);
    if (rc)
        return rc;
    if ((rc = fr_round_get(ep, round, state, call, r)))
        return rc;
    if (!args)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "%s: NULL pointer", args_name);
    size_t have = *(const size_t *)args;
    if (have < need)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "%s->size = %zu: set it to sizeof(%s)", args_name,
                          have, type);
    return FERRY_OK;
}

int ferry_dispatch_recv(ferry_ep_t ep, uint64_t round,
                        const ferry_dispatch_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_SENT, "dispatch_recv", out, sizeof(*out), "out",
                           "ferry_dispatch_out_t", &r);
    if (rc)
        return rc;
    if (!out->expert_x)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "expert_x: NULL pointer");
    if (!out->expert_num_tokens)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "expert_num_tokens: NULL pointer");
    if (ep->L.fp8 && !out->expert_x_scales)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "expert_x_scales: NULL pointer (fp8 dispatch)");
    rc = ep->cuda ? fr_cuda_dispatch_recv(ep, r, out)
                  : fr_cpu_dispatch_recv(ep, r, out);
    if (rc)
        return rc;
    r->state = FR_ROUND_RECVD;
    return FERRY_OK;
}

int ferry_combine_send(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_in_t *in)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_RECVD, "combine_send", in, sizeof(*in), "in",
                           "ferry_combine_in_t", &r);
    if (rc)
        return rc;
    if (!in->expert_y)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "expert_y: NULL pointer");
    rc = ep->cuda ? fr_cuda_combine_send(ep, r, in)
                  : fr_cpu_combine_send(ep, r, in);
    if (rc)
        return rc;
    r->state = FR_ROUND_COMBINED;
    return FERRY_OK;
}

int ferry_combine_recv(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_out_t *out)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    fr_round_t *r = NULL;
    int rc = fr_round_call(ep, round, FR_ROUND_COMBINED, "combine_recv", out, sizeof(*out), "out",
                           "ferry_combine_out_t", &r);
    if (rc)
        return rc;
    if (r->T > 0 && !out->out)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "out->out: NULL pointer");
    if (r->T > 0 && !out->topk_weights)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "topk_weights: NULL pointer");
    rc = ep->cuda ? fr_cuda_combine_recv(ep, r, out)
                  : fr_cpu_combine_recv(ep, r, out);
    if (rc)
        return rc;
    r->state = FR_ROUND_FREE;
    return FERRY_OK;
}

int ferry_ep_sync(ferry_ep_t ep, void *stream)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    if (ep->failed)
        return ep->failed;
    if (ep->cuda)
        return fr_cuda_sync(ep, stream);
    return FERRY_OK;
}

int ferry_dispatch(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                   const ferry_dispatch_out_t *out, uint64_t *round)
{
    uint64_t r = 0;
    int rc = ferry_dispatch_send(ep, in, &r);
    if (rc)
        return rc;
    if (round)
        *round = r;
    return ferry_dispatch_recv(ep, r, out);
}

int ferry_combine(ferry_ep_t ep, uint64_t round, const ferry_combine_in_t *in,
                  const ferry_combine_out_t *out)
{
    int rc = ferry_combine_send(ep, round, in);
    if (rc)
        return rc;
    return ferry_combine_recv(ep, round, out);
}
