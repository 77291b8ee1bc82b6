"""From command-line flags to the typed run configuration: the one boundary.

    config = parse_config(argv, world_size=...)    # RunConfig (run_config.py)
    args = parse_args(argv, world_size=...)        # the validated argparse.Namespace

The parser itself is the ``flags`` package; the rules that span configs are ``rules.py``. Here
:func:`build_run_config` turns the namespace into a :class:`RunConfig`: every dataclass
checks its own fields and fills its own derived defaults, naming fields, and
:func:`~.messages.flag_message` maps those names back to flags.

Every problem of a command line is reported in one ``ValueError`` (one line each), before
any process group exists, so a bad flag fails fast and identically on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, List, Optional

import torch

from megadlms.common.errors import ConfigError
from megadlms.data import TokenizerConfig
from megadlms.diffusion import DiffusionConfig
from megadlms.distributed import DistributedDataParallelConfig
from megadlms.distributed.fsdp2 import mixed_precision_policy
from megadlms.models import TransformerConfig
from megadlms.optimizer import OptimizerConfig

from .checkpoint_args import apply_checkpoint_args, given_dests
from .flags import build_parser
from .megatron_compat import WANDB_DESTS, WITHOUT_EFFECT
from .messages import FlagError, flag_message
from .profiling_config import ProfilingConfig
from .resilience_config import ResilienceConfig
from .rules import (
    checkpoint_steps,
    cross_flag_problems,
    layout_problems,
    pipeline_problems,
    profiling_problems,
)
from .run_config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    WandbConfig,
)

__all__ = ["build_parser", "build_run_config", "flag_message", "parse_args", "parse_config", "validate_args"]


def _default_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    # Matching by name: a new flag whose dest equals a field name reaches its config with no code here.
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
        # Megatron: --recompute-activations means selective, whatever --recompute-granularity says
        recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
    )


def _diffusion_config(args) -> DiffusionConfig:
    vanilla = args.model_running_mode == "vanilla"
    # --mask-token may be a string ("<|mask|>") that only the tokenizer can turn into an id.
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
        block_size=args.difflm_block_size,
        ar_loss_weight=args.difflm_ar_loss_weight or 0.0,
        noise_clip_low=0.0 if args.difflm_noise_clip_low is None else args.difflm_noise_clip_low,
        noise_clip_high=1.0 if args.difflm_noise_clip_high is None else args.difflm_noise_clip_high,
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
        # Megatron: bf16 reduces gradients in fp32 unless --main-grads-dtype bf16
        grad_reduce_in_fp32=bool(
            args.accumulate_allreduce_grads_in_fp32
            or (args.bf16 and getattr(args, "main_grads_dtype", "fp32") == "fp32")
        ),
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
        use_torch_fsdp2=bool(args.use_torch_fsdp2),
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
    # malformed --checkpoint-steps is reported by rules.py; () keeps the rest checkable
    return _from_args(CheckpointConfig, args, checkpoint_steps=checkpoint_steps(args) or ())


def _notes(args) -> List[str]:
    # getattr with `off` as default: a flag another entry point's parser lacks counts as not given.
    notes = [f"{flag}: {why}" for dest, flag, off, why in WITHOUT_EFFECT if getattr(args, dest, off) != off]
    if not args.wandb_project and any(getattr(args, d, None) is not None for d in WANDB_DESTS):
        notes.append("--wandb-*: no effect without --wandb-project (W&B stays off, as in Megatron)")
    return notes + _megadlms_notes(args)


def _megadlms_notes(args) -> List[str]:
    """Where a MegaDLMs flag array gets a decision made for it at parse time."""
    notes = []
    mask = args.attention_mask_type
    if args.model_running_mode == "vanilla" and mask not in (None, "causal", "causal_bottom_right"):
        notes.append(f"--attention-mask-type {mask}: vanilla mode runs causal attention (as MegaDLMs)")
    if args.model_running_mode in ("difflm-noshift", "difflm-shift") and mask is None:
        notes.append(
            f"--attention-mask-type not given: {args.model_running_mode} runs bidirectional (no_mask) "
            "attention (MegaDLMs' default would be causal_bottom_right)"
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
        "logging": _collect(
            problems,
            lambda: _from_args(LoggingConfig, args, notes=_notes(args), wandb=_from_args(WandbConfig, args)),
        ),
        "resilience": _collect(problems, lambda: _from_args(ResilienceConfig, args)),
        # the torch profiler writes where TensorBoard reads (Megatron: its trace handler's directory)
        "profiling": _collect(
            problems, lambda: _from_args(ProfilingConfig, args, trace_dir=args.tensorboard_dir)
        ),
    }
    # Training is built last: its batch rule needs dp, which only a valid ParallelConfig derives.
    dp = parts["parallel"].data_parallel_size if parts["parallel"] is not None else None
    parts["training"] = _collect(problems, lambda: _training_config(args, dp))
    problems += layout_problems(parts["model"], parts["parallel"], parts["ddp"])
    problems += pipeline_problems(parts["model"], parts["parallel"], parts["training"], parts["checkpoint"])
    problems += profiling_problems(parts["profiling"], parts["parallel"])
    # Flag-level problems first: an unsupported flag usually explains the field errors after it.
    problems = cross_flag_problems(args, parts["ddp"], parts["optimizer"]) + problems
    if problems:
        raise FlagError(problems)
    return RunConfig(vocab_divisible_by=args.make_vocab_size_divisible_by, **parts)


def validate_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Check parsed flags (every rule, one error listing all problems); returns the config."""
    return build_run_config(args, world_size)


def parse_config(
    argv: Optional[List[str]] = None, *, world_size: Optional[int] = None, checkpoint_args=None
) -> RunConfig:
    """Parse ``argv`` (default sys.argv) into the validated :class:`RunConfig`.
    ``checkpoint_args``: with --use-checkpoint-args, the function that finds the checkpoint
    record of a CheckpointConfig (``megadlms.checkpoint.checkpoint_record``; checkpoint_args.py)."""
    args = build_parser().parse_args(argv)
    notes = []
    if args.use_checkpoint_args and checkpoint_args is not None:
        given = given_dests(build_parser(), argv)
        notes = apply_checkpoint_args(args, given, _checkpoint_config, checkpoint_args)
    elif args.use_checkpoint_args:
        notes = ["--use-checkpoint-args: not applied by this caller (megadlms.pretrain applies it)"]
    config = build_run_config(args, world_size)
    config.logging.notes.extend(notes)
    return config


def parse_args(argv: Optional[List[str]] = None, *, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate ``argv``; returns the namespace (``parse_config`` for the configs).

    ``world_size`` defaults to $WORLD_SIZE (set by torchrun) or 1.
    """
    args = build_parser().parse_args(argv)
    build_run_config(args, world_size)
    return args


def fsdp_mixed_precision(config: RunConfig):
    """FSDP2 MixedPrecisionPolicy for --bf16 (fp32 grad reduction), None for fp32 runs."""
    # fp32 reduction always, as Megatron does for bf16: a bf16 all-reduce of many ranks loses bits.
    return mixed_precision_policy(config.optimizer.bf16, grad_reduce_in_fp32=True)
