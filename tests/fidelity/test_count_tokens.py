"""tools/count_tokens.py against MegaDLMs' tool: the same --weighted-prefix string, report lines
and .statistics_* cache; counts checked against the documents written here (plain Python)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
from contextlib import redirect_stderr, redirect_stdout

import numpy as np

from megadlms.data.indexed_dataset import IndexedDatasetBuilder

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "count_tokens.py")


def _tool():
    spec = importlib.util.spec_from_file_location("count_tokens", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _corpus(prefix, seed):
    """Write documents of random lengths (several sequences each); return (sequences, tokens)."""
    rng = random.Random(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    lengths = []
    for _ in range(rng.randint(20, 40)):
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 50)
            b.add_item([rng.randrange(1000) for _ in range(n)])
            lengths.append(n)
        b.end_document()
    b.finalize(prefix + ".idx")
    return len(lengths), sum(lengths)


def test_count_tokens_matches_megadlms_tool(tmp_path):
    tool = _tool()
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    (sa, ta), (sb, tb) = _corpus(a, 1), _corpus(b, 2)
    out = io.StringIO()
    with redirect_stdout(out):
        assert tool.main(["--weighted-prefix", f"0.7 {a} 0.3 {b}"]) == 0
    text = out.getvalue()
    counted = [int(n) for n in re.findall(r"Total number of sequences: (\d+)", text)]
    assert counted == [sa, sb] and f"Inspecting index for {a}" in text
    best = float(re.search(r"Maximum number of sequences .*: ([\d.]+)", text).group(1))
    assert best == min(sa / 0.7, sb / 0.3)
    # MegaDLMs' cache: beside the data, named after the whole prefix, counts as strings.
    cache = os.path.join(str(tmp_path), ".statistics_" + a.replace("/", "_"))
    assert json.load(open(cache)) == {"total_sequences": str(sa), "total_tokens": str(ta)}
    # A later call reads the cache (MegaDLMs' behaviour): a doctored cache shows through.
    json.dump({"total_sequences": "7", "total_tokens": str(tb)}, open(cache, "w"))
    assert tool.count(a) == (7, tb) and tool.count(b) == (sb, tb)
    # Mistakes: one line naming the flag, exit 2.
    for bad, says in (
        (f"1.0 {a} 0.5", "expected 'weight prefix' pairs"),
        (f"x {a}", "weight 'x' is not a number"),
        ("1.0 /nonexistent/dir/p", "data directory /nonexistent/dir does not exist"),
        (f"1.0 {tmp_path}/missing_document", "cannot read"),
    ):
        err = io.StringIO()
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            assert tool.main(["--weighted-prefix", bad]) == 2
        assert err.getvalue().count("\n") == 1 and says in err.getvalue(), err.getvalue()
