"""ALL_MODULE_WRAPPER_CLASSNAMES is Megatron's tuple of classes, importable from
megadlms.training.utils; unwrap_model takes classes and names."""

from __future__ import annotations

import torch

from megadlms.distributed import DistributedDataParallel, Float16Module


def test_isinstance_and_unwrap_with_megatron_idiom():
    from megadlms.training.utils import ALL_MODULE_WRAPPER_CLASSNAMES, unwrap_model

    net = torch.nn.Linear(2, 2)
    model = DistributedDataParallel(Float16Module(net, dtype=torch.bfloat16))
    assert isinstance(model, ALL_MODULE_WRAPPER_CLASSNAMES)  # TypeError with a tuple of str
    assert not isinstance(net, ALL_MODULE_WRAPPER_CLASSNAMES)
    assert unwrap_model(model, ALL_MODULE_WRAPPER_CLASSNAMES) is net
    assert unwrap_model(model, ("DistributedDataParallel", "Float16Module")) is net
    assert type(unwrap_model(model, (DistributedDataParallel,))) is Float16Module
    # the seed's debug helper
    print("Available wrappers:", ALL_MODULE_WRAPPER_CLASSNAMES, type(model).__name__)
