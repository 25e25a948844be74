#!/usr/bin/env python3
"""Order the timeline lines of a tracing build (-DFR_CU_TRACE) of the CUDA
low-latency engine and print them in microseconds from the first.

    build-gpu/bin/ferry-bench ... 2>&1 | tools/trace_timeline.py

A line is "TL <ns> r<rank> ph<phase> e<epoch> <event> <peer>", the time from
the GPU's global timer (one clock for every rank sharing a GPU). Events:
start (block 0 began the phase), doorbell (the slice for <peer> handed to
the proxy), seen / seen-host (block 0 saw <peer>'s flag; seen-host: the lane
that polled it in host memory)."""
import re
import sys


def main():
    pat = re.compile(r"^TL (\d+) r(\d+) ph(\d) e(\d+) (\S+) (-?\d+)")
    ev = []
    for line in sys.stdin:
        m = pat.match(line)
        if m:
            ev.append((int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5], int(m[6])))
    if not ev:
        sys.exit("no timeline lines (TL ...) on stdin: is the build traced (-DFR_CU_TRACE)?")
    ev.sort()
    t0 = ev[0][0]
    names = ("dispatch", "combine")
    for t, r, ph, e, what, peer in ev:
        print("%10.1f us  rank %d  %-8s epoch %d  %-9s %d" % ((t - t0) / 1e3, r, names[ph], e,
                                                             what, peer))


if __name__ == "__main__":
    main()
