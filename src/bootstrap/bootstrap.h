/*
 * Bootstrap: how ranks find each other and exchange setup data.
 *
 * Two flavours behind one handle:
 *  - tcp: a star of TCP connections to the root (rank 0), like NCCL's
 *    bootstrap. A watcher thread keeps the sockets after start-up so that a
 *    rank that dies (its socket closes without a goodbye) is reported to
 *    every other rank within ~100 ms: fr_boot_dead_rank() then names it.
 *  - callback: the caller's allgather (MPI, torch.distributed). No watcher;
 *    dead peers are found by timeouts only.
 */
#ifndef FR_BOOTSTRAP_H
#define FR_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"
#include "../core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fr_boot fr_boot_t;

/* Where rank/size/root come from (FERRY_*, Open MPI, torchrun, Slurm). */
typedef struct fr_boot_env {
    int rank;
    int size;
    char root_host[256];
    int root_port;
    const char *source; /* "FERRY", "OMPI", "torchrun", "slurm" */
    int local;          /* every rank is on this host (loopback root, or the
                           launcher says so) */
    int has_key;        /* key: SHA-256 of FERRY_SECRET; else (local jobs)
                           a per-user key file is made at the rendezvous */
    unsigned char key[32];
    char job[200];      /* the job's id among this user's local jobs (the
                           key file's name): FERRY_JOB_ID, the launcher's,
                           else "ppid:<parent pid>" */
    const char *job_from; /* where job came from, for messages */
    int job_ppid;       /* job is the "ppid:" default: the parent's pid */
} fr_boot_env_t;

/* Read the environment; FERRY_ERR_INVALID naming the variable when absent
 * or malformed, or when ranks span hosts and FERRY_SECRET is not set. The
 * caller wipes env->key when done (fr_boot_env_wipe). */
int fr_boot_env_read(fr_boot_env_t *env, fr_err_t *err);
void fr_boot_env_wipe(fr_boot_env_t *env);
/* A job of several ranks that needs a key file, and whose id is only the
 * "ppid:" default of ranks started by a shell, cannot be told from another
 * job that shell starts on the same port: FERRY_ERR_INVALID naming the
 * port, the shell and what to set. Else FERRY_OK. */
int fr_boot_env_check_job(const fr_boot_env_t *env, fr_err_t *err);

/* TCP rendezvous at root. Collective. Fails with FERRY_ERR_BOOTSTRAP naming
 * the ranks that did not arrive within FERRY_BOOTSTRAP_TIMEOUT_MS. */
int fr_boot_init_tcp(const fr_boot_env_t *env, fr_boot_t **boot, fr_err_t *err);

int fr_boot_init_callback(int rank, int size, ferry_allgather_fn fn, void *ctx,
                          fr_boot_t **boot, fr_err_t *err);

int fr_boot_rank(const fr_boot_t *b);
int fr_boot_size(const fr_boot_t *b);

/* Gather len bytes from every rank into out[size][len]. Collective. Fails
 * with FERRY_ERR_PEER naming a dead rank, or FERRY_ERR_TIMEOUT. */
int fr_boot_allgather(fr_boot_t *b, const void *in, void *out, size_t len,
                      fr_err_t *err);
int fr_boot_barrier(fr_boot_t *b, fr_err_t *err);

/* Rank known to have died (socket closed without goodbye), else -1.
 * Cheap: one atomic load; safe from any thread. */
int fr_boot_dead_rank(const fr_boot_t *b);

/* For an asynchronous error `status` of a proxy: the dead rank that
 * explains it, else -1. A fabric error caused by a peer dying (a write
 * from or to it cut off) can arrive before its bootstrap socket is seen
 * closed, so for FERRY_ERR_FABRIC this waits up to
 * FR_BOOT_DEATH_GRACE_MS for the watcher; at once without a watcher. */
#define FR_BOOT_DEATH_GRACE_MS 300 /* the watcher's ~100 ms, with margin */
int fr_boot_blame(const fr_boot_t *b, int status);

/* IPv4 address (text) this rank uses to reach the rendezvous: peers can
 * reach it, so the fabric prefers the interface that has it. -1 when the
 * bootstrap is not TCP. */
int fr_boot_local_ipv4(const fr_boot_t *b, char *buf, size_t len);

/* Orderly close: goodbye to the root, which waits (bounded) for everyone's
 * goodbye before closing, so no rank is reported dead at shutdown. */
int fr_boot_close(fr_boot_t *b, fr_err_t *err);

/* Monotonic clock in ms, and a sleep that resumes after signals: the
 * bootstrap's deadlines run on them (also usable by its callers). */
int64_t fr_boot_now_ms(void);
void fr_boot_sleep_ms(int ms);

/* A loopback TCP port free now, for a local job's root (launchers, tests):
 * below the kernel's ephemeral range when that leaves room, since a port in
 * it can be taken as the source of any outgoing connection on the machine
 * before the root binds it (rank 0 then fails "Address already in use");
 * else one the kernel picks. 0 on success, else an errno. */
int fr_boot_free_port(int *port);
/* The first port of the kernel's ephemeral range (the source ports of
 * outgoing connections; 32768 when it cannot be read). */
int fr_boot_ephemeral_lo(void);

#ifdef __cplusplus
}
#endif

#endif
