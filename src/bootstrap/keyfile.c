/*
 * The job key of a local job started without FERRY_SECRET.
 *
 * Rank 0 writes 32 random bytes, its pid and that process's start time
 * (/proc/<pid>/stat: a pid reused by another process later does not pass
 * for it), the run id it drew for this rendezvous and the job's id
 * (padded) to <folder>/ferry-<uid>-<address>-<port>-<job>.key, where
 * <address>:<port> is what it bound (two jobs on one port of two local
 * addresses never share a file) and <job> is 16 hex digits of SHA-256 of
 * the job's id (env.c: FERRY_JOB_ID, the launcher's job id, else the parent
 * process), so two jobs of one user on one port never read each other's
 * key. The file is written before rank 0 accepts anyone; rank 0's
 * challenge names the job's hash and the run id, so a rank that reads it
 * on the challenge knows at once whether the root is of its job, whether
 * the file it found is this run's (and not a stale one of the same name),
 * and whether its key folder is rank 0's. Rank 0 removes the file when
 * everyone has arrived, or when the rendezvous fails, and only while the
 * name still refers to the file it made (device and inode). An existing
 * file of the same name is removed only after the bind proved the address
 * and port are this job's, and only when its creator is gone (pid and
 * start time). A live key file of another job on the port fails a rank at
 * once, naming the port and that job's rank 0.
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
#include <time.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "hmac.h"
#include "keyfile.h"
#include "tcp.h"

/* The file: the key, its creator's pid (4 bytes, then 4 of zeros) and
 * start time (8), the run id, the job's id ('\0'-padded). */
#define FR_KEY_JOB_LEN 160
#define FR_KEY_OFF_PID FR_BOOT_KEY_LEN
#define FR_KEY_OFF_START (FR_KEY_OFF_PID + 8)
#define FR_KEY_OFF_RUN (FR_KEY_OFF_START + 8)
#define FR_KEY_OFF_JOB (FR_KEY_OFF_RUN + FR_BOOT_RUN_LEN)
#define FR_KEY_FILE_LEN (FR_KEY_OFF_JOB + FR_KEY_JOB_LEN)
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

void fr_boot_key_job_hash(const fr_boot_env_t *env,
                          unsigned char out[FR_BOOT_JOB_HASH_LEN])
{
    unsigned char h[FR_SHA256_LEN];
    fr_sha256(env->job, strlen(env->job), h);
    memcpy(out, h, FR_BOOT_JOB_HASH_LEN);
}

/* 16 hex digits of a job's hash. */
static void fr_key_hex(const unsigned char *h, char *out)
{
    for (int i = 0; i < FR_BOOT_JOB_HASH_LEN; i++)
        snprintf(out + 2 * i, 3, "%02x", h[i]);
}

static void fr_key_name(const fr_boot_env_t *env, const char *addr, int port,
                        char *name, size_t cap)
{
    unsigned char h[FR_BOOT_JOB_HASH_LEN];
    char hex[2 * FR_BOOT_JOB_HASH_LEN + 1], pre[96];
    fr_boot_key_job_hash(env, h);
    fr_key_hex(h, hex);
    fr_key_prefix(addr, port, pre, sizeof(pre));
    snprintf(name, cap, "%s%s.key", pre, hex);
}

uint64_t fr_boot_proc_start(int pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    /* After the command's ')': state is field 3, start time field 22. */
    char *p = strrchr(buf, ')');
    for (int f = 2; p && f < 22; f++)
        p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* pid is a live process (of any user) and, when start is known, the one
 * that started then (not a later process given the same pid). */
static int fr_pid_alive(int32_t pid, uint64_t start)
{
    if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM))
        return 0;
    uint64_t now = start ? fr_boot_proc_start(pid) : 0;
    return !start || !now || now == start;
}

/* What a key file says besides the key. */
typedef struct fr_key_meta {
    int32_t pid;
    uint64_t start;
    unsigned char run[FR_BOOT_RUN_LEN];
    char job[FR_KEY_JOB_LEN + 1];
} fr_key_meta_t;

/* Read the metadata of key file fd (a private regular file of this user of
 * the right size). 0, or -1. */
static int fr_key_read_meta(int fd, fr_key_meta_t *m)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || st.st_size != FR_KEY_FILE_LEN ||
        pread(fd, &m->pid, 4, FR_KEY_OFF_PID) != 4 ||
        pread(fd, &m->start, 8, FR_KEY_OFF_START) != 8 ||
        pread(fd, m->run, FR_BOOT_RUN_LEN, FR_KEY_OFF_RUN) !=
            FR_BOOT_RUN_LEN ||
        pread(fd, m->job, FR_KEY_JOB_LEN, FR_KEY_OFF_JOB) != FR_KEY_JOB_LEN)
        return -1;
    m->job[FR_KEY_JOB_LEN] = '\0';
    return 0;
}

