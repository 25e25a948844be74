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
the slowest rank's (all_reduce max). The libraries' rounds alternate (each
round runs both, the first one changing from round to round), so a drift
of the machine's speed during the run weighs on both alike.

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

Also, per call kind: the profiler's GPU kernel time per call, the call's
host time, and its host synchronisations (cudaStreamSynchronize /
cudaEventSynchronize / cudaDeviceSynchronize rows of the profiler), and a
new routing's count exchange kernel (the least over the ranks: each waits
for its peers, the one that started last least); with
--async G, the asynchronous use SGLang makes (previous_event, async_finish,
allocate_on_comm_stream, G bf16 GEMMs between the call and
event.current_stream_wait()) against each alone.

Usage: python3 tools/bench_peers_ht.py [--gpus N] [--tokens 4096[,8192...]] [--hidden 7168]
           [--experts 256] [--topk 8] [--dtype bf16|fp8] [--sms 24] [--iters 20]
           [--prof-reps 5] [--async G] [--json]
Needs DeepEP importable (deep_ep on PYTHONPATH) and ferry's library
(FERRY_LIB); python/ is added to the path here.
"""
import argparse
import json
import os
import sys
import time

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


def _sync_rows():
    return ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def run_round(buf, x, xs, idx, w, E, N, t):
    """One timed round: get_dispatch_layout + dispatch with a new routing,
    the cached dispatch, the combine, each after a barrier and a
    synchronize. Appends, per call kind (new, cached, combine), the event
    time and the host time (us) to t (None: not timed, a warmup round).
    Returns (recv_x, counts, out)."""
    st = torch.cuda.current_stream()
    arg = (x, xs) if xs is not None else x
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    torch.cuda.synchronize()
    dist.barrier()
    h0 = time.perf_counter()
    ev[0].record(st)
    pr, _, pe, inr, _ = buf.get_dispatch_layout(idx, E)
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        arg, num_tokens_per_rank=pr, is_token_in_rank=inr, num_tokens_per_expert=pe,
        topk_idx=idx, topk_weights=w, config=buf.get_dispatch_config(N))
    ev[1].record(st)
    h1 = time.perf_counter()
    torch.cuda.synchronize()
    dist.barrier()
    h2 = time.perf_counter()
    ev[2].record(st)
    rx2, *_ = buf.dispatch(arg, handle=handle, config=buf.get_dispatch_config(N))
    ev[3].record(st)
    h3 = time.perf_counter()
    y = rx2 if xs is None else dequant(rx2).to(torch.bfloat16)
    torch.cuda.synchronize()
    dist.barrier()
    h4 = time.perf_counter()
    ev[4].record(st)
    out, _, _ = buf.combine(y, handle, config=buf.get_combine_config(N))
    ev[5].record(st)
    h5 = time.perf_counter()
    torch.cuda.synchronize()
    if t is not None:
        t["new"].append(ev[0].elapsed_time(ev[1]) * 1000)
        t["cached"].append(ev[2].elapsed_time(ev[3]) * 1000)
        t["combine"].append(ev[4].elapsed_time(ev[5]) * 1000)
        t["h_new"].append((h1 - h0) * 1e6)
        t["h_cached"].append((h3 - h2) * 1e6)
        t["h_combine"].append((h5 - h4) * 1e6)
    return rx, counts, out


def run_libs(bufs, x, xs, idx, w, E, N, warmup, iters):
    """The libraries' rounds interleaved: round i runs each library once,
    in turn, the first library alternating from round to round, so that
    a drift of the machine's speed over the run (clocks, the other ranks'
    processes) falls on both alike. Returns per library the times of
    run_round and the last round's (recv_x, counts, out)."""
    ts = {name: {k: [] for k in ("new", "cached", "combine", "h_new", "h_cached",
                                 "h_combine")} for name, _ in bufs}
    res = {}
    for i in range(warmup + iters):
        for name, buf in (bufs if i % 2 == 0 else bufs[::-1]):
            res[name] = run_round(buf, x, xs, idx, w, E, N, ts[name] if i >= warmup else None)
    return ts, res


