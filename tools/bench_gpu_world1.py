#!/usr/bin/env python3
"""One GPU, world size 1: ferry's dispatch + combine kernels against a
PyTorch-native implementation of the same job, side by side in one process,
and both against the GPU's device-to-device copy bandwidth measured in the
same run.

PyTorch-native (what a single-GPU MoE layer does today):
  dispatch: fp8 block quantisation (bf16 -> e4m3, one scale per 128
            channels), stable sort of (token, k) pairs by expert,
            index_select of the token rows into an expert-major buffer;
  combine:  weighted index_add_ of the expert rows into fp32 per token,
            then bf16.
ferry: ferry_dispatch and ferry_combine (one launch each, own tokens
written in place; --split: the four round calls, two launches each, own
tokens staged) on one stream.

Both are verified against each other every timed configuration: the rows
each expert receives (fp8 bytes and scales) must be identical, and the
combined outputs must agree within one bf16 rounding. Prints #wrong.

Usage: python3 tools/bench_gpu_world1.py [--lib build-dev/libferry.so]
       [--tokens 128,1024,4096,8192] [--iters 20] [--split]
"""
import argparse
import ctypes as C
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from ferry import _lib  # noqa: E402  (the package's ctypes view of ferry.h)
from ferry.reference import fp8_block_quant  # noqa: E402

FERRY_EP_CONFIG_MAGIC = _lib.FERRY_EP_CONFIG_MAGIC
EpConfig, Layout = _lib.EpConfig, _lib.Layout
DispatchIn, DispatchOut = _lib.DispatchIn, _lib.DispatchOut
CombineIn, CombineOut = _lib.CombineIn, _lib.CombineOut


def check(lib, rc, what, ep=None):
    if rc != 0:
        msg = lib.ferry_ep_last_error(ep).decode() if ep else ""
        raise RuntimeError(f"{what}: {lib.ferry_strerror(rc).decode()}: {msg}")


def torch_dispatch(x, idx, E):
    T, H = x.shape
    q, scale = fp8_block_quant(x)
    flat = idx.reshape(-1)
    valid = flat >= 0
    order = torch.argsort(torch.where(valid, flat, E), stable=True)
    order = order[: int(valid.sum())]
    tok = order // idx.shape[1]
    counts = torch.bincount(flat[valid], minlength=E)
    return q.index_select(0, tok), scale.index_select(0, tok), tok, order, counts


def torch_combine(y_packed, tok, order, w, T):
    out = torch.zeros(T, y_packed.shape[1], dtype=torch.float32, device=y_packed.device)
    wp = w.reshape(-1).index_select(0, order)
    out.index_add_(0, tok, y_packed.float() * wp[:, None])
    return out.to(torch.bfloat16)


