#!/bin/bash
# DeepEP 2.1.0's own tests/elastic/test_ep.py, unmodified, on ferry's
# deep_ep.ElasticBuffer, every rank on the one GPU (MPS, started by
# scripts/gpu_check.sh). The package `deep_ep` it imports is assembled in a
# temporary folder at test time: ferry's compat deep_ep, DeepEP 2's test
# helpers (deep_ep/utils from the tarball) and tests/deepep2/_C.py, which
# answers the few calls those helpers make of DeepEP's compiled module.
# Ranks share the GPU through the shared-gpu shim plus
# tests/deepep2/sitecustomize.py (all_to_all_single on host copies).
# Usage: tests/deepep2.sh N [NODES] [ARGS...]   ($B: build)
#   N ranks per node; NODES > 1 runs one test process per simulated node
#   (DeepEP's WORLD_SIZE / RANK); ARGS go to test_ep.py. Its perf section
#   times kernels by DeepEP's names and divides by their time: the script
#   passes --skip-perf-test unless ARGS name --dump-profile-traces.
#   FERRY_DEEPEP2      DeepEP-2.1.0.tar.gz (default ../shared/peers/...)
#   FERRY_SHARED_GPU   the shim's folder (default ../shared/tools/shared-gpu)
# Skips (exit 77) saying why without a GPU, the tarball, the shim or torch.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TAR=${FERRY_DEEPEP2:-$ROOT/../shared/peers/DeepEP-2.1.0.tar.gz}
SHIM=${FERRY_SHARED_GPU:-$ROOT/../shared/tools/shared-gpu}
why=$("$ROOT/$B/bin/ferry-info" --cuda 2>&1) || { echo "skipped: no usable GPU here: $why"; exit 77; }
[ -f "$TAR" ] || { echo "skipped: DeepEP 2's tests not found at $TAR (FERRY_DEEPEP2)"; exit 77; }
[ -f "$SHIM/sitecustomize.py" ] || { echo "skipped: the shared-gpu shim not found at $SHIM (FERRY_SHARED_GPU)"; exit 77; }
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
  { echo "skipped: no torch with CUDA here"; exit 77; }
n=$1 nodes=${2:-1}
shift; [ $# -gt 0 ] && shift
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
tar xzf "$TAR" -C "$W" --wildcards '*/tests/elastic/*' '*/deep_ep/utils/*' || exit 2
D=$(echo "$W"/DeepEP-*)
mkdir -p "$W/pkg/site"
cp -r "$ROOT/python/compat/deep_ep" "$W/pkg/deep_ep"
rm -f "$W/pkg/deep_ep/utils.py"
cp -r "$D/deep_ep/utils" "$W/pkg/deep_ep/utils"
cp "$ROOT/tests/deepep2/_C.py" "$W/pkg/deep_ep/_C.py"
cp "$ROOT/tests/deepep2/sitecustomize.py" "$W/pkg/site/sitecustomize.py"
export SHARED_GPU_SHIM=1 SHARED_GPU_SITE=$SHIM/sitecustomize.py PYTHONUNBUFFERED=1
export FERRY_LIB=$ROOT/$B/libferry.so EP_SUPPRESS_NCCL_CHECK=1
export PYTHONPATH=$W/pkg/site:$W/pkg:$ROOT/python
args=("$@")
case " ${args[*]} " in *" --dump-profile-traces "*) ;; *) args+=(--skip-perf-test) ;; esac
cd "$D/tests/elastic" || exit 2
export MASTER_ADDR=127.0.0.1 WORLD_SIZE=$nodes
MASTER_PORT=$(python3 "$ROOT/tools/free_port.py")
export MASTER_PORT
[ "$nodes" -gt 1 ] && export SHARED_GPU_NODES=1
pids=""
for r in $(seq 0 $((nodes - 1))); do
  RANK=$r python3 test_ep.py --num-processes "$n" "${args[@]}" > "$W/node$r.log" 2>&1 & pids="$pids $!"
done
rc=0; for p in $pids; do wait "$p" || rc=1; done
cat "$W"/node*.log
exit $rc
