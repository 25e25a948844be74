/*
 * The CUDA high-throughput engine: set-up (geometry, segment in device
 * memory shared through CUDA IPC, device tables, error word), free, and
 * the error word turned into messages. Routes: route.cu; dispatch and
 * combine: stream.cu.
 */
#include <stdlib.h>

#include "engines/cuda_ht/cuda_ht_dev.cuh"
#include "ep/hmem.h"
#include "runtime/rt.h"

static unsigned long long fr_cuht_align(unsigned long long v, unsigned long long a)
{
    return (v + a - 1) / a * a;
}

/* Forwarding through one rank per node on this engine's fabric path
 * (docs/architecture.md): asked for (config.forward, FERRY_HT_FORWARD: on,
 * or auto), the ranks in more than one node and not every rank alone, and
 * what the records can say: node-relative expert ids in 16 bits, a node's
 * ranks in one warp's lanes. 1 with the largest node (NL) and the most
 * remote sources a rank forwards for (NF); 0, with why when asked but
 * impossible. The same on every rank (the node tables and the config are). */
static int fr_cuht_fwd_plan(const ferry_ep_t ep, int *NL, int *NF, char *why, size_t n)
{
    int N = ep->N, M = ep->nnodes, El = ep->cfg.num_experts / N;
    *NL = *NF = 0;
    if (why && n)
        why[0] = 0;
    if (ep->fwd_req == FERRY_FORWARD_OFF || M < 2 || M >= N || ep->nfabric == 0)
        return 0;
    fr_ep_fwd_sizes(ep, NL, NF);
    if (*NL > 32 || (long)*NL * El > 32767) {
        if (why)
            snprintf(why, n, "a node of %d ranks: forwarding on GPU ranks takes nodes of at "
                     "most 32 ranks and %d experts", *NL, 32767);
        *NL = *NF = 0;
        return 0;
    }
    return 1;
}

/* The segment's geometry from the config (every rank computes the same). */
static void fr_cuht_geo_init(fr_cuht_geo_t *G, const ferry_ep_t ep, int C, int RT, int NL, int NF)
{
    const ferry_ep_config_t *cfg = &ep->cfg;
    memset(G, 0, sizeof(*G));
    G->N = ep->N;
    G->rank = ep->rank;
    G->E = cfg->num_experts;
    G->El = cfg->num_experts / ep->N;
    G->K = cfg->topk;
    G->H = cfg->hidden;
    G->T = cfg->max_tokens;
    G->C = C;
    G->RT = RT;
    G->fwd = NL > 0;
    G->NL = NL;
    G->NF = NF;
    /* with forwarding the entry also holds the records to forward per channel */
    G->notify_entry = fr_cuht_align(16 + 4ull * C + 4ull * G->El + (G->fwd ? 4ull * C : 0), 128);
    G->off_notify = 0;
    G->off_ctr = fr_cuht_align(2ull * G->N * G->notify_entry, 4096);
    /* a dispatch record holds a bf16 row or an fp8 row with its scales */
    G->dhdr = fr_ht_dhdr_bytes(G->K);
    G->drec = fr_cuht_align(G->dhdr + 2ull * G->H + 4ull * ((G->H + 127) / 128), 16);
    G->chdr = fr_cuht_align(8 + 4ull * G->K, 16);
    G->crec = fr_cuht_align(G->chdr + 2ull * G->H, 16);
    G->off_drec = fr_cuht_align(G->off_ctr + 4ull * C * G->N * FR_CUHT_LINE, 4096);
    G->off_crec = fr_cuht_align(G->off_drec + (unsigned long long)C * G->N * RT * G->drec, 4096);
    G->seg_bytes = fr_cuht_align(G->off_crec + (unsigned long long)C * G->N * RT * G->crec, 4096);
    if (G->fwd) { /* forwarding's lines and combine rings (geo.h) */
        unsigned long long lines = (unsigned long long)C * G->N * NL * FR_CUHT_LINE;
        G->off_fhead = G->seg_bytes;
        G->off_fctail = fr_cuht_align(G->off_fhead + lines, 4096);
        G->off_fcring = fr_cuht_align(G->off_fctail + lines, 4096);
        G->seg_bytes = fr_cuht_align(G->off_fcring + (unsigned long long)C * NF * NL * RT *
                                     G->crec, 4096);
    }
    /* a fabric peer's outbox and host-mapped words (geo.h) */
    G->ob_drec = G->off_ctr;
    G->ob_crec = fr_cuht_align(G->ob_drec + (unsigned long long)C * RT * G->drec, 4096);
    G->ob_bytes = fr_cuht_align(G->ob_crec + (unsigned long long)C * RT * G->crec, 4096);
    G->hdr_bytes = G->off_drec;
}

