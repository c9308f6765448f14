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
  was allocated before the profiling started"), and the free of one it does know (a block
  allocated under an earlier profiler) is skipped unless the region allocated a block of that size
  still live (the records carry sizes, not addresses), so a region that frees earlier tensors is not
  credited for them: the CPU figure is then an upper bound on the rise above what was live before; it does not count memory of other allocators, e.g. the NumPy
  arrays the Triton interpreter uses for a kernel's tiles, which stand in for on-chip SRAM on a
  GPU and should not count as "HBM" traffic anyway.

* Without any memory: :func:`fake_memory` runs a region under torch's ``FakeTensorMode``
  (``torch._subclasses.fake_tensor``: tensors with shapes, dtypes and strides but no data) and a
  dispatch mode that adds each new storage's bytes when an operator returns it and subtracts them
  when its last reference dies (``weakref.finalize``): the live bytes the caching allocator would
  hand out, at any size, on a machine that has a fraction of them. Memory the allocator rounds up
  (512-byte blocks) and its reserved-but-free segments are not counted; the CUDA context and
  NCCL's buffers are outside torch's tensors altogether (:mod:`teraflops.gpu_fit` keeps a reserve
  for them). A CPU build of torch cannot run autograd on fake ``cuda`` tensors, so the region's
  tensors are fake CPU tensors: the bytes are the same, and the kernels that decide what is saved
  for backward are the fused ones too (scaled-dot-product attention keeps its log-sum-exp, not
  the ``N x N`` scores, on both).

Bytes are reported as integers; the notebooks print MiB (2**20) or GiB (2**30).
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from teraflops.errors import CourseError


def _cpu_peak(fn: Callable[[], object]) -> tuple[int, object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # by time only: records stamped alike keep the profiler's order (an allocation before its own free)
    records = sorted(
        ((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda r: r[0],
    )
    # A free is the region's own only if the region allocated a block of that size still live: the
    # allocator reports the free of any block it knows the size of, also one a tensor made before the
    # region held (allocated under an earlier profiler), and the records carry no address to match on.
    live: Counter[int] = Counter()
    level = peak = 0
    for _, nbytes in records:
        if nbytes < 0:
            if live[-nbytes] == 0:
                continue
            live[-nbytes] -= 1
        else:
            live[nbytes] += 1
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


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages the operators inside it create (module docstring).

    Attributes:
        live: bytes of the storages alive now.
        peak: the most bytes alive at once since entry or the last :meth:`reset_peak`.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> int:
        """Start a new peak from what is live now; returns ``live``."""
        self.peak = self.live
        return self.live

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._track(t)
        return out


@contextmanager
def fake_memory() -> Iterator[LiveBytes]:
    """A region whose tensors take no memory, and a :class:`LiveBytes` counting what they would take::

        with fake_memory() as mem:
            model = GPT(...)                       # 541 MB of fp32 weights, counted, none allocated
            base = mem.reset_peak()
            model(tokens).sum().backward()
            activations_and_grads = mem.peak - base

    Tensors made before the region cannot enter it (FakeTensorMode refuses real inputs). Objects
    that keep tensors alive past the region (a returned model) stop being counted when it ends.
    """
    gc.collect()
    with FakeTensorMode(), LiveBytes() as mem:
        yield mem
        gc.collect()
