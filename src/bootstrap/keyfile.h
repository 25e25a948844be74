/*
 * The per-user key file of a local job without FERRY_SECRET (keyfile.c):
 * rank 0 creates it, the others read it, rank 0 removes it. Private.
 */
#ifndef FR_BOOT_KEYFILE_H
#define FR_BOOT_KEYFILE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "../core/err.h"

#define FR_BOOT_KEY_LEN 32

/* The file rank 0 made: its path and identity (removed only while the
 * path still names it). */
typedef struct fr_keyfile {
    char path[400];
    dev_t dev;
    ino_t ino;
} fr_keyfile_t;

/* Rank 0, once it bound addr:port: a fresh random key in a new private file
 * named by them; kf (for fr_boot_key_remove) is set on success. */
int fr_boot_key_create(const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN], fr_keyfile_t *kf,
                       fr_err_t *err);
/* Other ranks: read the key of the root at addr:port (the address they
 * reached it at), waiting for the file until deadline. */
int fr_boot_key_load(const char *addr, int port, int64_t deadline,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err);
/* Remove the file if the path still names it (path emptied); no-op on an
 * empty path. */
void fr_boot_key_remove(fr_keyfile_t *kf);

#endif
