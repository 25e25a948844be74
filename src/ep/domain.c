/*
 * NVLink domains as nodes (ep.h: fr_dom_keys): GPU ranks whose GPUs share
 * an NVLink domain are one node for peer memory, even on different hosts,
 * when their segments can be shared: by file descriptor where they are on
 * one host (one kernel and network namespace), else by fabric handle.
 * A pure function of what every rank reported, so every rank reaches the
 * same nodes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/config.h"
#include "ep/ep.h"
#include "runtime/peer_mem.h"

int fr_dom_keys(int N, const fr_peer_info_t *peers, const fr_dom_t *d,
                char (*keys)[FR_NODE_ID_LEN], int *cross, char *why, size_t whylen)
{
    int any_set = 0, all_have = 1;
    *cross = 0;
    if (why && whylen)
        why[0] = 0;
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], FR_NODE_ID_LEN, "%s", peers[i].node);
        any_set |= peers[i].node_set;
        all_have &= d[i].has != 0;
    }
    if (any_set || !all_have)
        return 0; /* FERRY_NODE_ID given, or a rank outside any domain */
    for (int i = 0; i < N; i++)
        for (int j = 0; j < i; j++)
            if (strcmp(peers[i].node, peers[j].node) == 0 && strcmp(d[i].dom, d[j].dom) != 0) {
                if (why && whylen)
                    snprintf(why, whylen, "ranks %d and %d share host %s but report NVLink "
                             "domains %s and %s", j, i, peers[i].node, d[j].dom, d[i].dom);
                return 0;
            }
    int joined = 0, x = 0;
    for (int i = 0; i < N; i++)
        for (int j = 0; j < i; j++) {
            if (strcmp(d[i].dom, d[j].dom) != 0)
                continue;
            joined |= strcmp(peers[i].node, peers[j].node) != 0;
            if (strcmp(d[i].fdkey, d[j].fdkey) == 0)
                continue;
            if (!d[i].fabric_ok || !d[j].fabric_ok) {
                int r = d[j].fabric_ok ? i : j;
                if (why && whylen)
                    snprintf(why, whylen, "NVLink domain %s spans hosts, and rank %d cannot "
                             "share GPU memory by fabric handle (%s)", d[r].dom, r, d[r].why);
                return 0;
            }
            x = 1;
        }
    if (!joined)
        return 0;
    /* across kernels only when the whole job is one domain: with other
     * nodes left, segments take fabric peers' writes too and are
     * registered with the provider, which takes them from legacy CUDA IPC
     * allocations (not fabric handles) */
    for (int i = 1; i < N && x; i++)
        if (strcmp(d[i].dom, d[0].dom) != 0) {
            if (why && whylen)
                snprintf(why, whylen, "NVLink domains %s and %s span kernels, and a domain "
                         "across kernels is one node only when it holds every rank", d[0].dom,
                         d[i].dom);
            return 0;
        }
    for (int i = 0; i < N; i++)
        snprintf(keys[i], FR_NODE_ID_LEN, "nvl:%s", d[i].dom);
    *cross = x;
    return 1;
}

void fr_ep_fdkey(char *buf, size_t len)
{
    /* the kernel (its boot id: host names repeat) and the network
     * namespace (abstract Unix sockets are per namespace) */
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f || !fgets(boot, sizeof(boot), f)) {
        if (gethostname(boot, sizeof(boot) - 1) != 0)
            snprintf(boot, sizeof(boot), "unknown");
    }
    if (f)
        fclose(f);
    boot[strcspn(boot, "\n")] = 0;
    struct stat st;
    unsigned long long netns =
        stat("/proc/self/ns/net", &st) == 0 ? (unsigned long long)st.st_ino : 0;
    snprintf(buf, len, "%.60s:%llx", boot, netns);
}

/* What this rank reports: its GPU's domain (FERRY_NVLINK_DOMAIN, else
 * NVML), where its descriptors reach, and whether it can share by fabric
 * handle (tried only inside a domain). */
static void fr_dom_mine(fr_dom_t *m)
{
    memset(m, 0, sizeof(*m));
    fr_ep_fdkey(m->fdkey, sizeof(m->fdkey));
    int dev = -1;
    fr_err_t e;
    if (fr_cuda_device_current(&dev, &e) != FERRY_OK)
        return;
    const char *ov = fr_cfg_str(FR_CFG_NVLINK_DOMAIN);
    if (ov && *ov) {
        m->has = strcmp(ov, "none") != 0;
        snprintf(m->dom, sizeof(m->dom), "%.47s", ov);
    } else {
        uint8_t cl[16];
        unsigned clique = 0;
        if (fr_cuda_nvlink_domain(dev, cl, &clique, NULL, 0) == 1) {
            m->has = 1;
            for (int k = 0; k < 16; k++)
                snprintf(m->dom + 2 * k, sizeof(m->dom) - 2 * k, "%02x", cl[k]);
            snprintf(m->dom + 32, sizeof(m->dom) - 32, ":%u", clique);
        }
    }
    if (!m->has)
        return;
    m->fabric_ok = fr_pmem_usable(FR_PMEM_FABRIC, dev, m->why, sizeof(m->why));
}

int fr_ep_domains(ferry_ep_t ep, char (*keys)[FR_NODE_ID_LEN], fr_err_t *err)
{
    int N = ep->N;
    const fr_peer_info_t *peers = ep->comm->peers;
    ep->pmem_cross = 0;
    for (int i = 0; i < N; i++)
        snprintf(keys[i], FR_NODE_ID_LEN, "%s", peers[i].node);
    if (ep->cfg.device != FERRY_DEVICE_CUDA || N == 1 ||
        strcmp(fr_cfg_str(FR_CFG_TRANSPORT), "fabric") == 0)
        return FERRY_OK; /* alike on every rank (the create exchange compares them) */
    fr_dom_t mine, *all = (fr_dom_t *)calloc((size_t)N, sizeof(*all));
    if (!all)
        return FR_ERR(err, FERRY_ERR_NOMEM, "NVLink domain table for %d ranks", N);
    fr_dom_mine(&mine);
    int rc = fr_boot_allgather(ep->comm->boot, &mine, all, sizeof(mine), err);
    if (rc == FERRY_OK) {
        char why[320];
        int cross = 0;
        int joined = fr_dom_keys(N, peers, all, keys, &cross, why, sizeof(why));
        ep->pmem_cross = cross;
        if (joined && ep->rank == 0)
            FR_LOG_INFO(FR_SUB_INIT, "NVLink domain %s: its ranks are one node across hosts "
                        "(peer memory %s)", all[0].dom,
                        cross ? "by fabric handle" : "on one kernel, by descriptor");
        else if (why[0] && ep->rank == 0)
            FR_LOG_INFO(FR_SUB_INIT, "NVLink domains do not join hosts here: %s", why);
    }
    free(all);
    return rc;
}
