/*
 * EP contexts: creation in named steps (check and exchange configs, choose
 * paths, set up the engine, open the NICs and the proxy, finish), destroy,
 * and what a context tells about itself.
 */
#include "api/api.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "core/log.h"

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
        c->dispatch_dtype != FERRY_DTYPE_FP8_E4M3 && c->dispatch_dtype != FERRY_DTYPE_NVFP4)
        return FR_ERR(err, FERRY_ERR_INVALID, "dispatch_dtype = %d: unknown",
                      (int)c->dispatch_dtype);
    if (c->dispatch_dtype == FERRY_DTYPE_NVFP4 && c->mode != FERRY_MODE_LOW_LATENCY)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "dispatch_dtype nvfp4: low-latency mode only (high-throughput "
                      "dispatch takes bf16 or fp8)");
    if (c->dispatch_dtype == FERRY_DTYPE_NVFP4 && c->hidden % 64 != 0)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "dispatch_dtype nvfp4 needs hidden to be a multiple of 64 (its "
                      "scales go four 16-channel blocks to a word; hidden = %d)", c->hidden);
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
    if (c->mode != FERRY_MODE_LOW_LATENCY && c->mode != FERRY_MODE_HIGH_THROUGHPUT)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "mode = %d: unknown (FERRY_MODE_LOW_LATENCY = %d, "
                      "FERRY_MODE_HIGH_THROUGHPUT = %d)", (int)c->mode,
                      (int)FERRY_MODE_LOW_LATENCY, (int)FERRY_MODE_HIGH_THROUGHPUT);
    if (!fr_engine_find(c->device, c->mode))
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "mode = %d with device = %d: this build has no engine for it",
                      (int)c->mode, (int)c->device);
    if (c->fp8_round_scale != 0 && c->fp8_round_scale != 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "fp8_round_scale = %d: must be 0 or 1",
                      c->fp8_round_scale);
    if (c->fp8_round_scale && c->dispatch_dtype != FERRY_DTYPE_FP8_E4M3)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "fp8_round_scale = 1 needs dispatch_dtype fp8 (it rounds fp8 scales)");
    if (c->scales_layout < FERRY_SCALES_ROWS || c->scales_layout > FERRY_SCALES_UE8M0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "scales_layout = %d: unknown (FERRY_SCALES_ROWS = %d, "
                      "FERRY_SCALES_COLS = %d, FERRY_SCALES_UE8M0 = %d)", c->scales_layout,
                      (int)FERRY_SCALES_ROWS, (int)FERRY_SCALES_COLS, (int)FERRY_SCALES_UE8M0);
    if (c->scales_layout != FERRY_SCALES_ROWS &&
        (c->dispatch_dtype != FERRY_DTYPE_FP8_E4M3 || c->mode != FERRY_MODE_LOW_LATENCY))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "scales_layout = %d needs dispatch_dtype fp8 in low-latency mode "
                      "(it lays out expert_x_scales)", c->scales_layout);
    if (c->scales_layout == FERRY_SCALES_UE8M0 && !c->fp8_round_scale)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "scales_layout = FERRY_SCALES_UE8M0 needs fp8_round_scale = 1 (UE8M0 "
                      "holds powers of two only)");
    if (c->scales_layout == FERRY_SCALES_UE8M0 && c->hidden % 512)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "hidden = %d: FERRY_SCALES_UE8M0 packs four scales per int32, so "
                      "hidden must be a multiple of 512", c->hidden);
    if (c->mask_on_timeout != 0 && c->mask_on_timeout != 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "mask_on_timeout = %d: must be 0 or 1",
                      c->mask_on_timeout);
    if (c->mask_on_timeout && c->mode != FERRY_MODE_LOW_LATENCY)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "mask_on_timeout = 1 needs low-latency mode (ranks are masked there)");
    if (c->forward < FERRY_FORWARD_AUTO || c->forward > FERRY_FORWARD_ON)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "forward = %d: unknown (FERRY_FORWARD_AUTO = %d, FERRY_FORWARD_OFF = %d, "
                      "FERRY_FORWARD_ON = %d)", c->forward, (int)FERRY_FORWARD_AUTO,
                      (int)FERRY_FORWARD_OFF, (int)FERRY_FORWARD_ON);
    if (c->dp_size < 0 || c->dp_size > N || (c->dp_size > 1 && N % c->dp_size))
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "dp_size = %d: must divide the world size (%d), or be 0 or 1 (no DP "
                      "groups)", c->dp_size, N);
    if (c->ring_tokens < 0 || c->ring_tokens > (1 << 20))
        return FR_ERR(err, FERRY_ERR_INVALID, "ring_tokens = %d: must be 0 "
                      "(default) or 1..%d", c->ring_tokens, 1 << 20);
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
    int32_t E, K, H, T, dtype, device, mode, ring, shrink;
    int32_t forced; /* FERRY_TRANSPORT=fabric: every pair on the fabric path */
    int32_t fwd;    /* forwarding asked for (ferry_forward_t, FERRY_HT_FORWARD
                       applied) */
    int32_t pth;    /* FERRY_PROXY_THREADS: the endpoints every rank opens */
    int32_t dp;     /* dp_size (1: none) */
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
    if (ep->nics.ops && fr_cfg_str(FR_CFG_PROXY_STATS)[0])
        fr_ep_stats_print(ep);
    fr_nics_groups_destroy(&ep->nics, &ep->groups);
    if (ep->nics.ops) {
        fr_nics_dereg(&ep->nics, &ep->rseg);
        fr_nics_dereg(&ep->nics, &ep->rsend);
    }
    fr_nics_close(&ep->nics);
    if (ep->eng)
        ep->eng->free(ep); /* frees and clears seg, send, its own slices and ring */
    free(ep->path);
    free(ep->peer_seg);
    free(ep->group_peers);
    free(ep->group_index);
    free(ep->mask);
    free(ep->mask_since);
    free(ep->node_of);
    free(ep->node_lidx);
    free(ep->node_off);
    free(ep->node_ranks);
    fr_dp_close(ep);
    fr_proxy_tables_release(ep);
    free(ep);
}

