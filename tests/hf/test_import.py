"""Import of Hugging Face causal LMs (Llama, Qwen2) into GPTModel, and --hf-init."""

import json
import os

import pytest
import torch

from megadlms.hf.importer import init_from_hf, read_hf_config, transformer_config_from_hf
from megadlms.models import GPTModel

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.usefixtures("frozen_heap")  # in-process runs (tests/conftest.py)

SMALL = dict(
    vocab_size=259,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _hf_model(path, family, **kw):
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **kw))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, **kw))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, **kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, **kw))
    with torch.no_grad():  # random weights everywhere (norms and biases too)
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return model.eval()


CASES = [
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=16)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen2", dict(tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # Qwen3: per-head q/k RMSNorm, no biases; head_dim 16 is not hidden / heads
    ("qwen3", dict(tie_word_embeddings=True, head_dim=16)),
    ("qwen3", dict(tie_word_embeddings=False, rope_theta=1e6)),
    # Mistral: Llama's weights; a window covering the sequence (32 >= 24 tokens, seq_length 32) is full attention
    ("mistral", dict(sliding_window=None)),
    ("mistral", dict(sliding_window=32, head_dim=16)),
    # RoPE scaling (models/rope_scaling.py): original length 16 < the 24 tokens, so every regime is exercised
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
    (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 5e5,
            }
        ),
    ),
    (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 1e6,
            }
        ),
    ),
]


@pytest.mark.parametrize("family,kw", CASES)
def test_causal_logits_match_hf(tmp_path, family, kw):
    hf = _hf_model(tmp_path / "hf", family, **kw)
    cfg = transformer_config_from_hf(read_hf_config(str(tmp_path / "hf")), seq_length=32, attention="causal")
    cfg = type(cfg).from_dict({**cfg.to_dict(), "vocab_size": 384})  # Megatron-padded rows
    ours = GPTModel(cfg).eval()
    report = init_from_hf(ours, str(tmp_path / "hf"))
    assert report["mean_rows"] == list(range(259, 384))
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got[..., :259], ref, rtol=0, atol=1e-5)
    emb = ours.embedding.word_embeddings.weight
    torch.testing.assert_close(emb[300], hf.model.embed_tokens.weight.mean(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "family,kw,message",
    [
        (
            "llama",
            dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "RoPE scaling 'dynamic'",
        ),
        ("llama", dict(hidden_act="gelu"), "hidden_act"),
        ("llama", dict(attention_bias=True, mlp_bias=False), "attention_bias"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding-window"),
        ("qwen3", dict(use_sliding_window=True, sliding_window=16), "sliding-window"),
        ("qwen3", dict(attention_bias=True), "attention_bias"),
    ],
)
def test_refuses_what_it_cannot_map(tmp_path, family, kw, message):
    _hf_model(tmp_path / "hf", family, **kw)
    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(read_hf_config(str(tmp_path / "hf")))


def _byte_tokenizer_without_mask(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from megadlms.hf.tokenizer_files import _bytes_to_unicode

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(os.path.join(path, "tokenizer.json"))


def _train_flags(flags, tmp_path, iters=4):
    return flags + [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        str(iters),
        "--lr",
        "1e-3",
        "--mock-data",
        "--attention-dropout",
        "0.1",
        "--hidden-dropout",
        "0.1",
        "--log-interval",
        "1",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "0",
        "--seed",
        "3",
        "--num-workers",  # no data-loader processes forked from the pytest process
        "0",
    ]


def test_import_cli_adds_mask_and_trains_as_dlm(tmp_path):
    from megadlms.hf.import_cli import main
    from megadlms.pretrain import run

    _hf_model(tmp_path / "hf", "qwen2", tie_word_embeddings=True)
    _byte_tokenizer_without_mask(str(tmp_path / "hf"))
    assert main(["--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ck"), "--seq-length", "32"]) == 0
    common = json.load(open(tmp_path / "ck" / "iter_0000000" / "common.json"))
    assert common["tokenizer"]["mask_token"] == 257  # added after <|endoftext|> (256)
    # The real vocabulary (HF's 259 rows) travels with the model; Megatron's padding to 384 is not a token.
    assert (common["model_config"]["vocab_size"], common["model_config"]["unpadded_vocab_size"]) == (384, 259)
    assert common["tokenizer"]["vocab_size"] == 259
    assert common["model_config"]["add_qkv_bias"] is True
    from megadlms.hf.import_cli import import_hf

    flags = import_hf(str(tmp_path / "hf"), str(tmp_path / "ck2"), seq_length=32)["flags"]
    argv = " ".join(flags).split()
    assert argv[argv.index("--vocab-size") + 1] == "259"  # before padding, as Megatron's flag
    result = run(_train_flags(argv, tmp_path, iters=12))
    losses = list(result.losses.values())
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])  # a batch of 2 is noisy: compare thirds, not two steps


def test_hf_init_flag_checks_the_architecture(tmp_path):
    from megadlms.hf.importer import model_flags
    from megadlms.pretrain import run

    _hf_model(tmp_path / "hf", "llama")
    cfg = transformer_config_from_hf(read_hf_config(str(tmp_path / "hf")), seq_length=32)
    flags = " ".join(model_flags(cfg)).split() + ["--seq-length", "32", "--hf-init", str(tmp_path / "hf")]
    result = run(_train_flags(flags, tmp_path, iters=2))
    assert len(result.losses) == 2
    bad = [f if f != "1e-06" else "1e-05" for f in flags]  # --norm-epsilon differs
    with pytest.raises(ValueError, match="--norm-epsilon"):
        run(_train_flags(bad, tmp_path, iters=1))


