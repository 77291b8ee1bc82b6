"""Start from a Hugging Face model (Llama / Qwen2 / Qwen3 causal LMs, LLaDA's ``LLaDAModelLM``
and Dream's ``DreamModel`` diffusion LMs (``llada``, ``dream``), or a megadlms export): its weights
in megadlms' GPTModel, to continue training it as a diffusion LM (LLaDA, or the Dream / DiffuLLaMA
adaptation of an AR model) or as an AR model.

Two ways in:

* ``pretrain_difflm.py ... --hf-init DIR``: the run's model (built from its flags) is
  initialised from DIR before wrapping; every architecture flag must match DIR's
  config.json (the error lists the flags that do).
* ``megadlms-import-hf --hf DIR --output CKPT [--mask-token TOKEN|ID]``: writes a megadlms
  checkpoint (iteration 0, weights only) with the tokenizer (mask token added when it has
  none) and prints the flags to continue from it with ``--load CKPT --finetune``.

What maps: token embeddings, RMSNorm weights and epsilon, RoPE base and its scaling (linear,
llama3, yarn: ``--rope-scaling``), grouped-query attention, head_dim, q/k/v biases (Qwen2;
Llama ``attention_bias`` with ``mlp_bias``), Qwen3's per-head q/k norms, SwiGLU MLP, tied or
untied output layer, Mistral (Llama's weights; its ``sliding_window`` only when it covers the
training length, else refused); LLaDA's fused or separate projections (``llada``); LLaDA-MoE
onto the MoE layers (``lladamoe``); Dream (``dream``: Qwen2's weights, trained with
``--model-running-mode difflm-shift``). What is refused, with the reason: other activations,
other RoPE scaling types (dynamic, longrope, ...), sliding-window attention, biases on some
linears but not others (other than Qwen2's q/k/v), Gemma (``gemma``), unknown tensors.

MegaDLMs' own exports (tools/weights_conversion/hf_configs: ``DiffLM`` / ``CausalLM`` with
``configuration_dlm`` / ``configuration_ar``; Qwen3-like, qk-norm, no biases) map too,
and so do megadlms exports of any version (``megadlms_model_config``).

Layouts: ``--hf-init`` fills a model built at any tensor / expert parallel size: each full
tensor is cut to this rank's shard by its declared sharding (``parallel.sharding``); at
pipeline-parallel size > 1 each stage's chunks take their own layers from the full state dict
(global layer names), the last stage's tied output layer the embedding's rows.

Vocabulary rows: the first min(ours, theirs) rows are copied (exports hold the unpadded
vocabulary; the run re-pads it to its own --make-vocab-size-divisible-by and tp). Rows ours has beyond the
HF vocabulary (Megatron's padding, an added [MASK]) and an added [MASK] row inside it
start at the mean of the HF embedding rows of the real tokens (input and, when untied,
output), as ``transformers``' ``resize_token_embeddings`` does; a mask token chosen among
the existing tokens keeps its trained row.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Union, cast

import torch

from megadlms.common.enums import AttnMaskType, RunningMode
from megadlms.config.flags.model import rope_scaling_flag
from megadlms.models import GPTModel, PipelineChunk, TransformerConfig
from megadlms.models.rope_scaling import rope_scaling_problems
from megadlms.parallel.sharding import full_shape, local_from_full, sharding_of

from . import dream, gemma, llada, lladamoe
from .mapping import hf_to_megadlms

# Families whose weights are exactly GPTModel's (pre-norm RMSNorm, RoPE, SwiGLU, GQA).
OWN_MODEL_TYPE = "megadlms"  # config.json model_type of our own exports (hf/export.py)
SUPPORTED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    llada.MODEL_TYPE,
    lladamoe.MODEL_TYPE,
    dream.MODEL_TYPE,
    OWN_MODEL_TYPE,
)
ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "rotary_base",
    "rope_scaling",
    "untie_embeddings_and_output_weights",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_router_pre_softmax",
    "moe_router_score_function",
)


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--hf-init {hf_dir}: no config.json there (a Hugging Face model directory)")
    with open(path) as f:
        return json.load(f)


def _rope_base(hf: dict, where: str) -> float:
    # Newer transformers write RoPE settings to rope_parameters; older files use rope_scaling.
    rope = hf.get("rope_parameters") or {}
    base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # An int when exact: --rotary-base is an int flag, and the printed flags must parse back.
    return int(base) if float(base).is_integer() else float(base)


def _rope_scaling(hf: dict, where: str) -> Optional[dict]:
    """The config's RoPE scaling as ``TransformerConfig.rope_scaling`` (None: plain RoPE); a type
    or parameter megadlms does not implement is refused by name (models/rope_scaling.py)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if kind == "default":
        return None
    rope.pop("rope_theta", None)
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    scaling = {"rope_type": kind, **{k: v for k, v in rope.items() if v is not None}}
    problems = rope_scaling_problems(scaling)
    if problems:
        raise ValueError(f"{where}: RoPE scaling {kind!r} cannot be mapped ({'; '.join(problems)})")
    return scaling


