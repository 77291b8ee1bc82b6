"""GPTModel under tensor (and sequence) parallelism on 2 gloo ranks against the same model on
one process built from the same seed: the full initial weights (bitwise), the logits gathered
over the vocab, the loss through ``compute_loss`` and every gradient (gathered), for MHA +
GELU + learned positions (tied) and GQA + SwiGLU + rope + QK-layernorm (untied), each with and
without sequence parallelism (also on an input length tp does not divide: padded and masked
inside the model, exactly the unpadded result). With dropout 0.1 and the model-parallel RNG tracker the
TP-replicated parameters stay bitwise identical across the TP ranks over 3 SGD steps.

One 2-rank job computes every comparison (a module fixture); each test asserts its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadlms.common.errors import ConfigError
from megadlms.diffusion import DiffusionConfig, compute_loss
from megadlms.models import GPTModel, TransformerConfig
from megadlms.models.config import check_tensor_parallel
from megadlms.parallel import (
    ParallelGroups,
    TensorParallelContext,
    allreduce_sequence_parallel_grads,
    gather_full,
    model_parallel_manual_seed,
    shard_spec,
    sharding_of,
)
from tests.dist_utils import run_distributed

V, S, B, SEED = 64, 16, 2, 1234
MASK = V - 1
LOGITS_TOL = 1e-6  # relative to the largest |logit|, fp32
LOSS_TOL = 1e-6  # relative
GRAD_TOL = 1e-5  # absolute, fp32
DIFF = DiffusionConfig(mask_token_id=MASK, objective="llada", varilen_prob=0.0)

CONFIGS = {
    "mha_gelu_abs": dict(position_embedding_type="learned_absolute"),
    "gqa_swiglu_rope": dict(
        num_query_groups=2,
        swiglu=True,
        ffn_hidden_size=48,
        position_embedding_type="rope",
        qk_layernorm=True,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
        add_qkv_bias=True,
    ),
}
CASES = [(name, sp) for name in CONFIGS for sp in (False, True)]


def _config(name, dropout=0.0, **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=S)
    base.update(CONFIGS[name], attention_dropout=dropout, hidden_dropout=dropout, **kw)
    return TransformerConfig(**base)


def _batch():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, V - 1, (B, S), generator=g)
    loss_mask = torch.ones(B, S)
    loss_mask[1, -3:] = 0.0
    return {
        "tokens": torch.randint(0, V - 1, (B, S), generator=g),
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(S).expand(B, S),
        "sample_idx": torch.arange(B),
    }


def _full(t, like, group):
    """The full logical tensor of ``t`` (a param or its grad) sharded like ``like``."""
    spec = shard_spec(like)
    return t.detach() if spec is None else gather_full(t.detach(), group, *spec)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _compare_case(rank, group, name, sp):
    cfg = _config(name)
    torch.manual_seed(SEED)
    ref = GPTModel(cfg)
    torch.manual_seed(SEED)
    model = GPTModel(cfg, tp=TensorParallelContext(group=group, sequence_parallel=sp))
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    out = {
        "names_equal": list(params) == list(ref_params)
        and list(model.state_dict()) == list(ref.state_dict()),
        "init_bitwise": all(torch.equal(_full(p, p, group), ref_params[n]) for n, p in params.items()),
        "partial_grad_params": sorted(n for n, p in params.items() if sharding_of(p).tp_partial_grad),
    }
    batch = _batch()
    logits = gather_full(model(batch["tokens"]).detach(), group, -1)
    out["logits"] = _rel(logits, ref(batch["tokens"]).detach())

    loss, count, _ = compute_loss(model, batch, DIFF, 0, None)
    loss_ref, count_ref, _ = compute_loss(ref, batch, DIFF, 0, None)
    out["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    out["loss_value"] = loss.detach()
    out["count_equal"] = count.item() == count_ref.item()
    # backward of the per-token loss, as the trainer does (it divides by the token count)
    (loss / count).backward()
    (loss_ref / count_ref).backward()
    allreduce_sequence_parallel_grads(model, group)
    out["missing_grads"] = [n for n, p in params.items() if p.grad is None]
    out["grads"] = {
        n: (_full(p.grad, p, group) - ref_params[n].grad).abs().max().item()
        for n, p in params.items()
        if p.grad is not None
    }
    return out


def _vanilla_case(rank, group):
    # The AR loss (ar_loss over every token) through the vocab-parallel scorer, causal model.
    cfg = _config("mha_gelu_abs", attention="causal")
    vanilla = DiffusionConfig(model_running_mode="vanilla")
    torch.manual_seed(SEED)
    ref = GPTModel(cfg)
    torch.manual_seed(SEED)
    model = GPTModel(cfg, tp=TensorParallelContext(group=group, sequence_parallel=True))
    loss = compute_loss(model, _batch(), vanilla, 0)[0].item()
    loss_ref = compute_loss(ref, _batch(), vanilla, 0)[0].item()
    return abs(loss - loss_ref) / abs(loss_ref)


def _dropout_case(rank, group, name, sp, steps=3, lr=0.1):
    tracker = model_parallel_manual_seed(SEED, rank)
    mp_state0 = tracker.get_states()
    model = GPTModel(_config(name, dropout=0.1), tp=TensorParallelContext(group, sp, rng_tracker=tracker))
    model.train()
    batch = _batch()
    replicated = {n: p for n, p in model.named_parameters() if shard_spec(p) is None}
    before = {n: p.detach().clone() for n, p in replicated.items()}
    losses = []
    for it in range(steps):
        loss, count, _ = compute_loss(model, batch, DIFF, it, None)
        losses.append(loss.detach())
        (loss / count).backward()
        allreduce_sequence_parallel_grads(model, group)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
    model.eval()
    with torch.no_grad():
        eval_loss = compute_loss(model, batch, DIFF, 0, None)[0]
        model.train()
        train_loss = compute_loss(model, batch, DIFF, 0, None)[0]
    mp_state = tracker.get_states()
    return {
        "replicated": {n: p.detach().clone() for n, p in replicated.items()},
        "moved": [n for n, p in replicated.items() if not torch.equal(p, before[n])],
        "losses": torch.stack(losses),
        "dropout_active": not torch.equal(eval_loss, train_loss),
        "mp_stream_used": any(not torch.equal(mp_state[k], mp_state0[k]) for k in mp_state),
        "default_rng": torch.get_rng_state(),
    }


def _meta_case(rank, group):
    # FSDP2-style materialisation: build on meta, to_empty, reset_parameters from a seed.
    def build(tp):
        with torch.device("meta"):
            model = GPTModel(_config("gqa_swiglu_rope"), tp=tp)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED + 1)
        model.reset_parameters()
        return model

    ref = dict(build(TensorParallelContext()).named_parameters())
    model = build(TensorParallelContext(group=group, sequence_parallel=True))
    params = dict(model.named_parameters())
    return {
        "init_bitwise": all(torch.equal(_full(p, p, group), ref[n]) for n, p in params.items()),
        "partial_grad_params": sorted(n for n, p in params.items() if sharding_of(p).tp_partial_grad),
    }


def _error_cases(rank, group):
    errors = {}
    try:
        GPTModel(_config("mha_gelu_abs", vocab_size=V - 1), tp=TensorParallelContext(group=group))
    except ConfigError as e:
        errors["vocab"] = str(e)
    return errors


def _odd_length_case(rank, group, name, packed):
    """Sequence parallelism on an input length tp does not divide (S - 1, as MegaDLMs'
    objective feeds): padded and masked inside the model, exactly the unpadded result."""
    cfg = _config(name)
    torch.manual_seed(SEED)
    ref = GPTModel(cfg)
    torch.manual_seed(SEED)
    model = GPTModel(cfg, tp=TensorParallelContext(group=group, sequence_parallel=True))
    tokens = _batch()["tokens"][:, : S - 1]
    docs = (torch.arange(S - 1) >= 6).long().expand(B, S - 1) if packed else None
    logits = model(tokens, document_ids=docs)
    logits_ref = ref(tokens, document_ids=docs)
    out = {"shape": tuple(logits.shape), "logits": _rel(gather_full(logits.detach(), group, -1), logits_ref)}
    model.token_cross_entropy(logits, tokens).sum().backward()
    ref.token_cross_entropy(logits_ref, tokens).sum().backward()
    allreduce_sequence_parallel_grads(model, group)
    ref_params = dict(ref.named_parameters())
    out["grads"] = max(
        (_full(p.grad, p, group) - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    return out


def _cached_generation_case(rank, group, sp):
    """Fast-dLLM's KV cache under TP (each rank caches its heads; SP pads an odd slice and never
    writes the padding): the same tokens as one process, and the cached logits of an unchanged
    sequence equal the full forward's."""
    from megadlms.diffusion import generate
    from megadlms.ops.kv_cache import KVCache

    cfg = _config("gqa_swiglu_rope")
    torch.manual_seed(SEED)
    ref = GPTModel(cfg).double().eval()
    torch.manual_seed(SEED)
    model = GPTModel(cfg, tp=TensorParallelContext(group=group, sequence_parallel=sp)).double().eval()
    prompt = _batch()["tokens"][:, :3]
    out = {}
    for cache in (None, "prefix", "dual"):
        kw = dict(mask_token_id=MASK, gen_length=8, steps=8, block_length=4, cache=cache, threshold=0.02)
        out[f"tokens_{cache}"] = torch.equal(generate(model, prompt, **kw), generate(ref, prompt, **kw))
    x = _batch()["tokens"][:, : S - 1]
    kv = KVCache()
    full = gather_full(model(x, kv_cache=kv).detach(), group, -1)
    kv.truncate(6)
    rest = gather_full(model(x[:, 6:], kv_cache=kv, cache_offset=6).detach(), group, -1)
    out["cached_logits"] = _rel(rest, full[:, 6:])
    return out


