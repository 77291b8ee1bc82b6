"""Which submodules FSDP2 shards as their own units (``fully_shard`` before the root): the
transformer layers, the embedding, the rotary table and the untied output layer by default,
deepest first; a tied output layer stays with the root (its weight is the embedding's)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

# the wrapper's logger: the unit choice is reported as part of wrapping the model
_log = logging.getLogger("megadlms.distributed.fsdp2")

DEFAULT_FSDP_UNIT_CLASSNAMES = ("TransformerLayer", "LanguageModelEmbedding", "RotaryEmbedding")
"""Class names sharded as their own FSDP unit by default (plus the root's ``output_layer``)."""

UnitSpec = Union[str, type]


def _has_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_tied(root: torch.nn.Module) -> bool:
    """Embedding and output layer share one weight (Megatron: output_layer has no weight)."""
    if getattr(root, "share_embeddings_and_output_weights", False):
        return True
    out = getattr(root, "output_layer", None)
    return isinstance(out, torch.nn.Module) and not _has_params(out)


def select_fsdp_units(root: torch.nn.Module, fsdp_unit_modules: Optional[Sequence[UnitSpec]] = None) -> list:
    """The submodules to ``fully_shard`` before the root, deepest first.

    ``fsdp_unit_modules``: classes or class names; None means the defaults above plus the
    root's ``output_layer``. Modules without parameters are skipped (nothing to shard).
    A parameter shared by two candidate units (or a tied embedding/output weight, which
    the output layer reads outside the embedding unit) cannot live in one unit, so those
    units are left to the root; a message says so once.
    """
    default = fsdp_unit_modules is None
    specs = DEFAULT_FSDP_UNIT_CLASSNAMES if fsdp_unit_modules is None else tuple(fsdp_unit_modules)
    for s in specs:
        if not isinstance(s, (str, type)):
            raise ValueError(f"fsdp_unit_modules entries must be classes or class names, got {s!r}")

    def matches(m):
        return any(
            (isinstance(s, str) and type(m).__name__ == s) or (isinstance(s, type) and isinstance(m, s))
            for s in specs
        )

    # name '' is the root itself: it is sharded last, on its own, and owns the leftovers.
    units = [(name, m) for name, m in root.named_modules() if name and matches(m) and _has_params(m)]
    out = getattr(root, "output_layer", None)
    if (
        default
        and isinstance(out, torch.nn.Module)
        and _has_params(out)
        and all(m is not out for _, m in units)
    ):
        units.append(("output_layer", out))

    # Drop units whose parameters also belong to a disjoint unit (tied weights). A unit
    # nested in another owns its parameters legitimately (it is sharded first), so only the
    # innermost owners of each parameter count.
    owners: dict = {}
    for name, m in units:
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(name)
    shared = set()
    for names in owners.values():
        innermost = {n for n in names if not any(o.startswith(n + ".") for o in names)}
        if len(innermost) > 1:
            shared |= innermost
    if _is_tied(root):
        shared |= {name for name, m in units if type(m).__name__ == "LanguageModelEmbedding"}
    if shared:
        _log.warning(
            "FSDP2: leaving %s to the root unit because they hold weights used "
            "elsewhere (tied embeddings?); untie_embeddings_and_output_weights "
            "gives each its own unit",
            sorted(shared),
        )
    units = [(n, m) for n, m in units if n not in shared]
    # fully_shard takes the parameters not yet owned by a unit, so a parent sharded before
    # its child would swallow the child's parameters.
    units.sort(key=lambda nm: nm[0].count("."), reverse=True)  # children before parents
    return [m for _, m in units]
