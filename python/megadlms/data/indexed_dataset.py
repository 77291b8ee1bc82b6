"""Megatron-core compatible indexed dataset: a ``.bin`` token file plus a ``.idx`` index.

The byte layout is Megatron-core's (megatron/core/datasets/indexed_dataset.py), so files
written here are read by Megatron and files from Megatron's ``tools/preprocess_data.py``
are read here:

    .idx: b"MMIDIDX\\x00\\x00"          9-byte magic
          <Q version (= 1)             8 bytes
          <B dtype code (DType below)  1 byte
          <Q sequence count  S         8 bytes
          <Q document count  D         8 bytes   (D = number of documents + 1)
          int32[S]  sequence lengths   (tokens)
          int64[S]  sequence pointers  (byte offsets into .bin)
          int64[D]  document indices   (sequence index where each document starts; [0] = 0,
                                        [-1] = S)
          [int8[S]  sequence modes, multimodal files only; ignored here]
    .bin: the token arrays of all sequences back to back, in the dtype of the header.

Both files are memory-mapped; ``dataset[i]`` is a read-only view, nothing is copied.
"""

from __future__ import annotations

import os
import struct
from typing import List, Optional, Sequence, Union

import numpy as np

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence and document counts

# Megatron's DType enum: code -> numpy dtype (codes are part of the file format).
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    """Megatron's numeric code of a numpy dtype (raises ValueError for unsupported ones)."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype {dtype!r} cannot be stored in a Megatron .bin/.idx file; use one of "
            f"{sorted(np.dtype(t).name for t in DTYPE_CODES.values())}"
        ) from None


def optimal_dtype(vocab_size: Optional[int]):
    """Token dtype Megatron's preprocessing picks: uint16 below 65500 ids, else int32."""
    # 65500 rather than 65536 is Megatron's cut-off; keeping it gives our .bin the same dtype and bytes.
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _mmap(path: str) -> np.ndarray:
    # numpy cannot mmap an empty file; an empty dataset reads as an empty buffer.
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, mode="r", dtype=np.uint8, order="C")


