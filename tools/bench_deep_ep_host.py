#!/usr/bin/env python3
"""Host time per low-latency round through Python, for whichever `deep_ep`
is importable: ferry's (python/compat and python on PYTHONPATH) or DeepEP's.
World 1 on one GPU, DeepSeek-V3 decode shape (T=128, H=7168, top-8 of 256),
the call pattern of DeepEP's tests/test_low_latency.py (fp8 dispatch,
cumulative_local_expert_recv_stats, combine), with and without the stats
and the receive hook: host microseconds per round (time.perf_counter around
300 rounds), split into dispatch and combine, and the round time from CUDA
events. One bf16 round is checked first (the combine of the dispatched rows
must be x times the token's valid weights) and its #wrong printed.

Usage: python3 tools/bench_deep_ep_host.py LABEL   (LABEL names the library)
"""
import os
import sys
import time

import torch
import torch.distributed as dist

T, H, E, K = 128, 7168, 256, 8
ROUNDS = 300


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "deep_ep"
    port = os.environ.get("MASTER_PORT", "8377")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    torch.cuda.set_device(0)
    import deep_ep
    group = dist.new_group([0])
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                         low_latency_mode=True, num_qps_per_rank=E)
    x = torch.randn((T, H), dtype=torch.bfloat16, device="cuda") * 0.1
    scores = torch.randn((T, E), device="cuda").abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1)[1]
    topk_w = torch.rand((T, K), device="cuda")
    stats = torch.zeros((E,), dtype=torch.int, device="cuda")
    y = torch.randn((E, T, H), dtype=torch.bfloat16, device="cuda")

    # one checked bf16 round: combine(dispatched rows) = x * sum of valid weights
    rx, _, h, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(rx, topk_idx, topk_w, h)
    want = x.float() * topk_w.masked_fill(topk_idx < 0, 0).sum(1, keepdim=True)
    err = (out.float() - want).abs().amax(1) / want.abs().amax(1).clamp_min(1e-6)
    print(f"{which} #wrong {int((err > 2e-2).sum())} of {T} tokens")

    def dispatch(hook, st):
        r = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True,
                                     cumulative_local_expert_recv_stats=stats if st else None,
                                     async_finish=False, return_recv_hook=hook)
        if hook:
            r[4]()
        return r[2]

    def combine(handle, hook):
        r = buf.low_latency_combine(y, topk_idx, topk_w, handle, return_recv_hook=hook)
        if hook:
            r[2]()

    def rnd(hook=False, st=True):
        combine(dispatch(hook, st), hook)

    for _ in range(100):
        rnd()
    torch.cuda.synchronize()
    for st in (True, False):
        for hook in (False, True):
            t0 = time.perf_counter()
            for _ in range(ROUNDS):
                rnd(hook, st)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            td = tc = 0.0
            for _ in range(ROUNDS):
                a = time.perf_counter()
                handle = dispatch(hook, st)
                b = time.perf_counter()
                combine(handle, hook)
                td, tc = td + b - a, tc + time.perf_counter() - b
            torch.cuda.synchronize()
            us = 1e6 / ROUNDS
            print(f"{which} stats={st} hook={hook}: host per round {(t1 - t0) * us:.1f} us "
                  f"(incl. drain {(t2 - t0) * us:.1f}); dispatch {td * us:.1f} "
                  f"combine {tc * us:.1f}")
    # rounds timed with CUDA events, back to back (DeepEP's bench())
    n = 50
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]
    for s, e in ev:
        s.record()
        rnd()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
    print(f"{which} round events p50 {ts[n // 2]:.1f} us min {ts[0]:.1f}")
    if getattr(deep_ep, "backend", None) == "ferry":
        buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
