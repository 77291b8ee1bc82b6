"""PipelineP2P's receives posted ahead (gloo, known shapes): the payloads arrive unchanged in the
announced buffers, and a wrong announcement is refused by name without stealing a message."""

import pytest
import torch

from megadlms.pipeline.p2p import PipelineP2P
from tests.dist_utils import run_distributed

SHAPES = [(2, 3, 4), (2, 5, 4), (2, 1, 4)]  # per micro-batch, as per-step crops make them


def _payload(i: int, direction: int) -> torch.Tensor:
    return (
        torch.arange(torch.Size(SHAPES[i]).numel(), dtype=torch.float32).view(SHAPES[i]) + 100 * i + direction
    )


def _errors(p2p: PipelineP2P, rank: int) -> list:
    """Rank 0 announces shape 0 then receives shape 1 (refused), then announces a receive it never
    makes (finish refuses it); rank 1 sends what rank 0 then receives, so nothing stays posted."""
    seen = []
    if rank == 1:
        p2p.communicate(send_next=_payload(0, 0))
        p2p.communicate(send_next=_payload(0, 0))
        p2p.finish()
        return seen
    p2p.communicate(recv_prev=True, prev_shape=SHAPES[0], prev_ahead=SHAPES[0])
    with pytest.raises(
        ValueError, match=r"\(2, 5, 4\) from pipeline rank 1, but the previous call announced \(2, 3, 4\)"
    ):
        p2p.communicate(recv_prev=True, prev_shape=SHAPES[1])
    with pytest.raises(RuntimeError, match="posted ahead were never used"):
        p2p.finish()
    seen.append("mismatch")
    x, _ = p2p.communicate(recv_prev=True, prev_shape=SHAPES[0])  # the announced receive, drained
    assert torch.equal(x, _payload(0, 0))
    p2p.finish()
    with pytest.raises(ValueError, match="next_ahead needs recv_next"):
        p2p.communicate(next_ahead=SHAPES[0])
    return seen + ["unused", "no-receive"]


def _exchange(rank, world):
    """pp = 2, three micro-batches of different shapes each way (activations down, grads up),
    every receive announced one call ahead, as the 1F1B schedule does."""
    p2p = PipelineP2P(torch.distributed.group.WORLD, "cpu", torch.float32)
    got = []
    for i in range(len(SHAPES)):
        ahead = SHAPES[i + 1] if i + 1 < len(SHAPES) else None
        if rank == 0:
            _, g = p2p.communicate(
                send_next=_payload(i, 0), recv_next=True, next_shape=SHAPES[i], next_ahead=ahead
            )
            got.append(torch.equal(g, _payload(i, 1)))
        else:
            x, _ = p2p.communicate(recv_prev=True, prev_shape=SHAPES[i], prev_ahead=ahead)
            got.append(torch.equal(x, _payload(i, 0)))
            p2p.communicate(send_prev=_payload(i, 1))
        # the next micro-batch's receive is already posted, and only it
        assert sorted(p2p._ahead) == ([] if ahead is None else [(1 - rank, 1 - rank)])
    p2p.finish()
    return got, _errors(p2p, rank)


def test_receives_posted_ahead_deliver_each_payload_and_wrong_announcements_are_refused():
    got = run_distributed(_exchange, 2, timeout=60)
    assert got[0][0] == got[1][0] == [True] * len(SHAPES)
    assert got[0][1] == ["mismatch", "unused", "no-receive"] and got[1][1] == []
