"""Wrapper bookkeeping shared by the training code: which classes wrap a model, and
how to peel them off."""

from __future__ import annotations

import torch

_WRAPPERS: list = []


def model_wrapper(cls: type) -> type:
    """Class decorator: instances of ``cls`` hold the real model in ``.module`` and are peeled
    by :func:`unwrap_model`. Each wrapper registers itself where it is defined, so this module
    needs no import of the wrappers (which import it)."""
    _WRAPPERS.append(cls)
    return cls


def wrapper_classes() -> tuple:
    """Every registered wrapper class (``ALL_MODULE_WRAPPER_CLASSNAMES`` is this tuple)."""
    return tuple(_WRAPPERS)


def unwrap_model(model, module_instances=None):
    """Peel every wrapper (any nesting, e.g. DDP(Float16Module(model))) and return the model.

    ``module_instances``: wrapper classes (matched with isinstance, as Megatron does) or
    class names (matched by name, for older callers) to peel instead of
    ``megadlms.distributed.ALL_MODULE_WRAPPER_CLASSNAMES``. By default a class with the
    name of one of ours is peeled too (torch's own DistributedDataParallel shares the
    name and the ``.module`` layout). Lists/tuples of models map elementwise.
    """
    if isinstance(model, (list, tuple)):
        return type(model)(unwrap_model(m, module_instances) for m in model)
    specs = wrapper_classes() if module_instances is None else module_instances
    if isinstance(specs, (type, str)):
        specs = (specs,)
    classes = tuple(s for s in specs if isinstance(s, type))
    names = {s for s in specs if isinstance(s, str)}
    if module_instances is None:
        names |= {c.__name__ for c in classes}
    while isinstance(model, classes) or type(model).__name__ in names:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise ValueError(f"unwrap_model: {type(model).__name__} has no .module to unwrap")
        model = inner
    return model


@model_wrapper
class Float16Module(torch.nn.Module):
    """Holds ``module`` in bf16/fp16 (params cast once), casts floating inputs to it and
    floating outputs back to fp32, as Megatron's Float16Module does. The optimizer keeps
    fp32 main copies. Used under our DDP; FSDP2 uses a MixedPrecisionPolicy instead."""

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"Float16Module dtype must be bfloat16 or float16, got {dtype}")
        self.module = module.to(dtype)
        self.dtype = dtype

    def _cast_in(self, x):
        return x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def forward(self, *args, **kwargs):
        out = self.module(
            *(self._cast_in(a) for a in args), **{k: self._cast_in(v) for k, v in kwargs.items()}
        )
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out.float()
        if isinstance(out, (tuple, list)):  # e.g. (logits, aux): cast each floating tensor
            return type(out)(
                o.float() if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out
            )
        return out

    def state_dict(self, *args, **kwargs):
        """The wrapped module's keys (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