def megadlms_family(hf: dict) -> Optional[str]:
    """ "dlm" / "ar" for a config.json written by MegaDLMs' megatron_to_hf_te.py, else None."""
    auto_config = (hf.get("auto_map") or {}).get("AutoConfig", "")
    for family in ("dlm", "ar"):
        if auto_config.startswith(f"configuration_{family}."):
            return family
    return None


def _common_fields(seq_length: Optional[int], max_pos: int) -> dict:
    """The TransformerConfig fields every imported family shares."""
    return dict(
        # max_position_embeddings can be 128k: capped so the default run fits in memory.
        seq_length=seq_length or min(max_pos, 4096),
        max_position_embeddings=max_pos,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        # The HF models were trained without dropout; continued pretraining keeps it off unless overridden.
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


def _biases(hf: dict, kind: str, family: Optional[str], where: str) -> tuple:
    """(add_bias_linear, add_qkv_bias) of a Llama / Qwen2 / Qwen3 config."""
    if kind == "qwen2":
        # Qwen2 always has q/k/v biases and none elsewhere, whatever its config says (MegaDLMs': none).
        return False, family is None
    attn_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if attn_bias != mlp_bias:
        raise ValueError(
            f"{where}: attention_bias={attn_bias} with mlp_bias={mlp_bias} cannot be mapped "
            "(megadlms has biases on every linear or on q/k/v only)"
        )
    return attn_bias, False


def _llama_like_fields(hf: dict, kind: str, family: Optional[str], where: str) -> dict:
    """TransformerConfig fields of a Llama / Mistral / Qwen2 / Qwen3 config (HF names)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} cannot be mapped (SwiGLU needs silu)")
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ValueError(f"{where}: sliding-window attention (use_sliding_window) cannot be mapped")
    bias, qkv_bias = _biases(hf, kind, family, where)
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        # HF omits num_key_value_heads / head_dim when they are the multi-head defaults.
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_bias_linear=bias,
        add_qkv_bias=qkv_bias,
        # Qwen3: per-head RMSNorm of q and k before RoPE (q_norm / k_norm), megadlms' qk_layernorm.
        qk_layernorm=kind == "qwen3",
        rotary_base=_rope_base(hf, where),
        rope_scaling=_rope_scaling(hf, where),
        # transformers' PretrainedConfig defaults tie_word_embeddings to True, but Llama's and Qwen2's configs
        # default it to False; a file without the key comes from those, hence False.
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def transformer_config_from_hf(
    hf: dict, where: str = "the Hugging Face model", *, seq_length: Optional[int] = None, **overrides
) -> TransformerConfig:
    """The GPTModel config of HF config.json ``hf``; raises naming what cannot be mapped."""
    kind = hf.get("model_type")
    if kind == OWN_MODEL_TYPE:
        # Our own export: the recorded config is exact, no mapping of HF fields needed.
        d = dict(hf["megadlms_model_config"])
        # The rows the files hold: the unpadded vocabulary (older exports: the padded one, same in both).
        d["vocab_size"] = hf["vocab_size"]
        if seq_length:
            d["seq_length"] = seq_length
        d.update(overrides)
        return TransformerConfig.from_dict(d)
    family = megadlms_family(hf)
    if family is not None:
        # MegaDLMs' DLMAttention / ARAttention: per-head q/k RMSNorm, no bias anywhere; its own mask type.
        kind = "qwen2"
        overrides = {
            "qk_layernorm": True,
            "add_qkv_bias": False,
            "attention": (
                AttnMaskType.CAUSAL
                if hf.get("attn_mask_type") == AttnMaskType.CAUSAL
                else AttnMaskType.BIDIRECTIONAL
            ),
            **overrides,
        }
    if kind in gemma.MODEL_TYPES:
        raise ValueError(gemma.refusal(hf, where))
    if kind not in SUPPORTED:
        raise ValueError(f"{where}: model_type {kind!r} is not supported; megadlms imports {SUPPORTED}")
    if kind == llada.MODEL_TYPE:
        fields = llada.transformer_fields(hf, where)
    elif kind == dream.MODEL_TYPE:  # Qwen2's architecture and tensor names (hf/dream.py)
        fields = _llama_like_fields(hf, "qwen2", family, where)
    elif kind == lladamoe.MODEL_TYPE:  # Llama-style attention and dense layers, MoE layers (hf/lladamoe.py)
        moe = lladamoe.moe_fields(hf, where)
        fields = {**_llama_like_fields(lladamoe.llama_like(hf), "llama", family, where), **moe}
    else:
        fields = _llama_like_fields(hf, kind, family, where)
    fields = {**_common_fields(seq_length, fields["max_position_embeddings"]), **fields}
    fields.update(overrides)
    if kind == "mistral":
        _check_window(hf, fields["seq_length"], where)
    return TransformerConfig(**fields)


def _check_window(hf: dict, seq_length: int, where: str) -> None:
    """Mistral's sliding window changes nothing when it covers the whole sequence (Mistral
    v0.2+: none); a shorter window is not implemented."""
    window = hf.get("sliding_window")
    if window is not None and window < seq_length:
        raise ValueError(
            f"{where}: Mistral sliding_window {window} < seq_length {seq_length} cannot be mapped "
            f"(sliding-window attention is not implemented): use --seq-length {window} or less"
        )


def load_hf_tensors(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or its shards (via the index)."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            # The index maps every tensor to its shard; each shard file is read once.
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{hf_dir}: no model.safetensors (or index); only safetensors checkpoints are read "
            "(re-save a .bin model with save_pretrained(..., safe_serialization=True))"
        )
    out: Dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(hf_dir, name)))
    return out


def model_flags(cfg: TransformerConfig) -> List[str]:
    """pretrain_difflm.py flags that build ``cfg``'s architecture."""
    flags = [
        f"--num-layers {cfg.num_layers}",
        f"--hidden-size {cfg.hidden_size}",
        f"--ffn-hidden-size {cfg.ffn_hidden_size}",
        f"--num-attention-heads {cfg.num_attention_heads}",
        f"--kv-channels {cfg.kv_channels}",
        f"--max-position-embeddings {cfg.max_position_embeddings}",
        f"--normalization {cfg.normalization}",
        f"--norm-epsilon {cfg.norm_epsilon}",
        f"--position-embedding-type {cfg.position_embedding_type}",
        f"--rotary-base {cfg.rotary_base}",
    ]
    # Megatron ignores --num-query-groups without --group-query-attention: both are needed.
    if cfg.num_query_groups != cfg.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {cfg.num_query_groups}")
    flags += [
        f
        for f, on in (
            ("--swiglu", cfg.swiglu),
            ("--disable-bias-linear", not cfg.add_bias_linear),
            ("--add-qkv-bias", cfg.add_qkv_bias),
            ("--qk-layernorm", cfg.qk_layernorm),
            ("--untie-embeddings-and-output-weights", cfg.untie_embeddings_and_output_weights),
        )
        if on
    ]
    if cfg.rope_scaling:
        flags.append(f"--rope-scaling {rope_scaling_flag(cfg.rope_scaling)}")
    return flags + _moe_flags(cfg)


