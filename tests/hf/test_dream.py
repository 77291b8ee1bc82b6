"""Dream's format against Dream's own published code (tests/hf/dream_ref: Fast-dLLM's copy of
modeling_dream.py and generation_utils.py, vendored unchanged): a tiny random DreamModel saved
with save_pretrained and imported gives Dream's logits at tp 1 and tp 2; Dream -> megadlms ->
Dream (``--format dream``) is exact; the difflm-shift sampler on the import chooses Dream's
``diffusion_generate`` tokens (see test_sampler_on_the_import_follows_dreams_generate for
where the two schedules differ)."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from megadlms.common.enums import RunningMode
from megadlms.diffusion import generate, position_logits
from megadlms.hf.importer import init_from_hf, read_hf_config, transformer_config_from_hf
from megadlms.models import GPTModel
from tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

REF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dream_ref")
V, MASK, SHIFT = 300, 299, RunningMode.DIFFLM_SHIFT
TINY = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    mask_token_id=MASK,
    pad_token_id=298,
    eos_token_id=297,
    bos_token_id=296,
)


def _default_rope(config, device=None, **kwargs):
    """transformers 5 dropped ROPE_INIT_FUNCTIONS["default"], which Dream's file (written for
    4.x) looks up: plain RoPE's inverse frequencies, as 4.x computed them, and scaling 1."""
    dim = config.hidden_size // config.num_attention_heads
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta**exponent), 1.0


@pytest.fixture(scope="module")
def ref():
    """Dream's code as package ``dream_model``, with two transformers-5 shims that change no
    number: the "default" RoPE initialiser and GenerationConfig.validate's new keyword."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    added = "default" not in ROPE_INIT_FUNCTIONS
    if added:
        ROPE_INIT_FUNCTIONS["default"] = _default_rope
    sys.path.insert(0, REF_DIR)
    try:
        pkg = importlib.import_module("dream_model")
        gen = importlib.import_module("dream_model.generation_utils")
        gen.DreamGenerationConfig.validate = lambda self, *a, **k: None  # Dream's own validate is a no-op
        yield pkg, gen
    finally:
        sys.path.remove(REF_DIR)
        for k in [k for k in sys.modules if k == "dream_model" or k.startswith("dream_model.")]:
            del sys.modules[k]
        if added:
            del ROPE_INIT_FUNCTIONS["default"]


def _dream(pkg, path, seed=0):
    """A random DreamModel (norms and biases too) saved with save_pretrained."""
    torch.manual_seed(seed)
    model = pkg.DreamModel(pkg.DreamConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    # Dream's class lists its tied keys (4.x); transformers 5 wants a mapping: this model is untied.
    model._tied_weights_keys = {}
    model.save_pretrained(str(path))
    return model


def _ids():
    return torch.randint(0, 296, (2, 24), generator=torch.Generator().manual_seed(2))


def _ours(path):
    cfg = transformer_config_from_hf(read_hf_config(str(path)), seq_length=32)
    model = GPTModel(cfg).eval()
    init_from_hf(model, str(path), running_mode=SHIFT)
    return model


@pytest.fixture(scope="module")
def saved(ref, tmp_path_factory):
    """(dir, Dream's model, its logits on _ids())."""
    path = tmp_path_factory.mktemp("dream")
    model = _dream(ref[0], path)
    with torch.no_grad():
        return str(path), model, model(_ids()).logits


def test_import_matches_dream_logits(saved):
    path, _, ref_logits = saved
    assert read_hf_config(path)["model_type"] == "Dream"
    cfg = transformer_config_from_hf(read_hf_config(path))
    assert (cfg.attention, cfg.add_qkv_bias, cfg.add_bias_linear) == ("bidirectional", True, False)
    with torch.no_grad():
        got = _ours(path)(_ids())
    assert ref_logits.abs().max() > 0.1 and got.shape == ref_logits.shape
    torch.testing.assert_close(got, ref_logits, rtol=0, atol=1e-5)


def _tp2(rank, world, path):
    from megadlms.parallel import ParallelGroups, TensorParallelContext, gather_full

    group = ParallelGroups.build(tp=2).tp.group
    cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32)
    model = GPTModel(cfg, tp=TensorParallelContext(group=group)).eval()
    init_from_hf(model, path, running_mode=SHIFT)
    with torch.no_grad():
        return gather_full(model(_ids()), group, partition_dim=2)  # the vocab-parallel logits


def test_import_at_tp2_matches_dream_logits(saved):
    path, _, ref_logits = saved
    for got in run_distributed(_tp2, world_size=2, args=(path,), timeout=120):
        torch.testing.assert_close(got, ref_logits, rtol=0, atol=1e-5)


def test_import_at_pp2_matches_dream_logits(saved):
    from .helpers import pp2_logits

    path, _, ref_logits = saved
    torch.testing.assert_close(pp2_logits(path, _ids()), ref_logits, rtol=0, atol=1e-5)


