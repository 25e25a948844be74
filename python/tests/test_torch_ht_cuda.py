#!/usr/bin/env python3
"""ferry's high-throughput mode from PyTorch on CUDA tensors (run on a GPU
machine; ranks may share one GPU). Usage: test_torch_ht_cuda.py [nranks]

  1. ferry.EP(mode="ht", device="cuda"): route, ht_dispatch (bf16 and fp8
     with scales, weights) and ht_combine (with weights riding back), two
     routings back to back, Zipf-like routing, masked slots, a rank with no
     tokens: every received row (bytes, scales, local ids, weights,
     sources) and every combined token checked exactly against a reference
     built here from all ranks' inputs (rows by source rank, then token;
     sums in fp32 in rank order, rounded once).
  2. ferry.deep_ep.Buffer(low_latency_mode=False): get_dispatch_layout
     (also against the host code on a large routing with bad slots),
     dispatch (bf16 and fp8 tuple, expert_alignment), the cached dispatch
     with the handle, combine with weights; the low-latency calls refused
     on it; num_worst_tokens (outputs padded with -1 rows, an empty count
     list, as DeepEP's test_intranode checks), refused with a handle whose
     routing has another size; the same checks again under a default
     device (torch.set_default_device's mode, as DeepEP's tests run).
  3. deep_ep low latency on CUDA tensors: low_latency_update_mask_buffer
     (the last rank leaves, the others mask it and go on; rounds checked),
     query, clean refused once a round ran with the mask; shapes declared
     to Buffer() (ferry_shapes, FERRY_DEEP_EP_SHAPES) made there for CUDA
     tensors, their rounds checked.
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
from ranks import gather_all, torch_init, torch_main  # noqa: E402
from test_torch_cpu import declared_shapes, ll_mask, normal_deepep_checks  # noqa: E402


def inputs(rank, rnd, T, H, E, K):
    """This rank's tokens (on the CPU): none on rank 1 of odd rounds, Zipf
    routing (distinct experts per token), 10% masked slots, weights that
    do not sum to 1, values exact in bf16."""
    g = torch.Generator().manual_seed(7919 * rnd + rank)
    t = 0 if (rank == 1 and rnd % 2) else T - 3 * rank
    x = (torch.randint(-64, 64, (t, H), generator=g).float() / 16).to(torch.bfloat16)
    p = 1.0 / torch.arange(1, E + 1).float() ** 1.1
    idx = torch.stack([torch.multinomial(p, K, replacement=False, generator=g)
                       for _ in range(t)]) if t else torch.zeros((0, K), dtype=torch.int64)
    idx = idx.to(torch.int64)
    idx[torch.rand(t, K, generator=g) < 0.1] = -1
    w = torch.rand(t, K, generator=g) * 0.9 + 0.05
    return x, idx, w


def expected_rows(rank, N, El, xs, ids, ws):
    """Rows this rank receives: by source rank, then token."""
    rows = []
    for s in range(N):
        for t in range(ids[s].shape[0]):
            le = [(int(e) - rank * El) if int(e) >= 0 and int(e) // El == rank else -1
                  for e in ids[s][t]]
            if any(v >= 0 for v in le):
                rows.append((s, t, le))
    return rows


def fp8_quant(x):
    """Per-128 block scales and e4m3 values (the caller's own quantisation:
    HT mode moves fp8 as given)."""
    T, H = x.shape
    b = x.float().view(T, H // 128, 128)
    sc = (b.abs().amax(2) / 448).clamp(min=1e-8)
    q = (b / sc.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return q, sc.contiguous()


def check_native(ferry, comm, rank, N, dev, msgs):
    E, K, H, T = 8 * N, 4, 256, 40
    El = E // N
    ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=T, device="cuda",
                  mode="ht", num_sms=4)
    for rnd in (1, 2):
        x, idx, w = inputs(rank, rnd, T, H, E, K)
        xs, ids, wts = gather_all(N, x, idx, w)
        want = expected_rows(rank, N, El, xs, ids, wts)
        route = ep.route(idx.to(dev), expert_alignment=0)
        if route.num_recv != len(want):
            msgs.append(f"round {rnd}: num_recv {route.num_recv}, expected {len(want)}")
            continue
        cnt = [0] * El
        for _, _, le in want:
            for v in le:
                if v >= 0:
                    cnt[v] += 1
        if list(route.expert_counts) != cnt:
            msgs.append(f"round {rnd}: expert_counts {list(route.expert_counts)}, expected {cnt}")
        for fp8 in (False, True):
            if fp8:
                q, sc = fp8_quant(x)
                o = ep.ht_dispatch(route, q.to(dev), sc.to(dev), w.to(dev))
            else:
                o = ep.ht_dispatch(route, x.to(dev), topk_weights=w.to(dev))
            torch.cuda.synchronize()
            ep.sync()
            for i, (s, t, le) in enumerate(want):
                src = xs[s][t]
                if fp8:
                    qs, ss = fp8_quant(xs[s][t:t + 1])
                    ok = torch.equal(o["recv_x"][i].cpu().view(torch.uint8), qs[0].view(torch.uint8)) \
                        and torch.equal(o["recv_x_scales"][i].cpu(), ss[0])
                else:
                    ok = torch.equal(o["recv_x"][i].cpu(), src)
                wl = [float(wts[s][t][k]) if le[k] >= 0 else 0.0 for k in range(K)]
                if not ok or o["recv_topk_idx"][i].tolist() != le \
                        or o["recv_topk_weights"][i].cpu().tolist() != wl \
                        or int(o["recv_src_rank"][i]) != s or int(o["recv_src_token"][i]) != t:
                    msgs.append(f"round {rnd} fp8={fp8}: row {i} (rank {s} token {t}) wrong")
                    break
        # combine: each received row scaled by (1 + this rank / 4), back and
        # summed in rank order in fp32, rounded once
        y = (torch.stack([xs[s][t] for s, t, _ in want]).float() * (1 + rank / 4)).to(
            torch.bfloat16).to(dev) if want else torch.zeros((0, H), dtype=torch.bfloat16,
                                                              device=dev)
        yw = torch.rand(len(want), K, device=dev)
        out, wout = ep.ht_combine(route, y.contiguous(), yw)
        torch.cuda.synchronize()
        ep.sync()
        ys, yws, wants = gather_all(N, y, yw, want)
        ref = torch.zeros(x.shape, dtype=torch.float32)
        wref = torch.zeros(w.shape, dtype=torch.float32)
        for d in range(N):
            for i, (s, t, le) in enumerate(wants[d]):
                if s == rank:
                    ref[t] += ys[d][i].float()
                    for k in range(K):
                        if le[k] >= 0:
                            wref[t, k] = yws[d][i, k]
        if not torch.equal(out.cpu(), ref.to(torch.bfloat16)):
            msgs.append(f"round {rnd}: combine differs from the fp32 rank-order sum")
        if not torch.equal(wout.cpu(), wref):
            msgs.append(f"round {rnd}: combined weights differ")
        route.close()
    ep.close()


def check_route_reuse(ferry, comm, rank, N, dev, msgs):
    """Routes of changing token counts, each closed before the next: their
    table blocks are reused by routes laid out for other counts (a block
    may hold what another count's layout left where this one's counters
    lie); every route's counts and one dispatch's rows stay exact."""
    E, K, H = 8 * N, 4, 128
    El = E // N
    ep = ferry.EP(comm, num_experts=E, topk=K, hidden=H, max_tokens=2048, device=dev.type,
                  mode="ht", num_sms=4)
    for rnd, T in enumerate((1000, 300, 1500, 40, 2048, 257, 700)):
        x, idx, w = inputs(rank, rnd, T, H, E, K)
        xs, ids, wts = gather_all(N, x, idx, w)
        want = expected_rows(rank, N, El, xs, ids, wts)
        route = ep.route(idx.to(dev))
        cnt = [0] * El
        for _, _, le in want:
            for v in le:
                if v >= 0:
                    cnt[v] += 1
        if route.num_recv != len(want) or list(route.expert_counts) != cnt:
            msgs.append(f"route reuse, T={T}: num_recv {route.num_recv} (want {len(want)}), "
                        f"counts {list(route.expert_counts)} (want {cnt})")
        elif rnd % 3 == 0:
            o = ep.ht_dispatch(route, x.to(dev), topk_weights=w.to(dev))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            got = [(int(a), int(b)) for a, b in zip(o["recv_src_rank"].cpu(),
                                                     o["recv_src_token"].cpu())]
            if got != [(s, t) for s, t, _ in want] or not all(
                    torch.equal(o["recv_x"][i].cpu(), xs[s][t]) for i, (s, t, _) in
                    enumerate(want)):
                msgs.append(f"route reuse, T={T}: dispatched rows wrong")
        route.close()
    ep.close()


def check_deep_ep(deep_ep, rank, N, dev, msgs):
    E, K, H, T = 8 * N, 4, 512, 48
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, int(1e9), 0, low_latency_mode=False)
    if buf.low_latency_mode:
        msgs.append("low_latency_mode should be False")
    x, idx, w = inputs(rank, 2, T, H, E, K)
    xs, ids = gather_all(N, x, idx)
    xd, idd, wd = x.to(dev), idx.to(dev), w.to(dev)
    per_rank, rdma, per_exp, in_rank, ev = buf.get_dispatch_layout(idd, E)
    want_in = torch.zeros((x.shape[0], N), dtype=torch.bool)
    for t in range(x.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                want_in[t, e // El] = True
    want_exp = torch.bincount(idx[idx >= 0], minlength=E).int()
    # tokens per node only across nodes (DeepEP's None on one node)
    if (rdma is not None) != (buf.runtime.get_num_rdma_ranks() > 1) or \
            not torch.equal(in_rank.cpu(), want_in) or \
            not torch.equal(per_rank.cpu(), want_in.sum(0).int()) or \
            not torch.equal(per_exp.cpu(), want_exp):
        msgs.append("get_dispatch_layout: wrong counts")
    # the GPU kernel against the host code (checked in CI) on a large
    # skewed routing with masked, out-of-range and same-rank slots, and on
    # a non-contiguous view
    g = torch.Generator().manual_seed(31 + rank)
    big = torch.randint(0, E, (3000, K), generator=g) // (1 + (torch.rand(3000, K, generator=g) < 0.5).long() * 3)
    big[torch.rand(3000, K, generator=g) < 0.1] = -1
    big[5, 0], big[6, 1], big[7, 2] = E, E + 9, big[7, 0]
    from ferry import deep_ep as fde
    # 3000 tokens: one block storing its counters; 5000: blocks adding
    # theirs to zeroed counters
    big2 = torch.cat([big, big[:2000].flip(0)])
    for case, t in (("contiguous", big), ("strided", big.t().contiguous().t()),
                    ("5000 tokens", big2)):
        torch.full((1 << 20,), -7, dtype=torch.int32, device=dev)  # freed: garbage to reuse
        rpn = max(1, (N + 1) // 2)  # per-node counts too: two nodes, the last smaller
        ref = fde._layout_c(t, E, N, rpn)  # the host code
        for name, got in (("kernel", fde._layout_c(t.to(dev), E, N, rpn)),
                          ("torch ops", fde._layout_torch(t.to(dev), E, N))):
            for j in range(len(got)):
                if not torch.equal(got[j].cpu(), ref[j]):
                    msgs.append(f"get_dispatch_layout on the GPU ({name}, {case}): output "
                                f"{j} differs from the host's")
    want = expected_rows(rank, N, El, xs, ids, None)
    rx, ridx, rw, counts, handle, ev = buf.dispatch(
        xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_exp, topk_idx=idd, topk_weights=wd, expert_alignment=4,
        config=buf.get_dispatch_config(N), async_finish=True)
    ev.current_stream_wait()
    torch.cuda.synchronize()
    cnt = [0] * El
    for _, _, le in want:
        for v in le:
            if v >= 0:
                cnt[v] += 1
    if counts != [(c + 3) // 4 * 4 for c in cnt]:
        msgs.append(f"dispatch: expert counts {counts}, expected {cnt} rounded up to 4")
    if rx.shape[0] != len(want) or ridx.dtype != torch.int64:
        msgs.append(f"dispatch: {rx.shape[0]} rows ({ridx.dtype}), expected {len(want)} (int64)")
    else:
        for i, (s, t, le) in enumerate(want):
            if not torch.equal(rx[i].cpu(), xs[s][t]) or ridx[i].tolist() != le:
                msgs.append(f"dispatch: row {i} (rank {s} token {t}) wrong")
                break
    # cached: the same routing, new data (a backward pass's gradient)
    g = (xd.float() * 2).to(torch.bfloat16)
    rx2, a, b, c, h2, _ = buf.dispatch(g, handle=handle)
    if a is not None or b is not None or c is not None or h2 is not None or \
            not torch.equal(rx2.float(), rx.float() * 2):
        msgs.append("cached dispatch: wrong result")
    q, sc = fp8_quant(x)
    (fx, fs), *_ = buf.dispatch((q.to(dev), sc.to(dev)), handle=handle)
    torch.cuda.synchronize()
    for i, (s, t, _) in enumerate(want):
        qs, ss = fp8_quant(xs[s][t:t + 1])
        if not torch.equal(fx[i].cpu().view(torch.uint8), qs[0].view(torch.uint8)) or \
                not torch.equal(fs[i].cpu(), ss[0]):
            msgs.append(f"fp8 dispatch: row {i} wrong")
            break
    out, cw, ev = buf.combine(rx, handle, topk_weights=rw,
                              config=buf.get_combine_config(N))
    torch.cuda.synchronize()
    # every rank a token went to returns it unchanged: out = x * ranks
    nr = want_in.sum(1).float().unsqueeze(1)
    if not torch.equal(out.cpu(), (x.float() * nr).to(torch.bfloat16)):
        msgs.append("combine: out != x * (ranks the token went to)")
    wz = torch.where(idx >= 0, w, torch.zeros_like(w))
    if cw is None or not torch.equal(cw.cpu(), wz):
        msgs.append("combine: weights did not come back")
    # num_worst_tokens (a bounded route): DeepEP's test_intranode checks
    worst = T * N
    wx, widx, ww, empty, wh, _ = buf.dispatch(
        xd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_exp, topk_idx=idd, topk_weights=wd, num_worst_tokens=worst)
    torch.cuda.synchronize()
    n = rx.shape[0]
    if len(empty) != 0 or wx.shape[0] != worst or widx.shape[0] != worst or \
            ww.shape[0] != worst or not torch.equal(rx, wx[:n]) or \
            not torch.equal(ridx, widx[:n]) or not torch.equal(rw, ww[:n]) or \
            not bool(torch.all(widx[n:] == -1)):
        msgs.append("num_worst_tokens: outputs not padded like DeepEP's")
    wout, _, _ = buf.combine(wx, wh)
    torch.cuda.synchronize()
    if not torch.equal(wout.cpu(), (x.float() * nr).to(torch.bfloat16)):
        msgs.append("num_worst_tokens: combine on the padded rows wrong")
    del wh
    for name, fn in (("low_latency_dispatch", lambda: buf.low_latency_dispatch(xd, idd, T, E)),
                     ("num_worst_tokens", lambda: buf.dispatch(xd, handle=handle,
                                                               num_worst_tokens=n + 1))):
        try:
            fn()
            msgs.append(f"{name}: not refused")
        except (RuntimeError, NotImplementedError, ValueError) as e:
            if name.split("_")[0] not in str(e):
                msgs.append(f"{name}: message does not name it: {e}")
    del handle, h2
    buf.destroy()


def rank_main(rank, N, port, q):
    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch_init(rank, N, port)
        dev = torch.device("cuda", torch.cuda.current_device())
        import ferry
        from ferry import deep_ep
        msgs = []
        comm = ferry.Comm(torch.distributed.group.WORLD)
        check_native(ferry, comm, rank, N, dev, msgs)
        check_route_reuse(ferry, comm, rank, N, dev, msgs)
        comm.close()
        check_deep_ep(deep_ep, rank, N, dev, msgs)
        msgs += [f"deep_ep normal mode, DeepEP's checks: {m}"
                 for m in normal_deepep_checks(deep_ep, rank, N, dev)]
        msgs += [f"deep_ep low latency, masking a rank: {m}"
                 for m in ll_mask(deep_ep, rank, N, dev)]
        msgs += [f"deep_ep low latency, declared shapes: {m}"
                 for m in declared_shapes(deep_ep, rank, N, dev)]
        # under torch.set_default_device's mode, as DeepEP's tests run (ferry
        # turns the mode off inside its calls: what it makes names its device)
        with torch.device(dev):
            msgs += [f"deep_ep normal mode under a default device: {m}"
                     for m in normal_deepep_checks(deep_ep, rank, N, dev)]
        torch.distributed.destroy_process_group()
        q.put((rank, msgs))
    except Exception:
        q.put((rank, [traceback.format_exc()]))


def main():
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    title = (f"test_torch_ht_cuda ({N} ranks): EP(mode='ht') on CUDA, "
             "deep_ep normal mode")
    sys.exit(torch_main(rank_main, N, title))


if __name__ == "__main__":
    main()
