/*
 * libfabric transport (FI_EP_RDM, RMA writes with 32-bit remote CQ data):
 * opening and closing an endpoint, and the ops table. Opening asks
 * fi_getinfo for the provider FI_PROVIDER names (or the default one; for
 * FI_FENCE the one select.c picks), picks the offer on the rendezvous
 * route (NIC 0) or the k-th other interface of the same kind (NIC k),
 * opens fabric, domain, completion queue, address vector and endpoint, and
 * exchanges endpoint names with every rank. Also here: the sweep of a dead
 * rank's shm provider regions.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/mman.h>

#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include "core/config.h"
#include "core/log.h"
#include "runtime/rt.h"
#include "transport/fabric/fab_int.h"

#define FR_FAB_GOLDEN 0x9e3779b97f4a7c15ull

/* splitmix64's finaliser */
static uint64_t fab_mix(uint64_t x)
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t fab_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int fab_fail(fr_err_t *err, const char *call, int rc)
{
    return FR_ERR(err, FERRY_ERR_FABRIC, "fabric: %s failed: %s (%d)", call,
                  fi_strerror(rc < 0 ? -rc : rc), rc);
}

/* Is interface `name` up with a carrier (getifaddrs flags)? Unknown
 * names (not a network interface, e.g. an RDMA device) count as up. */
static int fab_iface_up(const char *name)
{
    struct ifaddrs *ifs = NULL, *i;
    int found = 0, up = 0;
    if (getifaddrs(&ifs) != 0)
        return 1;
    for (i = ifs; i; i = i->ifa_next)
        if (i->ifa_name && strcmp(i->ifa_name, name) == 0) {
            found = 1;
            up |= (i->ifa_flags & IFF_UP) && (i->ifa_flags & IFF_RUNNING);
        }
    freeifaddrs(ifs);
    return !found || up;
}