/* Records per (channel, peer) ring: ring_tokens, or by default enough to
 * keep the links busy between publications, fewer as N grows so the
 * segment stays bounded (cuda_ht_dev.cuh). With forwarding a rank's
 * traffic to another node goes through one ring per node, so the budget
 * is shared by the rings of a node's ranks and one per other node
 * (rings of 46 records at 4 nodes of 8 where 32 ranks flat get 16; the
 * same 8 as flat at 1024 ranks). */
static int fr_cuht_ring_tokens(const ferry_ep_t ep)
{
    if (ep->cfg.ring_tokens > 0)
        return ep->cfg.ring_tokens;
    int NL, NF, rings = ep->N;
    if (fr_cuht_fwd_plan(ep, &NL, &NF, NULL, 0))
        rings = NL + ep->nnodes - 1;
    int RT = FR_CUHT_RING_BUDGET / rings;
    return RT < FR_CUHT_RING_MIN ? FR_CUHT_RING_MIN : RT > FR_CUHT_RING_MAX ? FR_CUHT_RING_MAX : RT;
}

typedef struct fr_cuht_msg {
    int status;        /* this rank's set-up so far */
    int channels;      /* must agree: they shape every segment */
} fr_cuht_msg_t;

/* Checks and the own segment; FERRY_OK or the status every rank learns. */
static int fr_cuht_local(ferry_ep_t ep, struct fr_cuht_ep *c, int kind, fr_err_t *err)
{
    int rc = FERRY_OK;
    const fr_cuht_geo_t *G = &c->a.G;
    if (ep->nfabric > 0 && ep->fab_device < 0)
        return FR_ERR(err, FERRY_ERR_INTERNAL, "cuda_ht: fabric peers without GPU memory "
                      "on the fabric (the staged engine serves them)");
    if (ep->N > FR_CUHT_MAX_RANKS)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "mode = high throughput with device = cuda: %d ranks, at most %d",
                      ep->N, FR_CUHT_MAX_RANKS);
    if (G->E > 32767)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "num_experts = %d: the high-throughput records hold 16-bit expert ids",
                      G->E);
    /* the segment, of the kind every rank agreed on (fr_cuht_setup) */
    rc = fr_pmem_alloc(kind, c->device, G->seg_bytes, &c->seg_pm, err);
    ep->seg = (uint8_t *)c->seg_pm.ptr;
    if (rc != FERRY_OK)
        goto fail;
    if (ep->nfabric > 0) { /* outboxes (registered by the EP) and host-mapped words */
        size_t ob = (size_t)G->ob_bytes * (size_t)ep->nfabric;
        FR_CU(cudaMalloc((void **)&ep->send, ob), err, fail);
        FR_CU(cudaMemset(ep->send, 0, ob), err, fail);
        ep->L.send_bytes = ob;
        void *h;
        rc = fr_cuda_host_alloc((size_t)G->hdr_bytes * (size_t)ep->nfabric, &h, &c->hm_out_dev,
                                err);
        if (rc != FERRY_OK)
            goto fail;
        c->fab.out = (uint8_t *)h;
        rc = fr_cuda_host_alloc((size_t)G->hdr_bytes, &h, &c->hm_in_dev, err);
        if (rc != FERRY_OK)
            goto fail;
        c->fab.in = (uint8_t *)h;
    }
    /* the bounded routes' tables: before the exchange, so that a rank out
     * of memory fails every rank at once */
    rc = fr_cuht_pool_init(ep);
    if (rc != FERRY_OK)
        rc = FR_ERR(err, rc, "%s", ep->err.msg);
    if (rc == FERRY_OK && ep->nfabric > 0) { /* the thread's abort word */
        void *h, *d;
        rc = fr_cuda_host_alloc(sizeof(int), &h, &d, err);
        if (rc == FERRY_OK) {
            c->a.abort = (const volatile int *)d;
            c->fab.abort = (int *)h;
        }
    }
fail:
    return rc;
}

