/*
 * ferry: Mixture-of-Experts token dispatch and combine across ranks.
 *
 * Public C99 API. Everything else in the tree is private.
 *
 *   ferry_comm_t  a communicator: who the ranks are and how they met.
 *   ferry_ep_t    an expert-parallel context: buffers, peers, paths.
 *
 * A round is one dispatch and the combine that answers it:
 *
 *   ferry_dispatch_send(ep, &din, &round);   pack and start transfers
 *   ferry_dispatch_recv(ep, round, &dout);   wait, lay out per local expert
 *   ... run the local experts on dout.expert_x, producing expert_y ...
 *   ferry_combine_send(ep, round, &cin);     send expert outputs back
 *   ferry_combine_recv(ep, round, &cout);    wait, weighted sum per token
 *
 * Two rounds may be in flight at once (two micro-batches); starting a third
 * before the first finished its combine_recv is FERRY_ERR_STATE.
 */
#ifndef FERRY_H
#define FERRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the library's public calls: the only symbols libferry exports
 * (it is built with -fvisibility=hidden). */
#ifndef FERRY_API
#define FERRY_API __attribute__((visibility("default")))
#endif

#define FERRY_VERSION_MAJOR 0
#define FERRY_VERSION_MINOR 1
#define FERRY_VERSION_PATCH 2
#define FERRY_VERSION_CODE                                                     \
    (FERRY_VERSION_MAJOR * 10000 + FERRY_VERSION_MINOR * 100 +                 \
     FERRY_VERSION_PATCH)

/* Status codes: 0 is success, errors are negative. */
typedef enum ferry_status {
    FERRY_OK = 0,
    FERRY_ERR_INVALID = -1,     /* a bad argument; the message names it */
    FERRY_ERR_UNSUPPORTED = -2, /* valid, but not supported (e.g. fp8, H%128) */
    FERRY_ERR_NOMEM = -3,       /* allocation or mapping failed */
    FERRY_ERR_SYSTEM = -4,      /* an OS call failed (errno in the message) */
    FERRY_ERR_FABRIC = -5,      /* libfabric reported an error */
    FERRY_ERR_TIMEOUT = -6,     /* peers did not arrive within FERRY_TIMEOUT_MS */
    FERRY_ERR_PEER = -7,        /* a peer died or left; the message names it */
    FERRY_ERR_PROTOCOL = -8,    /* malformed or out-of-order data from a peer */
    FERRY_ERR_STATE = -9,       /* call out of sequence for this round */
    FERRY_ERR_BOOTSTRAP = -10,  /* rendezvous failed */
    FERRY_ERR_INTERNAL = -11
} ferry_status_t;

/* Short fixed description of a status code. Never NULL. */
FERRY_API const char *ferry_strerror(int status);

typedef struct ferry_comm *ferry_comm_t;
typedef struct ferry_ep *ferry_ep_t;

/* ---------------------------------------------------------------------- */
/* Communicators                                                          */
/* ---------------------------------------------------------------------- */

/*
 * Create a communicator from the environment. Rank and size are read from,
 * in order: FERRY_RANK/FERRY_WORLD_SIZE, Open MPI (OMPI_COMM_WORLD_RANK/
 * SIZE), torchrun (RANK/WORLD_SIZE), Slurm (SLURM_PROCID/SLURM_NTASKS).
 * The rendezvous address is FERRY_ROOT ("host:port"), else torchrun's
 * MASTER_ADDR/MASTER_PORT plus one, else, when every rank is on this host,
 * 127.0.0.1 and a port derived from the launcher's job id.
 * Collective: every rank must call it. On failure *comm is NULL and, when
 * errbuf is not NULL, a message is written there.
 */
FERRY_API int ferry_comm_init_env(ferry_comm_t *comm, char *errbuf, size_t errlen);

/*
 * Caller-supplied allgather: gather `len` bytes from every rank into `out`
 * (rank-major, nranks * len bytes). Return 0 on success.
 */
typedef int (*ferry_allgather_fn)(const void *in, void *out, size_t len,
                                  void *ctx);

/* Create a communicator over an existing runtime (MPI, torch.distributed). */
FERRY_API int ferry_comm_init_allgather(int rank, int nranks, ferry_allgather_fn fn,
                              void *ctx, ferry_comm_t *comm, char *errbuf,
                              size_t errlen);

FERRY_API int ferry_comm_rank(ferry_comm_t comm);
/* Detailed message of the last failure on this communicator, including a
 * failed ferry_ep_create (which leaves no EP handle to ask). */
FERRY_API const char *ferry_comm_last_error(ferry_comm_t comm);
FERRY_API int ferry_comm_size(ferry_comm_t comm);
/* Collective helpers over the communicator's bootstrap (setup-time speed;
 * not for the data path). */
FERRY_API int ferry_comm_allgather(ferry_comm_t comm, const void *in, void *out,
                         size_t len);
FERRY_API int ferry_comm_barrier(ferry_comm_t comm);
/* Collective; tolerates a dead peer (returns FERRY_ERR_PEER after cleanup).
 * Destroy every EP (and put-with-signal context) made on the communicator
 * first: they use it until they are destroyed; while any is left this
 * returns FERRY_ERR_STATE (saying how many) and frees nothing. */
FERRY_API int ferry_comm_destroy(ferry_comm_t comm);

/* ---------------------------------------------------------------------- */
/* Expert-parallel context                                                */
/* ---------------------------------------------------------------------- */

