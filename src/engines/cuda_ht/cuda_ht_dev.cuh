/*
 * The CUDA high-throughput engine's device side, shared by its kernel
 * files (setup.cu, route.cu, stream.cu): the segment geometry, the
 * kernels' argument blocks, the engine's state, the error word and the
 * bounded wait.
 *
 * Segment of each rank (device memory, mapped by the node's peers through
 * CUDA IPC; G = geometry below, C channels, N ranks, RT = ring_tokens):
 *
 *   [notify]   [2 parity][N sources] { u64 route id, i32 tokens (-1: the
 *              source's topk_idx was bad), i32 0, i32 per channel [C],
 *              i32 per local expert [El] } (128 B aligned)
 *   [counters] [4 kinds][C][N] u64, one per 64 B:
 *              DTAIL[c][s]  dispatch records source s wrote into ring (c, s)
 *                           here (stored by s)
 *              DHEAD[c][d]  records of this rank's ring (c) at d that d has
 *                           taken (stored by d)
 *              CTAIL[c][d]  combine records rank d wrote into ring (c, d)
 *                           here (stored by d)
 *              CHEAD[c][s]  records of this rank's combine ring (c) at s
 *                           that s has taken (stored by s)
 *   [dispatch rings] [C][N sources][RT] records (core/ht_rec.h)
 *   [combine rings]  [C][N expert ranks][RT] records { i32 seq, u32 route
 *              id, f32 w[K] (padded to 16 B), bf16 row [H] }
 *
 * Every counter is cumulative over the context's life (never reset): the
 * writer keeps its own copy in device memory (ctr[], not shared), stores
 * it into the peer's word with a release at system scope after a chunk of
 * records, and the reader polls its own word (relaxed loads, then one
 * acquire). Calls follow each other without barriers or clearing.
 */
#ifndef FR_CUDA_HT_DEV_CUH
#define FR_CUDA_HT_DEV_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "core/ht_rec.h"
#include "core/log.h"
#include "core/quant.h"
#include "engines/cuda_ht/cuda_ht.h"
#include "engines/cuda_ht/fab.h"
#include "engines/cuda_ht/geo.h"
#include "ep/ahead.h"
#include "runtime/cuda_mem.h"
#include "runtime/peer_mem.h"
#include "runtime/cuda_sync.cuh"

/* Defaults (setup.cu): channels = num_sms, or FR_CUHT_SMS_DEFAULT (one
 * block, so one SM, per channel), either lowered to the GPU's SMs over the
 * ranks sharing it; ring_tokens, or FR_CUHT_RING_BUDGET / N
 * records per (channel, peer) ring within [FR_CUHT_RING_MIN,
 * FR_CUHT_RING_MAX] (a segment then holds 24 x 512 records of each kind
 * from N = 4 to 64, ~354 MB at H = 7168; ~177 MB at N = 2; above 64 ranks
 * 24 x 8 x N). */
#define FR_CUHT_SMS_DEFAULT 24
#define FR_CUHT_RING_BUDGET 512
#define FR_CUHT_RING_MIN 8
#define FR_CUHT_RING_MAX 128
#define FR_CUHT_MAX_CHANNELS 128
#define FR_CUHT_MAX_RANKS 1024   /* per-peer shared arrays of the route and
                                    combine kernels; a warp serves up to
                                    FR_CUHT_RPL x 32 rings */
#define FR_CUHT_RPL 2            /* rings per lane of a warp that serves many */
#define FR_CUHT_STEP 4           /* records per warp between publications */
#define FR_CUHT_CBATCH 64        /* most tokens per combine batch */
#define FR_CUHT_CBATCH_MIN 8     /* fewest, where a channel is split to overlap */

/* error word (host-mapped): [0] status, [1] rank, [2] what, [3] detail */
enum { FR_CUHT_WHAT_ROUTE = 1, FR_CUHT_WHAT_DISPATCH = 2, FR_CUHT_WHAT_COMBINE = 3,
       FR_CUHT_WHAT_COUNTS = 4, FR_CUHT_WHAT_RECORD = 5, FR_CUHT_WHAT_ORDER = 6,
       FR_CUHT_WHAT_DTYPE = 7, FR_CUHT_WHAT_OVERRUN = 8, FR_CUHT_WHAT_BOUND = 9,
       FR_CUHT_WHAT_BADIDX = 10 };
