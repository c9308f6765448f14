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


def test_a_step_that_runs_out_of_memory_is_a_row_and_the_sweep_goes_on(monkeypatch):
    """On a GPU the plain step at the largest batch can run out of memory (2×T4, batch 32: ~18 GB of
    activations): injected here, it is a row marked ``oom``, the recomputed step of that batch still runs,
    and the fit and the table leave the failed row out."""
    cfg = mp_config(PRESETS["tiny"])
    real = rc.peak_bytes

    def peak(model, tokens):
        if tokens.shape[0] >= 4 and not isinstance(model.blocks[0], rc.Checkpointed):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.00 GiB")
        return real(model, tokens)

    monkeypatch.setattr(rc, "peak_bytes", peak)
    rows = rc.measure(cfg, (1, 2, 4), repeats=1)
    by = {(r["batch"], r["recompute"]): r for r in rows}
    assert len(rows) == 6 and by[(4, False)]["oom"] and by[(4, False)]["peak_bytes"] is None
    assert "out of memory" in by[(4, False)]["error"]
    assert not by[(4, True)]["oom"] and by[(4, True)]["peak_bytes"] > 0 and by[(4, True)]["step_s"] > 0
    assert "out of memory" in rc.recompute_table(rows)
    assert rc.largest_batch(rows, by[(2, False)]["peak_bytes"], False) >= 2  # fitted on batches 1 and 2


def test_on_one_gpu_recomputation_runs_on_the_gpu_though_the_ranks_are_cpu_ranks():
    """One GPU is too few for NCCL ranks, so the data-parallel plan's ranks and preset are the CPU's;
    recomputation's sweep is one process, and runs on the GPU the machine has."""
    from teraflops.launch.placement import data_parallel_plan
    from teraflops.machine import GPU, Machine

    def on(gpus, p="gpu"):
        m = Machine("cuda" if gpus else "cpu", tuple(GPU(i, "NVIDIA H100", 80 << 30, (9, 0)) for i in range(gpus)),
                    cpu_cores=16)
        return data_parallel_plan(PRESETS[p], machine=m)

    one = on(1)
    assert not one.placement.on_gpus and one.preset.device == "cpu"  # CPU ranks, the CPU preset's sizes
    assert one.local_device == "cuda"  # where recompute.measure(..., device=plan.local_device) runs
    assert on(2).local_device == "cuda" and on(2).placement.on_gpus
    assert on(0).local_device == "cpu" and on(1, "cpu").local_device == "cpu"  # no GPU, or the CPU preset asked for
