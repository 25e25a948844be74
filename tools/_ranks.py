"""Shared by the GPU benchmark scripts of tools/ (bench_nvlink.py,
bench_peers.py, bench_peers_ht.py): one spawned process per GPU."""
import socket
import sys

import torch.multiprocessing as mp


def spawn_ranks(target, N, args, timeout, join_s=60):
    """Run target(rank, N, port, args, q) in N spawned processes; each puts
    (rank, result) on q, a str result being its traceback. Prints the
    tracebacks and exits 1 if any; else returns {rank: result}."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, N, port, args, q)) for r in range(N)]
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