typedef enum ferry_dtype {
    FERRY_DTYPE_BF16 = 0,     /* 2 bytes per element */
    FERRY_DTYPE_FP8_E4M3 = 1, /* 1 byte, one fp32 scale per 128 channels */
    /* Low latency only, since 0.1.2: 4 bits per element (e2m1), one e4m3
     * scale per 16 channels, and a global fp32 encode scale per dispatch
     * (ferry_dispatch_in_t.x_global_scale, the same on every rank). A block
     * of 16 with largest magnitude amax gets the scale
     * sf = e4m3(gs * (amax * (1/6))) and codes e2m1(x * (1 / (sf * (1/gs)))),
     * e4m3 and e2m1 rounding to nearest even and saturating (+-448, +-6),
     * the reciprocals correctly rounded fp32 (an all-zero block: sf 0,
     * codes 0); x ~ e2m1 * sf / gs. amax is over the finite channels, Inf
     * saturates to +-6, NaN gives code 7 with its sign. expert_x holds
     * [E_local][capacity][H/2] bytes, channel 2c in the low nibble of byte c
     * and 2c + 1 in the high one; expert_x_scales the e4m3 bytes in the
     * 128 x 4 block-scaled layout of grouped NVFP4 GEMMs: scale j of row t
     * of local expert e at byte
     *   e * R * H/64 * 512 + (t/128) * (H/64) * 512 + (j/4) * 512
     *   + (t%32) * 16 + ((t%128)/32) * 4 + j%4,
     * R = capacity rounded up to 128 over 128 (padding rows and unwritten
     * rows are left as they were). hidden a multiple of 64. */
    FERRY_DTYPE_NVFP4 = 2
} ferry_dtype_t;

typedef enum ferry_device {
    FERRY_DEVICE_CPU = 0,
    FERRY_DEVICE_CUDA = 1
} ferry_device_t;

/* How an EP moves tokens. Low latency (decode): buffers sized for the
 * worst case of max_tokens from every rank, no count exchange; the calls
 * under "Rounds". High throughput (prefill, training): ranks exchange
 * counts first (ferry_route_create), outputs are exact, tokens stream
 * through bounded rings per peer (memory independent of T); the calls
 * under "High-throughput mode". */
typedef enum ferry_mode {
    FERRY_MODE_LOW_LATENCY = 0,
    FERRY_MODE_HIGH_THROUGHPUT = 1
} ferry_mode_t;

#define FERRY_EP_CONFIG_MAGIC 0x46455031u /* "FEP1" */

typedef struct ferry_ep_config {
    size_t size;       /* sizeof(ferry_ep_config_t) */
    uint32_t magic;    /* FERRY_EP_CONFIG_MAGIC */
    uint32_t version;  /* FERRY_VERSION_CODE of the header used */
    int num_experts;   /* E: global experts, divisible by the world size */
    int topk;          /* K: experts per token, 1..16 */
    int hidden;        /* H: channels per token */
    int max_tokens;    /* T: most tokens any rank passes per round */
    ferry_dtype_t dispatch_dtype; /* bf16, or fp8 with block scales */
    ferry_device_t device;
    int num_sms;       /* CUDA: blocks the kernels use (0: 16 in low-latency
                          mode; 24 channels in high-throughput mode); when
                          ranks share a GPU, lowered to their share of what
                          it holds at once, with a warning when given */
    ferry_mode_t mode; /* FERRY_MODE_LOW_LATENCY (0, the default) */
    /* High throughput: tokens each peer's ring holds (0: 256); ring memory
     * per rank is about 2 x N x ring_tokens x (2H + 128) bytes. CUDA: a
     * ring per (channel, peer), so num_sms (channels) x that, default
     * 512 / N tokens, within 32..128. */
    int ring_tokens;
    /* fp8 dispatch: 1 rounds each block's scale up to a power of two
     * (DeepEP's round_scale: the scale is then exactly an 8-bit exponent,
     * UE8M0, and dividing by it is exact); 0 (default): amax / 448. */
    int fp8_round_scale;
    /* Low latency, fp8: how expert_x_scales is laid out (ferry_scales_layout_t;
     * 0, the default: FERRY_SCALES_ROWS). */
    int scales_layout;
    /* Low latency: 1 turns a peer that sends nothing within FERRY_TIMEOUT_MS
     * (CPU ranks: or that is seen dead sooner) into a masked rank
     * (ferry_ep_mask_rank) instead of failing the round: the round
     * completes without it (its rows 0, the combine adding nothing for
     * slots on its experts) and later rounds leave it out;
     * ferry_ep_mask_query says which ranks were masked. Every survivor must
     * see the same peer go (DeepEP's shrink mode). Ranks of one node only:
     * FERRY_ERR_UNSUPPORTED with any pair on the fabric path (several
     * nodes, FERRY_TRANSPORT=fabric); FERRY_ERR_INVALID in high-throughput
     * mode. 0 (the default): a timeout fails the context, naming the rank. */
    int mask_on_timeout;
    /* High throughput across nodes (ferry_forward_t): FERRY_FORWARD_AUTO
     * (0, the default) forwards when the ranks span more than one node
     * and the engine can (FERRY_HT_FORWARD=on|off decides instead when
     * set); OFF sends every token to each destination rank directly (a
     * crossing per rank); ON forwards: a token crosses the fabric once
     * per destination node, to the rank there with the sender's local
     * index, which passes it on to that node's destinations through
     * shared memory and sums their combine rows before one row crosses
     * back. CPU ranks forward; CUDA ranks forward from GPU memory with
     * half of num_sms as forward blocks (nodes of up to 32 ranks, and
     * at least 2 blocks), or else through the staged engine (host
     * copies), which ON then selects (AUTO stays flat).
     * ferry_ep_get_nodes says what was chosen. */
    int forward;
    /* DP groups (pplx-kernels' dp_size): ranks in a data-parallel group,
     * consecutive ranks (group g = ranks g * dp_size .. g * dp_size +
     * dp_size - 1), dividing the world, each group inside one node; 0 or
     * 1: no groups. Every member holds the group's tokens and calls with
     * the same arguments (num_tokens = the group's T, at most max_tokens,
     * and the same x, topk_idx, weights); member m sends only its share,
     * tokens [m * T / G, (m + 1) * T / G) (integer division: a balanced
     * split, the same on every member), so each token leaves the group
     * once, and the combine writes every token's result into `out` on
     * every member (the members' shares gathered through shared memory).
     * The receivers see each member as a source rank with its share:
     * source token ids (expert_src_token, recv_src_token) are indices in
     * that share. Buffers are sized for ceil(max_tokens / G) tokens per
     * source. Members whose inputs differ are not detected: each sends its
     * share of its own inputs, and every member gets the gathered shares.
     * CUDA ranks gather through device memory shared by CUDA IPC, with
     * kernels on the combine's stream (capturable in a CUDA graph).
     * Not with num_tokens_dev (the split needs T on the host). Earlier
     * headers called this field `reserved` (0). */
    int dp_size;
} ferry_ep_config_t;

