"""Where checkpoints live: the ``iter_XXXXXXX`` directories of a --save root, its ``latest``
file, and ``common.json`` (read without loading any tensor)."""

from __future__ import annotations

import json
import os
from typing import Optional

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
TORCH_FILE = os.path.join("mp_rank_00", "model_optim_rng.pt")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """Iteration named by ``root/latest_checkpointed_iteration.txt`` or None if absent."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise RuntimeError(f"{path} should hold an iteration number, found {text!r}")
    return int(text)


def resolve_checkpoint(path: str) -> Optional[str]:
    """``path`` may be a --save root (uses its latest file) or one iter_* directory."""
    # An iter_* directory is recognised by its common.json, which the commit writes last.
    if os.path.isfile(os.path.join(path, COMMON_FILE)):
        return path
    it = read_latest_iteration(path)
    if it is None:
        return None
    ckpt = checkpoint_dir(path, it)
    # latest is only written after the rename, so a missing target means damage, not a save in flight.
    if not os.path.isfile(os.path.join(ckpt, COMMON_FILE)):
        raise RuntimeError(
            f"{os.path.join(path, LATEST_FILE)} names iteration {it} but {ckpt} "
            f"is missing or incomplete (no {COMMON_FILE})"
        )
    return ckpt


def older_checkpoints(root: str, before: int) -> list:
    """Complete ``iter_*`` directories of ``root`` older than iteration ``before``, newest first
    (the candidates of --ckpt-fallback)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        it = name[5:]
        if name.startswith("iter_") and it.isdigit() and int(it) < before:
            # Skips .tmp directories and torn ones: only committed checkpoints can be fallen back to.
            if os.path.isfile(os.path.join(root, name, COMMON_FILE)):
                found.append((int(it), os.path.join(root, name)))
    return [path for _, path in sorted(found, reverse=True)]


def read_common(ckpt: str) -> dict:
    with open(os.path.join(ckpt, COMMON_FILE)) as f:
        return json.load(f)
