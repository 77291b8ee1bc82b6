"""LLaDA's Hugging Face format (``LLaDAModelLM``, model_type "llada": GSAI-ML/LLaDA-8B-Base and
-Instruct, Fast-dLLM's and dllm's copies of its modeling_llada.py) <-> megadlms' GPTModel.

LLaDA's model is OLMo's code with a bidirectional mask: pre-norm RMSNorm blocks, RoPE
(rotate-half, theta from the config), SwiGLU, no biases, tied or untied head. Two block
layouts hold the same maths under different tensor names:

* ``block_type "llama"`` (LLaDA-8B): separate ``q_proj`` / ``k_proj`` / ``v_proj``, SiLU on
  ``ff_proj`` times ``up_proj``;
* ``block_type "sequential"``: one fused ``att_proj`` = [q; k; v] rows, and ``activation_type
  "swiglu"`` on a fused ``ff_proj`` = [up; gate] rows (OLMo's SwiGLU gates the SECOND half).

Both are renamed here to Llama-style names (``model.layers.i.self_attn.q_proj`` ...), which
``mapping.hf_to_megadlms`` then fuses into Megatron's layout, so there is one fusing rule.

Config: every LLaDA field that changes the maths is either mapped or refused by name (alibi,
learned positions, OLMo's whole-vector q/k norm, LayerNorm, Gemma norm, biases on every
linear, input embedding scaling, logit scaling, block groups). A missing field takes
LLaDA's ModelConfig default, as ``LLaDAConfig`` does. ``rope_full_precision`` false only
lowers the precision of LLaDA's own rotation in bf16; megadlms rotates in fp32 either way.
The [MASK] id is ``mask_token_id`` (126336 for LLaDA-8B).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megadlms.common.enums import AttnMaskType, PositionEmbeddingType

MODEL_TYPE = "llada"
LLADA_MASK_ID = 126336
"""LLaDA-8B's [MASK] (``<|mdm_mask|>``): the id LLaDA's and Fast-dLLM's generate default to."""

# LLaDA's ModelConfig defaults (configuration_llada.py) of the fields read here: config.json files
# written by LLaDAConfig hold every field, hand-written ones may not.
DEFAULTS = dict(
    d_model=768,
    n_heads=12,
    n_kv_heads=None,
    multi_query_attention=None,
    n_layers=12,
    mlp_ratio=4,
    mlp_hidden_size=None,
    activation_type="swiglu",
    block_type="sequential",
    block_group_size=1,
    alibi=False,
    rope=False,
    attention_layer_norm=False,
    layer_norm_type="default",
    layer_norm_with_affine=True,
    rms_norm_eps=1e-5,
    max_sequence_length=1024,
    rope_theta=10000.0,
    include_qkv_bias=False,
    include_bias=False,
    bias_for_layer_norm=None,
    scale_logits=False,
    input_emb_norm=False,
    vocab_size=50257,
    embedding_size=50304,
    weight_tying=True,
    init_std=0.02,
)
# (field, value megadlms can map, why another value cannot be)
_REQUIRED = (
    ("block_group_size", 1, "block groups rename every layer"),
    ("alibi", False, "ALiBi positions are not implemented (RoPE only)"),
    ("rope", True, "learned absolute positions are not LLaDA's layout (its MDM forward asserts rope)"),
    (
        "attention_layer_norm",
        False,
        "OLMo's q/k norm over the whole projection is not megadlms' per-head norm",
    ),
    ("layer_norm_type", "rms", "only RMSNorm is mapped (LayerNorm / Gemma's 1 + weight are not)"),
    ("layer_norm_with_affine", True, "norms without weights are not implemented"),
    ("include_bias", False, "biases on every linear and norm are not implemented (include_qkv_bias is)"),
    ("input_emb_norm", False, "scaling the input embedding by sqrt(d_model) is not implemented"),
    ("scale_logits", False, "scaling the logits by 1/sqrt(d_model) is not implemented"),
)
_ACTIVATION = {"llama": "silu", "sequential": "swiglu"}


def llada_field(hf: dict, name: str):
    """``name`` of LLaDA config ``hf``, or LLaDA's default."""
    return hf.get(name, DEFAULTS[name])


def kv_heads(hf: dict) -> int:
    """LLaDA's ``effective_n_kv_heads``."""
    n_kv, mqa = llada_field(hf, "n_kv_heads"), llada_field(hf, "multi_query_attention")
    if n_kv is None:
        return 1 if mqa else llada_field(hf, "n_heads")
    return n_kv


