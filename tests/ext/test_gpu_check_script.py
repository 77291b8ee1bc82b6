"""tools/gpu_check.sh and benchmarks/bench_gpu.py on a machine without a GPU.

The GPU check cannot run here, so its script is checked for syntax, its argument
handling and its --dry-run mode (which runs the CPU-side tests of the GPU path and the
benchmark's CPU fallback), and the benchmark's argument checks are exercised.
"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_gpu  # noqa: E402


def _bash(*args, **kw):
    return subprocess.run(["bash", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def test_script_syntax_and_arguments():
    assert _bash("-n", SCRIPT).returncode == 0
    help_ = _bash(SCRIPT, "--help")
    assert help_.returncode == 0 and "--dry-run" in help_.stdout and "make gpu-check" in help_.stdout
    bad = _bash(SCRIPT, "--bogus")
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs for real")
def test_without_a_gpu_the_full_check_refuses_clearly(tmp_path):
    r = _bash(SCRIPT, env={**os.environ, "PY": sys.executable, "LOG_DIR": str(tmp_path)})
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--dry-run" in r.stderr


@pytest.mark.slow
def test_dry_run_passes_and_prints_every_section(tmp_path):
    env = {**os.environ, "PY": sys.executable, "LOG_DIR": str(tmp_path)}
    r = _bash(SCRIPT, "--dry-run", env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = r.stdout
    for line in (
        "PASS  environment",
        "PASS  self-check",
        "PASS  cpu-tests-of-gpu-path",
        "PASS  bench-gpu-dry-run",
        "SKIP  pytest-gpu",
    ):
        assert line in out, out[-2000:]
    for header in ("## ops (cpu", "## ddp step", "## mfu ("):
        assert header in out
    assert (tmp_path / "bench-gpu-dry-run.log").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sections", "ops,bogus"], "unknown ['bogus']"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--device", "cpu"], "on CPU use --dry-run"),
    ],
)
def test_bench_gpu_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_gpu.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_gpu_cpu_fallback_ops_table(capsys):
    bench_gpu.main(["--dry-run", "--device", "cpu", "--sections", "ops", "--reps", "1"])
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| (")]
    # 5 ops + the copy baseline, for both cases; every ratio column is filled in
    assert len(rows) == 12, out
    assert all(r.count("x |") >= 1 for r in rows)
    assert "D2D copy_ (baseline)" in out and "_foreach_copy_" in out
