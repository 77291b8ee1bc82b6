"""Pipeline schedules: 1F1B (PipeDream-flush, Narayanan et al. 2021) and interleaved 1F1B
(virtual stages), plus forward-only, on this rank's model chunks.

The order of forwards, backwards and the paired p2p calls is Megatron-core's
(``pipeline_parallel/schedules.py``: ``forward_backward_pipelining_without_interleaving`` and
``..._with_interleaving``), rewritten around one small state object (``state.py``). A micro-batch's
activations travel either with their shape (``p2p.py``'s headers: each step may crop its
sequence differently, nothing needs to be known in advance) or, when the caller gives
``tensor_shape(micro_index)`` (Megatron's fixed ``tensor_shape``, ``--variable-seq-lengths``
off, here per micro-batch, so per-step crops stay possible), as bare payloads received into
buffers of that shape: one message per tensor instead of two. A gradient has its activation's
shape, so one callable sizes both directions. Chunk ``c`` on pipeline rank ``r`` is model stage
``c * pp + r``; the first model stage takes no input, the last one returns the loss.

No pipeline (pp = 1) is the degenerate schedule, :func:`forward_backward_no_pipelining`
(Megatron's ``get_forward_backward_func``: :func:`get_forward_backward_func` picks it), with
the same arguments: the trainer's step runs one code path whatever pp is.

Gradient sync: ``no_sync(chunk_index)`` (the caller's, e.g. ``chunks[c].no_sync()`` of a
``DataParallel`` chunk; None for plain modules) is entered around every backward of a chunk
except that chunk's LAST micro-batch, so a DDP chunk's buckets launch (with
``overlap_grad_reduce``, during the rest of the backward) exactly once per step.
``finish_grad_sync()`` is the caller's (``distributed.finalize_model_grads``).

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` applies ``no_sync`` only to
torch's own ``DistributedDataParallel`` (an ``isinstance`` check; our DDP would reduce on every
micro-batch), infers activation shapes once at the first step and preallocates receive buffers
(our per-step crops change them), splits the batch itself and divides the grads by the number
of micro-batches unless told not to (our loss is a sum normalised once by the global token count).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from megadlms.common.ranges import BACKWARD, FORWARD, traced

from .p2p import PipelineP2P
from .state import NoSync, ReceiveOrder, ScheduleState, TensorShape, record

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], object]


class ModelChunk(Protocol):
    """What a schedule asks of a model chunk (a plain module or a data-parallel wrapper)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def micro_batch_problems(
    num_micro_batches: int,
    pp: int,
    vp: int = 1,
    forward_only: bool = False,
    *,
    batch: Optional[Tuple[int, int, int]] = None,
) -> List[str]:
    """The schedules' rule, worded with field names: m >= pp for 1F1B training, m a multiple
    of pp for interleaved (m = global_batch_size / (micro_batch_size x data_parallel_size)).
    ``batch``: (global_batch_size, micro_batch_size, data_parallel_size), so the message can
    show the count and the batch size that fixes it (the CLI passes it at parse time)."""
    m = num_micro_batches
    if batch is None:
        count = f"{m} micro-batches per step"
        # without the batch sizes the fix can only be stated as the formula
        fix = (
            "(micro-batches per step = global_batch_size / (micro_batch_size x data_parallel_size)); "
            "raise global_batch_size or lower micro_batch_size"
        )
        more = fewer = fix
    else:
        g, b, d = batch
        count = (
            f"global_batch_size {g} / (micro_batch_size {b} x data_parallel_size {d}) = "
            f"{m} micro-batches per step"
        )
        more = f"raise global_batch_size to {pp * b * d} or more"
        fewer = f"use a global_batch_size that is a multiple of {pp * b * d}"
    if m < 1:
        return [f"{count}: the pipeline schedule needs at least one micro-batch; {more}"]
    if vp > 1 and m % pp:  # also for forward-only: the interleaved order walks pp micro-batches at a time
        return [
            f"{count}: the interleaved pipeline schedule ({vp} virtual stages) needs a multiple of "
            f"pipeline_model_parallel_size {pp}; {fewer}"
        ]
    if not forward_only and m < pp:  # validation (forward only) may run fewer micro-batches
        return [
            f"{count}: the 1F1B pipeline schedule needs at least pipeline_model_parallel_size {pp} "
            f"micro-batches; {more}"
        ]
    return []


