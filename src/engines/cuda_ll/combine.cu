/*
 * The CUDA low-latency engine's combine (dispatch: dispatch.cu; set-up,
 * free and the error word: setup.cu; masks: mask.cu).
 *
 *   combine send part    = rows of each source rank, one contiguous run,
 *                          then every block adds its share to the flags
 *   combine receive part = wait for all flags, fp32 weighted sum, bf16 out
 *   one kernel (ferry::combine): one launch runs both parts;
 *   combine_send / combine_recv launch it once per part.
 *
 * Ordering (IPC path): data stores, a block barrier, one system fence by
 * warp 0, then its lanes' relaxed system-scope adds to the destinations'
 * flags (fr_cu_arrive: flags count arrivals). Fabric path: a count of finished
 * blocks, and the block that finishes fills each peer's slice and rings
 * its doorbell for the proxy.
 * Receivers poll relaxed and acquire once. Waits are bounded by
 * %globaltimer: on expiry the kernel writes an error word in host-mapped
 * memory and returns (never traps); every later kernel sees the word and
 * returns at once.
 */

#include "engines/cuda_ll/cuda_ll_dev.cuh"
#include "core/logfmt.h"
#include "ep/hmem.h"
#include "runtime/rt.h"

/* threads per block of ferry::combine, whichever parts a launch runs */
#define FR_CS_THREADS 512
/* sources whose pair counts and destinations the send part loads at once */
#define FR_CS_SRC 256

/* ---------------------------------------------------------------------- */
/* combine                                                                */

/* The overlapped combine's signals (ferry_combine_in_t): row `slot` of
 * local expert e waits for sig[e * nb + slot / block] == value; sig NULL:
 * no waits. sent: optional per-expert counts of rows past their signal. */
typedef struct fr_cu_sig {
    const uint32_t *sig;
    uint32_t value;
    int block, nb;
    int32_t *sent;
    int lf; /* the round's rows are LogFMT (FERRY_COMBINE_LOGFMT) */
} fr_cu_sig_t;

/* ---------------------------------------------------------------------- */
/* LogFMT (core/logfmt.h) with the GPU's approximate lg2 and ex2, as
 * DeepEP's kernels: a value next to a code boundary can take the
 * neighbouring code of the CPU engine's (correctly rounded) choice. */

