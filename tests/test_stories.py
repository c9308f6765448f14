"""The lectures' stories about live measurements: each evaluated on injected measurements on each side
of its bound, inside its margin, on a busy machine and with a measurement missing; then how the run
summary, the report card and `teraflops run`'s exit code carry them. No process starts here."""

import json
import math

import pytest

from teraflops.course import cli, report_card, runner, stories
from teraflops.course.runner import NotebookResult, format_summary
from teraflops.course.stories import CANT_TELL, CONTRADICTS, HOLDS, STORIES, Story, StoryResult, evaluate
from teraflops.machine import BUSY_LOAD_PER_CORE, Machine

QUIET = {"mean": 0.2, "max": 0.5, "cores": 2}
BUSY = {"mean": BUSY_LOAD_PER_CORE * 2 + 2.2, "max": 8.0, "cores": 2}


def _entries(values: dict) -> dict:
    """Measurements as the runner reads them back from the notebook's report file."""
    return {k: {"value": v, "unit": "", "label": k, "card": False} for k, v in values.items()}


def _same(key):
    return lambda q: {key: q}


# For each story: the measurements whose reading is exactly q (a new story needs its line here).
MAKE = {
    "roofline_compute_bound": _same("compute_bound_ops"),
    "roofline_memory_bound": _same("memory_bound_ops"),
    "attention_memory_grows_n2": _same("attn_memory_ratio"),
    "attention_training_memory_grows_n2": _same("attn_train_memory_ratio"),
    "tp_across_slow_link": _same("tp_vs_dp_comm_seconds"),
    "idle_matches_model": _same("idle_model_error_max"),
    "idle_grows_with_delay": _same("idle_growth_min"),
    "straggler_flagged": lambda q: {"straggler_runs_caught": 4 * q, "straggler_runs_injected": 4},
    "no_false_flag": _same("straggler_false_flags"),
    "slow_link_found": _same("slow_link_found"),
    "slow_link_attributed": _same("slow_link_attributed"),
    "slow_compute_attributed": _same("slow_compute_attributed"),
    "ray_moved": _same("ray_moved"),
    "ray_detected": _same("ray_detect_s"),
    "ray_retry_at_old_size": _same("ray_retry_over_timeout"),
    "pg_pending_then_placed": _same("pg_pending_then_placed"),
    "simulated_batching_gain": lambda q: {"batching_sim_best_rps": 100 * q, "batching_sim_batch1_rps": 100},
    "executed_batch_grows": lambda q: {"served_batch_1": 1.0, "served_batch_4": 3.0, "served_batch_16": 3.0 * q},
    "batching_2x_at_16_clients": lambda q: {"served_rps_batched_16": 40 * q, "served_rps_single_16": 40},
    "onnxruntime_int8_beats_eager": lambda q: {"engine_tokens_per_s_ort_int8": 100 * q, "engine_tokens_per_s_eager": 100},
    "alpha_beta_fit": _same("alpha_beta_r2"),
    "aggregate_sublinear": lambda q: {"contention_aggregate_kmax": 80 * q, "contention_aggregate_k1": 10,
                                      "contention_kmax": 8, "contention_k1": 1},
    "per_transfer_falls": lambda q: {"contention_per_kmax": 10 * q, "contention_per_k1": 10},
    **{f"triage_{n}": _same(f"triage_matches_{n}")
       for n in ("matmul", "naive_attention", "zero3", "straggler", "decode", "allreduce")},
}
ALL = [s for unit in sorted(STORIES) for s in STORIES[unit]]


def _points(s: Story) -> dict[str, float]:
    """Readings just on the good side of the bound, just on the bad side, and past the margin."""
    bound = s.at_least if s.at_least is not None else s.at_most
    bad = -1 if s.at_least is not None else 1  # the direction that misses the bound
    eps = 1e-3 * max(1.0, abs(bound))
    return {"good": bound - bad * eps, "at": bound, "inside": bound + bad * s.margin / 2,
            "past": bound + bad * (s.margin + 0.1 * max(1.0, abs(bound)))}