def _moe_flags(cfg: TransformerConfig) -> List[str]:
    """The MoE flags of ``cfg`` (none for a dense model)."""
    if not cfg.num_moe_experts:
        return []
    freq = cfg.moe_layer_freq
    flags = [
        f"--num-experts {cfg.num_moe_experts}",
        f"--moe-router-topk {cfg.moe_router_topk}",
        f"--moe-ffn-hidden-size {cfg.moe_ffn_hidden_size}",
        f"--moe-layer-freq {freq if isinstance(freq, int) else '[' + ','.join(map(str, freq)) + ']'}",
    ]
    if cfg.moe_shared_expert_intermediate_size:
        flags.append(f"--moe-shared-expert-intermediate-size {cfg.moe_shared_expert_intermediate_size}")
    if cfg.moe_router_pre_softmax:
        flags.append("--moe-router-pre-softmax")
    return flags


def check_compatible(hf_cfg: TransformerConfig, run_cfg: TransformerConfig, where: str) -> None:
    """Raise listing every architecture field where the run differs from the HF model."""
    diffs = [
        f"{f}={getattr(run_cfg, f)!r} (the model has {getattr(hf_cfg, f)!r})"
        for f in ARCH_FIELDS
        if getattr(hf_cfg, f) != getattr(run_cfg, f)
    ]
    if diffs:
        raise ValueError(
            f"{where} does not match this run's model: "
            + "; ".join(diffs)
            + ". The model's flags: "
            + " ".join(model_flags(hf_cfg))
        )


