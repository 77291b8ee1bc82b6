"""One ``DataParallel`` over this rank's pipeline model chunks (docs/architecture.md).

Under pipeline parallelism a rank holds one model chunk per virtual stage (one without
interleaving); each chunk is its own :class:`~megadlms.distributed.DistributedDataParallel`
over the data-parallel group, with its own grad buffers and buckets, so that a chunk's
buckets can launch as soon as ITS last micro-batch's backward is done (the schedule runs
every other backward of the chunk under ``chunk.no_sync()``). :class:`ModelChunks` lets
the trainer and the optimizer see the chunks as one wrapper:

* ``no_sync`` / ``start_grad_sync`` / ``finish_grad_sync`` / ``zero_grad_buffer`` /
  ``scale_gradients`` / ``broadcast_params`` / ``start_param_sync`` / ``finish_param_sync``:
  every chunk, in order;
* ``named_trainable_parameters`` / ``main_grad`` / ``grad_buckets``: merged (a parameter
  lives in exactly one chunk; the bucket list is the concatenation, so a bucket's
  ``index`` is only unique within its chunk);
* ``module``: :class:`StageModules`, the chunks' plain modules as ONE module whose names
  are the chunks' own. Chunks name their layers with global layer numbers, so the names
  here are those of the full model restricted to this rank's stages: state dicts,
  checkpoint keys and optimizer keys need no translation;
* ``chunks``: the list the pipeline schedule runs.

``comm`` / ``shard_comm`` / ``parallel`` / ``ddp_config`` / ``optimizer_layout`` are the
first chunk's (every chunk is built over the same groups with the same config).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch

from megadlms.common.enums import OptimizerLayout

from .protocol import DataParallel
from .wrappers import model_wrapper, unwrap_model


class StageModules(torch.nn.Module):
    """This rank's chunk modules as one module: ``named_parameters`` / ``state_dict`` /
    ``load_state_dict`` under the chunks' own (global) names, no ``parts.<i>.`` prefix."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        merged = OrderedDict()
        for i, part in enumerate(self.parts):
            for key, value in part.state_dict(*args, **kwargs).items():
                if key in merged:
                    raise RuntimeError(
                        f"pipeline chunks 0..{i} both hold {key!r}: chunk names must be global"
                    )
                merged[key] = value
        return merged

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Each chunk takes its own keys; with ``strict`` a key no chunk has is an error."""
        state_dict, missing, unexpected = dict(state_dict), [], set(state_dict)
        for part in self.parts:
            # Each chunk loads its own keys non-strictly; strictness is judged over the union below.
            own = {k: state_dict[k] for k in part.state_dict() if k in state_dict}
            unexpected -= set(own)
            result = part.load_state_dict(own, strict=False, assign=assign)
            missing += list(result.missing_keys)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"StageModules.load_state_dict: missing keys {sorted(missing)[:5]}, unexpected keys "
                f"{sorted(unexpected)[:5]}"
            )
        return torch.nn.modules.module._IncompatibleKeys(missing, sorted(unexpected))

    def forward(self, *args, **kwargs):
        raise RuntimeError("StageModules has no forward: the pipeline schedule runs each chunk")


@model_wrapper
class ModelChunks(torch.nn.Module):
    """The ``DataParallel`` protocol over a list of per-chunk wrappers (module docstring)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("ModelChunks needs at least one model chunk")
        wrappers: List[DataParallel] = [c for c in chunks if isinstance(c, DataParallel)]
        layouts = {c.optimizer_layout for c in wrappers}
        if len(wrappers) != len(chunks) or len(layouts) != 1:
            got = [
                str(c.optimizer_layout) if isinstance(c, DataParallel) else type(c).__name__ for c in chunks
            ]
            raise ValueError(
                "ModelChunks: every chunk must be a data-parallel wrapper with the same optimizer_layout, "
                f"got {got}"
            )
        # Registered as submodules so .to()/parameters()/train() reach the chunks; self.chunks
        # is the plain list the schedule indexes.
        self.wrapped = torch.nn.ModuleList(chunks)
        self.chunks: List[DataParallel] = wrappers
        self.module = StageModules([unwrap_model(c) for c in chunks])
        first = wrappers[0]
        self.ddp_config = first.ddp_config
        self.comm, self.shard_comm = first.comm, first.shard_comm
        self.parallel = first.parallel
        self._owner: Dict[torch.nn.Parameter, DataParallel] = {}
        for c in wrappers:
            for p in c.named_trainable_parameters():
                if p in self._owner:
                    raise ValueError("ModelChunks: a parameter is in two chunks")
                self._owner[p] = c

    @property
    def optimizer_layout(self) -> OptimizerLayout:
        return self.chunks[0].optimizer_layout

    def forward(self, *args, **kwargs):
        if len(self.chunks) != 1:
            raise RuntimeError("ModelChunks with several chunks has no forward: run the pipeline schedule")
        return self.chunks[0](*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for c in self.chunks:
                stack.enter_context(c.no_sync())
            yield

    def start_grad_sync(self) -> None:
        for c in self.chunks:
            c.start_grad_sync()

    def finish_grad_sync(self) -> None:
        for c in self.chunks:
            c.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        for c in self.chunks:
            c.scale_gradients(scaling_factor)

    def broadcast_params(self) -> None:
        for c in self.chunks:
            c.broadcast_params()

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        merged: Dict[torch.nn.Parameter, str] = {}
        for c in self.chunks:
            merged.update(c.named_trainable_parameters())
        return merged

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        owner = self._owner.get(param)
        return owner.main_grad(param) if owner is not None else param.grad

    @property
    def grad_buckets(self) -> List:
        return [b for c in self.chunks for b in c.grad_buckets]

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        for c in self.chunks:
            c.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self) -> None:
        for c in self.chunks:
            c.finish_param_sync()

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True):
        for c in self.wrapped:
            c.train(mode)
        return super().train(mode)
