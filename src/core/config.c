#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ferry.h"
#include "log.h"

typedef struct fr_cfg_entry {
    const char *name;
    const char *defval;
    const char *help;
    int secret; /* value never shown: ferry_settings reports it hidden */
    long min, max;    /* a ranged integer (max > 0): values outside are refused */
    const char *unit; /* of the range, in its error message */
    const char *choices; /* the values taken, '|' between them (an empty
                            value is the default): others are refused */
    int nocase;          /* choices: 1 any case; 2 any case, a
                            comma-separated list of them */
} fr_cfg_entry_t;

#define FR_CFG_MS_UNIT " ms (up to a week)"

static const fr_cfg_entry_t fr_cfg_table[FR_CFG_COUNT] = {
    [FR_CFG_RANK] = {"FERRY_RANK", "",
                     "This process's rank (else OMPI_COMM_WORLD_RANK, RANK, "
                     "SLURM_PROCID)."},
    [FR_CFG_WORLD_SIZE] = {"FERRY_WORLD_SIZE", "",
                           "Number of ranks (else OMPI_COMM_WORLD_SIZE, "
                           "WORLD_SIZE, SLURM_NTASKS)."},
    [FR_CFG_ROOT] = {"FERRY_ROOT", "",
                     "host:port of the rendezvous at rank 0 (else "
                     "MASTER_ADDR:MASTER_PORT+1, else 127.0.0.1 and a port "
                     "from the job id when all ranks are local)."},
    [FR_CFG_ROOT_BIND] = {"FERRY_ROOT_BIND", "",
                          "Address rank 0 listens on for the rendezvous "
                          "(e.g. 0.0.0.0 for all). Default: the address the "
                          "root host resolves to (loopback for local jobs)."},
    [FR_CFG_SECRET] = {"FERRY_SECRET", "",
                       "Job secret every rank proves at the rendezvous (at "
                       "least 16 characters, e.g. $(openssl rand -hex 32); "
                       "pass it with mpirun -x FERRY_SECRET). Required when "
                       "ranks span hosts; for local jobs a per-user key "
                       "file is used instead. Never shown.", 1},
    [FR_CFG_JOB_ID] = {"FERRY_JOB_ID", "",
                       "Names the job among this user's local jobs started "
                       "without FERRY_SECRET: ranks with the same id read "
                       "the same key file. Default: the launcher's job id "
                       "(PMIx namespace, Open MPI job, Slurm job.step, "
                       "torchrun run id), else the parent process (ranks "
                       "started by one launcher; not a shell, whose jobs "
                       "would share it: set one id per job)."},
    [FR_CFG_KEY_DIR] = {"FERRY_KEY_DIR", "",
                        "Folder of the local key file (a folder of this "
                        "user with no access for others; created if "
                        "absent). Default: the first usable of "
                        "$XDG_RUNTIME_DIR/ferry, $TMPDIR/ferry-<uid> (/tmp "
                        "if TMPDIR is unset) and $HOME/.ferry."},
    [FR_CFG_NODE_ID] = {"FERRY_NODE_ID", "",
                        "Node identity; ranks with equal ids share memory. "
                        "Default: the host name, or for GPU ranks of one "
                        "NVLink domain the domain. Set, it is the node "
                        "(no domain joins nodes)."},
    [FR_CFG_HOST_NAME] = {"FERRY_HOST_NAME", "",
                          "The host name ranks are grouped by when "
                          "FERRY_NODE_ID is unset (default: the system's); "
                          "for tests that simulate hosts on one machine."},
    [FR_CFG_NVLINK_DOMAIN] = {"FERRY_NVLINK_DOMAIN", "",
                              "The NVLink domain of this rank's GPU: empty "
                              "asks NVML (the fabric cluster UUID and clique "
                              "id), none says there is none, any other text "
                              "names it (tests). GPU ranks of one domain are "
                              "one node for peer memory, across hosts when "
                              "every rank can share by fabric handle."},
    [FR_CFG_TRANSPORT] = {"FERRY_TRANSPORT", "auto",
                          "auto: shared memory inside a node, fabric between "
                          "nodes; fabric: every peer through the proxy and "
                          "libfabric (FI_PROVIDER picks the provider).",
                          .choices = "auto|fabric"},
    [FR_CFG_TIMEOUT_MS] = {"FERRY_TIMEOUT_MS", "30000",
                           "Deadline of every wait for peers, in ms "
                           "(1..604800000: up to a week).", 0, 1,
                           FR_CFG_MAX_MS, FR_CFG_MS_UNIT},
    [FR_CFG_BOOTSTRAP_TIMEOUT_MS] = {"FERRY_BOOTSTRAP_TIMEOUT_MS", "60000",
                                     "Deadline for all ranks to meet at "
                                     "start-up, in ms (1..604800000: up to "
                                     "a week).", 0, 1, FR_CFG_MAX_MS,
                                     FR_CFG_MS_UNIT},
    [FR_CFG_AUTH_MS] = {"FERRY_BOOTSTRAP_AUTH_MS", "1000",
                        "Time a connection to the rendezvous has to "
                        "authenticate before rank 0 drops it, in ms "
                        "(1..604800000; a dropped rank reconnects).", 0, 1,
                        FR_CFG_MAX_MS, FR_CFG_MS_UNIT},
    [FR_CFG_SPIN] = {"FERRY_SPIN", "1000",
                     "Polls of a flag before a waiting CPU rank sleeps on "
                     "its doorbell (a futex the senders ring).", 0, 0, 1000000000, " polls"},
    [FR_CFG_NICS_PER_RANK] = {"FERRY_NICS_PER_RANK", "0",
                               "Fabric NICs (interfaces) a rank uses, peers "
                               "sharded across them; 0: as many as the node "
                               "has, up to 2 (the first is the one on the "
                               "route to the rendezvous).", 0, 0, 2, ""},
    [FR_CFG_PROXY_THREADS] = {"FERRY_PROXY_THREADS", "1",
                              "Proxy threads per rank on the low-latency "
                              "fabric path (1-8), each owning NIC endpoints "
                              "and their peers; where the rank has fewer "
                              "NICs, more endpoints are opened on them.", 0, 1, 8, ""},
    [FR_CFG_PROXY_IDLE_US] = {"FERRY_PROXY_IDLE_US", "50",
                              "Longest sleep of an idle proxy thread, in us "
                              "(it yields first).", 0, 0, 1000000, " us (up to a second)"},
    [FR_CFG_FABRIC_HMEM] = {"FERRY_FABRIC_HMEM", "auto",
                            "GPU ranks on the fabric path: auto keeps the "
                            "receive and send regions in GPU memory, "
                            "registered with the provider (FI_HMEM), when "
                            "the provider registers it and writes it by NIC "
                            "DMA (efa, verbs), else in pinned host memory; "
                            "on: GPU memory or an error naming the "
                            "provider; off: host memory.",
                            .choices = "auto|on|off|1|0"},
    [FR_CFG_PEER_MEM] = {"FERRY_PEER_MEM", "auto",
                         "How GPU ranks of a node map each other's "
                         "segments: vmm (CUDA VMM allocations shared by "
                         "POSIX file descriptor over a Unix socket), "
                         "fabric (VMM shared by fabric handle, where the "
                         "device offers it), legacy (cudaMalloc and CUDA "
                         "IPC), or auto: vmm where every rank offers it "
                         "and no segment is also registered with the "
                         "fabric provider, else legacy. A kind asked for "
                         "that a rank lacks fails create on every rank, "
                         "naming the rank and why. Alike on every rank.",
                         .choices = "auto|vmm|fabric|legacy"},
    [FR_CFG_HT_FORWARD] = {"FERRY_HT_FORWARD", "auto",
                           "High-throughput mode across nodes, when the "
                           "config's forward field is left at AUTO: auto "
                           "and on send a token over the fabric once per "
                           "destination node, to the rank of the sender's "
                           "local index there, which forwards it to the "
                           "node's destinations through shared memory and "
                           "sums their combine rows; off sends it to each "
                           "destination rank directly. Alike on every "
                           "rank.",
                           .choices = "auto|on|off"},
    [FR_CFG_PROXY_STATS] = {"FERRY_PROXY_STATS", "",
                             "Set: each proxy prints, at exit, percentiles "
                             "of the time from picking up a request to the "
                             "last peer's write of that phase landing, and "
                             "each context on the fabric path its counters "
                             "(ferry_ep_get_stats)."},
    [FR_CFG_FAULT_DELAY_US] = {"FERRY_FAULT_DELAY_US", "0",
                               "Fault injection (tests): hold every fabric "
                               "write's arrival this many us before the "
                               "receiver sees it. 0: off.", 0, 0, 60000000, " us (up to a minute)"},
    [FR_CFG_FAULT_JITTER_US] = {"FERRY_FAULT_JITTER_US", "0",
                                "Fault injection: add a random 0..N us to "
                                "each held arrival. 0: off.", 0, 0, 60000000, " us (up to a minute)"},
    [FR_CFG_FAULT_REORDER] = {"FERRY_FAULT_REORDER", "0",
                              "Fault injection: 1 delivers held arrivals in "
                              "random order, as EFA's unordered transport "
                              "may. 0: off.", 0, 0, 1, ""},
    [FR_CFG_FAULT_SEED] = {"FERRY_FAULT_SEED", "1",
                           "Seed of the fault injector's random numbers.", 0, 0, LONG_MAX, ""},
    [FR_CFG_FAULT_POSTS] = {"FERRY_FAULT_POSTS", "0",
                             "Fault injection: 1 holds this rank's own "
                             "writes back before posting them instead of "
                             "holding arrivals (same delay and jitter; "
                             "random order with FERRY_FAULT_REORDER=1), so "
                             "a write may leave, and land, before an older "
                             "one. 0: off.", 0, 0, 1, ""},
    [FR_CFG_FAULT_EP_BUSY] = {"FERRY_FAULT_EP_BUSY", "0",
                              "Fault injection: the first N fabric endpoints "
                              "this process opens fail as if no local address "
                              "were free (FI_EADDRNOTAVAIL), which ferry "
                              "retries. 0: off.", 0, 0, 1000000, ""},
    [FR_CFG_SIGNAL_MODE] = {"FERRY_SIGNAL_MODE", "counted",
                            "Put-with-signal ordering when the context's "
                            "config leaves mode at DEFAULT: fence, grouped, "
                            "nicfence or counted.",
                            .choices = "fence|grouped|nicfence|counted"},
    [FR_CFG_SHM_SWEEP] = {"FERRY_SHM_SWEEP", "1",
                          "1: at start-up, remove this user's ferry regions "
                          "in /dev/shm made in this pid namespace whose "
                          "process is gone (left by a killed job).", 0, 0, 1, ""},
    [FR_CFG_LOG] = {"FERRY_LOG", "WARN",
                    "Log level: NONE, ERROR, WARN, INFO, DEBUG, TRACE.",
                    .choices = "NONE|ERROR|WARN|WARNING|INFO|DEBUG|TRACE", .nocase = 1},
    [FR_CFG_LOG_SUBSYS] = {"FERRY_LOG_SUBSYS", "ALL",
                           "Comma-separated subsystems to log: INIT, BOOT, "
                           "NET, PROXY, SHM, EP, SIG, ALL.",
                           .choices = "INIT|BOOT|NET|PROXY|SHM|EP|SIG|ALL", .nocase = 2},
};

