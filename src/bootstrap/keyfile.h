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
#include "bootstrap.h"

#define FR_BOOT_KEY_LEN 32

/* The file rank 0 made: its path and identity (removed only while the
 * path still names it). */
typedef struct fr_keyfile {
    char path[600];
    dev_t dev;
    ino_t ino;
} fr_keyfile_t;

/* Every rank, before the rendezvous: the key folder this job uses can be
 * found (FERRY_OK), else why none can, naming each place tried. */
int fr_boot_key_check_dir(fr_err_t *err);
/* Rank 0, once it bound addr:port: a fresh random key in a new private file
 * named by them and the job; kf (for fr_boot_key_remove) is set on
 * success. */
int fr_boot_key_create(const fr_boot_env_t *env, const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN], fr_keyfile_t *kf,
                       fr_err_t *err);
/* Other ranks: read the key of this job's root at addr:port (the address
 * they reached it at), waiting for the file until deadline; a live key
 * file of another job on that port fails it at once. */
int fr_boot_key_load(const fr_boot_env_t *env, const char *addr, int port,
                     int64_t deadline, unsigned char key[FR_BOOT_KEY_LEN],
                     fr_err_t *err);
/* Rank 0 while addr:port is in use: FERRY_ERR_BOOTSTRAP naming the port
 * when another live local job of this user holds it (its key file is
 * there), else FERRY_OK. */
int fr_boot_key_port_taken(const fr_boot_env_t *env, const char *addr,
                           int port, fr_err_t *err);
/* Remove the file if the path still names it (path emptied); no-op on an
 * empty path. */
void fr_boot_key_remove(fr_keyfile_t *kf);

#endif