/* Forwarding's device tables (fr_cuht_fw_t), in one allocation. */
static int fr_cuht_fw_tables(ferry_ep_t ep, struct fr_cuht_ep *c, fr_err_t *err)
{
    const fr_cuht_geo_t *G = &c->a.G;
    fr_cuht_fw_t *fw = &c->a.fw;
    int N = ep->N, me = ep->rank, node = ep->node_of[me];
    int L = ep->node_off[node + 1] - ep->node_off[node];
    size_t nctr = (size_t)G->C * N * G->NL;
    /* ints: nrank[L], fl[N], fslot[N], key[N], kord[N], nl[N], and the
     * view's via[N] (the kernels do not read it: a timeout is named on the
     * host, fr_cuht_check); then the segments [L]; then fsent and ftake */
    size_t ni = (size_t)L + 6 * (size_t)N, o_seg = (ni * 4 + 15) & ~(size_t)15;
    size_t o_ctr = o_seg + (size_t)L * sizeof(uint8_t *), bytes = o_ctr + 2 * nctr * 8;
    uint8_t *h = (uint8_t *)calloc(1, bytes);
    if (!h)
        return FR_ERR(err, FERRY_ERR_NOMEM, "forwarding tables");
    int *nrank = (int *)h, *fl = nrank + L, *fslot = fl + N, *key = fslot + N,
        *kord = key + N, *nl = kord + N, *via = nl + N;
    uint8_t **nseg = (uint8_t **)(h + o_seg);
    for (int j = 0; j < L; j++) {
        int r = ep->node_ranks[ep->node_off[node] + j];
        nrank[j] = r;
        nseg[j] = r == me ? ep->seg : (uint8_t *)c->peer_pm[r].ptr;
    }
    for (int s = 0; s < N; s++)
        nl[s] = ep->node_of[s] << 16 | ep->node_lidx[s];
    fr_fwd_view_t v = {key, via, fslot, kord, fl};
    int nf = fr_ep_fwd_view(ep, me, &v);
    int rc = FERRY_OK;
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, bytes);
    if (e == cudaSuccess)
        e = cudaMemcpy(d, h, o_ctr, cudaMemcpyHostToDevice);
    if (e == cudaSuccess)
        e = cudaMemset((uint8_t *)d + o_ctr, 0, 2 * nctr * 8);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (d)
            cudaFree(d);
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "forwarding tables: %s", cudaGetErrorString(e));
    } else {
        int *di = (int *)d;
        c->fw_mem = d;
        fw->L = L;
        fw->j = ep->node_lidx[me];
        fw->nf = nf;
        fw->node = node;
        fw->nrank = di;
        fw->fl = di + L;
        fw->fslot = di + L + N;
        fw->key = di + L + 2 * N;
        fw->kord = di + L + 3 * N;
        fw->nl = di + L + 4 * N;
        fw->nseg = (uint8_t *const *)((uint8_t *)d + o_seg);
        fw->fsent = (unsigned long long *)((uint8_t *)d + o_ctr);
        fw->ftake = fw->fsent + nctr;
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: forwarding between %d nodes: this rank forwards "
                    "for %d remote ranks, %d channels forward", ep->nnodes, nf, G->C);
    }
    free(h);
    return rc;
}