const char *fr_cfg_name(fr_cfg_id_t id) { return fr_cfg_table[id].name; }

int fr_cfg_is_secret(fr_cfg_id_t id) { return fr_cfg_table[id].secret; }

const char *fr_cfg_str(fr_cfg_id_t id)
{
    const char *v = getenv(fr_cfg_table[id].name);
    if (v && *v)
        return v;
    return fr_cfg_table[id].defval;
}

/* v as a whole decimal number: 0; one past the range of a long: 1 (*x
 * then LONG_MIN or LONG_MAX); not a number: -1. */
static int fr_cfg_parse(const char *v, long *x)
{
    char *end = NULL;
    errno = 0;
    *x = strtol(v, &end, 10);
    if (end == v || *end != '\0')
        return -1;
    return errno == ERANGE ? 1 : errno ? -1 : 0;
}

int fr_cfg_long(fr_cfg_id_t id, long *out, fr_err_t *err)
{
    const fr_cfg_entry_t *e = &fr_cfg_table[id];
    const char *v = fr_cfg_str(id), *shown = e->secret ? "(hidden)" : v;
    long x = 0;
    int p = fr_cfg_parse(v, &x);
    if (e->max == 0) { /* not ranged: any long */
        *out = p == 0 ? x : strtol(e->defval, NULL, 10);
        return p == 0 ? FERRY_OK
                      : FR_ERR(err, FERRY_ERR_INVALID, "%s=%s: not an integer in the "
                               "range of a long", e->name, shown);
    }
    if (p >= 0 && x >= e->min && x <= e->max) {
        *out = x;
        return FERRY_OK;
    }
    /* clamped for a caller that goes on regardless: no deadline computed
     * from it can overflow */
    *out = p < 0 ? strtol(e->defval, NULL, 10) : x < e->min ? e->min : e->max;
    return FR_ERR(err, FERRY_ERR_INVALID, "%s=%s: %smust be %ld..%ld%s", e->name, shown,
                  p < 0 ? "not a whole number; " : "", e->min, e->max, e->unit ? e->unit : "");
}

