/*
 * The CUDA low-latency engine: device state and set-up, error words, and
 * the combine kernels (dispatch kernels: dispatch.cu). Twins of
 * src/engines/cpu_ll/, sharing the record layout (core/layout.h) and
 * number formats (core/quant.h).
 *
 *   combine send part    = rows of each source rank, one contiguous run,
 *                          then every block adds its share to the flags
 *   combine receive part = wait for all flags, fp32 weighted sum, bf16 out
 *   one kernel (ferry::combine): one launch runs both parts;
 *   combine_send / combine_recv launch it once per part.
 *
 * Ordering (IPC path): data stores, a block barrier, one system fence by
 * thread 0, then relaxed system-scope adds to the destinations' flags
 * (fr_cu_arrive: flags count arrivals). Fabric path: a count of finished
 * blocks, and the block that finishes fills each peer's slice and rings
 * its doorbell for the proxy.
 * Receivers poll relaxed and acquire once. Waits are bounded by
 * %globaltimer: on expiry the kernel writes an error word in host-mapped
 * memory and returns (never traps); every later kernel sees the word and
 * returns at once.
 *
 * Epochs live on the device (per buffer set, advanced by dispatch_send),
 * so the calls can be captured in a CUDA graph and replayed.
 */
#include <sched.h>

#include "engines/cuda_ll/cuda_ll_dev.cuh"
#include "ep/hmem.h"
#include "runtime/rt.h"


/* threads per block of ferry::combine, whichever parts a launch runs */
#define FR_CS_THREADS 512

/* ---------------------------------------------------------------------- */
/* combine                                                                */

