"""Checkpoints that reshard: save under any wrapper at any data-parallel size, load
under any other.

Layout (Megatron's names)::

    SAVE/latest_checkpointed_iteration.txt     "20"  (replaced atomically, last)
    SAVE/iter_0000020/common.json              iteration, consumed samples, scheduler,
                                               args (plain dict), model config, and the
                                               non-tensor part of the optimizer state
    SAVE/iter_0000020/.metadata, __*_*.distcp  torch_dist: tensors via torch.distributed.checkpoint
    SAVE/iter_0000020/mp_rank_00/model_optim_rng.pt   torch: one file of full tensors (rank 0)
    SAVE/iter_0000020/rng/rank_{r}.pt          per-rank RNG states

Tensors are stored under flat keys ``model/<fqn>`` and ``optimizer/state/<fqn>/<name>``
(``/`` never occurs in a parameter name) with each parameter's FULL logical shape, but
(format 4) every rank hands DCP only the pieces it holds (views.py): TP / EP shards as
views of their boxes in the full tensor, FSDP2's DTensors, replicated tensors whole (DCP
writes each replica once). Nothing is gathered for torch_dist. DCP maps saved chunks onto
whatever sharding the loading run has, so a checkpoint from any wrapper and tp / pp / ep /
dp layout loads into any other (docs/checkpoints.md). The legacy torch format gathers full
tensors to rank 0 (tensor_parallel.py's :func:`gather_for_save`).

Crash safety: everything is written into ``iter_XXXXXXX.tmp`` and made current by
commit.py. With ``async_group`` the tensors are written in the background
(async_save.py) and the same finishing steps run only once the write has completed.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from megadlms.common.dtensor import is_dtensor
from megadlms.common.enums import CkptFormat
from megadlms.config.run_config import CKPT_FORMATS
from megadlms.distributed.wrappers import unwrap_model

from .async_save import PendingSave, start_async_save
from .commit import finalize_checkpoint, save_error
from .faults import agree
from .format import split_state
from .layout import SINGLE, ParallelLayout
from .optim_state import has_sharded_state, views_of_pieces
from .paths import TORCH_FILE, checkpoint_dir
from .pipeline import (
    drop_elsewhere,
    drop_shared_optimizer_state,
    merged_optimizer_state,
    shared_copies,
)
from .records import RunRecords
from .rng import rng_state
from .tensor_parallel import check_optimizer_keys, entry_view, gather_for_save, named_params, param_of
from .views import ShardView, ViewSavePlanner

FORMAT_VERSION = 4
"""4: sharded entries written as local chunks (DCP resharding); same keys and global shapes as 3.
3: common.json records every file's size and CRC-32 (``files``, checked on load); 2 added the
tokenizer record (``tokenizer``); 1 had only the flags (``args``)."""


def _full(t: torch.Tensor) -> torch.Tensor:
    """Full logical tensor on CPU (a collective for DTensors: every rank must call)."""
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach().cpu()


def _prepare(root: str, iteration: int, rank: int) -> str:
    """Rank 0 creates an empty ``iter_XXXXXXX.tmp`` (a torn one from a crash is removed)."""
    tmp = checkpoint_dir(root, iteration) + ".tmp"
    error = None
    # Only rank 0 touches the directory; the others learn the outcome in agree() below.
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):  # left by a crashed save
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "rng"))
        except OSError as exc:
            error = save_error(exc, root, iteration)
    agree(error, "creating the checkpoint directory")
    return tmp


def _collect(
    model, optimizer, layout: ParallelLayout, ckpt_format: str
) -> Tuple[Dict[str, Union[torch.Tensor, ShardView]], Optional[dict]]:
    """Flat entries to write and the optimizer's JSON skeleton. torch_dist: every sharded
    tensor as a view of its pieces of the full tensor (tensor_parallel.py's
    :func:`entry_view`); torch: TP (and EP) shards gathered to full tensors kept on rank 0.
    Under pipeline parallelism this stage's tensors, without the tied-embedding copy, and the
    skeleton of every stage (pipeline.py)."""
    module = unwrap_model(model)
    # (``model`` may be a state_dict holder, e.g. convert.py's: parameters only matter at tp > 1)
    all_params = named_params(module) if isinstance(module, torch.nn.Module) else {}
    copies = shared_copies(all_params)
    tensors: Dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        if isinstance(v, torch.Tensor) and k not in copies:  # skip extra_state objects
            tensors[f"model/{k}"] = v
    opt_skel = None
    # No parameters, no cuts: at tp = ep = 1 every tensor is already full.
    params = all_params if layout.tp > 1 or layout.ep > 1 else {}
    if optimizer is not None:
        # torch_dist: each rank's own state, no gather (optim_state.py); torch: full tensors.
        sharded = ckpt_format == CkptFormat.TORCH_DIST and has_sharded_state(optimizer)
        state = optimizer.sharded_state_dict() if sharded else optimizer.state_dict()
        if sharded:
            state = views_of_pieces(state, all_params, layout.tp_group, layout.ep_group)
        state = drop_shared_optimizer_state(state, copies)
        if params:
            check_optimizer_keys(state.get("state", {}), params)
        opt_skel = split_state(merged_optimizer_state(state, layout.pp_group), "optimizer", tensors)
        # Other stages' placeholders only had to reach the skeleton; their stage writes the tensors.
        drop_elsewhere(tensors)
    if ckpt_format == CkptFormat.TORCH:
        # Last: the gathers are collectives in sorted key order, so every key must be final here.
        gather_for_save(tensors, params, layout.tp_group, layout.rank == 0, ep_group=layout.ep_group)
        return dict(tensors), opt_skel
    views = {
        k: v
        if isinstance(v, ShardView)
        else entry_view(k, v, param_of(k, params), layout.tp_group, layout.ep_group)
        for k, v in tensors.items()
    }
    return views, opt_skel


def _write(tensors, tmp: str, ckpt_format: str, rank: int, rng: Optional[dict], background: bool) -> None:
    """This rank's files: its RNG state and (unless written in the background) the tensors."""
    if rng is not None:
        torch.save(rng, os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    if background:
        return
    if ckpt_format == CkptFormat.TORCH_DIST:
        # DCP's planner dedups keys replicated across ranks and rank 0 writes the global .metadata.
        dcp.save(
            tensors,
            storage_writer=FileSystemWriter(tmp),
            planner=ViewSavePlanner(),
            no_dist=not dist.is_initialized(),
        )
        return
    full = {k: _full(v) for k, v in tensors.items()}  # collective for DTensors
    if rank == 0:
        os.makedirs(os.path.join(tmp, "mp_rank_00"))
        torch.save(full, os.path.join(tmp, TORCH_FILE))


def _check_format(ckpt_format: str, background: bool, layout: ParallelLayout) -> None:
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"--ckpt-format must be 'torch_dist' or 'torch', got {ckpt_format!r}")
    if background and ckpt_format != CkptFormat.TORCH_DIST:
        raise ValueError("--async-save needs --ckpt-format torch_dist")
    if (
        layout.pp > 1 and ckpt_format == CkptFormat.TORCH
    ):  # one file of full tensors from rank 0: one stage only
        raise ValueError("--ckpt-format torch needs --pipeline-model-parallel-size 1: use torch_dist")


