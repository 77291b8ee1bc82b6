"""The run's configuration as one tree of typed dataclasses (docs/architecture.md).

``megadlms.config.build_run_config`` turns the parsed flags into a
:class:`RunConfig` once, at start-up; nothing below ``training/`` sees argparse. Each
dataclass owns its derived defaults (``__post_init__``) and checks its own fields,
reporting every problem at once by FIELD name (:mod:`megadlms.common.errors`); the CLI
maps field names back to flags. The library layers' configs are reused as they are:
``TransformerConfig`` (models), ``DiffusionConfig`` (diffusion), ``TokenizerConfig``
(data), ``DistributedDataParallelConfig`` (distributed), ``OptimizerConfig`` (optimizer).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megadlms.common.enums import CkptFormat, NonPersistentCkptType, as_member, plain
from megadlms.common.errors import Problems
from megadlms.data import DEFAULT_SPLIT, TokenizerConfig, data_source_problems
from megadlms.diffusion import DiffusionConfig
from megadlms.diffusion.config import block_diffusion_defaults
from megadlms.distributed import DistributedDataParallelConfig
from megadlms.models import TransformerConfig
from megadlms.optimizer import OptimizerConfig
from megadlms.parallel.groups import check_sizes
from megadlms.pipeline import virtual_pipeline_size

from .flags.checkpoint import ckpt_choice_problems
from .profiling_config import ProfilingConfig
from .resilience_config import ResilienceConfig

CKPT_FORMATS = tuple(m.value for m in CkptFormat)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron's padding of the embedding table: round up to divisible_by x tp."""
    # Megatron pads to divisible_by x tp so every TP rank holds an equal, aligned slice of the rows.
    multiple = max(1, divisible_by) * max(1, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


@dataclass(kw_only=True)
class ParallelConfig:
    """World size and the parallel sizes; ``data_parallel_size`` = world / (tp x pp)."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    data_parallel_size: Optional[int] = None
    """Derived when None; when given it must equal world / (tp x cp x pp)."""
    use_torch_fsdp2: bool = False
    """The data-parallel wrapper: PyTorch FSDP2 instead of megadlms DistributedDataParallel."""
    torch_fsdp2_reshard_after_forward: bool = True
    """FSDP2: free each unit's gathered parameters after its forward (re-gathered in backward,
    and again for every micro-batch). False (Megatron's ``--torch-fsdp2-no-reshard-after-forward``,
    "ZeRO-2"): gather once per step and keep the parameters through the step's micro-batches:
    fewer all-gathers and casts, the unsharded 16-bit parameters held for the whole step."""
    distributed_backend: Optional[str] = None
    """torch.distributed backend; None: nccl when CUDA is available, else gloo."""
    distributed_timeout_minutes: int = 10
    sequence_parallel: bool = False
    """Megatron sequence parallelism; switched off (with a note) when tp is 1, as Megatron does."""
    gradient_accumulation_fusion: Optional[bool] = None
    """Weight-gradient GEMMs accumulate straight into ``main_grad``. None: on under DDP
    (Megatron's default), off under FSDP2 (which has no ``main_grad``)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Interleaved 1F1B: decoder layers per model chunk (exclusive with the next field)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved 1F1B: model chunks per pipeline rank; None: 1 (or from the field above,
    see :meth:`virtual_stages`)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Uneven split: decoder layers of the first pipeline stage."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Uneven split: decoder layers of the last pipeline stage."""

    def __post_init__(self) -> None:
        bad = Problems("ParallelConfig")
        self._check_pipeline(bad)
        if self.tensor_model_parallel_size == 1:
            # Sequence parallelism shards over the TP group; without one there is nothing to shard.
            self.sequence_parallel = False
        if self.gradient_accumulation_fusion is None:
            self.gradient_accumulation_fusion = not self.use_torch_fsdp2
        bad.positive(self, "distributed_timeout_minutes")
        tp, pp, ep = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.expert_model_parallel_size,
        )
        try:  # the parallel layer's rule: dp = world / (tp x pp) is derived there, for groups too
            self.data_parallel_size = check_sizes(
                self.world_size, tp, pp, ep, self.data_parallel_size, self.context_parallel_size
            )
        except ValueError as exc:
            bad.add(str(exc))
        if self.distributed_backend is None:
            # Decided here, before init_process_group: the same answer on every rank of a homogeneous job.
            self.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
        bad.check(
            self.distributed_backend in ("nccl", "gloo"),
            f"distributed_backend must be 'nccl' or 'gloo', got {self.distributed_backend!r}",
        )
        bad.raise_if_any()

    _PIPELINE_LAYOUT = (
        "num_layers_per_virtual_pipeline_stage",
        "virtual_pipeline_model_parallel_size",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
    )

    def _check_pipeline(self, bad: Problems) -> None:
        bad.positive(self, *self._PIPELINE_LAYOUT, required=False)
        bad.check(
            self.num_layers_per_virtual_pipeline_stage is None
            or self.virtual_pipeline_model_parallel_size is None,
            "num_layers_per_virtual_pipeline_stage and virtual_pipeline_model_parallel_size are exclusive: "
            "pass one",
        )
        if self.pipeline_model_parallel_size == 1:
            for name in self._PIPELINE_LAYOUT:
                bad.check(
                    getattr(self, name) is None,
                    f"{name} needs pipeline_model_parallel_size > 1 (got 1): drop it or raise "
                    "pipeline_model_parallel_size",
                )

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (1 without interleaving); Megatron derives it from
        ``num_layers_per_virtual_pipeline_stage`` as (num_layers / pp) / that. ValueError
        naming the fields when they do not divide."""
        if self.virtual_pipeline_model_parallel_size is not None:
            return self.virtual_pipeline_model_parallel_size
        per_chunk = self.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return 1
        pp = self.pipeline_model_parallel_size
        uneven = self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        if uneven:
            # Megatron computes chunks as layers / pp / per_chunk, which uneven first/last stages would break.
            raise ValueError(
                "num_layers_per_virtual_pipeline_stage cannot be combined with uneven first/last stages "
                "(decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers): pass "
                "virtual_pipeline_model_parallel_size instead"
            )
        return virtual_pipeline_size(num_layers, pp, num_layers_per_virtual_pipeline_stage=per_chunk)


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch arithmetic, length of the run, NaN handling and exit conditions."""

    micro_batch_size: int = None  # type: ignore[assignment]  # required: __post_init__ rejects None
    global_batch_size: int = None  # type: ignore[assignment]  # None until __post_init__ derives it
    """Sequences per optimizer step; default micro_batch_size x data_parallel_size."""
    data_parallel_size: int = 1
    train_iters: int = None  # type: ignore[assignment]  # required: __post_init__ rejects None
    seed: int = 1234
    nan_skip_limit: int = 10
    """NaN/Inf-loss steps skipped (on every rank) before the run stops."""
    check_for_nan_in_loss_and_grad: bool = True
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    detect_anomaly: bool = False
    """Run forward/backward under torch.autograd.detect_anomaly (--detect-anomaly)."""
    use_torch_compile: bool = False
    """torch.compile each transformer layer (regional compilation, --use-torch-compile)."""
    core_attn_implementation: str = "TEDotProductAttention"
    """Attention kernel: torch SDPA ("TEDotProductAttention") or flex_attention ("FlexAttention")."""

    def __post_init__(self) -> None:
        bad = Problems("TrainingConfig")
        bad.check(
            self.core_attn_implementation in ("TEDotProductAttention", "FlexAttention"),
            "core_attn_implementation must be TEDotProductAttention or FlexAttention, "
            f"got {self.core_attn_implementation!r}",
        )
        bad.positive(self, "micro_batch_size", "train_iters", "data_parallel_size")
        bad.positive(self, "exit_interval", required=False)
        bad.check(self.nan_skip_limit >= 0, f"nan_skip_limit must be >= 0, got {self.nan_skip_limit}")
        mbs, dp = self.micro_batch_size, self.data_parallel_size
        if isinstance(mbs, int) and mbs > 0 and isinstance(dp, int) and dp > 0:
            if self.global_batch_size is None:
                # Megatron's default: one micro-batch per rank per step, no gradient accumulation.
                self.global_batch_size = mbs * dp
            gbs = self.global_batch_size
            bad.check(
                gbs > 0 and gbs % (mbs * dp) == 0,
                f"global_batch_size {gbs} is not a multiple of micro_batch_size {mbs} x data-parallel "
                f"size {dp} = {mbs * dp}: use a multiple of {mbs * dp}",
            )
        bad.raise_if_any()

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank per optimizer step (gradient accumulation)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(kw_only=True)
class LRScheduleConfig:
    """Megatron's iteration-based learning-rate schedule (peak/min lr: OptimizerConfig)."""

    train_iters: int
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of lr_decay_iters (exclusive with lr_warmup_iters)."""
    lr_warmup_init: float = 0.0
    lr_decay_iters: int = None  # type: ignore[assignment]  # None until __post_init__ (train_iters)
    """Default: train_iters."""
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None
    override_opt_param_scheduler: bool = False
    """On resume, keep this schedule instead of the checkpoint's."""

    def __post_init__(self) -> None:
        bad = Problems("LRScheduleConfig")
        if self.lr_decay_iters is None:
            # Megatron: decay over the whole run unless told otherwise; warmup fraction is of the decay span.
            self.lr_decay_iters = self.train_iters
        decay = self.lr_decay_iters
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                bad.add("lr_warmup_fraction and lr_warmup_iters are exclusive: pass one")
            elif decay:
                self.lr_warmup_iters = int(self.lr_warmup_fraction * decay)
        if bad.check(self.lr_warmup_iters >= 0, f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}"):
            bad.check(
                # Warmup at or past the decay end leaves the decay formula dividing by zero or going negative.
                decay is None or self.lr_decay_style == "constant" or not self.lr_warmup_iters >= decay > 0,
                f"lr_warmup_iters {self.lr_warmup_iters} must be smaller than lr_decay_iters {decay}",
            )
        if self.lr_decay_style == "WSD":
            wsd = self.lr_wsd_decay_iters
            if wsd is None or wsd <= 0:
                bad.add("lr_decay_style WSD needs lr_wsd_decay_iters N (length of the final decay)")
            elif decay is not None:
                bad.check(wsd <= decay, f"lr_wsd_decay_iters {wsd} exceeds lr_decay_iters {decay}")
        bad.raise_if_any()


