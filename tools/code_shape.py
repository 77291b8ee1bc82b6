"""The shape of the Python package, for before/after tables of a refactor.

    python tools/code_shape.py [REPO]          (default: this checkout)

Prints module sizes per package, every function over 60 lines, modules over 500 lines,
own-line comments per 100 code lines, and the import picture: cycles between modules
(function-local imports included) and imports from a lower layer to a higher one, with
one topological order of docs/architecture.md's layer graph ("Layers"; bottom first).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

# A topological order of docs/architecture.md's layer graph, bottom first; a module may import only from
# its own layer or below.
LAYERS = [
    ("common",),
    ("parallel", "ops"),
    ("data",),
    ("diffusion",),
    ("models",),
    ("optimizer",),
    ("distributed",),
    ("pipeline",),
    ("config",),
    ("checkpoint",),
    ("training",),
    ("planning",),
    ("generate", "hf", "eval", "pretrain", "startup", "experiments"),
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules(root: str) -> dict:
    pkg = os.path.join(root, "python", "megadlms")
    out = {}
    for d, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.join(root, "python"))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(mod: str, tree: ast.AST, is_pkg: bool, mods: dict) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import submodule` depends on the submodule, not on pkg/__init__.
            subs = [f"{target}.{a.name}" for a in node.names]
            names = subs if all(n in mods for n in subs) else [target] + subs
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("megadlms"))
    return found


def _layer(mod: str):
    parts = mod.split(".")
    return LEVEL.get(parts[1]) if len(parts) > 1 else None


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main(root: str) -> None:
    mods = _modules(root)
    sizes, long_funcs, graph = defaultdict(lambda: [0, 0]), [], {}
    code_lines = comment_lines = 0
    for mod, path in sorted(mods.items()):
        with open(path) as f:
            src = f.read()
        lines = src.splitlines()
        tree = ast.parse(src)
        pkg = ".".join(mod.split(".")[:2])
        sizes[pkg][0] += 1
        sizes[pkg][1] += len(lines)
        if len(lines) > 500:
            print(f"module over 500 lines: {mod} ({len(lines)})")
        comment_lines += sum(1 for ln in lines if ln.strip().startswith("#"))
        code_lines += sum(1 for ln in lines if ln.strip() and not ln.strip().startswith("#"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_funcs.append((n, f"{mod}.{node.name}"))
        deps = set()
        for target in _imports(mod, tree, path.endswith("__init__.py"), mods):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != mod:
                deps.add(target)
        graph[mod] = deps
    print("\npackage                       files  lines")
    for pkg, (n, ln) in sorted(sizes.items()):
        print(f"{pkg:30s}{n:5d}{ln:7d}")
    print(f"\nown-line comments per 100 code lines: {100 * comment_lines / max(code_lines, 1):.1f}")
    print("\nfunctions over 60 lines:")
    for n, name in sorted(long_funcs, reverse=True):
        print(f"  {n:4d}  {name}{'   (over 100)' if n > 100 else ''}")
    cycles = _cycles(graph)
    print(f"\nimport cycles: {len(cycles)}")
    for c in cycles:
        print("  " + " <-> ".join(c))
    upward = [
        (a, b)
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)
    ]
    print(f"\nimports from a lower layer to a higher one: {len(upward)}")
    for a, b in upward:
        print(f"  {a} -> {b}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
