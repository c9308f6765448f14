"""Verdicts that hold on a busy machine, or say they cannot tell (issue 29 items 2-4)."""

import json
import types

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
    assert "busy now (load 6.5, the probe read 33% and 36% of them)" in c.source


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


def _triage_says(monkeypatch, verdicts, load):
    monkeypatch.setattr(preflight, "profile", lambda name, tmp: types.SimpleNamespace(trace=name))
    monkeypatch.setattr(preflight, "triage", lambda trace: types.SimpleNamespace(verdict=verdicts[trace]))
    monkeypatch.setattr(machine, "busy_load", lambda *a: load)
    return preflight.run(only=["triage"], progress=False)[0]


def test_preflight_triage_on_a_busy_machine_is_inconclusive_not_failed(monkeypatch):
    wrong = {"matmul": "compute-bound", "naive_attention": "compute-bound", "decode": "overhead-bound"}
    r = _triage_says(monkeypatch, wrong, 6.2)
    assert r.status == "inconclusive" and r.detail.startswith("inconclusive: machine busy (load 6.2): ")
    assert "naive_attention" in r.detail and "??" in preflight.table([r])
    assert _triage_says(monkeypatch, wrong, None).status == "failed"  # quiet: a wrong verdict fails
    right = {"matmul": "compute-bound", "naive_attention": "memory-bound", "decode": "overhead-bound"}
    assert _triage_says(monkeypatch, right, 6.2).status == "passed"  # busy but right: compared, passed


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


@pytest.mark.slow
def test_preflight_triage_beside_a_hog_is_right_or_inconclusive(hog):
    """Beside other learners' runs: the unit's verdicts, or the inconclusive line; never a wrong verdict."""
    r = preflight.run(only=["triage"], progress=False)[0]
    assert r.status in ("passed", "inconclusive"), r.detail
    if r.status == "inconclusive":
        assert r.detail.startswith("inconclusive: machine busy (load ")
