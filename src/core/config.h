/* Settings: one table {name, default, help}, read from the environment. */
#ifndef FR_CONFIG_H
#define FR_CONFIG_H

#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fr_cfg_id {
    FR_CFG_RANK,
    FR_CFG_WORLD_SIZE,
    FR_CFG_ROOT,
    FR_CFG_ROOT_BIND,
    FR_CFG_SECRET,
    FR_CFG_JOB_ID,
    FR_CFG_KEY_DIR,
    FR_CFG_NODE_ID,
    FR_CFG_HOST_NAME,
    FR_CFG_NVLINK_DOMAIN,
    FR_CFG_TRANSPORT,
    FR_CFG_TIMEOUT_MS,
    FR_CFG_BOOTSTRAP_TIMEOUT_MS,
    FR_CFG_AUTH_MS,
    FR_CFG_SPIN,
    FR_CFG_NICS_PER_RANK,
    FR_CFG_PROXY_IDLE_US,
    FR_CFG_PROXY_THREADS,
    FR_CFG_FABRIC_HMEM,
    FR_CFG_PEER_MEM,
    FR_CFG_HT_FORWARD,
    FR_CFG_PROXY_STATS,
    FR_CFG_FAULT_DELAY_US,
    FR_CFG_FAULT_JITTER_US,
    FR_CFG_FAULT_REORDER,
    FR_CFG_FAULT_SEED,
    FR_CFG_FAULT_POSTS,
    FR_CFG_FAULT_EP_BUSY,
    FR_CFG_SIGNAL_MODE,
    FR_CFG_SHM_SWEEP,
    FR_CFG_LOG,
    FR_CFG_LOG_SUBSYS,
    FR_CFG_COUNT
} fr_cfg_id_t;

/* Current value as text: the environment's, else the default ("" if none). */
const char *fr_cfg_str(fr_cfg_id_t id);
/* The largest time setting in ms (FERRY_TIMEOUT_MS,
 * FERRY_BOOTSTRAP_TIMEOUT_MS, FERRY_BOOTSTRAP_AUTH_MS): a week, so a
 * deadline in ns (ms x 10^6 plus a clock) stays far inside 63 bits. */
#define FR_CFG_MAX_MS 604800000L

/* Integer value. A ranged setting (the time settings above) outside its
 * range, or not a number, is clamped into it with a warning naming the
 * variable (fr_cfg_check refuses it where an error can be returned); for
 * the others a malformed value falls back to the default with a warning. */
long fr_cfg_int(fr_cfg_id_t id);
/* Integer value into *out: FERRY_ERR_INVALID naming the variable and its
 * range when it is not a whole number or, for a ranged setting, outside
 * the range (*out then holds the clamped value fr_cfg_int returns). */
int fr_cfg_long(fr_cfg_id_t id, long *out, fr_err_t *err);
/* FERRY_OK when every ranged setting is within its range and every word
 * setting among its values, else FERRY_ERR_INVALID naming the first that
 * is not. */
int fr_cfg_check(fr_err_t *err);
/* A word setting's value (its default when unset or empty) as its index
 * among the values the table lists for it (any case where the table says
 * so, blanks around it ignored), or -1. */
int fr_cfg_choice_index(fr_cfg_id_t id);
/* The time settings alone (FERRY_TIMEOUT_MS, FERRY_BOOTSTRAP_TIMEOUT_MS,
 * FERRY_BOOTSTRAP_AUTH_MS): what must hold before any deadline. */
int fr_cfg_check_time(fr_err_t *err);
const char *fr_cfg_name(fr_cfg_id_t id);
/* 1 for a setting whose value is never shown (ferry_settings, logs). */
int fr_cfg_is_secret(fr_cfg_id_t id);

#ifdef __cplusplus
}
#endif

#endif
