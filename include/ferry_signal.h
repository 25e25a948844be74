/*
 * ferry put-with-signal: one-sided puts between ranks' registered heaps,
 * each optionally followed by a signal (set or add a 64-bit word on the
 * peer) that is applied only once the data it covers has landed.
 *
 * Public C99 API. Requests go to a proxy thread per rank through a
 * lock-free ring; the proxy moves them over libfabric (FI_PROVIDER picks
 * tcp, shm, verbs, efa, ...). CPU ranks call the host functions below;
 * CUDA kernels call the device functions of ferry_signal_device.cuh on a
 * context created with device = FERRY_DEVICE_CUDA.
 *
 * Guarantee: a signal from rank A to rank B is applied at B only after
 * every put A queued to B before it has landed at B; signals from A to B
 * are applied in the order A queued them. How the proxy keeps that
 * promise is the ordering mode (FERRY_SIGNAL_MODE or config.mode):
 *
 *   fence     drain every write in flight before each signal (the naive
 *             proxy; the baseline to measure against)
 *   grouped   never block: puts flow, and each destination's signals go
 *             out as soon as that destination's earlier puts completed
 *   nicfence  the signal write carries FI_FENCE so the NIC orders it; only
 *             where the provider advertises FI_FENCE (not tcp/shm:
 *             FERRY_ERR_UNSUPPORTED)
 *   counted   no ordering on the wire: each signal carries how many puts it
 *             covers and the receiving proxy applies it once those landed
 *             (for unordered fabrics such as EFA; the default)
 */
#ifndef FERRY_SIGNAL_H
#define FERRY_SIGNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ferry_sig *ferry_sig_t;

typedef enum ferry_sig_mode {
    FERRY_SIG_MODE_DEFAULT = 0, /* FERRY_SIGNAL_MODE, else counted */
    FERRY_SIG_MODE_FENCE = 1,
    FERRY_SIG_MODE_GROUPED = 2,
    FERRY_SIG_MODE_NICFENCE = 3,
    FERRY_SIG_MODE_COUNTED = 4
} ferry_sig_mode_t;

typedef enum ferry_sig_op {
    FERRY_SIG_SET = 0, /* signal word = value */
    FERRY_SIG_ADD = 1  /* signal word += value */
} ferry_sig_op_t;

typedef enum ferry_sig_cmp {
    FERRY_SIG_CMP_GE = 0, /* wait until word >= value */
    FERRY_SIG_CMP_EQ = 1  /* wait until word == value */
} ferry_sig_cmp_t;

/* Signal index meaning "no signal": a plain put. */
#define FERRY_SIG_NONE 0xffffffffu

#define FERRY_SIG_CONFIG_MAGIC 0x46535331u /* "FSS1" */

typedef struct ferry_sig_config {
    size_t size;          /* sizeof(ferry_sig_config_t) */
    uint32_t magic;       /* FERRY_SIG_CONFIG_MAGIC */
    uint32_t version;     /* FERRY_VERSION_CODE of the header used */
    uint64_t heap_bytes;  /* registered heap per rank, same on every rank */
    uint32_t num_signals; /* 64-bit signal words per rank, same everywhere */
    ferry_sig_mode_t mode;
    ferry_device_t device; /* CUDA: heap and signals in pinned host memory
                              mapped into the GPU; kernels queue the puts */
    int reserved[8];
} ferry_sig_config_t;

#define FERRY_SIG_CONFIG_INIT                                                  \
    {sizeof(ferry_sig_config_t), FERRY_SIG_CONFIG_MAGIC, FERRY_VERSION_CODE,   \
     0, 0, FERRY_SIG_MODE_DEFAULT, FERRY_DEVICE_CPU, {0}}

/* Collective over the communicator; every rank passes the same config. */
FERRY_API int ferry_sig_create(ferry_comm_t comm, const ferry_sig_config_t *config,
                     ferry_sig_t *sig);
/* Collective; waits (bounded) for this rank's requests to finish first. */
FERRY_API int ferry_sig_destroy(ferry_sig_t sig);
/* Detailed message for the last error on this handle ("" if none). */
FERRY_API const char *ferry_sig_last_error(ferry_sig_t sig);

/* The mode in use, and a mode's name ("fence", ...; "?" if unknown). */
FERRY_API ferry_sig_mode_t ferry_sig_mode(ferry_sig_t sig);
FERRY_API const char *ferry_sig_mode_name(int mode);

/* This rank's heap (host address; heap_bytes long, zeroed at create) and
 * signal words (num_signals, zeroed). While traffic flows only the proxy
 * writes the signal words; read them with ferry_sig_read/wait. */
FERRY_API void *ferry_sig_heap(ferry_sig_t sig);
FERRY_API uint64_t ferry_sig_read(ferry_sig_t sig, uint32_t sig_index);

