"""Shared by the GPU benchmark scripts of tools/ (bench_nvlink.py,
bench_peers.py, bench_peers_ht.py, bench_overlap.py, bench_elastic.py):
one spawned process per rank."""
import os
import sys

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from free_port import free_port  # noqa: E402


def _guarded(target, rank, N, port, args, q):
    """target(rank, N, port, args, q), its exception put on q as the rank's
    traceback."""
    try:
        target(rank, N, port, args, q)
    except Exception as e:  # noqa: BLE001 (reported to the launcher)
        import traceback
        q.put((rank, f"{e}\n{traceback.format_exc()}"))


def spawn_ranks(target, N, args, timeout, join_s=60):
    """Run target(rank, N, port, args, q) in N spawned processes; each puts
    (rank, result) on q (an exception it raises is put as its traceback, a
    str). Prints the tracebacks and exits 1 if any; else returns {rank:
    result}."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_guarded, args=(target, r, N, port, args, q))
          for r in range(N)]
    for pr in ps:
        pr.start()
    res = {}
    for _ in range(N):
        r, v = q.get(timeout=timeout)
        res[r] = v
    for pr in ps:
        pr.join(join_s)
    bad = [r for r, v in res.items() if isinstance(v, str)]
    for r in bad:
        print(f"rank {r}:\n{res[r]}")
    if bad:
        sys.exit(1)
    return res


def init_rank(rank, N, port):
    """A spawned rank's gloo group on 127.0.0.1:port and its GPU (ranks
    past the GPUs share them, as under MPS with the shared-gpu shim),
    ferry's timeout at 30 s."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FERRY_TIMEOUT_MS="30000")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=N)


def pct(v, f):
    """The f-quantile of v (sorted here)."""
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def shape_args(ap, tokens):
    """The arguments every normal-mode bench takes: ranks, tokens (a
    comma-separated list, default `tokens`), the MoE shape and the SMs."""
    ap.add_argument("--gpus", type=int, default=2, help="ranks (sharing the GPUs there are)")
    ap.add_argument("--tokens", default=tokens,
                    type=lambda s: [int(v) for v in s.split(",") if v])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--sms", type=int, default=24)
