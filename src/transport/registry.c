/*
 * Transports by name. Adding a transport is its folder plus its
 * declaration and one line in fr_transports[] here; callers open one through fr_transport_open and call it
 * through the ops it returns, which are the fault injector's (fault.c)
 * wrapped around the transport when a FERRY_FAULT_* setting is on.
 */
#include <string.h>

#include "transport/fault.h"
#include "transport/transport.h"

extern const fr_transport_ops_t fr_transport_fabric; /* transport/fabric/ */
extern const fr_transport_ops_t fr_transport_null;   /* transport/null/: benchmarks */

static const fr_transport_ops_t *const fr_transports[] = {
    &fr_transport_fabric,
    &fr_transport_null,
};

int fr_slice_in_bounds(const char *who, int i, int rank, const fr_slice_t *s,
                       uint64_t slen, uint64_t rlen, fr_err_t *err)
{
    if (s->src_off > slen || s->len > slen - s->src_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "%s: slice %d (rank %d): source [%llu, +%llu) "
                      "outside the registered %llu bytes",
                      who, i, rank, (unsigned long long)s->src_off,
                      (unsigned long long)s->len, (unsigned long long)slen);
    if (s->dst_off > rlen || s->len > rlen - s->dst_off)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "%s: slice %d (rank %d): destination [%llu, +%llu) "
                      "outside the peer's registered %llu bytes",
                      who, i, rank, (unsigned long long)s->dst_off,
                      (unsigned long long)s->len, (unsigned long long)rlen);
    return FERRY_OK;
}

const fr_transport_ops_t *fr_transport_find(const char *name)
{
    for (size_t i = 0; i < sizeof(fr_transports) / sizeof(fr_transports[0]);
         i++)
        if (name && strcmp(fr_transports[i]->name, name) == 0)
            return fr_transports[i];
    return NULL;
}

int fr_transport_open(const char *name, fr_boot_t *boot, int nic, int flags,
                      const fr_transport_ops_t **ops, fr_transport_t **t,
                      fr_err_t *err)
{
    const fr_transport_ops_t *o = fr_transport_find(name);
    *t = NULL;
    if (!o)
        return FR_ERR(err, FERRY_ERR_INVALID, "transport %s: unknown",
                      name ? name : "(null)");
    if ((flags & ~FR_TP_OPEN_HMEM) && nic != 0)
        return FR_ERR(err, FERRY_ERR_INVALID,
                      "transport %s: open flags 0x%x only on NIC 0", name,
                      flags & ~FR_TP_OPEN_HMEM);
    if (fr_fault_on()) {
        *ops = &fr_transport_fault;
        return fr_fault_open(o, boot, nic, flags, t, err);
    }
    *ops = o;
    return o->open(boot, nic, flags, t, err);
}