/* A live key file on addr:port in folder dfd other than the one named
 * mine (NULL: any but this process's): 1 with its name and metadata. */
static int fr_key_find_other(int dfd, const char *addr, int port,
                             const char *mine, char *name, size_t ncap,
                             fr_key_meta_t *m)
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
        if (fr_key_read_meta(fd, m) == 0 && m->pid != (int32_t)getpid() &&
            fr_pid_alive(m->pid, m->start)) {
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
                            const fr_key_meta_t *m, fr_err_t *err)
{
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "port %s:%d is taken by another ferry job of this user "
                  "(its rank 0 is pid %d, job '%s', key file %s/%s); this "
                  "rank's job is '%s' (from %s). Give this job another "
                  "FERRY_ROOT port; or, if both are one job, give every rank "
                  "the same %s (or %s)",
                  addr, port, (int)m->pid, m->job, dir, name, env->job,
                  env->job_from ? env->job_from : "?",
                  fr_cfg_name(FR_CFG_JOB_ID), fr_cfg_name(FR_CFG_SECRET));
}

int fr_boot_key_port_taken(const fr_boot_env_t *env, const char *addr,
                           int port, fr_err_t *err)
{
    char dir[300], name[256];
    fr_key_meta_t m;
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), NULL);
    if (dfd < 0)
        return FERRY_OK;
    int rc = FERRY_OK;
    if (fr_key_find_other(dfd, addr, port, NULL, name, sizeof(name), &m))
        rc = fr_key_err_taken(env, dir, name, addr, port, &m, err);
    close(dfd);
    return rc;
}

/* An existing file of this name that was left by a job that died: this rank
 * holds its address and port now. Removed (0) only when it is a file of
 * this user whose creator is gone; else -1, err set. */
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
    fr_key_meta_t m = {0};
    int stale = fstat(fd, &st) == 0 && fr_key_read_meta(fd, &m) == 0 &&
                m.pid != (int32_t)getpid() && !fr_pid_alive(m.pid, m.start);
    close(fd);
    if (!stale)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "key file %s/%s already exists and is not a stale one "
                      "of this user (its creator, pid %d, is alive or "
                      "unknown): another job with this job's id is "
                      "starting on this port; remove the file, or set "
                      "FERRY_JOB_ID or FERRY_SECRET",
                      dir, name, (int)m.pid);
    if (fstatat(dfd, name, &now, AT_SYMLINK_NOFOLLOW) == 0 &&
        now.st_dev == st.st_dev && now.st_ino == st.st_ino)
        (void)unlinkat(dfd, name, 0);
    return 0;
}

/* Fill key file fd: a fresh key and run id, this process's pid and start
 * time, the job's id. 0, or -1 (errno set). */
static int fr_key_write(int fd, const fr_boot_env_t *env,
                        unsigned char key[FR_BOOT_KEY_LEN],
                        unsigned char run[FR_BOOT_RUN_LEN])
{
    unsigned char buf[FR_KEY_FILE_LEN];
    int32_t pid = (int32_t)getpid();
    uint64_t start = fr_boot_proc_start(pid);
    memset(buf, 0, sizeof(buf));
    if (fchmod(fd, 0600) != 0 || fr_boot_random(key, FR_BOOT_KEY_LEN) != 0 ||
        fr_boot_random(run, FR_BOOT_RUN_LEN) != 0)
        return -1;
    memcpy(buf, key, FR_BOOT_KEY_LEN);
    memcpy(buf + FR_KEY_OFF_PID, &pid, 4);
    memcpy(buf + FR_KEY_OFF_START, &start, 8);
    memcpy(buf + FR_KEY_OFF_RUN, run, FR_BOOT_RUN_LEN);
    size_t jl = strlen(env->job);
    memcpy(buf + FR_KEY_OFF_JOB, env->job,
           jl < FR_KEY_JOB_LEN ? jl : FR_KEY_JOB_LEN - 1);
    ssize_t w = write(fd, buf, sizeof(buf));
    fr_boot_wipe(buf, sizeof(buf));
    if (w >= 0 && w != FR_KEY_FILE_LEN)
        errno = EIO;
    return w == FR_KEY_FILE_LEN ? 0 : -1;
}

