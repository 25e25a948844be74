#!/usr/bin/env python3
"""ferry from PyTorch on CUDA tensors (run on a GPU machine; ranks may share
one GPU under MPS). Usage: test_torch_cuda.py [nranks]

  1. DeepEP-compatible API at the DeepSeek-V3 decode shape (H 7168, E 256,
     top-8, 128 tokens), bf16 and fp8, with and without the receive hook:
     every expert's rows (bytes, scales, sources) and the combined output
     checked against a reference computed here.
     The same calls, experts included, captured in one CUDA graph and
     replayed with new routing. DeepEP's handle patterns: dispatch twice
     and combine the second; combine a handle twice (then zero copy).
  2. The native API captured in a CUDA graph (dispatch + combine, token
     count in device memory), replayed with new inputs, checked each time.
  3. Argument checks on CUDA tensors (native and DeepEP API): wrong shapes,
     dtypes, layouts and devices raise ValueError/TypeError naming the
     argument; a Comm closed before its EP closes after it.
Exit 77 (skipped) without torch or a usable GPU.
"""
import os
import sys
import traceback

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranks import gather_all, test_nodes, torch_init, torch_main  # noqa: E402
from ferry.reference import fp8_block_quant as quant_ref  # noqa: E402


def expert_fn(e, rows):
    return (rows.float() * (0.5 + 0.125 * (e % 13)) + 0.0625 * ((e * 7) % 11 - 5)).to(torch.bfloat16)


def make_inputs(rank, rnd, T, H, E, K, dev):
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    t = T if rank % 3 else (T if rnd % 2 else 0)  # some ranks send nothing
    cpu = torch.device("cpu")  # made on the CPU whatever the default device
    x = torch.randn(t, H, generator=g, device=cpu).to(torch.bfloat16)
    scores = torch.rand(t, E, generator=g, device=cpu) ** 4  # skewed
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(t, K, generator=g, device=cpu) < 0.05] = -1
    w = 0.1 + 0.9 * torch.rand(t, K, generator=g, device=cpu)
    return x.to(dev), idx.to(dev), w.float().to(dev)


def check_round(rank, N, E, K, x_all, idx_all, recv, count, src, fp8, round_scale=False):
    """Expected rows per local expert: sources from this rank on, wrapping
    (rank, rank + 1, ..., N - 1, 0, ..., rank - 1), then token."""
    El = E // N
    bad = 0
    srcs = [(rank + i) % N for i in range(N)]
    for le in range(El):
        e = rank * El + le
        exp = [(s, t) for s in srcs for t in range(idx_all[s].shape[0])
               if (idx_all[s][t] == e).any()]
        n = int(count[le])
        if n != len(exp):
            return f"expert {le}: {n} rows, expected {len(exp)}"
        if n == 0:
            continue
        sr, st = src[0][le, :n].cpu(), src[1][le, :n].cpu()
        if [(int(a), int(b)) for a, b in zip(sr, st)] != exp:
            return f"expert {le}: rows in the wrong order or from the wrong tokens"
        rows = torch.stack([x_all[s][t] for s, t in exp])
        if fp8:
            q, sc = quant_ref(rows, round_scale)
            if not torch.equal(recv[0][le, :n].view(torch.uint8).cpu(), q.view(torch.uint8).cpu()) \
                    or not torch.equal(recv[1][le, :n].cpu(), sc.cpu()):
                bad += 1
        elif not torch.equal(recv[le, :n].cpu(), rows.cpu()):
            bad += 1
    return f"{bad} experts with wrong bytes" if bad else None


def combine_ref(x, idx, w, fp8):
    out = torch.zeros(x.shape, dtype=torch.float64)
    xin = x.cpu()
    if fp8:
        q, sc = quant_ref(xin)
        xin = q.float() * sc.repeat_interleave(128, 1)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * expert_fn(e, xin[t:t + 1]).double()[0]
    return out


def expert_outputs(rank, El, recv, count, fp8, dev):
    """The experts' outputs to combine: each local expert's valid rows
    (dequantised when fp8) through expert_fn, zeros past them."""
    rows = recv[0].float() * recv[1].repeat_interleave(128, 2) if fp8 else recv.float()
    y = torch.zeros(rows.shape, dtype=torch.bfloat16, device=dev)
    for le in range(El):
        n = int(count[le])
        if n:
            y[le, :n] = expert_fn(rank * El + le, rows[le, :n])
    return y


