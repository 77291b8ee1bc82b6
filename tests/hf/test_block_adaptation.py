"""AR-to-block-diffusion adaptation (SDAR / Fast-dLLM v2 / Nemotron's route): a tiny Hugging Face
causal LM through --hf-init, trained as a shifted block-diffusion model with the joint AR loss."""

import math

import pytest

from .test_import import _hf_model, _train_flags

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)


def test_ar_model_adapts_to_block_diffusion_through_hf_init(tmp_path):
    from megadlms.hf.importer import model_flags, read_hf_config, transformer_config_from_hf
    from megadlms.pretrain import run

    _hf_model(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    cfg = transformer_config_from_hf(read_hf_config(str(tmp_path / "hf")), seq_length=32)
    flags = " ".join(model_flags(cfg)).split() + ["--seq-length", "32", "--mask-token", "258"]
    flags += [
        "--model-running-mode",
        "difflm-shift",
        "--difflm-block-size",
        "8",
        "--difflm-ar-loss-weight",
        "1.0",
    ]
    adapted = run(_train_flags(flags + ["--hf-init", str(tmp_path / "hf")], tmp_path, iters=4))
    scratch = run(_train_flags(flags, tmp_path, iters=4))
    losses = list(adapted.losses.values())
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    # the same batches and noise: only the starting weights (the HF model's) differ
    assert adapted.losses[1] != pytest.approx(scratch.losses[1], rel=1e-3)
