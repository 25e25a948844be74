/* ferry-info: version, libfabric providers here, every FERRY_* setting. */
#include <rdma/fabric.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry.h"

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
    printf("providers offering RDM endpoints with RMA writes:\n");
    if (rc != 0) {
        printf("  none (%s)\n", fi_strerror(-rc));
    } else {
        char last[256] = "";
        for (struct fi_info *i = info; i; i = i->next) {
            char line[256];
            snprintf(line, sizeof(line), "%s (fabric %s, domain %s)",
                     i->fabric_attr->prov_name, i->fabric_attr->name,
                     i->domain_attr->name);
            if (strcmp(line, last) != 0)
                printf("  %s\n", line);
            snprintf(last, sizeof(last), "%s", line);
        }
        fi_freeinfo(info);
    }
    fi_freeinfo(hints);
    ferry_setting_t set[64];
    int n = ferry_settings(set, 64);
    printf("settings:\n");
    for (int i = 0; i < n && i < 64; i++)
        printf("  %-28s = %-12s (default %s)\n      %s\n", set[i].name,
               set[i].value[0] ? set[i].value : "(unset)",
               set[i].defval[0] ? set[i].defval : "(none)", set[i].help);
    return 0;
}
