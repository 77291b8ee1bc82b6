"""The GPU tests' first-contact rules, read from their source on a machine without a GPU.

The first GPU run is one shot, so what makes a GPU test fail for a reason other than a bug
is checked here, where it can be:

* a test that captures a CUDA graph is marked ``cuda_graph`` (memcheck leaves it out: under
  compute-sanitizer the check runs with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, and torch's
  uncached allocator refuses to allocate while a stream is captured, which ``l2_norm``'s
  result and workspace do);
* every extension op a capture records was called before the capture in the same test (the
  warm-up, ``helpers.eagerly``): CUDA loads a kernel at its first launch, which must not be
  the captured one;
* work queued on a side stream (``with torch.cuda.stream(s)``) is ordered after the tensors'
  producers: ``s.wait_stream(...)`` or a ``torch.cuda.synchronize()`` comes first.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXT_NAMES = ("megadlm_ext", "ext")  # how the tests import the extension's ops


def _test_files():
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _src(node) -> str:
    return ast.unparse(node)


def _with_calls(fn, callee: str):
    """The ``with`` statements of ``fn`` one of whose items calls ``callee`` (e.g.
    "torch.cuda.graph"), with that item's first argument's source."""
    for node in ast.walk(fn):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _src(call.func) == callee:
                    yield node, _src(call.args[0]) if call.args else ""


def _ext_ops(nodes) -> set:
    """Names X of the ``megadlm_ext.X(...)`` calls under ``nodes``."""
    ops = set()
    for top in nodes:
        for node in ast.walk(top):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if isinstance(base, ast.Name) and base.id in EXT_NAMES:
                    ops.add(node.func.attr)
    return ops


def _functions():
    for path in _test_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        marks = " ".join(_src(n) for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in _src(n))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                yield os.path.relpath(path, ROOT), node, marks


def _before(fn, lineno: int):
    """The statements of ``fn``'s body (recursively) that end before line ``lineno``."""
    return [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and n is not fn and n.end_lineno < lineno]


CAPTURES = [(p, fn, m) for p, fn, m in _functions() if any(_with_calls(fn, "torch.cuda.graph"))]
SIDE_STREAMS = [(p, fn) for p, fn, _ in _functions() if any(_with_calls(fn, "torch.cuda.stream"))]


def test_the_rules_see_the_capture_and_stream_tests():
    """The scan finds what it checks (a broken scan would pass every rule vacuously)."""
    assert len(CAPTURES) >= 6 and len(SIDE_STREAMS) >= 8, (len(CAPTURES), len(SIDE_STREAMS))


@pytest.mark.parametrize("path, fn, marks", CAPTURES, ids=[f"{p}::{f.name}" for p, f, _ in CAPTURES])
def test_capture_tests_are_marked_and_warmed(path, fn, marks):
    decorators = " ".join(_src(d) for d in fn.decorator_list)
    assert "cuda_graph" in decorators or "cuda_graph" in marks, f"{path}::{fn.name}: mark it cuda_graph"
    for block, _ in _with_calls(fn, "torch.cuda.graph"):
        captured = _ext_ops(block.body)
        warmed = _ext_ops(_before(fn, block.lineno))
        assert captured <= warmed, (
            f"{path}::{fn.name}: {sorted(captured - warmed)} first launched under capture; "
            "call them once before it (with helpers.eagerly())"
        )


@pytest.mark.parametrize("path, fn", SIDE_STREAMS, ids=[f"{p}::{f.name}" for p, f in SIDE_STREAMS])
def test_side_streams_wait_for_the_producers(path, fn):
    for block, stream in _with_calls(fn, "torch.cuda.stream"):
        before = " ".join(_src(n) for n in _before(fn, block.lineno))
        assert f"{stream}.wait_stream(" in before or "torch.cuda.synchronize()" in before, (
            f"{path}::{fn.name} line {block.lineno}: work on stream {stream} is not ordered after "
            f"the default stream's producers ({stream}.wait_stream(torch.cuda.current_stream()))"
        )
