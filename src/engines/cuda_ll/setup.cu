/*
 * The CUDA low-latency engine: device state and set-up in named steps
 * (segment, exchange, tables, grid), free, the error word and the sync;
 * the kernels are dispatch.cu and combine.cu. Twins of src/engines/cpu_ll/,
 * sharing the record layout (core/layout.h) and number formats
 * (core/quant.h).
 *
 * Epochs live on the device (per buffer set, advanced by dispatch_send),
 * so the calls can be captured in a CUDA graph and replayed.
 */

#include <sched.h>

#include "engines/cuda_ll/cuda_ll_dev.cuh"
#include "ep/hmem.h"
#include "runtime/rt.h"
/* ---------------------------------------------------------------------- */
/* host side                                                              */

/* A runtime helper's status: on failure, keep it and leave. */
#define FR_CUH(call, label)                                                    \
    do {                                                                       \
        int s_ = (call);                                                       \
        if (s_ != FERRY_OK) {                                                  \
            rc = s_;                                                           \
            goto label;                                                        \
        }                                                                      \
    } while (0)

extern "C" int ferry_cuda_available(char *why, size_t len)
{
    int n = 0, drv = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0)
        return 1;
    (void)cudaGetLastError();
    /* say which of the two it is: no driver, or one older than the CUDA
     * runtime ferry was built with (CUDART_VERSION: 13000 is 13.0) */
    if (cudaDriverGetVersion(&drv) != cudaSuccess)
        drv = 0;
    (void)cudaGetLastError();
    if (why && len) {
        int rt = CUDART_VERSION;
        if (drv == 0)
            snprintf(why, len, "no NVIDIA driver found (libcuda.so.1 is not loadable): ferry's "
                     "CUDA %d.%d runtime needs the driver of a CUDA %d.%d or later toolkit",
                     rt / 1000, rt % 1000 / 10, rt / 1000, rt % 1000 / 10);
        else if (drv < rt)
            snprintf(why, len, "the NVIDIA driver supports CUDA %d.%d, ferry's runtime is CUDA "
                     "%d.%d: update the driver (README: requirements)", drv / 1000,
                     drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
        else
            snprintf(why, len, "no CUDA device: %s",
                     e != cudaSuccess ? cudaGetErrorString(e) : "count is 0");
    }
    return 0;
}

/* Where a rank whose peers are all on the fabric keeps its receive
 * segment and send region (FERRY_FABRIC_HMEM): GPU memory registered with
 * the provider (FI_HMEM) when it offers that, the flags beside it in
 * pinned host memory (the proxy stores them; kernels poll them there);
 * otherwise all of it in pinned host memory mapped into the GPU, which
 * any provider can read. */
