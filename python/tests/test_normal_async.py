#!/usr/bin/env python3
"""deep_ep normal mode without host round trips, and asynchronous as
DeepEP's. Usage: test_normal_async.py cpu|cuda [nranks]

On every device:
  - host waits per call: get_dispatch_layout, dispatch with a new routing,
    the cached dispatch, combine, num_worst_tokens and a handle's release
    make no collective of the group's (all_gather, all_reduce, broadcast,
    barrier: counted by wrapping torch.distributed) and no ferry sync; a
    new routing's one wait is the library's own (route_create);
    rank_prefix_matrix (handle[0]) gathers the counts when first read,
    and is right;
  - outputs of the asynchronous calls (previous_event, async_finish,
    allocate_on_comm_stream) equal the synchronous ones exactly, over
    back-to-back rounds with changing routing, masked slots and a rank
    with no tokens.
On CUDA also:
  - host synchronisations counted by the torch profiler
    (cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize
    rows): at most 1 for a new routing, none for the rest and with
    num_worst_tokens;
  - real asynchrony: with previous_event captured before a long GPU sleep
    on the current stream, the call's event completes while that stream
    still sleeps (the work ran on the comm stream beside it); without
    previous_event the call waits for the current stream (its event does
    not complete before the sleep ends); without async_finish the current
    stream waits for the call (a stream wait, not the host);
  - get_comm_stream() is the stream the calls ran on.
Across simulated nodes (FERRY_TEST_NODES) on CUDA:
  - FERRY_TEST_NB_STREAM=1: the rank's calls are made from a non-blocking
    stream of its own (GPU memory on the fabric path through a provider
    copying with CUDA calls in its thread, libfabric's shm, where deep_ep
    finishes every call on the host): the outputs are checked as above,
    the collectives and ferry syncs bounded, the host syncs counted and
    printed but not bounded, and the overlap is not checked (there is
    none), saying so;
  - FERRY_TEST_STAGED=1: the fabric peers go through the staged engine
    (pinned host memory), whose calls finish on the host by design
    (docs/architecture.md): the outputs are checked as above, the host
    syncs are counted and printed but not bounded, and the overlap is not
    checked (there is none), saying so.
Exit 77 (skipped) without torch, or on cuda without a usable GPU.
"""
import contextlib
import os
import sys
import time
import traceback

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranks import run_ranks, torch_init  # noqa: E402

_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "all_gather_into_tensor",
                "all_gather_object", "reduce_scatter", "all_to_all")


class Count:
    """Counts the group's collectives and ferry's syncs while on."""

    def __init__(self, ferry_ep_cls):
        import torch.distributed as dist
        self.n, self.on, self.what = 0, False, []
        for name in _COLLECTIVES:
            f = getattr(dist, name, None)
            if f is not None:
                setattr(dist, name, self._wrap(f, name))
        ferry_ep_cls.sync = self._wrap(ferry_ep_cls.sync, "EP.sync")

    def _wrap(self, f, name):
        def g(*a, **k):
            if self.on:
                self.n += 1
                self.what.append(name)
            return f(*a, **k)
        return g

    def __call__(self, fn):
        self.n, self.what, self.on = 0, [], True
        try:
            r = fn()
        finally:
            self.on = False
        return r, self.n, self.what


def inputs(rank, rnd, T, H, E, K, dev):
    """Rank 1 has no tokens in odd rounds; Zipf-like routing with distinct
    experts per token, 10% masked slots, weights not summing to 1, values
    exact in bf16 (a different value per source and token)."""
    g = torch.Generator().manual_seed(104729 * rnd + rank)
    t = 0 if (rank == 1 and rnd % 2) else T - 2 * rank
    x = (torch.randint(-64, 64, (t, H), generator=g).float() / 16).to(torch.bfloat16)
    p = 1.0 / torch.arange(1, E + 1).float() ** 1.1
    idx = torch.stack([torch.multinomial(p, K, replacement=False, generator=g)
                       for _ in range(t)]) if t else torch.zeros((0, K), dtype=torch.int64)
    idx = idx.to(torch.int64)
    idx[torch.rand(t, K, generator=g) < 0.1] = -1
    w = torch.rand(t, K, generator=g) * 0.9 + 0.05
    return x.to(dev), idx.to(dev), w.to(dev)


