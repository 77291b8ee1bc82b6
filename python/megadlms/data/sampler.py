"""Data-parallel batch sampler with Megatron's order (MegatronPretrainingSampler).

Global sample indices run ``consumed_samples, consumed_samples + 1, ...``; every
``micro_batch_size * data_parallel_size`` of them form one global micro-batch, and rank ``r``
takes positions ``[r * micro_batch_size, (r + 1) * micro_batch_size)`` of it. Resuming with
the ``consumed_samples`` of a checkpoint continues the exact sequence. The yielded indices
are the global sample indices (items carry them as ``sample_idx``), which seed the
diffusion noise, so the noise does not depend on the data-parallel layout.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch


class PretrainingSampler:
    """Yields this rank's micro-batches as lists of global sample indices (a batch_sampler)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"PretrainingSampler: no samples to draw (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"PretrainingSampler: consumed_samples {consumed_samples} must be in "
                f"[0, {total_samples}) (the dataset is exhausted; build more samples)"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = int(total_samples), int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank, self.data_parallel_size = int(data_parallel_rank), int(data_parallel_size)
        self.drop_last = drop_last
        self._global = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        left = self.total_samples - self.consumed_samples
        full, rest = divmod(left, self._global)
        if self.drop_last or rest == 0:
            return full
        # The partial global batch: a rank gets a last micro-batch only if its slice starts before the end.
        return full + int(rest > self.data_parallel_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self._global <= self.total_samples:
            # Positions depend only on (start, rank): resuming at a checkpoint's consumed_samples continues
            # exactly, and the indices are global, so the noise they seed ignores the dp layout.
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += self._global
        if not self.drop_last and start < self.total_samples:
            # Megatron yields this rank's slice of the final partial global batch (may be empty)
            batch = list(range(start, self.total_samples))[lo : lo + self.micro_batch_size]
            if batch:
                yield batch


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    drop_last: bool = True,
    total_samples: Optional[int] = None,
    seed: int = 0,
):
    """A DataLoader over ``dataset`` with PretrainingSampler; batches are dicts of stacked
    tensors including ``sample_idx`` int64[b]. None if ``dataset`` is None.

    The loader owns a ``torch.Generator`` seeded with ``seed``: each ``iter(loader)`` draws
    its workers' base seed from it, never from the global torch RNG, so building or
    iterating a loader after a checkpoint's RNG restore leaves the dropout stream exactly
    where the uninterrupted run has it (bitwise resume with dropout)."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(
        len(dataset) if total_samples is None else total_samples,
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
        drop_last,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
