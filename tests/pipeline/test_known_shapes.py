"""Pipeline p2p with known shapes (``tensor_shape``; Megatron's ``--variable-seq-lengths`` off):
bitwise the header path's losses and gradients with half its p2p batches, per-micro-batch crops
included (pipe_utils' micro-batches differ in length)."""

import pytest
import torch

from megadlms.pipeline.schedules import _Pipeline
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
    ],
    ids=["pp2-vp2", "pp2-tp2-sp"],
)
def test_known_shapes_match_one_process(world, spec):
    spec = {**spec, "known_shapes": True}
    _compare(run_distributed(pipeline_step, world, args=(spec,), timeout=TIMEOUT), spec)


def test_known_shapes_forward_only():
    spec = {"pp": 2, "vp": 2, "m": 2, "b": 2, "forward_only": True, "loss": "diffusion", "known_shapes": True}
    results = run_distributed(pipeline_step, 2, args=(spec,), timeout=TIMEOUT)
    ref = reference({}, 2, 2, "diffusion")
    torch.testing.assert_close(
        torch.stack([x.float() for x in results[1]["losses"]]), torch.stack(ref["losses"]), **TOL
    )
    assert results[0]["losses"] == [] and results[0]["p2p_batches"] > 0


class _P2P:  # what _Pipeline reads of PipelineP2P, without a process group
    size, rank, dtype = 2, 0, torch.float32


def test_a_sent_tensor_that_is_not_the_declared_shape_is_refused_by_name():
    s = _Pipeline([torch.nn.Linear(1, 1)], 2, None, _P2P(), None, False, None, None, lambda i: (2, 5 + i, 4))
    s._check_sent(0, 1, torch.zeros(2, 6, 4))  # as declared
    with pytest.raises(
        ValueError, match=r"micro-batch 1: sends .* \(2, 5, 4\) .* \(2, 6, 4\).*tensor_shape=None"
    ):
        s._check_sent(0, 1, torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="pipeline_dtype"):
        s._check_sent(0, 0, torch.zeros(2, 5, 4, dtype=torch.float64))
