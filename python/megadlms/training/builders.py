"""Build the run's pieces from the :class:`~megadlms.config.RunConfig`, once.

Each builder takes the part of the config it needs and returns a plain object (model,
wrapper, optimizer, schedule, datasets, loaders). The wrapper class is chosen in
:func:`wrap_model` and nowhere else; the loop uses only the ``DataParallel`` protocol.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from megadlms.config import DataConfig, LRScheduleConfig, RunConfig, fsdp_mixed_precision
from megadlms.data import build_pretraining_data_loader, build_pretraining_datasets, build_sft_datasets
from megadlms.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    Float16Module,
    ModelChunks,
    TorchFullyShardedDataParallel,
)
from megadlms.models import GPTModel, TransformerConfig
from megadlms.optimizer import OptimizerConfig
from megadlms.optimizer.lr_scheduler import OptimizerParamScheduler
from megadlms.parallel import ParallelGroups, TensorParallelContext, model_parallel_manual_seed

__all__ = [
    "build_datasets",
    "build_loader",
    "build_model",
    "build_parallel",
    "build_scheduler",
    "device_for_rank",
    "wrap_model",
]


_log = logging.getLogger(__name__)


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_parallel(config: RunConfig, device: torch.device, seed: int):
    """The run's process groups (built once, Megatron's rank order) and the model's parallel
    context (the TP group, the MoE layers' EP group); seeds the default generator (the same
    on every rank) and the model-parallel RNG stream (different per TP rank). Collective:
    every rank calls it."""
    par = config.parallel
    groups = ParallelGroups.build(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size,
        dp=par.data_parallel_size,
        device_type=device.type,
        num_distributed_optimizer_instances=config.ddp.num_distributed_optimizer_instances,
        cp=par.context_parallel_size,
    )
    # Default generator shared, model-parallel stream per TP rank: dropout inside sharded regions must differ
    # between shards, outside them it must match.
    tracker = model_parallel_manual_seed(seed, groups.tp.rank, device_type=device.type)
    tp = TensorParallelContext(
        group=groups.tp.group if groups.tp.size > 1 else None,
        sequence_parallel=par.sequence_parallel,
        gradient_accumulation_fusion=bool(par.gradient_accumulation_fusion),
        rng_tracker=tracker,
        expert_group=groups.ep.group if groups.ep.size > 1 else None,  # the MoE layers' EP group
        cp_group=groups.cp.group if groups.cp.size > 1 else None,  # attention gathers K/V over it
    )
    return groups, tp


def build_model(
    config: TransformerConfig,
    *,
    seed: int,
    device: torch.device,
    core_attn_implementation: str = "TEDotProductAttention",
    tp: Optional[TensorParallelContext] = None,
) -> torch.nn.Module:
    """The plain GPTModel (this rank's tensor-parallel shard with ``tp``), initialised from
    ``seed``: the full logical weights are the same at every tensor-parallel size."""
    torch.manual_seed(seed)
    tp = tp if tp is not None else TensorParallelContext()
    return GPTModel(config, core_attn_implementation=core_attn_implementation, tp=tp).to(device)


def wrap_model(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    config: RunConfig,
    groups: Optional[ParallelGroups] = None,
):
    """Apply precision and the data-parallel wrapper chosen by ``parallel.use_torch_fsdp2``;
    DDP reduces over ``groups``' data-parallel group (the world without ``groups``). A list of
    pipeline model chunks gets one DDP each, seen as one wrapper (``ModelChunks``)."""
    if not isinstance(model, torch.nn.Module):  # a pipeline rank's chunks
        return ModelChunks([wrap_model(m, config, groups) for m in model])
    opt: OptimizerConfig = config.optimizer
    ddp: DistributedDataParallelConfig = config.ddp
    if config.parallel.use_torch_fsdp2:
        # FSDP2 applies its own mixed precision; Float16Module would cast the weights it shards in fp32.
        return TorchFullyShardedDataParallel(
            model,
            ddp,
            mixed_precision=fsdp_mixed_precision(config),
            parallel=groups,
            reshard_after_forward=config.parallel.torch_fsdp2_reshard_after_forward,
        )
    if opt.bf16 or opt.fp16:
        model = Float16Module(model, dtype=torch.bfloat16 if opt.bf16 else torch.float16)
    return DistributedDataParallel(model, ddp, parallel=groups)


def build_scheduler(
    schedule: LRScheduleConfig, optimizer_config: OptimizerConfig, optimizer, global_batch_size: int
) -> OptimizerParamScheduler:
    """Megatron's iteration-based schedule, counted in samples (see lr_scheduler)."""
    wsd_iters = schedule.lr_wsd_decay_iters
    return OptimizerParamScheduler(
        optimizer,
        max_lr=optimizer_config.lr,
        min_lr=optimizer_config.min_lr,
        init_lr=schedule.lr_warmup_init,
        # In samples, as Megatron: the scheduler steps by the global batch size.
        lr_warmup_steps=schedule.lr_warmup_iters * global_batch_size,
        lr_decay_steps=schedule.lr_decay_iters * global_batch_size,
        lr_decay_style=schedule.lr_decay_style,
        wsd_decay_steps=None if wsd_iters is None else wsd_iters * global_batch_size,
        lr_wsd_decay_style=schedule.lr_wsd_decay_style,
        weight_decay=optimizer_config.weight_decay,
    )


def build_datasets(
    data: DataConfig,
    tokenizer,
    *,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    test_samples: int = 0,
    with_test: bool = False,
):
    """(train, valid) datasets with the given numbers of samples; (train, valid, test) with
    ``with_test`` (--sft: conversations, no test split)."""
    if data.sft:
        return _sft_datasets(data, seq_length, seed, train_samples, valid_samples, with_test)
    train, valid, test = build_pretraining_datasets(
        data_path=data.data_path,
        train_data_path=data.train_data_path,
        valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path,
        split=data.split,
        seq_length=seq_length,
        seed=seed,
        train_samples=train_samples,
        valid_samples=valid_samples,
        test_samples=test_samples,
        tokenizer=tokenizer,
        data_cache_path=data.data_cache_path,
        eod_mask_loss=data.eod_mask_loss,
        mock=data.mock_data,
    )
    return (train, valid, test) if with_test else (train, valid)


def _sft_datasets(data: DataConfig, seq_length, seed, train_samples, valid_samples, with_test):
    """--sft's (train, valid[, None]): conversations through the tokenizer's chat template. With a
    cache directory rank 0 tokenizes first and the others then read its cache (no rank
    tokenizes twice; the writes are atomic either way)."""
    assert data.tokenizer.tokenizer_model is not None  # --sft's rule (config/rules.py)

    def build():
        return build_sft_datasets(
            data_path=data.data_path,
            split=data.split,
            train_data_path=data.train_data_path,
            valid_data_path=data.valid_data_path,
            tokenizer_model=data.tokenizer.tokenizer_model,
            seq_length=seq_length,
            seed=seed,
            train_samples=train_samples,
            valid_samples=valid_samples,
            packing=data.sft_sequence_packing,
            skip_invalid=data.sft_skip_invalid_rows,
            cache_dir=data.data_cache_path,
        )

    shared_cache = bool(data.data_cache_path) and dist.is_initialized() and dist.get_world_size() > 1
    first = not shared_cache or dist.get_rank() == 0
    if first:
        train, valid = build()
    if shared_cache:
        dist.barrier()
    if not first:
        train, valid = build()
    # (INFO reaches the log on rank 0 only; an empty train split has raised in build)
    _log.info(
        f"sft data: {len(train)} training samples ({train.num_truncated} truncated from the prompt's "
        f"start, {train.num_answer_truncated} in the answer; {train.skipped} invalid rows skipped)"
    )
    return (train, valid, None) if with_test else (train, valid)


def build_loader(
    dataset,
    *,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    seed: int = 0,
) -> Optional[torch.utils.data.DataLoader]:
    """The loader draws from its own generator (``seed``), never the global torch RNG."""
    return build_pretraining_data_loader(
        dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers=num_workers, seed=seed
    )
