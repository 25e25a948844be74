/*
 * ferry-bench: dispatch + combine, verified every round, timed side by side
 * with the two-phase MPI exchange users write today.
 *
 * With no launcher around it starts its own ranks: through mpirun when it
 * is installed (so the MPI baseline runs in the same job), else by forking.
 * Under mpirun, torchrun or srun it uses their ranks.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef FERRY_HAVE_MPI
#include <mpi.h>
#endif

#include "bench/bench.h"
#include "ferry.h"
#include "launch.h"
#include "opt.h"

#define TOOL "ferry-bench"
/* the most rounds of either kind: warm-up plus timed stays an int */
#define MAX_ROUNDS 1000000000L

static void usage(FILE *f)
{
    fprintf(f,
            "usage: ferry-bench [options]\n"
            "  -n, --ranks N        ranks to start (default 8; ignored under a launcher)\n"
            "      --experts E      global experts (default 256)\n"
            "      --topk K         experts per token (default 8)\n"
            "      --hidden H       hidden size (default 7168)\n"
            "      --tokens T[,T2,...]  tokens per rank per round (default 128); a list\n"
            "                       sweeps them, one row each (one job: the contexts are\n"
            "                       made again for each)\n"
            "      --csv FILE       the rows as CSV too (a header line first)\n"
            "      --dtype fp8|bf16|mixed|nvfp4  dispatch dtype (default fp8; mixed: a\n"
            "                       bf16 and an fp8 context, alternating every round;\n"
            "                       nvfp4: low latency, encode scale 100.3)\n"
            "      --routing uniform|zipf:S|groups:G:M   expert choice (default uniform;\n"
            "                       groups: experts in G groups, each token picks M\n"
            "                       groups at random, then its top-k among their experts,\n"
            "                       as DeepSeek-V3 routes: a token reaches few nodes)\n"
            "      --mask P         probability a top-k slot is -1 (default 0)\n"
            "      --vary-tokens    token count per rank and round random in 0..T\n"
            "      --empty P        with --vary-tokens: probability of 0 tokens\n"
            "      --iters N        timed rounds (default 20)\n"
            "      --warmup N       untimed rounds first (default 3)\n"
            "      --seed S         workload seed (default 1)\n"
            "      --transport auto|fabric|null   auto, fabric: sets FERRY_TRANSPORT for\n"
            "                       the run; null: the proxy alone, in this process, with\n"
            "                       --peers simulated fabric peers whose writes complete at\n"
            "                       once (no bytes move, nothing is verified; implies --stats)\n"
            "      --peers P        --transport null: simulated peers (default 64)\n"
            "      --stats          add the fabric path's counters (ferry_ep_get_stats):\n"
            "                       writes, -FI_EAGAIN, proxy us per write, doorbell to\n"
            "                       post p50/p99\n"
            "      --forward auto|on|off  --mode ht across nodes: a token crosses once per\n"
            "                       destination node and is passed on there (on; auto:\n"
            "                       on with several nodes, FERRY_HT_FORWARD) or once per\n"
            "                       destination rank (off); config.forward\n"
            "      --dp G           DP groups of G consecutive ranks (config.dp_size):\n"
            "                       members hold the same tokens, each sends its share,\n"
            "                       every member gets every token's combine; verified\n"
            "                       against the reference, which knows the groups\n"
            "      --nodes N        split the ranks into N nodes, rank r on node\n"
            "                       r * N / ranks (FERRY_NODE_ID): ranks of one node\n"
            "                       use peer memory, the others the fabric path, as on\n"
            "                       a cluster (default, or 1: the host names decide)\n"
            "      --hosts H        simulate H hosts (FERRY_HOST_NAME, rank r on host\n"
            "                       r * H / ranks) that node ids do not fix: GPU ranks\n"
            "                       of one NVLink domain (FERRY_NVLINK_DOMAIN) join them\n"
            "      --device cpu|cuda\n"
            "      --sms N          CUDA: blocks the copy kernels use (default 16)\n"
            "      --gpu auto|N     CUDA: this rank's GPU (default auto: local rank\n"
            "                       modulo the visible GPUs)\n"
            "      --mode ll|ht     low latency (default) or high throughput (route,\n"
            "                       ht_dispatch, ht_combine; CPU or CUDA ranks)\n"
            "      --ring N         --mode ht: tokens per peer ring (default 256; CUDA:\n"
            "                       per channel and peer, default 64)\n"
            "      --launcher auto|mpirun|fork   how to start ranks (default auto)\n"
            "      --no-check       skip verification (prints #wrong as n/a; --mode ht\n"
            "                       without a baseline: every round the first one's inputs)\n"
            "      --round-scale    fp8: scales rounded up to powers of two (DeepEP's\n"
            "                       round_scale; checked against the same reference)\n"
            "      --scales rows|cols|ue8m0   fp8, low latency: expert_x_scales layout\n"
            "                       (default rows; cols: DeepEP's column-major; ue8m0:\n"
            "                       DeepEP's packed exponents, needs --round-scale)\n"
            "      --split          call dispatch_send/_recv and combine_send/_recv\n"
            "                       (default: ferry_dispatch and ferry_combine, one\n"
            "                       launch each on GPU ranks)\n"
            "      --graph          CUDA with --no-check: rounds captured as a CUDA graph\n"
            "                       of 20 (how engines run decode), replayed back to back\n"
            "                       and timed per replay with no event between\n"
            "                       operations; prints round time / 2 in both columns\n"
            "      --json FILE      write the result row as JSON\n"
            "  -q, --quiet          no header line\n");
}

