/*
 * libfabric transport: which provider. The providers ferry is tested with
 * (the vetted list), the hints every endpoint asks with, what an offer
 * must have to be usable, and the provider for FI_FENCE (nicfence).
 *
 * FI_FENCE is never left to libfabric's default choice: asked for
 * FI_FENCE with no provider named, fi_getinfo quietly answers with
 * whatever provider has it (sockets, here), not the one the other modes
 * use. So with FI_PROVIDER naming one provider, only that one is probed;
 * otherwise (unset, or a list or exclusion, which libfabric still applies)
 * the vetted providers are probed one by one, by name, in the order of the
 * table, and the first whose offer has FI_FENCE and everything else ferry
 * needs is taken. None: the reason names each provider considered and why
 * it was passed over.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fi_errno.h>

#include "transport/fabric/fab_int.h"

/* Preference order for a choice ferry makes itself (FI_FENCE with no
 * provider named): NICs first, then the socket providers. shm is vetted
 * but never picked this way: it reaches only ranks of one node. sockets
 * advertises FI_FENCE, but in libfabric 1.17 a fenced write to one peer
 * can stall for good once three or more ranks write to each other (every
 * test_signal nicfence run with 3 ranks here; the same run without the
 * flag passes), so ferry does not use its fence. */
const fr_fab_vetted_t fr_fab_vetted[] = {
    {"efa", 1, NULL},
    {"verbs;ofi_rxm", 1, NULL},
    {"tcp;ofi_rxm", 1, NULL},
    {"sockets", 1, "FI_FENCE stalls at 3+ ranks (libfabric 1.17)"},
    {"udp;ofi_rxd", 1, NULL},
    {"shm", 0, NULL},
};
const int fr_fab_nvetted =
    (int)(sizeof(fr_fab_vetted) / sizeof(fr_fab_vetted[0]));

const fr_fab_vetted_t *fab_vetted_find(const char *prov)
{
    for (int i = 0; prov && i < fr_fab_nvetted; i++)
        if (strcmp(fr_fab_vetted[i].name, prov) == 0)
            return &fr_fab_vetted[i];
    return NULL;
}

/* FI_PROVIDER when it names one provider; NULL when unset, empty, a list
 * ("a,b") or an exclusion ("^a") (those libfabric applies itself). */
static const char *fab_env_single(void)
{
    const char *e = getenv("FI_PROVIDER");
    return e && *e && !strpbrk(e, ",^") ? e : NULL;
}

/* The hints every endpoint asks with (RDM, RMA writes, every memory
 * registration mode ferry can handle) plus `caps`, for provider `prov`
 * (NULL: the one FI_PROVIDER names, if it names one). NULL when out of
 * memory. */
struct fi_info *fab_hints(uint64_t caps, const char *prov)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints)
        return NULL;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | caps;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR |
                                  FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT;
    /* device memory: ferry registers every buffer it hands the provider */
    if (caps & FI_HMEM)
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    if (!prov)
        prov = fab_env_single();
    if (prov) {
        hints->fabric_attr->prov_name = strdup(prov);
        if (!hints->fabric_attr->prov_name) {
            fi_freeinfo(hints);
            return NULL;
        }
    }
    return hints;
}

/* Can ferry use this offer (with `caps` on top of RMA writes)? 0 with the
 * reason in why. */
