/*
 * The CUDA low-latency engine's device side, shared by its kernel files
 * (dispatch.cu, combine.cu, setup.cu, mask.cu): the kernels' argument block, the engine's
 * state, flags with acquire/release at system scope, bounded waits,
 * error words, fp8 conversion, warp copies, publishing to peers and to
 * the proxy.
 */
#ifndef FR_CUDA_LL_DEV_CUH
#define FR_CUDA_LL_DEV_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "core/config.h"
#include "core/log.h"
#include "core/quant.h"
#include "engines/cuda_ll/cuda_ll.h"
#include "ep/ahead.h"
#include "runtime/cuda_mem.h"
#include "runtime/peer_mem.h"
#include "runtime/cuda_sync.cuh"

/* FR_CU_TRACE (a tracing build): a timeline of the rounds of epochs 41
 * and 42 across ranks, from the GPU's global timer (one clock for every
 * rank of a GPU): "TL <ns> r<rank> ph<phase> e<epoch> <event> <peer>";
 * tools/trace_timeline.py orders and prints it. */
#ifdef FR_CU_TRACE
#define FR_TL(A, ph, ep, ev, peer)                                                         \
    do {                                                                                   \
        if ((ep) == 41 || (ep) == 42)                                                      \
            printf("TL %llu r%d ph%d e%llu %s %d\n", fr_sys_timer(), (A).rank, (int)(ph),  \
                   (unsigned long long)(ep), ev, (int)(peer));                             \
    } while (0)
#else
#define FR_TL(A, ph, ep, ev, peer) do { } while (0)
#endif


/* Most experts of the CUDA engine: the send part keeps two counts per
 * expert in shared memory. */
#define FR_CU_EMAX 4096

/* error word (host-mapped): [0] status, [1] rank, [2] what, [3] detail */
enum { FR_CU_WHAT_DISPATCH = 1, FR_CU_WHAT_COMBINE = 2, FR_CU_WHAT_INPUT = 3,
       FR_CU_WHAT_RECORD = 4, FR_CU_WHAT_NTOK = 5, FR_CU_WHAT_MASK = 6,
       FR_CU_WHAT_SIGNAL = 7 /* rank: the local expert, detail: the signal's index */ };

typedef struct fr_cu_args {
    fr_layout_t L;
    int rank, N;
    int kd;                  /* K: record slots of a token in dst_rec */
    int round_scale;         /* fp8 scales rounded up to powers of two */
    uint8_t *seg;            /* own segment (device pointer) */
    uint8_t **peer;          /* [N] where to store for peer d (self/IPC) */
    uint8_t *send;           /* fabric send region (device pointer) or NULL */
    const int *path;         /* [N] */
    const int *gidx;         /* [N] index among fabric peers */
    int nfabric;
    fr_slice_t *slices;      /* host-mapped [2][2][nfabric] */
    unsigned long long *ready; /* host-mapped [2][2][nfabric]: per-peer
                                  doorbells, the epoch whose slice is packed */
    uint8_t *flags;          /* own segment's header and flags: seg, or
                                host-mapped when seg is GPU memory on the
                                fabric path (the proxy stores the flags) */
    uint8_t *iseg;           /* where IPC senders write this rank's slices,
                                combine rows and flags: seg unless peers are
                                on both paths (mixed), then the GPU segment
                                exported to them (flags at its head, as in
                                seg on a single node), which is seg itself
                                when seg is GPU memory, else one of its own */
    int mixed;               /* peers on both the IPC and fabric paths */
    unsigned long long *epoch; /* [2] per set */
    int32_t *ntok;           /* [2] */
    int32_t *rec_idx;        /* [2][T][N] */
    int32_t *pair_base;      /* [2][T][N] */
    int32_t *comb_pos;       /* [2][T][K] */
    int32_t *cnt, *npairs, *comb_off; /* [2][N] */
    uint8_t **dst_rec;       /* [2][T][K]: slot k: where the token's data goes for k: the record on k's rank when k is its first expert there, the own expert row when k is an own expert written in place, else NULL */
    uint8_t **dst_scl;       /* [2][T][K]: where slot k's scales go (fp8), else NULL:
                                a record's (float [S]), or an own row's scale 0 in
                                expert_x_scales, tagged (fr_cu_scl_own) when its layout
                                is not rows */
    int32_t *self_run;       /* [2][E_local]: own pairs per own expert (rows written in place) */
    int32_t *pair_row;       /* [2][N][T*kmax]: sender s's pairs at s*T*kmax: their expert rows */
    int32_t *pair_n;         /* [2][N]: pairs received from each sender */
    int32_t *scomb_off;      /* [2][N] */
    unsigned int *done;      /* [2 phase][2 set] finished-block counters */
    unsigned int *ddone;     /* [2 set][N] blocks done with destination d */
    unsigned int *dpub;      /* [2 set] destinations published */
    int *dflag;              /* device copy of err[0]: what kernels poll */
    volatile int *err;       /* host-mapped [4]: what the host reads */
    unsigned long long timeout_ns;
    int32_t *mask;           /* [N + 1]: [s] 1 where rank s is masked
                                (ferry_ep_mask_rank), [N] how many are */
    int mask_on_timeout;     /* a wait that runs out masks the peer */
    unsigned long long *claim;  /* [2 phase][2 set][N]: the last epoch whose wait for
                                   a host-memory flag a lane took on (fr_cu_flag_of) */
    unsigned long long *mirror; /* [2 phase][2 set][N]: that lane's copy of the flag */
    unsigned long long *decide; /* [2 phase][2 set][N]: with mask_on_timeout,
                                the grid's one answer per peer and round:
                                epoch * 4 + 1 arrived, + 2 masked */
} fr_cu_args_t;