@dataclass(kw_only=True)
class DataConfig:
    """Where the samples come from (Megatron's .bin/.idx blends or mock data)."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data_path: Optional[List[str]] = None
    split: str = None  # type: ignore[assignment]  # None until __post_init__ (DEFAULT_SPLIT)
    """Train/valid/test split of data_path; default Megatron's "969, 30, 1"."""
    train_data_path: Optional[List[str]] = None
    valid_data_path: Optional[List[str]] = None
    test_data_path: Optional[List[str]] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    num_workers: int = 2
    reset_position_ids: bool = False
    """Position ids restart after every end-of-document token (Megatron)."""
    reset_attention_mask: bool = False
    """Document packing: attention only within each document (needs reset_position_ids)."""
    sft: bool = False
    """The paths name conversations (jsonl of {"messages": [...]}, or preprocessed SFT prefixes)."""
    sft_tokenizer_prompt_format: str = "default"
    sft_sequence_packing: bool = False
    sft_skip_invalid_rows: bool = False

    def __post_init__(self) -> None:
        bad = Problems("DataConfig")
        bad.check(
            not self.reset_attention_mask or self.reset_position_ids,
            "reset_attention_mask needs reset_position_ids too (MegaDLMs packs documents only with both)",
        )
        if self.split is None:
            self.split = DEFAULT_SPLIT
        # the data layer owns the source rule (one source, the train split gets data)
        for problem in data_source_problems(
            mock=self.mock_data,
            data_path=self.data_path,
            train_data_path=self.train_data_path,
            valid_data_path=self.valid_data_path,
            test_data_path=self.test_data_path,
            split=self.split,
        ):
            bad.add(problem)
        bad.check(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers}")
        bad.raise_if_any()


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming (docs/checkpoints.md)."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_format: CkptFormat = CkptFormat.TORCH_DIST
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_save_rng: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    """Load weights only; start at iteration 0 with a fresh optimizer and schedule."""
    pretrained_checkpoint: Optional[str] = None
    """Fine-tune from this checkpoint (weights only) when load / save hold none (Megatron's)."""
    checkpoint_steps: Tuple[int, ...] = ()
    """Extra iterations to save at, besides every save_interval (MegaDLMs' --checkpoint-steps)."""
    hf_init: Optional[str] = None
    """Hugging Face model directory the fresh model is initialised from (megadlms.hf.importer)."""
    ckpt_convert_format: Optional[CkptFormat] = None
    """Convert ``load`` to this format into ``ckpt_convert_save``/<format>, then exit."""
    ckpt_convert_save: Optional[str] = None
    auto_resume: bool = True
    """Without load: resume from the latest checkpoint in save when it has one (docs/reliability.md)."""
    ckpt_fallback: bool = False
    """A checkpoint that fails verification: load the newest older one that passes, instead of failing."""
    async_save: bool = False
    """Write torch_dist checkpoints in the background; the next save and the exit wait for it."""
    # Which checkpoint to load and non-persistent saves (flags/checkpoint.py; Megatron's semantics).
    ckpt_step: Optional[int] = None
    use_checkpoint_args: bool = False
    use_tokenizer_model_from_checkpoint_args: bool = True
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[NonPersistentCkptType] = None
    non_persistent_global_ckpt_dir: Optional[str] = None
    non_persistent_local_ckpt_dir: Optional[str] = None

    def __post_init__(self) -> None:
        bad = Problems("CheckpointConfig")
        self.ckpt_format = as_member(CkptFormat, self.ckpt_format)
        self.ckpt_convert_format = as_member(CkptFormat, self.ckpt_convert_format)
        self.non_persistent_ckpt_type = as_member(NonPersistentCkptType, self.non_persistent_ckpt_type)
        for problem in ckpt_choice_problems(self):
            bad.add(problem)
        self.checkpoint_steps = tuple(self.checkpoint_steps)
        bad.check(
            all(isinstance(n, int) and n > 0 for n in self.checkpoint_steps),
            f"checkpoint_steps must be positive iterations, got {list(self.checkpoint_steps)}",
        )
        bad.check(not self.checkpoint_steps or bool(self.save), "checkpoint_steps needs save DIR")
        bad.check(
            not self.async_save or self.ckpt_format == "torch_dist",
            f"async_save needs ckpt_format torch_dist (got {self.ckpt_format})",
        )
        bad.check(
            self.ckpt_format in CKPT_FORMATS,
            f"ckpt_format {self.ckpt_format} is not supported yet: use torch_dist (default) or torch",
        )
        bad.check(self.save is None or self.save_interval is not None, "save needs save_interval N")
        bad.positive(self, "save_interval", required=False)
        bad.check(
            not self.finetune or bool(self.load or self.pretrained_checkpoint),
            "finetune needs load DIR (or pretrained_checkpoint DIR): the weights to start from",
        )
        bad.check(
            self.ckpt_convert_format in (None,) + CKPT_FORMATS,
            f"ckpt_convert_format must be one of {CKPT_FORMATS}, got {self.ckpt_convert_format!r}",
        )
        bad.check(
            self.ckpt_convert_format is None or bool(self.load and self.ckpt_convert_save),
            "ckpt_convert_format needs load DIR (the checkpoint to convert) and ckpt_convert_save DIR",
        )
        bad.check(
            self.hf_init is None or os.path.isdir(self.hf_init),
            f"hf_init {self.hf_init} is not a directory (a Hugging Face model directory with config.json)",
        )
        bad.raise_if_any()


