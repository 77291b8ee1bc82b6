"""Activation bytes a rank holds for backward: per layer, then over a pipeline stage.

Per layer the count is a combination of Megatron's monomials (``s*b*h``, ``s*b*f``,
``a*s^2*b``, ``a*s*b``, ``s*b``, ``s*b*d``, ``s*b*g*d``; d = kv channels, g = query groups)
whose coefficients are fitted, once per layer architecture, to the bytes autograd saves in
one training forward of this codebase's own ``TransformerBlock`` at small sizes
(benchmarks/activation_memory.py's method: ``saved_tensors_hooks``, once per storage,
parameters excluded, 2-layer minus 1-layer block). The fit is exact on torch's CPU kernels
(docs/memory.md); fused GPU kernels (flash attention, fused norms) save less, so on a GPU
these bytes are an upper bound.

Layouts: TP divides the head / ffn terms by tp and, with sequence parallelism, the rest too
(without it the ``s*b*h`` terms stay whole: an upper bound); CP keeps ``s/C`` tokens and
``a*(s/C)*s`` scores per rank; MoE layers are counted as a dense layer of width
``topk * moe_ffn_hidden_size`` (+ the shared expert) per token, times the capacity factor
when set. Recomputation: ``selective`` and ``full`` are fitted like ``none``; ``full`` also
holds one layer's un-recomputed activations while it recomputes (the peak).
Pipeline: the first stage holds the most in-flight micro-batches: ``min(pp, m)`` (1F1B),
``min(2*(pp-1) + (vp-1)*pp + 1, m*vp)`` chunk-micro-batches of ``L/(pp*vp)`` layers each
(interleaved, the schedule's warm-up count + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from megadlms.common.enums import RecomputeGranularity, RecomputeMethod
from megadlms.config import RunConfig
from megadlms.diffusion import model_length
from megadlms.models import TransformerConfig
from megadlms.models.transformer import RotaryEmbedding, TransformerBlock
from megadlms.parallel import TensorParallelContext, model_parallel_manual_seed

from .memory import param_dtype

__all__ = ["MONOMIALS", "activation_bytes", "block_saved_bytes", "layer_bytes"]

MONOMIALS = ("s*b*h", "s*b*f", "a*s^2*b", "a*s*b", "s*b", "s*b*d", "s*b*g*d")
# (hidden, heads, query-group divisor, ffn, seq): small shapes that vary every monomial independently
_FIT_SHAPES = [
    (64, 4, 1, 96, 32),
    (64, 4, 2, 160, 48),
    (96, 2, 1, 96, 64),
    (128, 8, 4, 256, 32),
    (64, 8, 2, 192, 80),
    (160, 4, 4, 64, 40),
    (128, 2, 2, 128, 16),
    (96, 6, 3, 32, 24),
    (64, 2, 1, 64, 56),
    (128, 4, 2, 96, 40),
]
_FITS: Dict[str, List[float]] = {}


def _monomials(s: float, b: float, h: float, f: float, a: float, d: float, g: float, s_kv: float):
    return [s * b * h, s * b * f, a * s * s_kv * b, a * s * b, s * b, s * b * d, s * b * g * d]


def _small(model: TransformerConfig, shape, layers: int, dtype) -> TransformerConfig:
    h, a, gdiv, f, s = shape
    gqa = model.num_query_groups not in (None, model.num_attention_heads)
    groups: Any = a // gdiv if gqa else None  # None: one group per head
    return dataclasses.replace(
        model,
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=a,
        num_query_groups=groups,
        kv_channels=h // a,
        ffn_hidden_size=f,
        seq_length=s,
        max_position_embeddings=max(s, 64),
        vocab_size=8,
        unpadded_vocab_size=None,
        num_moe_experts=None,
        moe_ffn_hidden_size=None,
        params_dtype=dtype,
        # one layer per span: the fit sees one saved input per layer (layer_bytes scales it)
        **_recompute_fields(model.recompute_granularity),
    )


def _recompute_fields(granularity) -> dict:
    full = granularity == RecomputeGranularity.FULL
    return dict(
        recompute_granularity=None if granularity in (None, "none") else granularity,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
    )


def block_saved_bytes(model: TransformerConfig, batch: int = 1) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one training forward of a
    ``TransformerBlock`` built from ``model`` (the layers' dtype is ``model.params_dtype``)."""
    torch.manual_seed(0)
    tp = TensorParallelContext(rng_tracker=model_parallel_manual_seed(0, 0))
    block = TransformerBlock(model, str(model.attention), tp=tp, post_process=False).train()
    rotary = RotaryEmbedding(model.kv_channels)(torch.arange(model.seq_length)[None])
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, model.seq_length, model.hidden_size, dtype=model.params_dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rotary)
    return sum(seen.values())