#define FR_CU_AHEAD 8
struct fr_cuda_ep {
    fr_cu_args_t a;
    int device, nblocks;
    int csms[FR_NSETS];      /* a combine_send's num_sms, for its recv (0: none) */
    int nsm;                 /* the GPU's SMs */
    int dgrid, cgrid;        /* most blocks of the one-launch kernels the GPU
                                holds at once for this rank, found at set-up
                                (its share when ranks share the GPU; -1: they
                                do not fit; send and receive go as two
                                launches) */
    int share;               /* ranks on this rank's GPU (same UUID), >= 1 */
    int host_seg;            /* every peer on the fabric: buffers for the proxy
                                (seg and send in GPU memory when
                                ep->fab_device >= 0, else pinned host memory
                                mapped into the GPU) */
    void *dev_seg, *dev_send, *dev_slices, *dev_flags, *dev_ready; /* GPU views */
    fr_pmem_t iseg;          /* the segment the node's peers map
                                (runtime/peer_mem.h): seg itself, or with
                                mixed paths and seg in host memory a GPU
                                segment of its own; borrowed (seg, legacy
                                IPC) where seg is registered with FI_HMEM */
    void *dmem;              /* one device allocation for the tables */
    fr_pmem_t *peer_pm;      /* [N] the node's peers' segments as opened here */
    int *err_host;
    void *err_dev;
    const void *y[FR_NSETS];     /* own expert_y, read in place by recv */
    int lf[FR_NSETS];            /* the set's combine rows are LogFMT (recv decodes) */
    int masked;              /* ranks masked, as the host set them: the
                                dispatch launches the kernel that cuts */
    fr_ahead_t ahead;        /* rounds queued ahead, bounded (ep/ahead.h): GPU
                                memory through a copying provider */
};


/* The last launch's error, then the kernels' error word (setup.cu). */
int fr_cuda_launch_check(ferry_ep_t ep, const char *what);
/* The one-launch kernels' grid: their blocks wait for each other, so
 * never more than the GPU holds at once, for every kernel of `ks` with
 * `threads` threads and `smem` bytes of dynamic shared memory. 0 or less
 * (or a failed query): -1, two launches from now on. */
template <typename K, int NK>
static int fr_cu_grid(const struct fr_cuda_ep *c, K (&ks)[NK], int threads, size_t smem,
                      const char *what)
{
    int per = -1;
    for (int i = 0; i < NK; i++) {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, ks[i], threads, smem) !=
            cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
        }
        per = per < 0 || n < per ? n : per;
    }
    /* ranks sharing the GPU split it: a rank's resident blocks wait for
     * its peers' blocks, which must find room */
    int share = c->share > 1 ? c->share : 1;
    if (per * c->nsm >= share)
        return per * c->nsm / share;
    FR_LOG_INFO(FR_SUB_EP, "%s: the one-launch kernel does not fit; sending and receiving in "
                           "two launches", what);
    return -1;
}

/* Kernels loaded now (cudaFuncGetAttributes loads a kernel under lazy
 * loading): fs[0..n) of the engine's `what` kernels, or an error. */
static int fr_cu_load(const void *const *fs, size_t n, const char *what, fr_err_t *err)
{
    for (size_t i = 0; i < n; i++) {
        struct cudaFuncAttributes fa;
        cudaError_t e = cudaFuncGetAttributes(&fa, fs[i]);
        if (e != cudaSuccess)
            return FR_ERR(err, FERRY_ERR_SYSTEM, "loading the %s kernels: %s", what,
                          cudaGetErrorString(e));
    }
    return FERRY_OK;
}

