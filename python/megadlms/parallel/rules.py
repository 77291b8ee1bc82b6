"""Which model shapes a tensor-parallel size can split: the one list of those rules.

The models raise with it at construction; the CLI reports it (reworded with flags) before
anything is built, together with every other problem of the command line.
"""

from __future__ import annotations

from typing import List


def tensor_parallel_problems(config, tp: int, sequence_parallel: bool = False) -> List[str]:
    """Problems (field-named) splitting ``config`` (a ``TransformerConfig``) over ``tp`` ranks.

    The vocabulary is not checked: the CLI pads it to a multiple of
    make_vocab_size_divisible_by x tp (Megatron); a model built directly must pass a
    padded ``vocab_size``."""
    if tp == 1:
        return []
    out = []
    groups = config.num_query_groups or config.num_attention_heads
    for field, value in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_query_groups", groups),
        ("ffn_hidden_size", config.ffn_hidden_size),
    ):
        if value is not None and value % tp:
            out.append(
                f"{field} {value} is not divisible by tensor_model_parallel_size {tp}: each tensor-parallel "
                f"rank holds {field} / tp of them; choose a tensor_model_parallel_size dividing {value}"
            )
    if sequence_parallel and config.seq_length % tp:
        out.append(
            f"seq_length {config.seq_length} is not divisible by tensor_model_parallel_size {tp}, which "
            "sequence_parallel splits it by; choose seq_length a multiple of it or drop sequence_parallel"
        )
    return out
