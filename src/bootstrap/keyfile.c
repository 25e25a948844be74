/*
 * The job key of a local job started without FERRY_SECRET: rank 0 writes
 * 32 random bytes, then its pid (4 bytes), to
 * <dir>/ferry-<uid>-<address>-<port>.key (the address and port it bound,
 * so two jobs on one port of two local addresses never share a file),
 * where <dir> is
 * $XDG_RUNTIME_DIR/ferry or /tmp/ferry-<uid>, a directory of this user
 * with no access for anyone else; the file is created exclusively with
 * mode 0600, no symbolic link is followed on the way, and owner and mode
 * of both are checked on the open descriptors. The other ranks read it
 * (same checks) once the root has answered their connection, waiting for
 * it within the bootstrap deadline; rank 0 removes it when everyone has
 * arrived, or when the rendezvous fails, and only while the name still
 * refers to the file it made (device and inode). An existing file is
 * removed only after the bind proved the address and port are this job's,
 * and only when its creator's pid is gone. Another user cannot read the
 * key, so cannot pass the handshake nor pose as the root.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
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

/* The file's size: the key, then its creator's pid. */
#define FR_KEY_FILE_LEN (FR_BOOT_KEY_LEN + 4)

static void fr_key_name(const char *addr, int port, char *name, size_t cap)
{
    snprintf(name, cap, "ferry-%u-%s-%d.key", (unsigned)geteuid(), addr,
             port);
}

/* An existing file of this name that was left by a job that died: this rank
 * holds its address and port now. Removed (0) only when it is a file of
 * this user whose creator's pid is gone; else -1, err set. */
static int fr_key_clear_stale(int dfd, const char *dir, const char *name,
                              fr_err_t *err)
{
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0
                               : FR_ERR(err, FERRY_ERR_SYSTEM,
                                        "cannot open the old key file %s/%s: "
                                        "%s",
                                        dir, name, strerror(errno));
    struct stat st, now;
    int32_t pid = 0;
    int stale = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                st.st_uid == geteuid() && st.st_size == FR_KEY_FILE_LEN &&
                pread(fd, &pid, 4, FR_BOOT_KEY_LEN) == 4 && pid > 0 &&
                pid != (int32_t)getpid() && kill(pid, 0) != 0 &&
                errno == ESRCH;
    close(fd);
    if (!stale)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "key file %s/%s already exists and is not a stale one "
                      "of this user (its creator, pid %d, is alive or "
                      "unknown): remove it, or set FERRY_SECRET",
                      dir, name, (int)pid);
    if (fstatat(dfd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        now.st_dev == st.st_dev && now.st_ino == st.st_ino)
        (void)unlinkat(dfd, name, 0);
    return 0;
}

int fr_boot_key_create(const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN], fr_keyfile_t *kf,
                       fr_err_t *err)
{
    char dir[300], name[96];
    kf->path[0] = '\0';
    int dfd = fr_key_dir_open(1, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    fr_key_name(addr, port, name, sizeof(name));
    int fd = openat(dfd, name,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
        if (fr_key_clear_stale(dfd, dir, name, err) != 0) {
            close(dfd);
            return FERRY_ERR_BOOTSTRAP;
        }
        fd = openat(dfd, name,
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                    0600);
    }
    int rc = FERRY_OK;
    if (fd < 0) {
        rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot create key file %s/%s: %s",
                    dir, name, strerror(errno));
    } else {
        snprintf(kf->path, sizeof(kf->path), "%s/%s", dir, name);
        unsigned char buf[FR_KEY_FILE_LEN];
        int32_t pid = (int32_t)getpid();
        struct stat st;
        ssize_t w = -1;
        if (fstat(fd, &st) == 0 && fchmod(fd, 0600) == 0 &&
            fr_boot_random(key, FR_BOOT_KEY_LEN) == 0) {
            memcpy(buf, key, FR_BOOT_KEY_LEN);
            memcpy(buf + FR_BOOT_KEY_LEN, &pid, 4);
            w = write(fd, buf, sizeof(buf));
            fr_boot_wipe(buf, sizeof(buf));
        }
        if (w != FR_KEY_FILE_LEN) {
            rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot write key file %s: %s",
                        kf->path, strerror(errno));
            (void)unlinkat(dfd, name, 0);
            kf->path[0] = '\0';
        } else {
            kf->dev = st.st_dev;
            kf->ino = st.st_ino;
        }
        close(fd);
    }
    close(dfd);
    return rc;
}

/* One try at reading the key: FERRY_OK, 1 (not there yet), or an error. */
static int fr_key_try_load(const char *addr, int port, unsigned char *key,
                           char *path, size_t pcap, fr_err_t *err)
{
    char dir[300], name[96];
    int dfd = fr_key_dir_open(0, dir, sizeof(dir), err);
    if (dfd == -1)
        return 1;
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    fr_key_name(addr, port, name, sizeof(name));
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
    else if (st.st_size == FR_KEY_FILE_LEN &&
             pread(fd, key, FR_BOOT_KEY_LEN, 0) == FR_BOOT_KEY_LEN)
        rc = FERRY_OK; /* a shorter file is still being written */
    close(fd);
    return rc;
}

int fr_boot_key_load(const char *addr, int port, int64_t deadline,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err)
{
    char path[400] = "";
    /* A root told to listen on every address names its file 0.0.0.0. */
    const char *names[2] = {addr, "0.0.0.0"};
    int nn = strcmp(addr, "0.0.0.0") ? 2 : 1;
    for (;;) {
        for (int i = 0; i < nn; i++) {
            char p[400];
            int rc = fr_key_try_load(names[i], port, key, p, sizeof(p), err);
            if (rc <= 0)
                return rc;
            if (i == 0)
                snprintf(path, sizeof(path), "%s", p);
        }
        if (fr_boot_now_ms() >= deadline)
            break;
        fr_boot_sleep_ms(10);
    }
    if (!path[0]) {
        char dir[300], name[96];
        fr_key_dir_path(dir, sizeof(dir));
        fr_key_name(addr, port, name, sizeof(name));
        snprintf(path, sizeof(path), "%s/%s", dir, name);
    }
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "FERRY_SECRET is not set and the job's key file %s did not "
                  "appear in time (is rank 0 on another host, or another "
                  "user? set FERRY_SECRET for every rank)",
                  path);
}

void fr_boot_key_remove(fr_keyfile_t *kf)
{
    struct stat st;
    if (kf && kf->path[0] && lstat(kf->path, &st) == 0 &&
        st.st_dev == kf->dev && st.st_ino == kf->ino)
        (void)unlink(kf->path);
    if (kf)
        kf->path[0] = '\0';
}