static __device__ __forceinline__ void fr_cs_run(const fr_cu_args_t &A, int set,
                                                 const uint8_t *y)
{
    const fr_layout_t &L = A.L;
    int N = A.N;
    unsigned int *done = A.done + FR_PH_COMBINE * FR_NSETS + set;
    const int32_t *pn = A.pair_n + set * N;
    size_t pstride = (size_t)L.T * L.kmax; /* sender s's pairs start at s * pstride */
    __shared__ int s_fail;
    __shared__ const int32_t *s_mk; /* the mask, NULL when no rank is masked */
    if (threadIdx.x == 0) {
        s_fail = fr_cu_failed(A);
        s_mk = A.mask[N] ? A.mask : NULL;
        if (blockIdx.x == 0)
            FR_TL(A, FR_PH_COMBINE, A.epoch[set], "start", A.rank);
    }
    __syncthreads();
    /* items of 4 KB (a warp's 8 x 16 bytes per lane) of every row, all
     * warps of the grid over each source's rows in turn; own rows are
     * read in place by combine_recv */
    int cpr = (int)((L.crow + 4095) / 4096);
    int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int nwg = gridDim.x * (blockDim.x >> 5);
    for (int s = 0; s < N && !s_fail; s++) {
        if (s == A.rank || (s_mk && s_mk[s])) /* a masked rank's memory: never */
            continue;
        int p0 = (int)(s * pstride), np = pn[s];
        const int32_t *rows = A.pair_row + (size_t)set * L.send_crows + p0;
        uint8_t *dst = A.path[s] == FR_PATH_FABRIC
                           ? A.send + fr_off_csend(&L, set, (uint64_t)p0)
                           : A.peer[s] + fr_off_crecv(&L, set, (uint64_t)A.scomb_off[set * N + s]);
        for (int q = gw; q < np * cpr; q += nwg) {
            int p = q / cpr, c = q - p * cpr;
            if (rows[p] < 0) /* dropped at dispatch (an input error was reported) */
                continue;
            size_t off = (size_t)c * 4096, len = L.crow - off < 4096 ? L.crow - off : 4096;
            fr_warp_copy16u<8, false>(dst + (size_t)p * L.crow + off, y + (size_t)rows[p] * L.crow + off, len);
        }
    }
    __shared__ bool last;
    if (A.nfabric == 0) {
        fr_cu_arrive(A, FR_PH_COMBINE, set, s_mk); /* barrier first, then thread 0 */
        return;
    }
    /* the block's stores, then one system fence (fr_cu_arrive says why
     * one thread's fence after a barrier covers them) before the count */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence_system();
    unsigned long long epoch = A.epoch[set];
    bool ok = !fr_cu_failed(A);
    for (int d = threadIdx.x; d < N && ok; d += blockDim.x) {
        if (s_mk && s_mk[d]) /* a masked rank is sent nothing */
            continue;
        int p0 = (int)(d * pstride), np = pn[d];
        fr_cu_publish(A, FR_PH_COMBINE, set, d, epoch, fr_off_csend(&L, set, (uint64_t)p0),
                      fr_off_crecv(&L, set, (uint64_t)A.scomb_off[set * N + d]),
                      (uint64_t)np * L.crow);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        *done = 0;
}

/* Blocks take runs of B consecutive tokens: the rows of all B x K pairs
 * are looked up at once, then every thread sums 8 channels of one token
 * with the K row loads in flight (no per-token barrier or lookup chain). */
#define FR_CR_PAIRS 256
#define FR_CR_CUTS 32 /* masked ranks a combine block lists for its cut */
static __device__ __forceinline__ void fr_cr_run(const fr_cu_args_t &A, int set,
                                                 const float *w, uint16_t *out,
                                                 const uint8_t *self_y, long long *cost)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, H = L.H;
    __shared__ int ok, s_own; /* s_own: a wait of this block masked a rank */
    __shared__ const uint8_t *srow[FR_CR_PAIRS];
    __shared__ float sw[FR_CR_PAIRS];
    /* Every sender is needed before any token can be summed: the first
     * warp's lanes wait for them at once (lane l for senders l, l + 32,
     * ...), so the wait costs one poll latency, not N in a row; block 0's
     * lanes add what each waited to the optional wait costs. */
    if (threadIdx.x == 0)
        s_own = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
        bool mine = !fr_cu_failed(A);
        unsigned long long epoch = A.epoch[set];
        int nmask = A.mask[N]; /* loaded beside the two above */
        for (int s = threadIdx.x; s < N && mine; s += 32) {
            if (nmask && A.mask[s]) /* sent nothing, waited for never */
                continue;
            long long t0 = clock64();
            int w = fr_cu_wait_peer(A, FR_PH_COMBINE, set, s, epoch, FR_CU_WHAT_COMBINE);
            mine = w != 0;
            if (w == 2)
                s_own = 1;
            if (w == 1 && cost && blockIdx.x == 0)
                atomicAdd((unsigned long long *)(cost + s), (unsigned long long)(clock64() - t0));
        }
        mine = __all_sync(0xffffffffu, mine);
        if (threadIdx.x == 0)
            ok = mine;
    }
    __syncthreads();
    if (!ok)
        return;
    int T = A.ntok[set];
    const int32_t *cpos = A.comb_pos + (size_t)set * L.T * K;
    /* ranks masked by now (a wait that ran out in this round, here or in
     * the dispatch) that this round sent rows to: those rows never come
     * back, their slots count 0 (ranks masked before this round got no
     * rows: their slots were cut at dispatch). Thread 0 lists them once
     * per block (s_ncut; more than FR_CR_CUTS: every slot checks every
     * rank); this block's own masked answers count even before the
     * count of masked ranks, another block's add, is seen. */
    __shared__ int s_ncut, s_cut[FR_CR_CUTS];
    const int32_t *soff = A.comb_off + set * N, *spn = A.npairs + set * N;
    if (threadIdx.x == 0) {
        s_ncut = 0;
        if (A.mask_on_timeout && (s_own || *(volatile int32_t *)(A.mask + N) != 0))
            for (int d = 0; d < N; d++)
                if (((volatile int32_t *)A.mask)[d] && spn[d] > 0) {
                    if (s_ncut < FR_CR_CUTS)
                        s_cut[s_ncut] = d;
                    s_ncut++;
                }
    }
    __syncthreads();
    int ncut = s_ncut, nscan = ncut <= FR_CR_CUTS ? ncut : N;
    /* pairs this rank sent itself: rows [cs, cs + ns) of its combine region
     * were never copied; they are expert_y rows pair_row[ps + pos - cs] */
    int cs = A.comb_off[set * N + A.rank], ns = A.npairs[set * N + A.rank];
    size_t ps = (size_t)A.rank * L.T * L.kmax;
    const int32_t *prow = A.pair_row + (size_t)set * L.send_crows;
    int hc = H / 8; /* 8-channel chunks of a token */
    /* runs of B tokens: the tokens spread over the blocks, B x K pairs fit */
    int B = max(1, min((T + (int)gridDim.x - 1) / (int)gridDim.x, FR_CR_PAIRS / K));
    for (int tb = blockIdx.x * B; tb < T; tb += gridDim.x * B) {
        int nb = min(B, T - tb);
        for (int i = threadIdx.x; i < nb * K; i += blockDim.x) {
            int pos = cpos[(size_t)tb * K + i];
            /* rows an IPC peer sent (peers on both paths): in iseg */
            const uint8_t *rb = pos >= 0 && (pos & FR_CPOS_IPC) ? A.iseg : A.seg;
            pos = pos >= 0 ? pos & ~FR_CPOS_IPC : pos;
            for (int j = 0; j < nscan && pos >= 0; j++) {
                int d = ncut <= FR_CR_CUTS ? s_cut[j] : j;
                if (ncut > FR_CR_CUTS && !(((volatile int32_t *)A.mask)[d] && spn[d] > 0))
                    continue;
                if (pos >= soff[d] && pos < soff[d] + spn[d])
                    pos = -1;
            }
            int pr = pos >= cs && pos < cs + ns ? prow[ps + pos - cs] : 0;
            srow[i] = pos < 0 || pr < 0 ? NULL
                      : pos >= cs && pos < cs + ns
                          ? self_y + (size_t)pr * L.crow
                          : rb + fr_off_crecv(&L, set, (uint64_t)pos);
            sw[i] = w[(size_t)tb * K + i];
        }
        __syncthreads();
        for (int j = threadIdx.x; j < nb * hc; j += blockDim.x) {
            int tl = j / hc, h0 = (j - tl * hc) * 8;
            const uint8_t *const *rr = srow + tl * K;
            const float *ww = sw + tl * K;
            /* up to 8 loads in flight, then their sum in k order */
            float acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = 0.f;
            for (int k0 = 0; k0 < K; k0 += 8) {
                int4 v[8];
#pragma unroll
                for (int k = 0; k < 8; k++)
                    if (k0 + k < K && rr[k0 + k])
                        v[k] = *(const int4 *)(rr[k0 + k] + (size_t)h0 * 2);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    if (k0 + k >= K || !rr[k0 + k])
                        continue;
                    const uint16_t *yv = (const uint16_t *)&v[k];
                    for (int i = 0; i < 8; i++)
                        acc[i] += ww[k0 + k] * fr_bf16_to_f32(yv[i]);
                }
            }
            int4 o;
            uint16_t *ov = (uint16_t *)&o;
            for (int i = 0; i < 8; i++)
                ov[i] = fr_f32_to_bf16(acc[i]);
            *(int4 *)(out + (size_t)(tb + tl) * H + h0) = o;
        }
        __syncthreads();
    }
}

