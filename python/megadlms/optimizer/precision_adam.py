"""AdamW with its moments (and optionally its main params) stored in lower precision.

The inner optimizer of :class:`~megadlms.optimizer.optimizer.MixedPrecisionOptimizer` when
``use_precision_aware_optimizer`` lowers any dtype (Megatron-LM hands this to TE's FusedAdam).
Per parameter and step: the stored moments are read back as fp32 (``StateCodec.decode``), the
step is torch's own single-tensor AdamW (``torch.optim.adam.adam``, decoupled weight decay) on
those fp32 tensors, the parameter is updated from the UNROUNDED new moments, and only then
the moments are stored rounded to their dtypes (``StateCodec.encode_``), as TE's kernel does.
With every dtype fp32 the step is bitwise torch.optim.AdamW's single-tensor step.

Where the step runs (``kernel``, adamw_fused.py): with unscaled state (fp32 / bf16 moments, fp32
main params) CUDA params take ``megadlm_ext.adamw_step``, one fused launch per param group, same
math order and rounding order to fp32 rounding; CPU params keep the per-parameter step below
(bitwise as before), and so do the scaled codecs (fp16 / fp8 moments, fp16 main params).

Gradients are read from ``param.decoupled_grad`` when set (Megatron's and TE's name: a main
grad whose dtype differs from the main param's, e.g. a bf16 grad buffer), else ``param.grad``;
a 16-bit gradient is upcast per parameter, one transient fp32 copy at a time.

``main_params_dtype`` fp16: the parameters given to this optimizer are then the bf16/fp16
MODEL params (the layouts pass them instead of an fp32 copy); the main param lives in the
state as ``master_param`` (fp16, scaled), the step updates an fp32 copy of it and writes the
model param from that fp32 result.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch.optim.adam import adam as _adam_step

from .adamw_fused import KERNELS, fused_group_step, kernel_applies, kernel_from_config, uses_kernel
from .precision import StateCodec

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def grad_of(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the optimizer reads: ``decoupled_grad`` when set, else ``grad``."""
    g = getattr(p, "decoupled_grad", None)
    return g if g is not None else p.grad


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` / ``exp_avg_sq`` (and ``master_param``) are stored in the given
    dtypes (see the module docstring); state keys and ``step`` as torch's AdamW."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas,
        eps: float,
        weight_decay: float,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        master_dtype: Optional[torch.dtype] = None,
        kernel: str = "auto",
    ) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.codecs: Dict[str, StateCodec] = {
            "exp_avg": StateCodec(exp_avg_dtype),
            "exp_avg_sq": StateCodec(exp_avg_sq_dtype),
        }
        if master_dtype is not None:  # main params held in the state (main_params_dtype fp16)
            self.codecs["master_param"] = StateCodec(master_dtype)
        self.scales: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        # The fused step (adamw_fused.py): where `kernel` sends a param, for unscaled state.
        self.kernel = kernel if kernel_applies(self.codecs) else "python"

    # ------------------------------------------------------------------ state access
    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            for key in self.codecs:
                st[key], scale = self.codecs[key].zeros_like(p)
                if scale is not None:
                    self.scales.setdefault(p, {})[key] = scale
            if "master_param" in self.codecs:
                self.set_fp32(p, "master_param", p.detach().float())
        return st

    def get_fp32(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """The fp32 values of state ``key`` of ``p`` (the stored tensor itself when fp32)."""
        st = self._init_state(p)
        return self.codecs[key].decode(st[key], self.scales.get(p, {}).get(key))

    def set_fp32(self, p: torch.Tensor, key: str, values: torch.Tensor) -> None:
        """Store fp32 ``values`` (consumed) as state ``key`` of ``p``, rounded to its dtype."""
        st = self.state[p]
        if key not in st:
            self._init_state(p)
        self.codecs[key].encode_(st[key], self.scales.get(p, {}).get(key), values)

    def stored(self, p: torch.Tensor, key: str, fill: bool = True) -> torch.Tensor:
        """What a checkpoint keeps of state ``key``: the tensor in its dtype when it needs no
        scale (fp32, bf16), else its fp32 values (fp16 / fp8, as Megatron saves them). State not
        created yet: zeros, or uninitialised with ``fill=False`` (only its layout is wanted)."""
        codec = self.codecs[key]
        if p not in self.state or key not in self.state[p]:
            make = torch.zeros_like if fill else torch.empty_like
            return make(p, dtype=self.export_dtype(key))
        if codec.scaled:
            return self.get_fp32(p, key)
        return self.state[p][key]

    def export_dtype(self, key: str) -> torch.dtype:
        """The dtype :meth:`stored` returns for ``key``."""
        codec = self.codecs[key]
        return torch.float32 if codec.scaled else codec.storage

    def load_value(self, p: torch.Tensor, key: str, full_piece: torch.Tensor) -> None:
        """Set state ``key`` of ``p`` from a checkpoint's tensor of any dtype (rounded to this
        optimizer's dtype, as Megatron's set_scaled_state does)."""
        self._init_state(p)
        self.set_fp32(p, key, full_piece.detach().to(torch.float32).clone().view(p.shape))

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            fused = []
            for p in group["params"]:
                g = grad_of(p)
                if g is None:
                    continue
                if uses_kernel(self.kernel, p):
                    fused.append((p, g))
                else:
                    self._step_one(p, g, group, beta1, beta2)
            if fused:
                fused_group_step(self, fused, group)
        return None

    def _step_one(self, p, g, group, beta1, beta2) -> None:
        st = self._init_state(p)
        m = self.get_fp32(p, "exp_avg")
        v = self.get_fp32(p, "exp_avg_sq")
        master = "master_param" in self.codecs
        target = self.get_fp32(p, "master_param") if master else p
        g32 = g if g.dtype == torch.float32 else g.float()
        # torch's own single-tensor AdamW math on fp32 tensors: with fp32 state this IS torch's step.
        _adam_step(
            [target],
            [g32.view(target.shape)],
            [m],
            [v],
            [],
            [st["step"]],
            foreach=False,
            fused=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        if master:
            p.copy_(target)  # the model param from the fp32 result, before the master is rounded
            self.set_fp32(p, "master_param", target)
        # Rounded only now: the update above used the unrounded new moments (TE's kernel order).
        self.set_fp32(p, "exp_avg", m)
        self.set_fp32(p, "exp_avg_sq", v)


def adamw_kernel(config, groups: List[dict]) -> dict:
    """torch.optim.AdamW's kernel choice (``OptimizerConfig.fused_adam``): None gives
    ``fused=True`` when every main param is a CUDA tensor and torch's default elsewhere (the
    per-tensor loop on CPU, so every CPU number stays bitwise what it was); True fuses on any
    device torch's fused kernel supports (CPU included: tests run the fused plumbing there);
    False keeps torch's default (foreach on CUDA)."""
    if config.fused_adam is None:
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        return {"fused": True} if on_cuda else {}
    return {"fused": True} if config.fused_adam else {}


def inner_optimizer(config, groups: List[dict]) -> torch.optim.Optimizer:
    """The torch optimizer that updates the main params of a MixedPrecisionOptimizer:
    AdamW, SGD, or (an OptimizerConfig dtype below fp32) the precision-aware AdamW."""
    if config.optimizer == "adam" and (config.lowers_state or config.fused_adam == "megadlm"):
        # Any dtype below fp32: moments (and main params) stored low, stepped in fp32. All-fp32
        # stays on torch's AdamW below, so the default is bitwise what it always was, unless
        # fused_adam="megadlm" asks for our fused kernel (fp32 state, same checkpoints).
        return PrecisionAwareAdamW(
            groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            exp_avg_dtype=config.exp_avg_dtype,
            exp_avg_sq_dtype=config.exp_avg_sq_dtype,
            master_dtype=None if config.main_params_dtype == torch.float32 else config.main_params_dtype,
            kernel=kernel_from_config(config),
        )
    elif config.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            **adamw_kernel(config, groups),
        )
    else:
        return torch.optim.SGD(
            groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay
        )