int fr_boot_key_create(const fr_boot_env_t *env, const char *addr, int port,
                       unsigned char key[FR_BOOT_KEY_LEN],
                       unsigned char run[FR_BOOT_RUN_LEN], fr_keyfile_t *kf,
                       fr_err_t *err)
{
    char dir[300], name[256];
    kf->path[0] = kf->failed[0] = '\0';
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
    struct stat st;
    if (fd < 0) {
        rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot create key file %s/%s: %s",
                    dir, name, strerror(errno));
    } else if (fstat(fd, &st) != 0 || fr_key_write(fd, env, key, run) != 0) {
        rc = FR_ERR(err, FERRY_ERR_SYSTEM, "cannot write key file %s/%s: %s",
                    dir, name, strerror(errno));
        (void)unlinkat(dfd, name, 0);
    } else {
        snprintf(kf->path, sizeof(kf->path), "%s/%s", dir, name);
        snprintf(kf->failed, sizeof(kf->failed), "%s.failed", kf->path);
        (void)unlink(kf->failed); /* an earlier run's */
        kf->dev = st.st_dev;
        kf->ino = st.st_ino;
    }
    if (fd >= 0)
        close(fd);
    close(dfd);
    return rc;
}

/* One look at key file name in folder dfd: FERRY_OK with the key when it is
 * there, private, whole and of run `run`; 1 when absent; 2 when it is of
 * another run (m: what it says); else an error. */
static int fr_key_try_load(int dfd, const char *path, const char *name,
                           const unsigned char *run, unsigned char *key,
                           fr_key_meta_t *m, fr_err_t *err)
{
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 1
                               : FR_ERR(err, FERRY_ERR_SYSTEM,
                                        "cannot open key file %s: %s", path,
                                        strerror(errno));
    struct stat st;
    int rc;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != geteuid() || (st.st_mode & 0777) != 0600)
        rc = FR_ERR(err, FERRY_ERR_SYSTEM,
                    "key file %s is not a private file of uid %u (owner %u, "
                    "mode %03o): refusing it",
                    path, (unsigned)geteuid(), (unsigned)st.st_uid,
                    (unsigned)(st.st_mode & 0777));
    else if (fr_key_read_meta(fd, m) != 0)
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                    "key file %s is not a ferry key file of this version "
                    "(%lld bytes)",
                    path, (long long)st.st_size);
    else if (memcmp(m->run, run, FR_BOOT_RUN_LEN) != 0)
        rc = 2;
    else
        rc = pread(fd, key, FR_BOOT_KEY_LEN, 0) == FR_BOOT_KEY_LEN
                 ? FERRY_OK
                 : FR_ERR(err, FERRY_ERR_SYSTEM, "cannot read key file %s: %s",
                          path, strerror(errno));
    close(fd);
    return rc;
}

/* The root's challenge names another job than this rank's: say which. */
static int fr_key_err_other_job(const fr_boot_env_t *env, int dfd,
                                const char *dir, const char *addr, int port,
                                const fr_challenge_t *ch, fr_err_t *err)
{
    char name[256], theirs[2 * FR_BOOT_JOB_HASH_LEN + 1];
    fr_key_meta_t m;
    if (fr_key_find_other(dfd, addr, port, NULL, name, sizeof(name), &m) ||
        fr_key_find_other(dfd, "0.0.0.0", port, NULL, name, sizeof(name),
                          &m))
        return fr_key_err_taken(env, dir, name, addr, port, &m, err);
    fr_key_hex(ch->job, theirs);
    return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                  "port %s:%d is taken by another ferry job (its rank 0 is "
                  "pid %d, job hash %s; its key file is gone, or not in "
                  "this rank's key folder %s); this rank's job is '%s' "
                  "(from %s). Give "
                  "this job another FERRY_ROOT port; or, if both are one "
                  "job, give every rank the same %s and %s (or %s)",
                  addr, port, (int)ch->root_pid, theirs, dir, env->job,
                  env->job_from ? env->job_from : "?",
                  fr_cfg_name(FR_CFG_JOB_ID), fr_cfg_name(FR_CFG_KEY_DIR),
                  fr_cfg_name(FR_CFG_SECRET));
}

