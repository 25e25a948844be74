#!/usr/bin/env python3
"""The layer rules of docs/architecture.md, checked on the tree.

1. A file under src/<layer>/ includes only headers of its own layer or of
   the layers below it (the table LAYERS); an engine folder does not
   include another engine's folder.
2. No library file other than a kernel (.cu) is over MAX_FILE lines.
3. No function in a library .c file, nor host function in a .cu file, is
   over MAX_FUNC lines.
Prints each violation and exits 1 if there is any.
"""
import os
import re
import sys

# layer -> the layers it may include (its own always)
LAYERS = {
    "core": [],
    "runtime": ["core"],
    "bootstrap": ["core", "runtime"],
    "transport": ["core", "runtime", "bootstrap"],
    "ep": ["core", "runtime", "bootstrap", "transport"],
    "signal": ["core", "runtime", "bootstrap", "transport"],
    "proxy": ["core", "runtime", "bootstrap", "transport", "ep"],
    "engines": ["core", "runtime", "bootstrap", "transport", "ep", "proxy"],
    "api": ["core", "runtime", "bootstrap", "transport", "ep", "proxy",
            "engines"],
}
MAX_FILE = 700
MAX_FUNC = 120

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
os.chdir(root)
bad = []
inc_re = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
for dirpath, _, files in os.walk("src"):
    for name in sorted(files):
        path = os.path.join(dirpath, name)
        parts = path.split(os.sep)
        layer = parts[1]
        if layer not in LAYERS:
            bad.append(f"{path}: folder src/{layer} is not in the layer table")
            continue
        allowed = set(LAYERS[layer]) | {layer}
        lines = open(path, encoding="utf-8").read().split("\n")
        for i, line in enumerate(lines, 1):
            m = inc_re.match(line)
            if not m:
                continue
            inc = m.group(1)
            if "/" not in inc:
                continue  # same folder, or a public header (include/)
            target = os.path.normpath(os.path.join(dirpath, inc))
            if inc.startswith(".."):
                tparts = target.split(os.sep)
            else:
                tparts = ["src"] + inc.split("/")
            tlayer = tparts[1] if len(tparts) > 2 else None
            if tlayer not in allowed:
                bad.append(f"{path}:{i}: layer {layer} includes {inc} "
                           f"(layer {tlayer})")
            if (layer == "engines" and tlayer == "engines" and len(parts) > 3
                    and len(tparts) > 3 and tparts[2] != parts[2]):
                bad.append(f"{path}:{i}: engine {parts[2]} includes another "
                           f"engine's {inc}")
        if not name.endswith(".cu") and len(lines) - 1 > MAX_FILE:
            bad.append(f"{path}: {len(lines) - 1} lines (at most {MAX_FILE} "
                       "outside kernel files)")
        if name.endswith(".c") or name.endswith(".cu"):
            # host functions (in .cu files: those not marked __global__ or
            # __device__, found from the lines of their signature)
            start, sig = None, []
            for i, line in enumerate(lines, 1):
                if line.startswith("{"):
                    kernel = any("__global__" in x or "__device__" in x for x in sig)
                    start = None if kernel else i
                elif line.startswith("}") and start is not None:
                    if i - start > MAX_FUNC:
                        bad.append(f"{path}:{start}: function of {i - start} "
                                   f"lines (at most {MAX_FUNC})")
                    start = None
                if not line.strip() or line.startswith("}") or line.startswith("#") \
                        or line.lstrip().startswith(("/*", "*")):
                    sig = []
                elif not line.startswith(("{", " ", "\t")):
                    sig.append(line)
                elif sig and line.startswith((" ", "\t")) and start is None:
                    sig.append(line)  # a signature's continuation line
for b in bad:
    print(b)
print(f"layers: {len(bad)} violation(s)")
sys.exit(1 if bad else 0)