def new_routing(buf, x, idx, w, E, **kw):
    """get_dispatch_layout + dispatch without a handle, with kw's stream
    arguments on both (the layout's event feeds the dispatch)."""
    lk = {k: v for k, v in kw.items() if k != "num_worst_tokens"}
    pr, _, pe, inr, ev = buf.get_dispatch_layout(idx, E, **lk)
    if kw.get("async_finish"):
        kw = dict(kw, previous_event=ev)
    return buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=inr,
                        num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w, **kw)


def check_waits(buf, x, idx, w, E, N, rank, count, msgs):
    """No collective and no sync in any call; handle[0] right."""
    (rx, ridx, rw, counts, h, _), n, what = count(lambda: new_routing(buf, x, idx, w, E))
    if n:
        msgs.append(f"dispatch with a new routing: {n} collectives/syncs ({what})")
    _, n, what = count(lambda: buf.dispatch(x, handle=h))
    if n:
        msgs.append(f"cached dispatch: {n} collectives/syncs ({what})")
    y = rx.clone()
    _, n, what = count(lambda: buf.combine(y, h, topk_weights=rw))
    if n:
        msgs.append(f"combine: {n} collectives/syncs ({what})")
    _, n, what = count(lambda: buf.get_dispatch_layout(idx, E))
    if n:
        msgs.append(f"get_dispatch_layout: {n} collectives/syncs ({what})")
    # num_worst_tokens: a bound every rank's rows fit in
    worst = N * 600  # every rank's tokens, at most
    _, n, what = count(lambda: new_routing(buf, x, idx, w, E, num_worst_tokens=worst))
    if n:
        msgs.append(f"dispatch with num_worst_tokens: {n} collectives/syncs ({what})")
    pr, _, _, inr, _ = buf.get_dispatch_layout(idx, E)
    parts = [torch.zeros_like(pr) for _ in range(N)]
    torch.distributed.all_gather(parts, pr)
    want = torch.cumsum(torch.stack(parts), 0, dtype=torch.int32)
    if len(h) == 10:
        # across nodes (DeepEP's internode handle): is_token_in_rank first,
        # recv_gbl_rank_prefix_sum (rows from ranks 0..i) at 6, no collective
        (ok, _), n, what = count(lambda: (torch.equal(h[0].cpu(), inr.cpu()), h[6]))
        if n:
            msgs.append(f"internode handle's fields: {n} collectives/syncs ({what})")
        if not ok:
            msgs.append("internode handle[0] (is_token_in_rank) differs from the layout's")
        got = h[6]
        if got is None or not torch.equal(got.cpu(), want[:, rank].cpu()):
            msgs.append(f"handle[6] (recv_gbl_rank_prefix_sum): {got} != {want[:, rank]}")
    else:
        # rank_prefix_matrix: gathered when read (collective: every rank reads it)
        got = h[0]
        if got is None or not torch.equal(got.cpu(), want.cpu()):
            msgs.append(f"handle[0] (rank_prefix_matrix): {got} != {want}")
        elif int(got[N - 1][rank]) != rx.shape[0]:
            msgs.append(f"handle[0][N-1][rank] = {int(got[N - 1][rank])}, rows {rx.shape[0]}")
    # a handle's release: its route dropped (queued by the collector) and
    # destroyed by the context's next call
    route = h.route
    ep, a = route.ep, route._h.value
    del h
    _, n, what = count(lambda: (route.__del__(), ep._ep()))
    if n:
        msgs.append(f"a handle's release: {n} collectives/syncs ({what})")
    if a in ep._route_hs:
        msgs.append("a dropped route was not destroyed by the context's next call")


