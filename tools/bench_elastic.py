#!/usr/bin/env python3
"""deep_ep.ElasticBuffer (DeepEP 2's API) on ferry against ferry's own
normal mode (deep_ep.Buffer) for the same work, in the same processes, and
ElasticBuffer's dispatch + combine time by num_sms.

N ranks (one per GPU, or sharing one GPU under MPS with the shared-gpu
shim, as tools/bench_peers_ht.py). Per T:
  - Buffer: get_dispatch_layout + dispatch (new routing) + combine;
  - ElasticBuffer: dispatch (new routing, do_cpu_sync) + combine;
  each timed with CUDA events around the calls after a barrier and a
  synchronize, p50 (p99) over --iters, the slowest rank's, the two
  alternating round by round (so that a drift of the machine's speed
  falls on both alike); then ElasticBuffer at each of --sms-curve (a
  buffer per SM count: a context keeps its SMs), the counts' rounds
  interleaved the same way. Also each round's host time (its Python
  calls timed on the host, p50, the slowest rank's), Buffer's against
  ElasticBuffer's at --sms: where the GPU waits for the host between
  kernels, this is where it shows.
Checked every call (#wrong): the combine of the received rows unchanged
returns x times the number of ranks the token went to (within bf16
rounding of that product).

Usage: python3 tools/bench_elastic.py [--gpus N] [--tokens 512,4096] [--hidden 7168]
           [--experts 256] [--topk 8] [--sms 24] [--sms-curve 4,6,8,12,24] [--iters 10]
Needs ferry's library (FERRY_LIB); python/ is added to the path here.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from _ranks import init_rank, pct, shape_args, spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def rank_main(rank, N, port, args, q):
    init_rank(rank, N, port)
    from ferry import deep_ep
    H, E, K = args.hidden, args.experts, args.topk
    g = torch.Generator(device="cuda").manual_seed(5 + rank)
    out = []
    for T in args.tokens:
        x = (torch.randn((T, H), device="cuda", generator=g) * 0.25).to(torch.bfloat16)
        idx = torch.topk(torch.rand((T, E), device="cuda", generator=g), K,
                         dim=-1).indices.to(torch.int64)
        w = torch.rand((T, K), device="cuda", generator=g)
        nr = torch.zeros((T, N), dtype=torch.bool, device="cuda")
        nr.scatter_(1, idx // (E // N), True)
        want = (x.float() * nr.sum(1, keepdim=True).float())

        def wrong(o):
            d = (o.float() - want).abs()
            return int((d > want.abs() / 128 + 1e-6).any(1).sum())

        def one(fn, ts, bad, hs):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            e0.record()
            h0 = time.perf_counter()
            o = fn()
            h1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            if ts is not None:
                ts.append(e0.elapsed_time(e1) * 1000)
                hs.append((h1 - h0) * 1e6)
                bad.append(wrong(o))

        def timed(fns, iters):
            """The rounds of fns interleaved: each round runs every fn once,
            starting one further along the list each round, so that a drift
            of the machine's speed falls on all alike."""
            ts, bad, hs = [[] for _ in fns], [[] for _ in fns], [[] for _ in fns]
            for it in range(args.warmup + iters):
                for j in range(len(fns)):
                    k = (j + it) % len(fns)
                    one(fns[k], ts[k] if it >= args.warmup else None, bad[k], hs[k])
            return ts, [sum(b) for b in bad], hs

        deep_ep.Buffer.set_num_sms(args.sms)
        v1 = deep_ep.Buffer(dist.group.WORLD, 1 << 30, 0)

        def v1_round():
            pr, _, pe, inr, _ = v1.get_dispatch_layout(idx, E)
            rx, _, _, _, h, _ = v1.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=inr,
                                            num_tokens_per_expert=pe, topk_idx=idx,
                                            topk_weights=w)
            return v1.combine(rx, h)[0]

        def v2_round(buf, sms):
            def f():
                rx, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                              num_experts=E, num_sms=sms)
                return buf.combine(rx, h)[0]
            return f

        # one ElasticBuffer per SM count (a context keeps its SMs); the one
        # of --sms is compared with Buffer
        sms_all = list(dict.fromkeys([args.sms] + args.sms_curve))
        v2s = {sms: deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H,
                                          num_topk=K, explicitly_destroy=True)
               for sms in sms_all}
        (t1, t2), (b1, b2), (h1, h2) = timed([v1_round, v2_round(v2s[args.sms], args.sms)],
                                             args.iters)
        row = [T, pct(t1, .5), pct(t1, .99), pct(t2, .5), pct(t2, .99), b1 + b2,
               pct(h1, .5), pct(h2, .5)]
        curve, cbad, _ = timed([v2_round(v2s[sms], sms) for sms in args.sms_curve], args.iters)
        for ts, bad in zip(curve, cbad):
            row += [pct(ts, .5), bad]
        for b in v2s.values():
            b.destroy()
        v1.destroy()
        st = torch.tensor(row, dtype=torch.float64)
        dist.all_reduce(st, op=dist.ReduceOp.MAX)
        out.append(st.tolist())
    q.put((rank, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap, "512,4096")
    ap.add_argument("--sms-curve", default="4,6,8,12,24",
                    type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    res = spawn_ranks(rank_main, args.gpus, args, timeout=900)
    rows = res[0]  # spawn_ranks exits on a rank's traceback
    print(f"# N={args.gpus} H={args.hidden} top-{args.topk} of {args.experts}, bf16, "
          f"{args.sms} SMs; p50 (p99) us, slowest rank; dispatch (new routing) + combine")
    print("# host: the round's Python calls (dispatch + combine, with Buffer's "
          "get_dispatch_layout) timed on the host, p50 us, the slowest rank's")
    print("| T | Buffer | ElasticBuffer | ratio | host Buffer / Elastic | " +
          " | ".join(f"Elastic {s} SMs" for s in args.sms_curve) + " | #wrong |")
    print("|---" * (6 + len(args.sms_curve)) + "|")
    bad = 0
    for r in rows:
        curve = r[8::2]
        nbad = int(r[5]) + int(sum(r[9::2]))
        bad += nbad
        print(f"| {int(r[0])} | {r[1]:.1f} ({r[2]:.1f}) | {r[3]:.1f} ({r[4]:.1f}) | "
              f"{r[3] / r[1]:.2f} | {r[6]:.1f} / {r[7]:.1f} | " +
              " | ".join(f"{c:.1f}" for c in curve) + f" | {nbad} |")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