static int fr_cuda_fabric_mem(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int rc = FERRY_OK;
    const fr_layout_t *L = &ep->L;
    fr_tp_hmem_t h;
    void *hp;
    int want = 0, order = 0; /* how NIC writes become visible (fr_cuda_gdr_order; 0: copies) */
    rc = fr_ep_hmem_policy(c->device, &want, &h, &order, err);
    if (rc != FERRY_OK)
        return rc;
    int on = want > 0, off = want < 0;
    if (!off && h.ok) {
        /* the segment itself is registered on trial */
        FR_CU(cudaMalloc((void **)&ep->seg, L->seg_bytes), err, fail);
        if (!fr_ep_hmem_trial(c->device, ep->seg, L->seg_bytes, &h)) {
            cudaFree(ep->seg);
            ep->seg = NULL;
        }
    }
    if (on && !h.ok)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "FERRY_FABRIC_HMEM=on: the fabric cannot register GPU memory: %s", h.why);
    if (h.ok) {
        ep->fab_device = c->device; /* first: fr_cuda_free frees by it */
        FR_CU(cudaMemset(ep->seg, 0, L->seg_bytes), err, fail);
        FR_CU(cudaMalloc((void **)&ep->send, L->send_bytes), err, fail);
        c->dev_seg = ep->seg;
        c->dev_send = ep->send;
        FR_CUH(fr_cuda_host_alloc(L->off_drecv, &hp, &c->dev_flags, err), fail);
        ep->flags = (uint8_t *)hp;
        /* before flags are published: a NIC's writes into GPU memory
         * flushed where the GPU does not order them itself; a copying
         * provider's cudaMemcpy calls waited for */
        ep->rx_flush = fr_ep_rx_flush_kind(&h, order);
        FR_LOG_INFO(FR_SUB_INIT, "fabric: receive segment and send region in GPU %d memory, "
                    "registered with FI_HMEM (%s)%s", c->device, h.why,
                    ep->rx_flush == FR_RX_FLUSH_GDR ? "; NIC writes flushed before each flag"
                    : ep->rx_flush == FR_RX_FLUSH_COPIES
                        ? "; the provider's copies waited for before each flag (calls need "
                          "streams created with cudaStreamNonBlocking)"
                        : "");
        return FERRY_OK;
    }
    FR_CUH(fr_cuda_host_alloc(L->seg_bytes, &hp, &c->dev_seg, err), fail);
    ep->seg = (uint8_t *)hp;
    FR_CUH(fr_cuda_host_alloc(L->send_bytes, &hp, &c->dev_send, err), fail);
    ep->send = (uint8_t *)hp;
    c->dev_flags = c->dev_seg;
    FR_LOG_INFO(FR_SUB_INIT, "fabric: receive segment and send region in pinned host memory "
                "(FERRY_FABRIC_HMEM=%s%s%s)", fr_cfg_str(FR_CFG_FABRIC_HMEM), off ? "" : ": ",
                off ? "" : h.why);
fail:
    return rc;
}

/* This rank's receive segment, step 1: with peers on the fabric, its
 * receive region (GPU memory, or pinned host memory mapped into the GPU)
 * and the proxy's tables. *legacy_only: why the segment the node's peers
 * map must be shared through legacy CUDA IPC (it is the fabric's GPU
 * region, which the provider registered). */
static int fr_cuda_segment(ferry_ep_t ep, struct fr_cuda_ep *c, const char **legacy_only,
                           fr_err_t *err)
{
    int rc = FERRY_OK;
    const fr_layout_t *L = &ep->L;
    *legacy_only = NULL;
    FR_CU(cudaGetDevice(&c->device), err, fail);
    c->host_seg = ep->nfabric > 0;
    /* peers on both paths (ranks of one node among several): the fabric's
     * receive region as with the fabric alone, and a GPU segment for the
     * IPC peers, which is that region itself when it is GPU memory. IPC
     * peers read each other's flags, so both must publish them alike
     * (fr_cu_target): they do, as ranks of one node see the same other
     * nodes (one node table) under the same FERRY_TRANSPORT (compared by
     * ferry_ep_create) */
    c->a.mixed = ep->nfabric > 0 && ep->nshm > 0;
    if (c->a.mixed && L->crows >= (uint64_t)FR_CPOS_IPC)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "%llu combine rows per rank: with peers on both the IPC and fabric "
                      "paths the CUDA engine takes fewer than %d (fewer ranks, tokens or "
                      "top-k)", (unsigned long long)L->crows, FR_CPOS_IPC);
    if (c->host_seg) {
        rc = fr_cuda_fabric_mem(ep, c, err);
        if (rc == FERRY_OK)
            rc = fr_ahead_init(ep, &c->ahead, FR_CU_AHEAD, err); /* after rx_flush is known */
        if (rc != FERRY_OK)
            return rc;
        if (c->a.mixed && ep->fab_device >= 0)
            *legacy_only = "its segment is also the fabric's receive region in GPU memory, "
                           "registered with the provider (FI_HMEM)";
        /* the proxy's tables: pinned host memory mapped into the GPU
         * (runtime/cuda_mem.h) */
        void *h;
        size_t nsl = 2 * FR_NSETS * (size_t)ep->nfabric;
        FR_CUH(fr_cuda_host_alloc(nsl * sizeof(fr_slice_t), &h, &c->dev_slices, err), fail);
        ep->slices = (fr_slice_t *)h;
        FR_CUH(fr_cuda_host_alloc(nsl * sizeof(uint64_t), &h, &c->dev_ready, err), fail);
        ep->ready = (uint64_t *)h;
    }
