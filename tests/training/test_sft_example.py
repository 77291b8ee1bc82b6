"""examples/sft.sh (docs/fine_tuning.md's measured table), shortened for CI to 3 steps per run:
the synthetic task's data, megadlms-preprocess-sft, three trainings on 2 CPU ranks (chance, --sft,
the pretraining objective on the same tokens) and the held-out exact-match table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sft_example_runs_and_prints_the_table(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "sft"), ITERS="3", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "sft.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "wrote 3840 conversations (3840 samples, 0 rows skipped)" in out
    rows = re.findall(r"^\| (untrained|--sft|pretraining objective)[^|]*\| (\d+\.\d)% \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["untrained", "--sft", "pretraining objective"], proc.stdout[-2000:]
    for name in ("chance", "sft", "pretraining_objective"):
        assert (tmp_path / "sft" / name / "latest_checkpointed_iteration.txt").exists()
