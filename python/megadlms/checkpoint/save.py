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
(``/`` never occurs in a parameter name) with each parameter's FULL logical shape:
plain tensors for DDP (identical on every rank; DCP writes each once), DTensors for
FSDP2, full tensors gathered by the distributed optimizer (docs/checkpoints.md). DCP
maps saved chunks onto whatever sharding the loading run has, so a
checkpoint from {DDP, DDP + distributed optimizer, FSDP2} at dp=N loads into any of
them at dp=M.

Crash safety: everything is written into ``iter_XXXXXXX.tmp``; rank 0 records every
file's size and CRC-32 (checkpoint_integrity.py), writes common.json last, renames the
directory into place, then replaces the ``latest`` file. A crash (or a full disk) at any
point leaves the previous checkpoint and ``latest`` intact. With ``async_group`` the
tensors are written in the background (checkpoint_async.py) and the same finishing steps
run only once the write has completed.

Safety on load: tensor files are read with ``weights_only=True``; DCP's ``.metadata``
pickle is read with an unpickler that only admits DCP's metadata classes; the rest
is JSON. Nothing else is unpickled.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch < 2.4: no FSDP2 either
    DTensor, distribute_tensor = (), None

from megadlms.distributed.wrappers import unwrap_model
from megadlms.parallel.mappings import group_size

from .checkpoint_faults import agree, find_enospc
from .checkpoint_format import SafeFileSystemReader, join_state, split_state, tensor_paths
from .checkpoint_integrity import CheckpointCorruptError, file_manifest, verify_checkpoint  # noqa: F401
from .checkpoint_paths import (  # noqa: F401
    COMMON_FILE,
    LATEST_FILE,
    TORCH_FILE,
    checkpoint_dir,
    older_checkpoints,
    read_common,
    read_latest_iteration,
    resolve_checkpoint,
)
from .checkpoint_pp import (
    check_stage_keys,
    drop_elsewhere,
    drop_shared_optimizer_state,
    merged_optimizer_state,
    own_skeleton,
    pp_size,
    shared_copies,
    stage_owner,
)
from .checkpoint_records import MODEL_CONFIG_FLAGS, check_model_config, tokenizer_record  # noqa: F401
from .checkpoint_rng import rng_state, same_layout, set_rng_state
from .checkpoint_tp import (
    check_optimizer_keys,
    gather_for_save,
    layout_record,
    named_params,
    read_resharded,
    sharded_full_shape,
    tp_size,
)

FORMAT_VERSION = 3
"""3: common.json records every file's size and CRC-32 (``files``, checked on load); 2 added the
tokenizer record (``tokenizer``); 1 had only the flags (``args``)."""


# ---------------------------------------------------------------------------- helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems do not support directory fsync
        pass