/* Step 1: check the own config, then exchange statuses and configs, so a
 * rank that failed its own checks fails everyone at once instead of
 * leaving them waiting. */
static int fr_create_exchange(ferry_ep_t ep, const ferry_ep_config_t *config,
                              fr_err_t *err)
{
    int N = ep->N, me = ep->rank;
    fr_setup_msg_t msg, *all = fr_zalloc(sizeof(*all) * (size_t)N);
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "config exchange");
    memset(&msg, 0, sizeof(msg));
    msg.status = fr_ep_check_config(N, config, err);
    long tmo; /* FERRY_TIMEOUT_MS in range on every rank, or all refuse */
    if (msg.status == FERRY_OK)
        msg.status = fr_cfg_long(FR_CFG_TIMEOUT_MS, &tmo, err);
    /* the paths (fr_create_paths) come from FERRY_TRANSPORT: a pair must
     * get the same one on both sides, so every rank checks it here */
    const char *tr = fr_cfg_str(FR_CFG_TRANSPORT);
    msg.forced = strcmp(tr, "fabric") == 0;
    if (msg.status == FERRY_OK && !msg.forced && strcmp(tr, "auto") != 0)
        msg.status = FR_ERR(err, FERRY_ERR_INVALID, "FERRY_TRANSPORT=%s: must be auto or fabric",
                            tr);
    msg.pth = (int32_t)fr_cfg_int(FR_CFG_PROXY_THREADS);
    if (msg.status == FERRY_OK && (msg.pth < 1 || msg.pth > FR_MAX_NICS))
        msg.status = FR_ERR(err, FERRY_ERR_INVALID, "FERRY_PROXY_THREADS=%s: must be 1..%d",
                            fr_cfg_str(FR_CFG_PROXY_THREADS), FR_MAX_NICS);
    ep->proxy_threads = msg.pth;
    if (msg.status == FERRY_OK) {
        /* FERRY_HT_FORWARD applies where the config leaves it to auto */
        const char *fw = fr_cfg_str(FR_CFG_HT_FORWARD);
        msg.fwd = config->forward;
        if (msg.fwd != FERRY_FORWARD_AUTO)
            ; /* the config decides */
        else if (strcmp(fw, "on") == 0)
            msg.fwd = FERRY_FORWARD_ON;
        else if (strcmp(fw, "off") == 0)
            msg.fwd = FERRY_FORWARD_OFF;
        else if (strcmp(fw, "auto") != 0)
            msg.status = FR_ERR(err, FERRY_ERR_INVALID,
                                "FERRY_HT_FORWARD=%s: must be auto, on or off", fw);
        ep->fwd_req = msg.fwd;
    }
    if (msg.status == FERRY_OK) {
        ep->cfg = *config;
        ep->eng = fr_engine_find(config->device, config->mode);
        msg.E = config->num_experts;
        msg.K = config->topk;
        msg.H = config->hidden;
        msg.T = config->max_tokens;
        msg.dtype = config->dispatch_dtype;
        msg.device = config->device;
        msg.mode = config->mode;
        msg.ring = config->ring_tokens;
        msg.shrink = config->mask_on_timeout;
        msg.dp = config->dp_size > 1 ? config->dp_size : 1;
        /* DP groups: the engine is made for a member's share of the
         * group's tokens; the API layer splits each call */
        ep->dp.G = msg.dp;
        ep->dp.m = me % msg.dp;
        ep->dp.T = config->max_tokens;
        ep->cfg.max_tokens = (config->max_tokens + msg.dp - 1) / msg.dp;
    }
    int rc = fr_boot_allgather(ep->comm->boot, &msg, all, sizeof(msg), err);
    if (rc == FERRY_OK && msg.status != FERRY_OK)
        rc = msg.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++) {
        if (all[i].status != FERRY_OK) {
            rc = FR_ERR(err, all[i].status,
                        "rank %d failed to create its EP context (%s)", i,
                        ferry_strerror(all[i].status));
        } else if (all[i].E != msg.E || all[i].K != msg.K ||
                   all[i].H != msg.H || all[i].T != msg.T ||
                   all[i].dtype != msg.dtype || all[i].device != msg.device ||
                   all[i].mode != msg.mode || all[i].ring != msg.ring ||
                   all[i].shrink != msg.shrink) {
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "config differs between ranks: rank %d has E=%d K=%d "
                        "H=%d T=%d dtype=%d mode=%d ring_tokens=%d mask_on_timeout=%d, "
                        "rank %d has E=%d K=%d H=%d T=%d dtype=%d mode=%d ring_tokens=%d "
                        "mask_on_timeout=%d",
                        me, msg.E, msg.K, msg.H, msg.T, msg.dtype, msg.mode, msg.ring,
                        msg.shrink, i, all[i].E, all[i].K, all[i].H, all[i].T, all[i].dtype,
                        all[i].mode, all[i].ring, all[i].shrink);
        } else if (all[i].dp != msg.dp) {
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "dp_size differs between ranks: rank %d has %d, rank %d has %d", me,
                        msg.dp, i, all[i].dp);
        } else if (all[i].fwd != msg.fwd) {
            static const char *fwn[] = {"auto", "off", "on"};
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "forwarding differs between ranks: rank %d has %s, rank %d has %s "
                        "(config.forward, else FERRY_HT_FORWARD: set it alike on every rank)",
                        me, fwn[msg.fwd], i, (unsigned)all[i].fwd < 3 ? fwn[all[i].fwd] : "?");
        } else if (all[i].pth != msg.pth) {
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "FERRY_PROXY_THREADS differs between ranks: rank %d has %d, rank %d "
                        "has %d (each rank opens that many fabric endpoints: set it alike on "
                        "every rank)", me, msg.pth, i, all[i].pth);
        } else if (all[i].forced != msg.forced) {
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "FERRY_TRANSPORT differs between ranks: rank %d has %s, rank %d has "
                        "%s; set it alike on every rank (a pair's path must be the same from "
                        "both sides)", me, msg.forced ? "fabric" : "auto", i,
                        all[i].forced ? "fabric" : "auto");
        }
    }
    free(all);
    if (rc != FERRY_OK)
        ep->eng = NULL;
    return rc;
}