def _finish(root: str, iteration: int, common: dict, rank: int) -> str:
    """Rank 0 makes the written checkpoint current (commit.py); every rank learns the outcome."""
    error = None
    if rank == 0:
        try:
            finalize_checkpoint(root, iteration, common)
        except Exception as exc:  # noqa: BLE001 - shared below so no rank waits forever
            error = save_error(exc, root, iteration)
    agree(error, f"finishing checkpoint iteration {iteration}")
    return checkpoint_dir(root, iteration)


def save_checkpoint(
    root: str,
    iteration: int,
    *,
    model,
    optimizer=None,
    scheduler=None,
    ckpt_format: str = "torch_dist",
    consumed_samples: int = 0,
    extra: Optional[dict] = None,
    records: Optional[RunRecords] = None,
    save_rng: bool = True,
    async_group=None,
    layout: ParallelLayout = SINGLE,
) -> Union[str, PendingSave]:
    """Write ``root/iter_XXXXXXX`` (collective: every rank calls). Returns its path, or with
    ``async_group`` (a gloo process group of all ranks, torch_dist only) a
    :class:`~megadlms.checkpoint.async_save.PendingSave` whose ``wait()`` returns it once
    the background write, the manifest, the rename and ``latest`` are done.

    ``model``: our wrapper or a plain module (its unwrapped state dict is stored).
    ``optimizer``: anything whose ``state_dict()`` has MixedPrecisionOptimizer's format
    (docs/checkpoints.md), or a torch.optim optimizer. ``extra``: a JSON-able dict (the
    training loop's counters); ``records``: what the run was (:class:`RunRecords`).
    ``layout``: this run's model-parallel groups (:class:`ParallelLayout`); TP / EP shards
    are stored as their pieces of the full logical tensors, every pipeline stage writes its own tensors under
    their global names, the tracker's RNG streams join this rank's RNG file.
    """
    _check_format(ckpt_format, async_group is not None, layout)
    records, rank = records or RunRecords(), layout.rank
    tmp = _prepare(root, iteration, rank)
    tensors, opt_skel = _collect(model, optimizer, layout, ckpt_format)
    common = {
        "format_version": FORMAT_VERSION,
        "ckpt_format": str(ckpt_format),  # a plain string in the file, never the enum
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        # The layout recorded here decides whether a later load may restore the RNG states (rng.py).
        "world_size": layout.world,
        "parallel": layout.record(),
        "wrapper": type(model).__name__,
        "model_config": records.model_config or {},
        "tokenizer": records.tokenizer,
        "args": records.args or {},
        "scheduler": scheduler.state_dict() if scheduler else None,
        "optimizer": opt_skel,
        "rng_saved": save_rng,
        "extra": extra or {},
    }
    error = None
    try:
        rng = rng_state(layout.rng_tracker) if save_rng else None
        _write(tensors, tmp, ckpt_format, rank, rng, background=async_group is not None)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank learns of it in agree
        error = save_error(exc, root, iteration)
    # Before the finish: rank 0 must not commit a checkpoint another rank failed to write.
    agree(error, f"saving checkpoint iteration {iteration}")
    if async_group is not None:
        # Only after agree(): a background write must not start for a checkpoint a rank failed to prepare.
        return start_async_save(tensors, tmp, root, iteration, common, async_group)
    return _finish(root, iteration, common, rank)
