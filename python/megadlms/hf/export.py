"""``megadlms-export-hf --load CKPT --output DIR [--dtype auto|fp32|bf16|fp16]``: a megadlms
checkpoint as a Hugging Face model directory.

DIR receives ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json``), ``config.json`` (``model_type`` "megadlms", ``auto_map``
to the bundled ``modeling_megadlms.py`` for AutoConfig, AutoModel, AutoModelForCausalLM and
AutoModelForMaskedLM, ``mask_token_id``), ``generation_config.json`` (the sampler
settings), the modeling and sampler files and the tokenizer files (with the chat template
and the special tokens it uses, when the run's tokenizer directory has one). Load it as
MegaDLMs' examples/dlm_generation/dlm_inference.py does:

    AutoModelForCausalLM.from_pretrained(DIR, torch_dtype="auto", trust_remote_code=True)

Vocabulary: ``vocab_size`` is the run's vocabulary before Megatron's padding (the model's
recorded ``unpadded_vocab_size``: --vocab-size, else the tokenizer's size; MegaDLMs'
hf_configs write 50289 for its GPT-NeoX tokenizer): the padding rows (whose number depends
on --make-vocab-size-divisible-by and the tensor parallel size) are dropped, so dp and tp
checkpoints of the same weights export the same files, and the export's logits are the
ones megadlms' sampler and scorers cut theirs to (``megadlms.diffusion.vocab``).
Precision: ``--dtype auto`` (default) writes the weights as the run stored them (bf16 for a
--bf16 run: MegaDLMs' conversion writes the bf16 model weights too), so a direct export
and one of a --ckpt-convert-format copy are identical; ``--dtype fp32`` writes a
mixed-precision run's exact fp32 main parameters where the checkpoint has them (a
conversion without optimizer state keeps only the bf16 weights).

The checkpoint may be of either format (torch_dist, torch), from any wrapper and any
data-parallel size: it is read by ``megadlms.checkpoint.load_model_state``, the loader every
megadlms tool uses. Needs ``safetensors`` (``pip install megadlms[hf]``), not transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, Optional, Sequence

import torch

from megadlms.checkpoint import open_checkpoint, tensor_shapes, tokenizer_record
from megadlms.common.enums import RunningMode
from megadlms.generate import load_for_inference, running_mode
from megadlms.models import TransformerConfig

from . import dream, llada, lladamoe
from .mapping import megadlms_to_hf
from .tokenizer_files import write_tokenizer_files

REMOTE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote")
REMOTE_FILES = ("modeling_megadlms.py", "generation_megadlms.py")
MEGADLMS_FORMAT = "megadlms"  # the default: our config and remote code (hf/remote/)
LLADA_FORMAT = "llada"  # --format llada: LLaDA's tensor names and config (hf/llada.py)
DREAM_FORMAT = "dream"  # --format dream: Dream's DreamModel config, Qwen2 names (hf/dream.py)
LLADAMOE_FORMAT = "lladamoe"  # --format lladamoe: LLaDA-MoE's config and names (hf/lladamoe.py)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EMBEDDING_KEY = "model/embedding.word_embeddings.weight"
FORMATS = (MEGADLMS_FORMAT, LLADA_FORMAT, DREAM_FORMAT, LLADAMOE_FORMAT)
SPECIAL_IDS = ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


def hf_config(cfg: TransformerConfig, special: Dict[str, Optional[int]], dtype: torch.dtype) -> dict:
    """config.json of the export (Hugging Face names where one exists)."""
    return {
        "architectures": ["MegaDLMsModelLM"],
        "model_type": "megadlms",
        "auto_map": {
            "AutoConfig": "modeling_megadlms.MegaDLMsConfig",
            "AutoModel": "modeling_megadlms.MegaDLMsModelLM",
            # MegaDLMs' dlm_inference.py loads through AutoModelForCausalLM.
            "AutoModelForCausalLM": "modeling_megadlms.MegaDLMsModelLM",
            "AutoModelForMaskedLM": "modeling_megadlms.MegaDLMsModelLM",
        },
        # Unpadded (cfg is the sliced config): the embedding rows of the export, layout-independent.
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        # head_dim explicitly: kv_channels need not be hidden_size / heads, HF's default guess.
        "head_dim": cfg.kv_channels,
        "max_position_embeddings": cfg.max_position_embeddings,
        "normalization": cfg.normalization,
        "norm_eps": cfg.norm_epsilon,
        "swiglu": cfg.swiglu,
        "add_bias_linear": cfg.add_bias_linear,
        "add_qkv_bias": bool(getattr(cfg, "add_qkv_bias", False)),
        "qk_layernorm": cfg.qk_layernorm,
        "position_embedding_type": cfg.position_embedding_type,
        "rope_theta": float(cfg.rotary_base),
        "attention": cfg.attention,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "initializer_range": cfg.init_method_std,
        "mask_token_id": special.get("mask_token_id"),
        "bos_token_id": special.get("bos_token_id"),
        "eos_token_id": special.get("eos_token_id"),
        "pad_token_id": special.get("pad_token_id"),
        "dtype": str(dtype).replace("torch.", ""),
        # transformers < 4.56 reads torch_dtype="auto" from this key.
        "torch_dtype": str(dtype).replace("torch.", ""),
        # The full config too: re-importing an export rebuilds it exactly, without the HF-name round trip.
        "megadlms_model_config": cfg.to_dict(),
    }


def save_safetensors(tensors: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> list:
    """Write ``tensors`` as one file or as shards of at most ``max_shard_bytes`` (+ index)."""
    from safetensors.torch import save_file

    shards: list = []
    current: Dict[str, torch.Tensor] = {}
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        # `current and`: a tensor larger than the limit still gets a shard of its own, never an empty one.
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        # safetensors refuses views (the q/k/v and gate/up slices); {"format": "pt"} is what
        # transformers checks in the header before loading.
        save_file(
            {k: v.contiguous() for k, v in shard.items()}, os.path.join(out_dir, name), {"format": "pt"}
        )
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _weights_source(load: str, dtype: str):
    """(torch dtype to write, read the fp32 main params?, words for the summary line)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    ckpt, common = open_checkpoint(load)
    shapes = tensor_shapes(ckpt, common)
    stored = shapes[EMBEDDING_KEY][1] if EMBEDDING_KEY in shapes else torch.float32
    target = stored if dtype == "auto" else DTYPES[dtype]
    has_main = any(k.endswith("/fp32_param") for k in shapes)
    # The main params only when the stored weights are less precise than what is asked for.
    use_main = has_main and target != stored
    name = str(stored).replace("torch.", "")
    return target, use_main, "fp32 main params" if use_main else f"the stored {name} weights"