/* The parts of an operation's kernel (ferry::dispatch, ferry::combine) one
 * launch runs: both for the one-shot calls, one each for the split calls. */
#define FR_PART_SEND 1
#define FR_PART_RECV 2

/* The dispatch kernels' shared memory above 48 KB, or an error (dispatch.cu). */
extern "C" int fr_cuda_dispatch_init(ferry_ep_t ep, fr_err_t *err);
/* The dispatch kernels loaded and c->dgrid set, at set-up (dispatch.cu). */
extern "C" int fr_cuda_dispatch_load(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err);
extern "C" int fr_cuda_combine_load(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err);

/* ---------------------------------------------------------------------- */
/* device helpers (flags, timer and the error word: runtime/cuda_sync.cuh) */

/* The context's error word: the first error wins. */
static __device__ void fr_cu_fail(const fr_cu_args_t &A, int status, int rank, int what,
                           int detail)
{
    fr_cu_err_set(A, status, rank, what, detail);
}

static __device__ __forceinline__ bool fr_cu_failed(const fr_cu_args_t &A)
{
    return fr_cu_err_seen(A);
}

/* Wait until flag == epoch; false (error word set) on timeout. On
 * arrival, the epoch is stored to *mirror when it is not NULL
 * (fr_cu_flag_of). */
static __device__ bool fr_cu_wait_flag(const fr_cu_args_t &A, const unsigned long long *flag,
                                unsigned long long epoch, int sender, int what,
                                unsigned long long *mirror)
{
    unsigned long long t0 = fr_sys_timer();
    unsigned int n = 0;
    for (;;) {
        /* relaxed polls; one acquire once the value is there */
        unsigned long long v = fr_sys_ld_relaxed(flag);
        if (v == epoch && fr_sys_ld_acquire(flag) == epoch) {
            if (mirror)
                fr_sys_st_release(mirror, epoch);
            return true;
        }
        if (v > epoch) {
            fr_cu_fail(A, FERRY_ERR_PROTOCOL, sender, what, (int)v);
            return false;
        }
        if ((++n & 255) == 0) {
            if (fr_cu_failed(A))
                return false;
            if (fr_sys_timer() - t0 > A.timeout_ns) {
                fr_cu_fail(A, FERRY_ERR_TIMEOUT, sender, what, 0);
                return false;
            }
        }
    }
}

/* Four bf16 values (two packed words, low half first) times inv, as four
 * e4m3 codes in one word (lowest byte first). */
static __device__ __forceinline__ uint32_t fr_cu_e4m3x4(uint32_t lo, uint32_t hi, float inv)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    /* cvt.rn.satfinite.e4m3x2: round to nearest even, +-448 saturation,
     * NaN -> 0x7f: what fr_f32_to_e4m3 computes (core/quant.h) */
    float a = fr_bf16_to_f32((uint16_t)(lo & 0xffff)) * inv;
    float b = fr_bf16_to_f32((uint16_t)(lo >> 16)) * inv;
    float c = fr_bf16_to_f32((uint16_t)(hi & 0xffff)) * inv;
    float d = fr_bf16_to_f32((uint16_t)(hi >> 16)) * inv;
    unsigned short p0, p1;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p0) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p1) : "f"(d), "f"(c));
    return (uint32_t)p0 | ((uint32_t)p1 << 16);
#else
    return (uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(lo & 0xffff)) * inv) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(lo >> 16)) * inv) << 8) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(hi & 0xffff)) * inv) << 16) |
           ((uint32_t)fr_f32_to_e4m3(fr_bf16_to_f32((uint16_t)(hi >> 16)) * inv) << 24);
#endif
}

/* Flags on the IPC path (self and CUDA-IPC peers) count arrivals: every
 * block of a sender's grid adds its share to the receiver's flag for that
 * (phase, set, sender) with a release at system scope once its own stores
 * are done (block 0 adds FR_CU_ROUND - (G - 1), the others 1), so a round
 * adds FR_CU_ROUND in all whatever the grid size, and the flag reaches
 * FR_CU_ROUND times the set's round count exactly when the last block is
 * in. One system fence per block, all in parallel, instead of a count of
 * finished blocks followed by fences and a store in the last one. On the
 * fabric path the proxy writes the epoch itself. */
#define FR_CU_ROUND_SHIFT 20
#define FR_CU_ROUND (1ull << FR_CU_ROUND_SHIFT)

/* Where sender s's slices and combine rows land here (the segment it
 * writes), and its flags: IPC senders' in iseg, self's and the
 * fabric's in seg/flags (the same places unless A.mixed). */
