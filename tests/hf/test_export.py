"""megadlms-export-hf: the exported directory loads in transformers and reproduces our model."""

import json
import os

import pytest
import torch

from megadlms.data import ByteTokenizer
from megadlms.diffusion import generate
from megadlms.hf.export import export_hf, main

from .helpers import LEARNED_GELU, ROPE_SWIGLU, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _load(out):
    return transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()


@pytest.mark.parametrize("arch,fmt", [(ROPE_SWIGLU, "torch_dist"), (LEARNED_GELU, "torch")])
def test_logits_match_with_and_without_attention_mask(tmp_path, arch, fmt):
    ours = save_tiny(tmp_path / "ck", tiny_config(**arch), fmt=fmt)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    hf = _load(tmp_path / "hf")
    ids = torch.randint(0, 259, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ours(ids)[..., :259]
        got = hf(ids).logits
        assert got.shape == ref.shape == (3, 20, 259)  # the tokenizer's vocabulary, padding rows dropped
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        # right padding + attention_mask == each row alone
        lengths = [20, 13, 7]
        mask = torch.zeros(3, 20, dtype=torch.int64)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        padded = torch.where(mask.bool(), ids, torch.full_like(ids, 258))
        got = hf(padded, attention_mask=mask).logits
        for i, n in enumerate(lengths):
            torch.testing.assert_close(got[i, :n], ours(ids[i : i + 1, :n])[0, :, :259], rtol=0, atol=1e-5)
        assert (got[1, :13] - hf(padded[1:2]).logits[0, :13]).abs().max() > 1e-3  # the mask mattered


def test_files_config_tokenizer_and_bf16(tmp_path, rope_swiglu_ckpt):
    ck, _ = rope_swiglu_ckpt
    assert main(["--load", str(ck), "--output", str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    files = set(os.listdir(tmp_path / "hf"))
    assert {"model.safetensors", "config.json", "generation_config.json", "modeling_megadlms.py"} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["mask_token_id"] == 257 and config["dtype"] == "bfloat16"
    hf = _load(tmp_path / "hf")
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    text = "In the beginning, Ünïcode ✓"
    assert tok(text).input_ids == ByteTokenizer().tokenize(text)
    assert tok.mask_token_id == 257 and tok.eos_token_id == 256
    assert tok.decode(ByteTokenizer().tokenize(text)) == text


def test_sharded_export_loads(tmp_path, rope_swiglu_ckpt):
    ck, ours = rope_swiglu_ckpt
    export_hf(str(ck), str(tmp_path / "hf"), max_shard_size_mb=0)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    ids = torch.randint(0, 259, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            _load(tmp_path / "hf")(ids).logits, ours(ids)[..., :259], rtol=0, atol=1e-5
        )


@pytest.fixture(scope="module")
def rope_swiglu_hf(rope_swiglu_export):
    """The shared export loaded in transformers."""
    out, ours = rope_swiglu_export
    return ours, _load(out)


@pytest.mark.parametrize(
    "kw",
    [
        # random remasking: the ranking does not use the probabilities
        dict(gen_length=16, steps=8, block_length=8, remasking="random"),
        dict(gen_length=12, steps=12, block_length=4, remasking="random", cfg_scale=1.5),
        # one step per block commits every position, whatever the confidences
        dict(gen_length=16, steps=2, block_length=8, remasking="low_confidence"),
        # several steps per block: both rank by p(x0) of the unmodified logits (LLaDA)
        dict(gen_length=16, steps=8, block_length=8, remasking="low_confidence"),
        dict(gen_length=12, steps=12, block_length=4, remasking="low_confidence", cfg_scale=1.0),
        # Fast-dLLM's parallel decoding: the same commits and the same number of forward passes
        dict(gen_length=16, steps=16, block_length=8, remasking="low_confidence", threshold=0.02),
        dict(gen_length=16, steps=16, block_length=16, remasking="random", threshold=0.5),
    ],
)
def test_generate_matches_megadlms_sampler(rope_swiglu_hf, kw):
    ours, hf = rope_swiglu_hf
    prompt = torch.tensor([list(b"And God said"), list(b"In the begin")], dtype=torch.int64)
    ours_stats, hf_stats = {}, {}
    ref = generate(
        ours, prompt, mask_token_id=257, temperature=0.0, seed=3, vocab_size=259, stats=ours_stats, **kw
    )
    got = hf.generate(prompt, temperature=0.0, seed=3, stats=hf_stats, **kw)
    assert torch.equal(got, ref)
    assert not (got == 257).any()
    assert ours_stats["nfe"] == hf_stats["nfe"] <= kw["steps"]