/* Peers' segments, the device tables and the host-mapped words. */
static int fr_cuht_tables(ferry_ep_t ep, struct fr_cuht_ep *c, fr_err_t *err)
{
    int rc = FERRY_OK, N = ep->N;
    fr_cuht_args_t *A = &c->a;
    const fr_cuht_geo_t *G = &A->G;
    fr_cuht_peer_t *peer = NULL;
    peer = (fr_cuht_peer_t *)calloc((size_t)N, sizeof(*peer));
    if (!peer) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "peer tables");
        goto fail;
    }
    for (int i = 0; i < N; i++) {
        fr_cuht_peer_t *q = &peer[i];
        uint8_t *w, *r; /* the words this rank stores for i, and i for this rank */
        unsigned long long line = (unsigned long long)N * FR_CUHT_LINE;
        if (ep->path[i] == FR_PATH_FABRIC) { /* the outbox and words of geo.h */
            int g = ep->group_index[i];
            uint8_t *ob = ep->send + (size_t)g * G->ob_bytes;
            q->wnot = ob;
            w = (uint8_t *)c->hm_out_dev + (size_t)g * G->hdr_bytes;
            r = (uint8_t *)c->hm_in_dev;
            for (int k = 0; k < 2; k++) {
                q->ring[k] = ob + fr_cuht_geo_obring(G, k, 0);
                q->stride[k] = (unsigned long long)G->RT * (k ? G->crec : G->drec);
            }
        } else {
            uint8_t *p = ep->path[i] == FR_PATH_SELF ? ep->seg : (uint8_t *)c->peer_pm[i].ptr;
            q->wnot = w = p;
            r = ep->seg;
            for (int k = 0; k < 2; k++) {
                q->ring[k] = p + fr_cuht_geo_ring(G, k, 0, ep->rank);
                q->stride[k] = (unsigned long long)N * G->RT * (k ? G->crec : G->drec);
            }
        }
        q->wnid = w;
        q->rnid = r;
        for (int k = 0; k < 4; k++) {
            q->w[k] = w + fr_cuht_geo_ctr(G, k, 0, ep->rank);
            q->r[k] = r + fr_cuht_geo_ctr(G, k, 0, i);
            q->csw[k] = q->csr[k] = line;
        }
        int f = G->fwd && ep->node_of[i] != ep->node_of[ep->rank]
                    ? fr_ep_fwd_of(ep, i, ep->node_of[ep->rank]) : ep->rank;
        if (f != ep->rank) {
            /* a remote source whose forwarder f is another rank of this
             * node: its dispatch records come from f (tail stored here by
             * f, head to f's line), its combine rows go to f (a ring, a
             * tail line at f, the head stored here by f) */
            uint8_t *fs = (uint8_t *)c->peer_pm[f].ptr;
            int j = ep->node_lidx[ep->rank], slot = fr_ep_fwd_slot(ep, i, f);
            unsigned long long fline = (unsigned long long)N * G->NL * FR_CUHT_LINE;
            q->r[FR_CUHT_DTAIL] = ep->seg + fr_cuht_geo_ctr(G, FR_CUHT_DTAIL, 0, i);
            q->w[FR_CUHT_DHEAD] = fs + fr_cuht_geo_fline(G, 0, 0, i, j);
            q->csw[FR_CUHT_DHEAD] = fline;
            q->ring[1] = fs + fr_cuht_geo_fcring(G, 0, slot, j);
            q->stride[1] = (unsigned long long)G->NF * G->NL * G->RT * G->crec;
            q->w[FR_CUHT_CTAIL] = fs + fr_cuht_geo_fline(G, 1, 0, i, j);
            q->csw[FR_CUHT_CTAIL] = fline;
            q->r[FR_CUHT_CHEAD] = ep->seg + fr_cuht_geo_ctr(G, FR_CUHT_CHEAD, 0, i);
        }
    }
    if (G->fwd && (rc = fr_cuht_fw_tables(ep, c, err)) != FERRY_OK)
        goto fail;
    {
        size_t nctr = 4 * (size_t)A->G.C * N;
        size_t o_ctr = ((size_t)N * sizeof(fr_cuht_peer_t) + 255) & ~(size_t)255;
        size_t o_flag = o_ctr + ((nctr * 8 + 255) & ~(size_t)255);
        FR_CU(cudaMalloc(&c->dmem, o_flag + 256), err, fail);
        FR_CU(cudaMemset(c->dmem, 0, o_flag + 256), err, fail);
        uint8_t *b = (uint8_t *)c->dmem;
        A->pt = (const fr_cuht_peer_t *)b;
        A->ctr = (unsigned long long *)(b + o_ctr);
        A->dflag = (int *)(b + o_flag);
        c->rseq = (unsigned long long *)(b + o_flag + 128);
        c->rlast = (unsigned int *)(b + o_flag + 192);
        FR_CU(cudaMemcpy(b, peer, sizeof(*peer) * N, cudaMemcpyHostToDevice), err, fail);
    }
    {
        void *h;
        rc = fr_cuda_host_alloc(sizeof(int) * 4, &h, &c->err_dev, err);
        if (rc != FERRY_OK)
            goto fail;
        c->err_host = (int *)h;
        A->err = (volatile int *)c->err_dev;
        rc = fr_cuda_host_alloc(sizeof(fr_cuht_res_t) + sizeof(int) * (size_t)A->G.El, &h,
                                &c->res_dev, err);
        if (rc != FERRY_OK)
            goto fail;
        c->res_host = (fr_cuht_res_t *)h;
    }
    A->seg = ep->seg;
    A->timeout_ns = (unsigned long long)ep->timeout_ms * 1000000ull;
fail:
    free(peer);
    return rc;
}

/* The channel count: num_sms, else FR_CUHT_SMS_DEFAULT; either lowered
 * when ranks share a GPU, so that every rank's blocks (one per SM) are
 * resident at once: the GPU's SMs divided by the most ranks on one GPU.
 * More would leave some ranks' blocks unscheduled while the resident ones
 * wait for their data, until the timeout (4 ranks with num_sms 64 on one
 * H200 did). Collective (every rank joins, whatever its own status); the
 * same answer on every rank (num_sms is the same everywhere), or -1 on
 * every rank. */
typedef struct fr_cuht_gpu {
    unsigned char uuid[16]; /* the rank's GPU's (a PCI bus id repeats across hosts) */
    int nsm;
    int status;
} fr_cuht_gpu_t;

