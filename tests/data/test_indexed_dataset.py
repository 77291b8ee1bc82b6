"""Megatron .bin/.idx: writer -> reader round trip, byte layout against a hand-built file,
and clear errors for truncated / foreign / corrupted files (property test over headers)."""

import os
import pickle
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megadlms.data import DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder

MAGIC = b"MMIDIDX\x00\x00"
# Megatron-core's DType enum, written out here independently of the package.
MEGATRON_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def _hand_built(docs_of_seqs, dtype):
    """(.idx bytes, .bin bytes) for documents given as lists of sequences, via struct.pack."""
    seqs = [np.asarray(s, dtype=dtype) for doc in docs_of_seqs for s in doc]
    lengths = [len(s) for s in seqs]
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * np.dtype(dtype).itemsize
    doc_idx, k = [0], 0
    for doc in docs_of_seqs:
        k += len(doc)
        doc_idx.append(k)
    idx = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype])
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return idx, b"".join(s.tobytes() for s in seqs)


def _write(tmp_path, name, idx_bytes, bin_bytes):
    prefix = str(tmp_path / name)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx_bytes)
    with open(prefix + ".bin", "wb") as f:
        f.write(bin_bytes)
    return prefix


def test_dtype_codes_are_megatrons():
    assert {np.dtype(t): c for c, t in DTYPE_CODES.items()} == {
        np.dtype(t): c for t, c in MEGATRON_CODES.items()
    }


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64, np.float32])
def test_round_trip_random_documents_with_empty_ones(tmp_path, dtype):
    rng = np.random.default_rng(0)
    hi = 250 if dtype == np.uint8 else 60000
    docs = [rng.integers(0, hi, rng.integers(0, 40)).astype(dtype) for _ in range(60)]
    docs[0] = docs[0][:0]
    docs[-1] = docs[-1][:0]
    docs[30] = docs[30][:0]
    prefix = str(tmp_path / "rt")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(d, [d.size])
    b.finalize(prefix + ".idx")

    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ds.sequence_lengths, [d.size for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    longest = int(np.argmax([d.size for d in docs]))
    np.testing.assert_array_equal(ds.get(longest, 2, 3), docs[longest][2:5])
    for got, want in zip(ds[10:20], docs[10:20]):
        np.testing.assert_array_equal(got, want)
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers re-open the mmaps by path
    np.testing.assert_array_equal(clone[longest], docs[longest])
    # the writer's bytes are exactly the hand-built (Megatron) layout
    idx, bin_ = _hand_built([[d] for d in docs], dtype)
    assert open(prefix + ".idx", "rb").read() == idx
    assert open(prefix + ".bin", "rb").read() == bin_


def test_reader_on_hand_built_multi_sequence_documents_and_merge(tmp_path):
    docs = [[[1, 2, 3], [4]], [[]], [[5, 6], [7, 8, 9], [10]]]
    prefix = _write(tmp_path, "hand", *_hand_built(docs, np.int32))
    ds = IndexedDataset(prefix)
    flat = [s for d in docs for s in d]
    assert len(ds) == len(flat)
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s
    assert ds.document_indices.tolist() == [0, 2, 3, 6]
    assert ds.sequence_pointers.tolist() == [0, 12, 16, 16, 24, 36]
    assert ds.get(4, offset=1, length=2).tolist() == [8, 9]
    with pytest.raises(IndexError):
        ds.get(4, offset=2, length=2)

    # add_item/end_document and add_index (merge) reproduce the same bytes
    out = str(tmp_path / "merged")
    b = IndexedDatasetBuilder(out + ".bin", dtype=np.int32)
    for s in docs[0]:
        b.add_item(np.array(s))
    b.end_document()
    tail = _write(tmp_path, "tail", *_hand_built(docs[1:], np.int32))
    b.add_index(tail)
    b.finalize(out + ".idx")
    assert open(out + ".idx", "rb").read() == open(prefix + ".idx", "rb").read()
    assert open(out + ".bin", "rb").read() == open(prefix + ".bin", "rb").read()


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.complex64)
    b = IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint8)
    with pytest.raises(ValueError, match="wider dtype"):
        b.add_document(np.array([1, 300]), [2])
    with pytest.raises(ValueError, match="sum to"):
        b.add_document(np.array([1, 2, 3]), [2])


def test_missing_files_and_truncated_bin(tmp_path):
    with pytest.raises(FileNotFoundError, match="prefix without .bin"):
        IndexedDataset(str(tmp_path / "nothing"))
    idx, bin_ = _hand_built([[[1, 2, 3]], [[4, 5]]], np.int32)
    prefix = _write(tmp_path, "short", idx, bin_[:-4])
    with pytest.raises(ValueError, match=r"short\.idx.*does not match its \.bin"):
        IndexedDataset(prefix)


_GOOD_IDX, _GOOD_BIN = _hand_built([[[1, 2, 3]], [[4, 5]], [[]], [[6]]], np.uint16)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["truncate", "magic", "version", "dtype", "counts", "garbage"]),
    cut=st.integers(0, len(_GOOD_IDX) - 1),
    byte=st.integers(0, 255),
    value=st.integers(0, 2**64 - 1),
    junk=st.binary(min_size=0, max_size=80),
)
def test_corrupted_headers_give_clear_errors(tmp_path, kind, cut, byte, value, junk):
    idx = bytearray(_GOOD_IDX)
    if kind == "truncate":
        idx = idx[:cut]
    elif kind == "magic":
        pos = cut % 9
        if idx[pos] == byte:
            byte = (byte + 1) % 256
        idx[pos] = byte
    elif kind == "version":
        if value == 1:
            value = 2
        idx[9:17] = struct.pack("<Q", value)
    elif kind == "dtype":
        if 1 <= byte <= 8:
            byte = 0 if byte % 2 else 9 + byte
        idx[17] = byte
    elif kind == "counts":
        pos = 18 if cut % 2 else 26
        if value == struct.unpack("<Q", idx[pos : pos + 8])[0]:
            value += 1
        idx[pos : pos + 8] = struct.pack("<Q", value % 2**64)
    else:
        idx = bytearray(junk)
        if bytes(idx) == _GOOD_IDX:
            idx += b"\x00"
    prefix = _write(tmp_path, "bad", bytes(idx), _GOOD_BIN)
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert os.path.basename(prefix) + ".idx" in msg
    want = {
        "truncate": "truncated",
        "magic": "not a Megatron",
        "version": "version",
        "dtype": "dtype code",
    }.get(kind)
    if want:
        assert want in msg
