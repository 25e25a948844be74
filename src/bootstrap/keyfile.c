/*
 * The job key of a local job started without FERRY_SECRET: rank 0 writes
 * 32 random bytes to <dir>/ferry-<uid>-<port>.key, where <dir> is
 * $XDG_RUNTIME_DIR/ferry or /tmp/ferry-<uid>, a directory of this user
 * with no access for anyone else; the file is created exclusively with
 * mode 0600, no symbolic link is followed on the way, and owner and mode
 * of both are checked on the open descriptors. The other ranks read it
 * (same checks) once the root has answered their connection, waiting for
 * it within the bootstrap deadline; rank 0 removes it when everyone has
 * arrived, or when the rendezvous fails. Another user cannot read the key,
 * so cannot pass the handshake nor pose as the root.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hmac.h"
#include "keyfile.h"
#include "tcp.h"

/* The key folder's path. */
static void fr_key_dir_path(char *dir, size_t cap)
{
    const char *x = getenv("XDG_RUNTIME_DIR");
    if (x && x[0] == '/')
        snprintf(dir, cap, "%s/ferry", x);
    else
        snprintf(dir, cap, "/tmp/ferry-%u", (unsigned)geteuid());
}

/* Open the key folder (creating it when create), checked: a directory of
 * this user, no access for group and others. >= 0: its descriptor; -1:
 * absent (errno ENOENT, not create); -2: unsafe or unusable (err set). */
static int fr_key_dir_open(int create, char *dir, size_t cap, fr_err_t *err)
{
    fr_key_dir_path(dir, cap);
    if (create && mkdir(dir, 0700) != 0 && errno != EEXIST) {
        FR_ERR(err, FERRY_ERR_SYSTEM, "cannot create the key folder %s: %s "
                                      "(or set FERRY_SECRET)",
               dir, strerror(errno));
        return -2;
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) {
        if (errno == ENOENT && !create)
            return -1;
        FR_ERR(err, FERRY_ERR_SYSTEM,
               "cannot open the key folder %s: %s (a symbolic link is not "
               "followed; or set FERRY_SECRET)",
               dir, strerror(errno));
        return -2;
    }
    struct stat st;
    if (fstat(dfd, &st) != 0 || st.st_uid != geteuid() ||
        (st.st_mode & 077) != 0) {
        FR_ERR(err, FERRY_ERR_SYSTEM,
               "key folder %s is not private to uid %u (owner %u, mode "
               "%03o): remove it, or set FERRY_SECRET",
               dir, (unsigned)geteuid(), (unsigned)st.st_uid,
               (unsigned)(st.st_mode & 0777));
        close(dfd);
        return -2;
    }
    return dfd;
}

static void fr_key_name(int port, char *name, size_t cap)
{
    snprintf(name, cap, "ferry-%u-%d.key", (unsigned)geteuid(), port);
}

int fr_boot_key_create(int port, unsigned char key[FR_BOOT_KEY_LEN],
                       char *path, size_t pcap, fr_err_t *err)
{
    char dir[300], name[64];
    path[0] = '\0';
    int dfd = fr_key_dir_open(1, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    fr_key_name(port, name, sizeof(name));
    /* A file left by a job that died: this rank holds the port now. */
    (void)unlinkat(dfd, name, 0);
    int fd = openat(dfd, name,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    int rc = FERRY_OK;
    if (fd < 0) {
        rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot create key file %s/%s: %s",
                    dir, name, strerror(errno));
    } else {
        snprintf(path, pcap, "%s/%s", dir, name);
        ssize_t w = -1;
        if (fchmod(fd, 0600) == 0 && fr_boot_random(key, FR_BOOT_KEY_LEN) == 0)
            w = write(fd, key, FR_BOOT_KEY_LEN);
        if (w != FR_BOOT_KEY_LEN) {
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot write key file %s: %s",
                        path, strerror(errno));
            (void)unlinkat(dfd, name, 0);
            path[0] = '\0';
        }
        close(fd);
    }
    close(dfd);
    return rc;
}

/* One try at reading the key: FERRY_OK, 1 (not there yet), or an error. */
static int fr_key_try_load(int port, unsigned char *key, char *path,
                           size_t pcap, fr_err_t *err)
{
    char dir[300], name[64];
    int dfd = fr_key_dir_open(0, dir, sizeof(dir), err);
    if (dfd == -1)
        return 1;
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    fr_key_name(port, name, sizeof(name));
    snprintf(path, pcap, "%s/%s", dir, name);
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    close(dfd);
    if (fd < 0)
        return errno == ENOENT ? 1
                               : FR_ERR(err, FERRY_ERR_SYSTEM,
                                        "cannot open key file %s: %s", path,
                                        strerror(errno));
    struct stat st;
    int rc = 1;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || (st.st_mode & 0777) != 0600)
        rc = FR_ERR(err, FERRY_ERR_SYSTEM,
                    "key file %s is not a private file of uid %u (owner %u, "
                    "mode %03o): refusing it",
                    path, (unsigned)geteuid(), (unsigned)st.st_uid,
                    (unsigned)(st.st_mode & 0777));
    else if (st.st_size == FR_BOOT_KEY_LEN &&
             pread(fd, key, FR_BOOT_KEY_LEN, 0) == FR_BOOT_KEY_LEN)
        rc = FERRY_OK; /* a shorter file is still being written */
    close(fd);
    return rc;
}

int fr_boot_key_load(int port, int64_t deadline,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err)
{
    char path[400] = "";
    for (;;) {
        int rc = fr_key_try_load(port, key, path, sizeof(path), err);
        if (rc <= 0)
            return rc;
        if (fr_boot_now_ms() >= deadline)
            break;
        fr_boot_sleep_ms(10);
    }
    if (!path[0]) {
        char dir[300], name[64];
        fr_key_dir_path(dir, sizeof(dir));
        fr_key_name(port, name, sizeof(name));
        snprintf(path, sizeof(path), "%s/%s", dir, name);
    }
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "FERRY_SECRET is not set and the job's key file %s did not "
                  "appear in time (is rank 0 on another host, or another "
                  "user? set FERRY_SECRET for every rank)",
                  path);
}

void fr_boot_key_remove(char *path)
{
    if (path && path[0]) {
        (void)unlink(path);
        path[0] = '\0';
    }
}
