"""Gemma 1/2/3 (model_type gemma, gemma2, gemma3, gemma3_text): refused by name, each feature
of the config that megadlms' GPTModel does not implement listed in the error, so a user sees
everything that stands between the checkpoint and an import (not the first item only)."""

from __future__ import annotations

from typing import List

MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def unsupported_features(hf: dict) -> List[str]:
    """What of Gemma config ``hf`` GPTModel cannot compute (always the first three: they are
    Gemma's architecture, whatever the config says)."""
    text = hf.get("text_config") or hf  # gemma3 (multimodal): the language model's config
    out = [
        "RMSNorm scaled by (1 + weight) (GemmaRMSNorm)",
        f"input embeddings scaled by sqrt(hidden_size) = {text.get('hidden_size', 0) ** 0.5:g}",
        f"GeGLU MLP (hidden_activation {text.get('hidden_activation') or text.get('hidden_act')!r})",
    ]
    if text.get("attn_logit_softcapping"):
        out.append(f"attention logit soft-capping {text['attn_logit_softcapping']}")
    if text.get("final_logit_softcapping"):
        out.append(f"final logit soft-capping {text['final_logit_softcapping']}")
    if text.get("sliding_window"):
        out.append(f"sliding-window attention layers (sliding_window {text['sliding_window']})")
    if (
        text.get("query_pre_attn_scalar")
        and text.get("head_dim")
        and text["query_pre_attn_scalar"] != text["head_dim"]
    ):
        out.append(
            f"query_pre_attn_scalar {text['query_pre_attn_scalar']} (attention scale other than head_dim)"
        )
    if hf.get("model_type") in ("gemma2", "gemma3", "gemma3_text"):
        out.append("post-attention and pre/post feed-forward norms (four norms per layer)")
    if text.get("rope_local_base_freq"):
        out.append(
            f"a second RoPE base for local layers (rope_local_base_freq {text['rope_local_base_freq']})"
        )
    return out


def refusal(hf: dict, where: str) -> str:
    """The one-line error for a Gemma config."""
    return (
        f"{where}: {hf.get('model_type')} cannot be mapped onto megadlms' GPTModel (not implemented: "
        + "; ".join(unsupported_features(hf))
        + ")"
    )