/* The nodes: ranks with equal node ids (each rank alone under
 * FERRY_TRANSPORT=fabric), numbered in the order of their lowest rank;
 * the same tables on every rank. */
static int fr_create_nodes(ferry_ep_t ep, int force_fabric, char (*key)[FR_NODE_ID_LEN],
                           fr_err_t *err)
{
    int N = ep->N;
    ep->node_of = fr_zalloc(sizeof(int) * (size_t)N);
    ep->node_lidx = fr_zalloc(sizeof(int) * (size_t)N);
    ep->node_off = fr_zalloc(sizeof(int) * ((size_t)N + 1));
    ep->node_ranks = fr_zalloc(sizeof(int) * (size_t)N);
    if (!ep->node_of || !ep->node_lidx || !ep->node_off || !ep->node_ranks)
        return FR_ERR(err, FERRY_ERR_NOMEM, "node tables");
    ep->nnodes = 0;
    for (int i = 0; i < N; i++) {
        int j = 0;
        if (!force_fabric)
            while (j < i && strcmp(key[j], key[i]) != 0)
                j++;
        else
            j = i;
        ep->node_of[i] = j < i ? ep->node_of[j] : ep->nnodes++;
    }
    int *n = ep->node_off; /* counts, then the CSR */
    for (int i = 0; i < N; i++)
        ep->node_lidx[i] = n[ep->node_of[i] + 1]++;
    for (int b = 0; b < ep->nnodes; b++)
        n[b + 1] += n[b];
    for (int i = 0; i < N; i++)
        ep->node_ranks[n[ep->node_of[i]] + ep->node_lidx[i]] = i;
    return FERRY_OK;
}

