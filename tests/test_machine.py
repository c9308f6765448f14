import os

import pytest
import torch

import teraflops
from teraflops import sizing
from teraflops.errors import CourseError


def test_detect_describes_this_machine():
    m = teraflops.detect()
    assert m.cpu_cores >= 1 and m.memory_bytes > 2**30
    assert m.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert m.summary()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU Triton is compiled")
def test_cpu_runs_triton_in_the_interpreter():
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert teraflops.detect().triton == "interpreter"


def test_preset_follows_the_machine_and_can_be_overridden(monkeypatch):
    assert sizing.preset().device == teraflops.detect().device
    monkeypatch.setenv("TERAFLOPS_PRESET", "tiny")
    assert sizing.preset().name == "tiny"
    assert sizing.preset_name() == "tiny"
    monkeypatch.setenv("TERAFLOPS_PRESET", "huge")
    with pytest.raises(CourseError, match="unknown TERAFLOPS_PRESET 'huge'; the presets are tiny, cpu, gpu") as e:
        sizing.preset()
    assert "\n" not in str(e.value)
    with pytest.raises(CourseError, match="unknown preset 'demo'"):
        sizing.preset("demo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU refusal")
def test_gpu_preset_refused_without_gpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        sizing.preset("gpu")


@pytest.mark.gpu
def test_gpu_peak_memory_uses_the_allocator():
    from teraflops.memory import peak_memory

    peak, _ = peak_memory(lambda: torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda"), "cuda")
    assert peak >= 64 * 2**20
