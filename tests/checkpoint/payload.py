"""File sizes of a DCP checkpoint: is every byte stored once (the TP and EP resharding tests)."""

from __future__ import annotations

import glob
import os


def distcp_bytes(ckpt: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(ckpt, "*.distcp")))


FRAME_BYTES = (1400, 1664)
"""torch.save's framing of one stored chunk (1.5-1.6 KB, with alignment): format 4 stores a
sharded tensor as several chunks (one per saving rank's piece), each framed: only that may grow."""


def chunks(ckpt: str) -> int:
    from megadlms.checkpoint.format import SafeFileSystemReader

    md = SafeFileSystemReader(ckpt).read_metadata()
    return sum(len(v.chunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))


def same_payload(multi_ckpt: str, one_ckpt: str, tol: float) -> bool:
    """The multi-rank checkpoint holds the single-process one's bytes once (no replica twice):
    equal sizes up to ``tol`` and the framing of its extra chunks."""
    multi, one = distcp_bytes(multi_ckpt), distcp_bytes(one_ckpt)
    extra = chunks(multi_ckpt) - chunks(one_ckpt)
    return one + FRAME_BYTES[0] * extra - tol * one <= multi <= one + FRAME_BYTES[1] * extra + tol * one