def _all_cases(rank, world):
    group = ParallelGroups.build(tp=2).tp.group
    out = {f"{name}_sp{sp}": _compare_case(rank, group, name, sp) for name, sp in CASES}
    out["vanilla"] = _vanilla_case(rank, group)
    out.update({f"dropout_{name}_sp{sp}": _dropout_case(rank, group, name, sp) for name, sp in CASES})
    out["meta"] = _meta_case(rank, group)
    out["errors"] = _error_cases(rank, group)
    for name in CONFIGS:
        for packed in (False, True):
            out[f"odd_{name}_{packed}"] = _odd_length_case(rank, group, name, packed)
    out.update(
        {f"cached_generation_sp{sp}": _cached_generation_case(rank, group, sp) for sp in (False, True)}
    )
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_cases, world_size=2, timeout=300)


def _expected_partial(name, sp):
    """Replicated params whose grad is partial per TP rank: QK-layernorm always (heads are
    split); with sequence parallelism also every hidden-size norm and row-parallel bias."""
    cfg = _config(name)
    names = []
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        if cfg.qk_layernorm:
            names += [p + f"self_attention.{qk}_layernorm.{w}" for qk in "qk" for w in ("weight", "bias")]
        if sp:
            names += [
                p + f"{norm}.{w}"
                for norm in ("input_layernorm", "pre_mlp_layernorm")
                for w in ("weight", "bias")
            ]
            if cfg.add_bias_linear:
                names += [p + "self_attention.linear_proj.bias", p + "mlp.linear_fc2.bias"]
    if sp:
        names += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    return sorted(names)


