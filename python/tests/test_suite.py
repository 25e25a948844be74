"""The Python tests under pytest: each script of this folder runs as its
own job, one item per rank count (the script starts that many ranks),
against the library FERRY_LIB names (default: build/libferry.so of this
tree) and the package of this tree. Items whose modules are missing, or
that need a GPU where there is none, are skipped saying so.

    python3 -m pytest -q python/tests                 # all of them
    python3 -m pytest -q python/tests -k "test_ht"    # one script
"""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LIB = os.environ.get("FERRY_LIB", os.path.join(ROOT, "build", "libferry.so"))


def run_script(script, args, needs=(), gpu=False, env=None, timeout=600):
    for mod in needs:
        pytest.importorskip(mod, reason=f"{script} needs {mod} (scripts/setup.sh installs it)")
    if gpu:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip(f"{script} needs a GPU")
    if not os.path.exists(LIB):
        pytest.fail(f"{LIB} not found: build the library (make) or set FERRY_LIB")
    e = dict(os.environ, FERRY_LIB=LIB,
             PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    r = subprocess.run([sys.executable, os.path.join(HERE, script), *args], env=e,
                       cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{script} {' '.join(args)}: exit {r.returncode}\n{r.stdout[-4000:]}"


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
def test_native(nranks):
    run_script("test_native.py", [str(nranks)], needs=("numpy",))


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_args(nranks):
    run_script("test_args.py", [str(nranks)], needs=("numpy",))


@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8])
def test_ht(nranks):
    run_script("test_ht.py", [str(nranks)], needs=("numpy",))


@pytest.mark.parametrize("nranks", [4, 5, 8])
def test_ht_nodes(nranks):
    """Two simulated nodes: forwarding through one rank per node."""
    run_script("test_ht.py", [str(nranks)], needs=("numpy",),
               env={"FERRY_TEST_NODES": "2", "FI_PROVIDER": "tcp"})


@pytest.mark.parametrize("nranks,dp", [(4, 2), (8, 4)])
def test_ht_dp(nranks, dp):
    """DP groups (dp_size): shares sent, every member's combine complete."""
    run_script("test_ht.py", [str(nranks)], needs=("numpy",), env={"FERRY_TEST_DP": str(dp)})


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_torch_cpu(nranks):
    run_script("test_torch_cpu.py", [str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [4])
def test_torch_cpu_normal_nodes(nranks):
    """DeepEP's normal mode on CPU tensors over two simulated nodes."""
    run_script("test_torch_cpu.py", ["normal", str(nranks)], needs=("torch",),
               env={"FERRY_TEST_NODES": "2"})


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_engine_calls(nranks):
    run_script("test_engine_calls.py", [str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [1, 2])
def test_torch_cuda(nranks):
    run_script("test_torch_cuda.py", [str(nranks)], gpu=True)


@pytest.mark.parametrize("nranks", [1, 2])
def test_torch_ht_cuda(nranks):
    run_script("test_torch_ht_cuda.py", [str(nranks)], gpu=True)


@pytest.mark.parametrize("nranks", [2, 3])
def test_normal_async_cpu(nranks):
    """deep_ep normal mode: no host round trips, async calls' outputs equal."""
    run_script("test_normal_async.py", ["cpu", str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [1, 3])
def test_elastic_cpu(nranks):
    """deep_ep.ElasticBuffer (DeepEP 2's API) on CPU ranks, every output exact."""
    run_script("test_elastic.py", ["cpu", str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [1, 3])
def test_nvfp4_cpu(nranks):
    """sgl-deep-ep's NVFP4 low-latency dispatch through deep_ep on CPU ranks:
    codes and scales bit for bit against a reference, its views, the
    dequantised rows, a combine after it."""
    run_script("test_nvfp4.py", [str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [1, 3])
def test_overlap_cpu(nranks):
    """sgl-deep-ep's overlapped combine on CPU ranks: rows leave as their
    signals rise, output equal to the plain combine, the stall's timeout."""
    run_script("test_overlap.py", ["cpu", str(nranks)], needs=("torch",))


@pytest.mark.parametrize("nranks", [1, 3])
def test_logfmt_cpu(nranks):
    """LogFMT combine (DeepEP's use_logfmt) on CPU ranks, bit for bit against
    a reference, through EP and deep_ep."""
    run_script("test_logfmt.py", [str(nranks)], needs=("torch", "numpy"))


@pytest.mark.parametrize("nranks", [2])
def test_normal_async_cuda(nranks):
    """The same on CUDA, with the profiler's host syncs and real overlap."""
    run_script("test_normal_async.py", ["cuda", str(nranks)], gpu=True)