def test_export_then_import_round_trips(tmp_path):
    from megadlms.hf.export import export_hf

    from .helpers import ROPE_SWIGLU, save_tiny, tiny_config

    cfg = tiny_config(**ROPE_SWIGLU)
    ours = save_tiny(tmp_path / "ck", cfg)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    hf_cfg = transformer_config_from_hf(read_hf_config(str(tmp_path / "hf")))
    # the export holds the unpadded rows (and says so); the run re-pads them
    assert hf_cfg.vocab_size == hf_cfg.unpadded_vocab_size == 259
    again = GPTModel(type(cfg).from_dict({**hf_cfg.to_dict(), "vocab_size": 384}))
    report = init_from_hf(again, str(tmp_path / "hf"))
    assert report["mean_rows"] == list(range(259, 384))
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        rows = 259 if k == "embedding.word_embeddings.weight" else None
        assert torch.equal(a[:rows], b[:rows]), k


def _tp2_logits(rank, world, paths):
    from megadlms.parallel import ParallelGroups, TensorParallelContext, gather_full

    group = ParallelGroups.build(tp=2).tp.group
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(2))
    out = []
    for path in paths:
        cfg = transformer_config_from_hf(read_hf_config(path), seq_length=32, attention="causal")
        cfg = type(cfg).from_dict({**cfg.to_dict(), "vocab_size": 384})  # Megatron-padded rows, split over tp
        model = GPTModel(cfg, tp=TensorParallelContext(group=group)).eval()
        init_from_hf(model, path)
        with torch.no_grad():
            out.append(gather_full(model(ids), group, partition_dim=2)[..., :259])
    return out


def test_import_at_tp2_matches_hf_logits(tmp_path):
    """--hf-init's copy at tensor-parallel size 2 (was a shape error): Llama (GQA, untied) and
    Qwen3 (q/k norms, tied, head_dim != hidden / heads) against transformers' logits."""
    from tests.dist_utils import run_distributed

    cases = [("llama", {}), ("qwen3", dict(tie_word_embeddings=True, head_dim=16))]
    refs, paths = [], []
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(2))
    for i, (family, kw) in enumerate(cases):
        hf = _hf_model(tmp_path / str(i), family, **kw)
        with torch.no_grad():
            refs.append(hf(ids).logits)
        paths.append(str(tmp_path / str(i)))
    results = run_distributed(_tp2_logits, world_size=2, args=(paths,), timeout=120)
    for rank in range(2):
        for got, ref in zip(results[rank], refs):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_mistral_window_shorter_than_the_sequence_is_refused(tmp_path):
    _hf_model(tmp_path / "hf", "mistral", sliding_window=16)
    hf = read_hf_config(str(tmp_path / "hf"))
    assert transformer_config_from_hf(hf, seq_length=16).seq_length == 16
    with pytest.raises(ValueError, match="sliding_window 16 < seq_length 32.*--seq-length 16"):
        transformer_config_from_hf(hf, seq_length=32)


def test_load_refuses_other_rope_and_router_flags_by_name(tmp_path):
    """The fields an import brings besides the shapes (RoPE base and scaling, q/k/v bias, the MoE
    router): a --load with other flags is refused naming the flag; a record older than a field
    skips it, and a record without rope_scaling is plain RoPE."""
    from megadlms.checkpoint import check_model_config, load_model_state, resolve_checkpoint

    from .helpers import ROPE_SWIGLU, save_tiny, tiny_config

    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
    cfg = tiny_config(**ROPE_SWIGLU, rope_scaling=yarn, rotary_base=500000)
    save_tiny(tmp_path / "ck", cfg)
    path = resolve_checkpoint(str(tmp_path / "ck"))
    plain = tiny_config(**ROPE_SWIGLU, rotary_base=500000)
    with pytest.raises(ValueError, match=r"rope_scaling=.*yarn.* rope_scaling=None \(--rope-scaling\)"):
        load_model_state(path, GPTModel(plain), model_config=plain.to_dict())
    load_model_state(path, GPTModel(cfg), model_config=cfg.to_dict())  # same flags: loads
    record = plain.to_dict()
    for field, value, flag in (
        ("rotary_base", 10000, "--rotary-base"),
        ("add_qkv_bias", True, "--add-qkv-bias"),
        ("moe_router_pre_softmax", True, "--moe-router-pre-softmax"),
        ("moe_router_score_function", "sigmoid", "--moe-router-score-function"),
    ):
        with pytest.raises(ValueError, match=f"{field}=.*\\({flag}\\)"):
            check_model_config(record, {**record, field: value}, "ck")
        older = {k: v for k, v in record.items() if k != field}
        check_model_config(older, {**record, field: value}, "ck")  # not recorded then: skipped
    with pytest.raises(ValueError, match=r"rope_scaling=None .*\(--rope-scaling\)"):
        check_model_config(record, cfg.to_dict(), "ck")  # no key = plain RoPE