/* Which of e's choices v is (len bytes, blanks around it ignored): its
 * index, or -1. */
static int fr_cfg_choice(const fr_cfg_entry_t *e, const char *v, size_t len)
{
    while (len && (*v == ' ' || *v == '\t'))
        v++, len--;
    while (len && (v[len - 1] == ' ' || v[len - 1] == '\t'))
        len--;
    int i = 0;
    for (const char *c = e->choices; *c; i++) {
        size_t n = strcspn(c, "|");
        if (n == len && (e->nocase ? strncasecmp(c, v, n) : strncmp(c, v, n)) == 0)
            return i;
        c += n + (c[n] == '|');
    }
    return -1;
}

int fr_cfg_choice_index(fr_cfg_id_t id)
{
    const char *v = fr_cfg_str(id);
    return fr_cfg_table[id].choices ? fr_cfg_choice(&fr_cfg_table[id], v, strlen(v)) : -1;
}

/* e's value is among its choices, or, for a list, each of its items. */
static int fr_cfg_check_choices(const fr_cfg_entry_t *e, fr_err_t *err)
{
    const char *v = getenv(e->name);
    if (!v || !*v)
        return FERRY_OK; /* the default */
    int ok = 1;
    if (e->nocase != 2) {
        ok = fr_cfg_choice(e, v, strlen(v)) >= 0;
    } else {
        for (const char *t = v; ok;) { /* empty items skipped */
            size_t n = strcspn(t, ",");
            ok = strspn(t, " \t") >= n || fr_cfg_choice(e, t, n) >= 0;
            if (!t[n])
                break;
            t += n + 1;
        }
    }
    if (ok)
        return FERRY_OK;
    char alts[200]; /* "a, b or c" */
    size_t k = 0;
    for (const char *c = e->choices; *c && k + 8 < sizeof(alts);) {
        size_t n = strcspn(c, "|");
        const char *sep = c[n] != '|' ? "" : strchr(c + n + 1, '|') ? ", " : " or ";
        k += (size_t)snprintf(alts + k, sizeof(alts) - k, "%.*s%s", (int)n, c, sep);
        c += n + (c[n] == '|');
    }
    return FR_ERR(err, FERRY_ERR_INVALID, "%s=%s: must be %s%s", e->name, v,
                  e->nocase == 2 ? "a comma-separated list of " : "", alts);
}

