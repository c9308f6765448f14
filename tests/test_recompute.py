"""Activation recomputation (teraflops.model_definition.recompute): same gradients, less peak memory,
more FLOPs, and the batch that fits a budget."""

import pytest
import torch

from teraflops.model_definition import recompute as rc
from teraflops.models import GPT
from teraflops.sizing import PRESETS, mp_config


def test_checkpointed_blocks_give_the_same_loss_and_gradients():
    torch.manual_seed(0)
    a = GPT(64, 32, 2, 2, 16)
    b = rc.with_recompute(GPT(64, 32, 2, 2, 16))
    b.load_state_dict({k.replace("blocks.0.", "blocks.0.block.").replace("blocks.1.", "blocks.1.block."): v
                       for k, v in a.state_dict().items()})
    tokens = torch.randint(0, 64, (2, 17))
    assert rc.train_step(a, tokens) == pytest.approx(rc.train_step(b, tokens), abs=1e-6)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    assert isinstance(rc.with_recompute(b).blocks[0].block, torch.nn.Module)  # not wrapped twice
    assert not isinstance(b.blocks[0].block, rc.Checkpointed)


def test_recomputation_halves_the_measured_peak_and_adds_a_forward_of_flops():
    cfg = mp_config(PRESETS["tiny"])
    rows = rc.measure(cfg, (2, 4), repeats=1)
    by = {(r["batch"], r["recompute"]): r for r in rows}
    for batch in (2, 4):
        plain, ck = by[(batch, False)], by[(batch, True)]
        assert ck["peak_bytes"] < 0.75 * plain["peak_bytes"]
        assert 1.1 < ck["flops"] / plain["flops"] <= 4 / 3  # one more forward of the blocks, at most
        assert ck["loss"] == pytest.approx(plain["loss"], abs=1e-5)
    assert by[(4, False)]["peak_bytes"] > 1.5 * by[(2, False)]["peak_bytes"]  # activations grow with the batch
    budget = by[(4, False)]["peak_bytes"]
    assert rc.largest_batch(rows, budget, True) > rc.largest_batch(rows, budget, False) >= 3
    assert "× plain" in rc.recompute_table(rows)
    with pytest.raises(rc.RecomputeError, match="two or more"):
        rc.largest_batch(rows[:2], budget, True)
    with pytest.raises(rc.RecomputeError, match="positive ints"):
        rc.measure(cfg, (0,))
