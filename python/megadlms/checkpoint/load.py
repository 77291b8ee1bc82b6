"""Restoring a run: the optimizer state, the RNG states and, in one call in the only safe
order, everything a resumed run needs (:func:`load_checkpoint`). The weights are read by
read.py's :func:`~megadlms.checkpoint.read.load_model_state`."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict

import torch

from megadlms.common.dtensor import is_dtensor
from megadlms.common.enums import CkptFormat
from megadlms.distributed.wrappers import unwrap_model

from .format import join_state, tensor_paths
from .integrity import verify_checkpoint
from .layout import SINGLE, ParallelLayout
from .optim_state import has_sharded_state, load_sharded, sharded_reads
from .paths import read_common
from .pipeline import own_skeleton, shared_copies
from .read import load_model_state, read_tensors, tensor_shapes
from .rng import same_layout, set_rng_state
from .tensor_parallel import entry_view, full_shape_of, named_params

_STATE_PREFIX = "optimizer/state/"


@dataclasses.dataclass
class TrainState:
    """Where a restored run continues (what :func:`load_checkpoint` read)."""

    iteration: int
    consumed_samples: int
    extra: dict
    rng_restored: bool
    common: dict


def _optimizer_reads(ckpt: str, skel, shapes, params, layout: ParallelLayout) -> Dict[str, tuple]:
    """``key -> (destination, what DCP reads into)`` for every optimizer tensor of this rank:
    destinations of the stored dtype shaped like their parameters' local tensors, read through
    views of this rank's pieces; shapes checked against the parameters' full shapes."""
    reads: Dict[str, tuple] = {}
    for path, key in tensor_paths(skel):
        shape, dtype = shapes[key]
        # Skeleton paths are ("state", fqn, name): only those entries belong to a parameter.
        p = params.get(path[1]) if len(path) >= 3 and path[0] == "state" else None
        # 0-d entries (Adam's step) are per-parameter scalars, never sharded: no shape to compare.
        if p is None or len(shape) == 0:
            dst = torch.empty(shape, dtype=dtype)
            reads[key] = (dst, dst)
            continue
        # FSDP2 at tp = 1 reads straight into a DTensor sharded like p (else p's local shape).
        full_dtensor = is_dtensor(p) and tuple(p.shape) == shape
        dst = torch.empty_like(p, dtype=dtype) if full_dtensor else torch.empty(p.shape, dtype=dtype)
        view = entry_view(key, dst, p, layout.tp_group, layout.ep_group)
        if full_shape_of(view) != shape:
            raise RuntimeError(
                f"checkpoint {ckpt}: optimizer state {key[len(_STATE_PREFIX) :]} has shape {shape} "
                f"but parameter {path[1]}'s full shape is {full_shape_of(view)}; the model flags differ "
                "from the checkpoint's"
            )
        reads[key] = (dst, view)
    return reads


def load_optimizer_state(ckpt: str, optimizer, model, *, layout: ParallelLayout = SINGLE) -> None:
    """Load the optimizer state of ``ckpt`` into ``optimizer`` (built for ``model``).
    Tensors of FSDP2 parameters are read straight into DTensors sharded like them; of a
    TP-sharded parameter only this rank's shard is read, of an expert parameter only this
    rank's experts (``layout``; views.py). Only this rank's parameters' state is read (any pipeline layout; a
    tied-embedding copy takes the embedding's)."""
    common = read_common(ckpt)
    skel = common.get("optimizer")
    if skel is None:
        raise RuntimeError(
            f"checkpoint {ckpt} holds no optimizer state; pass --no-load-optim "
            "(or --finetune) to load only the weights"
        )
    shapes = tensor_shapes(ckpt, common)
    params = named_params(unwrap_model(model))
    # Only this rank's parameters: another pipeline stage's state is not read at all.
    skel = own_skeleton(skel, set(params), shared_copies(params))
    sharded = None
    if common["ckpt_format"] == CkptFormat.TORCH_DIST and has_sharded_state(optimizer):
        # Only this rank's pieces are read (the distributed optimizer's flat ranges included).
        sharded = sharded_reads(skel, shapes, optimizer, params, layout.tp_group, layout.ep_group)
    reads = sharded if sharded is not None else _optimizer_reads(ckpt, skel, shapes, params, layout)
    read_tensors(ckpt, common, {k: view for k, (_, view) in reads.items()})
    if sharded is not None:
        load_sharded(optimizer, skel, reads)
        return
    optimizer.load_state_dict(join_state(skel, {k: dst for k, (dst, _) in reads.items()}))


def load_rng_state(ckpt: str, *, layout: ParallelLayout = SINGLE) -> bool:
    """Restore this rank's RNG states (and the layout's tracker streams, when saved); False
    (nothing changed) when the checkpoint was written by a different layout -- world size,
    tp (whose ranks must share their default stream), pp or ep -- or without RNG states."""
    common = read_common(ckpt)
    path = os.path.join(ckpt, "rng", f"rank_{layout.rank}.pt")
    if not common.get("rng_saved") or not same_layout(common, layout.world, layout.tp, layout.pp, layout.ep):
        return False
    if not os.path.isfile(path):
        return False
    set_rng_state(torch.load(path, map_location="cpu", weights_only=True), layout.rng_tracker)
    return True


def load_checkpoint(
    ckpt: str,
    *,
    model,
    optimizer=None,
    scheduler=None,
    restore_optimizer: bool = True,
    load_rng: bool = True,
    override_scheduler: bool = False,
    model_config=None,
    layout: ParallelLayout = SINGLE,
) -> TrainState:
    """Restore everything a run needs from checkpoint dir ``ckpt``, in one place and in
    the only safe order (collective under DTensor / distributed-optimizer layouts):

    1. the weights into ``model`` (our wrapper, any data-parallel size and layout);
    2. ``optimizer``: its saved state when ``restore_optimizer``, else its main params
       are refreshed from the loaded weights (``--finetune`` / ``--no-load-optim``);
    3. ``scheduler`` (with ``restore_optimizer``; ``override_scheduler`` keeps its flags);
    4. this rank's RNG states (and the tracker's streams) when ``load_rng`` and the layout
       (world size, tp, pp, ep) matches.

    ``layout``: this run's model-parallel groups; the checkpoint may come from any tp, pp, ep.
    Returns the counters to continue from; ``model_config`` (a ``TransformerConfig.to_dict()``)
    is checked against the checkpoint's record first, and every file is verified against the
    sizes and checksums recorded at save time (``CheckpointCorruptError`` names the file)."""
    # Verify before touching the model: a corrupt file must not leave it half loaded.
    verify_checkpoint(ckpt, read_common(ckpt))
    common = load_model_state(ckpt, model, model_config=model_config, layout=layout)
    if optimizer is not None:
        if restore_optimizer:
            load_optimizer_state(ckpt, optimizer, model, layout=layout)
        else:
            # Fresh optimizer: its fp32 main params must start from the loaded weights.
            optimizer.reload_model_params()
    if scheduler is not None and restore_optimizer and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"], override=override_scheduler)
    # RNG last, so no random draw made while loading the rest can shift the restored streams.
    rng = bool(load_rng) and load_rng_state(ckpt, layout=layout)
    return TrainState(
        iteration=int(common["iteration"]),
        consumed_samples=int(common["consumed_samples"]),
        extra=dict(common.get("extra", {})),
        rng_restored=rng,
        common=common,
    )
