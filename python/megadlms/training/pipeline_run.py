"""Pipeline parallelism in the trainer: this rank's model chunks, and the forward step the
pipeline schedule runs for training and for validation (docs/architecture.md).

* :func:`build_chunks`: the GPTModel chunks of this pipeline rank (one per virtual stage,
  Megatron's split: ``megadlms.pipeline.stage_layers``), each initialised from the seed so
  that its weights are bitwise the whole model's;
* :class:`PipelineRunner`: one step's forward/backward through the schedule
  ``megadlms.pipeline.get_forward_backward_func`` picks (the one-stage schedule without
  pipeline parallelism, so the step has one code path), the tied-embedding parameters and
  group ``finalize_model_grads`` sums over; a forward-only pipeline for the validation NELBO.

Every stage of a pipeline group holds the same micro-batches (the same data-parallel rank)
and computes the same model inputs from them: the masked-diffusion noise is a function of
(seed, sample index, draw) only, so the first stage's noisy tokens, the positions a later
stage needs for rotary / document masks and the last stage's targets, mask and p_mask all
agree without being sent. Only the last stage computes a loss; the caller's loss owner
(tensor-parallel rank 0 of the last stage) contributes it to the step's reductions.

For the same reason every stage knows the shape of each micro-batch's activations (its crop,
sequence-parallel padding and context-parallel slice are computed from the batch): the
schedule gets ``tensor_shape(micro_index)`` and the p2p receives need no shape exchange (one
message per tensor; Megatron's ``--variable-seq-lengths`` off, yet lengths vary per step).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, NamedTuple, Tuple

import torch

from megadlms.common.enums import AttnMaskType
from megadlms.config import RunConfig
from megadlms.diffusion import (
    ObjectiveBatch,
    loss_token_count,
    token_cross_entropy_of,
    training_inputs,
    validation_draws,
    validation_inputs,
)
from megadlms.distributed import DataParallel, unwrap_model
from megadlms.models import GPTModel
from megadlms.parallel.context_parallel import shard_sequence
from megadlms.pipeline import (
    build_embedding_group,
    forward_backward_pipelining,
    get_forward_backward_func,
    model_chunks,
    stage_layers,
    stages_in_lockstep,
    tied_embedding_params,
)


def chunk_layout(config: RunConfig, pp_rank: int):
    """This pipeline rank's :class:`~megadlms.models.PipelineChunk` list (one per virtual stage)."""
    par, n = config.parallel, config.model.num_layers
    pp = par.pipeline_model_parallel_size
    ranges = stage_layers(
        n,
        pp,
        vp=par.virtual_stages(n),
        first_stage_layers=par.decoder_first_pipeline_num_layers,
        last_stage_layers=par.decoder_last_pipeline_num_layers,
    )[pp_rank]
    return model_chunks(ranges, pp_rank, pp, n)


def build_chunks(
    config: RunConfig, pp_rank: int, *, seed: int, device, core_attn_implementation: str, tp
) -> List[GPTModel]:
    """The plain GPTModel chunks of pipeline rank ``pp_rank``. Each chunk draws the whole
    model's tensors from ``seed`` and keeps its own, so the union over all ranks is bitwise the
    pp=1 model (and the tied embedding's copy on the last stage equals the embedding)."""
    out = []
    for chunk in chunk_layout(config, pp_rank):
        # The same seed for every chunk: each replays the whole model's init draws and keeps its layers, so
        # the chunks' weights are the pp=1 model's bit for bit.
        torch.manual_seed(seed)
        model = GPTModel(
            config.model, core_attn_implementation=core_attn_implementation, tp=tp, pipeline=chunk
        )
        out.append(model.to(device))
    return out


# What chunks send each other: fp32 whatever the precision (Float16Module returns its output as float,
# and FSDP2, whose bf16 would differ, runs without pipeline parallelism); the schedule refuses, by name,
# a chunk that sends another dtype.
PIPELINE_DTYPE = torch.float32

# Padding of the targets under context parallelism: never masked, never a loss token.
_CP_PADS = {"tokens": 0, "labels": 0, "clean": 0, "masked": False, "p_mask": 1.0, "loss_mask": 0.0}


