"""Pipeline p2p with known shapes (``tensor_shape``; Megatron's ``--variable-seq-lengths`` off):
bitwise the header path's losses and gradients with half its p2p batches, per-micro-batch crops
included (pipe_utils' micro-batches differ in length)."""

import pytest
import torch

from megadlms.pipeline.schedules import _interleaved, _one_f_one_b
from megadlms.pipeline.state import ReceiveOrder, ScheduleState
from tests.dist_utils import run_distributed

from .pipe_utils import pipeline_step, reference
from .test_schedules import TIMEOUT, TOL, _compare


def test_known_shapes_are_bitwise_the_header_path_with_half_the_batches():
    spec = {"pp": 2, "m": 4, "b": 2}
    known = run_distributed(pipeline_step, 2, args=({**spec, "known_shapes": True},), timeout=TIMEOUT)
    headers = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    _compare(known, spec)
    for k, h in zip(known, headers):
        assert len(k["losses"]) == len(h["losses"])
        for a, b in zip(k["losses"], h["losses"]):
            assert torch.equal(a, b)
        assert k["grads"].keys() == h["grads"].keys()
        for n in k["grads"]:
            assert torch.equal(k["grads"][n], h["grads"][n]), n
        # headers: a first batch per call, then the payloads; known shapes: the payloads only
        assert 0 < k["p2p_batches"] and 2 * k["p2p_batches"] == h["p2p_batches"]


@pytest.mark.parametrize(
    "world, spec",
    [
        (2, {"pp": 2, "vp": 2, "m": 4, "b": 2, "loss": "diffusion"}),
        # sequence parallel: odd crops are padded and split, [b, ceil(L / 2), H] travels
        (4, {"pp": 2, "tp": 2, "sp": True, "m": 3, "b": 2, "loss": "diffusion"}),
        # 1F1B with a middle stage: receives from both neighbours, each posted one call ahead (p2p.py)
        (3, {"pp": 3, "m": 5, "b": 2, "cfg": {"num_layers": 3}}),
        # interleaved with middle stages, and m == pp (all warm-up): the receive order of the dry run
        (4, {"pp": 4, "vp": 2, "m": 8, "b": 1, "cfg": {"num_layers": 8}}),
        (2, {"pp": 2, "vp": 2, "m": 2, "b": 2}),
    ],
    ids=["pp2-vp2", "pp2-tp2-sp", "pp3", "pp4-vp2-m8", "pp2-vp2-m2"],
)
def test_known_shapes_match_one_process(world, spec):
    spec = {**spec, "known_shapes": True}
    _compare(run_distributed(pipeline_step, world, args=(spec,), timeout=TIMEOUT), spec)


@pytest.mark.parametrize("pp, vp, m, layers", [(2, 2, 2, 4), (3, 1, 3, 3)], ids=["pp2-vp2", "pp3"])
def test_known_shapes_forward_only(pp, vp, m, layers):
    spec = {
        "pp": pp,
        "vp": vp,
        "m": m,
        "b": 2,
        "forward_only": True,
        "loss": "diffusion",
        "known_shapes": True,
    }
    spec["cfg"] = {"num_layers": layers}
    results = run_distributed(pipeline_step, pp, args=(spec,), timeout=TIMEOUT)
    ref = reference(spec["cfg"], m, 2, "diffusion")
    torch.testing.assert_close(
        torch.stack([x.float() for x in results[-1]["losses"]]), torch.stack(ref["losses"]), **TOL
    )
    assert all(r["losses"] == [] and r["p2p_batches"] > 0 for r in results[:-1])


class _P2P:  # what ScheduleState reads of PipelineP2P, without a process group
    size, rank, dtype = 2, 0, torch.float32


def test_a_sent_tensor_that_is_not_the_declared_shape_is_refused_by_name():
    s = ScheduleState(
        [torch.nn.Linear(1, 1)], 2, None, _P2P(), None, False, None, None, lambda i: (2, 5 + i, 4)
    )
    s._check_sent(0, 1, torch.zeros(2, 6, 4))  # as declared
    with pytest.raises(
        ValueError, match=r"micro-batch 1: sends .* \(2, 5, 4\) .* \(2, 6, 4\).*tensor_shape=None"
    ):
        s._check_sent(0, 1, torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="pipeline_dtype"):
        s._check_sent(0, 0, torch.zeros(2, 5, 4, dtype=torch.float64))


@pytest.mark.parametrize("rank", range(4))
@pytest.mark.parametrize(
    "vp, forward_only, m",
    # validation may run fewer micro-batches than stages; interleaved walks pp at a time
    [(1, False, 8), (1, True, 8), (1, True, 2), (2, False, 8), (2, False, 4), (2, True, 8)],
)
def test_the_dry_run_lists_every_receive_of_the_walk_in_micro_batch_order_per_chunk(
    rank, vp, forward_only, m
):
    p2p = _P2P()
    p2p.size, p2p.rank = 4, rank
    dry = ReceiveOrder(
        ScheduleState([torch.nn.Linear(1, 1)] * vp, m, None, p2p, None, forward_only, None, None, None)
    )
    (_interleaved if vp > 1 else _one_f_one_b)(dry)
    assert dry.order is not None
    inputs, grads = dry.order["input"], dry.order["grad"]
    # every chunk but the first stage's receives each micro-batch's input once, in order within the chunk
    assert sorted(inputs) == sorted(list(range(m)) * (vp - (rank == 0)))
    assert dry.received == [0 if rank == 0 and c == 0 else m for c in range(vp)]
    if vp == 1:
        assert inputs == ([] if rank == 0 else list(range(m)))
        assert grads == ([] if rank == 3 or forward_only else list(range(m)))
    else:
        assert sorted(grads) == ([] if forward_only else sorted(list(range(m)) * (vp - (rank == 3))))
