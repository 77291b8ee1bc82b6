"""Shared pytest setup: the `gpu` marker skips without CUDA; tests never need a network;
the multi-rank worker pool (tests/dist_utils.py) is shut down, and checked, at session end."""

import gc
import os
import sys

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")
# PYTHONDONTWRITEBYTECODE (set in some images) makes every run recompile and re-rewrite the
# asserts of ~220 test modules (~5 s of CPU at collection), and every rank and CLI process
# recompile megadlms: the suite keeps its bytecode in the git-ignored __pycache__ folders.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _multirank_pool():
    """Stop run_distributed's pool after the last test; a slot that then exits uncleanly
    (e.g. SIGABRT at interpreter exit) is an error of the session."""
    yield
    from tests.dist_utils import shutdown_pool

    bad = shutdown_pool()
    if bad:
        pytest.fail(
            f"multi-rank pool slots exited uncleanly at shutdown (slot, exit code): {bad}", pytrace=False
        )


@pytest.fixture(scope="module")
def frozen_heap():
    """Leave the pytest process's own objects out of the gc passes of in-process runs.

    ``pretrain.run`` collects twice at its teardown; in the pytest process each full pass
    walks every object of the session (~0.6 s a pass measured, over half of a 5-step run).
    Objects made after the freeze, the trainer's included, are collected as before."""
    gc.freeze()
    yield
    gc.unfreeze()