static __device__ __forceinline__ const uint8_t *fr_cu_rseg(const fr_cu_args_t &A, int s)
{
    return A.mixed && A.path[s] == FR_PATH_SHM ? A.iseg : A.seg;
}

static __device__ __forceinline__ const uint8_t *fr_cu_rflags(const fr_cu_args_t &A, int s)
{
    return A.mixed && A.path[s] == FR_PATH_SHM ? A.iseg : A.flags;
}

/* A combine position (comb_pos) whose rows an IPC peer writes, with peers
 * on both paths: they are in iseg, not seg (the flag bit is cleared before
 * the position is used; positions stay below it, fr_cuda_setup checks). */
#define FR_CPOS_IPC (1 << 30)

/* What a receiver waits for in (set)'s round of this epoch (set 1 counts
 * epochs 1, 3, 5..., set 0 2, 4, 6...). */
static __device__ __forceinline__ unsigned long long fr_cu_target(const fr_cu_args_t &A,
                                                                  unsigned long long epoch)
{
    return A.nfabric > 0 ? epoch : ((epoch + 1) / 2) << FR_CU_ROUND_SHIFT;
}

/* Where a waiter polls peer s's flag of (phase, set) in the round of
 * `epoch`. Flags in GPU memory (the IPC path's) are polled where they are.
 * A flag in host memory (the fabric path's, which the proxy stores, and
 * then self's too) is polled over PCIe by one lane of the grid per round:
 * the first to ask (claim keeps the highest epoch taken on), which copies
 * it into device memory on arrival (*mirror); every other waiter polls
 * that copy. Sys-scope polls of host memory from every block of every
 * rank sharing a PCIe link starve it: 8 ranks on one H200 with 16 blocks
 * each took 2.0 / 1.4 ms per T=0 dispatch / combine, against 0.24 / 0.14
 * with 2 blocks. The copy is a release after the lane's acquire, so what
 * the proxy published before the flag is visible to whoever acquires the
 * copy. */
static __device__ __forceinline__ const unsigned long long *
fr_cu_flag_of(const fr_cu_args_t &A, int phase, int set, int s, unsigned long long epoch,
              unsigned long long **mirror)
{
    const unsigned long long *flag =
        (const unsigned long long *)(fr_cu_rflags(A, s) + fr_off_flag(&A.L, phase, set, s));
    *mirror = NULL;
    if (A.nfabric == 0 || (A.mixed && A.path[s] == FR_PATH_SHM)) /* GPU memory */
        return flag;
    size_t i = ((size_t)phase * FR_NSETS + set) * A.N + s;
    if (atomicMax(A.claim + i, epoch) >= epoch) /* another lane polls the flag */
        return A.mirror + i;
    *mirror = A.mirror + i;
    return flag;
}

/* Peer s's flag of (phase, set) for the round of `epoch`: 1 arrived, 0
 * failed (error word set), 2 masked. Without mask_on_timeout this is
 * fr_cu_wait_flag. With it, every waiter of every block reaches the same
 * answer through the pair's decision word, set once by a CAS: a waiter
 * that sees the flag claims "arrived", one whose wait runs out claims
 * "masked"; a claim that loses takes the winner's answer (a waiter that
 * lost to "arrived" keeps polling: the flag is up). A masked answer masks
 * the rank (the device mask and its count) before it is returned. */
static __device__ int fr_cu_wait_peer(const fr_cu_args_t &A, int phase, int set, int s,
                                      unsigned long long epoch, int what)
{
    unsigned long long target = fr_cu_target(A, epoch), *mirror;
    const unsigned long long *flag = fr_cu_flag_of(A, phase, set, s, epoch, &mirror);
    if (!A.mask_on_timeout || s == A.rank) { /* never masks itself */
        bool ok = fr_cu_wait_flag(A, flag, target, s, what, mirror);
        if (blockIdx.x == 0)
            FR_TL(A, phase, epoch, mirror ? "seen-host" : "seen", s);
        return ok ? 1 : 0;
    }
    unsigned long long *dw = A.decide + ((size_t)phase * FR_NSETS + set) * A.N + s;
    unsigned long long t0 = fr_sys_timer();
    unsigned int n = 0;
    for (;;) {
        unsigned long long v = fr_sys_ld_relaxed(flag);
        if (v > target) {
            fr_cu_fail(A, FERRY_ERR_PROTOCOL, s, what, (int)v);
            return 0;
        }
        bool arrived = v == target && fr_sys_ld_acquire(flag) == target, out = false;
        if (arrived && mirror) { /* once: the others may be waiting on it */
            fr_sys_st_release(mirror, target);
            mirror = NULL;
        }
        if (!arrived && (++n & 255) != 0)
            continue;
        if (!arrived) {
            if (fr_cu_failed(A))
                return 0;
            out = fr_sys_timer() - t0 > A.timeout_ns;
        }
        unsigned long long d = fr_sys_ld_relaxed(dw);
        if (d >> 2 != epoch && (arrived || out)) {
            unsigned long long want = epoch * 4 + (arrived ? 1 : 2);
            unsigned long long old = atomicCAS(dw, d, want);
            d = old == d ? want : old;
        }
        if (d >> 2 != epoch) /* undecided: wait on */
            continue;
        if ((d & 3) == 1) {
            if (arrived)
                return 1;
            continue; /* another waiter saw the flag: it shows here soon */
        }
        if (atomicExch(&A.mask[s], 1) == 0)
            atomicAdd(&A.mask[A.N], 1);
        return 2;
    }
}

