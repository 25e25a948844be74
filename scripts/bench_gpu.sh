#!/bin/bash
# GPU tables of docs/benchmarks.md (run on the H200 test machine, MPS on).
# Usage: scripts/bench_gpu.sh BUILD_DIR
set -u
B=${1:-build}
cd "$(dirname "$0")/.."
echo "## world 1, DeepSeek-V3 shape, ferry vs PyTorch-native"
python3 tools/bench_gpu_world1.py --lib $B/libferry.so --tokens 128,1024,4096,8192 --iters 20
echo "## 8 ranks on one GPU (MPS), IPC path, DeepSeek-V3 decode (T=128, fp8), SMs per rank"
for sm in 8 16 32; do
  FERRY_TIMEOUT_MS=20000 $B/bin/ferry-bench --launcher fork --device cuda -n 8 --sms $sm \
    --no-check --iters 200 --warmup 20 $([ $sm -ne 8 ] && echo -q) 2>&1 | grep -v "^ferry-bench: round"
done
echo "## same, checked every round (slow path: copies to the host between phases)"
FERRY_TIMEOUT_MS=20000 $B/bin/ferry-bench --launcher fork --device cuda -n 8 --iters 10 --warmup 1 -q
echo "## forced fabric path, host-pinned regions, 8 ranks, decode shape"
for p in shm tcp; do
  FI_PROVIDER=$p FERRY_TIMEOUT_MS=20000 $B/bin/ferry-bench --launcher fork --device cuda --transport fabric \
    -n 8 --sms 16 --no-check --iters 100 --warmup 10 2>&1 | grep -v "^ferry-bench: round"
done