#: the kernels of a new routing that exchange the counts (each waits for
#: every peer's): ferry's route (layout and notify in one launch, or notify
#: alone) and DeepEP's notify_dispatch
_EXCHANGE_KERNELS = ("fr_cuht_route1", "fr_cuht_notify", "notify_dispatch")


def run_prof(buf, x, xs, idx, w, E, N, reps):
    """Per call kind, under the torch profiler: GPU kernel time per call
    (us, memsets and copies apart) and host synchronisations per call
    (cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize
    rows)."""
    from torch.profiler import ProfilerActivity, profile
    arg = (x, xs) if xs is not None else x
    pr, _, pe, inr, _ = buf.get_dispatch_layout(idx, E)
    _, _, _, _, handle, _ = buf.dispatch(arg, num_tokens_per_rank=pr, is_token_in_rank=inr,
                                         num_tokens_per_expert=pe, topk_idx=idx,
                                         topk_weights=w, config=buf.get_dispatch_config(N))
    rx2, *_ = buf.dispatch(arg, handle=handle, config=buf.get_dispatch_config(N))
    y = rx2 if xs is None else dequant(rx2).to(torch.bfloat16)

    def new():
        p, _, e, r, _ = buf.get_dispatch_layout(idx, E)
        buf.dispatch(arg, num_tokens_per_rank=p, is_token_in_rank=r, num_tokens_per_expert=e,
                     topk_idx=idx, topk_weights=w, config=buf.get_dispatch_config(N))

    def cached():
        buf.dispatch(arg, handle=handle, config=buf.get_dispatch_config(N))

    def comb():
        buf.combine(y, handle, config=buf.get_combine_config(N))

    out = {}
    for name, fn in (("new", new), ("cached", cached), ("combine", comb)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            # every rank's profiler started before the calls (a rank's
            # kernels would otherwise wait for a peer still starting it)
            torch.cuda.synchronize()
            dist.barrier()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        k = syncs = x = 0.0
        for e in prof.events():
            n = e.name
            if e.device_type == torch.autograd.DeviceType.CUDA:
                if "memcpy" not in n.lower() and "memset" not in n.lower():
                    k += e.time_range.elapsed_us()
                    if any(m in n for m in _EXCHANGE_KERNELS):
                        x += e.time_range.elapsed_us()
            elif n in _sync_rows():
                syncs += 1
        if name == "new":
            # negated: the ranks' values are reduced by MAX, and the one
            # wanted is the least (the rank that waited least for its peers)
            out["xneg_new"] = -x / reps
        # the two synchronize calls above are the bench's, not the calls'
        out["k_" + name] = k / reps
        out["s_" + name] = max(0.0, syncs - 2) / reps
    return out


def run_async(buf, x, xs, idx, w, E, N, iters, gemms):
    """DeepEP's asynchronous use (SGLang's prefill): previous_event =
    Buffer.capture(), async_finish and allocate_on_comm_stream, then
    `gemms` 4096x4096 bf16 GEMMs on the current stream, then
    event.current_stream_wait(); for layout + dispatch with a new routing
    and for the combine. Returns p50 us of: the GEMMs alone, each call
    alone (synchronous), each call with the GEMMs overlapped."""
    arg = (x, xs) if xs is not None else x
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def compute():
        for _ in range(gemms):
            torch.mm(a, b)

    def new(asy):
        kw = dict(previous_event=buf.capture(), async_finish=True,
                  allocate_on_comm_stream=True) if asy else {}
        p, _, e, r, ev = buf.get_dispatch_layout(idx, E, **kw)
        if asy:
            kw["previous_event"] = ev
        rx, _, _, _, h, ev = buf.dispatch(arg, num_tokens_per_rank=p, is_token_in_rank=r,
                                          num_tokens_per_expert=e, topk_idx=idx, topk_weights=w,
                                          config=buf.get_dispatch_config(N), **kw)
        return ev, (rx, h)

    _, (rx, handle) = new(False)
    y = rx if xs is None else dequant(rx).to(torch.bfloat16)

    def comb(asy):
        kw = dict(previous_event=buf.capture(), async_finish=True,
                  allocate_on_comm_stream=True) if asy else {}
        out, _, ev = buf.combine(y, handle, config=buf.get_combine_config(N), **kw)
        return ev, out

    res = {}
    st = torch.cuda.current_stream()
    cases = (("gemm", lambda: (compute(), None)),
             ("new_alone", lambda: new(False)), ("combine_alone", lambda: comb(False)),
             ("new_overlap", None), ("combine_overlap", None))
    for name, fn in cases:
        ts = []
        for i in range(2 + iters):
            torch.cuda.synchronize()
            dist.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(st)
            if name.endswith("_overlap"):
                ev, keep = (new if name.startswith("new") else comb)(True)
                compute()
                ev.current_stream_wait()
            else:
                fn()
            e1.record(st)
            torch.cuda.synchronize()
            if i >= 2:
                ts.append(e0.elapsed_time(e1) * 1000)
        res[name] = pct(ts, .5)
    return res


KINDS = ("new", "cached", "combine")


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
        E, K, H = args.experts, args.topk, args.hidden
        fp8 = args.dtype == "fp8"
        for lib in (fde, dpe):
            lib.Buffer.set_num_sms(args.sms)
        # sized for bf16 rows: the combine sends bf16 whatever the dispatch
        nvl = max(c.get_nvl_buffer_size_hint(H * 2, N) for c in (
            dpe.Buffer.get_dispatch_config(N), dpe.Buffer.get_combine_config(N)))
        dbuf = dpe.Buffer(group, nvl, 0, explicitly_destroy=True)
        fbuf = fde.Buffer(group, nvl, 0, low_latency_mode=False)
        rows = []
        for T in args.tokens:
            x, idx, w = make_inputs(rank, T, E, K, H, seed=1000003 * rank + T)
            xs = None
            xin = x
            if fp8:
                from ferry.reference import fp8_block_quant
                xin, xs = fp8_block_quant(x)
            gathered = torch.empty((N, T, K), dtype=torch.int64, device="cuda")
            dist.all_gather_into_tensor(gathered, idx, group=group)
            libs = (("ferry", fbuf), ("DeepEP", dbuf))
            ts, last = run_libs(libs, xin, xs, idx, w, E, N, args.warmup, args.iters)
            for name, buf in libs:
                t, (rx, counts, out) = ts[name], last[name]
                r = {}
                for k in KINDS:
                    r[k], r[k + "_p99"] = pct(t[k], .5), pct(t[k], .99)
                    r["h_" + k] = pct(t["h_" + k], .5)
                r.update(run_prof(buf, xin, xs, idx, w, E, N, args.prof_reps))
                if args.async_gemms:
                    r.update(run_async(buf, xin, xs, idx, w, E, N, args.iters,
                                       args.async_gemms))
                r["wrong"] = check(rank, N, E, K, H, T, rx, counts, out, x, gathered, fp8)
                rows.append((name, T, r))
        keys = sorted(rows[0][2])
        st = torch.tensor([r[k] for _, _, r in rows for k in keys], dtype=torch.float64,
                          device="cuda")
        # the slowest rank's times; #wrong summed over ranks
        wr = torch.tensor([r["wrong"] for _, _, r in rows], dtype=torch.float64, device="cuda")
        dist.all_reduce(st, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(wr, group=group)
        st = st.view(len(rows), len(keys)).tolist()
        out = []
        for i, (name, T, _) in enumerate(rows):
            r = dict(zip(keys, st[i]))
            r["wrong"] = int(wr[i])
            r["x_new"] = -r.pop("xneg_new")
            out.append((name, T, r))
        fbuf.destroy()
        dbuf.destroy()
        dist.destroy_process_group()
        q.put((rank, out))
    except Exception:
        import traceback
        q.put((rank, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--tokens", default="4096",
                    help="tokens per rank, or a comma-separated list (a sweep)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prof-reps", type=int, default=5,
                    help="calls of each kind under the profiler (kernel time, host syncs)")
    ap.add_argument("--async", dest="async_gemms", type=int, default=0, metavar="G",
                    help="also time the asynchronous use with G 4096x4096 bf16 GEMMs between "
                         "each call and its event's current_stream_wait() (0: off)")
    ap.add_argument("--json", action="store_true", help="one JSON row per (library, T)")
    args = ap.parse_args()
    try:
        args.tokens = [int(v) for v in str(args.tokens).split(",") if v.strip()]
    except ValueError:
        sys.exit(f"bench_peers_ht: --tokens {args.tokens!r}: expected integers, comma-separated")
    if args.gpus < 2:
        sys.exit("bench_peers_ht: needs at least 2 GPUs (one process per GPU)")
    if not args.tokens or args.gpus > 8 or max(args.tokens) > 32768 or min(args.tokens) < 1 \
            or args.hidden < 128:
        sys.exit("bench_peers_ht: up to 8 GPUs, 1 to 32768 tokens, hidden >= 128 (rows carry "
                 "their source in their last channels)")
    N = args.gpus
    res = spawn_ranks(rank_main, N, args, timeout=1800, join_s=60)
    rows = res[0]
    if args.json:
        for name, T, r in rows:
            print(json.dumps(dict(library=name, ranks=N, tokens=T, hidden=args.hidden,
                                  experts=args.experts, topk=args.topk, dtype=args.dtype,
                                  sms=args.sms, iters=args.iters, **r)))
        sys.exit(1 if any(r["wrong"] for _, _, r in rows) else 0)
    print(f"# EP{N} normal mode, H={args.hidden} top-{args.topk} of {args.experts}, "
          f"{args.dtype}, {args.sms} SMs each, {args.iters} iters after {args.warmup}; slowest "
          f"rank's p50 (p99) us by CUDA events; kernel: profiler kernel time per call; host: "
          f"the call's host time; syncs: host synchronisations per call")
    print("\n| T | library | layout + dispatch | dispatch (cached) | combine | kernel new / cached "
          "/ combine | host new / cached / combine | syncs new / cached / combine | #wrong |\n"
          "|---|---|---|---|---|---|---|---|---|")
    by = {}
    for name, T, r in rows:
        by[(name, T)] = r
        print(f"| {T} | {name} | {r['new']:.1f} ({r['new_p99']:.1f}) | {r['cached']:.1f} "
              f"({r['cached_p99']:.1f}) | {r['combine']:.1f} ({r['combine_p99']:.1f}) | "
              f"{r['k_new']:.1f} / {r['k_cached']:.1f} / {r['k_combine']:.1f} | "
              f"{r['h_new']:.0f} / {r['h_cached']:.0f} / {r['h_combine']:.0f} | "
              f"{r['s_new']:.1f} / {r['s_cached']:.1f} / {r['s_combine']:.1f} | {r['wrong']} |")
    print("\nferry / DeepEP, p50:")
    for T in args.tokens:
        f, d = by[("ferry", T)], by[("DeepEP", T)]
        print(f"  T={T}: layout + dispatch {f['new'] / d['new']:.2f}, cached dispatch "
              f"{f['cached'] / d['cached']:.2f}, combine {f['combine'] / d['combine']:.2f}")
    print("\ncount exchange kernel of a new routing, us per call (ferry's fr_cuht_route1 or "
          "fr_cuht_notify, DeepEP's notify_dispatch; each waits for its peers: the least over "
          "the ranks):")
    for T in args.tokens:
        print(f"  T={T}: ferry {by[('ferry', T)]['x_new']:.1f}, DeepEP "
              f"{by[('DeepEP', T)]['x_new']:.1f}")
    if args.async_gemms:
        print(f"\nasync, {args.async_gemms} GEMMs between call and wait, p50 us: saved = call "
              f"alone + GEMMs alone - the overlapped pair")
        print("\n| T | library | GEMMs | layout + dispatch alone / overlapped / saved | combine "
              "alone / overlapped / saved |\n|---|---|---|---|---|")
        for name, T, r in rows:
            sn = r["new_alone"] + r["gemm"] - r["new_overlap"]
            sc = r["combine_alone"] + r["gemm"] - r["combine_overlap"]
            print(f"| {T} | {name} | {r['gemm']:.0f} | {r['new_alone']:.0f} / "
                  f"{r['new_overlap']:.0f} / {sn:.0f} | {r['combine_alone']:.0f} / "
                  f"{r['combine_overlap']:.0f} / {sc:.0f} |")
    sys.exit(1 if any(r["wrong"] for _, _, r in rows) else 0)


if __name__ == "__main__":
    main()
