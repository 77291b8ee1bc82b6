"""examples/crossover.sh (the DLM-vs-AR crossover experiment) end to end on its tiny preset:
the data split, both trainings through the real CLI, the evaluation of every checkpoint and
the three outputs. References: the commands are compared flag by flag, the AR model's
held-out NLL is recomputed here with plain PyTorch from the checkpoint, and the DLM's
numbers are recomputed in this process (they must be reproduced exactly)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# two trainings and their evaluations end to end: outside `make test-fast`
pytestmark = pytest.mark.slow


def _texts(path):
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


def _rows(texts, width, n):
    """The held-out stream cut into rows: bytes of each verse, then eod (256)."""
    stream = [b for t in texts for b in list(t.encode()) + [256]]
    return torch.tensor(stream[: n * width]).view(n, width)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    for mod in ("bible", "matplotlib"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"the crossover example needs {mod} (pip install 'megadlms[demo]')")
    out = tmp_path_factory.mktemp("crossover")
    env = dict(os.environ, PY=sys.executable, OMP_NUM_THREADS="1")
    # A caller with stale torchrun variables whose MASTER_PORT is taken (as after an in-process
    # trainer run in this pytest process): each training must still be a world of its own.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken.getsockname()[1]))
        proc = subprocess.run(
            ["bash", os.path.join(ROOT, "examples", "crossover.sh"), "--preset", "tiny", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = (out / "crossover.csv").read_text()
    # the report again, from the checkpoints: the DLM's cached scores dropped, so they are
    # recomputed in fresh (spawned) evaluation processes and must come out the same (the AR's
    # are reused). The CLI's main runs in this process: the script itself ran above, and a
    # second interpreter would only import torch again.
    for f in (out / "runs" / "dlm" / "eval").iterdir():
        f.unlink()
    from megadlms.experiments import crossover

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = crossover.main(["--preset", "tiny", "--skip-train", str(out)])
    assert rc == 0, printed.getvalue()[-3000:]
    assert (
        "training ar" not in printed.getvalue() and len(list((out / "runs" / "dlm" / "eval").iterdir())) == 2
    )
    assert (out / "crossover.csv").read_text() == first
    return out


def test_outputs_settings_and_metrics(tiny_run):
    from megadlms.experiments import crossover_data, crossover_eval
    from megadlms.generate import load_for_inference

    out = tiny_run
    # crossover.csv: one row per model, evaluation and metric; epochs 2 and 4 (eval_every 2)
    with open(out / "crossover.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"model", "epoch", "metric", "value"} <= set(rows[0])
    assert len(rows) == 2 * 2 * 3
    assert {(r["model"], r["metric"]) for r in rows} == {
        (m, k) for m in ("ar", "dlm") for k in ("heldout_loss", "train_loss", "cloze_acc")
    }
    for m in ("ar", "dlm"):
        epochs = sorted({float(r["epoch"]) for r in rows if r["model"] == m})
        assert (
            len(epochs) == 2
            and epochs[0] == pytest.approx(2.0, abs=0.3)
            and epochs[1] == pytest.approx(4.0, abs=0.3)
        )
    for r in rows:
        v = float(r["value"])
        assert math.isfinite(v) and (0.0 <= v <= 1.0 if r["metric"] == "cloze_acc" else 0.0 < v < 10.0)

    # crossover.png: a real PNG image of the size matplotlib was asked for
    from PIL import Image

    with Image.open(out / "crossover.png") as im:
        im.verify()
    with Image.open(out / "crossover.png") as im:
        assert im.format == "PNG" and im.size[0] > 1000 and im.size[1] > 300

    # summary.md: setting, chance level 1/4, every matched-settings check passed
    summary = (out / "summary.md").read_text()
    assert "Cloze chance level: 0.2500" in summary and "| cloze chance | 0.2500 |" in summary
    assert "Matched settings (checked):" in summary and "- same data order" in summary
    assert ": NO" not in summary and summary.count(": yes") == 5
    assert "crossover" in summary or "better than the AR model" in summary

    # the two commands differ only in the mode flags and their own output paths
    cmds = {m: json.loads((out / "runs" / m / "command.json").read_text()) for m in ("ar", "dlm")}
    diff = [(a, b) for a, b in zip(cmds["ar"], cmds["dlm"]) if a != b]
    assert len(cmds["ar"]) == len(cmds["dlm"])
    assert {d for d in diff if "/runs/" not in d[0]} == {("vanilla", "difflm-noshift"), ("causal", "no_mask")}
    assert cmds["ar"][1:3] == ["-m", "megadlms.pretrain"]

    # data: no verse is both trained on and held out
    train = set(_texts(out / "data" / "train.jsonl"))
    held = _texts(out / "data" / "heldout.jsonl") + _texts(out / "data" / "cloze.jsonl")
    assert train and held and not train & set(held)

    # AR held-out NLL at the last checkpoint, recomputed with plain PyTorch
    last = {
        m: max(int(d[5:]) for d in os.listdir(out / "runs" / m / "save") if d.startswith("iter_"))
        for m in cmds
    }
    model, _, _ = load_for_inference(
        str(out / "runs" / "ar" / "save" / f"iter_{last['ar']:07d}"), torch.device("cpu")
    )
    x = _rows(_texts(out / "data" / "heldout.jsonl"), 33, 8)
    with torch.no_grad():
        nll = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).double(), x[:, 1:].flatten()).item()
    final = {
        (r["model"], r["metric"]): float(r["value"]) for r in rows if int(r["iteration"]) == last[r["model"]]
    }
    assert final[("ar", "heldout_loss")] == pytest.approx(nll, rel=1e-5)

    # the DLM's numbers are deterministic: recomputed here, they are the same
    rows_t = crossover_data.token_rows(_texts(out / "data" / "heldout.jsonl"), 32, 8)
    assert torch.equal(rows_t, x)
    cloze = crossover_data.build_cloze(
        _texts(out / "data" / "cloze.jsonl"), num_questions=8, num_choices=4, answer_len=8,
        min_prompt=12, max_prompt=23, seed=1234,
    )  # fmt: skip
    m = crossover_eval.evaluate_checkpoint(
        str(out / "runs" / "dlm" / "save" / f"iter_{last['dlm']:07d}"),
        heldout_rows=rows_t,
        train_rows=crossover_data.token_rows(_texts(out / "data" / "train.jsonl"), 32, 8),
        cloze=cloze,
        nelbo_mc=2,
        cloze_mc=2,
        seed=1234,
    )
    for k in ("heldout_loss", "train_loss", "cloze_acc"):
        assert m[k] == pytest.approx(final[("dlm", k)], rel=1e-12, abs=1e-12), k
    # the cloze questions: the true choice continues its verse, every choice has 8 bytes
    verses = _texts(out / "data" / "cloze.jsonl")
    for item in cloze:
        assert all(len(c) == 8 for c in item.choices) and len({tuple(c) for c in item.choices}) == 4
        text = bytes(item.prompt[1:] + item.choices[item.answer]).decode()
        assert item.prompt[0] == 256 and any(v.startswith(text) for v in verses)