def _write_atomic(path: str, data: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _full(t: torch.Tensor) -> torch.Tensor:
    """Full logical tensor on CPU (a collective for DTensors: every rank must call)."""
    if DTensor and isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


# ---------------------------------------------------------------------------- save
def save_error(exc: BaseException, root: str, iteration: int) -> BaseException:
    """A save failure worded for the user: disk full names the directory and what is intact."""
    full = find_enospc(exc)
    if full is None:
        return exc
    previous = read_latest_iteration(root) if os.path.isdir(root) else None
    intact = (
        f"the previous checkpoint {checkpoint_dir(root, previous)} and {LATEST_FILE} are untouched"
        if previous is not None
        else f"no earlier checkpoint exists; {LATEST_FILE} was not written"
    )
    err = OSError(
        errno.ENOSPC,
        f"saving checkpoint iteration {iteration} to {root} failed: no space left on device "
        f"({full.filename or full}); {intact}. Free space on that filesystem or point --save elsewhere",
    )
    err.__cause__ = exc
    return err


def _prepare(root: str, iteration: int) -> str:
    """Rank 0 creates an empty ``iter_XXXXXXX.tmp`` (a torn one from a crash is removed)."""
    tmp = checkpoint_dir(root, iteration) + ".tmp"
    error = None
    if _rank() == 0:
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
    model, optimizer, tp_group, owner, pp_group=None, ep_group=None
) -> Tuple[Dict[str, torch.Tensor], Optional[dict]]:
    """Flat tensors to write and the optimizer's JSON skeleton; TP (and EP) shards gathered to
    full tensors, each kept only where ``owner(i)`` (checkpoint_tp.py). Under pipeline
    parallelism (``pp_group``) this stage's tensors, without the tied-embedding copy, and the
    skeleton of every stage (checkpoint_pp.py)."""
    module = unwrap_model(model)
    # (``model`` may be a state_dict holder, e.g. ckpt_convert's: parameters only matter at tp > 1)
    all_params = named_params(module) if isinstance(module, torch.nn.Module) else {}
    copies = shared_copies(all_params)
    tensors: Dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        if isinstance(v, torch.Tensor) and k not in copies:  # skip extra_state objects
            tensors[f"model/{k}"] = v
    opt_skel = None
    params = all_params if tp_size(tp_group) > 1 or group_size(ep_group) > 1 else {}
    if optimizer is not None:
        state = drop_shared_optimizer_state(optimizer.state_dict(), copies)
        if params:
            check_optimizer_keys(state.get("state", {}), params)
        opt_skel = split_state(merged_optimizer_state(state, pp_group), "optimizer", tensors)
        drop_elsewhere(tensors)
    gather_for_save(tensors, params, tp_group, owner, ep_group=ep_group)
    return tensors, opt_skel


def finalize_checkpoint(root: str, iteration: int, common: dict) -> str:
    """Rank 0, once every file of ``iter_XXXXXXX.tmp`` is written: record each file's size and
    checksum, write common.json, rename the directory into place, then replace ``latest``."""
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    common = dict(common, files=file_manifest(tmp))
    _write_atomic(os.path.join(tmp, COMMON_FILE), json.dumps(common, indent=1, default=str))
    if os.path.exists(final):  # re-saving the same iteration: swap, then drop the old one
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(os.path.join(root, LATEST_FILE), str(iteration))
    return final


