"""Checkpoints across pipeline layouts: every stage writes its own tensors under GLOBAL names.

A pipeline chunk names its layers with global layer numbers, so the union of the stages'
state dicts has exactly the keys of the pp=1 model and a checkpoint needs no renaming:

* save: each stage contributes its tensors (DCP writes every key once: replicas of a key
  inside a stage are deduplicated, different stages hold different keys). The last stage's
  copy of a tied embedding (``tied_copy``, ``output_layer.weight``) is never stored,
  nor its optimizer state: the first stage's embedding is the one tensor. The JSON skeleton
  of the optimizer state (common.json, written by rank 0) must describe every stage's
  parameters, so the stages' skeleton descriptions are gathered over the pipeline group
  (:func:`merged_optimizer_state`);
* load: each stage reads only its own keys; the tied copy is filled from
  ``embedding.word_embeddings.weight`` (weights, ``fp32_param`` and optimizer state), so a
  (pp=2) checkpoint loads at pp=1 and the other way round, at any tp and dp.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import torch
import torch.distributed as dist

from megadlms.parallel.sharding import sharding_of

EMBEDDING = "embedding.word_embeddings.weight"
"""The tensor a tied-embedding copy is stored as (and read from)."""


def pp_size(pp_group) -> int:
    """The pipeline-parallel size of ``pp_group`` (1 for None)."""
    return dist.get_world_size(pp_group) if pp_group is not None else 1


def shared_copies(params: Dict[str, torch.nn.Parameter]) -> Dict[str, str]:
    """{name of a tied-embedding copy on this rank: the name it is stored under}."""
    # At pp > 1 the last stage holds its own copy (equal: the gradients are summed), not an alias:
    # it is marked on the parameter, since the names alone cannot tell.
    return {n: EMBEDDING for n, p in params.items() if sharding_of(p).tied_copy}


def drop_shared_optimizer_state(state: dict, copies: Dict[str, str]) -> dict:
    """The optimizer state dict without the tied copies' entries (state and group lists)."""
    if not copies:
        return state
    out = dict(state)
    out["state"] = {k: v for k, v in state.get("state", {}).items() if k not in copies}
    out["param_groups"] = [
        dict(g, params=[p for p in g["params"] if p not in copies]) for g in state.get("param_groups", [])
    ]
    return out


def _elsewhere() -> torch.Tensor:
    """Placeholder for another stage's optimizer tensor: in the skeleton, not in the files."""
    t = torch.empty(0)
    # An empty tensor, so split_state records it in the skeleton; the flag lets drop_elsewhere find it.
    t.megadlms_elsewhere = True  # type: ignore[attr-defined]
    return t


def merged_optimizer_state(state: dict, pp_group) -> dict:
    """``state`` (this stage's, keyed by parameter name) extended with the other stages'
    entries, so its JSON skeleton describes every stage (collective over ``pp_group``). Tensors
    of other stages are :class:`_Elsewhere` placeholders; :func:`drop_elsewhere` removes them
    from the flat tensors after ``split_state``. Param groups with equal hyper-parameters merge."""
    if pp_size(pp_group) == 1:
        return state
    mine = {
        # Only the names of each parameter's state entries travel: the skeleton needs no tensor data.
        "state": {fqn: sorted(v) for fqn, v in state.get("state", {}).items()},
        "param_groups": state.get("param_groups", []),
    }
    stages: List[Any] = [None] * pp_size(pp_group)  # every stage's {"state", "param_groups"}
    dist.all_gather_object(stages, mine, group=pp_group)
    me = dist.get_rank(pp_group)
    merged_state: Dict[str, Any] = {}
    groups: List[dict] = []
    for s, desc in enumerate(stages):
        for fqn, keys in desc["state"].items():
            merged_state[fqn] = state["state"][fqn] if s == me else {k: _elsewhere() for k in keys}
        for g in desc["param_groups"]:
            # Stages build the same groups (decay / no decay) for their own params: merge them by
            # hyper-parameters so the saved optimizer looks like the pp=1 one.
            hyper = {k: v for k, v in g.items() if k != "params"}
            same = next((m for m in groups if {k: v for k, v in m.items() if k != "params"} == hyper), None)
            if same is None:
                groups.append(dict(g, params=list(g["params"])))
            else:
                same["params"] += list(g["params"])
    return dict(state, state=merged_state, param_groups=groups)


def drop_elsewhere(tensors: Dict[str, torch.Tensor]) -> None:
    """Remove other stages' placeholders from the flat tensors to write (in place)."""
    for key in [k for k, v in tensors.items() if getattr(v, "megadlms_elsewhere", False)]:
        del tensors[key]


def check_stage_keys(template: Set[str], saved: Set[str], pp_group, ckpt: str) -> None:
    """Every key this stage needs is stored, and the union of the stages' keys is exactly the
    stored set (collective over ``pp_group``); a mismatch names the keys."""
    union = set(template)
    if pp_size(pp_group) > 1:
        keys: List[Any] = [None] * pp_size(pp_group)  # every stage's sorted keys
        dist.all_gather_object(keys, sorted(template), group=pp_group)
        union = {k for ks in keys for k in ks}
    # Unexpected is judged on the union: a key only another stage reads is not unexpected here.
    missing, unexpected = set(template) - saved, saved - union
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {ckpt} does not match the model: missing "
            f"{sorted(k[6:] for k in missing)[:5]}, unexpected "
            f"{sorted(k[6:] for k in unexpected)[:5]} (check the model flags, "
            "e.g. --untie-embeddings-and-output-weights, --position-embedding-type)"
        )


def own_skeleton(skel: dict, own: Set[str], copies: Dict[str, str]) -> dict:
    """The optimizer skeleton restricted to this rank's parameters ``own`` (names), with each
    tied copy given the skeleton entry of the tensor it is stored as."""
    items = dict(skel.get("__dict__", []))
    state = items.get("state")
    if state is None:
        return skel
    entries = dict(state["__dict__"])
    # (a torch.optim optimizer keys its state by index: kept as it is)
    kept = [[fqn, v] for fqn, v in state["__dict__"] if not isinstance(fqn, str) or fqn in own]
    # The tied copy was never saved: it gets the embedding's state, which is the same parameter at pp=1.
    kept += [[copy, entries[src]] for copy, src in copies.items() if src in entries]
    out = [[k, {"__dict__": kept} if k == "state" else v] for k, v in skel["__dict__"]]
    return {"__dict__": out}
