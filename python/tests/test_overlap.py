#!/usr/bin/env python3
"""The overlapped low-latency combine (sgl-deep-ep's): rows leave as the
computation writing them raises its signals. Usage: test_overlap.py
[cpu|cuda] [nranks] (cuda: ranks sharing the current GPU).

A stand-in for the down GEMM (a thread on CPU ranks; kernels on a stream of
their own on CUDA ranks, with delays between them) writes each signal's
rows of expert_y, which held garbage (1e30) before, and only then raises
that signal, in steps (1, 2, then the value waited for: a combine that went
on anything but equality would send rows not yet written). Checked:

  - ferry.EP.combine_send(signals=..., signal_block=0 | B, sent_rows=...):
    before the last signal rises, the rows of the signals already raised
    have left (sent_rows counts them: on CPU ranks exactly those rows, on
    CUDA ranks some and never more), and the last signal's rows have not;
    at the end sent_rows counts every row;
  - the combined output equals, bit for bit, a plain combine of the same
    rows over the same routing, and the reference sum within bf16
    rounding; signals of blocks and experts with no rows are never
    raised (not waited for);
  - deep_ep.Buffer.low_latency_combine in both of sgl-deep-ep's forms:
    overlap=True with src_signals (uint32, one per local expert,
    src_signal_expect_value) and with comp_signal (int32, one per block of
    block_m rows, threshold, packed_recv_count), with and without
    return_recv_hook, each equal to the plain combine;
  - a signal never raised ends the combine in ferry's timeout naming the
    local expert and the signal's index; bad arguments name themselves.

Routing: Zipf-like skew, masked (-1) slots, a rank with no tokens in
alternate rounds, weights that do not sum to 1, a different transform per
expert, back-to-back rounds with changing routing. Exit 77 without torch
(or without a GPU for cuda).
"""
import os
import sys
import threading
import time
import traceback

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranks import ranks_main, torch_init  # noqa: E402
from test_torch_cuda import combine_error, combine_ref, expert_outputs, make_inputs  # noqa: E402

H, K, T = 256, 4, 24
GARBAGE = 1e30
VALUE = 3  # the value a signal is raised to, in steps 1, 2, 3


