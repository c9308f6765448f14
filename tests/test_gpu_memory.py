"""Every GPU-preset workload's memory per rank, measured without a GPU (FakeTensorMode) for a
T4, a 24 GB card, an H100 and an H200 with 1, 2 and 8 GPUs, within gpu_fit's model and budget; the
table in docs/gpu_memory.md is the one the code computes. Several minutes on 2 cores (the GPT steps
run as fake tensors): slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from teraflops import gpu_fit, machine, sizing
from teraflops.course import gpu_memory
from teraflops.hardware.remedies import SETTINGS
from teraflops.orchestration.stragglers import FACTOR, rebalance

DOC = Path(__file__).resolve().parents[1] / "docs" / "gpu_memory.md"


@pytest.fixture(scope="module")
def rows():
    return gpu_memory.table()


@pytest.mark.slow
def test_every_measured_workload_fits_its_model_and_its_budget(rows):
    assert {(r.gpu, r.world) for r in rows} == {(g, w) for g in gpu_memory.GPUS for w in gpu_memory.WORLDS}
    assert {r.workload for r in rows if r.measured is not None} == set(gpu_memory.MEASURED)
    bad = [f"{r.gpu} × {r.world}: {r.workload} measured {r.measured / 1e9:.2f} GB, model {r.model / 1e9:.2f}, "
           f"budget {r.budget / 1e9:.1f}" for r in rows if not r.fits]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_the_documented_table_is_the_computed_one(rows):
    assert DOC.read_text() == gpu_memory.markdown(rows), \
        "docs/gpu_memory.md is stale: python -m teraflops.course.gpu_memory > docs/gpu_memory.md"


def test_the_models_constants_are_the_workers():
    assert gpu_fit.REMEDY_SETTINGS == len(SETTINGS) and gpu_fit.STRAGGLER_FACTOR == FACTOR
    for world in (3, 4, 8):
        sizes = rebalance([1.0] * (world - 1) + [1 / FACTOR], world * 8)
        assert max(sizes) <= gpu_fit.rebalanced_micro_batch(8, world)


def test_the_budget_is_the_free_share_less_the_reserve(monkeypatch):
    g = gpu_memory.GPUS["H100 80 GB"]
    whole = gpu_fit.budget_bytes(g, 1)
    assert whole == int(0.8 * g.memory_bytes) - gpu_fit.CONTEXT_BYTES
    assert gpu_fit.budget_bytes(g, 8) == whole - gpu_fit.nccl_bytes(8)
    busy = machine.GPU(0, g.name, g.memory_bytes, g.capability, free_bytes=g.memory_bytes // 2)
    assert gpu_fit.budget_bytes(busy, 1) < whole * 0.51
    monkeypatch.setenv(gpu_fit.SHARE_ENV, "0.25")
    assert gpu_fit.gpu_share() == 0.25
    quarter = gpu_fit.fit_preset(sizing.PRESETS["gpu"], g, share=0.25)
    assert quarter.decode.fit_batch < gpu_fit.fit_preset(sizing.PRESETS["gpu"], g).decode.fit_batch
    monkeypatch.setenv(gpu_fit.SHARE_ENV, "4")
    with pytest.raises(ValueError, match="TERAFLOPS_GPU_SHARE='4' must be a fraction"):
        gpu_fit.gpu_share()
