#!/usr/bin/env python3
"""ferry.deep_ep on CPU ranks (torch CPU tensors, gloo), for CI: DeepEP's
low-latency API with every argument ferry takes, each round checked
against a reference computed here (the helpers of test_torch_cuda.py):

  - bf16 and fp8, with and without the receive hook, async_finish, ranks
    that send nothing, masked slots, weights that do not sum to 1, a
    different transform per expert, changing routing every round;
  - round_scale with use_ue8m0 (DeepEP's packed int32 scales);
  - cumulative_local_expert_recv_stats (counts added in place) and the
    wait-cost stats (nanoseconds on CPU ranks);
  - get_next_low_latency_combine_buffer (zero copy) refused on CPU
    tensors, naming the handle;
  - argument errors naming the argument (TypeError / ValueError /
    NotImplementedError), get_low_latency_rdma_size_hint, allow_mnnvl,
    clean_low_latency_buffer;
  - get_local_buffer_tensor: buffers of their own, DeepEP's units, apart
    from ferry's memory both ways;
  - shapes declared to Buffer() (ferry_shapes, FERRY_DEEP_EP_SHAPES): their
    contexts made there, none at their first call;
  - low_latency_update_mask_buffer / query / clean: a rank leaves, the
    others mask it and go on, rounds checked with it masked; the same with
    enable_shrink, where the waits that run out mask it;
  - normal mode (get_dispatch_layout, dispatch, combine) on the CPU
    high-throughput engine: rows, local expert ids and weights, counts
    with expert_alignment, combine and the weights gathered back, a cached
    handle, num_worst_tokens, fp8 tuples, argument errors.
Usage: test_torch_cpu.py [nranks ...]. Exit 77 (skipped) without torch.
"""
import os
import sys
import traceback

try:
    import torch