/* This block's share of (phase, set) to every destination (IPC path).
 * Every thread of the block calls it after its stores; after a barrier,
 * warp 0 fences at system scope (one fence instruction for the warp,
 * cumulative over the block's stores, ordered before it by the barrier,
 * as a grid barrier's fence is) and then each lane adds to its
 * destinations' flags (lane l: l, l + 32, ...): the fence and the adds in
 * one thread make each release. One system fence per block: fences are
 * costly and, with many ranks on one GPU, contend with each other. The
 * adds used to be thread 0's alone, one after another, each behind the
 * load of its destination's address: a chain as long as the ranks. Nothing
 * is added once the context has failed (lane 0 decides, so the whole
 * block agrees). */
static __device__ void fr_cu_arrive(const fr_cu_args_t &A, int phase, int set,
                                    const int32_t *mk)
{
    __syncthreads();
    if (threadIdx.x >= 32)
        return;
    int failed = threadIdx.x == 0 ? fr_cu_failed(A) : 0;
    if (__shfl_sync(0xffffffffu, failed, 0))
        return;
    unsigned long long add = blockIdx.x == 0 ? FR_CU_ROUND - (gridDim.x - 1) : 1ull;
    __threadfence_system();
    for (int d = threadIdx.x; d < A.N; d += 32) {
        if (mk && mk[d]) /* a masked rank is told nothing */
            continue;
        unsigned long long *f =
            (unsigned long long *)(A.peer[d] + fr_off_flag(&A.L, phase, set, A.rank));
        asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(f), "l"(add) : "memory");
    }
}

/* Publish (phase, set) to peer d: flag for self/IPC; otherwise d's slice
 * and then d's doorbell for the proxy, which posts d's write at once
 * (while later destinations are still being packed). */
static __device__ void fr_cu_publish(const fr_cu_args_t &A, int phase, int set, int d,
                              unsigned long long epoch, uint64_t src_off,
                              uint64_t dst_off, uint64_t len)
{
    if (A.path[d] == FR_PATH_FABRIC) {
        size_t i = ((size_t)phase * FR_NSETS + set) * A.nfabric + A.gidx[d];
        fr_slice_t *s = A.slices + i;
        s->src_off = src_off;
        s->dst_off = dst_off;
        s->len = len;
        s->imm = fr_imm_make(phase, epoch, A.rank);
        __threadfence_system();
        fr_sys_st_release(A.ready + i, epoch);
        FR_TL(A, phase, epoch, "doorbell", d);
    } else {
        uint8_t *seg = d == A.rank ? A.flags : A.peer[d];
        fr_sys_st_release((unsigned long long *)(seg + fr_off_flag(&A.L, phase, set, A.rank)),
                      epoch);
    }
}

/* An own row's scale pointer in dst_scl: tagged in bit 0 when
 * expert_x_scales is not laid out in rows (records' scales always are;
 * both are 4-byte aligned), so a slot's writer needs no second lookup. */
static __device__ __forceinline__ uint8_t *fr_cu_scl_own(const fr_layout_t &L, uint8_t *p)
{
    return L.sfmt == FERRY_SCALES_ROWS ? p : (uint8_t *)((uintptr_t)p | 1u);
}

/* Store scale q of slot pointer p (a dst_scl entry). */
static __device__ __forceinline__ void fr_cu_scl_put(const fr_layout_t &L, uint8_t *p, int q,
                                                     float v)
{
    if ((uintptr_t)p & 1u)
        fr_scl_put(&L, (uint8_t *)((uintptr_t)p & ~(uintptr_t)1), (uint32_t)q, v);
    else
        ((float *)p)[q] = v;
}

#endif
