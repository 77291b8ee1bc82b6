"""Build the train / valid / test datasets from Megatron-style data flags.

    --data-path A                       one dataset, split by --split
    --data-path 0.3 A 0.7 B             a weighted blend; every dataset split by --split
    --data-path A B                     unweighted: weights = the datasets' sizes
    --train-data-path / --valid-data-path / --test-data-path
                                        a separate blend per split (--split is ignored)
    --split 969,30,1                    shares of the documents for train, valid, test
    --mock-data                         MockGPTDataset (no files)

As Megatron-core (blended_megatron_dataset_builder.py): the split takes consecutive
document ranges ``[round(lo * D), round(hi * D))`` with bookends from the normalised split
weights; each blend member is asked for ``ceil(ceil(N * w) * 1.005)`` samples (0.5 % margin)
and the blend for N.
"""

from __future__ import annotations

import math
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .blended_dataset import BlendedDataset, normalize_weights
from .gpt_dataset import GPTDataset, MockGPTDataset
from .indexed_dataset import IndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
_SURPLUS = 0.005


def parse_blend(
    blend: Optional[Sequence[str]], flag: str = "data_path"
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Megatron's get_blend_from_list: ["0.3", "A", "0.7", "B"] -> (["A", "B"], [0.3, 0.7])."""
    if blend is None:
        return None
    items = [str(x) for x in blend]
    if not items:
        raise ValueError(f"{flag} is empty; give a dataset prefix or 'W1 P1 W2 P2 ...'")
    weights: Optional[List[float]] = None
    prefixes = items
    if len(items) % 2 == 0:
        pairs = list(zip(items[0::2], items[1::2]))
        parsed = []
        for w, _ in pairs:
            try:
                parsed.append(float(w))
            except ValueError:
                parsed.append(None)
        if all(w is not None for w in parsed):
            weights, prefixes = normalize_weights(parsed, flag), [p for _, p in pairs]
        elif any(w is not None for w in parsed):
            raise ValueError(
                f"{flag} {' '.join(items)}: mixes weights and prefixes; write either "
                "'W1 P1 W2 P2 ...' or 'P1 P2 ...'"
            )
    for p in prefixes:
        try:
            float(p)
        except ValueError:
            continue
        raise ValueError(
            f"{flag} {' '.join(items)}: {p!r} looks like a weight where a dataset "
            "prefix was expected (weights and prefixes must alternate)"
        )
    return [p.strip() for p in prefixes], weights


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalised [train, valid, test] shares (missing ones are 0)."""
    parts = re.findall(r"[.0-9]+", str(split))
    try:
        vec = [float(x) for x in parts]
    except ValueError:
        vec = []
    if not vec or len(vec) > 3 or sum(vec) <= 0:
        raise ValueError(
            f"split {split!r}: expected up to three non-negative numbers with a positive sum, e.g. 969,30,1"
        )
    vec += [0.0] * (3 - len(vec))
    return [x / sum(vec) for x in vec]


def split_document_ranges(split: Sequence[float], num_documents: int) -> List[Optional[np.ndarray]]:
    """Document ids of each split (None where its share is 0), as Megatron's bookends."""
    out: List[Optional[np.ndarray]] = []
    lo = 0.0
    for share in split:
        hi = lo + share
        if share == 0:
            out.append(None)
        else:
            beg, end = int(round(lo * num_documents)), int(round(hi * num_documents))
            out.append(np.arange(beg, end, dtype=np.int64))
        lo = hi
    return out


def _sizes_per_dataset(weights: Sequence[float], sizes: Sequence[int]) -> List[List[int]]:
    return [[int(math.ceil(math.ceil(n * w) * (1 + _SURPLUS))) for n in sizes] for w in weights]


def build_pretraining_datasets(
    *,
    data_path: Optional[Sequence[str]] = None,
    train_data_path: Optional[Sequence[str]] = None,
    valid_data_path: Optional[Sequence[str]] = None,
    test_data_path: Optional[Sequence[str]] = None,
    split: str = "969,30,1",
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int = 0,
    test_samples: int = 0,
    tokenizer,
    data_cache_path: Optional[str] = None,
    eod_mask_loss: bool = False,
    mock: bool = False,
):
    """(train, valid, test) datasets; None for a split with no share or 0 samples wanted.

    Every item is a dict with tokens / labels / loss_mask / position_ids / text / sample_idx
    (see GPTDataset). Deterministic given the flags; index caches go to ``data_cache_path``.
    """
    sizes = [int(train_samples or 0), int(valid_samples or 0), int(test_samples or 0)]
    # eod only feeds --eod-mask-loss; a tokenizer without one is fine otherwise.
    try:
        eod = tokenizer.eod
    except RuntimeError:
        if eod_mask_loss:
            raise
        eod = None
    if any(n < 0 for n in sizes):
        raise ValueError(f"sample counts must be >= 0, got train/valid/test {sizes}")
    per_split = (train_data_path, valid_data_path, test_data_path)
    given = [data_path is not None, any(p is not None for p in per_split)]
    if mock:
        if any(given):
            raise ValueError("mock_data cannot be combined with data_path / train_data_path")
        try:
            mask = tokenizer.mask
        except RuntimeError:  # AR (vanilla) runs need no mask token
            mask = None
        return tuple(
            MockGPTDataset(
                n,
                seq_length=seq_length,
                seed=seed,
                vocab_size=tokenizer.vocab_size,
                eod=eod,
                mask=mask,
                eod_mask_loss=eod_mask_loss,
                stream=i,
            )
            if n > 0
            else None
            for i, n in enumerate(sizes)
        )
    if given[0] and given[1]:
        raise ValueError(
            "data_path cannot be combined with train_data_path / valid_data_path "
            "/ test_data_path; use one or the other"
        )
    if not any(given):
        raise ValueError("no data: pass data_path PREFIX (or train_data_path ...), or mock_data")
    common = dict(
        seq_length=seq_length,
        seed=seed,
        eod=eod,
        eod_mask_loss=eod_mask_loss,
        data_cache_path=data_cache_path,
    )
    opened = {}

    def open_ds(prefix):
        if prefix not in opened:
            opened[prefix] = IndexedDataset(prefix)
        return opened[prefix]

    def build_split(blend, flag, i, doc_ranges_of):
        """The dataset of split i from blend (prefixes, weights)."""
        prefixes, weights = blend
        n = sizes[i]
        if n == 0:
            return None
        name = SPLIT_NAMES[i]
        if len(prefixes) == 1:
            docs = doc_ranges_of(open_ds(prefixes[0]))
            return (
                None if docs is None else GPTDataset(open_ds(prefixes[0]), docs, n, split_name=name, **common)
            )
        if weights is None:  # Megatron: one epoch of each, weighted by its size
            ranges = [doc_ranges_of(open_ds(p)) for p in prefixes]
            if any(r is None for r in ranges):
                return None
            parts = [
                GPTDataset(open_ds(p), r, None, split_name=name, **common) for p, r in zip(prefixes, ranges)
            ]
            total = sum(len(d) for d in parts)
            if n > total:
                raise ValueError(
                    f"{flag} (unweighted blend): {total} {name} samples in one epoch, "
                    f"fewer than the {n} wanted; give weights ('W1 P1 W2 P2 ...')"
                )
            return BlendedDataset(
                parts,
                [len(d) for d in parts],
                n,
                name=name,
                data_cache_path=data_cache_path,
                description="|".join(d.description for d in parts),
            )
        want = _sizes_per_dataset(weights, sizes)
        parts = []
        for p, w in zip(prefixes, want):
            docs = doc_ranges_of(open_ds(p))
            if docs is None:
                return None
            parts.append(GPTDataset(open_ds(p), docs, w[i], split_name=name, **common))
        return BlendedDataset(
            parts,
            weights,
            n,
            name=name,
            data_cache_path=data_cache_path,
            description="|".join(d.description for d in parts),
        )

    if given[0]:
        blend = parse_blend(data_path)
        shares = parse_split(split)

        def ranges(i):
            return lambda ds: split_document_ranges(shares, len(ds.sequence_lengths))[i]

        return tuple(build_split(blend, "data_path", i, ranges(i)) for i in range(3))
    whole = lambda ds: np.arange(len(ds.sequence_lengths), dtype=np.int64)  # noqa: E731
    out = []
    for i, (paths, flag) in enumerate(
        zip(per_split, ("train_data_path", "valid_data_path", "test_data_path"))
    ):
        out.append(None if paths is None else build_split(parse_blend(paths, flag), flag, i, whole))
    return tuple(out)
