"""Tiny megadlms checkpoints for the Hugging Face tests."""

import pytest
import torch

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.data import TokenizerConfig
from megadlms.models import GPTModel, TransformerConfig

ROPE_SWIGLU = dict(
    position_embedding_type="rope",
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    qk_layernorm=True,
    num_query_groups=2,
    # Room for MegaDLMs' dlm_inference.py call: its prompt + 256 new tokens.
    max_position_embeddings=288,
)
LEARNED_GELU = dict(
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    add_bias_linear=True,
    untie_embeddings_and_output_weights=True,
)


def tiny_config(**kw) -> TransformerConfig:
    # The byte tokenizer's 259 ids padded to 384 rows, as a run records them.
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=384,
        unpadded_vocab_size=259,
        seq_length=48,
    )
    base.update(kw)
    return TransformerConfig(**base)


def save_tiny(root, cfg: TransformerConfig, fmt="torch_dist", seed=0, iteration=3) -> GPTModel:
    """A GPTModel with random (non-default) weights saved as a megadlms checkpoint."""
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    with torch.no_grad():  # non-trivial norms and biases, so their mapping is tested
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif "word_embeddings" in name or "output_layer" in name:
                p.mul_(20.0)  # confident logits, so sampler tie-breaks do not decide
    save_checkpoint(
        str(root),
        iteration,
        model=model,
        ckpt_format=fmt,
        records=RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict()),
    )
    return model.eval()


@pytest.fixture(scope="session")
def rope_swiglu_ckpt(tmp_path_factory):
    """(checkpoint dir, model): one tiny RoPE / SwiGLU / GQA checkpoint (torch_dist, seed 0)
    shared by the tests that only read it (export, sampler, lm-eval)."""
    root = tmp_path_factory.mktemp("rope_swiglu") / "ck"
    return root, save_tiny(root, tiny_config(**ROPE_SWIGLU))


@pytest.fixture(scope="session")
def rope_swiglu_export(tmp_path_factory, rope_swiglu_ckpt):
    """(export dir, model): the shared checkpoint exported once (default dtype, one file)."""
    from megadlms.hf.export import export_hf

    ck, ours = rope_swiglu_ckpt
    out = tmp_path_factory.mktemp("rope_swiglu_export")
    export_hf(str(ck), str(out))
    return out, ours


def pp2_logits(hf_dir: str, ids: torch.Tensor, **overrides) -> torch.Tensor:
    """The logits of the HF model in ``hf_dir`` imported at pipeline-parallel size 2: its two
    stages (layer 0 with the embedding, the rest with the head) each filled by ``init_from_hf``
    on its own, as its rank does under --hf-init, then run one after the other."""
    from megadlms.hf.importer import init_from_hf, read_hf_config, transformer_config_from_hf
    from megadlms.models import PipelineChunk

    cfg = transformer_config_from_hf(read_hf_config(hf_dir), seq_length=32, **overrides)
    n = cfg.num_layers
    stages = (PipelineChunk(True, False, range(0, 1)), PipelineChunk(False, True, range(1, n)))
    first, last = (GPTModel(cfg, pipeline=stage).eval() for stage in stages)
    for chunk in (first, last):
        init_from_hf([chunk], hf_dir)
    if not cfg.untie_embeddings_and_output_weights:  # the last stage's tied copy: the embedding's rows
        assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    with torch.no_grad():
        return last(hidden_states=first(ids))
