"""check_for_nan_in_grad keeps backward free of host syncs: each bucket's check is a device
flag queued before its collective (megadlm_ext.nonfinite_flag), read once after the step.

One process (no process group: the local communicator), overlap on, one bucket per
parameter; the host-syncing megadlm_ext.has_nonfinite is counted while backward runs.
"""

import torch

import megadlm_ext
from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_nan_check_queues_device_flags_and_syncs_once(monkeypatch):
    model = _net()
    cfg = DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=True, bucket_size=1)
    ddp = DistributedDataParallel(model, cfg)
    assert len(ddp.buckets) >= 2
    syncs, flags = [], []
    real_has, real_flag = megadlm_ext.has_nonfinite, megadlm_ext.nonfinite_flag
    monkeypatch.setattr(megadlm_ext, "has_nonfinite", lambda ts: syncs.append(1) or real_has(ts))
    monkeypatch.setattr(megadlm_ext, "nonfinite_flag", lambda ts: flags.append(1) or real_flag(ts))
    x = torch.randn(5, 6)

    ddp.zero_grad_buffer()
    model(x).square().sum().backward()
    assert syncs == [] and len(flags) == len(ddp.buckets)  # every bucket launched in backward
    ddp.finish_grad_sync()  # finite: no error, still no per-bucket host query
    assert syncs == []

    ddp.zero_grad_buffer()
    model[0].weight.register_hook(lambda g: g * float("nan"))
    model(x).square().sum().backward()
    assert syncs == []
    try:
        ddp.finish_grad_sync()
        raise AssertionError("a NaN gradient did not stop the step")
    except RuntimeError as exc:
        msg = str(exc)
    # the offending parameter is named (found only now, on the failure path)
    assert "check_for_nan_in_grad" in msg and "first offending parameter: 0.weight" in msg, msg
    assert syncs  # the failure path looked parameters up
