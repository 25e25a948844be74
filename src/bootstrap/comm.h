/* Internal state of a communicator (ferry_comm_t): who the ranks are and
 * how they met. Shared by the EP and put-with-signal. */
#ifndef FR_COMM_H
#define FR_COMM_H

#include <stdint.h>

#include "ferry.h"
#include "bootstrap/bootstrap.h"
#include "core/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FR_NODE_ID_LEN 64

typedef struct fr_peer_info {
    char node[FR_NODE_ID_LEN];
    int32_t pid;
    int32_t rank;
    int32_t node_set;  /* node came from FERRY_NODE_ID */
    int32_t cfg_status; /* this rank's settings check (fr_cfg_check) */
} fr_peer_info_t;

struct ferry_comm {
    fr_boot_t *boot;
    int rank, size;
    fr_peer_info_t *peers; /* [size], exchanged at init */
    int nnodes;            /* distinct node ids */
    int users;             /* atomic: EP and put-with-signal contexts made on it
                              and not destroyed yet */
    fr_err_t err;
};

#ifdef __cplusplus
}
#endif

#endif