def slice_vocab(tensors: Dict[str, torch.Tensor], vocab: int) -> Dict[str, torch.Tensor]:
    """Drop Megatron's padding rows of the embedding and output layer (rows >= ``vocab``)."""
    out = dict(tensors)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in out:
            if out[name].shape[0] < vocab:
                raise ValueError(f"{name} has {out[name].shape[0]} rows, fewer than the vocabulary's {vocab}")
            out[name] = out[name][:vocab]
    return out


_CODE_FILES = {
    LLADA_FORMAT: llada.CODE_FILES,
    DREAM_FORMAT: dream.CODE_FILES,
    LLADAMOE_FORMAT: lladamoe.CODE_FILES,
}


def _check_format(fmt: str, llada_code: Optional[str]) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if llada_code and fmt not in _CODE_FILES:
        raise ValueError(
            "--llada-code is for --format llada / dream / lladamoe (the directory of their modeling files)"
        )
    if llada_code:
        missing = [n for n in _CODE_FILES[fmt] if not os.path.isfile(os.path.join(llada_code, n))]
        if missing:
            raise FileNotFoundError(f"--llada-code {llada_code}: no {', '.join(missing)} there")


def _format_config(fmt: str, cfg: TransformerConfig, special, target: torch.dtype, llada_code: Optional[str]):
    """(config.json, [(directory, file)] of the modeling code to copy) of format ``fmt``."""
    if fmt == LLADA_FORMAT:
        config = llada.llada_config(cfg, special, target, llada.auto_map(local=bool(llada_code)))
        return config, [(llada_code, name) for name in llada.CODE_FILES] if llada_code else []
    if fmt == DREAM_FORMAT:
        config = dream.dream_config(cfg, special, target, dream.auto_map(local=bool(llada_code)))
        return config, [(llada_code, name) for name in dream.CODE_FILES] if llada_code else []
    if fmt == LLADAMOE_FORMAT:
        config = lladamoe.lladamoe_config(cfg, special, target, lladamoe.auto_map(local=bool(llada_code)))
        return config, [(llada_code, name) for name in lladamoe.CODE_FILES] if llada_code else []
    return hf_config(cfg, special, target), [(REMOTE_DIR, name) for name in REMOTE_FILES]


