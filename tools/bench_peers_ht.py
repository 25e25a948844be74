#!/usr/bin/env python3
"""ferry's high-throughput mode against DeepEP's normal mode, side by side:
one process per GPU, the same tensors in the same processes, both called
through DeepEP's normal-mode API (what vLLM's deepep_high_throughput and
SGLang's normal mode call):

  ferry:  ferry.deep_ep.Buffer(group, low_latency_mode=False)
  DeepEP: deep_ep.Buffer(group, num_nvl_bytes, 0)  (intranode kernels)

  layout = buf.get_dispatch_layout(topk_idx, E)
  recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, topk_idx=...,
      topk_weights=..., num_tokens_per_rank=..., is_token_in_rank=...,
      num_tokens_per_expert=..., config=buf.get_dispatch_config(N))
  out, _, _ = buf.combine(recv_x, handle, config=buf.get_combine_config(N))

Both libraries get Buffer.set_num_sms(--sms) (DeepEP's test_intranode.py
uses 24). Timed per call with CUDA events after a barrier and a
synchronize: get_dispatch_layout + dispatch together ("dispatch", as an
engine calls them for a new routing), the cached dispatch (same handle,
"dispatch (cached)") and combine; p50 and p99 over --iters after --warmup,
the slowest rank's (all_reduce max).

Checked every configuration, for each library (#wrong):
  - received rows: their number equals the tokens routed to this rank (from
    the gathered topk_idx), and every row is one of them: x carries its
    source rank and token in its last channels (exact in bf16), and the
    rest of the row is a function of them; the multiset of (rank, token)
    equals the expected one;
  - the per-expert counts against the gathered topk_idx;
  - combine of the received rows unchanged: out[t] = x[t] * (the ranks
    token t went to), exact in bf16.
topk_idx: K distinct experts per token, Zipf-like skew, ~3% of slots -1.

Usage: python3 tools/bench_peers_ht.py [--gpus N] [--tokens 4096] [--hidden 7168]
           [--experts 256] [--topk 8] [--dtype bf16|fp8] [--sms 24] [--iters 20]
Needs DeepEP importable (deep_ep on PYTHONPATH) and ferry's library
(FERRY_LIB); python/ is added to the path here.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from _ranks import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def make_inputs(rank, T, E, K, H, seed):
    """x [T, H] bf16: the last 6 channels are the source rank and the token
    in base 8 (digits 0..7 survive fp8 quantisation and back), the rest a
    value in [-3.75, 3.75] fixed by (rank, token, channel); topk_idx with a
    Zipf-like skew and ~3% masked; weights in [0.1, 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tok = torch.arange(T, device="cuda")
    x = ((tok.view(-1, 1) * 7 + rank * 13 + torch.arange(H, device="cuda").view(1, -1)) % 61
         - 30).to(torch.bfloat16) / 8
    for j in range(5):
        x[:, H - 1 - j] = ((tok >> (3 * j)) & 7).to(torch.bfloat16)
    x[:, H - 6] = float(rank)
    p = 1.0 / torch.arange(1, E + 1, device="cuda").float() ** 0.8
    idx = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g)
    idx = idx[:, torch.randperm(K, device="cuda", generator=g)]  # experts not by rank
    idx[torch.rand(T, K, device="cuda", generator=g) < 0.03] = -1
    w = 0.1 + 0.9 * torch.rand(T, K, device="cuda", generator=g)
    return x, idx.to(torch.int64), w.float()


def dequant(recv_x):
    """float32 rows from received (fp8 [n, H], float32 scales [n, H/128])."""
    q, s = recv_x
    return (q.float().view(q.shape[0], -1, 128) * s.view(s.shape[0], -1, 1)).view(q.shape)


