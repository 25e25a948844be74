/* fr_boot_env_read: rank, size and rendezvous address from the environment
 * (FERRY_*, Open MPI, torchrun, Slurm), whether every rank is on this host,
 * and the job secret (FERRY_SECRET), required when ranks span hosts. */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../core/config.h"
#include "../core/log.h"
#include "bootstrap.h"
#include "hmac.h"

/* getenv, with an empty value counted as unset. */
static const char *fr_env(const char *name)
{
    const char *v = getenv(name);
    return (v && *v) ? v : NULL;
}

/* Strict decimal integer: the whole string, within int range. */
static int fr_parse_int(const char *s, long *out)
{
    char *end = NULL;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || x < INT_MIN || x > INT_MAX)
        return -1;
    *out = x;
    return 0;
}

static int fr_env_int(const char *name, const char *val, long *out,
                      fr_err_t *err)
{
    if (fr_parse_int(val, out) != 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "%s='%s' is not an integer",
                      name, val);
    return FERRY_OK;
}

/* "host:port", "[v6]:port". */
static int fr_parse_root(const char *name, const char *val, fr_boot_env_t *env,
                         fr_err_t *err)
{
    const char *host = val, *colon;
    size_t hlen;
    if (val[0] == '[') {
        const char *close = strchr(val, ']');
        if (!close || close[1] != ':')
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "%s='%s' is not host:port (e.g. 10.0.0.1:29500)",
                          name, val);
        host = val + 1;
        hlen = (size_t)(close - host);
        colon = close + 1;
    } else {
        colon = strrchr(val, ':');
        if (!colon)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "%s='%s' is not host:port (e.g. 10.0.0.1:29500)",
                          name, val);
        hlen = (size_t)(colon - val);
    }
    if (hlen == 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "%s='%s' has an empty host",
                      name, val);
    if (hlen >= sizeof(env->root_host))
        return FR_ERR(err, FERRY_ERR_INVALID, "%s='%s': host name too long",
                      name, val);
    long port;
    if (fr_parse_int(colon + 1, &port) != 0 || port < 1 || port > 65535)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "%s='%s': port '%s' is not in 1..65535", name, val,
                      colon + 1);
    memcpy(env->root_host, host, hlen);
    env->root_host[hlen] = '\0';
    env->root_port = (int)port;
    return FERRY_OK;
}

/* FNV-1a, folded into [10000, the ephemeral range's start) while that
 * starts above 12000 (every rank of a local job reads the same range), so
 * no outgoing connection on the host can hold the port as its source;
 * else into 20000..59999. */
static int fr_port_from_id(const char *id)
{
    uint32_t h = 2166136261u;
    for (const unsigned char *p = (const unsigned char *)id; *p; p++) {
        h ^= *p;
        h *= 16777619u;
    }
    h ^= h >> 16;
    int lo = fr_boot_ephemeral_lo();
    if (lo > 12000)
        return 10000 + (int)(h % (uint32_t)(lo - 10000));
    return 20000 + (int)(h % 40000u);
}

/* An integer environment variable equal to want (unset or malformed: no). */
static int fr_env_equals(const char *name, long want)
{
    const char *v = fr_env(name);
    long x;
    return v && fr_parse_int(v, &x) == 0 && x == want;
}

/* The launcher says every rank runs on this host. */
static int fr_env_all_local(long size)
{
    return size == 1 || fr_env_equals("OMPI_COMM_WORLD_LOCAL_SIZE", size) ||
           fr_env_equals("LOCAL_WORLD_SIZE", size) ||
           fr_env_equals("SLURM_STEP_NUM_NODES", 1) ||
           fr_env_equals("SLURM_NTASKS_PER_NODE", size);
}

/* A loopback root (127.0.0.0/8, ::1, localhost) is reachable from this host
 * only. */
static int fr_host_is_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&a6);
    return strcmp(host, "localhost") == 0;
}

/* The job secret: FERRY_SECRET's digest, or none for a local job (a key
 * file then); ranks spanning hosts must have one. */
static int fr_env_secret(fr_boot_env_t *env, fr_err_t *err)
{
    const char *s = fr_cfg_str(FR_CFG_SECRET);
    size_t n = s ? strlen(s) : 0;
    if (n > 0) {
        if (n < 16)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "%s is too short (%zu characters): use at least "
                          "16, e.g. export %s=$(openssl rand -hex 32)",
                          fr_cfg_name(FR_CFG_SECRET), n,
                          fr_cfg_name(FR_CFG_SECRET));
        fr_sha256(s, n, env->key);
        env->has_key = 1;
        return FERRY_OK;
    }
    if (env->local)
        return FERRY_OK;
    return FR_ERR(err, FERRY_ERR_INVALID,
                  "ranks span hosts (root %s:%d) and %s is not set: every "
                  "rank proves the job's secret at the rendezvous. Set the "
                  "same one for all ranks: export %s=$(openssl rand -hex 32), "
                  "then mpirun -x %s ... (torchrun and srun pass the "
                  "environment on)",
                  env->root_host, env->root_port, fr_cfg_name(FR_CFG_SECRET),
                  fr_cfg_name(FR_CFG_SECRET), fr_cfg_name(FR_CFG_SECRET));
}