def check_micro_batches(num_micro_batches: int, pp: int, vp: int = 1, forward_only: bool = False) -> None:
    """:func:`micro_batch_problems` as a ValueError (the schedule's guard at run time)."""
    problems = micro_batch_problems(num_micro_batches, pp, vp, forward_only)
    if problems:
        raise ValueError(problems[0])


def _one_f_one_b(s: ScheduleState) -> None:
    """Warm-up forwards, steady 1F1B, cool-down backwards (Megatron's non-interleaved order)."""
    r, pp, m = s.rank, s.pp, s.m
    first, last = r == 0, r == pp - 1
    # Forwards before this stage's first backward: the later stages' pipeline depth, so the last stage
    # starts 1F1B at once and stage 0 fills the whole pipeline.
    warm = m if s.forward_only else min(pp - r - 1, m)
    rest = m - warm
    chunk0 = None if first else 0  # chunk 0's inputs come from the previous stage, except on the first
    for k in range(warm):
        s.exchange(input_for=chunk0)
        s.exchange(send_next=s.forward(k))
    # The steady phase's first input is received here; later ones arrive with each grad sent upstream.
    if rest:
        s.exchange(input_for=chunk0)
    for i in range(rest):
        final = i == rest - 1
        out = s.forward(warm + i)
        if s.forward_only:
            s.exchange(send_next=out)
            if not final:
                s.exchange(input_for=chunk0)
            continue
        # send_forward_recv_backward: one batch, paired with the next stage's send_backward_recv_forward
        # below, so the two neighbours' sends and receives are posted together and cannot deadlock.
        s.exchange(send_next=out, grad_for=None if last else 0)
        # Steady state: forward of micro-batch warm + i, then backward of the oldest in flight, i.
        grad_in = s.backward(i)
        # After the final steady forward no input is left to receive.
        s.exchange(send_prev=grad_in, input_for=None if final else chunk0)
    if s.forward_only:
        return
    # Cool-down: the warm-up's micro-batches (rest .. m - 1) still owe their backward, oldest first.
    for i in range(warm):
        if not last:
            s.exchange(grad_for=0)
        s.exchange(send_prev=s.backward(rest + i))


