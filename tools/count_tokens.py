#!/usr/bin/env python
"""Count the sequences and tokens of indexed datasets: MegaDLMs' tools/count_tokens.py on
megadlms' reader (the first step of MegaDLMs' dlm_pretrain_1.7b.sh).

    python tools/count_tokens.py --weighted-prefix "1.0 /data/train_text_document"
    python tools/count_tokens.py --weighted-prefix "0.7 /data/a_text_document 0.3 /data/b_text_document"

``--weighted-prefix`` is the string a --data-path / --train-data-path takes: weight, prefix
pairs (each prefix names ``<prefix>.bin`` and ``<prefix>.idx``). For each prefix it prints
the number of sequences and tokens (billions, two decimals), then the most sequences and
tokens the mixture can draw before its scarcest member runs out (min over count / weight).
As in MegaDLMs, each prefix's counts are cached as JSON in ``.statistics_<prefix with / as
_>`` next to the data and read from there on later calls (delete it after rewriting the data).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple


class CountError(ValueError):
    """A bad --weighted-prefix or unreadable data: one line naming it."""


def weighted_prefixes(text: str) -> List[Tuple[float, str]]:
    """``"w1 p1 w2 p2"`` -> ``[(w1, p1), (w2, p2)]``; each weight a positive number and each
    prefix's directory existing (MegaDLMs' checks)."""
    words = text.split()
    if not words or len(words) % 2:
        raise CountError(f"--weighted-prefix {text!r}: expected 'weight prefix' pairs, e.g. '1.0 /data/a'")
    pairs = []
    for weight, prefix in zip(words[::2], words[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise CountError(f"--weighted-prefix: weight {weight!r} is not a number") from None
        if not w > 0:
            raise CountError(f"--weighted-prefix: weight {weight!r} of {prefix} must be positive")
        if not os.path.isdir(os.path.dirname(prefix) or "."):
            raise CountError(f"--weighted-prefix: data directory {os.path.dirname(prefix)} does not exist")
        pairs.append((w, prefix))
    return pairs


def statistics_file(prefix: str) -> str:
    """MegaDLMs' cache file of ``prefix``'s counts (same name, so either tool reuses the other's)."""
    return os.path.join(os.path.dirname(prefix), f".statistics_{prefix.replace('/', '_')}")


def count(prefix: str) -> Tuple[int, int]:
    """(sequences, tokens) of the indexed dataset ``prefix``, from its cache file when present."""
    cache = statistics_file(prefix)
    if os.path.exists(cache):
        with open(cache) as f:
            stats = json.load(f)
        return int(stats["total_sequences"]), int(stats["total_tokens"])
    from megadlms.data.indexed_dataset import IndexedDataset  # imported here: --help needs no torch

    try:
        data = IndexedDataset(prefix)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CountError(f"--weighted-prefix: cannot read {prefix}.idx/.bin: {exc}") from None
    # int64 sum: a corpus of billions of tokens overflows the index's int32 lengths.
    sequences, tokens = len(data), int(data.sequence_lengths.sum(dtype="int64"))
    with open(cache, "w") as f:
        json.dump({"total_sequences": str(sequences), "total_tokens": str(tokens)}, f)
    return sequences, tokens


def report(pairs: Sequence[Tuple[float, str]], out=None) -> Tuple[float, float]:
    """Print MegaDLMs' report for ``pairs`` (to ``out``, default stdout); returns (max sequences,
    max tokens) of the mixture."""
    out = out or sys.stdout  # looked up per call: a redirected stdout must receive the report
    bar = "--------------------------------"
    lines, per_seq, per_tok = [], [], []
    for weight, prefix in pairs:
        sequences, tokens = count(prefix)
        per_seq.append(sequences / weight)
        per_tok.append(tokens / weight)
        lines += [bar, f"Inspecting index for {prefix}", f"Total number of sequences: {sequences}"]
        lines += [f"Total number of tokens: {round(tokens / 1e9, 2)} Billion", bar]
    max_seq, max_tok = min(per_seq), min(per_tok)
    mixture = "sampled under this data mixture (estimated)"
    lines += [bar, f"Maximum number of sequences {mixture}: {max_seq}"]
    lines += [f"Maximum number of tokens {mixture}: {round(max_tok / 1e9, 2)} Billion", bar]
    print("\n".join(lines), file=out)
    return max_seq, max_tok


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry: 0, or 2 with one line on a bad --weighted-prefix or unreadable data."""
    p = argparse.ArgumentParser(prog="count_tokens.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--weighted-prefix",
        required=True,
        help="Weight, prefix pairs as --data-path takes them, e.g. '0.7 /data/a_text_document 0.3 /data/b'.",
    )
    args = p.parse_args(argv)
    try:
        report(weighted_prefixes(args.weighted_prefix))
    except CountError as exc:
        print(f"count_tokens.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