def _check_shifted(common: dict, load: str) -> None:
    """--format dream: Dream's tools shift the logits, so only a difflm-shift model is one."""
    mode = running_mode(common)
    if mode is not RunningMode.DIFFLM_SHIFT:
        raise ValueError(
            f"--format dream needs a model trained with --model-running-mode difflm-shift ({load} "
            f"records {mode}): Dream's generate reads token i+1 from position i; use --format llada"
        )


def _check_mode_fits_format(fmt: str, cfg: TransformerConfig, common: dict, load: str) -> None:
    """The exported code must read the model the way it was trained: only Dream's shifts the
    logits, and only ours generates block by block (LLaDA's and Dream's run full-sequence
    attention, which a block-diffusion model never saw)."""
    shifted = running_mode(common) is RunningMode.DIFFLM_SHIFT
    if shifted and fmt != DREAM_FORMAT:
        raise ValueError(
            f"{load} is a difflm-shift model (logits at i predict token i+1): export it with "
            f"--format dream; the {fmt} format's code reads token i from position i"
        )
    if cfg.num_moe_experts and fmt != LLADAMOE_FORMAT:
        raise ValueError(
            f"{load} is a mixture-of-experts model: export it with --format lladamoe (LLaDA-MoE's "
            f"format); the {fmt} format's code has dense MLPs only"
        )
    if cfg.difflm_block_size is not None and (fmt != MEGADLMS_FORMAT or shifted):
        raise ValueError(
            f"{load} is a block-diffusion model (--difflm-block-size {cfg.difflm_block_size}): only the "
            "default format (--format megadlms) of an unshifted model generates block by block; "
            "a shifted block model is not exportable yet (use megadlms-generate)"
        )


def _check_exportable(fmt: str, cfg: TransformerConfig, common: dict, load: str) -> None:
    """Raise naming what format ``fmt`` cannot express of checkpoint ``load``'s model."""
    if cfg.rope_scaling:
        raise ValueError(
            f"exporting a RoPE-scaled model (rope_scaling {cfg.rope_scaling}) is not implemented: "
            "the exported modeling files compute plain RoPE"
        )
    _check_mode_fits_format(fmt, cfg, common, load)
    if fmt == LLADA_FORMAT:
        llada.check_exportable(cfg)
    if fmt == DREAM_FORMAT:
        dream.check_exportable(cfg)
        _check_shifted(common, load)
    if fmt == LLADAMOE_FORMAT:
        lladamoe.check_exportable(cfg)


