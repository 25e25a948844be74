/*
 * fr_launch_local: fork n ranks of this program on this host, with a fresh
 * random job secret (FERRY_SECRET) that only they know. The parent
 * forwards SIGINT and SIGTERM to the ranks, reaps them, removes the shm
 * endpoint regions of any rank that died before closing them, and gives
 * the others a bounded grace after the first failure before killing them.
 */
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "bootstrap/hmac.h"
#include "core/config.h"
#include "core/log.h"
#include "launch.h"
#include "runtime/rt.h"
#include "transport/transport.h"

#define FR_LAUNCH_POLL_MS 20

/* Children still running, for the signal handler (0: reaped). */
static volatile pid_t *fr_launch_pids;
static volatile int fr_launch_n;

static void fr_launch_forward(int sig)
{
    int saved = errno;
    volatile pid_t *p = fr_launch_pids;
    for (int i = 0; p && i < fr_launch_n; i++)
        if (p[i] > 0)
            kill(p[i], sig);
    errno = saved;
}

void fr_launch_drop_psm_handlers(void)
{
    static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGINT, SIGTERM, SIGFPE};
    int dropped = 0;
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        struct sigaction sa;
        if (sigaction(sigs[i], NULL, &sa) != 0)
            continue;
        void *h = (sa.sa_flags & SA_SIGINFO) ? (void *)sa.sa_sigaction : (void *)sa.sa_handler;
        if (h == (void *)SIG_DFL || h == (void *)SIG_IGN)
            continue;
        Dl_info di;
        if (!dladdr(h, &di) || !di.dli_fname)
            continue;
        if (strstr(di.dli_fname, "libinfinipath") || strstr(di.dli_fname, "libpsm")) {
            signal(sigs[i], SIG_DFL);
            dropped++;
        }
    }
    if (dropped)
        FR_LOG_INFO(FR_SUB_BOOT, "put back the default action of %d signal%s whose handler "
                    "libinfinipath installed (it can deadlock a crashing rank)", dropped,
                    dropped == 1 ? "" : "s");
}

/* A free loopback port for the job's root (fr_boot_free_port). */
static int fr_free_port(fr_err_t *err, int *port)
{
    int e = fr_boot_free_port(port);
    if (e != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM,
                      "launch: cannot find a free loopback port: %s",
                      strerror(e));
    return FERRY_OK;
}

int fr_launch_make_secret(char *hex, size_t cap, fr_err_t *err)
{
    unsigned char r[32];
    if (cap < 2 * sizeof(r) + 1)
        return FR_ERR(err, FERRY_ERR_INVALID, "launch: secret buffer too small");
    if (fr_boot_random(r, sizeof(r)) != 0)
        return FR_ERR(err, FERRY_ERR_SYSTEM,
                      "launch: no random bytes for the job secret: %s",
                      strerror(errno));
    for (size_t i = 0; i < sizeof(r); i++)
        snprintf(hex + 2 * i, 3, "%02x", r[i]);
    fr_boot_wipe(r, sizeof(r));
    return FERRY_OK;
}

static int fr_decode_status(int st)
{
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return 255;
}

static void fr_report(int rank, int st)
{
    if (WIFSIGNALED(st))
        fprintf(stderr, "ferry: rank %d killed by signal %d (%s)\n", rank,
                WTERMSIG(st), strsignal(WTERMSIG(st)));
    else if (WIFEXITED(st))
        fprintf(stderr, "ferry: rank %d exited with status %d\n", rank,
                WEXITSTATUS(st));
}

/* Reap the started ranks (pids[i] becomes 0), sweeping the shm regions of
 * each and reporting failures; after the first failure the others get
 * FERRY_TIMEOUT_MS plus 2 s, then SIGKILL. Returns the first failure's exit
 * status, or 0. */
static int fr_launch_wait(pid_t *pids, int started, int *status)
{
    long grace = fr_cfg_int(FR_CFG_TIMEOUT_MS) + 2000; /* 1..a week, + 2 s */
    int left = started, first = 0, first_rank = -1, killed = 0;
    int64_t kill_at = -1;
    while (left > 0) {
        for (int i = 0; i < started; i++) {
            if (pids[i] <= 0)
                continue;
            int st = 0;
            pid_t w = waitpid(pids[i], &st, WNOHANG);
            if (w == 0 || (w < 0 && errno == EINTR))
                continue;
            int code = w < 0 ? 255 : fr_decode_status(st);
            if (w > 0) {
                /* what a rank that died left in /dev/shm: its EP segments
                 * (killed inside create, before they are unlinked), its
                 * shm provider regions (endpoints it did not close) */
                int swept = fr_shm_sweep_pid((long)w);
                if (swept)
                    FR_LOG_INFO(FR_SUB_BOOT, "removed %d shm region%s left "
                                "by rank %d (pid %d)", swept,
                                swept == 1 ? "" : "s", i, (int)w);
            }
            pids[i] = 0;
            left--;
            if (status)
                status[i] = code;
            if (code == 0)
                continue;
            if (w > 0)
                fr_report(i, st);
            else
                fprintf(stderr, "ferry: rank %d vanished (waitpid: %s)\n", i,
                        strerror(errno));
            if (first == 0) {
                first = code;
                first_rank = i;
                kill_at = fr_boot_now_ms() + grace;
                if (left > 0)
                    fprintf(stderr,
                            "ferry: giving the other %d rank%s %ld ms to "
                            "finish\n",
                            left, left == 1 ? "" : "s", grace);
            }
        }
        if (left == 0)
            break;
        if (kill_at >= 0 && !killed && fr_boot_now_ms() >= kill_at) {
            killed = 1;
            for (int i = 0; i < started; i++)
                if (pids[i] > 0) {
                    fprintf(stderr,
                            "ferry: killing rank %d: still running %ld ms "
                            "after rank %d failed\n",
                            i, grace, first_rank);
                    kill(pids[i], SIGKILL);
                }
        }
        fr_boot_sleep_ms(FR_LAUNCH_POLL_MS);
    }
    return first;
}

