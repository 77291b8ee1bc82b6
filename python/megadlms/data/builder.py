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

import logging
import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .blended_dataset import BlendedDataset, normalize_weights
from .gpt_dataset import GPTDataset, MockGPTDataset
from .indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SPLIT = "969, 30, 1"
"""Megatron's --split default when data_path is given without one."""
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
    # Only an even count can be weight/prefix pairs; an odd one is a list of prefixes.
    if len(items) % 2 == 0:
        pairs = list(zip(items[0::2], items[1::2]))
        parsed: List[Optional[float]] = []
        for w, _ in pairs:
            try:
                parsed.append(float(w))
            except ValueError:
                parsed.append(None)
        numbers = [w for w in parsed if w is not None]
        if len(numbers) == len(parsed):
            weights, prefixes = normalize_weights(numbers, flag), [p for _, p in pairs]
        elif any(w is not None for w in parsed):
            raise ValueError(
                f"{flag} {' '.join(items)}: mixes weights and prefixes; write either "
                "'W1 P1 W2 P2 ...' or 'P1 P2 ...'"
            )
    # A number where a prefix belongs is a misplaced weight far more often than a file named '0.3'.
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
    # Take the numbers, whatever separates them: Megatron accepts '969,30,1', '969, 30, 1' and '98/1/1'.
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
            # Round the cumulative bookends, not each share: neighbouring splits meet exactly and cover all
            # documents.
            beg, end = int(round(lo * num_documents)), int(round(hi * num_documents))
            out.append(np.arange(beg, end, dtype=np.int64))
        lo = hi
    return out


def _sizes_per_dataset(weights: Sequence[float], sizes: Sequence[int]) -> List[List[int]]:
    # 0.5 % spare per member: the greedy blend can ask a member for a few samples more than N * w.
    return [[int(math.ceil(math.ceil(n * w) * (1 + _SURPLUS))) for n in sizes] for w in weights]


def data_source_problems(
    *,
    mock: bool = False,
    data_path: Optional[Sequence[str]] = None,
    train_data_path: Optional[Sequence[str]] = None,
    valid_data_path: Optional[Sequence[str]] = None,
    test_data_path: Optional[Sequence[str]] = None,
    split: str = DEFAULT_SPLIT,
) -> List[str]:
    """The data-source rule, worded with field names: exactly one source (mock data, one blend
    split by ``split``, or one blend per split), and the train split gets data from it. Opens
    no file, so the CLI checks it before launch; :func:`build_pretraining_datasets` raises it."""
    per_split = (train_data_path, valid_data_path, test_data_path)
    # an empty list (a bare --data-path) is no source, as no flag at all
    sources = [bool(mock), bool(data_path), any(bool(p) for p in per_split)]
    if sum(sources) > 1:
        return [
            "use one data source: mock_data, data_path, or train_data_path/valid_data_path/"
            "test_data_path (they cannot be combined)"
        ]
    if sum(sources) == 0:
        return ["no training data: pass data_path PREFIX (or train_data_path PREFIX) or mock_data"]
    if sources[2] and not train_data_path:
        return [
            "valid_data_path / test_data_path without train_data_path: the train split has no data; "
            "pass train_data_path PREFIX too"
        ]
    out = []
    blends = [("data_path", data_path)] if data_path else []
    blends += [
        (f, p) for f, p in zip(("train_data_path", "valid_data_path", "test_data_path"), per_split) if p
    ]
    for flag, blend in blends:
        try:  # the blend's syntax (weights and prefixes): no file is opened
            parse_blend(blend, flag)
        except ValueError as exc:
            out.append(str(exc))
    if data_path:
        try:
            if parse_split(split)[0] == 0:
                out.append(
                    f"split {split!r} gives the train split no share of data_path: "
                    "make its first number positive"
                )
        except ValueError as exc:
            out.append(str(exc))
    return out


def _eod_of(tokenizer, eod_mask_loss: bool):
    """The tokenizer's eod id; it only feeds eod_mask_loss, so a tokenizer without one is fine
    otherwise (None)."""
    try:
        return tokenizer.eod
    except RuntimeError:
        if eod_mask_loss:
            raise
        return None


def _mock_datasets(sizes, tokenizer, *, seq_length, seed, eod, eod_mask_loss):
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
            stream=i,  # each split draws its own stream: train, valid and test differ
        )
        if n > 0
        else None
        for i, n in enumerate(sizes)
    )