typedef enum ferry_forward {
    FERRY_FORWARD_AUTO = 0,
    FERRY_FORWARD_OFF = 1,
    FERRY_FORWARD_ON = 2
} ferry_forward_t;

/* Layouts of the low-latency expert_x_scales (fp8 dispatch), S = H/128
 * scales per row, C = expert_capacity rows per local expert:
 *   FERRY_SCALES_ROWS    float [E_local][C][S], a row's scales together;
 *   FERRY_SCALES_COLS    float [E_local][S][C], a scale's rows together
 *                        (MN-major, what TMA-fed grouped GEMMs read: DeepEP's
 *                        layout, a [E_local][C][S] view with strides
 *                        (S*C, 1, C));
 *   FERRY_SCALES_UE8M0   int32 [E_local][S/4][C]: word (e, i, row) holds
 *                        the exponent bytes (UE8M0) of the row's scales
 *                        4i..4i+3, scale 4i+j in byte j (DeepEP's use_ue8m0
 *                        layout); needs fp8_round_scale = 1 (the scales are
 *                        powers of two) and H a multiple of 512. */
typedef enum ferry_scales_layout {
    FERRY_SCALES_ROWS = 0,
    FERRY_SCALES_COLS = 1,
    FERRY_SCALES_UE8M0 = 2
} ferry_scales_layout_t;

#define FERRY_EP_CONFIG_INIT                                                   \
    {sizeof(ferry_ep_config_t), FERRY_EP_CONFIG_MAGIC, FERRY_VERSION_CODE,     \
     0, 0, 0, 0, FERRY_DTYPE_BF16, FERRY_DEVICE_CPU, 0,                      \
     FERRY_MODE_LOW_LATENCY, 0, 0, FERRY_SCALES_ROWS, 0, FERRY_FORWARD_AUTO, 0}

/* Collective over the communicator; every rank passes the same config. */
FERRY_API int ferry_ep_create(ferry_comm_t comm, const ferry_ep_config_t *config,
                    ferry_ep_t *ep);
/* Collective; waits for this rank's transfers to finish first. */
FERRY_API int ferry_ep_destroy(ferry_ep_t ep);

/* Detailed message for the last error on this handle ("" if none). */
FERRY_API const char *ferry_ep_last_error(ferry_ep_t ep);

/* Sizes of the caller's buffers, filled from the config and world size. */
typedef struct ferry_ep_layout {
    size_t size;             /* set by the caller to sizeof(ferry_ep_layout_t) */
    int num_ranks;
    int rank;
    int num_local_experts;   /* E / N */
    int expert_capacity;     /* rows per local expert: N * T */
    size_t token_bytes;      /* bytes of one dispatched row (H or 2H) */
    int num_scales;          /* fp32 scales per row (H/128 for fp8, else 0) */
    size_t expert_x_bytes;   /* E_local * capacity * token_bytes */
    size_t expert_scales_bytes; /* E_local * capacity * num_scales * 4
                                   (UE8M0: * 1) */
    size_t expert_y_bytes;   /* E_local * capacity * H * 2 (bf16) */
    size_t shm_bytes;        /* this rank's shared receive segment */
    size_t host_bytes;       /* other buffers this rank holds */
    /* 1: every call of this context needs a CUDA stream created with
     * cudaStreamNonBlocking (GPU memory on the fabric path through a
     * provider that copies on the legacy default stream, shm with FI_HMEM;
     * docs/architecture.md, "Streams"), and nothing queued on the legacy
     * or a blocking stream may wait for a call still in flight; 0: any
     * stream. Filled when size covers it (callers built before it pass a
     * size ending at host_bytes). */
    int needs_nonblocking_stream;
} ferry_ep_layout_t;

FERRY_API int ferry_ep_get_layout(ferry_ep_t ep, ferry_ep_layout_t *layout);

/* The nodes as this context sees them: ranks that reach each other
 * through shared (peer) memory form a node (equal FERRY_NODE_ID or host
 * name; under FERRY_TRANSPORT=fabric every rank is a node of its own).
 * Nodes are numbered in the order of their lowest rank. Any argument but
 * ep may be NULL: *num_nodes, node_of[N] (each rank's node) and *forward
 * (1 when the high-throughput calls forward through one rank per node,
 * config.forward). */
