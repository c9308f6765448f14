"""Problem sizes chosen from the machine, so every notebook runs everywhere.

A notebook asks ``preset()`` for its sizes and never hard-codes one: on a CPU the sizes keep a
lecture under a few minutes (the Triton interpreter runs kernels with NumPy, ~10^4× slower
than a GPU); on a GPU they are large enough to show real behaviour, including naive attention
running out of memory. ``TERAFLOPS_PRESET=cpu|gpu|tiny`` overrides the choice (``tiny`` is for
smoke tests of the notebooks' code paths).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .machine import detect

MiB = 2**20


@dataclass(frozen=True)
class Preset:
    """Sizes for the course's measurements (element counts unless named ``*_bytes``)."""

    name: str
    device: str
    dtype: torch.dtype  # dtype of the roofline and matmul probes
    probe_matmul_n: int
    probe_copy_bytes: int
    matmul_sizes: tuple[int, ...]  # square matmuls on the roofline
    elementwise_numel: int  # add, copy, softmax (rows × 1024 columns) on the roofline
    launch_sizes: tuple[int, ...]  # numel sweep for launch overhead
    attn_batch: int
    attn_heads: int
    attn_head_dim: int
    attn_dtype: torch.dtype  # fp32 on CPU: the Triton interpreter has no bf16
    attn_seq_lens: tuple[int, ...]
    block_d_model: int  # transformer block profiled in Unit 1
    block_heads: int
    block_seq: int
    block_batch: int
    min_run_time: float  # seconds per benchmark() call


PRESETS = {
    "tiny": Preset("tiny", "cpu", torch.float32, 256, 16 * MiB, (32, 256), 1 << 18, (1, 1 << 10, 1 << 16),
                   1, 2, 32, torch.float32, (64, 128), 64, 2, 32, 2, 0.02),
    "cpu": Preset("cpu", "cpu", torch.float32, 1024, 128 * MiB, (16, 64, 256, 1024), 1 << 24,
                  (1, 1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22), 1, 2, 32, torch.float32,
                  (128, 256, 512, 1024), 256, 4, 128, 4, 0.1),
    "gpu": Preset("gpu", "cuda", torch.bfloat16, 8192, 2048 * MiB, (64, 256, 1024, 4096, 8192), 1 << 28,
                  (1, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26), 4, 16, 64, torch.float16,
                  (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536), 2048, 16, 2048, 8, 0.2),
}


def preset(name: str | None = None) -> Preset:
    """The preset for this machine (``"gpu"`` with CUDA, else ``"cpu"``), or the one named.

    Raises:
        ValueError: unknown name (in the argument or ``TERAFLOPS_PRESET``).
    """
    name = name or os.environ.get("TERAFLOPS_PRESET") or ("gpu" if detect().device == "cuda" else "cpu")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    if p.device == "cuda" and detect().device != "cuda":
        raise ValueError(f"preset {name!r} needs a CUDA GPU and none is visible")
    return p