def expected_rows(y_full, count, El, cap, block):
    """The signals with rows: [(index, expert, first row, end row)] in
    raising order (expert by expert, block by block)."""
    out = []
    bs = block if block else cap
    nb = -(-cap // bs)
    for e in range(El):
        n = int(count[e])
        for b in range(nb):
            r0, r1 = b * bs, min((b + 1) * bs, n)
            if r1 > r0:
                out.append((e * nb + b, e, r0, r1))
    return out, nb


def raise_cpu(y, y_full, sig, sigs, sent, snap):
    """The stand-in GEMM on CPU ranks (a thread): each signal's rows written
    in two halves between the steps 1, 2, 3. Before the last signal rises,
    waits (up to 10 s) for sent_rows to reach the rows already raised and
    keeps what it read in snap."""
    for i, (idx, e, r0, r1) in enumerate(sigs):
        time.sleep(0.003)
        if i == len(sigs) - 1 and sent is not None:
            want = sum(q[3] - q[2] for q in sigs[:-1])
            t0 = time.time()
            while int(sent.sum()) < want and time.time() - t0 < 10:
                time.sleep(0.001)
            time.sleep(0.02)  # time for a wrong send of the last rows to show
            snap.append(int(sent.sum()))
        mid = (r0 + r1) // 2
        sig[idx] = 1
        y[e, r0:mid] = y_full[e, r0:mid]
        sig[idx] = 2
        y[e, mid:r1] = y_full[e, mid:r1]
        sig[idx] = VALUE


def raise_cuda(y, y_full, sig, sigs, sent, snap, stream):
    """The stand-in GEMM on CUDA ranks: the same steps as kernels on
    `stream`, a sleep before each signal; before the last one a longer
    sleep, then sent_rows copied (what had left by then)."""
    with torch.cuda.stream(stream):
        for i, (idx, e, r0, r1) in enumerate(sigs):
            torch.cuda._sleep(200_000)
            if i == len(sigs) - 1 and sent is not None:
                torch.cuda._sleep(4_000_000)
                snap.append(sent.clone())
            mid = (r0 + r1) // 2
            sig[idx:idx + 1].fill_(1)
            y[e, r0:mid].copy_(y_full[e, r0:mid])
            sig[idx:idx + 1].fill_(2)
            y[e, mid:r1].copy_(y_full[e, mid:r1])
            sig[idx:idx + 1].fill_(VALUE)


def ep_rounds(ferry, comm, rank, N, E, dev, cuda):
    """ferry.EP's combine_send with signals against a plain combine."""
    msgs = []
    El = E // N
    ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, device=dev.type,
                  num_sms=4 if cuda else 0)
    cap = ep.capacity
    side = torch.cuda.Stream() if cuda else None
    try:
        for rnd, block in enumerate((0, 3, 0, 5)):
            x, idx, w = make_inputs(rank, 40 + rnd, T, H, E, K, dev)
            t = x.shape[0]
            res = []
            for overlap in (True, False):  # the same routing twice
                bufs = ep.alloc(torch)
                r = ep.dispatch(x, idx, num_tokens=t, **bufs)
                count = bufs["expert_num_tokens"].cpu()
                y_full = expert_outputs(rank, El, bufs["expert_x"], count, False, dev)
                out = torch.empty((t, H), dtype=torch.bfloat16, device=dev)
                if not overlap:
                    ep.combine(r, y_full, w, out)
                    res.append(out)
                    continue
                sigs, nb = expected_rows(y_full, count, El, cap, block)
                sig = torch.zeros(El * nb, dtype=torch.uint32 if rnd % 2 == 0 else torch.int32,
                                  device=dev)
                sent = torch.zeros(El, dtype=torch.int32, device=dev)
                y = torch.full(y_full.shape, GARBAGE, dtype=torch.bfloat16, device=dev)
                snap = []
                if cuda:
                    side.wait_stream(torch.cuda.current_stream())
                    raise_cuda(y, y_full, sig, sigs, sent, snap, side)
                    # round 1: the combine's kernels on one SM (num_sms), the
                    # GEMM's stand-in beside it
                    ep.combine_send(r, y, signals=sig, signal_value=VALUE, signal_block=block,
                                    sent_rows=sent, num_sms=1 if rnd == 1 else 0)
                    ep.combine_recv(r, w, out)
                    torch.cuda.synchronize()
                else:
                    th = threading.Thread(target=raise_cpu,
                                          args=(y, y_full, sig, sigs, sent, snap))
                    th.start()
                    try:
                        ep.combine_send(r, y, signals=sig, signal_value=VALUE,
                                        signal_block=block, sent_rows=sent,
                                        num_sms=1 if rnd == 1 else 0)
                    finally:
                        th.join()
                    ep.combine_recv(r, w, out)
                total = int(count.sum())
                before = sum(q[3] - q[2] for q in sigs[:-1])
                got = int(sent.sum())
                if got != total:
                    msgs.append(f"round {rnd}: sent_rows sums to {got}, want {total}")
                if snap:
                    s = int(snap[0].sum()) if cuda else snap[0]
                    if s > before or (before > 0 and (s == 0 if cuda else s != before)):
                        msgs.append(f"round {rnd} block {block}: before the last signal "
                                    f"sent_rows was {s}, want {'1..' if cuda else ''}{before} "
                                    f"(the rows of the signals raised so far)")
                    elif rank == 0 and rnd == 0:
                        print(f"rank 0: before the last of {len(sigs)} signals, {s} of "
                              f"{total} rows had left ({before} raised)", flush=True)
                res.append(out)
            if not torch.equal(res[0], res[1]):
                bad = (res[0] != res[1]).any(1).nonzero().flatten().tolist()
                msgs.append(f"round {rnd} block {block}: overlapped combine differs from the "
                            f"plain one at tokens {bad[:8]}")
            err = combine_error(res[0], combine_ref(x, idx, w, False))
            if err:
                msgs.append(f"round {rnd} block {block}: overlapped combine vs reference: {err}")
        msgs += bad_args(ep, rank, E, dev)
    finally:
        ep.close()
    return msgs