def test_every_story_is_unique_and_driven_here():
    names = [s.name for s in ALL]
    assert len(names) == len(set(names))
    assert set(names) == set(MAKE), "a story without injected measurements here, or a test of a removed story"
    for unit, group in STORIES.items():
        assert all(s.unit == unit and s.source and s.claim for s in group)


@pytest.mark.parametrize("story", ALL, ids=lambda s: s.name)
def test_each_side_of_the_bound_and_the_margin(story):
    p = _points(story)
    for where in ("good", "at"):
        r = evaluate(story, _entries(MAKE[story.name](p[where])), QUIET)
        assert r.status == HOLDS and r.why is None and r.value == pytest.approx(p[where]), (where, r)
    past = evaluate(story, _entries(MAKE[story.name](p["past"])), QUIET)
    assert past.status == CONTRADICTS and past.line().startswith("CONTRADICTS: " + story.claim), past
    if story.margin:
        inside = evaluate(story, _entries(MAKE[story.name](p["inside"])), QUIET)
        assert inside.status == CANT_TELL and inside.why == "inside the margin", inside
        assert inside.line().startswith("can't tell (inside the margin): ")


@pytest.mark.parametrize("story", ALL, ids=lambda s: s.name)
def test_a_busy_machine_turns_a_miss_into_cant_tell_never_a_contradiction(story):
    p = _points(story)
    miss = evaluate(story, _entries(MAKE[story.name](p["past"])), BUSY)
    assert miss.status == CANT_TELL and miss.why == f"machine busy: load {BUSY['mean']:.1f} on 2 cores", miss
    held = evaluate(story, _entries(MAKE[story.name](p["good"])), BUSY)
    assert held.status == HOLDS  # a busy machine does not hide a result that holds


@pytest.mark.parametrize("story", ALL, ids=lambda s: s.name)
def test_a_missing_measurement_cannot_tell(story):
    full = _entries(MAKE[story.name](_points(story)["good"]))
    for key in story.keys:
        r = evaluate(story, {k: v for k, v in full.items() if k != key}, QUIET)
        assert r.status == CANT_TELL and r.value is None and r.why.startswith(f"measurement missing: {key}"), r
    nan = evaluate(story, {**full, story.keys[0]: {"value": math.nan}}, QUIET)
    assert nan.status == CANT_TELL and "measurement missing" in nan.why


def test_busy_is_the_machines_rule_per_core_on_the_mean_load():
    at = {"mean": BUSY_LOAD_PER_CORE * 4, "max": 50.0, "cores": 4}
    assert stories.machine_busy(at) is None  # not above the rule; a peak (max) alone is not a busy unit
    assert stories.machine_busy({**at, "mean": at["mean"] + 0.1}) == f"machine busy: load {at['mean'] + 0.1:.1f} on 4 cores"
    assert stories.machine_busy({}) is None and stories.machine_busy(None) is None


def test_a_wide_spread_of_repeats_cannot_tell_a_miss():
    s = Story(9, "noisy", "the thing is fast", ("rate", "rate_spread"), lambda r, _: r, at_least=2.0,
              margin=0.1, spread_key="rate_spread", max_spread=0.2, source="test")
    assert evaluate(s, {"rate": 1.0, "rate_spread": 0.5}, QUIET).why == "spread of repeats too wide: 50% > 20%"
    assert evaluate(s, {"rate": 1.0, "rate_spread": 0.1}, QUIET).status == CONTRADICTS
    assert evaluate(s, {"rate": 2.5, "rate_spread": 0.5}, QUIET).status == HOLDS


def test_a_reading_that_is_not_a_number_cannot_tell():
    s = next(s for s in ALL if s.name == "batching_2x_at_16_clients")
    r = evaluate(s, {"served_rps_batched_16": 10.0, "served_rps_single_16": 0.0}, QUIET)
    assert r.status == CANT_TELL and r.why.startswith("measurement not usable")