def test_round_trip_dream_megadlms_dream_is_exact(ref, saved, tmp_path):
    from safetensors.torch import load_file

    from megadlms.hf.export import export_hf
    from megadlms.hf.import_cli import import_hf
    from tests.hf.test_import import _byte_tokenizer_without_mask

    path, _, ref_logits = saved
    _byte_tokenizer_without_mask(path)
    out = import_hf(path, str(tmp_path / "ck"), mask_token="256", seq_length=32)  # no id 151666 here
    assert "--model-running-mode difflm-shift" in out["flags"]  # Dream's own mode, recorded too
    export_hf(
        str(tmp_path / "ck"),
        str(tmp_path / "back"),
        fmt="dream",
        llada_code=os.path.join(REF_DIR, "dream_model"),
    )
    theirs, again = (load_file(os.path.join(p, "model.safetensors")) for p in (path, str(tmp_path / "back")))
    assert sorted(theirs) == sorted(again)
    for k, t in theirs.items():
        assert torch.equal(t, again[k]), k
    config = json.load(open(tmp_path / "back" / "config.json"))
    assert (config["model_type"], config["auto_map"]["AutoModel"]) == ("Dream", "modeling_dream.DreamModel")
    assert {"modeling_dream.py", "configuration_dream.py", "generation_utils.py"} <= set(
        os.listdir(tmp_path / "back")
    )
    pkg = ref[0]
    back = pkg.DreamModel(pkg.DreamConfig.from_pretrained(str(tmp_path / "back"))).eval()
    back.load_state_dict(again, strict=True)
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, ref_logits)


def _dream_generate(ref, model, prompt, steps, gen_length, mask=MASK):
    config = ref[1].DreamGenerationConfig(
        **{k: TINY[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")},
        mask_token_id=mask,
        max_new_tokens=gen_length,
        steps=steps,
        temperature=0.0,
        alg="maskgit_plus",
        output_history=True,
        return_dict_in_generate=True,
    )
    return model.diffusion_generate(prompt, generation_config=config)


def test_sampler_on_the_import_follows_dreams_generate(ref, saved):
    """Dream's diffusion_generate (maskgit_plus, temperature 0: deterministic) and ours choose
    tokens by the same rule (the logits shifted right, the most confident masked positions,
    their argmax), so: (1) in one step, where the schedules agree, the outputs are token-exact;
    (2) over several steps Dream commits int(n (1 - s/t)) tokens per step on its eps-floored
    time grid, ours n/steps evenly (LLaDA's schedule), so each of Dream's steps is checked
    against our rule on Dream's own intermediate sequence, with Dream's count."""
    path, dream, _ = saved
    ours, prompt = _ours(path), _ids()[:1, :8]
    with torch.no_grad():
        theirs = _dream_generate(ref, dream, prompt, steps=1, gen_length=16).sequences
        mine = generate(
            ours, prompt, mask_token_id=MASK, gen_length=16, steps=1, block_length=16, running_mode=SHIFT
        )
        assert torch.equal(mine, theirs) and not (theirs == MASK).any()
        history = _dream_generate(ref, dream, prompt, steps=8, gen_length=16).history
        x = torch.cat([prompt, torch.full((1, 16), MASK)], dim=1)
        for after in history:
            masked = x == MASK
            logits = position_logits(ours(x), SHIFT)
            conf, x0 = torch.softmax(logits, -1).max(-1)
            committed = masked & (after != MASK)
            k = int(committed.sum())
            top = torch.topk(torch.where(masked, conf, torch.full_like(conf, -1.0)), k).indices[0]
            assert set(top.tolist()) == set(committed[0].nonzero()[:, 0].tolist())
            assert torch.equal(after[committed], x0[committed])
            x = after
    assert not (x == MASK).any()


def test_dream_mode_refusals_are_named(saved, tmp_path):
    from megadlms.hf.export import export_hf
    from tests.hf.helpers import ROPE_SWIGLU, save_tiny, tiny_config

    path = saved[0]
    model = GPTModel(transformer_config_from_hf(read_hf_config(path), seq_length=32))
    with pytest.raises(ValueError, match="add --model-running-mode difflm-shift"):
        init_from_hf(model, path, running_mode=RunningMode.DIFFLM_NOSHIFT)
    save_tiny(
        tmp_path / "ck", tiny_config(**{**ROPE_SWIGLU, "qk_layernorm": False})
    )  # a difflm-noshift record
    with pytest.raises(
        ValueError, match="--format dream needs a model trained with --model-running-mode difflm-shift"
    ):
        export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"), fmt="dream")
    hf = {**read_hf_config(path), "use_sliding_window": True}
    with pytest.raises(ValueError, match="use_sliding_window"):
        transformer_config_from_hf(hf)


def test_our_shifted_model_exports_to_dream(ref, tmp_path):
    """A difflm-shift model of ours (tied head, no q/k/v biases) in Dream's format: Dream's
    class gives our logits (zero biases and the copied head are exact)."""
    from megadlms.checkpoint import RunRecords, save_checkpoint
    from megadlms.data import TokenizerConfig
    from megadlms.hf.export import export_hf
    from tests.hf.helpers import ROPE_SWIGLU, tiny_config

    cfg = tiny_config(**{**ROPE_SWIGLU, "qk_layernorm": False})
    assert not cfg.untie_embeddings_and_output_weights and not cfg.add_qkv_bias
    torch.manual_seed(0)
    ours = GPTModel(cfg).eval()
    with torch.no_grad():  # confident logits, and [MASK] (logit 0) never the best guess, as in a trained
        ours.embedding.word_embeddings.weight.mul_(
            20.0
        )  # model: Dream's generate would commit it, ours never
        ours.embedding.word_embeddings.weight[257] = 0.0
    records = RunRecords(
        args={"diffusion": {"model_running_mode": "difflm-shift"}},
        model_config=cfg.to_dict(),
        tokenizer=TokenizerConfig().to_dict(),
    )
    save_checkpoint(str(tmp_path / "ck"), 3, model=ours, ckpt_format="torch_dist", records=records)
    config = export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"), fmt="dream")
    assert config["auto_map"]["AutoModel"] == "Dream-org/Dream-v0-Base-7B--modeling_dream.DreamModel"
    from safetensors.torch import load_file

    pkg = ref[0]
    theirs = pkg.DreamModel(pkg.DreamConfig.from_pretrained(str(tmp_path / "hf"))).eval()
    theirs.load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), strict=True)
    ids = torch.randint(0, 259, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[..., :259], rtol=0, atol=1e-5)
        # Dream's published diffusion_generate runs on the export unchanged, with our sampler's tokens
        out = _dream_generate(ref, theirs, ids[:1, :8], steps=1, gen_length=8, mask=257).sequences
        mine = generate(
            ours, ids[:1, :8], mask_token_id=257, gen_length=8, steps=1, block_length=8, running_mode=SHIFT
        )
    assert torch.equal(out, mine) and not (out == 257).any()


