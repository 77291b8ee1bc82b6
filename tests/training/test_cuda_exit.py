"""A process that used CUDA through megadlms exits with status 0 (GPU only).

The first GPU run found every such process ending in SIGABRT after correct results: a CUDA
tensor held by a namespace-scope cache of megadlm_ext._C was destroyed by the exit handlers
after the CUDA runtime had unloaded, and its destructor threw inside a destructor. The child
below touches everything that keeps CUDA state for the process's life -- every op (so the
device segment-table cache holds entries), the extension's NCCL communicator (left open),
and two iterations of the trainer -- then simply returns, as a user's script does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "ByteTokenizer",
    "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", "--bf16", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--use-distributed-optimizer",
]  # fmt: skip

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import megadlm_ext as ext
    from megadlm_ext import _C, nccl
    from megadlms.pretrain import main

    dev = torch.device("cuda", 0)
    ts = [torch.randn(n, device=dev) for n in (3, 1000, 4099)]
    flat = ext.flatten(ts)
    ext.unflatten(flat, ts, scale=0.5)
    ext.accumulate_into(flat, ts)
    ext.scale_(ts, 2.0)
    assert float(ext.l2_norm(ts)) > 0 and not ext.has_nonfinite(ts)
    assert int(ext.nonfinite_flag(ts)) == 0
    mg = torch.zeros(8, 16, device=dev)
    ext.wgrad_accumulate(mg, torch.randn(4, 8, device=dev), torch.randn(4, 16, device=dev))
    ext.grouped_gemm(torch.randn(5, 16, device=dev), torch.randn(2, 16, 8, device=dev), torch.tensor([2, 3]))
    assert _C._cuda_table_cache_stats()[2] > 0  # cached device tables stay until exit
    comm = nccl.Communicator(nccl.unique_id(), 0, 1, 0)  # left open: closed (or not) at exit
    x = torch.ones(64, device=dev)
    comm.all_reduce(x).wait()
    torch.cuda.synchronize()
    rc = main(sys.argv[1:])  # two trainer iterations (NCCL process group of one)
    print("child done", rc, flush=True)
    sys.exit(rc)
    """
)


def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT}/python:{ROOT}", PYTHONUNBUFFERED="1")


def _check(proc: subprocess.CompletedProcess) -> None:
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{tail}"
    assert "terminate called" not in proc.stderr, tail


def test_a_process_that_used_every_cuda_object_exits_0():
    pytest.importorskip("megadlm_ext.nccl")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *TINY],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    _check(proc)
    assert "child done 0" in proc.stdout


def test_the_trainer_under_torchrun_exits_0():
    """What a scheduler sees: torchrun's own status after a successful run (it printed
    "pretrain_difflm.py FAILED ... Signal 6" for runs that had trained to the end)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "pretrain_difflm.py",
        *TINY,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    _check(proc)
    assert "iteration        2/       2" in proc.stdout + proc.stderr