static __device__ __forceinline__ float fr_lg2a(float x)
{
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
static __device__ __forceinline__ float fr_ex2a(float x)
{
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* A division's logs from its amax and amin; true: it may be cast. */
static __device__ __forceinline__ bool fr_lf_logs_d(float amax, float amin, float &la, float &lm)
{
    la = fr_lg2a(amax);
    lm = fmaxf(fr_lg2a(amin), la - FR_LF_CLIP);
    return la < 0.f && lm < la;
}

/* A warp encodes row y (H bf16) at dst: per chunk, lane l takes C/32
 * channels (two or one 16-channel groups), the lanes of a division
 * reduce its amax/amin, the warp votes the chunk's form. */
static __device__ void fr_lf_encode_warp(uint8_t *dst, const uint8_t *y, int H)
{
    const unsigned full = 0xffffffffu;
    int lane = threadIdx.x & 31, C = fr_lf_chunk(H), per = C / 32, lpd = FR_LF_DIV / per;
    uint32_t off = fr_lf_meta(H);
    for (int c = 0; c < H / C; c++) {
        int ch0 = c * C + lane * per;
        int4 v4[4];
        const uint16_t *v = (const uint16_t *)v4;
        for (int i = 0; i < per / 8; i++) /* coherent loads: a GEMM may have written y */
            v4[i] = __ldcg((const int4 *)(y + 2 * (size_t)(ch0 + 8 * i)));
        float amax = 0.f, amin = __int_as_float(0x7f800000);
        for (int i = 0; i < per; i++) {
            float f = fr_bf16_to_f32((uint16_t)(v[i] & 0x7fffu));
            amax = fmaxf(amax, f); /* NaN ignored */
            amin = fminf(amin, f);
        }
        for (int o = 1; o < lpd; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(full, amax, o));
            amin = fminf(amin, __shfl_xor_sync(full, amin, o));
        }
        float la, lm;
        bool cast = __all_sync(full, fr_lf_logs_d(amax, amin, la, lm));
        if (lane % lpd == 0) {
            uint32_t m = (uint32_t)fr_f32_to_bf16(amax) | ((uint32_t)fr_f32_to_bf16(amin) << 16);
            *(uint32_t *)(dst + 4 * (size_t)(ch0 / FR_LF_DIV)) = m;
        }
        if (!cast) {
            for (int i = 0; i < per / 8; i++)
                *(int4 *)(dst + off + 2 * (size_t)(lane * per + 8 * i)) = v4[i];
            off += fr_lf_chunk_bytes(C, 0);
            continue;
        }
        float step = __fdiv_rn(la - lm, FR_LF_STEPS), inv = __fdiv_rn(1.f, step);
        float half = __fmul_rn(__fadd_rn(1.f, fr_ex2a(step)), 0.5f);
        float fused = __fmaf_rn(-lm, inv, __fmaf_rn(-fr_lg2a(half), inv, 2.f));
        for (int g = 0; g < per / 16; g++) {
            uint32_t e[16], signs = 0, w[5];
            for (int m = 0; m < 16; m++) {
                uint16_t b = v[16 * g + m];
                float t = __fmaf_rn(fr_lg2a(fr_bf16_to_f32((uint16_t)(b & 0x7fffu))), inv, fused);
                t = fmaxf(t, 0.f); /* NaN: 0 */
                e[m] = t < 511.f ? (uint32_t)t : 511u;
                signs |= (uint32_t)(b >> 15) << m;
            }
            fr_lf_pack(w, e, signs);
            uint32_t *o = (uint32_t *)(dst + off + (size_t)(lane * per / 16 + g) * 20);
            for (int i = 0; i < 5; i++)
                o[i] = w[i];
        }
        off += fr_lf_chunk_bytes(C, 1);
    }
}

/* The cast chunks of a LogFMT row (bit c: chunk c cast), from its meta:
 * a warp, lanes over the divisions. */
static __device__ unsigned long long fr_lf_mask_warp(const uint8_t *row, int H)
{
    int lane = threadIdx.x & 31, nd = H / FR_LF_DIV, dpc = fr_lf_chunk(H) / FR_LF_DIV;
    unsigned long long mask = 0;
    for (int d0 = 0; d0 < nd; d0 += 32) {
        bool ok = true;
        if (d0 + lane < nd) {
            uint32_t m = *(const uint32_t *)(row + 4 * (size_t)(d0 + lane));
            float la, lm;
            ok = fr_lf_logs_d(fr_bf16_to_f32((uint16_t)(m & 0xffffu)),
                              fr_bf16_to_f32((uint16_t)(m >> 16)), la, lm);
        }
        unsigned b = __ballot_sync(0xffffffffu, ok);
        for (int j = 0; j < 32; j += dpc) { /* chunks of this window: all its divisions */
            unsigned want = dpc == 32 ? 0xffffffffu : ((1u << dpc) - 1u) << j;
            if (d0 + j < nd && (b & want) == want)
                mask |= 1ull << ((d0 + j) / dpc);
        }
    }
    return mask;
}

/* acc[0..8) += w * the decoded channels h0..h0+7 of a LogFMT row (fused,
 * as the CPU engine). */
static __device__ __forceinline__ void fr_lf_acc8(float acc[8], float w, const uint8_t *row,
                                                  unsigned long long mask, int h0, int H)
{
    int C = fr_lf_chunk(H), c = h0 / C, hc = h0 - c * C;
    uint32_t off = fr_lf_meta(H) + (uint32_t)c * 2u * (uint32_t)C -
                   (uint32_t)__popcll(mask & ((1ull << c) - 1ull)) * (uint32_t)(3 * C / 4);
    if (!(mask >> c & 1ull)) {
        int4 v = *(const int4 *)(row + off + 2 * (size_t)hc);
        const uint16_t *b = (const uint16_t *)&v;
        for (int i = 0; i < 8; i++)
            acc[i] = __fmaf_rn(fr_bf16_to_f32(b[i]), w, acc[i]);
        return;
    }
    uint32_t m = *(const uint32_t *)(row + 4 * (size_t)(h0 / FR_LF_DIV));
    float la, lm;
    fr_lf_logs_d(fr_bf16_to_f32((uint16_t)(m & 0xffffu)), fr_bf16_to_f32((uint16_t)(m >> 16)),
                 la, lm);
    float step = __fdiv_rn(la - lm, FR_LF_STEPS);
    const uint32_t *g = (const uint32_t *)(row + off + (size_t)(hc / 16) * 20);
    uint32_t wd[5];
    for (int i = 0; i < 5; i++)
        wd[i] = g[i];
    int m0 = hc & 8;
    for (int i = 0; i < 8; i++) {
        uint32_t e = fr_lf_code(wd, m0 + i);
        float x = e ? fr_ex2a(__fmaf_rn((float)(e - 1), step, lm)) : 0.f;
        x = (wd[4] >> (16 + m0 + i)) & 1u ? -x : x;
        acc[i] = __fmaf_rn(x, w, acc[i]);
    }
}

/* A warp waits (lane 0 polls, acquire at GPU scope: the signals come
 * from kernels on this GPU) until the signal of expert_y row `row` is
 * raised; false when the wait ran out (error word set: the expert and the
 * signal's index) or another error was reported. Warp-uniform. */
static __device__ bool fr_cs_signal(const fr_cu_args_t &A, const fr_cu_sig_t &S, int row)
{
    int cap = (int)A.L.cap, e = row / cap;
    long long idx = (long long)e * S.nb + (row - e * cap) / S.block;
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        const uint32_t *p = S.sig + idx;
        unsigned long long t0 = 0;
        for (unsigned int n = 1;; n++) {
            uint32_t v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
            if (v == S.value)
                break;
            if ((n & 63) == 0) {
                unsigned long long now = fr_sys_timer();
                if (fr_cu_failed(A)) {
                    ok = 0;
                    break;
                }
                if (!t0) {
                    t0 = now;
                } else if (now - t0 > A.timeout_ns) {
                    fr_cu_fail(A, FERRY_ERR_TIMEOUT, e, FR_CU_WHAT_SIGNAL, (int)idx);
                    ok = 0;
                    break;
                }
            }
            __nanosleep(100);
        }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp(); /* the lanes' reads of the row after lane 0's acquire */
    return ok != 0;
}

static __device__ __forceinline__ void fr_cs_run(const fr_cu_args_t &A, int set,
                                                 const uint8_t *y, const fr_cu_sig_t &S)
{
    const fr_layout_t &L = A.L;
    int N = A.N;
    unsigned int *done = A.done + FR_PH_COMBINE * FR_NSETS + set;
    const int32_t *pn = A.pair_n + set * N;
    size_t pstride = (size_t)L.T * L.kmax; /* sender s's pairs start at s * pstride */
    __shared__ int s_fail;
    __shared__ const int32_t *s_mk; /* the mask, NULL when no rank is masked */
    if (threadIdx.x == 0) {
        s_fail = fr_cu_failed(A);
        s_mk = A.mask[N] ? A.mask : NULL;
        if (blockIdx.x == 0)
            FR_TL(A, FR_PH_COMBINE, A.epoch[set], "start", A.rank);
    }
    __syncthreads();
    /* items of 4 KB (a warp's 8 x 16 bytes per lane) of every row, all
     * warps of the grid over each source's rows in turn; own rows are
     * read in place by combine_recv. Each source's pair count and
     * destination are loaded first, a thread per source, FR_CS_SRC at a
     * time: a source after another, each behind its own loads, was a
     * chain as long as the ranks even with nothing to send. */
    __shared__ int s_np[FR_CS_SRC];
    __shared__ uint8_t *s_dst[FR_CS_SRC];
    int cpr = S.lf ? 1 : (int)((L.crow + 4095) / 4096); /* LogFMT: a warp per row */
    bool sig_ok = true; /* this warp's signal waits (warp-uniform) */
    int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int nwg = gridDim.x * (blockDim.x >> 5);
    for (int s0 = 0; s0 < N && !s_fail; s0 += FR_CS_SRC) {
        int nsrc = min(FR_CS_SRC, N - s0);
        if (s0 > 0)
            __syncthreads(); /* the previous sources' entries are read */
        for (int i = threadIdx.x; i < nsrc; i += blockDim.x) {
            int s = s0 + i;
            /* a masked rank's memory: never; own rows: read in place,
             * but with signals each waited for (combine_recv reads them) */
            /* LogFMT: own rows encoded into this rank's region too (the
             * receive decodes every row alike; no fabric peers then) */
            int np = (s == A.rank && !S.sig && !S.lf) || (s_mk && s_mk[s]) ? 0 : pn[s];
            s_np[i] = np;
            if (np > 0)
                s_dst[i] = s == A.rank && !S.lf ? NULL
                           : A.path[s] == FR_PATH_FABRIC
                               ? A.send + fr_off_csend(&L, set, (uint64_t)(s * pstride))
                               : A.peer[s] + fr_off_crecv_st(&L, set,
                                                             (uint64_t)A.scomb_off[set * N + s],
                                                             S.lf ? L.cslot : L.crow);
        }
        __syncthreads();
        for (int i = 0; i < nsrc; i++) {
            int np = s_np[i];
            if (np == 0)
                continue;
            const int32_t *rows = A.pair_row + (size_t)set * L.send_crows + (s0 + i) * pstride;
            uint8_t *dst = s_dst[i];
            for (int q = gw; q < np * cpr && sig_ok; q += nwg) {
                int p = q / cpr, c = q - p * cpr;
                if (rows[p] < 0) /* dropped at dispatch (an input error was reported) */
                    continue;
                if (S.sig) { /* every piece of the row behind its signal */
                    if (!dst && c > 0)
                        continue;
                    if (!(sig_ok = fr_cs_signal(A, S, rows[p])))
                        break; /* the error word is set: the round fails */
                    if (c == 0 && S.sent && (threadIdx.x & 31) == 0)
                        atomicAdd(S.sent + rows[p] / (int)L.cap, 1);
                    if (!dst)
                        continue; /* an own row: waited for, read in place */
                }
                if (S.lf) {
                    fr_lf_encode_warp(dst + (size_t)p * L.cslot, y + (size_t)rows[p] * L.crow,
                                      L.H);
                    continue;
                }
                size_t off = (size_t)c * 4096, len = L.crow - off < 4096 ? L.crow - off : 4096;
                if (S.sig) /* coherent loads: the GEMM wrote the row during this kernel */
                    fr_warp_copy16u<8, true>(dst + (size_t)p * L.crow + off,
                                             y + (size_t)rows[p] * L.crow + off, len);
                else
                    fr_warp_copy16u<8, false>(dst + (size_t)p * L.crow + off,
                                              y + (size_t)rows[p] * L.crow + off, len);
            }
        }
    }
    __shared__ bool last;
    if (A.nfabric == 0) {
        fr_cu_arrive(A, FR_PH_COMBINE, set, s_mk); /* barrier first, then warp 0 */
        return;
    }
    /* the block's stores, then one system fence (fr_cu_arrive says why
     * one thread's fence after a barrier covers them) before the count */
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence_system();
    unsigned long long epoch = A.epoch[set];
    bool ok = !fr_cu_failed(A);
    for (int d = threadIdx.x; d < N && ok; d += blockDim.x) {
        if (s_mk && s_mk[d]) /* a masked rank is sent nothing */
            continue;
        int np = pn[d];
        fr_cu_publish(A, FR_PH_COMBINE, set, d, epoch,
                      fr_off_csend(&L, set, (uint64_t)(d * pstride)),
                      fr_off_crecv(&L, set, (uint64_t)A.scomb_off[set * N + d]),
                      (uint64_t)np * L.crow);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        *done = 0;
}

/* Blocks take runs of B consecutive tokens: the rows of all B x K pairs
 * are looked up at once, then every thread sums 8 channels of one token
 * with the K row loads in flight (no per-token barrier or lookup chain). */
#define FR_CR_PAIRS 256
#define FR_CR_CUTS 32 /* masked ranks a combine block lists for its cut */
static __device__ __forceinline__ void fr_cr_run(const fr_cu_args_t &A, int set,
                                                 const float *w, uint16_t *out,
                                                 const uint8_t *self_y, long long *cost, int lf)
{
    const fr_layout_t &L = A.L;
    int N = A.N, K = L.K, H = L.H;
    __shared__ int ok, s_own; /* s_own: a wait of this block masked a rank */
    __shared__ const uint8_t *srow[FR_CR_PAIRS];
    __shared__ float sw[FR_CR_PAIRS];
    __shared__ unsigned long long smask[FR_CR_PAIRS]; /* LogFMT: cast chunks per row */
    /* Every sender is needed before any token can be summed: the first
     * warp's lanes wait for them at once (lane l for senders l, l + 32,
     * ...), so the wait costs one poll latency, not N in a row; block 0's
     * lanes add what each waited to the optional wait costs. */
    if (threadIdx.x == 0)
        s_own = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
        bool mine = !fr_cu_failed(A);
        unsigned long long epoch = A.epoch[set];
        int nmask = A.mask[N]; /* loaded beside the two above */
        for (int s = threadIdx.x; s < N && mine; s += 32) {
            if (nmask && A.mask[s]) /* sent nothing, waited for never */
                continue;
            long long t0 = clock64();
            int w = fr_cu_wait_peer(A, FR_PH_COMBINE, set, s, epoch, FR_CU_WHAT_COMBINE);
            mine = w != 0;
            if (w == 2)
                s_own = 1;
            if (w == 1 && cost && blockIdx.x == 0)
                atomicAdd((unsigned long long *)(cost + s), (unsigned long long)(clock64() - t0));
        }
        mine = __all_sync(0xffffffffu, mine);
        if (threadIdx.x == 0)
            ok = mine;
    }
    __syncthreads();
    if (!ok)
        return;
    int T = A.ntok[set];
    const int32_t *cpos = A.comb_pos + (size_t)set * L.T * K;
    /* ranks masked by now (a wait that ran out in this round, here or in
     * the dispatch) that this round sent rows to: those rows never come
     * back, their slots count 0 (ranks masked before this round got no
     * rows: their slots were cut at dispatch). Thread 0 lists them once
     * per block (s_ncut; more than FR_CR_CUTS: every slot checks every
     * rank); this block's own masked answers count even before the
     * count of masked ranks, another block's add, is seen. */
    __shared__ int s_ncut, s_cut[FR_CR_CUTS];
    const int32_t *soff = A.comb_off + set * N, *spn = A.npairs + set * N;
    if (threadIdx.x == 0) {
        s_ncut = 0;
        if (A.mask_on_timeout && (s_own || *(volatile int32_t *)(A.mask + N) != 0))
            for (int d = 0; d < N; d++)
                if (((volatile int32_t *)A.mask)[d] && spn[d] > 0) {
                    if (s_ncut < FR_CR_CUTS)
                        s_cut[s_ncut] = d;
                    s_ncut++;
                }
    }
    __syncthreads();
    int ncut = s_ncut, nscan = ncut <= FR_CR_CUTS ? ncut : N;
    /* pairs this rank sent itself: rows [cs, cs + ns) of its combine region
     * were never copied; they are expert_y rows pair_row[ps + pos - cs] */
    int cs = A.comb_off[set * N + A.rank], ns = A.npairs[set * N + A.rank];
    size_t ps = (size_t)A.rank * L.T * L.kmax;
    const int32_t *prow = A.pair_row + (size_t)set * L.send_crows;
    int hc = H / 8; /* 8-channel chunks of a token */
    /* runs of B tokens: the tokens spread over the blocks, B x K pairs fit */
    int B = max(1, min((T + (int)gridDim.x - 1) / (int)gridDim.x, FR_CR_PAIRS / K));
    for (int tb = blockIdx.x * B; tb < T; tb += gridDim.x * B) {
        int nb = min(B, T - tb);
        for (int i = threadIdx.x; i < nb * K; i += blockDim.x) {
            int pos = cpos[(size_t)tb * K + i];
            /* rows an IPC peer sent (peers on both paths): in iseg */
            const uint8_t *rb = pos >= 0 && (pos & FR_CPOS_IPC) ? A.iseg : A.seg;
            pos = pos >= 0 ? pos & ~FR_CPOS_IPC : pos;
            for (int j = 0; j < nscan && pos >= 0; j++) {
                int d = ncut <= FR_CR_CUTS ? s_cut[j] : j;
                if (ncut > FR_CR_CUTS && !(((volatile int32_t *)A.mask)[d] && spn[d] > 0))
                    continue;
                if (pos >= soff[d] && pos < soff[d] + spn[d])
                    pos = -1;
            }
            int pr = pos >= cs && pos < cs + ns ? prow[ps + pos - cs] : 0;
            if (lf) /* every row encoded in this rank's region, own rows too */
                srow[i] = pos < 0 || pr < 0 ? NULL
                                            : A.seg + fr_off_crecv_st(&L, set, (uint64_t)pos,
                                                                      L.cslot);
            else
                srow[i] = pos < 0 || pr < 0 ? NULL
                          : pos >= cs && pos < cs + ns
                              ? self_y + (size_t)pr * L.crow
                              : rb + fr_off_crecv(&L, set, (uint64_t)pos);
            sw[i] = w[(size_t)tb * K + i];
        }
        __syncthreads();
        if (lf) { /* each row's cast chunks, a warp per row */
            for (int i = threadIdx.x >> 5; i < nb * K; i += blockDim.x >> 5)
                if (srow[i]) {
                    unsigned long long m = fr_lf_mask_warp(srow[i], H);
                    if ((threadIdx.x & 31) == 0)
                        smask[i] = m;
                }
            __syncthreads();
            for (int j = threadIdx.x; j < nb * hc; j += blockDim.x) {
                int tl = j / hc, h0 = (j - tl * hc) * 8;
                float acc[8];
                for (int i = 0; i < 8; i++)
                    acc[i] = 0.f;
                for (int k = 0; k < K; k++)
                    if (srow[tl * K + k])
                        fr_lf_acc8(acc, sw[tl * K + k], srow[tl * K + k], smask[tl * K + k], h0, H);
                int4 o;
                uint16_t *ov = (uint16_t *)&o;
                for (int i = 0; i < 8; i++)
                    ov[i] = fr_f32_to_bf16(acc[i]);
                *(int4 *)(out + (size_t)(tb + tl) * H + h0) = o;
            }
            __syncthreads();
            continue;
        }
        for (int j = threadIdx.x; j < nb * hc; j += blockDim.x) {
            int tl = j / hc, h0 = (j - tl * hc) * 8;
            const uint8_t *const *rr = srow + tl * K;
            const float *ww = sw + tl * K;
            /* up to 8 loads in flight, then their sum in k order */
            float acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = 0.f;
            for (int k0 = 0; k0 < K; k0 += 8) {
                int4 v[8];
#pragma unroll
                for (int k = 0; k < 8; k++)
                    if (k0 + k < K && rr[k0 + k])
                        v[k] = *(const int4 *)(rr[k0 + k] + (size_t)h0 * 2);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    if (k0 + k >= K || !rr[k0 + k])
                        continue;
                    const uint16_t *yv = (const uint16_t *)&v[k];
                    for (int i = 0; i < 8; i++)
                        acc[i] += ww[k0 + k] * fr_bf16_to_f32(yv[i]);
                }
            }
            int4 o;
            uint16_t *ov = (uint16_t *)&o;
            for (int i = 0; i < 8; i++)
                ov[i] = fr_f32_to_bf16(acc[i]);
            *(int4 *)(out + (size_t)(tb + tl) * H + h0) = o;
        }
        __syncthreads();
    }
}

