"""GPT-style sample construction over an IndexedDataset, as Megatron-core's GPTDataset.

Three indices define the samples (megatron/core/datasets/gpt_dataset.py):

- document index: the split's document ids repeated for ``num_epochs`` epochs and shuffled
  with ``numpy.random.RandomState(seed)`` (the final epoch shuffled separately when it is
  used for less than 80 % of its samples, so a short last epoch is not biased);
- sample index ``[n+1, 2]``: (position in the document index, token offset) where sample
  ``j`` starts. Laying the documents end to end in document-index order, sample ``j`` is
  the ``seq_length + 1`` tokens starting at token ``j * seq_length`` (consecutive samples
  share one token, so every token is once a label); a trailing partial sample is dropped;
- shuffle index: a permutation of the samples (same RNG, after the document index).

Given the same documents, seed, sequence length and sample count the three arrays equal
Megatron's. They are cached as .npy files under ``data_cache_path`` (written atomically,
keyed by an md5 of a description of everything they depend on) and reused.

An item is a dict of torch tensors: ``text`` int64[s+1]; ``tokens`` = text[:-1] and
``labels`` = text[1:] (int64[s]); ``loss_mask`` float32[s] (0 where tokens == eod when
``eod_mask_loss``, as Megatron); ``position_ids`` int64[s] (0..s-1); ``sample_idx`` int64
scalar, the index the item was asked for (the global sample index the diffusion noise is
seeded with; a DataLoader's default collate stacks it to int64[b]).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: separate the final epoch if used < 80 %


def _build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        # All epochs in one shuffle, so documents of different epochs interleave; int32 and this exact call
        # sequence are Megatron's, which is what makes the permutation equal to theirs.
        doc_idx = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    # Shuffle the final epoch apart: the full epochs then hold every document equally often, and the small
    # used part of the last one cannot bias which documents are seen twice.
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """Vectorised form of Megatron's helpers.build_sample_idx (drop_last_partial_sequence)."""
    doc_lengths = np.asarray(sizes, dtype=np.int64)[document_index]
    ends = np.cumsum(doc_lengths)  # exclusive end token of each document-index entry
    # Stride seq_length but read seq_length + 1: the last token of sample j is the first of j + 1, so every
    # token is a label exactly once. num_samples + 1 starts give the end of the last sample.
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The document holding token p: the first entry whose end exceeds p (skips empty docs).
    pos = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[pos] - doc_lengths[pos])
    # Megatron always records (0, 0) for the first sample, even if document 0 is empty.
    pos[0], offsets[0] = 0, 0
    # Megatron's dtype rule, so the arrays compare equal to its helper's output.
    dtype = np.int32 if max(len(document_index), int(doc_lengths.max(initial=0))) < 2**31 - 1 else np.int64
    return np.stack([pos, offsets], axis=1).astype(dtype)


