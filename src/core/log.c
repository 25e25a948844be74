#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"

int fr_log_level_cur = -1;
static int fr_log_subsys = ~0;
static int fr_log_rank = -1;
static char fr_log_host[64];
static pthread_once_t fr_log_once = PTHREAD_ONCE_INIT;

static void fr_log_setup(void)
{
    /* the level of each of FERRY_LOG's values, in config.c's order: NONE,
     * ERROR, WARN, WARNING, INFO, DEBUG, TRACE (another value: refused by
     * the settings check, WARN here) */
    static const int levels[] = {FR_LOG_NONE, FR_LOG_ERROR, FR_LOG_WARNL, FR_LOG_WARNL,
                                 FR_LOG_INFO, FR_LOG_DEBUG, FR_LOG_TRACE};
    int li = fr_cfg_choice_index(FR_CFG_LOG);
    int level = li >= 0 && li < (int)(sizeof(levels) / sizeof(levels[0])) ? levels[li]
                                                                          : FR_LOG_WARNL;
    const char *ss = fr_cfg_str(FR_CFG_LOG_SUBSYS);
    static const struct { const char *n; int bit; } subs[] = {
        {"INIT", FR_SUB_INIT}, {"BOOT", FR_SUB_BOOT}, {"NET", FR_SUB_NET},
        {"PROXY", FR_SUB_PROXY}, {"SHM", FR_SUB_SHM}, {"EP", FR_SUB_EP}, {"SIG", FR_SUB_SIG},
        {"ALL", ~0}};
    int mask = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", ss);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ", \t", &save); tok;
         tok = strtok_r(NULL, ", \t", &save))
        for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++)
            if (strcasecmp(tok, subs[i].n) == 0)
                mask |= subs[i].bit;
    fr_log_subsys = mask ? mask : ~0;
    if (gethostname(fr_log_host, sizeof(fr_log_host) - 1) != 0)
        snprintf(fr_log_host, sizeof(fr_log_host), "?");
    __atomic_store_n(&fr_log_level_cur, level, __ATOMIC_RELEASE);
}

void fr_log_init(void) { pthread_once(&fr_log_once, fr_log_setup); }

/* Set by every thread that logs for a rank (the proxy's threads too): the
 * same value, stored and read atomically. */
void fr_log_set_rank(int rank) { __atomic_store_n(&fr_log_rank, rank, __ATOMIC_RELAXED); }

int fr_log_enabled(int level, int subsys)
{
    if (__atomic_load_n(&fr_log_level_cur, __ATOMIC_ACQUIRE) < 0)
        fr_log_init();
    return level <= fr_log_level_cur && (subsys & fr_log_subsys);
}

void fr_log_emit(int level, int subsys, const char *fmt, ...)
{
    static const char *names[] = {"", "ERROR", "WARN", "INFO", "DEBUG",
                                  "TRACE"};
    (void)subsys;
    char line[1024];
    int n = snprintf(line, sizeof(line), "%s:%d:%d ferry %s ", fr_log_host,
                     (int)getpid(), __atomic_load_n(&fr_log_rank, __ATOMIC_RELAXED), names[level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(line))
        vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    /* one write per line, newline included: ranks sharing a log file do
     * not split each other's lines */
    size_t len = strnlen(line, sizeof(line) - 1);
    line[len++] = '\n';
    fflush(stderr);
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
