/*
 * The CUDA high-throughput engine's fabric thread (fab.c): peers on the
 * fabric path, with the rings in GPU memory registered with the provider
 * (FI_HMEM). The kernels write a fabric peer's records into this rank's
 * outbox and store their counters and route numbers into host-mapped
 * words (geo.h); this thread forwards the records to the ring at the peer
 * (one write with immediate per run of slots), the notify entries and
 * the heads (zero-byte writes with immediate), and stores what lands here
 * into the host-mapped words the kernels poll.
 */
#ifndef FR_CUHT_FAB_H
#define FR_CUHT_FAB_H

#include <stdint.h>

#include "engines/cuda_ht/geo.h"
#include "ep/ep.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records per ring on this path: a write's immediate carries its first
 * slot and its count in at most 8 bits each, and the ring's lap parity. */
#define FR_CUHT_FAB_RT_MAX 256
/* Channels the immediate's channel field holds (7 bits, whatever the
 * context's count, so the format follows from N and the ring alone). */
#define FR_CUHT_FAB_CBITS 7

/* The immediate's layout for N ranks and rings of RT records (the same on
 * every rank): kind 3 bits, then the source rank in bits(N), the channel
 * in FR_CUHT_FAB_CBITS, the value in the rest; a run of records needs
 * 1 + 2 bits(RT) of value (lap, first slot, count - 1). */
typedef struct fr_cuht_fab_fmt {
    unsigned sbits, rbits, vbits;
} fr_cuht_fab_fmt_t;
/* 0 when N and RT fit, else -1 with why (for the choice of engine). */
int fr_cuht_fab_fmt(int N, int RT, fr_cuht_fab_fmt_t *fmt, char *why, size_t whylen);
/* What a write's immediate says (its top 3 bits). */
enum { FR_FAB_DDATA = 1, FR_FAB_CDATA = 2, FR_FAB_DHEAD = 3, FR_FAB_CHEAD = 4,
       FR_FAB_NOTIFY = 5, FR_FAB_HELLO = 6 };
/* An immediate in that format. */
uint32_t fr_cuht_fab_imm(const fr_cuht_fab_fmt_t *fmt, int kind, int src, int c, uint32_t val);

typedef struct fr_cuht_fab {
    fr_cuht_geo_t G;
    fr_cuht_fab_fmt_t fmt; /* the immediates' layout (fr_cuht_fab_init) */
    int nf;                /* fabric peers (ep->group_peers) */
    uint8_t *out;          /* host view of the words stored for peer g: [nf][hdr_bytes] */
    uint8_t *in;           /* host view of the words stored for this rank: [hdr_bytes] */
    int *gnic, *gpos;      /* [nf] the peer's NIC and place in its group */
    /* [2 kinds (dispatch, combine)][nf][C] */
    uint64_t *posted;      /* records of this rank's ring at g posted */
    uint64_t *cred;        /* heads of g's ring here sent back to g */
    uint64_t *tail;        /* records of g's ring here landed, in order */
    uint64_t *head;        /* heads g sent back for this rank's ring there */
    uint8_t *landed;       /* [2][nf][C][RT] slots landed out of order */
    uint64_t *nsent, *nlast; /* [nf][2 parities] route numbers sent, landed */
    long pending;          /* writes posted, not completed */
    uint8_t *hello;        /* [nf] the peer's first write landed (set-up) */
    int *abort;            /* host-mapped word the kernels poll: set on failure */
    unsigned long quiet;   /* atomic: passes that found nothing to send and no
                              write in flight */
} fr_cuht_fab_t;

/* The tables for ep's fabric peers, each peer's NIC and group place
 * (ep's NICs and groups made; G filled by the caller, out and in set);
 * FERRY_OK or FERRY_ERR_NOMEM. */
int fr_cuht_fab_init(ferry_ep_t ep, fr_cuht_fab_t *f);
void fr_cuht_fab_free(fr_cuht_fab_t *f);
/* Set-up, on the calling thread: one write to every fabric peer and one
 * from each, so that a provider's first-write work (shm: opening the
 * peer's GPU memory through CUDA IPC, which can wait for a device
 * synchronisation in another thread) happens before any kernel waits on
 * it. Collective over the fabric peers, bounded by the timeout. */
int fr_cuht_fab_hello(ferry_ep_t ep, fr_cuht_fab_t *f, fr_err_t *err);
/* Wait (bounded by the timeout) until the thread has made a pass with
 * nothing to send and no write in flight, after the device finished
 * (before a context's last barrier: no head goes out after it). */
int fr_cuht_fab_quiesce(ferry_ep_t ep, fr_cuht_fab_t *f);
/* Start the thread (ep->proxy's thread, stop flag and running: stopped by
 * fr_proxy_stop when the context is freed). */
int fr_cuht_fab_start(ferry_ep_t ep, fr_cuht_fab_t *f);

#ifdef __cplusplus
}
#endif

#endif