def bad_args(ep, rank, E, dev):
    """Argument errors name the argument (the round is still usable)."""
    msgs = []
    El = E // ep.num_ranks
    x, idx, w = make_inputs(rank, 70, T, H, E, K, dev)
    bufs = ep.alloc(torch)
    r = ep.dispatch(x, idx, num_tokens=x.shape[0], **bufs)
    y = torch.zeros((El, ep.capacity, H), dtype=torch.bfloat16, device=dev)
    sig = torch.full((El,), VALUE, dtype=torch.uint32, device=dev)
    for kw, exc, name in (
            (dict(signals=sig, signal_block=-1), ValueError, "signal_block"),
            (dict(signals=sig[:El - 1] if El > 1 else sig[:0]), ValueError, "signals"),
            (dict(signals=sig.float()), TypeError, "signals"),
            (dict(signals=sig, signal_block=1), ValueError, "signals"),
            (dict(sent_rows=torch.zeros(El, dtype=torch.int32, device=dev)), TypeError,
             "sent_rows"),
            (dict(num_sms=-1), ValueError, "num_sms")):
        try:
            ep.combine_send(r, y, **kw)
            msgs.append(f"combine_send({sorted(kw)}) was accepted, want {exc.__name__}")
        except exc as e:
            if name not in str(e):
                msgs.append(f"combine_send({sorted(kw)}): the error does not name {name}: {e}")
    ep.combine(r, y, w, torch.empty((x.shape[0], H), dtype=torch.bfloat16, device=dev),
               signals=sig, signal_value=VALUE)
    # ferry_combine_in_t of the sizes before `signals` and before `num_sms`
    # (older callers) are still taken: a plain combine; the library's own
    # check of num_sms (below the binding's) names it, the round usable
    import ctypes
    from ferry import _lib
    from ferry._core import _lib_handle
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device=dev)
    for what, size, sms in (("the size before signals", _lib.CombineIn.signals.offset, 0),
                            ("the size before num_sms", _lib.CombineIn.num_sms.offset, 0),
                            ("num_sms -3", ctypes.sizeof(_lib.CombineIn), -3)):
        r = ep.dispatch(x, idx, num_tokens=x.shape[0], **bufs)
        cin = _lib.CombineIn(size, y.data_ptr(),
                             torch.cuda.current_stream().cuda_stream if dev.type == "cuda"
                             else None)
        cin.num_sms = sms
        rc = _lib_handle().ferry_combine_send(ep.handle(), r, ctypes.byref(cin))
        why = _lib_handle().ferry_ep_last_error(ep.handle()).decode()
        if sms < 0:
            if rc == 0 or "num_sms = -3" not in why:
                msgs.append(f"combine_send with {what}: rc {rc}, {why!r}; want an error naming "
                            f"num_sms")
            ep.combine_send(r, y)  # the round is still usable
        elif rc != 0:
            msgs.append(f"combine_send with {what}: error {rc}: {why}")
            continue
        ep.combine_recv(r, w, out)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return msgs


