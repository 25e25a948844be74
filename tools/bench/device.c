/*
 * ferry-bench --device cuda: inputs are copied to the GPU before a round
 * and outputs back after it, outside the timed calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "bench.h"

#ifdef FERRY_HAVE_CUDA
/* The rank's index among the ranks of its host, as its launcher tells it
 * (the fork launcher's ranks are all local: the rank itself). */
static int local_rank(int rank)
{
    static const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK",
                                 "SLURM_LOCALID", "MPI_LOCALRANKID",
                                 "PMI_LOCAL_RANK"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        if (v && *v)
            return atoi(v);
    }
    return rank;
}

int dev_bind(const char *gpu, int rank, int *chosen)
{
    int n = 0;
    *chosen = -1;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        return 0; /* no GPU: ferry_ep_create says why, on every rank */
    }
    char *end = NULL;
    long g = strcmp(gpu, "auto") == 0 ? (n > 0 ? local_rank(rank) % n : 0)
                                      : strtol(gpu, &end, 10);
    if ((end && (*end || end == gpu)) || g < 0 || g >= n) {
        fprintf(stderr, "ferry-bench: --gpu %s: use auto or 0..%d (visible GPUs)\n",
                gpu, n - 1);
        return -1;
    }
    DEVCHK(cudaSetDevice((int)g));
    *chosen = (int)g;
    return 0;
}

