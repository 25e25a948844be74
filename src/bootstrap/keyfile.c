/*
 * The job key of a local job started without FERRY_SECRET.
 *
 * Rank 0 writes 32 random bytes, its pid (4 bytes) and the job's id
 * (padded) to <folder>/ferry-<uid>-<address>-<port>-<job>.key, where
 * <address>:<port> is what it bound (two jobs on one port of two local
 * addresses never share a file) and <job> is 16 hex digits of SHA-256 of
 * the job's id (env.c: FERRY_JOB_ID, the launcher's job id, else the parent
 * process), so two jobs of one user on one port never read each other's
 * key. The other ranks read it (same checks) once the root has answered
 * their connection, waiting for it within the bootstrap deadline; rank 0
 * removes it when everyone has arrived, or when the rendezvous fails, and
 * only while the name still refers to the file it made (device and
 * inode). An existing file of the same name is removed only after the
 * bind proved the address and port are this job's, and only when its
 * creator's pid is gone. A live key file of another job on the port fails
 * a rank at once, naming the port and that job's rank 0.
 *
 * <folder> is FERRY_KEY_DIR, else the first usable of
 * $XDG_RUNTIME_DIR/ferry, $TMPDIR/ferry-<uid> (/tmp when TMPDIR is unset)
 * and $HOME/.ferry: a directory of this user with no access for anyone
 * else, created if absent; one that is not (another user made it first,
 * a symbolic link, a file) is skipped with a warning, and every rank
 * walks the same list, so they agree. The file is created exclusively with
 * mode 0600, no symbolic link is followed on the way, and owner and mode of
 * both are checked on the open descriptors. Another user cannot read the
 * key, so cannot pass the handshake nor pose as the root.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "keyfile.h"
#include "tcp.h"

/* The file: the key, its creator's pid, the job's id ('\0'-padded). */
#define FR_KEY_JOB_LEN 188
#define FR_KEY_FILE_LEN (FR_BOOT_KEY_LEN + 4 + FR_KEY_JOB_LEN)
#define FR_KEY_DIRS 3

/* The folders to try, in order; their count. */
static int fr_key_candidates(char dirs[FR_KEY_DIRS][300])
{
    const char *forced = fr_cfg_str(FR_CFG_KEY_DIR);
    if (forced && *forced) {
        snprintf(dirs[0], sizeof(dirs[0]), "%s", forced);
        return 1;
    }
    int n = 0;
    const char *x = getenv("XDG_RUNTIME_DIR");
    if (x && x[0] == '/')
        snprintf(dirs[n++], sizeof(dirs[0]), "%s/ferry", x);
    const char *t = getenv("TMPDIR");
    snprintf(dirs[n++], sizeof(dirs[0]), "%s/ferry-%u",
             t && t[0] == '/' ? t : "/tmp", (unsigned)geteuid());
    const char *h = getenv("HOME");
    if (h && h[0] == '/')
        snprintf(dirs[n++], sizeof(dirs[0]), "%s/.ferry", h);
    return n;
}

/* Open folder dir, creating it if absent, checked: a directory of this
 * user, no access for group and others. Its descriptor, or -1 (why set). */
static int fr_key_dir_try(const char *dir, char *why, size_t wcap)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(why, wcap, "cannot create it: %s", strerror(errno));
        return -1;
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) {
        snprintf(why, wcap, "cannot open it as a folder (a symbolic link "
                            "is not followed): %s",
                 strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(dfd, &st) != 0 || st.st_uid != geteuid() ||
        (st.st_mode & 077) != 0) {
        snprintf(why, wcap, "not private to uid %u (owner %u, mode %03o)",
                 (unsigned)geteuid(), (unsigned)st.st_uid,
                 (unsigned)(st.st_mode & 0777));
        close(dfd);
        return -1;
    }
    return dfd;
}

/* The job's key folder, opened (dir: its path), or -1 with err naming each
 * place tried. Unusable places before it are logged (quiet: not again). */