except ImportError:
    print("skipped: torch is not installed (scripts/setup.sh installs it)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import gather_all, ranks_main, test_nodes, torch_init  # noqa: E402
from test_torch_cuda import (check_round, combine_error, combine_ref, expect, scratch_buffer,  # noqa: E402
                             expert_fn, expert_outputs, make_inputs, quant_ref)


def ll_rounds(deep_ep, buf, rank, N, E, K, H, T):
    """Rounds through every form of the calls, each checked."""
    msgs, dev, El = [], torch.device("cpu"), E // N
    stats = torch.full((El,), 3, dtype=torch.int32)
    total = stats.clone()
    dws, cws = torch.zeros(N, dtype=torch.int64), torch.zeros(N, dtype=torch.int64)
    rnd = 0
    for fp8 in (False, True):
        for hook_mode in (False, True):
            rnd += 1
            x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
            xs, ids = gather_all(N, x, idx)
            recv, count, handle, ev, hook = buf.low_latency_dispatch(
                x, idx, T, E, use_fp8=fp8, return_recv_hook=hook_mode,
                cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=dws,
                async_finish=hook_mode)
            if hook_mode:
                hook()
            ev.current_stream_wait()
            total += count
            err = check_round(rank, N, E, K, xs, ids, recv, count,
                              (handle.src_rank, handle[0]), fp8)
            # DeepEP's scale layout: [E_local, rows, H/128], column-major in
            # the last two dims
            sc = recv[1] if fp8 else None
            if fp8 and sc.stride() != (sc.shape[1] * sc.shape[2], 1, sc.shape[1]):
                msgs.append(f"fp8 scales: strides {sc.stride()}, want DeepEP's column-major "
                            f"{(sc.shape[1] * sc.shape[2], 1, sc.shape[1])}")
            if err:
                msgs.append(f"dispatch fp8={fp8} hook={hook_mode}: {err}")
            lr = handle[1]
            for le in range(El):
                if int((lr[le] & 0xFFFFFFFF).sum()) != int(count[le]):
                    msgs.append(f"handle[1] expert {le}: counts do not sum to {int(count[le])}")
                    break
            y = expert_outputs(rank, El, recv, count, fp8, dev)
            out, ev, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook_mode,
                                                    combine_wait_recv_cost_stats=cws,
                                                    async_finish=not hook_mode)
            if hook_mode:
                hook()
            err = combine_error(out, combine_ref(x, idx, w, fp8))
            if err:
                msgs.append(f"combine fp8={fp8} hook={hook_mode}: {err}")
    if not torch.equal(stats, total) or int(total.sum()) == 3 * El:
        msgs.append(f"cumulative_local_expert_recv_stats: {stats.tolist()}, want 3 + the "
                    f"counts {total.tolist()}")
    if (dws < 0).any() or (cws < 0).any() or int(dws.sum()) <= 0 or int(cws.sum()) <= 0:
        msgs.append(f"wait-cost stats (ns): dispatch {dws.tolist()}, combine {cws.tolist()}")
    # round_scale with UE8M0 scales: packed int32 [E_local, rows, H/512],
    # column-major in the last two dims, four exponent bytes each
    rnd += 1
    x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
    xs, ids = gather_all(N, x, idx)
    (qx, packed), count, handle, _, _ = buf.low_latency_dispatch(
        x, idx, T, E, use_fp8=True, round_scale=True, use_ue8m0=True)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (El, qx.shape[1], H // 512) \
            or packed.stride()[1] != 1:
        msgs.append(f"ue8m0: packed scales {packed.dtype} {tuple(packed.shape)} "
                    f"strides {packed.stride()}")
    else:
        exps = torch.stack([(packed >> (8 * j)) & 0xFF for j in range(4)], dim=3)
        scales = (exps.reshape(El, qx.shape[1], H // 128) << 23).view(torch.float32)
        err = check_round(rank, N, E, K, xs, ids, (qx, scales), count,
                          (handle.src_rank, handle[0]), True, round_scale=True)
        if err:
            msgs.append(f"round_scale/ue8m0: {err}")
    buf.low_latency_combine(torch.zeros(qx.shape, dtype=torch.bfloat16), idx, w, handle)
    # zero copy uses the reusable buffers of CUDA contexts: on CPU tensors
    # it is refused naming the handle, and the round still combines
    rnd += 1
    x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y = expert_outputs(rank, El, recv, count, False, dev)
    expect(msgs, TypeError, "handle", buf.get_next_low_latency_combine_buffer, handle)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    err = combine_error(out, combine_ref(x, idx, w, False))
    if err:
        msgs.append(f"combine after the zero-copy refusal: {err}")
    return msgs


def runtime_queries(deep_ep, buf, rank):
    """buf.runtime: DeepEP's queries, from ferry's node names (here one
    node; a table of five ranks on two nodes, made directly); the rest of
    DeepEP's runtime refused naming it."""
    msgs, rt = [], buf.runtime
    dev = torch.cuda.current_device() if torch.cuda.is_available() else -1
    got = (rt.get_num_rdma_ranks(), rt.get_rdma_rank(), rt.get_root_rdma_rank(True),
           rt.get_root_rdma_rank(False), rt.is_internode_available(), rt.is_available(),
           rt.get_local_device_id())
    if got != (1, 0, rank, 0, False, True, dev):
        msgs.append(f"runtime on one node: {got}, want {(1, 0, rank, 0, False, True, dev)}")

    class Fake:
        _scratch = {}
    for r, want in ((0, (2, 0, 0)), (1, (2, 0, 1)), (2, (2, 1, 0)), (3, (2, 1, 1)),
                    (4, (2, 0, 2))):
        fb = Fake()
        fb.rank = r
        rt2 = deep_ep._Runtime(fb, ["a", "a", "b", "b", "a"])
        got = (rt2.get_num_rdma_ranks(), rt2.get_rdma_rank(), rt2.get_root_rdma_rank(True))
        if got != want or not rt2.is_internode_available():
            msgs.append(f"runtime of rank {r} on nodes a a b b a: {got}, want {want}")
    expect(msgs, AttributeError, "runtime.get_local_ipc_handle",
           lambda: rt.get_local_ipc_handle())
    return msgs


def ll_args(deep_ep, buf, rank, N, E, K, H, T):
    """Bad arguments raise, naming the argument; the context stays usable."""
    msgs, El = [], E // N
    x, idx, w = make_inputs(rank + 1, 99, T, H, E, K, torch.device("cpu"))  # every rank sends
    expect(msgs, TypeError, "x", buf.low_latency_dispatch, x.float(), idx, T, E)
    expect(msgs, ValueError, "x", buf.low_latency_dispatch, x, idx, x.shape[0] - 1, E)
    expect(msgs, ValueError, "topk_idx", buf.low_latency_dispatch, x, idx[:1], T, E)
    expect(msgs, TypeError, "cumulative_local_expert_recv_stats", buf.low_latency_dispatch,
           x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(El))
    expect(msgs, ValueError, "cumulative_local_expert_recv_stats", buf.low_latency_dispatch,
           x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(El + 1, dtype=torch.int32))
    expect(msgs, TypeError, "dispatch_wait_recv_cost_stats", buf.low_latency_dispatch,
           x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(N, dtype=torch.int32))
    expect(msgs, ValueError, "dispatch_wait_recv_cost_stats", buf.low_latency_dispatch,
           x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(N + 1, dtype=torch.int64))
    expect(msgs, ValueError, "use_ue8m0", buf.low_latency_dispatch, x, idx, T, E,
           use_ue8m0=True)
    # passed to libferry as C ints: outside their range a ValueError naming
    # them (ctypes would wrap 2**32 + T to T), before any context is made
    for v in (2**31, 2**32 + T):
        expect(msgs, ValueError, "num_max_dispatch_tokens_per_rank", buf.low_latency_dispatch,
               x, idx, v, E)
    for v in (2**31, 2**32 + E):
        expect(msgs, ValueError, "num_experts", buf.low_latency_dispatch, x, idx, T, v)
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y = torch.zeros(recv.shape, dtype=torch.bfloat16)
    expect(msgs, ValueError, "x", buf.low_latency_combine, y[:, :1], idx, w, handle)
    expect(msgs, ValueError, "topk_weights", buf.low_latency_combine, y, idx, w[:1], handle)
    expect(msgs, TypeError, "handle", buf.low_latency_combine, y, idx, w, (1, 2))
    # LogFMT (H = 512 here): zero rows travel as raw chunks and stay exactly
    # zero (python/tests/test_logfmt.py checks the format bit for bit)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle, use_logfmt=True)
    if out.shape != (x.shape[0], H) or out.abs().sum().item() != 0:
        msgs.append("use_logfmt=True combine of zero rows: not zero")
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    # DeepEP's EventOverlap(event, extra_tensors), positional
    keep = (torch.zeros(1),)
    eo = deep_ep.EventOverlap(None, keep)
    with eo as same:  # no event: leaving waits for nothing
        pass
    if eo.extra_tensors is not keep or eo.event is not None or same is not eo:
        msgs.append("EventOverlap(None, extra_tensors): attributes or `with` wrong")
    expect(msgs, ValueError, "combine_wait_recv_cost_stats", buf.low_latency_combine, y, idx, w,
           handle, combine_wait_recv_cost_stats=torch.zeros((N, N), dtype=torch.int64))
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)  # still usable
    if out.shape != (x.shape[0], H) or out.abs().sum().item() != 0:
        msgs.append("combine after the refused calls: wrong output")
    msgs += scratch_buffer(deep_ep, rank, N, E, K, H, T)
    if deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, N, E) <= 0:
        msgs.append("get_low_latency_rdma_size_hint: not positive")
    buf.clean_low_latency_buffer(T, H, E)
    if not (buf.allow_mnnvl and buf.low_latency_mode and buf.group_size == N) or \
            buf.explicitly_destroy or buf.num_nvl_bytes != 0:
        msgs.append("attributes: allow_mnnvl, low_latency_mode, group_size, "
                    "explicitly_destroy or num_nvl_bytes wrong")
    msgs += runtime_queries(deep_ep, buf, rank)
    return msgs


def ll_mask(deep_ep, rank, N, dev=torch.device("cpu"), shrink=False):
    """low_latency_update_mask_buffer: the last rank leaves after a round
    with everyone; the others mask it and go on, rounds (bf16, fp8)
    checked against the reference with its tokens gone and the slots on
    its experts -1; query, argument errors, clean refused once a round ran
    with the mask. shrink: no one masks it, the Buffer has enable_shrink
    (a wait that runs out, here after FERRY_TIMEOUT_MS = 1500, masks it).
    Tensors on `dev` (CPU ranks here, CUDA in test_torch_ht_cuda.py)."""
    msgs = []
    if N < 2:
        return msgs
    import ferry
    E, K, H, T, victim = 4 * N, 3, 256, 12, N - 1
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True,
                         enable_shrink=shrink)
    old = os.environ.get("FERRY_TIMEOUT_MS")
    if shrink:  # the contexts' waits (read when the first calls make them)
        os.environ["FERRY_TIMEOUT_MS"] = "1500"
    for fp8 in (False, True):  # both contexts made with everyone
        x, idx, w = make_inputs(rank, 60 + fp8, T, H, E, K, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8)
        buf.low_latency_combine(expert_outputs(rank, El, recv, count, fp8, dev), idx, w, handle)
    if old is None:
        os.environ.pop("FERRY_TIMEOUT_MS", None)
    else:
        os.environ["FERRY_TIMEOUT_MS"] = old
    if rank == victim:  # leaves; waits in the collective close
        buf.destroy()
        return msgs
    st = torch.full((N,), 7, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(st)
    if st.tolist() != [0] * N:
        msgs.append(f"query before masking: {st.tolist()}")
    if not shrink:
        expect(msgs, ValueError, "rank_to_mask", buf.low_latency_update_mask_buffer, rank, True)
        expect(msgs, ValueError, "rank_to_mask", buf.low_latency_update_mask_buffer, N, True)
        expect(msgs, TypeError, "mask_status", buf.low_latency_query_mask_buffer,
               torch.zeros(N, dtype=torch.int64, device=dev))
        buf.low_latency_update_mask_buffer(victim, True)
        buf.low_latency_query_mask_buffer(st)
        if st.tolist() != [int(r == victim) for r in range(N)]:
            msgs.append(f"query after masking rank {victim}: {st.tolist()}")

    def cut(i):  # slots on the masked rank's experts: -1
        i = i.clone()
        i[(i >= 0) & (i // El == victim)] = -1
        return i

    for rnd in (62, 63):
        for fp8 in (False, True):
            xs, ids = [], []
            for s in range(N):
                xs_s, idx_s, _ = make_inputs(s, rnd, T, H, E, K, dev)
                if s == victim:
                    xs_s, idx_s = xs_s[:0], idx_s[:0]
                xs.append(xs_s)
                ids.append(cut(idx_s))
            x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
            checked_round(msgs, f"masked round {rnd} fp8={fp8}", buf, rank, N, E, K, T, fp8,
                          dev, x, idx, w, xs, ids, cut(idx))
    if shrink:  # found by the waits; refused back as a mask set here is
        buf.low_latency_query_mask_buffer(st)
        if st.tolist() != [int(r == victim) for r in range(N)]:
            msgs.append(f"query after the timeouts: {st.tolist()}, want rank {victim} masked")
        try:
            buf.low_latency_update_mask_buffer(victim, False)
            msgs.append("unmask after a timeout: accepted, expected FerryError (out of step)")
        except ferry.FerryError as e:
            if "out of step" not in str(e):
                msgs.append(f"unmask after a timeout: {e}")
        # vLLM's fault-tolerance retry cleans, then expects the query to
        # read zeros: refused instead, naming the rank (a new Buffer)
        try:
            buf.low_latency_clean_mask_buffer()
            msgs.append("clean after a timeout's mask: accepted, though the rank stays masked")
        except ferry.FerryError as e:
            if f"rank(s) {victim} masked by a wait that timed out" not in str(e) or \
                    "make a new Buffer" not in str(e):
                msgs.append(f"clean after a timeout's mask: {e}")
    else:
        try:
            buf.low_latency_clean_mask_buffer()
            msgs.append("clean after masked rounds: accepted, expected FerryError (out of step)")
        except ferry.FerryError as e:
            if "out of step" not in str(e):
                msgs.append(f"clean after masked rounds: {e}")
    buf.destroy()
    return msgs


def checked_round(msgs, what, buf, rank, N, E, K, T, fp8, dev, x, idx, w, xs, ids, ref_idx):
    """One low-latency round of buf with x, idx, w; the dispatch checked
    against every rank's inputs (xs, ids: as the receiver should see them),
    the combine against ref_idx's slots; failures appended to msgs."""
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8)
    err = check_round(rank, N, E, K, xs, ids, recv, count, (handle.src_rank, handle[0]), fp8)
    if err:
        msgs.append(f"{what}: dispatch: {err}")
    y = expert_outputs(rank, E // N, recv, count, fp8, dev)
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    err = combine_error(out, combine_ref(x, ref_idx, w, fp8))
    if err:
        msgs.append(f"{what}: combine: {err}")


def declared_shapes(deep_ep, rank, N, dev=None):
    """ferry_shapes / FERRY_DEEP_EP_SHAPES: the declared shapes' contexts are
    made in Buffer() (collectively, beside the communicator), so the first
    dispatch of such a shape makes none; a shape not declared is still made
    at its first call; rounds of both checked; malformed declarations
    refused naming the argument or the variable. dev: the tensors' device.
    Declared shapes are made for CUDA tensors on a host with a GPU, so on
    such a host the CPU run (dev None) leaves these checks out and
    test_torch_ht_cuda.py runs them with dev a GPU."""
    msgs = []
    if dev is None:
        if torch.cuda.is_available():
            return msgs
        dev = torch.device("cpu")
    E, K, H, T = 4 * N, 3, 256, 12
    W = torch.distributed.group.WORLD
    for bad in ([(E, K, H)], "8,2,256,16,fp4", "a,b,c,d", (E, K, H, T), 7,
                [(E, K, 256, T, "fp8_ue8m0")]):
        expect(msgs, ValueError, "ferry_shapes", deep_ep.Buffer, W, 0, 0,
               low_latency_mode=True, ferry_shapes=bad)
    os.environ["FERRY_DEEP_EP_SHAPES"] = "1,2,3"
    try:
        expect(msgs, ValueError, "FERRY_DEEP_EP_SHAPES", deep_ep.Buffer, W, 0, 0,
               low_latency_mode=True)
    finally:
        del os.environ["FERRY_DEEP_EP_SHAPES"]
    expect(msgs, ValueError, "ferry_shapes", deep_ep.Buffer, W, 0, 0,
           low_latency_mode=False, ferry_shapes=[(E, K, H, T, "bf16")])
    os.environ["FERRY_DEEP_EP_SHAPES"] = f"{E},{K},{H},{T}"
    try:  # the variable is for low-latency buffers: a normal-mode one ignores it
        deep_ep.Buffer(W, 0, 0, low_latency_mode=False).destroy()
    finally:
        del os.environ["FERRY_DEEP_EP_SHAPES"]
    os.environ["FERRY_DEEP_EP_SHAPES"] = f"{E},{K},{H},{T},bf16; {E},{K},{H},{T}"
    try:
        buf = deep_ep.Buffer(W, 0, 0, low_latency_mode=True)
    finally:
        del os.environ["FERRY_DEEP_EP_SHAPES"]
    made = len(buf._eps)
    if made != 2:
        msgs.append(f"Buffer() made {made} contexts for 2 declared shapes")
    for rnd, (fp8, T2) in enumerate(((False, T), (True, T), (False, T + 4))):
        x, idx, w = make_inputs(rank, 80 + rnd, T2, H, E, K, dev)
        xs, ids = gather_all(N, x, idx)
        before = len(buf._eps)
        checked_round(msgs, f"declared shape T={T2} fp8={fp8}", buf, rank, N, E, K, T2, fp8,
                      dev, x, idx, w, xs, ids, idx)
        grew = len(buf._eps) - before
        if grew != (0 if T2 == T else 1):
            msgs.append(f"dispatch T={T2} fp8={fp8}: {grew} contexts made at the call")
    buf.destroy()
    return msgs


def layout_error(buf, idx, E, N):
    """get_dispatch_layout against a loop over the slots, on idx and on a
    copy with an index past E, a -1 and a token whose experts share a rank
    (the past-E slot counts nowhere), and on a non-contiguous view."""
    El = E // N
    bad = idx.clone()
    if bad.shape[0] >= 3:
        bad[0, 0] = E
        bad[1, :] = -1
        bad[2, 1] = bad[2, 0] if bad[2, 0] >= 0 else 0
    for case, t in (("idx", idx), ("with bad slots", bad), ("strided", bad.t().contiguous().t())):
        nr, _, ne, inr, _ = buf.get_dispatch_layout(t, E)
        want_in = torch.zeros((t.shape[0], N), dtype=torch.bool)
        want_ne = torch.zeros(E, dtype=torch.int32)
        for i in range(t.shape[0]):
            for e in t[i].tolist():
                if 0 <= e < E:
                    want_in[i, e // El] = True
                    want_ne[e] += 1
        if inr.dtype != torch.bool or not torch.equal(inr, want_in):
            return f"{case}: is_token_in_rank {inr.int().tolist()}, want {want_in.int().tolist()}"
        if not torch.equal(ne, want_ne):
            return f"{case}: num_tokens_per_expert {ne.tolist()}, want {want_ne.tolist()}"
        if not torch.equal(nr, want_in.sum(0, dtype=torch.int32)):
            return f"{case}: num_tokens_per_rank {nr.tolist()}"
        # the PyTorch-ops form (CUDA tensors' default) gives the same
        from ferry import deep_ep as fde
        tr = fde._layout_torch(t, E, N)
        if not (torch.equal(tr[0], nr) and torch.equal(tr[1], ne) and torch.equal(tr[2], inr)):
            return f"{case}: the PyTorch-ops layout differs"
    return None


def normal_mode(deep_ep, rank, N):
    """DeepEP's normal mode on ferry's high-throughput engine: rows by
    source rank, then token, with their local expert ids and weights;
    per-expert counts rounded up to the alignment; the combine of the
    experts' weighted outputs, and the weights gathered back; a cached
    handle; num_worst_tokens (padded rows); fp8 tuples; argument errors."""
    msgs, dev = [], torch.device("cpu")
    E, K, H, T, align = 4 * N, 3, 256, 24, 4
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, low_latency_mode=False)
    for rnd, fp8 in ((1, False), (2, True)):
        x, idx, w = make_inputs(rank, 200 + rnd, T, H, E, K, dev)
        xs, ids, ws = gather_all(N, x, idx, w)
        nr, nrdma, ne, inr, _ = buf.get_dispatch_layout(idx, E)
        exp_rows = [(s, t) for s in range(N) for t in range(ids[s].shape[0])
                    if ((ids[s][t] >= rank * El) & (ids[s][t] < rank * El + El)).any()]
        nodes = buf.runtime.get_num_rdma_ranks()
        if (nrdma is not None) != (nodes > 1) or int(nr.sum()) != int(inr.sum()) or \
                int(ne.sum()) != int((idx >= 0).sum()):
            msgs.append(f"get_dispatch_layout: {nr.tolist()} {ne.tolist()} "
                        f"{None if nrdma is None else nrdma.tolist()} ({nodes} nodes)")
        # tokens per node (DeepEP's num_tokens_per_rdma_rank), with the
        # ranks on nodes b a b a ... (a node's ranks need not be together)
        rt = buf.runtime
        try:
            names = ["ab"[(r + 1) % 2] for r in range(N)]
            buf.runtime = deep_ep._Runtime(buf, names)
            nrdma2 = buf.get_dispatch_layout(idx, E)[1]
        finally:
            buf.runtime = rt
        if N > 1:
            want = [int(inr[:, [r for r in range(N) if names[r] == n]].any(1).sum())
                    for n in ("b", "a")]
            if nrdma2 is None or nrdma2.dtype != torch.int32 or nrdma2.tolist() != want:
                msgs.append(f"num_tokens_per_rdma_rank on nodes {names}: "
                            f"{None if nrdma2 is None else nrdma2.tolist()}, want {want}")
        err = layout_error(buf, idx, E, N)
        if err:
            msgs.append(f"get_dispatch_layout round {rnd}: {err}")
        xin = x
        if fp8:
            q8, sc = quant_ref(x)
            xin = (q8, sc)
        rx, ridx, rw, counts, handle, _ = buf.dispatch(
            xin, topk_idx=idx, topk_weights=w, num_tokens_per_rank=nr, is_token_in_rank=inr,
            num_tokens_per_expert=ne, expert_alignment=align, async_finish=True)
        rows = rx[0] if fp8 else rx
        if rows.shape[0] != len(exp_rows):
            msgs.append(f"normal dispatch fp8={fp8}: {rows.shape[0]} rows, want {len(exp_rows)}")
            continue
        bad = 0
        for j, (s, t) in enumerate(exp_rows):
            row = quant_ref(xs[s][t:t + 1])[0][0].view(torch.uint8) if fp8 else xs[s][t]
            got = rows[j].view(torch.uint8) if fp8 else rows[j]
            loc = [int(e) - rank * El if rank * El <= int(e) < rank * El + El else -1
                   for e in ids[s][t]]
            wl = [float(ws[s][t][k]) if loc[k] >= 0 else 0.0 for k in range(K)]
            bad += not torch.equal(got, row) or ridx[j].tolist() != loc or \
                rw[j].tolist() != wl
        want = [-(-sum(1 for s, t in exp_rows if (ids[s][t] == rank * El + le).any()) // align)
                * align for le in range(El)]
        if bad or counts != want or ridx.dtype != torch.int64:
            msgs.append(f"normal dispatch fp8={fp8}: {bad} wrong rows, counts {counts} want {want}")
        # the experts: each row's local experts, weighted and summed
        rowsf = (rx[0].float() * rx[1].repeat_interleave(128, 1)) if fp8 else rx.float()
        y = torch.zeros(rowsf.shape, dtype=torch.float32)
        for j in range(rowsf.shape[0]):
            for k in range(K):
                if int(ridx[j, k]) >= 0:
                    e = rank * El + int(ridx[j, k])
                    y[j] += float(rw[j, k]) * expert_fn(e, rowsf[j:j + 1]).float()[0]
        out, cw, _ = buf.combine(y.to(torch.bfloat16), handle, topk_weights=rw, async_finish=True)
        err = combine_error(out, combine_ref(x, idx, w, fp8))
        wref = torch.where(idx >= 0, w, torch.zeros_like(w))
        if err or not torch.equal(cw, wref):
            msgs.append(f"normal combine fp8={fp8}: {err or 'weights gathered back differ'}")
        # the cached handle: the same routing, new data
        if not fp8:
            x2 = (x.float() * 2).to(torch.bfloat16)
            r2 = buf.dispatch(x2, handle=handle)
            # DeepEP returns no handle either (slot 4 None)
            if r2[1:5] != (None, None, None, None) or \
                    not torch.equal(r2[0], (rx.float() * 2).to(torch.bfloat16)):
                msgs.append("normal dispatch with a cached handle: wrong rows or results")
            out2, cw2, _ = buf.combine(y.to(torch.bfloat16), handle)
            if not torch.equal(out2, out) or cw2 is not None:
                msgs.append("normal combine again on the handle: differs")
            # DeepEP's names for the calls across nodes, in its argument
            # order, every argument positional on a new route: config is
            # the tenth (no num_worst_tokens; a forwarding that put the
            # Config there would fail)
            r3 = buf.internode_dispatch(x, None, nr, None, inr, ne, idx, w, align,
                                        buf.get_dispatch_config(N))
            out3, cw3, _ = buf.internode_combine(y.to(torch.bfloat16), r3[4], r3[2], None,
                                                 buf.get_combine_config(N))
            if not torch.equal(r3[0], rx) or not torch.equal(r3[1], ridx) or \
                    not torch.equal(r3[2], rw) or r3[3] != counts or \
                    not torch.equal(out3, out) or not torch.equal(cw3, cw):
                msgs.append("internode_dispatch/internode_combine: differ from dispatch/combine")
    # num_worst_tokens: rows padded to the bound, -1 past the real ones
    x, idx, w = make_inputs(rank, 210, T, H, E, K, dev)
    nr, _, ne, inr, _ = buf.get_dispatch_layout(idx, E)
    bound = N * T
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=ne, num_worst_tokens=bound)
    real = int((ridx >= 0).any(1).sum())
    if rx.shape[0] != bound or counts != [] or bool((ridx[real:] >= 0).any()):
        msgs.append(f"num_worst_tokens: {rx.shape[0]} rows (want {bound}), counts {counts}")
    buf.combine(torch.zeros(rx.shape, dtype=torch.bfloat16), handle)
    # bias (one tensor or two): zero rows back, so out is the bias, added in
    # fp32 and rounded once
    g = torch.Generator().manual_seed(5 + rank)
    b0 = torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16)
    b1 = (torch.randn(x.shape[0], H, generator=g) * 3).to(torch.bfloat16)
    zeros = torch.zeros(rx.shape, dtype=torch.bfloat16)
    ob = buf.combine(zeros, handle, bias=(b0, b1))[0]
    if not torch.equal(ob, (b0.float() + b1.float()).to(torch.bfloat16)) or \
            not torch.equal(buf.combine(zeros, handle, bias=b0)[0], b0):
        msgs.append("normal combine with bias: out is not the bias summed and rounded once")
    expect(msgs, ValueError, "bias", buf.combine, zeros, handle, bias=(b0, b1, b0))
    expect(msgs, ValueError, "bias[0]", buf.combine, zeros, handle,
           bias=torch.zeros(x.shape[0] + 1, H, dtype=torch.bfloat16))
    expect(msgs, TypeError, "handle", buf.combine, torch.zeros(1, H), (1, 2))
    expect(msgs, ValueError, "x", buf.combine, torch.zeros(rx.shape[0] + 1, H,
                                                          dtype=torch.bfloat16), handle)
    expect(msgs, TypeError, "ferry.deep_ep.Buffer.dispatch", buf.dispatch, x, topk_idx=idx)
    # a cached dispatch of rows of another hidden size
    expect(msgs, ValueError, "x", buf.dispatch, torch.cat([x, x], 1), handle=handle)
    expect(msgs, ValueError, "num_worst_tokens", buf.dispatch, x, num_tokens_per_expert=ne,
           topk_idx=idx, num_worst_tokens=-4)
    try:  # another dtype of x: the message says what x must be
        buf.dispatch(x.float(), handle=handle)
        msgs.append("normal dispatch of float32 x: accepted")
    except TypeError as e:
        if "expected shape (T, H) bfloat16" not in str(e):
            msgs.append(f"normal dispatch of float32 x: {e}")
    if N > 1:  # not a multiple of the group size
        expect(msgs, ValueError, f"num_experts = {E + 1}", buf.get_dispatch_layout, idx, E + 1)
    # passed to libferry as C ints: outside their range a ValueError naming
    # them (ctypes would wrap 2**32 + 8 to 8), before anything is allocated
    expect(msgs, ValueError, "num_experts", buf.get_dispatch_layout, idx, N << 62)
    for v in (2**31, 2**32 + 8):
        expect(msgs, ValueError, "num_worst_tokens", buf.dispatch, x, topk_idx=idx,
               num_tokens_per_expert=ne, num_worst_tokens=v)
        expect(msgs, ValueError, "expert_alignment", buf.dispatch, x, topk_idx=idx,
               num_tokens_per_expert=ne, expert_alignment=v)
        expect(msgs, ValueError, "new_num_sms", deep_ep.Buffer.set_num_sms, v)
    expect(msgs, RuntimeError, "ferry.deep_ep.Buffer.low_latency_dispatch",
           buf.low_latency_dispatch, x, idx, T, E)
    buf.destroy()
    return msgs


def normal_deepep_checks(deep_ep, rank, N, dev=torch.device("cpu")):
    """What DeepEP's tests/test_intranode.py checks of normal mode, on
    tensors of `dev` (CPU ranks here, CUDA in test_torch_ht_cuda.py):
    handle[0] (rank_prefix_matrix) bounds each source's rows (across
    nodes, as DeepEP's tests/test_internode.py: the 10-tuple's handle[-4],
    recv_gbl_rank_prefix_sum); combined_topk_weights sums the weights of every rank's row; dispatch
    without top-k (is_token_in_rank alone), its per-expert counts, a cached
    dispatch and the combine of its handle."""
    msgs = []
    E, K, H, T = 4 * N, 3, 256, 20
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, low_latency_mode=False)
    _, idx, _ = make_inputs(rank, 300, T, H, E, K, dev)
    T = idx.shape[0]  # some ranks have no tokens
    x = torch.full((T, H), float(rank), dtype=torch.bfloat16, device=dev)
    w = torch.full((T, K), float(rank + 1), dtype=torch.float32, device=dev)
    nr, _, ne, inr, _ = buf.get_dispatch_layout(idx, E)
    nrs = [torch.zeros_like(nr) for _ in range(N)]
    torch.distributed.all_gather(nrs, nr)
    nes = [torch.zeros_like(ne) for _ in range(N)]
    torch.distributed.all_gather(nes, ne)
    want_prefix = torch.cumsum(torch.stack(nrs), 0, dtype=torch.int32).cpu()
    want_counts = sum(nes)[rank * El:(rank + 1) * El].tolist()

    internode = buf.runtime.get_num_rdma_ranks() > 1
    if internode != (test_nodes() > 1 and N > 1):
        msgs.append(f"{internode and 'across nodes' or 'within a node'} with "
                    f"FERRY_TEST_NODES={test_nodes()}")

    def by_source(rows, prefix, what):
        start = 0
        for i in range(N):
            end = int(prefix[i]) if internode else int(prefix[i][rank])
            if not bool((rows[start:end].float() == i).all()):
                msgs.append(f"{what}: rows {start}..{end} are not all source {i}'s")
            start = end
        if start != rows.shape[0]:
            msgs.append(f"{what}: {rows.shape[0]} rows, handle[0] says {start}")

    # DeepEP's test order: without top-k, then with, then without again
    for with_topk in (False, True, False):
        args = dict(num_tokens_per_rank=nr, is_token_in_rank=inr, num_tokens_per_expert=ne)
        if with_topk:
            args.update(topk_idx=idx, topk_weights=w)
        rx, ridx, rw, counts, handle, _ = buf.dispatch(x, **args)
        what = f"dispatch {'with' if with_topk else 'without'} top-k"
        if len(handle) != (10 if internode else 6):
            msgs.append(f"{what}: a handle of {len(handle)} fields (internode={internode})")
            continue
        if internode:
            prefix, want = handle[-4], want_prefix[:, rank]
            name = "handle[-4] (recv_gbl_rank_prefix_sum)"
            if not torch.equal(handle[0].cpu(), inr.cpu()):
                msgs.append(f"{what}: handle[0] is not is_token_in_rank")
            rdma = handle[4]
            nodes = handle.ep_nodes
            last = [max(r for r in range(N) if nodes[r] == k) for k in range(max(nodes) + 1)]
            if rdma is None or rdma.tolist() != want[last].tolist():
                msgs.append(f"{what}: handle[4] (recv_rdma_rank_prefix_sum) "
                            f"{None if rdma is None else rdma.tolist()}, want "
                            f"{want[last].tolist()}")
        else:
            prefix, want, name = handle[0], want_prefix, "handle[0] (rank_prefix_matrix)"
        if prefix is None or prefix.dtype != torch.int32 or \
                not torch.equal(prefix.cpu(), want):
            msgs.append(f"{what}: {name} {None if prefix is None else prefix.tolist()}, "
                        f"want {want.tolist()}")
            continue
        by_source(rx, prefix, what)
        if counts != want_counts:
            msgs.append(f"{what}: counts {counts}, want {want_counts}")
        src = handle[7] if internode else handle[3]
        if src is None or src.shape != (rx.shape[0],):
            msgs.append(f"{what}: recv_src_idx / recv_src_meta missing from the handle")
        if with_topk:
            # as the DeepEP test does: every slot of a row holds its source's weight
            rw = torch.where(ridx == -1, rw.amax(1, keepdim=True).expand_as(rw), rw)
            by_source(rw - 1, prefix, what + ", weights")
        else:
            if ridx is not None or rw is not None:
                msgs.append(f"{what}: recv_topk_idx/weights should be None")
            r2 = buf.dispatch(x, handle=handle)
            if not torch.equal(r2[0], rx):
                msgs.append(f"{what}: a cached dispatch gave other rows")
        out, cw, _ = buf.combine(rx, handle, topk_weights=rw if with_topk else None)
        nrank = inr.sum(1)
        want = (x.float() * nrank.view(-1, 1)).to(torch.bfloat16)
        if not torch.equal(out, want):
            msgs.append(f"{what}: combine differs from x times the token's ranks")
        if with_topk:
            # DeepEP's combined_topk_weights: the K slots of every rank's row summed
            cwant = w * nrank.view(-1, 1).float()
            if cw is None or not torch.equal(cw, cwant):
                got = cw[:2].tolist() if cw is not None else None
                msgs.append(f"{what}: combined_topk_weights {got}, want {cwant[:2].tolist()}")
    buf.destroy()
    return msgs


def rank_main(rank, N, port, q):
    try:
        torch_init(rank, N, port)
        from ferry import deep_ep
        E, K, H, T = 8 * N, 4, 512, 16
        buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True,
                             allow_mnnvl=True)
        msgs = ll_rounds(deep_ep, buf, rank, N, E, K, H, T)
        msgs += [f"argument checks: {m}" for m in ll_args(deep_ep, buf, rank, N, E, K, H, T)]
        buf.destroy()
        msgs += [f"declared shapes: {m}" for m in declared_shapes(deep_ep, rank, N)]
        msgs += [f"masking a rank: {m}" for m in ll_mask(deep_ep, rank, N)]
        msgs += [f"enable_shrink: {m}" for m in ll_mask(deep_ep, rank, N, shrink=True)]
        msgs += [f"normal mode: {m}" for m in normal_mode(deep_ep, rank, N)]
        msgs += [f"normal mode, DeepEP's checks: {m}"
                 for m in normal_deepep_checks(deep_ep, rank, N)]
        # as DeepEP's tests run: under a default-device mode (meta here, so
        # anything made without naming its device would be on no real one)
        with torch.device("meta"):
            msgs += [f"normal mode under a default-device mode: {m}"
                     for m in normal_deepep_checks(deep_ep, rank, N)]
        torch.distributed.destroy_process_group()
        q.put((rank, msgs))
    except Exception:
        q.put((rank, [traceback.format_exc()]))