def combine_error(out, ref):
    """None when the combined rows match the reference within bf16
    rounding, else the largest error as text."""
    got = out.double().cpu()
    if torch.all((got - ref).abs() <= ref.abs() / 128 + 1e-2):
        return None
    return f"max error {(got - ref).abs().max().item():.3e}"


def deep_ep_graph(buf, rank, N, E, K, H, T, dev):
    """DeepEP-style dispatch, the experts and combine captured in one CUDA
    graph and replayed with new tokens and routing: the calls allocate,
    synchronise and read nothing on the host, and reuse their buffers."""
    msgs = []
    El = E // N
    ee = torch.arange(rank * El, rank * El + El, device=dev)
    ea = (0.5 + 0.125 * (ee % 13)).float().view(El, 1, 1)   # expert_fn, vectorised
    eb = (0.0625 * ((ee * 7) % 11 - 5)).float().view(El, 1, 1)
    x0, i0, w0 = make_inputs(rank, 101, T, H, E, K, dev)   # odd round: every rank has T tokens
    sx, si, sw = x0.clone(), i0.clone(), w0.clone()
    recv, count, handle, _, _ = buf.low_latency_dispatch(sx, si, T, E, use_fp8=False)
    buf.low_latency_combine((recv.float() * ea + eb).to(torch.bfloat16), si, sw, handle)
    torch.cuda.synchronize()
    g, gs = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(gs):
        with torch.cuda.graph(g, stream=gs):
            recv, count, handle, _, _ = buf.low_latency_dispatch(sx, si, T, E, use_fp8=False)
            y = (recv.float() * ea + eb).to(torch.bfloat16)
            out, _, _ = buf.low_latency_combine(y, si, sw, handle)
    # a shape never called before: its context cannot be made inside a
    # capture; refused by name before anything reaches CUDA (every rank)
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(gs):
            with torch.cuda.graph(g2, stream=gs):
                buf.low_latency_dispatch(sx[:, :H - 128].contiguous(), si, T, E, use_fp8=False)
        msgs.append("a new shape's first dispatch inside a capture was not refused")
    except Exception as e:  # the capture may add its own error on exit
        text = f"{e!r} {e.__context__!r}"
        if "inside a CUDA graph capture" not in text:
            msgs.append(f"new shape inside a capture: {text}")
    torch.cuda.synchronize()
    for rep in range(3):
        xi, ii, wi = make_inputs(rank, 103 + 2 * rep, T, H, E, K, dev)
        sx.copy_(xi)
        si.copy_(ii)
        sw.copy_(wi)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        g.replay()
        torch.cuda.synchronize()
        err = combine_error(out, combine_ref(xi, ii.cpu(), wi.cpu(), False))
        if err:
            msgs.append(f"deep_ep graph replay {rep}: {err}")
    return msgs