/* Step 2: a path per peer: self, shm (same node id) or fabric (another
 * node, or every peer under FERRY_TRANSPORT=fabric). */
static int fr_create_paths(ferry_ep_t ep, fr_err_t *err)
{
    int N = ep->N, me = ep->rank;
    /* auto or fabric, alike on every rank (fr_create_exchange) */
    int force_fabric = strcmp(fr_cfg_str(FR_CFG_TRANSPORT), "fabric") == 0;
    /* each rank's node: its host's, or its NVLink domain's (GPU ranks) */
    char(*key)[FR_NODE_ID_LEN] = fr_zalloc(sizeof(*key) * (size_t)N);
    if (!key)
        return FR_ERR(err, FERRY_ERR_NOMEM, "node keys");
    int rc = fr_ep_domains(ep, key, err);
    /* every rank reaches the same answer (the node keys are common) */
    int one_node = !force_fabric;
    for (int i = 1; i < N && one_node; i++)
        one_node = strcmp(key[i], key[0]) == 0;
    if (rc == FERRY_OK && ep->cfg.mask_on_timeout && !one_node)
        rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "mask_on_timeout = 1 with ranks on the fabric path (%s): writes the "
                      "proxy posted to a rank that died cannot be taken back, so its buffers "
                      "could not be reused; ranks of one node only (ferry_ep_mask_rank works "
                      "on every path)", force_fabric ? "FERRY_TRANSPORT=fabric" : "several nodes");
    if (rc != FERRY_OK) {
        free(key);
        return rc;
    }
    ep->path = fr_zalloc(sizeof(int) * (size_t)N);
    ep->peer_seg = fr_zalloc(sizeof(uint8_t *) * (size_t)N);
    ep->group_index = fr_zalloc(sizeof(int) * (size_t)N);
    ep->group_peers = fr_zalloc(sizeof(int) * (size_t)N);
    ep->mask = fr_zalloc(sizeof(int32_t) * (size_t)N);
    ep->mask_since = fr_zalloc(sizeof(uint64_t) * (size_t)N);
    if (!ep->path || !ep->peer_seg || !ep->group_index || !ep->group_peers || !ep->mask ||
        !ep->mask_since) {
        free(key);
        return FR_ERR(err, FERRY_ERR_NOMEM, "peer tables");
    }
    for (int i = 0; i < N; i++) {
        ep->group_index[i] = -1;
        if (i == me)
            ep->path[i] = FR_PATH_SELF;
        else if (!force_fabric && strcmp(key[i], key[me]) == 0)
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
    rc = fr_create_nodes(ep, force_fabric, key, err);
    free(key);
    return rc;
}

