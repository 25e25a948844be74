/*
 * Local launcher for the tools and tests: fork n ranks of the calling
 * program on this host, wired to meet through the TCP bootstrap on a free
 * loopback port with a fresh job secret, then wait for them, reporting and reaping each one
 * (including the shm regions a killed rank left behind).
 */
#ifndef FW_LAUNCH_H
#define FW_LAUNCH_H

#include <stddef.h>

#include "core/err.h"

/* libinfinipath (a dependency of libfabric's psm provider) installs, from
 * a constructor, handlers for SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGINT,
 * SIGTERM and SIGFPE that print a backtrace with backtrace(), which
 * allocates: a rank that aborts inside malloc (a corrupted heap) then
 * deadlocks in the handler instead of dying, and its job never ends.
 * IPATH_NO_BACKTRACE=1 (HFI_NO_BACKTRACE=1 for psm2) prevents it, but
 * only if set before the library loads, which for a program linked with
 * ferry is before main. This puts back the default action of each of
 * those signals whose handler lives in libinfinipath or libpsm (no other
 * handler is touched); fr_launch_local calls it before forking, and the
 * tools call it first thing in main. */
void fr_launch_drop_psm_handlers(void);

/* A fresh job secret: 32 random bytes as 64 hex digits (cap >= 65). */
int fr_launch_make_secret(char *hex, size_t cap, fr_err_t *err);

/* The most ranks fr_launch_local starts. */
#define FR_LAUNCH_MAX 4096

/* Local launcher: fork `n` ranks of this program with FERRY_RANK,
 * FERRY_WORLD_SIZE, FERRY_ROOT (a free loopback port) and FERRY_SECRET (a
 * fresh one for this job, fr_launch_make_secret) set; the children
 * return 0 from this call with *is_child = 1. The parent waits for all of
 * them; when one fails or dies, the others get FERRY_TIMEOUT_MS plus 2 s to
 * finish before being killed. The parent returns the first non-zero exit
 * status (128+signal for a signal), or 0. With FERRY_LAUNCH_NODES=H set,
 * child i also gets its node from fr_launch_set_node(i, n, H). */
int fr_launch_local(int n, int *is_child, fr_err_t *err);

/* Rank `rank` of `n` as if the job spanned `nodes` nodes: FERRY_NODE_ID
 * "nodeJ", J = rank * nodes / n (peer memory inside a node, the fabric
 * path between them). For tests and benchmarks on one machine. */
void fr_launch_set_node(int rank, int n, int nodes);

/* As fr_launch_local; a negative return is a ferry status (the launch itself
 * failed: bad n, fork). When status is not NULL (n entries), the parent also
 * gets every rank's exit status there (128+signal for a signal, -1 for a
 * rank never started). Lets a caller tell an intended death from others. */
int fr_launch_local_ex(int n, int *is_child, int *status, fr_err_t *err);

#endif
