"""The gradient NaN/Inf agreement of ``check_for_nan_in_grad`` (DDP): every rank learns which
ranks saw a non-finite gradient and all of them raise, so none is left blocked in a collective
the others never join. The per-bucket flags are queued on the device during backward
(``megadlm_ext.nonfinite_flag``) and read here once per step."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import megadlm_ext as ext

from .param_and_grad_buffer import Bucket


def nonfinite_detail(checked: Sequence[Tuple[Bucket, torch.Tensor]], dp_rank: int) -> Optional[str]:
    """This rank's first bucket flagged before its collective, and its first parameter whose
    gradient is non-finite now (a local NaN/Inf survives the reduction); None if none."""
    for bucket, flag in checked:
        # A host sync per flag is fine here: only reached once the agreement found a NaN.
        if int(flag):
            rank = dist.get_rank() if dist.is_initialized() else 0
            name, shape = next(
                (
                    (n, tuple(p.shape))
                    for p, n in zip(bucket.params, bucket.names)
                    if ext.has_nonfinite([p.main_grad])  # type: ignore[attr-defined]
                ),
                ("(none non-finite after the collective)", ()),
            )
            return (
                f"rank {rank} (dp rank {dp_rank}) found NaN/Inf in bucket {bucket.index} "
                f"before the data-parallel collective; first offending parameter: {name} (shape {shape})"
            )
    return None


def flagged_ranks(comm, flag, device) -> List[int]:
    """One all-reduce over ``comm``: the ranks whose ``flag`` (a number or 0-d tensor) is
    nonzero, known to every rank. One slot per rank rather than a single OR, so every rank can
    name the ranks that failed."""
    flags = torch.zeros(comm.world_size, dtype=torch.float32, device=device)
    flags[comm.rank] = flag
    comm.all_reduce(flags, "sum")
    return [r for r, f in enumerate(flags.tolist()) if f > 0]


def agree_on_nan(comm, checked, device: torch.device, *, where: str, dp_rank: int) -> None:
    """One flag all-reduce over ``comm`` (the wrapper's communicator): ``checked`` holds this
    rank's (bucket, device flag) pairs of the step; a flag on any rank raises RuntimeError on
    every rank, naming the ranks (``where`` says which numbering) and, on the flagged rank,
    the bucket and parameter."""
    # device-side sum of the bucket flags: the one host sync is in flagged_ranks
    flag = torch.stack([f for _, f in checked]).sum() if checked else 0.0
    ranks = flagged_ranks(comm, flag, device)
    if ranks:
        detail = nonfinite_detail(checked, dp_rank)
        detail = detail or "this rank's gradients are finite; see the named rank's error"
        raise RuntimeError(
            f"check_for_nan_in_grad: NaN/Inf gradients on {where} {ranks}; every rank stops. Here: {detail}"
        )