def rank_main_normal(rank, N, port, q):
    """Normal mode alone (DeepEP's test checks), for ranks split into
    nodes (FERRY_TEST_NODES), where the handle is DeepEP's internode one."""
    try:
        torch_init(rank, N, port)
        from ferry import deep_ep
        msgs = [f"normal mode, DeepEP's checks: {m}"
                for m in normal_deepep_checks(deep_ep, rank, N)]
        torch.distributed.destroy_process_group()
        q.put((rank, msgs))
    except Exception:
        q.put((rank, [traceback.format_exc()]))


def rank_routing_checks():
    """A dispatch without top-k above 16 ranks: the ranks is_token_in_rank
    names gathered into 16 slots (each the rank's first expert), -1 for
    the rest; a token to more than 16 ranks refused naming the argument.
    No ranks needed (the routing is made before any call)."""
    from ferry.deep_ep import _Normal
    N, E = 40, 80
    g = torch.Generator().manual_seed(3)
    inr = torch.rand((9, N), generator=g) < 0.2
    inr[0] = False          # a token to no rank
    inr[1, :16] = True      # exactly 16
    inr[1, 16:] = False
    r = _Normal._rank_routing(inr, E)
    assert r.shape == (9, 16) and r.dtype == torch.int64, r.shape
    for t in range(9):
        got = sorted(int(e) // (E // N) for e in r[t] if e >= 0)
        assert all(int(e) % (E // N) == 0 for e in r[t] if e >= 0), r[t]
        assert got == inr[t].nonzero().flatten().tolist(), (t, got)
    inr[2] = False
    inr[2, 3:20] = True  # 17 ranks
    try:
        _Normal._rank_routing(inr, E)
    except ValueError as e:
        assert "is_token_in_rank" in str(e) and "17" in str(e), e
    else:
        raise AssertionError("a token to 17 ranks was accepted")
    small = torch.tensor([[True, False, True, False]])
    assert _Normal._rank_routing(small, 8).tolist() == [[0, -1, 4, -1]]


def main():
    """test_torch_cpu.py [normal] [N ...]: every check at each N ranks
    (default 1 2 3), or with `normal` the normal mode's alone."""
    args = sys.argv[1:]
    normal = bool(args) and args[0] == "normal"
    sizes = [int(a) for a in args[1 if normal else 0:]] or [1, 2, 3]
    rank_routing_checks()
    if normal:
        return ranks_main(rank_main_normal, sizes, "DeepEP normal mode on CPU tensors")
    return ranks_main(rank_main, sizes, "DeepEP API (low latency and normal mode) on CPU tensors")


if __name__ == "__main__":
    sys.exit(main())
