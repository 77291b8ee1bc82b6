"""LLaDA's format against LLaDA's own published code (tests/hf/llada_ref: Fast-dLLM's copy of
modeling_llada.py, vendored unchanged): a tiny random LLaDAModelLM saved with save_pretrained
and imported (fused or separate projections, tied or untied, GQA, q/k/v bias) gives LLaDA's
logits at tp 1 and tp 2; our ``--format llada`` export loads back into LLaDA's class with our
logits and runs Fast-dLLM's ``generate`` unchanged (token for token our sampler's); LLaDA ->
megadlms -> LLaDA is exact (every tensor and the logits bitwise)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

import pytest
import torch

from megadlms.hf.importer import init_from_hf, read_hf_config, transformer_config_from_hf
from megadlms.models import GPTModel
from tests.dist_utils import run_distributed

from .helpers import ROPE_SWIGLU, pp2_logits, save_tiny, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

REF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llada_ref")
V = 320  # LLaDA's embedding_size (its vocab_size 300: LLaDA pads the rows itself)
TINY = dict(
    d_model=32,
    n_heads=4,
    n_layers=2,
    mlp_hidden_size=64,
    rope=True,
    rope_theta=500000.0,
    layer_norm_type="rms",
    rms_norm_eps=1e-5,
    include_bias=False,
    bias_for_layer_norm=False,
    vocab_size=300,
    embedding_size=V,
    max_sequence_length=64,
    attention_dropout=0.0,
    residual_dropout=0.0,
    embedding_dropout=0.0,
    mask_token_id=126336,
    eos_token_id=126081,
    pad_token_id=126081,
)
CASES = {
    # LLaDA-8B's layout: separate projections, SiLU(ff_proj) * up_proj, untied head
    "llama_untied_gqa": dict(block_type="llama", activation_type="silu", n_kv_heads=2, weight_tying=False),
    "llama_qkv_bias_tied": dict(
        block_type="llama", activation_type="silu", include_qkv_bias=True, weight_tying=True
    ),
}


@pytest.fixture(scope="module")
def ref():
    """LLaDA's code as Fast-dLLM ships it: package ``model`` (generate.py imports it by that name)."""
    saved = {
        k: sys.modules.pop(k)
        for k in list(sys.modules)
        if k in ("model", "generate") or k.startswith("model.")
    }
    sys.path.insert(0, REF_DIR)
    try:
        importlib.import_module("einops")
    except ImportError:
        # Fast-dLLM's file imports einops at the top for its block-diffusion block only (LLaDABlockDiffBlock,
        # never built here); without the package that import is satisfied by a module that refuses any call.
        sys.modules["einops"] = types.ModuleType("einops")
        sys.modules["einops"].rearrange = _no_einops  # type: ignore[attr-defined]
        saved.setdefault("einops", None)
    try:
        model, generate = importlib.import_module("model"), importlib.import_module("generate")
        yield types.SimpleNamespace(
            Config=model.LLaDAConfig, Model=model.LLaDAModelLM, generate=generate.generate
        )
    finally:
        sys.path.remove(REF_DIR)
        for k in [k for k in sys.modules if k in ("model", "generate") or k.startswith("model.")]:
            del sys.modules[k]
        sys.modules.pop("einops", None) if saved.get("einops", 0) is None else None
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


def _no_einops(*args, **kwargs):
    raise RuntimeError("einops is not installed: LLaDA's block-diffusion block is not used by these tests")


def _use_cache_off(model):
    """LLaDAConfig(use_cache=False) hands use_cache to PretrainedConfig, which transformers 5 no
    longer keeps as an attribute; LLaDA's forward reads it: set it as LLaDA's config meant."""
    if not hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.eval()


def _llada(ref, path, case, seed=0):
    """A random LLaDAModelLM (norms too) saved with save_pretrained."""
    torch.manual_seed(seed)
    model = _use_cache_off(ref.Model(ref.Config(**TINY, **CASES[case]), init_params=True))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return model


def _ids():
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))


def _ours(path, **kw):
    cfg = transformer_config_from_hf(read_hf_config(str(path)), seq_length=32)
    model = GPTModel(type(cfg).from_dict({**cfg.to_dict(), **kw})).eval()
    init_from_hf(model, str(path))
    return model


