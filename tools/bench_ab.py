#!/usr/bin/env python3
"""Two builds of ferry-bench against each other, runs alternating.

A change's effect on speed is often smaller than the drift of a machine
between two runs (ranks sharing a GPU under MPS move by 10-20% from one
run to the next). This runs build A and build B on the same arguments in
turns, the order swapped every repetition (A B, B A, A B, ...) so that a
steady drift weighs on both alike, and reports each repetition's p50s and
the median over repetitions of B / A for each metric and token count.

Usage: python3 tools/bench_ab.py A B [--reps 3] [--timeout 300] [--json F] -- ARGS...
  A, B   two ferry-bench executables (for example build-base/bin/ferry-bench
         and build/bin/ferry-bench)
  ARGS   ferry-bench's arguments, the same for both (not --json, --csv, -q:
         the tool sets those)
Every run must verify what it moved: a run that fails, or reports a
nonzero #wrong or no checked row, ends the tool with exit status 1.
--json F writes one JSON line per (repetition, build, token count).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

METRICS = (("dispatch_p50_us", "dispatch"), ("combine_p50_us", "combine"),
           ("route_p50_us", "route"))


def run_one(exe, args, timeout):
    """ferry-bench's JSON rows of one run, by token count, or exit."""
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    try:
        cmd = [exe] + args + ["--json", path, "-q"]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=timeout, text=True)
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_ab: {exe}: no result within {timeout} s (--timeout)")
        except OSError as e:
            sys.exit(f"bench_ab: {exe}: {e.strerror}")
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-2000:])
            sys.exit(f"bench_ab: {exe} exited with status {p.returncode}")
        rows = [json.loads(line) for line in open(path) if line.strip()]
    finally:
        os.unlink(path)
    if not rows:
        sys.exit(f"bench_ab: {exe}: no rows (is it ferry-bench?)")
    for r in rows:
        if not r.get("checked") or r.get("wrong") != 0:
            sys.exit(f"bench_ab: {exe}: T={r.get('tokens')}: #wrong {r.get('wrong')}, checked "
                     f"{r.get('checked')}: the results are not verified")
    return {r["tokens"]: r for r in rows}


def main():
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("bench_ab: usage: bench_ab.py A B [--reps N] [--timeout S] [--json F] -- "
                 "FERRY_BENCH_ARGS...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="ferry-bench of build A")
    ap.add_argument("b", help="ferry-bench of build B")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--json", help="one JSON line per (repetition, build, T)")
    a = ap.parse_args(argv[:cut])
    args = argv[cut + 1:]
    if a.reps < 1:
        sys.exit(f"bench_ab: --reps {a.reps}: at least 1")
    if a.timeout < 1:
        sys.exit(f"bench_ab: --timeout {a.timeout}: at least 1 second")
    for bad in ("--json", "--csv", "-q", "--quiet"):
        if bad in args:
            sys.exit(f"bench_ab: {bad}: set by the tool, not an argument to pass on")
    for exe in (a.a, a.b):
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            sys.exit(f"bench_ab: {exe}: not an executable file")
    res = {}  # (rep, label): {T: row}
    out = open(a.json, "w") if a.json else None
    for rep in range(a.reps):
        order = (("A", a.a), ("B", a.b)) if rep % 2 == 0 else (("B", a.b), ("A", a.a))
        for label, exe in order:
            rows = res[(rep, label)] = run_one(exe, args, a.timeout)
            for T, r in sorted(rows.items()):
                print(f"rep {rep + 1} {label}: T={T} " + ", ".join(
                    f"{name} {r[key]:.1f}" for key, name in METRICS if key in r) + " us p50",
                    flush=True)
                if out:
                    out.write(json.dumps(dict(rep=rep + 1, build=label, exe=exe, **r)) + "\n")
    if out:
        out.close()
    print(f"\nB / A, median over {a.reps} repetitions (each its own ratio; below 1: B faster):")
    for T in sorted(res[(0, "A")]):
        parts = []
        for key, name in METRICS:
            ratios = []
            for rep in range(a.reps):
                ra, rb = res[(rep, "A")].get(T, {}), res[(rep, "B")].get(T, {})
                if key in ra and key in rb and ra[key] > 0:
                    ratios.append(rb[key] / ra[key])
            if ratios:
                parts.append(f"{name} {statistics.median(ratios):.3f} "
                             f"({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"  T={T}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