FERRY_API int ferry_ep_get_nodes(ferry_ep_t ep, int *num_nodes, int32_t *node_of, int *forward);

/* Counters of the thread that drives this context's fabric path (the
 * low-latency proxy; in the high-throughput mode the CPU engine's own
 * fabric calls or the CUDA engine's fabric thread), cumulative since
 * ferry_ep_create and all zero when no peer is on the fabric path. Kept
 * always: a clock read around each post and each poll that returned
 * completions. Times are the driving thread's, not a round's. */
typedef struct ferry_ep_stats {
    size_t size;              /* IN: sizeof(ferry_ep_stats_t); fields past
                                 a smaller size are left alone */
    uint64_t writes;          /* OUT: writes posted to fabric peers */
    uint64_t requests;        /* OUT: requests taken (a request asks for one
                                 peer's write, or one per fabric peer) */
    uint64_t completions;     /* OUT: local completions of those writes
                                 (success or error); equals writes once
                                 nothing is in flight */
    uint64_t arrivals;        /* OUT: peers' writes that landed here */
    uint64_t eagain;          /* OUT: provider posts that returned
                                 -FI_EAGAIN (queued, retried later) */
    uint64_t post_ns;         /* OUT: time posting, from taking a request
                                 to its post call's return */
    uint64_t provider_ns;     /* OUT: of which inside the provider's post
                                 calls; post_ns minus this is ferry's own
                                 bookkeeping */
    uint64_t provider_calls;  /* OUT: provider post calls */
    uint64_t polls;           /* OUT: polls that returned completions */
    uint64_t poll_ns;         /* OUT: time in those polls and in handling
                                 what they returned (publishing flags) */
    uint64_t retry_ns;        /* OUT: time inside the provider's post calls
                                 retrying posts queued after -FI_EAGAIN
                                 (made from polls) */
    uint64_t doorbells;       /* OUT: samples of the delay below */
    double doorbell_to_post_p50_us; /* OUT: from a doorbell ringing (a
                                 request pushed by the rank thread, or the
                                 proxy noticing a destination marked ready)
                                 to the write being posted: median, and */
    double doorbell_to_post_p99_us; /* OUT: 99th percentile (a histogram
                                 of 8 buckets per power of two: +-6%) */
    uint64_t bytes;           /* OUT: bytes of the writes posted to fabric
                                 peers (payload) */
    uint64_t batched;         /* OUT: of the writes, those posted with
                                 FI_MORE: the provider may ring the NIC
                                 once for a batch (a pass of the proxy, a
                                 scatter) instead of once per write */
    double seen_to_post_p50_us; /* OUT: from the proxy first seeing a
                                 doorbell rung (the request in its ring,
                                 the doorbell word changed) to the write
                                 being posted, the proxy's own share of
                                 the delay above and a lower bound of it
                                 (for a GPU rank's doorbells that delay is
                                 an upper bound): median, and */
    double seen_to_post_p99_us; /* OUT: 99th percentile */
    uint64_t doorbells_stamped; /* OUT: of the doorbells, those whose delay
                                 starts at a record of when it rang: a
                                 request's push time (the rank thread
                                 stamps it), or a stamp beside a doorbell
                                 word (ferry-bench's null transport: its
                                 ringer's, or a thread watching the words;
                                 the proxy's own first sight where that
                                 came earlier). A GPU rank's other
                                 doorbells count from the proxy's previous
                                 look at the word, an upper bound */
} ferry_ep_stats_t;

/* Read ep's counters into *stats (IN: stats->size; OUT: the rest).
 * Any thread, any time after create; the counters are read one by one
 * while the driving thread may still add to them. Returns FERRY_OK, or
 * FERRY_ERR_INVALID for a NULL argument or a size smaller than the
 * first version's (message in ferry_ep_last_error when ep is valid). */
FERRY_API int ferry_ep_get_stats(ferry_ep_t ep, ferry_ep_stats_t *stats);

/* ---------------------------------------------------------------------- */
/* Rounds                                                                 */
/* ---------------------------------------------------------------------- */

/* bf16 values are passed as raw uint16_t bit patterns. With
 * FERRY_DEVICE_CUDA every pointer is device memory, work is enqueued on
 * `stream` (a cudaStream_t; NULL: the legacy default stream) and the calls
 * return before it ran; errors found on the GPU (a peer that did not arrive
 * in time, a bad expert index) are returned by the next call on the
 * context, or by ferry_ep_sync, and leave it failed. Every call can be captured in a CUDA graph:
 * the epoch lives on the device and the token count may too.
 * combine_recv reads the rows a rank's own experts produced for its own
 * tokens in place: keep expert_y unchanged until combine_recv has run.
 * On CPU ranks a bad topk_idx (below -1, E or more, an expert twice in a
 * token) takes its round: that rank's dispatch_send (or ferry_dispatch)
 * fails with FERRY_ERR_INVALID naming the entry, every other rank's
 * dispatch_recv (or ferry_dispatch) of that round fails with it naming
 * that rank (the lowest, if several), and every context goes on with the
 * next round. None of these calls waits for the others' (the round's end
 * is awaited by the next dispatch_send that reuses its buffers). */