/* the detail of a timeout on a source's rings: the host names the rank
 * that serves them here (its forwarder in this node, with forwarding) */
#define FR_CUHT_VIA 1

/* Per peer: where the kernels write for it and read what it wrote
 * (accessors below). Counter (kind, c) this rank stores for the peer is
 * at w[kind] + c * csw[kind], the one the peer stores for this rank at
 * r[kind] + c * csr[kind]: the peer's segment or this one, the outbox
 * words of a fabric peer, or with forwarding, for a remote source whose
 * forwarder is another rank of this node, that forwarder's lines. */
typedef struct fr_cuht_peer {
    uint8_t *wnot;                /* notify entries this rank writes for the peer */
    uint8_t *wnid, *rnid;         /* their route numbers: stored, read */
    uint8_t *w[4], *r[4];
    unsigned long long csw[4], csr[4];
    uint8_t *ring[2];             /* ring (0, this rank) of each kind */
    unsigned long long stride[2]; /* from ring c to ring c + 1 */
} fr_cuht_peer_t;

/* Forwarding through one rank per node (G.fwd; docs/architecture.md):
 * this rank's side of it. */
typedef struct fr_cuht_fw {
    int L, j, nf;                 /* this node's ranks, this rank's local index,
                                     remote sources it forwards for */
    int node;                     /* this rank's node */
    const int *nl;                /* [N] a rank's node << 16 | its local index there */
    const int *nrank;             /* [L] the node's ranks by local index */
    uint8_t *const *nseg;         /* [L] their segments, mapped here */
    const int *fl;                /* [nf] the sources forwarded here, ascending */
    const int *fslot;             /* [N] a source's place in fl, else -1 */
    const int *key;               /* [N] where records for an expert rank go: the
                                     rank itself in this node, else this
                                     rank's forwarder in the expert's node */
    const int *kord;              /* [N] a key's place in the order of sums:
                                     by node, then rank */
    unsigned long long *fsent;    /* [C][N][NL] records forwarded into ring (c, s)
                                     of the node's rank j (cumulative) */
    unsigned long long *ftake;    /* [C][N][NL] combine records of source s taken
                                     from local index j's ring here (cumulative) */
} fr_cuht_fw_t;

/* What every kernel gets (by value). */
typedef struct fr_cuht_args {
    fr_cuht_geo_t G;
    uint8_t *seg;                 /* own segment */
    const fr_cuht_peer_t *pt;     /* [N] where to write and read per peer
                                     (own at [rank]: the own segment) */
    unsigned long long *ctr;      /* [4 kinds][C][N] own copies of the counters
                                     this rank writes or consumes */
    int *dflag;                   /* device copy of err[0]: what kernels poll */
    volatile int *err;            /* host-mapped [4] */
    const volatile int *abort;    /* host-mapped, set by the fabric thread when
                                     it failed (NULL: no such thread) */
    unsigned long long timeout_ns;
    fr_cuht_fw_t fw;              /* forwarding (when G.fwd) */
} fr_cuht_args_t;

/* A route on the device (route->priv's tables). */
typedef struct fr_cuht_rdev {
    int T;                        /* this rank's tokens */
    unsigned int id;              /* route number (low 32 bits): read from
                                     *idp by each kernel as it starts */
    const unsigned long long *idp; /* the route number, written by notify
                                     (device-side, so graph replays get a
                                     new one each) */
    const int32_t *nrecv;         /* rows received, written by notify */
    int bound;                    /* max_recv of a bounded route, else 0 */
    const int32_t *idx;           /* [T][K] topk_idx as int32 (-1 where bad) */
    const int32_t *dst;           /* [T][K] the distinct ranks the token goes
                                     to, ascending, then -1 */
    const int32_t *dpos;          /* [T][K] its place among the channel's
                                     tokens to dst[t][k] */
    const int32_t *rtok;          /* [N][T] the inverse: channel c's i-th token
                                     to d at [d][chan_lo(c) + i] */
    const int32_t *ccnt;          /* [N][C] own tokens to d per channel */
    const int32_t *rcnt, *rbase;  /* [N][C] rows from s per channel, first row */
    /* forwarding: ccnt, rtok, dst and dpos are by key (fr_cuht_fw_t.key);
     * per source forwarded here, its node-level records per channel,
     * their first index, and the node-relative expert ids of each
     * ([NF x T][K], kept by the dispatch for the combine) */
    const int32_t *fcnt, *fbase;  /* [N][C] */
    int16_t *fids;
} fr_cuht_rdev_t;

