"""``teraflops demo``: each mode's story is decided on its numbers (tested on given numbers, each side of
each bound); beside other learners' runs every mode still ends in a figure, a sentence and the numbers
that do not depend on the load; a failed live mode falls back to a recorded one; bad input is one line."""

from __future__ import annotations

import os
from pathlib import Path
import time

import matplotlib
import pytest

from teraflops import plots
from teraflops.course import cli, demo
from teraflops.errors import CourseError

# Beside the hog (two NumPy copiers, two torch matmuls on two cores), with 2-3 other engineers' runs on the
# same machine, the modes took: attention 37 s, compile 40 s, straggler 69 s, interconnect 70 s (zero ~70 s
# without the hog). All of them are far past this suite's budget, so CI runs the two in-process modes, whose
# timings a busy machine bends most (compiled faster than eager, flash below naive); the launches' stories
# run with TERAFLOPS_DEMO_ALL=1 (about 4 minutes here), and ZeRO's per-rank ordering is also asserted on the
# ZeRO tests' own runs (tests/test_zero.py::test_zero_peak_model_states_fall_stage_by_stage).
BESIDE_HOG = ("attention", "compile")
BESIDE_HOG_ALL = ("attention", "compile", "straggler", "interconnect", "zero")


def test_unknown_mode_and_bad_scale_are_one_line_errors(capsys):
    with pytest.raises(CourseError, match="unknown demo mode 'zer0'. Hint: one or more of attention, zero"):
        demo.check_modes(["zer0"])
    assert cli.main(["demo", "zer0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert cli.main(["demo", "--scale", "huge"]) == 2
    assert "is not a figure scale" in capsys.readouterr().err


def _fake(mode, story=True):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [2, 1])
    return demo.DemoResult(mode, demo.TITLES[mode], f"{mode} verdict", {"x": 1.0}, story, figure=fig)


def test_a_failed_live_mode_shows_the_recorded_run(tmp_path, monkeypatch):
    monkeypatch.setitem(demo.RUNNERS, "attention", lambda: _fake("attention"))
    lines = []
    (live,) = demo.run_modes(["attention"], record_to=tmp_path / "rec", echo=lines.append)
    assert {p.name for p in (tmp_path / "rec").iterdir()} == {"attention.json", "attention.png", "attention.svg"}
    assert lines[-1] == "attention: attention verdict" and live.machine and live.recorded_at

    def broken():
        raise RuntimeError("rank 1 died")

    monkeypatch.setitem(demo.RUNNERS, "attention", broken)
    lines.clear()
    (shown,) = demo.run_modes(["attention"], fallback=tmp_path / "rec", echo=lines.append)
    assert shown.verdict == "attention verdict" and shown.figure is None and shown.recorded_at == live.recorded_at
    assert "live run failed (RuntimeError: rank 1 died); showing the run recorded" in lines[1]
    lines.clear()  # no fallback: the failure in one line, its log beside the figures, and the next mode runs
    monkeypatch.setitem(demo.RUNNERS, "zero", lambda: _fake("zero"))
    shown = demo.run_modes(["attention", "zero"], out=tmp_path / "out", echo=lines.append)
    assert [r.mode for r in shown] == ["zero"] and lines[-1] == "zero: zero verdict"
    assert lines[1] == (f"attention: FAILED live (RuntimeError: rank 1 died); full log: {tmp_path / 'out' / 'attention.error.txt'}")
    assert "rank 1 died" in (tmp_path / "out" / "attention.error.txt").read_text()
    lines.clear()
    assert demo.run_modes(["attention"], fallback=tmp_path / "nothing", echo=lines.append) == []
    assert lines[1].startswith("attention: FAILED live (RuntimeError: rank 1 died); no recording of it in")
    assert "--record" in lines[1]


def test_a_compiler_dump_is_one_line_and_the_demo_exits_1(tmp_path, monkeypatch, capsys):
    dump = (Path(__file__).parent / "data" / "failures" / "inductor_space.txt").read_text()

    def compile_fails():
        raise RuntimeError(dump)

    monkeypatch.setitem(demo.RUNNERS, "compile", compile_fails)
    monkeypatch.setitem(demo.RUNNERS, "triage", lambda: _fake("triage"))
    assert cli.main(["demo", "compile", "triage", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("compile: FAILED live (RuntimeError: /usr/bin/ld: cannot find -ltorch") and len(out[1]) < 400
    assert out[-1] == "triage: triage verdict" and len(out) == 5  # title, failure, title, figure, verdict


def test_a_story_that_does_not_hold_is_said_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(demo.RUNNERS, "triage", lambda: _fake("triage", story=False))
    assert cli.main(["demo", "triage", "--out", str(tmp_path)]) == 1
    assert "do not tell the lecture's story" in capsys.readouterr().out


def test_figure_scale_sets_font_lines_and_dpi(monkeypatch):
    monkeypatch.setenv(plots.ENV_VAR, "room")
    rc = plots.rc()
    assert rc["font.size"] == 16 and rc["figure.dpi"] == 160 and rc["lines.linewidth"] == pytest.approx(2.4)
    assert plots.rc(1.0)["font.size"] == 10  # scale 1: Matplotlib's defaults
    monkeypatch.setenv(plots.ENV_VAR, "9")
    with pytest.raises(CourseError, match="TERAFLOPS_FIG_SCALE=9 is not a figure scale"):
        plots.scale()


STORY_NUMBERS = {  # numbers that tell each story, and one change each that breaks it
    "attention": ({"naive": {512: 9e6, 1024: 34e6}, "flash": {512: 2e6, 1024: 4e6}, "ratio": 8.5},
                  [("ratio", 2.0), ("flash", {512: 9e6, 1024: 4e6})]),
    "zero": ({"peak_bytes": {"0": 40e6, "1": 20e6, "2": 15e6, "3": 8e6}},
             [("peak_bytes", {"0": 40e6, "1": 20e6, "2": 20e6, "3": 8e6})]),
    "straggler": ({"baseline": {"healthy_idle": 0.05}, "straggler": {"healthy_idle": 0.31}},
                  [("straggler", {"healthy_idle": 0.30}), ("baseline", {"healthy_idle": 0.12})]),
    "compile": ({"step_s_eager": 2e-3, "step_s_compiled": 1.9e-3, "launches_eager": 120, "launches_compiled": 30,
                 "fp32_weight_bytes": 100, "int8_weight_bytes": 29},
                [("step_s_compiled", 2e-3), ("launches_compiled", 120), ("int8_weight_bytes", 30)]),
    "interconnect": ({"busbw_peak": 0.6e9, "busbw_smallest": 0.14e9, "link": 0.61e9, "wrong": 0},
                     [("busbw_peak", 0.61e9), ("busbw_smallest", 0.15e9), ("wrong", 1)]),
    "triage": ({"matched": 3, "workloads": 3}, [("matched", 2)]),
}


@pytest.mark.parametrize("mode", demo.MODES)
def test_each_story_is_decided_on_its_numbers_each_side_of_each_bound(mode):
    numbers, breaks = STORY_NUMBERS[mode]
    assert demo.story_holds(mode, numbers)
    for key, value in breaks:
        assert not demo.story_holds(mode, {**numbers, key: value}), (key, value)
    with pytest.raises(demo.DemoError, match="unknown demo mode 'zer0'"):
        demo.story_holds("zer0", numbers)


@pytest.mark.slow
def test_each_mode_beside_a_hog_ends_in_a_figure_a_sentence_and_its_counted_numbers(hog, tmp_path):
    """The one test here beside real load (two memory-streaming and two matmul processes): each mode runs
    to its end, one figure readable at the room's scale and one sentence, its numbers recorded, and the
    numbers that are counted rather than timed tell the story whatever the load: fused attention's
    allocator peak below naive's, fewer launches compiled, ZeRO 3 < 2 < 1 < 0 per rank (with
    TERAFLOPS_DEMO_ALL=1). Whether a timed story held (compiled faster, a straggler's idle share) is
    reported by the mode's line, which says so when it does not; that rule is tested on given numbers above."""
    from figure_checks import assert_figure_readable

    modes = BESIDE_HOG_ALL if os.environ.get("TERAFLOPS_DEMO_ALL") else BESIDE_HOG
    times = {}
    for mode in modes:
        start = time.perf_counter()
        (r,) = demo.run_modes([mode], out=tmp_path, echo=lambda line: None)
        times[mode] = time.perf_counter() - start
        assert r.story == demo.story_holds(mode, r.numbers)
        assert ("do not tell the lecture's story" in r.line()) is not r.story
        assert (tmp_path / f"{mode}.png").stat().st_size > 10_000 and "\n" not in r.verdict
        with matplotlib.rc_context(plots.rc("room")):
            assert_figure_readable(r.figure)
    n = demo.recorded("attention", tmp_path).numbers
    assert all(n["flash"][k] < n["naive"][k] for k in n["flash"])
    c = demo.recorded("compile", tmp_path).numbers
    assert c["step_s_compiled"] > 0 and c["step_s_eager"] > 0 and c["launches_compiled"] < c["launches_eager"]
    if "zero" in modes:
        z = demo.recorded("zero", tmp_path).numbers["peak_bytes"]
        assert z["3"] < z["2"] < z["1"] < z["0"]
    print("beside the hog:", ", ".join(f"{m} {t:.0f} s" for m, t in times.items()))
