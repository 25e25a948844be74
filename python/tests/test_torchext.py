#!/usr/bin/env python3
"""ferry._torchext (the high-throughput calls' host path in C++) against the
Python path, on the same inputs. Usage: test_torchext.py [cpu|cuda] [nranks]

With FERRY_TORCH_EXT=1 (its absence is then an error) each rank checks
that the module is in use, then runs back-to-back rounds of deep_ep's
normal mode (get_dispatch_layout, dispatch with a new routing, a cached
dispatch, combine with weights and bias), each round twice on the same
inputs: through the module, then through the Python path (the module
switched off). Every output must be equal bit for bit (both paths run the
same library calls; only who makes the tensors and structs differs):
layout counts and is_token_in_rank, recv_x (bf16, and fp8 with row-major
and column-major scales), top-k ids and weights, per-expert counts, the
handle's source tokens, combined rows and weights. Inputs: a different
routing every round (Zipf-skewed experts, masked -1 slots, a rank with no
tokens in one round), weights that do not sum to 1. After the first
round each new routing's dispatch must be one call of new_plain (its C++
path), plain or async (two rounds call it as SGLang does: after an event,
async, outputs on the comm stream), and get_dispatch_layout one call
of layout_plain (plain, or on a GPU async on the comm stream); inputs those calls must hand to the full path (a nested x,
an out-of-range expert_alignment, a float topk_idx, fp8 rows without
scales) raise what the full path raises. Also checks that a library error through the module is
a FerryError with the library's message, and record (record_stream in
C++): on a GPU a recorded block is not handed out again while its stream
is busy, where an unrecorded one is; that on a GPU an async round's four
calls make their stream waits in one call of the module each
(call_begin), compared bit for bit as the rest; and that a module built
from an older source is refused by name. Exit 77 without torch (or on
cuda without a GPU).
"""
import os
import sys
import traceback
import warnings

try:
    import torch
