"""Megatron's padding rows are never sampled nor scored (issue 43).

A GPTModel with 19 real tokens padded to 32 rows whose padding rows carry the largest logits
at every position (``_padding.padding_rows_win``): the sampler in every mode (greedy,
temperature, low-confidence and random remasking, semi-autoregressive blocks, CFG) emits
only real tokens and exactly the tokens of the same model without the padding rows (what
the Hugging Face export holds); the answer likelihood is the same padded or not; and both
hold at tp = 2, where the logits are vocab-parallel slices (rank 1 holds ids 16..31: three
real ones and all the padding).
"""

from __future__ import annotations

import pytest
import torch

from megadlms.diffusion import conditional_log_likelihood, generate, real_vocab_size, token_logits
from megadlms.models import GPTModel, TransformerConfig
from megadlms.parallel import ParallelGroups, TensorParallelContext
from tests.diffusion._padding import padding_rows_win, unpadded_copy
from tests.dist_utils import run_distributed

REAL, PADDED, MASK, SEED = 19, 32, 18, 7

SETTINGS = {
    "greedy": dict(gen_length=8, steps=8, block_length=8),
    "greedy_semi_ar": dict(gen_length=12, steps=6, block_length=4),
    "temperature": dict(gen_length=8, steps=4, block_length=8, temperature=1.0),
    "random_remasking": dict(gen_length=8, steps=8, block_length=4, remasking="random"),
    "random_temperature": dict(gen_length=8, steps=4, block_length=4, remasking="random", temperature=0.7),
    "cfg": dict(gen_length=8, steps=8, block_length=8, cfg_scale=1.5),
    "cfg_temperature_semi_ar": dict(gen_length=8, steps=4, block_length=4, cfg_scale=1.0, temperature=1.0),
}
PROMPT = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
ANSWER = [8, 9, 7, 9]


def _config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=PADDED,
        unpadded_vocab_size=REAL,
        seq_length=24,
        position_embedding_type="rope",
        normalization="LayerNorm",
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return TransformerConfig(**{**base, **kw})


def _padded(tp=None) -> GPTModel:
    torch.manual_seed(SEED)  # the same logical weights at every tp
    model = GPTModel(_config(), **({} if tp is None else {"tp": tp}))
    return padding_rows_win(model, REAL).double().eval()


def _sample(model, name, **kw):
    return generate(model, PROMPT, mask_token_id=MASK, seed=11, **SETTINGS[name], **kw)


def _likelihoods(model, **kw):
    common = dict(mask_token_id=MASK, mc_samples=8, batch_size=4, seed=2, **kw)
    return [conditional_log_likelihood(model, [3, 1, 4], ANSWER, **common, cfg_scale=c) for c in (0.0, 1.5)]


@pytest.fixture(scope="module")
def models():
    padded = _padded()
    return padded, unpadded_copy(padded, REAL)


def test_padding_rows_carry_the_largest_logits(models):
    padded, plain = models
    x = torch.randint(0, REAL, (2, 10))
    with torch.no_grad():
        full, cut = padded(x), plain(x)
    assert (full.argmax(-1) >= REAL).all()  # an unguarded argmax would emit padding everywhere
    assert (full[..., REAL:].amin(-1) > full[..., :REAL].amax(-1) + 20).all()
    torch.testing.assert_close(token_logits(padded, full), cut, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampler_never_emits_padding_and_matches_the_unpadded_model(models, name):
    padded, plain = models
    out = _sample(padded, name)
    gen = out[:, PROMPT.shape[1] :]
    assert ((gen >= 0) & (gen < REAL) & (gen != MASK)).all()
    assert torch.equal(out, _sample(plain, name))  # the same tokens as the export's rows, noise included


def test_vocab_size_comes_from_the_model_or_the_caller(models):
    padded, _ = models
    assert real_vocab_size(padded) == REAL and real_vocab_size(padded, 25) == 25
    torch.manual_seed(SEED)
    unrecorded = padding_rows_win(GPTModel(_config(unpadded_vocab_size=None)), REAL).double().eval()
    assert real_vocab_size(unrecorded) is None
    # No record: every row is a token (padding wins) unless the caller names the vocabulary.
    assert (_sample(unrecorded, "greedy")[:, PROMPT.shape[1] :] >= REAL).all()
    assert torch.equal(_sample(unrecorded, "greedy", vocab_size=REAL), _sample(padded, "greedy"))
    with pytest.raises(ValueError, match="vocab_size 40 must be in 1..32"):
        _sample(padded, "greedy", vocab_size=40)
    with pytest.raises(ValueError, match="mask_token_id 20 is outside the model's vocabulary of 19"):
        generate(padded, PROMPT, mask_token_id=20, gen_length=4, steps=4, block_length=4)


def test_likelihood_is_the_same_padded_or_not(models):
    padded, plain = models
    got, want = _likelihoods(padded), _likelihoods(plain)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    # the padded softmax would count the padding rows' mass: a far lower likelihood
    assert _likelihoods(padded, vocab_size=PADDED)[0] < want[0] - 10
    with pytest.raises(ValueError, match="answer holds id 20, outside the model's 19 tokens"):
        conditional_log_likelihood(padded, [3], [20], mask_token_id=MASK, mc_samples=1)


def test_config_rejects_fewer_rows_than_tokens():
    with pytest.raises(ValueError, match="unpadded_vocab_size 33 exceeds vocab_size 32"):
        _config(unpadded_vocab_size=33)


def _tp2(rank, world):
    group = ParallelGroups.build(tp=2).tp.group
    model = _padded(TensorParallelContext(group=group))
    with torch.no_grad():
        local = model(PROMPT)
    return {
        "local_width": local.shape[-1],
        "padding_wins_here": bool((local.argmax(-1) >= REAL - 16).all()) if rank == 1 else None,
        "samples": {name: _sample(model, name) for name in SETTINGS},
        "likelihoods": _likelihoods(model),
    }


def test_tp2_vocab_parallel_logits(models):
    _, plain = models
    results = run_distributed(_tp2, world_size=2, timeout=300)
    assert [r["local_width"] for r in results] == [16, 16]
    assert results[1]["padding_wins_here"]  # rank 1's slice: its padding rows out-score its real ones
    for name in SETTINGS:
        want = _sample(plain, name)
        for r in results:  # both ranks draw the same tokens: the single process's, real ones only
            assert torch.equal(r["samples"][name], want), name
    want = _likelihoods(plain)
    for r in results:
        assert r["likelihoods"] == pytest.approx(want, rel=1e-12, abs=0)