static int fr_key_dir_pick(int quiet, char *dir, size_t cap, fr_err_t *err)
{
    char dirs[FR_KEY_DIRS][300], why[FR_KEY_DIRS][160];
    int n = fr_key_candidates(dirs);
    for (int i = 0; i < n; i++) {
        int dfd = fr_key_dir_try(dirs[i], why[i], sizeof(why[i]));
        if (dfd < 0) {
            if (!quiet)
                FR_LOG_WARN(FR_SUB_BOOT, "key folder %s is not usable: %s%s",
                            dirs[i], why[i],
                            i + 1 < n ? "; trying the next" : "");
            continue;
        }
        snprintf(dir, cap, "%.299s", dirs[i]);
        return dfd;
    }
    char list[3 * 480] = "";
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof(list); i++)
        off += (size_t)snprintf(list + off, sizeof(list) - off, "%s%s: %s",
                                i ? "; " : "", dirs[i], why[i]);
    FR_ERR(err, FERRY_ERR_SYSTEM,
           "no private folder for the job's key file (%.300s): set %s to a "
           "folder only this user can enter, or set %s",
           list, fr_cfg_name(FR_CFG_KEY_DIR), fr_cfg_name(FR_CFG_SECRET));
    return -1;
}

int fr_boot_key_check_dir(fr_err_t *err)
{
    char dir[300];
    int dfd = fr_key_dir_pick(0, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    close(dfd);
    return FERRY_OK;
}

/* "ferry-<uid>-<addr>-<port>-" (every job's files on that port). */
static void fr_key_prefix(const char *addr, int port, char *out, size_t cap)
{
    snprintf(out, cap, "ferry-%u-%s-%d-", (unsigned)geteuid(), addr, port);
}

static void fr_key_name(const fr_boot_env_t *env, const char *addr, int port,
                        char *name, size_t cap)
{
    unsigned char h[FR_SHA256_LEN];
    fr_sha256(env->job, strlen(env->job), h);
    char pre[96];
    fr_key_prefix(addr, port, pre, sizeof(pre));
    snprintf(name, cap,
             "%s%02x%02x%02x%02x%02x%02x%02x%02x.key", pre, h[0], h[1], h[2],
             h[3], h[4], h[5], h[6], h[7]);
}

/* pid is a live process (of any user). */
static int fr_pid_alive(int32_t pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* Read the pid and job id of key file fd (a private regular file of this
 * user of the right size). 0, or -1. */
static int fr_key_read_meta(int fd, int32_t *pid, char *job, size_t jcap)
{
    struct stat st;
    char j[FR_KEY_JOB_LEN + 1];
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || st.st_size != FR_KEY_FILE_LEN ||
        pread(fd, pid, 4, FR_BOOT_KEY_LEN) != 4 ||
        pread(fd, j, FR_KEY_JOB_LEN, FR_BOOT_KEY_LEN + 4) != FR_KEY_JOB_LEN)
        return -1;
    j[FR_KEY_JOB_LEN] = '\0';
    snprintf(job, jcap, "%s", j);
    return 0;
}

/* A live key file on addr:port in folder dfd other than the one named
 * mine (NULL: any but this process's): 1 with its name, pid and job. */
static int fr_key_find_other(int dfd, const char *addr, int port,
                             const char *mine, char *name, size_t ncap,
                             int32_t *pid, char *job, size_t jcap)
{
    char pre[96];
    fr_key_prefix(addr, port, pre, sizeof(pre));
    size_t pl = strlen(pre);
    int d2 = dup(dfd);
    DIR *d = d2 >= 0 ? fdopendir(d2) : NULL;
    if (!d) {
        if (d2 >= 0)
            close(d2);
        return 0;
    }
    rewinddir(d);
    int found = 0;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        size_t nl = strlen(e->d_name);
        if (strncmp(e->d_name, pre, pl) || nl < pl + 4 ||
            strcmp(e->d_name + nl - 4, ".key") ||
            (mine && !strcmp(e->d_name, mine)))
            continue;
        int fd = openat(dfd, e->d_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            continue;
        if (fr_key_read_meta(fd, pid, job, jcap) == 0 &&
            *pid != (int32_t)getpid() && fr_pid_alive(*pid)) {
            snprintf(name, ncap, "%s", e->d_name);
            found = 1;
        }
        close(fd);
    }
    closedir(d);
    return found;
}

/* The error for a port that another live job holds. */
static int fr_key_err_taken(const fr_boot_env_t *env, const char *dir,
                            const char *name, const char *addr, int port,
                            int32_t pid, const char *job, fr_err_t *err)
{
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "port %s:%d is taken by another ferry job of this user "
                  "(its rank 0 is pid %d, job '%s', key file %s/%s); this "
                  "rank's job is '%s' (from %s). Give this job another "
                  "FERRY_ROOT port; or, if both are one job, give every rank "
                  "the same %s (or %s)",
                  addr, port, (int)pid, job, dir, name, env->job,
                  env->job_from ? env->job_from : "?",
                  fr_cfg_name(FR_CFG_JOB_ID), fr_cfg_name(FR_CFG_SECRET));
}

