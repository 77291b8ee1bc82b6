"""benchmarks/bench_optimizer.py on CPU (--dry-run --device cpu, tiny shapes): every variant
runs and lands in the table with consistent figures; bad arguments are refused. The GPU
numbers come from the GPU check."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_optimizer", os.path.join(ROOT, "benchmarks", "bench_optimizer.py")
    )  # noqa: E501
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_table(bench, capsys, tmp_path):
    out = tmp_path / "table.md"
    assert bench.main(["--dry-run", "--device", "cpu", "--reps", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text().strip() == text.strip()
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("| ") and "variant" not in ln]
    assert [r[0].strip() for r in rows] == list(bench.VARIANTS)
    assert next(r for r in rows if r[0].strip() == bench.BASELINE)[5].strip() == "1.00x"


def test_figures_are_consistent(bench):
    import torch

    n, bw, rows = bench.run(torch.device("cpu"), reps=1, dry=True, names=["ours (fp32)"])
    assert n == sum(torch.Size(s).numel() for s in bench.shapes(True)) and bw > 0
    times = {name: ms for name, _, ms, _, _, _ in rows}
    for name, bpp, ms, floor, frac, speed in rows:
        assert bpp == bench.VARIANTS[name][0]
        assert floor == pytest.approx(n * bpp / bw * 1e3) and frac == pytest.approx(floor / ms)
        assert speed == pytest.approx(times[bench.BASELINE] / ms)


def test_variant_subset_and_refusals(bench, capsys):
    assert bench.main(["--dry-run", "--device", "cpu", "--reps", "1", "--variants", "ours bf16 moments"]) == 0
    names = [ln.split("|")[1].strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert names[1:] == [bench.BASELINE, "ours bf16 moments"]  # the baseline always runs
    for argv, message in (
        (["--device", "cpu"], "on CPU use --dry-run"),
        (["--dry-run", "--device", "cpu", "--variants", "nope"], "unknown variants"),
    ):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err
