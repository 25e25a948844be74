#!/usr/bin/env python3
"""sgl-deep-ep's NVFP4 low-latency dispatch on ferry (deep_ep.Buffer,
use_nvfp4=True with x_global_scale), CPU ranks: the checks of sgl-deep-ep's
tests/test_low_latency_nvfp4.py, written here:

  - the received codes and scales equal, bit for bit, the NVFP4
    quantisation (a reference in this file) of the bf16 rows the same
    routing delivers through a bf16 dispatch, for every valid row;
  - the outputs have sgl-deep-ep's shapes, dtypes and views: codes uint8
    [N*T, H/2, E_local] (a view of [E_local, N*T, H/2]), scales
    float8_e4m3fn [32, 4, ceil(N*T/128), 4, H/64, E_local] (a view of the
    128 x 4 swizzle), counts equal to the bf16 dispatch's;
  - the rows dequantised (code * scale / gs) are within sgl-deep-ep's
    tolerance of the bf16 rows (calc_diff < 0.1) and within NVFP4's own
    bound channel by channel;
  - a combine after an NVFP4 dispatch returns the reference sum.

Back-to-back rounds with changing Zipf routing, masked slots, a rank with
no tokens in odd rounds, magnitudes that differ per 16-channel block, the
encode scale all-reduced (MIN) as sgl-deep-ep's test makes it. Argument
errors name the argument. Usage: test_nvfp4.py [cpu|cuda] [nranks] (cuda:
CUDA tensors, ranks sharing the current GPU). Exit 77 without torch (or
without a GPU for cuda).
"""
import os
import sys
import traceback

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranks import ranks_main, torch_init  # noqa: E402