static int fr_cuht_channels(ferry_ep_t ep, fr_err_t *err)
{
    int N = ep->N, dev = 0;
    fr_cuht_gpu_t mine, *all = (fr_cuht_gpu_t *)calloc((size_t)N, sizeof(*all));
    memset(&mine, 0, sizeof(mine));
    cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        mine.status = FERRY_ERR_SYSTEM;
    } else {
        memcpy(mine.uuid, prop.uuid.bytes, sizeof(mine.uuid));
        mine.nsm = prop.multiProcessorCount;
    }
    if (!all) {
        FR_ERR(err, FERRY_ERR_NOMEM, "GPU table");
        return -1;
    }
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    int want = ep->cfg.num_sms > 0 ? ep->cfg.num_sms : FR_CUHT_SMS_DEFAULT, C = want, share_max = 1;
    for (int i = 0; i < N && rc == FERRY_OK; i++) {
        if (all[i].status != FERRY_OK) {
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "rank %d cannot read its GPU's UUID and SM "
                        "count", i);
            break;
        }
        int share = 0;
        for (int j = 0; j < N; j++)
            share += memcmp(all[i].uuid, all[j].uuid, sizeof(all[i].uuid)) == 0;
        int fit = all[i].nsm / share;
        C = fit < C ? fit : C;
        share_max = share > share_max ? share : share_max;
    }
    free(all);
    if (rc != FERRY_OK)
        return -1;
    C = C < 1 ? 1 : C;
    if (C < want && ep->cfg.num_sms > 0 && share_max > 1)
        FR_LOG_WARN(FR_SUB_INIT, "cuda_ht: num_sms %d lowered to %d: %d ranks share a GPU, "
                    "and every rank's blocks must be resident at once", want, C, share_max);
    else if (C < want && ep->cfg.num_sms > 0)
        FR_LOG_WARN(FR_SUB_INIT, "cuda_ht: num_sms %d lowered to %d, the GPU's SMs: every "
                    "block must be resident at once", want, C);
    else if (C < want)
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: ranks share a GPU: %d channels per rank by default "
                    "(num_sms sets it, up to what fits)", C);
    return C;
}

extern "C" int fr_cuht_setup(ferry_ep_t ep, fr_err_t *err)
{
    int rc = FERRY_OK, N = ep->N;
    const ferry_ep_config_t *cfg = &ep->cfg;
    fr_layout_init(&ep->L, N, ep->rank, cfg->num_experts, cfg->topk, cfg->hidden,
                   cfg->max_tokens, cfg->dispatch_dtype == FERRY_DTYPE_FP8_E4M3);
    struct fr_cuht_ep *c = (struct fr_cuht_ep *)calloc(1, sizeof(*c));
    if (!c)
        return FR_ERR(err, FERRY_ERR_NOMEM, "CUDA state");
    ep->eng_state = c;
    int C = fr_cuht_channels(ep, err);
    if (C < 0)
        return FERRY_ERR_SYSTEM; /* err says why; every rank failed with it */
    C = C < FR_CUHT_MAX_CHANNELS ? C : FR_CUHT_MAX_CHANNELS;
    int RT = fr_cuht_ring_tokens(ep), NL = 0, NF = 0;
    char why[160] = "";
    /* forwarding: half the blocks forward (num_sms stays the SM budget) */
    if (ep->fab_device >= 0 && fr_cuht_fwd_plan(ep, &NL, &NF, why, sizeof(why))) {
        if (C < 2 && ep->fwd_req == FERRY_FORWARD_ON)
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "forward = on: a GPU rank forwards "
                          "with half its blocks and has %d (num_sms, or the GPU's SMs over "
                          "the ranks sharing it)", C);
        if (C < 2) {
            FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: no forwarding between nodes: 1 block per "
                        "rank (forwarding takes half of them)");
            NL = NF = 0;
        } else {
            C /= 2;
        }
    } else if (why[0]) {
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: no forwarding between nodes: %s", why);
    }
    fr_cuht_geo_init(&c->a.G, ep, C, RT, NL, NF);
    ep->forward = c->a.G.fwd;
    ep->L.seg_bytes = c->a.G.seg_bytes; /* what ferry_ep_get_layout reports */
    ep->L.send_bytes = 0; /* the outboxes, with fabric peers (fr_cuht_local) */
    /* A rank whose checks or segment failed still joins the exchanges with
     * its status, so every rank fails at once: the kind of peer memory
     * (ep/pmem.c; a segment that fabric peers write is registered with the
     * provider, so it stays on legacy IPC), then the checks and the
     * segment, then the peers' segments opened. */
    int kind = 0, st = FERRY_OK;
    if (cudaGetDevice(&c->device) != cudaSuccess ||
        cudaDeviceGetAttribute(&c->nsm, cudaDevAttrMultiProcessorCount, c->device) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        st = FR_ERR(err, FERRY_ERR_SYSTEM, "cuda_ht: cannot read the current device");
    } else if (N <= 8 && !c->a.G.fwd) {
        const char *why = NULL;
        c->tma = fr_cuht_tma_prep(c->device, &why);
        if (!c->tma)
            FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: rows copied by warps, not the copy engine: %s",
                        why);
    }
    c->peer_pm = (fr_pmem_t *)calloc((size_t)N, sizeof(fr_pmem_t));
    if (st == FERRY_OK && !c->peer_pm)
        st = FR_ERR(err, FERRY_ERR_NOMEM, "IPC table");
    if ((rc = fr_ep_pmem_kind(ep, st, c->device,
                              ep->nfabric > 0 ? "its segment takes fabric peers' writes, "
                                                "registered with the provider (FI_HMEM)"
                                              : NULL,
                              &kind, NULL, err)) != FERRY_OK)
        return rc;
    fr_cuht_msg_t mine, *all = NULL;
    memset(&mine, 0, sizeof(mine));
    mine.channels = C;
    mine.status = fr_cuht_local(ep, c, kind, err);
    all = (fr_cuht_msg_t *)calloc((size_t)N, sizeof(*all));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "IPC table");
    rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++) {
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to set up its GPU segment (%s)", i,
                        ferry_strerror(all[i].status));
        else if (all[i].channels != C)
            rc = FR_ERR(err, FERRY_ERR_INVALID,
                        "num_sms differs between ranks: rank %d uses %d channels, rank %d "
                        "uses %d (every rank passes the same num_sms)", ep->rank, C, i,
                        all[i].channels);
    }
    free(all);
    if (rc == FERRY_OK)
        rc = fr_ep_pmem_share(ep, FERRY_OK, &c->seg_pm, 0, N, c->peer_pm, err);
    if (rc == FERRY_OK)
        rc = fr_cuht_tables(ep, c, err);
    if (rc == FERRY_OK)
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: %d channels, rings of %d tokens, segment %llu B",
                    C, RT, (unsigned long long)c->a.G.seg_bytes);
    return rc;
}