fail:
    return rc;
}

/* Step 2: the segment the node's peers map, of the agreed kind: seg itself
 * (every peer through IPC), a GPU segment beside the fabric's host one
 * (mixed), or the fabric's GPU region, borrowed. */
static int fr_cuda_iseg(ferry_ep_t ep, struct fr_cuda_ep *c, int kind, fr_err_t *err)
{
    const fr_layout_t *L = &ep->L;
    if (!c->host_seg) {
        int rc = fr_pmem_alloc(kind, c->device, L->seg_bytes, &c->iseg, err);
        ep->seg = (uint8_t *)c->iseg.ptr;
        return rc;
    }
    if (!c->a.mixed)
        return FERRY_OK;
    if (ep->fab_device >= 0) {
        c->iseg.kind = FR_PMEM_LEGACY;
        c->iseg.own = -1;
        c->iseg.device = c->device;
        c->iseg.ptr = ep->seg;
        c->iseg.size = L->seg_bytes;
    } else {
        int rc = fr_pmem_alloc(kind, c->device, L->seg_bytes, &c->iseg, err);
        if (rc != FERRY_OK)
            return rc;
    }
    c->a.iseg = (uint8_t *)c->iseg.ptr;
    FR_LOG_INFO(FR_SUB_INIT, "peers on both paths: %d over IPC into %s, %d over the fabric",
                ep->nshm, ep->fab_device < 0 ? "a GPU segment of their own"
                                             : "the fabric's GPU segment", ep->nfabric);
    return FERRY_OK;
}

/* Every kernel of the engine loaded now, and the one-launch grids sized.
 * Under CUDA's lazy loading (the default) a kernel is loaded at its first
 * use, and loading may wait for the kernels running in the context: a
 * first combine queued while a dispatch waits for data the proxy must
 * deliver with CUDA calls (GPU memory on the fabric path) would wait for
 * each other. */
static int fr_cuda_load_kernels(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int rc = fr_cuda_dispatch_load(ep, c, err);
    if (rc != FERRY_OK)
        return rc;
    return fr_cuda_combine_load(ep, c, err);
}

/* The device tables in one allocation, in this order; with b == NULL
 * only their size (the return), else A's pointers into b. Each table
 * starts on a 256-byte boundary. */
static size_t fr_cuda_carve(fr_cu_args_t *A, uint8_t *b, const fr_layout_t *L, int N)
{
    size_t T = (size_t)L->T, K = (size_t)L->K, kd = (size_t)L->K, at = 0;
    size_t sets = 2 * FR_NSETS * (size_t)N;
#define FR_CARVE(field, type, bytes)                                           \
    do {                                                                       \
        if (b)                                                                 \
            A->field = (type)(b + at);                                         \
        at += ((size_t)(bytes) + 255) & ~(size_t)255;                          \
    } while (0)
    FR_CARVE(peer, uint8_t **, sizeof(uint8_t *) * N);
    FR_CARVE(path, const int *, sizeof(int) * N);
    FR_CARVE(gidx, const int *, sizeof(int) * N);
    FR_CARVE(epoch, unsigned long long *, sizeof(unsigned long long) * 2);
    FR_CARVE(ntok, int32_t *, sizeof(int32_t) * 2);
    FR_CARVE(rec_idx, int32_t *, sizeof(int32_t) * 2 * T * N);
    FR_CARVE(pair_base, int32_t *, sizeof(int32_t) * 2 * T * N);
    FR_CARVE(comb_pos, int32_t *, sizeof(int32_t) * 2 * T * K);
    FR_CARVE(cnt, int32_t *, sizeof(int32_t) * 2 * N * 3); /* cnt, npairs, comb_off */
    FR_CARVE(dst_rec, uint8_t **, sizeof(uint8_t *) * 2 * T * kd);
    FR_CARVE(ddone, unsigned int *, sizeof(unsigned int) * (2 * (size_t)N + 2)); /* + dpub */
    FR_CARVE(pair_row, int32_t *, sizeof(int32_t) * 2 * L->send_crows);
    FR_CARVE(pair_n, int32_t *, sizeof(int32_t) * 2 * N);
    FR_CARVE(scomb_off, int32_t *, sizeof(int32_t) * 2 * N);
    FR_CARVE(done, unsigned int *, sizeof(unsigned int) * 4);
    FR_CARVE(dflag, int *, sizeof(int) * 4);
    FR_CARVE(dst_scl, uint8_t **, sizeof(float *) * 2 * T * kd);
    FR_CARVE(self_run, int32_t *, sizeof(int32_t) * 2 * (size_t)L->El);
    FR_CARVE(mask, int32_t *, sizeof(int32_t) * ((size_t)N + 1)); /* zeroed: none masked */
    FR_CARVE(decide, unsigned long long *, sizeof(unsigned long long) * sets);
    FR_CARVE(claim, unsigned long long *, sizeof(unsigned long long) * sets);
    FR_CARVE(mirror, unsigned long long *, sizeof(unsigned long long) * sets);
#undef FR_CARVE
    if (b) {
        A->npairs = A->cnt + 2 * N;
        A->comb_off = A->cnt + 4 * N;
        A->dpub = A->ddone + 2 * (size_t)N;
        A->kd = (int)kd;
    }
    return at;
}

