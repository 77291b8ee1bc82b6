"""The storage pieces of a checkpoint: nested state <-> flat tensors + JSON skeleton, and a
DCP reader that unpickles only DCP's own metadata classes (see read.py)."""

from __future__ import annotations

import pickle
from typing import Any, Dict, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from .views import ShardView


# ---------------------------------------------------------------------------- nesting
def split_state(obj: Any, prefix: str, tensors: Dict[str, Any]) -> Any:
    """Move tensor leaves (and format 4's ShardViews) of a nested dict/list into ``tensors``;
    return a JSON skeleton with ``{"__tensor__": key}`` where they were."""
    if isinstance(obj, (torch.Tensor, ShardView)):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        for k in obj:
            # '/' separates the levels of a flat key; a key holding one would split wrongly on load.
            if not isinstance(k, (str, int)) or "/" in str(k):
                raise ValueError(f"checkpoint key {k!r} under {prefix!r} must be a str/int without '/'")
        # Pairs, not a JSON object: int keys (torch.optim's param indices) would come back as strings.
        return {"__dict__": [[k, split_state(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        # Tuples kept apart from lists so the state comes back exactly as saved (e.g. Adam's betas).
        kind = "__tuple__" if isinstance(obj, tuple) else "__list__"
        return {kind: [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    # numpy scalars (from schedulers, data loaders) are not JSON-able; their Python value is.
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise TypeError(
        f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint "
        "(only tensors, numbers, strings, lists and dicts)"
    )


def join_state(skel: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            return tensors[skel["__tensor__"]]
        if "__dict__" in skel:
            return {k: join_state(v, tensors) for k, v in skel["__dict__"]}
        if "__list__" in skel:
            return [join_state(v, tensors) for v in skel["__list__"]]
        if "__tuple__" in skel:
            return tuple(join_state(v, tensors) for v in skel["__tuple__"])
    return skel


def tensor_paths(skel: Any, path: Tuple = ()):
    """Yield (path, key) for every tensor leaf of a skeleton."""
    if isinstance(skel, dict):
        if "__tensor__" in skel:
            yield path, skel["__tensor__"]
        for k, v in skel.get("__dict__", []):
            yield from tensor_paths(v, path + (k,))
        for i, v in enumerate(skel.get("__list__") or skel.get("__tuple__") or []):
            yield from tensor_paths(v, path + (i,))


# ---------------------------------------------------------------------------- safe DCP reader
class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's ``.metadata`` is made of."""

    # An allow-list: .metadata is a pickle, and a pickle from an untrusted checkpoint can run code.
    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner"}
    _NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module, name):
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        # dtypes pickle as torch.<name>; admit those names only when they really are dtypes.
        if module == torch.__name__ and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not "
            "a torch.distributed.checkpoint metadata class; refusing to load"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is read with :class:`_MetadataUnpickler`
    (the base class uses a bare ``pickle.load``)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        # Mirrors FileSystemReader.read_metadata: older files have no storage_meta, and DCP's planner
        # expects a load_id on it.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
