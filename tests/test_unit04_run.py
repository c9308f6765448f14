"""`teraflops run 4` on this machine: decode launches, compiled vs eager, int8 bytes."""

import math
from pathlib import Path

import pytest

from teraflops import detect
from teraflops.course.runner import format_summary, run_units
from teraflops.course.stories import STATUSES, STORIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_4_reports_launches_tokens_per_s_and_int8_bytes(tmp_path, lecture_out, monkeypatch):
    # a cold compile cache, as on a fresh install: the lecture compiles what it uses
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    (result,) = run_units([4], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert result.headline["tokens_per_s_eager"]["unit"] == "tokens/s" and result.headline["int8_weight_bytes"]["unit"] == "MB"
    assert h["launches_eager"] >= 3 * h["launches_compiled"] > 0  # counted by the profiler, not timed
    assert h["tokens_per_s_eager"] > 0 and h["tokens_per_s_compiled"] > 0
    assert h["int8_weight_bytes"] <= 0.27 * h["fp32_weight_bytes"]
    assert [s.name for s in result.stories] == [s.name for s in STORIES[4]]
    assert all(s.status in STATUSES for s in result.stories)
    summary = format_summary(detect(), [result])
    assert "launches" in summary and "tokens/s" in summary and "int8" in summary
    assert all(s.line() in summary for s in result.stories)