def _train_world(rank, world, hf_dir):
    """--hf-init of the Dream model in difflm-shift, 2 steps at tp 2 and at dp 2 (no dropout; the
    vocabulary padded to Dream's 300 rows at both sizes, so both models are the same)."""
    from megadlms.hf.importer import model_flags
    from megadlms.pretrain import run
    from tests.hf.test_import import _train_flags

    cfg = transformer_config_from_hf(read_hf_config(hf_dir), seq_length=32)
    flags = " ".join(model_flags(cfg)).split() + ["--seq-length", "32", "--hf-init", hf_dir]
    flags += ["--model-running-mode", "difflm-shift", "--difflm-objective", "llada", "--add-qkv-bias"]
    common = [
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--make-vocab-size-divisible-by",
        "150",
    ]
    losses = {}
    for name, layout in (("tp2", ["--tensor-model-parallel-size", "2"]), ("dp2", [])):
        losses[name] = run(_train_flags(flags, None, iters=2) + common + layout).losses
    return losses


def test_dream_import_trains_shifted_at_tp2_as_at_dp2(saved):
    for losses in run_distributed(_train_world, world_size=2, args=(saved[0],), timeout=300):
        tp2, dp2 = losses["tp2"], losses["dp2"]
        assert sorted(tp2) == [1, 2] and all(torch.isfinite(torch.tensor(list(tp2.values()))))
        for step in tp2:
            assert tp2[step] == pytest.approx(dp2[step], rel=1e-4), step


def test_exports_refuse_a_format_that_misreads_the_mode(tmp_path):
    # A shifted model exported where the code reads token i from position i, or a block-diffusion
    # model where the code attends over the whole sequence, would generate wrong text silently.
    from megadlms.checkpoint import RunRecords, save_checkpoint
    from megadlms.data import TokenizerConfig
    from megadlms.hf.export import export_hf
    from tests.hf.helpers import ROPE_SWIGLU, tiny_config

    def saved(name, mode, **extra):
        cfg = tiny_config(**{**ROPE_SWIGLU, "qk_layernorm": False, **extra})
        torch.manual_seed(0)
        records = RunRecords(
            args={"diffusion": {"model_running_mode": mode}},
            model_config=cfg.to_dict(),
            tokenizer=TokenizerConfig().to_dict(),
        )
        save_checkpoint(
            str(tmp_path / name), 1, model=GPTModel(cfg), ckpt_format="torch_dist", records=records
        )
        return str(tmp_path / name)

    shifted = saved("shift", "difflm-shift")
    for fmt in ("megadlms", "llada"):
        with pytest.raises(ValueError, match="is a difflm-shift model .* export it with --format dream"):
            export_hf(shifted, str(tmp_path / f"hf-{fmt}"), fmt=fmt)
    block = saved("block", "difflm-noshift", difflm_block_size=8)
    for fmt in ("llada", "dream"):
        with pytest.raises(ValueError, match="is a block-diffusion model"):
            export_hf(block, str(tmp_path / f"hfb-{fmt}"), fmt=fmt)
    shifted_block = saved("shift-block", "difflm-shift", difflm_block_size=8)
    with pytest.raises(ValueError, match="is a block-diffusion model"):
        export_hf(shifted_block, str(tmp_path / "hfsb"), fmt="dream")
