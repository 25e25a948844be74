#!/usr/bin/env python3
"""The native Python API across processes (numpy, CPU ranks): every round
checked against a reference computed here, bad arguments raising
FerryError with ferry's message. Usage: test_native.py [nranks ...]"""
import os
import sys
import traceback

import numpy as np

from ranks import bf16, f32, run_ranks

E_PER_RANK, K, H, T = 4, 4, 256, 16


def inputs(rank, rnd, N, H=H):
    rng = np.random.default_rng(1000 * rnd + rank)
    E = E_PER_RANK * N
    t = int(rng.integers(0, T + 1)) if rank % 3 else (0 if rnd % 2 else T)  # empty ranks
    x = bf16(rng.standard_normal((t, H)).astype(np.float32))
    idx = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int64) \
        if t else np.zeros((0, K), np.int64)
    idx[rng.random(idx.shape) < 0.1] = -1
    w = (0.1 + 0.9 * rng.random((t, K))).astype(np.float32)  # do not sum to 1
    return x, idx, w


def e4m3(q):
    """fp8 e4m3 codes (uint8) to float32."""
    q = q.astype(np.int32)
    s = np.where(q & 0x80, -1.0, 1.0)
    ex, m = (q >> 3) & 0xF, q & 7
    v = np.where(ex == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (ex - 7.0))
    return (s * v).astype(np.float32)


def expert_fn(e, rows):  # a different map per expert
    return bf16(f32(rows) * (0.5 + 0.125 * (e % 13)) + 0.0625 * ((e * 7) % 11 - 5))