/* Queue a put of len bytes from this rank's heap at src_off to peer's heap
 * at dst_off, then (unless sig_index is FERRY_SIG_NONE) op(value) on
 * peer's signal word sig_index, applied there once this put and every
 * earlier put from this rank to peer landed. len 0 with a signal: a signal
 * only. peer may be this rank. Returns when queued; the source bytes must
 * stay unchanged until ferry_sig_quiet returns. CPU contexts only. */
FERRY_API int ferry_sig_put(ferry_sig_t sig, int peer, uint64_t dst_off,
                  uint64_t src_off, uint64_t len, uint32_t sig_index,
                  ferry_sig_op_t op, uint64_t value);

/* Wait until every request queued so far (by this rank's threads, or by
 * finished kernels on a CUDA context) has been posted and its writes have
 * completed locally: source bytes may be reused. Bounded by
 * FERRY_TIMEOUT_MS; a dead peer is FERRY_ERR_PEER naming it. */
FERRY_API int ferry_sig_quiet(ferry_sig_t sig);

/* Wait until this rank's signal word sig_index compares true against
 * value; *seen (may be NULL) gets the last value read. Bounded by
 * FERRY_TIMEOUT_MS (FERRY_ERR_TIMEOUT); a dead rank or a proxy error ends
 * it early with a message naming the rank. */
FERRY_API int ferry_sig_wait(ferry_sig_t sig, uint32_t sig_index, ferry_sig_cmp_t cmp,
                   uint64_t value, uint64_t *seen);

/* FERRY_OK, or the error that ended this context (the proxy's, a
 * kernel's, a dead rank), with the message in ferry_sig_last_error. Does
 * not wait: for loops that poll ferry_sig_read. */
FERRY_API int ferry_sig_check(ferry_sig_t sig);

/* Puts from rank `peer` that have landed here, counted without gaps since
 * create (a put is counted once it and every earlier one from that peer
 * landed). */
FERRY_API int ferry_sig_landed(ferry_sig_t sig, int peer, uint64_t *count);

/* What a kernel needs (pass by value; see ferry_signal_device.cuh). */
typedef struct ferry_sig_device {
    void *ring;                    /* request ring (host memory, mapped) */
    unsigned long long *reserve;   /* producer counter (device memory) */
    unsigned char *heap;           /* this rank's heap (mapped) */
    unsigned long long *signals;   /* this rank's signal words (mapped) */
    int *error;                    /* first device-side error (mapped):
                                    * error[0] the status, error[1] what
                                    * (FERRY_SIG_DEVERR_*) */
    int rank, nranks;
    unsigned int ring_slots;       /* power of two */
    unsigned int num_signals;
    unsigned long long heap_bytes;
} ferry_sig_device_t;

/* What a kernel got wrong (error[1] of ferry_sig_device_t). */
enum {
    FERRY_SIG_DEVERR_PEER = 1,      /* peer outside 0..nranks-1 */
    FERRY_SIG_DEVERR_SRC = 2,       /* src_off + len beyond the heap */
    FERRY_SIG_DEVERR_DST = 3,       /* dst_off + len beyond the heap */
    FERRY_SIG_DEVERR_INDEX = 4,     /* sig_index >= num_signals */
    FERRY_SIG_DEVERR_OP = 5,        /* op neither SET nor ADD */
    FERRY_SIG_DEVERR_WAIT_INDEX = 6,/* wait on a word >= num_signals */
    FERRY_SIG_DEVERR_RING_FULL = 7  /* the ring stayed full ~10 s */
};

/* The device handle of a CUDA context (FERRY_ERR_INVALID on a CPU one). */
FERRY_API int ferry_sig_device(ferry_sig_t sig, ferry_sig_device_t *out);

/* One request in the ring between producers (threads, kernels) and the
 * proxy. A producer takes slot i by counting, waits until the proxy's
 * head is within ring_slots of i, fills the slot and stores seq = i + 1
 * last (release). Layout shared with ferry_signal_device.cuh. */
typedef struct ferry_sig_req {
    uint64_t seq;
    int32_t peer;
    uint32_t sig_index;
    uint64_t dst_off, src_off, len;
    uint64_t value;
    uint32_t op;
    uint32_t reserved0;
    uint64_t reserved1;
} ferry_sig_req_t;

/* The ring's header, followed by ring_slots requests. */
typedef struct ferry_sig_ring {
    uint64_t head;        /* next slot the proxy reads (proxy writes) */
    uint64_t pad0[7];
    uint64_t tail;        /* host producers' counter */
    uint64_t pad1[7];
    ferry_sig_req_t req[1]; /* [ring_slots] */
} ferry_sig_ring_t;

#ifdef __cplusplus
}
#endif

#endif