def check_llada(hf: dict, where: str) -> None:
    """Raise naming the first LLaDA config field megadlms cannot map."""
    for name, ok, why in _REQUIRED:
        if llada_field(hf, name) != ok:
            raise ValueError(f"{where}: LLaDA {name}={llada_field(hf, name)!r} cannot be mapped ({why})")
    block = llada_field(hf, "block_type")
    if block not in _ACTIVATION:
        raise ValueError(f"{where}: LLaDA block_type {block!r} cannot be mapped (llama or sequential)")
    act = llada_field(hf, "activation_type")
    if act != _ACTIVATION[block]:
        raise ValueError(
            f"{where}: LLaDA activation_type {act!r} with block_type {block!r} cannot be mapped "
            f"(a gated SiLU MLP: {_ACTIVATION[block]!r})"
        )
    bias_for_norm = llada_field(hf, "bias_for_layer_norm")
    if bias_for_norm:
        raise ValueError(f"{where}: LLaDA bias_for_layer_norm=True cannot be mapped (RMSNorm has no bias)")


def transformer_fields(hf: dict, where: str) -> dict:
    """TransformerConfig fields of LLaDA config ``hf`` (checked by :func:`check_llada` first)."""
    check_llada(hf, where)
    d, heads = llada_field(hf, "d_model"), llada_field(hf, "n_heads")
    hidden = llada_field(hf, "mlp_hidden_size") or llada_field(hf, "mlp_ratio") * d
    if llada_field(hf, "block_type") == "sequential":
        hidden //= 2  # the fused ff_proj holds [up; gate]: the MLP's width is half of it
    vocab = llada_field(hf, "embedding_size") or llada_field(hf, "vocab_size")
    theta = float(llada_field(hf, "rope_theta"))
    return dict(
        num_layers=llada_field(hf, "n_layers"),
        hidden_size=d,
        num_attention_heads=heads,
        num_query_groups=kv_heads(hf),
        kv_channels=d // heads,  # LLaDA's head width is always d_model / n_heads
        ffn_hidden_size=hidden,
        vocab_size=vocab,
        max_position_embeddings=llada_field(hf, "max_sequence_length"),
        norm_epsilon=llada_field(hf, "rms_norm_eps"),
        add_bias_linear=False,
        add_qkv_bias=bool(llada_field(hf, "include_qkv_bias")),
        rotary_base=int(theta) if theta.is_integer() else theta,
        untie_embeddings_and_output_weights=not llada_field(hf, "weight_tying"),
        init_method_std=llada_field(hf, "init_std"),
    )


HUB_CODE = "GSAI-ML/LLaDA-8B-Base"
"""Where ``auto_map`` points when the export carries no modeling code: transformers fetches
LLaDA's published ``modeling_llada.py`` from this Hub repository (``trust_remote_code``)."""
CODE_FILES = ("configuration_llada.py", "modeling_llada.py")


def auto_map(local: bool) -> dict:
    """config.json's ``auto_map``: the modeling files next to the weights, or LLaDA's on the Hub."""
    pre = "" if local else f"{HUB_CODE}--"
    model = f"{pre}modeling_llada.LLaDAModelLM"
    return {
        "AutoConfig": f"{pre}configuration_llada.LLaDAConfig",
        "AutoModel": model,
        "AutoModelForCausalLM": model,
    }


def _split_rows(t: torch.Tensor, sizes) -> list:
    return [x.contiguous() for x in torch.split(t, list(sizes), dim=0)]


