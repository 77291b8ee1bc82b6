"""Dream's Hugging Face format (``DreamModel``, model_type "Dream": Dream-org/Dream-v0-Base-7B and
-Instruct, Fast-dLLM's and dllm's copies of its modeling_dream.py) <-> megadlms' GPTModel.

Dream is Qwen2.5's architecture trained as a masked-diffusion model that keeps the AR shift:
its logits at position i predict the token at i + 1 (``--model-running-mode difflm-shift``,
``megadlms.diffusion.shift``), with bidirectional attention. Its weights carry Qwen2's names
(``model.layers.i.self_attn.q_proj`` ... with q/k/v biases, ``lm_head``), so the import is
Qwen2's mapping (``importer``); this module holds what is Dream's own: the model type, its
[MASK] id, the running mode an import continues in, and the export (``--format dream``).

Refused by name on import: sliding-window attention (``use_sliding_window``), RoPE scaling,
activations other than SiLU (``importer``). On export: what Dream's code cannot express
(:func:`check_exportable`).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megadlms.common.enums import AttnMaskType, PositionEmbeddingType, RunningMode

MODEL_TYPE = "Dream"
DREAM_MASK_ID = 151666
"""Dream-v0's [MASK] (``<|mask|>``), its config's ``mask_token_id``."""
HUB_CODE = "Dream-org/Dream-v0-Base-7B"
"""Where ``auto_map`` points when the export carries no modeling code (``trust_remote_code``)."""
CODE_FILES = ("configuration_dream.py", "modeling_dream.py", "generation_utils.py")


def is_dream(hf: dict) -> bool:
    """True for a Dream config.json."""
    return hf.get("model_type") == MODEL_TYPE


def running_mode(hf: dict) -> RunningMode:
    """The running mode a model of config.json ``hf`` was trained in: difflm-shift for Dream,
    else difflm-noshift (the importer's default for a DLM)."""
    return RunningMode.DIFFLM_SHIFT if is_dream(hf) else RunningMode.DIFFLM_NOSHIFT


def check_running_mode(hf: dict, mode: RunningMode, where: str) -> None:
    """Raise when a Dream model would be trained as an unshifted DLM (its head predicts the
    next token; vanilla, an AR continuation, keeps that alignment and is allowed)."""
    if is_dream(hf) and mode is RunningMode.DIFFLM_NOSHIFT:
        raise ValueError(
            f"{where} is a Dream model (its logits at position i predict token i+1): add "
            f"--model-running-mode difflm-shift (got {mode})"
        )


def auto_map(local: bool) -> dict:
    """config.json's ``auto_map``: the modeling files next to the weights, or Dream's on the Hub."""
    pre = "" if local else f"{HUB_CODE}--"
    return {
        "AutoConfig": f"{pre}configuration_dream.DreamConfig",
        "AutoModel": f"{pre}modeling_dream.DreamModel",
    }


def check_exportable(cfg) -> None:
    """Raise naming every feature of GPTModel config ``cfg`` that Dream's code cannot express."""
    problems = [
        (
            cfg.attention != AttnMaskType.BIDIRECTIONAL,
            f"attention {cfg.attention!r} (Dream is bidirectional)",
        ),
        (cfg.qk_layernorm, "qk_layernorm (Dream's attention has no q/k norms)"),
        (cfg.normalization != "RMSNorm", f"normalization {cfg.normalization!r} (Dream: RMSNorm)"),
        (not cfg.swiglu, "no swiglu (Dream's MLP is a gated SiLU)"),
        (cfg.add_bias_linear, "add_bias_linear (Dream has q/k/v biases only)"),
        (
            cfg.position_embedding_type != PositionEmbeddingType.ROPE,
            f"position_embedding_type {cfg.position_embedding_type!r}",
        ),
        (
            cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size,
            f"kv_channels {cfg.kv_channels} (Dream's head width is hidden_size / heads)",
        ),
        (cfg.num_moe_experts, "MoE layers"),
    ]
    bad = [why for cond, why in problems if cond]
    if bad:
        raise ValueError("--format dream cannot express this model: " + "; ".join(bad))


def dream_tensors(tensors: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """Llama-style tensors (``mapping.megadlms_to_hf``) as Dream's: zero q/k/v biases for a model
    without them (Dream always has them: adding zero is exact) and an explicit ``lm_head``
    (the export is untied: a tied model's head is its embedding, copied)."""
    out = dict(tensors)
    if not cfg.add_qkv_bias:
        kv = cfg.num_query_groups * cfg.kv_channels
        for i in range(cfg.num_layers):
            for proj, rows in (
                ("q_proj", cfg.num_attention_heads * cfg.kv_channels),
                ("k_proj", kv),
                ("v_proj", kv),
            ):
                ref = out[f"model.layers.{i}.self_attn.{proj}.weight"]
                out[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(rows, dtype=ref.dtype)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def dream_config(cfg, special: Dict[str, Optional[int]], dtype: torch.dtype, auto_map: dict) -> dict:
    """Dream's config.json for GPTModel config ``cfg`` (DreamConfig's fields)."""
    check_exportable(cfg)
    config = {
        "architectures": ["DreamModel"],
        "model_type": MODEL_TYPE,
        "auto_map": auto_map,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.norm_epsilon,
        "use_cache": False,
        "tie_word_embeddings": False,
        "rope_theta": float(cfg.rotary_base),
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    for key in ("eos_token_id", "bos_token_id"):
        if special.get(key) is not None:
            config[key] = special[key]
    # Always written, None included: DreamConfig's defaults are Dream-v0's ids (151666, 151643), and its
    # embedding takes pad_token_id as padding_idx, which must lie inside this vocabulary.
    config["mask_token_id"], config["pad_token_id"] = (
        special.get("mask_token_id"),
        special.get("pad_token_id"),
    )
    return config