void dev_name(char *buf, size_t len)
{
    int g = -1;
    struct cudaDeviceProp p;
    buf[0] = 0;
    if (cudaGetDevice(&g) != cudaSuccess || cudaGetDeviceProperties(&p, g) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    snprintf(buf, len, "%s", p.name);
}

int dev_init(dev_t_ *d, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    size_t T = (size_t)(s->T > 0 ? s->T : 1), El = (size_t)lay->num_local_experts;
    size_t cap = (size_t)lay->expert_capacity;
    DEVCHK(cudaStreamCreateWithFlags((cudaStream_t *)&d->stream, cudaStreamNonBlocking));
    DEVCHK(cudaMalloc(&d->x, T * s->H * 2));
    DEVCHK(cudaMalloc(&d->idx, T * s->K * 8));
    DEVCHK(cudaMalloc(&d->w, T * s->K * 4));
    DEVCHK(cudaMalloc(&d->out, T * s->H * 2));
    DEVCHK(cudaMalloc(&d->ex, lay->expert_x_bytes + 16));
    DEVCHK(cudaMalloc(&d->exs, lay->expert_scales_bytes + 16));
    DEVCHK(cudaMalloc(&d->cnt, El * 4));
    DEVCHK(cudaMalloc(&d->sr, El * cap * 4));
    DEVCHK(cudaMalloc(&d->st, El * cap * 4));
    DEVCHK(cudaMalloc(&d->ey, lay->expert_y_bytes + 16));
    DEVCHK(cudaMalloc(&d->gs, sizeof(float)));
    DEVCHK(cudaMemcpy(d->gs, &s->gs, sizeof(float), cudaMemcpyHostToDevice));
    d->on = 1;
    return 0;
}

int dev_inputs(dev_t_ *d, const fw_spec_t *s, const fw_input_t *in)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    DEVCHK(cudaMemcpyAsync(d->x, in->x, (size_t)in->T * s->H * 2, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaMemcpyAsync(d->idx, in->idx, (size_t)in->T * s->K * 8, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaMemcpyAsync(d->w, in->w, (size_t)in->T * s->K * 4, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

/* expert rows back to the host: only the rows each expert filled */
int dev_dispatch_out(dev_t_ *d, const ferry_ep_layout_t *lay, uint8_t *ex,
                     float *exs, int whole_scales, int32_t *cnt, int32_t *sr, int32_t *st_)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    size_t El = (size_t)lay->num_local_experts, cap = (size_t)lay->expert_capacity;
    size_t tb = lay->token_bytes, ns = (size_t)lay->num_scales;
    DEVCHK(cudaMemcpy(cnt, d->cnt, El * 4, cudaMemcpyDeviceToHost));
    if (ns && whole_scales)
        DEVCHK(cudaMemcpyAsync(exs, d->exs, lay->expert_scales_bytes, cudaMemcpyDeviceToHost, st));
    for (size_t le = 0; le < El; le++) {
        size_t n = (size_t)cnt[le], o = le * cap;
        if (!n || n > cap)
            continue;
        DEVCHK(cudaMemcpyAsync(ex + o * tb, (uint8_t *)d->ex + o * tb, n * tb, cudaMemcpyDeviceToHost, st));
        if (ns && !whole_scales)
            DEVCHK(cudaMemcpyAsync(exs + o * ns, (float *)d->exs + o * ns, n * ns * 4, cudaMemcpyDeviceToHost, st));
        DEVCHK(cudaMemcpyAsync(sr + o, (int32_t *)d->sr + o, n * 4, cudaMemcpyDeviceToHost, st));
        DEVCHK(cudaMemcpyAsync(st_ + o, (int32_t *)d->st + o, n * 4, cudaMemcpyDeviceToHost, st));
    }
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

int dev_expert_y(dev_t_ *d, const ferry_ep_layout_t *lay, const int32_t *cnt,
                 const uint16_t *ey, int H)
{
    cudaStream_t st = (cudaStream_t)d->stream;
    size_t El = (size_t)lay->num_local_experts, cap = (size_t)lay->expert_capacity;
    size_t rb = 2 * (size_t)H;
    for (size_t le = 0; le < El; le++)
        if (cnt[le] > 0 && (size_t)cnt[le] <= cap)
            DEVCHK(cudaMemcpyAsync((uint8_t *)d->ey + le * cap * rb, ey + le * cap * H,
                                   (size_t)cnt[le] * rb, cudaMemcpyHostToDevice, st));
    DEVCHK(cudaStreamSynchronize(st));
    return 0;
}

int dev_out(dev_t_ *d, uint16_t *out, int T, int H)
{
    DEVCHK(cudaMemcpy(out, d->out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    return 0;
}

void dev_free(dev_t_ *d)
{
    if (!d->on)
        return;
    void *p[] = {d->x, d->idx, d->w, d->out, d->ex, d->exs, d->cnt, d->sr, d->st, d->ey, d->gs};
    for (size_t i = 0; i < sizeof(p) / sizeof(p[0]); i++)
        cudaFree(p[i]);
    cudaStreamDestroy((cudaStream_t)d->stream);
}
#else
void dev_name(char *buf, size_t len)
{
    if (len)
        buf[0] = 0;
}
int dev_bind(const char *gpu, int rank, int *chosen)
{
    (void)gpu; (void)rank;
    *chosen = -1;
    return -1;
}
int dev_init(dev_t_ *d, const fw_spec_t *s, const ferry_ep_layout_t *lay)
{
    (void)d; (void)s; (void)lay;
    fprintf(stderr, "ferry-bench: built without CUDA\n");
    return -1;
}
int dev_inputs(dev_t_ *d, const fw_spec_t *s, const fw_input_t *in)
{ (void)d; (void)s; (void)in; return -1; }
int dev_dispatch_out(dev_t_ *d, const ferry_ep_layout_t *lay, uint8_t *ex, float *exs, int whole,
                     int32_t *cnt, int32_t *sr, int32_t *st_)
{ (void)d; (void)lay; (void)ex; (void)exs; (void)whole; (void)cnt; (void)sr; (void)st_; return -1; }
int dev_expert_y(dev_t_ *d, const ferry_ep_layout_t *lay, const int32_t *cnt,
                 const uint16_t *ey, int H)
{ (void)d; (void)lay; (void)cnt; (void)ey; (void)H; return -1; }
int dev_out(dev_t_ *d, uint16_t *out, int T, int H)
{ (void)d; (void)out; (void)T; (void)H; return -1; }
void dev_free(dev_t_ *d) { (void)d; }
#endif