/* Set-up step 3: the kind of peer memory agreed (a rank that failed its
 * segment joins with its status, so all fail at once), the ranks sharing
 * this GPU counted, the node's peers' segments opened
 * (ep/pmem.c). */
static int fr_cuda_exchange(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int N = ep->N, rc, kind = 0;
    const char *legacy_only = NULL;
    int status = fr_cuda_segment(ep, c, &legacy_only, err);
    c->peer_pm = (fr_pmem_t *)calloc((size_t)N, sizeof(fr_pmem_t));
    if (status == FERRY_OK && !c->peer_pm)
        status = FR_ERR(err, FERRY_ERR_NOMEM, "IPC table");
    rc = fr_ep_pmem_kind(ep, status, c->device, legacy_only, &kind, &c->share, err);
    if (rc != FERRY_OK)
        return rc;
    status = fr_cuda_iseg(ep, c, kind, err);
    return fr_ep_pmem_share(ep, status, &c->iseg, 0, N, c->peer_pm, err);
}

/* Step 3: the device tables (fr_cuda_carve) and what the kernels are
 * given: the layout, the paths, where each peer's segment is. */
static int fr_cuda_tables(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int N = ep->N, rc = FERRY_OK;
    fr_cu_args_t *A = &c->a;
    size_t tot = fr_cuda_carve(A, NULL, &ep->L, N);
    unsigned long long ep0[2] = {0ull, ~0ull}; /* set 1 starts at -1 */
    uint8_t **peer = NULL;
    cudaError_t e1;
    FR_CU(cudaMalloc(&c->dmem, tot), err, fail);
    FR_CU(cudaMemset(c->dmem, 0, tot), err, fail);
    fr_cuda_carve(A, (uint8_t *)c->dmem, &ep->L, N);
    A->L = ep->L;
    A->rank = ep->rank;
    A->N = N;
    A->round_scale = ep->cfg.fp8_round_scale;
    A->mask_on_timeout = ep->cfg.mask_on_timeout;
    FR_CU(cudaMemcpy(A->epoch, ep0, sizeof(ep0), cudaMemcpyHostToDevice), err, fail);
    FR_CU(cudaMemcpy((void *)A->path, ep->path, sizeof(int) * N, cudaMemcpyHostToDevice), err, fail);
    FR_CU(cudaMemcpy((void *)A->gidx, ep->group_index, sizeof(int) * N, cudaMemcpyHostToDevice), err,
          fail);
    if (c->host_seg) {
        A->seg = (uint8_t *)c->dev_seg;
        A->send = (uint8_t *)c->dev_send;
        A->ready = (unsigned long long *)c->dev_ready;
        A->slices = (fr_slice_t *)c->dev_slices;
        A->flags = (uint8_t *)c->dev_flags;
    } else {
        A->seg = ep->seg;
        A->flags = ep->seg;
    }
    A->nfabric = ep->nfabric;
    if (!A->mixed) /* one place for every sender (mixed: set by the segment step) */
        A->iseg = A->seg;
    peer = (uint8_t **)calloc((size_t)N, sizeof(uint8_t *));
    if (!peer)
        return FR_ERR(err, FERRY_ERR_NOMEM, "peer table");
    for (int i = 0; i < N; i++)
        peer[i] = ep->path[i] == FR_PATH_SELF ? A->seg : (uint8_t *)c->peer_pm[i].ptr;
    e1 = cudaMemcpy(A->peer, peer, sizeof(uint8_t *) * N, cudaMemcpyHostToDevice);
    free(peer);
    FR_CU(e1, err, fail);
fail:
    return rc;
}

