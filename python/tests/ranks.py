"""Shared by the tests (test_native, test_args, test_ht; the torch tests
use run_ranks through torch_main): start N ranks as spawned processes and
collect what each reports, and bf16 bits to and from float32 (numpy)."""
import multiprocessing as mp
import os
import sys

try:
    import numpy as np
except ImportError:  # the torch tests need only run_ranks
    np = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from free_port import free_port  # noqa: E402


def bf16(a):  # float32 -> bf16 bits, round to nearest even
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def gather_all(N, *objs):
    """torch tests: every rank's copy of each object (tensors as CPU
    copies), one list of N per object; collective."""
    import torch.distributed as dist
    out = []
    for o in objs:
        got = [None] * N
        dist.all_gather_object(got, o.cpu() if hasattr(o, "cpu") else o)
        out.append(got)
    return out


def test_nodes():
    """FERRY_TEST_NODES: the nodes the torch tests split their ranks into
    (0 or 1: the host names decide)."""
    import os
    return int(os.environ.get("FERRY_TEST_NODES", "0") or 0)


def torch_init(rank, N, port):
    """torch tests: this rank's gloo process group on 127.0.0.1:port (from
    run_ranks), with ferry's timeout at 20 s. FERRY_TEST_NODES=H: rank r
    on node r * H / N (FERRY_NODE_ID), so ranks of one node use peer memory
    and the others the fabric path, as on a cluster."""
    import os
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FERRY_TIMEOUT_MS="20000")
    nodes = test_nodes()
    if nodes > 1:
        os.environ["FERRY_NODE_ID"] = f"test-node{rank * nodes // N}"
    dist.init_process_group("gloo", rank=rank, world_size=N)


def run_ranks(target, N, timeout=120):
    """Run target(rank, N, port, q) in N processes; each puts (rank, result)
    on q. Returns ({rank: result} of those that answered, [lines naming the
    ranks that exited without answering]). Stuck ranks are killed."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, N, port, q)) for r in range(N)]
    for p in ps:
        p.start()
    res = {}
    for _ in range(N):
        try:
            r, msg = q.get(timeout=timeout)
        except Exception:
            break
        res[r] = msg
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    crashed = [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(ps) if r not in res]
    return res, crashed


def torch_main(rank_main, N, title, timeout=600):
    """The torch GPU tests' verdict: run rank_main on N ranks, each
    reporting a list of failure messages; print them, the ranks that died
    and a last line `title: passed|FAILED`. Returns the exit status (77
    when torch sees no GPU)."""
    import torch
    if not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 77
    res, crashed = run_ranks(rank_main, N, timeout=timeout)
    fails = N - len(res)  # the ranks in crashed
    for line in crashed:
        print(line)
    for rank in sorted(res):
        for m in res[rank]:
            print(f"rank {rank}: {m}")
        fails += bool(res[rank])
    print(f"{title}: {'passed' if not fails else 'FAILED'}")
    return 1 if fails else 0


def ranks_main(rank_main, sizes, title, timeout=300, gpu=False):
    """The torch tests' verdict over several world sizes: rank_main on N
    ranks for each N in sizes, each rank reporting a list of failure
    messages; prints them, the ranks that died and `N ranks: title:
    passed|FAILED` per size. Returns the exit status (gpu: 77 when torch
    sees no GPU)."""
    import torch
    if gpu and not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 77
    failed = 0
    for N in sizes:
        res, crashed = run_ranks(rank_main, N, timeout=timeout)
        bad = crashed + [f"rank {r}: {m}" for r in sorted(res) for m in res[r]]
        for line in bad:
            print(line)
        print(f"{N} ranks: {title}: {'FAILED' if bad or len(res) != N else 'passed'}")
        failed += bool(bad) or len(res) != N
    return 1 if failed else 0