class _Index:
    """The parsed, validated .idx file (arrays are views into the mmap)."""

    def __init__(self, idx_path: str, bin_size: int):
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        where = f"index file {idx_path}"
        # A file that ends inside the magic is a truncated index, not a foreign file: say so before the magic
        # check below would call it 'not Megatron'.
        if len(head) < 9 and _INDEX_HEADER.startswith(head):
            raise ValueError(
                f"{where} is truncated: {size} bytes, the header alone needs "
                f"{_HEADER_BYTES}; re-run the preprocessing that wrote it"
            )
        if head[:9] != _INDEX_HEADER:
            raise ValueError(
                f"{where} is not a Megatron indexed dataset: magic bytes {head[:9]!r} != "
                f"{_INDEX_HEADER!r}; preprocess the corpus with megadlms-preprocess "
                "(or Megatron's tools/preprocess_data.py)"
            )
        if len(head) < _HEADER_BYTES:
            raise ValueError(
                f"{where} is truncated: {size} bytes, the header alone needs "
                f"{_HEADER_BYTES}; re-run the preprocessing that wrote it"
            )
        # '<' is little-endian with no alignment padding: the 1-byte dtype code sits right between two Qs.
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise ValueError(
                f"{where} has format version {version}; only version 1 (Megatron-core's) is supported"
            )
        if code not in DTYPE_CODES:
            raise ValueError(
                f"{where} has unknown dtype code {code}; valid codes are 1..8 "
                "(uint8,int8,int16,int32,int64,float64,float32,uint16)"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        # Per sequence an int32 length and an int64 pointer; per document entry an int64.
        expected = _HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
        if size < expected:
            raise ValueError(
                f"{where} is truncated: header declares {n_seq} sequences and {n_doc - 1 if n_doc else 0} "
                f"documents ({expected} bytes) but the file has {size} bytes"
            )
        if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal modes
            raise ValueError(
                f"{where} has {size - expected} unexpected trailing bytes after "
                f"the document indices; it was not written by a Megatron-compatible tool"
            )
        if n_doc < 1:
            raise ValueError(
                f"{where} declares 0 document indices; a valid index holds at least the leading 0"
            )
        buf = _mmap(idx_path)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, n_seq, off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(buf, np.int64, n_seq, off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(buf, np.int64, n_doc, off)
        # Hold the mmap: the three frombuffer views above borrow its memory.
        self._buf = buf
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n_seq or (n_doc > 1 and np.any(np.diff(docs) < 0)):
            raise ValueError(
                f"{where} is corrupt: document indices must rise from 0 to the "
                f"sequence count {n_seq} (got first={docs[0]}, last={docs[-1]})"
            )
        if n_seq:
            if self.sequence_lengths.min() < 0:
                raise ValueError(f"{where} is corrupt: negative sequence length")
            # Pointers are in bytes, lengths in tokens: scale by the itemsize before comparing with the .bin.
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if self.sequence_pointers[0] != 0 or end > bin_size:
                raise ValueError(
                    f"{where} does not match its .bin: the last sequence ends at byte {end} but "
                    f"the .bin has {bin_size} bytes (truncated .bin or index of another file)"
                )


class IndexedDataset:
    """Read-only, memory-mapped Megatron indexed dataset at ``path_prefix`` (.bin + .idx).

    ``len(ds)`` is the number of sequences; ``ds[i]`` the tokens of sequence ``i`` as a
    read-only numpy array (``ds[a:b]`` a list of them); ``ds.get(i, offset, length)`` a
    slice of one sequence. Pickles by path, so DataLoader workers re-open the mmaps.
    """

    def __init__(self, path_prefix: str):
        self._open(path_prefix)

    def _open(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"indexed dataset {path_prefix!r}: missing {', '.join(missing)}; data_path takes "
                "the prefix without .bin/.idx (e.g. data/kjv_text_document)"
            )
        self.index = _Index(idx_path, os.path.getsize(bin_path))
        self._bin = _mmap(bin_path)

    # np.memmap objects do not pickle usefully; workers re-open the files from the prefix instead.
    def __getstate__(self):
        return self.path_prefix

    def __setstate__(self, state):
        self._open(state)

    def __len__(self) -> int:
        return len(self.index.sequence_lengths)

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (to its end if length is None)."""
        seq_len = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"{self.path_prefix}: tokens [{offset}, {offset + length}) are "
                f"outside sequence {idx} of length {seq_len}"
            )
        # A zero-copy view into the read-only mmap: callers that want to write must copy first.
        ptr = int(self.index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, ptr)

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, (int, np.integer)):
            if idx < 0:
                idx += len(self)
            if not 0 <= idx < len(self):
                raise IndexError(f"{self.path_prefix}: sequence {idx} out of range [0, {len(self)})")
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous (step 1)")
            return [self.get(i) for i in range(start, stop)]
        raise TypeError(f"IndexedDataset index must be an int or a slice, got {type(idx).__name__}")

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a Megatron indexed dataset: tokens stream to ``bin_path``; ``finalize(idx_path)``
    writes the index (atomically: a reader never sees a half-written .idx).

    ``add_document(tokens, lengths)`` appends one document made of ``len(lengths)`` sequences
    (megadlms-preprocess writes one sequence per document); ``add_item`` + ``end_document``
    build a document sequence by sequence, as in Megatron.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        dtype_code(dtype)  # validates
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]

    def _as_array(self, tokens) -> np.ndarray:
        if hasattr(tokens, "numpy"):  # torch tensor
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        # Check before the cast: astype wraps silently (id 70000 would be stored as 4464 in uint16).
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"{self.bin_path}: token ids span [{lo}, {hi}] but the dataset dtype "
                    f"{self.dtype.name} holds [{info.min}, {info.max}]; use a wider dtype"
                )
        return np.ascontiguousarray(arr.reshape(-1), dtype=self.dtype)

    def add_item(self, tokens) -> None:
        """Append one sequence (call ``end_document`` after a document's last sequence)."""
        arr = self._as_array(tokens)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document: ``tokens`` holds its sequences back to back, ``lengths`` their sizes."""
        arr = self._as_array(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != arr.size or any(n < 0 for n in lengths):
            raise ValueError(
                f"{self.bin_path}: document has {arr.size} tokens but lengths {lengths} sum to {sum(lengths)}"
            )
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (same dtype), as Megatron's merge tool does."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix} ({other.dtype.name}) into {self.bin_path} ({self.dtype.name})"
            )
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        # Drop the other index's leading 0 (we already hold one) and shift its entries past our sequences.
        self.document_indices.extend(int(d) + base for d in other.document_indices[1:])
        with open(get_bin_path(path_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._file.write(chunk)

    def close(self) -> None:
        """Close the .bin without writing an index (abandon the dataset)."""
        self._file.close()

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx (Megatron's byte layout)."""
        self._file.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(
                f"{self.bin_path}: a sequence has {lengths.max()} tokens; the .idx stores lengths as int32"
            )
        # Sequence i starts where the bytes of sequences 0..i-1 end; the first one at byte 0.
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self.document_indices, dtype=np.int64)
        # Temp file + rename: a reader or a crashed run never sees a half-written .idx.
        tmp = f"{idx_path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", docs.size))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
        os.replace(tmp, idx_path)
