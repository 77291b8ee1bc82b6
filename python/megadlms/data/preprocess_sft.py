"""megadlms-preprocess-sft: tokenize chat conversations into Megatron .bin/.idx datasets.

    megadlms-preprocess-sft --input chats.jsonl --output-prefix data/chats \\
        --tokenizer-model path/to/instruct-tokenizer-dir --workers 4

Each line is ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``;
the tokenizer directory's chat template renders it (LLaDA's layout: one sample per assistant
turn, data/chat.py). Writes ``data/chats_text_document.{bin,idx}`` (token ids, one sequence
per sample, one document per conversation) and ``data/chats_answer_document.{bin,idx}``
(the uint8 answer mask, same lengths); ``--data-path data/chats`` then trains on them,
memory-mapped. Output is identical for any --workers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

from .sft_store import ANSWER_SUFFIX, TEXT_SUFFIX, write_conversations


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, checked."""
    p = argparse.ArgumentParser(
        prog="megadlms-preprocess-sft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input", required=True, help='JSON-lines file, one {"messages": [...]} conversation per line'
    )
    p.add_argument(
        "--output-prefix", required=True, help="writes PREFIX_text_document and PREFIX_answer_document"
    )
    p.add_argument(
        "--tokenizer-model",
        required=True,
        help="tokenizer directory (tokenizer.json + tokenizer_config.json with a chat_template)",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (output is identical for any value)"
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip (and count) bad rows instead of stopping at the first one",
    )
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point: 0 on success; bad input prints one error line and returns 1."""
    args = get_args(argv)
    t0 = time.time()
    try:
        convs, samples, skipped = write_conversations(
            args.input,
            args.output_prefix,
            args.tokenizer_model,
            workers=args.workers,
            skip_invalid=args.skip_invalid,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"megadlms-preprocess-sft: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {convs} conversations ({samples} samples, {skipped} rows skipped) to "
        f"{args.output_prefix}{{{TEXT_SUFFIX},{ANSWER_SUFFIX}}}.bin/.idx ({time.time() - t0:.1f} s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
