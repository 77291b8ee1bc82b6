"""The two test tiers: ``make test`` runs everything; ``make test-fast`` (``-p tests.tiers -m
"not slow"``) runs every single-process test plus the multi-rank smoke tests listed in SMOKE.

Loaded as a pytest plugin (``-p tests.tiers``), this marks ``slow`` every collected test that
starts ranks or a launcher -- found by reading its source, its fixtures' and the helpers they
call -- unless SMOKE lists it. A new multi-rank test therefore lands in the full tier without
anyone marking it; tests/training/test_suite_tiers.py checks that SMOKE still names real,
multi-rank tests covering every wrapper and parallel dimension, and that every public helper
of tests/dist_utils.py is listed in SPAWNERS (starts ranks) or NOT_SPAWNERS.

To put a test into the fast tier's smoke set, add its node id to SMOKE with what it covers.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

# What starts rank processes or a launcher: a call of one of these names, or a string that
# names the launcher (a torchrun command line, the demo script). A single helper process (a
# compiler, a child killed mid-save) is not a rank: those tests stay in the fast tier.
# _Pool: the pool's own tests start private pools (tests/distributed/test_pool.py).
SPAWNERS = ("run_distributed", "_Pool")
# Public helpers of tests/dist_utils.py that start no ranks (test_suite_tiers checks the two
# lists cover all of them).
NOT_SPAWNERS: tuple = ("shutdown_pool",)  # stops the pool at session end; starts nothing
# gpu-check: `make gpu-check` runs tools/gpu_check.sh, which starts the benchmark and the test runs.
LAUNCHER_TEXT = ("torch.distributed.run", "torchrun", "demo.sh", "sft.sh", "gpu-check")

# node id -> what it smokes (one multi-rank test per wrapper and per parallel dimension).
SMOKE = {
    "tests/distributed/test_ddp.py::test_ddp_matches_torch_ddp[2]": {"wrapper:ddp", "dim:dp"},
    "tests/optimizer/test_distrib_optimizer.py::test_distributed_optimizer_and_checkpoints_dp2_to_dp3": {
        "wrapper:distopt"
    },
    # one world serves every case of test_layers.py: the sp case costs nothing more
    "tests/parallel/test_layers.py::test_column_parallel_linear[False]": {"dim:tp"},
    "tests/parallel/test_layers.py::test_column_parallel_linear[True]": {"dim:sp"},
    "tests/pipeline/test_schedules.py::test_pipeline_matches_one_process[pp2]": {"dim:pp"},
    "tests/models/test_moe_layer.py::test_moe_layer_expert_parallel_matches_one_process[2]": {"dim:ep"},
    # the trainer through the CLI on 2 ranks: DDP sum / average modes and FSDP2 (test_fsdp2.py's
    # own cases are marked slow there)
    "tests/training/test_boundary.py::test_sum_and_average_modes_train_the_same_curve": {
        "cli:pretrain",
        "wrapper:fsdp2",
    },
}
REQUIRED = {
    "wrapper:ddp",
    "wrapper:distopt",
    "wrapper:fsdp2",
    "dim:dp",
    "dim:tp",
    "dim:sp",
    "dim:pp",
    "dim:ep",
    "cli:pretrain",
}

_cache: dict = {}


def _direct(tree) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in SPAWNERS:
            return True
        if isinstance(n, ast.Attribute) and n.attr in SPAWNERS:
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            if any(t in n.value for t in LAUNCHER_TEXT):
                return True
    return False


def _is_test_code(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod == "tests" or mod.startswith("tests.")


def _strip_docstrings(tree) -> None:
    """Docstrings mention launchers without starting them."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                body[0] = ast.Pass()


def _spawns(obj, seen: set) -> bool:
    """Whether ``obj`` (a function or class of tests/) or what it calls starts processes."""
    obj = inspect.unwrap(obj)
    key = id(obj)
    if key in _cache:
        return _cache[key]
    if key in seen:
        return False
    seen.add(key)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return False
    _strip_docstrings(tree)
    found = _direct(tree)
    if not found:
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        glb = getattr(obj, "__globals__", None) or getattr(inspect.getmodule(obj), "__dict__", {})
        for name in sorted(names):
            ref = glb.get(name)
            if (inspect.isfunction(ref) or inspect.isclass(ref)) and _is_test_code(ref):
                if _spawns(ref, seen):
                    found = True
                    break
    _cache[key] = found
    return found


def item_spawns(item) -> bool:
    """Whether a collected test starts ranks or a launcher: itself, or a fixture it asks for
    (directly or through other fixtures; autouse fixtures are not followed)."""
    roots = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        todo, seen = list(info.argnames), set()
        while todo:
            name = todo.pop()
            defs = info.name2fixturedefs.get(name)
            if name in seen or not defs:
                continue
            seen.add(name)
            roots.append(defs[-1].func)
            todo += list(defs[-1].argnames)
    return any(r is not None and _is_test_code(r) and _spawns(r, set()) for r in roots)


@pytest.hookimpl(tryfirst=True)  # before -m deselects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid not in SMOKE and "slow" not in item.keywords and item_spawns(item):
            item.add_marker(pytest.mark.slow)
