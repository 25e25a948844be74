/* POSIX shared-memory segments: the CPU twin of peer memory over NVLink. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/rt.h"
#include "core/config.h"
#include "core/log.h"

int fr_shm_create(const char *name, size_t bytes, uint8_t **p, fr_err_t *err)
{
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "shm_open(%s): %s", name,
                      strerror(errno));
    fchmod(fd, 0600); /* whatever the umask: peers check for exactly 0600 */
    /* posix_fallocate reserves the pages now, so a /dev/shm that is too
     * small fails here with an error instead of SIGBUS mid-round. */
    int fe = posix_fallocate(fd, 0, (off_t)bytes);
    if (fe != 0) {
        close(fd);
        shm_unlink(name);
        return FR_ERR(err, FERRY_ERR_NOMEM,
                      "reserving %zu bytes of shared memory for %s: %s "
                      "(is /dev/shm large enough?)",
                      bytes, name, strerror(fe));
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(name);
        return FR_ERR(err, FERRY_ERR_NOMEM, "ftruncate(%s, %zu): %s", name,
                      bytes, strerror(e));
    }
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(name);
        return FR_ERR(err, FERRY_ERR_NOMEM, "mmap(%s, %zu): %s", name, bytes,
                      strerror(errno));
    }
    *p = (uint8_t *)m;
    FR_LOG_DEBUG(FR_SUB_SHM, "created %s (%zu bytes)", name, bytes);
    return FERRY_OK;
}

int fr_shm_map(const char *name, size_t bytes, uint8_t **p, fr_err_t *err)
{
    int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0600);
    if (fd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "shm_open(%s) of a peer: %s",
                      name, strerror(errno));
    /* Only a segment a rank of this job could have made: this user's,
     * readable by nobody else, of the size every rank computed. */
    struct stat st;
    const char *why = NULL;
    if (fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (st.st_uid != geteuid())
        why = "owned by another user";
    else if ((st.st_mode & 07777) != 0600)
        why = "its mode is not 0600";
    else if ((size_t)st.st_size != bytes)
        why = "its size is not the expected one";
    if (why) {
        close(fd);
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "peer segment %s refused: %s (uid %d, mode %04o, %lld "
                      "bytes; expected uid %d, mode 0600, %zu bytes)",
                      name, why, (int)st.st_uid, (unsigned)(st.st_mode & 07777),
                      (long long)st.st_size, (int)geteuid(), bytes);
    }
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return FR_ERR(err, FERRY_ERR_NOMEM, "mmap(%s): %s", name,
                      strerror(errno));
    *p = (uint8_t *)m;
    return FERRY_OK;
}

void fr_shm_unmap(uint8_t *p, size_t bytes)
{
    if (p)
        munmap(p, bytes);
}

void fr_shm_unlink(const char *name) { shm_unlink(name); }

/* Has process pid exited (gone, or a zombie nobody reaped yet)? */
static int fr_pid_gone(long pid)
{
    if (kill((pid_t)pid, 0) != 0)
        return errno == ESRCH; /* EPERM: alive, another user's */
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

uint64_t fr_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* The kinds of fr_shm_kind_t: name prefix and separator. */
static const struct {
    const char *prefix;
    char sep;
} fr_shm_kinds[FR_SHM_NKINDS] = {
    [FR_SHM_EP] = {"ferry-", '-'},
    [FR_SHM_FAB] = {"ferry.", '.'},
};

int fr_shm_name(char *buf, size_t cap, fr_shm_kind_t kind, const char *rest, ...)
{
    char sep = fr_shm_kinds[kind].sep;
    int n = snprintf(buf, cap, "%s%d%c%llx%c", fr_shm_kinds[kind].prefix, (int)getpid(), sep,
                     (unsigned long long)fr_pidns(), sep);
    if (n < 0 || (size_t)n >= cap)
        return -1;
    va_list ap;
    va_start(ap, rest);
    int m = vsnprintf(buf + n, cap - (size_t)n, rest, ap);
    va_end(ap);
    if (m < 0 || (size_t)m >= cap - (size_t)n)
        return -1;
    return n + m;
}

int fr_shm_owner(const char *name, long *pid, uint64_t *pidns)
{
    for (int k = 0; k < FR_SHM_NKINDS; k++) {
        size_t plen = strlen(fr_shm_kinds[k].prefix);
        char sep = fr_shm_kinds[k].sep;
        if (strncmp(name, fr_shm_kinds[k].prefix, plen) != 0)
            continue;
        const char *p = name + plen;
        if (*p < '0' || *p > '9')
            continue;
        char *end = NULL;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || *end != sep || v <= 0 || v > INT32_MAX)
            continue;
        p = end + 1;
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            continue;
        unsigned long long ns = strtoull(p, &end, 16);
        if (errno || *end != sep)
            continue;
        *pid = v;
        *pidns = ns;
        return k;
    }
    return -1;
}

/* Remove this user's entries of every kind made in this pid namespace
 * whose process is gone: every such process's, or (only_pid > 0) that
 * one's. */
static int fr_shm_sweep(long only_pid)
{
    uint64_t ns = fr_pidns();
    if (ns == 0)
        return 0; /* names of this namespace cannot be told apart */
    DIR *d = opendir("/dev/shm");
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long pid;
        uint64_t their;
        if (fr_shm_owner(e->d_name, &pid, &their) < 0)
            continue;
        /* only names made in this pid namespace: elsewhere the pid names
         * another process (or none) */
        if (their != ns || (only_pid > 0 && pid != only_pid))
            continue;
        if (!fr_pid_gone(pid))
            continue; /* alive, or not ours to ask about */
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            st.st_uid != geteuid() || !S_ISREG(st.st_mode))
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) == 0) {
            n++;
            FR_LOG_INFO(FR_SUB_SHM, "removed /dev/shm/%s left by pid %ld, "
                        "which is gone", e->d_name, pid);
        }
    }
    closedir(d);
    return n;
}

int fr_shm_sweep_dead(void)
{
    return fr_cfg_int(FR_CFG_SHM_SWEEP) == 0 ? 0 : fr_shm_sweep(0);
}

int fr_shm_sweep_pid(long pid)
{
    return pid > 0 ? fr_shm_sweep(pid) : 0;
}
