"""Verdicts that hold on a busy machine, or say they cannot tell: the ceilings' trust (load, spread,
quiet figures) and preflight's triage judgment, each on injected readings on both sides of its bound.
No process is started and no clock read: the load and the probe's rates are given."""

import json
import types
from dataclasses import replace

import pytest
import torch

from teraflops import ceilings, machine
from teraflops.ceilings import Ceilings
from teraflops.course import preflight, report_card, runner
from teraflops.model_definition.roofline import NEAR_RIDGE, RooflinePoint


@pytest.fixture
def probes(monkeypatch, tmp_path):
    """Fake probes: the rates each round reads, in the order called; the cache in tmp_path."""
    monkeypatch.setenv("TERAFLOPS_CACHE", str(tmp_path))
    calls = []
    rates = {"flops": iter([]), "copy": iter([])}

    def flops(n, dtype, device, min_run_time=0.3):
        calls.append(("matmul", n))
        return next(rates["flops"])

    def copy(nbytes, device, min_run_time=0.3):
        calls.append(("copy", nbytes))
        return next(rates["copy"])

    monkeypatch.setattr(ceilings, "measure_peak_flops", flops)
    monkeypatch.setattr(ceilings, "measure_copy_bandwidth", copy)
    return types.SimpleNamespace(calls=calls, rates=rates)


def _set(probes, flops, copy, load):
    probes.rates["flops"], probes.rates["copy"] = iter(flops), iter(copy)
    probes.calls.clear()


def test_the_probes_interleave_keep_the_best_and_report_the_spread(probes, monkeypatch):
    monkeypatch.setattr(machine, "busy_load", lambda *a: None)
    _set(probes, [1e11, 3e11, 2e11, 3.2e11, 3e11, 3.1e11], [2e10, 2.5e10, 2.4e10], None)
    c = ceilings.measure_ceilings(256, 1 << 20, torch.float32, "cpu")
    assert [k for k, _ in probes.calls] == ["matmul", "matmul", "copy"] * 3  # interleaved rounds
    assert c.peak_flops == 3.2e11 and c.bandwidth == 2.5e10 and c.trusted and c.load is None
    assert c.spread == pytest.approx(max(1 - 3e11 / 3.2e11, 1 - 2e10 / 2.5e10))
    assert ceilings.quiet_ceilings(torch.float32, "cpu", 256, 1 << 20).peak_flops == 3.2e11  # remembered


def test_on_a_busy_machine_the_quiet_values_are_used_and_labelled(probes, monkeypatch):
    monkeypatch.setattr(machine, "busy_load", lambda *a: None)
    _set(probes, [3e11] * 6, [2.5e10] * 3, None)
    ceilings.measure_ceilings(256, 1 << 20, torch.float32, "cpu")
    monkeypatch.setattr(machine, "busy_load", lambda *a: 6.5)
    _set(probes, [1e11] * 6, [9e9] * 3, 6.5)  # the hog: 0.3x and 0.4x, steady
    c = ceilings.measure_ceilings(256, 1 << 20, torch.float32, "cpu")
    assert (c.peak_flops, c.bandwidth) == (3e11, 2.5e10)
    assert c.source.startswith("quiet values measured on this machine at ")
    assert "the probe now is not trusted (machine busy (load 6.5); it read 33% and 36% of them)" in c.source
    assert c.doubt == "machine busy (load 6.5)" and c.trusted


def test_busy_without_quiet_values_the_ceilings_say_they_are_not_trusted(probes, monkeypatch):
    monkeypatch.setattr(machine, "busy_load", lambda *a: 7.0)
    _set(probes, [1e11] * 6, [9e9] * 3, 7.0)
    c = ceilings.measure_ceilings(256, 1 << 20, torch.float32, "cpu")
    assert not c.trusted and c.load == 7.0 and "at load 7.0" in str(c)
    assert ceilings.quiet_ceilings(torch.float32, "cpu", 256, 1 << 20) is None  # a busy probe is not kept
    assert Ceilings.from_json(json.loads(json.dumps(c.to_json())), "x").load == 7.0


def test_an_intensity_near_the_ridge_reads_near_the_ridge():
    c = Ceilings(1e11, 1e10, torch.float32, "cpu", 1, 1)  # ridge 10 FLOP/byte
    def at(intensity):
        return RooflinePoint("op", intensity * 1e6, 1e6, 1.0)
    assert at(10 * NEAR_RIDGE * 1.01).bound(c) == "compute" and at(10 / NEAR_RIDGE / 1.01).bound(c) == "memory"
    assert at(10).bound(c) == at(11).bound(c) == at(9).bound(c) == "near the ridge"


TRUSTED = Ceilings(1e11, 1e10, torch.float32, "cpu", 256, 1 << 20)


def _triage_says(monkeypatch, verdicts, load, c=TRUSTED):
    monkeypatch.setattr(preflight, "profile", lambda name, tmp: types.SimpleNamespace(trace=name))
    monkeypatch.setattr(preflight, "triage", lambda trace: types.SimpleNamespace(verdict=verdicts[trace], ceilings=c))
    monkeypatch.setattr(machine, "busy_load", lambda *a: load)
    return preflight.run(only=["triage"], progress=False)[0]