/* The combine kernel: one for the operation, its parts chosen by `phases`
 * (FR_PART_SEND, FR_PART_RECV or both: a split call launches it twice).
 * Both parts in one launch need the grid resident at once (blocks wait
 * for the other blocks' sends). self_y: this rank's own rows (the send's
 * y; the receive alone gets the y its send part was given). */
namespace ferry {
__global__ void __launch_bounds__(FR_CS_THREADS, 2)
combine(fr_cu_args_t A, int set, const uint8_t *y, const float *w, uint16_t *out,
        const uint8_t *self_y, long long *cost, int phases, fr_cu_sig_t S)
{
    if (phases & FR_PART_SEND)
        fr_cs_run(A, set, y, S);
    if (!(phases & FR_PART_RECV))
        return;
    if (phases & FR_PART_SEND)
        __syncthreads();
    fr_cr_run(A, set, w, out, self_y, cost, S.lf);
}
} /* namespace ferry */


/* The combine kernel loaded now, its grid within what the GPU holds
 * (setup.cu's fr_cuda_load_kernels). */
extern "C" int fr_cuda_combine_load(ferry_ep_t ep, struct fr_cuda_ep *c, fr_err_t *err)
{
    (void)ep;
    decltype(&ferry::combine) ks[] = {ferry::combine};
    c->cgrid = fr_cu_grid(c, ks, FR_CS_THREADS, 0, "combine");
    const void *fs[] = {(const void *)ferry::combine};
    return fr_cu_load(fs, sizeof(fs) / sizeof(fs[0]), "combine", err);
}