@torch.no_grad()
def init_from_hf(
    model: Union[GPTModel, Sequence[GPTModel]],
    hf_dir: str,
    *,
    mean_init_ids: Iterable[int] = (),
    num_real_tokens: Optional[int] = None,
    running_mode: Optional[RunningMode] = None,
) -> dict:
    """Copy the HF model in ``hf_dir`` into the plain GPTModel ``model`` (in place), or into
    this pipeline rank's chunks (a list): each takes its own layers from the full state dict
    (chunks name their layers with global numbers), the last stage's tied output layer the
    embedding's rows.

    ``mean_init_ids``: vocabulary rows (e.g. an added [MASK]) to set to the mean embedding
    like the rows beyond the HF vocabulary; ``num_real_tokens``: rows the mean is taken
    over (default all HF rows); ``running_mode``: the run's, checked against the model's
    (``dream.check_running_mode``). Returns {"hf_vocab_size", "mean_rows"}."""
    # A list: this pipeline rank's chunks (the trainer's model before wrapping at pp > 1).
    chunks = cast(List[GPTModel], list(model) if isinstance(model, (list, tuple)) else [model])
    where = f"--hf-init {hf_dir}"
    hf = read_hf_config(hf_dir)
    if running_mode is not None:
        dream.check_running_mode(hf, RunningMode(running_mode), where)
    ours = chunks[0].config
    theirs = transformer_config_from_hf(hf, where, seq_length=ours.seq_length)
    check_compatible(theirs, ours, where)
    sd = _megadlms_tensors(hf_dir, hf, theirs, where)
    hf_vocab = theirs.vocab_size
    real = num_real_tokens or hf_vocab
    mean_rows = sorted({*range(hf_vocab, ours.vocab_size), *mean_init_ids})
    for chunk in chunks:
        _copy_into(chunk, sd, mean_rows, real, where)
    return {"hf_vocab_size": hf_vocab, "mean_rows": mean_rows}


def _megadlms_tensors(
    hf_dir: str, hf: dict, theirs: TransformerConfig, where: str
) -> Dict[str, torch.Tensor]:
    """The full HF model in ``hf_dir`` under GPTModel's names (the whole model, every layer)."""
    tensors = load_hf_tensors(hf_dir)
    if hf.get("model_type") == llada.MODEL_TYPE:
        tensors = _renamed(llada.to_llama_names, tensors, hf, where)
    if not theirs.untie_embeddings_and_output_weights:
        tensors.pop("lm_head.weight", None)  # some tied exports store the copy anyway
    try:
        moe: Dict[str, torch.Tensor] = {}
        if hf.get("model_type") == lladamoe.MODEL_TYPE:
            tensors, moe = lladamoe.split_experts(tensors, hf)
        sd = {**hf_to_megadlms(tensors, theirs), **moe}
    except KeyError as exc:
        raise ValueError(f"{where}: {exc.args[0]}") from exc
    # Names no part of the model has (each part is checked strictly by the chunk that holds it).
    stray = [k for k in sd if _part(k, theirs.num_layers) is None]
    if stray:
        raise ValueError(f"{where}: tensors do not match the model: unexpected {sorted(stray)[:5]}")
    return sd