def check_async_equal(buf, x, idx, w, E, rnd, msgs):
    """The asynchronous calls' outputs equal the synchronous ones."""
    dev = x.device
    rx, ridx, rw, counts, h, _ = new_routing(buf, x, idx, w, E)
    y = (rx.float() * (1 + (rx.shape[0] % 3))).to(torch.bfloat16) if rx.numel() else rx
    out, ow, _ = buf.combine(y, h, topk_weights=rw)
    kw = dict(async_finish=True, allocate_on_comm_stream=True)
    before = torch.cuda.current_stream() if dev.type == "cuda" else None
    prev = type(buf).capture() if dev.type == "cuda" else None
    arx, aridx, arw, acounts, ah, ev = new_routing(buf, x, idx, w, E, previous_event=prev, **kw)
    ev.current_stream_wait()
    ay = (arx.float() * (1 + (arx.shape[0] % 3))).to(torch.bfloat16) if arx.numel() else arx
    aout, aow, ev = buf.combine(ay, ah, topk_weights=arw,
                                previous_event=type(buf).capture()
                                if dev.type == "cuda" else None, **kw)
    ev.current_stream_wait()
    crx, *_, ev = buf.dispatch(x, handle=ah, async_finish=True)
    ev.current_stream_wait()
    if dev.type == "cuda" and torch.cuda.current_stream() != before:
        msgs.append(f"round {rnd}: the async calls left {torch.cuda.current_stream()} current, "
                    f"not the caller's {before}")
    for name, a, b in (("recv_x", arx, rx), ("recv_topk_idx", aridx, ridx),
                       ("recv_topk_weights", arw, rw), ("combined_x", aout, out),
                       ("combined_topk_weights", aow, ow), ("cached recv_x", crx, rx)):
        if a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            msgs.append(f"round {rnd}: async {name} differs from the synchronous call's")
    if acounts != counts:
        msgs.append(f"round {rnd}: async counts {acounts} != {counts}")


def _sync_rows(prof):
    names = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
    return [e.name for e in prof.events() if e.name in names]


def check_profiler(buf, x, idx, w, E, N, msgs, why=None):
    """Host synchronisations per call, as the profiler sees them: at most
    the cases' counts, or printed only where why says what finishes the
    calls on the host."""
    from torch.profiler import ProfilerActivity, profile
    rx, _, rw, _, h, _ = new_routing(buf, x, idx, w, E)
    y = rx.clone()
    worst = N * 600  # every rank's tokens, at most
    cases = (("dispatch with a new routing", 1, lambda: new_routing(buf, x, idx, w, E)),
             ("cached dispatch", 0, lambda: buf.dispatch(x, handle=h)),
             ("combine", 0, lambda: buf.combine(y, h, topk_weights=rw)),
             ("get_dispatch_layout", 0, lambda: buf.get_dispatch_layout(idx, E)),
             ("num_worst_tokens", 0, lambda: new_routing(buf, x, idx, w, E,
                                                         num_worst_tokens=worst)),
             ("async new routing", 1, lambda: new_routing(
                 buf, x, idx, w, E, previous_event=type(buf).capture(),
                 async_finish=True, allocate_on_comm_stream=True)))
    for name, most, fn in cases:
        torch.cuda.synchronize()
        torch.distributed.barrier()
        keep = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                keep.append(fn())
            keep.clear()  # handles released under the profiler too
        rows = _sync_rows(prof)
        if why is not None:
            if torch.distributed.get_rank() == 0:
                print(f"rank 0: {name}: {len(rows)} host synchronisations in 3 calls "
                      f"({why}: not bounded)", flush=True)
            continue
        if len(rows) > 3 * most:
            msgs.append(f"{name}: {len(rows)} host synchronisations in 3 calls (at most "
                        f"{3 * most}): {rows}")


