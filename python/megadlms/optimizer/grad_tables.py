"""TensorTables of the step's gradient lists, kept while the same tensors come back.

The optimizer runs several extension ops per step over the main grads (fp16 unscale and
overflow check, the grad norm, clipping). When the grads are views of our DDP's grad
buffers, the layouts hand over the same tensor objects every step, so one
``megadlm_ext.TensorTable`` serves every op of every step: no per-call parsing of the list
(~100 ns per tensor and op). When they are fresh tensors (fp32 copies of a 16-bit buffer,
FSDP2's or a plain module's ``param.grad``), a table is still built once per step and shared
by that step's ops, then released, so that it never keeps a finished step's copies alive.

A table is reused only while ``table.matches(tensors)``: the list holds exactly its tensor
objects (an O(n) pointer comparison; the table keeps them alive, so an id cannot be reused).
Like every table it assumes those tensors keep their memory (no ``.data =``, ``set_``,
``resize_``); the grad buffers never move.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import megadlm_ext as ext


class GradTables:
    """At most one table per name; ``get`` also reuses another name's table for the same list
    (the clip list is usually the grads list, the norm list too when nothing is filtered)."""

    def __init__(self) -> None:
        self._tables: Dict[str, Any] = {}  # name -> megadlm_ext.TensorTable

    def get(self, name: str, tensors: List[torch.Tensor]):
        """A TensorTable of ``tensors``: a kept one that matches them, else a new one."""
        own = self._tables.get(name)
        if own is not None and own.matches(tensors):
            return own
        for table in self._tables.values():
            if table is not own and table.matches(tensors):
                self._tables[name] = table
                return table
        table = self._tables[name] = ext.TensorTable(tensors)
        return table

    def clear(self) -> None:
        """Drop every table (and with it the references to its tensors)."""
        self._tables.clear()