def deep_ep_twice(buf, rank, N, E, K, H, T, dev):
    """What DeepEP's tests/test_low_latency.py does with handles: dispatch
    twice and combine only the second (the first handle is dropped), then
    combine that handle twice, the second time with zero_copy=True from
    get_next_low_latency_combine_buffer(handle); bf16 and fp8, one launch
    and hooks; then a plain round, to see the rounds still in step."""
    msgs = []
    El = E // N
    rnd = 200
    for fp8 in (False, True):
        for hook_mode in (False, True):
            for i in range(2):  # the first of the two is never combined
                rnd += 1
                x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
                recv, count, handle, ev, hook = buf.low_latency_dispatch(
                    x, idx, T, E, use_fp8=fp8, return_recv_hook=hook_mode)
                if hook_mode and i == 1:  # the dropped round's receive never ran
                    hook()
            torch.cuda.synchronize()
            xs, ids = gather_all(N, x, idx)
            err = check_round(rank, N, E, K, xs, ids, recv, count, (handle.src_rank, handle[0]),
                              fp8)
            if err:
                msgs.append(f"twice fp8={fp8} hook={hook_mode}: second dispatch: {err}")
            y = expert_outputs(rank, El, recv, count, fp8, dev)
            ref = combine_ref(x, idx.cpu(), w.cpu(), fp8)
            for zero_copy in (False, True):
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device=dev)
                out, ev, hook = buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy,
                                                        return_recv_hook=hook_mode, out=out)
                if hook_mode:
                    hook()
                torch.cuda.synchronize()
                err = combine_error(out, ref)
                if err:
                    msgs.append(f"twice fp8={fp8} hook={hook_mode} zero_copy={zero_copy}: "
                                f"combine {err}")
    # dispatch twice, combine the second once, dispatch again (the dropped
    # round is settled by that dispatch), then a plain round: all checked
    for rnd in (291, 292, 293, 295):
        x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        if rnd == 291:
            continue  # dropped
        torch.cuda.synchronize()
        xs, ids = gather_all(N, x, idx)
        err = check_round(rank, N, E, K, xs, ids, recv, count, (handle.src_rank, handle[0]),
                          False)
        if err:
            msgs.append(f"round {rnd} after a dropped one: dispatch: {err}")
        y = expert_outputs(rank, El, recv, count, False, dev)
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        err = combine_error(out, combine_ref(x, idx.cpu(), w.cpu(), False))
        if err:
            msgs.append(f"round {rnd} after a dropped one: combine {err}")
    # two handles held and a third dispatch (DeepEP allows it): the first
    # round is settled when its buffer set is needed; combining its held
    # handle later dispatches its routing again; all three combine right
    rounds = []
    for rnd in (297, 298, 299):
        x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        # the experts' outputs now: recv is reused two rounds later
        y = expert_outputs(rank, El, recv, count, False, dev)
        rounds.append((rnd, x, idx, w, y, handle))
    for rnd, x, idx, w, y, handle in (rounds[2], rounds[1], rounds[0]):
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        err = combine_error(out, combine_ref(x, idx.cpu(), w.cpu(), False))
        if err:
            msgs.append(f"round {rnd} of three held handles: combine {err}")
    return msgs


def expect(msgs, exc, name, fn, *args, **kw):
    """fn raises exc with a message naming the argument; else a message."""
    try:
        fn(*args, **kw)
    except exc as e:
        if not str(e).startswith(name + ":"):
            msgs.append(f"{name}: message does not name it: {e}")
        return
    except Exception as e:
        msgs.append(f"{name}: raised {type(e).__name__}({e}), expected {exc.__name__}")
        return
    msgs.append(f"{name}: accepted, expected {exc.__name__}")