def _interleaved(s: ScheduleState) -> None:
    """Megatron's interleaved order: per rank, micro-batches in groups of pp go through chunk 0,
    then chunk 1, ...; each step's sends and receives are one paired p2p call."""
    r, pp, vp, m = s.rank, s.pp, s.vp, s.m
    first, last = r == 0, r == pp - 1
    total = m * vp
    # m == pp: the warm-up below would already cover every forward, so run them all, then all backwards.
    all_warmup = s.forward_only or m == pp
    # Megatron's count: (vp - 1) rounds of pp forwards to reach the last chunk, plus two per later stage,
    # as earlier ranks wait longer for the first grad to come back up.
    warm = total if all_warmup else min((pp - r - 1) * 2 + (vp - 1) * pp, total)
    rest = total - warm
    if not first:
        s.exchange(input_for=0)
    for k in range(warm):
        out = s.forward(k)
        nxt = s.chunk_id(k + 1, True)
        # Rank 0 reads chunk 0's input from the data; its other chunks receive from the last rank (ring).
        recv_prev = not (first and nxt == 0) and k != total - 1
        # The last warm-up step also posts the receive of the first grad (for the last chunk), to match the
        # next stage's first backward send.
        first_grad = k == warm - 1 and not all_warmup and not last
        s.exchange(
            send_next=out, input_for=nxt if recv_prev else None, grad_for=vp - 1 if first_grad else None
        )
    for i in range(rest):
        # Forward runs warm virtual steps ahead of backward.
        fk, bk = warm + i, i
        out = s.forward(fk)
        grad_in = s.backward(bk)
        recv_prev, recv_next = True, True
        if first:  # what arrives now from the last rank feeds the chunk after its current one
            nf = s.chunk_id(fk - (pp - 1), True)
            # The last rank's last chunk produced a loss, not an activation: nothing arrives for it.
            recv_prev, nf = nf != vp - 1, nf + 1
        else:
            nf = s.chunk_id(fk + 1, True)
        if last:
            # Mirror of the first rank: a grad arriving from rank 0 belongs to the chunk before the one rank 0
            # ran backward on; rank 0's chunk 0 (the first stage) sends none.
            nb = s.chunk_id(bk - (pp - 1), False)
            recv_next, nb = nb != 0, nb - 1
        else:
            nb = s.chunk_id(bk + 1, False)
        # The final steady forward was the step's last: no input left to receive.
        recv_prev = recv_prev and i != rest - 1
        s.exchange(out, grad_in, nf if recv_prev else None, nb if recv_next else None)
    if s.forward_only:
        return
    # With all forwards in warm-up the steady loop never received a grad: fetch the first one here.
    if all_warmup and not last:
        s.exchange(grad_for=vp - 1)
    for k in range(rest, total):
        grad_in = s.backward(k)
        nb = s.chunk_id(k + 1, False)
        # The last rank's last chunk starts from its own loss; after the final backward nothing comes.
        recv_next = not (last and nb == vp - 1) and k != total - 1
        s.exchange(send_prev=grad_in, grad_for=nb if recv_next else None)


def forward_backward_pipelining(
    chunks: Sequence[ModelChunk],
    micro_batches: Sequence[object],
    forward_step: ForwardStep,
    *,
    pp_group,
    backward_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    forward_only: bool = False,
    timeline: Optional[list] = None,
    device=None,
    no_sync: Optional[NoSync] = None,
    tensor_shape: Optional[TensorShape] = None,
    pipeline_dtype: Optional[torch.dtype] = None,
) -> List[Any]:
    """Run one step's micro-batches through this rank's model chunks (forward and backward).

    ``chunks``: this rank's chunks in order (len vp; DDP-wrapped or plain modules); vp > 1
    selects the interleaved schedule. ``micro_batches``: the step's micro-batches (the same
    list on every stage of the pipeline group; only their count is read here).
    ``forward_step(chunk_index, micro_index, input_tensor)``: run chunk ``chunk_index`` on
    micro-batch ``micro_index``; ``input_tensor`` is the previous stage's output (None on the
    first stage). It returns the hidden states, or on the last stage
    ``(loss_to_backprop 0-d, loss_for_logging)``. ``backward_loss``: applied to the loss before
    its backward (e.g. the optimizer's loss scale). ``pp_group``: ``ParallelGroups.pp`` or a
    process group. ``forward_only``: no grad, no backward (validation). ``timeline``: a list that
    receives one dict per forward / backward (``kind`` "F"/"B", ``chunk``, ``micro``,
    ``start``, ``end`` from ``time.perf_counter``; compute only, no p2p). ``device``: where
    received activations live (default: the first chunk's parameters'). ``no_sync``: see the
    module docstring (None: no gradient-sync control, e.g. plain modules).
    ``tensor_shape(micro_index)``: the shape every stage sends for that micro-batch (the same on
    every rank; a gradient has it too): receives are allocated from it, no shape headers; dtype
    ``pipeline_dtype`` (default: the first chunk's parameters'). None: shapes travel in headers.

    Returns the ``loss_for_logging`` of every micro-batch (in micro-batch order) on the last
    stage, [] on the others. Does not call ``finish_grad_sync()``.
    """
    if len(chunks) < 1:
        raise ValueError("forward_backward_pipelining needs at least one model chunk")
    first_param = next(iter(chunks[0].parameters()))
    device = first_param.device if device is None else device
    dtype = None if tensor_shape is None else (pipeline_dtype or first_param.dtype)
    p2p = PipelineP2P(pp_group, device, dtype)
    check_micro_batches(len(micro_batches), p2p.size, len(chunks), forward_only)
    state = ScheduleState(
        list(chunks),
        len(micro_batches),
        forward_step,
        p2p,
        backward_loss,
        forward_only,
        timeline,
        no_sync,
        tensor_shape,
    )
    schedule = _interleaved if len(chunks) > 1 else _one_f_one_b
    if p2p.receives_ahead:
        # p2p posts each receive a call early: it needs the next one's shape, from a dry run of the walk
        dry = ReceiveOrder(state)
        schedule(dry)
        state.order = dry.order
    schedule(state)
    p2p.finish()
    if not state.last_stage(len(chunks) - 1):
        return []
    return [state.losses[i] for i in range(len(micro_batches))]


