"""From command-line flags to the typed run configuration: the one boundary.

    config = parse_config(argv, world_size=...)    # RunConfig (training/config.py)
    args = parse_args(argv, world_size=...)        # the validated argparse.Namespace

The parser itself is ``flags.py``. Here:

* :func:`cross_flag_problems`: the rules that span several flags (unsupported features,
  the FSDP2 and nccl_ext rules), worded with the flags;
* :func:`build_run_config`: namespace -> :class:`RunConfig`; every dataclass checks its
  own fields and fills its own derived defaults, naming fields, and :func:`flag_message`
  maps those names back to flags.

Every problem of a command line is reported in one ``ValueError`` (one line each), before
any process group exists, so a bad flag fails fast and identically on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Callable, Dict, List, Optional

import torch

from megadlms.config_errors import ConfigError
from megadlms.data import TokenizerConfig
from megadlms.diffusion import DiffusionConfig
from megadlms.distributed import DistributedDataParallelConfig
from megadlms.distributed.fsdp2 import fsdp2_config_problems, mixed_precision_policy, torch_supports_fsdp2
from megadlms.models import TransformerConfig
from megadlms.models.config import expert_parallel_problems, tensor_parallel_problems
from megadlms.optimizer import OptimizerConfig
from megadlms.parallel.groups import check_instances
from megadlms.pipeline import stage_layers

from .flags import build_parser
from .megatron_compat import UNSUPPORTED, WANDB_DESTS, WITHOUT_EFFECT
from .run_config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)

__all__ = ["build_parser", "build_run_config", "parse_args", "parse_config", "validate_args"]

# Config fields whose flag is not simply "--" + the field name with dashes.
_FIELD_FLAG_OVERRIDES = {
    "mask_eps": "--difflm-mask-eps",
    "p_mask": "--difflm-p-mask",
    "varilen_prob": "--difflm-varilen-prob",
    "eval_mc_samples": "--difflm-eval-mc-samples",
    "mask_token_id": "--mask-token",
    "objective": "--difflm-objective",
    "attention": "--attention-mask-type",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "bucket_size": "--ddp-bucket-size",
    "average_in_collective": "--ddp-average-in-collective",
    "add_bias_linear": "--disable-bias-linear",
    "num_moe_experts": "--num-experts",
}
# Field names that are also plain English words in messages: never rewritten.
_NOT_MAPPED = {"optimizer"}


def _field_flags() -> Dict[str, str]:
    flags = {}
    for action in build_parser()._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in _NOT_MAPPED:
            flags.setdefault(action.dest, long[0])
    flags.update(_FIELD_FLAG_OVERRIDES)
    return flags


_FIELD_FLAGS = _field_flags()
_FIELD_RE = re.compile(
    r"\b(" + "|".join(sorted(map(re.escape, _FIELD_FLAGS), key=len, reverse=True)) + r")\b"
)


def flag_message(message: str) -> str:
    """A config error worded with field names, reworded with the flags that set them."""
    return _FIELD_RE.sub(lambda m: _FIELD_FLAGS[m.group(1)], message)


def _default_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------------------- cross-flag rules
def _unsupported_problems(args) -> List[str]:
    out = []
    for dest, flag, off in UNSUPPORTED:
        value = getattr(args, dest, off)
        if value != off:
            shown = "" if isinstance(value, bool) else f" {value}"
            fix = "remove it" if off in (None, False) else f"remove it (or set it to {off})"
            out.append(f"{flag}{shown} is not supported yet by megadlms: {fix}")
    if args.attention_mask_type == "block_causal":
        out.append(
            "--attention-mask-type block_causal needs MegaDLMs' conditional (block diffusion) mode, "
            "which megadlms does not have: use no_mask or causal"
        )
    return out + _megadlms_problems(args)


def _megadlms_problems(args) -> List[str]:
    out = []
    if args.tokenizer_model and args.tokenizer_type == "ByteTokenizer":
        out.append(
            f"--tokenizer-model {args.tokenizer_model} is given with --tokenizer-type ByteTokenizer, "
            "which reads no model: drop --tokenizer-type (HuggingFaceTokenizer is the default with "
            "--tokenizer-model) or drop --tokenizer-model"
        )
    if args.core_attn_implementation == "FlexAttention" and args.attention_dropout > 0:
        out.append(
            f"--core-attn-implementation FlexAttention has no attention dropout: add --attention-dropout 0 "
            f"(got {args.attention_dropout}) or use TEDotProductAttention"
        )
    if args.core_attn_implementation == "FlexAttention" and not torch.cuda.is_available():
        out.append(
            "--core-attn-implementation FlexAttention needs CUDA: torch's flex_attention has no CPU "
            "backward; use TEDotProductAttention (SDPA with a block mask) on CPU"
        )
    if args.checkpoint_steps is not None:
        try:
            _checkpoint_steps(args)
        except ValueError:
            out.append(f"--checkpoint-steps {args.checkpoint_steps!r}: expected comma-separated integers")
    return out


def _checkpoint_steps(args) -> tuple:
    text = args.checkpoint_steps
    return tuple(int(x) for x in text.split(",") if x.strip()) if text else ()


def _fsdp2_problems(args, ddp: Optional[DistributedDataParallelConfig]) -> List[str]:
    """Megatron's rules for --use-torch-fsdp2, each with its fix."""
    out = []
    for flag, value in (
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        ("--expert-model-parallel-size", args.expert_model_parallel_size),
    ):
        if value != 1:
            out.append(f"--use-torch-fsdp2 requires {flag} 1 (got {value})")
    if getattr(args, "num_experts", None) is not None:
        out.append(
            f"--use-torch-fsdp2 does not shard mixture-of-experts layers (--num-experts {args.num_experts}): "
            "drop --use-torch-fsdp2 (DDP, optionally with --use-distributed-optimizer and "
            "--expert-model-parallel-size) or drop --num-experts"
        )
    if ddp is not None:  # the wrapper's own rule (FSDP2 shards the optimizer state itself)
        out += [flag_message(p) for p in fsdp2_config_problems(ddp, who="use_torch_fsdp2")]
    if args.gradient_accumulation_fusion:
        out.append(
            "--use-torch-fsdp2 is incompatible with gradient accumulation fusion: "
            "add --no-gradient-accumulation-fusion"
        )
    if args.ckpt_format != "torch_dist":
        out.append(f"--use-torch-fsdp2 requires --ckpt-format torch_dist (got {args.ckpt_format})")
    if not args.untie_embeddings_and_output_weights:
        out.append(
            "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights "
            "(a tied weight cannot live in two FSDP units)"
        )
    if args.fp16:
        out.append("--use-torch-fsdp2 is incompatible with --fp16: use --bf16 or drop --use-torch-fsdp2")
    if not torch_supports_fsdp2():
        out.append(
            f"--use-torch-fsdp2 requires PyTorch >= 2.4 (found {torch.__version__}): "
            "upgrade torch or drop --use-torch-fsdp2"
        )
    return out


