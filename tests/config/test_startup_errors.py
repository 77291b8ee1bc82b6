"""Every mistake of a user's first hour is one line naming the flag, the value and the fix,
printed once (by rank 0), before the process group or the model exists, with no traceback:
missing data files, a missing tokenizer, a tokenizer without a mask token, a --load that is
a file, an unknown flag. In-process (rank 0, then rank 1 of a world of two), with the
process group and the trainer replaced by tripwires."""

from __future__ import annotations

import re
import shlex
import time

import numpy as np
import pytest

import megadlms.pretrain as pretrain_mod
from megadlms.data import IndexedDatasetBuilder

BASE = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3"
)


def _tokenizer(path, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(path))
    return str(path)


def _cases(tmp_path):
    """case -> (extra flags, the one line expected on stderr, as a regex)."""
    nomask = _tokenizer(tmp_path / "nomask.json", ["<|endoftext|>"])
    empty = str(tmp_path / "empty")
    b = IndexedDatasetBuilder(empty + ".bin", dtype=np.int32)
    b.add_document(np.zeros(0, dtype=np.int32), [0])
    b.finalize(empty + ".idx")
    missing = str(tmp_path / "nope" / "corpus")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    return {
        "data_path": (["--data-path", missing], rf"--data-path {missing}: no {missing}\.idx or .*preprocess"),
        "train_data_path": (
            ["--train-data-path", missing, "--valid-data-path", missing],
            rf"--train-data-path {missing}: no .*\n  - --valid-data-path {missing}: no ",
        ),
        "bin_suffix": (["--data-path", missing + ".bin"], r"give the prefix without \.bin/\.idx"),
        "no_tokens": (["--data-path", empty], rf"--data-path {empty}: no tokens for training"),
        "tokenizer_model": (
            ["--mock-data", "--tokenizer-model", missing],
            rf"--tokenizer-model '{missing}': no tokenizer\.json there; pass the path",
        ),
        "no_mask_token": (
            ["--mock-data", "--tokenizer-model", nomask],
            rf"--tokenizer-model {nomask} has none of the mask tokens .*'<\|mask_token\|>'\); .*"
            r"pass --mask-token TOKEN_OR_ID \(or --model-running-mode vanilla",
        ),
        "load_is_a_file": (["--mock-data", "--load", nomask], rf"--load {nomask} is a file; pass the --save"),
        "convert_without_checkpoint": (
            ["--mock-data", "--load", str(tmp_path), "--ckpt-convert-format", "torch"]
            + ["--ckpt-convert-save", str(tmp_path / "out")],
            r"holds no checkpoint .*--ckpt-convert-format converts an existing checkpoint",
        ),
        "load_is_a_hf_model": (
            ["--mock-data", "--load", str(hf)],
            rf"--load {hf} is a Hugging Face model .*--hf-init",
        ),
        "save_is_a_file": (
            ["--mock-data", "--save", nomask, "--save-interval", "5"],
            rf"--save {nomask} is a file; pass a directory",
        ),
        "rule": (["--mock-data", "--fp16", "--bf16"], r"--fp16 and --bf16 are exclusive: pick one"),
    }


def test_each_mistake_is_one_line_before_any_expensive_work(tmp_path, capsys, monkeypatch):
    built = []
    # Nothing past the checks may run: no process group, no trainer (hence no model).
    monkeypatch.setattr(pretrain_mod, "init_distributed", lambda *a: built.append("process group"))
    monkeypatch.setattr(pretrain_mod, "pretrain", lambda *a, **k: built.append("model"))
    for name, (flags, expected) in _cases(tmp_path).items():
        t0 = time.perf_counter()
        rc = pretrain_mod.main(BASE + flags)
        elapsed = time.perf_counter() - t0
        err = capsys.readouterr().err
        assert rc == 2 and not built, (name, rc, built)
        assert "Traceback" not in err and "raised at" not in err, (name, err)
        assert re.search(expected, err), (name, err)
        assert err.startswith("pretrain_difflm.py: error: ") and "---" not in err, (name, err)
        # one line per problem (the two-problem case: a header and two lines)
        assert err.count("\n") == (3 if name == "train_data_path" else 1), (name, err)
        assert elapsed < 5, (name, elapsed)  # parse + file checks: well under a second unloaded
    with pytest.raises(SystemExit) as exc:
        pretrain_mod.main(BASE + ["--mock-data", "--no-such-flag", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines() == [
        "usage: pretrain_difflm.py [flags]  (--help lists every flag; docs/flags.md)",
        "pretrain_difflm.py: error: unrecognized arguments: --no-such-flag 3",
    ]


def test_other_ranks_exit_quietly_with_the_same_status(tmp_path, capsys, monkeypatch):
    """Rank 1 of a torchrun world (RANK=1 before any process group exists) meets the same
    errors, prints nothing (argparse's usage and error included) and returns the same status;
    as every check runs before the process group, no rank can wait for another."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(pretrain_mod, "init_distributed", lambda *a: pytest.fail("reached the process group"))
    for name, (flags, _) in _cases(tmp_path).items():
        assert pretrain_mod.main(BASE + flags) == 2, name
    with pytest.raises(SystemExit) as exc:
        pretrain_mod.main(BASE + ["--mock-data", "--no-such-flag", "3"])
    assert exc.value.code == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == ""
