"""`teraflops run 3` on this machine: the straggler measured, recovered from, and scheduled around."""

import re
from pathlib import Path

import nbformat
import pytest
from budgets import assert_within

from teraflops import detect
from teraflops.nodes import slurm
from teraflops.nodes.cluster import unavailable
from teraflops.course.runner import format_summary, run_units

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_3_reports_idle_time_at_the_largest_delay(lecture_out):
    (result,) = run_units([3], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert 0 < h["idle_at_max_delay"] < 100 and abs(h["idle_at_max_delay"] - h["idle_predicted"]) <= 10
    assert h["backfill_utilisation"] > h["fifo_utilisation"] and h["elastic_time_lost"] > 0
    if detect().device == "cpu":
        assert_within(result, 240, 3)
    summary = format_summary(detect(), [result])
    assert "healthy ranks idle at" in summary and "%" in summary
    out = "\n".join(o.get("text", "") for c in nbformat.read(result.executed, as_version=4).cells
                    if c.cell_type == "code" for o in c.get("outputs", []))
    if unavailable() is None:  # the emulated-node section ran: what the learner read there
        assert "slow link on node(s): [1]" in out, "the pair test did not find node 1's link (5 MB/s vs 50 MB/s)"
        verdict = re.search(r"^slow link: +(.*)$", out, re.M).group(1)
        assert "transfer grew" in verdict and "busy for longer" not in verdict, verdict
        assert "busy for longer" in re.search(r"^slow compute: +(.*)$", out, re.M).group(1)
    if unavailable() is None and slurm.unavailable(accounting=True) is None:  # the real Slurm section ran
        jumped = re.search(r"^Slurm backfill started jobs \[(.*)\] ahead of the blocked head job (\d+)$", out, re.M)
        assert jumped and jumped.group(1), "backfill started no job ahead of the blocked head job on Slurm"
        assert "Slurm FIFO started none ahead of it: True" in out
        bf, ff = map(float, re.search(r"^the head job started ([\d.]+) s after .* backfill, ([\d.]+) s under FIFO",
                                      out, re.M).groups())
        assert bf <= ff + 1.5, f"backfill delayed the head job on Slurm: {bf} s against FIFO's {ff} s"
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
