"""Tokenized SFT conversations on disk and in memory: the format megadlms-preprocess-sft
writes and the jsonl cache reuses.

A prefix ``P`` is two Megatron indexed datasets with the same sequence lengths:

- ``P_text_document.{bin,idx}``: token ids, one SEQUENCE per sample (an assistant turn with
  its history), one DOCUMENT per conversation (its samples), so splits cut between
  conversations and never put two turns of one dialogue on both sides;
- ``P_answer_document.{bin,idx}``: the uint8 answer mask of each sample (1 = answer).

Both are memory-mapped on read (:class:`IndexedConversations`). A store answers
``sequence_lengths``, ``document_indices`` (conversation c holds samples
``[d[c], d[c + 1])``), ``tokens(i)`` and ``answer(i)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from .chat import Sample, conversation_samples, load_chat_tokenizer
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

TEXT_SUFFIX = "_text_document"
ANSWER_SUFFIX = "_answer_document"
_FORMAT = 1  # bump when the tokenization changes: old caches are then not reused

_worker_state: Dict[str, Any] = {}  # this worker process's chat tokenizer (_init_worker)


class ConversationStore(Protocol):
    """What SFTDataset reads: samples grouped by conversation."""

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int[N]: tokens of each sample."""
        ...

    @property
    def document_indices(self) -> np.ndarray:
        """int64[C + 1]: conversation c holds samples [d[c], d[c + 1])."""
        ...

    skipped: int
    """Rows skip_invalid dropped while tokenizing."""

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of sample ``i``."""
        ...

    def answer(self, i: int) -> np.ndarray:
        """bool answer mask of sample ``i``."""
        ...


class IndexedConversations:
    """The samples written under prefix ``P`` (P_text_document + P_answer_document), mmapped."""

    def __init__(self, prefix: str, skipped: int = 0):
        self.prefix = prefix
        self.text = IndexedDataset(prefix + TEXT_SUFFIX)
        self.answers = IndexedDataset(prefix + ANSWER_SUFFIX)
        self.skipped = int(skipped)  # rows skip_invalid dropped while tokenizing
        if not np.array_equal(
            self.text.sequence_lengths, self.answers.sequence_lengths
        ) or not np.array_equal(self.text.document_indices, self.answers.document_indices):
            raise ValueError(
                f"{prefix}: {TEXT_SUFFIX} and {ANSWER_SUFFIX} do not hold the same samples; "
                "re-run megadlms-preprocess-sft"
            )

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.text.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.text.document_indices

    def tokens(self, i: int) -> np.ndarray:
        return self.text.get(int(i))

    def answer(self, i: int) -> np.ndarray:
        return self.answers.get(int(i)).astype(bool)


class ConcatConversations:
    """Several stores as one (--data-path A B): conversations and samples in order."""

    def __init__(self, stores: Sequence[ConversationStore]):
        self.stores = list(stores)
        counts = [len(s.sequence_lengths) for s in self.stores]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.sequence_lengths = np.concatenate([np.asarray(s.sequence_lengths) for s in self.stores])
        docs = [
            np.asarray(s.document_indices[1:], dtype=np.int64) + f for s, f in zip(self.stores, self._first)
        ]
        self.document_indices = np.concatenate([[0]] + docs).astype(np.int64)
        self.skipped = sum(int(getattr(s, "skipped", 0)) for s in self.stores)

    def _locate(self, i: int) -> Tuple[ConversationStore, int]:
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        return self.stores[k], int(i) - int(self._first[k])

    def tokens(self, i: int) -> np.ndarray:
        store, j = self._locate(i)
        return store.tokens(j)

    def answer(self, i: int) -> np.ndarray:
        store, j = self._locate(i)
        return store.answer(j)


def _init_worker(tokenizer_dir: str, skip_invalid: bool) -> None:
    _worker_state.update(tok=load_chat_tokenizer(tokenizer_dir), skip_invalid=skip_invalid)


def _encode_row(tok: Any, skip_invalid: bool, item: Tuple[str, str]) -> Optional[List[Sample]]:
    where, line = item
    try:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        return conversation_samples(tok, row, where)
    except ValueError:
        if skip_invalid:
            return None  # counted by the caller
        raise


def _encode(item: Tuple[str, str]) -> Optional[List[Sample]]:
    """Pool workers' entry: the tokenizer is loaded once per worker (_init_worker), not pickled per row."""
    return _encode_row(_worker_state["tok"], _worker_state["skip_invalid"], item)


