"""Decoding token by token: a static KV cache, launches per token, and ``torch.compile``.

Generating text runs the model once per new token, on one token per sequence. Each step reads
every weight and the whole KV cache to do a few FLOPs per byte, and launches one operator (or
kernel) per layer piece: decode is **memory- and overhead-bound**. This module measures both.

* **The model** (:func:`decode_model`): a small :class:`teraflops.models.Llama` (RMSNorm, RoPE,
  SwiGLU), whose hand-written glue (six operators per norm, seven per rotation, a gate) is what a
  compiler fuses. Every function here takes *any* model with the cache interface of
  :class:`~teraflops.models.GPT` and :class:`~teraflops.models.Llama`: ``new_cache(batch)``,
  ``forward(tokens, cache=None, input_pos=None)`` and a ``max_seq_len`` attribute.
* **Static KV cache** (:class:`teraflops.models.KVCache`, the pytorch-labs/gpt-fast pattern): per
  layer, keys and values preallocated as ``(batch, heads, max_seq_len, head_dim)``, written at the
  current position with ``index_copy_``; attention runs over the whole cache with a boolean mask
  ``position ≤ input_pos``. Every decode step has the same shapes, so a compiled step is compiled
  once, not once per token, and can be captured as a CUDA graph.
* **Launches per token** (:func:`launches_per_token`): what ``torch.profiler`` records for one
  decode step (see that function for exactly what is counted).
* **torch.compile** (:func:`compile_decode`): eager vs compiled launches, tokens/s, compile time.
* **Batch sweep** (:func:`batch_sweep`): ms per step is flat at small batch (weights are read once
  per step whatever the batch), so tokens/s grows with the batch for free until compute catches up.
  Bytes per step: :func:`decode_bytes_per_step`; bandwidth utilisation = bytes/step × steps/s ÷ the
  measured copy bandwidth (:func:`teraflops.ceilings.measure_copy_bandwidth`).
* **Pitfalls** (:func:`graph_break_demo`, :func:`recompile_demo`): a graph break from ``.item()``,
  seen with ``torch._dynamo.explain``, and recompilation on a new shape, seen with dynamo's
  ``recompiles`` log and counters.

Shapes: prompts are int64 ``(batch, prompt_len)``; a decode step takes ``token`` int64
``(batch, 1)`` and ``input_pos`` int64 ``(1,)`` and returns logits float ``(batch, vocab)``.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from teraflops.ceilings import measure_copy_bandwidth
from teraflops.errors import CourseError, ShapeError
from teraflops.model_definition import attention
from teraflops.model_definition.profiling import METADATA_OPS
from teraflops.models import KVCache, Llama
from teraflops.sizing import preset
from teraflops.tables import table
from teraflops.timing import benchmark

# Any nn.Module with ``max_seq_len``, ``new_cache(batch, max_seq_len=None, dtype=None) -> KVCache`` and
# ``forward(tokens, cache=None, input_pos=None) -> logits``: models.GPT and models.Llama.
Model = nn.Module
StepFn = Callable[[Model, KVCache, torch.Tensor, torch.Tensor], torch.Tensor]


def decode_model(p=None, dtype: torch.dtype | None = None, seed: int = 0) -> Llama:
    """The Unit 4 decode model: a :class:`~teraflops.models.Llama` of the preset's ``decode``
    sizes (default :func:`teraflops.sizing.preset`), in eval mode, on the preset's device, in
    ``dtype`` (default the preset's ``dtype``); weights from ``seed``."""
    p = p or preset()
    model = Llama(p.decode.vocab, p.decode.d_model, p.decode.layers, p.decode.heads, p.decode.max_seq_len,
                  seed=seed)
    return model.to(device=p.device, dtype=dtype or p.dtype).eval()


def _device(model: Model) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------------------------
# Prefill, one decode step, greedy generation
# ----------------------------------------------------------------------------------------------

def on_model_device(model: Model, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` on the device of ``model``'s parameters (moved if elsewhere, e.g. a prompt made
    with ``torch.randint`` on the CPU for a model on a GPU): the model's device decides, since the
    embedding, the KV cache and the positions all live there."""
    device = _device(model)
    return tokens if tokens.device == device else tokens.to(device)


def prefill(model: Model, cache: KVCache, prompt: torch.Tensor) -> torch.Tensor:
    """Run the whole prompt ``(batch, P)`` int64 at positions ``0..P-1``, filling ``cache``; return
    the logits of the last position, float ``(batch, vocab)``. The prompt and the positions are
    put on the model's device (:func:`on_model_device`)."""
    prompt = on_model_device(model, prompt)
    pos = torch.arange(prompt.shape[1], device=prompt.device)
    return model(prompt, cache=cache, input_pos=pos)[:, -1]


def decode_step(model: Model, cache: KVCache, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One decode step: ``token`` int64 ``(batch, 1)`` at position ``input_pos`` int64 ``(1,)``;
    writes its keys/values into ``cache`` and returns the next-token logits float ``(batch, vocab)``.
    The eager step; :func:`compile_decode` compiles this same function."""
    return model(token, cache=cache, input_pos=input_pos)[:, -1]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_prompt(model: Model, prompt, new_tokens: int, cache: KVCache | None = None) -> None:
    """Raise a one-line :class:`CourseError` / :class:`ShapeError` unless ``prompt`` is int64
    ``(batch, P)`` with ``P ≥ 1`` and ``P + new_tokens ≤`` the cache's (or model's) ``max_seq_len``."""
    if not isinstance(prompt, torch.Tensor):
        raise CourseError(f"prompt must be a torch.Tensor of token ids, got {type(prompt).__name__}. "
                          "Hint: torch.tensor([[1, 2, 3]])")
    if prompt.dtype != torch.long:
        raise CourseError(f"prompt must hold int64 token ids, got {prompt.dtype}. Hint: prompt.long()")
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ShapeError(f"prompt must have shape (batch, prompt_len ≥ 1), got {tuple(prompt.shape)}. "
                         "Hint: one sequence is prompt[None]")
    if new_tokens < 1:
        raise CourseError(f"new_tokens must be ≥ 1, got {new_tokens}")
    limit = cache.max_seq_len if cache is not None else model.max_seq_len
    if prompt.shape[1] + new_tokens > limit:
        raise ShapeError(f"prompt_len {prompt.shape[1]} + new_tokens {new_tokens} = "
                         f"{prompt.shape[1] + new_tokens} > max_seq_len {limit} of the KV cache. "
                         "Hint: a shorter prompt or fewer new tokens")
    if cache is not None and cache.batch != prompt.shape[0]:
        raise ShapeError(f"the KV cache holds {cache.batch} sequences but the prompt has {prompt.shape[0]}. "
                         "Hint: model.new_cache(prompt.shape[0])")


@dataclass(frozen=True)
class Generation:
    """Result of :func:`generate`.

    Attributes:
        tokens: int64 ``(batch, P + new_tokens)``: the prompt then the generated tokens.
        prefill_seconds: wall time of the prefill (which also yields the first new token).
        step_seconds: wall time of each decode step (``new_tokens - 1`` of them), synchronised.
    """

    tokens: torch.Tensor
    prefill_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (all sequences) per second of decode steps (prefill left out)."""
        n = len(self.step_seconds)
        return self.tokens.shape[0] * n / sum(self.step_seconds) if n else float("nan")


@torch.no_grad()
def generate(model: Model, prompt: torch.Tensor, new_tokens: int, step_fn: StepFn = decode_step,
             cache: KVCache | None = None) -> Generation:
    """Greedy decoding: prefill ``prompt`` (int64 ``(batch, P)``), then ``new_tokens - 1`` calls of
    ``step_fn(model, cache, token, input_pos)``, each taking the argmax of the last logits.

    ``cache`` defaults to a fresh ``model.new_cache(batch)``; a given one is reset first (a compiled
    CUDA-graph step must be called with the cache it was compiled with). The prefill is always
    eager. A prompt on another device than the model (a CPU prompt for a GPU model) is moved to
    the model's device; the returned tokens live there. Raises :class:`ShapeError` /
    :class:`CourseError` for a prompt that is not int64 ``(batch, P)`` or when ``P + new_tokens``
    exceeds the cache length.
    """
    check_prompt(model, prompt, new_tokens, cache)
    prompt = on_model_device(model, prompt)
    if cache is None:
        cache = model.new_cache(prompt.shape[0])
    else:
        cache.reset()
    device = prompt.device
    t0 = time.perf_counter()
    token = prefill(model, cache, prompt).argmax(-1, keepdim=True)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    out, times = [prompt, token], []
    for pos in range(prompt.shape[1], prompt.shape[1] + new_tokens - 1):
        input_pos = torch.tensor([pos], device=device)
        t0 = time.perf_counter()
        token = step_fn(model, cache, token, input_pos).argmax(-1, keepdim=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        out.append(token)
    return Generation(torch.cat(out, dim=1), prefill_s, times)


# ----------------------------------------------------------------------------------------------
# torch.compile of the decode step
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompiledDecode:
    """Result of :func:`compile_decode`.

    Attributes:
        step: the compiled step, same signature as :func:`decode_step`.
        compile_seconds: wall time of the first call (tracing + Inductor codegen + C++/Triton
            compile, or a load from the on-disk caches when warm).
        mode: the ``torch.compile`` mode used (``None`` = default).
        note: one line on the choice (e.g. why CUDA graphs were skipped).
    """

    step: StepFn
    compile_seconds: float
    mode: str | None
    note: str


def compile_decode(model: Model, cache: KVCache, mode: str | None = "auto") -> CompiledDecode:
    """``torch.compile`` :func:`decode_step` and pay the compile up front (one call on ``cache``,
    which is then reset).

    ``mode="auto"``: ``"reduce-overhead"`` (Inductor + CUDA graphs: the whole step is replayed as
    one graph launch) on a GPU, the default mode on a CPU. ``"reduce-overhead"`` asked for on a CPU
    falls back to the default mode: CUDA graphs need a GPU (the ``note`` says so).

    ``dynamic=False``: the step's shapes are static (that is what the static cache is for), so it
    is specialised to ``cache``'s batch; another batch compiles again. On a CPU the kernels are
    built with ``cpp.enable_kernel_profile`` so that :func:`launches_per_token` can see them
    (a ``RECORD_FUNCTION`` per generated kernel; it costs nothing while no profiler runs).
    """
    device = cache.layers[0].k.device if len(cache.layers) else torch.device("cpu")
    on_gpu = device.type == "cuda"
    if mode == "auto":
        mode = "reduce-overhead" if on_gpu else None
    if mode == "reduce-overhead" and not on_gpu:
        mode, note = None, "default mode: 'reduce-overhead' uses CUDA graphs, which need a GPU"
    elif mode == "reduce-overhead":
        note = "reduce-overhead: Inductor kernels captured in a CUDA graph, one replay per token"
    else:
        note = f"mode {mode!r}" if mode else "default mode (Inductor kernels, no CUDA graphs)"
    if on_gpu:
        step = torch.compile(decode_step, mode=mode, dynamic=False)
    elif mode is None:
        step = torch.compile(decode_step, dynamic=False, options={"cpp.enable_kernel_profile": True})
    else:
        step = torch.compile(decode_step, mode=mode, dynamic=False)
    token = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        t0 = time.perf_counter()
        step(model, cache, token, torch.tensor([0], device=device))
        _sync(device)
        seconds = time.perf_counter() - t0
        if mode == "reduce-overhead":  # cudagraph trees record on a later call: pay it here too
            for _ in range(2):
                step(model, cache, token, torch.tensor([0], device=device))
            _sync(device)
            seconds = time.perf_counter() - t0
    cache.reset()
    return CompiledDecode(step, seconds, mode, note)


# ----------------------------------------------------------------------------------------------
# Launches per token (torch.profiler)
# ----------------------------------------------------------------------------------------------

def _is_generated_kernel(name: str) -> bool:
    # Inductor's C++ kernels are named cpp_fused_<ops>_<n> (prefixed graph_<i>_ in the profiler).
    return "cpp_fused" in name or name.startswith("cpp_kernel")


@dataclass(frozen=True)
class Launches:
    """Result of :func:`launches_per_token`: ``total`` launches in one decode step, by name."""

    total: int
    by_name: dict[str, int]
    what: str  # what was counted, in words

    def top(self, n: int = 8) -> list[tuple[str, int]]:
        return sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]


def profile_step(step_fn: StepFn, model: Model, cache: KVCache, warmup: int = 2) -> list:
    """Profile one decode step (``step_fn(model, cache, token, pos)`` at position 0, after ``warmup``
    calls) with ``torch.profiler`` and return its events (``prof.events()``: each has ``.name``,
    ``.cpu_parent`` (the enclosing CPU event or ``None``) and ``.device_type``). CUDA kernels are
    recorded too when the cache lives on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    device = cache.layers[0].k.device if len(cache.layers) else torch.device("cpu")
    token = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
    pos = torch.tensor([0], device=device)
    with torch.no_grad():
        for _ in range(warmup):
            step_fn(model, cache, token, pos)
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step_fn(model, cache, token, pos)
            _sync(device)
    return list(prof.events())


VIEW_OPS = METADATA_OPS  # aten ops that only make a new view of the same memory: no kernel runs


def inside_aten_op(event) -> bool:
    """Whether a profiler event runs inside an ``aten::`` operator: walks up ``.cpu_parent``
    past ``record_function`` ranges (an op inside a range inside an op is still inside it)."""
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


# The CUDA runtime/driver API calls that launch work on the GPU, as torch.profiler (Kineto/CUPTI)
# names its cuda_runtime and cuda_driver events (CUDA Runtime API §"Execution Control" and
# §"Graph Management"; Driver API §"Execution Control" and §"Graph Management").
CUDA_LAUNCH_CALLS = frozenset({
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernelMultiDevice", "cudaGraphLaunch",
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch",
})


def is_launch_call(name: str) -> bool:
    """Whether a profiler event name is a CPU-side CUDA launch call (:data:`CUDA_LAUNCH_CALLS`),
    also under CUPTI's versioned or per-thread-stream names (``cudaLaunchKernel_v7000``,
    ``cudaLaunchKernel_ptsz``, ``cuLaunchKernelEx_ptsz``)."""
    import re

    return re.sub(r"(_v\d+)?(_ptsz|_ptds)?$", "", name) in CUDA_LAUNCH_CALLS


def count_launches(events, device: str = "cpu") -> Launches:
    """Count the launches in profiler ``events`` (from :func:`profile_step`).

    CPU (``device="cpu"``): the *outermost* ``aten::`` operator events (an op called by another op,
    e.g. ``addmm`` inside ``linear``, is part of its caller's launch), leaving out metadata-only ops
    that run no kernel (:data:`VIEW_OPS`: views, transposes), plus Inductor's generated C++ kernels
    (``cpp_fused_*`` events, recorded because :func:`compile_decode` sets
    ``cpp.enable_kernel_profile``). In eager mode every operator is one kernel; in compiled code the
    ``aten::`` events are the extern calls (GEMMs, attention) and each fused kernel counts once,
    however many operators it fuses.

    CUDA (``device="cuda"``): the CPU-side launch calls, i.e. the profiler's ``cuda_runtime`` /
    ``cuda_driver`` events of the launch APIs in :data:`CUDA_LAUNCH_CALLS` (``cudaLaunchKernel``,
    ``cudaLaunchKernelExC``, ``cuLaunchKernel``, ``cuLaunchKernelEx`` (Triton, recent PyTorch),
    cooperative launches, ``cudaGraphLaunch``): what the CPU pays per token. A CUDA graph replay
    is one launch call however many kernels it holds; the kernels that ran on the device are
    counted in ``what``, not in ``total``.
    """
    if hasattr(events, "events") and callable(events.events):  # a torch.profiler.profile: take its events
        events = events.events()
    if device not in ("cpu", "cuda"):
        raise CourseError(f"count_launches: device must be 'cpu' or 'cuda', got {device!r}")
    if events is None or isinstance(events, str) or not hasattr(events, "__iter__"):
        raise CourseError(f"count_launches needs the profiler's events (a list from profile_step, or prof.events()); "
                          f"got {type(events).__name__}")
    events = list(events)
    if events and not all(hasattr(e, "name") and hasattr(e, "cpu_parent") for e in events):
        raise CourseError("count_launches needs profiler FunctionEvents (with .name and .cpu_parent), e.g. from "
                          "profile_step or prof.events(), not prof.key_averages()")
    counts: dict[str, int] = {}
    if device == "cuda":
        kernels = 0
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels += 1
            elif is_launch_call(e.name):
                counts[e.name] = counts.get(e.name, 0) + 1
        what = f"CPU-side CUDA launch calls per step ({kernels} kernels ran on the GPU)"
        return Launches(sum(counts.values()), counts, what)
    for e in events:
        name = e.name
        if _is_generated_kernel(name):
            counts[name] = counts.get(name, 0) + 1
            continue
        if not name.startswith("aten::") or name[6:] in VIEW_OPS:
            continue
        if not inside_aten_op(e):  # outermost aten op
            counts[name] = counts.get(name, 0) + 1
    what = "outermost aten ops (views excluded) + Inductor C++ kernels per step"
    return Launches(sum(counts.values()), counts, what)


def launches_per_token(step_fn: StepFn, model: Model, cache: KVCache, warmup: int = 2) -> Launches:
    """What one decode step launches: :func:`count_launches` of :func:`profile_step` (read
    :func:`count_launches` for exactly what is counted on a CPU and on a GPU)."""
    device = cache.layers[0].k.device if len(cache.layers) else torch.device("cpu")
    return count_launches(profile_step(step_fn, model, cache, warmup), device.type)


# ----------------------------------------------------------------------------------------------
# Speed, bytes, bandwidth, batch sweep
# ----------------------------------------------------------------------------------------------

def step_seconds(step_fn: StepFn, model: Model, cache: KVCache, min_run_time: float = 0.2) -> float:
    """Median seconds of one decode step at position 0 (:func:`teraflops.timing.benchmark`,
    i.e. ``torch.utils.benchmark``; the cache is rewritten at the same position every call, and
    since the cache is static every step costs the same wherever it writes)."""
    device = cache.layers[0].k.device
    token = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
    pos = torch.tensor([0], device=device)
    with torch.no_grad():
        return benchmark(lambda: step_fn(model, cache, token, pos), min_run_time=min_run_time, warmup=2).median


def decode_bytes_per_step(model: Model, cache: KVCache) -> int:
    """Minimum bytes read by one decode step (all sequences of the batch):

    ``s_w · (Ψ − lookup tables) + s_kv · 2 · n_layers · batch · cache_len · d_model``

    Ψ parameters (each tensor once), less the tables only looked up by an ``nn.Embedding``, of
    which a few rows are read (GPT: the position table, ``max_seq_len · d_model``; its token table
    is tied to the head, which reads all of it. Llama: the token table, its head being untied);
    then every key and value of the static cache, all ``cache_len`` positions, since the masked
    attention reads them all (a cache sized to the current length would read ``pos + 1``).
    ``s`` = bytes per element. Activations and the looked-up rows (a few ``batch × d_model``
    vectors) are left out: a lower bound, as in :mod:`teraflops.model_definition.roofline`.
    """
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():  # a table also used by another module (a tied head) is read whole
        if not isinstance(m, nn.Embedding):
            lookup_only -= {id(p) for p in m.parameters(recurse=False)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lookup_only)
    return weights + cache.nbytes


@dataclass(frozen=True)
class BatchRow:
    """One row of :func:`batch_sweep`: times in seconds, bandwidth in bytes/s."""

    batch: int
    step_seconds: float  # per decode step = per token of each sequence
    bytes_per_step: int
    bandwidth: float  # measured copy bandwidth used for the utilisation

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_seconds

    @property
    def achieved_bandwidth(self) -> float:
        """bytes/step × steps/s (bytes/s)."""
        return self.bytes_per_step / self.step_seconds

    @property
    def utilisation(self) -> float:
        """achieved ÷ measured copy bandwidth (0..1, above 1 when the data fits in a cache)."""
        return self.achieved_bandwidth / self.bandwidth


def batch_sweep(model: Model, batches, cache_len: int | None = None, step_fn: StepFn = decode_step,
                bandwidth: float | None = None, min_run_time: float = 0.2) -> list[BatchRow]:
    """Time one decode step for each batch size (a fresh cache of ``cache_len`` positions each).

    ``bandwidth`` (bytes/s): default measured here with a large copy
    (:func:`teraflops.ceilings.measure_copy_bandwidth`, STREAM "Copy" bytes, 128 MiB on a CPU).
    A compiled ``step_fn`` compiles once per batch size (``dynamic=False``; dynamo's recompile
    limit is raised to the number of batch sizes for the sweep, :func:`recompile_limit`). A batch whose cache or
    step runs out of memory ends the sweep with a warning (the rows so far are returned). Each
    batch's cache is freed before the next one is allocated, so the peak is one cache, not two,
    and the batch that runs out of memory is the first whose own cache and step do not fit.
    """
    device = _device(model)
    if bandwidth is None:
        bandwidth = measure_copy_bandwidth(128 * 2**20 if device.type == "cpu" else 2**31, str(device.type))

    batches = list(batches)
    with recompile_limit(len(batches)):
        return _sweep(model, batches, cache_len, step_fn, bandwidth, min_run_time, device)


def recompile_limit(n: int):
    """A context in which dynamo compiles a function for at least ``n`` distinct shapes before
    giving up: ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before PyTorch 2.6),
    default 8, raised to ``n`` inside the context and restored after. Past the limit dynamo stops
    compiling and runs the frame eagerly (with a warning), so a compiled step swept over 9 batch
    sizes at ``dynamic=False`` would time its 9th batch in eager mode. Never lowers the limit."""
    import torch._dynamo.config as cfg

    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(int(n), getattr(cfg, name))})


def _sweep(model, batches, cache_len, step_fn, bandwidth, min_run_time, device):
    rows = []
    for b in batches:
        cache = oom = None  # the previous batch's cache is freed before this one is allocated
        try:
            cache = model.new_cache(int(b), cache_len)
            t = step_seconds(step_fn, model, cache, min_run_time)
            nbytes = decode_bytes_per_step(model, cache)
        except (RuntimeError, MemoryError) as e:
            if not attention.is_oom(e):
                raise
            oom = True
        cache = None
        if oom:  # outside the except: the traceback no longer holds the failed step's tensors
            attention.release_cached_memory(device)
            warnings.warn(f"batch {b}: out of memory (its KV cache alone is {_cache_bytes(model, int(b), cache_len) / 1e9:.3g} "
                          "GB); the sweep stops at the largest batch that fit: the memory ceiling of decode", stacklevel=2)
            break
        rows.append(BatchRow(int(b), t, nbytes, bandwidth))
    return rows


def _cache_bytes(model: Model, batch: int, cache_len: int | None) -> int:
    """Bytes of a static KV cache: 2 (K, V) × n_layers × batch × cache_len × d_model × element size."""
    w = next(model.parameters())
    layers = len(model.blocks)
    d_model = model.tok.embedding_dim
    return 2 * layers * batch * (cache_len or model.max_seq_len) * d_model * w.element_size()


def batch_table(rows: list[BatchRow]) -> str:
    """The sweep as a table: batch, ms/token, tokens/s, MB read per step, GB/s, % of copy bandwidth."""
    return table([(r.batch, r.step_seconds * 1e3, r.tokens_per_s, r.bytes_per_step / 1e6,
                   r.achieved_bandwidth / 1e9, 100 * r.utilisation) for r in rows],
                 ["batch", "ms/step", "tokens/s", "MB read/step", "GB/s", "% of copy bw"])


def plot_batch_sweep(rows: list[BatchRow]):
    """Two panels against the batch size (log 2 axis), from :func:`batch_sweep`'s rows: ms per
    decode step (measured; dashed, the batch-1 time as a reference: a flat line means the extra
    sequences came for free), and tokens/s (measured; dashed, ``batch ÷ batch-1 time``, the
    throughput if the step time stayed flat). Returns the Figure."""
    import matplotlib.pyplot as plt

    b = [r.batch for r in rows]
    ms = [r.step_seconds * 1e3 for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(b, ms, "o-", label="measured")
    ax1.axhline(ms[0], color="grey", linestyle="--", linewidth=0.8, label="batch-1 time")
    ax1.set(xscale="log", xlabel="batch (sequences decoded together)", ylabel="ms per decode step",
            ylim=(0, None), title="Time per decode step vs batch")
    ax2.plot(b, [r.tokens_per_s for r in rows], "o-", label="measured")
    ax2.plot(b, [x / rows[0].step_seconds for x in b], "--", color="grey", linewidth=0.8,
             label="if the step stayed at its batch-1 time")
    ax2.set(xscale="log", yscale="log", xlabel="batch (sequences decoded together)", ylabel="tokens/s (all sequences)",
            title="Throughput vs batch")
    for ax in (ax1, ax2):
        ax.set_xticks(b, [str(x) for x in b])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", frameon=False)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Pitfalls: graph breaks and recompilation
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphBreaks:
    """From ``torch._dynamo.explain``: graphs compiled, breaks between them, and why."""

    graph_count: int
    graph_break_count: int
    op_count: int
    reasons: list[str]


def step_with_eos_check(model: Model, cache: KVCache, token: torch.Tensor, input_pos: torch.Tensor,
                        eos: int = 0) -> torch.Tensor:
    """A decode step returning log-probabilities ``(batch, vocab)``, with a classic mistake: an
    end-of-sequence test ``next_token.item() == eos`` inside the step. ``.item()`` copies a value
    to Python, which dynamo cannot trace: the graph breaks there and the step runs as two graphs
    with Python in between."""
    logits = decode_step(model, cache, token, input_pos)
    finished = logits[0].argmax().item() == eos  # data-dependent: graph break
    logp = torch.log_softmax(logits, dim=-1)
    return logp if not finished else logp.clone()


def graph_break_demo(model: Model, cache: KVCache, step_fn=step_with_eos_check) -> GraphBreaks:
    """Run ``torch._dynamo.explain`` on one decode step and report graphs, breaks and reasons
    (the cache is reset afterwards). Nothing is compiled by Inductor: explain only traces."""
    device = cache.layers[0].k.device
    token = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch._dynamo.explain(step_fn)(model, cache, token, torch.tensor([0], device=device))
    cache.reset()
    reasons = [str(getattr(r, "reason", r)).strip().splitlines()[0] for r in out.break_reasons]
    return GraphBreaks(out.graph_count, out.graph_break_count, out.op_count, reasons)


@dataclass(frozen=True)
class Recompiles:
    """From :func:`recompile_demo`: ``compiles`` graphs compiled for ``calls`` calls, one line per
    recompilation from dynamo's ``recompiles`` log (which guard failed)."""

    dynamic: bool | None
    seq_lens: tuple[int, ...]
    compiles: int
    reasons: list[str]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _newest_failure(message: str) -> str:
    """The guard failure that caused a recompile: dynamo lists one per cached graph, newest first
    ("- 0/1: ... expected 9, actual 10", then "- 0/0: ... expected 8, actual 10"); the first is the
    graph the call last ran, the one whose guard the new shape broke."""
    failures = [ln.strip() for ln in message.splitlines() if ln.strip().startswith("- ")]
    return failures[0] if failures else message.strip().splitlines()[-1].strip()


def _toy_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x @ w, (w.shape[1],)).relu()


def recompile_demo(seq_lens=(8, 9, 10, 11), dynamic: bool | None = False, fn=_toy_forward,
                   width: int = 32) -> Recompiles:
    """Compile ``fn(x, w)`` (default a small matmul + layer norm) and call it on ``x`` of shape
    ``(seq_len, width)`` for each length: the uncached decode pattern, where the input grows by
    one token per step.

    With ``dynamic=False`` every new length fails a shape guard and compiles again (after
    ``torch._dynamo.config.recompile_limit`` of them, dynamo gives up and runs eagerly); with
    ``dynamic=None`` (the default of ``torch.compile``) the second length triggers one recompile
    with a symbolic length, then no more. Counted with ``torch._dynamo.utils.counters`` and
    explained by the ``recompiles`` log (``TORCH_LOGS=recompiles``; ``torch._logging.set_logs``).
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    handler = _Capture()
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    try:
        compiled = torch.compile(fn, dynamic=dynamic)
        w = torch.randn(width, width)
        for n in seq_lens:
            compiled(torch.randn(n, width), w)
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    compiles = int(counters["stats"]["unique_graphs"])
    reasons = [_newest_failure(line) for line in handler.lines]
    return Recompiles(dynamic, tuple(seq_lens), compiles, reasons)