WRONG = {"matmul": "compute-bound", "naive_attention": "compute-bound", "decode": "overhead-bound"}
RIGHT = {"matmul": "compute-bound", "naive_attention": "memory-bound", "decode": "overhead-bound"}


def test_preflight_triage_on_a_busy_machine_is_inconclusive_not_failed(monkeypatch):
    r = _triage_says(monkeypatch, WRONG, 6.2)
    assert r.status == "inconclusive" and r.detail.startswith("inconclusive: machine busy (load 6.2): ")
    assert "naive_attention" in r.detail and "??" in preflight.table([r])
    assert _triage_says(monkeypatch, WRONG, None).status == "failed"  # quiet: a wrong verdict fails
    assert _triage_says(monkeypatch, RIGHT, 6.2).status == "passed"  # busy but right: compared, passed


@pytest.mark.parametrize("c, status, says", [
    (replace(TRUSTED, spread=0.3), "inconclusive", "inconclusive: the probe's repeats disagree (spread 30%"),
    (replace(TRUSTED, of_quiet=0.4), "inconclusive", "inconclusive: the probe read 40% of this machine's quiet figures"),
    (replace(TRUSTED, doubt="the probe read 40% of this machine's quiet figures (bound 60%)"), "inconclusive",
     "inconclusive: the probe read 40%"),
    (replace(TRUSTED, of_quiet=0.7), "failed", "triage verdicts"),
])
def test_preflight_triage_against_doubtful_ceilings_is_inconclusive_at_a_load_under_the_bound(monkeypatch, c, status, says):
    """The load average lags (a 1-minute mean): beside work that started seconds ago it reads under the
    busy bound while the probe already reads low. A wrong verdict against ceilings that are not trusted,
    or quiet figures put in place of such a probe, cannot tell; against trusted ones it fails."""
    r = _triage_says(monkeypatch, WRONG, None, c)
    assert r.status == status and r.detail.startswith(says) and "\n" not in r.detail, r.detail
    assert _triage_says(monkeypatch, RIGHT, None, c).status == "passed"


def test_judge_triage_is_the_check_s_outcome_without_running_anything():
    want = {"matmul": "compute", "decode": "overhead"}
    assert preflight.judge_triage(want, {"matmul": "compute-bound", "decode": "overhead-bound"}, 7.0)[0] == 2
    with pytest.raises(preflight.CheckInconclusive, match="machine busy \\(load 7.0\\)"):
        preflight.judge_triage(want, {"matmul": "memory-bound", "decode": "overhead-bound"}, 7.0)
    with pytest.raises(preflight.CheckInconclusive, match="^inconclusive: spread: triage"):
        preflight.judge_triage(want, {"matmul": "memory-bound", "decode": "overhead-bound"}, None, ["spread"])
    with pytest.raises(preflight.CheckFailed, match="^triage verdicts \\{'matmul': 'memory-bound'\\}") as e:
        preflight.judge_triage(want, {"matmul": "memory-bound", "decode": "overhead-bound"}, None)
    assert not isinstance(e.value, preflight.CheckInconclusive)


# ---- the ceilings' trust, on injected readings -----------------------------------------------------

QUIET = Ceilings(237e9, 21e9, torch.float32, "cpu", 1024, 128 << 20, source="quiet values measured on this machine")


def _read(flops, bw, spread=0.0, load=None):
    return Ceilings(flops, bw, torch.float32, "cpu", 1024, 128 << 20, spread=spread, load=load)


@pytest.mark.parametrize("spread, trusted", [(ceilings.SPREAD_LIMIT - 0.001, True), (ceilings.SPREAD_LIMIT, False)])
def test_the_spread_bound_on_each_side(spread, trusted):
    c = _read(2e11, 2e10, spread=spread)
    assert c.trusted is trusted
    assert c.reason == ("" if trusted else f"the probe's repeats disagree (spread {spread:.0%}, bound 25%)")


@pytest.mark.parametrize("of_quiet, trusted", [(ceilings.QUIET_FLOOR + 0.001, True), (ceilings.QUIET_FLOOR - 0.001, False),
                                               (None, True)])
def test_the_quiet_figures_bound_on_each_side(of_quiet, trusted):
    c = replace(_read(2e11, 2e10), of_quiet=of_quiet)
    assert c.trusted is trusted
    assert ("quiet figures" in c.reason) is not trusted and ("not trusted: " in str(c)) is not trusted


def test_the_load_decides_first_and_the_reason_says_so():
    c = replace(_read(2e11, 2e10, spread=0.5, load=6.2), of_quiet=0.3)
    assert not c.trusted and c.reason == "machine busy (load 6.2)"
    assert replace(c, load=None).reason.startswith("the probe's repeats disagree")
    assert replace(c, load=None, spread=0.0).reason.startswith("the probe read 30% of this machine's quiet figures")


