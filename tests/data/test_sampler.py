"""PretrainingSampler: Megatron's MegatronPretrainingSampler order, rank partition, resume."""

import pytest
import torch

from megadlms.data import MockGPTDataset, PretrainingSampler, build_pretraining_data_loader


def _megatron_sampler(total, consumed, mbs, rank, dp, drop_last):
    """MegatronPretrainingSampler.__iter__, written out as Megatron has it."""
    batch, out = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            out.append(batch[rank * mbs : (rank + 1) * mbs])
            batch = []
    if len(batch) > 0 and not drop_last:
        part = batch[rank * mbs : (rank + 1) * mbs]
        if part:
            out.append(part)
    return out


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_megatron_and_partitions_each_index_once(dp, drop_last):
    for total, consumed, mbs in [(50, 0, 2), (50, 7, 3), (31, 12, 1), (10, 0, 4)]:
        per_rank = []
        for rank in range(dp):
            s = PretrainingSampler(total, consumed, mbs, rank, dp, drop_last=drop_last)
            got = list(s)
            assert got == _megatron_sampler(total, consumed, mbs, rank, dp, drop_last)
            assert len(s) == len(got)
            per_rank.append(got)
        flat = sorted(i for r in per_rank for b in r for i in b)
        full = consumed + (total - consumed) // (mbs * dp) * mbs * dp
        assert flat == list(range(consumed, total if not drop_last else full))
        # global micro-batch k is the contiguous block [k*mbs*dp, (k+1)*mbs*dp) across ranks
        for k in range(len(per_rank[0]) if drop_last else 0):
            block = [i for r in range(dp) for i in per_rank[r][k]]
            assert block == list(range(consumed + k * mbs * dp, consumed + (k + 1) * mbs * dp))


@pytest.mark.parametrize("dp", [2, 3])
def test_resume_from_consumed_samples(dp):
    mbs, total = 2, 60
    for rank in range(dp):
        full = list(PretrainingSampler(total, 0, mbs, rank, dp))
        for steps in range(1, len(full)):
            resumed = list(PretrainingSampler(total, steps * mbs * dp, mbs, rank, dp))
            assert resumed == full[steps:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="consumed_samples"):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="micro_batch"):
        PretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="rank 2"):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_data_loader_batches_carry_global_sample_idx():
    ds = MockGPTDataset(40, seq_length=8, seed=0, vocab_size=20, eod=19, mask=18)
    for rank in range(3):
        loader = build_pretraining_data_loader(
            ds, consumed_samples=6, micro_batch_size=2, data_parallel_rank=rank, data_parallel_size=3
        )
        want = _megatron_sampler(40, 6, 2, rank, 3, True)
        batches = list(loader)
        assert len(batches) == len(want)
        for batch, idx in zip(batches, want):
            assert batch["sample_idx"].dtype == torch.int64 and batch["sample_idx"].tolist() == idx
            assert torch.equal(batch["tokens"], torch.stack([ds[i]["tokens"] for i in idx]))
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