/* The combine kernel: one for the operation, its parts chosen by `phases`
 * (FR_PART_SEND, FR_PART_RECV or both: a split call launches it twice).
 * Both parts in one launch need the grid resident at once (blocks wait
 * for the other blocks' sends). self_y: this rank's own rows (the send's
 * y; the receive alone gets the y its send part was given). */
namespace ferry {
__global__ void __launch_bounds__(FR_CS_THREADS, 2)
combine(fr_cu_args_t A, int set, const uint8_t *y, const float *w, uint16_t *out,
        const uint8_t *self_y, long long *cost, int phases)
{
    if (phases & FR_PART_SEND)
        fr_cs_run(A, set, y);
    if (!(phases & FR_PART_RECV))
        return;
    if (phases & FR_PART_SEND)
        __syncthreads();
    fr_cr_run(A, set, w, out, self_y, cost);
}
} /* namespace ferry */

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

typedef struct fr_ipc_msg {
    cudaIpcMemHandle_t h;
    unsigned char uuid[16]; /* the GPU's: ranks with the same one share it */
    int device;
    int status;        /* this rank's segment set-up */
} fr_ipc_msg_t;

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

/* This rank's receive segment (device memory, or pinned host memory mapped
 * into the GPU when peers are on the fabric) and what peers need to map it. */