/* The route's result the host polls for, its one wait (host-mapped, as
 * DeepEP's receive counter): num_recv, the first source with a bad
 * topk_idx (-1: none), the local experts' counts; `done` is stored last,
 * after a system fence, once all of them are. */
typedef struct fr_cuht_res {
    int num_recv, bad_rank;
    unsigned int id;              /* the route number (low 32 bits) */
    volatile unsigned int done;   /* 0 while notify runs (the host clears it) */
    int ecnt[1];                  /* [El] */
} fr_cuht_res_t;

/* what the fabric thread's immediates carry (fab.h: the channel in 7
 * bits, the source and the run of slots in what N and the ring leave); a
 * warp serves at most FR_CUHT_RPL x 32 rings of a role of 16 warps */
static_assert(FR_CUHT_MAX_CHANNELS <= (1 << FR_CUHT_FAB_CBITS) &&
              (FR_CUHT_MAX_RANKS + 16 * 32 - 1) / (16 * 32) <= FR_CUHT_RPL &&
              FR_CUHT_RING_MAX <= FR_CUHT_FAB_RT_MAX && FR_CUHT_FAB_RT_MAX <= 256,
              "fab.c's immediate fields");

#define FR_CUHT_POOL 8
/* spare table blocks an exact route takes before allocating one */
#define FR_CUHT_SPARES 2
#define FR_CUHT_AHEAD 8 /* combines queued ahead, at most, on the fabric path with copies */

struct fr_cuht_ep {
    fr_cuht_args_t a;
    int device, nsm;
    int tma;                      /* rows through the copy engine (up to 8
                                     ranks, no forwarding, the device takes it) */
    unsigned long long *rseq;     /* device: routes created so far, counted by
                                     the notify kernel (the same on every
                                     rank) */
    unsigned int *rlast;          /* device: fr_cuht_route1's blocks done (0
                                     between routes) */
    struct fr_cuht_route *pool[FR_CUHT_POOL]; /* bounded routes' tables */
    int pool_used[FR_CUHT_POOL], pool_next;
    fr_pmem_t seg_pm;             /* ep->seg (runtime/peer_mem.h) */
    fr_pmem_t *peer_pm;           /* [N] the node's peers' segments as opened here */
    void *dmem;                   /* device tables: peer[N], ctr, dflag */
    void *fw_mem;                 /* forwarding's tables (a.fw) */
    int *err_host;
    void *err_dev;
    fr_cuht_res_t *res_host;
    void *res_dev;
    /* peers on the fabric path (fab.h): the thread's tables and the
     * host-mapped words (device views; fab.out and fab.in the host's) */
    fr_cuht_fab_t fab;
    void *hm_out_dev, *hm_in_dev;
    /* combines queued ahead, bounded where the fabric thread makes CUDA
     * calls (ep/ahead.h); ncomb: combines launched so far */
    fr_ahead_t ahead;
    unsigned long long ncomb;
    /* exact routes' tables: never cudaFree'd while the context lives (a
     * free waits for the device: a route's release would wait for its
     * kernels, and on the fabric path for kernels that wait on the
     * thread's copies); a freed route's block is reused once the event
     * recorded after its last call has passed */
    struct fr_cuht_spare *spare;
};

typedef struct fr_cuht_spare {
    void *mem;
    size_t size;                  /* bytes (a power of two's tokens: few sizes) */
    cudaEvent_t done;
    int dirty;                    /* as fr_cuht_route_t's */
    struct fr_cuht_spare *next;
} fr_cuht_spare_t;