typedef struct ferry_dispatch_in {
    size_t size;               /* sizeof(ferry_dispatch_in_t) */
    int num_tokens;            /* T_r, 0..max_tokens */
    const void *x;             /* [T][H] bf16, or fp8 when x_scales != NULL */
    const float *x_scales;     /* [T][H/128] when x is already fp8, else NULL */
    const int64_t *topk_idx;   /* [T][K], -1 = no expert */
    void *stream;              /* CUDA: cudaStream_t */
    const int32_t *num_tokens_dev; /* CUDA: if set, T is read from here */
    /* FERRY_DTYPE_NVFP4: the encode scale gs (one float, device memory on
     * CUDA ranks, finite and > 0), the same on every rank; NULL otherwise.
     * Since 0.1.2: the size before this field is still taken. */
    const float *x_global_scale;
} ferry_dispatch_in_t;

typedef struct ferry_dispatch_out {
    size_t size;               /* sizeof(ferry_dispatch_out_t) */
    /* On rank r, each expert's rows come from source ranks r, r + 1, ...,
     * N - 1, 0, ..., r - 1 (own tokens first, wrapping around), each
     * source's in token order; the first expert_num_tokens rows are valid. */
    void *expert_x;            /* [E_local][capacity][token_bytes] */
    float *expert_x_scales;    /* [E_local][capacity][H/128]; fp8 only (the
                                  layout config.scales_layout names) */
    int32_t *expert_num_tokens;/* [E_local] */
    /* Optional (may be NULL): which token each row is, [E_local][capacity]. */
    int32_t *expert_src_rank;
    int32_t *expert_src_token;
    void *stream;              /* CUDA: cudaStream_t */
    /* Optional (may be NULL; a struct of the size before this field, as
     * older callers pass, is accepted without it): int64 [num_ranks], where the engine adds,
     * per source rank, how long this receive waited for that source's data
     * (the same memory as expert_x: device memory on CUDA ranks). CUDA:
     * SM clock cycles (clock64, as DeepEP's wait-cost stats); CPU:
     * nanoseconds. Adds, never clears: the caller zeroes it. */
    int64_t *wait_cost;
    /* Optional (may be NULL; the two older sizes, before wait_cost and
     * before this field, are accepted without it): int32 [E_local], same
     * memory as expert_x, where the receive adds each local expert's row
     * count (expert_num_tokens) once the rows are in: a running total
     * for load balancing (DeepEP's cumulative_local_expert_recv_stats),
     * added by the kernel itself on CUDA ranks, so it costs no launch and
     * replays with a captured graph. Adds, never clears. */
    int32_t *recv_stats;
} ferry_dispatch_out_t;

typedef struct ferry_combine_in {
    size_t size;               /* sizeof(ferry_combine_in_t) */
    const void *expert_y;      /* [E_local][capacity][H] bf16 */
    void *stream;              /* CUDA: cudaStream_t */
    /* Optional, since 0.1.2 (the size before `signals` is still taken):
     * the combine overlapped with the computation that writes expert_y
     * (sgl-deep-ep's overlapped combine: the down GEMM raises a signal as
     * it finishes an expert, or a block of an expert's rows). With signals
     * not NULL, row `slot` of local expert e leaves (and, for this rank's
     * own tokens, is read) only once
     *     signals[e * nb + slot / signal_block] == signal_value,
     * nb = ceil(capacity / signal_block); signal_block 0 means one signal
     * per expert (signals[e]). Each rank's rows go as their signals rise,
     * before the last one (to a fabric peer: its write once all of its
     * rows are in). Equality, as sgl-deep-ep: ferry never writes the
     * signals, the caller resets them between rounds. A signal whose rows
     * are all empty is not waited for. Same memory as expert_y (device
     * memory on CUDA ranks, polled by the combine kernel: run the combine
     * on a stream beside the computation's, with SMs left for both).
     * Not in one call with DP groups. A signal not raised within the
     * context's timeout: FERRY_ERR_TIMEOUT naming the expert and the
     * signal's index and value. */
    const uint32_t *signals;
    uint32_t signal_value;
    int32_t signal_block;      /* rows per signal, 0: the whole expert */
    /* Optional (may be NULL): int32 [E_local], same memory as expert_y,
     * where the send adds each local expert's rows once it passed their
     * signal (a progress counter: what left before the last signal).
     * Adds, never clears. */
    int32_t *sent_rows;
    /* How the rows travel: FERRY_COMBINE_BF16 (0), or FERRY_COMBINE_LOGFMT
     * (DeepEP's `use_logfmt`: 10-bit logarithmic codes per 128 channels
     * where a 1024-channel chunk's values are all below 1 in magnitude,
     * else the chunk's bf16; relative error at most 2.17%, about 64% of
     * bf16's bytes when every chunk is cast; hidden a multiple of 512).
     * Every rank passes the same format in a round (a receiver decodes
     * what its own combine_send announced). CPU ranks take it on every
     * path; GPU ranks with peers on the fabric path: FERRY_ERR_UNSUPPORTED. */
    int32_t format;
    int32_t reserved; /* ignored: the padding after `format` in the struct
                         before num_sms, which older callers may not zero */
    /* Optional, since 0.1.2: the most SMs (thread blocks) this combine's
     * kernels take on a GPU rank; 0: the context's num_sms. sgl-deep-ep's
     * `num_sms`: an overlapped combine waits on signals the down GEMM
     * raises beside it, so the GEMM must keep the SMs the combine does not
     * take. Below 0: FERRY_ERR_INVALID. CPU ranks take and ignore it. */
    int32_t num_sms;
} ferry_combine_in_t;

typedef enum ferry_combine_format {
    FERRY_COMBINE_BF16 = 0,
    FERRY_COMBINE_LOGFMT = 1
} ferry_combine_format_t;