def _rows(path: str) -> Iterator[Tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():  # blank lines are not rows; the numbering still counts them
                yield f"{path}:{lineno}", line


def _tokenized(
    input_path: str, tokenizer_dir: str, *, workers: int, skip_invalid: bool
) -> Iterator[Optional[List[Sample]]]:
    """The samples of each row of ``input_path`` in order (None for a row skip_invalid dropped)."""
    if workers <= 1:
        encode = functools.partial(_encode_row, load_chat_tokenizer(tokenizer_dir), skip_invalid)
        yield from map(encode, _rows(input_path))
        return
    pool = multiprocessing.get_context().Pool(
        workers, initializer=_init_worker, initargs=(tokenizer_dir, skip_invalid)
    )
    try:
        yield from pool.imap(_encode, _rows(input_path), chunksize=32)  # imap keeps the input order
    finally:
        pool.terminate()


class MemoryConversations:
    """A jsonl file tokenized into memory (no cache_dir): the same interface as IndexedConversations."""

    def __init__(self, input_path: str, tokenizer_dir: str, *, skip_invalid: bool = False):
        self._tokens: List[np.ndarray] = []
        self._answers: List[np.ndarray] = []
        docs, self.skipped = [0], 0
        for conv in _tokenized(input_path, tokenizer_dir, workers=1, skip_invalid=skip_invalid):
            if conv is None:
                self.skipped += 1
                continue
            for ids, answer in conv:
                self._tokens.append(np.asarray(ids, dtype=np.int64))
                self._answers.append(np.asarray(answer, dtype=bool))
            docs.append(len(self._tokens))
        self.sequence_lengths = np.asarray([len(t) for t in self._tokens], dtype=np.int32)
        self.document_indices = np.asarray(docs, dtype=np.int64)

    def tokens(self, i: int) -> np.ndarray:
        return self._tokens[int(i)]

    def answer(self, i: int) -> np.ndarray:
        return self._answers[int(i)]


def write_conversations(
    input_path: str, prefix: str, tokenizer_dir: str, *, workers: int = 1, skip_invalid: bool = False
) -> Tuple[int, int, int]:
    """Tokenize the jsonl ``input_path`` into ``prefix`` (text + answer datasets).

    Returns (conversations written, samples, rows skipped). The .bin files are written under
    temporary names and renamed with their .idx at the end (answer index last): a reader,
    or a rank racing on the same cache, never sees a partial dataset.
    """
    tok = load_chat_tokenizer(tokenizer_dir)
    dtype = optimal_dtype(len(tok))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    parts = {TEXT_SUFFIX: dtype, ANSWER_SUFFIX: np.uint8}
    builders = {s: IndexedDatasetBuilder(tmp + s + ".bin", dtype=d) for s, d in parts.items()}
    try:
        convs = samples = skipped = 0
        for conv in _tokenized(input_path, tokenizer_dir, workers=workers, skip_invalid=skip_invalid):
            if conv is None:
                skipped += 1
                continue
            lengths = [len(ids) for ids, _ in conv]
            builders[TEXT_SUFFIX].add_document(np.concatenate([ids for ids, _ in conv]), lengths)
            builders[ANSWER_SUFFIX].add_document(
                np.concatenate([a for _, a in conv]).astype(np.uint8), lengths
            )
            convs, samples = convs + 1, samples + len(conv)
        for s, b in builders.items():
            b.finalize(tmp + s + ".idx")
    except BaseException:
        for s, b in builders.items():
            b.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(tmp + s + ext):
                    os.remove(tmp + s + ext)
        raise
    for s in parts:  # bins first, indices last: an .idx marks a complete dataset
        os.replace(tmp + s + ".bin", prefix + s + ".bin")
    for s in parts:
        os.replace(tmp + s + ".idx", prefix + s + ".idx")
    return convs, samples, skipped


def _tokenizer_digest(tokenizer_dir: str) -> str:
    md5 = hashlib.md5()
    for name in sorted(os.listdir(tokenizer_dir)):
        path = os.path.join(tokenizer_dir, name)
        # The files that decide ids and the template; weights or READMEs beside them do not matter.
        if os.path.isfile(path) and (
            name.endswith(".json") or name.endswith(".jinja") or name.endswith(".model")
        ):
            md5.update(name.encode())
            with open(path, "rb") as f:
                md5.update(hashlib.md5(f.read()).digest())
    return md5.hexdigest()


def cached_conversations(
    input_path: str, tokenizer_dir: str, cache_dir: str, *, skip_invalid: bool = False
) -> IndexedConversations:
    """The jsonl ``input_path`` tokenized, from ``cache_dir`` when an earlier run wrote it.

    The key covers the file (absolute path, size, mtime), the tokenizer files and
    ``skip_invalid`` -- nothing that depends on the sequence length, so runs with other
    lengths, seeds or sample counts share it.
    """
    stat = os.stat(input_path)
    description = json.dumps(
        {
            "format": _FORMAT,
            "input": os.path.abspath(input_path),
            "file": [stat.st_size, stat.st_mtime_ns],
            "tokenizer": _tokenizer_digest(tokenizer_dir),
            "skip_invalid": bool(skip_invalid),
        },
        sort_keys=True,
    )
    key = hashlib.md5(description.encode()).hexdigest()
    prefix = os.path.join(cache_dir, f"{key}-sft")
    marker = prefix + "-description.json"
    if not os.path.isfile(marker):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            convs, samples, skipped = write_conversations(
                input_path, prefix, tokenizer_dir, skip_invalid=skip_invalid
            )
            tmp = f"{marker}.tmp{os.getpid()}"
            with open(tmp, "w") as f:  # written last: its presence marks a complete cache entry
                json.dump({"description": json.loads(description), "skipped": skipped}, f)
            os.replace(tmp, marker)
        except OSError as exc:
            raise RuntimeError(
                f"cache_dir {cache_dir}: cannot write the SFT token cache ({exc}); pass a writable directory"
            ) from exc
    with open(marker) as f:
        skipped = int(json.load(f)["skipped"])
    return IndexedConversations(prefix, skipped=skipped)