int fab_offer_ok(const struct fi_info *i, uint64_t caps, char *why,
                 size_t len)
{
    const uint64_t need = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | caps;
    const uint64_t mr_known = FI_MR_LOCAL | FI_MR_VIRT_ADDR |
                              FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                              FI_MR_ENDPOINT | FI_MR_HMEM;
    const uint64_t mode_known = FI_CONTEXT | FI_CONTEXT2;
    if ((i->caps & need) != need)
        snprintf(why, len, "no %s",
                 (caps & FI_FENCE) && !(i->caps & FI_FENCE)  ? "FI_FENCE"
                 : (caps & FI_HMEM) && !(i->caps & FI_HMEM) ? "FI_HMEM"
                 : "RMA writes (FI_RMA, FI_WRITE, FI_REMOTE_WRITE)");
    else if (!i->domain_attr || i->domain_attr->cq_data_size < 4)
        snprintf(why, len, "remote CQ data of %zu bytes (needs 4)",
                 i->domain_attr ? i->domain_attr->cq_data_size : 0);
    else if (i->domain_attr->mr_mode & ~mr_known)
        snprintf(why, len, "mr_mode 0x%llx beyond what ferry handles "
                 "(0x%llx)", (unsigned long long)i->domain_attr->mr_mode,
                 (unsigned long long)mr_known);
    else if (i->domain_attr->mr_key_size > sizeof(uint64_t))
        snprintf(why, len, "memory keys of %zu bytes (needs <= 8)",
                 i->domain_attr->mr_key_size);
    else if (i->mode & ~mode_known)
        snprintf(why, len, "mode 0x%llx (e.g. FI_RX_CQ_DATA: receives "
                 "posted for CQ data) beyond FI_CONTEXT(2)",
                 (unsigned long long)i->mode);
    else if (!i->ep_attr || i->ep_attr->max_msg_size == 0)
        snprintf(why, len, "max_msg_size 0");
    else
        return 1;
    return 0;
}

/* Probe provider `name` (NULL: libfabric's own choice under FI_PROVIDER)
 * for a usable offer with `caps`: 1 and its name in prov, or 0 with the
 * reason in why. */
static int fab_probe_one(const char *name, uint64_t caps, char *prov,
                         size_t plen, char *why, size_t wlen)
{
    /* FI_HMEM is a primary capability: offered only when asked for */
    struct fi_info *hints = fab_hints(caps & FI_HMEM, name), *list = NULL;
    if (!hints) {
        snprintf(why, wlen, "out of memory");
        return 0;
    }
    int frc = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &list);
    int ok = 0;
    if (frc) {
        snprintf(why, wlen, "absent");
    } else {
        snprintf(why, wlen, "no offer");
        for (struct fi_info *i = list; i && !ok; i = i->next) {
            char r[160];
            const fr_fab_vetted_t *v =
                fab_vetted_find(i->fabric_attr->prov_name);
            ok = fab_offer_ok(i, caps, r, sizeof(r));
            if (ok && (caps & FI_FENCE) && v && v->nofence) {
                ok = 0;
                snprintf(r, sizeof(r), "%s", v->nofence);
            }
            if (ok)
                snprintf(prov, plen, "%s", i->fabric_attr->prov_name);
            else if (i == list)
                snprintf(why, wlen, "%s", r);
        }
    }
    if (list)
        fi_freeinfo(list);
    fi_freeinfo(hints);
    return ok;
}

/* The provider for an FI_FENCE endpoint: 1 and its name in prov (why:
 * how it was chosen), or 0 with the reason in why. Local, no
 * communication; every rank of one kind of host comes to the same answer
 * (the address exchange checks that they did). */