def cross_flag_problems(args, ddp: Optional[DistributedDataParallelConfig] = None) -> List[str]:
    """Every rule that spans flags of different configs (the single-config rules live in
    the dataclasses). Returns the problems, worded with flags."""
    out = _unsupported_problems(args)
    if args.comm_backend == "nccl_ext":
        if args.distributed_backend == "gloo" or not torch.cuda.is_available():
            out.append(
                "--comm-backend nccl_ext needs CUDA GPUs and --distributed-backend nccl: "
                "use --comm-backend torch on CPU"
            )
        if args.use_torch_fsdp2:
            out.append(
                "--comm-backend nccl_ext is for DDP; FSDP2 uses torch.distributed: "
                "drop --comm-backend nccl_ext or --use-torch-fsdp2"
            )
    if args.use_torch_fsdp2:
        out += _fsdp2_problems(args, ddp)
    return out


# ---------------------------------------------------------------------------- namespace -> configs
def _attention(args) -> str:
    mask = args.attention_mask_type
    if args.model_running_mode == "vanilla":  # MegaDLMs' vanilla_forward always runs causal
        return "causal"
    if mask is None:  # a DLM without the flag: bidirectional (MegaDLMs: causal_bottom_right)
        return "bidirectional"
    # causal_bottom_right is causal when queries and keys have the same length (always here)
    return "causal" if mask in ("causal", "causal_bottom_right") else "bidirectional"


