"""Parameter-name and layout mapping between megadlms' GPTModel (Megatron names, grouped
QKV, fused SwiGLU ``linear_fc1``) and Hugging Face's Llama-style names (separate
``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``).

The same two functions serve the export (``megadlms -> hf``) and the import of Llama /
Qwen2 checkpoints (``hf -> megadlms``), so one is the exact inverse of the other.
"""

from __future__ import annotations

from typing import Dict

import torch

from megadlms.models import TransformerConfig

_PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    # Same norm, two names: HF names it after the attention it follows, Megatron after the MLP it feeds.
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.q_layernorm.bias": "self_attn.q_norm.bias",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.k_layernorm.bias": "self_attn.k_norm.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "embedding.position_embeddings.weight": "model.embed_positions.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}


def _qkv_split(t: torch.Tensor, cfg: TransformerConfig):
    """Megatron grouped [G * (n + 2) * D, ...] -> (q [N*D, ...], k [G*D, ...], v [G*D, ...])."""
    G, D = cfg.num_query_groups, cfg.kv_channels
    n = cfg.num_attention_heads // G
    # Megatron interleaves per kv group: [q_0 .. q_{n-1}, k, v] for each group, not [all q; all k; all v],
    # so a plain three-way chunk would mix heads of different groups.
    grouped = t.reshape(G, n + 2, D, *t.shape[1:])
    # No rotary permutation of q/k rows: GPTModel's RoPE is rotate-half (apply_rotary), HF Llama's layout.
    # The permute in Meta -> HF converters is for Meta's interleaved pairs and is not needed here.
    q = grouped[:, :n].reshape(G * n * D, *t.shape[1:])
    return q, grouped[:, n].reshape(G * D, *t.shape[1:]), grouped[:, n + 1].reshape(G * D, *t.shape[1:])


def _qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """Inverse of :func:`_qkv_split` (query head h belongs to kv group h // (N / G), as in HF)."""
    G, D = cfg.num_query_groups, cfg.kv_channels
    n = cfg.num_attention_heads // G
    # Works for weights [rows, hidden] and biases [rows] alike: the trailing dims are carried along.
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(G, n, D, *rest), k.reshape(G, 1, D, *rest), v.reshape(G, 1, D, *rest)], dim=1
    )
    return grouped.reshape(G * (n + 2) * D, *rest)


def megadlms_to_hf(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """GPTModel state dict -> Llama-style names (tied output layers have no ``lm_head``)."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        parts = name.split(".")
        if parts[:2] != ["decoder", "layers"]:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        i, rest = parts[2], ".".join(parts[3:])
        pre = f"model.layers.{i}."
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = _qkv_split(t, cfg)
            for proj, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{pre}self_attn.{proj}.{kind}"] = x.contiguous()
        elif rest.startswith("mlp.linear_fc1."):
            kind = rest.rsplit(".", 1)[1]
            if cfg.swiglu:
                # The fused fc1 is [gate; up] (GPTModel applies silu to the first half).
                gate, up = t.chunk(2, dim=0)
                out[f"{pre}mlp.gate_proj.{kind}"] = gate.contiguous()
                out[f"{pre}mlp.up_proj.{kind}"] = up.contiguous()
            else:
                # Without a gate, fc1 is HF's up_proj alone.
                out[f"{pre}mlp.up_proj.{kind}"] = t
        elif rest in _PER_LAYER:
            out[pre + _PER_LAYER[rest]] = t
        else:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return out


def hf_to_megadlms(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Llama-style state dict -> GPTModel names; raises naming any tensor it cannot place."""
    inverse_global = {v: k for k, v in _GLOBAL.items()}
    inverse_layer = {v: k for k, v in _PER_LAYER.items()}
    out: Dict[str, torch.Tensor] = {}
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in sd.items():
        if name in inverse_global:
            out[inverse_global[name]] = t
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5:
            raise KeyError(f"cannot map Hugging Face tensor {name!r} onto megadlms' GPTModel")
        i, rest = parts[2], ".".join(parts[3:])
        pre = f"decoder.layers.{i}."
        if rest in inverse_layer:
            out[pre + inverse_layer[rest]] = t
        elif rest.split(".")[0] in ("self_attn", "mlp") and rest.split(".")[1] in (
            "q_proj",
            "k_proj",
            "v_proj",
            "gate_proj",
            "up_proj",
        ):
            _, proj, kind = rest.split(".")
            # Fused tensors need all their parts: hold them per (layer, weight|bias) until the loop is done.
            pending.setdefault(f"{i}.{kind}", {})[proj] = t
        else:
            raise KeyError(f"cannot map Hugging Face tensor {name!r} onto megadlms' GPTModel")
    for key, group in pending.items():
        i, kind = key.split(".")
        pre = f"decoder.layers.{i}."
        if {"q_proj", "k_proj", "v_proj"} & group.keys():
            if not {"q_proj", "k_proj", "v_proj"} <= group.keys():
                raise KeyError(f"layer {i}: q_proj, k_proj and v_proj {kind}s must all be present")
            out[f"{pre}self_attention.linear_qkv.{kind}"] = _qkv_join(
                group["q_proj"], group["k_proj"], group["v_proj"], cfg
            )
        # A missing gate_proj with swiglu raises KeyError here, which callers report as an unmappable tensor.
        if "up_proj" in group:
            fc1 = torch.cat([group["gate_proj"], group["up_proj"]]) if cfg.swiglu else group["up_proj"]
            out[f"{pre}mlp.linear_fc1.{kind}"] = fc1
    return out
