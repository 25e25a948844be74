/* The runtime's clock, backoff, proxy idling/joining and doorbell. */
#include "runtime/rt.h"

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/config.h"
#include "core/layout.h"
#include "core/log.h"

uint64_t fr_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Spin `spin` polls, then yield the core (ranks share cores), then after a
 * long wait sleep 100 us per poll so a stuck peer costs nothing. */
void fr_backoff(uint64_t *iter, long spin)
{
    uint64_t i = (*iter)++;
    if (i < (uint64_t)spin) {
        fr_cpu_relax();
    } else if (i < (uint64_t)spin + 20000) {
        sched_yield();
    } else {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

long fr_proxy_idle_us(int gpu)
{
    /* A GPU rings from a kernel: nobody wakes a sleeping proxy, so it only
     * yields between polls unless the setting says otherwise. */
    const char *v = getenv(fr_cfg_name(FR_CFG_PROXY_IDLE_US));
    if (gpu && !(v && *v))
        return 0;
    return fr_cfg_int(FR_CFG_PROXY_IDLE_US);
}

void fr_proxy_idle(uint64_t *idle, long idle_us)
{
    uint64_t i = ++*idle;
    if (i < 64)
        return;
    if (i < 2000 || idle_us <= 0) {
        sched_yield();
    } else {
        struct timespec ts = {idle_us / 1000000, (idle_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
}

int fr_proxy_join(pthread_t th, int *stop, long ms, const char *who)
{
    __atomic_store_n(stop, 1, __ATOMIC_RELEASE);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    int e = pthread_timedjoin_np(th, NULL, &ts);
    if (e == 0)
        return 0;
    FR_LOG_WARN(FR_SUB_PROXY,
                "%s: the proxy thread did not stop within %ld ms (stuck in "
                "the fabric provider, e.g. shm waiting on a lock a killed "
                "peer held); leaving it, its endpoint and its memory behind",
                who, ms);
    pthread_detach(th);
    return -1;
}

static inline uint32_t *fr_bell(uint8_t *seg)
{
    return (uint32_t *)(seg + FR_SEG_OFF_BELL);
}
static inline uint32_t *fr_sleepers(uint8_t *seg)
{
    return (uint32_t *)(seg + FR_SEG_OFF_SLEEPERS);
}

void fr_doorbell_ring(uint8_t *seg)
{
    __atomic_add_fetch(fr_bell(seg), 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(fr_sleepers(seg), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, fr_bell(seg), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

uint32_t fr_doorbell_read(uint8_t *seg)
{
    return __atomic_load_n(fr_bell(seg), __ATOMIC_SEQ_CST);
}

void fr_doorbell_sleepers_add(uint8_t *seg, int delta)
{
    __atomic_add_fetch(fr_sleepers(seg), (uint32_t)delta, __ATOMIC_SEQ_CST);
}

void fr_doorbell_sleep(uint8_t *seg, uint32_t seen, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull),
                          (long)(ns % 1000000000ull)};
    syscall(SYS_futex, fr_bell(seg), FUTEX_WAIT, seen, &ts, NULL, 0);
}