def scratch_buffer(deep_ep, rank, N, E, K, H, T, dev=torch.device("cpu")):
    """get_local_buffer_tensor: buffers of the sizes given to Buffer(), in
    DeepEP's units (byte offset, elements of dtype), writable, zeroed at
    first, on the rank's device (the GPU where there is one, as DeepEP's),
    and apart from ferry's memory both ways: a round after every byte of
    both was overwritten is still right, and leaves them as written.
    Collective (a Buffer of its own; dev: the rounds' tensors)."""
    msgs = []
    nvl, rdma = 4096, 3 * 4096
    want_dev = "cuda" if torch.cuda.is_available() else "cpu"
    El = E // N
    b = deep_ep.Buffer(torch.distributed.group.WORLD, nvl, rdma, low_latency_mode=True)
    try:
        # a round first, so that ferry's context exists when they are made
        x, idx, w = make_inputs(rank, 76, T, H, E, K, dev)
        recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        b.low_latency_combine(expert_outputs(rank, El, recv, count, False, dev), idx, w, handle)
        t = b.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
        u = b.get_local_buffer_tensor(torch.uint8)
        if t.dtype != torch.bfloat16 or t.numel() != rdma // 2 or u.numel() != nvl \
                or t.device.type != want_dev or int(t.view(torch.uint8).sum()) != 0 \
                or int(u.sum()) != 0:
            msgs.append(f"get_local_buffer_tensor: {t.dtype} {t.numel()} {u.numel()} "
                        f"{t.device}, want bf16 {rdma // 2} and {nvl} zeroed on {want_dev}")
        v = b.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=64,
                                      use_rdma_buffer=True)
        v.fill_(0x01020304)
        raw = b.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        if tuple(v.shape) != (4, 8) or raw[64:64 + 128].view(torch.int32).tolist() != \
                [0x01020304] * 32 or int(raw[:64].sum()) + int(raw[192:].sum()) != 0:
            msgs.append("get_local_buffer_tensor: the view at offset 64 is not that slice")
        if b.get_local_buffer_tensor(torch.int32, offset=rdma - 8,
                                     use_rdma_buffer=True).numel() != 2:
            msgs.append("get_local_buffer_tensor: offset near the end, wrong length")
        expect(msgs, ValueError, "offset", b.get_local_buffer_tensor, torch.int32, None, 2)
        expect(msgs, ValueError, "offset", b.get_local_buffer_tensor, torch.uint8, None, -1)
        expect(msgs, ValueError, "offset", b.get_local_buffer_tensor, torch.uint8, None, nvl + 1)
        if b.get_local_buffer_tensor(torch.uint8, 16).numel() != 16:
            msgs.append("get_local_buffer_tensor: an int size, wrong length")
        expect(msgs, ValueError, "size", b.get_local_buffer_tensor, torch.uint8,
               torch.Size([nvl + 1]))
        expect(msgs, ValueError, "size", b.get_local_buffer_tensor, torch.uint8, (-1,))
        expect(msgs, TypeError, "size", b.get_local_buffer_tensor, torch.uint8, 2.5)
        expect(msgs, TypeError, "offset", b.get_local_buffer_tensor, torch.uint8, None, 1.0)
        expect(msgs, TypeError, "dtype", b.get_local_buffer_tensor, "bf16")
        # scribbled over, then a round: still right (ferry never reads them)
        # and they hold what was written (ferry never writes them)
        raw.fill_(0xFF)
        u.fill_(0xFF)
        x, idx, w = make_inputs(rank, 77, T, H, E, K, dev)
        recv, count, handle, _, _ = b.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        y = expert_outputs(rank, El, recv, count, False, dev)
        out, _, _ = b.low_latency_combine(y, idx, w, handle)
        err = combine_error(out, combine_ref(x, idx, w, False))
        if err:
            msgs.append(f"a round after get_local_buffer_tensor was overwritten: {err}")
        if int((raw != 0xFF).sum()) or int((u != 0xFF).sum()):
            msgs.append("get_local_buffer_tensor: a round changed the buffer's bytes")
    finally:
        b.destroy()
    expect(msgs, RuntimeError, "get_local_buffer_tensor", b.get_local_buffer_tensor,
           torch.uint8)
    if b.runtime.is_available():
        msgs.append("runtime.is_available(): True after destroy()")
    return msgs


