/*
 * Where a CUDA rank's fabric regions may live (FERRY_FABRIC_HMEM and the
 * provider): shared by the CUDA engines of both modes
 * (docs/architecture.md, "Fabric: GPU memory").
 */
#include <stdio.h>
#include <string.h>

#include "core/config.h"
#include "ep/hmem.h"
#include "runtime/cuda_mem.h"

int fr_ep_hmem_policy(int device, int *want, fr_tp_hmem_t *h, int *order, fr_err_t *err)
{
    const char *s = fr_cfg_str(FR_CFG_FABRIC_HMEM);
    int on = strcmp(s, "on") == 0 || strcmp(s, "1") == 0;
    int off = strcmp(s, "off") == 0 || strcmp(s, "0") == 0;
    memset(h, 0, sizeof(*h));
    *order = 0;
    *want = on ? 1 : off ? -1 : 0;
    if (!on && !off && strcmp(s, "auto") != 0)
        return FR_ERR(err, FERRY_ERR_INVALID, "FERRY_FABRIC_HMEM=%s: use auto, on or off", s);
    const fr_transport_ops_t *tp = fr_transport_find("fabric");
    if (off || !tp || !tp->hmem_probe)
        return FERRY_OK;
    tp->hmem_probe(device, NULL, 0, h); /* which provider, and does it DMA */
    if (!on && h->ok && h->copies) {
        /* shm and tcp move GPU memory with cudaMemcpy in the proxy thread,
         * on the legacy default stream: every call would need a
         * non-blocking stream (docs/architecture.md), so auto stages */
        h->ok = 0;
        snprintf(h->why, sizeof(h->why), "provider %s offers FI_HMEM but moves GPU memory "
                 "with CUDA copies on the legacy default stream (FERRY_FABRIC_HMEM=on "
                 "takes it: calls then need streams created with cudaStreamNonBlocking)",
                 h->prov);
    }
    if (h->ok && !h->copies && (*order = fr_cuda_gdr_order(device)) < 0) {
        /* a NIC writing GPU memory that the GPU neither orders for its
         * kernels nor lets the host flush: a flag could be seen first */
        h->ok = 0;
        snprintf(h->why, sizeof(h->why), "provider %s writes GPU %d by DMA, but the GPU "
                 "neither orders those writes for its kernels nor offers a host flush "
                 "(cudaDevAttrGPUDirectRDMAWritesOrdering)", h->prov, device);
    }
    return FERRY_OK;
}

int fr_ep_hmem_trial(int device, void *p, size_t len, fr_tp_hmem_t *h)
{
    const fr_transport_ops_t *tp = fr_transport_find("fabric");
    if (tp && tp->hmem_probe)
        tp->hmem_probe(device, p, len, h);
    return h->ok;
}

int fr_ep_rx_flush_kind(const fr_tp_hmem_t *h, int order)
{
    return h->copies ? FR_RX_FLUSH_COPIES : order > 0 ? FR_RX_FLUSH_GDR : FR_RX_FLUSH_NONE;
}

int fr_ep_rx_visible(ferry_ep_t ep, const fr_cqe_t *cqe, int n, const char **what)
{
    if (ep->rx_flush == FR_RX_FLUSH_NONE)
        return 0;
    for (int i = 0; i < n; i++)
        if (cqe[i].kind == FR_CQE_RX) {
            int gdr = ep->rx_flush == FR_RX_FLUSH_GDR;
            if ((gdr ? fr_cuda_gdr_flush(ep->fab_device)
                     : fr_cuda_copies_wait(ep->fab_device)) == 0)
                return 0;
            *what = gdr ? "flushing GPUDirect RDMA writes"
                        : "waiting for the provider's copies into GPU memory";
            return -1;
        }
    return 0;
}
