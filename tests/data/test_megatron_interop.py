"""Against Megatron-core itself, when it is importable (skipped otherwise; CI does not
install it). Verified with megatron-core 0.16.1:
    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1
    PYTHONPATH=/tmp/mcore:python:. python -m pytest tests/data/test_megatron_interop.py
"""

import types

import numpy as np
import pytest
import torch

mcore_idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
pytest.importorskip("megatron.core.datasets.helpers_cpp")

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.utils import get_blend_from_list  # noqa: E402

from megadlms.data import (
    ByteTokenizer,
    IndexedDataset,
    IndexedDatasetBuilder,  # noqa: E402
    build_pretraining_datasets,
)


def _corpus(tmp_path, name, seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, rng.integers(0, 120)) for _ in range(400)]
    prefix = str(tmp_path / name)
    mb = mcore_idx.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        mb.add_document(torch.tensor(np.append(d, 256)), [len(d) + 1])
    mb.finalize(prefix + ".idx")
    return prefix, docs


def test_files_and_samples_identical_to_megatron(tmp_path):
    a, docs = _corpus(tmp_path, "a", 0)
    b, _ = _corpus(tmp_path, "b", 1)
    ours = str(tmp_path / "ours")
    w = IndexedDatasetBuilder(ours + ".bin", dtype=np.uint16)
    for d in docs:
        w.add_document(np.append(d, 256), [len(d) + 1])
    w.finalize(ours + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(a + ext, "rb").read()
    theirs = mcore_idx.IndexedDataset(ours)
    assert all(np.array_equal(theirs[i], IndexedDataset(a)[i]) for i in range(len(docs)))

    mtok = types.SimpleNamespace(eod=256, pad=258, vocab_size=259, unique_identifiers={"class": "Byte"})
    sizes = [3000, 200, 50]
    for blend in ([a], ["0.3", a, "0.7", b]):
        cfg = GPTDatasetConfig(
            random_seed=1234,
            sequence_length=32,
            blend=get_blend_from_list(blend),
            split="90,8,2",
            tokenizer=mtok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=True,
            path_to_cache=None,
        )
        megatron = BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, cfg).build()
        mine = build_pretraining_datasets(
            data_path=blend,
            split="90,8,2",
            seq_length=32,
            seed=1234,
            train_samples=sizes[0],
            valid_samples=sizes[1],
            test_samples=sizes[2],
            tokenizer=ByteTokenizer(),
            eod_mask_loss=True,
        )
        for m, o in zip(megatron, mine):
            assert len(m) == len(o)
            for i in range(len(o)):
                mi, oi = m[i], o[i]
                for key in ("tokens", "labels", "loss_mask", "position_ids"):
                    assert torch.equal(mi[key], oi[key]), (blend, i, key)


def test_split_smaller_than_one_sample_identical_to_megatron(tmp_path):
    """A valid/test split with fewer tokens than one sample: Megatron repeats its epochs; so do
    we, with the same document, sample and shuffle indices and the same items."""
    rng = np.random.default_rng(3)
    prefix = str(tmp_path / "tiny")
    w = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(20):
        doc = np.append(rng.integers(0, 256, rng.integers(1, 6)), 256)
        w.add_document(doc, [len(doc)])
    w.finalize(prefix + ".idx")
    mtok = types.SimpleNamespace(eod=256, pad=258, vocab_size=259, unique_identifiers={"class": "Byte"})
    sizes, split = [40, 9, 5], "80,15,5"
    cfg = GPTDatasetConfig(
        random_seed=5,
        sequence_length=32,
        blend=get_blend_from_list([prefix]),
        split=split,
        tokenizer=mtok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
    )
    megatron = BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, cfg).build()
    mine = build_pretraining_datasets(
        data_path=[prefix], split=split, seq_length=32, seed=5, train_samples=sizes[0],
        valid_samples=sizes[1], test_samples=sizes[2], tokenizer=ByteTokenizer(),
    )  # fmt: skip
    assert mine[2].tokens_per_epoch < 33  # the test split holds less than one sample
    for m, o in zip(megatron, mine):
        for name in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(getattr(m, name), getattr(o, name))
        assert len(m) == len(o) and all(torch.equal(m[i]["tokens"], o[i]["tokens"]) for i in range(len(o)))
