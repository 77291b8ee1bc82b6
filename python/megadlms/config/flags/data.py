"""The data group: dataset blends and splits, the tokenizer, and document packing."""

from __future__ import annotations

from ._flag import add_flag


def data_args(p):
    g = p.add_argument_group("data")
    add_flag(
        g,
        "--data-path",
        nargs="*",
        default=None,
        help="Blend of .bin/.idx prefixes: 'PREFIX' or 'W1 P1 W2 P2 ...'.",
    )
    add_flag(
        g,
        "--train-data-path",
        nargs="*",
        default=None,
        help="Training blend (instead of --data-path + --split).",
    )
    add_flag(g, "--valid-data-path", nargs="*", default=None, help="Validation blend.")
    add_flag(g, "--test-data-path", nargs="*", default=None, help="Test blend.")
    add_flag(
        g,
        "--split",
        default=None,
        help="Train/valid/test split of --data-path, e.g. '969,30,1' (the default).",
    )
    add_flag(g, "--mock-data", action="store_true", help="Random tokens instead of files (smoke tests).")
    add_flag(
        g,
        "--tokenizer-type",
        default=None,
        choices=["ByteTokenizer", "HuggingFaceTokenizer"],
        help="ByteTokenizer (offline: 256 bytes + eod/mask/pad) or a tokenizers-library tokenizer.json. "
        "Default: HuggingFaceTokenizer with --tokenizer-model (as MegaDLMs), else ByteTokenizer.",
    )
    add_flag(
        g,
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: tokenizer.json file or its directory.",
    )
    add_flag(g, "--data-cache-path", default=None, help="Directory for the dataset index caches.")
    add_flag(g, "--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens.")
    add_flag(g, "--num-workers", type=int, default=2, help="DataLoader worker processes.")
    add_flag(
        g,
        "--reset-position-ids",
        action="store_true",
        help="Position ids restart after every end-of-document token (Megatron).",
    )
    add_flag(
        g,
        "--reset-attention-mask",
        action="store_true",
        help="With --reset-position-ids: document packing, each token attends only within its document.",
    )