typedef struct ferry_combine_out {
    size_t size;               /* sizeof(ferry_combine_out_t) */
    const float *topk_weights; /* [T][K] as passed at dispatch's T */
    void *out;                 /* [T][H] bf16: sum_k w[t][k] * y_k[t] */
    void *stream;              /* CUDA: cudaStream_t */
    int64_t *wait_cost;        /* optional, as ferry_dispatch_out_t's */
} ferry_combine_out_t;

FERRY_API int ferry_dispatch_send(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                        uint64_t *round);
FERRY_API int ferry_dispatch_recv(ferry_ep_t ep, uint64_t round,
                        const ferry_dispatch_out_t *out);
FERRY_API int ferry_combine_send(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_in_t *in);
FERRY_API int ferry_combine_recv(ferry_ep_t ep, uint64_t round,
                       const ferry_combine_out_t *out);

/* Wait for `stream` (CUDA; ignored on CPU) and return the context's status:
 * FERRY_OK, or the error a kernel reported (naming the rank). */
FERRY_API int ferry_ep_sync(ferry_ep_t ep, void *stream);

/* Masking ranks (low-latency mode; DeepEP's mask buffer). A masked rank
 * is treated as gone: from the next round on, this rank sends it nothing,
 * waits for nothing from it, and top-k slots whose expert lives on it count
 * as -1 (no row there, nothing added by the combine). Every surviving rank
 * must mask the same ranks before the same round: a rank that still
 * expects data from a peer that masked it times out, naming that peer.
 *
 * ferry_ep_mask_rank: rank's entry set (masked 1) or cleared (0); not this
 * rank itself; only between rounds (none in flight: FERRY_ERR_STATE).
 * Clearing a mask after a round ran with it set is FERRY_ERR_STATE (the
 * pair's flags are out of step: create a new context); clearing it before
 * is allowed. CUDA: the entry is written on `stream` (a kernel: capturable
 * in a CUDA graph, which then replays the write), so the rounds must run on
 * that stream or one ordered after it. The dispatch launched
 * while some rank is masked is the kernel that cuts; a CUDA graph of
 * rounds captured while no rank was masked holds the kernel without the
 * mask, and replayed after a mask is set it fails the round
 * (FERRY_ERR_STATE, saying so: capture again after masking, in a new
 * context), never running it unmasked. CPU: at once.
 *
 * ferry_ep_mask_query: int32 status[num_ranks] = 1 where masked, else 0
 * (CUDA: device memory, copied on `stream`; CPU: host memory). */
FERRY_API int ferry_ep_mask_rank(ferry_ep_t ep, int rank, int masked, void *stream);
FERRY_API int ferry_ep_mask_query(ferry_ep_t ep, int32_t *status, void *stream);

/* 1 when this build has CUDA kernels and a GPU is visible, else 0 (and a
 * reason in why). */
FERRY_API int ferry_cuda_available(char *why, size_t len);

/* One-shot forms: send then receive. */
FERRY_API int ferry_dispatch(ferry_ep_t ep, const ferry_dispatch_in_t *in,
                   const ferry_dispatch_out_t *out, uint64_t *round);
FERRY_API int ferry_combine(ferry_ep_t ep, uint64_t round, const ferry_combine_in_t *in,
                  const ferry_combine_out_t *out);

/* ---------------------------------------------------------------------- */
/* High-throughput mode (config.mode = FERRY_MODE_HIGH_THROUGHPUT)        */
/* ---------------------------------------------------------------------- */

/* A route: where this rank's tokens go and what it receives, from one
 * topk_idx. Creating it is collective (ranks exchange their counts); it can
 * then serve any number of dispatches and combines with the same routing
 * (forward and backward passes) until destroyed. Received rows are laid
 * out by source rank, then token.
 *
 * With FERRY_DEVICE_CUDA (ranks of one node, peers' memory through CUDA
 * IPC; for peers on the fabric path see the end of this comment), every pointer in
 * the structs below is device memory, 16-byte aligned for x, recv_x, y and
 * out. ferry_route_create runs its kernels on in->stream and waits for
 * them once (it must return num_recv; a bounded route does not wait).
 * Keep a context's routes and their calls on one stream: bounded routes
 * rely on stream order alone. ferry_ht_dispatch and
 * ferry_ht_combine only enqueue work on in->stream and return: outputs are
 * ready, and inputs may be reused, once the stream has run it; errors found
 * on the GPU (a peer that did not arrive within FERRY_TIMEOUT_MS, a
 * malformed record, routes used in a different order) come back from
 * ferry_ep_sync or the next call, naming the rank. Calls follow each other
 * on one stream without host synchronisation; ferry_route_destroy does
 * not wait for the GPU. ring_tokens is per channel and peer on CUDA
 * (default 512 / N, within 32..128); num_sms is the channel count, one block and
 * one SM each (0: 24), lowered to the GPU's SMs over the most ranks
 * sharing one GPU when that is less (with a warning when num_sms was
 * given).
 *
 * CUDA ranks with peers on the fabric path (other nodes, or
 * FERRY_TRANSPORT=fabric) run the CPU engine's protocol on pinned host
 * copies of the same device pointers: every call copies its inputs to the
 * host on in->stream, waits, moves the data, copies the outputs back and
 * waits again, so it returns with its outputs in place (slow: each row
 * crosses PCIe twice); no call can be captured in a CUDA graph (refused,
 * naming it), and ring_tokens follows the CPU rule (default 256 per peer). */
typedef struct ferry_route *ferry_route_t;

