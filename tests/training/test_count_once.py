"""Each element of the full model counts once (``sharding.counts_once``): the params norm and the
logged parameter count of a sharded model equal those of the same model on one process.

One 4-rank gloo world, three layouts: tp2 x dp2 (TP shards, SwiGLU's two blocks, replicas over
tp and dp), ep2 over dp4 (experts replicated over expert_dp, dense weights over dp) and pp2 x
dp2 with tied embeddings (the last stage's copy of the embedding counts zero times). The
reference is the one-process model built from the same seed (the initialisation is layout
independent), its norm and numel summed in plain PyTorch.
"""

from __future__ import annotations

import math

import torch

from tests.dist_utils import run_distributed

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
LAYOUTS = {
    "tp2dp2": (dict(tp=2), dict(swiglu=True, untie_embeddings_and_output_weights=True)),
    "ep2dp4": (dict(ep=2), dict(num_moe_experts=4)),
    "pp2dp2_tied": (dict(pp=2), dict()),
}


def _reference(cfg) -> tuple:
    """(L2 norm, element count) of the one-process model from seed 0."""
    from megadlms.models import GPTModel

    torch.manual_seed(0)
    params = list(GPTModel(cfg).parameters())
    norm = math.sqrt(sum(p.detach().double().square().sum().item() for p in params))
    return norm, sum(p.numel() for p in params)


def _sharded(cfg, groups):
    """This rank's part of the model at ``groups``' layout, from seed 0."""
    from megadlms.models import GPTModel
    from megadlms.parallel import TensorParallelContext
    from megadlms.pipeline import model_chunks, stage_layers

    tp = TensorParallelContext(group=groups.tp.group, expert_group=groups.ep.group)
    torch.manual_seed(0)
    if groups.pp.size == 1:
        return GPTModel(cfg, tp=tp)
    split = stage_layers(cfg.num_layers, groups.pp.size)
    (chunk,) = model_chunks(split[groups.pp.rank], groups.pp.rank, groups.pp.size, cfg.num_layers)
    return GPTModel(cfg, tp=tp, pipeline=chunk)


def _worker(rank, world):
    from megadlms.models import TransformerConfig
    from megadlms.parallel import ParallelGroups
    from megadlms.training import train
    from megadlms.training.validation import params_norm

    out = {}
    for name, (sizes, fields) in LAYOUTS.items():
        cfg = TransformerConfig(**BASE, **fields)
        groups = ParallelGroups.build(**sizes)
        model = _sharded(cfg, groups)
        out[name] = {
            "norm": params_norm(model, torch.device("cpu"), groups),
            "count": train._logical_params([model], groups, torch.device("cpu")),
            "local": sum(p.numel() for p in model.parameters()),
            "reference": _reference(cfg),
        }
    return out


def test_norm_and_count_see_each_element_once():
    results = run_distributed(_worker, 4, timeout=600)
    for name in LAYOUTS:
        ref_norm, ref_count = results[0][name]["reference"]
        for rank, res in enumerate(results):
            r = res[name]
            assert r["count"] == ref_count, (name, rank, r["count"], ref_count)
            assert math.isclose(r["norm"], ref_norm, rel_tol=1e-12), (name, rank, r["norm"], ref_norm)
        # the layout really shards: no rank holds the whole model
        assert all(res[name]["local"] < ref_count for res in results), name
