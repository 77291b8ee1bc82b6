"""Supervised fine-tuning samples over tokenized conversations (LLaDA's SFT layout).

An item has GPTDataset's shape plus the answer mask. With ``seq`` the sample's ids (history
+ one assistant turn, data/chat.py, BOS first) padded to ``seq_length`` with the tokenizer's
eod, the padding being ANSWER (LLaDA: the model learns where to stop):

    labels       int64[S]   seq: the conversation as the template renders it, from position 0
    tokens       int64[S]   [eod] + seq[:-1] (the shifted input of the autoregressive mode)
    answer_mask  bool[S]    answer(seq)            (aligned with labels)
    loss_mask    float32[S] answer_mask as 1.0 / 0.0
    position_ids int64[S]   0..S-1 (packing: restarting at each conversation)
    sample_idx   int64      the global sample index (seeds the diffusion noise)
    document_ids int64[S]   packing only: the conversation of each labels position, as
                            data/packing.py's ``document_ids``

The diffusion objective reads ``labels`` (--sft needs --difflm-objective llada), so the model
sees a conversation exactly as generation feeds it (megadlms-generate --chat): BOS at position 0.
A sample longer than ``S`` loses the start of its prompt (never the answer's start);
when the answer alone is longer, the prompt goes and the answer's end is cut. Both are
counted (``num_truncated``, ``num_answer_truncated``) for the trainer to log.

Packing (--sft-sequence-packing) fills each row greedily with whole samples in the shuffled
order; the row's tail is eod padding that belongs, as answer, to its last conversation, so a
row holding one conversation equals the unpacked item.

Epochs: the split's samples are repeated and shuffled with ``numpy.random.RandomState(seed)``
until ``num_samples`` items (rows, when packing) exist, with GPTDataset's document-index
shuffle (a short final epoch shuffled apart).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .builder import parse_split, split_document_ranges
from .gpt_dataset import _FINAL_EPOCH_THRESHOLD, _build_document_index
from .indexed_dataset import IndexedDataset
from .packing import document_ids as packed_document_ids
from .packing import reset_position_ids
from .sft_store import (
    ANSWER_SUFFIX,
    TEXT_SUFFIX,
    ConcatConversations,
    ConversationStore,
    IndexedConversations,
    MemoryConversations,
    cached_conversations,
)
from .tokenizers import HuggingFaceTokenizer


def truncate_sample(ids: np.ndarray, answer: np.ndarray, limit: int) -> Tuple[np.ndarray, np.ndarray]:
    """``ids`` / ``answer`` cut to ``limit`` tokens: from the left of the prompt, keeping the
    answer's start; if the answer alone is longer, from the answer's end."""
    n = len(ids)
    if n <= limit:
        return ids, answer
    start = int(np.argmax(answer)) if answer.any() else n
    drop = n - limit
    if drop <= start:
        return ids[drop:], answer[drop:]
    return ids[start : start + limit], answer[start : start + limit]


class SFTDataset(torch.utils.data.Dataset):
    """SFT items over the conversations ``conversation_ids`` of ``store`` (data/sft_store.py).

    Args:
        store: tokenized conversations (IndexedConversations, MemoryConversations, ...).
        conversation_ids: the conversations of this split.
        num_samples: items wanted (rows when packing); None: one epoch.
        seq_length: S, tokens per item fed to the model.
        seed: --seed, for the epoch shuffles.
        eod: the pad id (the tokenizer's end-of-text), an answer token.
        packing: several conversations per row, with document_ids.
        split_name: for messages.
    """

    def __init__(
        self,
        store: ConversationStore,
        conversation_ids: np.ndarray,
        num_samples: Optional[int],
        *,
        seq_length: int,
        seed: int,
        eod: int,
        packing: bool = False,
        split_name: str = "train",
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.store, self.seq_length, self.seed, self.eod = store, int(seq_length), int(seed), int(eod)
        self.packing, self.split_name = bool(packing), split_name
        docs = np.asarray(store.document_indices, dtype=np.int64)
        conv = np.asarray(conversation_ids, dtype=np.int64)
        self.sample_ids = (
            np.concatenate([np.arange(docs[c], docs[c + 1]) for c in conv])
            if len(conv)
            else np.zeros(0, np.int64)
        )
        if len(self.sample_ids) == 0:
            raise ValueError(
                f"SFT {split_name} split has no samples ({len(conv)} conversations); give it conversations "
                "(split, or more data)"
            )
        self.skipped = int(getattr(store, "skipped", 0))
        lengths = np.asarray(store.sequence_lengths, dtype=np.int64)[self.sample_ids]
        long = self.sample_ids[lengths > self.seq_length]
        self.num_truncated = len(long)
        self.num_answer_truncated = sum(
            1
            for i in long
            if int(store.sequence_lengths[i]) - int(np.argmax(store.answer(i))) > self.seq_length
        )
        self.num_samples = num_samples
        rng = np.random.RandomState(self.seed)
        if self.packing:
            self.order, self.row_starts = self._pack(rng)
        else:
            self.order = self._epochs(rng, num_samples)

    def _epochs(self, rng: np.random.RandomState, num_samples: Optional[int]) -> np.ndarray:
        n = len(self.sample_ids)
        if num_samples is None:
            return _build_document_index(self.sample_ids, 1, rng, False)[:n]
        num_epochs = max(1, -(-num_samples // n))
        from_final = num_samples - (num_epochs - 1) * n
        separate = num_epochs > 1 and from_final < int(_FINAL_EPOCH_THRESHOLD * n)
        return _build_document_index(self.sample_ids, num_epochs, rng, separate)[:num_samples]

    def _pack(self, rng: np.random.RandomState) -> Tuple[np.ndarray, np.ndarray]:
        # Greedy, in the shuffled order, one epoch at a time until num_samples rows are complete.
        limit = self.seq_length
        lengths = np.minimum(np.asarray(self.store.sequence_lengths, dtype=np.int64), limit)
        order: List[np.ndarray] = []
        starts, pos, fill = [0], 0, 0
        while True:
            epoch = _build_document_index(self.sample_ids, 1, rng, False)
            order.append(epoch)
            for s in epoch:
                n = int(lengths[s])
                if fill and fill + n > limit:
                    starts.append(pos)
                    fill = 0
                    if self.num_samples is not None and len(starts) - 1 == self.num_samples:
                        return np.concatenate(order).astype(np.int64), np.asarray(starts, np.int64)
                fill, pos = fill + n, pos + 1
            if self.num_samples is None:
                starts.append(pos)  # the epoch's last row
                return np.concatenate(order).astype(np.int64), np.asarray(starts, np.int64)

    def __len__(self) -> int:
        return len(self.row_starts) - 1 if self.packing else len(self.order)

    def _sample(self, s: int) -> Tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(self.store.tokens(s), dtype=np.int64)
        answer = np.asarray(self.store.answer(s), dtype=bool)
        return truncate_sample(ids, answer, self.seq_length)

    def row(self, idx: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``idx`` as (ids, answer, conversation number) over ``seq_length + 1`` tokens: a
        leading eod (the autoregressive input's first token, never a label) and the samples."""
        samples = (
            self.order[self.row_starts[idx] : self.row_starts[idx + 1]]
            if self.packing
            else self.order[idx : idx + 1]
        )
        parts = [self._sample(int(s)) for s in samples]
        ids = np.concatenate([p[0] for p in parts])
        answer = np.concatenate([p[1] for p in parts])
        conv = np.concatenate([np.full(len(p[0]), k, dtype=np.int64) for k, p in enumerate(parts)])
        pad = self.seq_length - len(ids)
        # eod padding is answer and belongs to the last conversation: the model learns to stop.
        ids = np.concatenate([[self.eod], ids, np.full(pad, self.eod, dtype=np.int64)])
        answer = np.concatenate([[False], answer, np.ones(pad, dtype=bool)])
        conv = np.concatenate([[0], conv, np.full(pad, len(parts) - 1, dtype=np.int64)])
        return ids, answer, conv

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"SFTDataset ({self.split_name}): sample {idx} out of range [0, {len(self)})")
        ids, answer, conv = self.row(idx)
        text = torch.from_numpy(ids)
        answer_mask = torch.from_numpy(answer[1:].copy())
        item = {
            "tokens": text[:-1].clone(),
            "labels": text[1:].clone(),
            "answer_mask": answer_mask,
            "loss_mask": answer_mask.to(torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
            "sample_idx": torch.tensor(int(idx), dtype=torch.int64),
        }
        if self.packing:
            # A 1 on each conversation's last token marks the boundaries as eod does in pretraining, so the
            # packing functions give the same position_ids / document_ids conventions.
            marker = torch.from_numpy((conv[:-1] != conv[1:]).astype(np.int64))[None]
            item["position_ids"] = reset_position_ids(marker, 1)[0]
            item["document_ids"] = packed_document_ids(marker, 1)[0]
        return item


def _as_list(paths: Any) -> List[str]:
    return [paths] if isinstance(paths, str) else [str(p) for p in paths]


def open_conversations(
    paths: Any, tokenizer_model: str, *, cache_dir: Optional[str] = None, skip_invalid: bool = False
) -> ConversationStore:
    """One store over ``paths``: jsonl files (tokenized, through the cache when ``cache_dir``) or
    prefixes megadlms-preprocess-sft wrote (``P`` or ``P_text_document``)."""
    stores: List[ConversationStore] = []
    for path in _as_list(paths):
        prefix = path[: -len(TEXT_SUFFIX)] if path.endswith(TEXT_SUFFIX) else path
        if IndexedDataset.exists(prefix + TEXT_SUFFIX):
            stores.append(IndexedConversations(prefix))
        elif os.path.isfile(path):
            if cache_dir is None:
                stores.append(MemoryConversations(path, tokenizer_model, skip_invalid=skip_invalid))
            else:
                stores.append(
                    cached_conversations(path, tokenizer_model, cache_dir, skip_invalid=skip_invalid)
                )
        else:
            raise FileNotFoundError(
                f'SFT data {path!r}: neither a jsonl file of {{"messages": [...]}} rows nor a prefix '
                f"with {TEXT_SUFFIX}/{ANSWER_SUFFIX} .bin/.idx (megadlms-preprocess-sft --output-prefix)"
            )
    return stores[0] if len(stores) == 1 else ConcatConversations(stores)


def build_sft_datasets(
    *,
    data_path: Any = None,
    split: str = "969,30,1",
    train_data_path: Any = None,
    valid_data_path: Any = None,
    tokenizer_model: str,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    packing: bool = False,
    skip_invalid: bool = False,
    cache_dir: Optional[str] = None,
) -> Tuple[Optional[SFTDataset], Optional[SFTDataset]]:
    """(train, valid) SFT datasets from Megatron-style data paths (valid None when it has no
    conversations or ``valid_samples`` is 0).

    ``data_path``: jsonl files / preprocessed prefixes split by ``split`` between
    conversations; or ``train_data_path`` / ``valid_data_path`` (``split`` ignored).
    ``tokenizer_model``: the tokenizer directory with the chat template; its eod pads.
    """
    if (data_path is None) == (train_data_path is None):
        raise ValueError("SFT data: give data_path, or train_data_path (and valid_data_path), not both")
    eod = HuggingFaceTokenizer(tokenizer_model).eod

    def open_(paths: Any) -> ConversationStore:
        return open_conversations(paths, tokenizer_model, cache_dir=cache_dir, skip_invalid=skip_invalid)

    sources: List[Tuple[Optional[ConversationStore], Optional[np.ndarray]]]
    if data_path is not None:
        store = open_(data_path)
        ranges = split_document_ranges(parse_split(split), len(store.document_indices) - 1)
        sources = [(store, ranges[0]), (store, ranges[1])]
    else:
        train = open_(train_data_path)
        sources = [(train, np.arange(len(train.document_indices) - 1))]
        if valid_data_path is None:
            sources.append((None, None))
        else:
            valid = open_(valid_data_path)
            sources.append((valid, np.arange(len(valid.document_indices) - 1)))
    out: List[Optional[SFTDataset]] = []
    for (src, convs), name, n in zip(sources, ("train", "valid"), (train_samples, valid_samples)):
        # An empty train split is an error (SFTDataset says so); an empty valid one means no validation.
        if src is None or (name == "valid" and (convs is None or len(convs) == 0 or n == 0)):
            out.append(None)
            continue
        convs = np.zeros(0, dtype=np.int64) if convs is None else convs
        out.append(
            SFTDataset(
                src, convs, n, seq_length=seq_length, seed=seed, eod=eod, packing=packing, split_name=name
            )
        )
    return out[0], out[1]
