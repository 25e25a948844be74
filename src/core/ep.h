/* Internal state of EP contexts (the communicator is in core/comm.h). */
#ifndef FR_EP_H
#define FR_EP_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "ferry.h"
#include "bootstrap/bootstrap.h"
#include "core/comm.h"
#include "core/err.h"
#include "core/layout.h"
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

/* Per buffer set: what one round needs from send to combine_recv. */
typedef struct fr_round {
    uint64_t epoch;
    int state;
    int T;               /* tokens this rank sent */
    int32_t *comb_pos;   /* [T][K]: row of my combine region, or -1 */
    /* expert side (filled by dispatch_recv) */
    int32_t *pair_row;   /* [N*T*kmax]: le*cap + slot, by sender, record, k */
    uint32_t *pair_off;  /* [N+1]: first pair of each sender */
    uint32_t *comb_off;  /* [N]: where each sender wants its replies */
} fr_round_t;

/* Request from the rank thread to its proxy (single producer/consumer). */
typedef struct fr_proxy_req {
    int phase, set;
    uint64_t epoch;
} fr_proxy_req_t;

#define FR_PROXY_RING 16

/* The doorbell ring: in host memory, mapped into the GPU for CUDA ranks
 * (the send kernel is the producer there). */
typedef struct fr_proxy_ring {
    fr_proxy_req_t req[FR_PROXY_RING];
    uint64_t head;                         /* consumer (proxy) */
    uint64_t tail;                         /* producer */
} fr_proxy_ring_t;

typedef struct fr_proxy {
    pthread_t thread;
    int running;
    int stop;                              /* atomic */
    fr_proxy_ring_t *ring;
    int64_t tx_pending[FR_NSETS];          /* atomic: writes in flight per set */
    uint64_t posted, completed_rx;         /* statistics */
    /* FERRY_PROXY_STATS: per phase, time from picking up this rank's
     * request to the last peer's write of the same phase landing here */
    uint64_t t_pick[2][FR_NSETS];
    int rx_seen[2][FR_NSETS];
    uint32_t *xfer_ns[2];                  /* samples */
    int nxfer[2], stats;
} fr_proxy_t;

struct ferry_ep {
    ferry_comm_t comm;
    ferry_ep_config_t cfg;
    fr_layout_t L;
    fr_err_t err;
    int failed;          /* sticky status after a failure (0 = healthy) */
    int N, rank;
    long timeout_ms;
    long spin;

    int *path;           /* [N] enum fr_path */
    int nfabric;         /* peers on the fabric path */
    int nshm;            /* peers on the shared-memory path */

    uint8_t *seg;        /* own receive segment */
    char seg_name[96];
    uint8_t **peer_seg;  /* [N] mapped receive segments (self and shm peers) */

    /* fabric: one transport per NIC; each peer on one NIC (sharded) */
    fr_nics_t nics;
    fr_nic_region_t rseg, rsend;  /* segment (remote writes), send region */
    fr_nic_groups_t groups;       /* fabric peers per NIC */
    uint8_t *send;       /* send region */
    fr_slice_t *gslices;             /* scratch: one group's slices */
    int *group_peers;    /* [nfabric] ranks, by fabric index */
    int *group_index;    /* [N] fabric index or -1 */
    fr_slice_t *slices;  /* [phase 2][set 2][nfabric] filled by the sender */
    fr_proxy_ring_t *ring_mem; /* owned ring (CPU ranks) */
    struct fr_cuda_ep *cuda;   /* CUDA state, NULL for CPU ranks */
    uint64_t *flag_last; /* [phase 2][set 2][N] last epoch seen (proxy) */
    fr_proxy_t proxy;
    /* error raised asynchronously by the proxy */
    int async_status;    /* atomic */
    int async_peer;
    char async_msg[FR_ERRMSG_LEN];

    fr_round_t rounds[FR_NSETS];
    uint64_t next_epoch;

    /* scratch */
    uint8_t *qbuf;       /* [T][tok_bytes] quantised tokens */
    float *qscales;      /* [T][nscales] */
    int32_t *cnt_rank;   /* [N] */
    int32_t *pairs_rank; /* [N] */
    int32_t *fill;       /* [N] */
    int32_t *rec_next;   /* [N] */
    uint32_t *comb_base; /* [N] */
    int32_t *expert_fill;/* [El] */
    float *acc;          /* [H] */
};

/* Flag word of (phase, set, sender) in a segment. */
static inline uint64_t *fr_flag_ptr(const fr_layout_t *L, uint8_t *seg,
                                    int phase, int set, int sender)
{
    return (uint64_t *)(seg + fr_off_flag(L, phase, set, sender));
}

/* Set the EP's error message and sticky status; returns code. */
int fr_ep_fail(ferry_ep_t ep, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Wait until flag(phase, set, s) == epoch for every sender s; deadline,
 * dead peers and proxy errors turn into statuses naming the ranks. */
int fr_wait_flags(ferry_ep_t ep, int phase, int set, uint64_t epoch,
                  const char *what);

/* Proxy (src/proxy/proxy.c). */
int fr_proxy_start(ferry_ep_t ep);
int fr_proxy_stop(ferry_ep_t ep); /* -1: left running (fr_proxy_join) */
int fr_proxy_submit(ferry_ep_t ep, int phase, int set, uint64_t epoch);
/* Wait until the proxy has no writes in flight from `set` (bounded). */
int fr_proxy_wait_set(ferry_ep_t ep, int set);

/* CPU kernels (src/kernels/cpu/). */
int fr_cpu_dispatch_send(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_in_t *in);
int fr_cpu_dispatch_recv(ferry_ep_t ep, fr_round_t *r,
                         const ferry_dispatch_out_t *out);
int fr_cpu_combine_send(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_in_t *in);
int fr_cpu_combine_recv(ferry_ep_t ep, fr_round_t *r,
                        const ferry_combine_out_t *out);

/* Argument checks (also run under the fuzzer). */
int fr_ep_check_config(int nranks, const ferry_ep_config_t *c, fr_err_t *err);
int fr_check_dispatch_args(const fr_layout_t *L, const ferry_dispatch_in_t *in,
                           int on_gpu, fr_err_t *err);

/* Record decoding, shared with the fuzzer: validate one received slice. */
int fr_slice_check(const fr_layout_t *L, const uint8_t *slice, int sender,
                   uint64_t epoch, fr_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