extern "C" void fr_cuht_free(ferry_ep_t ep)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    if (!c)
        return;
    cudaDeviceSynchronize();
    if (c->peer_pm)
        for (int i = 0; i < ep->N; i++)
            fr_pmem_close(&c->peer_pm[i]);
    free(c->peer_pm);
    fr_cuht_pool_free(ep);
    fr_pmem_close(&c->seg_pm);
    ep->seg = NULL;
    if (ep->send) /* the outboxes (the NICs let go of them first: fr_ep_free) */
        cudaFree(ep->send);
    ep->send = NULL;
    if (c->fab.out)
        fr_cuda_host_free(c->fab.out);
    if (c->fab.in)
        fr_cuda_host_free(c->fab.in);
    fr_cuht_fab_free(&c->fab);
    fr_ahead_free(&c->ahead);
    while (c->spare) { /* after the device synchronisation above */
        fr_cuht_spare_t *sp = c->spare;
        c->spare = sp->next;
        cudaFree(sp->mem);
        cudaEventDestroy(sp->done);
        free(sp);
    }
    if (c->fab.abort)
        fr_cuda_host_free(c->fab.abort);
    if (c->dmem)
        cudaFree(c->dmem);
    if (c->fw_mem)
        cudaFree(c->fw_mem);
    if (c->err_host)
        fr_cuda_host_free(c->err_host);
    if (c->res_host)
        fr_cuda_host_free(c->res_host);
    free(c);
    ep->eng_state = NULL;
}

static const char *fr_cuht_what(int what)
{
    switch (what) {
    case FR_CUHT_WHAT_ROUTE:
    case FR_CUHT_WHAT_BOUND:
    case FR_CUHT_WHAT_BADIDX:
    case FR_CUHT_WHAT_COUNTS: return "route_create";
    case FR_CUHT_WHAT_COMBINE: return "ht_combine";
    default: return "ht_dispatch";
    }
}

extern "C" int fr_cuht_check(ferry_ep_t ep)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    if (!c || !c->err_host)
        return FERRY_OK;
    volatile int *e = (volatile int *)c->err_host;
    int st = e[0];
    if (st == 0) {
        /* the fabric thread's failure, when no kernel reported one */
        return c->fab.abort ? fr_ep_async_check(ep) : FERRY_OK;
    }
    int rank = e[1], what = e[2], detail = e[3];
    const char *call = fr_cuht_what(what);
    switch (what) {
    case FR_CUHT_WHAT_COUNTS:
        return fr_ep_fail(ep, st, "route_create: rank %d sent malformed counts (item %d; "
                          "checked on the GPU)", rank, detail);
    case FR_CUHT_WHAT_BOUND:
        return fr_ep_fail(ep, st, "route_create: this rank receives %d rows, more than "
                          "max_recv = %d (a bounded route; checked on the GPU)", detail, rank);
    case FR_CUHT_WHAT_BADIDX:
        return fr_ep_fail(ep, st, "route_create: rank %d passed a bad topk_idx to a bounded "
                          "route (-1 or 0..num_experts-1, no expert twice in a token; "
                          "checked on the GPU)", rank);
    case FR_CUHT_WHAT_RECORD:
        return fr_ep_fail(ep, st, "GPU: malformed high-throughput record from rank %d "
                          "(token %d)", rank, detail);
    case FR_CUHT_WHAT_ORDER:
        return fr_ep_fail(ep, st, "GPU: rank %d sends rows of route %d, this rank expects "
                          "another (every rank must use the same routes in the same order)",
                          rank, detail);
    case FR_CUHT_WHAT_DTYPE:
        return fr_ep_fail(ep, st, "ht_dispatch: rank %d sends %s rows, this rank expects the "
                          "other dtype (every rank passes x_scales, or none does)", rank,
                          detail ? "fp8" : "bf16");
    case FR_CUHT_WHAT_OVERRUN:
        return fr_ep_fail(ep, st, "GPU: rank %d wrote %d records past its ring's room", rank,
                          detail);
    default:
        /* a source's rings served here by its forwarder: name the forwarder */
        if (st == FERRY_ERR_TIMEOUT && detail == FR_CUHT_VIA && ep->forward && rank >= 0 &&
            rank < ep->N && ep->node_of[rank] != ep->node_of[ep->rank])
            rank = fr_ep_fwd_of(ep, rank, ep->node_of[ep->rank]);
        if (st == FERRY_ERR_TIMEOUT)
            return fr_ep_fail_gpu_wait(ep, call, rank);
        if (what == FR_CUHT_WHAT_ROUTE)
            return fr_ep_fail(ep, st, "route_create: rank %d is at route %d (every rank "
                              "creates the same routes in the same order)", rank, detail);
        return fr_ep_fail(ep, st, "%s: GPU reported %s for rank %d (%d)", call,
                          ferry_strerror(st), rank, detail);
    }
}

