"""tools/gpu_check.sh and benchmarks/bench_gpu.py on a machine without a GPU.

The GPU check cannot run here, so its argument handling, its budget and its --dry-run
mode are checked: `make gpu-check GPU_CHECK_ARGS=--dry-run` with pip cut off from every
index must pass, install nothing and leave its summary under $OUT. The dry run builds
nothing and does not re-run the CPU tests of the GPU path (test_cuda_emulation.py and
test_nccl_fake.py run on their own in the suite). The Makefile's dry run, one single-threaded
chain of subprocesses, starts with the module and runs on the second core while the other
script runs of the module go on; its test reads the result.
"""

import os
import re
import signal
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_gpu  # noqa: E402

# pip with no index, no find-links and no config file: any download attempt fails.
OFFLINE = {
    "PIP_NO_INDEX": "1",
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_CONFIG_FILE": os.devnull,
}


def _bash(*args, **kw):
    return subprocess.run(["bash", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def _env(out, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, **OFFLINE, "PY": sys.executable, "OUT": str(out), **extra}


@pytest.fixture(scope="module", autouse=True)
def make_dry_run(request, tmp_path_factory):
    """`make gpu-check GPU_CHECK_ARGS=--dry-run` with pip cut off, started in the background
    at the module's first test when its test is selected; yields a function that waits for
    it and returns (CompletedProcess, the $OUT folder)."""
    if not any(i.name == "test_make_gpu_check_dry_run_offline" for i in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("make_dry_run")
    env = _env(out, GPU_CHECK_PY=sys.executable)
    env.pop("PY")
    env.pop("VIRTUAL_ENV", None)  # the target must not fall back to a venv of its own
    argv = ["make", "--no-print-directory", "gpu-check", "GPU_CHECK_ARGS=--dry-run"]
    logs = out / "make.stdout", out / "make.stderr"
    with open(logs[0], "w") as so, open(logs[1], "w") as se:  # files: a full pipe would block it
        # a session of its own: an unfinished run is stopped with all its children
        proc = subprocess.Popen(argv, stdout=so, stderr=se, cwd=ROOT, env=env, start_new_session=True)

    def result():
        rc = proc.wait(timeout=600)
        return subprocess.CompletedProcess(argv, rc, logs[0].read_text(), logs[1].read_text()), out

    try:
        yield result
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_script_arguments_and_budget(tmp_path):
    assert _bash("-n", SCRIPT).returncode == 0
    help_ = _bash(SCRIPT, "--help")
    assert help_.returncode == 0 and "--dry-run" in help_.stdout and "--budget" in help_.stdout
    bad = _bash(SCRIPT, "--bogus")
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
    bad = _bash(SCRIPT, "--budget", "soon")
    assert bad.returncode == 2 and "--budget needs minutes" in bad.stderr
    # A budget of 3 s: no step is started, each is a SKIP naming the budget, none fails.
    r = _bash(SCRIPT, "--dry-run", "--budget", "0.05", env=_env(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "SKIP  environment: not reached, budget spent" in summary
    assert "SKIP  bench-gpu-dry-run: not reached, budget spent" in summary
    assert "PASS" not in summary and "FAIL" not in summary


@pytest.mark.slow  # the whole script up to its GPU probe (imports torch in a child)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs for real")
def test_without_a_gpu_the_full_check_refuses_clearly(tmp_path):
    r = _bash(SCRIPT, env=_env(tmp_path))
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--dry-run" in r.stderr


def test_make_gpu_check_dry_run_offline(make_dry_run):
    """The Makefile target (no `install` prerequisite), pip cut off, summary under $OUT."""
    r, tmp_path = make_dry_run()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "pip install" not in r.stdout.split("=== [environment]")[0]  # no `make install` ran first
    summary = (tmp_path / "summary.txt").read_text()
    for step in (
        "environment",
        "self-check",
        "install-plan",
        "bench-gpu-dry-run",
        "trainer-dry-run",
        "wrappers-dry-run",
    ):
        assert f"PASS  {step}" in summary, summary
    for name in (
        "build",
        "cuda-build-check",
        "pytest-gpu",
        "trainer",
        "optimizer",
        "bench-gpu",
        "wrappers",
        "memcheck",
    ):
        assert f"SKIP  {name}: dry run" in summary, summary
    # What a lent GPU machine sends back is at most 8 files: the logs travel as one archive.
    written = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("make."))  # ours: make.*
    assert written == ["figures.md", "logs.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        logs = {
            m.name.lstrip("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()
        }
    # the offline install plan names the project and nothing else to fetch
    plan = logs["install-plan.log"]
    assert "Would install megadlms" in plan, plan
    figures = (tmp_path / "figures.md").read_text()
    assert "## trainer throughput (tiny model" in figures and "| ddp-s2048 | 64 | 8 | 16 |" in figures, (
        figures
    )
    assert "## ops (cpu" in figures and "## mfu (" in figures, figures  # every benchmark appends
    assert "## FSDP2 vs DDP, world size 1, cpu" in figures and "| fsdp2 |" in figures, figures
    _check_plan(logs["plan.log"])
    bench = logs["bench-gpu-dry-run.log"]
    for header in ("## ops (cpu", "## ddp step", "## mfu (", "## memory"):
        assert header in bench
    rows = {r.split(" | ")[1]: r for r in bench.splitlines() if r.startswith("| (a)")}
    # CPU: table vs list, vs copy, vs foreach (no kernel-only time without CUDA graphs)
    assert len(rows) == 5 and all(r.count("x |") == 3 and "| - | - |" in r for r in rows.values()), bench
    moved = {k: float(re.search(r"\| ([\d.]+) MB \|", r).group(1)) for k, r in rows.items()}
    # a read-only op moves half the bytes of a copy-like one: it is compared with a copy that size
    assert moved["l2_norm"] * 2 == pytest.approx(moved["flatten"], rel=0.01)
    assert "n/a (1 rank" in bench and "matmul ceiling" in bench


def _check_plan(plan: str) -> None:
    """The GPU run's plan (written by the dry run): the steps in order of value, caps that
    leave the must-have steps uncut by the budget, memcheck's deliberate settings."""
    steps = {line.split()[0]: line for line in plan.splitlines() if " cap " in line}
    order = list(steps)
    assert order[:4] == ["build", "cuda-build-check", "trainer", "pytest-gpu"], order
    assert order[-1] == "memcheck", order
    must = int(re.search(r"caps through pytest-gpu: (\d+)s of the (\d+)s budget", plan).group(1))
    assert must <= 480, plan  # environment .. pytest-gpu: never cut by the default budget
    memcheck = steps["memcheck"]
    for flag in ("PYTORCH_NO_CUDA_MEMORY_CACHING=1", "--error-exitcode 1", "--report-api-errors no",
                 "not profiler and not cuda_graph"):  # fmt: skip
        assert flag in memcheck, (flag, memcheck)
    assert "--dry-run" not in steps["build"] and "--no-index" in steps["build"], steps["build"]


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