def forward_backward_no_pipelining(
    chunks: Sequence[ModelChunk],
    micro_batches: Sequence[object],
    forward_step: ForwardStep,
    *,
    pp_group=None,
    backward_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
    forward_only: bool = False,
    timeline: Optional[list] = None,
    device=None,
    no_sync: Optional[NoSync] = None,
    tensor_shape: Optional[TensorShape] = None,
    pipeline_dtype: Optional[torch.dtype] = None,
) -> List[Any]:
    """The one-stage schedule (no pipeline), with :func:`forward_backward_pipelining`'s
    arguments: ``chunks`` is the one whole model, ``forward_step(0, i, None)`` returns
    ``(loss_to_backprop, loss_for_logging)``; ``pp_group``, ``device``, ``tensor_shape`` and
    ``pipeline_dtype`` are not used (nothing is sent).

    Each micro-batch's forward and backward run back to back (no activations of several
    micro-batches alive at once); all but the last under ``no_sync(0)``, forward included,
    as Megatron's ``forward_backward_no_pipelining``. Returns every ``loss_for_logging``."""
    if len(chunks) != 1:
        raise ValueError(f"the one-stage schedule runs one model chunk, got {len(chunks)}")
    losses = []
    for i in range(len(micro_batches)):
        last = i == len(micro_batches) - 1
        # Forward included, as Megatron: torch's DDP decides in forward whether its backward will reduce.
        with contextlib.nullcontext() if last or no_sync is None else no_sync(0):
            start = time.perf_counter()
            with torch.no_grad() if forward_only else contextlib.nullcontext(), traced(FORWARD):
                out = forward_step(0, i, None)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "forward_step of the one-stage schedule must return (loss_to_backprop, loss_for_logging)"
                )
            record(timeline, "F", 0, i, start)
            losses.append(out[1].detach() if isinstance(out[1], torch.Tensor) else out[1])
            if not forward_only:
                start = time.perf_counter()
                with traced(BACKWARD):
                    torch.autograd.backward(backward_loss(out[0]))
                record(timeline, "B", 0, i, start)
    return losses


def get_forward_backward_func(pp_size: int) -> Callable[..., List[Any]]:
    """The schedule for ``pp_size`` pipeline stages (Megatron's name): the one-stage schedule
    at 1, else 1F1B (interleaved when the caller passes several chunks)."""
    return forward_backward_pipelining if pp_size > 1 else forward_backward_no_pipelining


def stages_in_lockstep(pp_size: int) -> bool:
    """Whether the schedule's ranks wait on each other's point-to-point messages (pp > 1):
    then a rank that cannot run the schedule must make every rank skip it, and one that fails
    inside it must stop at once (its exit ends its peers' waits) instead of carrying the
    error to the step's reductions, which its peers never reach."""
    return pp_size > 1
