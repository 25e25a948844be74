#!/usr/bin/env python3
"""ferry's overlapped low-latency combine (sgl-deep-ep's overlap=True) against
its plain combine: how long after the GEMM's last signal the combine ends.

N ranks share the current GPU (run under MPS with the shared-gpu shim, as
tools/bench_peers_ht.py) or one rank per GPU. Per round: a bf16 dispatch of
T tokens (DeepSeek-V3 shape by default), then

  plain:      the stand-in GEMM (G kernels of --gemm-us each, one per
              local-expert group, on the compute stream), then the combine
              after it: time from the GEMM's end to the combine's end;
  overlapped: the same GEMM raising each local expert's signal as it
              finishes that expert's rows (src_signals, the Blackwell form),
              the combine launched beside it on another stream before the
              GEMM starts: time from the last signal to the combine's end.

Both outputs are checked against the plain combine of the same rows
(bit for bit: the same sums), printed as #wrong. p50 (p99) us over --iters,
the slowest rank's.

Usage: python3 tools/bench_overlap.py [--gpus N] [--tokens 128] [--hidden 7168]
           [--experts 256] [--topk 8] [--sms 8] [--gemm-us 20] [--iters 30]
Needs ferry's library (FERRY_LIB); python/ is added to the path here.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from _ranks import init_rank, pct, spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def rank_main(rank, N, port, args, q):
    init_rank(rank, N, port)
    from ferry import deep_ep
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    El = E // N
    buf = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 30, low_latency_mode=True,
                         num_qps_per_rank=El)
    # the combine's SMs (its blocks poll while the GEMM runs): the rest
    # stay free for the GEMM's kernels, as SGLang splits them
    buf.ferry_ll_sms = args.sms
    g = torch.Generator(device="cuda").manual_seed(17 + rank)
    x = (torch.randn((T, H), device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    idx = torch.topk(torch.rand((T, E), device="cuda", generator=g), K, dim=-1).indices
    w = torch.rand((T, K), device="cuda", generator=g)
    side = torch.cuda.Stream()
    cyc = int(args.gemm_us * torch.cuda.get_device_properties(0).clock_rate / 1000)
    res = {"plain": [], "overlap": []}
    wrong = 0
    for it in range(args.warmup + args.iters):
        outs = {}
        for mode in ("plain", "overlap"):
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
            y_full = recv * (1.0 + torch.arange(El, device="cuda").view(El, 1, 1) / 64)
            y_full = y_full.to(torch.bfloat16)
            y = torch.zeros_like(y_full)
            sig = torch.zeros(El, dtype=torch.uint32, device="cuda")
            torch.cuda.synchronize()
            dist.barrier()
            e_last, e_end = torch.cuda.Event(enable_timing=True), \
                torch.cuda.Event(enable_timing=True)
            cur = torch.cuda.current_stream()
            if mode == "plain":
                for e in range(El):
                    torch.cuda._sleep(cyc)
                    y[e].copy_(y_full[e])
                e_last.record(cur)
                out, _, _ = buf.low_latency_combine(y, idx, w, handle)
                e_end.record(cur)
            else:
                side.wait_stream(cur)
                with torch.cuda.stream(side):  # the combine beside the GEMM
                    out, _, hook = buf.low_latency_combine(
                        y, idx, w, handle, overlap=True, src_signals=sig,
                        src_signal_expect_value=1, return_recv_hook=True)
                for e in range(El):  # the GEMM, expert by expert
                    torch.cuda._sleep(cyc)
                    y[e].copy_(y_full[e])
                    sig[e:e + 1].fill_(1)
                e_last.record(cur)
                with torch.cuda.stream(side):
                    hook()  # the receive, on the combine's stream
                cur.wait_stream(side)
                e_end.record(cur)
            torch.cuda.synchronize()
            outs[mode] = out.clone()
            if it >= args.warmup:
                res[mode].append(e_last.elapsed_time(e_end) * 1000)
        wrong += int(not torch.equal(outs["plain"], outs["overlap"]))
    st = torch.tensor([pct(res["plain"], .5), pct(res["plain"], .99),
                       pct(res["overlap"], .5), pct(res["overlap"], .99), wrong],
                      dtype=torch.float64)
    dist.all_reduce(st, op=dist.ReduceOp.MAX)
    q.put((rank, st.tolist()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="ranks (sharing the GPUs there are)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", type=int, default=8)
    ap.add_argument("--gemm-us", type=float, default=20.0,
                    help="the stand-in GEMM's time per local expert")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    res = spawn_ranks(rank_main, args.gpus, args, timeout=900)
    r = res[0]  # spawn_ranks exits on a rank's traceback
    print(f"N={args.gpus} T={args.tokens} H={args.hidden} E={args.experts} K={args.topk} "
          f"sms={args.sms} gemm {args.gemm_us} us/expert")
    print(f"after the last signal: plain combine {r[0]:.1f} ({r[1]:.1f}) us, overlapped "
          f"{r[2]:.1f} ({r[3]:.1f}) us, ratio {r[2] / r[0]:.2f}; #wrong {int(r[4])}")
    return 0 if r[4] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
