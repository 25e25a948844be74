/*
 * The runtime: what the EP, its engines, the proxies and put-with-signal
 * share below the API. Clock, backoff, proxy idling and joining, the
 * doorbell futex in a receive segment, POSIX shared-memory segments.
 * Depends only on src/core.
 */
#ifndef FR_RT_H
#define FR_RT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

uint64_t fr_now_ns(void);

static inline void fr_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spin/yield/sleep backoff shared by every waiting loop. */
void fr_backoff(uint64_t *iter, long spin);

/* A proxy thread's longest nap (FERRY_PROXY_IDLE_US; 0 for GPU producers
 * unless set), and one step of its idle backoff after a pass with nothing
 * to do: spin a little, yield, then nap (manual-progress providers still
 * need it back). Reset *idle to 0 after a pass with work. */
long fr_proxy_idle_us(int gpu);
void fr_proxy_idle(uint64_t *idle, long idle_us);
/* Stop a proxy thread: set *stop, join within ms. 0: joined. -1: still
 * running (stuck inside the provider: shm spins forever on a lock a killed
 * peer held in shared memory); it is left behind, with everything it may
 * touch, and a warning names who. */
int fr_proxy_join(pthread_t th, int *stop, long ms, const char *who);
#define FR_PROXY_JOIN_MS 2000

/* The doorbell of a receive segment (its first page, see core/layout.h):
 * a counter and a sleeper count. Ring after publishing flags; sleep until
 * the counter moves from `seen` or `ns` pass. */
void fr_doorbell_ring(uint8_t *seg);
uint32_t fr_doorbell_read(uint8_t *seg);
void fr_doorbell_sleep(uint8_t *seg, uint32_t seen, uint64_t ns);
void fr_doorbell_sleepers_add(uint8_t *seg, int delta);

/* Shared-memory segments (shm.c). A peer's segment is mapped only when it
 * is this user's, mode 0600 and of the expected size. */
int fr_shm_create(const char *name, size_t bytes, uint8_t **p, fr_err_t *err);
int fr_shm_map(const char *name, size_t bytes, uint8_t **p, fr_err_t *err);
void fr_shm_unmap(uint8_t *p, size_t bytes);
void fr_shm_unlink(const char *name);
/* This process's pid namespace (the inode of /proc/self/ns/pid; 0 when
 * unknown). Names of shared regions carry it next to the pid, since a pid
 * means something only in its own namespace. */
uint64_t fr_pidns(void);
/* The /dev/shm entries a rank makes, one kind per creator. Every name is
 * <prefix><pid><sep><pidns hex><sep><rest>, written by fr_shm_name and
 * read back by fr_shm_owner, so that the sweeps below find every kind
 * named here and nothing else:
 *   FR_SHM_EP   an EP's receive segment (ep/seg.c),
 *               ferry-<pid>-<pidns>-<tag><rank>-<time>
 *   FR_SHM_FAB  a libfabric shm provider region, named after the endpoint's
 *               address (transport/fabric/open.c),
 *               ferry.<pid>.<pidns>.<random>[provider's suffix] */
typedef enum fr_shm_kind { FR_SHM_EP, FR_SHM_FAB, FR_SHM_NKINDS } fr_shm_kind_t;
/* This process's name of `kind` into buf, `rest` (printf format) after the
 * pid namespace: the length, or -1 when it does not fit. */
int fr_shm_name(char *buf, size_t cap, fr_shm_kind_t kind, const char *rest, ...)
    __attribute__((format(printf, 4, 5)));
/* The kind of a /dev/shm entry name (no leading '/') made by fr_shm_name,
 * with its maker's pid and pid namespace; -1 when it is not one. */
int fr_shm_owner(const char *name, long *pid, uint64_t *pidns);
/* Remove this user's /dev/shm entries of every kind made in this pid
 * namespace whose process is gone (left by a killed job). Off when
 * FERRY_SHM_SWEEP=0. Returns how many. */
int fr_shm_sweep_dead(void);
/* The same for the entries of one process, a rank its launcher has just
 * reaped (whatever FERRY_SHM_SWEEP says). Returns how many. */
int fr_shm_sweep_pid(long pid);

#ifdef __cplusplus
}
#endif

#endif