int fr_cfg_check_time(fr_err_t *err)
{
    static const fr_cfg_id_t ids[] = {FR_CFG_TIMEOUT_MS, FR_CFG_BOOTSTRAP_TIMEOUT_MS,
                                      FR_CFG_AUTH_MS};
    for (size_t i = 0; i < sizeof(ids) / sizeof(ids[0]); i++) {
        long x;
        int rc = fr_cfg_long(ids[i], &x, err);
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

int fr_cfg_check(fr_err_t *err)
{
    for (int i = 0; i < FR_CFG_COUNT; i++) {
        const fr_cfg_entry_t *e = &fr_cfg_table[i];
        long x;
        int rc = e->max > 0 ? fr_cfg_long((fr_cfg_id_t)i, &x, err)
                 : e->choices ? fr_cfg_check_choices(e, err)
                              : FERRY_OK;
        if (rc != FERRY_OK)
            return rc;
    }
    return FERRY_OK;
}

long fr_cfg_int(fr_cfg_id_t id)
{
    const fr_cfg_entry_t *e = &fr_cfg_table[id];
    long x = 0;
    fr_err_t err;
    if (e->max > 0) {
        if (fr_cfg_long(id, &x, &err) != FERRY_OK)
            FR_LOG_WARN(FR_SUB_INIT, "%s; using %ld", err.msg, x);
        return x;
    }
    const char *v = fr_cfg_str(id);
    if (fr_cfg_parse(v, &x) != 0) {
        x = strtol(e->defval, NULL, 10);
        FR_LOG_WARN(FR_SUB_INIT, "%s=%s is not an integer; using %ld", e->name,
                    e->secret ? "(hidden)" : v, x);
    }
    return x;
}

int ferry_settings(ferry_setting_t *out, int max)
{
    for (int i = 0; i < FR_CFG_COUNT && out && i < max; i++) {
        out[i].name = fr_cfg_table[i].name;
        out[i].defval = fr_cfg_table[i].defval;
        const char *v = fr_cfg_str((fr_cfg_id_t)i);
        out[i].value = fr_cfg_table[i].secret && v[0] ? "(set, hidden)" : v;
        out[i].help = fr_cfg_table[i].help;
    }
    return FR_CFG_COUNT;
}

const char *ferry_version_string(void)
{
#define FR_STR2(x) #x
#define FR_STR(x) FR_STR2(x)
    return FR_STR(FERRY_VERSION_MAJOR) "." FR_STR(
        FERRY_VERSION_MINOR) "." FR_STR(FERRY_VERSION_PATCH);
}