/* --mask, --empty: a probability */
static int parse_prob(const char *name, const char *arg, double *out)
{
    char *end = NULL;
    double p = strtod(arg, &end);
    if (end == arg || *end || !(p >= 0 && p <= 1)) {
        fprintf(stderr, TOOL ": --%s %s: a probability, 0..1\n", name, arg);
        return -1;
    }
    *out = p;
    return 0;
}

/* --routing groups:G:M (1 <= M <= G, M <= 64): 0, else -1 */
static int parse_groups(const char *arg, opts_t *o)
{
    const char *g = arg + strlen("groups:"), *m = strchr(g, ':');
    long G, M;
    if (strncmp(arg, "groups:", 7) != 0 || !m || fr_opt_num(g, m, 1, INT_MAX, &G) != 0 ||
        fr_opt_num(m + 1, NULL, 1, 64, &M) != 0 || M > G)
        return -1;
    o->groups = (int)G;
    o->gpick = (int)M;
    return 0;
}

static int parse(int argc, char **argv, opts_t *o)
{
    static struct option lo[] = {
        {"ranks", 1, 0, 'n'},   {"experts", 1, 0, 'E'},  {"topk", 1, 0, 'K'},
        {"hidden", 1, 0, 'H'},  {"tokens", 1, 0, 'T'}, {"csv", 1, 0, 'c'},   {"dtype", 1, 0, 'd'},
        {"routing", 1, 0, 'r'}, {"mask", 1, 0, 'm'},     {"vary-tokens", 0, 0, 'v'},
        {"empty", 1, 0, 'z'},   {"iters", 1, 0, 'i'},    {"warmup", 1, 0, 'w'},
        {"seed", 1, 0, 's'},    {"transport", 1, 0, 't'}, {"device", 1, 0, 'D'},
        {"launcher", 1, 0, 'L'}, {"no-check", 0, 0, 'C'}, {"json", 1, 0, 'j'},
        {"quiet", 0, 0, 'q'},   {"help", 0, 0, 'h'},     {"sms", 1, 0, 'S'},
        {"gpu", 1, 0, 'G'},     {"mode", 1, 0, 'M'},     {"ring", 1, 0, 'R'},
        {"graph", 0, 0, 'g'},   {"split", 0, 0, 'p'},    {"round-scale", 0, 0, 'o'},
        {"scales", 1, 0, 'x'},  {"nodes", 1, 0, 'N'}, {"forward", 1, 0, 'F'},    {"stats", 0, 0, 'Z'},
        {"peers", 1, 0, 'P'},   {"dp", 1, 0, 'y'},      {"hosts", 1, 0, 'W'},
        {0, 0, 0, 0}};
    *o = (opts_t){.ranks = 8, .experts = 256, .topk = 8, .hidden = 7168,
                  .tokens = 128, .iters = 20, .warmup = 3, .fp8 = 1,
                  .check = 1, .seed = 1, .transport = NULL, .device = "cpu",
                  .launcher = "auto", .routing = "uniform", .gpu = "auto", .nodes = 1, .hosts = 1,
                  .peers = 64};
    int c, bad = 0;
    while ((c = getopt_long(argc, argv, "n:qh", lo, NULL)) != -1) {
        char *end = NULL;
        /* every number whole and in range, else refused naming the option
         * (a cast of strtol's long wrapped: -n 4294967298 ran 2 ranks) */
        switch (c) {
        case 'n': bad = fr_opt_int(TOOL, "ranks", optarg, 1, FR_LAUNCH_MAX, &o->ranks); break;
        case 'E': bad = fr_opt_int(TOOL, "experts", optarg, 1, INT_MAX, &o->experts); break;
        case 'K': bad = fr_opt_int(TOOL, "topk", optarg, 1, INT_MAX, &o->topk); break;
        case 'H': bad = fr_opt_int(TOOL, "hidden", optarg, 1, INT_MAX, &o->hidden); break;
        case 'T':
            o->ntoks = fr_opt_list(TOOL, "tokens", optarg, 0, INT_MAX, o->toks,
                                   (int)(sizeof(o->toks) / sizeof(o->toks[0])));
            bad = o->ntoks < 0;
            o->ntoks = bad ? 0 : o->ntoks;
            o->tokens = o->toks[0];
            break;
        case 'c': o->csv = optarg; break;
        case 'i': bad = fr_opt_int(TOOL, "iters", optarg, 1, MAX_ROUNDS, &o->iters); break;
        case 'w': bad = fr_opt_int(TOOL, "warmup", optarg, 0, MAX_ROUNDS, &o->warmup); break;
        case 's': bad = fr_opt_u64(TOOL, "seed", optarg, &o->seed); break;
        case 'm': bad = parse_prob("mask", optarg, &o->mask); break;
        case 'z': bad = parse_prob("empty", optarg, &o->empty); break;
        case 'v': o->vary = 1; break;
        case 'S': bad = fr_opt_int(TOOL, "sms", optarg, 0, INT_MAX, &o->sms); break;
        case 'G': o->gpu = optarg; break;
        case 'R': bad = fr_opt_int(TOOL, "ring", optarg, 0, INT_MAX, &o->ring); break;
        case 'N': bad = fr_opt_int(TOOL, "nodes", optarg, 1, FR_LAUNCH_MAX, &o->nodes); break;
        case 'W': bad = fr_opt_int(TOOL, "hosts", optarg, 1, FR_LAUNCH_MAX, &o->hosts); break;
        case 'P': bad = fr_opt_int(TOOL, "peers", optarg, 1, INT_MAX, &o->peers); break;
        case 'Z': o->stats = 1; break;
        case 'o': o->round_scale = 1; break;
        case 'x':
            if (strcmp(optarg, "rows") == 0) {
                o->scales = FERRY_SCALES_ROWS;
            } else if (strcmp(optarg, "cols") == 0) {
                o->scales = FERRY_SCALES_COLS;
            } else if (strcmp(optarg, "ue8m0") == 0) {
                o->scales = FERRY_SCALES_UE8M0;
            } else {
                fprintf(stderr, "ferry-bench: --scales %s: use rows, cols or ue8m0\n", optarg);
                return -1;
            }
            break;
        case 'M':
            if (strcmp(optarg, "ll") == 0 || strcmp(optarg, "ht") == 0) {
                o->ht = optarg[0] == 'h';
            } else {
                fprintf(stderr, "ferry-bench: --mode %s: use ll or ht\n", optarg);
                return -1;
            }
            break;
        case 'C': o->check = 0; break;
        case 'g': o->graph = 1; break;
        case 'p': o->split = 1; break;
        case 'q': o->quiet = 1; break;
        case 'j': o->json = optarg; break;
        case 'L': o->launcher = optarg; break;
        case 'D': o->device = optarg; break;
        case 't': o->transport = optarg; break;
        case 'd':
            if (strcmp(optarg, "fp8") == 0)
                o->fp8 = 1;
            else if (strcmp(optarg, "bf16") == 0)
                o->fp8 = 0;
            else if (strcmp(optarg, "mixed") == 0)
                o->fp8 = 2; /* two contexts, bf16 and fp8, alternating */
            else if (strcmp(optarg, "nvfp4") == 0)
                o->fp8 = 3; /* NVFP4, low latency */
            else {
                fprintf(stderr, "ferry-bench: --dtype %s: use fp8, bf16, mixed or nvfp4\n",
                        optarg);
                return -1;
            }
            break;
        case 'y': bad = fr_opt_int(TOOL, "dp", optarg, 0, INT_MAX, &o->dp); break;
        case 'F':
            if (strcmp(optarg, "auto") == 0)
                o->forward = FERRY_FORWARD_AUTO;
            else if (strcmp(optarg, "on") == 0)
                o->forward = FERRY_FORWARD_ON;
            else if (strcmp(optarg, "off") == 0)
                o->forward = FERRY_FORWARD_OFF;
            else {
                fprintf(stderr, "ferry-bench: --forward %s: use auto, on or off\n", optarg);
                return -1;
            }
            break;
        case 'r':
            o->routing = optarg;
            o->zipf = 0;
            o->groups = o->gpick = 0;
            if (strcmp(optarg, "uniform") == 0)
                o->zipf = 0;
            else if (parse_groups(optarg, o) == 0)
                end = NULL;
            else if (strncmp(optarg, "zipf:", 5) == 0 &&
                     (o->zipf = strtod(optarg + 5, &end)) > 0 && *end == 0)
                end = NULL;
            else {
                fprintf(stderr, "ferry-bench: --routing %s: use uniform, zipf:S (S > 0) or "
                        "groups:G:M (1 <= M <= G, M <= 64)\n", optarg);
                return -1;
            }
            break;
        case 'h': usage(stdout); exit(0);
        default: usage(stderr); return -1;
        }
        if (bad)
            return -1;
        if (end && *end) {
            fprintf(stderr, "ferry-bench: bad number '%s'\n", optarg);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "ferry-bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (o->graph && (o->check || strcmp(o->device, "cuda") != 0 || o->ht)) {
        fprintf(stderr, "ferry-bench: --graph needs --device cuda --no-check (low-latency mode)\n");
        return -1;
    }
    if (o->fp8 == 3 && o->ht) {
        fprintf(stderr, "ferry-bench: --dtype nvfp4 runs in low-latency mode, without the MPI "
                        "baseline\n");
        return -1;
    }
    if (o->ntoks == 0)
        o->toks[o->ntoks++] = o->tokens;
    return 0;
}

/* Launchers' variables for this rank's number and the world size; the
 * last (torchrun's) counts only with its size, being a common name. */
static const struct {
    const char *rank, *size;
    int need_size;
} launcher_env[] = {{"FERRY_RANK", "FERRY_WORLD_SIZE", 0},
                    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", 0},
                    {"PMI_RANK", "PMI_SIZE", 0},
                    {"SLURM_PROCID", "SLURM_NTASKS", 0},
                    {"RANK", "WORLD_SIZE", 1}};
#define N_LAUNCHER_ENV (sizeof(launcher_env) / sizeof(launcher_env[0]))

static int in_launcher(void)
{
    for (size_t i = 0; i < N_LAUNCHER_ENV; i++)
        if (getenv(launcher_env[i].rank) &&
            (!launcher_env[i].need_size || getenv(launcher_env[i].size)))
            return 1;
    return 0;
}

#ifdef FERRY_HAVE_MPI
static int have_mpirun(void)
{
    const char *path = getenv("PATH");
    if (!path)
        return 0;
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    char *save = NULL;
    for (char *d = strtok_r(buf, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        char p[4200];
        snprintf(p, sizeof(p), "%s/mpirun", d);
        if (access(p, X_OK) == 0)
            return 1;
    }
    return 0;
}
#endif

static int launch(int argc, char **argv, const opts_t *o)
{
    int use_mpi = 0;
#ifdef FERRY_HAVE_MPI
    if (strcmp(o->launcher, "mpirun") == 0 ||
        (strcmp(o->launcher, "auto") == 0 && have_mpirun()))
        use_mpi = 1;
#endif
    if (strcmp(o->launcher, "auto") && strcmp(o->launcher, "mpirun") &&
        strcmp(o->launcher, "fork")) {
        fprintf(stderr, "ferry-bench: --launcher %s: use auto, mpirun or fork\n",
                o->launcher);
        return 2;
    }
    if (o->transport)
        setenv("FERRY_TRANSPORT", o->transport, 1);
    if (use_mpi) {
        /* mpirun starts the ranks; the baseline runs in the same job. */
        char n[16];
        snprintf(n, sizeof(n), "%d", o->ranks);
        char self[4096];
        ssize_t l = readlink("/proc/self/exe", self, sizeof(self) - 1);
        if (l <= 0)
            snprintf(self, sizeof(self), "%s", argv[0]);
        else
            self[l] = 0;
        /* A job secret for the ranks' rendezvous, passed on by mpirun. */
        const char *sv = getenv("FERRY_SECRET");
        if (!sv || !*sv) {
            char secret[65];
            fr_err_t serr = {{0}};
            if (fr_launch_make_secret(secret, sizeof(secret), &serr) != FERRY_OK) {
                fprintf(stderr, "ferry-bench: %s\n", serr.msg);
                return 2;
            }
            setenv("FERRY_SECRET", secret, 1);
        }
        const char *base[] = {"mpirun", "-n", n, "--oversubscribe",
                              "--bind-to", "none", "--mca", "btl", "self,vader",
                              "--mca", "mpi_yield_when_idle", "1",
                              "-x", "FERRY_SECRET"};
        int nb = (int)(sizeof(base) / sizeof(base[0]));
        char **av = calloc((size_t)(argc + nb + 4), sizeof(char *));
        int k = 0;
        for (int i = 0; i < nb; i++)
            av[k++] = (char *)base[i];
        if (geteuid() == 0)
            av[k++] = "--allow-run-as-root";
        av[k++] = self;
        for (int i = 1; i < argc; i++)
            av[k++] = argv[i];
        av[k] = NULL;
        fflush(stdout);
        execvp("mpirun", av);
        fprintf(stderr, "ferry-bench: exec mpirun: %s\n", strerror(errno));
        return 2;
    }
    int is_child = 0;
    fr_err_t err = {{0}};
    int rc = fr_launch_local(o->ranks, &is_child, &err);
    if (is_child)
        return -1; /* continue as a rank */
    if (rc < 0)
        fprintf(stderr, "ferry-bench: %s\n", err.msg);
    return rc == 0 ? 0 : (rc < 0 ? 2 : rc);
}

/* -- one rank's run, step by step ---------------------------------------- */

/* The communicator: through MPI when mpirun started the job (the baseline
 * then runs beside ferry), else from the environment. */
static int open_comm(bench_t *b, int *argc, char ***argv)
{
    char errbuf[512] = "";
    int rc;
#ifdef FERRY_HAVE_MPI
    if (getenv("OMPI_COMM_WORLD_RANK")) {
        MPI_Init(argc, argv);
        int r, n;
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
        MPI_Comm_size(MPI_COMM_WORLD, &n);
        rc = ferry_comm_init_allgather(r, n, mpi_allgather_cb, NULL, &b->comm,
                                       errbuf, sizeof(errbuf));
        b->have_base = 1;
    } else
#endif
        rc = ferry_comm_init_env(&b->comm, errbuf, sizeof(errbuf));
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: communicator: %s: %s\n", ferry_strerror(rc), errbuf);
        return 1;
    }
    b->me = ferry_comm_rank(b->comm);
    b->N = ferry_comm_size(b->comm);
    return 0;
}

/* The workload spec and the EP config, from the options. */
static int make_config(bench_t *b)
{
    const opts_t *o = b->o;
    b->s = (fw_spec_t){.N = b->N, .E = o->experts, .K = o->topk, .H = o->hidden,
                       .T = o->tokens, .fp8 = o->fp8, .zipf_s = o->zipf,
                       .mask_p = o->mask, .vary_tokens = o->vary, .empty_p = o->empty,
                       .seed = o->seed, .round_scale = o->round_scale,
                       .groups = o->groups, .gpick = o->gpick, .dp = o->dp};
    ferry_ep_config_t cfg = FERRY_EP_CONFIG_INIT;
    cfg.num_experts = o->experts;
    cfg.topk = o->topk;
    cfg.hidden = o->hidden;
    cfg.max_tokens = o->tokens > 0 ? o->tokens : 1;
    cfg.dispatch_dtype = o->fp8 == 1   ? FERRY_DTYPE_FP8_E4M3
                         : o->fp8 == 3 ? FERRY_DTYPE_NVFP4
                                       : FERRY_DTYPE_BF16;
    cfg.device = strcmp(o->device, "cuda") == 0 ? FERRY_DEVICE_CUDA : FERRY_DEVICE_CPU;
    cfg.num_sms = o->sms;
    cfg.mode = o->ht ? FERRY_MODE_HIGH_THROUGHPUT : FERRY_MODE_LOW_LATENCY;
    cfg.ring_tokens = o->ring;
    cfg.fp8_round_scale = o->round_scale;
    cfg.scales_layout = o->scales;
    cfg.forward = o->forward;
    cfg.dp_size = o->dp;
    b->cfg = cfg;
    if (o->groups && (o->experts % o->groups || o->topk > o->gpick * (o->experts / o->groups))) {
        fprintf(stderr, "ferry-bench: --routing groups:%d:%d: the groups must divide the %d "
                "experts and %d groups hold at least top-k (%d) experts\n", o->groups,
                o->gpick, o->experts, o->gpick, o->topk);
        return 2;
    }
    if (o->round_scale && (o->fp8 != 1 || o->ht)) {
        fprintf(stderr, "ferry-bench: --round-scale needs --dtype fp8 in low-latency mode\n");
        return 2;
    }
    if (o->scales && (o->fp8 != 1 || o->ht)) {
        fprintf(stderr, "ferry-bench: --scales needs --dtype fp8 in low-latency mode\n");
        return 2;
    }
    if (o->scales == FERRY_SCALES_UE8M0 && !o->round_scale) {
        fprintf(stderr, "ferry-bench: --scales ue8m0 needs --round-scale (UE8M0 holds "
                        "powers of two only)\n");
        return 2;
    }
    if (o->dp > 1 && (o->graph || b->have_base || o->fp8 == 2)) {
        fprintf(stderr, "ferry-bench: --dp runs without --graph, --dtype mixed or the MPI "
                        "baseline (start the ranks with --launcher fork)\n");
        return 2;
    }
    if (o->ht && o->fp8 == 2) {
        fprintf(stderr, "ferry-bench: --mode ht runs with --dtype fp8 or bf16\n");
        return 2;
    }
    if (o->fp8 == 3 && (o->ht || b->have_base)) {
        fprintf(stderr, "ferry-bench: --dtype nvfp4 runs in low-latency mode, without the MPI "
                        "baseline\n");
        return 2;
    }
    if (o->fp8 == 2 && cfg.device == FERRY_DEVICE_CUDA) {
        fprintf(stderr, "ferry-bench: --dtype mixed is for CPU ranks\n");
        return 2;
    }
    b->s.fp8 = o->fp8 == 1;
    b->s.nvfp4 = o->fp8 == 3;
    b->s.gs = 100.3f; /* NVFP4's encode scale: not a power of two, no block saturates */
    return 0;
}

/* The EP (with --dtype mixed two: bf16, then fp8) and its layout. */
static int create_eps(bench_t *b)
{
    ferry_ep_config_t cfg = b->cfg;
    int gpu = -1;
    if (cfg.device == FERRY_DEVICE_CUDA && dev_bind(b->o->gpu, b->me, &gpu) != 0) {
        ferry_comm_destroy(b->comm); /* the others fail in their create */
        return 1;
    }
    if (gpu >= 0 && !b->o->quiet)
        fprintf(stderr, "ferry-bench: rank %d on GPU %d\n", b->me, gpu);
    b->rc = ferry_ep_create(b->comm, &cfg, &b->ep);
    b->eps[0] = b->ep;
    if (b->rc == FERRY_OK && b->o->fp8 == 2) {
        cfg.dispatch_dtype = FERRY_DTYPE_FP8_E4M3;
        b->rc = ferry_ep_create(b->comm, &cfg, &b->eps[1]);
    }
    if (b->rc != FERRY_OK) {
        if (b->me == 0)
            fprintf(stderr, "ferry-bench: rank %d: ep_create: %s: %s\n", b->me,
                    ferry_strerror(b->rc), ferry_comm_last_error(b->comm));
        ferry_comm_destroy(b->comm);
#ifdef FERRY_HAVE_MPI
        if (b->have_base)
            MPI_Finalize();
#endif
        return 1;
    }
    b->lay = (ferry_ep_layout_t){.size = sizeof(b->lay)};
    ferry_ep_get_layout(b->ep, &b->lay);
    b->node_of = calloc((size_t)b->N, sizeof(int32_t));
    if (!b->node_of) {
        fprintf(stderr, "ferry-bench: rank %d: out of memory\n", b->me);
        return 1;
    }
    ferry_ep_get_nodes(b->ep, &b->nnodes, b->node_of, &b->fwd);
    b->lays[0] = b->lays[1] = b->lay;
    if (b->eps[1])
        ferry_ep_get_layout(b->eps[1], &b->lays[1]);
    b->cap = (size_t)b->lay.expert_capacity;
    b->El = (size_t)b->lay.num_local_experts;
    return 0;
}

/* The host buffers a round fills and the inputs, every page touched. */
static int make_workload(bench_t *b)
{
    const ferry_ep_layout_t *lay = &b->lays[0], *lay1 = &b->lays[1];
    size_t rows = b->El * b->cap + 1;
    /* sized for the larger of the contexts (mixed: bf16 rows, fp8 scales) */
    b->ex = calloc(lay->expert_x_bytes + 1, 1);
    size_t exs_bytes = lay1->expert_scales_bytes + lay->expert_scales_bytes;
    /* in rows, whatever layout dispatch wrote (UE8M0 is a quarter of it) */
    size_t rows_bytes = b->El * b->cap * 4 * (size_t)lay->num_scales;
    b->exs = calloc((exs_bytes > rows_bytes ? exs_bytes : rows_bytes) + 4, 1);
    /* scales not in rows: dispatch writes them here, the check reads exs */
    b->exs_raw = b->o->scales || b->s.nvfp4 ? calloc(lay->expert_scales_bytes + 4, 1) : NULL;
    b->cnt = calloc(b->El, sizeof(int32_t));
    b->sr = calloc(rows, sizeof(int32_t));
    b->st = calloc(rows, sizeof(int32_t));
    b->ey = calloc(lay->expert_y_bytes / 2 + 1, 2);
    b->out = calloc((size_t)b->cfg.max_tokens * b->o->hidden + 1, 2);
    b->acc = calloc((size_t)b->o->hidden, sizeof(float));
    if (!b->ex || !b->exs || ((b->o->scales || b->s.nvfp4) && !b->exs_raw) || !b->cnt || !b->sr || !b->st || !b->ey || !b->out ||
        !b->acc || fw_input_alloc(&b->s, &b->in)) {
        fprintf(stderr, "ferry-bench: rank %d: out of memory\n", b->me);
        return 1;
    }
    /* Touch every page once, as an engine's long-lived tensors would be, so
     * no first-touch page faults land in whichever side runs first. */
    memset(b->ex, 1, lay->expert_x_bytes);
    memset(b->exs, 1, exs_bytes);
    memset(b->ey, 1, lay->expert_y_bytes);
    memset(b->sr, 1, rows * sizeof(int32_t));
    memset(b->st, 1, rows * sizeof(int32_t));
    return 0;
}

/* --device cuda: the GPU's copies of the buffers. */
static int open_device(bench_t *b)
{
    /* --mode ht keeps its own (exact-size) GPU buffers (bench/ht.c) */
    if (b->cfg.device == FERRY_DEVICE_CUDA && !b->o->ht && dev_init(&b->dv, &b->s, &b->lay) != 0) {
        fprintf(stderr, "ferry-bench: rank %d: GPU buffers\n", b->me);
        return 1;
    }
    return 0;
}

/* The timing table, the baseline's buffers, and the progress clock. */
static int prepare_rounds(bench_t *b)
{
    b->tm = calloc((size_t)b->o->iters * BENCH_COLS, sizeof(double));
#ifdef FERRY_HAVE_MPI
    if (b->have_base && !b->o->ht && base_init(&b->base, &b->s) != 0) {
        fprintf(stderr, "ferry-bench: rank %d: out of memory (baseline)\n", b->me);
        return 1;
    }
#endif
    b->last_progress = now_us();
    return 0;
}

/* A failed round: say which step failed and why, and leave at once. */
static void abort_run(const bench_t *b)
{
    fprintf(stderr, "ferry-bench: rank %d: %s failed: %s: %s\n", b->me, b->fail,
            ferry_strerror(b->rc),
            strcmp(b->fail, "barrier") == 0 ? ferry_comm_last_error(b->comm)
                                            : ferry_ep_last_error(b->ep));
    ferry_ep_destroy(b->eps[0]);
    if (b->eps[1])
        ferry_ep_destroy(b->eps[1]);
    ferry_comm_destroy(b->comm);
    /* Leave without MPI_Finalize: peers may be gone. */
    _exit(1);
}

/* Release one row's contexts and buffers (the communicator stays); the
 * status is 1 if anything went wrong. */
static int release_row(bench_t *b, int status)
{
    if (b->wrong > 0)
        status = 1;
    dev_free(&b->dv);
    int rc = ferry_ep_destroy(b->eps[0]);
    if (b->eps[1] && rc == FERRY_OK)
        rc = ferry_ep_destroy(b->eps[1]);
    if (rc != FERRY_OK) {
        fprintf(stderr, "ferry-bench: rank %d: ep_destroy: %s\n", b->me, ferry_strerror(rc));
        status = 1;
    }
#ifdef FERRY_HAVE_MPI
    if (b->have_base && !b->o->ht)
        base_free(&b->base);
#endif
    free(b->tm);
    free(b->ex);
    free(b->exs);
    free(b->exs_raw);
    free(b->cnt);
    free(b->sr);
    free(b->st);
    free(b->ey);
    free(b->out);
    free(b->acc);
    fw_input_free(&b->in);
    free(b->node_of);
    return status;
}

/* The communicator (and MPI) last. */
static int teardown(bench_t *b, int status)
{
    ferry_comm_destroy(b->comm);
#ifdef FERRY_HAVE_MPI
    if (b->have_base)
        MPI_Finalize();
#endif
    return status;
}

/* --nodes (hosts = 0): this rank's FERRY_NODE_ID from its rank and the
 * world size (as the fork launcher, tests/cluster.sh or mpirun set them),
 * before the communicator reads it; --hosts (hosts = 1): its
 * FERRY_HOST_NAME. */
static int split_nodes(const opts_t *o, int hosts)
{
    int rank = -1, size = 0;
    for (size_t i = 0; i < N_LAUNCHER_ENV && rank < 0; i++) {
        const char *r = getenv(launcher_env[i].rank), *n = getenv(launcher_env[i].size);
        if (r && n) {
            rank = atoi(r);
            size = atoi(n);
        }
    }
    if (rank < 0 || size < 1 || rank >= size) {
        fprintf(stderr, "ferry-bench: --nodes: this rank's number or the world size is unknown "
                        "(FERRY_RANK/FERRY_WORLD_SIZE, OMPI_COMM_WORLD_RANK/_SIZE, "
                        "PMI_RANK/PMI_SIZE, SLURM_PROCID/SLURM_NTASKS or RANK/WORLD_SIZE)\n");
        return 2;
    }
    int n = hosts ? o->hosts : o->nodes;
    if (n > size) {
        fprintf(stderr, "ferry-bench: --%s %d: more %s than the %d ranks\n",
                hosts ? "hosts" : "nodes", n, hosts ? "hosts" : "nodes", size);
        return 2;
    }
    if (hosts) {
        char v[32];
        snprintf(v, sizeof(v), "host%d", (int)((long)rank * n / size));
        setenv("FERRY_HOST_NAME", v, 1);
    } else {
        fr_launch_set_node(rank, size, n);
    }
    return 0;
}

int main(int argc, char **argv)
{
    fr_launch_drop_psm_handlers(); /* before anything can crash (launch.h) */
    int rc0;
    opts_t o;
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* ranks share the terminal: a line goes out in one write (unbuffered,
     * a long line went out in pieces that other ranks' lines split) */
    static char errbuf[4096];
    setvbuf(stderr, errbuf, _IOLBF, sizeof(errbuf));
    if (parse(argc, argv, &o) != 0)
        return 2;
    if (strcmp(o.device, "cpu") != 0 && strcmp(o.device, "cuda") != 0) {
        fprintf(stderr, "ferry-bench: --device %s: use cpu or cuda\n", o.device);
        return 2;
    }
    if (o.transport && strcmp(o.transport, "null") == 0)
        return run_null(&o); /* the proxy alone, in this process */
    if (!in_launcher()) {
        int rc = launch(argc, argv, &o);
        if (rc >= 0)
            return rc;
    } else if (o.transport) {
        setenv("FERRY_TRANSPORT", o.transport, 1);
    }
    if (o.nodes > 1 && (rc0 = split_nodes(&o, 0)) != 0)
        return rc0;
    if (o.hosts > 1 && (rc0 = split_nodes(&o, 1)) != 0)
        return rc0;

    /* This process is one rank from here on. */
    bench_t b = {.o = &o};
    int rc, status = 0;
    if ((rc = open_comm(&b, &argc, &argv)) != 0)
        return rc;
    for (o.sweep_i = 0; o.sweep_i < o.ntoks; o.sweep_i++) { /* a row per token count */
        o.tokens = o.toks[o.sweep_i];
        bench_t keep = b;
        b = (bench_t){.o = &o, .comm = keep.comm, .me = keep.me, .N = keep.N,
                      .have_base = keep.have_base};
        if ((rc = make_config(&b)) != 0 || (rc = create_eps(&b)) != 0 ||
            (!o.ht && (rc = make_workload(&b)) != 0) || (rc = open_device(&b)) != 0 ||
            (rc = prepare_rounds(&b)) != 0)
            return rc;
        if (o.ht)
            run_ht_rounds(&b); /* its own buffers: exact sizes, from the routes */
        else
#ifdef FERRY_HAVE_CUDA
        if (b.dv.on && !o.check)
            run_gpu_rounds(&b); /* warm-up and timed rounds back to back */
        else
#endif
        {
            run_rounds(&b, 0, o.warmup);                  /* warm up, untimed */
            stats_mark(&b); /* --stats: counters of the timed rounds only */
            run_rounds(&b, o.warmup, o.warmup + o.iters); /* timed rounds */
        }
        if (b.fail)
            abort_run(&b);
        status |= release_row(&b, report(&b));
    }
    return teardown(&b, status);
}