int fr_boot_key_load(const fr_boot_env_t *env, const char *addr, int port,
                     const fr_challenge_t *ch,
                     unsigned char key[FR_BOOT_KEY_LEN], fr_err_t *err)
{
    if (ch->keysrc != FR_KEYSRC_FILE)
        return FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                      "root %s:%d (pid %d) proves the job with %s, and this "
                      "rank has none: give every rank the same %s",
                      addr, port, (int)ch->root_pid,
                      fr_cfg_name(FR_CFG_SECRET), fr_cfg_name(FR_CFG_SECRET));
    char dir[300], name[2][256], path[2][600];
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), err);
    if (dfd < 0)
        return FERRY_ERR_SYSTEM;
    unsigned char mine[FR_BOOT_JOB_HASH_LEN];
    fr_boot_key_job_hash(env, mine);
    int rc;
    if (memcmp(mine, ch->job, sizeof(mine)) != 0) {
        rc = fr_key_err_other_job(env, dfd, dir, addr, port, ch, err);
        close(dfd);
        return rc;
    }
    /* A root told to listen on every address names its file 0.0.0.0. */
    const char *addrs[2] = {addr, "0.0.0.0"};
    int nn = strcmp(addr, "0.0.0.0") ? 2 : 1, other = -1;
    fr_key_meta_t m, om = {0};
    for (int i = 0; i < nn; i++) {
        fr_key_name(env, addrs[i], port, name[i], sizeof(name[i]));
        snprintf(path[i], sizeof(path[i]), "%s/%s", dir, name[i]);
        rc = fr_key_try_load(dfd, path[i], name[i], ch->run, key, &m, err);
        if (rc <= 0)
            goto out;
        if (rc == 2 && other < 0) {
            other = i;
            om = m;
        }
    }
    /* The root wrote its file before it accepted this connection, and
     * removes it on failure after saying why. */
    char failed[FR_ERRMSG_LEN];
    if (fr_boot_key_failed(env, addr, port, failed, sizeof(failed)))
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP, "%s", failed);
    else if (other >= 0)
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                    "key file %s is not the one rank 0 (pid %d) of this job "
                    "made for this rendezvous (it is of another run, made "
                    "by pid %d: a file left behind, or rank 0 uses another "
                    "key folder): give every rank the same %s (or set %s)",
                    path[other], (int)ch->root_pid, (int)om.pid,
                    fr_cfg_name(FR_CFG_KEY_DIR), fr_cfg_name(FR_CFG_SECRET));
    else
        rc = FR_ERR(err, FERRY_ERR_BOOTSTRAP,
                    "rank 0 (pid %d) of this job (job '%s' from %s) made its "
                    "key file, but not in this rank's key folder %s (no %s): "
                    "rank 0 uses another folder; give every rank the same "
                    "%s (or XDG_RUNTIME_DIR, TMPDIR and HOME), or set %s",
                    (int)ch->root_pid, env->job,
                    env->job_from ? env->job_from : "?", dir, name[0],
                    fr_cfg_name(FR_CFG_KEY_DIR), fr_cfg_name(FR_CFG_SECRET));
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

/* Milliseconds since boot (CLOCK_BOOTTIME: process start times count from
 * there too). */
static int64_t fr_key_boot_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A failure note: its writer's pid, when (fr_key_boot_ms), why. */
typedef struct fr_key_note {
    int32_t pid;
    int32_t pad;
    int64_t when;
    char why[FR_ERRMSG_LEN];
} fr_key_note_t;

void fr_boot_key_note_failure(const fr_keyfile_t *kf, const char *why)
{
    if (!kf || !kf->failed[0])
        return;
    fr_key_note_t n;
    memset(&n, 0, sizeof(n));
    n.pid = (int32_t)getpid();
    n.when = fr_key_boot_ms();
    snprintf(n.why, sizeof(n.why), "%s", why);
    int fd = open(kf->failed,
                  O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    (void)!write(fd, &n, sizeof(n));
    close(fd);
}

int fr_boot_key_failed(const fr_boot_env_t *env, const char *addr, int port,
                       char *why, size_t cap)
{
    char dir[300], name[300];
    int dfd = fr_key_dir_pick(1, dir, sizeof(dir), NULL);
    if (dfd < 0)
        return 0;
    long hz = sysconf(_SC_CLK_TCK);
    int64_t born = (int64_t)fr_boot_proc_start((int)getpid()) * 1000 /
                   (hz > 0 ? hz : 100);
    const char *addrs[2] = {addr, "0.0.0.0"};
    int found = 0;
    for (int i = 0; i < 2 && !found; i++) {
        fr_key_name(env, addrs[i], port, name, sizeof(name) - 8);
        strcat(name, ".failed");
        int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
            continue;
        fr_key_note_t n;
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            st.st_uid == geteuid() &&
            read(fd, &n, sizeof(n)) == (ssize_t)sizeof(n) && born > 0 &&
            n.when >= born) {
            n.why[sizeof(n.why) - 1] = '\0';
            snprintf(why, cap, "rank 0 (pid %d) failed this job's "
                               "rendezvous %lld ms ago: %s",
                     (int)n.pid, (long long)(fr_key_boot_ms() - n.when),
                     n.why);
            found = 1;
        }
        close(fd);
    }
    close(dfd);
    return found;
}
