"""The checks of the paths a run reads and writes, before any process group or model exists.

:func:`parse_config` checks the flags alone (it opens no file, so a command line can be
validated anywhere). :func:`startup_problems` then opens what the flags name, cheaply: each
dataset prefix's .idx/.bin (headers and document counts, not the tokens), the tokenizer
(and its mask token, for a diffusion run), the checkpoint --load names and --hf-init's
config.json. A missing or wrong input is then one line naming the flag, the value and the
fix, seconds after the launch, instead of a traceback after the model is built.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

from megadlms.checkpoint.paths import resolve_checkpoint
from megadlms.config import RunConfig, flag_message
from megadlms.config.messages import FlagError
from megadlms.data import IndexedDataset, parse_blend, parse_split
from megadlms.data.builder import DEFAULT_SPLIT, split_document_ranges

_PREPROCESS = "megadlms-preprocess (or Megatron's tools/preprocess_data.py)"


def _open(flag: str, prefix: str, out: List[str]) -> Optional[IndexedDataset]:
    missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
    if missing:
        hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        out.append(f"{flag} {prefix}: no {' or '.join(missing)}{hint}; write it with {_PREPROCESS}")
        return None
    try:
        return IndexedDataset(prefix)
    except (OSError, ValueError) as exc:  # a corrupt or truncated index names itself
        out.append(f"{flag} {prefix}: {exc}")
        return None


def _blend_problems(flag: str, blend: Sequence[str], shares: Optional[List[float]]) -> List[str]:
    """Every prefix of one blend opens; with ``shares`` (--data-path split by --split) the
    train split of each gets tokens (a split smaller than a sample repeats epochs, as
    Megatron; an empty one cannot)."""
    out: List[str] = []
    parsed = parse_blend(blend, flag)  # the syntax was checked by parse_config
    for prefix in parsed[0] if parsed else []:
        ds = _open(flag, prefix, out)
        if ds is None:
            continue
        n = len(ds.sequence_lengths)
        docs = split_document_ranges(shares, n)[0] if shares else None
        tokens = int(ds.sequence_lengths[docs].sum()) if docs is not None else int(ds.sequence_lengths.sum())
        if tokens == 0:
            where = (
                f" (--split gives the train split {len(docs)} of its {n} documents)"
                if docs is not None
                else ""
            )
            out.append(f"{flag} {prefix}: no tokens for training{where}; use a corpus with text")
    return out


def _sft_path_problems(data) -> List[str]:
    """--sft: every path is a jsonl file of conversations or a megadlms-preprocess-sft prefix."""
    out = []
    for flag, paths in (
        ("--data-path", data.data_path),
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
    ):
        for path in paths or ():
            if not (os.path.isfile(path) or os.path.isfile(path + "_text_document.idx")):
                out.append(
                    f"{flag} {path}: no such jsonl file (nor megadlms-preprocess-sft output "
                    f"{path}_text_document.idx); --sft reads conversations"
                )
    return out


def data_problems(config: RunConfig) -> List[str]:
    """The dataset files every data flag names exist, open, and give the train split tokens."""
    data = config.data
    if data.mock_data:
        return []
    if data.sft:
        return _sft_path_problems(data)
    out: List[str] = []
    if data.data_path:
        out += _blend_problems("--data-path", data.data_path, parse_split(data.split or DEFAULT_SPLIT))
    for flag, blend in (
        ("--train-data-path", data.train_data_path),
        ("--valid-data-path", data.valid_data_path),
        ("--test-data-path", data.test_data_path),
    ):
        if blend:
            out += _blend_problems(flag, blend, None)
    return out


def tokenizer_problems(config: RunConfig) -> List[str]:
    """The tokenizer builds, and a diffusion run has a mask token."""
    try:
        tokenizer = config.data.tokenizer.build()
        if config.diffusion.diffusion:
            tokenizer.mask  # noqa: B018 - raises (naming the fix) when the tokenizer has none
    except (OSError, ValueError, RuntimeError) as exc:
        return [flag_message(str(exc))]
    return []


def checkpoint_problems(config: RunConfig) -> List[str]:
    """--load (when given) is a directory whose latest file is sound; the conversion mode and
    --hf-init need their inputs to exist. A --load without a checkpoint trains from scratch
    (Megatron's behaviour; the trainer says so)."""
    ck, out = config.checkpoint, []
    if ck.load and os.path.exists(ck.load) and not os.path.isdir(ck.load):
        out.append(f"--load {ck.load} is a file; pass the --save directory of a run (or one iter_* in it)")
    elif ck.load:
        try:
            found = resolve_checkpoint(ck.load)
        except (OSError, RuntimeError) as exc:
            out.append(f"--load {ck.load}: {exc}")
        else:
            if found is None and os.path.isfile(os.path.join(ck.load, "config.json")):
                out.append(
                    f"--load {ck.load} is a Hugging Face model directory, not a checkpoint: start "
                    f"from its weights with --hf-init {ck.load} (or convert it with megadlms-import-hf)"
                )
            elif found is None and ck.ckpt_convert_format:
                out.append(
                    f"--load {ck.load} holds no checkpoint (no latest_checkpointed_iteration.txt, "
                    "no iter_*/common.json): --ckpt-convert-format converts an existing checkpoint"
                )
    hf = ck.hf_init
    if hf and os.path.isdir(hf) and not os.path.isfile(os.path.join(hf, "config.json")):
        out.append(f"--hf-init {ck.hf_init}: no config.json there; pass a Hugging Face model directory")
    return out


def output_problems(config: RunConfig) -> List[str]:
    """The directories a run writes to are not files and (the dataset index cache, written
    before the first step) writable."""
    out = []
    for flag, path in (
        ("--save", config.checkpoint.save),
        ("--data-cache-path", config.data.data_cache_path),
    ):
        if path and os.path.exists(path) and not os.path.isdir(path):
            out.append(f"{flag} {path} is a file; pass a directory (it is created when missing)")
    cache = config.data.data_cache_path
    if cache and os.path.isdir(cache) and not os.access(cache, os.W_OK | os.X_OK):
        out.append(f"--data-cache-path {cache} is not writable; pass a writable directory")
    return out


def device_problems(config: RunConfig) -> List[str]:
    """--distributed-backend nccl needs a CUDA device on this host."""
    if config.parallel.distributed_backend == "nccl" and not torch.cuda.is_available():
        return ["--distributed-backend nccl needs CUDA devices (none visible here): use gloo on CPU"]
    return []


def startup_problems(config: RunConfig) -> List[str]:
    """Every problem of the run's inputs on disk, one line each, worded with flags."""
    found = data_problems(config) + tokenizer_problems(config)
    return found + checkpoint_problems(config) + output_problems(config) + device_problems(config)


def check_startup(config: RunConfig) -> None:
    """Raise one :class:`FlagError` listing :func:`startup_problems`, if any."""
    problems = startup_problems(config)
    if problems:
        raise FlagError(problems)
