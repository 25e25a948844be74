#!/usr/bin/env python3
"""Latency against tokens per rank, from ferry-bench's results, to a PNG.

    ferry-bench ... --tokens 1,32,128,512 --json ferry.jsonl
    python3 tools/plot_bench.py ferry.jsonl [more.jsonl or .csv ...] -o lat.png

Each input is ferry-bench's --json output (one object per line for a
sweep) or its --csv output; each becomes a series named after its file
(or --label, once per input). Two panels, dispatch and combine p50 in us
against tokens per rank (log-log), with p99 as a shaded band; where an
input holds a baseline ran in the same job (mpirun: baseline_*_p50_us),
it is drawn dashed beside ferry. The title names what the first input
ran on (ferry version and commit, host, GPU, ranks, mode). Needs
matplotlib."""
import argparse
import csv
import json
import os
import sys


def load(path):
    """The rows of one file, sorted by tokens, as dicts of floats/strings."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".csv"):
        rows = list(csv.DictReader(text.splitlines()))
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for r in rows:
        for k, v in list(r.items()):
            try:
                r[k] = float(v)
            except (TypeError, ValueError):
                pass
    if not rows:
        raise ValueError(f"{path}: no rows")
    missing = [k for k in ("tokens", "dispatch_p50_us", "combine_p50_us") if k not in rows[0]]
    if missing:
        raise ValueError(f"{path}: not ferry-bench output (no {', '.join(missing)})")
    return sorted(rows, key=lambda r: r["tokens"])


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="ferry-bench --json or --csv files")
    ap.add_argument("-o", "--output", default="ferry-bench.png", help="PNG to write")
    ap.add_argument("--label", action="append", help="a series' name, once per input")
    a = ap.parse_args(argv)
    if a.label and len(a.label) != len(a.inputs):
        ap.error(f"--label given {len(a.label)} times for {len(a.inputs)} inputs")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_bench.py: matplotlib is not installed (pip install matplotlib)")
    series = []
    for i, path in enumerate(a.inputs):
        try:
            rows = load(path)
        except (OSError, ValueError) as e:
            sys.exit(f"plot_bench.py: {e}")
        name = a.label[i] if a.label else os.path.splitext(os.path.basename(path))[0]
        series.append((name, rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, op in zip(axes, ("dispatch", "combine")):
        for name, rows in series:
            t = [r["tokens"] for r in rows]
            p50 = [r[f"{op}_p50_us"] for r in rows]
            line, = ax.plot(t, p50, marker="o", label=f"{name}")
            if f"{op}_p99_us" in rows[0]:
                ax.fill_between(t, p50, [r[f"{op}_p99_us"] for r in rows],
                                color=line.get_color(), alpha=0.15)
            base = [r.get(f"baseline_{op}_p50_us", -1) for r in rows]
            if all(isinstance(b, float) and b > 0 for b in base):
                ax.plot(t, base, marker="x", linestyle="--", color=line.get_color(),
                        label=f"{name}: baseline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(f"{op} p50 (us; band to p99)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    r0 = series[0][1][0]
    what = " ".join(str(x) for x in (
        f"ferry {r0.get('ferry_version', '?')}",
        f"({r0['commit']})" if r0.get("commit") else "",
        f"on {r0['host']}" if r0.get("host") else "",
        f"{r0['gpu']}" if r0.get("gpu") else "",
        f"{int(r0.get('ranks', 0))} ranks, {r0.get('device', '?')}, E={int(r0.get('experts', 0))} "
        f"K={int(r0.get('topk', 0))} H={int(r0.get('hidden', 0))} {r0.get('dtype', '')}",
        f"{r0.get('date', '')}") if x)
    fig.suptitle(what, fontsize=9)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"plot_bench.py: wrote {a.output} ({sum(len(r) for _, r in series)} points)")


if __name__ == "__main__":
    main(sys.argv[1:])