def save_checkpoint(
    root: str,
    iteration: int,
    *,
    model,
    optimizer=None,
    scheduler=None,
    ckpt_format: str = "torch_dist",
    consumed_samples: int = 0,
    args: Optional[dict] = None,
    model_config: Optional[dict] = None,
    tokenizer: Optional[dict] = None,
    extra: Optional[dict] = None,
    save_rng: bool = True,
    async_group=None,
    tp_group=None,
    rng_tracker=None,
    pp_group=None,
    vp: int = 1,
    ep_group=None,
):
    """Write ``root/iter_XXXXXXX`` (collective: every rank calls). Returns its path, or with
    ``async_group`` (a gloo process group of all ranks, torch_dist only) a
    :class:`~megadlms.training.checkpoint_async.PendingSave` whose ``wait()`` returns it once
    the background write, the manifest, the rename and ``latest`` are done.

    ``model``: our wrapper or a plain module (its unwrapped state dict is stored).
    ``optimizer``: anything whose ``state_dict()`` has MixedPrecisionOptimizer's format
    (docs/checkpoints.md), or a torch.optim optimizer. ``args`` / ``model_config`` /
    ``tokenizer`` / ``extra``: JSON-able dicts.

    ``tp_group``: the tensor-parallel group (None: no TP). TP shards of the model and of the
    optimizer state are stored as full logical tensors (gathered over it; torch_dist writes
    each once, ``torch`` writes them from rank 0). ``rng_tracker``: the model-parallel
    :class:`~megadlms.parallel.RNGStatesTracker`, whose streams join this rank's RNG file.
    ``pp_group``: the pipeline-parallel group (None: no PP; ``vp`` model chunks per rank):
    every stage writes its own tensors under their global names (checkpoint_pp.py).
    ``ep_group``: the expert-parallel group (None: no EP); expert parameters and their
    optimizer state are stored under their full [E, ...] shape (gathered over it).
    """
    if ckpt_format not in ("torch_dist", "torch"):
        raise ValueError(f"--ckpt-format must be 'torch_dist' or 'torch', got {ckpt_format!r}")
    if async_group is not None and ckpt_format != "torch_dist":
        raise ValueError("--async-save needs --ckpt-format torch_dist")
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp = _prepare(root, iteration)
    # Who keeps each gathered full tensor: rank 0 writes the torch file; DCP spreads them.
    pp = pp_size(pp_group)
    if pp > 1 and ckpt_format == "torch":
        raise ValueError("--ckpt-format torch needs --pipeline-model-parallel-size 1: use torch_dist")
    owner = stage_owner(rank, world, pp, spread=ckpt_format != "torch")
    tensors, opt_skel = _collect(model, optimizer, tp_group, owner, pp_group, ep_group)
    common = {
        "format_version": FORMAT_VERSION,
        "ckpt_format": ckpt_format,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "world_size": world,
        "parallel": layout_record(world, tp_group, pp, vp, ep_group),
        "wrapper": type(model).__name__,
        "model_config": model_config or {},
        "tokenizer": tokenizer,
        "args": args or {},
        "scheduler": scheduler.state_dict() if scheduler else None,
        "optimizer": opt_skel,
        "rng_saved": save_rng,
        "extra": extra or {},
    }
    error = None
    try:
        if save_rng:
            torch.save(rng_state(rng_tracker), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if async_group is None and ckpt_format == "torch_dist":
            dcp.save(tensors, storage_writer=FileSystemWriter(tmp), no_dist=not dist.is_initialized())
        elif async_group is None:
            full = {k: _full(v) for k, v in tensors.items()}  # collective for DTensors
            if rank == 0:
                os.makedirs(os.path.join(tmp, "mp_rank_00"))
                torch.save(full, os.path.join(tmp, TORCH_FILE))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every rank learns of it in _agree
        error = save_error(exc, root, iteration)
    agree(error, f"saving checkpoint iteration {iteration}")
    if async_group is not None:
        from .checkpoint_async import start_async_save

        return start_async_save(tensors, tmp, root, iteration, common, async_group)
    error, final = None, checkpoint_dir(root, iteration)
    if rank == 0:
        try:
            finalize_checkpoint(root, iteration, common)
        except Exception as exc:  # noqa: BLE001 - shared below so no rank waits forever
            error = save_error(exc, root, iteration)
    agree(error, f"finishing checkpoint iteration {iteration}")
    return final


# ---------------------------------------------------------------------------- load
def _load_torch_file(ckpt: str) -> Dict[str, torch.Tensor]:
    """The torch-format file, memory-mapped (tensors are read from disk when copied)."""
    return torch.load(os.path.join(ckpt, TORCH_FILE), map_location="cpu", weights_only=True, mmap=True)


def _read_tensors(ckpt: str, common: dict, template: Dict[str, torch.Tensor]) -> None:
    """Fill ``template`` (plain tensors or DTensors) in place from the checkpoint (one DCP
    read: collective; every rank calls with the same keys)."""
    if not template:
        return
    if common["ckpt_format"] == "torch_dist":
        with warnings.catch_warnings():
            # Single-process loads (megadlms-generate) are intended: silence DCP's notice.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=SafeFileSystemReader(ckpt), no_dist=not dist.is_initialized())
        return
    full = _load_torch_file(ckpt)
    for key, dst in template.items():
        if key not in full:
            raise RuntimeError(f"{ckpt}: tensor {key!r} missing from {TORCH_FILE}")
        src = full[key]
        if DTensor and isinstance(dst, DTensor):
            src = distribute_tensor(src.to(dst.dtype), dst.device_mesh, dst.placements).to_local()
            dst = dst.to_local()
        if tuple(src.shape) != tuple(dst.shape):
            raise RuntimeError(f"{ckpt}: {key!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)


def _metadata_shapes(ckpt: str, common: dict) -> Dict[str, Tuple[tuple, torch.dtype]]:
    if common["ckpt_format"] == "torch_dist":
        md = SafeFileSystemReader(ckpt).read_metadata()
        return {
            k: (tuple(v.size), v.properties.dtype)
            for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
    return {k: (tuple(v.shape), v.dtype) for k, v in _load_torch_file(ckpt).items()}


def load_model_state(
    ckpt: str,
    model,
    *,
    model_config: Optional[dict] = None,
    prefer_fp32_params: bool = True,
    tp_group=None,
    pp_group=None,
    ep_group=None,
) -> dict:
    """Load the weights of checkpoint dir ``ckpt`` into ``model`` (wrapper or plain
    module; any sharding). Checks the model config first. Returns common.json's dict.

    ``prefer_fp32_params``: an fp32 model parameter is read from the optimizer's
    ``fp32_param`` (the exact main copy of a bf16/fp16 run) when the checkpoint has one.
    ``tp_group``: this run's tensor-parallel group (None: no TP); each TP-sharded parameter
    gets its shard of the stored full tensor, whatever tp the checkpoint was saved at; each
    expert parameter its experts (``ep_group``: this run's EP group), whatever the saved ep.
    ``pp_group``: this run's pipeline group (None: no PP); this stage reads its own keys, and a
    tied-embedding copy is read from the embedding (checkpoint_pp.py)."""
    common = read_common(ckpt)
    if model_config is not None:
        check_model_config(common.get("model_config", {}), model_config, ckpt)
    module = unwrap_model(model)
    params = named_params(module)
    copies = shared_copies(params)  # stored as (and read from) the embedding
    sd = module.state_dict()
    template = {f"model/{k}": v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    stored = {k: f"model/{copies.get(k[6:], k[6:])}" for k in template}
    shapes = _metadata_shapes(ckpt, common)
    saved_model = {k for k in shapes if k.startswith("model/")}
    check_stage_keys(set(stored.values()), saved_model, pp_group, ckpt)
    for k, v in template.items():
        p = params.get(k[6:])
        shape = sharded_full_shape(p, tp_group, ep_group) if p is not None else tuple(v.shape)
        if shapes[stored[k]][0] != shape:
            raise RuntimeError(
                f"checkpoint {ckpt}: parameter {k[6:]} has shape {shapes[stored[k]][0]} but the "
                f"model's is {shape}; the model flags differ from the checkpoint's"
            )
    reads = {}
    for k, v in template.items():
        main = f"optimizer/state/{stored[k][6:]}/fp32_param"
        use_main = prefer_fp32_params and v.dtype == torch.float32 and main in shapes
        reads[main if use_main else stored[k]] = (v, params.get(k[6:]))
    read_resharded(reads, tp_group, lambda batch: _read_tensors(ckpt, common, batch), ep_group=ep_group)
    module.load_state_dict({k[6:]: v for k, v in template.items()}, strict=True)
    return common


def load_optimizer_state(ckpt: str, optimizer, model, *, tp_group=None, pp_group=None, ep_group=None) -> None:
    """Load the optimizer state of ``ckpt`` into ``optimizer`` (built for ``model``).
    Tensors of FSDP2 parameters are read straight into DTensors sharded like them; state of
    a TP-sharded parameter (``tp_group``: this run's TP group) is cut to this rank's shard, of
    an expert parameter to this rank's experts (``ep_group``). Only this rank's parameters'
    state is read (any pipeline layout; a tied-embedding copy takes the embedding's)."""
    common = read_common(ckpt)
    skel = common.get("optimizer")
    if skel is None:
        raise RuntimeError(
            f"checkpoint {ckpt} holds no optimizer state; pass --no-load-optim "
            "(or --finetune) to load only the weights"
        )
    shapes = _metadata_shapes(ckpt, common)
    params = named_params(unwrap_model(model))
    skel = own_skeleton(skel, set(params), shared_copies(params))
    reads: Dict[str, tuple] = {}
    for path, key in tensor_paths(skel):
        shape, dtype = shapes[key]
        p = params.get(path[1]) if len(path) >= 3 and path[0] == "state" else None
        full = sharded_full_shape(p, tp_group, ep_group) if p is not None else None
        if p is not None and len(shape) > 0 and shape != full:
            raise RuntimeError(
                f"checkpoint {ckpt}: optimizer state {key[len('optimizer/state/') :]} has shape {shape} "
                f"but parameter {path[1]}'s full shape is {full}; the model flags differ "
                "from the checkpoint's"
            )
        if DTensor and isinstance(p, DTensor) and tuple(p.shape) == shape:
            reads[key] = (torch.empty_like(p, dtype=dtype), None)
        elif p is not None and len(shape) > 0:
            reads[key] = (torch.empty(p.shape, dtype=dtype), p)  # p's local shape
        else:
            reads[key] = (torch.empty(shape, dtype=dtype), None)
    read_resharded(reads, tp_group, lambda batch: _read_tensors(ckpt, common, batch), ep_group=ep_group)
    optimizer.load_state_dict(join_state(skel, {k: dst for k, (dst, _) in reads.items()}))


def load_rng_state(ckpt: str, *, rng_tracker=None, tp_group=None, pp_group=None, ep_group=None) -> bool:
    """Restore this rank's RNG states (and ``rng_tracker``'s streams, when saved); False
    (nothing changed) when the checkpoint was written by a different layout -- world size,
    or tensor-parallel size (``tp_group``), whose TP ranks must share their default stream --
    or without RNG states."""
    common = read_common(ckpt)
    world = dist.get_world_size() if dist.is_initialized() else 1
    path = os.path.join(ckpt, "rng", f"rank_{_rank()}.pt")
    layout = (tp_size(tp_group), pp_size(pp_group), group_size(ep_group))
    if not common.get("rng_saved") or not same_layout(common, world, *layout):
        return False
    if not os.path.isfile(path):
        return False
    set_rng_state(torch.load(path, map_location="cpu", weights_only=True), rng_tracker)
    return True


# ---------------------------------------------------------------------------- restore
@dataclasses.dataclass
class TrainState:
    """Where a restored run continues (what :func:`load_checkpoint` read)."""

    iteration: int
    consumed_samples: int
    extra: dict
    rng_restored: bool
    common: dict


def load_checkpoint(
    ckpt: str,
    *,
    model,
    optimizer=None,
    scheduler=None,
    restore_optimizer: bool = True,
    load_rng: bool = True,
    override_scheduler: bool = False,
    model_config: Optional[dict] = None,
    tp_group=None,
    rng_tracker=None,
    pp_group=None,
    ep_group=None,
) -> TrainState:
    """Restore everything a run needs from checkpoint dir ``ckpt``, in one place and in
    the only safe order (collective under DTensor / distributed-optimizer layouts):

    1. the weights into ``model`` (our wrapper, any data-parallel size and layout);
    2. ``optimizer``: its saved state when ``restore_optimizer``, else its main params
       are refreshed from the loaded weights (``--finetune`` / ``--no-load-optim``);
    3. ``scheduler`` (with ``restore_optimizer``; ``override_scheduler`` keeps its flags);
    4. this rank's RNG states (and ``rng_tracker``'s streams) when ``load_rng`` and the
       layout (world size, tensor-parallel size) matches.

    ``tp_group`` / ``pp_group`` / ``ep_group``: this run's tensor- / pipeline- / expert-parallel
    groups (None: none); the checkpoint may come from any tp, pp and ep.

    Returns the counters to continue from; ``model_config`` (a ``TransformerConfig.to_dict()``)
    is checked against the checkpoint's record first, and every file is verified against the
    sizes and checksums recorded at save time (:class:`CheckpointCorruptError` names the file)."""
    verify_checkpoint(ckpt, read_common(ckpt))
    groups = {"tp_group": tp_group, "pp_group": pp_group, "ep_group": ep_group}
    common = load_model_state(ckpt, model, model_config=model_config, **groups)
    if optimizer is not None:
        if restore_optimizer:
            load_optimizer_state(ckpt, optimizer, model, **groups)
        else:
            optimizer.reload_model_params()
    if scheduler is not None and restore_optimizer and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"], override=override_scheduler)
    rng = bool(load_rng) and load_rng_state(ckpt, rng_tracker=rng_tracker, **groups)
    return TrainState(
        iteration=int(common["iteration"]),
        consumed_samples=int(common["consumed_samples"]),
        extra=dict(common.get("extra", {})),
        rng_restored=rng,
        common=common,
    )
