#!/usr/bin/env python3
"""A real MoE layer (top-k softmax router, SwiGLU experts with random
weights) sharded across expert-parallel ranks through ferry, checked
against the same layer computed unsharded.

    python3 examples/moe_layer.py --ranks 4 --device cuda --dtype fp8

Starts its own ranks (a gloo process group for start-up; ferry moves the
tokens). Several ranks may share one GPU (start the MPS daemon first).
Exit status 0 when every rank's output matches within the tolerance.
"""
import argparse
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def layer_weights(E, H, F, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = 1.0 / H ** 0.5
    return dict(router=torch.randn(H, E, generator=g) * s,
                w1=torch.randn(E, H, F, generator=g) * s,
                w3=torch.randn(E, H, F, generator=g) * s,
                w2=torch.randn(E, F, H, generator=g) / F ** 0.5)


def route(x, router, K):
    logits = x.float() @ router
    top, idx = logits.topk(K, dim=1)
    return idx, torch.softmax(top, dim=1)


def swiglu(rows, e, W):
    h = torch.nn.functional.silu(rows @ W["w1"][e]) * (rows @ W["w3"][e])
    return h @ W["w2"][e]


def reference(x, W, K):
    idx, w = route(x, W["router"], K)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(K):
            out[t] += w[t, k] * swiglu(x[t:t + 1].float(), int(idx[t, k]), W)[0]
    return out


def rank_main(rank, world, port, args, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        import ferry
        from ferry import deep_ep
        dev = torch.device(args.device)
        E, K, H, F, T = args.experts, args.topk, args.hidden, args.ffn, args.tokens
        W = {k: v.to(dev) for k, v in layer_weights(E, H, F).items()}
        g = torch.Generator().manual_seed(100 + rank)
        x = (torch.randn(T, H, generator=g)).to(torch.bfloat16).to(dev)
        idx, w = route(x, W["router"], K)
        buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True)
        fp8 = args.dtype == "fp8"
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8)
        El = E // world
        if fp8:
            q8, sc = recv
            rows = q8.float() * sc.repeat_interleave(128, dim=2)
        else:
            rows = recv.float()
        y = torch.zeros(rows.shape, dtype=torch.bfloat16, device=dev)
        for le in range(El):
            n = int(count[le])
            if n:
                y[le, :n] = swiglu(rows[le, :n], rank * El + le, W).to(torch.bfloat16)
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ref = reference(x, W, K)
        err = (out.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        tol = (0.08 if fp8 else 0.02) * scale
        buf.destroy()
        torch.distributed.destroy_process_group()
        q.put((rank, err, scale, tol))
    except Exception:
        import traceback
        q.put((rank, traceback.format_exc(), 0, 0))



def free_port():
    """MASTER_PORT for this local job: a free loopback port with a free one
    after it (ferry's rendezvous takes MASTER_PORT + 1), below the kernel's
    ephemeral range, where no outgoing connection can take it meanwhile."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    for _ in range(64):
        p = random.randrange(10000, max(lo - 1, 10001))
        socks = [socket.socket(), socket.socket()]
        try:
            socks[0].bind(("127.0.0.1", p))
            socks[1].bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError("no free loopback port pair")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    port = free_port()
    os.environ.setdefault("FERRY_TIMEOUT_MS", "30000")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, q))
          for r in range(args.ranks)]
    for p in ps:
        p.start()
    ok = True
    for _ in range(args.ranks):
        rank, err, scale, tol = q.get(timeout=300)
        if isinstance(err, str):
            print(f"rank {rank} failed:\n{err}")
            ok = False
        else:
            good = err <= tol
            ok &= good
            print(f"rank {rank}: max |sharded - unsharded| = {err:.3e} "
                  f"(output scale {scale:.3e}, tolerance {tol:.3e}) {'ok' if good else 'TOO LARGE'}")
    for p in ps:
        p.join(30)
    print(f"moe_layer ({args.ranks} ranks, {args.device}, {args.dtype}): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