static int fr_cuda_segment(ferry_ep_t ep, struct fr_cuda_ep *c,
                           fr_ipc_msg_t *mine, fr_err_t *err)
{
    int rc = FERRY_OK;
    const fr_layout_t *L = &ep->L;
    FR_CU(cudaGetDevice(&c->device), err, fail);
    mine->device = c->device;
    {
        cudaDeviceProp prop;
        FR_CU(cudaGetDeviceProperties(&prop, c->device), err, fail);
        memcpy(mine->uuid, prop.uuid.bytes, sizeof(mine->uuid));
    }
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
        if (c->a.mixed) {
            uint8_t *is = ep->seg;
            if (ep->fab_device < 0) { /* seg is host memory: a GPU one beside it */
                FR_CU(cudaMalloc(&c->iseg_own, L->seg_bytes), err, fail);
                FR_CU(cudaMemset(c->iseg_own, 0, L->seg_bytes), err, fail);
                is = (uint8_t *)c->iseg_own;
            }
            FR_CU(cudaIpcGetMemHandle(&mine->h, is), err, fail);
            c->a.iseg = is;
            FR_LOG_INFO(FR_SUB_INIT, "peers on both paths: %d over IPC into %s, %d over the "
                        "fabric", ep->nshm, c->iseg_own ? "a GPU segment of their own"
                                                         : "the fabric's GPU segment",
                        ep->nfabric);
        }
        /* the proxy's tables: pinned host memory mapped into the GPU
         * (runtime/cuda_mem.h) */
        void *h;
        size_t nsl = 2 * FR_NSETS * (size_t)ep->nfabric;
        FR_CUH(fr_cuda_host_alloc(nsl * sizeof(fr_slice_t), &h, &c->dev_slices, err), fail);
        ep->slices = (fr_slice_t *)h;
        FR_CUH(fr_cuda_host_alloc(nsl * sizeof(uint64_t), &h, &c->dev_ready, err), fail);
        ep->ready = (uint64_t *)h;
    } else {
        FR_CU(cudaMalloc((void **)&ep->seg, L->seg_bytes), err, fail);
        FR_CU(cudaMemset(ep->seg, 0, L->seg_bytes), err, fail);
        FR_CU(cudaIpcGetMemHandle(&mine->h, ep->seg), err, fail);
    }
fail:
    return rc;
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
    decltype(&ferry::combine) ks[] = {ferry::combine};
    c->cgrid = fr_cu_grid(c, ks, FR_CS_THREADS, 0, "combine");
    const void *fs[] = {(const void *)ferry::combine};
    return fr_cu_load(fs, sizeof(fs) / sizeof(fs[0]), "combine", err);
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

/* Set-up step 2: every rank's segment handle (a rank that failed its own
 * joins with its status, so all fail at once), the node's peers opened,
 * the ranks sharing this GPU counted. */
