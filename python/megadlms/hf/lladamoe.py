"""LLaDA-MoE's Hugging Face format (``LLaDAMoEModelLM``, model_type "lladamoe":
inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct, dllm's copy of its modeling_lladamoe.py) ->
megadlms' GPTModel with MoE layers.

LLaDA-MoE is OLMoE's architecture with a bidirectional mask: Llama-style attention with
per-head q/k RMSNorm (``qk_layernorm``), a dense SwiGLU MLP on the layers ``moe_layer_freq``
marks 0 (``dense_intermediate_size``) and on the others a sparse block: a router
(``mlp.gate``: softmax over all experts, then the top ``num_experts_per_tok``, NOT
renormalised: its code fixes ``norm_topk_prob`` to False) over ``num_experts`` SwiGLU experts
(``expert_intermediate_size``), plus an ungated shared expert (``shared_expert``,
``shared_expert_intermediate_size``). megadlms' MoELayer computes exactly that with
``moe_router_pre_softmax`` (router in fp32, experts stacked per layer: ``experts.linear_fc1``
[E, 2F, H] = [gate; up], ``experts.linear_fc2`` [E, H, F]); the experts shard over expert
parallelism by their declared sharding (``importer``).

Refused by name: ``clip_qkv``, ``partial_rotary_factor`` other than 1, a sigmoid router,
the router's expert bias, ``routed_scaling_factor`` other than 1, grouped routing
(``router_num_group``), and what ``importer`` refuses for every family (RoPE scaling, other
activations). Export to LLaDA-MoE's format is not implemented (``--format llada`` refuses
MoE models).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

MODEL_TYPE = "lladamoe"

# (field, what the code computes when it is absent or this value, why another value cannot be mapped)
_REQUIRED = (
    ("clip_qkv", None, "clamping q/k/v is not implemented"),
    ("partial_rotary_factor", 1, "RoPE on part of the head is not implemented"),
    ("moe_router_score_function", "softmax", "only the softmax router is LLaDA-MoE's mapped router"),
    ("moe_router_enable_expert_bias", False, "the router's expert bias is not implemented"),
    ("routed_scaling_factor", 1, "scaling the routed experts' output is not implemented"),
)


def check_lladamoe(hf: dict, where: str) -> None:
    """Raise naming the first LLaDA-MoE config field megadlms cannot map."""
    for name, ok, why in _REQUIRED:
        value = hf.get(name, ok)
        if value is not None and value != ok:
            raise ValueError(f"{where}: LLaDA-MoE {name}={value!r} cannot be mapped ({why})")
    if hf.get("router_num_group") not in (None, -2, 1) or hf.get("router_topk_group") not in (None, -2, 1):
        raise ValueError(f"{where}: LLaDA-MoE grouped routing (router_num_group) cannot be mapped")
    if hf.get("num_experts", -1) < 1 or hf.get("num_experts_per_tok", -1) < 1:
        raise ValueError(f"{where}: LLaDA-MoE needs num_experts and num_experts_per_tok")


def moe_fields(hf: dict, where: str) -> dict:
    """The TransformerConfig fields of LLaDA-MoE config ``hf`` that the Llama-style mapping
    does not give (the MoE layout, q/k norms, the dense width), checked first."""
    check_lladamoe(hf, where)
    freq = list(hf.get("moe_layer_freq") or [1] * hf["num_hidden_layers"])
    if len(freq) != hf["num_hidden_layers"]:
        raise ValueError(
            f"{where}: LLaDA-MoE moe_layer_freq has {len(freq)} entries for {hf['num_hidden_layers']} layers"
        )
    shared = hf.get("shared_expert_intermediate_size")
    return dict(
        ffn_hidden_size=hf["dense_intermediate_size"],
        qk_layernorm=bool(hf.get("qk_layernorm")),
        num_moe_experts=hf["num_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["expert_intermediate_size"],
        moe_layer_freq=[int(bool(f)) for f in freq],
        moe_shared_expert_intermediate_size=shared if shared and shared > 0 else None,
        moe_router_pre_softmax=True,  # softmax over all experts, top-k not renormalised
    )


def llama_like(hf: dict) -> dict:
    """``hf`` with the keys the Llama-style field mapping reads (its dense width)."""
    return {
        **hf,
        "intermediate_size": hf["dense_intermediate_size"],
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("attention_bias", False),
    }


def split_experts(
    tensors: Dict[str, torch.Tensor], hf: dict
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(Llama-style tensors for ``mapping.hf_to_megadlms``, GPTModel-named MoE tensors): the
    router, the stacked experts and the shared expert of every sparse layer."""
    E = hf["num_experts"]
    dense: Dict[str, torch.Tensor] = {}
    moe: Dict[str, torch.Tensor] = {}
    experts: Dict[Tuple[str, str], Dict] = {}  # (layer, proj | "shared") -> expert index | proj -> tensor
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 6 or parts[3] not in ("mlp", "shared_expert"):
            dense[name] = t
            continue
        i, rest = parts[2], parts[3:]
        pre = f"decoder.layers.{i}.mlp."
        if rest[:2] == ["mlp", "gate"]:
            moe[pre + "router.weight"] = t
        elif rest[:2] == ["mlp", "experts"]:
            experts.setdefault((i, rest[3]), {})[int(rest[2])] = t
        elif rest[0] == "shared_expert":
            experts.setdefault((i, "shared"), {})[rest[1]] = t
        else:
            dense[name] = t  # a dense layer's mlp.gate_proj / up_proj / down_proj
    for (i, kind), group in experts.items():
        if kind == "shared":  # an ungated dense MLP: fc1 = [gate; up], as GPTModel's
            pre = f"decoder.layers.{i}.mlp.shared_experts."
            moe[pre + "linear_fc1.weight"] = torch.cat([group["gate_proj"], group["up_proj"]])
            moe[pre + "linear_fc2.weight"] = group["down_proj"]
    for i in sorted({i for i, kind in experts if kind != "shared"}):
        pre = f"decoder.layers.{i}.mlp."
        try:
            stack = {
                proj: torch.stack([experts[(i, proj)][e] for e in range(E)])
                for proj in ("gate_proj", "up_proj", "down_proj")
            }
        except KeyError as exc:
            raise KeyError(f"layer {i}: LLaDA-MoE expert tensors are missing ({exc.args[0]})") from exc
        # [E, F, H] gate and up -> [E, 2F, H] = [gate; up] per expert (GPTModel's fused SwiGLU order).
        moe[pre + "experts.linear_fc1.weight"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        moe[pre + "experts.linear_fc2.weight"] = stack["down_proj"]
    return dense, moe
