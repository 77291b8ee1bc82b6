"""Block diffusion (BD3-LM): the mask against bd3lms' own, the objective, and the defining
property (the training pass's x_t logits are the cached generation step's)."""

import dataclasses
import pathlib

import pytest
import torch

from megadlms.diffusion import DiffusionConfig, compute_loss, loss_token_count, training_inputs
from megadlms.diffusion.noise import micro_batch_crop
from megadlms.models import GPTModel, TransformerConfig
from megadlms.ops.block_mask import BlockDiffusion, block_diffusion_mask, block_diffusion_predicate
from megadlms.ops.kv_cache import KVCache

V, MASK = 23, 22
_VENDORED = pathlib.Path(__file__).with_name("bd3lms_block_diff_mask.py.txt")


def _bd3lms_block_diff_mask():
    """bd3lms' block_diff_mask, exec'd from its vendored source (models/dit.py)."""
    namespace = {"torch": torch}
    exec(compile(_VENDORED.read_text(), str(_VENDORED), "exec"), namespace)
    return namespace["block_diff_mask"]


@pytest.mark.parametrize("S,B", [(8, 1), (8, 2), (12, 4), (16, 16), (32, 8), (24, 3)])
def test_block_mask_equals_bd3lms(S, B):
    reference = _bd3lms_block_diff_mask()
    idx = torch.arange(2 * S)
    expected = reference(None, None, idx[:, None], idx[None, :], block_size=B, n=S)
    assert torch.equal(block_diffusion_mask(S, BlockDiffusion(B), torch.device("cpu")), expected)
    # the FlexAttention mask_mod is the same predicate, evaluated pointwise
    q, kv = torch.tensor(5), torch.tensor(2 * S - 1)
    assert bool(block_diffusion_predicate(q, kv, S, B)) == bool(expected[5, 2 * S - 1])


def test_block_mask_padding_sees_itself_only():
    mask = block_diffusion_mask(4, BlockDiffusion(2), torch.device("cpu"), total=10)
    assert torch.equal(mask[:8, :8], block_diffusion_mask(4, BlockDiffusion(2), torch.device("cpu")))
    assert not mask[:8, 8:].any() and torch.equal(mask[8:, 8:], torch.eye(2, dtype=torch.bool))


def _model(dtype=torch.float32, S=16):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=V, seq_length=S,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return GPTModel(cfg, attention="bidirectional").to(dtype)


def _batch(b=2, S=16):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, MASK, (b, S + 1), generator=g)
    pos = torch.arange(S).expand(b, S)
    return {
        "tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(b, S),
        "position_ids": pos, "sample_idx": torch.arange(b) + 7,
    }  # fmt: skip


@pytest.mark.parametrize("objective", ["megadlms", "llada"])
def test_block_size_equal_seq_length_is_todays_objective(objective):
    batch, model = _batch(), _model()
    base = DiffusionConfig(mask_token_id=MASK, objective=objective)
    block = dataclasses.replace(base, block_size=16)
    a, b = compute_loss(model, batch, base, 3, crop=None), compute_loss(model, batch, block, 3, crop=None)
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.num_tokens, b.num_tokens)
    # every crop of the full-sequence objective is kept (shorter than one block)
    for it in range(300):
        assert micro_batch_crop(base, it, 0, 1, 16) == micro_batch_crop(block, it, 0, 1, 16)


def test_block_objective_two_streams_and_crop():
    batch = _batch()
    cfg = DiffusionConfig(mask_token_id=MASK, objective="llada", block_size=4, p_mask="realised")
    inputs = training_inputs(batch, cfg, None)
    assert inputs.tokens.shape == (2, 32) and inputs.block == BlockDiffusion(4)
    assert torch.equal(inputs.tokens[:, 16:], batch["labels"])
    assert torch.equal(inputs.position_ids[:, :16], inputs.position_ids[:, 16:])
    masked = inputs.targets["masked"].view(2, 4, 4)
    assert masked.any(dim=2).all()  # realised: at least one mask per block
    assert torch.equal(loss_token_count(batch, None, cfg), torch.tensor(32.0))
    loss = compute_loss(_model(), batch, cfg, 0, crop=None)
    assert loss.stats["seq_length"] == 32 and torch.isfinite(loss.loss_sum)
    crops = {micro_batch_crop(dataclasses.replace(cfg, varilen_prob=1.0), it, 0, 1, 16) for it in range(50)}
    assert all(c < 4 or c % 4 == 0 for c in crops) and len(crops) > 2


def test_noise_clip_bounds_block_times():
    cfg = DiffusionConfig(mask_token_id=MASK, block_size=2, noise_clip_low=0.3, noise_clip_high=0.8)
    from megadlms.diffusion.block import block_times

    t = block_times(cfg, torch.arange(50), 0, 8)
    assert t.shape == (50, 8) and bool(((t >= 0.3) & (t < 0.8)).all())


