"""Peak memory of a region of code, on GPU and on CPU.

* GPU: PyTorch's caching allocator keeps statistics per device. We reset the peak
  (``torch.cuda.reset_peak_memory_stats``), run the region, and report
  ``torch.cuda.max_memory_allocated() - allocated_before``: the most bytes of tensor memory that
  were allocated at once above what was already live. Memory the allocator reserved but did not
  hand out, and memory outside PyTorch (cuBLAS workspaces created earlier, the CUDA context), is
  not counted. Docs: https://pytorch.org/docs/stable/torch_cuda_memory.html
* CPU: the PyTorch profiler with ``profile_memory=True`` records every allocation and free made
  by PyTorch's CPU allocator, with a timestamp (https://pytorch.org/docs/stable/profiler.html).
  We sum those records in time order and report the highest level they reach: the most bytes
  the region's own allocations held at once. It counts tensor storage created by torch operators
  in the region (including temporaries freed before the region ends). The profiler does not
  record the free of a tensor allocated before the region (it warns "Memory block of unknown size
  was allocated before the profiling started"), so a region that frees earlier tensors is not
  credited for them: the CPU figure is then an upper bound on the rise above what was live before; it does not count memory of other allocators, e.g. the NumPy
  arrays the Triton interpreter uses for a kernel's tiles, which stand in for on-chip SRAM on a
  GPU and should not count as "HBM" traffic anyway.

Bytes are reported as integers; the notebooks print MiB (2**20) or GiB (2**30).
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from teraflops.errors import CourseError


def _cpu_peak(fn: Callable[[], object]) -> tuple[int, object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    level = peak = 0
    for _, nbytes in records:
        level += nbytes
        peak = max(peak, level)
    return peak, result


def _cuda_peak(fn: Callable[[], object], device) -> tuple[int, object]:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before), result


def peak_memory(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[int, object]:
    """Run ``fn()`` once and return ``(peak_bytes, result)``.

    ``peak_bytes`` is the largest amount of tensor memory allocated at once during the call. On a
    GPU it is the rise above what was live before (frees of earlier tensors included); on a CPU
    it counts only the region's own allocations and frees, so a region that frees a tensor made
    before it still counts what it allocates in its place (an upper bound; module docstring).
    ``torch.cuda.OutOfMemoryError`` propagates: catch it to turn an OOM into a data point.

    Raises:
        CourseError: called while a profiler (or another ``peak_memory``) is active; nesting would
            corrupt both measurements.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        raise CourseError("peak_memory cannot run inside another profiler or peak_memory region: "
                          "measure the regions one after the other")
    device = torch.device(device)
    gc.collect()  # free earlier garbage now, not inside the region (it would blur the level)
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    return _cpu_peak(fn)
