"""Placement groups (teraflops.orchestration.placement_groups): the decision on injected free GPUs, and
what the lecture reads from the demo's records (injected here). Nothing here starts Ray; the real demo runs
in Unit 3's lecture (tests/test_unit03_run.py)."""

import pytest

from teraflops.orchestration import placement_groups as pg

FRAGMENTED = {"a": 1, "b": 1, "c": 1}  # 3 free GPUs, one per node


@pytest.mark.parametrize("strategy, free, nodes", [
    ("STRICT_PACK", FRAGMENTED, None),  # 3 free, but no node has 2: pending
    ("STRICT_PACK", {"a": 1, "b": 2, "c": 1}, ["b", "b"]),  # a node freed: placed there
    ("SPREAD", FRAGMENTED, ["a", "b"]),  # one per node
    ("SPREAD", {"a": 2, "b": 0, "c": 0}, ["a", "a"]),  # best effort: the same node when no other has room
    ("PACK", FRAGMENTED, ["a", "b"]),  # packs as far as it can, spills over
    ("STRICT_SPREAD", {"a": 2, "b": 0, "c": 0}, None),  # needs two nodes with room
    ("STRICT_SPREAD", FRAGMENTED, ["a", "b"]),
    ("SPREAD", {"a": 1, "b": 0, "c": 0}, None),  # not enough GPUs in all: pending whatever the strategy
])
def test_the_placement_decision(strategy, free, nodes):
    got = pg.placeable(strategy, 2, free)
    if nodes is None:
        assert got is None
    else:  # which node among equals is Ray's choice: compare how many nodes, and that each had room
        assert got is not None and len(got) == 2 and len(set(got)) == len(set(nodes))
        assert all(got.count(n) <= free[n] for n in set(got))


def test_free_gpus_in_all_do_not_place_a_packed_group():
    """Fragmentation: the total would do, the shape does not."""
    assert sum(FRAGMENTED.values()) >= 2 and pg.placeable("STRICT_PACK", 2, FRAGMENTED) is None


def test_a_bad_request_is_one_line():
    with pytest.raises(pg.PlacementError, match="unknown strategy") as e:
        pg.placeable("TIGHT", 2, FRAGMENTED)
    assert "\n" not in str(e.value) and "Hint" in str(e.value)
    with pytest.raises(pg.PlacementError, match="bundles"):
        pg.placeable("PACK", 0, FRAGMENTED)


A = ["10.213.0.1", "10.213.0.2", "10.213.0.3"]


def _demo() -> pg.PlacementRun:
    """The demo's steps as the driver records them (injected: the states Ray's GCS reports for each group)."""
    fill = {f"filler{i}": {"state": "CREATED", "nodes": [a]} for i, a in enumerate(A)}
    pending = {"state": "PENDING", "nodes": []}
    return pg.PlacementRun([
        pg.Step("take 1 GPU on every node", dict(fill), {a: 1.0 for a in A}, []),
        pg.Step("ask STRICT_PACK 2 × 1 GPU", {**fill, "STRICT_PACK": pending}, {a: 1.0 for a in A}, None),
        pg.Step("ask SPREAD 2 × 1 GPU", {**fill, "STRICT_PACK": pending, "SPREAD": {"state": "CREATED", "nodes": A[:2]}},
                {A[0]: 0.0, A[1]: 0.0, A[2]: 1.0}, [A[0], A[1]]),
        pg.Step("free node 1 (remove SPREAD and node 1's filler)",
                {"filler0": fill["filler0"], "filler2": fill["filler2"], "STRICT_PACK": {"state": "CREATED", "nodes": [A[1]] * 2},
                 "SPREAD": {"state": "REMOVED", "nodes": []}}, {A[0]: 1.0, A[1]: 0.0, A[2]: 1.0}, None),
    ], "  {'GPU': 1.0} * 2 (STRICT_PACK): 1+ pending placement groups")


def test_the_demo_reads_pending_then_placed():
    r = _demo()
    assert r.packed_waited_then_placed() and r.spread_placed_at_once() and r.predictions_match()
    text = pg.table_of(r)
    assert "STRICT_PACK: pending" in text and "STRICT_PACK: created" in text


def test_a_packed_group_placed_at_once_is_not_the_lesson():
    """The reading fails when Ray placed STRICT_PACK on the fragmented cluster (it must not be true by setup)."""
    r = _demo()
    asked = r.step("ask STRICT_PACK")
    placed = pg.Step(asked.what, {**asked.groups, "STRICT_PACK": {"state": "CREATED", "nodes": ["10.213.0.1"] * 2}},
                     asked.free, asked.predicted)
    bad = pg.PlacementRun([placed if s is asked else s for s in r.steps], r.status_pending)
    assert not bad.packed_waited_then_placed() and not bad.predictions_match()
