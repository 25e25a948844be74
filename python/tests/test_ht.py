#!/usr/bin/env python3
"""High-throughput mode from Python (numpy, CPU ranks): routes, dispatch and
combine checked against a reference every rank computes for all ranks
(the inputs are regenerated from seeds), with Zipf-skewed routing, masked
slots, empty ranks, bf16 and fp8 rows, expert alignment, a small ring
(streaming), route reuse, the backward identity <C(y), g> = <y, D(g)>, and
a bounded route (max_recv: padded outputs, counts in the route's outputs).
Usage: test_ht.py [nranks ...]"""
import os
import sys
import traceback

import numpy as np

from ranks import bf16, f32, run_ranks

E_PER_RANK, K, H, T = 4, 4, 256, 48


def inputs(rank, rnd, N):
    rng = np.random.default_rng(7000 * rnd + rank)
    E = E_PER_RANK * N
    t = 0 if (rank + rnd) % 4 == 3 else int(rng.integers(1, T + 1))  # some ranks send nothing
    p = 1.0 / np.arange(1, E + 1) ** 1.2  # Zipf-like expert popularity
    idx = np.stack([rng.choice(E, size=min(K, E), replace=False, p=p / p.sum())
                    for _ in range(t)]).astype(np.int64) if t else np.zeros((0, K), np.int64)
    idx[rng.random(idx.shape) < 0.1] = -1
    if t > 2:
        idx[1, :] = -1  # a token that goes nowhere
    x = bf16(rng.standard_normal((t, H)).astype(np.float32))
    w = (0.1 + 0.9 * rng.random((t, K))).astype(np.float32)
    q = rng.integers(0, 256, (t, H), dtype=np.uint8)  # fp8 rows: bytes, passed through
    qs = rng.random((t, H // 128)).astype(np.float32)
    return x, idx, w, q, qs


def expected_rows(rank, N, all_in):
    """(source, token) of the rows this rank receives, in order."""
    El = E_PER_RANK
    rows = []
    for s in range(N):
        idx = all_in[s][1]
        for t in range(idx.shape[0]):
            if any(e >= 0 and e // El == rank for e in idx[t]):
                rows.append((s, t))
    return rows


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def run_round(ferry, ep, rank, N, rnd, align):
    El = E_PER_RANK
    all_in = [inputs(s, rnd, N) for s in range(N)]
    x, idx, w, q, qs = all_in[rank]
    route = ep.route(idx, expert_alignment=align)
    rows = expected_rows(rank, N, all_in)
    check(route.num_recv == len(rows), f"num_recv {route.num_recv}, expected {len(rows)}")
    cnt = np.zeros(El, np.int64)
    for s, t in rows:
        for e in all_in[s][1][t]:
            if e >= 0 and e // El == rank:
                cnt[e % El] += 1
    if align > 1:
        cnt = (cnt + align - 1) // align * align
    check(np.array_equal(route.expert_counts, cnt), f"expert_counts {route.expert_counts} != {cnt}")
    o = ep.ht_dispatch(route, x, topk_weights=w)
    for i, (s, t) in enumerate(rows):
        sx, si, sw = all_in[s][0], all_in[s][1], all_in[s][2]
        check(np.array_equal(o["recv_x"][i], sx[t]), f"row {i} from ({s},{t}): wrong data")
        check(o["recv_src_rank"][i] == s and o["recv_src_token"][i] == t, f"row {i}: wrong source")
        for k in range(K):
            e = si[t][k]
            local = e >= 0 and e // El == rank
            check(o["recv_topk_idx"][i][k] == (e % El if local else -1), f"row {i} slot {k}: idx")
            check(o["recv_topk_weights"][i][k] == (sw[t][k] if local else 0), f"row {i} slot {k}: w")
    # int64 ids (DeepEP's dtype), written so by the library: the same ids
    o64 = ep.ht_dispatch(route, x, topk_weights=w, topk_idx_dtype="int64")
    check(o64["recv_topk_idx"].dtype == np.int64 and
          np.array_equal(o64["recv_topk_idx"], o["recv_topk_idx"]) and
          np.array_equal(o64["recv_x"], o["recv_x"]), "topk_idx_dtype='int64': wrong ids")
    try:
        ep.ht_dispatch(route, x, topk_idx_dtype="int16")
        check(False, "topk_idx_dtype='int16' was taken")
    except ValueError as e:
        check("topk_idx_dtype" in str(e), f"topk_idx_dtype error: {e}")
    # only the outputs asked for: the others None, recv_x the same
    oa = ep.ht_dispatch(route, x, topk_weights=w, outputs=("recv_src_token",))
    check(oa["recv_topk_idx"] is None and oa["recv_topk_weights"] is None and
          oa["recv_src_rank"] is None, "outputs=: an output not asked for was made")
    check(np.array_equal(oa["recv_x"], o["recv_x"]) and
          np.array_equal(oa["recv_src_token"], o["recv_src_token"]), "outputs=: wrong rows")
    try:
        ep.ht_dispatch(route, x, outputs=("recv_y",))
        check(False, "outputs=('recv_y',) was taken")
    except ValueError as e:
        check("outputs" in str(e) and "recv_y" in str(e), f"outputs error: {e}")
    o8 = ep.ht_dispatch(route, q, x_scales=qs)  # fp8 rows on the same route
    for i, (s, t) in enumerate(rows):
        check(np.array_equal(o8["recv_x"][i], all_in[s][3][t]) and
              np.array_equal(o8["recv_x_scales"][i], all_in[s][4][t]), f"fp8 row {i}: wrong")
    # the same scales column-major ([H/128][T + 3], NaN padding), taken without a copy
    col = np.full((qs.shape[1], qs.shape[0] + 3), np.nan, np.float32)
    col[:, :qs.shape[0]] = qs.T
    oc = ep.ht_dispatch(route, q, x_scales=col[:, :qs.shape[0]].T)
    check(np.array_equal(oc["recv_x_scales"], o8["recv_x_scales"]) and
          np.array_equal(oc["recv_x"], o8["recv_x"]), "fp8, column-major x_scales: wrong rows")
    # combine: y = a different map per row's first local expert
    y = bf16(f32(o["recv_x"]) * (1 + rank) + 0.25 * np.arange(len(rows))[:, None])
    yw = (o["recv_topk_weights"] * 2).astype(np.float32)
    out, wout = ep.ht_combine(route, y, topk_weights=yw)
    ref = np.zeros((x.shape[0], H), np.float32)
    refw = np.zeros((x.shape[0], K), np.float32)
    node_of, fwd = ep.nodes()
    # rank order, as ferry sums; forwarding: nodes in order, another
    # node's rows summed there and rounded once to bf16
    order = [d for b in sorted(set(node_of)) for d in range(N) if node_of[d] == b] \
        if fwd else list(range(N))
    part, part_node = None, None
    for d in order + [None]:
        b = node_of[d] if d is not None else None
        if part is not None and b != part_node:  # another node's sum is complete
            ref += f32(bf16(part))
            part = None
        if d is None:
            break
        if fwd and b != node_of[rank] and part is None:
            part, part_node = np.zeros_like(ref), b
        drows = expected_rows(d, N, all_in)
        dy = bf16(f32(all_in[rank][0][[t for s, t in drows if s == rank]]) * (1 + d) +
                  0.25 * np.array([j for j, (s, t) in enumerate(drows) if s == rank])[:, None]) \
            if any(s == rank for s, _ in drows) else None
        n = 0
        for j, (s, t) in enumerate(drows):
            if s != rank:
                continue
            (part if part is not None else ref)[t] += f32(dy[n])
            n += 1
            for k in range(K):
                e = idx[t][k]
                if e >= 0 and e // El == d:
                    refw[t][k] = 2 * w[t][k]
    check(np.array_equal(out, bf16(ref)), f"combine: {np.sum(out != bf16(ref))} values differ")
    check(np.array_equal(wout, refw), "combine: weights differ")
    # bias (DeepEP's): added in fp32 after the rows, before the one rounding
    rb = np.random.default_rng(rnd * 7 + rank)
    b0 = bf16(rb.standard_normal((x.shape[0], H)).astype(np.float32))
    b1 = bf16(rb.standard_normal((x.shape[0], H)).astype(np.float32) * 3)
    outb = ep.ht_combine(route, y, bias=(b0, b1))
    refb = bf16((ref + f32(b0)) + f32(b1))
    check(np.array_equal(outb, refb), f"combine with bias: {np.sum(outb != refb)} values differ")
    check(np.array_equal(ep.ht_combine(route, y, bias=b0), bf16(ref + f32(b0))),
          "combine with one bias: values differ")
    try:
        ep.ht_combine(route, y, bias=(b0, b1, b0))
        check(False, "three biases taken")
    except ValueError as e:
        check("bias" in str(e), f"three biases: {e}")
    try:
        ep.ht_combine(route, y, bias=np.zeros((x.shape[0] + 1, H), np.uint16))
        check(False, "a bias of the wrong shape was taken")
    except (ValueError, TypeError) as e:
        check("bias[0]" in str(e), f"bias shape: {e}")
    # backward identity on the same route: <C(y), g> == <y, D(g)>
    g = bf16(np.round(np.random.default_rng(rnd + 99 * rank).standard_normal((x.shape[0], H)) * 4) / 4)
    yi = bf16(np.round(np.random.default_rng(rnd * 3 + rank).standard_normal((len(rows), H)) * 4) / 4)
    lhs = float(np.sum(f32(ep.ht_combine(route, yi)).astype(np.float64) * f32(g)))
    rhs = float(np.sum(f32(yi).astype(np.float64) * f32(ep.ht_dispatch(route, g)["recv_x"])))
    route.close()
    return lhs, rhs


def run_bounded(ep, rank, N, rnd):
    """A bounded route (max_recv = rows + 2 + rank): num_recv is the bound,
    the real count and the per-expert counts come in the route's outputs,
    the dispatch rows past the real count are padding, combine as usual."""
    El = E_PER_RANK
    all_in = [inputs(s, rnd, N) for s in range(N)]
    x, idx, w = all_in[rank][:3]
    rows = expected_rows(rank, N, all_in)
    bound = len(rows) + 2 + rank
    route = ep.route(idx, max_recv=bound)
    check(route.num_recv == bound and route.num_recv_real[0] == len(rows),
          f"bounded: num_recv {route.num_recv}, real {route.num_recv_real}, rows {len(rows)}")
    cnt = np.zeros(El, np.int64)
    for s, t in rows:
        for e in all_in[s][1][t]:
            if e >= 0 and e // El == rank:
                cnt[e % El] += 1
    check(np.array_equal(route.expert_counts, cnt), f"bounded: expert_counts {route.expert_counts}")
    o = ep.ht_dispatch(route, x, topk_weights=w, topk_idx_dtype="int64" if rank % 2 else "int32")
    check(o["recv_x"].shape[0] == bound, f"bounded: recv_x has {o['recv_x'].shape[0]} rows")
    for i, (s, t) in enumerate(rows):
        check(np.array_equal(o["recv_x"][i], all_in[s][0][t]) and o["recv_src_rank"][i] == s
              and o["recv_src_token"][i] == t, f"bounded: row {i} wrong")
    pad = slice(len(rows), bound)
    check(np.all(o["recv_topk_idx"][pad] == -1) and np.all(o["recv_topk_weights"][pad] == 0) and
          np.all(o["recv_src_rank"][pad] == -1) and np.all(o["recv_src_token"][pad] == -1),
          "bounded: padding rows are not -1 / 0")
    y = np.zeros((bound, H), np.uint16)
    y[:len(rows)] = o["recv_x"][:len(rows)]
    out = ep.ht_combine(route, y)  # identity experts: each token's x times its ranks
    for t in range(x.shape[0]):
        m = sum(any(e >= 0 and e // El == d for e in idx[t]) for d in range(N))
        want = bf16(f32(x[t]) * m) if m else np.zeros(H, np.uint16)  # nowhere: +0
        check(np.array_equal(out[t], want), f"bounded: combined token {t}")
    route.close()


def run_dp(ferry, comm, rank, N, G):
    """DP groups of G (dp_size): every member passes its group's tokens
    (those of the group's first rank); member m's share, tokens
    [m*T//G, (m+1)*T//G), is what it sends; every member's combine holds
    every token's result (identity experts: x times the ranks it reached)."""
    El = E_PER_RANK
    ep = ferry.EP(comm, num_experts=El * N, topk=K, hidden=H, max_tokens=T, mode="ht",
                  ring_tokens=8, dp_size=G)
    check(ep.dp_size == G, f"dp_size {ep.dp_size}")
    for rnd in range(3):  # back to back, the routing changing
        grp = [inputs(s - s % G, 20 + rnd, N) for s in range(N)]  # every rank's inputs
        x, idx, w = grp[rank][0], grp[rank][1], grp[rank][2]
        route = ep.route(idx)
        rows = []  # (source, index in its share, token) of the rows this rank receives
        for s in range(N):
            Ts = grp[s][1].shape[0]
            lo, hi = (s % G) * Ts // G, (s % G + 1) * Ts // G
            for t in range(lo, hi):
                if any(e >= 0 and e // El == rank for e in grp[s][1][t]):
                    rows.append((s, t - lo, t))
        check(route.num_recv == len(rows), f"dp: num_recv {route.num_recv}, expected {len(rows)}")
        o = ep.ht_dispatch(route, x, topk_weights=w)
        for i, (s, j, t) in enumerate(rows):
            check(np.array_equal(o["recv_x"][i], grp[s][0][t]), f"dp: row {i} wrong data")
            check(o["recv_src_rank"][i] == s and o["recv_src_token"][i] == j,
                  f"dp: row {i}: source ({o['recv_src_rank'][i]}, {o['recv_src_token'][i]}), "
                  f"expected ({s}, {j})")
        out, _ = ep.ht_combine(route, o["recv_x"], topk_weights=o["recv_topk_weights"])
        for t in range(x.shape[0]):
            m = len({int(e) // El for e in idx[t] if e >= 0})
            want = bf16(f32(x[t]) * m) if m else np.zeros(H, np.uint16)
            check(np.array_equal(out[t], want), f"dp: combined token {t} of {x.shape[0]}")
        route.close()
    ep.close()


def rank_main(rank, N, port, q):
    try:
        os.environ.update(FERRY_RANK=str(rank), FERRY_WORLD_SIZE=str(N),
                          FERRY_ROOT=f"127.0.0.1:{port}", FERRY_TIMEOUT_MS="10000")
        nodes = int(os.environ.get("FERRY_TEST_NODES", "1"))
        if nodes > 1:  # simulated nodes: shared memory inside, the fabric between
            os.environ["FERRY_NODE_ID"] = f"node{rank * nodes // N}"
        import ferry
        comm = ferry.Comm()
        ep = ferry.EP(comm, num_experts=E_PER_RANK * N, topk=K, hidden=H, max_tokens=T,
                      mode="ht", ring_tokens=8)  # small rings: rows stream through
        node_of, fwd = ep.nodes()
        check(node_of == [r * nodes // N for r in range(N)] and fwd == (nodes > 1 and nodes < N),
              f"nodes() = {node_of}, forwards {fwd}")
        sums = []
        for rnd in range(4):
            sums.append(run_round(ferry, ep, rank, N, rnd, 16 if rnd % 2 else 0))
        run_bounded(ep, rank, N, 5)
        dp = int(os.environ.get("FERRY_TEST_DP", "1"))
        if dp > 1:
            run_dp(ferry, comm, rank, N, dp)
        try:
            ep.dispatch_send(np.zeros((1, H), np.uint16), np.zeros((1, K), np.int64))
            raise AssertionError("a low-latency call on an HT context was accepted")
        except ferry.FerryError as e:
            check("high-throughput" in str(e), f"message: {e}")
        # a dropped route is destroyed by the next call on its context (in
        # that call's thread), not by the collector
        dropped = ep.route(inputs(rank, 8, N)[1])
        a = dropped._h.value
        del dropped
        check(a in ep._route_hs, "a dropped route was destroyed by the collector")
        ep._ep()
        check(a not in ep._route_hs, "a dropped route was not destroyed by the next call")
        left_open = ep.route(inputs(rank, 9, N)[1])  # closed by ep.close()
        # a route the context no longer sees among its live ones (as when
        # the collector cleared the weak reference of a route in a cycle
        # before the context's owner closed it) is still destroyed before
        # the context, and not again after it
        unseen = ep.route(inputs(rank, 7, N)[1])
        ep._routes.discard(unseen)
        ep.close()
        check(not left_open._h, "a route outlived its context")
        check(not ep._route_hs, "routes left owned by a closed context")
        unseen.close()  # nothing to destroy: the context's close did
        del unseen
        try:
            ep.ht_dispatch(left_open, np.zeros((0, H), np.uint16))
            raise AssertionError("a call on a closed context was accepted")
        except ValueError:
            pass
        comm.close()
        q.put((rank, (None, sums)))
    except Exception:
        q.put((rank, (traceback.format_exc(), None)))


def run(N):
    got, crashed = run_ranks(rank_main, N)
    res = [(r, e, sums) for r, (e, sums) in sorted(got.items())]
    errs = [f"rank {r}: {e}" for r, e, _ in res if e] + crashed
    if not errs:  # backward identity: sum over ranks of both sides
        for rnd in range(4):
            lhs = sum(sums[rnd][0] for _, _, sums in res)
            rhs = sum(sums[rnd][1] for _, _, sums in res)
            if abs(lhs - rhs) > 1e-3 * max(1.0, abs(lhs)):
                errs.append(f"round {rnd}: <C(y), g> = {lhs} but <y, D(g)> = {rhs}")
    print(f"test_ht {N} ranks: " + ("ok" if not errs else "FAILED\n" + "\n".join(errs)))
    return not errs


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ok = all([run(int(n)) for n in (sys.argv[1:] or ["1", "2", "3"])])
    sys.exit(0 if ok else 1)
