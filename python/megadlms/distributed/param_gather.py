"""The distributed optimizer's parameter all-gather, overlapped with the next forward.

Invariant (issue 21): a parameter's storage is read only after the all-gather that writes
it has been waited for. While a gather is in flight its bucket's param buffer is undefined
(the collective writes it at some moment before its handle's ``wait()`` returns), so a
read before the wait trains a model that depends on machine load.

Where it is enforced:

* forward: a pre-hook on each *reader* module waits for the buckets of the parameters its
  forward may read (:func:`forward_readers`): its own, and those of descendants that have
  no forward of their own (a container such as an experts module holding one weight, a
  ``ParameterList``), which only an ancestor's forward can read. Megatron-core hooks
  ``module.parameters(recurse=False)`` only, which misses such containers: the weight of
  tests/distributed/expert_toy.py's ``Experts`` was read by its parent's forward before
  its gather finished;
* a parameter read in a forward without any covering pre-hook having run (read outside
  the forward of the module that owns it) is caught when its gradient arrives:
  :meth:`ParamGather.check_read` raises naming it, on every rank (the model is the same);
* outside a forward: ``finish()`` before any other read (``state_dict`` / checkpoints,
  ``load_state_dict``, the params norm via ``finish_param_sync()``, the root's forward
  post-hook for parameters the forward never used).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Set

import torch

from megadlms.common.ranges import param_gather, traced


def forward_readers(root: torch.nn.Module) -> Dict[torch.nn.Module, List[torch.nn.Parameter]]:
    """Each module whose forward must see some parameters gathered, with those parameters:
    a module with a forward reads its own; a module without one (``nn.Module.forward``) is
    read through the nearest ancestor that has one (``root`` counts as having one)."""
    readers: Dict[torch.nn.Module, Dict[int, torch.nn.Parameter]] = {}
    seen: Set[int] = set()

    def walk(mod: torch.nn.Module, reader: torch.nn.Module) -> None:
        if id(mod) in seen:  # a shared module: its first position covers it
            return
        seen.add(id(mod))
        # A class that keeps nn.Module.forward (a container) never runs one itself: its params
        # are read inside the nearest ancestor's forward, so that ancestor must wait for them.
        if mod is root or type(mod).forward is not torch.nn.Module.forward:
            reader = mod
        own = readers.setdefault(reader, {})
        for p in mod.parameters(recurse=False):
            own[id(p)] = p
        for child in mod.children():
            walk(child, reader)

    walk(root, root)
    return {m: list(ps.values()) for m, ps in readers.items() if ps}


class ParamGather:
    """Launch, wait and guard the all-gathers of a wrapper's buckets (module docstring).

    ``module``: the wrapped model; ``buckets``: the wrapper's buckets (each with
    ``param_data`` and a ``reduce_group`` whose ``shard_comm`` gathers it); ``names``: the
    parameters' names for error messages; ``overlap``: ``overlap_param_gather``."""

    def __init__(self, module: torch.nn.Module, buckets, names, overlap: bool) -> None:
        self.buckets, self.names, self.overlap = buckets, names, overlap
        self._in_flight: Set[torch.nn.Parameter] = set()  # gathered async, not yet waited for a reader
        self._unguarded: Set[torch.nn.Parameter] = set()  # read in a forward before any such wait
        self.hooks: list = []
        if overlap:
            self._install(module)

    def start(self, *, force_sync: bool = False) -> None:
        """All-gather every bucket's updated shard into the params; async with ``overlap``
        (and not ``force_sync``), in forward order (the last bucket first) within each reduce
        group on every rank."""
        # A previous step's gathers still in flight would race the new ones on the same
        # param buffers.
        self.finish()
        overlap = self.overlap and not force_sync
        # Last bucket first: buffers hold params in reverse registration order, so the last
        # bucket holds the first layers the next forward reads.
        for bucket in reversed(self.buckets):
            shard = bucket.reduce_group.shard_comm
            lo, hi = bucket.shard_range(shard.rank, shard.world_size)
            # In place: the input is this rank's slice of the output, which the parameters view.
            with traced(param_gather(bucket.index)):
                h = shard.all_gather(bucket.param_data, bucket.param_data[lo:hi], async_op=overlap)
            bucket.gather_handle = h if overlap else None
        if overlap:
            self._in_flight = {p for b in self.buckets for p in b.params}

    def finish(self) -> None:
        """Wait for every gather in flight: afterwards every parameter holds its new value."""
        _wait(self.buckets)
        self._in_flight.clear()

    def check_read(self, param: torch.nn.Parameter) -> None:
        """Called when ``param``'s gradient arrives: raise if the forward read it unguarded."""
        if param in self._unguarded:
            self._unguarded.clear()
            raise RuntimeError(
                f"parameter {self.names[param]} was read in the forward before its overlapped "
                "all-gather was waited for (overlap_param_gather): it is read outside the forward "
                "of the module that registers it. Read it inside that module's forward (or hold it "
                "in a module without a forward), or run without --overlap-param-gather"
            )

    def clear_reads(self) -> None:
        """End of a step's backward: forget this step's forward reads."""
        self._unguarded.clear()

    def _pre_hook(self, module, args, params, buckets) -> None:
        _wait(buckets)
        self._in_flight.difference_update(params)

    def _post_hook(self, module, args, output) -> None:
        # Parameters still in flight were not read through a covering pre-hook: fine if the
        # forward did not use them; check_read raises if one gets a gradient.
        self._unguarded |= self._in_flight
        # End of the root forward: wait for the rest so backward and the optimizer never see a
        # half-written parameter.
        self.finish()

    def _install(self, module: torch.nn.Module) -> None:
        bucket_of = {p: b for b in self.buckets for p in b.params}
        for reader, params in forward_readers(module).items():
            mine = [p for p in params if p in bucket_of]
            if not mine:
                continue
            buckets = list({id(bucket_of[p]): bucket_of[p] for p in mine}.values())
            hook = functools.partial(self._pre_hook, params=mine, buckets=buckets)
            self.hooks.append(reader.register_forward_pre_hook(hook))
        self.hooks.append(module.register_forward_hook(self._post_hook))


def _wait(buckets) -> None:
    """Wait for the gathers of ``buckets`` still in flight (each handle waited once)."""
    for bucket in buckets:
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None
