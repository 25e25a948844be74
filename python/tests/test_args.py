#!/usr/bin/env python3
"""Argument checks of the Python binding across processes (numpy, CPU
ranks): every array's shape, dtype, layout and device is checked against
the EP before a pointer reaches libferry, each failure a ValueError or
TypeError naming the argument; a Comm closed while an EP is open is
closed when the last EP closes; methods after close raise; closing twice
is harmless. Usage: test_args.py [nranks ...]"""
import os
import sys
import traceback

import numpy as np

from ranks import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

E_PER_RANK, K, H, T = 4, 4, 256, 16


class FakeCuda:
    """Claims to be CUDA memory; its pointer must never reach the library."""

    def __init__(self, shape, typestr):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(16, False),
                                             strides=None, version=3)


def expect(exc, name, fn, *args, **kw):
    """fn(*args, **kw) raises exc (not a subclass of another kind) whose
    message starts with the argument's name; returns the message."""
    try:
        fn(*args, **kw)
    except exc as e:
        msg = str(e)
        assert msg.startswith(name + ":") or f" {name}" in msg, \
            f"{name}: message does not name it: {msg!r}"
        return msg
    except Exception as e:
        raise AssertionError(f"{name}: raised {type(e).__name__}({e}), expected "
                             f"{exc.__name__}") from e
    raise AssertionError(f"{name}: accepted, expected {exc.__name__}")


def inputs(rank, E):
    rng = np.random.default_rng(rank)
    x = rng.integers(0, 1 << 14, size=(T, H)).astype(np.uint16)  # finite bf16
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, K)).astype(np.float32)
    return x, idx, w


