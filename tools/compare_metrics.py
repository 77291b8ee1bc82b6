"""Compare the --metrics-jsonl train records of two directories written by loss_curves.sh.

    python tools/compare_metrics.py BEFORE_DIR AFTER_DIR

Prints, per run found in BEFORE_DIR, how many iterations have identical (lm_loss, grad_norm) and the largest
relative difference; exits 1 if any run differs (in iterations or in any value).
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _records(path: str) -> dict:
    with open(path) as f:
        recs = [json.loads(line) for line in f if '"train"' in line]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in recs}


def main(before: str, after: str) -> int:
    status = 0
    names = sorted(os.path.basename(f)[: -len(".jsonl")] for f in glob.glob(f"{before}/*.jsonl"))
    for name in names:
        if not os.path.exists(f"{after}/{name}.jsonl"):
            print(f"{name}: missing in {after}")
            status = 1
            continue
        b, a = _records(f"{before}/{name}.jsonl"), _records(f"{after}/{name}.jsonl")
        if sorted(a) != sorted(b):
            print(f"{name}: iterations differ ({len(b)} vs {len(a)})")
            status = 1
            continue
        same = sum(b[i] == a[i] for i in b)
        status |= same != len(b)
        rel = max(abs(x - y) / abs(x) for i in b for x, y in zip(b[i], a[i]))
        print(f"{name:8s} iterations {len(b)}  identical {same}/{len(b)}  max relative diff {rel:.2e}")
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
