"""Context-parallel flags beyond the size (which lives with the other parallel sizes in
flags_model.py): Megatron's --cp-comm-type."""

from __future__ import annotations

from .flags_model import add_flag

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def add_cp_args(p) -> None:
    """--cp-comm-type: accepted with Megatron's choices; attention always all-gathers K/V here
    (a different choice changes speed and memory, never the numbers: noted once at start)."""
    g = p.add_argument_group("context parallelism")
    add_flag(
        g,
        "--cp-comm-type",
        nargs="+",
        choices=CP_COMM_TYPES,
        default=["allgather"],
        help="How attention communicates across the context-parallel ranks (Megatron: p2p ring, "
        "a2a, allgather, a2a+p2p; one value or one per layer). megadlms always all-gathers K/V "
        "(the default here); other values are accepted and noted as without effect.",
    )
