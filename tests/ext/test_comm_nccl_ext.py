"""megadlms' NcclExtCommunicator over a stand-in for megadlm_ext.nccl, on CPU.

The real communicator needs GPUs; here the extension's Communicator is replaced by a
recorder so the wrapper's contract is checked everywhere: the NCCL timeout is the
process group's (--distributed-timeout-minutes), async collectives return the work
handle, blocking ones wait on it (a device-side wait, no host sync) before returning.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from megadlm_ext import nccl
from megadlms.distributed import comm as comm_mod


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


class _FakeComm:
    def __init__(self, log):
        self.log = log

    def all_reduce(self, t, op="sum"):
        self.log.append(f"all_reduce {op}")
        return _Work(self.log, "all_reduce")

    def reduce_scatter(self, out, inp, op="sum"):
        self.log.append(f"reduce_scatter {op}")
        return _Work(self.log, "reduce_scatter")

    def all_gather(self, out, inp):
        self.log.append("all_gather")
        return _Work(self.log, "all_gather")

    def abort(self, why):
        self.log.append(f"abort {why}")

    def close(self):
        self.log.append("close")


@pytest.fixture()
def gloo_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=7))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_group_timeout_is_the_init_timeout(gloo_group):
    assert nccl.group_timeout(gloo_group) == 7 * 60.0
    assert nccl.group_timeout(None) == 7 * 60.0


def test_wrapper_handles_and_timeout(gloo_group, monkeypatch):
    log, seen = [], {}

    def from_pg(group, device=None, timeout=None):
        seen.update(group=group, device=device, timeout=timeout)
        return _FakeComm(log)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nccl, "available", lambda: True)
    monkeypatch.setattr(nccl.Communicator, "from_process_group", staticmethod(from_pg))
    c = comm_mod.build_communicator("nccl_ext", gloo_group)
    assert isinstance(c, comm_mod.NcclExtCommunicator)
    assert seen == {"group": gloo_group, "device": 0, "timeout": 7 * 60.0} and c.timeout == 420.0
    x = torch.zeros(4)
    h = c.all_reduce(x, op="avg", async_op=True)
    assert isinstance(h, _Work) and log == ["all_reduce avg"]  # not waited yet: overlaps
    h.wait()
    assert c.reduce_scatter(x[:2], x, op="sum") is None  # blocking: waited before returning
    assert c.all_gather(x, x[:2], async_op=False) is None
    assert log == [
        "all_reduce avg",
        "wait all_reduce",
        "reduce_scatter sum",
        "wait reduce_scatter",
        "all_gather",
        "wait all_gather",
    ]
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        c.all_reduce(x, op="max")
    c.abort("rank 0 saw NaN")
    c.close()
    assert log[-2:] == ["abort rank 0 saw NaN", "close"]
