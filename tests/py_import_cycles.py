#!/usr/bin/env python3
"""The modules of python/ferry import each other without a cycle (module
level and function level alike): a shared module imports none of the
modules that use it. Prints the modules and their imports; exit 1 naming
a cycle."""
import ast
import glob
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "ferry")
mods = {os.path.basename(f)[:-3]: f for f in glob.glob(os.path.join(ROOT, "*.py"))}
deps = {}
for m, f in mods.items():
    d = set()
    for node in ast.walk(ast.parse(open(f).read(), f)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:  # from .x import y
                d.add(node.module.split(".")[0])
            else:  # from . import x: a module when one is named so
                d.update(a.name for a in node.names if a.name in mods)
    # "from . import X" of a name the package re-exports: __init__
    deps[m] = {x for x in d if x in mods and x != m} | (
        {"__init__"} if any(isinstance(n, ast.ImportFrom) and n.level == 1 and not n.module
                            and any(a.name not in mods for a in n.names)
                            for n in ast.walk(ast.parse(open(f).read(), f))) else set())
deps["__init__"].discard("__init__")


def cycle():
    state = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(deps.get(m, ())):
            if d == "__init__":  # the package itself imports everything it re-exports
                continue
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                c = visit(d, path + [d])
                if c:
                    return c
        state[m] = 2
        return None

    for m in sorted(deps):
        if m not in state:
            c = visit(m, [m])
            if c:
                return c
    return None


c = cycle()
if c:
    print("python/ferry imports in a circle: " + " -> ".join(c))
    sys.exit(1)
print(f"{len(deps)} modules of python/ferry, no import cycle")