def check_args(ferry, deep_ep, N, dev):
    """Bad CUDA arguments are refused before they reach libferry."""
    msgs = []
    E, K, H, T = 4 * N, 4, 256, 16
    comm = ferry.Comm(torch.distributed.group.WORLD)
    ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, dtype="fp8",
                  device="cuda", num_sms=4)
    El, cap = ep.num_local_experts, ep.capacity
    x = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    w = torch.zeros(T, K, dtype=torch.float32, device=dev)
    expect(msgs, ValueError, "x", ep.dispatch_send, x[:, :8].contiguous(), idx)
    expect(msgs, ValueError, "x", ep.dispatch_send, torch.zeros(T + 1, H, dtype=torch.bfloat16,
                                                                 device=dev),
           torch.full((T + 1, K), -1, dtype=torch.int64, device=dev))
    expect(msgs, TypeError, "x", ep.dispatch_send, x.float(), idx)
    expect(msgs, ValueError, "x", ep.dispatch_send,
           torch.zeros(H, T, dtype=torch.bfloat16, device=dev).t(), idx)  # non-contiguous
    expect(msgs, ValueError, "x", ep.dispatch_send, x.cpu(), idx)         # device
    expect(msgs, ValueError, "topk_idx", ep.dispatch_send, x, idx.cpu())
    expect(msgs, ValueError, "topk_idx", ep.dispatch_send, x, idx[:, :2].contiguous())
    expect(msgs, TypeError, "topk_idx", ep.dispatch_send, x, idx.int())
    expect(msgs, ValueError, "x_scales", ep.dispatch_send, x.to(torch.float8_e4m3fn), idx,
           x_scales=torch.ones(1, dtype=torch.float32, device=dev))
    expect(msgs, ValueError, "num_tokens", ep.dispatch_send, x[:T // 2].contiguous(),
           idx[:T // 2].contiguous(), num_tokens=torch.zeros(1, dtype=torch.int32, device=dev))
    r = ep.dispatch_send(x, idx)
    b = ep.alloc(torch)
    for k, bad, exc in (
            ("expert_x", torch.empty(El, cap // 2, H, dtype=torch.float8_e4m3fn, device=dev),
             ValueError),
            ("expert_x", torch.empty(El, cap, H, dtype=torch.bfloat16, device=dev), TypeError),
            ("expert_x", torch.empty(El, cap, H, dtype=torch.float8_e4m3fn), ValueError),
            ("expert_x_scales", torch.empty(El, cap, 1, dtype=torch.float32, device=dev),
             ValueError),
            ("expert_x_scales", None, TypeError),
            ("expert_num_tokens", torch.empty(1, dtype=torch.int32, device=dev), ValueError),
            ("expert_src_rank", torch.empty(El, 1, dtype=torch.int32, device=dev), ValueError)):
        expect(msgs, exc, k, ep.dispatch_recv, r, **dict(b, **{k: bad}))
    ep.dispatch_recv(r, **b)
    y = torch.zeros(El, cap, H, dtype=torch.bfloat16, device=dev)
    expect(msgs, ValueError, "expert_y", ep.combine_send, r, y[:, :1].contiguous())
    ep.combine_send(r, y)
    out = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    expect(msgs, ValueError, "topk_weights", ep.combine_recv, r,
           torch.ones(1, dtype=torch.float32, device=dev), out)
    expect(msgs, ValueError, "out", ep.combine_recv, r, w, out[:T // 2])
    expect(msgs, TypeError, "out", ep.combine_recv, r, w, out.float())
    expect(msgs, ValueError, "out", ep.combine_recv, r, w, out.cpu())
    ep.combine_recv(r, w, out)
    ep.sync()
    comm.close()     # deferred: ep is open
    ep.close()       # closes comm too
    ep.close()
    expect(msgs, ValueError, "EP", ep.dispatch_send, x, idx)

    buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True)
    expect(msgs, ValueError, "topk_idx", buf.low_latency_dispatch, x, idx[:, 0], T, E)
    expect(msgs, ValueError, "topk_idx", buf.low_latency_dispatch, x, idx[:T // 2], T, E)
    expect(msgs, TypeError, "x", buf.low_latency_dispatch, x.float(), idx, T, E)
    expect(msgs, ValueError, "x", buf.low_latency_dispatch, x, idx, T // 2, E)  # T > max
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    y = torch.zeros(recv.shape, dtype=torch.bfloat16, device=dev)
    expect(msgs, ValueError, "x", buf.low_latency_combine, y[:, :1], idx, w, handle)
    expect(msgs, ValueError, "topk_weights", buf.low_latency_combine, y, idx, w[:1], handle)
    expect(msgs, ValueError, "out", buf.low_latency_combine, y, idx, w, handle,
           out=torch.empty(T // 2, H, dtype=torch.bfloat16, device=dev))
    expect(msgs, TypeError, "handle", buf.low_latency_combine, y, idx, w, (1, 2))
    buf.low_latency_combine(y, idx, w, handle)
    # cumulative_local_expert_recv_stats: checked, then the counts added in
    # place (one launch, and through the hook). Routing of its own: every
    # token to K distinct experts, so counts and outputs are not zero.
    El = E // N
    me = torch.distributed.get_rank()
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    idx = ((torch.arange(T, device=dev)[:, None] + 3 * torch.arange(K, device=dev)[None, :] + me)
           % E).to(torch.int64)
    w = 0.5 + torch.rand(T, K, device=dev)
    expect(msgs, TypeError, "cumulative_local_expert_recv_stats", buf.low_latency_dispatch,
           x, idx, T, E, cumulative_local_expert_recv_stats=torch.zeros(El, device=dev))
    expect(msgs, ValueError, "cumulative_local_expert_recv_stats", buf.low_latency_dispatch,
           x, idx, T, E,
           cumulative_local_expert_recv_stats=torch.zeros(El + 1, dtype=torch.int32, device=dev))
    stats = torch.full((El,), 5, dtype=torch.int32, device=dev)
    total = torch.full((El,), 5, dtype=torch.int32, device=dev)
    for hooked in (False, True):
        _, count, handle, _, hook = buf.low_latency_dispatch(
            x, idx, T, E, use_fp8=False, cumulative_local_expert_recv_stats=stats,
            return_recv_hook=hooked)
        if hook is not None:
            hook()
        total += count
        buf.low_latency_combine(y, idx, w, handle)
    torch.cuda.synchronize()
    if not torch.equal(stats, total) or int(total.sum()) == 5 * El:
        msgs.append(f"cumulative_local_expert_recv_stats: {stats.tolist()}, want 5 + the "
                    f"(nonzero) counts {total.tolist()}")
    # wait-cost stats (DeepEP's int64 [num_ranks]): checked, then cycles
    # added per source rank, through one launch and through the hooks;
    # dispatch skips waiting for itself (own rows written in place), the
    # combine waits for every rank, itself included
    expect(msgs, TypeError, "dispatch_wait_recv_cost_stats", buf.low_latency_dispatch,
           x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(N, device=dev))
    expect(msgs, ValueError, "dispatch_wait_recv_cost_stats", buf.low_latency_dispatch,
           x, idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(N + 1, dtype=torch.int64,
                                                                   device=dev))
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    expect(msgs, ValueError, "combine_wait_recv_cost_stats", buf.low_latency_combine, y, idx, w,
           handle, combine_wait_recv_cost_stats=torch.zeros((N, N), dtype=torch.int64,
                                                            device=dev))
    # LogFMT takes a hidden size that is a multiple of 512 (H is 256 here)
    expect(msgs, ValueError, "use_logfmt", buf.low_latency_combine, y, idx, w, handle,
           use_logfmt=True)
    buf.low_latency_combine(y, idx, w, handle)
    for hooked in (False, True):
        dws = torch.zeros(N, dtype=torch.int64, device=dev)
        cws = torch.zeros(N, dtype=torch.int64, device=dev)
        _, _, handle, _, hook = buf.low_latency_dispatch(
            x, idx, T, E, use_fp8=False, dispatch_wait_recv_cost_stats=dws,
            return_recv_hook=hooked)
        if hook is not None:
            hook()
        _, _, hook = buf.low_latency_combine(y, idx, w, handle,
                                             combine_wait_recv_cost_stats=cws,
                                             return_recv_hook=hooked)
        if hook is not None:
            hook()
        torch.cuda.synchronize()
        d, c = dws.tolist(), cws.tolist()
        # one launch: own rows written in place by the send, nothing waited
        # for; with the hook the receive waits for its own slice too, and
        # so does a rank with peers on the fabric path (ranks split into
        # nodes, FERRY_TEST_NODES): its own tokens go through its slice
        split = test_nodes() > 1 and N > 1
        own_ok = d[me] > 0 if hooked or split else d[me] == 0
        if any(v <= 0 for r, v in enumerate(d) if r != me) or not own_ok or \
                any(v <= 0 for v in c):
            msgs.append(f"wait-cost stats (hook {hooked}): dispatch {d} (want > 0 for the "
                        f"other ranks, {'> 0' if hooked or split else '0'} for rank {me}), "
                        f"combine {c} "
                        f"(want all > 0)")
    # async_finish: a real event, recorded after the launches
    _, _, handle, ev, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False,
                                                   async_finish=True)
    ev.current_stream_wait()
    o2, ev2, _ = buf.low_latency_combine(y, idx, w, handle, async_finish=True)
    ev2.current_stream_wait()
    if not (isinstance(ev.event, torch.cuda.Event) and isinstance(ev2.event, torch.cuda.Event)):
        msgs.append(f"async_finish=True: events {ev.event!r}, {ev2.event!r}, want CUDA events")
    cs = buf.get_comm_stream()
    if not isinstance(cs, torch.cuda.Stream) or cs == torch.cuda.current_stream() or \
            cs.device.index != torch.cuda.current_device() or cs != buf.get_comm_stream():
        msgs.append(f"get_comm_stream: {cs!r}, want the Buffer's own stream on the current device, "
                    f"not the current stream, the same one every call")
    msgs += scratch_buffer(deep_ep, me, N, E, K, H, T, dev)
    # zero copy: the experts write into get_next_low_latency_combine_buffer;
    # the same rounds with and without it combine to the same bytes
    yv = torch.randn(y.shape, device=dev).to(torch.bfloat16)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    ref = buf.low_latency_combine(yv, idx, w, handle)[0].clone()
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    buf.get_next_low_latency_combine_buffer(handle).copy_(yv)
    zc = buf.low_latency_combine(torch.zeros_like(yv), idx, w, handle, zero_copy=True)[0]
    torch.cuda.synchronize()
    if not torch.equal(zc, ref) or not ref.abs().sum().item() > 0:
        msgs.append(f"zero_copy: differs from the copied combine or is zero "
                    f"(max diff {(zc.float() - ref.float()).abs().max().item()}, "
                    f"|ref| {ref.float().abs().sum().item()})")
    expect(msgs, TypeError, "handle", buf.get_next_low_latency_combine_buffer, (1, 2))
    cfg = deep_ep.Config(24, 6, 256, 8, 128)
    if cfg.num_max_rdma_chunked_recv_tokens != 128 or not deep_ep.Buffer.is_sm90_compiled():
        msgs.append(f"Config / is_sm90_compiled: {cfg!r}")
    deep_ep.Buffer.capture().current_stream_wait()
    buf.clean_low_latency_buffer(T, H, E)
    torch.cuda.synchronize()
    buf.destroy()
    b2 = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True,
                        allow_mnnvl=True)
    if not (b2.allow_mnnvl and b2.low_latency_mode):
        msgs.append("allow_mnnvl=True: not kept")
    b2.destroy()
    return [f"argument checks: {m}" for m in msgs]


def rank_main(rank, N, port, q):
    try:
        torch_init(rank, N, port)
        dev = torch.device("cuda")
        import ferry
        from ferry import deep_ep
        msgs = []
        E, K, H, T = 256, 8, 7168, 128
        buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0,
                             deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, N, E),
                             low_latency_mode=True, num_qps_per_rank=1)
        rnd = 0
        for fp8 in (False, True):
            for hook_mode in (False, True):
                rnd += 1
                x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
                xs, ids = gather_all(N, x, idx)
                recv, count, handle, ev, hook = buf.low_latency_dispatch(
                    x, idx, T, E, use_fp8=fp8, return_recv_hook=hook_mode)
                if hook_mode:
                    hook()
                torch.cuda.synchronize()
                err = check_round(rank, N, E, K, xs, ids, recv, count, (handle.src_rank, handle[0]), fp8)
                if err:
                    msgs.append(f"dispatch fp8={fp8} hook={hook_mode}: {err}")
                # DeepEP's handle: [0] each row's source token, [1] begin << 32 | count
                # per source rank, then T, H, E
                lr = handle[1].cpu()
                sr_h = handle.src_rank.cpu()
                if len(handle) != 5 or tuple(handle[2:]) != (T, H, E) or \
                        handle[1].dtype != torch.int64 or tuple(lr.shape) != (E // N, N):
                    msgs.append(f"handle: {len(handle)} items, {tuple(handle[2:])}")
                for le in range(E // N):
                    n = int(count[le])
                    if int((lr[le] & 0xFFFFFFFF).sum()) != n:
                        msgs.append(f"handle[1] expert {le}: counts do not sum to {n}")
                        break
                    for j in range(N):
                        b, c = int(lr[le, j] >> 32), int(lr[le, j] & 0xFFFFFFFF)
                        if c and not bool((sr_h[le, b:b + c] == j).all()):
                            msgs.append(f"handle[1] expert {le} rank {j}: rows {b}..{b + c} "
                                        f"are not all from rank {j}")
                y = expert_outputs(rank, E // N, recv, count, fp8, dev)
                out, ev, hook = buf.low_latency_combine(y, idx, w, handle,
                                                        return_recv_hook=hook_mode)
                if hook_mode:
                    hook()
                torch.cuda.synchronize()
                err = combine_error(out, combine_ref(x, idx.cpu(), w.cpu(), fp8))
                if err:
                    msgs.append(f"combine fp8={fp8} hook={hook_mode}: {err}")
        # round_scale with UE8M0 scales (packed int32, column-major), both
        # forms of the call
        for hook_mode in (False, True):
            rnd += 1
            x, idx, w = make_inputs(rank, rnd, T, H, E, K, dev)
            xs, ids = gather_all(N, x, idx)
            (qx, packed), count, handle, ev, hook = buf.low_latency_dispatch(
                x, idx, T, E, use_fp8=True, round_scale=True, use_ue8m0=True,
                return_recv_hook=hook_mode)
            if hook_mode:
                hook()
            torch.cuda.synchronize()
            El = E // N
            if packed.dtype != torch.int32 or tuple(packed.shape) != (El, qx.shape[1], H // 512) \
                    or packed.stride()[1] != 1:
                msgs.append(f"ue8m0: packed scales {packed.dtype} {tuple(packed.shape)} "
                            f"strides {packed.stride()}")
                continue
            exps = torch.stack([(packed >> (8 * j)) & 0xFF for j in range(4)], dim=3)
            scales = (exps.reshape(El, qx.shape[1], H // 128) << 23).view(torch.float32)
            err = check_round(rank, N, E, K, xs, ids, (qx, scales), count, (handle.src_rank, handle[0]),
                              True, round_scale=True)
            if err:
                msgs.append(f"round_scale/ue8m0 hook={hook_mode}: {err}")
            out, ev, hook = buf.low_latency_combine(torch.zeros(qx.shape, dtype=torch.bfloat16,
                                                                device=dev), idx, w, handle)
        msgs += deep_ep_graph(buf, rank, N, E, K, H, T, dev)
        msgs += deep_ep_twice(buf, rank, N, E, K, H, T, dev)
        buf.destroy()

        # native API captured in a CUDA graph and replayed
        comm = ferry.Comm(torch.distributed.group.WORLD)
        E2, K2, H2, T2 = 8 * N, 4, 512, 32
        ep = ferry.EP(comm, num_experts=E2, topk=K2, hidden=H2, max_tokens=T2,
                      dtype="bf16", device="cuda", num_sms=4)
        bufs = ep.alloc(torch)
        x = torch.zeros(T2, H2, dtype=torch.bfloat16, device=dev)
        idx = torch.full((T2, K2), -1, dtype=torch.int64, device=dev)
        w = torch.zeros(T2, K2, dtype=torch.float32, device=dev)
        ntok = torch.zeros(1, dtype=torch.int32, device=dev)
        y = torch.zeros(ep.num_local_experts, ep.capacity, H2, dtype=torch.bfloat16, device=dev)
        out = torch.zeros(T2, H2, dtype=torch.bfloat16, device=dev)
        s = torch.cuda.Stream()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g1, stream=s):
                r = ep.dispatch_send(x, idx, num_tokens=ntok)
                ep.dispatch_recv(r, **bufs)
            with torch.cuda.graph(g2, stream=s):
                ep.combine_send(r, y)
                ep.combine_recv(r, w, out)
        for rep in range(1, 21):
            xi, ii, wi = make_inputs(rank, 100 + rep, T2, H2, E2, K2, dev)
            t = xi.shape[0]
            x[:t].copy_(xi)
            idx[:t].copy_(ii)
            w[:t].copy_(wi)
            ntok.fill_(t)
            xs, ids = gather_all(N, xi, ii)
            torch.cuda.synchronize()
            g1.replay()
            ep.sync(s.cuda_stream)
            err = check_round(rank, N, E2, K2, xs, ids, bufs["expert_x"], bufs["expert_num_tokens"],
                              (bufs["expert_src_rank"], bufs["expert_src_token"]), False)
            if err:
                msgs.append(f"graph replay {rep} dispatch: {err}")
                break
            El = ep.num_local_experts
            for le in range(El):
                n = int(bufs["expert_num_tokens"][le])
                if n:
                    y[le, :n] = expert_fn(rank * El + le, bufs["expert_x"][le, :n])
            torch.cuda.synchronize()
            torch.distributed.barrier()
            g2.replay()
            ep.sync(s.cuda_stream)
            err = combine_error(out[:t], combine_ref(xi, ii.cpu(), wi.cpu(), False))
            if err:
                msgs.append(f"graph replay {rep} combine: {err}")
                break
        ep.close()
        comm.close()
        msgs += check_args(ferry, deep_ep, N, dev)
        torch.distributed.destroy_process_group()
        q.put((rank, msgs))
    except Exception:
        q.put((rank, [traceback.format_exc()]))


def main():
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    title = (f"test_torch_cuda ({N} ranks): DeepEP API bf16/fp8 with and without hook, "
             "graph replays, argument checks")
    sys.exit(torch_main(rank_main, N, title))


if __name__ == "__main__":
    main()
