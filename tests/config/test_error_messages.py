"""Every rule message of the config says flags once: iterate the rules (each flag of the
parser set to a bad value or switched on, plus the cross-config rules of
test_rules_once.py) and check each problem line against the parser itself: no '---', every
'--name' a real flag, no config field name left. Parse-level only: no ranks, no files."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re

import pytest

from megadlms.config import build_parser, build_run_config, flag_message
from megadlms.config.messages import FlagError
from tests.config.test_rules_once import BASE, RULES

MOCK = BASE + ["--mock-data"]
_PARSER = build_parser()
FLAGS = {s for a in _PARSER._actions for s in a.option_strings if s.startswith("--")}


def _field_names(obj) -> set:
    """Every field name of the config dataclass ``obj`` and of the configs inside it."""
    out = set()
    for f in dataclasses.fields(obj):
        out.add(f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= _field_names(value)
    return out


# Single words ('lr', 'split') are also prose: the leak check looks at snake_case names.
FIELDS = {n for n in _field_names(build_run_config(_PARSER.parse_args(MOCK), 1)) if "_" in n}


def _problems(argv, world=1):
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a value argparse itself rejects
            args = _PARSER.parse_args(argv)
        build_run_config(args, world)
    except SystemExit:
        return []
    except FlagError as exc:
        return exc.problems
    return []


def _bad_values(action: argparse.Action):
    """Values of one flag that may break its rules (alone, or with the base command): the
    switch on, out-of-range numbers, every choice, a path."""
    flag = action.option_strings[-1]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [[flag]]
    if action.choices:
        return [[flag, str(c)] for c in action.choices]
    if action.type in (int, float):
        return [[flag, "-1"], [flag, "0"]]
    return [[flag, "/nonexistent/x"]]


def _all_rule_messages():
    """(command, problem) for every problem the iteration reaches."""
    out = []
    for action in _PARSER._actions:
        if not action.option_strings or action.dest == "help":
            continue
        for extra in _bad_values(action):
            out += [(extra, p) for p in _problems(MOCK + extra)]
    for rule_id, flags, world, _, _ in RULES:
        out += [([rule_id], p) for p in _problems(BASE + flags, world)]
    return out


def _check(problem: str) -> list:
    bad = []
    if "---" in problem:
        bad.append("'---'")
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", problem):
        if flag not in FLAGS:
            bad.append(f"{flag} is not a flag of the parser")
    # A quoted value may legitimately hold anything; the rest must not name a field.
    prose = re.sub(r"'[^']*'|\"[^\"]*\"|\([^()]*'[^()]*\)", "", problem)
    leaked = FIELDS & set(re.findall(r"(?<![\w./-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/-])", prose))
    bad += [f"field {name} leaks" for name in sorted(leaked)]
    return bad


def test_every_rule_message_names_real_flags_once():
    messages = _all_rule_messages()
    assert len(messages) > 100, len(messages)  # the iteration reaches the rules
    wrong = {f"{' '.join(cmd)} -> {p}: {_check(p)}" for cmd, p in messages if _check(p)}
    assert not wrong, "\n".join(sorted(wrong))
    # The messages of the issue, as users saw them mangled before ("----fp16", "--min---lr").
    assert _problems(MOCK + ["--fp16", "--bf16"]) == ["--fp16 and --bf16 are exclusive: pick one"]
    assert _problems(MOCK + ["--min-lr", "1"]) == ["--min-lr 1.0 exceeds --lr 0.001"]
    assert _problems(MOCK + ["--save", "/x"]) == ["--save needs --save-interval N"]
    assert _problems(MOCK + ["--lr-decay-style", "WSD"])[0].startswith(
        "--lr-decay-style WSD needs --lr-wsd-decay-iters N"
    )
    tp4 = _problems(MOCK + ["--tensor-model-parallel-size", "4", "--num-attention-heads", "2"], world=4)
    assert tp4[0].startswith("--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 4")


@pytest.mark.parametrize(
    "field_worded,flag_worded",
    [
        ("fp16 and bf16 are exclusive", "--fp16 and --bf16 are exclusive"),
        ("min_lr 0.1 exceeds lr 0.01", "--min-lr 0.1 exceeds --lr 0.01"),
        (
            "lr_decay_style WSD needs lr_wsd_decay_iters N",
            "--lr-decay-style WSD needs --lr-wsd-decay-iters N",
        ),
        ("save needs save_interval N", "--save needs --save-interval N"),
        ("num_attention_heads 2 is not divisible", "--num-attention-heads 2 is not divisible"),
        ("split '1,0,0' gives valid nothing", "--split '1,0,0' gives valid nothing"),
        # prose, paths, quoted values and token names stay as written
        ("sliding-window attention cannot be mapped", "sliding-window attention cannot be mapped"),
        ("cannot load /tmp/save/lr.txt", "cannot load /tmp/save/lr.txt"),
        ("none of ('<|mask_token|>', 'seed')", "none of ('<|mask_token|>', 'seed')"),
        ("start without `--load`", "start without `--load`"),
    ],
)
def test_flag_message_rewrites_whole_field_tokens_only(field_worded, flag_worded):
    assert flag_message(field_worded) == flag_worded
    assert flag_message(flag_worded) == flag_worded  # idempotent, though applied once


def test_the_leak_check_knows_the_config_fields():
    # the leak check above is only as good as its field list
    assert {"num_attention_heads", "lr_decay_iters", "train_data_path", "data_parallel_size"} <= FIELDS
    assert _check("num_attention_heads 3 ----fp16 --no-such-flag") == [
        "'---'",
        "--no-such-flag is not a flag of the parser",
        "field num_attention_heads leaks",
    ]