int fr_cuht_launch_check(ferry_ep_t ep, const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "launching %s: %s", what, cudaGetErrorString(e));
    return fr_cuht_check(ep);
}

extern "C" int fr_cuht_sync(ferry_ep_t ep, void *stream)
{
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream)
                           : cudaDeviceSynchronize();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "cudaStreamSynchronize: %s",
                          cudaGetErrorString(e));
    int rc = fr_cuht_check(ep);
    /* the device is done: the fabric thread's last heads out too (the
     * context's destroy syncs this way before its last barrier) */
    if (rc == FERRY_OK && !stream && ep->nfabric > 0 && fr_cuht(ep))
        rc = fr_cuht_fab_quiesce(ep, &fr_cuht(ep)->fab);
    return rc;
}

/* ---------------------------------------------------------------------- */
/* peers on the fabric path                                               */

/* GPU memory on the fabric (FERRY_FABRIC_HMEM and the provider, as the
 * low-latency engine decides: ep/hmem.h), agreed by every rank: this
 * engine then serves the fabric peers itself (fab.h); otherwise the
 * staged engine does, whose protocol differs, so no rank may choose alone. */
extern "C" int fr_cuht_fabric_native(ferry_ep_t ep, int *native, fr_err_t *err)
{
    typedef struct { int status, ok, on; } fr_nat_t;
    fr_nat_t mine = {FERRY_OK, 0, 0}, *all = (fr_nat_t *)calloc((size_t)ep->N, sizeof(fr_nat_t));
    fr_tp_hmem_t h;
    int dev = 0, want = 0, order = 0;
    memset(&h, 0, sizeof(h));
    *native = 0;
    if (!all)
        mine.status = FR_ERR(err, FERRY_ERR_NOMEM, "fabric table");
    else if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        mine.status = FR_ERR(err, FERRY_ERR_SYSTEM, "cudaGetDevice failed");
    } else {
        mine.status = fr_ep_hmem_policy(dev, &want, &h, &order, err);
    }
    if (mine.status == FERRY_OK && h.ok) {
        void *p = NULL; /* a trial region: some providers offer FI_HMEM without CUDA */
        if (cudaMalloc(&p, 2u << 20) == cudaSuccess) {
            fr_ep_hmem_trial(dev, p, 2u << 20, &h);
            cudaFree(p);
        } else {
            (void)cudaGetLastError();
            h.ok = 0;
            snprintf(h.why, sizeof(h.why), "no GPU memory for a trial registration");
        }
    }
    /* what this engine refuses and the staged engine takes: a format of
     * the fabric thread's immediates for these ranks and rings (fab.h) */
    fr_cuht_fab_fmt_t fmt;
    if (mine.status == FERRY_OK && h.ok && ep->N > FR_CUHT_MAX_RANKS) {
        h.ok = 0;
        snprintf(h.why, sizeof(h.why), "%d ranks (this engine takes at most %d)", ep->N,
                 FR_CUHT_MAX_RANKS);
    }
    if (mine.status == FERRY_OK && h.ok &&
        fr_cuht_fab_fmt(ep->N, fr_cuht_ring_tokens(ep), &fmt, h.why, sizeof(h.why)) != 0)
        h.ok = 0;
    if (mine.status == FERRY_OK && h.ok && ep->fwd_req == FERRY_FORWARD_ON) {
        int nl, nfs; /* forwarding asked for, and this engine cannot: the staged one does */
        char w[160];
        if (!fr_cuht_fwd_plan(ep, &nl, &nfs, w, sizeof(w)) && w[0]) {
            h.ok = 0;
            snprintf(h.why, sizeof(h.why), "forward = on: %s", w);
        }
    }
    if (mine.status == FERRY_OK && h.ok && ep->cfg.num_experts > 32767) {
        h.ok = 0;
        snprintf(h.why, sizeof(h.why), "num_experts = %d (this engine takes at most 32767)",
                 ep->cfg.num_experts);
    }
    if (!all) /* 8 bytes a rank: the peers learn of it when this rank goes */
        return mine.status;
    mine.ok = mine.status == FERRY_OK && h.ok;
    mine.on = want > 0;
    fr_err_t e2 = {{0}};
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), &e2);
    if (rc != FERRY_OK) {
        free(all);
        return FR_ERR(err, rc, "%s", e2.msg);
    }
    rc = mine.status;
    int first_no = -1, first_on = -1;
    for (int i = 0; i < ep->N && rc == FERRY_OK; i++) {
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d cannot choose where its fabric regions "
                        "live (%s)", i, ferry_strerror(all[i].status));
        if (!all[i].ok && first_no < 0)
            first_no = i;
        if (all[i].on && first_on < 0)
            first_on = i;
    }
    /* one rank's FERRY_FABRIC_HMEM=on fails every rank alike, not only it
     * (the others would wait in the staged engine's set-up for it) */
    if (rc == FERRY_OK && first_on >= 0 && first_no >= 0)
        rc = FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                    "rank %d sets FERRY_FABRIC_HMEM=on, but rank %d cannot take GPU memory on "
                    "the fabric (%s)", first_on, first_no,
                    first_no == ep->rank ? h.why : "its log says why");
    free(all);
    if (rc != FERRY_OK)
        return rc;
    *native = first_no < 0;
    if (*native) {
        ep->fab_device = dev;
        ep->rx_flush = fr_ep_rx_flush_kind(&h, order);
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: rings for fabric peers in GPU %d memory, "
                    "registered with FI_HMEM (%s)%s", dev, h.why,
                    ep->rx_flush == FR_RX_FLUSH_COPIES
                        ? "; calls need streams created with cudaStreamNonBlocking" : "");
    } else {
        FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: fabric peers through the staged engine, in "
                    "pinned host memory (%s)", first_no == ep->rank ? h.why
                                                      : "another rank cannot take GPU memory");
    }
    return FERRY_OK;
}

