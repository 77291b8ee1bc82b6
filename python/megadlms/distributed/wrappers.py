"""Wrapper bookkeeping shared by the training code: which classes wrap a model, and
how to peel them off."""

from __future__ import annotations

import torch

ALL_MODULE_WRAPPER_CLASSNAMES = ("DistributedDataParallel", "TorchFullyShardedDataParallel", "Float16Module")


def unwrap_model(model, module_instances=None):
    """Peel every wrapper in ``ALL_MODULE_WRAPPER_CLASSNAMES`` (any nesting); lists map elementwise."""
    if isinstance(model, (list, tuple)):
        return type(model)(unwrap_model(m, module_instances) for m in model)
    names = ALL_MODULE_WRAPPER_CLASSNAMES if module_instances is None else module_instances
    while type(model).__name__ in names:
        model = model.module
    return model


class Float16Module(torch.nn.Module):
    """Holds ``module`` in bf16/fp16 (params cast once), casts floating inputs to it and
    fp32 outputs back, as Megatron's Float16Module does. The optimizer keeps fp32 copies."""

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Float16Module dtype must be bfloat16 or float16, got {dtype}")
        self.module = module.to(dtype)
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        out = self.module(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.float()
        return out

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)