def pct(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def check(rank, N, E, K, H, T, recv_x, counts, out, x, gathered, fp8):
    """#wrong for one library: rows, counts, combine."""
    El = E // N
    wrong = 0
    mine = (gathered >= rank * El) & (gathered < (rank + 1) * El)  # [N, T, K]
    want_rows = mine.any(2)  # [N, T]
    rx = dequant(recv_x) if fp8 else recv_x.float()
    if rx.shape[0] != int(want_rows.sum()):
        return 1 + abs(rx.shape[0] - int(want_rows.sum()))
    if rx.shape[0]:
        src = rx[:, H - 6].round().long()
        tok = sum(rx[:, H - 1 - j].round().long() << (3 * j) for j in range(5))
        ok = (src >= 0) & (src < N) & (tok >= 0) & (tok < T)
        wrong += int((~ok).sum())
        key = (src.clamp(0, N - 1) * T + tok.clamp(0, T - 1))
        got = torch.zeros(N * T, dtype=torch.int64, device="cuda")
        got.scatter_add_(0, key, torch.ones_like(key))
        wrong += int((got != want_rows.view(-1).long()).sum())
    flat = gathered[mine]
    want_cnt = torch.bincount(flat - rank * El, minlength=El).tolist()
    if [int(c) for c in counts] != want_cnt:
        wrong += 1
    # the ranks each of this rank's tokens went to
    nr = torch.zeros(T, dtype=torch.float32, device="cuda")
    for d in range(N):
        nr += ((gathered[rank] >= d * El) & (gathered[rank] < (d + 1) * El)).any(1).float()
    if not fp8:
        ref = (x.float() * nr.view(-1, 1)).to(torch.bfloat16)
        wrong += int((out != ref).any(1).sum())
    else:  # combine of dequantised rows: within fp8 precision
        ref = x.float() * nr.view(-1, 1)
        wrong += int(((out.float() - ref).abs() > ref.abs() / 8 + 0.5).any(1).sum())
    return wrong


def run_lib(buf, x, xs, idx, w, E, N, warmup, iters):
    td, tcd, tc = [], [], []
    st = torch.cuda.current_stream()
    arg = (x, xs) if xs is not None else x
    res = None
    for i in range(warmup + iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        torch.cuda.synchronize()
        dist.barrier()
        ev[0].record(st)
        pr, _, pe, inr, _ = buf.get_dispatch_layout(idx, E)
        rx, ridx, rw, counts, handle, _ = buf.dispatch(
            arg, num_tokens_per_rank=pr, is_token_in_rank=inr, num_tokens_per_expert=pe,
            topk_idx=idx, topk_weights=w, config=buf.get_dispatch_config(N))
        ev[1].record(st)
        torch.cuda.synchronize()
        dist.barrier()
        ev[2].record(st)
        rx2, *_ = buf.dispatch(arg, handle=handle, config=buf.get_dispatch_config(N))
        ev[3].record(st)
        y = rx2 if xs is None else dequant(rx2).to(torch.bfloat16)
        torch.cuda.synchronize()
        dist.barrier()
        ev[4].record(st)
        out, _, _ = buf.combine(y, handle, config=buf.get_combine_config(N))
        ev[5].record(st)
        torch.cuda.synchronize()
        if i >= warmup:
            td.append(ev[0].elapsed_time(ev[1]) * 1000)
            tcd.append(ev[2].elapsed_time(ev[3]) * 1000)
            tc.append(ev[4].elapsed_time(ev[5]) * 1000)
        res = (rx, counts, out)
        del handle
    return td, tcd, tc, res


def rank_main(rank, N, port, args, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          FERRY_TIMEOUT_MS="30000")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=N,
                                device_id=torch.device("cuda", rank))
        group = dist.new_group(list(range(N)))
        import deep_ep as dpe
        from ferry import deep_ep as fde
        E, K, H, T = args.experts, args.topk, args.hidden, args.tokens
        fp8 = args.dtype == "fp8"
        for lib in (fde, dpe):
            lib.Buffer.set_num_sms(args.sms)
        hb = H * (1 if fp8 else 2)
        nvl = max(c.get_nvl_buffer_size_hint(hb, N) for c in (
            dpe.Buffer.get_dispatch_config(N), dpe.Buffer.get_combine_config(N)))
        dbuf = dpe.Buffer(group, nvl, 0, explicitly_destroy=True)
        fbuf = fde.Buffer(group, nvl, 0, low_latency_mode=False)
        x, idx, w = make_inputs(rank, T, E, K, H, seed=1000003 * rank + T)
        xs = None
        if fp8:
            from ferry.reference import fp8_block_quant
            xq, xs = fp8_block_quant(x)
            xin = xq
        else:
            xin = x
        gathered = torch.empty((N, T, K), dtype=torch.int64, device="cuda")
        dist.all_gather_into_tensor(gathered, idx, group=group)
        stats, wrong = [], []
        for buf in (fbuf, dbuf):
            td, tcd, tc, (rx, counts, out) = run_lib(buf, xin, xs, idx, w, E, N,
                                                     args.warmup, args.iters)
            stats += [pct(td, .5), pct(td, .99), pct(tcd, .5), pct(tcd, .99),
                      pct(tc, .5), pct(tc, .99)]
            wrong.append(check(rank, N, E, K, H, T, rx, counts, out, x, gathered, fp8))
        st = torch.tensor(stats, dtype=torch.float64, device="cuda")
        dist.all_reduce(st, op=dist.ReduceOp.MAX, group=group)
        wr = torch.tensor(wrong, dtype=torch.int64, device="cuda")
        dist.all_reduce(wr, group=group)
        fbuf.destroy()
        dbuf.destroy()
        dist.destroy_process_group()
        q.put((rank, (st.tolist(), wr.tolist())))
    except Exception:
        import traceback
        q.put((rank, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.gpus < 2:
        sys.exit("bench_peers_ht: needs at least 2 GPUs (one process per GPU)")
    if args.gpus > 8 or args.tokens > 32768 or args.hidden < 128:
        sys.exit("bench_peers_ht: up to 8 GPUs, 32768 tokens, hidden >= 128 (rows carry their "
                 "source in their last channels)")
    N = args.gpus
    res = spawn_ranks(rank_main, N, args, timeout=1800, join_s=60)
    st, wr = res[0]
    print(f"# EP{N} normal mode, T={args.tokens} H={args.hidden} top-{args.topk} of "
          f"{args.experts}, {args.dtype}, {args.sms} SMs each, {args.iters} iters after "
          f"{args.warmup}; slowest rank's p50 (p99), us")
    print("\n| library | layout + dispatch | dispatch (cached) | combine | #wrong |\n"
          "|---|---|---|---|---|")
    for name, o, wv in (("ferry", 0, wr[0]), ("DeepEP", 6, wr[1])):
        print(f"| {name} | {st[o]:.1f} ({st[o+1]:.1f}) | {st[o+2]:.1f} ({st[o+3]:.1f}) "
              f"| {st[o+4]:.1f} ({st[o+5]:.1f}) | {wv} |")
    print(f"\nferry / DeepEP, p50: layout + dispatch {st[0] / st[6]:.2f}, cached dispatch "
          f"{st[2] / st[8]:.2f}, combine {st[4] / st[10]:.2f}")
    sys.exit(1 if sum(wr) else 0)


if __name__ == "__main__":
    main()
