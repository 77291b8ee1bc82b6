"""The fast tier cannot rot silently (tests/tiers.py): every SMOKE entry is a real multi-rank
test that is not marked slow, SMOKE covers every wrapper and parallel dimension, and every
public function of tests/dist_utils.py is listed as a way of starting ranks (SPAWNERS) or not
(NOT_SPAWNERS), so a new entry point cannot slip multi-rank tests into the fast tier."""

from __future__ import annotations

import inspect
import os

from tests import dist_utils, tiers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_set_is_real_multirank_and_covers_every_dimension(request):
    covered = set().union(*tiers.SMOKE.values())
    assert tiers.REQUIRED <= covered, f"SMOKE in tests/tiers.py lacks {sorted(tiers.REQUIRED - covered)}"
    items = {item.nodeid: item for item in request.session.items}
    collected_files = {nodeid.split("::")[0] for nodeid in items}
    for nodeid in tiers.SMOKE:
        path = nodeid.split("::")[0]
        assert os.path.isfile(os.path.join(ROOT, path)), f"SMOKE entry {nodeid}: no file {path}"
        if path not in collected_files:
            continue  # this run did not collect that file (a subset was asked for)
        item = items.get(nodeid)
        assert item is not None, (
            f"SMOKE entry {nodeid} is not a collected test (renamed, or marked slow and deselected): "
            "fix tests/tiers.py"
        )
        assert tiers.item_spawns(item), f"SMOKE entry {nodeid} starts no ranks: pick a multi-rank test"
        assert "slow" not in item.keywords, f"SMOKE entry {nodeid} is marked slow: unmark it or pick another"


def test_every_rank_launcher_in_dist_utils_is_a_known_spawner():
    public = [
        name
        for name, obj in vars(dist_utils).items()
        if inspect.isfunction(obj) and obj.__module__ == dist_utils.__name__ and not name.startswith("_")
    ]
    assert "run_distributed" in public
    unknown = [name for name in public if name not in tiers.SPAWNERS + tiers.NOT_SPAWNERS]
    assert not unknown, f"add {unknown} to SPAWNERS or NOT_SPAWNERS in tests/tiers.py"


def test_the_classifier_sees_through_fixtures_and_helpers(request):
    """This module's tests start no ranks; a test whose fixture calls a helper that calls
    run_distributed does (tests/training/test_pretrain.py's ddp_runs fixture)."""
    items = {item.nodeid: item for item in request.session.items}
    assert not tiers.item_spawns(request.node)
    probe = "tests/training/test_pretrain.py::test_ddp_resume_is_bitwise_and_metrics_parse"
    if probe in items:
        assert tiers.item_spawns(items[probe])