@dataclass(kw_only=True)
class WandbConfig:
    """Megatron's --wandb-* flags (W&B is on when ``wandb_project`` is set)."""

    wandb_project: str = ""
    wandb_exp_name: Optional[str] = None
    wandb_run_id: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_mode: Optional[str] = None
    wandb_tags: Optional[str] = None
    wandb_group: Optional[str] = None
    wandb_notes: Optional[str] = None
    wandb_resume: Optional[str] = None
    wandb_resume_from: Optional[str] = None


@dataclass(kw_only=True)
class LoggingConfig:
    """Progress lines, metrics files and validation (Megatron's logging switches: docs/flags.md)."""

    log_interval: int = 100
    eval_interval: Optional[int] = 1000
    eval_iters: int = 100
    """Validation batches (global) per evaluation; 0 disables validation."""
    tensorboard_dir: Optional[str] = None
    metrics_jsonl: Optional[str] = None
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_throughput: bool = False
    log_progress: bool = False
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    timing_log_level: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)
    notes: List[str] = field(default_factory=list)
    """One-time notices for the start of the run (flags accepted without effect)."""

    def __post_init__(self) -> None:
        bad = Problems("LoggingConfig")
        bad.positive(self, "log_interval")
        bad.positive(self, "tensorboard_log_interval")
        bad.positive(self, "eval_interval", required=False)
        bad.check(self.eval_iters >= 0, f"eval_iters must be >= 0, got {self.eval_iters}")
        bad.raise_if_any()


