"""teraflops.launch.wire: the one dataclass ⇄ JSON round trip of every Spec and Result, checked at the boundary."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from teraflops.launch.rank import RankIdentity, read_spec
from teraflops.sizing import PRESETS, TrainConfig, dp_config
from teraflops.launch.wire import SpecError, from_json, read, to_json, write


@dataclass(frozen=True)
class Inner:
    name: str
    sizes: tuple[int, ...]
    pair: tuple[int, float] = (1, 2.0)


@dataclass(frozen=True)
class Outer:
    model: TrainConfig
    inners: tuple[Inner, ...]
    comms: dict[str, dict[int, list]]
    maybe: float | None = None
    raw: object = None
    rows: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Child(RankIdentity):
    value: float
    extra: tuple[int, ...] = ()


def sample() -> Outer:
    return Outer(dp_config(PRESETS["tiny"]), (Inner("a", (1, 2)), Inner("b", (), (3, 4.5))),
                 {"all_reduce": {1024: [3, [0.1]], 8: [1, []]}}, None, {"free": [1, "x"]}, [[1.0, 2.5]])


def test_round_trip_keeps_nested_dataclasses_tuples_none_and_int_keys(tmp_path):
    obj = sample()
    text = json.dumps(to_json(obj))  # real JSON on the way: int keys become strings, tuples lists
    back = from_json(Outer, json.loads(text))
    assert back == obj and isinstance(back.inners, tuple) and isinstance(back.inners[0].sizes, tuple)
    assert list(back.comms["all_reduce"]) == [1024, 8] and back.maybe is None
    assert read(Outer, write(obj, tmp_path / "spec.json")) == obj


def test_a_float_field_takes_an_int_and_an_int_field_refuses_a_float_or_bool():
    data = to_json(sample())
    data["model"]["lr"] = 1
    assert from_json(Outer, data).model.lr == 1.0 and isinstance(from_json(Outer, data).model.lr, float)
    for bad in (4.0, True, "4"):
        data["model"]["vocab"] = bad
        with pytest.raises(SpecError, match=r"^Outer\.model\.vocab: expected int"):
            from_json(Outer, data)


@pytest.mark.parametrize("change, words", [
    (lambda d: d["model"].pop("vocab"), r"^Outer\.model: missing field 'vocab'"),
    (lambda d: d.update(stpes=3), r"^Outer: unknown field 'stpes'"),
    (lambda d: d["inners"][1].update(sizes="1,2"), r"^Outer\.inners\[1\]\.sizes: expected a list"),
    (lambda d: d["inners"][0].update(pair=[1]), r"^Outer\.inners\[0\]\.pair: expected 2 items"),
    (lambda d: d["comms"]["all_reduce"].update(big=[1]), r"^Outer\.comms\['all_reduce'\]: expected int keys"),
    (lambda d: d.update(maybe="fast"), r"^Outer\.maybe: expected float"),
])
def test_a_wrong_or_missing_field_is_one_line_naming_it(change, words):
    data = to_json(sample())
    change(data)
    with pytest.raises(SpecError, match=words) as e:
        from_json(Outer, data)
    assert "\n" not in str(e.value)


def test_a_result_reads_the_fields_it_inherits_from_the_rank_identity():
    """Every Result starts with :class:`RankIdentity` (rank, world_size, backend, device; ``node``
    keyword-only, after the subclass's own fields): decoded and checked like the Result's own."""
    obj = Child(rank=1, world_size=2, backend="gloo", device="cpu", value=0.5, node=1)
    data = json.loads(json.dumps(to_json(obj)))
    assert list(data) == ["rank", "world_size", "backend", "device", "node", "value", "extra"]
    assert from_json(Child, data) == obj
    assert from_json(Child, {k: v for k, v in data.items() if k != "node"}).node is None
    with pytest.raises(SpecError, match=r"^Child: missing field 'backend' \(str\)"):
        from_json(Child, {k: v for k, v in data.items() if k != "backend"})
    with pytest.raises(SpecError, match=r"^Child\.rank: expected int"):
        from_json(Child, {**data, "rank": "1"})


def test_read_spec_takes_the_file_after_spec_and_says_when_there_is_none(tmp_path):
    path = write(sample(), tmp_path / "spec.json")
    assert read_spec(Outer, ["--local_rank=0", "--spec", str(path)]) == sample()
    with pytest.raises(SpecError, match=r"^Outer: no --spec PATH"):
        read_spec(Outer, ["--local_rank=0"])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SpecError, match=r"^Outer: .*bad\.json is not JSON"):
        read_spec(Outer, ["--spec", str(tmp_path / "bad.json")])


def test_to_json_refuses_what_json_cannot_carry():
    with pytest.raises(SpecError, match="cannot send a set"):
        to_json({"x": {1, 2}})


def test_launch_reads_each_ranks_result_as_the_dataclass_and_names_the_rank_of_a_bad_one():
    from teraflops.launch.launcher import typed_results

    @dataclass(frozen=True)
    class WithNode:
        rank: int
        node: int | None = None

    @dataclass(frozen=True)
    class Plain:
        rank: int

    got = [{"rank": 0, "node": 1}, {"rank": 1, "node": 0}]
    assert typed_results(got, WithNode) == [WithNode(0, 1), WithNode(1, 0)]
    assert typed_results(got, Plain) == [Plain(0), Plain(1)]  # a multi-node launch's "node" only where declared
    with pytest.raises(SpecError, match=r"^Plain of rank 1\.rank: expected int, got str"):
        typed_results([{"rank": 0}, {"rank": "1"}], Plain)
