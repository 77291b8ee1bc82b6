"""Model-parallel RNG streams (Megatron's ``CudaRNGStatesTracker``, for CPU and CUDA).

Dropout draws from the default (global) generator of its device. Two streams are needed
under tensor parallelism:

* the DEFAULT stream, seeded identically on every TP rank, for dropout on activations that
  are replicated across the TP group (after a row-parallel layer), so replicas stay equal;
* the MODEL-PARALLEL stream, seeded differently per TP rank, for dropout on activations
  that are split across the group (attention probabilities of this rank's heads).

:meth:`RNGStatesTracker.fork` swaps a named stream into the device's default generator for
the duration of a ``with`` block and swaps the original back afterwards, so the default
stream continues exactly as if the block had not drawn anything.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the default seed and the model-parallel seeds.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device type (``"cpu"`` or ``"cuda"``), swapped in by :meth:`fork`."""

    def __init__(self, device_type: str = "cpu") -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"RNGStatesTracker: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self._states: Dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed`` (the default generator is untouched)."""
        if name in self._states:
            raise ValueError(f"RNGStatesTracker: stream {name!r} already exists")
        generator = torch.Generator(device=self.device_type)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of every stream's state (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Restore streams saved by :meth:`get_states`."""
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is restored after."""
        if name not in self._states:
            raise KeyError(f"RNGStatesTracker: no stream {name!r}; known: {sorted(self._states)}")
        # Saved so the block's draws do not advance the default stream: TP replicas keep identical masks.
        original = _get_state(self.device_type)
        _set_state(self._states[name], self.device_type)
        try:
            yield
        finally:
            # Keep the advanced state, or the next fork would replay the same dropout mask.
            self._states[name] = _get_state(self.device_type)
            _set_state(original, self.device_type)


def model_parallel_manual_seed(seed: int, tp_rank: int, device_type: str = "cpu") -> RNGStatesTracker:
    """Seed the default generator of ``device_type`` with ``seed`` (the same on every TP rank)
    and return a tracker whose model-parallel stream is seeded ``seed + 2718 + tp_rank``.

    Callers that add pipeline stages offset ``seed`` per stage before calling (Megatron adds
    ``100 * pp_rank``)."""
    if device_type == "cuda":
        # Only the current CUDA device's generator: each rank drives one device.
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    tracker = RNGStatesTracker(device_type)
    tracker.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def get_all_rng_states(tracker: Optional[RNGStatesTracker]) -> Tuple:
    """Every generator a dropout may draw from: the CPU default generator, the current CUDA
    device's (when CUDA is initialised) and ``tracker``'s named streams (Megatron's
    ``_get_all_rng_states``). Activation recomputation saves these before a forward and
    replays them (:func:`set_all_rng_states`), so the recomputed dropout masks are the same."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, None if tracker is None else tracker.get_states()


def set_all_rng_states(states: Tuple, tracker: Optional[RNGStatesTracker]) -> None:
    """Restore what :func:`get_all_rng_states` returned (the same ``tracker``)."""
    cpu, cuda, streams = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    if tracker is not None:
        tracker.set_states(streams)


@contextlib.contextmanager
def fork_all_rng(tracker: Optional[RNGStatesTracker]) -> Iterator[None]:
    """Run the block with any RNG states set inside it, then put back every state of
    :func:`get_all_rng_states` as it was before: the streams continue as if the block (a
    recomputation in the backward) had drawn nothing."""
    saved = get_all_rng_states(tracker)
    try:
        yield
    finally:
        set_all_rng_states(saved, tracker)
