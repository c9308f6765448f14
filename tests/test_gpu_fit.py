"""The GPU preset fitted to each GPU class: every workload's memory model fits with 20 % headroom,
the intended out-of-memory points stay, and bf16 only where the GPU has bf16 tensor cores."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from teraflops import gpu_fit, sizing
from teraflops.machine import GPU, Machine
from teraflops.models import GPT, Llama

GiB = 2**30
# total memory as torch reports it (a little under the marketing figure), compute capability
CLASSES = {"Tesla T4": (14.75, (7, 5)), "NVIDIA L4": (22.5, (8, 9)), "NVIDIA A10": (22.5, (8, 6)),
           "NVIDIA GeForce RTX 4090": (23.6, (8, 9)), "NVIDIA A100-SXM4-40GB": (39.4, (8, 0)),
           "NVIDIA A100-SXM4-80GB": (79.2, (8, 0)), "NVIDIA H100 80GB HBM3": (79.1, (9, 0)),
           "NVIDIA H200": (139.8, (9, 0)), "NVIDIA H200 (torch's total_memory)": (150.1e9 / GiB, (9, 0))}


def gpu(name: str) -> GPU:
    mem, cap = CLASSES[name]
    return GPU(0, name, int(mem * GiB), cap)


@pytest.mark.parametrize("name", CLASSES)
def test_every_gpu_preset_workload_fits_with_headroom(name):
    g = gpu(name)
    p = gpu_fit.fit_preset(sizing.PRESETS["gpu"], g)
    over = {w: round(b / g.memory_bytes, 2) for w, b in gpu_fit.workload_bytes(p).items()
            if b > 0.8 * g.memory_bytes}
    assert not over, f"{name}: over 80 % of memory: {over}"
    # the decode sweep still ends in one out-of-memory step, as the lecture's memory ceiling
    assert gpu_fit.decode_sweep_bytes(p, p.decode.batches[-1]) > g.memory_bytes
    assert p.decode.fit_batch in p.decode.batches and p.decode.fit_batch < p.decode.batches[-1]
    # and naive attention's N² scores still run out of memory at the sweep's longest N
    n = max(p.attention.seq_lens)
    assert 2 * p.attention.batch * p.attention.heads * n * n * 2 > g.memory_bytes


@pytest.mark.parametrize("name", CLASSES)
def test_bf16_only_on_sm80_and_newer(name):
    p = gpu_fit.fit_preset(sizing.PRESETS["gpu"], gpu(name))
    assert p.dtype == (torch.bfloat16 if CLASSES[name][1] >= (8, 0) else torch.float16)


# what fit_preset may change: the dtype, and per unit's sizes the fields it shrinks
FITTED = {"collective": {"max_bytes"}, "dp": {"micro_batch"}, "straggler": {"micro_batch"}, "comm_gpt": {"d_model"},
          "decode": {"fit_batch", "batches"}}


@pytest.mark.parametrize("name", CLASSES)
def test_the_fit_changes_only_the_sizes_it_fits(name):
    base = sizing.PRESETS["gpu"]
    p = gpu_fit.fit_preset(base, gpu(name))
    assert isinstance(p, sizing.Preset)
    for unit in (f.name for f in dataclasses.fields(base) if f.name != "dtype"):
        was, now = getattr(base, unit), getattr(p, unit)
        assert type(now) is type(was), unit
        if not dataclasses.is_dataclass(was):  # name, device, min_run_time
            assert now == was, unit
            continue
        changed = {f.name for f in dataclasses.fields(was) if getattr(now, f.name) != getattr(was, f.name)}
        assert changed <= FITTED.get(unit, set()), f"{name}: fit_preset changed {unit}.{sorted(changed)}"


def test_the_unfitted_gpu_preset_did_not_fit_a_t4():
    """What the fit is for: the preset written for an H100 plans a 34 GB KV cache."""
    over = {w for w, b in gpu_fit.workload_bytes(sizing.PRESETS["gpu"]).items() if b > 0.8 * gpu("Tesla T4").memory_bytes}
    assert "decode at the largest batch that fits" in over and "stale gradients (τ sweep)" in over


def test_preset_is_fitted_to_the_smallest_visible_gpu(monkeypatch):
    m = Machine("cuda", (GPU(0, "NVIDIA H100 80GB HBM3", 79 * GiB, (9, 0)), GPU(1, "Tesla T4", int(14.75 * GiB), (7, 5))))
    monkeypatch.setattr(sizing, "detect", lambda: m)
    p = sizing.preset("gpu")
    assert p.dtype == torch.float16 and p.decode.fit_batch == gpu_fit.fit_preset(sizing.PRESETS["gpu"],
                                                                                 gpu("Tesla T4")).decode.fit_batch


def test_parameter_counts_are_the_models_own():
    assert gpu_fit.gpt_params(256, 64, 2, 4, 32) == GPT(256, 64, 2, 4, 32).num_params()
    assert gpu_fit.llama_params(256, 64, 2) == Llama(256, 64, 2, 2, 32).num_params()


def test_training_memory_follows_the_cited_formula():
    # 16 B/parameter of fp32 Adam model states, 68·s·b·h per layer, 12·b·s·V for the logits
    assert gpu_fit.training_bytes(10, layers=2, d_model=8, seq_len=4, micro_batch=3, vocab=5) == \
        160 + 68 * 4 * 3 * 8 * 2 + 12 * 3 * 4 * 5


def test_the_decode_sweep_is_sized_in_the_element_size_decode_runs_in():
    """Notebook 04 builds the decode model in fp32: its weights and cache, counted on the meta device at
    that dtype, are what the sweep's memory model says, and its out-of-memory step is the first power of
    two past the whole memory at that size (not at 2-byte elements, which put it one doubling too far)."""
    p = sizing.PRESETS["gpu"]
    d = p.decode
    with torch.device("meta"):
        model = Llama(d.vocab, d.d_model, d.layers, d.heads, d.max_seq_len)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    assert next(model.parameters()).dtype == torch.float32 and gpu_fit.DECODE_ELEM == 4
    cache = 2 * d.layers * 8 * d.max_seq_len * d.d_model * torch.finfo(torch.float32).bits // 8
    assert gpu_fit.decode_sweep_bytes(p, 8) == weights + cache
    h100 = gpu("NVIDIA H100 80GB HBM3")
    fitted = gpu_fit.fit_preset(p, h100)
    over = fitted.decode.batches[-1]
    assert gpu_fit.decode_sweep_bytes(fitted, over // 2) <= h100.memory_bytes < gpu_fit.decode_sweep_bytes(fitted, over)