def check_overlap(buf, x, idx, w, E, msgs):
    """The call runs beside the caller's stream (see the module's text)."""
    rx, _, rw, _, h, _ = new_routing(buf, x, idx, w, E)
    cur = torch.cuda.current_stream()
    if buf.get_comm_stream() == cur:
        msgs.append("get_comm_stream() is the current stream: calls cannot overlap it")
    cycles = int(1.5e9)  # about a second at the H200's clock

    def sleeping():
        return not cur.query()

    for kind in ("dispatch", "combine"):
        torch.cuda.synchronize()
        torch.distributed.barrier()
        prev = type(buf).capture()
        torch.cuda._sleep(cycles)
        if kind == "dispatch":
            *_, ev = new_routing(buf, x, idx, w, E, previous_event=prev, async_finish=True,
                                 allocate_on_comm_stream=True)
        else:
            *_, ev = buf.combine(rx, h, previous_event=prev, async_finish=True,
                                 allocate_on_comm_stream=True)
        t0 = time.time()
        while not ev.event.query() and time.time() - t0 < 30:
            time.sleep(0.0005)
        if not ev.event.query():
            msgs.append(f"async {kind}: its event did not complete in 30 s")
        elif not sleeping():
            msgs.append(f"async {kind} after previous_event: it finished only once the current "
                        f"stream's sleep had (no overlap)")
    torch.cuda.synchronize()
    torch.distributed.barrier()
    # without previous_event: after the current stream's work
    torch.cuda._sleep(cycles)
    *_, ev = buf.combine(rx, h, async_finish=True)
    time.sleep(0.05)
    if ev.event.query() and sleeping():
        msgs.append("async combine without previous_event ran before the current stream's "
                    "work")
    torch.cuda.synchronize()
    torch.distributed.barrier()
    # without async_finish: the current stream waits for the call, whose
    # outputs are then complete there
    out, _, _ = buf.combine(rx, h)
    torch.cuda._sleep(1000)
    e0 = torch.cuda.Event()
    e0.record()
    e0.synchronize()
    ref, _, ev = buf.combine(rx, h, async_finish=True)
    ev.current_stream_wait()
    torch.cuda.synchronize()
    if not torch.equal(out, ref):
        msgs.append("combine without async_finish: the current stream did not wait for it")


def rank_main(rank, N, port, q, dev_kind):
    msgs = []
    try:
        torch_init(rank, N, port)
        dev, side = torch.device("cpu"), contextlib.nullcontext()
        if dev_kind == "cuda":
            torch.cuda.set_device(0)
            dev = torch.device("cuda", 0)
            if os.environ.get("FERRY_TEST_NB_STREAM") == "1":
                side = torch.cuda.stream(torch.cuda.Stream())
        with side:
            rank_checks(rank, N, dev, dev_kind, msgs)
    except Exception:
        msgs.append(traceback.format_exc())
    q.put((rank, msgs))


def rank_checks(rank, N, dev, dev_kind, msgs):
    from ferry import deep_ep as de
    from ferry import EP
    count = Count(EP)
    buf = de.Buffer(torch.distributed.group.WORLD, low_latency_mode=False)
    E, K, H, T = 4 * N, 3, 256, 24
    x, idx, w = inputs(rank, 9, T, H, E, K, dev)
    new_routing(buf, x, idx, w, E)  # the shape's context made (collective, once)
    for rnd in range(3):  # back to back, changing routing
        x, idx, w = inputs(rank, rnd, T, H, E, K, dev)
        check_waits(buf, x, idx, w, E, N, rank, count, msgs)
        check_async_equal(buf, x, idx, w, E, rnd, msgs)
    if dev_kind == "cuda":
        # calls finished on the host by design: the staged engine's, and
        # deep_ep's on a fabric provider copying with CUDA calls
        staged = os.environ.get("FERRY_TEST_STAGED") == "1"
        copies = any(ep.needs_nonblocking_stream for ep in buf._eps.values())
        why = "the staged engine" if staged else "a copying fabric provider (deep_ep)"
        x, idx, w = inputs(rank, 0, 512, 1024, E, K, dev)
        check_profiler(buf, x, idx, w, E, N, msgs, why=why if staged or copies else None)
        if staged or copies:
            if rank == 0:
                print(f"rank 0: overlap not checked: {why} finishes its calls on the host",
                      flush=True)
        else:
            check_overlap(buf, x, idx, w, E, msgs)
    buf.destroy()


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    N = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    if kind == "cuda" and not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        sys.exit(77)
    import functools
    res, crashed = run_ranks(functools.partial(_entry, kind=kind), N, timeout=300)
    bad = crashed + [f"rank {r}: {m}" for r in sorted(res) for m in res[r]]
    for line in bad:
        print(line)
    ok = not bad and len(res) == N
    print(f"test_normal_async ({kind}, {N} ranks): {'passed' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


def _entry(rank, N, port, q, kind):
    rank_main(rank, N, port, q, kind)


if __name__ == "__main__":
    main()