@pytest.mark.parametrize("name,sp", CASES)
def test_tp2_matches_single_process(results, name, sp):
    for rank, res in enumerate(results):
        case = res[f"{name}_sp{sp}"]
        assert case["names_equal"], f"rank {rank}: parameter names differ from the tp=1 model"
        assert case["init_bitwise"], f"rank {rank}: gathered initial weights differ from the tp=1 init"
        assert case["partial_grad_params"] == _expected_partial(name, sp), rank
        assert case["logits"] <= LOGITS_TOL, f"rank {rank}: logits differ by {case['logits']} (relative)"
        assert case["loss"] <= LOSS_TOL, f"rank {rank}: loss differs by {case['loss']} (relative)"
        assert case["count_equal"]
        assert not case["missing_grads"], case["missing_grads"]
        bad = {n: d for n, d in case["grads"].items() if d > GRAD_TOL}
        assert not bad, f"rank {rank}: grads differ from the tp=1 grads: {bad}"
    # the vocab-parallel loss is one number, bitwise the same on both TP ranks
    assert torch.equal(results[0][f"{name}_sp{sp}"]["loss_value"], results[1][f"{name}_sp{sp}"]["loss_value"])


def test_tp2_vanilla_ar_loss_matches_single_process(results):
    for rank, res in enumerate(results):
        assert res["vanilla"] <= LOSS_TOL, f"rank {rank}: AR loss differs by {res['vanilla']} (relative)"