def deep_ep_rounds(deep_ep, rank, N, E, dev, cuda):
    """sgl-deep-ep's two forms through deep_ep.Buffer."""
    msgs = []
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 1 << 24, low_latency_mode=True,
                         num_qps_per_rank=max(El, 1))
    side = torch.cuda.Stream() if cuda else None
    try:
        for rnd, (form, hook) in enumerate((("blackwell", False), ("hopper", True),
                                            ("blackwell", True), ("hopper", False))):
            x, idx, w = make_inputs(rank, 60 + rnd, T, H, E, K, dev)
            res = []
            for overlap in (True, False):
                recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E,
                                                                     use_fp8=False)
                count = count.cpu()
                y_full = expert_outputs(rank, El, recv, count, False, dev)
                if not overlap:
                    out, _, _ = buf.low_latency_combine(y_full, idx, w, handle)
                    res.append(out.clone())
                    continue
                M = recv.shape[1]
                block = 0 if form == "blackwell" else 2
                sigs, nb = expected_rows(y_full, count, El, M, block)
                if form == "blackwell":
                    sig = torch.zeros(El, dtype=torch.uint32, device=dev)
                    kw = dict(overlap=True, src_signals=sig, src_signal_expect_value=VALUE)
                else:
                    sig = torch.zeros(El * nb + 3, dtype=torch.int32, device=dev)  # roomier
                    kw = dict(overlap=True, packed_recv_count=count.to(dev), comp_signal=sig,
                              block_m=block, threshold=VALUE, num_sms=3)
                y = torch.full(y_full.shape, GARBAGE, dtype=torch.bfloat16, device=dev)
                if cuda:
                    side.wait_stream(torch.cuda.current_stream())
                    raise_cuda(y, y_full, sig, sigs, None, [], side)
                    out, _, h = buf.low_latency_combine(y, idx, w, handle,
                                                        return_recv_hook=hook, **kw)
                    if hook:
                        h()
                    torch.cuda.synchronize()
                else:
                    th = threading.Thread(target=raise_cpu, args=(y, y_full, sig, sigs, None, []))
                    th.start()
                    try:
                        out, _, h = buf.low_latency_combine(y, idx, w, handle,
                                                            return_recv_hook=hook, **kw)
                    finally:
                        th.join()
                    if hook:
                        h()
                res.append(out.clone())
            if not torch.equal(res[0], res[1]):
                msgs.append(f"deep_ep {form} hook={hook}: overlapped combine differs from "
                            f"the plain one")
            err = combine_error(res[0], combine_ref(x, idx, w, False))
            if err:
                msgs.append(f"deep_ep {form} hook={hook}: vs reference: {err}")
        # both forms at once, and a bad block_m, name themselves
        x, idx, w = make_inputs(rank, 80, T, H, E, K, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        s32 = torch.full((El * recv.shape[1],), VALUE, dtype=torch.int32, device=dev)
        for kw, exc, name in (
                (dict(src_signals=s32, comp_signal=s32), TypeError, "comp_signal"),
                (dict(comp_signal=s32, block_m=0), ValueError, "block_m"),
                (dict(comp_signal=s32, num_sms=-2), ValueError, "num_sms")):
            try:
                buf.low_latency_combine(recv, idx, w, handle, overlap=True, **kw)
                msgs.append(f"low_latency_combine({sorted(kw)}) accepted, want {exc.__name__}")
            except exc as e:
                if name not in str(e):
                    msgs.append(f"low_latency_combine({sorted(kw)}): no {name} in: {e}")
        buf.low_latency_combine(recv, idx, w, handle, overlap=True, comp_signal=s32,
                                block_m=1, threshold=VALUE)
    finally:
        buf.destroy() if hasattr(buf, "destroy") else None
    return msgs


def stalled(ferry, comm, rank, N, E, dev, cuda):
    """A signal never raised: ferry's timeout, naming the expert and the
    signal's index (every rank stalls its own)."""
    msgs = []
    El = E // N
    os.environ["FERRY_TIMEOUT_MS"] = "1500"
    ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, device=dev.type,
                  num_sms=4 if cuda else 0)
    try:
        x, idx, w = make_inputs(rank, 91, T, H, E, K, dev)  # odd: every rank has tokens
        bufs = ep.alloc(torch)
        r = ep.dispatch(x, idx, num_tokens=x.shape[0], **bufs)
        count = bufs["expert_num_tokens"].cpu()
        stuck = int(count.argmax())
        if int(count[stuck]) == 0:
            return [f"no rows received in round 91: the stall is not tested"]
        sig = torch.full((El,), VALUE, dtype=torch.uint32, device=dev)
        sig[stuck] = 2
        y = torch.zeros((El, ep.capacity, H), dtype=torch.bfloat16, device=dev)
        t0 = time.time()
        try:
            ep.combine_send(r, y, signals=sig, signal_value=VALUE)
            if cuda:
                ep.combine_recv(r, w, torch.empty((x.shape[0], H), dtype=torch.bfloat16,
                                                  device=dev))
                ep.sync()
            msgs.append("a signal never raised: the combine returned without an error")
        except ferry.FerryError as e:
            m = str(e)
            if f"expert {stuck}" not in m or f"signals[{stuck}]" not in m:
                msgs.append(f"stalled signal: the error does not name local expert {stuck} "
                            f"and signals[{stuck}]: {m}")
            elif time.time() - t0 > 30:
                msgs.append(f"stalled signal: the error took {time.time() - t0:.1f} s")
            elif rank == 0:
                print(f"rank 0: stalled signal: {m}", flush=True)
    finally:
        try:
            ep.close()
        except Exception:
            pass
    return msgs


def rank_main(rank, N, port, q):
    msgs = []
    try:
        cuda = sys.argv[1:2] == ["cuda"]
        if cuda:
            torch.cuda.set_device(0)
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        torch_init(rank, N, port)
        import ferry
        from ferry import deep_ep
        E = 4 * N
        comm = ferry.Comm(torch.distributed.group.WORLD)
        msgs += ep_rounds(ferry, comm, rank, N, E, dev, cuda)
        msgs += deep_ep_rounds(deep_ep, rank, N, E, dev, cuda)
        msgs += stalled(ferry, comm, rank, N, E, dev, cuda)
    except Exception:
        msgs.append(traceback.format_exc())
    q.put((rank, msgs))


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    sizes = [int(sys.argv[2])] if len(sys.argv) > 2 else [1, 3]
    sys.exit(ranks_main(rank_main, sizes, f"overlapped combine ({dev})", gpu=dev == "cuda"))
