"""LLaDA-MoE's format against its own published code (tests/hf/lladamoe_ref, dllm's copy,
vendored unchanged): a tiny random LLaDAMoEModelLM (a dense layer, then a sparse one with 4
experts, top-2 and a shared expert; per-head q/k norms) saved with save_pretrained and imported
onto megadlms' MoE layers gives its logits at ep 1 and ep 2; LLaDA-MoE -> megadlms ->
``--format lladamoe`` loads back into LLaDA-MoE's class with every tensor and the logits bitwise;
unmappable fields (import) and inexpressible models (export) are refused by name."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from megadlms.hf.importer import init_from_hf, model_flags, read_hf_config, transformer_config_from_hf
from megadlms.models import GPTModel
from tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

REF_DIR = __file__.rsplit("/", 1)[0] + "/lladamoe_ref"
TINY = dict(
    vocab_size=300,
    hidden_size=32,
    dense_intermediate_size=64,
    expert_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    partial_rotary_factor=1,
    num_experts_per_tok=2,
    num_experts=4,
    norm_topk_prob=False,
    qk_layernorm=True,
    moe_layer_freq=[0, 1],
    moe_router_enable_expert_bias=False,
    moe_router_score_function="softmax",
    pad_token_id=298,
    eos_token_id=297,
    max_position_embeddings=64,
)


def _default_rope(config, device=None, **kwargs):
    """transformers 5 dropped ROPE_INIT_FUNCTIONS["default"], which LLaDA-MoE's file (written for
    4.x) looks up: plain RoPE's inverse frequencies, as 4.x computed them."""
    dim = config.hidden_size // config.num_attention_heads
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta**exponent), 1.0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(dir, LLaDA-MoE's logits on _ids()) of a random model saved with save_pretrained."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    added = "default" not in ROPE_INIT_FUNCTIONS
    if added:
        ROPE_INIT_FUNCTIONS["default"] = _default_rope
    sys.path.insert(0, REF_DIR)
    try:
        config = importlib.import_module("lladamoe_model.configuration_lladamoe")
        modeling = importlib.import_module("lladamoe_model.modeling_lladamoe")
        torch.manual_seed(0)
        model = modeling.LLaDAMoEModelLM(config.LLaDAMoEConfig(**TINY)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
            logits = model(_ids()).logits
        model._tied_weights_keys = {}  # 4.x's list; transformers 5 wants a mapping (this model is untied)
        path = tmp_path_factory.mktemp("lladamoe")
        model.save_pretrained(str(path))
        yield str(path), logits
    finally:
        sys.path.remove(REF_DIR)
        for k in [k for k in sys.modules if k == "lladamoe_model" or k.startswith("lladamoe_model.")]:
            del sys.modules[k]
        if added:
            del ROPE_INIT_FUNCTIONS["default"]


def _ids():
    return torch.randint(0, 296, (2, 24), generator=torch.Generator().manual_seed(2))


def test_lladamoe_import_matches_its_logits(saved):
    path, ref_logits = saved
    cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_layer_freq) == (4, 2, [0, 1])
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_router_pre_softmax, cfg.qk_layernorm) == (
        24,
        True,
        True,
    )
    assert "--moe-layer-freq [0,1]" in model_flags(cfg) and "--moe-router-pre-softmax" in model_flags(cfg)
    model = GPTModel(cfg).eval()
    init_from_hf(model, path)
    with torch.no_grad():
        got = model(_ids())
    assert ref_logits.abs().max() > 0.1
    torch.testing.assert_close(got, ref_logits, rtol=0, atol=1e-5)


def _ep2(rank, world, path):
    from megadlms.parallel import ParallelGroups, TensorParallelContext

    groups = ParallelGroups.build(ep=2, dp=2)
    cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32)
    model = GPTModel(cfg, tp=TensorParallelContext(expert_group=groups.ep.group)).eval()
    init_from_hf(model, path)
    local = model.decoder.layers[1].mlp.experts.linear_fc1.weight
    with torch.no_grad():
        return model(_ids()), tuple(local.shape)


def test_lladamoe_import_at_ep2_matches_its_logits(saved):
    path, ref_logits = saved
    for logits, local_shape in run_distributed(_ep2, world_size=2, args=(path,), timeout=120):
        assert local_shape == (2, 32, 32)  # 2 of the 4 experts on each rank: [gate; up] rows of width 16
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def test_lladamoe_import_at_pp2_matches_its_logits(saved):
    from .helpers import pp2_logits

    path, ref_logits = saved  # stage 0: the dense layer; stage 1: the sparse one and the head
    torch.testing.assert_close(pp2_logits(path, _ids()), ref_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "field,value",
    [
        ("clip_qkv", 8.0),
        ("partial_rotary_factor", 0.5),
        ("moe_router_score_function", "sigmoid"),
        ("moe_router_enable_expert_bias", True),
        ("routed_scaling_factor", 2.5),
        ("router_num_group", 4),
    ],
)
def test_lladamoe_refusals_are_named(saved, field, value):
    hf = {**read_hf_config(saved[0]), field: value}
    with pytest.raises(ValueError, match=field):
        transformer_config_from_hf(hf)