typedef struct ferry_route_in {
    size_t size;               /* sizeof(ferry_route_in_t) */
    int num_tokens;            /* T_r, 0..max_tokens */
    const int64_t *topk_idx;   /* [T][K], -1 = no expert */
    int expert_alignment;      /* per-expert counts rounded up to a multiple
                                  of this (0 or 1: exact) */
    void *stream;              /* CUDA: cudaStream_t (NULL: the legacy
                                  default stream). A size of the struct
                                  before this field (an older ferry.h)
                                  is still taken: stream is then NULL */
    /* A bounded route (DeepEP's num_worst_tokens), when max_recv > 0: the
     * caller's upper bound on the rows this rank receives. route_create
     * then does not wait for the counts (on CUDA ranks it only enqueues,
     * and create, dispatch, combine and destroy can be captured in a CUDA
     * graph and replayed with new topk_idx and data in the same buffers);
     * ferry_route_counts gives num_recv = max_recv; the dispatch outputs
     * hold max_recv rows, rows past the real count being padding
     * (recv_topk_idx -1, recv_topk_weights 0, recv_src_rank and
     * recv_src_token -1; recv_x and its scales not written). More rows
     * than max_recv is FERRY_ERR_INVALID naming max_recv, and fails the
     * context (on CUDA ranks it is found on the GPU: from ferry_ep_sync or
     * the next call). The sizes before these fields are still taken. */
    int max_recv;
    int32_t *num_recv_out;     /* bounded, optional: the real row count
                                  ([1]; device memory on CUDA ranks, written
                                  on the stream) */
    int32_t *expert_counts_out; /* bounded, optional: rows per local expert
                                  ([E_local], rounded up to
                                  expert_alignment; device memory on CUDA
                                  ranks) */
} ferry_route_in_t;

/* Collective. A bad topk_idx value (below -1, E or more, or an expert
 * twice in a token) on any rank fails every rank's route_create with
 * FERRY_ERR_INVALID (that rank's message names the entry, the others'
 * name the rank); no route is made and the context stays usable. */
FERRY_API int ferry_route_create(ferry_ep_t ep, const ferry_route_in_t *in,
                       ferry_route_t *route);
/* Rows this rank receives (num_recv), and optionally rows per local
 * expert ([E_local], rounded up to expert_alignment). A bounded route
 * gives num_recv = max_recv, and its expert counts only through
 * expert_counts_out (FERRY_ERR_STATE here). */
FERRY_API int ferry_route_counts(ferry_route_t route, int *num_recv,
                       int32_t *expert_counts);
/* Not collective; no call may use the route after this (it is gone, as
 * it is when its context is destroyed first: destroy routes first). On
 * CUDA ranks it does not wait for the GPU: an exact route's tables go to
 * a later route once the calls queued on it have run (an event), and a
 * bounded route's come from a pool of eight, given to a later bounded
 * route on the same stream (stream order keeps that safe); tables of a
 * route made while its stream was being captured stay with the graph.
 * With every pooled table taken, a bounded route allocates its own (not
 * capturable). */
FERRY_API int ferry_route_destroy(ferry_route_t route);

typedef struct ferry_ht_dispatch_in {
    size_t size;               /* sizeof(ferry_ht_dispatch_in_t) */
    const void *x;             /* [T][H] bf16, or fp8 when x_scales != NULL */
    const float *x_scales;     /* [T][H/128], or NULL (see x_scales_stride) */
    const float *topk_weights; /* [T][K], or NULL */
    void *stream;              /* CUDA: cudaStream_t (NULL: legacy default);
                                  the outputs are written on it too */
    /* x_scales' strides in floats: [0] from a token to the next, [1] from
     * a scale to the next; {0, 0}: row-major, {H/128, 1}. Scale q of token
     * t is x_scales[t * x_scales_stride[0] + q * x_scales_stride[1]], and
     * nothing past the last of those is read: column-major scales (DeepEP's,
     * [H/128][ld] with ld >= T) are {1, ld}, taken without a copy. Both at
     * least 1 otherwise. The struct sizes before this field and before
     * stream are still taken (row-major then). recv_x_scales is always
     * row-major. Since 0.1.1: an older library takes the struct and reads
     * the scales row-major (check ferry_version_string). */
    int64_t x_scales_stride[2];
} ferry_ht_dispatch_in_t;

typedef struct ferry_ht_dispatch_out {
    size_t size;               /* sizeof(ferry_ht_dispatch_out_t) */
    void *recv_x;              /* [num_recv][H], dtype of x */
    float *recv_x_scales;      /* [num_recv][H/128] when x is fp8 */
    /* Optional (may be NULL): per row, the token's K slots as local expert
     * ids (-1: not an expert of this rank) and their weights (0 there);
     * the source rank and token index. */
    int32_t *recv_topk_idx;    /* [num_recv][K] */
    float *recv_topk_weights;  /* [num_recv][K]; needs in->topk_weights */
    int32_t *recv_src_rank;    /* [num_recv] */
    int32_t *recv_src_token;   /* [num_recv] */
    /* recv_topk_idx as int64 (DeepEP's dtype), written instead of the
     * int32 one, with no widening pass after the call: give at most one of
     * the two. Since 0.1.2; the struct size before this field is still
     * taken. */
    int64_t *recv_topk_idx_i64; /* [num_recv][K] */
} ferry_ht_dispatch_out_t;

