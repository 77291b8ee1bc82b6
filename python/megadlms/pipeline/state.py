"""One pipeline step's state on a rank (:class:`ScheduleState`: what the schedules in
``schedules.py`` read and call) and its dry run (:class:`ReceiveOrder`: the order of the
step's receives, known before the first, so that ``p2p.py`` can post each one a call early)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from megadlms.common.ranges import BACKWARD, FORWARD, traced

NoSync = Callable[[int], ContextManager]  # chunk index -> context without gradient sync
TensorShape = Callable[[int], Sequence[int]]  # micro-batch index -> shape of the activations it sends


class ScheduleState:
    """One step's state on this rank: the activations and grads waiting for their backward,
    keyed by (chunk, micro-batch); received tensors are queued per chunk in micro-batch order."""

    def __init__(
        self,
        chunks,
        num_micro,
        forward_step,
        p2p,
        backward_loss,
        forward_only,
        timeline,
        no_sync,
        tensor_shape,
    ) -> None:
        self.chunks, self.m, self.forward_step, self.p2p = chunks, num_micro, forward_step, p2p
        self.tensor_shape: Optional[TensorShape] = tensor_shape
        self.no_sync: Optional[NoSync] = no_sync
        self.backward_loss, self.forward_only, self.timeline = backward_loss, forward_only, timeline
        self.pp, self.rank, self.vp = p2p.size, p2p.rank, len(chunks)
        self.inputs: List[Dict[int, Optional[torch.Tensor]]] = [{} for _ in chunks]
        self.outputs: List[Dict[int, object]] = [{} for _ in chunks]
        self.grads: List[Dict[int, Optional[torch.Tensor]]] = [{} for _ in chunks]
        self.received = [0] * self.vp  # inputs received per chunk (micro-batch order)
        self.grads_received = [0] * self.vp
        self.backwards_done = [0] * self.vp
        self.losses: Dict[int, torch.Tensor] = {}
        # The micro-batch index of every receive, per direction, in schedule order (ReceiveOrder), when
        # p2p posts receives ahead.
        self.order: Optional[Dict[str, List[int]]] = None

    # -- indices (Megatron's get_model_chunk_id / micro-batch id in the interleaved order)
    def chunk_id(self, k: int, forward: bool) -> int:
        # Virtual step k runs a group of pp micro-batches through chunk 0, the same group through chunk 1,
        # ...; backward walks the chunks in reverse, starting from the last (the one holding the loss).
        c = (k % (self.pp * self.vp)) // self.pp
        return c if forward else self.vp - 1 - c

    def micro_id(self, k: int) -> int:
        # Group index (one group per pp*vp steps) times pp, plus the position inside the group.
        return (k // (self.pp * self.vp)) * self.pp + k % self.pp

    def first_stage(self, c: int) -> bool:
        return c == 0 and self.rank == 0

    def last_stage(self, c: int) -> bool:
        return c == self.vp - 1 and self.rank == self.pp - 1

    # -- the p2p calls: every receive is queued for its chunk, sized from tensor_shape when given
    def exchange(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        input_for: Optional[int] = None,
        grad_for: Optional[int] = None,
    ) -> None:
        """One paired p2p call: sends, and receives chunk ``input_for``'s next input (from the
        previous stage) / chunk ``grad_for``'s next output grad (from the next) when not None."""
        x, g = self.p2p.communicate(
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=input_for is not None,
            recv_next=grad_for is not None,
            prev_shape=None if input_for is None else self._shape(self.received[input_for]),
            # a gradient has its activation's shape
            next_shape=None if grad_for is None else self._shape(self.grads_received[grad_for]),
            prev_ahead=None if input_for is None else self._ahead("input", self.received, input_for),
            next_ahead=None if grad_for is None else self._ahead("grad", self.grads_received, grad_for),
        )
        if input_for is not None:
            self.add_input(input_for, x)
        if grad_for is not None:
            self.add_grad(grad_for, g)

    def _ahead(self, direction: str, received: List[int], c: int) -> Optional[Tuple[int, ...]]:
        # The shape of the receive that follows chunk c's next one from the same neighbour (p2p.py posts
        # it at once), from the schedule's dry run; None without one or after the last receive.
        # ``received``: this direction's receives so far per chunk, so their sum is this receive's index.
        if self.order is None:
            return None
        order, j, i = self.order[direction], sum(received), received[c]
        if order[j] != i:  # the dry run walks the same schedule code: a difference is a bug here
            raise RuntimeError(
                f"pipeline schedule: receive {j} ({direction}) is micro-batch {i}, planned {order[j]}"
            )
        return self._shape(order[j + 1]) if j + 1 < len(order) else None

    def _shape(self, i: int) -> Optional[Tuple[int, ...]]:
        if self.tensor_shape is None or i >= self.m:
            return None
        return tuple(self.tensor_shape(i))

    def _check_sent(self, c: int, i: int, out: torch.Tensor) -> None:
        # The receiver allocates from tensor_shape / dtype: a mismatch would be read as garbage or hang it.
        want = self._shape(i)
        if want is not None and (tuple(out.shape) != want or out.dtype != self.p2p.dtype):
            raise ValueError(
                f"pipeline chunk {c}, micro-batch {i}: sends {out.dtype} {tuple(out.shape)} but "
                f"tensor_shape / pipeline_dtype declare {self.p2p.dtype} {want}; "
                "fix them or pass tensor_shape=None"
            )

    def add_input(self, c: int, x: Optional[torch.Tensor]) -> None:
        if x is not None and not self.forward_only:
            # The received activation is a leaf of this stage's graph: requires_grad is what makes backward
            # leave x.grad, the gradient to send upstream.
            x.requires_grad_()
        self.inputs[c][self.received[c]] = x
        self.received[c] += 1

    def add_grad(self, c: int, g: Optional[torch.Tensor]) -> None:
        self.grads[c][self.grads_received[c]] = g
        self.grads_received[c] += 1

    def _record(self, kind: str, c: int, i: int, start: float) -> None:
        record(self.timeline, kind, c, i, start)

    def forward(self, k: int) -> Optional[torch.Tensor]:
        """Forward of virtual micro-batch k; returns what to send to the next stage (None on the last)."""
        c, i = self.chunk_id(k, True), self.micro_id(k)
        x = None if self.first_stage(c) else self.inputs[c][i]
        start = time.perf_counter()
        with torch.no_grad() if self.forward_only else contextlib.nullcontext(), traced(FORWARD):
            out = self.forward_step(c, i, x)
        self._record("F", c, i, start)
        if self.forward_only:
            # Nothing is kept for a backward, so validation holds one micro-batch's activations at a time.
            self.inputs[c].pop(i, None)
        else:
            self.inputs[c][i] = x  # the first stage's None too: backward pops one per micro-batch
        if self.last_stage(c):
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "forward_step of the last pipeline stage must return (loss_to_backprop, loss_for_logging)"
                )
            # Detached: logging must not keep every micro-batch's graph alive until the step ends.
            self.losses[i] = out[1].detach() if isinstance(out[1], torch.Tensor) else out[1]
            if not self.forward_only:
                self.outputs[c][i] = out[0]
            return None
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"forward_step of chunk {c} (not the last stage) must return the hidden-states tensor"
            )
        if not self.forward_only:
            self.outputs[c][i] = out
        self._check_sent(c, i, out)
        return out

    def backward(self, k: int) -> Optional[torch.Tensor]:
        """Backward of virtual micro-batch k; returns the input grad for the previous stage."""
        c, i = self.chunk_id(k, False), self.micro_id(k)
        # Pop, so a micro-batch's activations are freed right after its backward (1F1B's memory bound).
        x, out = self.inputs[c].pop(i), self.outputs[c].pop(i)
        if self.last_stage(c):
            # The last stage starts from the loss (scaled); others start from the grad the next stage sent.
            tensors, grad = self.backward_loss(out), None
        else:
            tensors, grad = out, self.grads[c].pop(i)
        self.backwards_done[c] += 1
        last = self.backwards_done[c] == self.m  # this chunk's last backward: its buckets launch
        sync = contextlib.nullcontext() if last or self.no_sync is None else self.no_sync(c)
        start = time.perf_counter()
        with sync, traced(BACKWARD):
            torch.autograd.backward(tensors, grad_tensors=grad)
        self._record("B", c, i, start)
        return None if x is None else x.grad


