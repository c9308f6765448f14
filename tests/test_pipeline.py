"""Pipeline parallelism (teraflops.parallelization.pipeline): the bubble formula, the stage split, and one
real 2-stage run of GPipe and 1F1B (slow)."""

import pytest
import torch

from teraflops.parallelization import pipeline as pp
from teraflops.sizing import PRESETS, pp_config
from teraflops.workers.common import build_model
from teraflops.workers.pipeline import in_flight


def test_bubble_formula_and_its_errors():
    assert pp.bubble_fraction(2, 1) == 0.5 and pp.bubble_fraction(4, 13) == 3 / 16 and pp.bubble_fraction(1, 8) == 0
    with pytest.raises(pp.PipelineError, match="micro_batches must be a positive int"):
        pp.bubble_fraction(2, 0)


def test_stages_chained_compute_the_whole_model():
    cfg = pp_config(PRESETS["tiny"])
    gpt = build_model(cfg)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    stages = [pp.stage_module(gpt, i, 2) for i in range(2)]
    assert [len(s.blocks) for s in stages] == [cfg.layers // 2] * 2
    assert torch.allclose(stages[1](stages[0](x)), gpt(x), atol=1e-6)
    with pytest.raises(pp.PipelineError, match="one stage per block"):
        pp.stage_module(gpt, 0, cfg.layers + 1)


def test_in_flight_counts_forwards_not_yet_backwarded():
    gpipe = [["F", 0, 0, 1], ["F", 1, 1, 2], ["B", 0, 3, 4], ["B", 1, 4, 5]]
    one_f_one_b = [["F", 0, 0, 1], ["B", 0, 1, 2], ["F", 1, 2, 3], ["B", 1, 3, 4]]
    assert in_flight(gpipe) == 2 and in_flight(one_f_one_b) == 1


@pytest.mark.slow
def test_two_stage_bubbles_follow_the_formula_and_1f1b_bounds_memory():
    cfg = pp_config(PRESETS["cpu"])
    rows = pp.run(cfg, 2, micro_batches=(1, 4, 8), steps=1, warmup=1)
    print(pp.bubble_table(rows))
    got = {(r["schedule"], r["m"]): r for r in rows}
    assert "must be greater than or equal" in got[("1f1b", 1)]["refused"]
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            r = got[(schedule, m)]
            assert abs(r["bubble"] - r["theory"]) < 0.15, (schedule, m, r["bubble"], r["theory"])
            assert r["loss_diff"] < 1e-5
        assert got[(schedule, 8)]["bubble"] < got[(schedule, 4)]["bubble"]
    assert got[("gpipe", 8)]["peak_in_flight"] == [8, 8] and max(got[("1f1b", 8)]["peak_in_flight"]) <= 2
