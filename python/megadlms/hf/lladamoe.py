"""LLaDA-MoE's Hugging Face format (``LLaDAMoEModelLM``, model_type "lladamoe":
inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct, dllm's copy of its modeling_lladamoe.py) ->
megadlms' GPTModel with MoE layers.

Both ways: import (``moe_fields``, ``split_experts``) and ``megadlms-export-hf --format lladamoe``
(``check_exportable``, ``join_experts``, ``lladamoe_config``), each the other's inverse.

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
activations). The export refuses by name what LLaDA-MoE's code cannot compute: our default
router (top-k, then a softmax over the k chosen), a sigmoid router, expert capacity (token
dropping), biases, causal attention, other norms / activations / positions, a head width other
than hidden / heads, and a dense model (``--format llada``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megadlms.common.enums import AttnMaskType, PositionEmbeddingType

MODEL_TYPE = "lladamoe"
HUB_CODE = "inclusionAI/LLaDA-MoE-7B-A1B-Base"
"""Where ``auto_map`` points when the export carries no modeling code (``trust_remote_code``)."""
CODE_FILES = ("configuration_lladamoe.py", "modeling_lladamoe.py")

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


def auto_map(local: bool) -> dict:
    """config.json's ``auto_map``: the modeling files next to the weights, or LLaDA-MoE's on the Hub."""
    pre = "" if local else f"{HUB_CODE}--"
    model = f"{pre}modeling_lladamoe.LLaDAMoEModelLM"
    return {
        "AutoConfig": f"{pre}configuration_lladamoe.LLaDAMoEConfig",
        "AutoModel": model,
        "AutoModelForCausalLM": model,
    }


def check_exportable(cfg) -> None:
    """Raise naming every feature of GPTModel config ``cfg`` that LLaDA-MoE's code cannot express."""
    if not cfg.num_moe_experts:
        raise ValueError("--format lladamoe needs a mixture-of-experts model (a dense model: --format llada)")
    problems = [
        (
            cfg.attention != AttnMaskType.BIDIRECTIONAL,
            f"attention {cfg.attention!r} (LLaDA-MoE is bidirectional)",
        ),
        (cfg.normalization != "RMSNorm", f"normalization {cfg.normalization!r} (LLaDA-MoE's is RMSNorm)"),
        (not cfg.swiglu, "no swiglu (LLaDA-MoE's MLPs and experts are gated SiLU)"),
        (cfg.add_bias_linear, "add_bias_linear (LLaDA-MoE's experts have no biases)"),
        (cfg.add_qkv_bias, "add_qkv_bias (LLaDA-MoE's attention_bias also biases o_proj)"),
        (
            cfg.position_embedding_type != PositionEmbeddingType.ROPE,
            f"position_embedding_type {cfg.position_embedding_type!r}",
        ),
        (
            cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size,
            f"kv_channels {cfg.kv_channels} (LLaDA-MoE's head width is hidden_size / heads)",
        ),
        (
            not cfg.moe_router_pre_softmax,
            "the router without moe_router_pre_softmax (top-k, then a softmax over the k chosen: "
            "LLaDA-MoE's router takes the softmax over all experts and keeps it, norm_topk_prob False)",
        ),
        (
            cfg.moe_router_score_function != "softmax",
            f"moe_router_score_function {cfg.moe_router_score_function!r} (LLaDA-MoE's router is a softmax)",
        ),
        (
            cfg.moe_expert_capacity_factor is not None,
            "moe_expert_capacity_factor (token dropping; LLaDA-MoE's experts are dropless)",
        ),
    ]
    bad = [why for cond, why in problems if cond]
    if bad:
        raise ValueError("--format lladamoe cannot express this model: " + "; ".join(bad))


def join_experts(sd: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(GPTModel tensors for ``mapping.megadlms_to_hf``, LLaDA-MoE-named MoE tensors): the inverse
    of :func:`split_experts` (router -> ``mlp.gate``, stacked experts -> ``mlp.experts.e.*``,
    shared experts -> ``shared_expert.*``)."""
    dense: Dict[str, torch.Tensor] = {}
    moe: Dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        parts = name.split(".")  # decoder.layers.i.mlp.<router | experts | shared_experts>.<...>
        if parts[:2] != ["decoder", "layers"] or parts[3:4] != ["mlp"] or parts[4] not in _MOE_PARTS:
            dense[name] = t
            continue
        pre, rest = f"model.layers.{parts[2]}.", ".".join(parts[4:])
        if rest == "router.weight":
            moe[pre + "mlp.gate.weight"] = t
        elif rest == "experts.linear_fc1.weight":  # [E, 2F, H] = [gate; up] per expert
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                moe[f"{pre}mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                moe[f"{pre}mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif rest == "experts.linear_fc2.weight":  # [E, H, F]
            for e, down in enumerate(t):
                moe[f"{pre}mlp.experts.{e}.down_proj.weight"] = down.contiguous()
        elif rest == "shared_experts.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            moe[pre + "shared_expert.gate_proj.weight"] = gate.contiguous()
            moe[pre + "shared_expert.up_proj.weight"] = up.contiguous()
        elif rest == "shared_experts.linear_fc2.weight":
            moe[pre + "shared_expert.down_proj.weight"] = t
        else:
            raise KeyError(f"no LLaDA-MoE name for parameter {name!r}")
    return dense, moe


_MOE_PARTS = ("router", "experts", "shared_experts")


def lladamoe_config(cfg, special: Dict[str, Optional[int]], dtype: torch.dtype, auto_map: dict) -> dict:
    """LLaDA-MoE's config.json (``LLaDAMoEConfig``'s fields) for GPTModel config ``cfg``."""
    check_exportable(cfg)
    shared = cfg.moe_shared_expert_intermediate_size
    config = {
        "architectures": ["LLaDAMoEModelLM"],
        "model_type": MODEL_TYPE,
        "auto_map": auto_map,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "dense_intermediate_size": cfg.ffn_hidden_size,
        "expert_intermediate_size": cfg.moe_ffn_hidden_size,
        # None, not the class default -1: its decoder layer builds a shared expert unless the field is None.
        "shared_expert_intermediate_size": shared or None,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.norm_epsilon,
        "use_cache": False,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "rope_theta": float(cfg.rotary_base),
        "partial_rotary_factor": 1,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "num_experts_per_tok": cfg.moe_router_topk,
        "num_experts": cfg.num_moe_experts,
        "norm_topk_prob": False,
        "qk_layernorm": bool(cfg.qk_layernorm),
        "moe_layer_freq": [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)],
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "routed_scaling_factor": 1,
        "router_num_group": -2,  # LLaDAMoEConfig's defaults: no grouped routing
        "router_topk_group": -2,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    for key in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        if special.get(key) is not None:
            config[key] = special[key]
    return config