int fab_fence_pick(char *prov, size_t plen, char *why, size_t wlen)
{
    const char *env = getenv("FI_PROVIDER");
    const char *single = fab_env_single();
    char r[160];
    if (single) {
        if (fab_probe_one(single, FI_FENCE, prov, plen, r, sizeof(r))) {
            snprintf(why, wlen, "named by FI_PROVIDER=%s%s", single,
                     fab_vetted_find(prov) ? ""
                                           : " (not among ferry's vetted "
                                             "providers)");
            return 1;
        }
        snprintf(why, wlen, "FI_PROVIDER=%s: %s", single, r);
        return 0;
    }
    size_t off = (size_t)snprintf(why, wlen, "no vetted provider%s%s offers "
                                  "FI_FENCE for RDM RMA writes (",
                                  env && *env ? " allowed by FI_PROVIDER=" : "",
                                  env && *env ? env : "");
    size_t start = off;
    int n = 0;
    for (int v = 0; v < fr_fab_nvetted; v++) {
        if (!fr_fab_vetted[v].autopick)
            continue;
        if (fab_probe_one(fr_fab_vetted[v].name, FI_FENCE, prov, plen, r,
                          sizeof(r))) {
            char passed[256];
            snprintf(passed, sizeof(passed), "%s",
                     start < wlen && n ? why + start : "");
            snprintf(why, wlen, "the first vetted provider offering FI_FENCE "
                     "(FI_PROVIDER %s)%s%s", env && *env ? env : "unset",
                     n ? "; passed over: " : "", passed);
            return 1;
        }
        if (off < wlen)
            off += (size_t)snprintf(why + off, wlen - off, "%s%s: %s",
                                    n++ ? ", " : "", fr_fab_vetted[v].name,
                                    r);
    }
    if (off < wlen)
        snprintf(why + off, wlen - off, ")");
    return 0;
}

/* Does the provider for FI_FENCE exist here (fab_fence_pick)? 0 with the
 * reason in why. Local, no communication. */
int fab_fence_probe(char *why, size_t len)
{
    char prov[FR_FAB_PROV_MAX];
    return fab_fence_pick(prov, sizeof(prov), why, len);
}

/* Providers that move device memory with CUDA copies in the host (a
 * completed write is already in GPU memory); the others (efa, verbs) DMA
 * into it from the NIC. */
static int fab_hmem_copies(const char *prov)
{
    static const char *const copy[] = {"shm", "sm2", "tcp", "sockets", "udp"};
    for (size_t i = 0; i < sizeof(copy) / sizeof(copy[0]); i++)
        if (strncmp(prov, copy[i], strlen(copy[i])) == 0)
            return 1;
    return 0;
}

/* The provider an endpoint without FI_HMEM would use (FI_PROVIDER when it
 * names one, else libfabric's first usable offer), and whether it offers
 * FI_HMEM and registers [ptr, ptr + len) of CUDA device `device` (a trial
 * in a domain of its own): asking for device memory never changes the
 * provider, so ranks on other nodes (or with host staging) still meet on
 * the same one. */
void fab_hmem_probe(int device, void *ptr, size_t len, fr_tp_hmem_t *out)
{
    char r[160];
    const char *single = fab_env_single();
    memset(out, 0, sizeof(*out));
    if (single) {
        snprintf(out->prov, sizeof(out->prov), "%s", single);
    } else if (!fab_probe_one(NULL, 0, out->prov, sizeof(out->prov), r, sizeof(r))) {
        snprintf(out->why, sizeof(out->why), "no usable provider (%s)", r);
        return;
    }
    out->copies = fab_hmem_copies(out->prov);
    char tmp[FR_FAB_PROV_MAX];
    const char *how = single ? "named by FI_PROVIDER" : "libfabric's first usable offer";
    out->ok = fab_probe_one(out->prov, FI_HMEM, tmp, sizeof(tmp), r, sizeof(r));
    if (out->ok && ptr && !fab_hmem_try(out->prov, device, ptr, len, r, sizeof(r))) {
        out->ok = 0;
        snprintf(out->why, sizeof(out->why), "provider %s (%s) offers FI_HMEM but cannot "
                 "register GPU memory: %s (libfabric %u.%u, built without CUDA?)", out->prov,
                 how, r, FI_MAJOR(fi_version()), FI_MINOR(fi_version()));
        return;
    }
    if (out->ok)
        snprintf(out->why, sizeof(out->why), "provider %s (%s) offers FI_HMEM", out->prov,
                 how);
    else
        snprintf(out->why, sizeof(out->why), "provider %s (%s): %s (libfabric %u.%u)",
                 out->prov, how, strcmp(r, "absent") == 0 ? "no FI_HMEM offer" : r,
                 FI_MAJOR(fi_version()), FI_MINOR(fi_version()));
}
