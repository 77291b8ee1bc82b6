"""Verified checkpoints: the size and CRC-32 of every file, recorded at save time and checked
on load (docs/reliability.md).

The manifest (``{relative path: {"size", "crc32"}}``) is computed over the finished files of
``iter_XXXXXXX.tmp`` and stored in ``common.json`` before the directory is renamed into
place, so a checkpoint that ``latest`` names always carries the record of what it held.
``common.json`` itself is not in it: it is written last, atomically, and parsed as JSON.

Verification is spread over the ranks (file i is read by rank i mod world) and the findings
are shared, so every rank raises the same :class:`CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import os
import zlib
from typing import Dict, List, Optional

import torch.distributed as dist

_CHUNK = 8 << 20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or altered (the message names it)."""


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return f"{crc & 0xFFFFFFFF:08x}"
            crc = zlib.crc32(block, crc)


def checkpoint_files(ckpt: str, exclude=("common.json",)) -> List[str]:
    """Relative paths of the files under ``ckpt`` (sorted; ``exclude``d names left out)."""
    out = []
    for base, _, names in os.walk(ckpt):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), ckpt)
            if rel not in exclude:
                out.append(rel)
    return sorted(out)


def file_manifest(ckpt: str) -> Dict[str, dict]:
    """``{relative path: {"size": bytes, "crc32": hex}}`` of every file of ``ckpt`` but common.json."""
    return {
        rel: {"size": os.path.getsize(os.path.join(ckpt, rel)), "crc32": _crc32(os.path.join(ckpt, rel))}
        for rel in checkpoint_files(ckpt)
    }


def check_file(ckpt: str, rel: str, record: dict) -> Optional[str]:
    """What is wrong with one file of the manifest, or None."""
    path = os.path.join(ckpt, rel)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    # Size first: it costs nothing and names truncation, the usual failure, more clearly than a CRC.
    if size != record["size"]:
        return f"{path} has {size} bytes, {record['size']} were written (truncated or overwritten)"
    crc = _crc32(path)
    if crc != record["crc32"]:
        return f"{path} fails its checksum (crc32 {crc}, {record['crc32']} was written): the file is corrupt"
    return None


def verify_checkpoint(ckpt: str, common: dict) -> None:
    """Raise :class:`CheckpointCorruptError` on every rank if any file of the manifest in
    ``common`` is missing or differs (collective when a process group exists). Checkpoints
    written before manifests existed (no ``files`` record) pass unchecked."""
    manifest = common.get("files")
    if manifest is None:
        return
    ranked = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if ranked else (0, 1)
    # Sorted, so every rank agrees which files are its share (rank i checks files i, i+world, ...).
    mine = [p for i, (rel, rec) in enumerate(sorted(manifest.items())) if i % world == rank
            for p in [check_file(ckpt, rel, rec)] if p]  # fmt: skip
    if ranked and world > 1:
        gathered: List[Optional[List[str]]] = [None] * world
        # Share the findings: a rank that raised alone would leave the others waiting in the next collective.
        dist.all_gather_object(gathered, mine)
        mine = [p for part in gathered for p in part or []]
    if mine:
        more = f" (and {len(mine) - 1} more problem(s))" if len(mine) > 1 else ""
        raise CheckpointCorruptError(
            f"checkpoint {ckpt} failed verification: {mine[0]}{more}. Restore the file, load an older "
            "checkpoint (--load DIR/iter_N, or --ckpt-fallback to take the newest one that verifies)"
        )
