"""Activation / gradient exchange between neighbouring pipeline stages.

One call, :meth:`PipelineP2P.communicate`, does what a schedule step needs at once (send to the
next stage, send to the previous, receive from either), as Megatron's ``_communicate``: all of
a step's operations are posted together before any wait, so the paired calls of two neighbours
can never wait on each other. Under NCCL they are one ``batch_isend_irecv`` group, waited on
together. Under gloo they are posted one by one (gloo runs each on its own anyway) and only the
receives are waited on: a call's sends are waited on when the next call starts (or at
:meth:`PipelineP2P.finish`, which the schedule calls at its end), so the compute after a send
overlaps its transfer, as torch's ``Schedule1F1B`` does. This cannot deadlock where waiting at
once would not: the peer's paired call, which receives them, never depended on our later calls.
A sent tensor is referenced until its wait; the schedules never modify one in place.

Two ways to size a receive buffer (the choice is made once, for both neighbours alike):

* known shapes (``dtype`` given): the caller passes the shape of each receive
  (``prev_shape`` / ``next_shape``; a schedule computes it per micro-batch from the caller's
  ``tensor_shape(micro_index)``), the buffer is allocated from it and a call is ONE batch of
  payloads: Megatron's path with ``--variable-seq-lengths`` off;
* variable shapes (``dtype`` None): every tensor is preceded by a small header (dtype code,
  ndim, dims; int64 [8]) exchanged in a first batch, then the tensors themselves in a second
  (Megatron's ``variable_seq_lengths`` shape exchange): twice the messages and a host sync per
  receive, but the receiver needs to know nothing about the micro-batch.

Receiving ahead (gloo, known shapes): a caller that knows the shape of its NEXT receive from a
neighbour passes it (``prev_ahead`` / ``next_ahead``) and that receive is posted at once, into
a buffer the later call then uses. Why: gloo moves a message only after the receiver has posted
its receive (the sender announces it, the receiver answers "ready", then the payload goes), so a
receive posted after the peer's send costs a round trip through both processes' gloo threads,
on the critical path of every micro-batch, and on a busy host those threads wait for a core. A
receive posted a whole micro-batch early has its "ready" there before the peer sends, and the
send writes the payload at once. Messages on one (peer, tag) match in posting order, so posting
early changes no pairing; a caller must only announce receives that will come (the schedule
takes them from a dry run of its own walk, ``state.py``; :meth:`PipelineP2P.finish` refuses a
step that leaves one unused). NCCL keeps one
``batch_isend_irecv`` group per call: a lone early ``irecv`` would hold the pair's stream ahead of
our own sends.

Tags keep the two directions apart: a message travelling down the pipeline (to the next
stage) has tag 0, one travelling up (to the previous) tag 1, so with pp = 2 (next == prev) an
activation can never be matched with a gradient (gloo matches by (peer, tag) in order).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megadlms.common.ranges import PIPELINE_P2P, traced

_DOWN, _UP = 0, 1  # tags: towards the next stage / towards the previous stage
_HEADER = 8
_MAX_DIMS = _HEADER - 2
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# One message of a call: (is a send, tensor, peer's rank in the pipeline group, tag)
_Op = Tuple[bool, torch.Tensor, int, int]
# A receive to post ahead: (peer's rank in the pipeline group, tag, shape)
_Ahead = Tuple[int, int, Sequence[int]]


def _header(t: torch.Tensor, device) -> torch.Tensor:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(
            f"pipeline p2p sends float tensors of at most {_MAX_DIMS} dims, got {t.dtype} {tuple(t.shape)}"
        )
    # Filled on the host and copied once: writing a device tensor element by element costs a copy each.
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h.to(device)


def _from_header(h: torch.Tensor, device) -> torch.Tensor:
    # The shape must be known on the host to allocate the receive buffer (one device sync per receive).
    h = h.cpu()
    dtype, ndim = _DTYPES[int(h[0])], int(h[1])
    return torch.empty(tuple(int(d) for d in h[2 : 2 + ndim]), dtype=dtype, device=device)


class PipelineP2P:
    """Point-to-point exchange of one rank with its pipeline neighbours (ring order: the last
    stage's next is the first, which interleaved schedules use).

    ``pp_group``: the pipeline axis (``ParallelGroups.pp``: ``.ranks``, ``.rank``, ``.group``)
    or a process group. ``next`` / ``prev``: the neighbours' global ranks. ``device``: where headers and
    received tensors live (the model's device; CPU for gloo). ``dtype``: the dtype of every
    received tensor when the caller gives each receive's shape (no header exchange); None:
    shapes and dtypes travel in headers (see the module docstring)."""

    def __init__(self, pp_group, device, dtype: Optional[torch.dtype] = None) -> None:
        if isinstance(pp_group, dist.ProcessGroup):
            self.group = pp_group
            self.ranks = tuple(dist.get_process_group_ranks(pp_group))
            self.rank = self.ranks.index(dist.get_rank())
        else:
            self.group, self.ranks, self.rank = pp_group.group, tuple(pp_group.ranks), pp_group.rank
        self.size = len(self.ranks)
        self.device = torch.device(device)
        self.dtype = dtype
        self.next = self.ranks[(self.rank + 1) % self.size]
        self.prev = self.ranks[(self.rank - 1) % self.size]
        # the neighbours' ranks within the group (what the process group's own send / recv take)
        self._next_in_group, self._prev_in_group = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        # gloo runs each send / receive on its own anyway: posting them directly skips
        # batch_isend_irecv's coalescing manager (~25 us a call on a 2-core EPYC, gloo, 64 KB)
        self._post_directly = dist.get_backend(self.group) == dist.Backend.GLOO
        # the process group itself (None names the default one) for the direct gloo path
        self._pg = self.group if self.group is not None else dist.group.WORLD
        # gloo sends in flight, with their tensors (referenced until waited on)
        self._sends: List[Tuple[dist.Work, torch.Tensor]] = []
        # gloo receives posted ahead (module docstring), one per (peer, tag) at most: buffer, work
        self._ahead: Dict[Tuple[int, int], Tuple[torch.Tensor, dist.Work]] = {}

    def _batch(self, ops: List[_Op], ahead: Sequence[_Ahead] = ()) -> None:
        # every op posted before any wait (NCCL: one group, which its paired calls need; gloo: one by one,
        # the previous call's sends waited on first, this call's left in flight: module docstring)
        if not ops:
            return
        with traced(PIPELINE_P2P):
            if not self._post_directly:
                p2p_ops = [
                    dist.P2POp(dist.isend if send else dist.irecv, t, self.ranks[peer], self.group, tag)
                    for send, t, peer, tag in ops
                ]
                for work in dist.batch_isend_irecv(p2p_ops):
                    work.wait()
                return
            self.flush()
            # Straight to the process group (peers are group ranks): dist.isend / irecv and
            # P2POp add ~15 us of Python checks a message (2-core EPYC, gloo, 64 KB).
            waits = []
            for send, t, peer, tag in ops:
                if send:
                    self._sends.append((self._pg.send([t], peer, tag), t))
                    continue
                posted = self._ahead.pop((peer, tag), None)
                # a buffer handed out by _known from a receive posted ahead: wait on that receive
                waits.append(posted[1] if posted is not None else self._pg.recv([t], peer, tag))
            # posted behind this call's receives on each (peer, tag), so they match the next messages
            for peer, tag, shape in ahead:
                if (peer, tag) in self._ahead:
                    raise RuntimeError(
                        f"pipeline p2p: a receive from pipeline rank {peer} is already posted ahead"
                    )
                buf = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
                self._ahead[(peer, tag)] = (buf, self._pg.recv([buf], peer, tag))
            for work in waits:
                work.wait()

    def flush(self) -> None:
        """Waits for the sends still in flight (gloo)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def finish(self) -> None:
        """The schedule's last p2p act: waits for the sends in flight and checks that every
        receive posted ahead was used."""
        self.flush()
        if self._ahead:
            # a receive announced but never made would take the next step's first message
            raise RuntimeError(
                f"pipeline p2p: receives posted ahead were never used (peer, tag): {sorted(self._ahead)}; "
                "a schedule must announce only receives it makes"
            )

    @property
    def receives_ahead(self) -> bool:
        """Whether receives announced one call early are posted then (gloo with known shapes)."""
        return self._post_directly and self.dtype is not None

    @property
    def known_shapes(self) -> bool:
        """Whether receives are sized by the caller (one batch per call, no headers)."""
        return self.dtype is not None

    def communicate(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        *,
        prev_shape: Optional[Sequence[int]] = None,
        next_shape: Optional[Sequence[int]] = None,
        prev_ahead: Optional[Sequence[int]] = None,
        next_ahead: Optional[Sequence[int]] = None,
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Send ``send_next`` down / ``send_prev`` up and receive from the previous / next stage
        (when asked); returns ``(from_prev, from_next)``. Every neighbour must make the paired
        call (its ``recv_prev`` for our ``send_next``, ...). With known shapes each receive
        needs its shape (``prev_shape`` for ``recv_prev``, ``next_shape`` for ``recv_next``), and
        ``prev_ahead`` / ``next_ahead`` (with the same receive) give the shape of the FOLLOWING
        receive from that neighbour, which gloo then posts at once (module docstring); only a
        receive that a later call surely makes may be announced."""
        for announced, want, name in ((prev_ahead, recv_prev, "prev"), (next_ahead, recv_next, "next")):
            if announced is not None and not (want and self.dtype is not None):
                raise ValueError(
                    f"pipeline p2p: {name}_ahead needs recv_{name} and known shapes (dtype given)"
                )
        sends: Sequence[Tuple[torch.Tensor, int, int]] = [
            (t, peer, tag)
            for t, peer, tag in (
                (send_next, self._next_in_group, _DOWN),
                (send_prev, self._prev_in_group, _UP),
            )
            if t is not None
        ]
        recvs = [
            (peer, tag, shape)
            # What the previous stage sends us travels DOWN (its send_next), so receives from prev use _DOWN.
            for want, peer, tag, shape in (
                (recv_prev, self._prev_in_group, _DOWN, prev_shape),
                (recv_next, self._next_in_group, _UP, next_shape),
            )
            if want
        ]
        if self.dtype is not None:
            received = [self._known(peer, tag, shape) for peer, tag, shape in recvs]
        else:
            received = self._exchange_headers(sends, recvs)
        # Only values travel: the sent activation stays in this stage's graph for its own backward.
        ops: List[_Op] = [(True, t.detach().contiguous(), peer, tag) for t, peer, tag in sends]
        ops += [(False, buf, peer, tag) for buf, (peer, tag, _) in zip(received, recvs)]
        # NCCL: one group per call, announcements unused (module docstring)
        ahead: List[_Ahead] = [
            (peer, tag, shape)
            for shape, peer, tag in (
                (prev_ahead, self._prev_in_group, _DOWN),
                (next_ahead, self._next_in_group, _UP),
            )
            if shape is not None and self.receives_ahead
        ]
        self._batch(ops, ahead)
        # received follows recvs, which lists prev before next.
        out = iter(received)
        return (next(out) if recv_prev else None), (next(out) if recv_next else None)

    def _known(self, peer: int, tag: int, shape: Optional[Sequence[int]]) -> torch.Tensor:
        if shape is None:
            raise ValueError("pipeline p2p with known shapes (dtype given): every receive needs its shape")
        posted = self._ahead.get((peer, tag))
        if posted is None:
            return torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        # posted by the previous call from this neighbour, sized from what it announced
        if tuple(posted[0].shape) != tuple(shape):
            raise ValueError(
                f"pipeline p2p: a receive of shape {tuple(shape)} from pipeline rank {peer}, but the "
                f"previous call announced {tuple(posted[0].shape)} (prev_ahead / next_ahead)"
            )
        return posted[0]

    def _exchange_headers(self, sends, recvs) -> List[torch.Tensor]:
        """The variable-shape path's first batch: one header per tensor; returns the receive buffers."""
        headers = [torch.empty(_HEADER, dtype=torch.int64, device=self.device) for _ in recvs]
        ops: List[_Op] = [(True, _header(t, self.device), peer, tag) for t, peer, tag in sends]
        ops += [(False, h, peer, tag) for h, (peer, tag, _) in zip(headers, recvs)]
        self._batch(ops)
        # Only now are the shapes known: the payloads need a second batch, posted in the same order.
        return [_from_header(h, self.device) for h in headers]