/* ---------------------------------------------------------------------- */
/* host entry points                                                      */

/* A receive launch's: no signals, the round's format. */
static fr_cu_sig_t fr_cu_recv_sig(int lf)
{
    fr_cu_sig_t S = {NULL, 0, 1, 1, NULL, lf};
    return S;
}

/* The signals of `in` as the kernel takes them (none: sig NULL). */
static fr_cu_sig_t fr_cu_sig_of(ferry_ep_t ep, const ferry_combine_in_t *in)
{
    fr_cu_sig_t S = {NULL, 0, 1, 1, NULL, in->format == FERRY_COMBINE_LOGFMT};
    if (in->signals) {
        int cap = (int)ep->L.cap;
        S.sig = in->signals;
        S.value = in->signal_value;
        S.block = in->signal_block > 0 && in->signal_block < cap ? in->signal_block : cap;
        S.nb = (cap + S.block - 1) / S.block;
        S.sent = in->sent_rows;
    }
    return S;
}

/* Blocks for a combine kernel: at most b, and at most the call's num_sms
 * (sms > 0). The kernels spread their work over gridDim.x. */
static int fr_cu_cblocks(int b, int sms)
{
    b = sms > 0 && sms < b ? sms : b;
    return b < 1 ? 1 : b;
}

extern "C" int fr_cuda_combine_send(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_in_t *in)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    c->y[set] = in->expert_y;
    c->lf[set] = in->format == FERRY_COMBINE_LOGFMT;
    c->csms[set] = in->num_sms;
    ferry::combine<<<fr_cu_cblocks(c->nblocks, in->num_sms), FR_CS_THREADS, 0, st>>>(c->a, set, (const uint8_t *)in->expert_y,
                                                        NULL, NULL, NULL, NULL, FR_PART_SEND,
                                                        fr_cu_sig_of(ep, in));
    return fr_cuda_launch_check(ep, "combine_send");
}