def test_training_logits_equal_cached_generation_step():
    """The defining property (float64): x_t block b's training logits are those of the cached
    forward that committed the clean blocks < b and sees the noised block b."""
    S, B = 16, 4
    model, batch = _model(torch.float64), _batch()
    cfg = DiffusionConfig(mask_token_id=MASK, objective="llada", block_size=B)
    inputs = training_inputs(batch, cfg, None)
    model.eval()
    with torch.no_grad():
        train = inputs.forward(model)[:, :S]
        noisy, clean = inputs.tokens[:, :S], inputs.tokens[:, S:]
        cache = KVCache()
        for blk in range(S // B):
            lo, hi = blk * B, (blk + 1) * B
            step = model(noisy[:, lo:hi], kv_cache=cache, cache_offset=lo)
            torch.testing.assert_close(step, train[:, lo:hi], rtol=0, atol=1e-10)
            cache.truncate(lo)
            model(clean[:, lo:hi], kv_cache=cache, cache_offset=lo)  # commit the clean block


def _block_model(B=4, S=24):
    model = _model(torch.float64, S=S)
    model.config.difflm_block_size = B  # as a checkpoint of a --difflm-block-size run records it
    return model


@pytest.mark.parametrize("P", [0, 4, 5])
def test_cached_block_generation_is_token_exact(P):
    from megadlms.diffusion import generate

    model = _block_model()
    prompt = torch.randint(0, MASK, (2, P), generator=torch.Generator().manual_seed(3))
    kw = dict(mask_token_id=MASK, gen_length=12, steps=12)
    stats_c, stats_r = {}, {}
    cached = generate(model, prompt, cache="prefix", stats=stats_c, **kw)
    full = generate(model, prompt, cache=None, stats=stats_r, **kw)
    assert cached.shape == (2, P + 12) and torch.equal(cached, full)
    assert not (cached == MASK).any() and torch.equal(cached[:, :P], prompt)
    assert stats_c["block_nfe"] == [4, 4, 4]
    fast = generate(model, prompt, cache="prefix", threshold=0.5, **kw)
    assert torch.equal(fast, generate(model, prompt, cache=None, threshold=0.5, **kw))


def test_block_generation_stops_at_eos_block():
    from megadlms.diffusion import generate

    model = _block_model()
    prompt = torch.randint(0, MASK, (1, 4), generator=torch.Generator().manual_seed(3))
    full = generate(model, prompt, mask_token_id=MASK, gen_length=12, steps=12, cache="prefix")
    eos = int(full[0, 5])  # a token of the first generated block
    short = generate(model, prompt, mask_token_id=MASK, gen_length=12, steps=12, eos_token_id=eos)
    assert torch.equal(short, full[:, :8])
    with pytest.raises(ValueError, match="block size"):
        generate(model, prompt, mask_token_id=MASK, gen_length=12, steps=12, block_length=6)


@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (
            ["--difflm-block-size", "5"],
            1,
            "--difflm-block-size 5 must be positive and divide --seq-length 32",
        ),
        (["--difflm-block-size", "8", "--context-parallel-size", "2"], 2, "not sliced over cp ranks"),
        (
            ["--difflm-block-size", "8", "--model-running-mode", "vanilla"],
            1,
            "needs masked-diffusion pretraining",
        ),
        (["--difflm-noise-clip-low", "0.3"], 1, "--difflm-noise-clip-low needs --difflm-block-size"),
        (["--difflm-block-size", "8", "--reset-attention-mask"], 1, "document packing"),
    ],
)
def test_block_size_rules_name_the_flag(extra, world, needle):
    from megadlms.config import parse_args, parse_config

    base = "--mock-data --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32".split()
    base += "--micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-3".split()
    with pytest.raises(ValueError, match=needle):
        parse_args(base + extra, world_size=world)
    cfg = parse_config(base + ["--difflm-block-size", "8", "--difflm-noise-clip-low", "0.3"], world_size=1)
    assert cfg.diffusion.block_size == 8 and cfg.model.difflm_block_size == 8
    assert cfg.diffusion.noise_clip_low == 0.3 and cfg.diffusion.noise_clip_high == 1.0


def test_flex_block_mask_gives_the_sdpa_logits():
    """The FlexAttention BlockMask (same predicate) on CPU, eager and forward only."""
    sdpa = _model()
    flex = GPTModel(sdpa.config, attention="bidirectional", core_attn_implementation="FlexAttention")
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, MASK, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = sdpa.eval()(x, block_diffusion=4)
        torch.testing.assert_close(flex.eval()(x, block_diffusion=4), expected, rtol=1e-5, atol=1e-5)


