#!/usr/bin/env python
"""Megatron-style entry point for megadlms-preprocess (same flags as Megatron's
tools/preprocess_data.py): python tools/preprocess_data.py --input corpus.jsonl ..."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from megadlms.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