def _fused(src, dst):
    """``src``'s LLaDA model in the fused layout (block_type sequential: att_proj = [q; k; v],
    activation swiglu on ff_proj = [up; gate]): the same function, other tensors. Fast-dLLM's
    copy of LLaDA's code runs llama blocks only, so the fused files are made here from the
    separate ones and compared with the separate model's logits."""
    from safetensors.torch import load_file, save_file

    t = load_file(os.path.join(src, "model.safetensors"))
    for i in range(TINY["n_layers"]):
        pre = f"model.transformer.blocks.{i}."
        t[pre + "att_proj.weight"] = torch.cat([t.pop(pre + f"{x}_proj.weight") for x in "qkv"])
        t[pre + "ff_proj.weight"] = torch.cat([t.pop(pre + "up_proj.weight"), t.pop(pre + "ff_proj.weight")])
    os.makedirs(dst)
    save_file(t, os.path.join(dst, "model.safetensors"), {"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    config.update(
        block_type="sequential", activation_type="swiglu", mlp_hidden_size=2 * TINY["mlp_hidden_size"]
    )
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))


@pytest.fixture(scope="module")
def saved(ref, tmp_path_factory):
    """{case: (dir, LLaDA's logits)} for every case, built once."""
    out = {}
    for case in CASES:
        path = tmp_path_factory.mktemp(case)
        with torch.no_grad():
            out[case] = (str(path), _llada(ref, path, case)(_ids()).logits)
    fused = str(tmp_path_factory.mktemp("fused") / "hf")
    _fused(out["llama_untied_gqa"][0], fused)
    out["fused_untied_gqa"] = (fused, out["llama_untied_gqa"][1])
    return out


def _load_back(ref, path):
    """LLaDA's class with an export's config.json and weights, as from_pretrained would fill it
    (LLaDA's file never calls post_init, which transformers 5's from_pretrained needs)."""
    from safetensors.torch import load_file

    model = ref.Model(ref.Config.from_pretrained(str(path)))
    model.load_state_dict(load_file(os.path.join(str(path), "model.safetensors")), strict=True)
    return _use_cache_off(model)


@pytest.mark.parametrize("case", [*CASES, "fused_untied_gqa"])
def test_import_matches_llada_logits(saved, case):
    path, ref_logits = saved[case]
    assert read_hf_config(path)["block_type"] == ("sequential" if case.startswith("fused") else "llama")
    cfg = transformer_config_from_hf(read_hf_config(path))
    assert (cfg.vocab_size, cfg.attention, cfg.qk_layernorm) == (V, "bidirectional", False)
    with torch.no_grad():
        got = _ours(path)(_ids())
    assert ref_logits.abs().max() > 0.1 and got.shape == ref_logits.shape
    torch.testing.assert_close(got, ref_logits, rtol=0, atol=1e-5)


def _tp2(rank, world, paths):
    from megadlms.parallel import ParallelGroups, TensorParallelContext, gather_full

    group = ParallelGroups.build(tp=2).tp.group
    out = {}
    for case, path in paths.items():
        cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32)
        model = GPTModel(cfg, tp=TensorParallelContext(group=group)).eval()
        init_from_hf(model, path)
        with torch.no_grad():
            out[case] = gather_full(model(_ids()), group, partition_dim=2)  # the vocab-parallel logits
    return out


def test_import_at_tp2_matches_llada_logits(saved):
    results = run_distributed(_tp2, world_size=2, args=({c: p for c, (p, _) in saved.items()},), timeout=120)
    for case, (_, ref_logits) in saved.items():
        for rank in range(2):
            torch.testing.assert_close(results[rank][case], ref_logits, rtol=0, atol=1e-5)


def test_import_at_pp2_matches_llada_logits(saved):
    for path, ref_logits in saved.values():  # untied and tied, separate and fused projections
        torch.testing.assert_close(pp2_logits(path, _ids()), ref_logits, rtol=0, atol=1e-5)


def test_round_trip_llada_megadlms_llada_is_exact(ref, saved, tmp_path):
    from megadlms.hf.export import export_hf
    from megadlms.hf.import_cli import import_hf

    path, ref_logits = saved["llama_untied_gqa"]
    _byte_tokenizer(path)
    import_hf(path, str(tmp_path / "ck"), mask_token="256", seq_length=32)  # the tiny vocab has no id 126336
    export_hf(
        str(tmp_path / "ck"), str(tmp_path / "back"), fmt="llada", llada_code=os.path.join(REF_DIR, "model")
    )
    back = _load_back(ref, tmp_path / "back")
    from safetensors.torch import load_file

    theirs, again = (
        load_file(os.path.join(path, "model.safetensors")),
        load_file(str(tmp_path / "back" / "model.safetensors")),
    )
    assert sorted(theirs) == sorted(again)
    for k, t in theirs.items():
        assert torch.equal(t, again[k]), k
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, ref_logits)
    config = json.load(open(tmp_path / "back" / "config.json"))
    assert config["auto_map"]["AutoModel"] == "modeling_llada.LLaDAModelLM"
    assert {"modeling_llada.py", "configuration_llada.py"} <= set(os.listdir(tmp_path / "back"))


