#!/usr/bin/env python3
"""DeepEP's get_dispatch_layout, two ways on the same tensors: ferry's
ferry_dispatch_layout (two memsets and one kernel) and the same layout in
PyTorch ops (ferry.deep_ep's _layout_torch, which FERRY_DEEP_EP_LAYOUT_KERNEL=0
selects), each checked against the other, p50/p99 over back-to-back calls timed
with CUDA events.

Usage: python3 tools/bench_layout.py [--lib build-gpu/libferry.so]
       [--tokens 128,4096,16384] [--experts 256] [--topk 8] [--ranks 8]
"""
import argparse
import ctypes as C
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def timed(fn, iters):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
    return t[len(t) // 2], t[min(len(t) - 1, (len(t) * 99) // 100)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-gpu/libferry.so")
    ap.add_argument("--tokens", default="128,4096,16384")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    os.environ["FERRY_LIB"] = a.lib
    from ferry import _lib, _lib_handle
    from ferry.deep_ep import _layout_torch as torch_layout
    lib = _lib_handle()
    E, K, N = a.experts, a.topk, a.ranks
    print(f"# get_dispatch_layout, E={E} K={K} N={N}, us p50 (p99) over {a.iters} calls")
    print(f"#{'T':>6} {'ferry':>16} {'torch ops':>16} {'ratio':>6} #wrong")
    for T in [int(v) for v in a.tokens.split(",")]:
        g = torch.Generator().manual_seed(T)
        idx = torch.randint(0, E, (T, K), generator=g)
        idx[torch.rand(T, K, generator=g) < 0.05] = -1
        idx = idx.cuda()
        pr = torch.empty(N, dtype=torch.int32, device="cuda")
        pe = torch.empty(E, dtype=torch.int32, device="cuda")
        inr = torch.empty((T, N), dtype=torch.bool, device="cuda")
        st = torch.cuda.current_stream().cuda_stream
        args = _lib.LayoutArgs(C.sizeof(_lib.LayoutArgs), _lib.DEVICES["cuda"], T, K, E, N,
                               idx.data_ptr(), pr.data_ptr(), pe.data_ptr(), inr.data_ptr(), st)
        msg = C.create_string_buffer(512)

        def ferry_call():
            if lib.ferry_dispatch_layout(C.byref(args), msg, len(msg)) != 0:
                raise RuntimeError(msg.value.decode())

        ferry_call()
        ref = torch_layout(idx, E, N)
        torch.cuda.synchronize()
        wrong = int(not torch.equal(pr, ref[0])) + int(not torch.equal(pe, ref[1])) + \
            int(not torch.equal(inr, ref[2]))
        fp = timed(ferry_call, a.iters)
        tp = timed(lambda: torch_layout(idx, E, N), a.iters)
        print(f"{T:>7} {fp[0]:>8.1f} ({fp[1]:>5.1f}) {tp[0]:>8.1f} ({tp[1]:>5.1f}) "
              f"{tp[0] / fp[0]:>6.1f} {wrong}")


if __name__ == "__main__":
    main()