def check_dispatch_send(ferry, ep, x, idx):
    expect(ValueError, "x", ep.dispatch_send, x[:, :8].copy(), idx)       # too few columns
    expect(ValueError, "x", ep.dispatch_send, np.zeros((T, 2 * H), np.uint16), idx)
    big = np.zeros((T + 1, H), np.uint16)
    expect(ValueError, "x", ep.dispatch_send, big, np.full((T + 1, K), -1, np.int64))
    expect(TypeError, "x", ep.dispatch_send, x.astype(np.float32), idx)  # wrong dtype
    wide = np.zeros((T, 2 * H), np.uint16)
    expect(ValueError, "x", ep.dispatch_send, wide[:, ::2], idx)          # non-contiguous
    expect(ValueError, "x", ep.dispatch_send, np.asfortranarray(x), idx)
    expect(ValueError, "x", ep.dispatch_send, x[:T // 2], idx)            # rows differ
    expect(ValueError, "x", ep.dispatch_send, x.reshape(T * H), idx)      # 1-D
    expect(TypeError, "x", ep.dispatch_send, x.tolist(), idx)             # not an array
    expect(ValueError, "x", ep.dispatch_send, FakeCuda((T, H), "<u2"), idx)  # device
    expect(ValueError, "topk_idx", ep.dispatch_send, x, idx[:, :K - 1].copy())
    expect(ValueError, "topk_idx", ep.dispatch_send, x, np.zeros((T, K + 1), np.int64))
    expect(ValueError, "topk_idx", ep.dispatch_send, x, idx.reshape(T * K))
    expect(TypeError, "topk_idx", ep.dispatch_send, x, idx.astype(np.int32))
    expect(TypeError, "topk_idx", ep.dispatch_send, x, idx.astype(np.float64))
    expect(ValueError, "topk_idx", ep.dispatch_send, x, np.zeros((2 * T, K), np.int64)[::2])
    expect(ValueError, "x_scales", ep.dispatch_send, x, idx,
           x_scales=np.ones((T, H // 128), np.float32))                   # bf16 EP
    expect(ValueError, "num_tokens", ep.dispatch_send, x, idx, num_tokens=T + 1)
    expect(ValueError, "num_tokens", ep.dispatch_send, x, idx, num_tokens=-1)
    expect(TypeError, "num_tokens", ep.dispatch_send, x, idx,
           num_tokens=np.array([T], np.int32))                            # CPU: an int


def check_dispatch_recv(ferry, ep, r, bufs):
    El, cap = ep.num_local_experts, ep.capacity
    b = dict(bufs)
    b["expert_x"] = np.zeros((El, cap // 2, H), np.uint16)                 # undersized
    msg = expect(ValueError, "expert_x", ep.dispatch_recv, r, **b)
    assert msg == f"expert_x: expected shape ({El}, {cap}, {H}) uint16, got " \
                  f"({El}, {cap // 2}, {H}) uint16", msg
    b["expert_x"] = np.zeros((El, cap, H // 2), np.uint16)
    expect(ValueError, "expert_x", ep.dispatch_recv, r, **b)
    b["expert_x"] = np.zeros((El, cap, H), np.uint8)                       # fp8 bytes, bf16 EP
    expect(TypeError, "expert_x", ep.dispatch_recv, r, **b)
    b["expert_x"] = np.zeros((El, cap, H), np.uint16)[:, ::-1]
    expect(ValueError, "expert_x", ep.dispatch_recv, r, **b)
    ro = np.zeros((El, cap, H), np.uint16)
    ro.flags.writeable = False
    b["expert_x"] = ro
    expect(ValueError, "expert_x", ep.dispatch_recv, r, **b)
    b["expert_x"] = None
    expect(TypeError, "expert_x", ep.dispatch_recv, r, **b)
    b = dict(bufs)
    b["expert_num_tokens"] = np.zeros(1, np.int32)                         # undersized
    expect(ValueError, "expert_num_tokens", ep.dispatch_recv, r, **b)
    b["expert_num_tokens"] = np.zeros(El, np.int64)
    expect(TypeError, "expert_num_tokens", ep.dispatch_recv, r, **b)
    b = dict(bufs)
    b["expert_src_rank"] = np.zeros((El, 1), np.int32)
    expect(ValueError, "expert_src_rank", ep.dispatch_recv, r, **b)
    b = dict(bufs)
    b["expert_src_token"] = np.zeros((El, cap), np.float32)
    expect(TypeError, "expert_src_token", ep.dispatch_recv, r, **b)
    b = dict(bufs)
    b["expert_x_scales"] = np.zeros((El, cap, 2), np.float32)              # bf16 EP: none
    expect(ValueError, "expert_x_scales", ep.dispatch_recv, r, **b)


def check_combine(ferry, ep, r, y, w, out):
    cap = ep.capacity
    expect(ValueError, "expert_y", ep.combine_send, r, y[:, :cap // 2].copy())
    expect(TypeError, "expert_y", ep.combine_send, r, y.astype(np.float32))
    ep.combine_send(r, y)
    expect(ValueError, "topk_weights", ep.combine_recv, r, np.ones(1, np.float32), out)
    expect(ValueError, "topk_weights", ep.combine_recv, r, w[:T - 1].copy(), out)
    expect(TypeError, "topk_weights", ep.combine_recv, r, w.astype(np.float64), out)
    msg = expect(ValueError, "out", ep.combine_recv, r, w, np.zeros((T // 2, H), np.uint16))
    assert msg == f"out: expected shape ({T}, {H}) uint16, got ({T // 2}, {H}) uint16", msg
    expect(ValueError, "out", ep.combine_recv, r, w, np.zeros((T, H - 1), np.uint16))
    expect(TypeError, "out", ep.combine_recv, r, w, np.zeros((T, H), np.float32))
    expect(ValueError, "out", ep.combine_recv, r, w, np.zeros((T, 2 * H), np.uint16)[:, ::2])
    ep.combine_recv(r, w, out)


INT32 = "(-2147483648..2147483647)"
UINT64 = "(0..18446744073709551615)"


def check_int_ranges(ferry, comm, E, x, idx):
    """Integers libferry takes as C ints (uint64_t for rounds): outside the
    C type's range a ValueError naming the argument and the range, before
    any call reaches the library (ctypes would wrap them: 2**32 + 8 would
    run as 8). Every rank alike (EP and route creation are collective)."""
    good = dict(num_experts=E, topk=K, hidden=H, max_tokens=T)
    for name in ("num_experts", "topk", "hidden", "max_tokens", "num_sms", "ring_tokens"):
        for v in (2**31, 2**32 + 8, -2**31 - 1):
            msg = expect(ValueError, name, ferry.EP, comm, **dict(good, **{name: v}))
            assert INT32 in msg and str(v) in msg, msg
    # in range but not a valid config: ferry's own check
    expect(ferry.FerryError, "num_experts", ferry.EP, comm, **dict(good, num_experts=-1))
    expect(TypeError, "topk", ferry.EP, comm, **dict(good, topk=4.0))
    ep = ferry.EP(comm, **dict(good, num_experts=np.int64(E), max_tokens=np.int32(T)))
    assert type(ep.num_experts) is int and ep.num_experts == E, ep.num_experts
    bufs = ep.alloc()
    r = ep.dispatch_send(x, idx)
    # a round number is a uint64_t: 2**64 + r would wrap to r
    for v in (2**64 + r, -1):
        msg = expect(ValueError, "round", ep.dispatch_recv, v, **bufs)
        assert UINT64 in msg, msg
    ep.dispatch_recv(np.uint64(r), **bufs)
    y = bufs["expert_x"]
    for v in (2**64 + r, -1):
        expect(ValueError, "round", ep.combine_send, v, y)
        expect(ValueError, "round", ep.combine, v, y, None, None)
    ep.combine_send(r, y)
    out = np.zeros((T, H), np.uint16)
    w = np.ones((T, K), np.float32)
    expect(ValueError, "round", ep.combine_recv, 2**64 + r, w, out)
    ep.combine_recv(r, w, out)
    # rank of mask_rank: a C int (2**32 + 1 would mask rank 1)
    for v in (2**31, 2**32 + 1):
        msg = expect(ValueError, "rank", ep.mask_rank, v)
        assert INT32 in msg, msg
    ep.close()
    ht = ferry.EP(comm, **good, mode="ht")
    for name in ("max_recv", "expert_alignment"):
        for v in (2**31, 2**32 + 8):
            expect(ValueError, name, ht.route, idx, **{name: v})
    with ht.route(idx, expert_alignment=np.int64(2)) as route:  # numpy ints pass
        assert route.num_tokens == T
    ht.close()


def rank_main(rank, N, port, q):
    try:
        os.environ.update(FERRY_RANK=str(rank), FERRY_WORLD_SIZE=str(N),
                          FERRY_ROOT=f"127.0.0.1:{port}", FERRY_TIMEOUT_MS="10000")
        import ferry
        comm = ferry.Comm()
        E = E_PER_RANK * N
        ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, dtype="bf16")
        El, cap = ep.num_local_experts, ep.capacity
        x, idx, w = inputs(rank, E)

        # bf16 round: every argument of every call
        check_dispatch_send(ferry, ep, x, idx)
        ro = x.copy()
        ro.flags.writeable = False  # inputs may be read-only
        r = ep.dispatch_send(ro, idx)
        bufs = ep.alloc()
        check_dispatch_recv(ferry, ep, r, bufs)
        ep.dispatch_recv(r, **bufs)
        y = bufs["expert_x"].copy()  # identity experts: out = sum_k w * x
        out = np.zeros((T, H), np.uint16)
        check_combine(ferry, ep, r, y, w, out)
        f = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
        ref = f(x) * w.sum(axis=1, keepdims=True)
        assert np.all(np.abs(f(out) - ref) <= np.abs(ref) / 64 + 1e-3), "combined output"
        # num_tokens below the rows of x: combine takes that many rows
        r = ep.dispatch_send(x, idx, num_tokens=T // 2)
        ep.dispatch_recv(r, **bufs)
        ep.combine_send(r, bufs["expert_x"])
        expect(ValueError, "topk_weights", ep.combine_recv, r, w, out[:T // 2])
        expect(ValueError, "out", ep.combine_recv, r, w[:T // 2], out)
        ep.combine_recv(r, w[:T // 2], out[:T // 2])

        # fp8: scales, pre-quantised input
        ep8 = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, dtype="fp8")
        ns = ep8.num_scales
        assert ns == H // 128, ns
        x8 = np.zeros((T, H), np.uint8)
        expect(ValueError, "x_scales", ep8.dispatch_send, x8, idx,
               x_scales=np.ones((1,), np.float32))
        expect(ValueError, "x_scales", ep8.dispatch_send, x8, idx,
               x_scales=np.ones((T, ns - 1), np.float32))
        expect(TypeError, "x_scales", ep8.dispatch_send, x8, idx,
               x_scales=np.ones((T, ns), np.float64))
        expect(TypeError, "x", ep8.dispatch_send, x, idx, x_scales=np.ones((T, ns), np.float32))
        expect(TypeError, "x", ep8.dispatch_send, x8, idx)  # fp8 input needs its scales
        r = ep8.dispatch_send(x, idx)
        b8 = ep8.alloc()
        assert b8["expert_x"].shape == (El, cap, H) and b8["expert_x"].dtype == np.uint8
        assert b8["expert_x_scales"].shape == (El, cap, ns)
        b = dict(b8)
        b["expert_x_scales"] = np.zeros((El, cap, 1), np.float32)          # undersized
        expect(ValueError, "expert_x_scales", ep8.dispatch_recv, r, **b)
        b["expert_x_scales"] = None
        expect(TypeError, "expert_x_scales", ep8.dispatch_recv, r, **b)
        b = dict(b8)
        b["expert_x"] = np.zeros((El, cap, H), np.uint16)                  # bf16 rows, fp8 EP
        expect(TypeError, "expert_x", ep8.dispatch_recv, r, **b)
        b["expert_x"] = np.zeros((El, cap, H // 2), np.uint8)
        expect(ValueError, "expert_x", ep8.dispatch_recv, r, **b)
        ep8.dispatch_recv(r, **b8)
        ep8.combine_send(r, np.zeros((El, cap, H), np.uint16))
        ep8.combine_recv(r, w, out)
        # scale layouts: unknown, on bf16, UE8M0 without power-of-two scales
        expect(ValueError, "scales_layout='col'", ferry.EP, comm, num_experts=E, topk=K, hidden=H,
               max_tokens=T, dtype="fp8", scales_layout="col")
        expect(ferry.FerryError, "scales_layout", ferry.EP, comm, num_experts=E, topk=K,
               hidden=H, max_tokens=T, dtype="bf16", scales_layout="cols")
        expect(ferry.FerryError, "fp8_round_scale", ferry.EP, comm, num_experts=E, topk=K,
               hidden=512, max_tokens=T, dtype="fp8", scales_layout="ue8m0")

        check_int_ranges(ferry, comm, E, x, idx)

        # close: the Comm is closed after the last EP; methods after close raise
        comm.close()          # two EPs still open: deferred
        comm.close()          # twice: harmless
        expect(ValueError, "comm", ferry.EP, comm, num_experts=E, topk=K, hidden=H,
               max_tokens=T)
        expect(ValueError, "comm", comm.barrier)
        r = ep.dispatch_send(x, idx)  # the open EPs still work
        ep.dispatch_recv(r, **bufs)
        ep.combine_send(r, bufs["expert_x"])
        ep.combine_recv(r, w, out)
        ep8.close()
        ep.close()            # the last EP: closes the Comm too
        ep.close()            # twice: harmless
        ep8.close()
        comm.close()
        for fn, args in ((ep.dispatch_send, (x, idx)), (ep.dispatch_recv, (r, bufs["expert_x"], bufs["expert_num_tokens"])),
                         (ep.combine_send, (r, y)), (ep.combine_recv, (r, w, out)),
                         (ep.sync, ()), (ep.dispatch, (x, idx)), (ep.alloc, ())):
            msg = expect(ValueError, "EP", fn, *args)
            assert "closed" in msg, msg
        msg = expect(ValueError, "comm", lambda: comm.rank)
        assert "closed" in msg, msg
        q.put((rank, "ok"))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def run(N):
    res, crashed = run_ranks(rank_main, N)
    bad = {r: m for r, m in res.items() if m != "ok"}
    if len(res) < N or bad:
        for r, m in bad.items():
            print(f"rank {r}:\n{m}")
        for c in crashed:
            print(c)
        print(f"{N} ranks: FAILED ({len(res)} answered)")
        return False
    print(f"{N} ranks: bad shapes, dtypes, layouts, devices rejected; close order: ok")
    return True


def env_knobs():
    """The Python package's own settings out of range are a ValueError
    naming them, at import (deep_ep's) or first use (FERRY_TORCH_EXT);
    in range they are taken. Needs torch (skipped, saying so, without)."""
    import subprocess
    try:
        import torch  # noqa: F401
    except ImportError:
        print("env knobs: skipped (torch is not installed)")
        return True
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    code = ("import ferry, ferry.deep_ep\n"
            "from ferry._core import _torchext\n"
            "for i in range(2):  # refused every time, not once\n"
            "    try:\n        _torchext()\n    except ImportError:\n        pass\n"
            "    except ValueError as e:\n        print(f'call {i}: ValueError: {e}')\n"
            "print('imported')")
    cases = [("FERRY_DEEP_EP_MAX_TOKENS", "abc", "must be a whole number, 1..1048576"),
             ("FERRY_DEEP_EP_MAX_TOKENS", "0", "must be a whole number, 1..1048576"),
             ("FERRY_DEEP_EP_LAYOUT_KERNEL", "yes", "must be 0 or 1"),
             ("FERRY_TORCH_EXT", "on", "must be auto, 0 or 1"),
             ("FERRY_DEEP_EP_MAX_TOKENS", "4096", None),
             ("FERRY_DEEP_EP_LAYOUT_KERNEL", "0", None),
             ("FERRY_TORCH_EXT", "0", None)]
    ok = True
    for var, val, want in cases:
        env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[var] = val
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120)
        out = p.stdout + p.stderr
        good = ("imported" in out and p.returncode == 0) if want is None else \
            (f"ValueError: {var}={val}: {want}" in out and
             (p.returncode != 0 or all(f"call {i}: ValueError" in out for i in range(2))))
        if not good:
            print(f"env knobs: {var}={val}: rc {p.returncode}: {out[-400:]}")
            ok = False
    print(f"env knobs: {'ok' if ok else 'FAILED'}")
    return ok


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [1, 2]
    ok = all([run(n) for n in sizes]) and (1 not in sizes or env_knobs())
    sys.exit(0 if ok else 1)
