"""--hf-init at pipeline-parallel size 2: each stage's chunk takes its own layers from the HF
model's full state dict (global layer names), the last stage's tied output layer the
embedding's rows. The two stages run one after the other give transformers' logits (Llama,
untied, GQA; Qwen3, tied, q/k norms; LLaDA, LLaDA-MoE and Dream in their own test files,
``helpers.pp2_logits``), and a run with --hf-init at pp 2 trains with the losses
of the same run at pp 1 (dp 2, the same global batch)."""

from __future__ import annotations

import pytest
import torch

from megadlms.hf.importer import model_flags, read_hf_config, transformer_config_from_hf
from tests.dist_utils import run_distributed

from .helpers import pp2_logits
from .test_import import _hf_model, _train_flags

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

CASES = [("llama", {}), ("qwen3", dict(tie_word_embeddings=True, head_dim=16))]


@pytest.mark.parametrize("family,kw", CASES)
def test_hf_init_at_pp2_gives_the_hf_logits(tmp_path, family, kw):
    hf = _hf_model(tmp_path, family, **kw)
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(2))
    got = pp2_logits(str(tmp_path), ids, attention="causal")
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got[..., :259], ref, rtol=0, atol=1e-5)


def _pp2_and_pp1(rank, world, path, root):
    """Four steps from --hf-init at pp 2 and at pp 1 (dp 2), the same global batch."""
    from megadlms.pretrain import run

    cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32)
    flags = " ".join(model_flags(cfg)).split() + ["--seq-length", "32", "--hf-init", path]
    layout = ["--global-batch-size", "4", "--micro-batch-size", "1", "--attention-dropout", "0"]
    pp2 = run(
        _train_flags(flags, None, iters=3)
        + layout
        + ["--hidden-dropout", "0", "--pipeline-model-parallel-size", "2"]
    )
    pp1 = run(_train_flags(flags, None, iters=3) + layout + ["--hidden-dropout", "0"])
    return pp2.losses, pp1.losses


def test_hf_init_trains_at_pp2_as_at_pp1(tmp_path):
    _hf_model(tmp_path / "hf", "qwen3", tie_word_embeddings=True)
    results = run_distributed(
        _pp2_and_pp1, world_size=2, args=(str(tmp_path / "hf"), str(tmp_path)), timeout=240
    )
    for pp2, pp1 in results:
        assert sorted(pp1) == [1, 2, 3] and all(torch.isfinite(torch.tensor(list(pp1.values()))))
        assert [pp2[i] for i in (1, 2, 3)] == pytest.approx([pp1[i] for i in (1, 2, 3)], rel=1e-5)
