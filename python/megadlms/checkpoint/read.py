"""The public read API: what generate, Hugging Face export, conversion and the loaders use.

* :func:`open_checkpoint`: a --save root or an ``iter_*`` directory -> (directory, common.json);
* :func:`tensor_shapes`: every stored tensor's key, full shape and dtype (no tensor read);
* :func:`read_tensors`: fill a dict of tensors (plain, DTensors, or format 4's
  :class:`~megadlms.checkpoint.views.ShardView` s of local pieces) from the stored ones;
* :func:`load_model_state`: the weights into a model, any sharding (see load.py for the rest).

Safety on load: tensor files are read with ``weights_only=True``; DCP's ``.metadata``
pickle is read with an unpickler that only admits DCP's metadata classes (format.py);
the rest is JSON. Nothing else is unpickled.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megadlms.common.dtensor import is_dtensor
from megadlms.common.enums import CkptFormat
from megadlms.distributed.wrappers import unwrap_model

from .format import SafeFileSystemReader
from .layout import SINGLE, ParallelLayout
from .paths import COMMON_FILE, LATEST_FILE, TORCH_FILE, read_common, resolve_checkpoint
from .pipeline import check_stage_keys, shared_copies
from .records import check_model_config
from .tensor_parallel import entry_view, full_shape_of, named_params
from .views import NO_CUT, ShardView, ViewLoadPlanner, local_view

MODEL_PREFIX = "model/"


def open_checkpoint(path: str, what: str = "--load") -> Tuple[str, dict]:
    """(checkpoint directory, its common.json) for a --save root or one ``iter_*`` directory;
    ValueError naming ``what`` when there is none."""
    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise ValueError(f"{what} {path}: no checkpoint there (no {LATEST_FILE} and no {COMMON_FILE})")
    return ckpt, read_common(ckpt)


def _torch_file(ckpt: str) -> Dict[str, torch.Tensor]:
    """The torch-format file, memory-mapped (tensors are read from disk when copied)."""
    # mmap: a one-file checkpoint of a large model never sits in RAM whole on every rank.
    return torch.load(os.path.join(ckpt, TORCH_FILE), map_location="cpu", weights_only=True, mmap=True)


def tensor_shapes(ckpt: str, common: dict) -> Dict[str, Tuple[tuple, torch.dtype]]:
    """``{key: (full shape, dtype)}`` of every tensor stored in checkpoint dir ``ckpt``."""
    if common["ckpt_format"] == CkptFormat.TORCH_DIST:
        # DCP's .metadata records every key's full (global) shape, so no tensor data is read here.
        md = SafeFileSystemReader(ckpt).read_metadata()
        return {
            k: (tuple(v.size), v.properties.dtype)
            for k, v in md.state_dict_metadata.items()
            # Non-tensor entries (BytesStorageMetadata) are not ours: the non-tensor state is in common.json.
            if isinstance(v, TensorStorageMetadata)
        }
    return {k: (tuple(v.shape), v.dtype) for k, v in _torch_file(ckpt).items()}


def read_tensors(ckpt: str, common: dict, template: Mapping[str, Union[torch.Tensor, ShardView]]) -> None:
    """Fill ``template`` (plain tensors, DTensors or :class:`ShardView` s, keyed like
    :func:`tensor_shapes`) in place from the checkpoint, whatever chunks it was stored in (one
    DCP read: collective; every rank calls with the same keys). Only the bytes of the
    requested pieces are read from a torch_dist checkpoint."""
    if not template:
        return
    if common["ckpt_format"] == CkptFormat.TORCH_DIST:
        with warnings.catch_warnings():
            # Single-process loads (megadlms-generate) are intended: silence DCP's notice.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                template,
                storage_reader=SafeFileSystemReader(ckpt),
                planner=ViewLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
        return
    full = _torch_file(ckpt)
    for key, dst in template.items():
        if key not in full:
            raise RuntimeError(f"{ckpt}: tensor {key!r} missing from {TORCH_FILE}")
        src = full[key]
        # A DTensor takes its own piece, cut as FSDP2 cuts (the same description DCP uses).
        view = local_view(dst, NO_CUT) if is_dtensor(dst) else dst
        if tuple(src.shape) != tuple(view.size()):
            raise RuntimeError(f"{ckpt}: {key!r} has shape {tuple(src.shape)}, expected {tuple(view.size())}")
        if isinstance(view, ShardView):
            view.fill_from_full(src)
        else:
            view.copy_(src)


def _check_shapes(ckpt, views, stored, shapes) -> None:
    """Every model tensor's full shape matches the stored one (the model flags match)."""
    for k, v in views.items():
        if shapes[stored[k]][0] != full_shape_of(v):
            raise RuntimeError(
                f"checkpoint {ckpt}: parameter {k[len(MODEL_PREFIX) :]} has shape {shapes[stored[k]][0]} "
                f"but the model's is {full_shape_of(v)}; the model flags differ from the checkpoint's"
            )


def load_model_state(
    ckpt: str,
    model,
    *,
    model_config: Optional[dict] = None,
    prefer_fp32_params: bool = True,
    layout: ParallelLayout = SINGLE,
) -> dict:
    """Load the weights of checkpoint dir ``ckpt`` into ``model`` (wrapper or plain
    module; any sharding). Checks the model config first. Returns common.json's dict.

    ``prefer_fp32_params``: an fp32 model parameter is read from the optimizer's
    ``fp32_param`` (the exact main copy of a bf16/fp16 run) when the checkpoint has one.
    ``layout``: this run's model-parallel groups; each TP-sharded parameter reads its pieces
    of the stored full tensor whatever tp the checkpoint was saved at, each expert parameter
    its experts whatever the saved ep (no full tensor is built); a pipeline stage reads its
    own keys, and a tied-embedding copy is read from the embedding (pipeline.py)."""
    common = read_common(ckpt)
    if model_config is not None:
        check_model_config(common.get("model_config", {}), model_config, ckpt)
    module = unwrap_model(model)
    params = named_params(module)
    copies = shared_copies(params)  # stored as (and read from) the embedding
    sd = module.state_dict()
    # state_dict() tensors share storage with the parameters: reading into them loads in place.
    template = {f"{MODEL_PREFIX}{k}": v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    # The key each tensor is read from: its own, or the embedding's for a tied copy.
    stored = {k: MODEL_PREFIX + copies.get(k[6:], k[6:]) for k in template}
    shapes = tensor_shapes(ckpt, common)
    saved_model = {k for k in shapes if k.startswith(MODEL_PREFIX)}
    # Compared against what all stages need together: one stage alone holds only part of the keys.
    check_stage_keys(set(stored.values()), saved_model, layout.pp_group, ckpt)
    # Views over the parameters' own storage: DCP reads this rank's pieces straight into them.
    tp_group, ep_group = layout.tp_group, layout.ep_group
    views = {k: entry_view(k, v, params.get(k[6:]), tp_group, ep_group) for k, v in template.items()}
    _check_shapes(ckpt, views, stored, shapes)
    reads: Dict[str, Union[torch.Tensor, ShardView]] = {}
    for k, v in template.items():
        main = f"optimizer/state/{stored[k][6:]}/fp32_param"
        # A bf16/fp16 run's exact fp32 main copy beats its rounded weight for an fp32 model.
        use_main = prefer_fp32_params and v.dtype == torch.float32 and main in shapes
        reads[main if use_main else stored[k]] = views[k]
    read_tensors(ckpt, common, reads)
    module.load_state_dict({k[6:]: v for k, v in template.items()}, strict=True)
    return common