def _load_back(path):
    """LLaDA-MoE's class (the vendored code, imported by ``saved``) with an export's config and weights."""
    from safetensors.torch import load_file

    config = importlib.import_module("lladamoe_model.configuration_lladamoe")
    modeling = importlib.import_module("lladamoe_model.modeling_lladamoe")
    model = modeling.LLaDAMoEModelLM(config.LLaDAMoEConfig.from_pretrained(str(path)))
    model.load_state_dict(load_file(os.path.join(str(path), "model.safetensors")), strict=True)
    return model.eval()


def test_round_trip_lladamoe_megadlms_lladamoe_is_exact(saved, tmp_path):
    from safetensors.torch import load_file

    from megadlms.hf.export import main
    from megadlms.hf.import_cli import import_hf
    from tests.hf.test_import import _byte_tokenizer_without_mask

    path, ref_logits = saved
    _byte_tokenizer_without_mask(path)
    import_hf(path, str(tmp_path / "ck"), mask_token="256", seq_length=32)  # the tiny vocab has no mask
    argv = ["--load", str(tmp_path / "ck"), "--output", str(tmp_path / "back"), "--format", "lladamoe"]
    assert main(argv + ["--llada-code", os.path.join(REF_DIR, "lladamoe_model")]) == 0
    theirs, again = (load_file(os.path.join(d, "model.safetensors")) for d in (path, str(tmp_path / "back")))
    assert sorted(theirs) == sorted(again)
    for k, t in theirs.items():
        assert torch.equal(t, again[k]), k
    with torch.no_grad():
        assert torch.equal(_load_back(tmp_path / "back")(_ids()).logits, ref_logits)
    config, original = json.load(open(tmp_path / "back" / "config.json")), read_hf_config(path)
    assert {k: config[k] for k in TINY if k not in ("pad_token_id", "eos_token_id")} == {
        k: original[k] for k in TINY if k not in ("pad_token_id", "eos_token_id")
    }
    assert (config["model_type"], config["mask_token_id"]) == ("lladamoe", 256)
    assert config["auto_map"]["AutoModel"] == "modeling_lladamoe.LLaDAMoEModelLM"
    assert {"modeling_lladamoe.py", "configuration_lladamoe.py"} <= set(os.listdir(tmp_path / "back"))


def test_lladamoe_export_refusals_are_named(tmp_path):
    from megadlms.hf.export import export_hf

    from .helpers import ROPE_SWIGLU, save_tiny, tiny_config

    moe = dict(ROPE_SWIGLU, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    cases = [
        ({}, "lladamoe", "moe_router_pre_softmax"),  # our default router renormalises over the top k
        (dict(moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0), "lladamoe", "capacity"),
        (dict(moe_router_pre_softmax=True), "llada", "--format lladamoe"),
        (dict(moe_router_pre_softmax=True), "megadlms", "--format lladamoe"),
    ]
    for i, (kw, fmt, message) in enumerate(cases):
        save_tiny(tmp_path / f"ck{i}", tiny_config(**moe, **kw))
        with pytest.raises(ValueError, match=message):
            export_hf(str(tmp_path / f"ck{i}"), str(tmp_path / f"hf{i}"), fmt=fmt)
        assert not os.path.exists(tmp_path / f"hf{i}")
    save_tiny(tmp_path / "dense", tiny_config(**ROPE_SWIGLU))
    with pytest.raises(ValueError, match="a dense model: --format llada"):
        export_hf(str(tmp_path / "dense"), str(tmp_path / "hf"), fmt="lladamoe")


def test_our_moe_model_exports_to_lladamoe_with_our_logits(saved, tmp_path):  # saved: their code imported
    """A MoE model of ours (not imported: every layer sparse, moe_layer_freq 1, a shared expert,
    untied, Megatron-padded vocabulary) as --format lladamoe: LLaDA-MoE's class gives our logits
    over the real vocabulary."""
    from megadlms.hf.export import export_hf

    from .helpers import ROPE_SWIGLU, save_tiny, tiny_config

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_router_pre_softmax=True)
    cfg = tiny_config(
        **ROPE_SWIGLU,
        **moe,
        moe_shared_expert_intermediate_size=24,
        untie_embeddings_and_output_weights=True,
    )
    ours = save_tiny(tmp_path / "ck", cfg)
    config = export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"), fmt="lladamoe")
    assert (config["moe_layer_freq"], config["vocab_size"], config["tie_word_embeddings"]) == (
        [1, 1],
        259,
        False,
    )
    ids = torch.randint(0, 259, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = _load_back(tmp_path / "hf")(ids).logits, ours(ids)[..., :259]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