def test_shifted_block_logits_equal_cached_steps():
    """difflm-shift (AR adaptation) with blocks, float64: each token is predicted where cached
    generation has its predictor: inside the noised block by the position before it, a block's
    first token by the last position of the committed clean block before it (x_0)."""
    from megadlms.diffusion.block import logit_index

    S, B = 16, 4
    model, batch = _model(torch.float64, S=S), _batch()
    cfg = DiffusionConfig(
        mask_token_id=MASK, objective="llada", block_size=B, model_running_mode="difflm-shift"
    )
    inputs = training_inputs(batch, cfg, None)
    n = inputs.tokens.shape[1] // 2
    assert n == S and torch.equal(inputs.tokens[:, n:], batch["tokens"])  # x_0 = text[0:S]
    model.eval()
    with torch.no_grad():
        train = inputs.forward(model).index_select(1, logit_index(n, B, torch.device("cpu")))
        noisy, clean, cache = inputs.tokens[:, :n], inputs.tokens[:, n:], KVCache()
        for lo in range(0, n, B):
            step = model(noisy[:, lo : lo + B], kv_cache=cache, cache_offset=lo)
            torch.testing.assert_close(step[:, :-1], train[:, lo : lo + B - 1], rtol=0, atol=1e-10)
            cache.truncate(lo)
            commit = model(clean[:, lo : lo + B], kv_cache=cache, cache_offset=lo)
            torch.testing.assert_close(commit[:, -1], train[:, lo + B - 1], rtol=0, atol=1e-10)


def test_ar_loss_weight_adds_a_leak_free_ar_loss():
    model, batch = _model(), _batch()
    kw = dict(mask_token_id=MASK, objective="llada", block_size=4, model_running_mode="difflm-shift")
    losses = {
        w: compute_loss(model, batch, DiffusionConfig(**kw, ar_loss_weight=w), 0, crop=None)
        for w in (0.5, 1, 2)
    }
    ar = losses[2].loss_sum - losses[1].loss_sum  # the AR sum: the loss is diffusion + w * AR
    assert float(ar.detach()) > 0
    torch.testing.assert_close(losses[1].loss_sum - losses[0.5].loss_sum, ar / 2, rtol=1e-4, atol=1e-4)
    # x_0 is token-causal: its logits at i never see token i + 1, the one they predict
    inputs = training_inputs(batch, DiffusionConfig(**kw, ar_loss_weight=1.0), None)
    changed = inputs.tokens.clone()
    changed[:, 16 + 9] = (changed[:, 16 + 9] + 1) % MASK
    with torch.no_grad():
        a, b = inputs.forward(model.eval()), model(changed, inputs.position_ids, block_diffusion=inputs.block)
    torch.testing.assert_close(a[:, 16 : 16 + 9], b[:, 16 : 16 + 9], rtol=0, atol=0)
    with pytest.raises(ValueError, match="difflm-shift"):
        DiffusionConfig(mask_token_id=MASK, block_size=4, ar_loss_weight=1.0)


@pytest.mark.parametrize("P", [3, 8])
def test_shifted_block_generation_cache_is_token_exact(P):
    from megadlms.diffusion import generate

    model = _block_model()
    prompt = torch.randint(0, MASK, (2, P), generator=torch.Generator().manual_seed(4))
    kw = dict(mask_token_id=MASK, gen_length=12, steps=12, running_mode="difflm-shift")
    cached = generate(model, prompt, cache="prefix", **kw)
    assert torch.equal(cached, generate(model, prompt, cache=None, **kw))
    assert not (cached == MASK).any()
    assert not torch.equal(
        cached, generate(model, prompt, cache="prefix", mask_token_id=MASK, gen_length=12, steps=12)
    )


def test_run_record_without_block_diffusion_is_unchanged():
    from megadlms.config import parse_config

    base = "--mock-data --num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 32".split()
    base += "--micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-3".split()
    plain = parse_config(base, world_size=1).to_dict()
    assert not {"block_size", "noise_clip_low", "noise_clip_high", "ar_loss_weight"} & set(plain["diffusion"])
    assert "difflm_block_size" not in plain["model"]
    block = parse_config(base + ["--difflm-block-size", "8"], world_size=1).to_dict()
    assert block["diffusion"]["block_size"] == 8 and block["model"]["difflm_block_size"] == 8


def test_answer_likelihood_of_a_block_model_is_refused_by_name():
    # Scoring would run full-sequence attention, which a block-diffusion model never saw.
    import dataclasses

    from megadlms.diffusion.likelihood import conditional_log_likelihood
    from megadlms.models import GPTModel, TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=16)
    model = GPTModel(dataclasses.replace(cfg, difflm_block_size=4))
    with pytest.raises(ValueError, match="block-diffusion model .* not implemented"):
        conditional_log_likelihood(model, [1, 2, 3], [4, 5, 6], mask_token_id=31)
