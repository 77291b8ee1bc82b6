"""--use-checkpoint-args: the model flags of a run taken from its checkpoint's recorded run.

MegaDLMs' (and Megatron's) ``load_args_from_checkpoint``, on our records: before the
flags are validated, each architecture flag below is set from the checkpoint that the
run would load (--ckpt-step's iteration, else the newest). Two kinds, as there:

* sizes (``UNLESS_GIVEN``): taken from the checkpoint only when the command line does not
  give the flag (in Megatron those default to None: a given value wins);
* everything else (``FORCED``): the checkpoint's value replaces the command line's.

A checkpoint without records, or no checkpoint at all, leaves the flags as given (with a
note), as Megatron does. The config layer cannot read checkpoints (it sits below
``checkpoint``): the caller hands in a function that finds and reads the record
(``megadlms.checkpoint.checkpoint_record``).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, List, Optional, Sequence, Tuple

from megadlms.common.errors import ConfigError

from .messages import flag_message

# dest == key of the recorded model config.
UNLESS_GIVEN = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "seq_length",
    "num_attention_heads",
    "kv_channels",
    "max_position_embeddings",
)
# (dest, key of the recorded model config): MegaDLMs' force=True list, where we have the setting.
FORCED = (
    ("num_query_groups", "num_query_groups"),
    ("position_embedding_type", "position_embedding_type"),
    ("rotary_base", "rotary_base"),
    ("add_bias_linear", "add_bias_linear"),
    ("add_qkv_bias", "add_qkv_bias"),
    ("swiglu", "swiglu"),
    ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights"),
    ("normalization", "normalization"),
    ("attention_dropout", "attention_dropout"),
    ("hidden_dropout", "hidden_dropout"),
    ("qk_layernorm", "qk_layernorm"),
    ("norm_epsilon", "norm_epsilon"),
    ("num_experts", "num_moe_experts"),
    ("moe_layer_freq", "moe_layer_freq"),
    ("moe_ffn_hidden_size", "moe_ffn_hidden_size"),
    ("moe_router_topk", "moe_router_topk"),
    ("moe_token_dispatcher_type", "moe_token_dispatcher_type"),
    ("moe_router_pre_softmax", "moe_router_pre_softmax"),
    ("moe_shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
)

Record = Tuple[str, dict]  # (checkpoint directory, its common.json)


def given_dests(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> set:
    """The dests the command line ``argv`` sets itself (not left at their defaults)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # what stays out of the namespace was not given
    return set(vars(parser.parse_args(argv)))


def _recorded(common: dict, use_tokenizer_model: bool) -> Tuple[dict, dict]:
    """(values for UNLESS_GIVEN dests, values for forced dests) from one checkpoint record."""
    model = common.get("model_config") or {}
    sizes = {d: model[d] for d in UNLESS_GIVEN if model.get(d) is not None}
    forced = {dest: model[key] for dest, key in FORCED if model.get(key) is not None}
    if "num_query_groups" in forced:  # the record fills groups = heads when the run had no GQA
        gqa = forced["num_query_groups"] != model.get("num_attention_heads")
        forced["group_query_attention"] = gqa
        forced["num_query_groups"] = forced["num_query_groups"] if gqa else None
    divisible = (common.get("args") or {}).get("vocab_divisible_by")
    if divisible is not None:
        forced["make_vocab_size_divisible_by"] = divisible
    # Format-1 checkpoints recorded the tokenizer only among their flags.
    tok = common.get("tokenizer") or (common.get("args") or {})
    for key in ("tokenizer_type", "vocab_size") + (("tokenizer_model",) if use_tokenizer_model else ()):
        if tok.get(key) is not None:
            forced[key] = tok[key]
    return sizes, forced


def apply_checkpoint_args(
    args: argparse.Namespace,
    given: set,
    checkpoint_config: Callable[[argparse.Namespace], Any],
    find_record: Callable[[Any], Optional[Record]],
) -> List[str]:
    """Set ``args``' architecture flags from the checkpoint ``find_record`` finds for the run's
    CheckpointConfig (``checkpoint_config(args)``); returns the notes to log."""
    try:
        ck = checkpoint_config(args)
    except ConfigError:  # the checkpoint flags are wrong: the validation that follows says how
        return []
    found = find_record(ck)
    if found is None:
        return [
            f"--use-checkpoint-args: no checkpoint in --load {ck.load}; the command line's flags are used"
        ]
    path, common = found
    sizes, forced = _recorded(common, ck.use_tokenizer_model_from_checkpoint_args)
    if not sizes and not forced:
        return [f"--use-checkpoint-args: {path} records no run flags; the command line's flags are used"]
    changed = []
    for dest, value in list(sizes.items()) + list(forced.items()):
        if dest in sizes and dest in given:
            continue  # a size given on the command line wins (Megatron's force=False)
        if getattr(args, dest, None) != value:
            changed.append(f"{dest}={value!r}")
        setattr(args, dest, value)
    taken = ", ".join(changed) if changed else "nothing differed from the command line"
    return [flag_message(f"--use-checkpoint-args: model flags from {path}: {taken}")]