static int fr_cuda_exchange(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    int N = ep->N, rc;
    fr_ipc_msg_t mine;
    memset(&mine, 0, sizeof(mine));
    mine.status = fr_cuda_segment(ep, c, &mine, err);
    fr_ipc_msg_t *all = (fr_ipc_msg_t *)calloc((size_t)N, sizeof(*all));
    c->peer_host = (uint8_t **)calloc((size_t)N, sizeof(uint8_t *));
    if (!all || !c->peer_host) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "IPC table");
        goto fail;
    }
    rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK)
        rc = mine.status;
    for (int i = 0; i < N && rc == FERRY_OK; i++)
        if (all[i].status != FERRY_OK)
            rc = FR_ERR(err, all[i].status, "rank %d failed to set up its GPU segment (%s)", i,
                        ferry_strerror(all[i].status));
    if (rc != FERRY_OK)
        goto fail;
    c->share = 0;
    for (int i = 0; i < N; i++)
        c->share += memcmp(all[i].uuid, mine.uuid, sizeof(mine.uuid)) == 0;
    c->share = c->share < 1 ? 1 : c->share;
    for (int i = 0; i < N; i++) {
        if (ep->path[i] == FR_PATH_SELF) {
            c->peer_host[i] = c->host_seg ? NULL : ep->seg;
        } else if (ep->path[i] == FR_PATH_SHM) {
            void *p = NULL;
            FR_CU(cudaIpcOpenMemHandle(&p, all[i].h, cudaIpcMemLazyEnablePeerAccess), err, fail);
            c->peer_host[i] = (uint8_t *)p;
        }
    }
fail:
    free(all);
    return rc;
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
        peer[i] = ep->path[i] == FR_PATH_SELF ? A->seg : c->peer_host[i];
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
                   cfg->hidden, cfg->max_tokens,
                   cfg->dispatch_dtype == FERRY_DTYPE_FP8_E4M3);
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
    if (c->peer_host)
        for (int i = 0; i < ep->N; i++)
            if (ep->path && ep->path[i] == FR_PATH_SHM && c->peer_host[i])
                cudaIpcCloseMemHandle(c->peer_host[i]);
    free(c->peer_host);
    if (ep->fab_device >= 0) {
        cudaFree(ep->seg);
        cudaFree(ep->send);
        fr_cuda_host_free(ep->flags);
    } else if (c->host_seg) {
        fr_cuda_host_free(ep->seg);
        fr_cuda_host_free(ep->send);
    } else if (ep->seg) {
        cudaFree(ep->seg);
    }
    if (c->host_seg) {
        fr_cuda_host_free(ep->slices);
        fr_cuda_host_free(ep->ready);
    }
    if (c->iseg_own)
        cudaFree(c->iseg_own);
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
        return fr_ep_fail(ep, st,
                          "topk_idx[%d][%d] (checked on the GPU of rank %d): must "
                          "be -1 or 0..%d and not repeat an expert of the token",
                          detail / ep->L.K, detail % ep->L.K, rank, ep->L.E - 1);
    case FR_CU_WHAT_MASK:
        fr_ep_fail(ep, st, "dispatch on the GPU of rank %d: %d rank(s) masked, but this launch "
                   "is of the kernel without a mask (a CUDA graph captured before "
                   "ferry_ep_mask_rank): the round did not run; capture the graph again "
                   "after masking, in a new context", rank, detail);
        fr_ep_set_failed(ep, st); /* the error word stays up: every later kernel returns */
        return st;
    case FR_CU_WHAT_NTOK:
        return fr_ep_fail(ep, st,
                          "num_tokens_dev = %d (read on the GPU of rank %d): must "
                          "be 0..max_tokens (%d)", detail, rank, ep->L.T);
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

/* Entry `rank` of the device mask set to v and the count of masked ranks
 * made again: one thread, on the stream (capturable). */
static __global__ void fr_cu_mask_set(int32_t *mask, int N, int rank, int v)
{
    mask[rank] = v;
    int n = 0;
    for (int s = 0; s < N; s++)
        n += mask[s] != 0;
    mask[N] = n;
}

extern "C" int fr_cuda_mask_write(ferry_ep_t ep, int rank, int masked, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    int rc = fr_cuda_check(ep); /* an earlier kernel's error, before anything is queued */
    if (rc)
        return rc;
    fr_cu_mask_set<<<1, 1, 0, (cudaStream_t)stream>>>(c->a.mask, ep->N, rank, masked);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) /* not queued: the API takes its change back */
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "launching ferry_ep_mask_rank's kernel: %s",
                          cudaGetErrorString(e));
    c->masked += masked ? 1 : -1; /* the API calls this only on a change */
    return FERRY_OK;
}

