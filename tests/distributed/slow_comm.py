"""Deliberately slow communication for race tests (issue 21).

Inside ``with slow_comm() as sc:`` every ASYNC torch.distributed collective (``async_op=True``:
all_reduce, all_gather, all_gather_into_tensor / all_gather_single, reduce_scatter_tensor /
reduce_scatter_single, broadcast) behaves like the slowest legal one: it completes only when
its handle is waited for. Between launch and ``wait()`` a real collective's output is undefined
(NCCL or gloo's worker thread writes it at some moment in between), so this helper makes the
worst case happen every time:

* at launch the inputs are copied and the collective runs to completion on private buffers;
* the caller's output holds NaN (``poison=True``; stale values with ``poison=False``) until the
  handle's ``wait()``, which copies the result in. The part of an in-place all-gather's output
  that is this rank's own input keeps its value (NCCL does not rewrite it);
* a write into an input after the launch is lost (a real collective may read it at once).

So a read of an output before its wait sees NaN (or the old value) deterministically, and a
handle that is never waited leaves its output unwritten. Blocking collectives run unchanged:
they return complete. Handles are ``torch.distributed.Work`` objects, so code that checks for
one (FSDP2) still waits. Functional collectives (``torch.distributed._functional_collectives``,
used by DTensor) are not intercepted.

``sc.launched`` counts async launches per op, ``sc.pending()`` the handles not waited yet;
the patches are undone on exit (a pooled worker process stays clean).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


class _DeferredWork(dist.Work):
    """Handle whose ``wait()`` publishes the already computed result into the caller's output."""

    def __init__(self, publish: Callable[[], None], owner: SlowComm) -> None:
        super().__init__()
        self._publish: Optional[Callable[[], None]] = publish
        self._owner = owner

    def wait(self, timeout=None) -> bool:
        if self._publish is not None:
            publish, self._publish = self._publish, None
            publish()
            self._owner.waited += 1
        return True

    def is_completed(self) -> bool:
        return self._publish is None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class SlowComm:
    """The patched collectives and their bookkeeping (see the module docstring)."""

    def __init__(self, poison: bool) -> None:
        self.poison = poison
        self.launched: collections.Counter = collections.Counter()
        self.waited = 0
        self._works: List[_DeferredWork] = []
        self.real = {}

    def pending(self) -> int:
        """Async handles launched inside the block and not waited for (yet)."""
        return sum(not w.is_completed() for w in self._works)

    def _hide(self, outputs: List[torch.Tensor], keep: List[torch.Tensor] = ()) -> None:
        """Make ``outputs`` undefined until the wait; ``keep``: views of them to leave intact."""
        saved = [k.clone() for k in keep]
        if self.poison:
            for t in outputs:
                if t.is_floating_point() or t.is_complex():
                    t.fill_(float("nan"))
        for k, v in zip(keep, saved):
            k.copy_(v)

    def _deferred(self, op: str, outputs: List[torch.Tensor], results: List[torch.Tensor], keep=()):
        self._hide(outputs, keep)

        def publish():
            for out, res in zip(outputs, results):
                out.copy_(res)

        work = _DeferredWork(publish, self)
        self._works.append(work)
        self.launched[op] += 1
        return work

    # ------------------------------------------------------------------ the patched calls
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return self.real["all_reduce"](tensor, op=op, group=group)
        staged = tensor.detach().clone()
        self.real["all_reduce"](staged, op=op, group=group)
        return self._deferred("all_reduce", [tensor], [staged])

    def _gather_into(self, name, output_tensor, input_tensor, group=None, async_op=False):
        real = self.real[name]
        if not async_op:
            return real(output_tensor, input_tensor, group=group)
        staged = torch.empty_like(output_tensor)
        real(staged, input_tensor.detach().clone(), group=group)
        keep = [input_tensor] if _same_storage(input_tensor, output_tensor) else []
        return self._deferred("all_gather_into_tensor", [output_tensor], [staged], keep)

    def _scatter_into(self, name, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real = self.real[name]
        if not async_op:
            return real(output, input, op=op, group=group)
        staged = torch.empty_like(output)
        real(staged, input.detach().clone(), op=op, group=group)
        return self._deferred("reduce_scatter_tensor", [output], [staged])

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        if not async_op:
            return self.real["all_gather"](tensor_list, tensor, group=group)
        staged = [torch.empty_like(t) for t in tensor_list]
        self.real["all_gather"](staged, tensor.detach().clone(), group=group)
        return self._deferred("all_gather", list(tensor_list), staged)

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        kw = dict(group=group, group_src=group_src) if src is None else dict(src=src, group=group)
        if not async_op:
            return self.real["broadcast"](tensor, **kw)
        staged = tensor.detach().clone()
        self.real["broadcast"](staged, **kw)
        is_src = (src if src is not None else dist.get_global_rank(group, group_src)) == dist.get_rank()
        return self._deferred("broadcast", [] if is_src else [tensor], [] if is_src else [staged])


_GATHERS = ("all_gather_into_tensor", "all_gather_single")
_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


@contextlib.contextmanager
def slow_comm(poison: bool = True):
    """Patch torch.distributed (and megadlms' communicator, which bound its collectives at
    import) so that every async collective completes at its wait; yields the :class:`SlowComm`."""
    from megadlms.distributed import comm as mcomm

    sc = SlowComm(poison)
    names = ("all_reduce", "all_gather", "broadcast") + tuple(
        n for n in _GATHERS + _SCATTERS if hasattr(dist, n)
    )
    patches = {}
    for name in names:
        sc.real[name] = getattr(dist, name)
        if name in _GATHERS:
            patches[name] = lambda *a, _n=name, **k: sc._gather_into(_n, *a, **k)
        elif name in _SCATTERS:
            patches[name] = lambda *a, _n=name, **k: sc._scatter_into(_n, *a, **k)
        else:
            patches[name] = getattr(sc, name)
    bound = {
        "all_gather_single": mcomm.all_gather_single,
        "reduce_scatter_single": mcomm.reduce_scatter_single,
    }
    try:
        for name, fn in patches.items():
            setattr(dist, name, fn)
        mcomm.all_gather_single = patches[
            "all_gather_single" if hasattr(dist, "all_gather_single") else _GATHERS[0]
        ]
        mcomm.reduce_scatter_single = patches[
            "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else _SCATTERS[0]
        ]
        yield sc
    finally:
        for name, fn in sc.real.items():
            setattr(dist, name, fn)
        for name, fn in bound.items():
            setattr(mcomm, name, fn)