except ImportError:
    print("skipped: torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ranks import ranks_main, torch_init  # noqa: E402

E, K, H = 16, 4, 256


def routing(rank, rnd, T, dev):
    """Zipf-skewed experts, distinct per token, some slots masked."""
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p = p[torch.randperm(E, generator=g)]
    idx = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g) if T else \
        torch.empty((0, K), dtype=torch.int64)
    idx = idx.to(torch.int64)
    mask = torch.rand((T, K), generator=g) < 0.2
    idx[mask] = -1
    w = torch.rand((T, K), generator=g) * 0.9  # rows do not sum to 1
    x = (torch.randn((T, H), generator=g) * 0.5).to(torch.bfloat16)
    bias = (torch.randn((T, H), generator=g) * 0.1).to(torch.bfloat16)
    sc = torch.rand((T, H // 128), generator=g) + 0.5
    # column-major scales (DeepEP's) on odd T: read in place
    sc = sc.t().contiguous().t() if T % 2 else sc
    return idx.to(dev), w.to(dev), x.to(dev), bias.to(dev), sc.to(dev)


def same(fails, what, a, b):
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if a is None or b is None or len(a) != len(b):
            fails.append(f"{what}: {a!r} vs {b!r}")
            return
        for i, (u, v) in enumerate(zip(a, b)):
            same(fails, f"{what}[{i}]", u, v)
        return
    if a is None or b is None:
        if a is not b:
            fails.append(f"{what}: one path gave None ({a is None}, {b is None})")
        return
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            fails.append(f"{what}: {a.dtype} {tuple(a.shape)} {a.device} vs "
                         f"{b.dtype} {tuple(b.shape)} {b.device}")
        elif not torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                             b.view(torch.uint8) if b.element_size() == 1 else b):
            fails.append(f"{what}: values differ")
        return
    if a != b:
        fails.append(f"{what}: {a!r} vs {b!r}")


LAST_ROUTE = None  # the last round's route (one_round)


def one_round(buf, idx, w, x, bias, sc, fp8, asyn):
    """A round's outputs: layout, new-routing dispatch (asyn: as SGLang
    calls it, on the Buffer's comm stream after an event, returning one),
    cached dispatch, combine (with weights and bias)."""
    # asyn: every call on the comm stream (the layout and combine async
    # after the current stream, the cached dispatch's outputs allocated
    # there and the current stream made to wait)
    lkw = dict(async_finish=True, allocate_on_comm_stream=True) if asyn else {}
    pr, pn, pe, inr, lev = buf.get_dispatch_layout(idx, E, **lkw)
    lev.current_stream_wait()
    if fp8:
        xin = (x.float().clamp(-400, 400).to(torch.float8_e4m3fn), sc)
    else:
        xin = x
    kw = {}
    if asyn:
        kw = dict(async_finish=True, allocate_on_comm_stream=True, expert_alignment=4,
                  previous_event=type(buf).capture() if idx.is_cuda else None)
    r = buf.dispatch(xin, num_tokens_per_rank=pr, is_token_in_rank=inr,
                     num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w, **kw)
    r[5].current_stream_wait()
    rx, ridx, rw, counts, handle = r[:5]
    cached = buf.dispatch(xin, handle=handle, allocate_on_comm_stream=asyn)[0]
    y = (rx[0].float() if fp8 else rx.float()) * 0.5
    cx, cw, cev = buf.combine(y.to(torch.bfloat16), handle, topk_weights=rw, bias=bias, **lkw)
    cev.current_stream_wait()
    global LAST_ROUTE
    LAST_ROUTE = handle.route
    return dict(layout=(pr, pn, pe, inr), recv_x=rx, topk_idx=ridx, topk_weights=rw,
                counts=counts, src=handle.src_idx, cached=cached, combined=cx,
                combined_w=cw)


def check_stale(fails):
    """A module built from an older source (here: one without any function)
    is not used: with FERRY_TORCH_EXT=1 an ImportError naming what it lacks
    and `make pyext`, else the Python path (None)."""
    import types
    import ferry
    from ferry import _core
    saved = (_core._EXT, _core._EXT_ERR, sys.modules.get("ferry._torchext"),
             ferry.__dict__.get("_torchext"), os.environ.get("FERRY_TORCH_EXT"))
    stub = types.ModuleType("ferry._torchext")
    try:
        sys.modules["ferry._torchext"] = ferry._torchext = stub
        for want in ("1", ""):
            os.environ["FERRY_TORCH_EXT"] = want
            _core._EXT = _core._EXT_ERR = None
            try:
                got = _core._torchext()
            except ImportError as e:
                got = e
            if want == "1" and not (isinstance(got, ImportError) and "call_begin" in str(got)
                                    and "make pyext" in str(got)):
                fails.append(f"a stale module with FERRY_TORCH_EXT=1: {got!r}, expected an "
                             f"ImportError naming call_begin and make pyext")
            if want == "" and got is not None:
                fails.append(f"a stale module: {got!r}, expected None (the Python path)")
    finally:
        _core._EXT, _core._EXT_ERR = saved[0], saved[1]
        if saved[2] is not None:
            sys.modules["ferry._torchext"] = saved[2]
        if saved[3] is not None:
            ferry._torchext = saved[3]
        if saved[4] is None:
            os.environ.pop("FERRY_TORCH_EXT", None)
        else:
            os.environ["FERRY_TORCH_EXT"] = saved[4]


def check_record(ext, dev, fails):
    """ext.record: record_stream for the CUDA tensors given. On a GPU, a
    block recorded for a stream that is still busy (torch.cuda._sleep) is
    not handed out again when freed, where an unrecorded one is (the
    control); CPU tensors and other objects are skipped; a bad argument is
    a TypeError."""
    n = 1 << 20
    if dev.type == "cuda":
        side = torch.cuda.Stream(device=dev)
        for recorded in (False, True):
            torch.cuda.synchronize(dev)
            a = torch.empty(n, dtype=torch.uint8, device=dev)
            p = a.data_ptr()
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # the side stream busy for a while
            if recorded:
                ext.record(side.stream_id, side.device_index, side.device_type,
                           (a, None, 3, torch.zeros(2)))
            del a
            b = torch.empty(n, dtype=torch.uint8, device=dev)
            reused = b.data_ptr() == p
            del b
            if reused == recorded:
                fails.append(f"record: a block {'recorded for' if recorded else 'not recorded for'}"
                             f" a busy stream was {'' if reused else 'not '}handed out again")
        torch.cuda.synchronize(dev)
    else:
        ext.record(0, -1, 0, (torch.zeros(2), None))  # CPU tensors: nothing to do
    try:
        ext.record(0, 0, 1, 5)
        fails.append("record of a non-sequence: no error")
    except TypeError:
        pass


def check_refusals(buf, dev, fails):
    """Inputs the one-call paths must hand to the full path, which then
    raises as it always did (the same exception type either way, and no
    crash): a nested tensor as x, expert_alignment past a C long long, a
    float topk_idx, an fp8 x without scales' tensor. Rank-local checks
    (each raises before any collective work)."""
    from ferry import _core
    T = 8
    idx = torch.zeros((T, K), dtype=torch.int64, device=dev)
    pr, _, pe, inr, _ = buf.get_dispatch_layout(idx, E)
    x = torch.zeros((T, H), dtype=torch.bfloat16, device=dev)
    with warnings.catch_warnings():  # nested tensors are a prototype (a UserWarning)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(H)] * (T - 1) + [torch.zeros(H - 1)],
                                            dtype=torch.bfloat16, device=dev)
    cases = {
        "nested x": dict(x=nested),
        "expert_alignment 2**70": dict(expert_alignment=2 ** 70),
        "float topk_idx": dict(topk_idx=idx.float()),
        "fp8 x, scales None": dict(x=(x.to(torch.float8_e4m3fn), None)),
    }
    for name, kw in cases.items():
        args = dict(num_tokens_per_rank=pr, is_token_in_rank=inr, num_tokens_per_expert=pe,
                    topk_idx=idx)
        args.update(kw)
        xin = args.pop("x", x)
        got = []
        for ext_on in (True, False):
            saved = _core._EXT
            if not ext_on:
                _core._EXT = False
            try:
                buf.dispatch(xin, **args)
                got.append("no error")
            except Exception as e:  # noqa: BLE001
                got.append(type(e).__name__)
            finally:
                _core._EXT = saved
        if got[0] != got[1] or got[0] == "no error":
            fails.append(f"{name}: with the module {got[0]}, without {got[1]} (expected the "
                         f"same error)")