def export_hf(
    load: str,
    output: str,
    *,
    dtype: str = "auto",
    max_shard_size_mb: int = 5000,
    steps: Optional[int] = None,
    gen_length: int = 128,
    block_length: Optional[int] = None,
    fmt: str = "megadlms",
    llada_code: Optional[str] = None,
) -> dict:
    """Export checkpoint ``load`` to Hugging Face directory ``output``; returns config.json
    (with ``megadlms_source``: the checkpoint, iteration and which weights were written).
    ``fmt`` "llada" / "dream" / "lladamoe": LLaDA's, Dream's or LLaDA-MoE's format (``hf.llada``,
    ``hf.dream``, ``hf.lladamoe``), with their modeling files copied from ``llada_code`` when given."""

    _check_format(fmt, llada_code)
    target, use_main, source = _weights_source(load, dtype)
    # The inference loader: any format, wrapper and dp, and the checkpoint's own tokenizer record.
    model, tokenizer, common = load_for_inference(load, torch.device("cpu"), prefer_fp32_params=use_main)
    # The real vocabulary the loader gave the model: the one megadlms' own sampler cuts its logits to, so the
    # export and megadlms.diffusion.generate choose from the same rows.
    vocab = model.config.unpadded_vocab_size
    cfg = TransformerConfig.from_dict({**model.config.to_dict(), "vocab_size": vocab})
    _check_exportable(fmt, cfg, common, load)  # before anything is written
    os.makedirs(output, exist_ok=True)
    sd = {k: v.detach().to(target) for k, v in model.state_dict().items()}
    sd, experts = lladamoe.join_experts(sd) if fmt == LLADAMOE_FORMAT else (sd, {})
    tensors = {**slice_vocab(megadlms_to_hf(sd, model.config), vocab), **experts}
    if fmt == LLADA_FORMAT:
        tensors = llada.from_llama_names(tensors)
    if fmt == DREAM_FORMAT:
        tensors = dream.dream_tensors(tensors, cfg)
    save_safetensors(tensors, output, max_shard_size_mb * 1024 * 1024)
    record = tokenizer_record(common)
    special = write_tokenizer_files(tokenizer, record, output, cfg.max_position_embeddings)
    config, remote = _format_config(fmt, cfg, special, target, llada_code)
    generation = {
        # Default steps = gen_length: one token unmasked per step, the slowest, most careful schedule.
        "steps": steps or gen_length,
        "gen_length": gen_length,
        "block_length": block_length or gen_length,
        "cfg_scale": 0.0,
        "remasking": "low_confidence",
    }
    # In config.json too: transformers loads generation_config.json only for GenerationMixin models.
    config["generation_defaults"] = generation
    config["megadlms_source"] = {
        "checkpoint": os.path.abspath(load),
        "iteration": common.get("iteration"),
        "weights": source,
    }
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(output, "generation_config.json"), "w") as f:
        json.dump(
            {**generation, **{k: special.get(k) for k in SPECIAL_IDS}},
            f,
            indent=2,
        )
    for src_dir, name in remote:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(output, name))
    return config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megadlms-export-hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint: a --save directory or one iter_* directory")
    p.add_argument("--output", required=True, help="Hugging Face model directory to write")
    p.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="weight dtype; auto (default): as the run stored them (bf16 for --bf16); "
        "fp32: a bf16 run's fp32 main params",
    )
    p.add_argument("--max-shard-size-mb", type=int, default=5000, help="largest safetensors shard")
    p.add_argument("--gen-length", type=int, default=128, help="generation_config.json: tokens to generate")
    p.add_argument(
        "--steps", type=int, default=None, help="generation_config.json: steps (default gen-length)"
    )
    p.add_argument("--block-length", type=int, default=None, help="generation_config.json: block length")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="megadlms",
        help="megadlms (default: our modeling file); llada: LLaDA's LLaDAModelLM format, for tools "
        "written for LLaDA (Fast-dLLM, dInfer, lm-eval setups); dream: Dream's DreamModel format "
        "(a difflm-shift model); lladamoe: LLaDA-MoE's LLaDAMoEModelLM format (a MoE model)",
    )
    p.add_argument(
        "--llada-code",
        default=None,
        help="--format llada / dream / lladamoe: directory holding their modeling files (LLaDA's "
        "configuration_llada.py and modeling_llada.py; Dream's configuration_dream.py, modeling_dream.py, "
        "generation_utils.py; LLaDA-MoE's configuration_lladamoe.py, modeling_lladamoe.py), copied into "
        "the export (default: config.json's auto_map names them on the Hub, "
        f"{llada.HUB_CODE} / {dream.HUB_CODE} / {lladamoe.HUB_CODE})",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = export_hf(
            args.load,
            args.output,
            dtype=args.dtype,
            max_shard_size_mb=args.max_shard_size_mb,
            steps=args.steps,
            gen_length=args.gen_length,
            block_length=args.block_length,
            fmt=args.format,
            llada_code=args.llada_code,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"megadlms-export-hf: error: {exc}", file=sys.stderr)
        return 2
    if args.format in (DREAM_FORMAT, LLADAMOE_FORMAT):
        name = "Dream" if args.format == DREAM_FORMAT else "LLaDA-MoE"
        print(
            f"exported {args.load} -> {args.output} ({name} format, {config['num_hidden_layers']} layers, "
            f"vocab {config['vocab_size']}, mask_token_id {config.get('mask_token_id')})"
        )
        return 0
    if args.format == LLADA_FORMAT:
        print(
            f"exported {args.load} -> {args.output} (LLaDA format, {config['n_layers']} layers, d_model "
            f"{config['d_model']}, vocab {config['vocab_size']}, {config['torch_dtype']} from "
            f"{config['megadlms_source']['weights']}, mask_token_id {config.get('mask_token_id')})"
        )
        return 0
    print(
        f"exported {args.load} -> {args.output} ({config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, vocab {config['vocab_size']}, {config['attention']}, {config['dtype']} "
        f"from {config['megadlms_source']['weights']}, mask_token_id {config['mask_token_id']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