void fr_boot_env_wipe(fr_boot_env_t *env)
{
    if (env) {
        fr_boot_wipe(env->key, sizeof(env->key));
        env->has_key = 0;
    }
}

/* Rendezvous address: FERRY_ROOT, torchrun's MASTER_ADDR/PORT, or (all
 * ranks on one host) loopback with a port derived from the job id. */
static int fr_env_root(fr_boot_env_t *env, long size, fr_err_t *err)
{
    int rc;
    const char *root = fr_cfg_str(FR_CFG_ROOT);
    const char *maddr = fr_env("MASTER_ADDR");
    if (root && *root) {
        if ((rc = fr_parse_root(fr_cfg_name(FR_CFG_ROOT), root, env, err)) !=
            FERRY_OK)
            return rc;
    } else if (maddr) {
        const char *mport = fr_env("MASTER_PORT");
        long port = 0;
        if (!mport)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "MASTER_ADDR is set (%s) but MASTER_PORT is not",
                          maddr);
        if ((rc = fr_env_int("MASTER_PORT", mport, &port, err)) != FERRY_OK)
            return rc;
        /* torchrun's own store holds MASTER_PORT; ferry uses the next one. */
        if (port < 1 || port + 1 > 65535)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "MASTER_PORT=%ld: ferry listens on MASTER_PORT+1, "
                          "which must be in 1..65535; set FERRY_ROOT",
                          port);
        if (strlen(maddr) >= sizeof(env->root_host))
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "MASTER_ADDR='%s': host name too long", maddr);
        snprintf(env->root_host, sizeof(env->root_host), "%s", maddr);
        env->root_port = (int)port + 1;
    } else {
        if (!fr_env_all_local(size))
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "no rendezvous address: set FERRY_ROOT=host:port "
                          "(reachable address of rank 0 and a free port; "
                          "ranks are not all on one host, so 127.0.0.1 "
                          "cannot be used)");
        char id[512] = "";
        const char *v;
        if ((v = fr_env("PMIX_NAMESPACE")))
            snprintf(id, sizeof(id), "pmix:%s", v);
        else if ((v = fr_env("OMPI_MCA_ess_base_jobid")))
            snprintf(id, sizeof(id), "ompi:%s", v);
        else if ((v = fr_env("SLURM_JOB_ID"))) {
            const char *step = fr_env("SLURM_STEP_ID");
            snprintf(id, sizeof(id), "slurm:%s.%s", v, step ? step : "");
        }
        if (!id[0] && size > 1)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "no rendezvous address: set FERRY_ROOT=host:port "
                          "(no launcher job id to derive a port from)");
        snprintf(env->root_host, sizeof(env->root_host), "127.0.0.1");
        env->root_port = fr_port_from_id(id[0] ? id : "ferry");
    }

    return FERRY_OK;
}

/* The job's id among this user's local jobs: every rank of one job gets
 * the same, two jobs running at once get different ones. */
static void fr_env_job(fr_boot_env_t *env)
{
    const char *v, *step;
    const char *mine = fr_cfg_str(FR_CFG_JOB_ID);
    if (mine && *mine) {
        snprintf(env->job, sizeof(env->job), "ferry:%s", mine);
        env->job_from = fr_cfg_name(FR_CFG_JOB_ID);
    } else if ((v = fr_env("PMIX_NAMESPACE"))) {
        snprintf(env->job, sizeof(env->job), "pmix:%s", v);
        env->job_from = "PMIX_NAMESPACE";
    } else if ((v = fr_env("OMPI_MCA_ess_base_jobid"))) {
        snprintf(env->job, sizeof(env->job), "ompi:%s", v);
        env->job_from = "OMPI_MCA_ess_base_jobid";
    } else if ((v = fr_env("SLURM_JOB_ID"))) {
        step = fr_env("SLURM_STEP_ID");
        snprintf(env->job, sizeof(env->job), "slurm:%s.%s", v,
                 step ? step : "");
        env->job_from = "SLURM_JOB_ID";
    } else if ((v = fr_env("TORCHELASTIC_RUN_ID")) && strcmp(v, "none")) {
        snprintf(env->job, sizeof(env->job), "torchrun:%s", v);
        env->job_from = "TORCHELASTIC_RUN_ID";
    } else {
        env->job_ppid = (int)getppid();
        snprintf(env->job, sizeof(env->job), "ppid:%d", env->job_ppid);
        env->job_from = "the parent process";
    }
}

/* Process pid runs a command shell (its name, in comm): a shell starts any
 * number of jobs, so its pid cannot name one. */