class ReceiveOrder(ScheduleState):
    """A dry run of a schedule on ``state``'s rank: no compute, no p2p. Records the micro-batch
    index of every receive, per direction ("input" from the previous stage, "grad" from the
    next), in the order the schedule makes them: with interleaved chunks the next receive from
    a neighbour belongs to a chunk and micro-batch only the schedule's walk determines. The
    walk is the schedule's own code, so the order cannot drift from the real run's."""

    _SENT = object()  # stands for a tensor to send: the schedules only pass it on to exchange

    def __init__(self, state: ScheduleState) -> None:
        super().__init__(state.chunks, state.m, None, state.p2p, None, state.forward_only, None, None, None)
        self.order = {"input": [], "grad": []}

    def forward(self, k: int):  # type: ignore[override]
        return None if self.last_stage(self.chunk_id(k, True)) else self._SENT

    def backward(self, k: int):  # type: ignore[override]
        return None if self.first_stage(self.chunk_id(k, False)) else self._SENT

    def exchange(self, send_next=None, send_prev=None, input_for=None, grad_for=None) -> None:
        assert self.order is not None
        if input_for is not None:
            self.order["input"].append(self.received[input_for])
            self.received[input_for] += 1
        if grad_for is not None:
            self.order["grad"].append(self.grads_received[grad_for])
            self.grads_received[grad_for] += 1


def record(timeline: Optional[list], kind: str, c: int, i: int, start: float) -> None:
    """Appends one forward / backward to ``timeline`` (when not None), ending now."""
    if timeline is not None:
        timeline.append({"kind": kind, "chunk": c, "micro": i, "start": start, "end": time.perf_counter()})
