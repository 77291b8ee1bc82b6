"""The mixed-precision optimizer: fp32 main params, fp16 loss scaling, global-norm
clipping, AdamW/SGD, and a checkpoint format keyed by parameter names.

One class, :class:`MixedPrecisionOptimizer`, runs the step; WHERE the main params
live is delegated to a layout object (composition, not an inheritance chain):

* :class:`~megadlms.optimizer.layouts.ReplicaLayout` — our DDP (or a plain module): every
  rank holds full fp32 main params (the model params themselves when they are fp32).
* :class:`~megadlms.optimizer.distrib_optimizer.ShardedBufferLayout` — the distributed
  optimizer: each rank holds fp32 main params for its shard of every bucket.
* :class:`~megadlms.optimizer.layouts.DTensorLayout` — FSDP2: the (fp32, sharded) DTensor
  params are the main params.

Step: grads -> main grads; fp16: unscale, check overflow (skip step, update the loss
scale); global grad norm (``megadlm_ext.l2_norm`` on a TensorTable of the grads, kept across
steps when they are DDP buffer views: grad_tables.py; plus one all-reduce of squares when
sharded, and one over the model-parallel group over a TP grid: ``grid.py``); a
non-finite norm skips the step; clip; inner torch AdamW/SGD step on the main
params; copy main -> model params (cast; all-gather for the distributed optimizer).
``step()`` returns ``(success, grad_norm)``; on a skipped step ``grad_norm`` is inf or NaN.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

import megadlm_ext as ext
from megadlms.common.dtensor import is_dtensor, local_tensor

from .clip_grads import clip_grads_with_norm_, get_grad_norm_fp32
from .config import OptimizerConfig
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .grad_tables import GradTables
from .layouts import DTensorLayout, Entry, full_plain, no_weight_decay
from .precision_adam import PrecisionAwareAdamW, inner_optimizer

_HYPER_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum")


class MixedPrecisionOptimizer:
    """AdamW/SGD over fp32 main params with loss scaling and clipping (see module doc)."""

    def __init__(self, config: OptimizerConfig, layout, *, wrapper=None) -> None:
        self.config = config
        self.layout = layout
        self.wrapper = wrapper
        decay: List[int] = []
        no_decay: List[int] = []
        for i, e in enumerate(layout.entries):
            (no_decay if no_weight_decay(e.fqn, e.param) else decay).append(i)
        fqn_groups = self._global_groups()
        groups = []
        for idx, wd, fqns in ((decay, config.weight_decay, fqn_groups[0]), (no_decay, 0.0, fqn_groups[1])):
            if fqns:
                groups.append(
                    {
                        "params": [layout.entries[i].main for i in idx],
                        "weight_decay": wd,
                        "_entries": idx,
                        "_fqns": fqns,
                    }
                )
        if not any(g["params"] for g in groups):
            # This rank owns no elements (tiny model, large dp): keep torch.optim happy, on the
            # device the other ranks' params live on (their fused kernel choice is then this one's).
            empty = torch.zeros(0, device=layout.device)
            groups.append({"params": [empty], "weight_decay": 0.0, "_entries": [], "_fqns": []})
        layout.decoupled_grads = config.lowers_state
        layout.keep_buffer_grads = config.main_grads_dtype != torch.float32
        self.inner = inner_optimizer(config, groups)
        self.grad_scaler: Optional[ConstantGradScaler | DynamicGradScaler] = None
        if config.fp16:
            self.grad_scaler = (
                ConstantGradScaler(config.loss_scale)
                if config.loss_scale
                else DynamicGradScaler(
                    config.initial_loss_scale,
                    config.min_loss_scale,
                    growth_interval=int(config.loss_scale_window),
                    hysteresis=config.hysteresis,
                )
            )
        self.step_count = 0
        # TensorTables of the step's grad lists (grad_tables.py), kept across steps while the
        # layout hands over the same buffer views (layout.grads_persist)
        self._grad_tables = GradTables()

    def _global_groups(self):
        decay, no_decay = [], []
        for fqn, p in self.layout.all_fqns():
            (no_decay if no_weight_decay(fqn, p) else decay).append(fqn)
        return decay, no_decay

    @property
    def param_groups(self) -> List[dict]:
        """The inner optimizer's groups; write ``group["lr"]`` to set the learning rate."""
        return self.inner.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale()

    @torch.no_grad()
    def step(self, *, grad_unscale: Optional[float] = None):
        """One update. Returns ``(success, grad_norm)``; False means the step was skipped.

        ``grad_unscale`` (fp16): the factor that undoes the loss scale the step's backward
        started from (``distributed.StepScales.grad_unscale``, where the step's factors are
        decided); default ``1 / get_loss_scale()``, the same number."""
        grads = self.layout.collect_grads()
        if self.grad_scaler is not None:
            unscale = 1.0 / self.grad_scaler.scale if grad_unscale is None else grad_unscale
            table = self._grad_tables.get("grads", grads)  # one parse of the list, if any
            # on the fp32 main grads, before the overflow check (it needs unscaled values)
            ext.scale_(table, unscale)
            # One vote for all ranks: a skip on some ranks only would leave the others alone in
            # the norm's all-reduce below.
            found_inf = self.layout.any_rank(ext.has_nonfinite(table))
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, float("inf")
        norm_tensors, clip_tensors = self.layout.norm_and_clip_tensors(grads)
        grad_norm = get_grad_norm_fp32(
            self._grad_tables.get("norm", norm_tensors),
            self.layout.all_reduce_sum(),
            device=self.layout.device,
        )
        # The norm is the same number on every rank after its sums, so all ranks skip together.
        if not math.isfinite(grad_norm):
            return False, grad_norm
        if self.config.clip_grad > 0:
            clip = self._grad_tables.get("clip", clip_tensors)
            clip_grads_with_norm_(clip, self.config.clip_grad, grad_norm)
        self.inner.step()
        self.step_count += 1
        # Distributed optimizer: this also launches the param all-gather, which overlaps the
        # next forward with overlap_param_gather.
        self.layout.copy_main_to_model()
        return True, grad_norm

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: AdamW/SGD buffers plus fp32 main-param copies."""
        n = 0
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    local = local_tensor(v)
                    n += local.numel() * local.element_size()
        for e in self.layout.entries:
            if e.owns_main:
                n += e.main.numel() * e.main.element_size()
        return n

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model params (after loading model weights
        into an already built optimizer without loading its state; Megatron's name)."""
        for i, e in enumerate(self.layout.entries):
            self.layout.reload_main_from_model(i)
            if self._master_in_state:
                self._precision_aware().load_value(e.main, "master_param", e.main.detach())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop main and model grads (and zero our DDP's grad buffers)."""
        for e in self.layout.entries:
            e.main.grad = None
            e.main.decoupled_grad = None
            e.param.grad = None
        if not self.layout.grads_persist:
            self._grad_tables.clear()  # the step's copies go now, not at the next step
        if self.wrapper is not None:
            self.wrapper.zero_grad_buffer()

    # ------------------------------------------------------------------ checkpoint format
    def state_dict(self) -> dict:
        """``{"state": {fqn: {"exp_avg", "exp_avg_sq"[, "fp32_param"]}}, "step", "param_groups",
        "grad_scaler"}`` with full logical shapes (DTensors under FSDP2). Collective for the
        distributed optimizer: every rank must call it."""
        return self._state_tree(self.layout.export)

    def sharded_state_dict(self, *, values: bool = True) -> dict:
        """The nesting of :meth:`state_dict` with every tensor LOCAL, and no collective: the
        tensor of the parameter's local (TP-shard) shape for the replicated layout, the DTensor
        under FSDP2, a :class:`~megadlms.optimizer.FlatPiece` (this rank's contiguous range of
        the flattened local tensor; empty where it holds none) for the distributed optimizer.
        Values and dtypes are those :meth:`state_dict` exports for the same elements; leaves may
        be the live state (no copy). ``values=False``: only the layout is wanted (a loader
        allocating its destinations), so state not created yet is left uninitialised instead of
        zero-filled (a fresh optimizer's moments: 0.74 -> 0.54 s of a tp2 x dp2 load)."""
        return self._state_tree(self.layout.export_local, fill=values)

    def _state_tree(self, export, fill: bool = True) -> dict:
        """The checkpoint nesting with each state key's values put together by ``export``
        (``layout.export``: full tensors; ``layout.export_local``: this rank's pieces)."""
        keys = ("exp_avg", "exp_avg_sq") if self.config.optimizer == "adam" else ("momentum_buffer",)
        state: Dict[str, dict] = {fqn: {} for fqn, _ in self.layout.all_fqns()}
        for key in keys:
            values = {}
            for i, e in enumerate(self.layout.entries):
                values[i] = self._stored_state(e.main, key, fill)
            for fqn, t in export(values, dtype=self._export_dtype(key)).items():
                state[fqn][key] = t
        if self.config.bf16 or self.config.fp16:
            mains = {i: self._main_fp32(e) for i, e in enumerate(self.layout.entries)}
            for fqn, t in export(mains, dtype=torch.float32).items():
                state[fqn]["fp32_param"] = t
        groups = []
        for g in self.inner.param_groups:
            if g["_fqns"]:
                groups.append({**{k: g[k] for k in _HYPER_KEYS if k in g}, "params": list(g["_fqns"])})
        return {
            "state": state,
            "step": self.step_count,
            "param_groups": groups,
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the format of :meth:`state_dict`, whatever wrapper/dp size produced it.

        Load the MODEL state first: parameters without a saved ``fp32_param`` take their
        main params from the current model params."""
        saved = state_dict["state"]
        if not isinstance(self.layout, DTensorLayout):
            # DTensor values (an FSDP2 checkpoint loaded in memory): gather to full tensors in
            # one rank-independent order BEFORE slicing, because this rank's pieces differ.
            saved = {fqn: {k: full_plain(v) for k, v in saved[fqn].items()} for fqn in sorted(saved)}
        self._restore(state_dict, saved, self.layout.local_piece)

    def load_sharded_state_dict(self, state_dict: dict, *, take: bool = False) -> None:
        """Load the nesting of :meth:`sharded_state_dict` with every leaf filled by the caller
        (the same ranges as this optimizer's own ``sharded_state_dict()``, any floating dtype):
        restores exactly what :meth:`load_state_dict` restores from the full tensors, with no
        collective but the parameter gather of ``copy_main_to_model``. Load the MODEL state
        first (as for :meth:`load_state_dict`). ``take``: the leaves were filled for this call only
        (a checkpoint load), so fp32 moments become the optimizer's state as they are, without a
        copy; the caller must not use them afterwards."""
        self._restore(state_dict, state_dict["state"], self.layout.piece_of, take=take)

    def _restore(self, state_dict: dict, saved: dict, piece_of, take: bool = False) -> None:
        """Load ``saved`` ({fqn: {key: value}}) and ``state_dict``'s scalars; ``piece_of(i, value)``
        is entry ``i``'s part of a saved value (a slice of a full tensor, or a local piece)."""
        missing = [fqn for fqn, _ in self.layout.all_fqns() if fqn not in saved]
        if missing:
            raise RuntimeError(
                f"optimizer checkpoint has no state for parameters {missing[:5]} "
                f"({len(missing)} missing): was it saved from a different model?"
            )
        self.step_count = int(state_dict["step"])
        for i, e in enumerate(self.layout.entries):
            entry_state = saved[e.fqn]
            with torch.no_grad():
                # main_params_dtype fp16: e.main is the model param, already loaded (a straight run
                # wrote it from the fp32 step result, not from the rounded master): keep it.
                if "fp32_param" in entry_state and not self._master_in_state:
                    _copy_into(e.main, piece_of(i, entry_state["fp32_param"]))
                else:
                    self.layout.reload_main_from_model(i)
            if isinstance(self.inner, PrecisionAwareAdamW):
                self._load_precision_aware(i, e, entry_state, piece_of)
                continue
            st = {}
            for key, value in entry_state.items():
                if key == "fp32_param":
                    continue
                piece = piece_of(i, value).to(torch.float32)
                # A taken leaf is a tensor of its own (or .to made one): a second copy would double
                # the load's peak memory (the loaded optimizer's whole state, briefly twice).
                st[key] = piece if take else piece.clone()
            if self.config.optimizer == "adam":
                # torch's AdamW keeps a per-param step tensor for bias correction: rebuild it from the
                # saved global count (fp32 on the param's device for the fused kernel, as torch's own
                # AdamW makes it; a host tensor otherwise, as before).
                st["step"] = self._adam_step_tensor(e.main)
            self.inner.state[e.main] = st
        for sg in state_dict.get("param_groups", []):
            for g in self.inner.param_groups:
                if set(sg["params"]) & set(g["_fqns"]):
                    g.update({k: v for k, v in sg.items() if k in _HYPER_KEYS and k in g})
        if self.grad_scaler is not None and state_dict.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        # Push the loaded main params into the model params (cast, and gather when sharded).
        self.layout.copy_main_to_model()

    def _adam_step_tensor(self, main: torch.Tensor) -> torch.Tensor:
        if any(g.get("fused") for g in self.inner.param_groups):
            return torch.tensor(float(self.step_count), dtype=torch.float32, device=main.device)
        return torch.tensor(float(self.step_count))

    # ------------------------------------------------------------------ precision-aware state
    @property
    def _master_in_state(self) -> bool:
        return isinstance(self.inner, PrecisionAwareAdamW) and "master_param" in self.inner.codecs

    def _export_dtype(self, key: str) -> torch.dtype:
        if isinstance(self.inner, PrecisionAwareAdamW):
            return self.inner.export_dtype(key)  # bf16 moments are saved as bf16
        return torch.float32

    def _stored_state(self, main: torch.Tensor, key: str, fill: bool = True) -> torch.Tensor:
        if isinstance(self.inner, PrecisionAwareAdamW):
            return self.inner.stored(main, key, fill)
        v = self.inner.state.get(main, {}).get(key)  # absent before the first step (or SGD without momentum)
        # Zeros for state not created yet, so every rank exports the same keys: export is a
        # collective for the distributed optimizer.
        if v is not None:
            return v
        make = torch.zeros_like if fill else torch.empty_like
        return make(main, dtype=torch.float32)

    def _precision_aware(self) -> PrecisionAwareAdamW:
        """The inner optimizer where only the precision-aware AdamW can be it (its codecs)."""
        if not isinstance(self.inner, PrecisionAwareAdamW):
            raise TypeError(f"expected the precision-aware AdamW, got {type(self.inner).__name__}")
        return self.inner

    def _main_fp32(self, e: Entry) -> torch.Tensor:
        """The main param's fp32 values (main_params_dtype fp16: decoded from the state)."""
        if self._master_in_state:
            return self._precision_aware().get_fp32(e.main, "master_param").detach()
        return e.main.detach()

    def _load_precision_aware(self, i: int, e: Entry, entry_state: dict, piece_of) -> None:
        """Entry ``i``'s saved moments (any stored dtype) rounded into this optimizer's dtypes."""
        opt = self._precision_aware()
        for key in ("exp_avg", "exp_avg_sq"):
            opt.load_value(e.main, key, piece_of(i, entry_state[key]))
        if self._master_in_state:
            # e.main is the model param here: the saved fp32 main param (or the weights) seeds it.
            src = entry_state.get("fp32_param")
            piece = piece_of(i, src) if src is not None else e.main.detach()
            opt.load_value(e.main, "master_param", piece)
        opt.state[e.main]["step"] = torch.tensor(float(self.step_count))


def _copy_into(dst: torch.Tensor, src) -> None:
    if is_dtensor(dst) and is_dtensor(src):
        dst.to_local().copy_(src.to_local())
    else:
        dst.copy_(src)