@dataclass(kw_only=True)
class RunConfig:
    """Everything one pretraining run needs; the trainer hands each part to its layer."""

    model: TransformerConfig
    diffusion: DiffusionConfig
    data: DataConfig
    parallel: ParallelConfig
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig
    schedule: LRScheduleConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    vocab_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this x tensor-parallel size (Megatron's
    --make-vocab-size-divisible-by)."""

    def with_tokenizer(self, tokenizer, checkpoint_vocab: Optional[int] = None) -> RunConfig:
        """The config with the fields only the tokenizer knows filled in: the padded
        ``model.vocab_size``, the real ``model.unpadded_vocab_size`` and
        ``diffusion.mask_token_id`` (called once, at build time).

        ``checkpoint_vocab``: the padded vocabulary of the checkpoint being resumed. Padding
        depends on the tensor-parallel size, so a checkpoint from another tp may have more
        rows than this run would pad to; when this layout can split them (a multiple of tp,
        covering the tokenizer) they are kept -- the same model -- instead of a mismatch."""
        vocab = self.data.tokenizer.vocab_size or tokenizer.vocab_size
        tp = self.parallel.tensor_model_parallel_size
        padded = padded_vocab_size(vocab, self.vocab_divisible_by, tp)
        # Fewer rows than the tokenizer has ids cannot be the same model: then the mismatch is real.
        if checkpoint_vocab and checkpoint_vocab != padded and checkpoint_vocab >= vocab:
            # Not a multiple of tp: the rows cannot be split here, so the ordinary padding (and the mismatch
            # error at load) stands.
            padded = checkpoint_vocab if checkpoint_vocab % tp == 0 else padded
        # The real size travels with the model (checkpoints record it): generation and answer scoring leave
        # the padding rows out without the tokenizer at hand.
        model = dataclasses.replace(self.model, vocab_size=padded, unpadded_vocab_size=vocab)
        vanilla = self.diffusion.model_running_mode == "vanilla"
        diffusion = dataclasses.replace(
            self.diffusion, mask_token_id=-1 if vanilla else tokenizer.mask_token_id
        )
        diffusion.check_vocab(padded)
        return dataclasses.replace(self, model=model, diffusion=diffusion)

    @property
    def precision(self) -> str:
        return "bf16" if self.optimizer.bf16 else "fp16" if self.optimizer.fp16 else "fp32"

    def to_dict(self) -> dict:
        """A JSON-able record of the whole configuration (stored in checkpoints)."""
        d = plain(dataclasses.asdict(self))
        d["model"] = self.model.to_dict()
        if self.resilience == ResilienceConfig():  # off: today's record (checkpoints, metrics) unchanged
            del d["resilience"]
        del d["profiling"]  # a diagnostic that changes no number: not part of the run's record
        for name in block_diffusion_defaults(self.diffusion):  # block diffusion off: today's record too
            del d["diffusion"][name]
        return d
