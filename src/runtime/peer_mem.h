/*
 * Peer memory: device memory that other ranks map, one allocation at a
 * time (an engine's segment, a DP group's region). Three kinds:
 *
 *   vmm     the CUDA VMM API (cuMemCreate at the granularity the device
 *           asks for, cuMemAddressReserve, cuMemMap, cuMemSetAccess),
 *           shared by a POSIX file descriptor: within one host, passed
 *           over a Unix socket (fdpass below);
 *   fabric  the same allocation shared by a fabric handle
 *           (CU_MEM_HANDLE_TYPE_FABRIC): across the hosts of an NVLink
 *           domain, where the device offers it and IMEX runs;
 *   legacy  cudaMalloc and cudaIpcGetMemHandle (one host).
 *
 * What one process does; which kind every rank uses and the exchange are
 * the EP's (ep/pmem.c). The driver calls are taken through
 * cudaGetDriverEntryPointByVersion, so nothing links libcuda. Without
 * CUDA (peer_mem_stub.c) every call answers FERRY_ERR_UNSUPPORTED.
 */
#ifndef FR_PEER_MEM_H
#define FR_PEER_MEM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { FR_PMEM_LEGACY = 1, FR_PMEM_VMM = 2, FR_PMEM_FABRIC = 4 };
#define FR_PMEM_BLOB 64 /* cudaIpcMemHandle_t and CUmemFabricHandle: 64 bytes */

typedef struct fr_pmem {
    int kind;                /* FR_PMEM_*; 0: nothing held */
    int own;                 /* 1: allocated here (freed by close), 0: a
                                peer's opened here (closed), -1: borrowed
                                (close forgets it) */
    int device;
    void *ptr;               /* this process's view */
    size_t size;             /* mapped bytes (vmm, fabric: rounded up to the
                                granularity) */
    unsigned long long h;    /* the VMM allocation's handle */
} fr_pmem_t;

/* The calling thread's current CUDA device. */
int fr_cuda_device_current(int *device, fr_err_t *err);
/* The device's UUID (16 bytes): ranks with equal ones share a GPU.
 * FERRY_OK or the error. */
int fr_cuda_device_uuid(int device, uint8_t uuid[16], fr_err_t *err);
/* The NVLink domain `device` belongs to (NVML's GPU fabric info, loaded
 * with dlopen: the cluster UUID and clique id a fabric manager gave it):
 * 1 with both, 0 when it has none and -1 when NVML cannot say; `why`
 * says which (the state, or the call that failed). */
int fr_cuda_nvlink_domain(int device, uint8_t cluster[16], unsigned *clique, char *why,
                          size_t whylen);
/* "legacy", "vmm", "fabric" (kind 0: "none"). */
const char *fr_pmem_name(int kind);
/* The kinds `device` offers this process (FR_PMEM_* bits; legacy always),
 * and in `why` the first reason each other kind is missing (the attribute
 * or call that said no), "" when none is. */
int fr_pmem_kinds(int device, char *why, size_t whylen);
/* A trial: the smallest allocation of `kind` made, exported and freed
 * (MPS clients, containers without the descriptor or IMEX channel may
 * refuse what the attributes offer). FERRY_OK, or the error (why). Once
 * per process, kind and device. */
int fr_pmem_try(int kind, int device, fr_err_t *err);
/* 1 when `device` offers `kind` (fr_pmem_kinds) and its trial passes,
 * else 0 and in `why` the attribute or call that said no. */
int fr_pmem_usable(int kind, int device, char *why, size_t whylen);
/* A zeroed allocation of at least `bytes` on `device`, shareable as
 * `kind`. */
int fr_pmem_alloc(int kind, int device, size_t bytes, fr_pmem_t *m, fr_err_t *err);
/* What a peer opens `m` with: legacy and fabric fill blob, vmm returns a
 * new file descriptor in *fd (the caller closes it once passed). */
int fr_pmem_export(const fr_pmem_t *m, uint8_t blob[FR_PMEM_BLOB], int *fd, fr_err_t *err);
/* Open a peer's allocation of `size` bytes (its fr_pmem_t size) from its
 * blob or its file descriptor (closed here, opened or not) for `device`. */
int fr_pmem_open(int kind, int device, const uint8_t *blob, int fd, size_t size, fr_pmem_t *m,
                 fr_err_t *err);
/* Unmap a peer's, or free an own allocation; m is cleared. */
void fr_pmem_close(fr_pmem_t *m);

/* File descriptors passed between processes of one host: a listening
 * Unix socket in the abstract namespace (per network namespace), one
 * connection per descriptor, each carrying an int tag (the sender's rank)
 * and the descriptor (SCM_RIGHTS). A sender does not wait for the
 * receiver to accept, so every rank can send all its descriptors before
 * receiving any. peer_mem_host.c, plain POSIX.
 *
 * Any process of the network namespace can connect to an abstract name
 * and see it in /proc/net/unix: both ends check who is at the other
 * (SO_PEERCRED) against what the peer announced, and a receiver drops a
 * connection that is not a peer's without failing. */
typedef struct fr_fdx {
    int lfd;
    char name[64]; /* without the leading NUL */
} fr_fdx_t;

/* Who is expected at the other end: the uid is always this process's;
 * the pid is checked when pidns is this process's pid namespace. */
typedef struct fr_fdx_peer {
    int tag;                  /* what its messages carry (its rank) */
    long pid;                 /* the pid it announced */
    unsigned long long pidns; /* its pid namespace (fr_pidns) */
    const char *name;         /* where it listens */
} fr_fdx_peer_t;

#define FR_FDX_SLOTS 32     /* connections a receiver reads at once */
#define FR_FDX_READ_MS 1000 /* how long one connection may take to send */
#define FR_FDX_MAXFD 8      /* descriptors read from one message (one taken) */

/* Listen on @name, with room for `backlog` peers' connections (and
 * FR_FDX_SLOTS more). */
int fr_fdx_listen(fr_fdx_t *x, const char *name, int backlog, fr_err_t *err);
/* Pass fd with `tag` to to->name, once the listener there is `to` (its
 * uid, and pid in one pid namespace; otherwise nothing is sent and the
 * error names who holds the name). Bounded by timeout_ms (a listener whose
 * backlog stays full). */
int fr_fdx_send(const fr_fdx_peer_t *to, int tag, int fd, long timeout_ms, fr_err_t *err);
/* Takes peers[i]'s descriptor fd (closing it when done). */
typedef void (*fr_fdx_take_fn)(void *arg, int i, int fd);
/* One descriptor from each of peers[0, n), each handed to take as it
 * comes, until all came or timeout_ms passed (FERRY_ERR_TIMEOUT naming
 * the first tag missing and the first connection dropped). A connection
 * is dropped, and the exchange goes on, when it is of another uid, of a
 * pid no peer due announced (peers in this pid namespace), sends nothing
 * within FR_FDX_READ_MS, or sends anything but a due peer's tag with one
 * descriptor; every descriptor received and not taken is closed. Up to
 * FR_FDX_SLOTS connections are read at once. */
int fr_fdx_gather(fr_fdx_t *x, const fr_fdx_peer_t *peers, int n, long timeout_ms,
                  fr_fdx_take_fn take, void *arg, fr_err_t *err);
void fr_fdx_close(fr_fdx_t *x);

#ifdef __cplusplus
}
#endif

#endif
