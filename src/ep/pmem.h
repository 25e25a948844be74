/*
 * The vmm kind's exchange of peer memory (ep/pmem.c), the part that needs
 * no GPU: each rank listens on a Unix socket whose name the set-up
 * allgather announces, then passes its allocation's descriptor to every
 * peer in range and takes theirs. Declared here so that it runs on CPU
 * ranks too, with a stand-in for the import (tests/unit/test_pmem_pass.c).
 */
#ifndef FR_EP_PMEM_H
#define FR_EP_PMEM_H

#include <stddef.h>
#include <stdint.h>

#include "ep/ep.h"
#include "runtime/peer_mem.h"

/* What each rank announces in the exchange's allgather. */
typedef struct fr_pmem_msg {
    int status;
    int kind;
    unsigned long long size;
    long pid;
    unsigned long long pidns;
    char sock[48];               /* vmm: where this rank takes descriptors */
    uint8_t blob[FR_PMEM_BLOB];  /* legacy, fabric: the handle */
} fr_pmem_msg_t;

/* Opens a peer's allocation (fr_pmem_open's signature). */
typedef int (*fr_pmem_open_fn)(int kind, int device, const uint8_t *blob, int fd, size_t size,
                               fr_pmem_t *m, fr_err_t *err);

/* One rank's side of the vmm exchange. */
typedef struct fr_pmem_pass {
    fr_fdx_t *x;              /* where this rank takes descriptors (fr_pmem_listen) */
    int fd;                   /* this rank's descriptor */
    const fr_pmem_msg_t *all; /* [N] every rank's announcement */
    int r0, r1;               /* the ranks in range */
    int device;               /* this rank's GPU */
    fr_pmem_open_fn open;     /* fr_pmem_open */
} fr_pmem_pass_t;

/* Listen for `near` peers' descriptors; the name is written to m->sock. */
int fr_pmem_listen(fr_fdx_t *x, fr_pmem_msg_t *m, int near, fr_err_t *err);
/* Pass p->fd to every rank of [r0, r1) on the shared-memory path and open
 * each one's descriptor into peers[rank] with p->open. Every send is tried
 * and every descriptor taken even after a failure, so that no peer waits
 * for this rank until its timeout; the first failure is returned. */
int fr_pmem_pass(ferry_ep_t ep, const fr_pmem_pass_t *p, fr_pmem_t *peers, fr_err_t *err);

#endif