H, K, T = 256, 4, 40
MAG = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def inputs(rank, rnd, E):
    g = torch.Generator().manual_seed(7919 * rnd + 31 * rank + 5)
    t = 0 if (rank == 1 and rnd % 2) else T - 5 * (rank % 3)
    blockmag = torch.pow(2.0, torch.randint(-6, 5, (t, H // 16), generator=g).float())
    x = torch.randn((t, H), generator=g) * blockmag.repeat_interleave(16, dim=1)
    p = 1.0 / torch.arange(1, E + 1).float() ** 1.2
    idx = torch.stack([torch.multinomial(p, K, replacement=False, generator=g)
                       for _ in range(t)]) if t else torch.zeros((0, K), dtype=torch.int64)
    idx[torch.rand(t, K, generator=g) < 0.1] = -1
    w = 0.1 + 0.9 * torch.rand((t, K), generator=g)
    return x.to(torch.bfloat16), idx, w


def e2m1_codes(v):
    """Nearest e2m1 code of each float32 (ties to the even code, saturating
    at 6), the sign in bit 3."""
    a = v.abs().double()
    d = (a.unsqueeze(-1) - MAG).abs()
    best = d == d.min(dim=-1, keepdim=True).values
    odd = torch.arange(8) % 2
    code = torch.argmin((~best).long() * 2 + odd, dim=-1)
    return code | (torch.signbit(v).long() << 3)


def quantize(rows, gs):
    """Reference NVFP4 of bf16 rows [n, H] with encode scale gs (float32):
    (codes uint8 [n, H/2], scale bytes uint8 [n, H/16])."""
    n, H = rows.shape
    xf = rows.float().view(n, H // 16, 16)
    amax = xf.abs().amax(dim=-1)
    sfv = gs * (amax * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    sf = sfv.to(torch.float8_e4m3fn)
    sq = sf.float()
    inv = torch.where(sq != 0, 1.0 / (sq * (1.0 / gs)), torch.zeros_like(sq))
    codes = e2m1_codes(xf * inv.unsqueeze(-1)).view(n, H)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, sf.view(torch.uint8)


def dequantize(codes, sfb, gs):
    """codes uint8 [n, H/2], scale bytes uint8 [n, H/16] -> float32 [n, H]."""
    n, H = codes.shape[0], codes.shape[1] * 2
    c = torch.stack((codes & 15, codes >> 4), dim=-1).view(n, H).long()
    v = MAG.float()[c & 7] * torch.where(c >= 8, -1.0, 1.0)
    s = sfb.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    return v * s / gs


def unswizzle(scales, El, M):
    """sgl-deep-ep's logical scales [32, 4, rm, 4, rk, El] back to rows:
    uint8 [El, rm * 128, rk * 4]."""
    rm, rk = scales.shape[2], scales.shape[4]
    phys = scales.view(torch.uint8).permute(5, 2, 4, 0, 1, 3)  # [El, rm, rk, 32, 4, 4]
    return phys.permute(0, 1, 4, 3, 2, 5).reshape(El, rm * 128, rk * 4)


def calc_diff(x, y):
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def expert_fn(e, rows):
    return (rows * (0.5 + 0.125 * (e % 13)) + 0.0625 * ((e * 7) % 11 - 5)).to(torch.bfloat16)


def one_round(buf, rank, N, E, rnd, gs, msgs, dev):
    El = E // N
    M = N * T
    x, idx, w = inputs(rank, rnd, E)
    tag = f"round {rnd}"
    xd, idd, gsd = x.to(dev), idx.to(dev), gs.to(dev)
    rb, cb, hb, _, _ = buf.low_latency_dispatch(xd, idd, T, E, use_fp8=False)
    rb, cb = rb.cpu(), cb.cpu()
    (codes, scales), cnt, h, ev, hook = buf.low_latency_dispatch(
        xd, idd, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gsd)
    if codes.device != xd.device or scales.device != xd.device:
        msgs.append(f"{tag}: outputs on {codes.device}, x on {xd.device}")
    codes, scales, cnt = codes.cpu(), scales.cpu(), cnt.cpu()
    if codes.shape != (M, H // 2, El) or codes.dtype != torch.uint8:
        msgs.append(f"{tag}: codes {tuple(codes.shape)} {codes.dtype}, want "
                    f"({M}, {H // 2}, {El}) uint8")
        return
    rm = (M + 127) // 128
    if scales.shape != (32, 4, rm, 4, H // 64, El) or scales.dtype != torch.float8_e4m3fn:
        msgs.append(f"{tag}: scales {tuple(scales.shape)} {scales.dtype}")
        return
    if codes.permute(2, 0, 1).stride() != (M * H // 2, H // 2, 1) or \
            not codes.permute(2, 0, 1).is_contiguous():
        msgs.append(f"{tag}: codes are not a view of [E_local, N*T, H/2]: strides "
                    f"{codes.stride()}")
    if not torch.equal(cnt, cb):
        msgs.append(f"{tag}: counts {cnt.tolist()} != the bf16 dispatch's {cb.tolist()}")
        return
    phys = codes.permute(2, 0, 1)
    srows = unswizzle(scales, El, M)
    for e in range(El):
        n = int(cnt[e])
        if n == 0:
            continue
        want_c, want_s = quantize(rb[e, :n], gs)
        if not torch.equal(phys[e, :n], want_c):
            bad = (phys[e, :n] != want_c).nonzero()[0].tolist()
            msgs.append(f"{tag}: expert {e} codes differ first at row {bad[0]} byte {bad[1]}")
            return
        if not torch.equal(srows[e, :n, :H // 16], want_s):
            msgs.append(f"{tag}: expert {e} scales differ")
            return
        deq = dequantize(phys[e, :n], srows[e, :n, :H // 16], gs)
        ref = rb[e, :n].float()
        d = calc_diff(deq, ref)
        if not d < 0.1:
            msgs.append(f"{tag}: expert {e}: calc_diff {d:.4f} >= 0.1")
        amax = ref.view(n, H // 16, 16).abs().amax(-1).repeat_interleave(16, dim=1)
        if not ((deq - ref).abs() <= ref.abs() * 0.25 + amax / 12 + 1e-30).all():
            msgs.append(f"{tag}: expert {e}: a channel outside NVFP4's bound")
    # combine after the NVFP4 dispatch: each expert's map of its dequantised rows
    y = torch.zeros((El, M, H), dtype=torch.bfloat16)
    for e in range(El):
        n = int(cnt[e])
        if n:
            y[e, :n] = expert_fn(e + rank * El, dequantize(phys[e, :n], srows[e, :n, :H // 16],
                                                            gs))
    out, _, _ = buf.low_latency_combine(y.to(dev), idd, w.to(dev), h)
    out = out.cpu()
    if x.shape[0]:
        qc, qs = quantize(x, gs)
        xd = dequantize(qc, qs, gs)
        ref = torch.zeros((x.shape[0], H), dtype=torch.float64)
        mag = torch.zeros_like(ref)
        for k in range(K):
            for t in range(x.shape[0]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                term = w[t, k].double() * expert_fn(e, xd[t:t + 1]).double()[0]
                ref[t] += term
                mag[t] += term.abs()
        tol = ref.abs() / 256 + 1e-5 * mag + 1e-30
        if not ((out.double() - ref).abs() <= tol).all():
            msgs.append(f"{tag}: combine after the NVFP4 dispatch differs from the reference")
    # argument errors name the argument
    for kw, name in ((dict(use_fp8=True, use_nvfp4=True, x_global_scale=gs), "use_fp8"),
                     (dict(use_fp8=False, use_nvfp4=True), "x_global_scale"),
                     (dict(use_fp8=False, x_global_scale=gs), "x_global_scale")):
        try:
            buf.low_latency_dispatch(xd, idd, T, E, **dict(
                kw, **({"x_global_scale": gsd} if "x_global_scale" in kw else {})))
            msgs.append(f"{tag}: dispatch with {sorted(kw)}: no error")
        except (ValueError, TypeError) as err:
            if name not in str(err):
                msgs.append(f"{tag}: {sorted(kw)}: {err} does not name {name}")


def rank_main(rank, N, port, q, kind="cpu"):
    msgs = []
    try:
        torch_init(rank, N, port)
        dev = torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(0)
            dev = torch.device("cuda", 0)
        from ferry import deep_ep as de
        E = 4 * N
        buf = de.Buffer(torch.distributed.group.WORLD, 0,
                        de.Buffer.get_low_latency_rdma_size_hint(T, H, N, E),
                        low_latency_mode=True, num_qps_per_rank=E // N)
        amax = torch.tensor([max(float(inputs(r, rnd, E)[0].float().abs().max())
                                 if inputs(r, rnd, E)[0].numel() else 0.0
                                 for r in range(N) for rnd in range(4))])
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MIN)
        gs = (448.0 * 6.0 / amax[0]).to(torch.float32).reshape(())  # as sgl-deep-ep's test
        for rnd in range(4):
            one_round(buf, rank, N, E, rnd, gs, msgs, dev)
    except Exception:
        msgs.append(traceback.format_exc())
    q.put((rank, msgs))


def main():
    args = sys.argv[1:]
    kind = args.pop(0) if args and args[0] in ("cpu", "cuda") else "cpu"
    N = int(args[0]) if args else 2
    import functools
    sys.exit(ranks_main(functools.partial(rank_main, kind=kind), [N],
                        f"sgl-deep-ep's NVFP4 dispatch on ferry ({kind})", gpu=kind == "cuda"))


if __name__ == "__main__":
    main()