def _cp_shard(inputs: ObjectiveBatch, cp, causal: bool, multiple: int) -> ObjectiveBatch:
    """This context-parallel rank's part of ``inputs`` (parallel/context_parallel.py): the noise
    and targets were made for the whole sequence (so they do not depend on cp), then sliced."""
    if inputs.document_ids is not None:
        raise ValueError(
            "--reset-attention-mask (document packing) is not supported with --context-parallel-size > 1"
        )
    tokens = inputs.tokens
    B, S = tokens.shape
    pos = inputs.position_ids
    pos = torch.arange(S, device=tokens.device).expand(B, S) if pos is None else pos.expand(B, S)
    targets = dict(inputs.targets)
    ref = next(t for t in targets.values() if t is not None)
    if targets.get("loss_mask") is None:  # the padding must not count as loss tokens
        targets["loss_mask"] = torch.ones(ref.shape, dtype=torch.float32, device=ref.device)
    out = shard_sequence(
        {"tokens": tokens, "position_ids": pos, **targets},
        _CP_PADS,
        cp=cp.size,
        rank=cp.rank,
        load_balance=causal,
        multiple=multiple,
    )
    part, part_pos = out.pop("tokens"), out.pop("position_ids")
    assert part is not None  # given above, so sliced, not None
    return dataclasses.replace(inputs, tokens=part, position_ids=part_pos, document_ids=None, targets=out)


class ValidationSums(NamedTuple):
    """A forward-only pipeline's validation sums (:meth:`PipelineRunner.validation_sums`)."""

    loss_sum: float
    """Non-zero only on the last stage."""
    num_tokens: float
    """Loss tokens, the same on every stage."""