def rank_main(rank, N, port, q):
    fails = []
    try:
        torch_init(rank, N, port)
        dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        import torch.distributed as dist
        from ferry import FerryError, _core
        from ferry import deep_ep
        from ferry._deep_ep_common import _layout_c
        ext = _core._torchext()
        if ext is None:
            fails.append("ferry._torchext is not in use (FERRY_TORCH_EXT=1)")
            q.put((rank, fails))
            return
        buf = deep_ep.Buffer(dist.group.WORLD, int(1e8), 0)
        fast = []  # what each new_plain call gave: a tuple, or None (the full path)
        fast_layout = []  # the same of layout_plain

        begun = []  # call_begin's calls (a call's stream waits in C++)

        class Counting:  # the module, its new_plain and layout_plain calls noted
            def __getattr__(self, name):
                f = getattr(ext, name)
                if name == "call_begin":
                    def noted_begin(*a):
                        begun.append(a)
                        return f(*a)
                    return noted_begin
                if name not in ("new_plain", "layout_plain"):
                    return f
                into = fast if name == "new_plain" else fast_layout

                def noted(*a):
                    r = f(*a)
                    into.append(r is not None)
                    return r
                return noted
        ext_on = Counting()
        _core._EXT = ext_on
        for rnd in range(6):
            T = 0 if (rnd == 3 and rank == N - 1) else 24 + 8 * rnd + rank
            idx, w, x, bias, sc = routing(rank, rnd, T, dev)
            fp8 = rnd % 2 == 1
            n_fast, n_layout, n_begun = len(fast), len(fast_layout), len(begun)
            asyn = rnd in (2, 5)
            got = one_round(buf, idx, w, x, bias, sc, fp8, asyn)
            # (async: on a GPU only; CPU calls have no comm stream)
            if rnd > 0 and (not asyn or dev.type == "cuda") and \
                    fast_layout[n_layout:] != [True]:
                fails.append(f"round {rnd} (T={T}): layout_plain calls "
                             f"{fast_layout[n_layout:]}, expected one that made the layout")
            # after the first round, a new routing's dispatch with tokens is one
            # call of new_plain (bf16; fp8 with row-major scales on even T,
            # column-major on odd; plain and async)
            if rnd > 0 and T and fast[n_fast:] != [True]:
                fails.append(f"round {rnd} (T={T}): new_plain calls {fast[n_fast:]}, expected "
                             f"one that made the dispatch")
            # on a GPU, the four calls of an async round make their stream
            # waits in one call of the module each
            if asyn and dev.type == "cuda" and len(begun) - n_begun != 4:
                fails.append(f"round {rnd}: {len(begun) - n_begun} call_begin calls, expected "
                             f"4 (layout, dispatch, cached dispatch, combine)")
            # the route's per-expert counts stay a writable numpy array
            ec = LAST_ROUTE.expert_counts
            if not ec.flags.writeable:
                fails.append(f"round {rnd}: route.expert_counts is read-only")
            _core._EXT = False  # the Python path, the same inputs
            try:
                want = one_round(buf, idx, w, x, bias, sc, fp8, asyn)
            finally:
                _core._EXT = ext_on
            for k in got:
                same(fails, f"round {rnd} ({'fp8' if fp8 else 'bf16'}, T={T}) {k}", got[k],
                     want[k])
        check_record(ext, dev, fails)
        check_stale(fails)
        if buf._plain_ctx is None:
            fails.append("no dispatch made the one-call path's context")
        check_refusals(buf, dev, fails)
        # a library error through the module: FerryError with its message
        try:
            _layout_c(torch.zeros((4, K), dtype=torch.int64, device=dev), 7, 2)
            fails.append("layout of 7 experts over 2 ranks: no error")
        except FerryError as e:
            if "num_experts = 7" not in str(e):
                fails.append(f"layout of 7 experts over 2 ranks: {e}")
        buf.destroy()
    except Exception as e:  # noqa: BLE001
        fails.append(f"{e}\n{traceback.format_exc()}")
    q.put((rank, fails))


if __name__ == "__main__":
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    sys.exit(ranks_main(rank_main, [n], "ferry._torchext against the Python path",
                        gpu=len(sys.argv) > 1 and sys.argv[1] == "cuda"))
