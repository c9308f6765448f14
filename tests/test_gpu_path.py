"""The findings on the GPU path, each checked without a GPU: what a rank builds and holds at
the GPU preset's sizes (measured under FakeTensorMode), the plans the notebooks build on a 2-GPU box,
and the environments a real cluster would get."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import nbformat
import pytest
import torch

from teraflops import machine, sizing
from teraflops.launch import placement
from teraflops.machine import GPU, Machine
from teraflops.memory import fake_memory
from teraflops.models import lm_loss
from teraflops.orchestration import stragglers
from teraflops.orchestration.detection import MIN_RANKS
from teraflops.workers import common
from teraflops.workers import straggler as straggler_worker

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
TWO_H100 = Machine("cuda", tuple(GPU(i, "NVIDIA H100 80GB HBM3", 79 * GiB, (9, 0)) for i in range(2)), cpu_cores=16)


def fake_rows(cfg, rows):
    """Token rows ``(inputs, targets)`` as fake tensors (inside :func:`fake_memory`)."""
    return torch.zeros(rows, cfg.seq_len, dtype=torch.int64), torch.zeros(rows, cfg.seq_len, dtype=torch.int64)


def test_held_out_evaluation_holds_one_micro_batch_of_logits_on_8_ranks():
    """The one-pass evaluation of 8 ranks × 8 held-out batches × 8 sequences held ~138 GB of logits and
    log-softmax at the GPU preset; in micro-batches it holds what a training step's logits hold."""
    p = sizing.PRESETS["gpu"]
    cfg = sizing.gpt_config(p, p.straggler.micro_batch, p.straggler.lr)
    world, steps = 8, 2
    with fake_memory() as mem:
        model = common.build_model(cfg)
        data = fake_rows(cfg, (steps + cfg.eval_batches) * world * cfg.micro_batch)
        base = mem.reset_peak()
        common.held_out_loss(model, data, cfg, steps, world, "cpu")
        chunked = mem.peak - base
        base = mem.reset_peak()
        x, y = common.held_out(data, cfg, steps, world)
        with torch.no_grad():
            lm_loss(model(x), y)  # what the workers did before
        one_pass = mem.peak - base
    logits = cfg.micro_batch * cfg.seq_len * cfg.vocab * 4
    assert one_pass > 100e9, f"the one-pass evaluation measured {one_pass / 1e9:.0f} GB"
    assert chunked < 3 * logits, f"chunked evaluation held {chunked / 1e9:.1f} GB, {chunked / logits:.1f} micro-batches of logits"


def test_held_out_loss_in_chunks_is_the_mean_over_all_rows():
    cfg = sizing.gpt_config(sizing.PRESETS["tiny"], 2, 0.1)
    data = common.make_data(cfg, 3, 2)
    model = common.build_model(cfg)
    x, y = common.held_out(data, cfg, 3, 2)
    with torch.no_grad():
        whole = lm_loss(model(x), y).item()
    assert common.held_out_loss(model, data, cfg, 3, 2, "cpu").item() == pytest.approx(whole, rel=1e-5)


class _Made:
    pass


@pytest.mark.parametrize("interleave, most", [(True, 3), (False, 1)])
def test_straggler_settings_are_built_one_at_a_time_unless_they_take_turns(monkeypatch, interleave, most):
    alive, peak = weakref.WeakSet(), []

    class Fake(_Made):
        t, total, warmup = 0, 2, 0

        def step(self):
            self.t += 1

        def result(self):
            return self.t

    def make():
        gc.collect()
        s = Fake()
        alive.add(s)
        peak.append(len(alive))
        return s

    monkeypatch.setattr(straggler_worker.dist, "barrier", lambda: None)
    out = straggler_worker.run_settings([make] * 3, lambda: None, interleave)
    assert out == (2, 2, 2) and max(peak) == most


def test_the_straggler_spec_runs_settings_one_at_a_time_on_gpus():
    cpu_plan = stragglers.default_plan(sizing.PRESETS["cpu"])
    four = placement.DataParallelPlan(placement.place(4, machine=Machine("cuda", TWO_H100.gpus * 2, cpu_cores=16)),
                                      sizing.PRESETS["gpu"])
    assert four.placement.on_gpus
    assert stragglers.straggler_spec(cpu_plan).interleave and not stragglers.straggler_spec(four).interleave


def test_notebook_03s_plan_has_the_detectors_three_ranks_on_two_gpus(monkeypatch):
    """On exactly 2 GPUs the plan of notebook 03's first cell must be CPU ranks (3 or more), not 2 NCCL
    ranks: its detection cell raises ``at least 3 ranks`` otherwise."""
    monkeypatch.setattr(machine, "detect", lambda: TWO_H100)
    monkeypatch.setattr(sizing, "detect", lambda: TWO_H100)
    monkeypatch.setattr(placement, "detect", lambda: TWO_H100)
    monkeypatch.setattr(machine, "busy_warning", lambda *a, **k: None)
    cell = next(c.source for c in nbformat.read(ROOT / "notebooks/03_orchestration.ipynb", as_version=4).cells
                if c.cell_type == "code" and "plan =" in c.source)
    scope = {}
    exec(compile(cell, "notebook 03, first cell", "exec"), scope)
    assert scope["plan"].placement.world_size >= MIN_RANKS, scope["plan"].note


def test_a_launch_env_with_cuda_visible_devices_is_refused_not_silently_undone():
    """The rank wrapper puts the placement's GPUs back over the launcher's CUDA_VISIBLE_DEVICES, so an
    ``env=`` one never reached the ranks: it is refused in one line naming the way that works."""
    from teraflops.launch.plan import prepare

    with pytest.raises(placement.PlacementError, match=r"would be undone.*os.environ\['CUDA_VISIBLE_DEVICES'\]"):
        prepare("teraflops.workers.selftest", 2, env={"CUDA_VISIBLE_DEVICES": "1"})


def test_notebook_04_says_a_gpu_launch_is_a_cpu_launch_call():
    """count_launches on CUDA counts the CPU-side launch calls (a CUDA graph replay is one); notebook 04
    said it counts the kernels that ran on the device."""
    text = "\n".join(c.source for c in nbformat.read(ROOT / "notebooks/04_compilation.ipynb", as_version=4).cells
                     if c.cell_type == "markdown")
    assert "counts the kernels that ran on the device" not in text
    assert "launch calls" in text
