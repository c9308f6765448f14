"""`teraflops run 3` on this machine: the straggler measured, recovered from, and scheduled around."""

import math
import re
from pathlib import Path

import nbformat
import pytest

from teraflops import detect
from teraflops.nodes import slurm
from teraflops.nodes.cluster import unavailable
from teraflops.course.runner import format_summary, run_units
from teraflops.course.stories import CANT_TELL, STATUSES, STORIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a hang guard, not a budget: the unit starts Slurm clusters and a 3-node Ray cluster
def test_run_unit_3_reports_idle_time_and_tells_its_stories(lecture_out):
    # Ray's cell (start, kill, shrink, regrow) took 593 s at load 12: twice the runner's default per cell
    (result,) = run_units([3], out_dir=lecture_out, root=ROOT, timeout_per_cell=1200)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert result.headline["idle_at_max_delay"]["unit"] == "%" and result.headline["elastic_time_lost"]["unit"] == "s"
    assert 0 <= h["idle_at_max_delay"] <= 100 and 0 <= h["idle_predicted"] <= 100  # fractions of a step
    assert h["elastic_time_lost"] > 0  # a killed rank costs the work since the last checkpoint
    assert h["backfill_utilisation"] > h["fifo_utilisation"]  # the simulated queue: the same jobs, no clock
    assert 0 <= h["straggler_runs_caught"] <= h["straggler_runs_injected"] and h["straggler_false_flags"] >= 0
    assert [s.name for s in result.stories] == [s.name for s in STORIES[3]]
    assert all(s.status in STATUSES for s in result.stories)
    if unavailable() is not None:  # the emulated-node section skipped: its stories cannot tell, and say why
        assert all(s.status == CANT_TELL and "measurement missing" in s.why for s in result.stories
                   if s.name.startswith(("slow_link", "slow_compute", "ray_", "pg_")))
    summary = format_summary(detect(), [result])
    assert "healthy ranks idle at" in summary and "%" in summary
    assert all(s.line() in summary for s in result.stories)
    out = "\n".join(o.get("text", "") for c in nbformat.read(result.executed, as_version=4).cells
                    if c.cell_type == "code" for o in c.get("outputs", []))
    if unavailable() is None and slurm.unavailable(accounting=True) is None:  # the real Slurm section ran
        # start orders and accounting, not start times: Slurm's decisions, whatever the load
        jumped = re.search(r"^Slurm backfill started jobs \[(.*)\] ahead of the blocked head job (\d+)$", out, re.M)
        assert jumped and jumped.group(1), "backfill started no job ahead of the blocked head job on Slurm"
        assert "Slurm FIFO started none ahead of it: True" in out
        assert re.findall(r"^(fifo|backfill): Slurm's start order matches the simulation's: True", out, re.M) == \
            ["fifo", "backfill"], "Slurm's start order differs from the simulation's (the lecture should explain it)"
        fair = re.search(r"^(\w+)'s job started first though submitted after (\w+)'s: (True|False)$", out, re.M)
        assert fair and fair.group(3) == "True", "fair share did not run the light account's job first on Slurm"
        assert f"the simulation's fair share starts them in the order: ['{fair.group(1)}', '{fair.group(2)}']" in out
        # the history job is charged when it ends (AccountingStorageEnforce=...,limits; without it RawUsage stays 0
        # and the order above still comes out right, from the blocker's usage charged at the restart)
        usage = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(team\w+) +([\d.]+) +[\d.]+ +[\d.]+ +\d", out, re.M)}
        assert usage.get(fair.group(2), 0) > 0 == usage.get(fair.group(1)), f"usage after the history job: {usage}"
        stranded = re.search(r"^fifo: utilisation .* GPUs stranded by fragmentation ([\d.]+) vs", out, re.M)
        assert stranded and float(stranded.group(1)) > 0, "FIFO stranded no GPU on Slurm"
