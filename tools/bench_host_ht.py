#!/usr/bin/env python3
"""Where a normal-mode call's host time goes: ferry's deep_ep.Buffer
get_dispatch_layout + dispatch (new routing) + combine, piece by piece,
and DeepEP's calls whole beside it when its deep_ep is importable.

N ranks (one per GPU, or sharing one GPU under MPS with the shared-gpu
shim, as tools/bench_peers_ht.py). Each round runs after a synchronize and
a barrier; the pieces are timed on the host (time.perf_counter_ns) by
wrapping ferry's Python functions and its library calls (the library's own
share in parentheses):

  layout      get_dispatch_layout (ferry_dispatch_layout)
  pre         dispatch's Python before the route
  route       the route: notify and the one wait (ferry_route_create)
  outputs     the dispatch's outputs and launch (ferry_ht_dispatch)
  dispatch    the whole dispatch call
  combine     the whole combine call (ferry_ht_combine)
  gpu         from combine's return to the end of a synchronize

With ferry._torchext built (make pyext) the library is called from C++
and its share is not separated, and a new routing's route and outputs
are one call (route holds both, outputs shows -; after the first round
pre is all of dispatch's Python before it, argument checks included,
which ferry._torchext makes); FERRY_TORCH_EXT=0
times the Python path, with the library's share. p50 over --iters rounds per rank, each rank's row printed. Each round's
result is checked (the combine of the received rows unchanged is x times
the number of ranks the token went to: #wrong).

Usage: python3 tools/bench_host_ht.py [--gpus 2] [--tokens 128,512,4096] [--iters 30]
           [--device cuda|cpu] [--rounds barrier|tight] [--async]
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

P = time.perf_counter_ns
PIECES = ("layout", "pre", "route", "outputs", "dispatch", "combine", "gpu")
LIB = {"layout": "ferry_dispatch_layout", "route": "ferry_route_create",
       "outputs": "ferry_ht_dispatch", "combine": "ferry_ht_combine"}


def wrap_ferry(rec):
    """Record (start, end) of ferry's pieces and library calls into rec."""
    from ferry import _core, _deep_ep_common, _deep_ep_normal, _ep

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def g(*a, **k):
            t = P()
            r = f(*a, **k)
            rec.setdefault(key, []).append((t, P()))
            return r
        setattr(obj, name, g)
    wrap(_ep.EP, "_route_run", "route")
    wrap(_ep.EP, "_ht_dispatch_run", "outputs")
    ext = _core._torchext()
    if ext is not None:  # its calls that make a route and its dispatch at once
        class Ext:
            def __getattr__(self, n):
                f = getattr(ext, n)
                if n not in ("route_dispatch", "new_plain"):
                    return f

                def g(*a):
                    t = P()
                    r = f(*a)
                    rec.setdefault("route+outputs", []).append((t, P()))
                    return r
                return g
        _core._EXT = Ext()
    real = _core._lib_handle()

    class Lib:  # the library, its calls timed
        def __getattr__(self, n):
            f = getattr(real, n)
            if not n.startswith("ferry_"):
                return f

            def g(*a):
                t = P()
                r = f(*a)
                rec.setdefault(n, []).append((t, P()))
                return r
            return g
    lib = Lib()
    for m in (_ep, _deep_ep_common):
        m._lib_handle = lambda: lib
    return _deep_ep_normal


