"""Fast-dLLM's KV cache (prefix and dual) and parallel decoding: our sampler, our Hugging Face
export's ``generate`` and NVlabs/Fast-dLLM's own three functions (``generate``,
``generate_with_prefix_cache``, ``generate_with_dual_cache``) run on that export give the same
tokens and the same forward-pass counts, in float64 with greedy decoding."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from megadlms.checkpoint import RunRecords, save_checkpoint
from megadlms.data import TokenizerConfig
from megadlms.diffusion import generate
from megadlms.hf.export import export_hf
from megadlms.models import GPTModel
from megadlms.ops.kv_cache import KVCache
from tests.diffusion import _fast_dllm_reference as fast_dllm
from tests.hf.helpers import ROPE_SWIGLU, tiny_config

MASK = 258  # the byte tokenizer's last real id stands in for [MASK]
FAST_DLLM = {
    None: fast_dllm.generate,
    "prefix": fast_dllm.generate_with_prefix_cache,
    "dual": fast_dllm.generate_with_dual_cache,
}


def _varied_weights(model: GPTModel) -> None:
    """Weights that give varied tokens, confidences across (0, 1), and answers that the cache's
    approximation changes (an init-scale model predicts one token everywhere): matrices x10,
    embeddings and output x20, norms and biases moved off their init. Then [MASK]'s output row
    zero and rows 1 and 2 opposite: max(l1, l2) = |w . h| > 0 = l_MASK, so [MASK] is never the
    argmax (our sampler never commits it, Fast-dLLM's could)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(20.0 if "word_embeddings" in name or "output_layer" in name else 10.0)
        w = model.output_layer.weight
        w[MASK].zero_()
        w[2].copy_(-w[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours float64, export float64): the same weights, an untied RoPE / SwiGLU / GQA / qk-norm
    model (fp32 checkpoint, both upcast)."""
    root = tmp_path_factory.mktemp("fast_dllm") / "ck"
    cfg = tiny_config(**ROPE_SWIGLU, untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    _varied_weights(model)
    save_checkpoint(
        str(root), 1, model=model, ckpt_format="torch_dist",
        records=RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict()),
    )  # fmt: skip
    out = tmp_path_factory.mktemp("fast_dllm_export")
    export_hf(str(root), str(out))
    hf = transformers.AutoModelForMaskedLM.from_pretrained(
        str(out), trust_remote_code=True, dtype=torch.float64
    )
    return copy.deepcopy(model).double().eval(), hf.eval()


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_cache_modes_equal_fast_dllm(models, cache):
    ours, hf = models
    settings = [(16, None), (8, None), (4, None), (8, 0.9), (4, 0.3), (16, 0.1)]
    tokens, parallel, differs = set(), 0, 0
    for block_length, threshold in settings:
        for plen in (3, 8):
            prompt = torch.randint(0, MASK, (1, plen), generator=torch.Generator().manual_seed(plen))
            kw = dict(steps=16, gen_length=16, block_length=block_length, threshold=threshold)
            want, nfe = FAST_DLLM[cache](hf, prompt, mask_id=MASK, **kw)
            stats, hf_stats = {}, {}
            got = generate(ours, prompt, mask_token_id=MASK, cache=cache, stats=stats, **kw)
            got_hf = hf.generate(prompt, mask_id=MASK, cache=cache, stats=hf_stats, **kw)
            case = (cache, block_length, threshold, plen)
            assert torch.equal(got, want), case
            assert torch.equal(got_hf, want), case
            # Fast-dLLM's cached loops run one more forward after a block whose first (full) step
            # filled it (their loop tests for masks after the forward); ours stops there.
            wasted = 0 if cache is None else stats["block_nfe"].count(1)
            assert stats["nfe"] == hf_stats["nfe"] == nfe - wasted, case
            tokens |= set(got[0, plen:].tolist())
            parallel += nfe < 16
            differs += not torch.equal(got, generate(ours, prompt, mask_token_id=MASK, **kw))
    # Not vacuous: varied answers, parallel commits, and (cached) answers the approximation changed.
    assert len(tokens) > 5 and parallel > 0
    assert (differs > 0) == (cache is not None)


def test_first_cached_step_is_the_uncached_step(models):
    ours, _ = models
    x = torch.randint(0, MASK, (2, 20), generator=torch.Generator().manual_seed(1))
    for model in (ours, ours.float()):
        cache = KVCache()
        assert torch.equal(model(x, kv_cache=cache), model(x))  # bitwise: the same attention call
        assert cache.length == 20
    ours.double()
    prompt = x[:, :6]
    one = dict(mask_token_id=MASK, gen_length=16, steps=1, block_length=16)
    plain = generate(ours, prompt, **one)
    for cache in ("prefix", "dual"):
        assert torch.equal(generate(ours, prompt, cache=cache, **one), plain)


def test_prefix_cache_is_exact_for_an_unchanged_sequence(models):
    """Keys of the prefix from the full forward + the rest recomputed = the full forward (no
    approximation when nothing changed), for the model API itself."""
    ours, _ = models
    x = torch.randint(0, MASK, (2, 24), generator=torch.Generator().manual_seed(2))
    full = ours(x)
    cache = KVCache()
    ours(x, kv_cache=cache)
    cache.truncate(10)
    rest = ours(x[:, 10:], kv_cache=cache, cache_offset=10)
    torch.testing.assert_close(rest, full[:, 10:], rtol=0, atol=1e-12)
    block = ours(x[:, 10:14], kv_cache=cache, cache_offset=10)  # dual: slots after it kept
    torch.testing.assert_close(block, full[:, 10:14], rtol=0, atol=1e-12)
    ours.train()
    with pytest.raises(ValueError, match="eval"):
        ours(x, kv_cache=KVCache())
    ours.eval()


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_left_padded_batch_equals_each_prompt_alone(models, cache):
    ours, hf = models
    lens = (3, 7, 5)
    prompts = [torch.randint(0, MASK, (1, n), generator=torch.Generator().manual_seed(n)) for n in lens]
    P = max(lens)
    batch = torch.zeros(len(lens), P, dtype=torch.int64)
    attention_mask = torch.zeros(len(lens), P, dtype=torch.int64)
    for i, p in enumerate(prompts):
        batch[i, P - p.shape[1] :] = p
        attention_mask[i, P - p.shape[1] :] = 1
    kw = dict(steps=8, gen_length=16, block_length=8, threshold=0.5)
    got = generate(ours, batch, mask_token_id=MASK, cache=cache, attention_mask=attention_mask, **kw)
    got_hf = hf.generate(batch, attention_mask=attention_mask, mask_id=MASK, cache=cache, **kw)
    assert torch.equal(got, got_hf)
    for i, p in enumerate(prompts):
        alone = generate(ours, p, mask_token_id=MASK, cache=cache, **kw)
        assert torch.equal(got[i, P:], alone[0, p.shape[1] :]), (cache, i)


def test_cache_argument_rules(models):
    ours, hf = models
    prompt = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(ours, prompt, mask_token_id=MASK, gen_length=8, steps=8, block_length=8, cache="full")
    with pytest.raises(ValueError, match="cache must be"):
        hf.generate(prompt, mask_id=MASK, gen_length=8, steps=8, block_length=8, cache="full")
