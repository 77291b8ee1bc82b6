"""Config errors are worded with dataclass FIELD names (``hidden_size``: the library layers
know no flags); the CLI says them with the flags that set them (``--hidden-size``).

:func:`flag_message` is that one rewording. It runs exactly once per message: where a
config's problems are collected (``arguments.py``, ``rules.py``), which then raise a
:class:`FlagError` already worded with flags, and in ``pretrain.main`` for the errors of
the lower layers at run time. It rewrites whole tokens only: a name glued to ``-``, ``_``,
``/`` or ``.`` (a flag, a longer name, a path) is left alone, and a field named by an
ordinary English word (``load``, ``split``, ``attention``) only where a message uses it as
a field (followed by ``needs``, ``must``, a value, ...).
"""

from __future__ import annotations

import re
from typing import Dict, List

from .flags import build_parser

# Config fields whose flag is not simply "--" + the field name with dashes.
_FIELD_FLAG_OVERRIDES = {
    "mask_eps": "--difflm-mask-eps",
    "p_mask": "--difflm-p-mask",
    "varilen_prob": "--difflm-varilen-prob",
    "eval_mc_samples": "--difflm-eval-mc-samples",
    "mask_token_id": "--mask-token",
    "objective": "--difflm-objective",
    "block_size": "--difflm-block-size",
    "ar_loss_weight": "--difflm-ar-loss-weight",
    "attention": "--attention-mask-type",
    "grad_reduce_in_fp32": "--accumulate-allreduce-grads-in-fp32",
    "bucket_size": "--ddp-bucket-size",
    "average_in_collective": "--ddp-average-in-collective",
    # Inverted flags: the field is True when the flag is absent, but the flag is what the user can change.
    "add_bias_linear": "--disable-bias-linear",
    "num_moe_experts": "--num-experts",
}
# Field names that are also plain English words in messages: never rewritten.
_NOT_MAPPED = {"optimizer"}


def _field_flags() -> Dict[str, str]:
    """dest -> its first long option, for every flag of the parser (plus the overrides)."""
    flags: Dict[str, str] = {}
    for action in build_parser()._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in _NOT_MAPPED:
            # setdefault: a dest set by two flags (--x and --no-x) keeps the first one registered.
            flags.setdefault(action.dest, long[0])
    flags.update(_FIELD_FLAG_OVERRIDES)
    return flags


_FIELD_FLAGS = _field_flags()
# Single-word fields that are also English words: "sliding-window attention" or "another
# split" are prose, "split '1,0,0' gives" and "load DIR" are the field.
_ENGLISH = {"attention", "debug", "finetune", "help", "hysteresis", "load", "normalization"}
_ENGLISH |= {"objective", "save", "seed", "split"}
_AS_FIELD = r"(?=\s+(?:must|needs|requires|exceeds|is|=|[A-Z]{2,}\b|['\"\d\[{])|\s*[:;,)]|$)"
# Whole tokens: not glued to "-" (a flag), "_" or a letter (a longer name), "/" or "." (a
# path), nor inside a quoted value or a token name ('<|mask_token|>'); a dtype flag's value
# ("--exp-avg-dtype bf16") stays a value.
_WORD = r"(?<!dtype )(?<![-\w./$'\"|<])(?:{})(?![-\w/'\"|>])"


def _alternatives(names) -> str:
    # Longest first, so "lr_decay_iters" is tried before "lr".
    return "|".join(sorted(map(re.escape, names), key=len, reverse=True))


_FIELD_RE = re.compile(
    "(" + _WORD.format(_alternatives(set(_FIELD_FLAGS) - _ENGLISH)) + ")"
    + "|(" + _WORD.format(_alternatives(_ENGLISH & set(_FIELD_FLAGS))) + _AS_FIELD + ")"
)  # fmt: skip


def flag_message(message: str) -> str:
    """A config error worded with field names, reworded with the flags that set them.

    Idempotent (a message already worded with flags comes back unchanged), but called once:
    see the module docstring."""
    return _FIELD_RE.sub(lambda m: _FIELD_FLAGS[m.group(0)], message)


class FlagError(ValueError):
    """Invalid command-line flags: ``problems`` are one line each, already worded with flags
    (printed as they are; never reworded again)."""

    def __init__(self, problems: List[str]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid arguments ({n} problem{'s' * (n > 1)}):\n{lines}")