static int fab_is_loopback(const struct fi_info *i)
{
    return i->addr_format == FI_SOCKADDR_IN && i->src_addr &&
           (ntohl(((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr) >> 24) == 127;
}

/* The shm provider names an endpoint's /dev/shm region after the pid in
 * its default address ("fi_shm://<pid>" -> "<pid>:<uid>:<index>") and
 * refuses (fi_enable: EBUSY) when a region of that name exists and the pid
 * written in it is alive. A rank killed with SIGKILL leaves its region
 * behind; once pids wrap, a new rank with that pid cannot open an endpoint.
 * Ours are named ferry.<pid>.<pidns>.<random> instead (FR_SHM_FAB): never
 * reused, and the launcher removes a dead rank's regions by the pid. */
static int fab_shm_name(struct fi_info *info)
{
    if (info->addr_format != FI_ADDR_STR)
        return 0;
    static uint64_t seq;
    uint64_t x = fab_mix(fab_now() ^ ((uint64_t)getpid() << 40) ^
                         (++seq * FR_FAB_GOLDEN));
    static const char scheme[] = "fi_shm://";
    char name[96];
    memcpy(name, scheme, sizeof(scheme));
    /* the name the sweeps know (runtime/rt.h): pid and pid namespace
     * first, so a region whose process is gone is removed */
    int len = fr_shm_name(name + sizeof(scheme) - 1, sizeof(name) - sizeof(scheme) + 1,
                          FR_SHM_FAB, "%016llx", (unsigned long long)x);
    if (len < 0)
        return -1;
    len += (int)sizeof(scheme) - 1;
    char *copy = strdup(name);
    if (!copy)
        return -1;
    free(info->src_addr);
    info->src_addr = copy;
    info->src_addrlen = (size_t)len + 1;
    return 0;
}

/* NIC k > 0: the k-th other interface (domain) of the same kind as nic0
 * that is up, in the provider's order; NULL: this rank has no NIC k. */
static struct fi_info *fab_nic_k(struct fi_info *list, struct fi_info *nic0,
                                 int nic, uint64_t caps)
{
    int k = 0;
    char why[160];
    if (fab_is_loopback(nic0))
        return NULL;
    for (struct fi_info *i = list; i; i = i->next) {
        if (!fab_offer_ok(i, caps, why, sizeof(why)) || fab_is_loopback(i) ||
            i->addr_format != nic0->addr_format ||
            strcmp(i->domain_attr->name, nic0->domain_attr->name) == 0 ||
            !fab_iface_up(i->domain_attr->name))
            continue;
        int dup = 0; /* count each interface once */
        for (struct fi_info *j = list; j != i && !dup; j = j->next)
            dup = fab_offer_ok(j, caps, why, sizeof(why)) &&
                  j->addr_format == i->addr_format &&
                  strcmp(j->domain_attr->name, i->domain_attr->name) == 0;
        if (!dup && ++k == nic)
            return i;
    }
    return NULL;
}

/* Pick NIC `nic` among fi_getinfo's offers usable with `caps`: t->info,
 * or t->absent when this rank has no such NIC. */
static int fab_choose(fr_boot_t *boot, fr_transport_t *t,
                      struct fi_info *list, int nic, uint64_t caps,
                      fr_err_t *err)
{
    /* First usable offer (fab_offer_ok: RMA writes, >= 32 bits of remote
     * CQ data, a memory-registration mode ferry handles); among
     * socket-addressed offers (tcp) prefer the interface this rank reached
     * the rendezvous through, which its peers can reach too (on a
     * multi-homed host the first offer may be loopback). */
    char myip[64], why[160] = "", w[160];
    struct in_addr mine4;
    int have_ip = fr_boot_local_ipv4(boot, myip, sizeof(myip)) == 0 &&
                  inet_pton(AF_INET, myip, &mine4) == 1;
    struct fi_info *first = NULL, *match = NULL;
    for (struct fi_info *i = list; i; i = i->next) {
        if (!fab_offer_ok(i, caps, w, sizeof(w))) {
            if (!why[0])
                snprintf(why, sizeof(why), "%s", w);
            continue;
        }
        if (!first)
            first = i;
        if (have_ip && !match && i->addr_format == FI_SOCKADDR_IN &&
            i->src_addr && i->src_addrlen >= sizeof(struct sockaddr_in) &&
            ((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr == mine4.s_addr)
            match = i;
    }
    /* without the rendezvous address (a caller's allgather), prefer a
     * socket offer that is not loopback: peers may be on other hosts */
    if (!match && first && first->addr_format == FI_SOCKADDR_IN) {
        for (struct fi_info *i = list; i; i = i->next)
            if (fab_offer_ok(i, caps, w, sizeof(w)) &&
                i->addr_format == FI_SOCKADDR_IN && i->src_addr &&
                (ntohl(((struct sockaddr_in *)i->src_addr)->sin_addr.s_addr) >> 24) != 127) {
                first = i;
                break;
            }
    }
    struct fi_info *nic0 = match ? match : first, *pick = nic0;
    if (nic > 0 && nic0)
        pick = fab_nic_k(list, nic0, nic, caps);
    if (pick) {
        t->info = fi_dupinfo(pick);
        if (match && nic == 0)
            FR_LOG_INFO(FR_SUB_NET, "fabric: using the interface of %s "
                        "(the rendezvous route)", myip);
    } else if (nic > 0 && nic0) {
        /* take part in the exchange, with nothing to offer */
        snprintf(t->prov, sizeof(t->prov), "%s", nic0->fabric_attr->prov_name);
        t->absent = 1;
    }
    if (!t->info && !t->absent)
        return FR_ERR(err, FERRY_ERR_UNSUPPORTED,
                      "fabric: no offer of provider %s is usable: %s",
                      list->fabric_attr->prov_name, why);
    return FERRY_OK;
}

/* Log which provider is in use and why. */
static void fab_log_choice(const fr_transport_t *t, const char *how)
{
    const char *prov = t->info ? t->info->fabric_attr->prov_name : t->prov;
    const char *env = getenv("FI_PROVIDER");
    if (how) {
        FR_LOG_INFO(FR_SUB_NET, "fabric: provider %s for FI_FENCE: %s", prov,
                    how);
    } else if (env && *env) {
        FR_LOG_INFO(FR_SUB_NET, "fabric: provider %s: FI_PROVIDER=%s%s", prov,
                    env, fab_vetted_find(prov) ? ""
                                               : " (not among ferry's "
                                                 "vetted providers)");
    } else if (fab_vetted_find(prov)) {
        FR_LOG_INFO(FR_SUB_NET, "fabric: provider %s: libfabric's first "
                    "usable offer (FI_PROVIDER unset)", prov);
    } else {
        FR_LOG_WARN(FR_SUB_NET, "fabric: provider %s: libfabric's first "
                    "usable offer (FI_PROVIDER unset), not among ferry's "
                    "vetted providers (docs/architecture.md); set "
                    "FI_PROVIDER to choose", prov);
    }
}

/* fi_getinfo with the hints for `caps`, then fab_choose. FI_FENCE: only
 * for the provider select.c picks, never libfabric's default. */
static int fab_discover(fr_boot_t *boot, fr_transport_t *t, int nic,
                        uint64_t caps, fr_err_t *err)
{
    char pick[FR_FAB_PROV_MAX], how[FR_ERRMSG_LEN - 64];
    const char *prov = NULL;
    if (caps & FI_FENCE) {
        if (!fab_fence_pick(pick, sizeof(pick), how, sizeof(how)))
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "fabric: FI_FENCE: %s",
                          how);
        prov = pick;
    } else if (caps & FI_HMEM) {
        fr_tp_hmem_t h;
        fab_hmem_probe(-1, NULL, 0, &h);
        if (!h.ok)
            return FR_ERR(err, FERRY_ERR_UNSUPPORTED, "fabric: FI_HMEM: %s", h.why);
        snprintf(pick, sizeof(pick), "%s", h.prov);
        snprintf(how, sizeof(how), "%s", h.why);
        prov = pick;
    }
    struct fi_info *hints = fab_hints(caps, prov), *list = NULL;
    if (!hints)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory for hints");
    const char *envprov = getenv("FI_PROVIDER");
    int rc, frc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
    if (frc)
        rc = FR_ERR(err, FERRY_ERR_FABRIC,
                    "fabric: fi_getinfo (FI_EP_RDM, FI_RMA%s%s, provider %s, "
                    "FI_PROVIDER=%s) failed: %s (%d)",
                    (caps & FI_FENCE) ? ", FI_FENCE" : "",
                    (caps & FI_HMEM) ? ", FI_HMEM" : "",
                    prov ? prov : "any", envprov ? envprov : "(unset)",
                    fi_strerror(-frc), frc);
    else
        rc = fab_choose(boot, t, list, nic, caps, err);
    if (rc == FERRY_OK)
        fab_log_choice(t, prov ? how : NULL);
    if (list)
        fi_freeinfo(list);
    fi_freeinfo(hints);
    return rc;
}

/* Settle the chosen offer's options (op_flags, the shm region name) and
 * log what is in use. */
static int fab_prepare(fr_transport_t *t, uint64_t op_flags, fr_err_t *err)
{
    struct fi_info *info = t->info;
    /* e.g. FI_DELIVERY_COMPLETE: a local completion then means the data is
     * visible at the target (what an ordering point waits for) */
    if ((op_flags & FI_DELIVERY_COMPLETE) &&
        (strcmp(info->fabric_attr->prov_name, "shm") == 0 ||
         strncmp(info->fabric_attr->prov_name, "tcp", 3) == 0)) {
        /* tcp (one stream per peer) and shm (one command queue per peer)
         * apply one endpoint's writes to a peer in order, so a local
         * completion already orders what is posted after it; and shm in
         * libfabric 1.17 can leave a FI_DELIVERY_COMPLETE write
         * uncompleted forever */
        op_flags &= ~(uint64_t)FI_DELIVERY_COMPLETE;
        FR_LOG_INFO(FR_SUB_NET, "fabric: %s keeps write order per peer; "
                    "local completions serve as ordering points",
                    info->fabric_attr->prov_name);
    }
    info->tx_attr->op_flags |= op_flags;
    t->op_flags = info->tx_attr->op_flags; /* what fi_writedata uses */
    /* sockets defaults to a progress thread per domain that spins for 10
     * ms at a time, beside the proxy that polls anyway: on a loaded host
     * the two fight for the CPU (rounds 5-20x slower). ferry drives
     * progress from poll() on every rank, so ask for manual progress. */
    if (strcmp(info->fabric_attr->prov_name, "sockets") == 0) {
        info->domain_attr->data_progress = FI_PROGRESS_MANUAL;
        info->domain_attr->control_progress = FI_PROGRESS_MANUAL;
    }
    if (strcmp(info->fabric_attr->prov_name, "shm") == 0 &&
        fab_shm_name(info) != 0)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    snprintf(t->iface, sizeof(t->iface), "%s", info->domain_attr->name);
    t->mr_mode = info->domain_attr->mr_mode;
    t->max_msg = info->ep_attr->max_msg_size;
    t->tx_size = info->tx_attr ? info->tx_attr->size : 0;
    snprintf(t->prov, sizeof(t->prov), "%s", info->fabric_attr->prov_name);
    FR_LOG_INFO(FR_SUB_NET,
                "fabric: provider %s (fabric %s, domain %s), mr_mode 0x%llx"
                "%s%s%s%s%s, cq_data_size %zu, inject_size %zu, "
                "max_msg_size %zu, tx size %zu",
                t->prov, info->fabric_attr->name, info->domain_attr->name,
                (unsigned long long)t->mr_mode,
                (t->mr_mode & FI_MR_LOCAL) ? " LOCAL" : "",
                (t->mr_mode & FI_MR_VIRT_ADDR) ? " VIRT_ADDR" : "",
                (t->mr_mode & FI_MR_ALLOCATED) ? " ALLOCATED" : "",
                (t->mr_mode & FI_MR_PROV_KEY) ? " PROV_KEY" : "",
                (t->mr_mode & FI_MR_ENDPOINT) ? " ENDPOINT" : "",
                info->domain_attr->cq_data_size, info->tx_attr->inject_size,
                info->ep_attr->max_msg_size, info->tx_attr->size);
    return FERRY_OK;
}

/* fi_endpoint, tried again while no local address or port is free: the
 * tcp provider binds a socket per endpoint, and a machine running many
 * jobs (or a test suite) can run out of ephemeral ports for a moment.
 * Bounded: FR_EP_TRIES tries, FR_EP_WAIT_MS apart (about 2 s in all);
 * FERRY_FAULT_EP_BUSY=N makes the first N attempts of the process fail
 * that way (tests). */
#define FR_EP_TRIES 20
#define FR_EP_WAIT_MS 100
static int fab_endpoint(fr_transport_t *t, struct fi_info *info)
{
    static long busy = -1; /* attempts still to fail (FERRY_FAULT_EP_BUSY) */
    long b = __atomic_load_n(&busy, __ATOMIC_RELAXED);
    if (b < 0) {
        long v = fr_cfg_int(FR_CFG_FAULT_EP_BUSY);
        long neg = -1;
        __atomic_compare_exchange_n(&busy, &neg, v > 0 ? v : 0, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
    }
    int frc = 0;
    for (int try = 1;; try++) {
        long c = __atomic_load_n(&busy, __ATOMIC_RELAXED);
        while (c > 0 && !__atomic_compare_exchange_n(&busy, &c, c - 1, 0, __ATOMIC_RELAXED,
                                                     __ATOMIC_RELAXED))
            ;
        if (c > 0)
            frc = -FI_EADDRNOTAVAIL;
        else
            frc = fi_endpoint(t->domain, info, &t->ep, NULL);
        if ((frc != -FI_EADDRNOTAVAIL && frc != -FI_EADDRINUSE) || try == FR_EP_TRIES)
            return frc;
        FR_LOG_INFO(FR_SUB_NET, "fabric: fi_endpoint: %s; trying again in %d ms (%d of %d)",
                    fi_strerror(-frc), FR_EP_WAIT_MS, try, FR_EP_TRIES);
        struct timespec ts = {0, FR_EP_WAIT_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* Fabric, domain, completion queue, address vector and endpoint. */
static int fab_open_ep(fr_transport_t *t, fr_err_t *err)
{
    struct fi_info *info = t->info;
    int frc;
    if ((frc = fi_fabric(info->fabric_attr, &t->fabric, NULL)))
        return fab_fail(err, "fi_fabric", frc);
    if ((frc = fi_domain(t->fabric, info, &t->domain, NULL)))
        return fab_fail(err, "fi_domain", frc);
    struct fi_cq_attr cqa;
    memset(&cqa, 0, sizeof(cqa));
    cqa.format = FI_CQ_FORMAT_DATA;
    cqa.wait_obj = FI_WAIT_NONE;
    if ((frc = fi_cq_open(t->domain, &cqa, &t->cq, NULL)))
        return fab_fail(err, "fi_cq_open", frc);
    struct fi_av_attr ava;
    memset(&ava, 0, sizeof(ava));
    ava.type = FI_AV_TABLE;
    ava.count = (size_t)t->size;
    if ((frc = fi_av_open(t->domain, &ava, &t->av, NULL)))
        return fab_fail(err, "fi_av_open", frc);
    if ((frc = fab_endpoint(t, info)))
        return fab_fail(err,
                        frc == -FI_EADDRNOTAVAIL || frc == -FI_EADDRINUSE
                            ? "fi_endpoint (20 tries over 2 s)"
                            : "fi_endpoint",
                        frc);
    if ((frc = fi_ep_bind(t->ep, &t->cq->fid, FI_TRANSMIT | FI_RECV)))
        return fab_fail(err, "fi_ep_bind(cq)", frc);
    if ((frc = fi_ep_bind(t->ep, &t->av->fid, 0)))
        return fab_fail(err, "fi_ep_bind(av)", frc);
    if ((frc = fi_enable(t->ep)))
        return fab_fail(err, "fi_enable", frc);
    return FERRY_OK;
}

/* Insert the ranks' addresses from the exchanged blocks. */
static int fab_insert(fr_transport_t *t, fr_fab_block_t *blocks, int nic,
                      fr_err_t *err)
{
    for (int r = 0; r < t->size; r++) {
        fr_fab_block_t *b = &blocks[r];
        b->prov[sizeof(b->prov) - 1] = '\0';
        if (nic > 0 && b->namelen == 0)
            continue; /* that rank has no NIC of this index */
        t->present[r] = 1;
        if (strcmp(b->prov, t->prov) != 0)
            return FR_ERR(err, FERRY_ERR_FABRIC,
                          "fabric: rank %d uses provider %s but rank %d uses "
                          "%s (set FI_PROVIDER alike on all ranks)",
                          r, b->prov, t->rank, t->prov);
        if (b->namelen == 0 || b->namelen > sizeof(b->name))
            return FR_ERR(err, FERRY_ERR_PROTOCOL,
                          "fabric: rank %d sent an address of %u bytes", r,
                          b->namelen);
        /* One at a time: some providers (shm) step through a packed array
         * by string length, not by addrlen. */
        int frc = fi_av_insert(t->av, b->name, 1, &t->addrs[r], 0, NULL);
        if (frc != 1)
            return FR_ERR(err, FERRY_ERR_FABRIC,
                          "fabric: fi_av_insert of rank %d failed: %s (%d)",
                          r, fi_strerror(frc < 0 ? -frc : FI_EINVAL), frc);
    }
    return FERRY_OK;
}

/* Exchange names (and provider names, which must agree) with all ranks. */
static int fab_exchange(fr_boot_t *boot, fr_transport_t *t, int nic,
                        fr_err_t *err)
{
    fr_fab_block_t mine, *blocks = NULL;
    memset(&mine, 0, sizeof(mine));
    size_t namelen = sizeof(mine.name);
    int rc, frc = fi_getname(&t->ep->fid, mine.name, &namelen);
    if (frc)
        return FR_ERR(err, FERRY_ERR_FABRIC,
                      "fabric: fi_getname failed: %s (%d) (name needs %zu "
                      "bytes, room for %zu)",
                      fi_strerror(-frc), frc, namelen, sizeof(mine.name));
    mine.namelen = (uint32_t)namelen;
    snprintf(mine.prov, sizeof(mine.prov), "%s", t->prov);
    blocks = calloc((size_t)t->size, sizeof(*blocks));
    t->addrs = calloc((size_t)t->size, sizeof(*t->addrs));
    if (!blocks || !t->addrs) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
        goto out;
    }
    FR_CHECK_GOTO(fr_boot_allgather(boot, &mine, blocks, sizeof(mine), err),
                  rc, out);
    t->present = calloc((size_t)t->size, 1);
    if (!t->present) {
        rc = FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
        goto out;
    }
    rc = fab_insert(t, blocks, nic, err);
out:
    free(blocks);
    return rc;
}

/* A rank without NIC k still joins NIC k's address exchange. */
static int fab_exchange_absent(fr_boot_t *boot, fr_transport_t *t,
                               fr_err_t *err)
{
    fr_fab_block_t mine, *blocks = calloc((size_t)t->size, sizeof(mine));
    memset(&mine, 0, sizeof(mine));
    snprintf(mine.prov, sizeof(mine.prov), "%s", t->prov);
    t->present = calloc((size_t)t->size, 1);
    int rc = blocks && t->present
                 ? fr_boot_allgather(boot, &mine, blocks, sizeof(mine), err)
                 : FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    free(blocks);
    if (rc == FERRY_OK)
        FR_LOG_INFO(FR_SUB_NET, "fabric: no NIC %d on this rank", t->nic);
    return rc;
}

/* Open this rank's NIC `nic` (0: the one on the rendezvous route; k: the
 * k-th other interface of the same kind that is up) with FR_TP_OPEN_*
 * flags, and exchange addresses with all ranks. */
static int fab_open(fr_boot_t *boot, int nic, int flags, fr_transport_t **tp,
                    fr_err_t *err)
{
    *tp = NULL;
    fr_transport_t *t = calloc(1, sizeof(*t));
    if (!t)
        return FR_ERR(err, FERRY_ERR_NOMEM, "fabric: out of memory");
    t->rank = fr_boot_rank(boot);
    t->size = fr_boot_size(boot);
    t->next_key = 1;
    t->nic = nic;
    uint64_t caps = ((flags & FR_TP_OPEN_FENCE) ? FI_FENCE : 0) |
                    ((flags & FR_TP_OPEN_HMEM) ? FI_HMEM : 0);
    uint64_t op_flags =
        (flags & FR_TP_OPEN_DELIVERY) ? FI_DELIVERY_COMPLETE : 0;
    int rc = fab_discover(boot, t, nic, caps, err);
    if (rc == FERRY_OK && t->absent) {
        rc = fab_exchange_absent(boot, t, err);
    } else if (rc == FERRY_OK) {
        rc = fab_prepare(t, op_flags, err);
        if (rc == FERRY_OK)
            rc = fab_open_ep(t, err);
        if (rc == FERRY_OK)
            rc = fab_exchange(boot, t, nic, err);
    }
    if (rc != FERRY_OK) {
        fab_close(t);
        return rc;
    }
    t->fence_caps = (flags & FR_TP_OPEN_FENCE) != 0;
    t->hmem = (flags & FR_TP_OPEN_HMEM) != 0 && !t->absent;
    *tp = t;
    return FERRY_OK;
}

static void fab_close_fid(struct fid *f, const char *what)
{
    int frc = fi_close(f);
    if (frc)
        FR_LOG_WARN(FR_SUB_NET, "fabric: fi_close(%s) failed: %s (%d)", what,
                    fi_strerror(-frc), frc);
}

void fab_close(fr_transport_t *t)
{
    if (!t)
        return;
    FR_LOG_DEBUG(FR_SUB_NET,
                 "fabric: closing with %ld posted and %ld queued writes; "
                 "%ld posts waited for -FI_EAGAIN",
                 t->inflight, t->nqueued, t->nwaited);
    free(t->present);
    t->present = NULL;
    while (t->groups)
        fab_group_destroy(t, t->groups);
    while (t->mrs)
        fab_dereg(t, t->mrs);
    if (t->ep)
        fab_close_fid(&t->ep->fid, "ep");
    if (t->av)
        fab_close_fid(&t->av->fid, "av");
    if (t->cq)
        fab_close_fid(&t->cq->fid, "cq");
    if (t->domain)
        fab_close_fid(&t->domain->fid, "domain");
    if (t->fabric)
        fab_close_fid(&t->fabric->fid, "fabric");
    if (t->info)
        fi_freeinfo(t->info);
    fab_pool_free(t);
    free(t->addrs);
    free(t);
}

/* Both this rank and `rank` opened this NIC. */
static int fab_has_peer(fr_transport_t *t, int rank)
{
    return t && !t->absent && t->present && rank >= 0 && rank < t->size &&
           t->present[rank];
}

static const char *fab_iface(fr_transport_t *t) { return t->iface; }

static const char *fab_provider(fr_transport_t *t) { return t->prov; }

static void fab_stats(fr_transport_t *t, fr_tp_stats_t *out) { *out = t->st; }

const fr_transport_ops_t fr_transport_fabric = {
    .size = sizeof(fr_transport_ops_t),
    .name = "fabric",
    .open = fab_open,
    .reg = fab_reg,
    .dereg = fab_dereg,
    .group_create = fab_group_create,
    .group_destroy = fab_group_destroy,
    .scatter = fab_scatter,
    .barrier = fab_barrier,
    .write_imm = fab_write_imm,
    .write_batch = fab_write_batch,
    .poll = fab_poll,
    .pending = fab_pending,
    .close = fab_close,
    .provider = fab_provider,
    .has_peer = fab_has_peer,
    .iface = fab_iface,
    .fence_probe = fab_fence_probe,
    .write_fence = fab_write_fence,
    .hmem_probe = fab_hmem_probe,
    .reg_dev = fab_reg_dev,
    .stats = fab_stats,
};