int fr_boot_key_port_taken(const fr_boot_env_t *env, const char *addr,
                           int port, fr_err_t *err)
{
    char dir[300], name[256], job[FR_KEY_JOB_LEN + 1];
    int32_t pid = 0;
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), NULL);
    if (dfd < 0)
        return FERRY_OK;
    int rc = FERRY_OK;
    if (fr_key_find_other(dfd, addr, port, NULL, name, sizeof(name), &pid,
                          job, sizeof(job)))
        rc = fr_key_err_taken(env, dir, name, addr, port, pid, job, err);
    close(dfd);
    return rc;
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
    char job[FR_KEY_JOB_LEN + 1];
    int stale = fstat(fd, &st) == 0 &&
                fr_key_read_meta(fd, &pid, job, sizeof(job)) == 0 &&
                pid != (int32_t)getpid() && !fr_pid_alive(pid);
    close(fd);
    if (!stale)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "key file %s/%s already exists and is not a stale one "
                      "of this user (its creator, pid %d, is alive or "
                      "unknown): another job with this job's id is "
                      "starting on this port; remove the file, or set "
                      "FERRY_JOB_ID or FERRY_SECRET",
                      dir, name, (int)pid);
    if (fstatat(dfd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        now.st_dev == st.st_dev && now.st_ino == st.st_ino)
        (void)unlinkat(dfd, name, 0);
    return 0;
}

int fr_boot_key_create(const fr_boot_env_t *env, const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN], fr_keyfile_t *kf,
                       fr_err_t *err)
{
    char dir[300], name[256];
    kf->path[0] = '\0';
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    fr_key_name(env, addr, port, name, sizeof(name));
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
        memset(buf, 0, sizeof(buf));
        if (fstat(fd, &st) == 0 && fchmod(fd, 0600) == 0 &&
            fr_boot_random(key, FR_BOOT_KEY_LEN) == 0) {
            memcpy(buf, key, FR_BOOT_KEY_LEN);
            memcpy(buf + FR_BOOT_KEY_LEN, &pid, 4);
            size_t jl = strlen(env->job);
            memcpy(buf + FR_BOOT_KEY_LEN + 4, env->job,
                   jl < FR_KEY_JOB_LEN ? jl : FR_KEY_JOB_LEN - 1);
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

/* One try at reading the key from folder dfd: FERRY_OK, 1 (not there
 * yet), or an error. */
static int fr_key_try_load(int dfd, const char *path, const char *name,
                           unsigned char *key, fr_err_t *err)
{
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
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

int fr_boot_key_load(const fr_boot_env_t *env, const char *addr, int port,
                     int64_t deadline, unsigned char key[FR_BOOT_KEY_LEN],
                     fr_err_t *err)
{
    char dir[300], name[2][256], path[2][600];
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    /* A root told to listen on every address names its file 0.0.0.0. */
    const char *addrs[2] = {addr, "0.0.0.0"};
    int nn = strcmp(addr, "0.0.0.0") ? 2 : 1;
    for (int i = 0; i < nn; i++) {
        fr_key_name(env, addrs[i], port, name[i], sizeof(name[i]));
        snprintf(path[i], sizeof(path[i]), "%s/%s", dir, name[i]);
    }
    int rc = FERRY_ERR_BOOTSTRAP;
    for (int64_t check = 0;;) {
        for (int i = 0; i < nn; i++) {
            rc = fr_key_try_load(dfd, path[i], name[i], key, err);
            if (rc <= 0)
                goto out;
        }
        /* Not there yet: is the port another job's? (every 100 ms) */
        if (fr_boot_now_ms() >= check) {
            char other[256], job[FR_KEY_JOB_LEN + 1];
            int32_t pid;
            for (int i = 0; i < nn; i++)
                if (fr_key_find_other(dfd, addrs[i], port, name[i], other,
                                      sizeof(other), &pid, job,
                                      sizeof(job))) {
                    rc = fr_key_err_taken(env, dir, other, addrs[i], port,
                                          pid, job, err);
                    goto out;
                }
            check = fr_boot_now_ms() + 100;
        }
        if (fr_boot_now_ms() >= deadline)
            break;
        fr_boot_sleep_ms(10);
    }
    rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                "FERRY_SECRET is not set and this job's key file %s did not "
                "appear in time (job '%s' from %s: is rank 0 on another "
                "host, another user, or started by another launcher? give "
                "every rank the same %s, or set FERRY_SECRET)",
                path[0], env->job, env->job_from ? env->job_from : "?",
                fr_cfg_name(FR_CFG_JOB_ID));
out:
    close(dfd);
    return rc;
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