def _coefficients(model: TransformerConfig, dtype: torch.dtype) -> List[float]:
    key = repr((_small(model, _FIT_SHAPES[0], 1, dtype), dtype))
    if key not in _FITS:
        rows, got = [], []
        for shape in _FIT_SHAPES:
            small = [_small(model, shape, n, dtype) for n in (2, 1)]
            got.append(block_saved_bytes(small[0]) - block_saved_bytes(small[1]))
            c = small[0]
            g = c.num_query_groups or c.num_attention_heads
            rows.append(_monomials(c.seq_length, 1, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads,
                                   c.kv_channels, g, c.seq_length))  # fmt: skip
        a = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor(got, dtype=torch.float64)[:, None]
        _FITS[key] = torch.linalg.lstsq(a, y).solution[:, 0].tolist()
    return _FITS[key]


def _layer_widths(model: TransformerConfig) -> float:
    """The mean per-token MLP width over the layers (an MoE layer: its routed experts' widths)."""
    if model.num_moe_experts is None:
        return float(model.ffn_hidden_size)
    assert model.moe_ffn_hidden_size is not None  # derived with the expert count
    moe = model.moe_ffn_hidden_size * model.moe_router_topk * (model.moe_expert_capacity_factor or 1.0)
    moe += model.moe_shared_expert_intermediate_size or 0
    n = model.num_layers
    return sum(moe if model.is_moe_layer(i) else model.ffn_hidden_size for i in range(n)) / n


def layer_bytes(config: RunConfig, granularity=None) -> float:
    """Activation bytes one transformer layer saves for one micro-batch on one rank."""
    m, par = config.model, config.parallel
    dtype = param_dtype(config) if not par.use_torch_fsdp2 else _fsdp2_compute_dtype(config)
    if granularity is not None:
        m = dataclasses.replace(m, **_recompute_fields(granularity))
    coef = _coefficients(m, dtype)
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    # block diffusion's [x_t ; x_0] pass: a sequence of twice the tokens (its boolean mask not counted)
    full = model_length(config.diffusion, m.seq_length)
    s, b = full / cp, config.training.micro_batch_size
    heads, groups = m.num_attention_heads / tp, (m.num_query_groups or m.num_attention_heads) / tp
    outside = tp if par.sequence_parallel else 1  # the sequence-split terms
    terms = _monomials(s, b, m.hidden_size, _layer_widths(m) / tp, heads, m.kv_channels, groups, full)
    terms[0] /= outside
    terms[4] /= outside
    return sum(c * t for c, t in zip(coef, terms))


def _fsdp2_compute_dtype(config: RunConfig) -> torch.dtype:
    return torch.bfloat16 if config.optimizer.bf16 else torch.float32


def in_flight(config: RunConfig) -> Tuple[int, int]:
    """(chunk-micro-batches the first pipeline stage holds at its peak, layers per chunk)."""
    par, t = config.parallel, config.training
    pp, m, n = par.pipeline_model_parallel_size, t.num_micro_batches, config.model.num_layers
    vp = par.virtual_stages(n)
    if pp == 1:
        return 1, n
    if vp == 1:
        return min(pp, m), n // pp
    return min(2 * (pp - 1) + (vp - 1) * pp + 1, m * vp), n // (pp * vp)


def activation_bytes(config: RunConfig) -> Dict[str, float]:
    """Peak activation bytes of the most loaded rank (the first pipeline stage), by part."""
    m, par = config.model, config.parallel
    units, layers = in_flight(config)
    per_layer = layer_bytes(config)
    if m.recompute_granularity == RecomputeGranularity.FULL:
        k = m.recompute_num_layers or 1
        if (
            m.recompute_method == RecomputeMethod.BLOCK
        ):  # the first k layers of each chunk recomputed, the rest kept
            k_ = min(k, layers)
            per_layer = (k_ * per_layer + (layers - k_) * layer_bytes(config, "none")) / layers
        else:  # uniform: one saved input per span of k layers
            per_layer /= k
    out = {"layers": units * layers * per_layer}
    if m.recompute_granularity == RecomputeGranularity.FULL:
        out["recompute peak"] = layer_bytes(config, "none") * (m.recompute_num_layers or 1)
    length = model_length(config.diffusion, m.seq_length)
    tokens = length / par.context_parallel_size * config.training.micro_batch_size
    # the last stage's logits (16-bit) and the loss's fp32 copy, vocab-parallel over tp
    if par.pipeline_model_parallel_size == 1:
        itemsize = torch.empty((), dtype=param_dtype(config)).element_size()
        out["logits"] = tokens * m.vocab_size / par.tensor_model_parallel_size * (itemsize + 4)
    return out