@pytest.mark.parametrize("name,sp", CASES)
def test_dropout_keeps_tp_replicas_identical(results, name, sp):
    r0, r1 = (res[f"dropout_{name}_sp{sp}"] for res in results)
    for rank, r in enumerate((r0, r1)):
        assert r["dropout_active"], f"rank {rank}: dropout had no effect on the loss"
        assert r["mp_stream_used"], (
            f"rank {rank}: attention dropout did not draw from the model-parallel stream"
        )
        assert len(r["moved"]) == len(r["replicated"]), "SGD left some replicated params unchanged"
    assert torch.equal(r0["default_rng"], r1["default_rng"]), "default generators drifted apart"
    assert torch.equal(r0["losses"], r1["losses"])
    drifted = [n for n in r0["replicated"] if not torch.equal(r0["replicated"][n], r1["replicated"][n])]
    assert not drifted, f"TP-replicated params differ across TP ranks after 3 steps: {drifted}"


def test_reset_parameters_after_to_empty_from_meta(results):
    # the shard attributes survive to_empty, so the re-init is layout independent too
    for rank, res in enumerate(results):
        assert res["meta"]["init_bitwise"], f"rank {rank}: meta -> to_empty -> reset differs from tp=1"
        assert res["meta"]["partial_grad_params"] == _expected_partial("gqa_swiglu_rope", True)


def test_tp2_errors_name_the_fields(results):
    for res in results:
        err = res["errors"]
        assert "vocab_size 63" in err["vocab"] and "tensor_model_parallel_size 2" in err["vocab"]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_parallel_pads_odd_lengths_exactly(results, name, packed):
    for res in results:
        got = res[f"odd_{name}_{packed}"]
        assert got["shape"][1] == S - 1
        assert got["logits"] < LOGITS_TOL and got["grads"] < GRAD_TOL, got


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_attention_heads=6, num_query_groups=3, hidden_size=48), "num_query_groups 3"),
        (dict(num_attention_heads=3, hidden_size=48), "num_attention_heads 3"),
        (dict(ffn_hidden_size=33), "ffn_hidden_size 33"),
        (dict(vocab_size=65), "vocab_size 65"),
    ],
)
def test_divisibility_errors(kw, field):
    cfg = TransformerConfig(
        **{**dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=S), **kw}
    )
    with pytest.raises(ConfigError, match=f"{field} is not divisible by tensor_model_parallel_size 2"):
        check_tensor_parallel(cfg, 2)
    check_tensor_parallel(cfg, 1)  # always fine on one rank


def test_single_process_model_has_no_partial_grads_and_plain_cross_entropy():
    torch.manual_seed(SEED)
    model = GPTModel(_config("gqa_swiglu_rope"))
    assert not any(sharding_of(p).tp_partial_grad for p in model.parameters())
    logits = model(_batch()["tokens"])
    target = _batch()["labels"]
    expect = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none").view(B, S)
    assert torch.equal(model.token_cross_entropy(logits, target), expect)


@pytest.mark.parametrize("sp", [False, True])
def test_cached_generation_under_tensor_parallelism(results, sp):
    for rank in range(2):
        case = results[rank][f"cached_generation_sp{sp}"]
        assert case["tokens_None"] and case["tokens_prefix"] and case["tokens_dual"], case
        assert case["cached_logits"] < 1e-12, case
