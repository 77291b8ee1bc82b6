"""GPT sample construction against an independent reimplementation: Megatron's sample-index
loop (helpers.cpp) ported literally, and the definition 'sample j is seq_length + 1
consecutive tokens of the shuffled documents laid end to end, starting at j * seq_length'."""

import os

import numpy as np
import pytest
import torch

from megadlms.data import GPTDataset, IndexedDataset, IndexedDatasetBuilder, MockGPTDataset

EOD = 999


def _corpus(tmp_path, lengths, seed=0, name="c"):
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / name)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    docs = []
    for n in lengths:
        d = rng.integers(0, 500, n).astype(np.int32)
        if n:
            d[-1] = EOD
        docs.append(d)
        b.add_document(d, [n])
    b.finalize(prefix + ".idx")
    return prefix, docs


def _megatron_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """helpers.cpp build_sample_idx (drop_last_partial_sequence, add_extra_token=1), as a loop."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[d]] - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                d += 1
                off = 0
        out.append((d, off))
    return np.array(out)


def _reference(docs, document_ids, num_samples, seq_length, seed):
    """(document_index, sample_index, shuffle_index) from the definitions, Megatron's RNG order."""
    tpe = sum(len(docs[i]) for i in document_ids)
    epochs = 1 if num_samples is None else max(1, -(-(num_samples * seq_length + 1) // tpe))
    rng = np.random.RandomState(seed)

    def shuffled(n_ep):
        di = np.mgrid[0:n_ep, 0 : len(document_ids)][1]
        di[:] = document_ids
        di = di.reshape(-1).astype(np.int32)
        rng.shuffle(di)
        return di

    separate = False
    if epochs > 1:
        sans = ((epochs - 1) * tpe - 1) // seq_length
        separate = num_samples - sans < int(0.8 * ((tpe - 1) // seq_length))
    doc_index = np.concatenate([shuffled(epochs - 1), shuffled(1)]) if separate else shuffled(epochs)
    sizes = np.array([len(d) for d in docs])
    sample_index = _megatron_sample_idx(sizes, doc_index, seq_length, epochs, tpe)
    n = len(sample_index) - 1
    first = np.arange(sans if separate else n, dtype=np.uint32)
    rng.shuffle(first)
    if separate:
        last = np.arange(sans, n, dtype=np.uint32)
        rng.shuffle(last)
        first = np.concatenate([first, last])
    return doc_index, sample_index, first, separate


@pytest.mark.parametrize(
    "num_samples,expect_separate", [(None, False), (40, False), (60, True), (200, True), (203, False)]
)
def test_samples_match_independent_reference(tmp_path, num_samples, expect_separate):
    lengths = [5, 0, 9, 1, 14, 0, 3, 22, 7, 7, 2, 0, 11]
    prefix, docs = _corpus(tmp_path, lengths)
    indexed = IndexedDataset(prefix)
    s, seed = 6, 1234
    document_ids = np.arange(1, 12)  # a split: documents 1..11
    ds = GPTDataset(indexed, document_ids, num_samples, seq_length=s, seed=seed, eod=EOD)
    doc_index, sample_index, shuffle, separate = _reference(docs, document_ids, num_samples, s, seed)
    assert separate == expect_separate
    np.testing.assert_array_equal(ds.document_index, doc_index)
    np.testing.assert_array_equal(ds.sample_index, sample_index)
    np.testing.assert_array_equal(ds.shuffle_index, shuffle)
    if num_samples is not None:
        assert len(ds) >= num_samples
    stream = np.concatenate([docs[i] for i in doc_index]).astype(np.int64)
    for i in range(len(ds)):
        j = int(shuffle[i])
        item = ds[i]
        want = stream[j * s : j * s + s + 1]
        assert item["text"].tolist() == want.tolist()
        assert item["tokens"].tolist() == want[:-1].tolist()
        assert item["labels"].tolist() == want[1:].tolist()
        assert item["sample_idx"].item() == i
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_item_format_and_eod_loss_mask(tmp_path):
    prefix, _ = _corpus(tmp_path, [4, 6, 3, 9, 5])
    ds = GPTDataset(
        IndexedDataset(prefix), np.arange(5), None, seq_length=8, seed=3, eod=EOD, eod_mask_loss=True
    )
    item = ds[0]
    assert {k: (tuple(v.shape), v.dtype) for k, v in item.items()} == {
        "tokens": ((8,), torch.int64),
        "labels": ((8,), torch.int64),
        "loss_mask": ((8,), torch.float32),
        "position_ids": ((8,), torch.int64),
        "text": ((9,), torch.int64),
        "sample_idx": ((), torch.int64),
    }
    for i in range(len(ds)):
        it = ds[i]
        np.testing.assert_array_equal(it["loss_mask"].numpy(), (it["tokens"] != EOD).float().numpy())
        assert it["position_ids"].tolist() == list(range(8))
    plain = GPTDataset(IndexedDataset(prefix), np.arange(5), None, seq_length=8, seed=3, eod=EOD)
    assert torch.all(plain[0]["loss_mask"] == 1)


def test_index_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    prefix, _ = _corpus(tmp_path, [30, 12, 0, 25, 40, 8])
    cache = str(tmp_path / "cache")
    kw = dict(seq_length=10, seed=7, eod=EOD, data_cache_path=cache, split_name="train")
    first = GPTDataset(IndexedDataset(prefix), np.arange(6), 50, **kw)
    assert not first.cache_hit
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)

    def no_build(self):
        raise AssertionError("index rebuilt although the cache holds it")

    monkeypatch.setattr(GPTDataset, "_build", no_build)
    second = GPTDataset(IndexedDataset(prefix), np.arange(6), 50, **kw)
    assert second.cache_hit and sorted(os.listdir(cache)) == files
    for a, b in [
        (first.document_index, second.document_index),
        (first.sample_index, second.sample_index),
        (first.shuffle_index, second.shuffle_index),
    ]:
        np.testing.assert_array_equal(a, b)
    assert [second[i]["text"].tolist() for i in range(len(second))] == [
        first[i]["text"].tolist() for i in range(len(first))
    ]
    # a different seed or sample count is a different cache entry (and must build)
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(IndexedDataset(prefix), np.arange(6), 50, **{**kw, "seed": 8})


@pytest.mark.parametrize("num_samples", [1, 7])
def test_split_smaller_than_one_sample_repeats_epochs(tmp_path, num_samples):
    """Megatron's GPTDataset adds epochs until num_samples are covered, however few tokens the
    split has: 5 tokens and seq_length 16 still give samples (the documents repeat within one)."""
    prefix, docs = _corpus(tmp_path, [3, 0, 2])
    s, seed, document_ids = 16, 7, np.arange(3)
    ds = GPTDataset(IndexedDataset(prefix), document_ids, num_samples, seq_length=s, seed=seed, eod=EOD)
    doc_index, sample_index, shuffle, _ = _reference(docs, document_ids, num_samples, s, seed)
    np.testing.assert_array_equal(ds.document_index, doc_index)
    np.testing.assert_array_equal(ds.sample_index, sample_index)
    np.testing.assert_array_equal(ds.shuffle_index, shuffle)
    assert len(ds) >= num_samples and len(ds.document_index) == 3 * -(-(num_samples * s + 1) // 5)
    stream = np.concatenate([docs[i] for i in doc_index]).astype(np.int64)
    for i in range(len(ds)):
        j = int(shuffle[i])
        assert ds[i]["text"].tolist() == stream[j * s : j * s + s + 1].tolist()


def test_bad_inputs(tmp_path):
    prefix, _ = _corpus(tmp_path, [0, 0])
    # no tokens at all: Megatron's epoch loop would never end; here one line names the split
    with pytest.raises(ValueError, match="the valid split has no tokens"):
        GPTDataset(
            IndexedDataset(prefix), np.arange(2), 4, seq_length=16, seed=1, eod=EOD, split_name="valid"
        )
    sent = str(tmp_path / "sent")
    b = IndexedDatasetBuilder(sent + ".bin", dtype=np.int32)
    b.add_document(np.arange(10), [4, 6])
    b.finalize(sent + ".idx")
    # Megatron samples over sequences: the two sentences are two GPT "documents"
    ds = GPTDataset(IndexedDataset(sent), np.arange(2), None, seq_length=4, seed=1, eod=EOD)
    assert ds.tokens_per_epoch == 10


def test_mock_dataset_is_deterministic_and_avoids_mask():
    a = MockGPTDataset(20, seq_length=64, seed=5, vocab_size=10, eod=8, mask=3)
    b = MockGPTDataset(20, seq_length=64, seed=5, vocab_size=10, eod=8, mask=3)
    c = MockGPTDataset(20, seq_length=64, seed=6, vocab_size=10, eod=8, mask=3)
    texts = torch.stack([a[i]["text"] for i in range(20)])
    assert torch.equal(texts, torch.stack([b[i]["text"] for i in range(20)]))
    assert not torch.equal(texts, torch.stack([c[i]["text"] for i in range(20)]))
    assert texts.min() >= 0 and texts.max() < 10 and not (texts == 3).any()
    assert set(texts.unique().tolist()) == set(range(10)) - {3}
    assert a[7]["sample_idx"].item() == 7 and torch.equal(a[7]["tokens"], a[7]["text"][:-1])
