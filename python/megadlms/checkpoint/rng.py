"""Per-rank RNG states of a checkpoint (``rng/rank_<r>.pt``): python, numpy, torch, cuda and the
model-parallel RNG tracker's streams (``megadlms.parallel.RNGStatesTracker``).

They are restored only at the same layout -- world size, tensor- and pipeline-parallel size: the TP
ranks of a group must share their default stream (dropout on replicated activations), which
per-rank states from another layout do not guarantee. Only dropout uses them; the masking
noise is a function of (seed, sample index).
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(rng_tracker=None) -> dict:
    """This process's RNG states (python, numpy, torch, cuda) and ``rng_tracker``'s streams."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # the legacy MT19937 tuple (a dict only for other bit generators)
    return {
        "tracker": rng_tracker.get_states() if rng_tracker is not None else None,
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        # A tensor, not a numpy array: weights_only=True loads tensors but refuses numpy objects.
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(s: dict, rng_tracker=None) -> None:
    """Restore what :func:`rng_state` returned (the tracker's streams when both exist)."""
    if rng_tracker is not None and s.get("tracker") is not None:
        rng_tracker.set_states(s["tracker"])
    random.setstate((s["python_version"], tuple(s["python"]), s["python_gauss"]))
    np.random.set_state(
        (
            "MT19937",
            s["numpy"].numpy().astype(np.uint32),
            s["numpy_pos"],
            s["numpy_has_gauss"],
            s["numpy_gauss"],
        )
    )
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def same_layout(common: dict, world: int, tp: int, pp: int = 1, ep: int = 1) -> bool:
    """True when the checkpoint recorded in ``common`` was saved at this world size, tp, pp and
    ep (checkpoints without a ``parallel`` record, or without one of its keys, were saved
    without that dimension): a rank's dropout stream belongs to its place in the grid."""
    # Defaults of 1: a checkpoint from before a dimension existed was saved without it.
    par = common.get("parallel", {})
    return (
        common.get("world_size") == world
        and par.get("tp", 1) == tp
        and par.get("pp", 1) == pp
        and par.get("ep", 1) == ep
    )
