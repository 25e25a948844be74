#!/usr/bin/env python3
"""ferry against DeepEP's low-latency mode, side by side: one process per
GPU, the same tensors in the same processes, both called the way engines
call them (deep_ep.Buffer low_latency_dispatch / low_latency_combine):

  ferry:  ferry.deep_ep.Buffer(group, 0, hint, low_latency_mode=True)
  DeepEP: deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=hint,
                         low_latency_mode=True, num_qps_per_rank=E/N)

fp8 dispatch, bf16 combine. Dispatch and combine are timed separately with
CUDA events around each Python call (a barrier and a synchronize before
each), p50 and p99 over --iters after --warmup; every number is the slowest
rank's (all_reduce max). Both libraries get the same num_max_dispatch_
tokens_per_rank per shape: the largest T of the run for that shape (rounded
up to a multiple of 4, which DeepEP's TMA layout needs), and T tokens each
call.

Checked every configuration, for each library separately (#wrong):
  - per-local-expert received counts against the counts of the gathered
    topk_idx (so ferry's and DeepEP's counts are also equal to each other);
  - the combined output against a reference computed in PyTorch from x:
    q, s = ferry.reference.fp8_block_quant(x), expert e's output
    f_e(v) = bf16(float(q) * s * (1 + e/64)), out[t] = sum_k w[t,k] f_e(x_t)
    over the unmasked slots. Each library's received rows go through the
    same f_e (its own fp8 rows and scales) into its own combine. A token is
    wrong when any channel has |out - ref| > |ref|/64 + 1e-2 (or is NaN).
topk_idx: K distinct experts per token drawn with a Zipf-like skew, about
3% of the slots -1, and (T >= 32) one token with every slot -1;
topk_weights in [0.1, 1), not normalised.

Needs DeepEP importable (deep_ep on PYTHONPATH), ferry's library
(FERRY_LIB) and python/ on the path (added here).

With --graph R, each configuration is also run the way engines run decode:
rounds (dispatch, then combine of a fixed expert output) captured as one
CUDA graph of 10 rounds per library and replayed R times back to back, an
event only between replays; time per round, p50 (p99) over the replays.

With --b2b R, each configuration is also run the way DeepEP's own
tests/test_low_latency.py times it: R rounds (dispatch, then combine of a
fixed expert output) called back to back from Python with no barrier or
synchronize between them, (a) CUDA events around every call, and (b) the
kernel time of each operation from the PyTorch profiler (CUDA kernels whose
name holds "dispatch" or "combine", summed per round; any other kernel
launched by the calls is reported as "other"); p50 (p99) per operation.

With --logfmt, both libraries combine in DeepEP's LogFMT (use_logfmt=True);
the combine check then allows each term its 2.17% (the format's bound).

--gpus 1 runs a world of one rank (both libraries accept it): every token
stays on the GPU, so it measures the kernels and the calls with no link in
between, which is what a one-GPU machine can compare.

Usage: python3 tools/bench_peers.py [--gpus N] [--shapes DeepSeek-V3,Qwen3-235B,Kimi-K2]
                                    [--tokens 1,32,128,256,512] [--iters 50] [--graph R]
                                    [--b2b R] [--logfmt]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from _ranks import spawn_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from ferry.reference import fp8_block_quant as quant  # noqa: E402

# name: (experts, top-k, hidden)
SHAPES = {
    "DeepSeek-V3": (256, 8, 7168),
    "Qwen3-235B": (128, 8, 4096),
    "Kimi-K2": (384, 8, 7168),
}
ALIASES = {"dsv3": "DeepSeek-V3", "deepseek": "DeepSeek-V3", "qwen3": "Qwen3-235B",
           "qwen": "Qwen3-235B", "kimi": "Kimi-K2", "k2": "Kimi-K2"}


def shape_name(s):
    for n in SHAPES:
        if n.lower() == s.lower():
            return n
    if s.lower() in ALIASES:
        return ALIASES[s.lower()]
    raise argparse.ArgumentTypeError(f"unknown shape {s!r} (one of {', '.join(SHAPES)})")


def make_inputs(T, E, K, H, seed):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct, skewed, some -1),
    topk_weights [T, K] float32, all on the current GPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    # Zipf-like popularity over a random permutation of the experts
    pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64).pow(0.6)
    pop = pop[torch.randperm(E, generator=g)]
    idx = torch.multinomial(pop.expand(T, E).contiguous(), K, replacement=False, generator=g)
    idx[torch.rand(T, K, generator=g) < 0.03] = -1
    if T >= 32:
        idx[T // 2] = -1
    w = 0.1 + 0.9 * torch.rand(T, K, generator=g, dtype=torch.float32)
    return x.cuda(), idx.to(torch.int64).contiguous().cuda(), w.contiguous().cuda()


def expert_out(recv_q, recv_s, cnt, first_expert):
    """The experts' outputs for one library's received rows: row r of local
    expert e (r < cnt[e]) becomes bf16(float(q) * scale * (1 + g/64)), g the
    global expert id; rows past the counts are zero."""
    El, R, H = recv_q.shape
    mask = torch.arange(R, device=recv_q.device)[None, :] < cnt.to(torch.int64)[:, None]
    ei, ri = mask.nonzero(as_tuple=True)
    q = recv_q.view(torch.uint8)[ei, ri].view(torch.float8_e4m3fn).float()
    s = recv_s[ei, ri].float()  # DeepEP's scales are column-major: index, don't view
    c = 1.0 + (first_expert + ei).float() / 64.0
    rows = (q * s.repeat_interleave(128, 1)) * c[:, None]
    y = torch.zeros((El, R, H), dtype=torch.bfloat16, device=recv_q.device)
    y[ei, ri] = rows.to(torch.bfloat16)
    return y


#: --logfmt: combines in DeepEP's LogFMT (use_logfmt=True), both libraries
LOGFMT = [False]


def reference(x, idx, w):
    """(out, mag): the combined rows and the sums of the magnitudes of
    their terms (LogFMT's error is relative to each term)."""
    q, s = quant(x)
    dq = q.float() * s.repeat_interleave(128, 1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    mag = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        g = idx[:, k]
        c = 1.0 + g.clamp(min=0).float() / 64.0
        yk = (dq * c[:, None]).to(torch.bfloat16).float()
        out += (w[:, k] * (g >= 0).float())[:, None] * yk
        mag += (w[:, k] * (g >= 0).float())[:, None] * yk.abs()
    return out, mag


def n_wrong_tokens(out, ref):
    ref, mag = ref
    diff = (out.float() - ref).abs()
    # LogFMT: each term within 2.17% (DeepEP's 10-bit codes over 32 octaves)
    tol = ref.abs() / 64 + 1e-2 + (0.022 * mag if LOGFMT[0] else 0)
    ok = diff <= tol  # NaN compares False: counted wrong
    return int((~ok).any(dim=1).sum())


def pct(v, f):
    return v[min(len(v) - 1, int(f * len(v)))]


def run_lib(buf, x, idx, w, maxT, E, El, rank, warmup, iters):
    """Times one library; returns (dispatch times, combine times, count, out)
    of the last iteration (sorted times, us)."""
    fd, fc = [], []
    for it in range(warmup + iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        ev[0].record()
        (rq, rs), cnt, handle, _, _ = buf.low_latency_dispatch(
            x, idx, maxT, E, use_fp8=True, async_finish=False, return_recv_hook=False)
        ev[1].record()
        y = expert_out(rq, rs, cnt, rank * El)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        ev[2].record()
        out, _, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=LOGFMT[0])
        ev[3].record()
        ev[3].synchronize()
        if it >= warmup:
            fd.append(ev[0].elapsed_time(ev[1]) * 1000)
            fc.append(ev[2].elapsed_time(ev[3]) * 1000)
    return sorted(fd), sorted(fc), cnt.clone(), out.clone()


def run_graph(buf, x, idx, w, maxT, E, reps, G=10):
    """Rounds (dispatch, then combine of a fixed expert output: no expert
    work) captured as one CUDA graph of G rounds and replayed back to back,
    as engines run decode; an event between replays only. Returns the
    sorted times per round (us)."""
    (rq, _), _, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True)
    y = torch.full(rq.shape, 0.5, dtype=torch.bfloat16, device=x.device)
    buf.low_latency_combine(y, idx, w, handle)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(G):
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True)
            buf.low_latency_combine(y, idx, w, handle)
    torch.cuda.synchronize()
    dist.barrier()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    g.replay()  # warm-up
    for i in range(reps):
        ev[i].record()
        g.replay()
    ev[reps].record()
    torch.cuda.synchronize()
    t = sorted(ev[i].elapsed_time(ev[i + 1]) * 1000 / G for i in range(reps))
    dist.barrier()
    del g
    return t


