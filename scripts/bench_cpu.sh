#!/bin/bash
# The CPU-rank table of docs/benchmarks.md: ferry vs the MPI baseline, one
# mpirun job per row (same machine, same data, side by side), EP2/EP4/EP8.
# Usage: scripts/bench_cpu.sh [extra ferry-bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/bin/ferry-bench}
ITERS=${ITERS:-30}
first=1
run() {
  local q=-q; [ $first -eq 1 ] && q= && first=0
  $BIN --launcher mpirun --iters "$ITERS" --warmup 3 $q "$@" | grep -v '^ferry-bench:'
}
for n in 2 4 8; do
  run -n $n --experts 256 --topk 8 --hidden 7168 --tokens 128 --dtype fp8 "$@"   # DeepSeek-V3 decode
done
for n in 2 4 8; do
  run -n $n --experts 128 --topk 8 --hidden 2048 --tokens 128 --dtype bf16 "$@"  # Qwen3-30B-A3B
done
run -n 8 --experts 256 --topk 8 --hidden 7168 --tokens 128 --dtype fp8 --routing zipf:1.2 "$@"
run -n 8 --experts 256 --topk 8 --hidden 7168 --tokens 16 --dtype fp8 "$@"
