"""megadlms-preprocess: tokenize a JSON-lines corpus into Megatron .bin/.idx datasets.

Flags follow Megatron's tools/preprocess_data.py:

    megadlms-preprocess --input corpus.jsonl --json-keys text --output-prefix data/corpus \\
        --tokenizer-type ByteTokenizer --append-eod --workers 4

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per --json-keys key). Each
JSON line is one document, as in Megatron's preprocess_data.py: a string value is one
sequence, a list of strings one sequence per non-empty string; --append-eod ends every
non-empty document with the tokenizer's eod id (after its last sequence). An empty text
becomes a document with no sequence (so document i is always line i, while the readers,
which sample over sequences, skip it). Workers tokenize in parallel but results are written in input order:
the output is byte-identical for any --workers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from .tokenizers import SUPPORTED_TOKENIZERS, build_tokenizer

_worker_state: Dict[str, Any] = {}  # this worker process's tokenizer and flags (_init_worker)


def _init_worker(
    tokenizer_type: str,
    tokenizer_model: Optional[str],
    json_keys: Sequence[str],
    append_eod: bool,
    input_path: str,
) -> None:
    tok = build_tokenizer(tokenizer_type, tokenizer_model)
    _worker_state.update(
        tok=tok,
        keys=list(json_keys),
        append_eod=append_eod,
        input=input_path,
        eod=tok.eod if append_eod else None,
    )


_Encoded = Tuple[int, Dict[str, Tuple[np.ndarray, List[int]]]]  # (bytes read, key -> (ids, sequence lengths))


def _encode(item: Tuple[int, str]) -> _Encoded:
    lineno, line = item
    where = f"{_worker_state['input']}:{lineno}"
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--input {where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--input {where}: expected a JSON object per line")
    out = {}
    for key in _worker_state["keys"]:
        if key not in doc:
            raise ValueError(f"--input {where}: no key {key!r} (--json-keys); keys are {sorted(doc)}")
        text = doc[key]
        sentences = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in sentences):
            raise ValueError(
                f"--input {where}: {key!r} is a {type(text).__name__}, expected a string or a list of strings"
            )
        # Megatron's encode: one sequence per non-empty sentence, eod after the last; an
        # empty text gives a document with no sequence.
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = list(_worker_state["tok"].tokenize(sentence))
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and _worker_state["append_eod"]:
            ids.append(_worker_state["eod"])
            # The eod joins the last sequence instead of forming one of its own, as in Megatron.
            lengths[-1] += 1
        out[key] = (np.asarray(ids, dtype=np.int64), lengths)
    return len(line.encode("utf-8")), out


def _lines(path: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            # enumerate counts blank lines too, so error messages name the real line number.
            if line.strip():
                yield lineno, line


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megadlms-preprocess",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    g.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys of the JSON objects to tokenize (one output dataset each)",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        default="ByteTokenizer",
        choices=SUPPORTED_TOKENIZERS,
        help="tokenizer to use (default ByteTokenizer)",
    )
    g.add_argument(
        "--tokenizer-model", default=None, help="tokenizer.json (or its directory) for HuggingFaceTokenizer"
    )
    g.add_argument("--append-eod", action="store_true", help="append the eod token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--workers", type=int, default=1, help="tokenizer processes (output is identical for any value)"
    )
    g.add_argument("--log-interval", type=int, default=10000, help="report progress every N documents")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        p.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    return args


def preprocess(args: argparse.Namespace) -> Dict[str, str]:
    """Run the preprocessing; returns {json key: output path prefix}."""
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    if args.append_eod:
        _ = tok.eod  # fail before any work if the tokenizer has no eod token
    # Megatron's dtype rule: the same corpus and tokenizer give byte-identical .bin files.
    dtype = optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in prefixes.items()}
    init = (args.tokenizer_type, args.tokenizer_model, args.json_keys, args.append_eod, args.input)
    pool = None
    results: Iterator[_Encoded]
    if args.workers == 1:
        _init_worker(*init)
        results = map(_encode, _lines(args.input))
    else:
        pool = multiprocessing.get_context().Pool(args.workers, initializer=_init_worker, initargs=init)
        results = pool.imap(_encode, _lines(args.input), chunksize=64)  # imap keeps input order
    t0, total_bytes, n = time.time(), 0, 0
    try:
        for n, (nbytes, docs) in enumerate(results, start=1):
            total_bytes += nbytes
            for k, (ids, lengths) in docs.items():
                builders[k].add_document(ids, lengths)
            if n % args.log_interval == 0:
                dt = max(time.time() - t0, 1e-9)
                print(
                    f"processed {n} documents ({n / dt:.0f} docs/s, {total_bytes / dt / 2**20:.2f} MB/s)",
                    file=sys.stderr,
                    flush=True,
                )
    # BaseException: after Ctrl-C too, no .bin may be left that looks like a finished dataset.
    except BaseException:
        for k, b in builders.items():  # leave no half-written .bin behind
            b.close()
            if os.path.exists(prefixes[k] + ".bin"):
                os.remove(prefixes[k] + ".bin")
        raise
    finally:
        if pool is not None:
            pool.terminate()
    for k, b in builders.items():
        # Indices only once every document is in: an .idx is the mark of a complete dataset.
        b.finalize(prefixes[k] + ".idx")
    print(
        f"wrote {n} documents to {', '.join(p + '.bin/.idx' for p in prefixes.values())} "
        f"({time.time() - t0:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    return prefixes


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point: 0 on success; bad input prints one error line and returns 1."""
    args = get_args(argv)
    try:
        preprocess(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"megadlms-preprocess: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
