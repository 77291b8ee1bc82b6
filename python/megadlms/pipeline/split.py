"""Which transformer layers each pipeline stage (and virtual chunk) builds: Megatron-core's split.

Facts from megatron/core/transformer (``get_num_layers_to_build``,
``get_transformer_layer_offset``), rewritten as one pure function over global layer indices:

* even: every pipeline rank holds ``num_layers / pp`` layers; rank r holds the r-th block.
* uneven (``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``, Megatron's
  ``num_layers_in_first/last_pipeline_stage``): the first (last) rank holds that many layers,
  the remaining layers are split evenly over the remaining ("middle") ranks.
* interleaved (``vp`` virtual chunks per rank): every rank's share is cut into ``vp`` equal
  chunks, and the model is laid out round by round: round v holds chunk v of rank 0, then
  chunk v of rank 1, ..., so with an even split chunk v of rank r is the ``(v*pp + r)``-th
  block of ``num_layers / (pp*vp)`` layers. Uneven stages with vp: each rank's layers must
  divide by vp (Megatron's rule); round v holds ``first/vp`` layers of rank 0, ``middle/vp``
  of each middle rank, ``last/vp`` of the last rank.
"""

from __future__ import annotations

from typing import List, Optional

from megadlms.models.chunk import PipelineChunk


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _per_rank_layers(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> List[int]:
    """Layers held by each pipeline rank (all its virtual chunks together)."""
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(
                f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp}; "
                f"choose a divisor, or set decoder_first_pipeline_num_layers / "
                f"decoder_last_pipeline_num_layers for an uneven split"
            )
        return [num_layers // pp] * pp
    if pp == 1:
        raise ValueError(
            "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers need "
            "pipeline_model_parallel_size > 1"
        )
    for name, value in (
        ("decoder_first_pipeline_num_layers", first),
        ("decoder_last_pipeline_num_layers", last),
    ):
        if value is not None:
            _positive(name, value)
    # Stages given an explicit count are not middle stages; the rest share what remains evenly.
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"decoder_first_pipeline_num_layers {first} + decoder_last_pipeline_num_layers {last} "
            f"must leave the other {middle_stages} pipeline stage(s) the rest of num_layers {num_layers} "
            f"(with pipeline_model_parallel_size {pp}, they must sum to {num_layers} when both are set)"
        )
    if middle_stages and (middle_layers % middle_stages or middle_layers == 0):
        raise ValueError(
            f"the {middle_layers} layers left by decoder_first_pipeline_num_layers {first} / "
            f"decoder_last_pipeline_num_layers {last} out of num_layers {num_layers} do not split "
            f"evenly (at least one each) over the {middle_stages} middle stages of "
            f"pipeline_model_parallel_size {pp}"
        )
    middle = middle_layers // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layers(
    num_layers: int,
    pp: int,
    *,
    vp: int = 1,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> List[List[range]]:
    """For each pipeline rank, the GLOBAL layer ranges of its ``vp`` virtual chunks.

    ``result[r][v]`` is ``range(start, stop)`` of chunk v on pipeline rank r (Megatron's layout,
    see the module docstring). ``first_stage_layers`` / ``last_stage_layers`` are
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``. Every chunk
    holds at least one layer. Raises ValueError naming the config fields when they do not
    divide: ``num_layers``, ``pipeline_model_parallel_size``,
    ``num_layers_per_virtual_pipeline_stage`` (vp), ``decoder_first/last_pipeline_num_layers``.
    """
    _positive("num_layers", num_layers)
    _positive("pipeline_model_parallel_size", pp)
    _positive("virtual pipeline size (num_layers_per_virtual_pipeline_stage)", vp)
    if vp > 1 and pp == 1:
        raise ValueError(
            "interleaved pipelining (num_layers_per_virtual_pipeline_stage / "
            "virtual_pipeline_model_parallel_size) needs pipeline_model_parallel_size > 1"
        )
    counts = _per_rank_layers(num_layers, pp, first_stage_layers, last_stage_layers)
    for r, n in enumerate(counts):
        if n % vp or n == 0:
            raise ValueError(
                f"pipeline stage {r} holds {n} layers (num_layers {num_layers}, "
                f"pipeline_model_parallel_size {pp}, decoder_first_pipeline_num_layers "
                f"{first_stage_layers}, decoder_last_pipeline_num_layers {last_stage_layers}), "
                f"which do not split into {vp} virtual chunks of at least one layer each: choose "
                f"num_layers_per_virtual_pipeline_stage dividing {n}"
            )
    out: List[List[range]] = [[] for _ in range(pp)]
    start = 0
    for _v in range(vp):  # round v: chunk v of rank 0, then of rank 1, ...
        for r in range(pp):
            # A rank's chunks are equal across rounds, so vp must divide each rank's count (checked above).
            size = counts[r] // vp
            out[r].append(range(start, start + size))
            start += size
    assert start == num_layers
    return out


def virtual_pipeline_size(
    num_layers: int,
    pp: int,
    *,
    num_layers_per_virtual_pipeline_stage: Optional[int] = None,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> int:
    """vp (chunks per rank) from Megatron's two spellings: ``num_layers_per_virtual_pipeline_stage``
    (vp = num_layers / pp / that, even split) or ``virtual_pipeline_model_parallel_size``; 1 if
    neither is set. Raises ValueError naming the fields when both are set or they do not divide."""
    per_stage, size = num_layers_per_virtual_pipeline_stage, virtual_pipeline_model_parallel_size
    if per_stage is not None and size is not None:
        raise ValueError(
            "set only one of num_layers_per_virtual_pipeline_stage and virtual_pipeline_model_parallel_size"
        )
    if size is not None:
        return _positive("virtual_pipeline_model_parallel_size", size)
    if per_stage is None:
        return 1
    _positive("num_layers_per_virtual_pipeline_stage", per_stage)
    if num_layers % (pp * per_stage):
        raise ValueError(
            f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp} x "
            f"num_layers_per_virtual_pipeline_stage {per_stage}"
        )
    return num_layers // (pp * per_stage)


def model_chunks(ranges: List[range], pp_rank: int, pp: int, num_layers: int) -> List[PipelineChunk]:
    """The :class:`PipelineChunk` of each of this rank's virtual chunks, ``ranges`` being
    ``stage_layers(...)[pp_rank]``: the embedding on the chunk holding layer 0 (chunk 0 of
    rank 0), the final norm and output layer on the chunk holding the last layer."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside pipeline_model_parallel_size {pp}")
    return [PipelineChunk(r.start == 0, r.stop == num_layers, r) for r in ranges]
