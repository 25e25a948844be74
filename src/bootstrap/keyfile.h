/*
 * The per-job key file of a local job without FERRY_SECRET (keyfile.c):
 * rank 0 creates it, the others read it, rank 0 removes it. Private.
 */
#ifndef FR_BOOT_KEYFILE_H
#define FR_BOOT_KEYFILE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "../core/err.h"
#include "boot_int.h"
#include "bootstrap.h"

#define FR_BOOT_KEY_LEN 32

/* The file rank 0 made: its path and identity (removed only while the
 * path still names it). */
typedef struct fr_keyfile {
    char path[600];
    dev_t dev;
    ino_t ino;
    char failed[620]; /* <path>.failed: where a failed rendezvous is told */
} fr_keyfile_t;

/* Every rank, before the rendezvous: the key folder this job uses can be
 * found (FERRY_OK), else why none can, naming each place tried. */
int fr_boot_key_check_dir(fr_err_t *err);
/* The first bytes of SHA-256 of the job's id (as in its key file's name). */
void fr_boot_key_job_hash(const fr_boot_env_t *env,
                          unsigned char out[FR_BOOT_JOB_HASH_LEN]);
/* The start time of process pid (/proc/<pid>/stat, clock ticks since
 * boot), 0 when unknown. */
uint64_t fr_boot_proc_start(int pid);
/* Rank 0, once it bound addr:port: a fresh random key and run id in a new
 * private file named by them and the job; kf (for fr_boot_key_remove) is
 * set on success. */
int fr_boot_key_create(const fr_boot_env_t *env, const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN],
                       unsigned char run[FR_BOOT_RUN_LEN], fr_keyfile_t *kf,
                       fr_err_t *err);
/* Other ranks, on the challenge ch of the root they reached at addr:port:
 * the key of that root's key file. Fails at once, saying why, when the
 * root uses FERRY_SECRET, is of another job, or its file for this run is
 * not in this rank's key folder (rank 0 writes it before it accepts). */
int fr_boot_key_load(const fr_boot_env_t *env, const char *addr, int port,
                     const fr_challenge_t *ch,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err);
/* Rank 0 while addr:port is in use: FERRY_ERR_BOOTSTRAP naming the port
 * when another live local job of this user holds it (its key file is
 * there), else FERRY_OK. */
int fr_boot_key_port_taken(const fr_boot_env_t *env, const char *addr,
                           int port, fr_err_t *err);
/* Remove the file if the path still names it (path emptied); no-op on an
 * empty path. */
void fr_boot_key_remove(fr_keyfile_t *kf);
/* Rank 0, its rendezvous failed: leave why beside the key file
 * (<name>.failed, with its pid and the time), for the ranks still to come;
 * the next rank 0 of this name removes it. No-op when kf made no file. */
void fr_boot_key_note_failure(const fr_keyfile_t *kf, const char *why);
/* Other ranks, while nobody listens on addr:port: 1 when rank 0 of this
 * job left a failure note there since this process started (why: what it
 * says, and how long ago), else 0. */
int fr_boot_key_failed(const fr_boot_env_t *env, const char *addr, int port,
                       char *why, size_t cap);

#endif
