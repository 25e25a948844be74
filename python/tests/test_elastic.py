#!/usr/bin/env python3
"""deep_ep.ElasticBuffer (DeepEP 2's V2 API) on ferry, CPU ranks (or CUDA
with `cuda`): every output against a reference of DeepEP 2's documented
semantics computed from every rank's inputs. Usage:
test_elastic.py [cpu|cuda] [nranks]

Per round (back to back, changing routing): Zipf routing with distinct
experts, 10% masked slots, a rank with no tokens in odd rounds, weights
not summing to 1, dispatched values exact in bf16 and fp8. For do_cpu_sync 1 and 0, do_expand 0 and 1, expert_alignment 1
and 4, bf16 and fp8 (with scales): rows (by source rank, then token),
recv_src_metadata, recv_topk_idx (local ids, -1 elsewhere), the full
weight rows or the expanded 1-D weights, the per-rank and per-expert
prefix sums, the aligned per-expert list, cumulative stats, zero padding,
a cached dispatch (the same handle, equal rows), combine with 0, 1 and 2
biases and a different row per expert, in values whose fp32 sums depend
on their order, against DeepEP 2's order (biases first, then each rank's
row at its highest top-k slot), and the returned weights; with
allow_multiple_reduction=False, the expanded combine's single reduction
(biases, then every slot's row in slot order, one rounding) and its
refusal of topk_weights.
Argument errors name the argument; a bad topk_idx on one rank fails
every rank's dispatch, naming it, and the buffer goes on; the experimental
methods are refused by name. Exit 77 without torch.
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
from ranks import ranks_main, test_nodes, torch_init  # noqa: E402

H, K, MAXT = 256, 4, 24


def inputs(rank, rnd, E, dev):
    g = torch.Generator().manual_seed(7919 * rnd + rank)
    t = 0 if (rank == 1 and rnd % 2) else MAXT - 3 * rank
    x = (torch.randint(-15, 16, (t, H), generator=g).float() / 8)  # exact in fp8 too
    p = 1.0 / torch.arange(1, E + 1).float() ** 1.1
    idx = torch.stack([torch.multinomial(p, K, replacement=False, generator=g)
                       for _ in range(t)]) if t else torch.zeros((0, K), dtype=torch.int64)
    idx[torch.rand(t, K, generator=g) < 0.1] = -1
    w = (torch.randint(1, 16, (t, K), generator=g).float() / 16)
    return x.to(torch.bfloat16).to(dev), idx.to(dev), w.to(dev)


TOLD = [0, 0]  # tokens whose slot-order sum differed from the rank-order one; tokens
# whose single reduction differed from the per-rank one


def wide(s, t, e, dev):
    """Expert e's output row for rank s's token t: +-2^20 exactly (a third
    of the channels) or +-(1 + m/128) 2^-j, j < 7 (exact in bf16): a small
    value added before two bigs cancel is lost, so fp32 sums of these
    depend on their order."""
    hh = torch.arange(H, dtype=torch.int64, device=dev)
    z = ((s * 1000003 + t * 7919 + (e + 1) * 104729) * (hh * 2 + 1) + hh * 65537) % 2147483647
    z = (z * 48271) % 2147483647
    small = (1 + ((z >> 5) % 128).double() / 128) * torch.pow(2.0, -((z >> 12) % 7).double())
    v = torch.where(z % 3 == 0, torch.full_like(small, 2.0 ** 20), small)
    v = torch.where((z >> 3) % 2 == 1, -v, v)
    return v.to(torch.bfloat16)


def partial(s, t, experts, r, El, dev):
    """Rank r's row for rank s's token t: its experts' rows (global ids,
    -1 elsewhere) summed in slot order in fp32, rounded once."""
    a = torch.zeros(H, dtype=torch.float32, device=dev)
    for e in experts:
        if e >= 0 and e // El == r:
            a += wide(s, t, e, dev).float()
    return a.to(torch.bfloat16)


def combine_reference(me, T, idx, El, biases, nodes, dev):
    """DeepEP 2's combine order (ferry's sum_order "slots"): the biases
    first, then per slot the row of the contributor whose highest slot it
    is, fp32, one rounding. A contributor is a rank, or with forwarding
    another node (its ranks' rows summed there in rank order, rounded).
    Returns (out, tokens where ascending rank order, biases last, differs)."""
    node_of, fwd = nodes
    out = torch.zeros((T, H), dtype=torch.bfloat16, device=dev)
    told = 0
    for t in range(T):
        ids = idx[t].tolist()
        ranks = sorted({e // El for e in ids if e >= 0})
        rows = {r: partial(me, t, ids, r, El, dev) for r in ranks}

        def key(r):
            return ("n", node_of[r]) if fwd and node_of[r] != node_of[me] else ("r", r)
        val = {}
        for k in sorted({key(r) for r in ranks}):
            if k[0] == "r":
                val[k] = rows[k[1]]
            else:
                a = torch.zeros(H, dtype=torch.float32, device=dev)
                for r in ranks:
                    if key(r) == k:
                        a += rows[r].float()
                val[k] = a.to(torch.bfloat16)
        top = {}
        for j, e in enumerate(ids):
            if e >= 0:
                top[key(e // El)] = j
        a = torch.zeros(H, dtype=torch.float32, device=dev)
        for b in biases:
            a += b[t].float()
        for k in sorted(top, key=lambda k: top[k]):
            a += val[k].float()
        out[t] = a.to(torch.bfloat16)
        r_acc = torch.zeros(H, dtype=torch.float32, device=dev)
        for k in sorted(val):
            r_acc += val[k].float()
        for b in biases:
            r_acc += b[t].float()
        told += int(not torch.equal(r_acc.to(torch.bfloat16), out[t]))
    return out, told


def single_reference(me, T, idx, biases, dev):
    """DeepEP 2's combine of an expanded dispatch without
    allow_multiple_reduction: the biases, then every slot's expert row in
    slot order, fp32, one rounding. Returns (out, tokens where it differs
    from the per-rank reduction's result, multi)."""
    out = torch.zeros((T, H), dtype=torch.bfloat16, device=dev)
    for t in range(T):
        a = torch.zeros(H, dtype=torch.float32, device=dev)
        for b in biases:
            a += b[t].float()
        for e in idx[t].tolist():
            if e >= 0:
                a += wide(me, t, e, dev).float()
        out[t] = a.to(torch.bfloat16)
    return out


def reference(everyone, me, N, E):
    """What rank `me` receives: [(src, tok, x row, local ids, weights)], in
    source rank, then token order."""
    El = E // N
    rows = []
    for src, (x, idx, w) in enumerate(everyone):
        for t in range(x.shape[0]):
            ids = idx[t].tolist()
            if any(e >= 0 and e // El == me for e in ids):
                loc = [e - me * El if e >= 0 and e // El == me else -1 for e in ids]
                rows.append((src, t, x[t], loc, w[t]))
    return rows


def check(msgs, what, ok):
    if not ok:
        msgs.append(what)


def one_round(buf, everyone, rank, N, E, rnd, dev, msgs, cpu_sync, expand, A, fp8, nbias,
              single=False):
    El = E // N
    x, idx, w = everyone[rank]
    tag = f"round {rnd} sync={cpu_sync} expand={expand} align={A} fp8={fp8} bias={nbias}" + \
        (" single reduction" if single else "")
    xin = x
    if fp8:
        xin = (x.float().to(torch.float8_e4m3fn), torch.ones((x.shape[0], H // 128),
                                                             dtype=torch.float32, device=dev))
    stats = torch.zeros(El, dtype=torch.int32, device=dev)
    rx, ridx, rw, h, ev = buf.dispatch(xin, topk_idx=idx, topk_weights=w, num_experts=E,
                                       num_max_tokens_per_rank=MAXT, expert_alignment=A,
                                       do_cpu_sync=cpu_sync, do_expand=expand,
                                       do_zero_padding=expand,
                                       cumulative_local_expert_recv_stats=stats)
    ref = reference(everyone, rank, N, E)
    n = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
    check(msgs, f"{tag}: {n} rows, want {len(ref)}", n == len(ref))
    if n != len(ref):
        return
    per_src = [sum(1 for r in ref if r[0] == s) for s in range(N)]
    check(msgs, f"{tag}: psum per rank {h.psum_num_recv_tokens_per_scaleup_rank.tolist()}",
          h.psum_num_recv_tokens_per_scaleup_rank.tolist() ==
          torch.cumsum(torch.tensor(per_src), 0).tolist())
    meta = h.recv_src_metadata
    want0 = [s * MAXT + t for s, t, *_ in ref]
    check(msgs, f"{tag}: metadata column 0", meta[:n, 0].tolist() == want0)
    # column 1: source rank x K + the highest slot whose expert is here
    want1 = [s * K + max(j for j, e in enumerate(loc) if e >= 0) for s, t, _, loc, _ in ref]
    check(msgs, f"{tag}: metadata column 1", meta[:n, 1].tolist() == want1)
    x_idx = everyone[rank][1]
    check(msgs, f"{tag}: dst_buffer_slot_idx (destination rank per slot)",
          h.dst_buffer_slot_idx.tolist() == torch.where(x_idx >= 0, x_idx // El,
                                                        -1).tolist())
    cnt = [sum(1 for r in ref for e in r[3] if e == le) for le in range(El)]
    al = [(c + A - 1) // A * A for c in cnt]
    check(msgs, f"{tag}: stats {stats.tolist()} want {cnt}", stats.tolist() == cnt)
    check(msgs, f"{tag}: unaligned counts",
          h.num_unaligned_recv_tokens_per_expert.tolist() == cnt)
    if cpu_sync:
        check(msgs, f"{tag}: expert list {h.num_recv_tokens_per_expert_list} want {al}",
              h.num_recv_tokens_per_expert_list == al)
        check(msgs, f"{tag}: rows {rx[0].shape[0] if fp8 else rx.shape[0]} (cpu sync: exact)",
              (rx[0] if fp8 else rx).shape[0] == (sum(al) if expand else n))
    else:
        check(msgs, f"{tag}: no cpu sync: empty expert list", h.num_recv_tokens_per_expert_list
              == [])
    xr = rx[0].float() if fp8 else rx.float()
    if not expand:
        check(msgs, f"{tag}: psum per expert", h.psum_num_recv_tokens_per_expert.tolist() ==
              torch.cumsum(torch.tensor(al), 0).tolist())
        for i, (s, t, xrow, loc, wrow) in enumerate(ref):
            if not torch.equal(xr[i], xrow.float()):
                msgs.append(f"{tag}: row {i} (rank {s} token {t}) differs")
                break
            wm = torch.where(torch.tensor(loc, device=dev) >= 0, wrow, torch.zeros_like(wrow))
            rwm = torch.where(ridx[i] >= 0, rw[i], torch.zeros_like(rw[i]))
            if ridx[i].tolist() != loc or not torch.equal(rwm, wm):
                msgs.append(f"{tag}: row {i} ids {ridx[i].tolist()} != {loc} or weights")
                break
    else:
        check(msgs, f"{tag}: recv_topk_idx None when expanded", ridx is None)
        start = [sum(al[:e]) for e in range(El)]
        check(msgs, f"{tag}: expanded psum", h.psum_num_recv_tokens_per_expert.tolist() ==
              [start[e] + cnt[e] for e in range(El)])
        for e in range(El):
            mine = [(i, r) for i, r in enumerate(ref) if e in r[3]]
            for k, (i, (s, t, xrow, loc, wrow)) in enumerate(mine):
                p = start[e] + k
                j = loc.index(e)
                if not torch.equal(xr[p], xrow.float()) or float(rw[p]) != float(wrow[j]) or \
                        int(meta[i, 2 + j]) != p:
                    msgs.append(f"{tag}: expert {e} row {k} (rank {s} token {t}) differs")
                    return
            for p in range(start[e] + cnt[e], start[e] + al[e]):  # zero padding
                if xr[p].abs().sum() != 0 or float(rw[p]) != 0:
                    msgs.append(f"{tag}: expert {e} padding row {p} not zero")
                    return
    # cached: rows of another hidden size refused naming x
    try:
        buf.dispatch(torch.cat([x, x], 1), handle=h, do_expand=expand)
        msgs.append(f"{tag}: a cached dispatch of rows twice as wide was accepted")
    except (ValueError, TypeError) as e:
        check(msgs, f"{tag}: the wide rows' error names x: {e}", str(e).startswith("x"))
    # cached: the same rows, the same handle's layout
    cx, cidx, cw, ch, _ = buf.dispatch(xin, handle=h, do_expand=expand)
    check(msgs, f"{tag}: cached dispatch returns the same handle", ch is h)
    cxr = cx[0].float() if fp8 else cx.float()
    m = sum(al) if expand else n
    if expand:  # the rows an expert got (padding is not written without do_zero_padding)
        v = meta[:n, 2:]
        v = v[v >= 0].long()
        check(msgs, f"{tag}: cached rows differ", torch.equal(cxr[v], xr[v]))
    else:
        check(msgs, f"{tag}: cached rows differ", torch.equal(cxr[:m], xr[:m]))
    # combine: each row's experts here applied (expanded: per row of an
    # expert), values whose fp32 sums depend on their order (wide)
    if expand:
        y = torch.zeros((xr.shape[0], H), dtype=torch.bfloat16, device=dev)
        for i, (s, t, xrow, loc, wrow) in enumerate(ref):
            for j, le in enumerate(loc):
                if le >= 0:
                    y[int(meta[i, 2 + j])] = wide(s, t, le + rank * El, dev)
        yw = rw
    else:
        y = torch.zeros((xr.shape[0], H), dtype=torch.bfloat16, device=dev)
        for i, (s, t, xrow, loc, wrow) in enumerate(ref):
            y[i] = partial(s, t, [le + rank * El if le >= 0 else -1 for le in loc], rank, El,
                           dev)
        yw = rw
    T = x.shape[0]
    biases = [wide(rank, 1000 + b, 7 * b, dev).repeat(T, 1) *
              (1 + torch.arange(T, device=dev).view(T, 1) % 3).to(torch.bfloat16)
              for b in range(nbias)]
    bias = None if nbias == 0 else (biases[0] if nbias == 1 else tuple(biases))
    nodes = h._ep.nodes()
    if single:  # DeepEP 2's allow_multiple_reduction=False: no weights, one reduction
        try:
            buf.combine(y, h, topk_weights=yw, bias=bias)
            msgs.append(f"{tag}: combine with topk_weights accepted")
        except ValueError as e:
            check(msgs, f"{tag}: {e} does not name allow_multiple_reduction",
                  "allow_multiple_reduction" in str(e))
        out, ow, _ = buf.combine(y, h, bias=bias)
        want = single_reference(rank, x.shape[0], idx, biases, dev)
        multi, _ = combine_reference(rank, x.shape[0], idx, El, biases, nodes, dev)
        TOLD[1] += int((want != multi).any(1).sum())
        check(msgs, f"{tag}: combined x differs", torch.equal(out, want))
        check(msgs, f"{tag}: combined weights {ow}, want None", ow is None)
        return
    out, ow, _ = buf.combine(y, h, topk_weights=yw, bias=bias)
    if test_nodes() > 1:  # on simulated nodes: flat, as the logical domain (1, N) says
        check(msgs, f"{tag}: nodes {nodes}: want {test_nodes()} nodes, no forwarding",
              len(set(nodes[0])) == test_nodes() and not nodes[1])
    want, told = combine_reference(rank, x.shape[0], idx, El, biases, nodes, dev)
    TOLD[0] += told
    check(msgs, f"{tag}: combined x differs", torch.equal(out, want))
    wz = torch.where(idx >= 0, w, torch.zeros_like(w))
    check(msgs, f"{tag}: combined weights differ", ow is not None and torch.equal(ow, wz))
    if not expand:
        lazy_handle(buf, xin, idx, w, E, A, cpu_sync, h, tag, msgs)


LAZY = ("recv_src_metadata", "dst_buffer_slot_idx", "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert")


def lazy_handle(buf, xin, idx, w, E, A, cpu_sync, h, tag, msgs):
    """A dispatch without stats or expansion makes its handle's tensors when
    first read: they equal those of the same routing's handle made by a
    dispatch (h, with stats), even after the caller changed recv_topk_idx
    in place; a combine needs none of them; each can be set."""
    rx, ridx, rw, h2, _ = buf.dispatch(xin, topk_idx=idx, topk_weights=w, num_experts=E,
                                       num_max_tokens_per_rank=MAXT, expert_alignment=A,
                                       do_cpu_sync=cpu_sync)
    check(msgs, f"{tag}: lazy handle: made after the dispatch", h2.__dict__["_make"] is not None)
    ridx.fill_(-7)  # the caller's to change
    buf.combine(torch.zeros((ridx.shape[0], H), dtype=torch.bfloat16, device=idx.device), h2,
                topk_weights=rw)
    check(msgs, f"{tag}: lazy handle: a combine reads none", h2.__dict__["_make"] is not None)
    for name in LAZY:
        a, b = getattr(h2, name), getattr(h, name)
        n = int(h.psum_num_recv_tokens_per_scaleup_rank[-1]) if name == "recv_src_metadata" \
            else None
        if n is not None:  # columns 2.. are DeepEP's "uninitialized" (exact routes)
            a, b = a[:n, :2], b[:n, :2]
        check(msgs, f"{tag}: lazy handle: {name} differs", torch.equal(a, b))
    n2 = h2.num_recv_tokens
    if n2 > 0:  # fewer rows than the route received, the handle told so: refused
        h2.num_recv_tokens = n2 - 1
        try:
            buf.combine(torch.zeros((n2 - 1, H), dtype=torch.bfloat16, device=idx.device), h2)
            msgs.append(f"{tag}: a combine of {n2 - 1} rows for {n2} received was accepted")
        except ValueError as e:
            check(msgs, f"{tag}: the short combine's error names y: {e}", str(e).startswith("y"))
        h2.num_recv_tokens = n2
    t = torch.zeros(3, dtype=torch.int32, device=idx.device)
    h2.dst_buffer_slot_idx = t
    check(msgs, f"{tag}: lazy handle: a field set reads back", h2.dst_buffer_slot_idx is t)
    # without do_handle_copy the handle holds the caller's topk_idx: the
    # destinations are those of the dispatch, whatever the caller writes after
    mine = idx.clone()
    rx, _, rw, h3, _ = buf.dispatch(xin, topk_idx=mine, topk_weights=w, num_experts=E,
                                    num_max_tokens_per_rank=MAXT, expert_alignment=A,
                                    do_cpu_sync=cpu_sync, do_handle_copy=False)
    check(msgs, f"{tag}: do_handle_copy=False keeps the caller's topk_idx", h3.topk_idx is mine)
    mine.fill_(-1)
    check(msgs, f"{tag}: do_handle_copy=False: destinations of the dispatch",
          torch.equal(h3.dst_buffer_slot_idx, h.dst_buffer_slot_idx))
    buf.combine(torch.zeros((rw.shape[0], H), dtype=torch.bfloat16, device=idx.device), h3)


def rank_main(rank, N, port, q, kind):
    msgs = []
    try:
        torch_init(rank, N, port)
        dev = torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(0)
            dev = torch.device("cuda", 0)
        from ferry import deep_ep as de
        E = 4 * N
        buf = de.ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=MAXT,
                               hidden=H, explicitly_destroy=True)
        check(msgs, "logical domain", buf.get_logical_domain_size() == (1, N))
        check(msgs, "theoretical SMs", buf.get_theoretical_num_sms(E, K) >= 1)
        rnd = 0
        for cpu_sync in (True, False):
            for expand in (False, True):
                for A, fp8, nbias in ((1, False, 0), (4, True, 1), (1, False, 2)):
                    everyone = [inputs(r, rnd, E, dev) for r in range(N)]
                    one_round(buf, everyone, rank, N, E, rnd, dev, msgs, cpu_sync, expand, A,
                              fp8, nbias)
                    rnd += 1
        # a dropped handle's route is freed (an EPHandle has no close; a
        # route nobody holds closes itself): none is left open after the
        # rounds, whose handles are gone
        left = 0
        for ep in buf._buf._eps.values():
            ep._ep()  # a call on the context destroys the dead routes
            left += len(ep._routes) + len(ep._route_hs)
        check(msgs, f"{left} routes still open after the rounds' handles were dropped",
              left == 0)
        one = de.ElasticBuffer(torch.distributed.group.WORLD, num_max_tokens_per_rank=MAXT,
                               hidden=H, explicitly_destroy=True,
                               allow_multiple_reduction=False)
        for cpu_sync in (True, False):
            for A, fp8, nbias in ((1, False, 0), (4, True, 2)):
                everyone = [inputs(r, rnd, E, dev) for r in range(N)]
                one_round(one, everyone, rank, N, E, rnd, dev, msgs, cpu_sync, True, A, fp8,
                          nbias, single=True)
                rnd += 1
        one.destroy()
        check(msgs, "the combine checks could not tell slot order from rank order "
              "(no token where they differ)", TOLD[0] > 0)
        check(msgs, "the single-reduction checks could not tell it from the per-rank "
              "reduction (no token where they differ)", TOLD[1] > 0)
        x, idx, w = inputs(rank, 0, E, dev)
        for args, name in ((dict(previous_event=object()), "allocate_on_comm_stream"),
                           (dict(do_zero_padding=True), "do_zero_padding"),
                           (dict(num_experts=0), "num_experts")):
            try:
                buf.dispatch(x, topk_idx=idx, topk_weights=w, **dict(dict(num_experts=E),
                                                                     **args))
                msgs.append(f"dispatch with {args}: no error")
            except (ValueError, TypeError) as e:
                check(msgs, f"dispatch with {args}: {e} does not name {name}", name in str(e))
        # a bad topk_idx on the last rank alone: every rank's dispatch
        # raises, the others' naming that rank, and the buffer goes on
        bad = idx.clone()
        if rank == N - 1:
            bad[0, 0] = 10 * E
        try:
            buf.dispatch(x, topk_idx=bad, topk_weights=w, num_experts=E)
            msgs.append(f"a bad topk_idx on rank {N - 1}: no error")
        except Exception as e:  # noqa: BLE001 (FerryError)
            check(msgs, f"a bad topk_idx on rank {N - 1}: {e}",
                  "topk_idx" in str(e) and (rank == N - 1 or f"rank {N - 1}" in str(e)))
        try:
            rx, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            buf.combine(rx, h)
        except Exception as e:  # noqa: BLE001
            msgs.append(f"a dispatch after a bad topk_idx: {e}")
        try:
            buf.engram_write(None)
            msgs.append("engram_write: no error")
        except NotImplementedError as e:
            check(msgs, f"engram_write: {e}", "engram_write" in str(e))
        buf.destroy()
    except Exception:
        msgs.append(traceback.format_exc())
    q.put((rank, msgs))


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    N = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    import functools
    sys.exit(ranks_main(functools.partial(rank_main, kind=kind), [N],
                        f"deep_ep.ElasticBuffer on ferry ({kind})", gpu=kind == "cuda"))


if __name__ == "__main__":
    main()
