/*
 * The per-user key file of a local job without FERRY_SECRET (keyfile.c):
 * rank 0 creates it, the others read it, rank 0 removes it. Private.
 */
#ifndef FR_BOOT_KEYFILE_H
#define FR_BOOT_KEYFILE_H

#include <stddef.h>
#include <stdint.h>

#include "../core/err.h"

#define FR_BOOT_KEY_LEN 32

/* Rank 0: a fresh random key in a new private file for this port; path
 * (for fr_boot_key_remove) is set on success. */
int fr_boot_key_create(int port, unsigned char key[FR_BOOT_KEY_LEN],
                       char *path, size_t pcap, fr_err_t *err);
/* Other ranks: read the key, waiting for the file until deadline. */
int fr_boot_key_load(int port, int64_t deadline,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err);
/* Remove the file (path emptied); no-op on an empty path. */
void fr_boot_key_remove(char *path);

#endif
