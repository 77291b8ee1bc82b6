"""--ckpt-convert-format / --ckpt-convert-save: convert a checkpoint and exit (Megatron)."""

import os

import pytest
import torch

from megadlms import checkpoint as ck
from megadlms.pretrain import run

pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
    "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --mock-data --eval-iters 0 --log-interval 1 "
    "--num-workers 0"
).split()


def _tensors(ckpt):
    common = ck.read_common(ckpt)
    shapes = ck.tensor_shapes(ckpt, common)
    out = {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
    ck.read_tensors(ckpt, common, out)
    return common, out


@pytest.mark.parametrize("src_fmt,dst_fmt", [("torch_dist", "torch"), ("torch", "torch_dist")])
def test_convert_and_resume(tmp_path, src_fmt, dst_fmt):
    save = str(tmp_path / "ck")
    run(
        MODEL
        + [
            "--train-iters",
            "5",
            "--save",
            save,
            "--save-interval",
            "3",
            "--exit-interval",
            "3",
            "--ckpt-format",
            src_fmt,
        ]
    )
    out = run(
        MODEL
        + [
            "--train-iters",
            "3",
            "--load",
            save,
            "--ckpt-convert-format",
            dst_fmt,
            "--ckpt-convert-save",
            str(tmp_path / "conv"),
        ]
    )
    assert out == os.path.join(str(tmp_path / "conv"), dst_fmt, "iter_0000003")
    src_common, src = _tensors(os.path.join(save, "iter_0000003"))
    dst_common, dst = _tensors(out)
    assert dst_common["ckpt_format"] == dst_fmt and dst_common["iteration"] == 3
    assert dst_common["model_config"] == src_common["model_config"]
    assert set(src) == set(dst) and any(k.startswith("optimizer/") for k in dst)
    for k in src:
        assert torch.equal(src[k], dst[k]), k
    # both continue the same way
    a = run(MODEL + ["--train-iters", "5", "--load", save, "--no-load-rng"])
    b = run(
        MODEL
        + ["--train-iters", "5", "--load", os.path.join(str(tmp_path / "conv"), dst_fmt), "--no-load-rng"]
    )
    assert a.losses == b.losses and len(a.losses) == 2


def test_convert_needs_load_and_save():
    with pytest.raises(ValueError, match="--ckpt-convert-format needs --load"):
        run(MODEL + ["--train-iters", "1", "--ckpt-convert-format", "torch"])


def test_convert_v3_torch_dist_writes_v4(tmp_path):
    """The v3 -> v4 converter: --ckpt-convert-format torch_dist of a format-3 torch_dist checkpoint."""
    import json

    save = str(tmp_path / "ck")
    run(MODEL + ["--train-iters", "2", "--save", save, "--save-interval", "2"])
    src = os.path.join(save, "iter_0000002")
    with open(os.path.join(src, ck.COMMON_FILE)) as f:
        common = json.load(f)
    common["format_version"] = 3  # what main wrote: the same keys, shapes and (tp = 1) one chunk each
    with open(os.path.join(src, ck.COMMON_FILE), "w") as f:
        json.dump(common, f)
    conv = str(tmp_path / "conv")
    out = run(MODEL + ["--train-iters", "2", "--load", save, "--ckpt-convert-format", "torch_dist",
                       "--ckpt-convert-save", conv])  # fmt: skip
    assert out == os.path.join(conv, "torch_dist", "iter_0000002")
    src_common, before = _tensors(src)
    dst_common, after = _tensors(out)
    assert src_common["format_version"] == 3 and dst_common["format_version"] == ck.FORMAT_VERSION == 4
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
