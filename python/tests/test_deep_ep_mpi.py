"""ferry.deep_ep on an mpi4py communicator: DeepEP v1.2.1's
Buffer(group=None, comm=...), on CPU ranks started by mpirun.

On COMM_WORLD, then on a split of it (the last rank alone, the others
together, so a rank's number in the communicator is not its number in
the world), each rank checks:
  - low-latency rounds (bf16 and fp8): every local expert's rows, their
    order and sources against the inputs of all the communicator's ranks,
    and the combine against a reference (a different transform per expert,
    weights that do not sum to 1, masked slots, one rank with no tokens);
  - normal mode: get_dispatch_layout, dispatch with expert_alignment, the
    handle's rank_prefix_matrix (all-gathered over the communicator), the
    combine, and a dispatch routed by is_token_in_rank alone (its counts
    per expert all-reduced over the communicator);
  - a bad `comm` (not a communicator) is refused naming it.

Run: mpirun -n 3 python3 test_deep_ep_mpi.py (FERRY_LIB, PYTHONPATH as for
the other tests); every rank prints its failures, rank 0 the verdict.
"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from test_torch_cuda import (check_round, combine_error, combine_ref, expect,  # noqa: E402
                             expert_fn, expert_outputs, make_inputs)


def ll_rounds(deep_ep, comm, msgs):
    rank, N = comm.Get_rank(), comm.Get_size()
    E, K, H, T = 4 * N, 3, 256, 12
    El, dev = E // N, torch.device("cpu")
    # every argument positional, as DeepEP v1.2.1 orders them: comm is the
    # ninth (group, nvl and rdma bytes, low_latency_mode, qps, nvlink,
    # mnnvl, explicitly_destroy, comm)
    buf = deep_ep.Buffer(None, 0, 0, True, 24, True, False, False, comm)
    try:
        if (buf.rank, buf.group_size, buf.group) != (rank, N, comm):
            msgs.append(f"rank/group_size/group: {buf.rank} {buf.group_size}, want {rank} {N}")
        for rnd, fp8 in ((1, False), (2, True), (3, False)):
            x, idx, w = make_inputs(rank, 300 + rnd, T, H, E, K, dev)
            if rnd == 3 and rank == N - 1:
                idx = torch.full_like(idx, -1)  # a rank with no tokens
            xs = comm.allgather(x)
            ids = comm.allgather(idx)
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8)
            err = check_round(rank, N, E, K, xs, ids, recv, count,
                              (handle.src_rank, handle[0]), fp8)
            if err:
                msgs.append(f"low-latency dispatch round {rnd} fp8={fp8}: {err}")
            y = expert_outputs(rank, El, recv, count, fp8, dev)
            out, _, _ = buf.low_latency_combine(y, idx, w, handle)
            err = combine_error(out, combine_ref(x, idx, w, fp8))
            if err:
                msgs.append(f"low-latency combine round {rnd} fp8={fp8}: {err}")
    finally:
        buf.destroy()


def normal_rounds(deep_ep, comm, msgs):
    rank, N = comm.Get_rank(), comm.Get_size()
    E, K, H, T, align = 4 * N, 3, 256, 16, 4
    El, dev = E // N, torch.device("cpu")
    buf = deep_ep.Buffer(None, low_latency_mode=False, comm=comm)
    try:
        x, idx, w = make_inputs(rank, 400, T, H, E, K, dev)
        xs, ids, ws = comm.allgather(x), comm.allgather(idx), comm.allgather(w)
        nr, _, ne, inr, _ = buf.get_dispatch_layout(idx, E)
        rx, ridx, rw, counts, handle, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=nr, is_token_in_rank=inr,
            num_tokens_per_expert=ne, expert_alignment=align)
        exp_rows = [(s, t) for s in range(N) for t in range(ids[s].shape[0])
                    if ((ids[s][t] >= rank * El) & (ids[s][t] < rank * El + El)).any()]
        want = [-(-sum(1 for s, t in exp_rows if (ids[s][t] == rank * El + le).any()) // align)
                * align for le in range(El)]
        if counts != want:
            msgs.append(f"normal dispatch: counts per expert {counts}, want {want}")
        if rx.shape[0] != len(exp_rows) or any(
                not torch.equal(rx[j], xs[s][t]) for j, (s, t) in enumerate(exp_rows)):
            msgs.append(f"normal dispatch: {rx.shape[0]} rows, want {len(exp_rows)} in order")
        # rank_prefix_matrix [i][j]: tokens ranks 0..i send to rank j
        sent = torch.tensor([[sum(1 for t in range(ids[i].shape[0])
                                  if ((ids[i][t] >= j * El) & (ids[i][t] < j * El + El)).any())
                              for j in range(N)] for i in range(N)], dtype=torch.int32)
        if not torch.equal(handle[0], torch.cumsum(sent, 0, dtype=torch.int32)):
            msgs.append(f"normal dispatch: rank_prefix_matrix {handle[0].tolist()}, want "
                        f"{torch.cumsum(sent, 0).tolist()}")
        y = torch.zeros(rx.shape, dtype=torch.float32)
        for j in range(rx.shape[0]):
            for k in range(K):
                if int(ridx[j, k]) >= 0:
                    e = rank * El + int(ridx[j, k])
                    y[j] += float(rw[j, k]) * expert_fn(e, rx[j:j + 1].float()).float()[0]
        out, _, _ = buf.combine(y.to(torch.bfloat16), handle, topk_weights=rw)
        err = combine_error(out, combine_ref(x, idx, w, False))
        if err:
            msgs.append(f"normal combine: {err}")
        # routed by is_token_in_rank alone (no top-k): the rows per expert
        # are the callers' num_tokens_per_expert, all-reduced over comm
        nes = comm.allgather(ne)
        r2 = buf.dispatch(x, num_tokens_per_rank=nr, is_token_in_rank=inr,
                          num_tokens_per_expert=ne, expert_alignment=align)
        want2 = [-(-sum(int(n[rank * El + le]) for n in nes) // align) * align
                 for le in range(El)]
        if r2[3] != want2 or r2[0].shape[0] != len(exp_rows):
            msgs.append(f"normal dispatch by is_token_in_rank: counts {r2[3]}, want {want2}; "
                        f"{r2[0].shape[0]} rows, want {len(exp_rows)}")
        buf.combine(torch.zeros(r2[0].shape, dtype=torch.bfloat16), r2[4])
        del ws
    finally:
        buf.destroy()


def main():
    import ferry.deep_ep as deep_ep
    world = MPI.COMM_WORLD
    msgs = []
    try:
        expect(msgs, TypeError, "comm", deep_ep.Buffer, None, 0, 0, True, comm=object())
        for name, comm in (("COMM_WORLD", world),
                           ("a split", world.Split(int(world.Get_rank() == world.Get_size() - 1),
                                                   world.Get_rank()))):
            before = len(msgs)
            ll_rounds(deep_ep, comm, msgs)
            normal_rounds(deep_ep, comm, msgs)
            for i in range(before, len(msgs)):
                msgs[i] = f"{name}: {msgs[i]}"
            if comm is not world:
                comm.Free()
    except Exception:
        msgs.append(traceback.format_exc())
    for m in msgs:
        print(f"rank {world.Get_rank()}: {m}", flush=True)
    bad = world.allreduce(len(msgs), op=MPI.SUM)
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks: ferry.deep_ep on mpi4py communicators: "
              f"{'passed' if bad == 0 else 'FAILED'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
