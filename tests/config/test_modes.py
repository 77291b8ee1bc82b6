"""Typed modes: the flags that pick a mode become enum members once, in megadlms.config, and
no code outside config/ compares a mode as a string.

* a source scan (ast, not a regex: comments and docstrings may name modes) of python/megadlms
  for a comparison with a string literal that is one of the mode enums' values;
* each mode flag's argparse choices hold its enum's values (one list of modes);
* parse_config turns the strings into members, the library's dataclasses accept either, and
  the records stored in checkpoints hold plain strings (no enum is ever pickled).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import pathlib

import pytest

from megadlms.common.enums import (
    MODE_ENUMS,
    AttnMaskType,
    CkptFormat,
    MoETokenDispatcher,
    Objective,
    PMaskMode,
    PositionEmbeddingType,
    RecomputeGranularity,
    RecomputeMethod,
    RunningMode,
    plain,
)
from megadlms.config import build_parser, parse_config
from megadlms.diffusion import DiffusionConfig
from megadlms.models import TransformerConfig

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "megadlms"
# config/ parses the flags' strings; hf/remote/ is copied into exported model directories and
# runs without megadlms installed (it cannot import the enums).
EXEMPT = ("config", "hf/remote")
MODE_VALUES = {m.value for e in MODE_ENUMS for m in e}


def _string_constants(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for elt in node.elts:
            yield from _string_constants(elt)


def _mode_string_compares(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for value in _string_constants(side):
                    if value in MODE_VALUES:
                        yield f"{path.relative_to(root)}:{node.lineno}: compares {value!r}"


def test_no_mode_string_compares_outside_config():
    files = [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if not any(str(p.relative_to(PACKAGE)).startswith(e) for e in EXEMPT)
    ]
    assert len(files) > 100  # the scan really walks the package
    found = [hit for p in files for hit in _mode_string_compares(p)]
    assert not found, "compare enum members (megadlms.common.enums), not strings:\n" + "\n".join(found)


def test_the_scan_finds_a_string_compare(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('x = 1\nif cfg.attention == "causal" or mode in ("sampled", "other"):\n    pass\n')
    hits = list(_mode_string_compares(bad, tmp_path))
    assert [h.split(": ", 1)[1] for h in hits] == ["compares 'causal'", "compares 'sampled'"]


FLAG_ENUMS = {
    "model_running_mode": RunningMode,
    "difflm_objective": Objective,
    "difflm_p_mask": PMaskMode,
    "position_embedding_type": PositionEmbeddingType,
    "recompute_granularity": RecomputeGranularity,
    "recompute_method": RecomputeMethod,
    "moe_token_dispatcher_type": MoETokenDispatcher,
    "ckpt_format": CkptFormat,
}


@pytest.mark.parametrize("dest", sorted(FLAG_ENUMS))
def test_flag_choices_are_the_enum_values(dest):
    actions = {a.dest: a for a in build_parser()._actions}
    assert dest in actions, dest
    assert set(actions[dest].choices) >= {m.value for m in FLAG_ENUMS[dest]}


BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
    "--global-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --position-embedding-type rope"
).split()


def test_parse_config_gives_members_and_plain_records():
    cfg = parse_config(BASE + ["--model-running-mode", "vanilla", "--ckpt-format", "torch"], world_size=1)
    assert cfg.diffusion.model_running_mode is RunningMode.VANILLA
    assert cfg.diffusion.p_mask is PMaskMode.REALISED  # the CLI's objective: MegaDLMs'
    assert cfg.model.attention is AttnMaskType.CAUSAL
    assert cfg.model.position_embedding_type is PositionEmbeddingType.ROPE
    assert cfg.checkpoint.ckpt_format is CkptFormat.TORCH
    record = cfg.to_dict()

    def leaves(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from leaves(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from leaves(v)
        else:
            yield x

    assert not any(isinstance(v, enum.Enum) for v in leaves(record))
    assert record["diffusion"]["model_running_mode"] == "vanilla" and record["model"]["attention"] == "causal"
    json.dumps(record, default=str)  # the metrics JSON record


def test_library_configs_accept_values_and_members():
    a = DiffusionConfig(model_running_mode="vanilla", objective="megadlms")
    b = DiffusionConfig(model_running_mode=RunningMode.VANILLA, objective=Objective.MEGADLMS)
    assert a == b and a.p_mask is PMaskMode.REALISED and not a.diffusion
    m = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, seq_length=8)
    assert m.attention is AttnMaskType.BIDIRECTIONAL
    causal = dataclasses.replace(m, attention="causal")
    assert causal.attention is AttnMaskType.CAUSAL and causal.to_dict()["attention"] == "causal"
    assert type(causal.to_dict()["attention"]) is str
    with pytest.raises(
        ValueError, match=r"model_running_mode must be one of \('difflm-noshift', 'difflm-shift', 'vanilla'\)"
    ):
        DiffusionConfig(model_running_mode="ar")
    with pytest.raises(ValueError, match=r"attention must be one of \('bidirectional', 'causal'\)"):
        dataclasses.replace(m, attention="sideways")
    assert plain({"x": [RunningMode.VANILLA, (CkptFormat.TORCH,)]}) == {"x": ["vanilla", ("torch",)]}