/* Step 4: the error word, the kernels loaded, the grid: every kernel's
 * grid (the split parts too) within this rank's share of what the GPU
 * holds at once (with ranks sharing a GPU, more left some ranks' blocks
 * unscheduled while the others waited for them: 8 ranks with num_sms 40
 * on one H200 timed out). */
static int fr_cuda_grid(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int rc = FERRY_OK;
    fr_cu_args_t *A = &c->a;
    void *eh;
    FR_CUH(fr_cuda_host_alloc(sizeof(int) * 4, &eh, &c->err_dev, err), fail);
    c->err_host = (int *)eh;
    A->err = (volatile int *)c->err_dev;
    A->timeout_ns = (unsigned long long)ep->timeout_ms * 1000000ull;
    c->nblocks = ep->cfg.num_sms > 0 ? ep->cfg.num_sms : 16;
    FR_CU(cudaDeviceGetAttribute(&c->nsm, cudaDevAttrMultiProcessorCount, c->device), err, fail);
    FR_CUH(fr_cuda_load_kernels(ep, c, err), fail);
    {
        int cap = c->dgrid > 0 && c->cgrid > 0 ? (c->dgrid < c->cgrid ? c->dgrid : c->cgrid)
                                               : c->dgrid > 0 ? c->dgrid : c->cgrid;
        if (c->share > 1 && cap > 0 && c->nblocks > cap) {
            if (ep->cfg.num_sms > 0)
                FR_LOG_WARN(FR_SUB_INIT, "num_sms %d lowered to %d: %d ranks share this GPU, "
                            "and their blocks must be resident at once", c->nblocks, cap,
                            c->share);
            c->nblocks = cap;
        }
    }
fail:
    return rc;
}

/* Set-up: the layout and checks (step 1), then the steps above. */
extern "C" int fr_cuda_setup(ferry_ep_t ep, fr_err_t *err)
{
    const ferry_ep_config_t *cfg = &ep->cfg;
    fr_layout_init(&ep->L, ep->N, ep->rank, cfg->num_experts, cfg->topk,
                   cfg->hidden, cfg->max_tokens, (int)cfg->dispatch_dtype);
    if (!ep->L.nvfp4) /* NVFP4's scales have their own layout */
        ep->L.sfmt = cfg->scales_layout;
    if (cfg->num_experts > FR_CU_EMAX) /* the same on every rank: all fail here */
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "num_experts %d: the CUDA engine takes at most %d (its kernels keep a "
                      "count per expert in shared memory)", cfg->num_experts, FR_CU_EMAX);
    int rc = fr_cuda_dispatch_init(ep, err); /* the same on every rank of one GPU model */
    if (rc != FERRY_OK)
        return rc;
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)calloc(1, sizeof(*c));
    if (!c)
        return FR_ERR(err, FERRY_ERR_NOMEM, "CUDA state");
    ep->eng_state = c;
    if ((rc = fr_cuda_exchange(ep, c, err)) != FERRY_OK ||
        (rc = fr_cuda_tables(ep, c, err)) != FERRY_OK)
        return rc;
    return fr_cuda_grid(ep, c, err);
}

