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
from megadlms.optimizer import OptimizerConfig

from .config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LRScheduleConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from .flags import build_parser
from .megatron_compat import UNSUPPORTED, WANDB_DESTS, WITHOUT_EFFECT

__all__ = ["build_parser", "build_run_config", "parse_args", "parse_config", "validate_args"]

# Config fields whose flag is not simply "--" + the field name with dashes.
_FIELD_FLAG_OVERRIDES = {
    "mask_eps": "--difflm-mask-eps",
    "p_mask": "--difflm-p-mask",
    "varilen_prob": "--difflm-varilen-prob",
    "eval_mc_samples": "--difflm-eval-mc-samples",
    "mask_token_id": "--mask-token",
    "attention": "--attention-mask-type",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "bucket_size": "--ddp-bucket-size",
    "average_in_collective": "--ddp-average-in-collective",
    "add_bias_linear": "--disable-bias-linear",
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
        out.append("--attention-mask-type block_causal is not supported yet: use no_mask or causal")
    return out


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
    if mask is None:  # Megatron/MegaDLMs: causal for autoregressive runs, none for DLMs
        return "causal" if args.model_running_mode == "vanilla" else "bidirectional"
    # causal_bottom_right is causal when queries and keys have the same length (always here)
    return "causal" if mask in ("causal", "causal_bottom_right") else "bidirectional"


def _model_config(args) -> TransformerConfig:
    # The vocabulary comes from the tokenizer at build time (RunConfig.with_tokenizer); until
    # then the requested --vocab-size (or 1) stands in so every other field is checked now.
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size or 1,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        # Megatron ignores --num-query-groups without --group-query-attention
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=bool(args.swiglu),
        add_bias_linear=bool(args.add_bias_linear),
        qk_layernorm=bool(args.qk_layernorm),
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        # fp32 parameters even with --bf16/--fp16 (cast by Float16Module or FSDP2's policy),
        # so every wrapper starts from the same initial weights for a given --seed
        params_dtype=torch.float32,
        attention=_attention(args),
    )


def _diffusion_config(args) -> DiffusionConfig:
    vanilla = args.model_running_mode == "vanilla"
    placeholder = args.mask_token if isinstance(args.mask_token, int) else 0  # real id: with_tokenizer
    return DiffusionConfig(
        model_running_mode=args.model_running_mode,
        mask_token_id=-1 if vanilla else placeholder,
        mask_eps=args.difflm_mask_eps,
        p_mask=args.difflm_p_mask,
        varilen_prob=args.difflm_varilen_prob,
        seed=args.seed,
        eval_mc_samples=args.difflm_eval_mc_samples,
    )


def _data_config(args) -> DataConfig:
    tokenizer = TokenizerConfig(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        mask_token=args.mask_token,
        vocab_size=args.vocab_size,
    )
    return DataConfig(
        tokenizer=tokenizer,
        data_path=args.data_path,
        split=args.split,
        train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path,
        mock_data=bool(args.mock_data),
        data_cache_path=args.data_cache_path,
        eod_mask_loss=bool(args.eod_mask_loss),
        num_workers=args.num_workers,
    )


def _parallel_config(args, world_size: int) -> ParallelConfig:
    return ParallelConfig(
        world_size=world_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        use_torch_fsdp2=bool(args.use_torch_fsdp2),
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def _ddp_config(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        # Megatron: bf16 always reduces gradients in fp32
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32 or args.bf16),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        overlap_param_gather=bool(args.overlap_param_gather),
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        # NaN/Inf steps are skipped by the loop while --nan-skip-limit allows; past it (or with
        # --nan-skip-limit 0) a NaN reduced gradient raises on every rank, naming the parameter.
        check_for_nan_in_grad=bool(args.check_for_nan_in_loss_and_grad) and args.nan_skip_limit == 0,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=bool(args.ddp_average_in_collective),
        comm_backend=args.comm_backend,
        # the trainer divides the loss by the step's global loss-token count: sum-mode reduction
        calculate_per_token_loss=not args.ddp_average_in_collective,
    )


def _optimizer_config(args) -> OptimizerConfig:
    return OptimizerConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=bool(args.bf16),
        fp16=bool(args.fp16),
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )


def _schedule_config(args) -> LRScheduleConfig:
    return LRScheduleConfig(
        train_iters=args.train_iters,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_warmup_init=args.lr_warmup_init,
        lr_decay_iters=args.lr_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
    )


def _training_config(args, data_parallel_size: Optional[int]) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        # with an invalid layout the batch rule cannot be checked: the layout error stands alone
        global_batch_size=args.global_batch_size if data_parallel_size else None,
        data_parallel_size=data_parallel_size or 1,
        train_iters=args.train_iters,
        seed=args.seed,
        nan_skip_limit=args.nan_skip_limit,
        check_for_nan_in_loss_and_grad=bool(args.check_for_nan_in_loss_and_grad),
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=bool(args.exit_signal_handler),
    )


def _checkpoint_config(args) -> CheckpointConfig:
    return CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        ckpt_format=args.ckpt_format,
        no_save_optim=bool(args.no_save_optim),
        no_load_optim=bool(args.no_load_optim),
        no_save_rng=bool(args.no_save_rng),
        no_load_rng=bool(args.no_load_rng),
        finetune=bool(args.finetune),
        **_reliability_fields(args),
    )


def _reliability_fields(args) -> dict:
    """Automatic resume, verified-checkpoint fallback, asynchronous saves (docs/reliability.md)."""
    return dict(
        auto_resume=bool(args.auto_resume),
        ckpt_fallback=bool(args.ckpt_fallback),
        async_save=bool(args.async_save),
    )


def _notes(args) -> List[str]:
    notes = [f"{flag}: {why}" for dest, flag, off, why in WITHOUT_EFFECT if getattr(args, dest, off) != off]
    if not args.wandb_project and any(getattr(args, d, None) is not None for d in WANDB_DESTS):
        notes.append("--wandb-*: no Weights & Biases client; the flags are ignored")
    return notes


def _logging_config(args) -> LoggingConfig:
    return LoggingConfig(
        log_interval=args.log_interval,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        tensorboard_dir=args.tensorboard_dir,
        metrics_jsonl=args.metrics_jsonl,
        log_params_norm=bool(args.log_params_norm),
        notes=_notes(args),
    )


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
        "parallel": _collect(problems, lambda: _parallel_config(args, world_size)),
        "ddp": _collect(problems, lambda: _ddp_config(args)),
        "optimizer": _collect(problems, lambda: _optimizer_config(args)),
        "schedule": _collect(problems, lambda: _schedule_config(args)),
        "checkpoint": _collect(problems, lambda: _checkpoint_config(args)),
        "logging": _collect(problems, lambda: _logging_config(args)),
    }
    dp = parts["parallel"].data_parallel_size if parts["parallel"] is not None else None
    parts["training"] = _collect(problems, lambda: _training_config(args, dp))
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