def _build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    # The samples of a separated final epoch are shuffled among themselves after the others, so the first
    # num_samples entries stay a permutation of the full epochs' samples.
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` (.npy) through a temporary file and a rename: a reader never
    sees a partial index file."""
    tmp = f"{path}.tmp.{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)  # concurrent builders (several ranks) write identical bytes


def _make_item(
    text: np.ndarray, idx: int, eod: Optional[int], eod_mask_loss: bool
) -> Dict[str, torch.Tensor]:
    text_t = torch.from_numpy(np.ascontiguousarray(text, dtype=np.int64))
    # clone: as views of one buffer, an in-place edit of tokens would also change labels and text.
    tokens, labels = text_t[:-1].clone(), text_t[1:].clone()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss:
        # Keyed on the input token, as Megatron: the label dropped is the one after an eod (the next
        # document's first token, unpredictable from the previous document).
        loss_mask[tokens == eod] = 0.0
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(tokens.numel(), dtype=torch.int64),
        "text": text_t,
        "sample_idx": torch.tensor(int(idx), dtype=torch.int64),
    }


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens over the documents ``document_ids`` of ``indexed``.

    Args:
        indexed: the IndexedDataset (one sequence per document, as megadlms-preprocess writes).
        document_ids: the documents of this split (e.g. ``np.arange(lo, hi)``).
        num_samples: samples wanted; epochs are added until they are covered (None: 1 epoch).
        seq_length: tokens per sample fed to the model (--seq-length).
        seed: --seed; the shuffles use ``numpy.random.RandomState(seed)``.
        eod: the tokenizer's end-of-document id (None if it has none); eod_mask_loss: zero
            the loss mask where the input token is eod.
        split_name: "train" / "valid" / "test" (part of the cache key).
        data_cache_path: directory for the index caches (None: build in memory only).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: Optional[int],
        *,
        seq_length: int,
        seed: int,
        eod: Optional[int],
        eod_mask_loss: bool = False,
        split_name: str = "train",
        data_cache_path: Optional[str] = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        # Megatron's GPTDataset samples over SEQUENCES (numel_low_level_dataset): a document
        # written as a list of sentences contributes one "document" per sentence, and a
        # document with no sequence (an empty text) contributes none.
        self.indexed = indexed
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        if eod_mask_loss and eod is None:
            raise ValueError("eod_mask_loss needs a tokenizer with an end-of-document token")
        self.seq_length, self.seed, self.eod = int(seq_length), int(seed), eod
        self.eod_mask_loss, self.split_name = bool(eod_mask_loss), split_name
        self.num_samples = num_samples
        self.tokens_per_epoch = int(np.sum(indexed.sequence_lengths[self.document_ids], dtype=np.int64))
        # Megatron repeats epochs until num_samples are covered, so a split smaller than one
        # sample still yields samples; only an empty one cannot (Megatron's epoch loop would
        # never end).
        if self.tokens_per_epoch == 0:
            raise ValueError(
                f"{indexed.path_prefix}: the {split_name} split has no tokens "
                f"({len(self.document_ids)} documents); give it documents (split, or more data)"
            )
        idx_stat = os.stat(indexed.path_prefix + ".idx")
        # Everything the indices depend on; a rewritten .idx (new size/mtime) is a new key.
        self.description = json.dumps(
            {
                "class": "GPTDataset",
                "path_prefix": os.path.abspath(indexed.path_prefix),
                "index_file": [idx_stat.st_size, idx_stat.st_mtime_ns],
                "split": split_name,
                "documents": hashlib.md5(self.document_ids.tobytes()).hexdigest(),
                "num_samples": num_samples,
                "seq_length": self.seq_length,
                "seed": self.seed,
            },
            sort_keys=True,
        )
        self.cache_hit = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(data_cache_path)

    def _num_epochs(self) -> int:
        if self.num_samples is None:
            return 1
        # + 1: the last sample reads one token past its seq_length (its final label). -(-a // b) is ceil.
        needed = self.num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _build(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, tpe = self.seq_length, self.tokens_per_epoch
        num_epochs = self._num_epochs()
        separate_final_epoch = False
        if num_epochs > 1:
            assert self.num_samples is not None  # None means one epoch (_num_epochs)
            # Samples the full epochs yield (their last token only serves as a label); the final epoch is
            # separated when under 80 % of its samples are needed.
            sans_final = ((num_epochs - 1) * tpe - 1) // s
            from_final = self.num_samples - sans_final
            per_epoch = (tpe - 1) // s
            separate_final_epoch = from_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
        # One RandomState for both shuffles, document index first: Megatron's draw order, hence its arrays.
        rng = np.random.RandomState(self.seed)
        document_index = _build_document_index(self.document_ids, num_epochs, rng, separate_final_epoch)
        # The sample index covers every sample of all epochs, not only num_samples, as Megatron's does.
        total = (num_epochs * tpe - 1) // s
        sample_index = _build_sample_index(self.indexed.sequence_lengths, document_index, s, total)
        n = sample_index.shape[0] - 1
        shuffle_index = _build_shuffle_index(sans_final if separate_final_epoch else n, n, rng)
        return document_index, sample_index, shuffle_index

    def _load_or_build(self, cache_dir: Optional[str]):
        if cache_dir is None:
            return self._build()
        key = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        base = os.path.join(cache_dir, f"{key}-GPTDataset-{self.split_name}")
        names = ("document_index", "sample_index", "shuffle_index")
        paths = [f"{base}-{n}.npy" for n in names]
        if all(os.path.isfile(p) for p in paths + [f"{base}-description.txt"]):
            self.cache_hit = True
            # mmap: the ranks on a node share the page cache instead of each holding a copy.
            return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        arrays = self._build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for p, a in zip(paths, arrays):
                atomic_save_npy(p, a)
            tmp = f"{base}-description.txt.tmp.{os.getpid()}"
            with open(tmp, "w") as f:  # written last: its presence marks a complete cache
                f.write(self.description)
            os.replace(tmp, f"{base}-description.txt")
        except OSError as exc:
            raise RuntimeError(
                f"data_cache_path {cache_dir}: cannot write the dataset index "
                f"cache ({exc}); pass a writable directory"
            ) from exc
        return arrays

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_text(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (after the shuffle)."""
        # The shuffle permutes whole samples; the tokens of one sample stay contiguous in document order.
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        doc = lambda i: int(self.document_index[i])  # noqa: E731
        if d0 == d1:
            # o1 is where the next sample starts; its token is also this sample's last label, hence + 1.
            return np.asarray(self.indexed.get(doc(d0), o0, o1 - o0 + 1), dtype=np.int64)
        parts = [self.indexed.get(doc(d0), o0)]
        parts += [self.indexed.get(doc(i)) for i in range(d0 + 1, d1)]
        parts.append(self.indexed.get(doc(d1), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"GPTDataset ({self.split_name}): sample {idx} out of range [0, {len(self)})")
        return _make_item(self.sample_text(idx), idx, self.eod, self.eod_mask_loss)


class MockGPTDataset(torch.utils.data.Dataset):
    """--mock-data: ``num_samples`` deterministic random samples in GPTDataset's item format.

    Sample ``i`` draws ``seq_length + 1`` ids uniformly from the vocabulary minus the mask
    token, with ``numpy.random.default_rng([seed, stream, i])`` (stream: 0 train, 1 valid,
    2 test): a function of (seed, stream, i) only.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seq_length: int,
        seed: int,
        vocab_size: int,
        eod: Optional[int],
        mask: Optional[int] = None,
        eod_mask_loss: bool = False,
        stream: int = 0,
    ):
        if num_samples < 0 or seq_length < 1 or vocab_size < 2:
            raise ValueError(
                f"MockGPTDataset: need num_samples >= 0, seq_length >= 1, vocab_size >= 2 "
                f"(got {num_samples}, {seq_length}, {vocab_size})"
            )
        self.num_samples, self.seq_length, self.seed = int(num_samples), int(seq_length), int(seed)
        if eod_mask_loss and eod is None:
            raise ValueError("eod_mask_loss needs a tokenizer with an end-of-document token")
        self.vocab_size, self.eod, self.mask = int(vocab_size), eod, mask
        self.eod_mask_loss, self.stream = bool(eod_mask_loss), int(stream)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockGPTDataset: sample {idx} out of range [0, {self.num_samples})")
        # A generator per sample: item i is the same whichever worker, batch or order asks for it.
        rng = np.random.default_rng([self.seed, self.stream, int(idx)])
        if self.mask is None:
            text = rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
        else:  # draw from V-1 ids and step over the mask id
            text = rng.integers(0, self.vocab_size - 1, self.seq_length + 1, dtype=np.int64)
            text[text >= self.mask] += 1
        return _make_item(text, idx, self.eod, self.eod_mask_loss)