/* The engine's part of a route. */
typedef struct fr_cuht_route {
    fr_cuht_rdev_t r;
    void *mem;                    /* one device allocation for its tables */
    size_t size;                  /* its bytes */
    cudaEvent_t done;             /* recorded after its last call: its block
                                     is reused once that has passed */
    int32_t *bad;                 /* device: the first bad t * K + k of topk_idx */
    int32_t *ccnt, *dcnt;         /* device: counts the layout kernel makes */
    int32_t *rcc;                 /* device: tokens per (rank, channel), what
                                     notify sends (ccnt, unless forwarding) */
    int dispatched;               /* a dispatch ran on it (forwarding: the
                                     combine needs the dispatch's ids) */
    int slot;                     /* bounded: its place in the pool, else -1 */
    int dirty;                    /* the per-expert counts and the bad-entry
                                     word may be non-zero: zeroed by a memset
                                     before the next route on these tables
                                     (a new block, a failed or forwarding
                                     route; route1 leaves them zero) */
    int captured;                 /* made while its stream was captured: a
                                     graph replays into these tables, so
                                     the slot is never given out again */
} fr_cuht_route_t;

/* The bounded routes' tables, sized for max_tokens, allocated at set-up
 * (nothing is allocated or freed while a graph is captured). */
extern "C" int fr_cuht_pool_init(ferry_ep_t ep);
/* Enqueue the padding of a bounded route's rows past the real count
 * (route.cu). */
extern "C" void fr_cuht_pad_rows(ferry_route_t route, const ferry_ht_dispatch_out_t *out,
                                 void *stream);
extern "C" void fr_cuht_pool_free(ferry_ep_t ep);

static inline struct fr_cuht_ep *fr_cuht(ferry_ep_t ep)
{
    return (struct fr_cuht_ep *)ep->eng_state;
}

/* Byte offsets in a segment (geo.h). */
static __host__ __device__ __forceinline__ unsigned long long
fr_cuht_off_notify(const fr_cuht_geo_t &G, int parity, int src)
{
    return fr_cuht_geo_notify(&G, parity, src);
}
static __host__ __device__ __forceinline__ unsigned long long
fr_cuht_off_ctr(const fr_cuht_geo_t &G, int kind, int c, int r)
{
    return fr_cuht_geo_ctr(&G, kind, c, r);
}
static __host__ __device__ __forceinline__ unsigned long long
fr_cuht_off_ring(const fr_cuht_geo_t &G, int combine, int c, int r)
{
    return fr_cuht_geo_ring(&G, combine, c, r);
}

/* Where this rank writes for peer d and reads what d wrote (the peer
 * table: d's segment through peer memory, or for a peer on the fabric
 * path the outbox and host-mapped words of geo.h; with forwarding, for a
 * remote source whose forwarder is another rank of this node, its
 * dispatch head and combine ring, tail and head at that forwarder):
 *   wnot(d)      d's notify entry [parity][this rank], its contents
 *   wnotid(d)    that entry's route number, stored here
 *   rnotid(s)    the route number of entry [parity][s] that s stores
 *   wctr(d, k, c)  counter (kind k, channel c) this rank stores for d
 *   rctr(s, k, c)  the one s (or its forwarder) stores for this rank
 *                (the entries' contents and the rings this rank reads are
 *                always in the own segment)
 *   wring(d, k, c)  ring (c, this rank) of kind k that d reads */
static __device__ __forceinline__ uint8_t *fr_cuht_wnot(const fr_cuht_args_t &A, int d,
                                                        int parity)
{
    return A.pt[d].wnot + fr_cuht_off_notify(A.G, parity, A.G.rank);
}
static __device__ __forceinline__ unsigned long long *fr_cuht_wnotid(const fr_cuht_args_t &A,
                                                                     int d, int parity)
{
    return (unsigned long long *)(A.pt[d].wnid + fr_cuht_off_notify(A.G, parity, A.G.rank));
}
static __device__ __forceinline__ const unsigned long long *
fr_cuht_rnotid(const fr_cuht_args_t &A, int s, int parity)
{
    return (const unsigned long long *)(A.pt[s].rnid + fr_cuht_off_notify(A.G, parity, s));
}
static __device__ __forceinline__ unsigned long long *fr_cuht_wctr(const fr_cuht_args_t &A,
                                                                   int d, int kind, int c)
{
    const fr_cuht_peer_t &p = A.pt[d];
    return (unsigned long long *)(p.w[kind] + (unsigned long long)c * p.csw[kind]);
}
static __device__ __forceinline__ const unsigned long long *
fr_cuht_rctr(const fr_cuht_args_t &A, int s, int kind, int c)
{
    const fr_cuht_peer_t &p = A.pt[s];
    return (const unsigned long long *)(p.r[kind] + (unsigned long long)c * p.csr[kind]);
}
static __device__ __forceinline__ uint8_t *fr_cuht_wring(const fr_cuht_args_t &A, int d,
                                                         int combine, int c)
{
    return A.pt[d].ring[combine] + (unsigned long long)c * A.pt[d].stride[combine];
}
/* Forwarding: whether source s's rings here are this rank's to forward. */
static __device__ __forceinline__ bool fr_cuht_fwd_here(const fr_cuht_args_t &A, int s)
{
    return A.G.fwd && A.fw.fslot[s] >= 0;
}