/* DP groups: each inside one node (the gather goes through shared
 * memory), alike on every rank (the node tables are); then the members'
 * regions (collective). */
static int fr_create_dp(ferry_ep_t ep, fr_err_t *err)
{
    int G = ep->dp.G;
    for (int g0 = 0; G > 1 && g0 < ep->N; g0 += G)
        for (int j = 1; j < G; j++)
            if (ep->node_of[g0 + j] != ep->node_of[g0])
                return FR_ERR(err, FERRY_ERR_INVALID,
                              "dp_size = %d: ranks %d and %d of DP group %d are on different "
                              "nodes%s (a group must be inside one node)", G, g0, g0 + j,
                              g0 / G,
                              strcmp(fr_cfg_str(FR_CFG_TRANSPORT), "fabric") == 0
                                  ? " (FERRY_TRANSPORT=fabric puts every rank alone)"
                                  : "");
    return fr_dp_open(ep, err);
}

/* Step 4: when any peer is on the fabric (every rank joins: opening a
 * NIC is collective), open the NICs, register the engine's segment and
 * send region, make the peer groups, start the proxy. */
static int fr_create_fabric(ferry_ep_t ep, fr_err_t *err)
{
    const fr_layout_t *L = &ep->L;
    fr_boot_t *boot = ep->comm->boot;
    int rc;
    if (!ep->send)
        return FR_ERR(err, FERRY_ERR_INTERNAL,
                      "engine %s set up no send region", ep->eng->name);
    /* NICs: FERRY_NICS_PER_RANK, or (0) as many as the node has, up to
     * FR_MAX_NICS. Opening NIC k is collective, present or not. */
    /* seg and send in GPU memory (the engine says which device): the
     * NICs open with FI_HMEM and register them as that device's */
    int dev = ep->fab_device;
    /* the low-latency proxy: FERRY_PROXY_THREADS threads, each with an
     * endpoint per interface; the high-throughput engines drive the NICs
     * from one thread */
    int eps = ep->eng->route_create || ep->eng->fabric_up ? 1 : ep->proxy_threads;
    if ((rc = fr_nics_open_eps(&ep->nics, boot, "fabric",
                               fr_cfg_int(FR_CFG_NICS_PER_RANK), eps,
                               dev >= 0 ? FR_TP_OPEN_HMEM : 0, err)) ||
        (rc = fr_nics_reg_dev(&ep->nics, boot, ep->seg, L->seg_bytes, 1, dev,
                              &ep->rseg, err)) ||
        (rc = fr_nics_reg_dev(&ep->nics, boot, ep->send, L->send_bytes, 0, dev,
                              &ep->rsend, err)) ||
        (rc = fr_nics_groups(&ep->nics, ep->group_peers, ep->nfabric,
                             &ep->rsend, &ep->rseg, &ep->groups, err)))
        return rc;
    if (ep->eng->fabric_up)
        return ep->eng->fabric_up(ep, err);
    if (ep->eng->route_create)
        return FERRY_OK; /* high throughput: the engine drives the NICs itself */
    if ((rc = fr_proxy_tables(ep, err)) != FERRY_OK)
        return rc;
    rc = fr_proxy_start(ep);
    if (rc != FERRY_OK)
        snprintf(err->msg, sizeof(err->msg), "%s", ep->err.msg);
    return rc;
}

/* Step 5: everyone has mapped everyone, so segment names can go (nothing
 * is left in /dev/shm if a rank dies later); say what was built. */