class _SplitBuilder:
    """Builds the dataset of one split from a blend; each prefix is opened once for all splits."""

    def __init__(self, sizes: Sequence[int], data_cache_path: Optional[str], **common) -> None:
        self.sizes, self.cache, self.common = sizes, data_cache_path, common
        self.opened: Dict[str, IndexedDataset] = {}

    def open(self, prefix: str) -> IndexedDataset:
        if prefix not in self.opened:
            self.opened[prefix] = IndexedDataset(prefix)
        return self.opened[prefix]

    def build(self, blend, flag: str, i: int, doc_ranges_of):
        """Split ``i`` from ``blend`` = (prefixes, weights); ``doc_ranges_of(dataset)`` gives
        the split's document ids (None: no share). None when the split wants no samples."""
        prefixes, weights = blend
        n, name = self.sizes[i], SPLIT_NAMES[i]
        if n == 0:
            return None
        if len(prefixes) == 1:
            ds = self.open(prefixes[0])
            docs = doc_ranges_of(ds)
            if docs is not None and len(docs) == 0:
                return self._no_documents(prefixes[0], flag, i, skippable=i > 0 and flag == "data_path")
            return None if docs is None else self._gpt(ds, docs, n, name)
        if weights is None:
            return self._unweighted(prefixes, flag, n, name, doc_ranges_of)
        want = _sizes_per_dataset(weights, self.sizes)
        parts = []
        for p, w in zip(prefixes, want):
            docs = doc_ranges_of(self.open(p))
            # The split shares are the same for every member, so one None means the split has no data at all.
            if docs is None:
                return None
            if len(docs) == 0:
                return self._no_documents(p, flag, i, skippable=False)
            parts.append(self._gpt(self.open(p), docs, w[i], name))
        return self._blend(parts, weights, n, name)

    def _no_documents(self, prefix: str, flag: str, i: int, skippable: bool):
        """A split with a share but no documents (a tiny corpus: 969,30,1 of 12 documents gives
        the test split none). Megatron's epoch loop would never end on it; here a valid/test
        split of one dataset is skipped (None, as a split with no share), anything else is an
        error naming the fix."""
        name = SPLIT_NAMES[i]
        total = len(self.open(prefix).sequence_lengths)
        if skippable:
            logger.info(
                f"--data-path {prefix}: --split gives the {name} split none of its {total} "
                f"documents; no {name} evaluation (a larger {name} share or more documents gives one)"
            )
            return None
        where = "split" if flag == "data_path" else flag
        raise ValueError(
            f"{flag} {prefix}: the {name} split gets none of its {total} documents; "
            f"give the {name} split documents ({where}, or more data)"
        )

    def _unweighted(self, prefixes, flag, n, name, doc_ranges_of):
        """Megatron: one epoch of each dataset, weighted by its size."""
        ranges = [doc_ranges_of(self.open(p)) for p in prefixes]
        if any(r is None for r in ranges):
            return None
        parts = [self._gpt(self.open(p), r, None, name) for p, r in zip(prefixes, ranges)]
        # One epoch of each member: an unweighted blend cannot repeat data, so it holds at most total samples.
        total = sum(len(d) for d in parts)
        if n > total:
            raise ValueError(
                f"{flag} (unweighted blend): {total} {name} samples in one epoch, "
                f"fewer than the {n} wanted; give weights ('W1 P1 W2 P2 ...')"
            )
        return self._blend(parts, [len(d) for d in parts], n, name)

    def _gpt(self, ds, docs, n, name):
        return GPTDataset(ds, docs, n, split_name=name, data_cache_path=self.cache, **self.common)

    def _blend(self, parts, weights, n, name):
        description = "|".join(d.description for d in parts)
        return BlendedDataset(
            parts, weights, n, name=name, data_cache_path=self.cache, description=description
        )


def build_pretraining_datasets(
    *,
    data_path: Optional[Sequence[str]] = None,
    train_data_path: Optional[Sequence[str]] = None,
    valid_data_path: Optional[Sequence[str]] = None,
    test_data_path: Optional[Sequence[str]] = None,
    split: str = DEFAULT_SPLIT,
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
    eod = _eod_of(tokenizer, eod_mask_loss)
    if any(n < 0 for n in sizes):
        raise ValueError(f"sample counts must be >= 0, got train/valid/test {sizes}")
    per_split = (train_data_path, valid_data_path, test_data_path)
    problems = data_source_problems(
        mock=mock,
        data_path=data_path,
        split=split,
        **dict(zip(("train_data_path", "valid_data_path", "test_data_path"), per_split)),
    )
    if problems:
        raise ValueError("; ".join(problems))
    if mock:
        return _mock_datasets(
            sizes, tokenizer, seq_length=seq_length, seed=seed, eod=eod, eod_mask_loss=eod_mask_loss
        )
    builder = _SplitBuilder(
        sizes, data_cache_path, seq_length=seq_length, seed=seed, eod=eod, eod_mask_loss=eod_mask_loss
    )
    if data_path:
        blend, shares = parse_blend(data_path), parse_split(split)

        def ranges(i):  # the i-th consecutive document range of every dataset of the blend
            return lambda ds: split_document_ranges(shares, len(ds.sequence_lengths))[i]

        return tuple(builder.build(blend, "data_path", i, ranges(i)) for i in range(3))
    whole = lambda ds: np.arange(len(ds.sequence_lengths), dtype=np.int64)  # noqa: E731
    flags = ("train_data_path", "valid_data_path", "test_data_path")
    return tuple(
        None if not paths else builder.build(parse_blend(paths, flag), flag, i, whole)
        for i, (paths, flag) in enumerate(zip(per_split, flags))
    )