def to_llama_names(tensors: Dict[str, torch.Tensor], hf: dict) -> Dict[str, torch.Tensor]:
    """LLaDA tensor names -> the Llama-style names ``mapping.hf_to_megadlms`` reads."""
    d, heads = llada_field(hf, "d_model"), llada_field(hf, "n_heads")
    kv = kv_heads(hf) * (d // heads)
    glob = {
        "model.transformer.wte.weight": "model.embed_tokens.weight",
        "model.transformer.ln_f.weight": "model.norm.weight",
        "model.transformer.ff_out.weight": "lm_head.weight",
    }
    layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ff_norm.weight": "post_attention_layernorm.weight",
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "attn_out": "self_attn.o_proj",
        "ff_out": "mlp.down_proj",
        "up_proj": "mlp.up_proj",
    }
    fused = llada_field(hf, "block_type") == "sequential"
    out: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in glob:
            out[glob[name]] = t
            continue
        parts = name.split(".")
        if parts[:3] != ["model", "transformer", "blocks"] or len(parts) < 6:
            raise KeyError(f"cannot map LLaDA tensor {name!r} onto megadlms' GPTModel")
        pre, module, kind = f"model.layers.{parts[3]}.", ".".join(parts[4:-1]), parts[-1]
        if module == "att_proj" and fused:
            for proj, x in zip(("q_proj", "k_proj", "v_proj"), _split_rows(t, (d, kv, kv))):
                out[f"{pre}self_attn.{proj}.{kind}"] = x
        elif module == "ff_proj" and fused:
            up, gate = _split_rows(t, (t.shape[0] // 2, t.shape[0] // 2))  # OLMo's SwiGLU: silu(2nd) * 1st
            out[f"{pre}mlp.gate_proj.{kind}"], out[f"{pre}mlp.up_proj.{kind}"] = gate, up
        elif module == "ff_proj":
            out[f"{pre}mlp.gate_proj.{kind}"] = t  # llama block: act(ff_proj(x)) * up_proj(x)
        elif f"{module}.{kind}" in layer:
            out[pre + layer[f"{module}.{kind}"]] = t
        elif module in layer:
            out[f"{pre}{layer[module]}.{kind}"] = t
        else:
            raise KeyError(f"cannot map LLaDA tensor {name!r} onto megadlms' GPTModel")
    return out


def from_llama_names(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Llama-style names (``mapping.megadlms_to_hf``) -> LLaDA's block_type "llama" names."""
    glob = {
        "model.embed_tokens.weight": "model.transformer.wte.weight",
        "model.norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight",
    }
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ff_norm",
        "self_attn.q_proj": "q_proj",
        "self_attn.k_proj": "k_proj",
        "self_attn.v_proj": "v_proj",
        "self_attn.o_proj": "attn_out",
        "mlp.gate_proj": "ff_proj",
        "mlp.up_proj": "up_proj",
        "mlp.down_proj": "ff_out",
    }
    out: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in glob:
            out[glob[name]] = t
            continue
        parts = name.split(".")  # model.layers.i.<module>.<weight|bias>
        module, kind = ".".join(parts[3:-1]), parts[-1]
        if parts[:2] != ["model", "layers"] or module not in layer:
            raise KeyError(f"no LLaDA name for tensor {name!r}")
        out[f"model.transformer.blocks.{parts[2]}.{layer[module]}.{kind}"] = t
    return out


def check_exportable(cfg) -> None:
    """Raise naming every feature of GPTModel config ``cfg`` that LLaDA's code cannot express."""
    problems = [
        (
            cfg.attention != AttnMaskType.BIDIRECTIONAL,
            f"attention {cfg.attention!r} (LLaDA's model is bidirectional)",
        ),
        (cfg.qk_layernorm, "qk_layernorm (LLaDA's attention_layer_norm normalises the whole projection)"),
        (
            cfg.normalization != "RMSNorm",
            f"normalization {cfg.normalization!r} (LLaDA's layer_norm_type rms)",
        ),
        (not cfg.swiglu, "no swiglu (LLaDA's llama block is a gated SiLU MLP)"),
        (cfg.add_bias_linear, "add_bias_linear (LLaDA has include_qkv_bias only)"),
        (
            cfg.position_embedding_type != PositionEmbeddingType.ROPE,
            f"position_embedding_type {cfg.position_embedding_type!r}",
        ),
        (
            cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size,
            f"kv_channels {cfg.kv_channels} (LLaDA's head width is hidden_size / heads)",
        ),
        (cfg.num_moe_experts, "MoE layers (export them with --format lladamoe)"),
    ]
    bad = [why for cond, why in problems if cond]
    if bad:
        raise ValueError("--format llada cannot express this model: " + "; ".join(bad))


def llada_config(cfg, special: Dict[str, Optional[int]], dtype: torch.dtype, auto_map: dict) -> dict:
    """LLaDA's config.json for GPTModel config ``cfg`` (separate projections, block_type "llama")."""
    check_exportable(cfg)
    config = {**DEFAULTS, "architectures": ["LLaDAModelLM"], "model_type": MODEL_TYPE, "auto_map": auto_map}
    config.update(
        d_model=cfg.hidden_size,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_query_groups,
        n_layers=cfg.num_layers,
        mlp_hidden_size=cfg.ffn_hidden_size,
        activation_type="silu",
        block_type="llama",
        rope=True,
        rope_full_precision=True,
        rope_theta=float(cfg.rotary_base),
        layer_norm_type="rms",
        rms_norm_eps=cfg.norm_epsilon,
        bias_for_layer_norm=False,
        include_qkv_bias=bool(cfg.add_qkv_bias),
        max_sequence_length=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        embedding_size=cfg.vocab_size,
        weight_tying=not cfg.untie_embeddings_and_output_weights,
        init_std=cfg.init_method_std,
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        flash_attention=False,
        use_cache=False,
        torch_dtype=str(dtype).replace("torch.", ""),
    )
    for key in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        if special.get(key) is not None:
            config[key] = special[key]
    return config