def busy(seconds=1.0):
    """Keep the GPU busy so its clocks leave the idle state (345 MHz)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    import time
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    ts.sort()
    return ts[len(ts) // 2], ts[min(len(ts) - 1, int(0.99 * len(ts)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-dev/libferry.so")
    ap.add_argument("--tokens", default="128,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--split", action="store_true",
                    help="time the four round calls (two launches per operation) instead of "
                         "ferry_dispatch / ferry_combine")
    args = ap.parse_args()
    os.environ.setdefault("FERRY_RANK", "0")
    os.environ.setdefault("FERRY_WORLD_SIZE", "1")
    lib = C.CDLL(args.lib)
    lib.ferry_strerror.restype = C.c_char_p
    lib.ferry_ep_last_error.restype = C.c_char_p
    lib.ferry_comm_last_error.restype = C.c_char_p
    torch.cuda.init()
    dev = torch.device("cuda")
    E, K, H = args.experts, args.topk, args.hidden

    # device-to-device copy bandwidth, bytes read + written
    buf = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    p50, _ = timed(lambda: dst.copy_(buf), 10)
    copy_bw = 2 * buf.numel() / (p50 * 1e-6)
    del buf, dst
    torch.cuda.empty_cache()
    print(f"# device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write), {torch.cuda.get_device_name()}")
    print(f"# ferry num_sms={args.sms}; times in us, p50 (p99) over {args.iters} iterations")
    print(f"#{'T':>6} {'ferry_disp':>12} {'ferry_comb':>12} {'torch_disp':>12} {'torch_comb':>12} "
          f"{'speedup':>8} {'ferry_GB/s':>10} {'of_copy':>8} {'#wrong':>7}")
    errbuf = C.create_string_buffer(512)
    comm = C.c_void_p()
    check(lib, lib.ferry_comm_init_env(C.byref(comm), errbuf, 512), "comm")
    total_wrong = 0
    for T in [int(t) for t in args.tokens.split(",")]:
        cfg = EpConfig(C.sizeof(EpConfig), FERRY_EP_CONFIG_MAGIC, 100, E, K, H, T, 1, 1, args.sms)
        ep = C.c_void_p()
        rc = lib.ferry_ep_create(comm, C.byref(cfg), C.byref(ep))
        if rc != 0:
            raise RuntimeError(f"ep_create: {lib.ferry_comm_last_error(comm).decode()}")
        lay = Layout()
        lay.size = C.sizeof(Layout)
        check(lib, lib.ferry_ep_get_layout(ep, C.byref(lay)), "layout", ep)
        cap = lay.expert_capacity
        g = torch.Generator(device=dev)
        g.manual_seed(T)
        x = (torch.randn(T, H, device=dev, generator=g) *
             torch.exp2(torch.randint(-4, 5, (T, H // 128, 1), device=dev, generator=g).float()).repeat_interleave(128, 2).view(T, H)
             ).to(torch.bfloat16)
        scores = torch.rand(T, E, device=dev, generator=g)
        idx = scores.topk(K, dim=1).indices.to(torch.int64)
        idx[torch.rand(T, K, device=dev, generator=g) < 0.05] = -1
        w = (0.1 + 0.9 * torch.rand(T, K, device=dev, generator=g)).float()
        ex = torch.empty(lay.expert_x_bytes, dtype=torch.uint8, device=dev)
        exs = torch.empty(max(1, lay.expert_scales_bytes // 4), dtype=torch.float32, device=dev)
        cnt = torch.zeros(E, dtype=torch.int32, device=dev)
        ey = torch.empty(E * cap * H, dtype=torch.bfloat16, device=dev)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        stream = torch.cuda.current_stream().cuda_stream
        din = DispatchIn(C.sizeof(DispatchIn), T, x.data_ptr(), None, idx.data_ptr(), stream, None)
        dout = DispatchOut(C.sizeof(DispatchOut), ex.data_ptr(), exs.data_ptr(), cnt.data_ptr(), None, None, stream)
        cin = CombineIn(C.sizeof(CombineIn), ey.data_ptr(), stream)
        cout = CombineOut(C.sizeof(CombineOut), w.data_ptr(), out.data_ptr(), stream)
        state = {}

        def f_dispatch():
            r = C.c_uint64()
            if args.split:
                check(lib, lib.ferry_dispatch_send(ep, C.byref(din), C.byref(r)), "dispatch_send", ep)
                check(lib, lib.ferry_dispatch_recv(ep, r, C.byref(dout)), "dispatch_recv", ep)
            else:
                check(lib, lib.ferry_dispatch(ep, C.byref(din), C.byref(dout), C.byref(r)), "dispatch", ep)
            state["r"] = r

        def f_combine():
            r = state["r"]
            if args.split:
                check(lib, lib.ferry_combine_send(ep, r, C.byref(cin)), "combine_send", ep)
                check(lib, lib.ferry_combine_recv(ep, r, C.byref(cout)), "combine_recv", ep)
            else:
                check(lib, lib.ferry_combine(ep, r, C.byref(cin), C.byref(cout)), "combine", ep)

        def f_round_dispatch():
            f_dispatch()

        # ferry: time dispatch and combine of the same rounds
        busy()
        fd, fc = [], []
        for i in range(args.iters + 3):
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            f_dispatch()
            b.record()
            f_combine()
            c.record()
            c.synchronize()
            if i >= 3:
                fd.append(a.elapsed_time(b) * 1000)
                fc.append(b.elapsed_time(c) * 1000)
        check(lib, lib.ferry_ep_sync(ep, C.c_void_p(stream)), "sync", ep)
        fd.sort()
        fc.sort()
        pct = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
        # torch-native
        busy()
        td = timed(lambda: state.__setitem__("t", torch_dispatch(x, idx, E)), args.iters)
        q, sc, tok, order, counts = state["t"]
        y_packed = (q.float() * sc.repeat_interleave(128, 1)).to(torch.bfloat16)
        tc = timed(lambda: state.__setitem__("o", torch_combine(y_packed, tok, order, w, T)), args.iters)
        # verify: one more ferry round with expert_y = the same expert outputs
        f_dispatch()
        torch.cuda.synchronize()
        check(lib, lib.ferry_ep_sync(ep, C.c_void_p(stream)), "sync", ep)
        wrong = 0
        cnt_h = cnt.cpu()
        if not torch.equal(cnt_h.long(), counts.cpu()):
            wrong += 1
        exv = ex.view(E, cap, H)
        exsv = exs[: E * cap * (H // 128)].view(E, cap, H // 128)
        eyv = ey.view(E, cap, H)
        off = 0
        qb = q.view(torch.uint8)
        for e in range(E):
            n = int(cnt_h[e])
            if n == 0:
                continue
            if not torch.equal(exv[e, :n], qb[off:off + n]) or not torch.equal(exsv[e, :n], sc[off:off + n]):
                if wrong < 2 and os.environ.get("FERRY_BENCH_DEBUG"):
                    bad = (exv[e, :n] != qb[off:off + n]).nonzero()
                    print("expert", e, "n", n, "byte mismatches", bad.shape[0], bad[:4].tolist(),
                          "scales equal", torch.equal(exsv[e, :n], sc[off:off + n]),
                          exv[e, :n].flatten()[:8].tolist(), qb[off:off + n].flatten()[:8].tolist(),
                          exsv[e, :n].flatten()[:4].tolist(), sc[off:off + n].flatten()[:4].tolist())
                wrong += 1
            eyv[e, :n] = y_packed[off:off + n]
            off += n
        f_combine()
        torch.cuda.synchronize()
        check(lib, lib.ferry_ep_sync(ep, C.c_void_p(stream)), "sync", ep)
        ref = state["o"].float()
        diff = (out.float() - ref).abs()
        tol = ref.abs() / 128 + 1e-3
        bad_tokens = int((diff > tol).any(dim=1).sum())
        wrong += bad_tokens
        total_wrong += wrong
        P = int((idx >= 0).sum())
        moved = (T * 2 * H + P * (H + 4 * H // 128)) + (P * 2 * H + T * 2 * H)
        ferry_t = pct(fd, 0.5) + pct(fc, 0.5)
        bw = moved / (ferry_t * 1e-6)
        print(f" {T:>6} {pct(fd, .5):>7.1f}({pct(fd, .99):>4.0f}) {pct(fc, .5):>7.1f}({pct(fc, .99):>4.0f}) "
              f"{td[0]:>7.1f}({td[1]:>4.0f}) {tc[0]:>7.1f}({tc[1]:>4.0f}) "
              f"{(td[0] + tc[0]) / ferry_t:>8.2f} {bw / 1e9:>10.1f} {bw / copy_bw:>8.1%} {wrong:>7}")
        sys.stdout.flush()
        check(lib, lib.ferry_ep_destroy(ep), "destroy")
        del ex, exs, ey, out, x, idx, w, q, sc, tok, order, counts, y_packed, state
        torch.cuda.empty_cache()
    lib.ferry_comm_destroy(comm)
    if total_wrong:
        print(f"# {total_wrong} wrong", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