/* The own copy of counter (kind, c, r). */
static __device__ __forceinline__ unsigned long long *fr_cuht_my_ctr(const fr_cuht_args_t &A,
                                                                     int kind, int c, int r)
{
    return A.ctr + ((size_t)kind * A.G.C + c) * A.G.N + r;
}
/* Channel c's tokens of T: [t0, t1) (contiguous, in token order). */
static __host__ __device__ __forceinline__ int fr_cuht_chan_lo(int T, int C, int c)
{
    return (int)((long long)T * c / C);
}

/* ---------------------------------------------------------------------- */
/* errors and waits                                                       */

/* The context's error word (runtime/cuda_sync.cuh). */
static __device__ void fr_cuht_fail(const fr_cuht_args_t &A, int status, int rank, int what,
                                    int detail)
{
    fr_cu_err_set(A, status, rank, what, detail);
}

static __device__ __forceinline__ bool fr_cuht_failed(const fr_cuht_args_t &A)
{
    return fr_cu_err_seen(A) || (A.abort && *A.abort != 0);
}

/* One thread waits until the counter *w reaches `target` (counters only
 * grow): relaxed polls, one acquire once it is there. Bounded by the
 * timeout (error naming `rank`, for `what`; with src, `rank` is a source
 * whose rings here its forwarder may serve: FR_CUHT_VIA in the detail,
 * and the host names the rank that serves them); false after any
 * failure. */
static __device__ bool fr_cuht_wait_ge(const fr_cuht_args_t &A, const unsigned long long *w,
                                       unsigned long long target, int rank, int what,
                                       unsigned long long *seen, bool src = false)
{
    unsigned long long t0 = fr_sys_timer();
    unsigned int n = 0;
    for (;;) {
        if (fr_sys_ld_relaxed(w) >= target) {
            *seen = fr_sys_ld_acquire(w);
            return true;
        }
        if ((++n & 255) == 0) {
            if (fr_cuht_failed(A))
                return false;
            if (fr_sys_timer() - t0 > A.timeout_ns) {
                fr_cuht_fail(A, FERRY_ERR_TIMEOUT, rank, what, src ? FR_CUHT_VIA : 0);
                return false;
            }
        }
    }
}

/* Publish counter value v into a peer's word (one thread, after the
 * barrier that orders its group's stores before it): a system-scope
 * fence, then a release store. */
static __device__ __forceinline__ void fr_cuht_publish(unsigned long long *w,
                                                       unsigned long long v)
{
    __threadfence_system();
    fr_sys_st_release(w, v);
}

/* Every kernel of the engine loaded (lazy loading would wait for running
 * kernels, which may wait for the fabric thread's CUDA copies). */
extern "C" int fr_cuht_load_route(void);
extern "C" int fr_cuht_load_stream(void);
extern "C" int fr_cuht_load_dlayout(void);

/* Whether this device takes the kernels that move rows through the copy
 * engine (their shared memory fits, its limit raised: an attribute is the
 * device's, so each context's create asks): 1, or 0 with why. */
extern "C" int fr_cuht_tma_prep(int device, const char **why);

/* Deferred frees (fabric path with CUDA copies in the thread): mark the
 * route's last use on `stream`. */
void fr_cuht_route_used(ferry_route_t route, void *stream);

/* Host: the last launch's error, then the kernels' error word. */
int fr_cuht_launch_check(ferry_ep_t ep, const char *what);

#endif
