/* Settings: one table {name, default, help}, read from the environment. */
#ifndef FR_CONFIG_H
#define FR_CONFIG_H

#include <stdint.h>

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
/* Integer value; a malformed value falls back to the default with a warning. */
long fr_cfg_int(fr_cfg_id_t id);
const char *fr_cfg_name(fr_cfg_id_t id);
/* 1 for a setting whose value is never shown (ferry_settings, logs). */
int fr_cfg_is_secret(fr_cfg_id_t id);

#ifdef __cplusplus
}
#endif

#endif