void fr_launch_set_node(int rank, int n, int nodes)
{
    char v[32];
    snprintf(v, sizeof(v), "node%d", (int)((long)rank * nodes / n));
    setenv(fr_cfg_name(FR_CFG_NODE_ID), v, 1);
}

int fr_launch_local_ex(int n, int *is_child, int *status, fr_err_t *err)
{
    if (!is_child)
        return FR_ERR(err, FERRY_ERR_INVALID, "launch: is_child is NULL");
    *is_child = 0;
    if (n < 1 || n > FR_LAUNCH_MAX)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "launch: n=%d ranks; want 1..%d", n, FR_LAUNCH_MAX);
    if (fr_launch_pids)
        return FR_ERR(err, FERRY_ERR_STATE, "launch: already launching");
    const char *ln = getenv("FERRY_LAUNCH_NODES");
    if (ln && *ln) {
        char *end = NULL;
        long h = strtol(ln, &end, 10);
        if (*end || h < 1 || h > n)
            return FR_ERR(err, FERRY_ERR_INVALID,
                          "FERRY_LAUNCH_NODES=%s: want 1..%d nodes (the ranks launched)", ln,
                          n);
    }
    /* the ranks would each refuse a time setting out of range: once here */
    int port = 0, rc = fr_cfg_check(err);
    if (rc != FERRY_OK)
        return rc;
    fr_launch_drop_psm_handlers(); /* the ranks inherit the default actions */
    char secret[65];
    if ((rc = fr_free_port(err, &port)) != FERRY_OK ||
        (rc = fr_launch_make_secret(secret, sizeof(secret), err)) != FERRY_OK)
        return rc;
    pid_t *pids = calloc((size_t)n, sizeof(pid_t));
    if (!pids)
        return FR_ERR(err, FERRY_ERR_NOMEM, "launch: out of memory");
    if (status)
        for (int i = 0; i < n; i++)
            status[i] = -1;

    /* Signals that arrive while forking wait until the pids are known. */
    sigset_t block, oldmask;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &block, &oldmask);
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = fr_launch_forward;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    /* Forward, unless the signal is ignored (nohup, background jobs). */
    sigaction(SIGINT, NULL, &old_int);
    sigaction(SIGTERM, NULL, &old_term);
    if (old_int.sa_handler != SIG_IGN)
        sigaction(SIGINT, &sa, NULL);
    if (old_term.sa_handler != SIG_IGN)
        sigaction(SIGTERM, &sa, NULL);
    /* Ignored SIGCHLD would reap the ranks before waitpid sees them. */
    struct sigaction old_chld, dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGCHLD, NULL, &old_chld);
    int chld_ign = old_chld.sa_handler == SIG_IGN ||
                   (old_chld.sa_flags & SA_NOCLDWAIT);
    if (chld_ign)
        sigaction(SIGCHLD, &dfl, NULL);
    fr_launch_pids = pids;
    fr_launch_n = n;

    fflush(stdout);
    fflush(stderr);
    pid_t parent = getpid();
    char root[64], v[32];
    snprintf(root, sizeof(root), "127.0.0.1:%d", port);
    int started = 0, fork_errno = 0;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            /* Child: becomes rank i. */
            fr_launch_pids = NULL;
            fr_launch_n = 0;
            free(pids);
            sigaction(SIGINT, &old_int, NULL);
            sigaction(SIGTERM, &old_term, NULL);
            if (chld_ign)
                sigaction(SIGCHLD, &old_chld, NULL);
            pthread_sigmask(SIG_SETMASK, &oldmask, NULL);
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) /* the launcher is already gone */
                _exit(127);
            snprintf(v, sizeof(v), "%d", i);
            setenv(fr_cfg_name(FR_CFG_RANK), v, 1);
            snprintf(v, sizeof(v), "%d", n);
            setenv(fr_cfg_name(FR_CFG_WORLD_SIZE), v, 1);
            setenv(fr_cfg_name(FR_CFG_ROOT), root, 1);
            setenv(fr_cfg_name(FR_CFG_SECRET), secret, 1);
            fr_boot_wipe(secret, sizeof(secret));
            /* FERRY_LAUNCH_NODES=H (tests, benchmarks): as if the job
             * spanned H nodes */
            if (ln && atoi(ln) > 1)
                fr_launch_set_node(i, n, atoi(ln));
            *is_child = 1;
            return FERRY_OK;
        }
        if (pid < 0) {
            fork_errno = errno;
            break;
        }
        pids[i] = pid;
        started++;
    }
    pthread_sigmask(SIG_SETMASK, &oldmask, NULL);
    if (fork_errno) {
        for (int i = 0; i < started; i++)
            kill(pids[i], SIGKILL);
    } else {
        FR_LOG_INFO(FR_SUB_BOOT, "launched %d ranks, root %s", n, root);
    }

    fr_boot_wipe(secret, sizeof(secret));
    int first = fr_launch_wait(pids, started, status);

    fr_launch_pids = NULL;
    fr_launch_n = 0;
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (chld_ign)
        sigaction(SIGCHLD, &old_chld, NULL);
    free(pids);
    if (fork_errno)
        return FR_ERR(err, FERRY_ERR_SYSTEM,
                      "launch: fork of rank %d of %d failed: %s", started, n,
                      strerror(fork_errno));
    return first;
}

int fr_launch_local(int n, int *is_child, fr_err_t *err)
{
    return fr_launch_local_ex(n, is_child, NULL, err);
}
