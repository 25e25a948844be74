/*
 * The EP's shared state and its runtime: what the API layer, the engines
 * and the proxy all see (paths, segments, fabric, proxy, failure), the
 * waits on flags and the failure rule (wait.c). Nothing here includes the
 * API layer or an engine; an engine keeps its own buffers and tables in
 * ep->eng_state.
 */
#ifndef FR_EP_H
#define FR_EP_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "ferry.h"
#include "bootstrap/bootstrap.h"
#include "bootstrap/comm.h"
#include "core/err.h"
#include "core/log.h"
#include "core/layout.h"
#include "ep/dp_cuda.h"
#include "ep/stats.h"
#include "runtime/rt.h"
#include "transport/nics.h"

#ifdef __cplusplus
extern "C" {
#endif

enum fr_path { FR_PATH_SELF = 0, FR_PATH_SHM = 1, FR_PATH_FABRIC = 2 };

enum fr_round_state {
    FR_ROUND_FREE = 0,
    FR_ROUND_SENT,     /* dispatch_send done */
    FR_ROUND_RECVD,    /* dispatch_recv done */
    FR_ROUND_COMBINED  /* combine_send done */
};

/* Per buffer set: the round in flight in it (sequenced by the API). */
typedef struct fr_round {
    uint64_t epoch;
    int state;
    int T;               /* tokens this rank sent */
    int gT, glo;         /* DP groups: the group's tokens, this member's first */
} fr_round_t;

/* DP groups (config.dp_size, dp.c): each member's region (POSIX shared
 * memory on CPU ranks, device memory shared through CUDA IPC on CUDA
 * ranks), where the combine's shares are gathered. */
typedef struct fr_dp {
    int G;               /* members per group (1: no groups) */
    int m;               /* this rank's index in its group */
    int T;               /* max_tokens as given (the group's) */
    int share;           /* ceil(T / G): the most tokens a member sends */
    int cuda;            /* CUDA ranks: the regions and the gather on the GPU */
    size_t bytes;        /* each member's region */
    uint8_t **peer;      /* [G] the members' regions, this one's included */
    struct fr_pmem *pm;  /* CUDA ranks: [N] the regions (own at rank, the
                            members' opened; runtime/peer_mem.h) */
    char name[96];       /* this rank's region, until the members mapped it */
    uint64_t epoch;      /* gathers done (CPU; CUDA ranks count on the GPU) */
    fr_dp_cuda_t cu;     /* CUDA ranks: what the kernels need */
} fr_dp_t;

/* Request from the rank thread (or the GPU send kernel) to its proxy
 * (single producer/consumer): post (phase, set)'s slices to every fabric
 * peer, or (peer1 = g + 1) to fabric peer g alone, as soon as its slice is
 * packed. Slots start zeroed, so a producer that never sets peer1 asks
 * for every peer. */
typedef struct fr_proxy_req {
    int phase, set;
    uint64_t epoch;
    int peer1;
    uint64_t t_ring;   /* fr_now_ns() when pushed (0: not stamped, as by a
                          GPU producer; the proxy then takes the time it
                          noticed the request) */
} fr_proxy_req_t;

#define FR_PROXY_RING 64

/* A member that starts a cache line (this header is C and C++). */
#ifdef __cplusplus
#define FR_LINE_ALIGN alignas(64)
#else
#define FR_LINE_ALIGN _Alignas(64)
#endif

/* The doorbell ring: in host memory, mapped into the GPU for CUDA ranks
 * (the send kernel is the producer there). */
typedef struct fr_proxy_ring {
    fr_proxy_req_t req[FR_PROXY_RING];
    /* a cache line each: the proxy moves one, the rank thread the other */
    FR_LINE_ALIGN uint64_t head;            /* consumer (proxy) */
    FR_LINE_ALIGN uint64_t tail;            /* producer */
} fr_proxy_ring_t;

/* A write's delay waiting for its doorbell's stamp: word i, the epoch,
 * when the write was posted (t1), first seen by the proxy, and the
 * previous pass's start (the delay's start without a stamp). */
typedef struct fr_proxy_pend {
    size_t i;
    uint64_t epoch, t1, seen, bell;
} fr_proxy_pend_t;

/* One proxy thread: it owns the NIC endpoints [j * per, (j + 1) * per), their
 * peers' requests (its ring) and doorbells, and their completions. */
typedef struct fr_proxy_th {
    pthread_t thread;
    int j, started;
    int k0, k1;                            /* its NIC endpoints [k0, k1) */
    ferry_ep_t ep;
    fr_proxy_ring_t *ring;                 /* thread 0: fr_proxy_t's ring */
    fr_proxy_ring_t own;                   /* the ring of a thread j > 0 */
    fr_slice_t *gslices;                   /* scatter scratch [N + 1] */
    int *scan, nscan;                      /* doorbell words it scans */
    fr_proxy_req_t *rq;                    /* [nrq]: a run of per-peer requests */
    int *bidx, *bq, nrq;                   /* [nrq]: a batch's group places, and
                                              its requests' places in the run */
    fr_slice_t *bsl;                       /* [nrq]: a batch's slices */
    uint64_t t_scan;                       /* when the last pass began */
    /* delays whose doorbell stamp (ep->ready_ts) was not there yet when
     * the write was posted: counted once it is (fr_proxy_pend) */
    struct fr_proxy_pend *pend;            /* [every doorbell word]; at most
                                              nscan of them used */
    int npend;
    fr_ep_stats_t *st;                     /* thread 0: &ep->st; else &mine */
    fr_ep_stats_t mine;                    /* merged into ep->st at stop */
    /* writes this thread posted still in flight, per set (atomic; the
     * rank thread sums the threads'): its own cache line, and each
     * thread's struct starts a line, so that no two threads write one */
    FR_LINE_ALIGN int64_t inflight[FR_NSETS];
} fr_proxy_th_t;

typedef struct fr_proxy {
    pthread_t thread;
    int running;
    int stop;                              /* atomic */
    int nth;                               /* threads (fr_proxy_th_t) */
    int per;                               /* NIC endpoints per thread */
    fr_proxy_th_t *th;
    fr_proxy_ring_t *ring;
    /* FERRY_PROXY_STATS: per phase, time from picking up this rank's
     * request to the last peer's write of the same phase landing here
     * (the counters every EP keeps are ep->st) */
    uint64_t t_pick[2][FR_NSETS];
    int rx_seen[2][FR_NSETS];
    fr_hist_t *xfer;                       /* [2]: per phase */
    int stats;
    int *gnic, *gpos;                      /* [nfabric]: fabric peer g's NIC and
                                              place in that NIC's group */
    uint64_t *ready_seen;                  /* [2][2][nfabric]: doorbells taken
                                              (when ep->ready is used) */
} fr_proxy_t;

struct fr_engine;

/* ep->rx_flush: what makes writes into GPU memory visible to kernels. */
enum {
    FR_RX_FLUSH_NONE = 0,  /* host memory, or a NIC whose writes the GPU orders */
    FR_RX_FLUSH_GDR = 1,   /* a NIC's writes: cudaDeviceFlushGPUDirectRDMAWrites */
    FR_RX_FLUSH_COPIES = 2 /* the provider's cudaMemcpy calls on the legacy
                              default stream (shm): synchronize that stream */
};

struct ferry_ep {
    ferry_comm_t comm;
    ferry_ep_config_t cfg;
    fr_layout_t L;
    fr_err_t err;
    int failed;          /* sticky status after a failure (0 = healthy) */
    fr_err_t cause;      /* the message of the failure that made `failed` set */
    int N, rank;
    long timeout_ms;
    long spin;
    int proxy_threads;   /* FERRY_PROXY_THREADS, alike on every rank */

    /* the engine (chosen at create from device and mode) and its state */
    const struct fr_engine *eng;
    void *eng_state;
    void *eng_aux;       /* a wrapping engine's own state (engines/staged) */

    int *path;           /* [N] enum fr_path */
    int nfabric;         /* peers on the fabric path */
    int nshm;            /* peers on the shared-memory path */
    /* nodes (create.c): ranks that reach each other through shared memory
     * (equal node ids; each rank alone under FERRY_TRANSPORT=fabric),
     * numbered in the order of their lowest rank, alike on every rank */
    int nnodes;
    int *node_of;        /* [N] a rank's node */
    int *node_lidx;      /* [N] its place among its node's ranks (rank order) */
    int *node_off;       /* [nnodes + 1] CSR into node_ranks */
    int *node_ranks;     /* [N] each node's ranks, in rank order */
    int fwd_req;         /* forwarding asked for (ferry_forward_t; FERRY_HT_FORWARD
                            applied), alike on every rank */
    int forward;         /* the high-throughput engine forwards (its setup) */
    int pmem_cross;      /* a node spans hosts (an NVLink domain): peer memory
                            by fabric handle (create.c, pmem.c) */
    fr_dp_t dp;          /* DP groups (dp.c) */

    /* set up by the engine */
    uint8_t *seg;        /* own receive segment */
    char seg_name[96];   /* its name until every peer mapped it */
    uint8_t **peer_seg;  /* [N] mapped receive segments (self and shm peers) */
    uint8_t *flags;      /* host memory holding the segment's header and
                            flags (FR_SEG_HDR + flags): seg itself, unless
                            the engine keeps seg in GPU memory */
    int fab_device;      /* seg and send are memory of this CUDA device,
                            registered with FI_HMEM (-1: host memory) */
    int rx_flush;        /* what the proxy does before publishing the
                            flags of arrivals in GPU memory
                            (FR_RX_FLUSH_*) */
    uint64_t *ready;     /* [phase 2][set 2][nfabric] per-peer doorbells
                            (the epoch whose slice is packed), when the
                            engine uses them instead of the ring */
    uint64_t *ready_ts;  /* optional, benchmarks: [2 x ready] beside each
                            doorbell word the epoch last stamped (stored
                            last, release) and when it rang (fr_now_ns),
                            recorded by the ringer or a thread watching
                            the words: the delay's start (proxy.c) */
    uint8_t *send;       /* send region (when nfabric > 0) */
    fr_slice_t *slices;  /* [phase 2][set 2][nfabric] filled by the sender */
    fr_proxy_ring_t *ring_mem; /* the engine's ring, or one owned here */

    /* fabric: one transport per NIC; each peer on one NIC (sharded) */
    fr_nics_t nics;
    fr_nic_region_t rseg, rsend;  /* segment (remote writes), send region */
    fr_nic_groups_t groups;       /* fabric peers per NIC */
    int *group_peers;    /* [nfabric] ranks, by fabric index */
    int *group_index;    /* [N] fabric index or -1 */
    uint64_t *flag_last; /* [phase 2][set 2][N] last epoch seen (proxy) */
    fr_proxy_t proxy;
    fr_ep_stats_t st;    /* counters of the thread driving the fabric path */
    /* error raised asynchronously by the proxy or a fabric thread */
    fr_async_err_t async;

    /* round sequencing (the API layer) */
    fr_round_t rounds[FR_NSETS];
    uint64_t next_epoch;

    /* masked ranks (ferry_ep_mask_rank): [N] 1 where masked, what the CPU
     * engine reads (a CUDA engine keeps its own copy in device memory);
     * mask_since[s]: the first round to run with s masked (the next round
     * when the mask was set) */
    int32_t *mask;
    uint64_t *mask_since;
};

/* Is rank s masked (host view)? */
static inline int fr_ep_masked(const struct ferry_ep *ep, int s)
{
    return ep->mask && ep->mask[s];
}

/* Flag word of (phase, set, sender) in a segment. */
static inline uint64_t *fr_flag_ptr(const fr_layout_t *L, uint8_t *seg,
                                    int phase, int set, int sender)
{
    return (uint64_t *)(seg + fr_off_flag(L, phase, set, sender));
}

/* CPU engines' receive segment (seg.c): create this rank's (ep->L.seg_bytes,
 * `tag` in its name), exchange names and statuses with every rank, map
 * the shm peers' into ep->peer_seg. Collective; a rank whose `status` is
 * not FERRY_OK still joins and everyone fails at once. */
int fr_ep_segments(ferry_ep_t ep, char tag, int status, fr_err_t *err);
/* Unmap the peers' and the own segment, unlink its name if still there. */
void fr_ep_segments_close(ferry_ep_t ep);

/* NVLink domains as nodes (domain.c). What a GPU rank reports: */
typedef struct fr_dom {
    int32_t has;          /* its GPU is in an NVLink domain */
    int32_t fabric_ok;    /* it can share GPU memory by fabric handle */
    char dom[48];         /* the domain's name (cluster UUID and clique) */
    char fdkey[96];       /* where its file descriptors reach (fr_ep_fdkey) */
    char why[128];        /* why not fabric_ok */
} fr_dom_t;
/* Where this process's file descriptors can be passed: its kernel's boot
 * id and its network namespace. */
void fr_ep_fdkey(char *buf, size_t len);
/* Each rank's node key into keys[N]: its host's (peers[i].node), or where
 * every rank is in a domain, FERRY_NODE_ID is set nowhere, each host's
 * ranks report one domain, and (for a domain whose ranks are on different
 * kernels or network namespaces) the domain holds every rank and each can
 * share by fabric handle, its domain's. 1 when a domain joined
 * hosts (*cross: a node spans hosts, so its peer memory must be fabric
 * handles), else 0 (why says, when a domain could not). */
int fr_dom_keys(int N, const fr_peer_info_t *peers, const fr_dom_t *d,
                char (*keys)[FR_NODE_ID_LEN], int *cross, char *why, size_t whylen);
/* Collective: the node key of every rank for ep (its host's, or on GPU
 * ranks its NVLink domain's, fr_dom_keys over what every rank reports;
 * sets ep->pmem_cross). */
int fr_ep_domains(ferry_ep_t ep, char (*keys)[FR_NODE_ID_LEN], fr_err_t *err);

/* Peer memory of the GPU engines and DP groups (pmem.c over
 * runtime/peer_mem.h). Collective: the kind every rank's segments use,
 * from FERRY_PEER_MEM and what every rank's `device` offers (legacy_only:
 * why this rank's segment must stay on legacy CUDA IPC, else NULL), and
 * the ranks sharing this rank's GPU (same_gpu may be NULL); a rank whose `status` is not
 * FERRY_OK still joins and every rank fails naming it. */
int fr_ep_pmem_kind(ferry_ep_t ep, int status, int device, const char *legacy_only,
                    int *kind, int *same_gpu, fr_err_t *err);
/* Collective: the allocations of the ranks in [r0, r1) on the
 * shared-memory path opened into peers[N] (others left empty;
 * fr_pmem_close each). The ranges are symmetric: a rank in this one's
 * range has this one in its own (the whole world, or a DP group). */
struct fr_pmem;
int fr_ep_pmem_share(ferry_ep_t ep, int status, const struct fr_pmem *mine, int r0, int r1,
                     struct fr_pmem *peers, fr_err_t *err);

/* DP groups (dp.c). Member m of G sends tokens [lo, hi) of the group's T. */
static inline void fr_dp_share(int T, int G, int m, int *lo, int *hi)
{
    *lo = (int)((long long)T * m / G);
    *hi = (int)((long long)T * (m + 1) / G);
}
/* Map the group's regions (collective over every rank; nothing when
 * dp.G is 1). */
int fr_dp_open(ferry_ep_t ep, fr_err_t *err);
void fr_dp_close(ferry_ep_t ep);
/* Where the engine's combine writes this member's rows (and weights)
 * of the group's out / w, whose first row is the member's `lo`: there on
 * CPU ranks, in the member's region on CUDA ranks. */
void fr_dp_target(ferry_ep_t ep, void *out, float *w, int lo, void **tout, float **tw);
/* Before the engine's combine (CUDA: a kernel on stream waiting until the
 * members have read the previous gather; CPU: nothing). */
int fr_dp_begin(ferry_ep_t ep, void *stream, const char *what);
/* After it: the combine's result of the group's T tokens on every member,
 * out (bf16 [T][H]) and w (float [T][K], may be NULL, alike on every
 * member). CPU: waits for the members (timeout and dead members named);
 * CUDA: kernels on stream, errors reported by fr_dp_check. */
int fr_dp_gather(ferry_ep_t ep, void *out, float *w, int T, void *stream, const char *what);
/* An error the GPU's gather kernels reported, made the context's (FERRY_OK
 * when none). */
int fr_dp_check(ferry_ep_t ep);

/* Forwarding through one rank per node (high-throughput mode): the rank of
 * node b that source s's tokens for b go through, the one with s's local
 * index modulo b's size (with equal nodes the same GPU index). */
static inline int fr_ep_fwd_of(ferry_ep_t ep, int s, int b)
{
    int n = ep->node_off[b + 1] - ep->node_off[b];
    return ep->node_ranks[ep->node_off[b] + ep->node_lidx[s] % n];
}
/* Does rank f forward source s's tokens (s on another node)? */
static inline int fr_ep_fwd_by(ferry_ep_t ep, int s, int f)
{
    int b = ep->node_of[f];
    return ep->node_of[s] != b && fr_ep_fwd_of(ep, s, b) == f;
}

/* Forwarding's plan (fwd.c), the same on every rank: NL the largest
 * node's ranks, NF the most remote sources one rank forwards for. */
void fr_ep_fwd_sizes(const ferry_ep_t ep, int *NL, int *NF);
/* Source s's place among the remote sources f forwards for (ascending),
 * or -1 when f does not forward s. */
int fr_ep_fwd_slot(const ferry_ep_t ep, int s, int f);
/* Rank me's view, per rank r ([N] each, the caller's): where records
 * for an expert on r go (key: r in me's node, else me's forwarder in
 * r's node), who serves source r's rings at me (via: r in me's node,
 * else r's forwarder in me's node), r's place among the sources me
 * forwards for (fslot, -1), r's place in the order of sums (kord: by
 * node, then rank); fl gets the sources me forwards for, ascending.
 * Returns their count. */
typedef struct fr_fwd_view {
    int *key, *via, *fslot, *kord, *fl;
} fr_fwd_view_t;
int fr_ep_fwd_view(const ferry_ep_t ep, int me, fr_fwd_view_t *v);

/* The EP's asynchronous error (a proxy or fabric thread's), kept when one
 * is already set; the next call reports it. Logged at WARN. */
#define fr_ep_async_fail(ep, code, peer, ...) \
    fr_async_fail(&(ep)->async, FR_SUB_PROXY, (code), (peer), __VA_ARGS__)

/* The asynchronous error, when one is set, made the EP's error (a dead
 * rank it blames named: FERRY_ERR_PEER); FERRY_OK when none. */
int fr_ep_async_check(ferry_ep_t ep);

/* Set the EP's error message and sticky status; returns code. */
int fr_ep_fail(ferry_ep_t ep, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Make the EP's status sticky (code), its current message kept as the
 * cause the later calls report; a second failure keeps the first cause. */
void fr_ep_set_failed(ferry_ep_t ep, int code);

/* A GPU wait of `call` that timed out on `rank` (the kernel's error
 * word): what the host knows first, a dead rank (FERRY_ERR_PEER) or the
 * proxy's error, else the timeout naming `rank`. */
int fr_ep_fail_gpu_wait(ferry_ep_t ep, const char *call, int rank);

/* Wait until flag(phase, set, s) == epoch for every sender s; deadline,
 * dead peers and proxy errors turn into statuses naming the ranks. cost
 * (optional, [N]): adds per sender the ns from the wait's start until
 * its flag was seen. */
int fr_wait_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                  const char *what, int64_t *cost);

#ifdef __cplusplus
}
#endif

#endif
