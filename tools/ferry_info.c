/* ferry-info: version, libfabric providers here (and which offer FI_HMEM),
 * every FERRY_* setting. */
#include <rdma/fabric.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"
#include "runtime/peer_mem.h"

/* Each visible GPU: the kinds of peer memory it offers (and why not the
 * others) and its NVLink domain. */
static void gpus(void)
{
    char why[512] = "";
    if (!ferry_cuda_available(why, sizeof(why))) {
        printf("GPUs: none (%s)\n", why);
        return;
    }
    const char *pm = getenv("FERRY_PEER_MEM");
    printf("GPUs (peer memory FERRY_PEER_MEM=%s; kinds each GPU offers, its NVLink domain):\n",
           pm && *pm ? pm : "auto");
    for (int d = 0; d < 64; d++) {
        uint8_t u[16], cl[16];
        fr_err_t err;
        if (fr_cuda_device_uuid(d, u, &err) != FERRY_OK)
            break;
        /* what the attributes offer, tried (an IMEX channel or MPS may
         * still refuse it); each reason once */
        int k = 0;
        why[0] = 0;
        for (int t = FR_PMEM_LEGACY; t <= FR_PMEM_FABRIC; t <<= 1) {
            char w[256];
            size_t l = strlen(why);
            if (fr_pmem_usable(t, d, w, sizeof(w)))
                k |= t;
            else if (w[0] && !strstr(why, w))
                snprintf(why + l, sizeof(why) - l, "%s%s", l ? "; " : "", w);
        }
        printf("  %d: GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", d,
               u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
               u[13], u[14], u[15]);
        printf("     peer memory: %s%s%s%s%s\n", (k & FR_PMEM_LEGACY) ? "legacy" : "",
               (k & FR_PMEM_VMM) ? " vmm" : "", (k & FR_PMEM_FABRIC) ? " fabric" : "",
               why[0] ? "; " : "", why);
        unsigned clique = 0;
        int dom = fr_cuda_nvlink_domain(d, cl, &clique, why, sizeof(why));
        if (dom == 1)
            printf("     NVLink domain: cluster %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
                   "%02x%02x%02x%02x%02x%02x clique %u\n", cl[0], cl[1], cl[2], cl[3], cl[4],
                   cl[5], cl[6], cl[7], cl[8], cl[9], cl[10], cl[11], cl[12], cl[13], cl[14],
                   cl[15], clique);
        else
            printf("     NVLink domain: none beyond this host (%s)\n", why);
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--cuda") == 0) {
        /* exit 0 when CUDA ranks can run here, else say why and exit 1 */
        char why[256] = "";
        int ok = ferry_cuda_available(why, sizeof(why));
        printf("%s\n", ok ? "cuda: available" : why);
        return ok ? 0 : 1;
    }
    if (argc > 1) {
        printf("usage: ferry-info [--cuda]\n");
        return 0;
    }
    printf("ferry %s\n", ferry_version_string());
    uint32_t v = fi_version();
    printf("libfabric %u.%u (FI_PROVIDER=%s)\n", FI_MAJOR(v), FI_MINOR(v),
           getenv("FI_PROVIDER") ? getenv("FI_PROVIDER") : "(unset)");
    struct fi_info *hints = fi_allocinfo(), *info = NULL;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode = FI_CONTEXT;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR |
                                  FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT;
    int rc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
    /* the same query asking for FI_HMEM (registration of device memory) */
    struct fi_info *hinfo = NULL;
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM; /* registering device memory needs it */
    if (fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &hinfo) != 0)
        hinfo = NULL;
    printf("providers offering RDM endpoints with RMA writes (FI_HMEM: the provider offers\n"
           "device-memory registration; which device interfaces work shows only when one\n"
           "is registered):\n");
    if (rc != 0) {
        printf("  none (%s)\n", fi_strerror(-rc));
    } else {
        char last[256] = "";
        for (struct fi_info *i = info; i; i = i->next) {
            char line[256];
            snprintf(line, sizeof(line), "%s (fabric %s, domain %s)",
                     i->fabric_attr->prov_name, i->fabric_attr->name,
                     i->domain_attr->name);
            int hmem = 0;
            for (struct fi_info *h = hinfo; h && !hmem; h = h->next)
                hmem = strcmp(h->fabric_attr->prov_name, i->fabric_attr->prov_name) == 0 &&
                       strcmp(h->domain_attr->name, i->domain_attr->name) == 0;
            if (strcmp(line, last) != 0)
                printf("  %s  %s\n", line, hmem ? "FI_HMEM" : "no FI_HMEM");
            snprintf(last, sizeof(last), "%s", line);
        }
        fi_freeinfo(info);
    }
    if (hinfo)
        fi_freeinfo(hinfo);
    fi_freeinfo(hints);
    const char *hm = getenv("FERRY_FABRIC_HMEM");
    printf("GPU ranks on the fabric path (FERRY_FABRIC_HMEM=%s): auto keeps their send and\n"
           "receive regions in GPU memory registered with FI_HMEM where the provider writes\n"
           "GPU memory by DMA (efa, verbs), else in pinned host memory (providers without\n"
           "FI_HMEM, and those that move GPU memory with CUDA copies, such as shm and tcp);\n"
           "on: GPU memory wherever the provider offers FI_HMEM; off: pinned host memory.\n"
           "ferry_ep_create says which, and why, at FERRY_LOG=INFO\n",
           hm && *hm ? hm : "auto");
    gpus();
    ferry_setting_t set[64];
    int n = ferry_settings(set, 64);
    printf("settings:\n");
    for (int i = 0; i < n && i < 64; i++)
        printf("  %-28s = %-12s (default %s)\n      %s\n", set[i].name,
               set[i].value[0] ? set[i].value : "(unset)",
               set[i].defval[0] ? set[i].defval : "(none)", set[i].help);
    return 0;
}