/* What fabric_up needs before the hello: the kernels loaded, the events,
 * the thread's tables. */
static int fr_cuht_fabric_prep(ferry_ep_t ep, struct fr_cuht_ep *c, fr_err_t *err)
{
    if (fr_cuht_load_route() || fr_cuht_load_stream() || fr_cuht_load_dlayout())
        return FR_ERR(err, FERRY_ERR_SYSTEM, "loading the kernels: %s",
                      cudaGetErrorString(cudaGetLastError()));
    int rc = fr_ahead_init(ep, &c->ahead, FR_CUHT_AHEAD, err);
    if (rc != FERRY_OK)
        return rc;
    c->fab.G = c->a.G;
    if (fr_cuht_fab_init(ep, &c->fab) != FERRY_OK)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric thread tables");
    return FERRY_OK;
}

/* The NICs are up: the kernels loaded, the hello, then the thread. */
extern "C" int fr_cuht_fabric_up(ferry_ep_t ep, fr_err_t *err)
{
    struct fr_cuht_ep *c = fr_cuht(ep);
    /* every rank's status first, so that one that failed here fails every
     * rank at once instead of leaving them to wait for its hello */
    int mine = fr_cuht_fabric_prep(ep, c, err), *all = (int *)calloc((size_t)ep->N, sizeof(int));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric status table");
    fr_err_t e2 = {{0}};
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(int), &e2);
    if (rc != FERRY_OK)
        rc = FR_ERR(err, rc, "%s", e2.msg);
    else if (mine != FERRY_OK)
        rc = mine; /* err says why */
    for (int i = 0; i < ep->N && rc == FERRY_OK; i++)
        if (all[i] != FERRY_OK)
            rc = FR_ERR(err, all[i], "rank %d failed to set up its fabric thread (%s)", i,
                        ferry_strerror(all[i]));
    free(all);
    if (rc == FERRY_OK)
        rc = fr_cuht_fab_hello(ep, &c->fab, err);
    if (rc != FERRY_OK)
        return rc;
    rc = fr_cuht_fab_start(ep, &c->fab);
    if (rc != FERRY_OK)
        return FR_ERR(err, rc, "%s", ep->err.msg);
    FR_LOG_INFO(FR_SUB_INIT, "cuda_ht: %d fabric peers, outboxes %llu B each", ep->nfabric,
                (unsigned long long)c->a.G.ob_bytes);
    return FERRY_OK;
}