extern "C" void fr_cuda_free(ferry_ep_t ep)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    if (!c)
        return;
    cudaDeviceSynchronize();
    if (c->peer_pm)
        for (int i = 0; i < ep->N; i++)
            fr_pmem_close(&c->peer_pm[i]);
    free(c->peer_pm);
    if (ep->fab_device >= 0) {
        cudaFree(ep->seg);
        cudaFree(ep->send);
        fr_cuda_host_free(ep->flags);
    } else if (c->host_seg) {
        fr_cuda_host_free(ep->seg);
        fr_cuda_host_free(ep->send);
    }
    if (c->host_seg) {
        fr_cuda_host_free(ep->slices);
        fr_cuda_host_free(ep->ready);
    }
    fr_pmem_close(&c->iseg); /* seg itself without the fabric; borrowed: nothing */
    ep->seg = NULL;
    ep->send = NULL;
    ep->flags = NULL;
    ep->slices = NULL;
    ep->ready = NULL;
    if (c->dmem)
        cudaFree(c->dmem);
    fr_ahead_free(&c->ahead);
    if (c->err_host)
        fr_cuda_host_free(c->err_host);
    free(c);
    ep->eng_state = NULL;
}

extern "C" int fr_cuda_check(ferry_ep_t ep)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    volatile int *e = (volatile int *)c->err_host;
    int st = e[0];
    if (st == 0)
        return FERRY_OK;
    int rank = e[1], what = e[2], detail = e[3];
    switch (what) {
    case FR_CU_WHAT_INPUT:
        /* the error word stays up: every later kernel of this context
         * returns at once, so its peers time out waiting for it */
        fr_ep_fail(ep, st,
                   "topk_idx[%d][%d] (checked on the GPU of rank %d): must be -1 or 0..%d and "
                   "not repeat an expert of the token; the context is failed (its kernels stop "
                   "here, its peers time out waiting for this rank): create a new one",
                   detail / ep->L.K, detail % ep->L.K, rank, ep->L.E - 1);
        fr_ep_set_failed(ep, st);
        return st;
    case FR_CU_WHAT_MASK:
        fr_ep_fail(ep, st, "dispatch on the GPU of rank %d: %d rank(s) masked, but this launch "
                   "is of the kernel without a mask (a CUDA graph captured before "
                   "ferry_ep_mask_rank): the round did not run; capture the graph again "
                   "after masking, in a new context", rank, detail);
        fr_ep_set_failed(ep, st); /* the error word stays up: every later kernel returns */
        return st;
    case FR_CU_WHAT_NTOK: /* as INPUT: the error word stays up */
        fr_ep_fail(ep, st,
                   "num_tokens_dev = %d (read on the GPU of rank %d): must be 0..max_tokens "
                   "(%d); the context is failed (its kernels stop here, its peers time out "
                   "waiting for this rank): create a new one", detail, rank, ep->L.T);
        fr_ep_set_failed(ep, st);
        return st;
    case FR_CU_WHAT_SIGNAL:
        fr_ep_fail(ep, st, "combine: local expert %d's signal (signals[%d]) did not read "
                   "signal_value within the timeout (%ld ms): the computation writing "
                   "expert_y never raised it; the context is failed (create a new one)",
                   rank, detail, ep->timeout_ms);
        fr_ep_set_failed(ep, st);
        return st;
    case FR_CU_WHAT_RECORD:
        return fr_ep_fail(ep, st, "GPU: malformed dispatch slice from rank %d (record %d)",
                          rank, detail);
    default:
        if (st == FERRY_ERR_TIMEOUT)
            return fr_ep_fail_gpu_wait(ep, what == FR_CU_WHAT_COMBINE ? "combine" : "dispatch",
                                       rank);
        return fr_ep_fail(ep, st, "GPU reported %s for rank %d (%d)", ferry_strerror(st),
                          rank, detail);
    }
}

int fr_cuda_launch_check(ferry_ep_t ep, const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "launching %s: %s", what, cudaGetErrorString(e));
    return fr_cuda_check(ep);
}

extern "C" int fr_cuda_sync(ferry_ep_t ep, void *stream)
{
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream)
                           : cudaDeviceSynchronize();
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "cudaStreamSynchronize: %s", cudaGetErrorString(e));
    return fr_cuda_check(ep);
}

