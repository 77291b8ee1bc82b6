"""Config errors are worded with dataclass FIELD names (``hidden_size``: the library layers
know no flags); the CLI says them with the flags that set them (``--hidden-size``).

:func:`flag_message` is that one rewording, used by every message the CLI prints.
"""

from __future__ import annotations

import re
from typing import Dict

from .flags import build_parser

# Config fields whose flag is not simply "--" + the field name with dashes.
_FIELD_FLAG_OVERRIDES = {
    "mask_eps": "--difflm-mask-eps",
    "p_mask": "--difflm-p-mask",
    "varilen_prob": "--difflm-varilen-prob",
    "eval_mc_samples": "--difflm-eval-mc-samples",
    "mask_token_id": "--mask-token",
    "objective": "--difflm-objective",
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
    flags = {}
    for action in build_parser()._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in _NOT_MAPPED:
            # setdefault: a dest set by two flags (--x and --no-x) keeps the first one registered.
            flags.setdefault(action.dest, long[0])
    flags.update(_FIELD_FLAG_OVERRIDES)
    return flags


_FIELD_FLAGS = _field_flags()
# Longest names first, so "lr_decay_iters" is matched before "lr"; \b keeps words whole, and
# (?<!-) leaves a name that is already a flag alone, so rewording twice (the library's message,
# then the CLI's whole error) cannot turn "--fp16" into "----fp16"; (?<!dtype ) keeps a dtype
# flag's value ("--exp-avg-dtype bf16") a value.
_FIELD_RE = re.compile(
    r"(?<!-)(?<!dtype )\b(" + "|".join(sorted(map(re.escape, _FIELD_FLAGS), key=len, reverse=True)) + r")\b"
)


def flag_message(message: str) -> str:
    """A config error worded with field names, reworded with the flags that set them
    (idempotent: a message already worded with flags is returned unchanged)."""
    return _FIELD_RE.sub(lambda m: _FIELD_FLAGS[m.group(1)], message)