def test_a_story_has_exactly_one_bound_and_a_non_negative_margin():
    with pytest.raises(ValueError, match="exactly one"):
        Story(1, "x", "x", ("a",), lambda a: a, source="test")
    with pytest.raises(ValueError, match="exactly one"):
        Story(1, "x", "x", ("a",), lambda a: a, at_least=1, at_most=2, source="test")
    with pytest.raises(ValueError, match="distance"):
        Story(1, "x", "x", ("a",), lambda a: a, at_least=1, margin=-1, source="test")


def test_evaluate_unit_evaluates_every_story_of_the_unit_and_none_elsewhere():
    got = stories.evaluate_unit(4, {}, QUIET)
    assert [r.name for r in got] == [s.name for s in STORIES[4]]
    assert all(r.status == CANT_TELL for r in got)
    assert stories.evaluate_unit(None, {}, QUIET) == [] and stories.evaluate_unit(99, {}, QUIET) == []


# ---- how a run carries them ---------------------------------------------------------------------------

def _result(name, status, why=None, value=1.0):
    return StoryResult(4, name, f"claim {name}", status, value, "≥ 2 (margin 0.3)", why, "batched / unbatched req/s")


def _runs():
    ok = NotebookResult("04_compilation", 10.0, True, stories=[
        _result("a", HOLDS, value=2.5), _result("b", CANT_TELL, "machine busy: load 5.2 on 2 cores")])
    bad = NotebookResult("05_hardware", 20.0, True, stories=[_result("c", CONTRADICTS, value=1.2)])
    return ok, bad


def test_a_contradiction_fails_the_notebook_a_cant_tell_does_not():
    ok, bad = _runs()
    assert ok.status == "ok" and not ok.contradicted
    assert bad.ok and bad.status == "FAILED" and [s.name for s in bad.contradicted] == ["c"]


def test_the_summary_prints_one_line_per_story():
    ok, bad = _runs()
    text = format_summary(Machine("cpu", cpu_cores=2), [ok, bad])
    assert "holds: claim a (batched / unbatched req/s 2.5, needs ≥ 2 (margin 0.3))" in text
    assert "can't tell (machine busy: load 5.2 on 2 cores): claim b" in text
    assert "CONTRADICTS: claim c (batched / unbatched req/s 1.2, needs ≥ 2 (margin 0.3))" in text
    assert "05_hardware     FAILED" in text and "04_compilation  ok" in text
    assert "1/2 notebooks ok" in text and "see CONTRADICTS" in text


def test_the_report_card_shows_stories_per_unit_and_results_json_keeps_them(tmp_path):
    ok, bad = _runs()
    page = report_card.render(Machine("cpu", cpu_cores=2), [ok, bad], references=[])
    four, five = page.split("Unit 5:")
    assert "holds: claim a" in four and "can&#x27;t tell (machine busy: load 5.2 on 2 cores): claim b" in four
    assert "CONTRADICTS: claim c" in five and "failed: the measurements contradict 1 of the lecture" in five
    report_card.write(Machine("cpu", cpu_cores=2), [ok, bad], tmp_path, references=[])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [s["status"] for s in data["stories"]["04_compilation"]] == [HOLDS, CANT_TELL]
    assert data["stories"]["05_hardware"][0] == {**_result("c", CONTRADICTS, value=1.2).to_json()}


@pytest.mark.parametrize("statuses, code", [((HOLDS, CANT_TELL), 0), ((HOLDS, CONTRADICTS), 1)])
def test_teraflops_run_exits_non_zero_on_a_contradiction_only(statuses, code, tmp_path, monkeypatch, capsys):
    def fake_run_units(units, out_dir, timeout_per_cell, html):
        return [NotebookResult("04_compilation", 1.0, True,
                               stories=[_result(f"s{i}", s, "inside the margin" if s == CANT_TELL else None)
                                        for i, s in enumerate(statuses)])]

    monkeypatch.setattr(runner, "run_units", fake_run_units)
    assert cli.main(["run", "4", "--out", str(tmp_path), "--no-html"]) == code
    out = capsys.readouterr().out
    assert "holds: claim s0" in out
    assert ("CONTRADICTS: claim s1" in out) == (code == 1)
    assert (tmp_path / "report_card.html").is_file()