extern "C" int fr_cuda_mask_pull(ferry_ep_t ep, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)stream;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(st, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return FERRY_OK; /* no copy inside a capture: the host's view stands */
    }
    int32_t *m = (int32_t *)calloc((size_t)ep->N + 1, sizeof(int32_t));
    if (!m)
        return fr_ep_fail(ep, FERRY_ERR_NOMEM, "ferry_ep_mask_rank: the mask's copy");
    cudaError_t e = cudaMemcpyAsync(m, c->a.mask, sizeof(int32_t) * ((size_t)ep->N + 1),
                                    cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) {
        free(m);
        return fr_ep_fail(ep, FERRY_ERR_SYSTEM, "ferry_ep_mask_rank: reading the GPU's mask: %s",
                          cudaGetErrorString(e));
    }
    for (int s = 0; s < ep->N; s++)
        if (m[s] && !ep->mask[s]) { /* masked by a wait that ran out */
            ep->mask[s] = 1;
            ep->mask_since[s] = ep->next_epoch;
        }
    c->masked = m[ep->N];
    free(m);
    return FERRY_OK;
}

extern "C" int fr_cuda_mask_read(ferry_ep_t ep, int32_t *status, void *stream)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaError_t e = cudaMemcpyAsync(status, c->a.mask, sizeof(int32_t) * (size_t)ep->N,
                                    cudaMemcpyDeviceToDevice, (cudaStream_t)stream);
    if (e != cudaSuccess)
        return fr_ep_fail(ep, FERRY_ERR_INVALID, "ferry_ep_mask_query: status: not device "
                          "memory of this GPU? (cudaMemcpyAsync: %s)", cudaGetErrorString(e));
    return FERRY_OK;
}

extern "C" int fr_cuda_combine_send(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    c->y[set] = in->expert_y;
    ferry::combine<<<c->nblocks, FR_CS_THREADS, 0, st>>>(c->a, set, (const uint8_t *)in->expert_y,
                                                        NULL, NULL, NULL, NULL, FR_PART_SEND);
    return fr_cuda_launch_check(ep, "combine_send");
}

extern "C" int fr_cuda_combine_recv(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)out->stream;
    int set = (int)(r->epoch % FR_NSETS);
    int blocks = c->nblocks < ep->L.T ? c->nblocks : ep->L.T;
    blocks = blocks < 1 ? 1 : blocks;
    ferry::combine<<<blocks, FR_CS_THREADS, 0, st>>>(c->a, set, NULL, out->topk_weights,
                                                    (uint16_t *)out->out,
                                                    (const uint8_t *)c->y[set],
                                                    (long long *)out->wait_cost, FR_PART_RECV);
    int rc = fr_cuda_launch_check(ep, "combine_recv");
    if (rc == FERRY_OK)
        fr_ahead_mark(&c->ahead, r->epoch, st);
    return rc;
}

extern "C" int fr_cuda_combine(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                               const ferry_combine_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    c->y[set] = in->expert_y;
    if (c->cgrid < 0) {
        int rc = fr_cuda_combine_send(ep, r, in);
        return rc ? rc : fr_cuda_combine_recv(ep, r, out);
    }
    int blocks = c->nblocks < c->cgrid ? c->nblocks : c->cgrid;
    ferry::combine<<<blocks, FR_CS_THREADS, 0, st>>>(c->a, set, (const uint8_t *)in->expert_y,
                                                    out->topk_weights, (uint16_t *)out->out,
                                                    (const uint8_t *)in->expert_y,
                                                    (long long *)out->wait_cost,
                                                    FR_PART_SEND | FR_PART_RECV);
    int rc = fr_cuda_launch_check(ep, "combine");
    if (rc == FERRY_OK)
        fr_ahead_mark(&c->ahead, r->epoch, st);
    return rc;
}