static int fr_create_finish(ferry_ep_t ep, fr_err_t *err)
{
    const fr_layout_t *L = &ep->L;
    int rc = fr_boot_barrier(ep->comm->boot, err);
    if (rc != FERRY_OK)
        return rc;
    if (ep->seg_name[0])
        fr_shm_unlink(ep->seg_name);
    ep->seg_name[0] = 0;
    if (!fr_log_enabled(FR_LOG_INFO, FR_SUB_INIT))
        return FERRY_OK;
    for (int i = 0; i < ep->N; i++)
        FR_LOG_INFO(FR_SUB_INIT, "peer %d: path %s%s%s", i,
                    ep->path[i] == FR_PATH_SELF ? "self"
                    : ep->path[i] == FR_PATH_SHM ? "shm"
                    : "fabric",
                    ep->path[i] == FR_PATH_FABRIC ? " via " : "",
                    ep->path[i] == FR_PATH_FABRIC ? fr_nics_iface(&ep->nics, i)
                                                  : "");
    FR_LOG_INFO(FR_SUB_INIT,
                "EP E=%d K=%d H=%d T=%d %s (%s): segment %llu B, send %llu B",
                L->E, L->K, L->H, L->T, L->nvfp4 ? "nvfp4" : L->fp8 ? "fp8" : "bf16", ep->eng->name,
                (unsigned long long)L->seg_bytes,
                (unsigned long long)(ep->send ? L->send_bytes : 0));
    return FERRY_OK;
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
    ferry_ep_t ep = fr_zalloc(sizeof(*ep));
    if (!ep)
        return FERRY_ERR_NOMEM;
    ep->comm = comm;
    ep->N = comm->size;
    ep->rank = comm->rank;
    ep->fab_device = -1;
    fr_cfg_long(FR_CFG_TIMEOUT_MS, &ep->timeout_ms, NULL); /* clamped; the exchange refuses */
    ep->spin = fr_cfg_int(FR_CFG_SPIN);
    FR_CHECK_GOTO(fr_create_exchange(ep, config, &err), rc, fail);
    FR_CHECK_GOTO(fr_create_paths(ep, &err), rc, fail);
    FR_CHECK_GOTO(fr_create_dp(ep, &err), rc, fail);
    int native = 0;
    /* forward = on across nodes: an engine that cannot forward on its own
     * fabric path says so in fabric_native, and its fabric engine (staged,
     * over the CPU engine) forwards */
    int want_fwd = ep->fwd_req == FERRY_FORWARD_ON && ep->nnodes > 1 && ep->nnodes < ep->N;
    if (ep->nfabric > 0 && ep->eng->fabric_engine && ep->eng->fabric_native)
        FR_CHECK_GOTO(ep->eng->fabric_native(ep, &native, &err), rc, fail);
    if (ep->nfabric > 0 && ep->eng->fabric_engine && !native) {
        /* the same on every rank: a rank with a peer on another node makes
         * every rank's paths include the fabric (FERRY_TRANSPORT agrees:
         * fr_create_exchange) */
        FR_LOG_INFO(FR_SUB_INIT, "engine %s for peers on the fabric path (instead of %s)",
                    ep->eng->fabric_engine->name, ep->eng->name);
        ep->eng = ep->eng->fabric_engine;
        if (ep->pmem_cross) { /* alike on every rank */
            rc = FR_ERR(&err, FERRY_ERR_UNSUPPORTED,
                        "engine %s: its node peers share host memory, which cannot span the "
                        "hosts of an NVLink domain; keep GPU memory on the fabric path "
                        "(FERRY_FABRIC_HMEM) or set FERRY_NODE_ID", ep->eng->name);
            goto fail;
        }
    }
    /* Step 3: the engine lays out and allocates its buffers, maps the
     * peers' (collective). */
    FR_CHECK_GOTO(ep->eng->setup(ep, &err), rc, fail);
    /* alike on every rank: the node tables and the config are */
    if (want_fwd && config->mode == FERRY_MODE_HIGH_THROUGHPUT && !ep->forward) {
        rc = FR_ERR(&err, FERRY_ERR_UNSUPPORTED,
                    "forward = on: engine %s does not forward between nodes", ep->eng->name);
        goto fail;
    }
    if (!ep->flags)
        ep->flags = ep->seg;
    if (ep->N > 1 && ep->nfabric > 0)
        FR_CHECK_GOTO(fr_create_fabric(ep, &err), rc, fail);
    FR_CHECK_GOTO(fr_create_finish(ep, &err), rc, fail);
    *out = ep;
    __atomic_add_fetch(&comm->users, 1, __ATOMIC_ACQ_REL);
    return FERRY_OK;
fail:
    FR_LOG_INFO(FR_SUB_INIT, "ep_create: %s", err.msg);
    snprintf(ep->err.msg, sizeof(ep->err.msg), "%s", err.msg);
    /* The caller has no handle to read the message from: keep it on the
     * communicator. */
    snprintf(comm->err.msg, sizeof(comm->err.msg), "%s", err.msg);
    fr_ep_free(ep);
    return rc;
}