def _byte_tokenizer(path):
    from tests.hf.test_import import _byte_tokenizer_without_mask

    _byte_tokenizer_without_mask(path)


def test_our_export_loads_in_llada_and_runs_fast_dllm_generate(ref, tmp_path):
    from megadlms.checkpoint import RunRecords, save_checkpoint
    from megadlms.data import TokenizerConfig
    from megadlms.diffusion import generate
    from megadlms.hf.export import main

    cfg = tiny_config(**{**ROPE_SWIGLU, "qk_layernorm": False})
    ours = save_tiny(tmp_path / "ck0", cfg)
    with torch.no_grad():  # as a trained model: [MASK] (logit 0 here) never the best guess, which LLaDA's
        ours.embedding.word_embeddings.weight[257] = 0.0  # generate would commit (ours never draws it)
    records = RunRecords(model_config=cfg.to_dict(), tokenizer=TokenizerConfig().to_dict())
    save_checkpoint(str(tmp_path / "ck"), 3, model=ours, ckpt_format="torch_dist", records=records)
    assert main(["--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf"), "--format", "llada"]) == 0
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["auto_map"]["AutoModel"] == "GSAI-ML/LLaDA-8B-Base--modeling_llada.LLaDAModelLM"
    assert (config["model_type"], config["block_type"], config["mask_token_id"]) == ("llada", "llama", 257)
    theirs = _load_back(ref, tmp_path / "hf")
    ids = torch.randint(0, 259, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[..., :259], rtol=0, atol=1e-5)
        prompt = ids[:1, :8]
        kw = dict(steps=8, gen_length=16, block_length=8)
        out, nfe = ref.generate(theirs, prompt, mask_id=257, **kw)
        mine = generate(ours, prompt, mask_token_id=257, **kw)
    assert torch.equal(out, mine) and not (out == 257).any() and nfe == 8


def test_refusals_are_named(ref, tmp_path):
    from megadlms.hf.export import export_hf

    for field, value, message in (
        ("alibi", True, "alibi"),
        ("attention_layer_norm", True, "attention_layer_norm"),
        ("layer_norm_type", "default", "layer_norm_type"),
        ("scale_logits", True, "scale_logits"),
        ("activation_type", "gelu", "activation_type"),
    ):
        hf = {**TINY, **CASES["llama_untied_gqa"], "model_type": "llada", field: value}
        with pytest.raises(ValueError, match=message):
            transformer_config_from_hf(hf)
    save_tiny(tmp_path / "ck", tiny_config(**ROPE_SWIGLU))  # per-head q/k norms: not LLaDA's
    with pytest.raises(ValueError, match="qk_layernorm"):
        export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"), fmt="llada")
    assert not os.path.exists(tmp_path / "hf")


def _continue_world(rank, world, hf_dir, root):
    """--hf-init of a LLaDA model at tp 2 x dp 2: 2 steps and a save, the resumed run's steps 3-4,
    and 4 steps in one go (same flags; a --load checkpoint wins over --hf-init)."""
    from megadlms.hf.importer import model_flags
    from megadlms.pretrain import run
    from tests.hf.test_import import _train_flags

    cfg = transformer_config_from_hf(read_hf_config(hf_dir), seq_length=32)
    flags = " ".join(model_flags(cfg)).split() + ["--seq-length", "32", "--hf-init", hf_dir]
    layout = ["--tensor-model-parallel-size", "2", "--global-batch-size", "4", "--micro-batch-size", "1"]

    def train(save, *extra):
        # the later --global/--micro-batch-size replace _train_flags' (argparse keeps the last)
        ckpt = ["--save", save, "--load", save, "--save-interval", "2"]
        return run(_train_flags(flags, None, iters=4) + layout + ckpt + list(extra)).losses

    first = train(os.path.join(root, "a"), "--exit-interval", "2")  # stops (and saves) after step 2
    resumed = train(os.path.join(root, "a"))
    straight = train(os.path.join(root, "b"))
    return first, resumed, straight


def test_llada_import_trains_at_tp2_dp2_and_resumes(saved, tmp_path):
    path, _ = saved["llama_untied_gqa"]
    for first, resumed, straight in run_distributed(
        _continue_world, world_size=4, args=(path, str(tmp_path)), timeout=300
    ):
        assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
        assert [first[1], first[2], resumed[3], resumed[4]] == [straight[i] for i in (1, 2, 3, 4)]
        assert all(torch.isfinite(torch.tensor(list(straight.values()))))
