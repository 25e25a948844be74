/* Logging: level and subsystems from FERRY_LOG / FERRY_LOG_SUBSYS. */
#ifndef FR_LOG_H
#define FR_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fr_log_level {
    FR_LOG_NONE = 0,
    FR_LOG_ERROR,
    FR_LOG_WARNL,
    FR_LOG_INFO,
    FR_LOG_DEBUG,
    FR_LOG_TRACE
} fr_log_level_t;

enum {
    FR_SUB_INIT = 1 << 0,
    FR_SUB_BOOT = 1 << 1,
    FR_SUB_NET = 1 << 2,
    FR_SUB_PROXY = 1 << 3,
    FR_SUB_SHM = 1 << 4,
    FR_SUB_EP = 1 << 5,
    FR_SUB_SIG = 1 << 6
};

extern int fr_log_level_cur; /* -1 until first use */
void fr_log_init(void);
void fr_log_set_rank(int rank);
int fr_log_enabled(int level, int subsys);
void fr_log_emit(int level, int subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FR_LOG_AT(lvl, sub, ...)                                               \
    do {                                                                       \
        if (fr_log_enabled((lvl), (sub)))                                      \
            fr_log_emit((lvl), (sub), __VA_ARGS__);                            \
    } while (0)
#define FR_LOG_ERR(sub, ...) FR_LOG_AT(FR_LOG_ERROR, sub, __VA_ARGS__)
#define FR_LOG_WARN(sub, ...) FR_LOG_AT(FR_LOG_WARNL, sub, __VA_ARGS__)
#define FR_LOG_INFO(sub, ...) FR_LOG_AT(FR_LOG_INFO, sub, __VA_ARGS__)
#define FR_LOG_DEBUG(sub, ...) FR_LOG_AT(FR_LOG_DEBUG, sub, __VA_ARGS__)
#define FR_LOG_TRACE(sub, ...) FR_LOG_AT(FR_LOG_TRACE, sub, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
