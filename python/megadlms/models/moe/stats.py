"""The model-level MoE API of the training loop: the aux-loss scale and the statistics.

- :func:`set_moe_aux_loss_scale` (once per step, before the first forward): every MoE layer
  multiplies the gradient of its aux losses by ``scale``. The trainer's scale is decided
  with the step's other factors (``distributed.step_scales``: ``loss_scale x dp /
  (micro-batches in the global batch)``); with sum-mode DDP the gradient is that of
  ``masked-diffusion loss + mean over the global batch's micro-batches of the aux losses``:
  the same at any dp / EP / gradient accumulation for a given micro-batch size (an aux
  loss is computed on one micro-batch's tokens of one rank, as Megatron's).
- :func:`moe_layer_stats`: per layer, since the last reset, the mean aux and z loss per
  forward, the tokens routed to each expert (before capacity dropping) and the load
  imbalance max/mean over the experts; summed over ``group`` when given (a collective).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .layer import MoELayer


def moe_layers(model: torch.nn.Module) -> List[MoELayer]:
    """The MoE layers of ``model`` (any wrapper around a GPTModel), in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_moe_aux_loss_scale(model: torch.nn.Module, scale) -> None:
    """Set the backward scale of every MoE layer's aux losses (a float or a 0-d tensor);
    only stored here: each layer applies it in its backward."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


def moe_layer_stats(
    model: torch.nn.Module,
    *,
    group: Optional[dist.ProcessGroup] = None,
    reduce: bool = False,
    reset: bool = False,
    num_layers: Optional[int] = None,
) -> Dict:
    """``{"layers": {layer_number: {"aux_loss", "z_loss", "tokens_per_expert", "max_over_mean",
    "forwards"}}, "aux_loss", "z_loss", "max_over_mean"}``: per-layer means per forward, their
    sum over the layers, and the largest imbalance.

    ``reduce``: sum the counts over ``group`` (None: the world) first -- a collective every
    rank of it must call, with the same ``num_layers`` (the model's; layers this rank does not
    hold contribute zeros, so the ranks need not hold the same layers). ``reset``: zero the
    running sums afterwards."""
    layers = moe_layers(model)
    if not layers:
        return {"layers": {}, "aux_loss": 0.0, "z_loss": 0.0, "max_over_mean": 0.0}
    E = layers[0].config.num_moe_experts
    n = num_layers if num_layers is not None else layers[0].config.num_layers
    device = layers[0].router.weight.device
    # One row per model layer (not per held layer), so every pipeline stage packs the same shape and a
    # single all-reduce covers them all.
    packed = torch.zeros(n, 3 + E, dtype=torch.float64, device=device)
    for layer in layers:
        sums, tokens = layer.stats_tensors()
        packed[layer.layer_number - 1, :3] += sums.to(device)
        packed[layer.layer_number - 1, 3:] += tokens.to(device)
        if reset:
            layer.reset_stats()
    if reduce:
        dist.all_reduce(packed, group=group)
    return _summarise(packed.cpu(), {layer.layer_number for layer in layers})


def _summarise(packed: torch.Tensor, own: set) -> Dict:
    out: Dict[str, Any] = {"layers": {}, "aux_loss": 0.0, "z_loss": 0.0, "max_over_mean": 0.0}
    for i, row in enumerate(packed):
        forwards = float(row[2])
        if forwards == 0 and (i + 1) not in own:  # a layer of another pipeline stage
            continue
        tokens = row[3:]
        mean = float(tokens.mean())
        imbalance = float(tokens.max()) / mean if mean > 0 else 0.0
        aux = float(row[0]) / max(forwards, 1.0)
        z = float(row[1]) / max(forwards, 1.0)
        out["layers"][i + 1] = {
            "aux_loss": aux,
            "z_loss": z,
            "tokens_per_expert": [int(t) for t in tokens.tolist()],
            "max_over_mean": imbalance,
            "forwards": int(forwards),
        }
        out["aux_loss"] += aux
        out["z_loss"] += z
        out["max_over_mean"] = max(out["max_over_mean"], imbalance)
    return out