def rank_main(rank, N, port, args, q):
    cuda = args.device == "cuda"
    if cuda:
        init_rank(rank, N, port)
    else:  # CPU tensors (ferry alone): a check that the tool runs
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=N)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = {}
    wrap_ferry(rec)
    from ferry import deep_ep as fde
    libs = [("ferry", fde)]
    try:
        import deep_ep as dpe
        if cuda and dpe.Buffer is not fde.Buffer:  # a real DeepEP, not ferry's compat
            libs.append(("DeepEP", dpe))
    except ImportError:
        pass
    E, K, H = args.experts, args.topk, args.hidden
    group = dist.new_group(list(range(N)))
    bufs = []
    for name, lib in libs:
        lib.Buffer.set_num_sms(args.sms)
        bufs.append((name, lib.Buffer(group, int(1e9), 0, explicitly_destroy=True)
                     if name == "DeepEP" else lib.Buffer(group, int(1e9), 0)))
    out = []
    for T in args.tokens:
        g = torch.Generator(device=dev).manual_seed(7 + rank)
        x = (torch.randn((T, H), device=dev, generator=g) * 0.25).to(torch.bfloat16)
        idxs = [torch.topk(torch.rand((T, E), device=dev, generator=g), K,
                           dim=-1).indices.to(torch.int64) for _ in range(4)]
        w = torch.rand((T, K), device=dev, generator=g)
        for name, buf in bufs:
            rows, bad = [], 0
            for i in range(args.warmup + args.iters):
                idx = idxs[i % 4]
                if args.rounds == "barrier":
                    sync()
                    dist.barrier(group)
                rec.clear()
                kw = {}
                if args.asyn:  # SGLang's: after an event, on the comm stream, async
                    kw = dict(async_finish=True, allocate_on_comm_stream=True)
                t0 = P()
                if args.asyn and cuda:
                    kw["previous_event"] = buf.capture()
                pr, _, pe, inr, ev = buf.get_dispatch_layout(idx, E, **kw)
                t1 = P()
                if args.asyn and cuda:
                    kw["previous_event"] = ev
                r = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=inr,
                                 num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w,
                                 expert_alignment=128 if args.asyn else 1, **kw)
                t2 = P()
                if args.asyn:  # (DeepEP's event of a plain call is empty: no wait)
                    r[-1].current_stream_wait()
                if args.asyn and cuda:
                    kw["previous_event"] = buf.capture()
                o, _, ev = buf.combine(r[0], r[4], **kw)
                t3 = P()
                if args.asyn:
                    ev.current_stream_wait()
                sync()
                t4 = P()
                if i < args.warmup:
                    continue
                nr = torch.zeros((T, N), dtype=torch.bool, device=dev)
                nr.scatter_(1, idx // (E // N), True)
                want = x.float() * nr.sum(1, keepdim=True).float()
                bad += int(((o.float() - want).abs() > want.abs() / 128 + 1e-6)
                           .any(1).sum())
                d = {"layout": t1 - t0, "dispatch": t2 - t1, "combine": t3 - t2,
                     "gpu": t4 - t3}
                if name == "ferry" and "route" in rec:
                    (a, b), = rec["route"]
                    (c, e), = rec["outputs"]
                    d.update(pre=a - t1, route=b - a, outputs=e - c)
                elif name == "ferry":  # one call of ferry._torchext: route holds both
                    (a, b), = rec["route+outputs"]
                    d.update(pre=a - t1, route=b - a)
                    for k, f in LIB.items():
                        if f in rec:  # through ctypes (not ferry._torchext)
                            d["lib_" + k] = sum(v - u for u, v in rec[f])
                rows.append(d)
            med = {k: pct([r[k] for r in rows], .5) / 1e3 for k in rows[0]}
            out.append((name, T, med, bad))
    for _, buf in bufs:
        buf.destroy()
    q.put((rank, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape_args(ap, "128,512,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: CPU tensors, ferry alone (a check that the tool runs)")
    ap.add_argument("--rounds", choices=("barrier", "tight"), default="barrier",
                    help="barrier: a synchronize and a barrier before each round; tight: "
                    "rounds back to back (a synchronize at the end of each)")
    ap.add_argument("--async", dest="asyn", action="store_true",
                    help="the calls as SGLang makes them: previous_event=Buffer.capture(), "
                    "async_finish, allocate_on_comm_stream, expert_alignment=128, then "
                    "event.current_stream_wait() (outside the timings)")
    args = ap.parse_args()
    if args.device == "cuda" and args.gpus < 2:
        sys.exit("bench_host_ht: needs at least 2 ranks (DeepEP's normal mode refuses 1)")
    res = spawn_ranks(rank_main, args.gpus, args, timeout=900)
    print(f"# N={args.gpus} H={args.hidden} top-{args.topk} of {args.experts}, bf16, "
          f"{args.sms} SMs, {args.rounds} rounds{', async calls' if args.asyn else ''}; host "
          f"us, p50 of {args.iters} rounds (library call in parentheses)")
    print("| rank | T | library | " + " | ".join(PIECES) + " | #wrong |")
    print("|---" * (len(PIECES) + 4) + "|")
    bad = 0
    for rank in sorted(res):
        for name, T, m, b in res[rank]:
            bad += b
            cells = []
            for k in PIECES:
                if k not in m:
                    cells.append("-")
                    continue
                lib = m.get("lib_" + k)
                cells.append(f"{m[k]:.0f}" + (f" ({lib:.0f})" if lib is not None else ""))
            print(f"| {rank} | {T} | {name} | " + " | ".join(cells) + f" | {b} |")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