def _from_args(cls, args, **explicit):
    """``cls`` built from the flags whose dest equals a field name, plus ``explicit`` values
    for fields whose flag differs (the few mappings that are not one to one)."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(explicit)
    return cls(**kw)


def _model_config(args) -> TransformerConfig:
    return _from_args(
        TransformerConfig,
        args,
        # The vocabulary comes from the tokenizer at build time (RunConfig.with_tokenizer);
        # until then the requested --vocab-size (or 1) stands in so the rest is checked now.
        vocab_size=args.vocab_size or 1,
        # Megatron ignores --num-query-groups without --group-query-attention
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        # fp32 parameters even with --bf16/--fp16 (cast by Float16Module or FSDP2's policy),
        # so every wrapper starts from the same initial weights for a given --seed
        params_dtype=torch.float32,
        attention=_attention(args),
        add_qkv_bias=bool(args.add_qkv_bias),
        num_moe_experts=args.num_experts,
    )


def _diffusion_config(args) -> DiffusionConfig:
    vanilla = args.model_running_mode == "vanilla"
    placeholder = args.mask_token if isinstance(args.mask_token, int) else 0  # real id: with_tokenizer
    return _from_args(
        DiffusionConfig,
        args,
        mask_token_id=-1 if vanilla else placeholder,
        mask_eps=args.difflm_mask_eps,
        p_mask=args.difflm_p_mask,
        varilen_prob=args.difflm_varilen_prob,
        eval_mc_samples=args.difflm_eval_mc_samples,
        objective=args.difflm_objective,
    )


def _data_config(args) -> DataConfig:
    tokenizer = _from_args(TokenizerConfig, args, tokenizer_type=_tokenizer_type(args))
    return _from_args(DataConfig, args, tokenizer=tokenizer)


def _tokenizer_type(args) -> str:
    """MegaDLMs' pretrain_difflm.py defaults to HuggingFaceTokenizer; a run without any
    --tokenizer-model keeps the offline ByteTokenizer."""
    if args.tokenizer_type is not None:
        return args.tokenizer_type
    return "HuggingFaceTokenizer" if args.tokenizer_model else "ByteTokenizer"


def _ddp_config(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        # Megatron: bf16 always reduces gradients in fp32
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32 or args.bf16),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # NaN/Inf steps are skipped by the loop while --nan-skip-limit allows; past it (or with
        # --nan-skip-limit 0) a NaN reduced gradient raises on every rank, naming the parameter.
        check_for_nan_in_grad=bool(args.check_for_nan_in_loss_and_grad) and args.nan_skip_limit == 0,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
        comm_backend=args.comm_backend,
        # the trainer divides the loss by the step's global loss-token count: sum-mode reduction
        calculate_per_token_loss=not args.ddp_average_in_collective,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )


def _training_config(args, data_parallel_size: Optional[int]) -> TrainingConfig:
    return _from_args(
        TrainingConfig,
        args,
        # with an invalid layout the batch rule cannot be checked: the layout error stands alone
        global_batch_size=args.global_batch_size if data_parallel_size else None,
        data_parallel_size=data_parallel_size or 1,
    )


def _checkpoint_config(args) -> CheckpointConfig:
    steps = _checkpoint_steps(args) if not _megadlms_problems(args) else ()
    return _from_args(CheckpointConfig, args, checkpoint_steps=steps)


def _notes(args) -> List[str]:
    notes = [f"{flag}: {why}" for dest, flag, off, why in WITHOUT_EFFECT if getattr(args, dest, off) != off]
    if not args.wandb_project and any(getattr(args, d, None) is not None for d in WANDB_DESTS):
        notes.append("--wandb-*: no Weights & Biases client; the flags are ignored")
    return notes + _megadlms_notes(args)


def _megadlms_notes(args) -> List[str]:
    """Where a MegaDLMs flag array gets a decision made for it at parse time."""
    notes = []
    mask = args.attention_mask_type
    if args.model_running_mode == "vanilla" and mask not in (None, "causal", "causal_bottom_right"):
        notes.append(f"--attention-mask-type {mask}: vanilla mode runs causal attention (as MegaDLMs)")
    if args.model_running_mode == "difflm-noshift" and mask is None:
        notes.append(
            "--attention-mask-type not given: difflm-noshift runs bidirectional (no_mask) attention "
            "(MegaDLMs' default would be causal_bottom_right)"
        )
    if args.tokenizer_type is None and args.tokenizer_model:
        notes.append(
            "--tokenizer-type not given: HuggingFaceTokenizer (MegaDLMs' default) reads --tokenizer-model"
        )
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel: off with --tensor-model-parallel-size 1 (as Megatron)")
    if args.use_torch_fsdp2 and args.gradient_accumulation_fusion is None:
        notes.append(
            "gradient accumulation fusion is off under --use-torch-fsdp2 (FSDP2 has no main_grad buffer)"
        )
    if args.cut_off_varlen_to_seqlen and not args.reset_attention_mask:
        notes.append(
            "--cut-off-varlen-to-seqlen: no effect without --reset-position-ids --reset-attention-mask"
        )
    return notes


def _layout_problems(model, parallel: Optional[ParallelConfig], ddp) -> List[str]:
    """The model shapes the tensor-parallel size must divide (the vocabulary is padded
    later) and the data-parallel size the distributed-optimizer instances must divide."""
    if parallel is None:
        return []
    out = []
    if model is not None:
        tp, sp = parallel.tensor_model_parallel_size, parallel.sequence_parallel
        out += tensor_parallel_problems(model, tp, sp, check_vocab=False)
    if ddp is not None and parallel.data_parallel_size:
        try:
            check_instances(parallel.data_parallel_size, ddp.num_distributed_optimizer_instances)
        except ValueError as exc:
            out.append(str(exc).replace("the data-parallel size", "data_parallel_size"))
    out += _expert_layout_problems(model, parallel, ddp)
    return [flag_message(p) for p in out]


def _expert_layout_problems(model, parallel: ParallelConfig, ddp) -> List[str]:
    """Expert parallelism needs an MoE model whose experts split over ep, and no
    distributed-optimizer instances (ddp_groups.py)."""
    ep = parallel.expert_model_parallel_size
    out = expert_parallel_problems(model, ep) if model is not None else []
    if ep > 1 and ddp is not None and ddp.num_distributed_optimizer_instances > 1:
        out.append(
            f"num_distributed_optimizer_instances {ddp.num_distributed_optimizer_instances} with "
            f"expert_model_parallel_size {ep}: distributed-optimizer instances are not supported with "
            "expert parallelism; use num_distributed_optimizer_instances 1"
        )
    return out


def _pipeline_problems(model, parallel: Optional[ParallelConfig], training, checkpoint) -> List[str]:
    """The pipeline rules that span configs: the layer split over the stages (and chunks)
    and the number of micro-batches the schedule needs (m >= pp for 1F1B, a multiple of pp
    for the interleaved schedule), worded with the flags."""
    if parallel is None or parallel.pipeline_model_parallel_size == 1:
        return []
    pp, out, vp = parallel.pipeline_model_parallel_size, [], None
    if model is not None:
        try:
            vp = parallel.virtual_stages(model.num_layers)
            stage_layers(
                model.num_layers,
                pp,
                vp=vp,
                first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                last_stage_layers=parallel.decoder_last_pipeline_num_layers,
            )
        except ValueError as exc:
            out.append(str(exc))
    if checkpoint is not None and checkpoint.hf_init:
        out.append(
            "hf_init needs pipeline_model_parallel_size 1: convert the model to a checkpoint with "
            "megadlms-import-hf, then --load it with pipeline parallelism (checkpoints reshard)"
        )
    if checkpoint is not None and checkpoint.ckpt_format == "torch":
        out.append(
            "ckpt_format torch (one file written by rank 0) needs pipeline_model_parallel_size 1: "
            "every pipeline stage writes its own tensors with ckpt_format torch_dist (the default)"
        )
    if training is not None and training.global_batch_size and vp is not None:
        t = training
        m = t.num_micro_batches
        count = (
            f"global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} x "
            f"data_parallel_size {t.data_parallel_size}) = {m} micro-batches per step"
        )
        if vp == 1 and m < pp:
            out.append(
                f"{count}: the 1F1B pipeline schedule needs at least pipeline_model_parallel_size {pp}; "
                f"raise global_batch_size to {pp * t.micro_batch_size * t.data_parallel_size} or more"
            )
        elif vp > 1 and m % pp:
            out.append(
                f"{count}: the interleaved pipeline schedule ({vp} virtual stages) needs a multiple of "
                f"pipeline_model_parallel_size {pp}; use a global_batch_size that is a multiple of "
                f"{pp * t.micro_batch_size * t.data_parallel_size}"
            )
    return [flag_message(p) for p in out]


def _collect(problems: List[str], build: Callable):
    """``build()``, or None with its ConfigError's problems (reworded with flags) recorded."""
    try:
        return build()
    except ConfigError as exc:
        problems.extend(flag_message(p) for p in exc.problems)
        return None


