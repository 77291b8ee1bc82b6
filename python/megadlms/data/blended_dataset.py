"""Blend several datasets by weight, as Megatron-core's BlendedDataset.

Weights are normalised to sum to 1. Sample ``k`` of the blend comes from the dataset whose
realised share lags its weight the most (Megatron's helpers.cpp ``build_blending_indices``):

    i_k = argmax_i ( w_i * max(k, 1) - c_i(k) ),   first index on ties,

where ``c_i(k)`` counts the samples taken from dataset ``i`` before ``k``; it takes that
dataset's next sample, ``c_i(k)``. Deterministic; after ``k`` samples every dataset is
within about one sample of ``w_i * k``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from .gpt_dataset import atomic_save_npy


class SizedDataset(Protocol):
    """A map-style dataset with a length (what a blend draws from)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def normalize_weights(weights: Sequence[float], what: str = "data_path") -> List[float]:
    w = [float(x) for x in weights]
    if not w or any(not np.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"{what}: blend weights must be finite, >= 0 and not all 0, got {list(weights)}")
    total = sum(w)
    return [x / total for x in w]


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) by the greedy rule above."""
    n = len(weights)
    w = [float(x) for x in weights]
    counts = [0] * n
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for k in range(size):
        # At k = 0 every error is 0; using 1 makes the first pick the heaviest dataset, as Megatron's C++
        # does.
        kk = max(float(k), 1.0)
        best, best_err = 0, w[0] * kk - counts[0]
        for i in range(1, n):
            err = w[i] * kk - counts[i]
            # Strict >: ties keep the lower index, the rule the Megatron indices are built with.
            if err > best_err:
                best, best_err = i, err
        dataset_index[k] = best
        dataset_sample_index[k] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Items are the inner dataset's items with ``sample_idx`` set to the blended index and
    ``dataset_id`` (int64) naming the source. Indices are cached under ``data_cache_path``.
    """

    def __init__(
        self,
        datasets: Sequence[SizedDataset],
        weights: Sequence[float],
        size: int,
        *,
        data_cache_path: Optional[str] = None,
        name: str = "train",
        description: Optional[str] = None,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"data_path blends at most 32767 datasets, got {len(datasets)}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.description = json.dumps(
            {
                "class": "BlendedDataset",
                "name": name,
                "size": self.size,
                "weights": self.weights,
                "inner": description,
            },
            sort_keys=True,
        )
        self.cache_hit = False
        self.dataset_index, self.dataset_sample_index = self._load_or_build(data_cache_path)
        # Fail at build time, not mid-run: the greedy order may ask a small member for more than it holds.
        for i, d in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == i]
            if used.size and int(used.max()) >= len(d):
                raise ValueError(
                    f"BlendedDataset ({name}): dataset {i} has {len(d)} samples but the "
                    f"blend needs {int(used.max()) + 1}; build it with more samples"
                )

    def _load_or_build(self, cache_dir: Optional[str]):
        if cache_dir is None or self.description is None:
            return build_blending_indices(self.weights, self.size)
        key = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        base = os.path.join(cache_dir, f"{key}-BlendedDataset")
        paths = [f"{base}-dataset_index.npy", f"{base}-dataset_sample_index.npy"]
        if all(os.path.isfile(p) for p in paths + [f"{base}-description.txt"]):
            self.cache_hit = True
            return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        arrays = build_blending_indices(self.weights, self.size)
        os.makedirs(cache_dir, exist_ok=True)
        for p, a in zip(paths, arrays):
            atomic_save_npy(p, a)
        tmp = f"{base}-description.txt.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.description)
        os.replace(tmp, f"{base}-description.txt")
        return arrays

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendedDataset: sample {idx} out of range [0, {self.size})")
        d = int(self.dataset_index[idx])
        item = dict(self.datasets[d][int(self.dataset_sample_index[idx])])
        # sample_idx seeds the diffusion noise: the inner index repeats across members, the blended one is
        # unique, so two members' samples never share masks.
        item["sample_idx"] = torch.tensor(int(idx), dtype=torch.int64)
        item["dataset_id"] = torch.tensor(d, dtype=torch.int64)
        return item
