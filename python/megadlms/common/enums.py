"""The run's modes as enums, one per flag that picks a mode (the flag's value is the member's
value, so ``RunningMode("vanilla") is RunningMode.VANILLA``).

``megadlms.config`` parses each flag into its member once; the config dataclasses also accept
the value string (their ``__post_init__`` converts it: a library user may write
``DiffusionConfig(model_running_mode="vanilla")``), so code past the configs compares members,
never strings. ``StrEnum``: a member formats, prints and JSON-encodes as its value, so log lines
and the JSON run records read as before; configs store plain values in checkpoints
(:func:`plain`), so a checkpoint never pickles one of these classes.
"""

from __future__ import annotations

import enum
from typing import Any


class RunningMode(enum.StrEnum):
    """--model-running-mode: what the model learns."""

    DIFFLM_NOSHIFT = "difflm-noshift"
    """Masked diffusion: the model sees x_t at the positions of x_0 and predicts the masked tokens."""
    DIFFLM_SHIFT = "difflm-shift"
    """Masked diffusion with the autoregressive alignment (Dream, Fast-dLLM v2): the logits at
    position i predict the token at i + 1 (``megadlms.diffusion.shift``)."""
    VANILLA = "vanilla"
    """Autoregressive: next-token prediction on the shifted labels (a causal model)."""


class Objective(enum.StrEnum):
    """--difflm-objective: which reference implementation's diffusion objective."""

    MEGADLMS = "megadlms"
    LLADA = "llada"


class PMaskMode(enum.StrEnum):
    """--difflm-p-mask: the p in the loss weight 1/p."""

    SAMPLED = "sampled"
    """The sampled masking probability (LLaDA, MDLM)."""
    REALISED = "realised"
    """The row's realised masked fraction, at least one mask per row (MegaDLMs)."""


class AttnMaskType(enum.StrEnum):
    """The attention mask of a model (MegaDLMs' --attn-mask-type; --model-running-mode picks it)."""

    BIDIRECTIONAL = "bidirectional"
    CAUSAL = "causal"


class PositionEmbeddingType(enum.StrEnum):
    """--position-embedding-type."""

    ROPE = "rope"
    LEARNED_ABSOLUTE = "learned_absolute"


class RecomputeGranularity(enum.StrEnum):
    """--recompute-granularity."""

    FULL = "full"
    SELECTIVE = "selective"


class RecomputeMethod(enum.StrEnum):
    """--recompute-method."""

    UNIFORM = "uniform"
    BLOCK = "block"


class MoETokenDispatcher(enum.StrEnum):
    """--moe-token-dispatcher-type."""

    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"


class CommBackend(enum.StrEnum):
    """Who runs the data-parallel collectives (DistributedDataParallelConfig.comm_backend)."""

    TORCH = "torch"
    """torch.distributed (gloo or NCCL)."""
    NCCL_EXT = "nccl_ext"
    """The extension's own NCCL communicator (GPU only)."""


class OptimizerLayout(enum.StrEnum):
    """How a data-parallel wrapper lays out the gradients the optimizer reads."""

    REPLICATED = "replicated"
    """Every rank holds every gradient (DDP, a plain module)."""
    BUCKET_SHARDS = "bucket_shards"
    """Each rank owns a contiguous shard of every bucket (DDP + the distributed optimizer)."""
    DTENSOR = "dtensor"
    """Parameters and gradients are DTensors sharded on dim 0 (FSDP2)."""


class CkptFormat(enum.StrEnum):
    """--ckpt-format."""

    TORCH_DIST = "torch_dist"
    TORCH = "torch"


class NonPersistentCkptType(enum.StrEnum):
    """--non-persistent-ckpt-type."""

    GLOBAL = "global"
    LOCAL = "local"


class SFTLossNormalization(enum.StrEnum):
    """--sft-loss-normalization: how the fine-tuning loss is averaged."""

    SAMPLE = "sample"
    """LLaDA's: each sample's loss over its answer length (EOS padding included), averaged
    over the samples of the global batch."""
    TOKEN = "token"
    """The mean over every answer token of the global batch."""


MODE_ENUMS = (
    RunningMode,
    Objective,
    PMaskMode,
    AttnMaskType,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    MoETokenDispatcher,
    CommBackend,
    OptimizerLayout,
    CkptFormat,
    NonPersistentCkptType,
    SFTLossNormalization,
)
"""Every mode enum: tests/config/test_modes.py checks that no code outside config/ compares
one of their values as a string."""


def as_member(enum_cls: type[enum.Enum], value: Any) -> Any:
    """The member of ``enum_cls`` that ``value`` names, or ``value`` unchanged when it names
    none (None included): the config's own check then reports it with its message."""
    try:
        return enum_cls(value)
    except ValueError:
        return value


def plain(value: Any) -> Any:
    """``value`` with every enum member (in dicts, lists and tuples) replaced by its value: the
    records stored in checkpoints hold builtin types only."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