def run_b2b(buf, x, idx, w, maxT, E, reps):
    """R rounds called back to back (no barrier, no synchronize between
    calls). Returns sorted per-call event times (dispatch, combine) and
    sorted per-round profiler kernel times (dispatch, combine, other), us."""
    from torch.profiler import ProfilerActivity, profile
    (rq, _), _, handle, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True)
    y = torch.full(rq.shape, 0.5, dtype=torch.bfloat16, device=x.device)
    buf.low_latency_combine(y, idx, w, handle)

    def rounds(n, ev=None):
        for i in range(n):
            if ev:
                ev[2 * i].record()
            _, _, h, _, _ = buf.low_latency_dispatch(x, idx, maxT, E, use_fp8=True)
            if ev:
                ev[2 * i + 1].record()
            buf.low_latency_combine(y, idx, w, h)
        if ev:
            ev[2 * n].record()

    rounds(5)
    torch.cuda.synchronize()
    dist.barrier()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps + 1)]
    rounds(reps, ev)
    torch.cuda.synchronize()
    td = sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) * 1000 for i in range(reps))
    tc = sorted(ev[2 * i + 1].elapsed_time(ev[2 * i + 2]) * 1000 for i in range(reps))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rounds(reps)
        torch.cuda.synchronize()
    kd, kc, ko = 0.0, 0.0, 0.0
    nd = nc = 0
    kds, kcs = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        n = e.name.lower()
        t = e.time_range.elapsed_us()
        if "dispatch" in n:
            kds.append((e.time_range.start, t))
        elif "combine" in n:
            kcs.append((e.time_range.start, t))
        elif "memcpy" not in n and "memset" not in n:
            ko += t
    # a round's kernels of one operation: consecutive in time, one or two
    # kernels (send and receive) per operation; group them into reps rounds
    kds.sort()
    kcs.sort()
    per = max(1, len(kds) // reps)
    kd = sorted(sum(t for _, t in kds[i * per:(i + 1) * per]) for i in range(len(kds) // per))
    per = max(1, len(kcs) // reps)
    kc = sorted(sum(t for _, t in kcs[i * per:(i + 1) * per]) for i in range(len(kcs) // per))
    dist.barrier()
    return td, tc, kd or [float("nan")], kc or [float("nan")], ko / reps


def rank_main(rank, N, port, args, q):
    LOGFMT[0] = bool(args.logfmt)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          FERRY_TIMEOUT_MS="30000")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=N,
                                device_id=torch.device("cuda", rank))
        group = dist.new_group(list(range(N)))
        import deep_ep as dpe
        from ferry import deep_ep as fde

        plan = [(s, SHAPES[s]) for s in args.shapes]
        maxT = -(-max(args.tokens) // 4) * 4
        fhint = max(fde.Buffer.get_low_latency_rdma_size_hint(maxT, H, N, E) for _, (E, K, H) in plan)
        dhint = max(dpe.Buffer.get_low_latency_rdma_size_hint(maxT, H, N, E) for _, (E, K, H) in plan)
        qps = max(E // N for _, (E, K, H) in plan)
        fbuf = fde.Buffer(group, 0, fhint, low_latency_mode=True, num_qps_per_rank=qps)
        if args.sms:
            fbuf.ferry_ll_sms = args.sms  # the low-latency kernels' SMs
        dbuf = dpe.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=dhint, low_latency_mode=True,
                          num_qps_per_rank=qps, explicitly_destroy=True)
        if rank == 0:
            print(f"# EP{N} over NVLink, {torch.cuda.get_device_name()}, fp8 dispatch / bf16 combine, "
                  f"ferry {args.sms or 'default'} SMs, DeepEP LL ({os.path.dirname(dpe.__file__)}), "
                  f"{args.iters} iters after {args.warmup}; slowest rank's p50 (p99), us; "
                  f"ratio = ferry / DeepEP, p50", flush=True)
            print("# shape        T  maxT   ferry_disp      ferry_comb      deepep_disp     "
                  "deepep_comb     ratio d/c/round    #wrong f/d", flush=True)
        rows = []
        for si, (name, (E, K, H)) in enumerate(plan):
            El = E // N
            # the previous shape's layout left DeepEP's signal words elsewhere
            dbuf.clean_low_latency_buffer(maxT, H, E)
            torch.cuda.synchronize()
            dist.barrier()
            for T in args.tokens:
                x, idx, w = make_inputs(T, E, K, H, seed=1000003 * rank + 1009 * si + T)
                gathered = torch.empty((N, T, K), dtype=torch.int64, device="cuda")
                dist.all_gather_into_tensor(gathered, idx, group=group)
                flat = gathered.reshape(-1)
                want = torch.bincount(flat[flat >= 0], minlength=E)[rank * El:(rank + 1) * El]
                ref = reference(x, idx, w)
                stats, wrong = [], []
                for buf in (fbuf, dbuf):
                    td, tc, cnt, out = run_lib(buf, x, idx, w, maxT, E, El, rank,
                                               args.warmup, args.iters)
                    stats += [pct(td, .5), pct(td, .99), pct(tc, .5), pct(tc, .99)]
                    wrong.append(int((cnt.to(torch.int64) != want).sum()) + n_wrong_tokens(out, ref))
                st = torch.tensor(stats, dtype=torch.float64, device="cuda")
                dist.all_reduce(st, op=dist.ReduceOp.MAX, group=group)
                wr = torch.tensor(wrong, dtype=torch.int64, device="cuda")
                dist.all_reduce(wr, op=dist.ReduceOp.SUM, group=group)
                s = st.tolist()
                wf, wd = wr.tolist()
                r = (name, T, maxT, *s, s[0] / s[4], s[2] / s[6], (s[0] + s[2]) / (s[4] + s[6]), wf, wd)
                if args.graph:
                    gs = []
                    for buf in (fbuf, dbuf):
                        try:
                            t = run_graph(buf, x, idx, w, maxT, E, args.graph)
                        except Exception as e:  # noqa: BLE001 (reported, the run goes on)
                            print(f"rank {rank}: graph run failed: {e}", flush=True)
                            t = [float("nan")]
                        gs += [pct(t, .5), pct(t, .99)]
                    gt = torch.tensor(gs, dtype=torch.float64, device="cuda")
                    dist.all_reduce(gt, op=dist.ReduceOp.MAX, group=group)
                    r = r + tuple(gt.tolist())
                if args.b2b:
                    bs = []
                    for buf in (fbuf, dbuf):
                        td, tc, kd, kc, ko = run_b2b(buf, x, idx, w, maxT, E, args.b2b)
                        bs += [pct(td, .5), pct(td, .99), pct(tc, .5), pct(tc, .99),
                               pct(kd, .5), pct(kd, .99), pct(kc, .5), pct(kc, .99), ko]
                    bt = torch.tensor(bs, dtype=torch.float64, device="cuda")
                    dist.all_reduce(bt, op=dist.ReduceOp.MAX, group=group)
                    b = bt.tolist()
                    if not args.graph:
                        r = r + (float("nan"),) * 4
                    r = r + tuple(b)
                    if rank == 0:
                        for lib, o in (("ferry", 0), ("DeepEP", 9)):
                            print(f"  {'':11s} {'':4s} {'':5s}  back to back, {lib:6s}: events "
                                  f"{b[o]:6.1f} ({b[o+1]:6.1f}) / {b[o+2]:6.1f} ({b[o+3]:6.1f}); "
                                  f"kernels {b[o+4]:6.1f} ({b[o+5]:6.1f}) / {b[o+6]:6.1f} "
                                  f"({b[o+7]:6.1f}); other kernels {b[o+8]:.1f} per round",
                                  flush=True)
                rows.append(r)
                if rank == 0:
                    print(f"  {name:11s} {T:4d} {maxT:5d}  {s[0]:6.1f} ({s[1]:6.1f})  "
                          f"{s[2]:6.1f} ({s[3]:6.1f})  {s[4]:6.1f} ({s[5]:6.1f})  "
                          f"{s[6]:6.1f} ({s[7]:6.1f})  {r[11]:4.2f}/{r[12]:4.2f}/{r[13]:4.2f}"
                          f"     {wf}/{wd}", flush=True)
                    if args.graph:
                        g = r[16:]
                        print(f"  {'':11s} {'':4s} {'':5s}  graph: ferry round {g[0]:6.1f} ({g[1]:6.1f})"
                              f"  DeepEP round {g[2]:6.1f} ({g[3]:6.1f})  ratio {g[0] / g[2]:4.2f}",
                              flush=True)
        q.put((rank, rows))
        torch.cuda.synchronize()
        dist.barrier()
        fbuf.destroy()
        dbuf.destroy()
        dist.destroy_process_group()
    except Exception:
        import traceback
        q.put((rank, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    type=lambda v: [shape_name(s.strip()) for s in v.split(",") if s.strip()],
                    help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--tokens", default="1,32,128,256,512",
                    type=lambda v: [int(t) for t in v.split(",") if t.strip()],
                    help="tokens per rank, comma-separated (the largest is num_max_dispatch_tokens)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sms", type=int, default=0,
                    help="ferry's num_sms (default: ferry.deep_ep's, the GPU's SMs; "
                         "DeepEP LL takes what it needs)")
    ap.add_argument("--graph", type=int, default=0, metavar="REPLAYS",
                    help="also time rounds (dispatch + combine, no expert work) replayed "
                         "back to back from a CUDA graph of 10 rounds, REPLAYS times per "
                         "library (not checked: the same calls are checked above)")
    ap.add_argument("--logfmt", action="store_true",
                    help="combine in DeepEP's LogFMT (use_logfmt=True) in both libraries "
                         "(the check then allows each term its 2.17%%)")
    ap.add_argument("--b2b", type=int, default=0, metavar="ROUNDS",
                    help="also time ROUNDS rounds called back to back (no barrier between "
                         "calls): CUDA events around each call and profiler kernel time, "
                         "as DeepEP's tests/test_low_latency.py reports them")
    args = ap.parse_args()
    if args.gpus < 1:
        sys.exit("bench_peers: --gpus: at least 1 (one process per GPU; 1 is a world of one "
                 "rank, nothing crossing a link)")
    if not args.tokens or min(args.tokens) < 1:
        sys.exit("bench_peers: --tokens: positive integers")
    N = args.gpus
    res = spawn_ranks(rank_main, N, args, timeout=1800, join_s=60)
    rows = res[0]

    def header(*cols):
        print("\n| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|")

    header("shape", "T", "ferry dispatch p50 (p99)", "ferry combine p50 (p99)",
           "DeepEP dispatch p50 (p99)", "DeepEP combine p50 (p99)",
           "ferry/DeepEP dispatch, combine, round", "#wrong ferry, DeepEP")
    for (name, T, maxT, fd, fd99, fc, fc99, dd, dd99, dc, dc99, rd, rc, rr, wf, wd) in \
            (r[:16] for r in rows):
        print(f"| {name} | {T} | {fd:.1f} ({fd99:.1f}) | {fc:.1f} ({fc99:.1f}) | {dd:.1f} ({dd99:.1f}) "
              f"| {dc:.1f} ({dc99:.1f}) | {rd:.2f}, {rc:.2f}, {rr:.2f} | {wf}, {wd} |")
    if args.graph:
        header("shape", "T", "ferry round in a CUDA graph p50 (p99)", "DeepEP round p50 (p99)",
               "ferry/DeepEP")
        for r in rows:
            g = r[16:]
            print(f"| {r[0]} | {r[1]} | {g[0]:.1f} ({g[1]:.1f}) | {g[2]:.1f} ({g[3]:.1f}) "
                  f"| {g[0] / g[2]:.2f} |")
    if args.b2b:
        header("shape", "T", "library", "dispatch, events", "combine, events", "dispatch kernel",
               "combine kernel", "ferry/DeepEP: events d, c; kernels d, c")
        for r in rows:
            b = r[20:]
            rat = (f"{b[0] / b[9]:.2f}, {b[2] / b[11]:.2f}; {b[4] / b[13]:.2f}, "
                   f"{b[6] / b[15]:.2f}")
            for lib, o in (("ferry", 0), ("DeepEP", 9)):
                print(f"| {r[0]} | {r[1]} | {lib} | {b[o]:.1f} ({b[o+1]:.1f}) | {b[o+2]:.1f} "
                      f"({b[o+3]:.1f}) | {b[o+4]:.1f} ({b[o+5]:.1f}) | {b[o+6]:.1f} "
                      f"({b[o+7]:.1f}) | {rat if lib == 'ferry' else ''} |")
    wrong = sum(r[14] + r[15] for r in rows)
    print(f"\n# {'all verified' if not wrong else f'{wrong} wrong (tokens + expert counts)'}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
