"""Blends follow their weights, --split takes Megatron's document ranges, and
build_pretraining_datasets wires prefixes, weights, per-split paths and mock data."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megadlms.data import (
    BlendedDataset,
    ByteTokenizer,
    IndexedDatasetBuilder,
    MockGPTDataset,
    build_blending_indices,
    build_pretraining_datasets,
    parse_blend,
    parse_split,
)

TOK = ByteTokenizer()


def _doc_id_corpus(tmp_path, name, n_docs, base, length=9):
    """Document k holds `length` copies of token base + k: a sample reveals its documents."""
    prefix = str(tmp_path / name)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for k in range(n_docs):
        b.add_document(np.full(length, base + k), [length])
    b.finalize(prefix + ".idx")
    return prefix


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=5), st.integers(1, 3000))
def test_blending_indices_follow_weights(raw, size):
    w = np.array(raw) / sum(raw)
    di, dsi = build_blending_indices(list(w), size)
    counts = np.zeros(len(w), dtype=np.int64)
    for k in range(size):
        # after every prefix each dataset holds its share to within about one sample
        d = int(di[k])
        assert dsi[k] == counts[d]  # each dataset's samples are taken in order 0, 1, 2, ...
        counts[d] += 1
        assert np.all(np.abs(counts - w * (k + 1)) <= 2.0)
    assert counts.sum() == size
    assert np.all(np.abs(counts / size - w) <= 2.0 / size)


def test_blending_indices_hand_computed():
    # k=0 uses max(k, 1) = 1: errors .3/.7 -> 1; k=1: .3/-.3 -> 0; k=2: -.4/.4 -> 1; ...
    di, dsi = build_blending_indices([0.3, 0.7], 5)
    assert di.tolist() == [1, 0, 1, 1, 0] and dsi.tolist() == [0, 0, 1, 2, 1]
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]


def test_split_ranges_and_blend_contents(tmp_path):
    a = _doc_id_corpus(tmp_path, "a", 50, base=0)
    b = _doc_id_corpus(tmp_path, "b", 40, base=1000)
    train, valid, test = build_pretraining_datasets(
        data_path=[a],
        split="8,1,1",
        seq_length=16,
        seed=11,
        train_samples=30,
        valid_samples=4,
        test_samples=4,
        tokenizer=TOK,
    )
    assert train.document_ids.tolist() == list(range(0, 40))
    assert valid.document_ids.tolist() == list(range(40, 45))
    assert test.document_ids.tolist() == list(range(45, 50))
    for ds, lo, hi in [(train, 0, 40), (valid, 40, 45), (test, 45, 50)]:
        seen = np.unique(np.concatenate([ds[i]["text"].numpy() for i in range(len(ds))]))
        assert seen.min() >= lo and seen.max() < hi

    n = 400
    train, valid, test = build_pretraining_datasets(
        data_path=["0.25", a, "0.75", b],
        split="90,10",
        seq_length=16,
        seed=11,
        train_samples=n,
        valid_samples=8,
        test_samples=5,
        tokenizer=TOK,
        data_cache_path=str(tmp_path / "cache"),
    )
    assert test is None  # no share in --split
    assert isinstance(train, BlendedDataset) and len(train) == n and len(valid) == 8
    from_b = 0
    for i in range(n):
        item = train[i]
        d = item["dataset_id"].item()
        assert item["sample_idx"].item() == i
        text = item["text"].numpy()
        assert (text >= 1000).all() if d == 1 else (text < 1000).all()
        from_b += d
    assert from_b == 300  # 0.75 * 400 exactly: the greedy rule hits integer targets
    # the members were asked for ceil(ceil(N * w) * 1.005) samples (Megatron's margin)
    assert len(train.datasets[0]) >= 101 and len(train.datasets[1]) >= 302
    again = build_pretraining_datasets(
        data_path=["0.25", a, "0.75", b],
        split="90,10",
        seq_length=16,
        seed=11,
        train_samples=n,
        valid_samples=8,
        test_samples=5,
        tokenizer=TOK,
        data_cache_path=str(tmp_path / "cache"),
    )[0]
    assert again.cache_hit and all(d.cache_hit for d in again.datasets)
    assert [again[i]["text"].tolist() for i in range(0, n, 37)] == [
        train[i]["text"].tolist() for i in range(0, n, 37)
    ]


def test_unweighted_blend_per_split_paths_and_mock(tmp_path):
    a = _doc_id_corpus(tmp_path, "a", 30, base=0)
    b = _doc_id_corpus(tmp_path, "b", 10, base=1000)
    train, valid, test = build_pretraining_datasets(
        data_path=[a, b],
        split="1,0,0",
        seq_length=8,
        seed=2,
        train_samples=20,
        valid_samples=3,
        tokenizer=TOK,
    )
    assert valid is None and test is None
    la, lb = len(train.datasets[0]), len(train.datasets[1])
    assert np.allclose(train.weights, [la / (la + lb), lb / (la + lb)])

    train, valid, test = build_pretraining_datasets(
        train_data_path=[a],
        valid_data_path=[b],
        seq_length=8,
        seed=2,
        train_samples=10,
        valid_samples=3,
        test_samples=3,
        tokenizer=TOK,
    )
    assert test is None
    assert train.document_ids.tolist() == list(range(30)) and valid.document_ids.tolist() == list(range(10))
    assert (valid[0]["text"] >= 1000).all()

    mtrain, mvalid, mtest = build_pretraining_datasets(
        mock=True, seq_length=8, seed=2, train_samples=10, valid_samples=0, test_samples=2, tokenizer=TOK
    )
    assert isinstance(mtrain, MockGPTDataset) and len(mtrain) == 10 and mvalid is None
    assert not (mtrain[0]["text"] == TOK.mask).any()
    assert not np.array_equal(mtrain[0]["text"].numpy(), mtest[0]["text"].numpy())


def test_flag_errors(tmp_path):
    a = _doc_id_corpus(tmp_path, "a", 5, base=0)
    common = dict(seq_length=8, seed=1, train_samples=4, tokenizer=TOK)
    with pytest.raises(ValueError, match="no training data"):
        build_pretraining_datasets(**common)
    with pytest.raises(ValueError, match="cannot be combined"):
        build_pretraining_datasets(data_path=[a], train_data_path=[a], **common)
    with pytest.raises(ValueError, match="split"):
        parse_split("x")
    with pytest.raises(ValueError, match="weights must be"):
        parse_blend(["-1", a, "2", a])
    with pytest.raises(ValueError, match="looks like a weight"):
        parse_blend(["0.3", a, a])
    with pytest.raises(ValueError, match="mixes weights"):
        parse_blend(["0.3", a, a, "b"])
    with pytest.raises(FileNotFoundError, match="missing"):
        build_pretraining_datasets(data_path=[str(tmp_path / "nope")], **common)
    assert parse_blend(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_blend(["A"]) == (["A"], None)
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_split("98,2") == [0.98, 0.02, 0.0]


class _NoEodTokenizer:
    """Stands in for a tokenizer.json without an end-of-document token."""

    vocab_size = 300

    @property
    def eod(self):
        raise RuntimeError("no end-of-document token")

    @property
    def mask(self):
        return 299


def test_tokenizer_without_eod_needs_it_only_for_eod_mask_loss(tmp_path):
    a = _doc_id_corpus(tmp_path, "a", 10, base=0)
    train, _, _ = build_pretraining_datasets(
        data_path=[a], split="1", seq_length=8, seed=1, train_samples=5, tokenizer=_NoEodTokenizer()
    )
    assert len(train) >= 5 and bool((train[0]["loss_mask"] == 1).all())
    with pytest.raises(RuntimeError, match="end-of-document"):
        build_pretraining_datasets(
            data_path=[a],
            split="1",
            seq_length=8,
            seed=1,
            train_samples=5,
            tokenizer=_NoEodTokenizer(),
            eod_mask_loss=True,
        )


def test_tiny_corpus_with_the_default_split(tmp_path, caplog):
    """969,30,1 over 12 documents gives the valid and test splits none (Megatron's epoch loop
    would never end on them): they are skipped, with a note; the train split repeats epochs.
    An empty split the run cannot skip (the train split, a blend member) is one line."""
    a = _doc_id_corpus(tmp_path, "a", 12, base=0, length=3)
    common = dict(seq_length=64, seed=1, tokenizer=TOK)
    with caplog.at_level("INFO", logger="megadlms"):
        train, valid, test = build_pretraining_datasets(
            data_path=[a], train_samples=10, valid_samples=4, test_samples=4, **common
        )
    assert valid is None and test is None and len(train) >= 10  # 36 tokens, 64 per sample
    seen = np.unique(np.concatenate([train[i]["text"].numpy() for i in range(len(train))]))
    assert len(train[0]["text"]) == 65 and seen.tolist() == list(range(12))  # the epochs repeat
    assert sum("no test evaluation" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match=r"data_path .*a: the train split gets none of its 12 documents"):
        build_pretraining_datasets(data_path=[a], split="1,99,0", train_samples=10, **common)
    b = _doc_id_corpus(tmp_path, "b", 400, base=100, length=3)
    with pytest.raises(ValueError, match=r"data_path .*a: the valid split gets none of its 12 documents"):
        build_pretraining_datasets(data_path=["1", a, "1", b], train_samples=10, valid_samples=4, **common)