static int fr_env_is_shell(int pid, char *comm, size_t cap)
{
    static const char *const shells[] = {
        "sh",  "bash", "dash", "zsh",  "ksh",  "ksh93", "mksh", "pdksh",
        "ash", "fish", "tcsh", "csh",  "yash", "busybox", "xonsh", "nu",
        "elvish", "pwsh", "rbash", "oksh", "loksh"};
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/comm", pid);
    comm[0] = '\0';
    FILE *f = fopen(path, "re");
    if (!f)
        return 0;
    if (!fgets(comm, (int)cap, f))
        comm[0] = '\0';
    fclose(f);
    comm[strcspn(comm, "\n")] = '\0';
    /* A login shell is named "-bash". */
    const char *name = comm[0] == '-' ? comm + 1 : comm;
    for (size_t i = 0; i < sizeof(shells) / sizeof(shells[0]); i++)
        if (!strcmp(name, shells[i]))
            return 1;
    return 0;
}

int fr_boot_env_check_job(const fr_boot_env_t *env, fr_err_t *err)
{
    char comm[64];
    if (!env || env->size < 2 || env->has_key || !env->job_ppid ||
        !fr_env_is_shell(env->job_ppid, comm, sizeof(comm)))
        return FERRY_OK;
    return FR_ERR(err, FERRY_ERR_INVALID,
                  "rank %d: nothing tells this job from another one that "
                  "shell %s (pid %d) starts on port %s:%d: %s is not set, "
                  "no launcher gave a job id, and %s is not set, so the job "
                  "id would be only the parent's pid ('%s'), which two jobs "
                  "of that shell share (their ranks would take each other's "
                  "places). Give every rank of this job the same %s, one "
                  "per job (e.g. export %s=$(date +%%s%%N) before starting "
                  "its ranks), or a %s of its own",
                  env->rank, comm, env->job_ppid, env->root_host,
                  env->root_port, fr_cfg_name(FR_CFG_JOB_ID),
                  fr_cfg_name(FR_CFG_SECRET), env->job,
                  fr_cfg_name(FR_CFG_JOB_ID), fr_cfg_name(FR_CFG_JOB_ID),
                  fr_cfg_name(FR_CFG_SECRET));
}

int fr_boot_env_read(fr_boot_env_t *env, fr_err_t *err)
{
    if (!env)
        return FR_ERR(err, FERRY_ERR_INVALID, "fr_boot_env_read: env is NULL");
    memset(env, 0, sizeof(*env));
    env->rank = -1;

    static const struct {
        const char *rank, *size, *source;
    } srcs[] = {
        {NULL, NULL, "FERRY"}, /* through fr_cfg_str */
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI"},
        {"RANK", "WORLD_SIZE", "torchrun"},
        {"SLURM_PROCID", "SLURM_NTASKS", "slurm"},
    };
    const char *rname = NULL, *sname = NULL, *rval = NULL, *sval = NULL;
    int rc;
    for (size_t i = 0; i < sizeof(srcs) / sizeof(srcs[0]); i++) {
        const char *rn, *sn, *rv, *sv;
        if (i == 0) {
            rn = fr_cfg_name(FR_CFG_RANK);
            sn = fr_cfg_name(FR_CFG_WORLD_SIZE);
            rv = fr_cfg_str(FR_CFG_RANK);
            sv = fr_cfg_str(FR_CFG_WORLD_SIZE);
            rv = (rv && *rv) ? rv : NULL;
            sv = (sv && *sv) ? sv : NULL;
        } else {
            rn = srcs[i].rank;
            sn = srcs[i].size;
            rv = fr_env(rn);
            sv = fr_env(sn);
        }
        if (!rv && !sv)
            continue;
        if (!rv || !sv)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "%s is set (%s) but %s is not; set both",
                          rv ? rn : sn, rv ? rv : sv, rv ? sn : rn);
        rname = rn;
        sname = sn;
        rval = rv;
        sval = sv;
        env->source = srcs[i].source;
        break;
    }
    if (!env->source)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "no rank in the environment: set FERRY_RANK and "
                      "FERRY_WORLD_SIZE (or launch with mpirun, torchrun or "
                      "srun)");

    long rank = 0, size = 0;
    if ((rc = fr_env_int(rname, rval, &rank, err)) != FERRY_OK)
        return rc;
    if ((rc = fr_env_int(sname, sval, &size, err)) != FERRY_OK)
        return rc;
    if (size < 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "%s=%ld: must be at least 1",
                      sname, size);
    if (rank < 0 || rank >= size)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "%s=%ld is out of range for %s=%ld (want 0..%ld)", rname,
                      rank, sname, size, size - 1);
    env->rank = (int)rank;
    env->size = (int)size;

    if ((rc = fr_env_root(env, size, err)) != FERRY_OK)
        return rc;
    env->local = fr_env_all_local(size) || fr_host_is_loopback(env->root_host);
    if ((rc = fr_env_secret(env, err)) != FERRY_OK)
        return rc;
    fr_env_job(env);
    FR_LOG_INFO(FR_SUB_BOOT,
                "bootstrap env (%s): rank %d of %d, root %s:%d, %s, secret "
                "from %s%s%s",
                env->source, env->rank, env->size, env->root_host,
                env->root_port, env->local ? "all ranks local" : "multi-host",
                env->has_key ? fr_cfg_name(FR_CFG_SECRET)
                             : "a per-user key file",
                env->has_key ? "" : " of job ", env->has_key ? "" : env->job);
    return FERRY_OK;
}
