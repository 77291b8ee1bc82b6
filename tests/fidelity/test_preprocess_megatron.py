"""megadlms-preprocess writes what Megatron's tools/preprocess_data.py writes, byte for byte:
an empty text is a document with NO sequence; a list of sentences is one sequence per
non-empty sentence with eod after the last. The expected files are built here from
Megatron's encode rules and its MMIDIDX index layout, independently of our writer."""

from __future__ import annotations

import json
import struct

import numpy as np

from megadlms.data import ByteTokenizer, IndexedDataset
from megadlms.data.preprocess import main

DOCS = [
    {"text": "abc"},
    {"text": ""},  # Megatron: a document with no sequence
    {"text": ["first one", "", "second"]},  # two sequences, eod after "second"
    {"text": []},
    {"text": "z"},
]


def _megatron_files(docs, eod):
    """(.bin bytes, .idx bytes) per Megatron's encode + MMIDIDXIndexWriter (uint16 data)."""
    data, seq_lens, doc_idx = [], [], [0]
    for d in docs:
        sentences = d["text"] if isinstance(d["text"], list) else [d["text"]]
        ids, lens = [], []
        for s in sentences:
            t = list(s.encode("utf-8"))
            if t:
                ids += t
                lens.append(len(t))
        if ids:
            ids.append(eod)
            lens[-1] += 1
        data += ids
        seq_lens += lens
        doc_idx.append(len(seq_lens))
    pointers = np.concatenate([[0], np.cumsum(seq_lens)[:-1] * 2]).astype(np.int64)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)  # 8: uint16
    idx += struct.pack("<Q", len(seq_lens)) + struct.pack("<Q", len(doc_idx))
    idx += np.asarray(seq_lens, np.int32).tobytes() + pointers.tobytes()
    idx += np.asarray(doc_idx, np.int64).tobytes()
    return np.asarray(data, np.uint16).tobytes(), idx


def test_empty_text_and_sentence_lists_match_megatron_bytes(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    prefix = str(tmp_path / "out")
    argv = ["--input", str(src), "--output-prefix", prefix, "--append-eod"]
    assert main(argv) == 0
    want_bin, want_idx = _megatron_files(DOCS, ByteTokenizer().eod)
    assert open(prefix + "_text_document.bin", "rb").read() == want_bin
    assert open(prefix + "_text_document.idx", "rb").read() == want_idx
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.sequence_lengths.tolist() == [4, 9, 7, 2]  # abc+eod, "first one", second+eod, z+eod
    assert ds.document_indices.tolist() == [0, 1, 1, 3, 3, 4]
