"""benchmarks/bench_trainer.py on the CPU: the GPU check's trainer figures come from this
command (the real ``pretrain_difflm.py`` under torchrun per row), here with the tiny model."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_trainer  # noqa: E402


def test_a_row_runs_the_trainer_and_a_late_row_is_not_reached(tmp_path):
    """One DDP row trains (tokens/s, TFLOP/s, MFU of the measured ceiling, the SDPA backend);
    the second row, with less than --min-row seconds of the --deadline left, is reported
    "not reached" and the command still exits 0."""
    out = tmp_path / "figures.md"
    argv = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_trainer.py"), "--tiny", "--iters", "2",
            "--rows", "ddp-s2048,fsdp2-s4096-recompute", "--deadline", "120", "--min-row", "115",
            "--out", str(out)]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("## trainer throughput (tiny model") and "matmul ceiling, measured" in lines[1]
    ddp = next(x for x in lines if x.startswith("| ddp-s2048 |")).split(" | ")
    assert ddp[1:5] == ["64", "8", "16", "flash (CPU)"], ddp  # the CPU's SDPA at this shape
    assert float(ddp[5]) > 0 and float(ddp[6].rstrip("k")) > 0 and ddp[-1] == "0 |", ddp
    assert ddp[8].endswith("%"), ddp  # MFU of the matmul ceiling measured in the run
    late = next(x for x in lines if x.startswith("| fsdp2-s4096-recompute |"))
    assert late.endswith("not reached (--deadline) |"), late


def test_rows_cover_both_wrappers_sequences_and_recompute():
    names = set(bench_trainer.ROWS)
    for wrapper in ("ddp", "fsdp2"):
        for seq in (2048, 4096):
            assert {f"{wrapper}-s{seq}", f"{wrapper}-s{seq}-recompute"} <= names
    assert set(bench_trainer.DEFAULT_ROWS.split(",")) <= names
    assert "--recompute-activations" in bench_trainer.ROWS["ddp-s4096-recompute"][3]


@pytest.mark.parametrize(
    "argv, message",
    [(["--rows", "ddp-s2048,bogus"], "unknown ['bogus']"), (["--iters", "1"], "--iters must be >= 2")],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_trainer.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