@pytest.mark.parametrize("load, busy", [(2.9, None), (3.1, 3.1)])
def test_the_busy_load_bound_is_per_core(monkeypatch, load, busy):
    monkeypatch.setattr(machine, "load_average", lambda: load)
    monkeypatch.setattr(machine, "detect", lambda: machine.Machine("cpu", cpu_cores=2))
    assert machine.busy_load() == busy  # 1.5 per core on 2 cores: 3.0


def test_a_steady_low_probe_under_the_busy_load_is_not_trusted(tmp_path, monkeypatch):
    """The newcomer's first run: at load 2.9 on 2 cores (under the busy bound of 3.0) the probe read
    94.8 GFLOP/s and 8.4 GB/s, steady, 0.4x this machine's quiet figures. The quiet figures are used,
    and ``doubt`` says why; the probe is not remembered."""
    monkeypatch.setenv("TERAFLOPS_CACHE", str(tmp_path))
    low = _read(94.8e9, 8.4e9, spread=0.05)
    assert low.trusted  # alone, nothing says it is low: only the machine's own quiet figures can
    c = ceilings.judged(low, QUIET)
    assert (c.peak_flops, c.bandwidth) == (237e9, 21e9) and c.trusted and c.ridge_point == pytest.approx(237 / 21)
    assert c.doubt == "the probe read 40% of this machine's quiet figures (bound 60%)"
    assert c.source.endswith("; the probe now is not trusted (the probe read 40% of this machine's quiet figures "
                             "(bound 60%); it read 40% and 40% of them)")
    assert ceilings.quiet_ceilings(torch.float32, "cpu", 1024, 128 << 20) is None  # nothing kept
    alone = ceilings.judged(low, None)  # no quiet figures known yet: measured, trusted, remembered
    assert alone is not None and alone.of_quiet is None and alone.trusted
    assert ceilings.quiet_ceilings(torch.float32, "cpu", 1024, 128 << 20).peak_flops == 94.8e9


def test_a_probe_a_little_low_is_trusted_and_the_quiet_figures_keep_the_best(tmp_path, monkeypatch):
    monkeypatch.setenv("TERAFLOPS_CACHE", str(tmp_path))
    ceilings.remember_quiet(QUIET)
    c = ceilings.judged(_read(0.7 * 237e9, 1.05 * 21e9), QUIET)
    assert c.trusted and c.of_quiet == pytest.approx(0.7) and c.peak_flops == pytest.approx(0.7 * 237e9)
    kept = ceilings.quiet_ceilings(torch.float32, "cpu", 1024, 128 << 20)
    assert kept.peak_flops == 237e9 and kept.bandwidth == pytest.approx(1.05 * 21e9)  # each figure's best
    assert kept.of_quiet is None and kept.doubt == ""


def test_trust_travels_with_the_ceilings_file():
    c = replace(_read(1e11, 1e10, spread=0.1), of_quiet=0.5, doubt="x")
    back = Ceilings.from_json(json.loads(json.dumps(c.to_json())), "y")
    assert (back.of_quiet, back.doubt, back.spread, back.trusted) == (0.5, "x", 0.1, False)
    old = {k: v for k, v in c.to_json().items() if k not in ("of_quiet", "doubt")}  # a file written before them
    assert Ceilings.from_json(old, "y").of_quiet is None and Ceilings.from_json(old, "y").doubt == ""


def test_the_run_s_shared_ceilings_are_the_roof_the_points_are_placed_against():
    """Unit 1 raised the run's ceilings to its roofline points (``covering``) and quoted another ridge
    point than the report card: the run's ceilings now come back as they are; others are raised."""
    shared = replace(_read(94.8e9, 8.4e9), source=ceilings.SHARED_SOURCE)
    fast = RooflinePoint("matmul 1024", 2 * 1024**3, 3 * 1024**2 * 4, 2 * 1024**3 / 238e9)
    assert shared.covering([fast]) is shared
    raised = replace(shared, source="measured").covering([fast])
    assert raised.peak_flops == pytest.approx(238e9) and raised.bandwidth == 8.4e9


def test_the_summary_and_the_card_carry_each_units_load_and_stalls(tmp_path):
    stall = runner.CellStall(41, "comm_budget.gradient_sync_widget(fit);", 600.0)
    r = runner.NotebookResult("05_hardware", 719.0, True, stalls=[stall], load={"mean": 5.2, "max": 7.9, "cores": 2})
    text = runner.format_summary(machine.Machine("cpu", cpu_cores=2), [r])
    assert "STALLED: cell 41 `comm_budget.gradient_sync_widget(fit);` waited 600 s" in text
    assert "load 5.2 (max 7.9) on 2 cores" in text
    page = report_card.render(machine.Machine("cpu", cpu_cores=2), [r], references=[],
                              context={"ceilings": {"peak_flops": 1e11, "bandwidth": 1e10, "device": "cpu",
                                                    "dtype": "float32", "load": 6.0, "spread": 0.3}})
    assert "load 5.2 (max 7.9) on 2 cores" in page and "Stalled:" in page and "too busy to trust" in page


