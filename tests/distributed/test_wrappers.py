"""unwrap_model over nested wrappers, and Float16Module against a hand-cast reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megadlms.distributed import ALL_MODULE_WRAPPER_CLASSNAMES, Float16Module, unwrap_model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else (y * scale, torch.tensor(3))


def _named_wrapper(name):
    """A minimal wrapper class called `name` (like ours: holds the model in .module)."""

    def init(self, module):
        nn.Module.__init__(self)
        self.module = module

    return type(name, (nn.Module,), {"__init__": init, "forward": lambda self, *a: self.module(*a)})


def test_wrapper_classnames():
    # Megatron's tuple holds the classes themselves (isinstance works on it)
    assert {c.__name__ for c in ALL_MODULE_WRAPPER_CLASSNAMES} == {
        "DistributedDataParallel",
        "TorchFullyShardedDataParallel",
        "Float16Module",
        "ModelChunks",  # a pipeline rank's chunks (unwraps to their StageModules)
    }


def test_unwrap_peels_any_stack_and_maps_lists():
    net = Net()
    ddp_cls, fsdp_cls = (
        _named_wrapper("DistributedDataParallel"),
        _named_wrapper("TorchFullyShardedDataParallel"),
    )
    stacked = ddp_cls(Float16Module(fsdp_cls(net), dtype=torch.bfloat16))
    assert unwrap_model(stacked) is net
    assert unwrap_model(net) is net  # nothing to peel
    other = Net()
    assert unwrap_model([stacked, ddp_cls(other)]) == [net, other]
    assert unwrap_model((stacked,)) == (net,)
    # module_instances restricts what is peeled; classes work as well as names (Megatron passes classes)
    assert type(unwrap_model(stacked, (ddp_cls,))).__name__ == "Float16Module"
    assert (
        unwrap_model(stacked, ["DistributedDataParallel", "Float16Module", "TorchFullyShardedDataParallel"])
        is net
    )


def test_unwrap_real_ddp_over_float16module():
    from megadlms.distributed import DistributedDataParallel

    net = Net()
    wrapped = DistributedDataParallel(Float16Module(net, dtype=torch.bfloat16))  # 1 process, no group
    assert unwrap_model(wrapped) is net
    assert isinstance(wrapped, ALL_MODULE_WRAPPER_CLASSNAMES)


def test_unwrap_rejects_wrapper_without_module():
    broken = _named_wrapper("DistributedDataParallel")(Net())
    del broken.module
    with pytest.raises(ValueError, match="has no .module"):
        unwrap_model(broken)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float16module_matches_hand_cast(dtype):
    torch.manual_seed(0)
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    reference = reference.to(dtype)
    x = torch.randn(3, 6)
    wrapped = Float16Module(net, dtype=dtype)
    assert all(p.dtype == dtype for p in wrapped.parameters())
    out = wrapped(x)
    expected = reference(x.to(dtype)).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    # tuple outputs: floating members cast back, others untouched; kwargs are cast too
    y, count = wrapped(x, scale=torch.tensor(2.0))
    assert y.dtype == torch.float32 and torch.equal(
        y, (reference(x.to(dtype)) * torch.tensor(2.0, dtype=dtype)).float()
    )
    assert count.dtype == torch.int64
    # state_dict keys are the inner module's (checkpoints do not depend on the wrapper)
    assert list(wrapped.state_dict()) == ["fc.weight", "fc.bias"]
    wrapped.load_state_dict({k: torch.zeros_like(v) for k, v in wrapped.state_dict().items()})
    assert float(net.fc.weight.detach().abs().sum()) == 0.0


def test_float16module_rejects_fp32():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Float16Module(Net(), dtype=torch.float32)
