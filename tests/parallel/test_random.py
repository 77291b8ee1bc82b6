"""The model-parallel RNG tracker on 2 tensor-parallel gloo ranks, with Megatron's default
dropout 0.1: the default stream is identical across TP ranks, the model-parallel stream
differs, and fork() leaves the default stream exactly where it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megadlms.parallel import MODEL_PARALLEL_RNG, ParallelGroups, RNGStatesTracker, model_parallel_manual_seed
from tests.dist_utils import run_distributed

SEED, P, N = 1234, 0.1, 4096


def _draws(rank, world):
    groups = ParallelGroups.build(tp=2)
    ones = torch.ones(N)
    tracker = model_parallel_manual_seed(SEED, groups.tp.rank)
    before = F.dropout(ones, P)
    with tracker.fork():
        inside1 = F.dropout(ones, P)
    after = F.dropout(ones, P)
    with tracker.fork(MODEL_PARALLEL_RNG):
        inside2 = F.dropout(ones, P)
    saved = tracker.get_states()
    with tracker.fork():
        inside3 = F.dropout(ones, P)
    tracker.set_states(saved)
    with tracker.fork():
        inside3_again = F.dropout(ones, P)
    # The same draws without the tracker: fork() must not have moved the default stream.
    torch.manual_seed(SEED)
    plain = [F.dropout(ones, P), F.dropout(ones, P)]
    return dict(
        tp_rank=groups.tp.rank,
        before=before,
        after=after,
        inside=[inside1, inside2, inside3],
        inside3_again=inside3_again,
        plain=plain,
    )


@pytest.fixture(scope="module")
def draws():
    return run_distributed(_draws, world_size=2, timeout=120)


def test_default_stream_identical_across_tp_ranks(draws):
    r0, r1 = draws
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert torch.equal(r0["before"], r1["before"]) and torch.equal(r0["after"], r1["after"])
    # Dropout really dropped (about 10 %) and rescaled by 1/(1-p).
    dropped = (r0["before"] == 0).float().mean().item()
    assert 0.07 < dropped < 0.13 and torch.allclose(r0["before"].max(), torch.tensor(1 / (1 - P)))


def test_model_parallel_stream_differs_across_tp_ranks(draws):
    r0, r1 = draws
    for a, b in zip(r0["inside"], r1["inside"]):
        assert not torch.equal(a, b)
    # Successive forks continue the stream rather than restarting it.
    assert not torch.equal(r0["inside"][0], r0["inside"][1])


def test_fork_restores_default_stream(draws):
    for r in draws:
        assert torch.equal(r["before"], r["plain"][0]) and torch.equal(r["after"], r["plain"][1])
        assert torch.equal(r["inside"][2], r["inside3_again"])  # get_states / set_states round trip


def test_tracker_errors():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="no stream 'b'"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        RNGStatesTracker("xla")