class PipelineRunner:
    """The step's schedule over this rank's model chunks, its forward step, and what
    ``finalize_model_grads`` sums across stages (the tied embedding).

    ``model``: the step's ``DataParallel`` wrapper; its ``chunks`` are what the schedule runs
    (the one wrapper without pipeline: the one-stage schedule). Built once (collective under
    pipeline parallelism: creates the embedding groups). ``sharded``: the wrapper gathers and
    reduce-scatters each unit's parameters inside the forward/backward (FSDP2)."""

    def __init__(self, groups, model: DataParallel, sharded: bool = False) -> None:
        self.groups = groups
        self.chunks: List[DataParallel] = list(model.chunks)
        self.schedule = get_forward_backward_func(groups.pp.size)
        self.lockstep = stages_in_lockstep(groups.pp.size)  # see pipeline.stages_in_lockstep
        # The forward/backward holds collectives a failing rank would skip (``sharded``: FSDP2's
        # per-unit all-gathers and reduce-scatters): its failure cannot be paired (step.py, "Failures").
        axes = (groups.tp, groups.cp, groups.ep)
        self.unpaired = self.lockstep or sharded or any(axis.size > 1 for axis in axes)
        self.embedding_group = build_embedding_group(groups)  # None at pp 1 (no collective)
        self.tied = tied_embedding_params(self.chunks)
        self._last = [bool(unwrap_model(c).pipeline.post_process) for c in self.chunks]
        plain = unwrap_model(self.chunks[0])
        self.cp = groups.cp
        self._cp_causal = plain.attention == AttnMaskType.CAUSAL  # Megatron's 2C-chunk load balancing
        # under sequence parallelism each cp part is split again over tp
        self._cp_multiple = plain.tp.size if plain.tp.sequence_parallel else 1
        self._hidden = plain.config.hidden_size
        self._sp_split = plain.tp.size if plain.tp.sequence_parallel else 1

    def _prepare(self, inputs: ObjectiveBatch) -> ObjectiveBatch:
        if self.cp is None or self.cp.size == 1:
            return inputs
        return _cp_shard(inputs, self.cp, self._cp_causal, self._cp_multiple)

    def _hidden_shape(self, inputs: ObjectiveBatch) -> Tuple[int, ...]:
        """The [B, S, H] hidden states a chunk sends for ``inputs`` (GPTModel.forward: under
        sequence parallelism the sequence is padded to a multiple of tp and split over it)."""
        B, S = inputs.tokens.shape
        return (B, -(-S // self._sp_split), self._hidden)

    def _step_fn(self, prepare: Callable[[int], ObjectiveBatch], on_loss: Callable):
        """(forward_step, tensor_shape) of one schedule run over ``prepare``'s micro-batches."""
        cache: Dict[int, ObjectiveBatch] = {}
        shapes: Dict[int, Tuple[int, ...]] = {}
        last_chunk = len(self.chunks) - 1

        def prepared(micro_index: int) -> ObjectiveBatch:
            if micro_index not in cache:  # every chunk of this rank sees the same micro-batch
                cache[micro_index] = prepare(micro_index)
                shapes[micro_index] = self._hidden_shape(cache[micro_index])
            return cache[micro_index]

        def tensor_shape(micro_index: int) -> Tuple[int, ...]:
            # A receive may come before this rank's first forward of the micro-batch: prepare it then.
            return shapes[micro_index] if micro_index in shapes else self._hidden_shape(prepared(micro_index))

        def forward_step(chunk_index: int, micro_index: int, hidden):
            inputs = prepared(micro_index)
            if chunk_index == last_chunk:  # the last chunk's forward of a micro-batch is its last use here
                cache.pop(micro_index)
            chunk = self.chunks[chunk_index]
            out = inputs.forward(chunk, hidden)
            if not self._last[chunk_index]:
                return out
            loss_sum, _ = inputs.score(out, token_cross_entropy_of(unwrap_model(chunk)))
            return on_loss(loss_sum)

        return forward_step, tensor_shape

    def forward_backward(self, micro_batches: List[dict], cfg, crops, scales, device) -> torch.Tensor:
        """This rank's loss sum of the step (0 off the last stage); gradients accumulated in
        every chunk's buffers, each chunk's collectives launched on its last micro-batch.
        ``scales``: the step's ``distributed.StepScales`` (the 1/N on each micro-batch's
        loss, the loss scale on what its backward starts from)."""
        step, shape = self._step_fn(
            lambda i: self._prepare(training_inputs(micro_batches[i], cfg, crops[i])),
            # (what backward starts from, what is reported): the 1/N-scaled loss, and the raw sum detached.
            lambda loss_sum: (loss_sum * scales.loss, loss_sum.detach().to(torch.float64)),
        )
        losses = self.schedule(
            self.chunks,
            micro_batches,
            step,
            pp_group=self.groups.pp,
            backward_loss=scales.backward_loss,
            no_sync=lambda c: self.chunks[c].no_sync(),
            tensor_shape=shape,
            pipeline_dtype=PIPELINE_DTYPE,
        )
        total = torch.zeros((), dtype=torch.float64, device=device)
        for loss in losses:
            total += loss.to(device)
        return total

    @torch.no_grad()
    def validation_sums(self, batches: List[dict], cfg, *, num_mc_samples: int, seed: int) -> ValidationSums:
        """The sums of ``validation_nelbo`` over ``batches`` with a forward-only pipeline: one
        pipeline micro-batch per (batch, Monte Carlo draw)."""
        k = validation_draws(cfg, num_mc_samples)
        cfg = dataclasses.replace(cfg, seed=seed) if seed != cfg.seed else cfg
        # One pipeline micro-batch per (batch, draw): the K draws flow through the stages like more batches.
        micro = [(b, d) for b in batches for d in range(k)]
        step, shape = self._step_fn(
            lambda i: self._prepare(validation_inputs(micro[i][0], cfg, micro[i][1], k)),
            # / k: the mean over draws, validation_nelbo's 1/K.
            lambda loss_sum: (loss_sum, loss_sum.detach().to(torch.float64) / k),
        )
        was_training = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        try:
            losses = forward_backward_pipelining(
                self.chunks,
                micro,
                step,
                pp_group=self.groups.pp,
                forward_only=True,
                tensor_shape=shape,
                pipeline_dtype=PIPELINE_DTYPE,
            )
        finally:
            for c, mode in zip(self.chunks, was_training):
                c.train(mode)
        # Counted from the inputs alone, on every stage: all stages agree on N without sending it.
        # Under context parallelism every cp rank sees the whole micro-batch: cp rank 0 counts it.
        tokens = 0.0
        for b in batches if self.cp is None or self.cp.rank == 0 else ():
            tokens += float(loss_token_count(b, None, cfg, validation=True).double())
        return ValidationSums(loss_sum=float(sum(float(x) for x in losses)), num_tokens=tokens)