int ferry_ep_destroy(ferry_ep_t ep)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    int rc = FERRY_OK;
    fr_err_t err = {{0}};
    int gpu = ep->cfg.device == FERRY_DEVICE_CUDA;
    if (gpu && !ep->failed) {
        int c = ep->eng->sync(ep, NULL);
        if (c != FERRY_OK)
            rc = c;
    }
    if (ep->proxy.running && !ep->failed && !gpu) {
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
    ferry_comm_t comm = ep->comm;
    fr_ep_free(ep);
    __atomic_sub_fetch(&comm->users, 1, __ATOMIC_ACQ_REL);
    return rc;
}

const char *ferry_ep_last_error(ferry_ep_t ep)
{
    return ep ? ep->err.msg : "ep: NULL handle";
}

int ferry_ep_get_stats(ferry_ep_t ep, ferry_ep_stats_t *st)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    if (!st)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_get_stats: stats is NULL");
    /* the first version ended at doorbell_to_post_p99_us: a caller built
     * against it gets its fields, and those past its size stay as they are */
    size_t v1 = offsetof(ferry_ep_stats_t, bytes);
    if (st->size < v1)
        return fr_ep_fail(ep, FERRY_ERR_INVALID,
                          "ferry_ep_get_stats: stats->size %zu, expected at least %zu (set it "
                          "to sizeof(ferry_ep_stats_t))",
                          st->size, v1);
    fr_ep_stats_get(ep, st);
    return FERRY_OK;
}

int ferry_ep_get_nodes(ferry_ep_t ep, int *num_nodes, int32_t *node_of, int *forward)
{
    if (!ep)
        return FERRY_ERR_INVALID;
    if (num_nodes)
        *num_nodes = ep->nnodes;
    for (int i = 0; node_of && i < ep->N; i++)
        node_of[i] = ep->node_of[i];
    if (forward)
        *forward = ep->forward;
    return FERRY_OK;
}

int ferry_ep_get_layout(ferry_ep_t ep, ferry_ep_layout_t *lay)
{
    if (!ep || !lay)
        return FERRY_ERR_INVALID;
    /* the first version ended at host_bytes */
    size_t first = offsetof(ferry_ep_layout_t, needs_nonblocking_stream);
    if (lay->size < first)
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
    lay->expert_scales_bytes = (size_t)fr_scl_bytes(L);
    lay->expert_y_bytes = (size_t)L->El * L->cap * L->crow;
    lay->shm_bytes = L->seg_bytes;
    lay->host_bytes = (ep->send ? L->send_bytes : 0) +
                      (size_t)L->T * (L->tok_bytes + 4 * L->nscales) +
                      FR_NSETS * ((size_t)L->T * L->K * 4 + L->send_crows * 4);
    if (lay->size >= sizeof(*lay))
        lay->needs_nonblocking_stream = ep->rx_flush == FR_RX_FLUSH_COPIES;
    return FERRY_OK;
}