extern "C" int fr_cuda_combine_recv(ferry_ep_t ep, fr_round_t *r,
                                    const ferry_combine_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)out->stream;
    int set = (int)(r->epoch % FR_NSETS);
    int blocks = fr_cu_cblocks(c->nblocks < ep->L.T ? c->nblocks : ep->L.T, c->csms[set]);
    ferry::combine<<<blocks, FR_CS_THREADS, 0, st>>>(c->a, set, NULL, out->topk_weights,
                                                    (uint16_t *)out->out,
                                                    (const uint8_t *)c->y[set],
                                                    (long long *)out->wait_cost, FR_PART_RECV,
                                                    fr_cu_recv_sig(c->lf[set]));
    int rc = fr_cuda_launch_check(ep, "combine_recv");
    if (rc == FERRY_OK)
        fr_ahead_mark(&c->ahead, r->epoch, st);
    return rc;
}

extern "C" int fr_cuda_combine(ferry_ep_t ep, fr_round_t *r, const ferry_combine_in_t *in,
                               const ferry_combine_out_t *out)
{
    struct fr_cuda_ep *c = (struct fr_cuda_ep *)ep->eng_state;
    cudaStream_t st = (cudaStream_t)in->stream;
    int set = (int)(r->epoch % FR_NSETS);
    c->y[set] = in->expert_y;
    c->lf[set] = in->format == FERRY_COMBINE_LOGFMT;
    if (c->cgrid < 0) {
        int rc = fr_cuda_combine_send(ep, r, in);
        return rc ? rc : fr_cuda_combine_recv(ep, r, out);
    }
    int blocks = fr_cu_cblocks(c->nblocks < c->cgrid ? c->nblocks : c->cgrid, in->num_sms);
    ferry::combine<<<blocks, FR_CS_THREADS, 0, st>>>(c->a, set, (const uint8_t *)in->expert_y,
                                                    out->topk_weights, (uint16_t *)out->out,
                                                    (const uint8_t *)in->expert_y,
                                                    (long long *)out->wait_cost,
                                                    FR_PART_SEND | FR_PART_RECV,
                                                    fr_cu_sig_of(ep, in));
    int rc = fr_cuda_launch_check(ep, "combine");
    if (rc == FERRY_OK)
        fr_ahead_mark(&c->ahead, r->epoch, st);
    return rc;
}