def _part(name: str, num_layers: int) -> Optional[Union[str, int]]:
    """Which part of the model holds tensor ``name``: its layer index, "pre" (embedding), "post"
    (final norm, output layer), or None (no part: not a GPTModel tensor)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"] and len(parts) > 3 and parts[2].isdigit():
        return int(parts[2]) if int(parts[2]) < num_layers else None
    if parts[0] == "embedding":
        return "pre"
    if parts[0] == "output_layer" or parts[:2] == ["decoder", "final_layernorm"]:
        return "post"
    return None


def _holds(pipe: PipelineChunk, part: Optional[Union[str, int]], num_layers: int) -> bool:
    """Whether pipeline chunk ``pipe`` holds model part ``part`` (:func:`_part`)."""
    if isinstance(part, int):
        return part in pipe.layer_range(num_layers)
    return pipe.pre_process if part == "pre" else pipe.post_process and part == "post"


def _copy_into(
    chunk: GPTModel, sd: Dict[str, torch.Tensor], mean_rows: List[int], real: int, where: str
) -> None:
    """Fill (pipeline chunk or whole model) ``chunk`` from full state dict ``sd``: its own
    tensors, each cut to this rank's tp / ep shard by its declared sharding."""
    # Every tensor of the chunk, each as its FULL logical shape: at tp / ep > 1 the model holds shards,
    # which are cut from the full tensors below (the declared sharding of each parameter).
    params = dict(chunk.named_parameters(remove_duplicate=False))
    target = {k: params.get(k, v) for k, v in chunk.state_dict().items()}
    pipe, n = chunk.pipeline, chunk.config.num_layers
    owned = {k: v for k, v in sd.items() if _holds(pipe, _part(k, n), n)}
    tied = target.get("output_layer.weight")
    if tied is not None and sharding_of(tied).tied_copy and "output_layer.weight" not in owned:
        # The last stage's copy of a tied embedding: the same rows (and mean rows) as the first stage's.
        owned["output_layer.weight"] = sd["embedding.word_embeddings.weight"]
    missing, unexpected = set(target) - set(owned), set(owned) - set(target)
    if missing or unexpected:
        raise ValueError(
            f"{where}: tensors do not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    tp = chunk.tp
    for name, src in owned.items():
        dst = target[name]
        full = _full_tensor(
            name, src, full_shape(dst, tp.size, tp.ep_size), dst.dtype, mean_rows, real, where
        )
        dst.data.copy_(local_from_full(full, dst, tp.group, tp.expert_group))


def _renamed(rename, tensors: Dict[str, torch.Tensor], hf: dict, where: str) -> Dict[str, torch.Tensor]:
    try:
        return rename(tensors, hf)
    except KeyError as exc:
        raise ValueError(f"{where}: {exc.args[0]}") from exc


def _full_tensor(
    name: str, src: torch.Tensor, shape, dtype: torch.dtype, mean_rows: List[int], real: int, where: str
) -> torch.Tensor:
    """The model's full logical tensor ``name`` (of ``shape``) from the HF tensor ``src``."""
    if name not in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if tuple(shape) != tuple(src.shape):
            raise ValueError(f"{where}: {name} has shape {tuple(src.shape)}, the model {tuple(shape)}")
        return src
    # Vocab sizes differ (our padding, an added mask, HF's own padding): copy the common rows.
    full = torch.empty(shape, dtype=dtype)
    n = min(shape[0], src.shape[0])
    full[:n] = src[:n]
    if mean_rows:
        # Mean over real tokens only (HF's padding rows are untrained), summed in fp64 not bf16.
        full[mean_rows] = src[:real].to(torch.float64).mean(0).to(dtype)
    return full
