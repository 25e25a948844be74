/* POSIX shared-memory segments: the CPU twin of peer memory over NVLink. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/rt.h"
#include "core/log.h"

int fr_shm_create(const char *name, size_t bytes, uint8_t **p, fr_err_t *err)
{
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "shm_open(%s): %s", name,
                      strerror(errno));
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
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM, "shm_open(%s) of a peer: %s",
                      name, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < bytes) {
        close(fd);
        return FR_ERR(err, FERRY_ERR_PROTOCOL,
                      "peer segment %s is smaller than %zu bytes", name, bytes);
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