def build_run_config(args: argparse.Namespace, world_size: Optional[int] = None) -> RunConfig:
    """The :class:`RunConfig` of parsed flags; one ValueError lists every problem found."""
    world_size = _default_world_size() if world_size is None else world_size
    problems: List[str] = []
    parts = {
        "model": _collect(problems, lambda: _model_config(args)),
        "diffusion": _collect(problems, lambda: _diffusion_config(args)),
        "data": _collect(problems, lambda: _data_config(args)),
        "parallel": _collect(problems, lambda: _from_args(ParallelConfig, args, world_size=world_size)),
        "ddp": _collect(problems, lambda: _ddp_config(args)),
        "optimizer": _collect(problems, lambda: _from_args(OptimizerConfig, args)),
        "schedule": _collect(problems, lambda: _from_args(LRScheduleConfig, args)),
        "checkpoint": _collect(problems, lambda: _checkpoint_config(args)),
        "logging": _collect(problems, lambda: _from_args(LoggingConfig, args, notes=_notes(args))),
    }
    dp = parts["parallel"].data_parallel_size if parts["parallel"] is not None else None
    parts["training"] = _collect(problems, lambda: _training_config(args, dp))
    problems += _layout_problems(parts["model"], parts["parallel"], parts["ddp"])
    problems += _pipeline_problems(parts["model"], parts["parallel"], parts["training"], parts["checkpoint"])
    problems = cross_flag_problems(args, parts["ddp"]) + problems
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"invalid arguments ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}")
    return RunConfig(vocab_divisible_by=args.make_vocab_size_divisible_by, **parts)


def validate_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Check parsed flags (every rule, one error listing all problems); returns the config."""
    return build_run_config(args, world_size)


def parse_config(argv: Optional[List[str]] = None, *, world_size: Optional[int] = None) -> RunConfig:
    """Parse ``argv`` (default sys.argv) into the validated :class:`RunConfig`."""
    return build_run_config(build_parser().parse_args(argv), world_size)


def parse_args(argv: Optional[List[str]] = None, *, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate ``argv``; returns the namespace (``parse_config`` for the configs).

    ``world_size`` defaults to $WORLD_SIZE (set by torchrun) or 1.
    """
    args = build_parser().parse_args(argv)
    build_run_config(args, world_size)
    return args


def fsdp_mixed_precision(config: RunConfig):
    """FSDP2 MixedPrecisionPolicy for --bf16 (fp32 grad reduction), None for fp32 runs."""
    return mixed_precision_policy(config.optimizer.bf16, grad_reduce_in_fp32=True)
