#!/usr/bin/env python3
"""ferry over NVLink (one process per GPU, MPS off) against the standard
exchange through NCCL, on the same tensors in the same processes.

NCCL baseline (what engines write without an EP library): fp8 block
quantisation, all_to_all of counts, all_to_all_single of one row per
(token, expert) (fp8 bytes + scales + expert + token), lay out per expert;
combine: all_to_all_single of the expert rows back, weighted index_add_.
ferry: ferry.deep_ep low_latency_dispatch / low_latency_combine.
Checked every configuration: per-expert counts equal, combined outputs equal
within one bf16 rounding (both use expert outputs y = dequantised rows).

Usage: python3 tools/bench_nvlink.py [--gpus N] [--tokens 128] [--iters 50]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from _ranks import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from ferry.reference import fp8_block_quant as quant  # noqa: E402


def nccl_round(x, idx, w, E, N):
    T, H = x.shape
    K = idx.shape[1]
    El = E // N
    dev = x.device
    q, sc = quant(x)
    flat = idx.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    e = flat[valid]
    dest = e // El
    order = torch.argsort(dest, stable=True)
    sel = valid[order]
    tok = sel // K
    send_counts = torch.bincount(dest, minlength=N)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    rowb = H + (H // 128) * 4 + 16
    pay = torch.empty((sel.numel(), rowb), dtype=torch.uint8, device=dev)
    pay[:, :H] = q.view(torch.uint8)[tok]
    pay[:, H:H + (H // 128) * 4] = sc[tok].view(torch.uint8).view(-1, (H // 128) * 4)
    meta = torch.stack([e[order], tok], 1).to(torch.int64)
    pay[:, H + (H // 128) * 4:] = meta.view(torch.uint8).view(-1, 16)
    sc_l, rc_l = send_counts.tolist(), recv_counts.tolist()
    recv = torch.empty((sum(rc_l), rowb), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv, pay, rc_l, sc_l)
    rmeta = recv[:, H + (H // 128) * 4:].contiguous().view(torch.int64).view(-1, 2)
    le = rmeta[:, 0] % El
    lorder = torch.argsort(le, stable=True)
    counts = torch.bincount(le, minlength=El)
    rows_q = recv[lorder, :H].contiguous().view(torch.float8_e4m3fn)
    rows_s = recv[lorder, H:H + (H // 128) * 4].contiguous().view(torch.float32)
    return dict(counts=counts, rows_q=rows_q, rows_s=rows_s, lorder=lorder, sc_l=sc_l,
                rc_l=rc_l, sel=sel, T=T)


def nccl_combine(st, y_rows, w, H):
    # y_rows: expert outputs in per-expert order; undo the layout, send back
    back = torch.empty_like(y_rows)
    back[st["lorder"]] = y_rows
    ret = torch.empty((sum(st["sc_l"]), H), dtype=torch.bfloat16, device=y_rows.device)
    dist.all_to_all_single(ret, back, st["sc_l"], st["rc_l"])
    out = torch.zeros((st["T"], H), dtype=torch.float32, device=y_rows.device)
    wsel = w.reshape(-1)[st["sel"]]
    out.index_add_(0, st["sel"] // w.shape[1], ret.float() * wsel[:, None])
    return out.to(torch.bfloat16)


def timed(fn, iters):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        a.record()
        r = fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return sorted(ts), r


def rank_main(rank, N, port, args, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          FERRY_TIMEOUT_MS="30000")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=N,
                                device_id=torch.device("cuda", rank))
        from ferry import deep_ep
        E, K, H, T = args.experts, 8, 7168, args.tokens
        El = E // N
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.cuda()
        w = (0.1 + 0.9 * torch.rand(T, K, generator=g)).cuda()
        buf = deep_ep.Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True)
        buf.ferry_ll_sms = args.sms  # the low-latency kernels' SMs
        st = {}

        def f_disp():
            st["d"] = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)

        def f_comb():
            (qx, sx), cnt, handle, _, _ = st["d"]
            return buf.low_latency_combine(st["y"], idx, w, handle)[0]

        fd, fc = [], []
        for it in range(5 + args.iters):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            dist.barrier()
            torch.cuda.synchronize()
            ev[0].record()
            f_disp()
            ev[1].record()
            (qx, sx), cnt, handle, _, _ = st["d"]
            st["y"] = (qx.float() * sx.repeat_interleave(128, 2)).to(torch.bfloat16)
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            ev[2].record()
            fout = f_comb()
            ev[3].record()
            ev[3].synchronize()
            if it >= 5:
                fd.append(ev[0].elapsed_time(ev[1]) * 1000)
                fc.append(ev[2].elapsed_time(ev[3]) * 1000)
        fd.sort()
        fc.sort()
        # NCCL baseline on the same tensors
        for _ in range(3):
            nst = nccl_round(x, idx, w, E, N)
        bd, nst = timed(lambda: nccl_round(x, idx, w, E, N), args.iters)
        yb = (nst["rows_q"].float() * nst["rows_s"].repeat_interleave(128, 1)).to(torch.bfloat16)
        bc, bout = timed(lambda: nccl_combine(nst, yb, w, H), args.iters)
        wrong = int(not torch.equal(cnt.long().cpu(), nst["counts"].cpu()))
        diff = (fout.float() - bout.float()).abs()
        wrong += int((diff > bout.float().abs() / 128 + 1e-2).any(dim=1).sum())
        p = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]
        q.put((rank, (p(fd, .5), p(fd, .99), p(fc, .5), p(fc, .99), p(bd, .5), p(bc, .5), wrong)))
        buf.destroy()
        dist.destroy_process_group()
    except Exception:
        import traceback
        q.put((rank, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sms", type=int, default=32)
    args = ap.parse_args()
    N = args.gpus
    res = spawn_ranks(rank_main, N, args, timeout=300, join_s=30)
    mx = lambda i: max(v[i] for v in res.values())
    wrong = sum(v[6] for v in res.values())
    print(f"# EP{N} over NVLink, {torch.cuda.get_device_name()}, E={args.experts} K=8 H=7168 "
          f"T={args.tokens} fp8 dispatch / bf16 combine, ferry {args.sms} SMs, "
          f"slowest rank's p50, us")
    print(f"# ferry_disp p50 (p99)   ferry_comb p50 (p99)   nccl_disp   nccl_comb   speedup  #wrong")
    print(f"  {mx(0):8.1f} ({mx(1):6.1f})   {mx(2):8.1f} ({mx(3):6.1f})   {mx(4):9.1f}   {mx(5):9.1f}"
          f"   {(mx(4) + mx(5)) / (mx(0) + mx(2)):6.2f}  {wrong}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