typedef struct ferry_ht_combine_in {
    size_t size;               /* sizeof(ferry_ht_combine_in_t) */
    const void *y;             /* [num_recv][H] bf16: one row per received
                                  token (its local experts' outputs, weighted
                                  and summed by the caller) */
    const float *topk_weights; /* [num_recv][K] or NULL: returned to the
                                  source in out->topk_weights */
    void *stream;              /* CUDA: cudaStream_t (NULL: legacy default);
                                  the outputs are written on it too */
    /* How out->topk_weights is made: 0, slot k from the row of the rank of
     * expert k (the adjoint of dispatch's recv_topk_weights: backward
     * passes); 1, slot k summed over the rows of every rank the token went
     * to, in rank order (DeepEP's combined_topk_weights). The two sizes
     * before stream and before this field are still taken (0 then). */
    int weights_sum;
    /* [T][H] bf16 each, or NULL: added to out in fp32 after the token's
     * rows, bias[0] then bias[1], before out's one rounding (DeepEP's
     * combine bias). The size before this field is still taken (none). */
    const void *bias[2];
    /* The order of out's fp32 sum (one FERRY_HT_SUM_* value):
     * FERRY_HT_SUM_RANKS (0), the token's rows in ascending rank order,
     * then bias[0], bias[1]; FERRY_HT_SUM_SLOTS, bias[0] + bias[1] first,
     * then the rows in the order of the highest top-k slot each rank holds
     * for the token (DeepEP 2's combine order, bit for bit with its
     * reference when no rows are forwarded between nodes; with forwarding
     * a remote node's summed row counts as one, at its highest slot). The
     * sums agree whenever they are exact. Since 0.1.2; the size before
     * this field is still taken (FERRY_HT_SUM_RANKS). */
    int sum_order;
} ferry_ht_combine_in_t;

enum { FERRY_HT_SUM_RANKS = 0, FERRY_HT_SUM_SLOTS = 1 };

typedef struct ferry_ht_combine_out {
    size_t size;               /* sizeof(ferry_ht_combine_out_t) */
    void *out;                 /* [T][H] bf16: sum of the token's rows from
                                  every rank it went to (fp32, in
                                  in->sum_order, rounded once) */
    float *topk_weights;       /* [T][K] or NULL: slot k from the rank of
                                  expert k (0 for -1), or summed over the
                                  token's ranks (in->weights_sum) */
} ferry_ht_combine_out_t;

/* Collective over the ranks, on the same routes in the same order (a
 * mismatch is FERRY_ERR_PROTOCOL naming the rank); returns when this
 * rank's rows have arrived and its inputs may be reused. Backward passes use the same calls on
 * the same route: the gradient of a combine is a dispatch of the output's
 * gradient (bf16), the gradient of a dispatch is a combine of recv_x's
 * gradient (with topk_weights' gradient riding along). */
FERRY_API int ferry_ht_dispatch(ferry_ep_t ep, ferry_route_t route,
                      const ferry_ht_dispatch_in_t *in,
                      const ferry_ht_dispatch_out_t *out);
FERRY_API int ferry_ht_combine(ferry_ep_t ep, ferry_route_t route,
                     const ferry_ht_combine_in_t *in,
                     const ferry_ht_combine_out_t *out);

/* A routing's layout on its own, as DeepEP's get_dispatch_layout gives it
 * (no context, nothing exchanged): from topk_idx [T][K] (-1 = no expert;
 * an index outside 0..E-1 counts nowhere, as -1), for N ranks owning E/N
 * experts each: per rank, the tokens with at least one expert there; per
 * expert, its (token, k) slots; per token and rank, 1 if the token goes
 * there, else 0 (one byte each: a torch.bool [T, N]). Every output is
 * written whole. CUDA: device pointers, two memsets and one kernel on
 * `stream`, no host synchronisation (capturable in a CUDA graph). */
typedef struct ferry_layout_args {
    size_t size;                /* sizeof(ferry_layout_args_t) */
    ferry_device_t device;
    int num_tokens;             /* T >= 0 */
    int topk;                   /* K, 1..16 */
    int num_experts;            /* E, a multiple of num_ranks */
    int num_ranks;              /* N >= 1 */
    const int64_t *topk_idx;    /* [T][K] */
    int32_t *tokens_per_rank;   /* [N] */
    int32_t *tokens_per_expert; /* [E] */
    uint8_t *token_in_rank;     /* [T][N] */
    void *stream;               /* CUDA: cudaStream_t */
    /* Per node (DeepEP's num_tokens_per_rdma_rank), when ranks_per_node >
     * 0: nodes are blocks of ranks_per_node consecutive ranks (the last
     * may be smaller), and tokens_per_node [ceil(N / ranks_per_node)]
     * counts the tokens with an expert on a rank of each. 0: not counted
     * (callers built against the header before these fields pass the
     * smaller size). */
    int ranks_per_node;
    int32_t *tokens_per_node;
} ferry_layout_args_t;

/* Returns FERRY_ERR_INVALID naming the argument (message in errbuf, which
 * may be NULL), or FERRY_ERR_UNSUPPORTED for CUDA in a build without it. */
FERRY_API int ferry_dispatch_layout(const ferry_layout_args_t *args, char *errbuf, size_t errlen);

/* ---------------------------------------------------------------------- */
/* Settings                                                               */
/* ---------------------------------------------------------------------- */

typedef struct ferry_setting {
    const char *name;   /* e.g. "FERRY_TIMEOUT_MS" */
    const char *defval; /* default as text */
    const char *value;  /* current value as text (default if unset);
                           "(set, hidden)" for a secret (FERRY_SECRET) */
    const char *help;
} ferry_setting_t;

/* Number of settings; fills `out` with up to `max` of them. */
FERRY_API int ferry_settings(ferry_setting_t *out, int max);

FERRY_API const char *ferry_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_H */