def rank_main(rank, N, port, q):
    try:
        os.environ.update(FERRY_RANK=str(rank), FERRY_WORLD_SIZE=str(N),
                          FERRY_ROOT=f"127.0.0.1:{port}", FERRY_TIMEOUT_MS="10000")
        import ferry
        comm = ferry.Comm()
        assert comm.rank == rank and comm.size == N
        E = E_PER_RANK * N
        # bad arguments raise with ferry's message
        try:
            ferry.EP(comm, num_experts=E + 1 if N > 1 else 0, topk=K, hidden=H, max_tokens=T)
            raise AssertionError("E not divisible was accepted")
        except ferry.FerryError as e:
            assert e.name == "FERRY_ERR_INVALID" and "num_experts" in str(e), str(e)
        ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, dtype="bf16")
        bufs = ep.alloc()
        x, idx, w = inputs(rank, 0, N)
        bad = idx.copy()
        if len(bad):
            bad[0, 0] = E
            try:
                ep.dispatch_send(x, bad)
                raise AssertionError("expert index out of range was accepted")
            except ferry.FerryError as e:
                assert e.name == "FERRY_ERR_INVALID" and "topk_idx[0][0]" in str(e), str(e)
        try:
            ep.dispatch_send(x, idx.astype(np.int32))
            raise AssertionError("int32 topk_idx was accepted")
        except TypeError as e:
            assert "topk_idx" in str(e)
        big = np.zeros((T + 1, H), np.uint16)
        try:
            ep.dispatch_send(big, np.full((T + 1, K), -1, np.int64))
            raise AssertionError("too many tokens accepted")
        except ValueError as e:  # checked by the binding, before libferry
            assert str(e).startswith("x:") and "max_tokens" in str(e), str(e)
        El = ep.num_local_experts
        dwait, cwait = np.zeros(N, np.int64), np.zeros(N, np.int64)  # wait costs, ns
        for rnd in range(1, 31):
            x, idx, w = inputs(rank, rnd, N)
            one_call = rnd % 3 == 0  # ep.dispatch / ep.combine every third round
            if one_call:
                r = ep.dispatch(x, idx, wait_cost=dwait, **bufs)
            else:
                r = ep.dispatch_send(x, idx)
                ep.dispatch_recv(r, wait_cost=dwait, **bufs)
            # expected rows: sources from this rank on, wrapping (rank,
            # rank + 1, ..., N - 1, 0, ..., rank - 1), then token
            exp = {le: [] for le in range(El)}
            for src in [(rank + i) % N for i in range(N)]:
                xs, ids, _ = inputs(src, rnd, N)
                for t in range(len(ids)):
                    for e in ids[t]:
                        if e // E_PER_RANK == rank and e >= 0:
                            exp[e % E_PER_RANK].append((src, t, xs[t]))
            y = np.zeros((El, ep.capacity, H), np.uint16)
            for le in range(El):
                n = int(bufs["expert_num_tokens"][le])
                assert n == len(exp[le]), (rnd, le, n, len(exp[le]))
                for s, (src, t, row) in enumerate(exp[le]):
                    assert bufs["expert_src_rank"][le, s] == src
                    assert bufs["expert_src_token"][le, s] == t
                    assert np.array_equal(bufs["expert_x"][le, s], row)
                y[le, :n] = expert_fn(rank * El + le, bufs["expert_x"][le, :n])
            out = np.zeros((len(x), H), np.uint16)
            if one_call:
                ep.combine(r, y, w, out, wait_cost=cwait)
            else:
                ep.combine_send(r, y)
                ep.combine_recv(r, w, out, wait_cost=cwait)
            ref = np.zeros((len(x), H), np.float64)
            for t in range(len(x)):
                for k in range(K):
                    e = idx[t, k]
                    if e >= 0:
                        ref[t] += w[t, k] * f32(expert_fn(e, x[t:t + 1]))[0]
            err = np.abs(f32(out) - ref)
            assert np.all(err <= np.abs(ref) / 256 + 1e-4), (rnd, float(err.max()))
        # 30 rounds of waits added per source rank, in ns
        assert (dwait >= 0).all() and (cwait >= 0).all() and dwait.sum() > 0 and \
            cwait.sum() > 0, (dwait, cwait)
        ep.close()
        # fp8 with scales rounded up to powers of two (DeepEP's round_scale)
        ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, dtype="fp8",
                      fp8_round_scale=True)
        bufs = ep.alloc()
        x, idx, w = inputs(rank, 7, N)
        ep.dispatch(x, idx, **bufs)
        for le in range(El):
            for s in range(int(bufs["expert_num_tokens"][le])):
                src, t = int(bufs["expert_src_rank"][le, s]), int(bufs["expert_src_token"][le, s])
                row = f32(inputs(src, 7, N)[0][t]).reshape(-1, 128)
                sc = bufs["expert_x_scales"][le, s]
                amax = np.abs(row).max(axis=1)
                mant, _ = np.frexp(sc)
                assert np.all(mant == 0.5), ("scales not powers of two", sc)
                assert np.all((sc >= amax / 448) & ((sc < 2 * amax / 448) | (amax == 0))), sc
                deq = e4m3(bufs["expert_x"][le, s]).reshape(-1, 128) * sc[:, None]
                assert np.all(np.abs(deq - row) <= np.abs(row) / 8 + sc[:, None] / 256), \
                    float(np.abs(deq - row).max())
        ep.close()
        # one round into DeepEP's scale layouts, column-major float32 and
        # UE8M0 words (four exponent bytes; H a multiple of 512; two words
        # per row, so that rows and columns differ), beside
        # rows: the same rows and scales
        H2 = 1024
        x, idx, w = inputs(rank, 8, N, H2)
        ref = None
        for layout in ("rows", "cols", "ue8m0"):
            ep2 = ferry.EP(comm, num_experts=E, topk=K, hidden=H2, max_tokens=T, dtype="fp8",
                           fp8_round_scale=True, scales_layout=layout)
            b2 = ep2.alloc()
            sc2, ns, cap = b2["expert_x_scales"], ep2.num_scales, ep2.capacity
            S = ns if layout != "ue8m0" else ns // 4
            assert sc2.shape == (El, cap, S), (layout, sc2.shape)
            if layout != "rows":
                assert sc2.swapaxes(1, 2).flags.c_contiguous, (layout, sc2.strides)
                try:  # rows where columns are expected: refused, naming it
                    ep2.dispatch(x, idx, **dict(b2, expert_x_scales=np.ascontiguousarray(sc2)))
                    raise AssertionError(f"{layout}: C-contiguous expert_x_scales taken")
                except ValueError as e:
                    assert "expert_x_scales.transpose(1, 2)" in str(e), str(e)
            ep2.dispatch(x, idx, **b2)
            if layout == "ue8m0":
                ex = np.stack([(sc2 >> (8 * j)) & 0xFF for j in range(4)], axis=3)
                sc2 = np.ldexp(1.0, ex.reshape(El, cap, ns) - 127).astype(np.float32)
            if ref is None:
                ref = b2["expert_num_tokens"].copy(), b2["expert_x"].copy(), sc2.copy()
            cnt, rx, rsc = ref
            assert np.array_equal(b2["expert_num_tokens"], cnt), layout
            for le in range(El):
                n = int(cnt[le])
                assert np.array_equal(b2["expert_x"][le, :n], rx[le, :n]), layout
                assert np.array_equal(sc2[le, :n], rsc[le, :n]), (layout, le)
            ep2.close()
        comm.close()
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
    print(f"{N} ranks: 30 rounds checked, bad arguments rejected: ok")
    return True


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [1, 2, 3]
    ok = all([run(n) for n in sizes])
    sys.exit(0 if ok else 1)
