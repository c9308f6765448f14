"""Checks for Unit 4 (Compilation & optimization). Each takes the learner's function(s) and nothing else.

Every check compares the learner's answer with the package's reference on cases built here
(:mod:`teraflops.compilation.decode`, :mod:`teraflops.compilation.quantization`, :mod:`teraflops.compilation.batching`) and, on a wrong
answer, tries the plausible wrong versions: a mistake is named only when it reproduces every answer
the learner gave. Exercise 7 is judged by measurement: the learner's queue delay served by the real server
(:mod:`teraflops.compilation.serving`) under perf_analyzer (:mod:`teraflops.compilation.loadgen`), beside
alternatives measured in the same check.
"""

from __future__ import annotations

import math
import numbers
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from teraflops.compilation import loadgen, serving
from teraflops.compilation.batching import BatchingError, dynamic_batch_policy, simulate_server
from teraflops.compilation.decode import (VIEW_OPS, count_launches as reference_launches, decode_model, decode_step,
    inside_aten_op, profile_step)
from teraflops.errors import ExerciseSkipped
from teraflops.model_definition.profiling import count_ops
from teraflops.compilation.quantization import (QMAX, dequantize as reference_dequantize,
    quantize_per_channel as reference_quantize)
from teraflops.sizing import PRESETS
from teraflops.grading.core import (check_cases, exercise, expect_number, expect_tensor, fail, kernel_setting,
    max_error, reveal)


# --- exercise 1: launches per token from a profile ------------------------------------------------

def _event(name: str, parent=None):
    """A stand-in for a profiler FunctionEvent: the fields a counter may read."""
    e = SimpleNamespace(name=name, key=name, cpu_parent=parent, cpu_children=[],
                        device_type=torch.autograd.DeviceType.CPU)
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def _compiled_like_events() -> list:
    """A compiled step as the profiler records it: record_function ranges around Inductor's fused
    kernels and extern aten calls (GEMMs), whose own aten children are inside them."""
    region = _event("Torch-Compiled Region: 0/0")
    graph = _event("CompiledFunction", region)
    events = [region, graph]
    for i in range(3):
        events.append(_event(f"graph_0_cpp_fused_add_mul_rsqrt_{i}", graph))
        mm = _event("aten::mm", graph)
        events += [mm, _event("aten::empty", mm), _event("aten::as_strided", mm)]
    events.append(_event("aten::_scaled_dot_product_flash_attention_for_cpu", graph))
    return events


def _eager_like_events() -> list:
    """Eager operators with nested calls, views and one user range (record_function)."""
    block = _event("## attention ##")
    lin = _event("aten::linear")
    events = [block, lin, _event("aten::t", lin), _event("aten::addmm", lin), _event("aten::view"),
              _event("aten::mul"), _event("aten::add", block)]
    soft = _event("aten::softmax", block)
    events += [soft, _event("aten::_softmax", soft), _event("aten::transpose"), _event("aten::index_copy_", block)]
    sdpa = _event("aten::scaled_dot_product_attention")  # an op whose kernel sits inside a range inside it
    inner = _event("## flash ##", sdpa)
    events += [sdpa, inner, _event("aten::_scaled_dot_product_flash_attention_for_cpu", inner)]
    return events


def _real_events() -> list:
    model = decode_model(PRESETS["tiny"])
    cache = model.new_cache(1)
    return profile_step(decode_step, model, cache, warmup=1)


def _count_all_aten(ev):
    return sum(e.name.startswith("aten::") for e in ev)


def _count_with_views(ev):
    return sum(e.name.startswith("aten::") and not inside_aten_op(e) for e in ev) \
        + sum("cpp_fused" in e.name for e in ev)


def _no_fused(ev):
    return sum(e.name.startswith("aten::") and e.name[6:] not in VIEW_OPS and not inside_aten_op(e) for e in ev)


def _parent_is_none(ev):
    return sum(e.name.startswith("aten::") and e.name[6:] not in VIEW_OPS and e.cpu_parent is None for e in ev) \
        + sum("cpp_fused" in e.name for e in ev)


def _immediate_parent(ev):
    return sum(e.name.startswith("aten::") and e.name[6:] not in VIEW_OPS
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")) for e in ev) \
        + sum("cpp_fused" in e.name for e in ev)


_LAUNCH_MISTAKES = [
    (_count_all_aten, "an operator called by another (addmm inside linear) runs inside its caller's launch: "
                      "count only aten ops with no aten:: event above them, walking up .cpu_parent"),
    (_count_with_views, "views and transposes (VIEW_OPS) only make new metadata; no kernel runs: skip them. "
                        "VIEW_OPS holds names without the 'aten::' prefix: test e.name[len('aten::'):]"),
    (_no_fused, "in compiled code Inductor's fused kernels (names containing 'cpp_fused') are launches too, "
                "each one however many operators it fuses"),
    (_immediate_parent, "an aten op can sit inside a record_function range that is itself inside an aten op: "
                        "keep walking up .cpu_parent to the top, not just one level"),
    (_parent_is_none, "an operator inside a record_function range (a non-aten parent such as "
                      "'Torch-Compiled Region') is still outermost: walk up .cpu_parent and look for an aten:: "
                      "ancestor, not for no parent at all"),
]


@exercise(1, "launches per token from a profile")
def count_launches(fn) -> None:
    """``fn(events) -> int``: launches in one step's CPU profiler events (see
    :func:`teraflops.compilation.decode.count_launches`)."""
    cases = [("an eager-like event list", _eager_like_events()), ("a compiled-like event list", _compiled_like_events()),
             ("a real eager decode step of the tiny Llama", _real_events())]
    answers = []
    for what, events in cases:
        got = fn(list(events))
        if hasattr(got, "total"):  # a Launches
            got = got.total
        got = expect_number("count_launches", got, "a count of launches")
        answers.append((got, reference_launches(events).total, what, events))
    wrong = [a for a in answers if a[0] != a[1]]
    if not wrong:
        return
    got, want, what, _ = wrong[0]
    hint = next((h for m, h in _LAUNCH_MISTAKES if all(m(ev) == g for g, _, _, ev in answers)),
                "count outermost aten:: events (no aten:: ancestor), skip VIEW_OPS, and add every cpp_fused kernel")
    fail(f"on {what} you counted {got:g} launches, expected {want}. Hint: {hint}")


# --- exercise 2: memory-bandwidth utilisation of a decode step -------------------------------------

def _utilisation(weight_bytes, n_layers, d_model, kv_bytes_per_element, batch, cache_len, step_s, bandwidth):
    kv = 2 * n_layers * batch * cache_len * d_model * kv_bytes_per_element
    return (weight_bytes + kv) / step_s / bandwidth


# (weight bytes, layers, d_model, bytes/element, batch, cache_len, step s, bandwidth B/s)
_UTIL_CASES = [
    (14e9, 32, 4096, 2, 1, 4096, 0.0105, 3.35e12),  # a 7B model in bf16 on an H100-class GPU
    (14e9, 32, 4096, 2, 16, 4096, 0.0220, 3.35e12),
    (4.4e6, 4, 256, 4, 8, 256, 0.004, 2.0e10),  # the course's CPU decode model
    (1.2e6, 2, 64, 4, 32, 32, 0.0009, 1.5e10),
]


def _describe_util(c) -> str:
    return (f"weight_bytes={c[0]:g}, n_layers={c[1]}, d_model={c[2]}, kv_bytes_per_element={c[3]}, batch={c[4]}, "
            f"cache_len={c[5]}, step_s={c[6]:g}, bandwidth={c[7]:g}")


@exercise(2, "memory-bandwidth utilisation of decode")
def bandwidth_utilisation(fn) -> None:
    """``fn(weight_bytes, n_layers, d_model, kv_bytes_per_element, batch, cache_len, step_s, bandwidth)``
    → fraction of ``bandwidth`` (bytes/s) used by one decode step of ``step_s`` seconds."""
    def ref(*c):
        return _utilisation(*c)

    def holds(formula):
        return lambda got, want, case: abs(got - formula(*case)) <= 1e-6 * abs(formula(*case))

    mistakes = [
        (holds(lambda w, L, d, e, b, t, s, bw: (w * b + 2 * L * b * t * d * e) / s / bw),
         "the weights are read once per step for the whole batch, not once per sequence: do not multiply them by batch"),
        (holds(lambda w, L, d, e, b, t, s, bw: (w + L * b * t * d * e) / s / bw),
         "the cache holds keys AND values: 2 × n_layers × batch × cache_len × d_model elements"),
        (holds(lambda w, L, d, e, b, t, s, bw: w / s / bw),
         "a decode step also reads the whole KV cache: 2 × n_layers × batch × cache_len × d_model × bytes/element"),
        (holds(lambda *c: 100 * _utilisation(*c)), "return a fraction (0.42), not a percentage"),
        (holds(lambda *c: _utilisation(*c) * c[4]),
         "bytes per step × steps per second: one step serves the whole batch, so do not multiply by the batch"),
        (holds(lambda *c: 1 / _utilisation(*c)), "utilisation = achieved bandwidth ÷ the machine's bandwidth"),
    ]
    check_cases(fn, "bandwidth_utilisation", "a fraction of the bandwidth", _UTIL_CASES, ref, mistakes,
                "bytes per step = weight bytes + 2·n_layers·batch·cache_len·d_model·bytes/element; "
                "utilisation = bytes per step ÷ step seconds ÷ bandwidth",
                _describe_util, lambda g, w: f"got {g:.6g}, expected {w:.6g}")


# --- exercise 3: a fused SiLU·mul kernel in Triton ------------------------------------------------

_KERNEL_HINTS = {
    "must be Tensor, not tensor": "inside a @triton.jit kernel use triton.language (tl.load, tl.sigmoid), not torch",
    "pointer": "load with tl.load(A + offsets, mask=mask) and store with tl.store(OUT + offsets, out, mask=mask)",
    "ptr": "tl.store(pointer, value, mask=...): the pointer (OUT + offsets) comes first, then the value",
}
_TORCH_MATH = {"silu", "sigmoid", "mul", "mul_", "exp", "div", "neg", "reciprocal", "add"}
_PAD = 8192  # elements of guard space after every tensor the check hands over or the learner allocates
_SENTINEL = 12345.0  # what the guard space holds (representable in fp16); anything else there was stored


class _Guarded(torch.overrides.TorchFunctionMode):
    """Give every ``torch.empty_like``/``zeros_like``/``empty``/``zeros`` result ``_PAD`` elements of
    guard space after it (holding ``_SENTINEL``), so that a kernel storing past the end writes into the guard (which the
    check then inspects) instead of corrupting the heap, which kills the process under Triton's
    interpreter and faults on a GPU."""

    def __init__(self):
        super().__init__()
        self.guards: list[torch.Tensor] = []

    def guarded(self, shape, dtype, device, fill=None) -> torch.Tensor:
        n = math.prod(shape)
        flat = torch.full((n + _PAD,), _SENTINEL, dtype=dtype, device=device)  # (inside its handler a mode is off)
        if fill is not None:
            flat[:n] = fill.reshape(-1) if isinstance(fill, torch.Tensor) else fill
        self.guards.append(flat[n:])
        return flat[:n].view(shape)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.empty_like, torch.zeros_like) and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            return self.guarded(tuple(t.shape), kwargs.get("dtype") or t.dtype, kwargs.get("device") or t.device,
                                0 if func is torch.zeros_like else None)
        if func in (torch.empty, torch.zeros) and args:
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)
            return self.guarded(shape, kwargs.get("dtype") or torch.get_default_dtype(), kwargs.get("device") or "cpu",
                                0 if func is torch.zeros else None)
        return func(*args, **kwargs)

    def overrun(self) -> bool:
        return any(bool((g.float() != _SENTINEL).any()) for g in self.guards)


@exercise(3, "a fused SiLU·mul kernel in Triton")
def silu_mul(fn) -> None:
    """``fn(a, b) -> silu(a) * b`` computed by the learner's Triton kernel, same shape and dtype.

    fp32 within 1e-5 under the interpreter (CPU); fp16 on a GPU within 2e-3 × (1 + |silu(a)·b|)
    (fp16 keeps about 3 significant digits). Inputs and outputs carry guard space after them, so a
    store past the end is reported, not a crash.
    """
    device, dtype, tol = kernel_setting()
    g = torch.Generator().manual_seed(0)
    for shape in [(4, 256), (3, 1000), (7,)]:  # 3000 and 7 elements: not a multiple of any block size
        guard = _Guarded()
        a = guard.guarded(shape, dtype, device, (torch.randn(shape, generator=g) * 3).to(device, dtype))
        b = guard.guarded(shape, dtype, device, torch.randn(shape, generator=g).to(device, dtype))
        with guard:
            fn(a, b)  # the first call compiles; compilation may run torch ops of its own
            ops = count_ops(lambda: fn(a, b))
        torch_math = sorted(op for op in ops if op in _TORCH_MATH)
        if torch_math:
            fail(f"the math ran in PyTorch ({', '.join(torch_math)}), not in your kernel: silu_mul should only "
                 "allocate the output and launch silu_mul_kernel")
        with guard:
            out = fn(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        n = a.numel()
        if guard.overrun():
            fail(f"your kernel wrote past the end of a tensor of {n} elements. Hint: the last program's block "
                 "runs past the end: store with mask=offsets < n_elements (strictly less than)")
        out = expect_tensor("silu_mul(a, b)", out, shape, dtype)
        want = F.silu(a.float()) * b.float()
        bad = ~((out.float() - want).abs() <= tol * (1 + want.abs()))  # NaN counts as bad
        if not bad.any():
            continue
        err = max_error(out, want)
        first = int(bad.reshape(-1).nonzero()[0])
        if first > 0 and max_error(out.float().reshape(-1)[:first], want.reshape(-1)[:first]) <= tol * (1 + want.abs().max().item()):
            fail(f"the first {first} of {n} elements are right, the rest are not. Hint: launch enough programs to "
                 "cover every element, triton.cdiv(n, BLOCK), each at offsets = program_id * BLOCK + "
                 "tl.arange(0, BLOCK), with loads and store masked by offsets < n_elements")
        if max_error(out, torch.sigmoid(a.float()) * b.float()) <= 100 * tol:
            fail(f"max error {err:.2e} for shape {shape}: that is sigmoid(a)·b. Hint: silu(a) = a·sigmoid(a)")
        if max_error(out, F.silu(a.float())) <= 100 * tol:
            fail(f"max error {err:.2e} for shape {shape}: that is silu(a) alone. Hint: multiply by b")
        fail(f"max error {err:.2e} against F.silu(a) * b for shape {shape} (tolerance {tol:g}). "
             "Hint: " + reveal("compare with silu(a)·b element by element, in float32",
                               "out = a * tl.sigmoid(a) * b, computed in float32"))


silu_mul.__wrapped__.hints = _KERNEL_HINTS


# --- exercise 4: per-channel symmetric int8 ---------------------------------------------------------

def _badly_scaled(seed: int = 0) -> torch.Tensor:
    """A [64, 128] weight whose rows span 4 orders of magnitude (1e-3 … 10)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 128, generator=g) * torch.logspace(-3, 1, 64)[:, None]


def _check_quantize(fn) -> None:
    w = _badly_scaled()
    got = fn(w.clone())
    if not (isinstance(got, tuple) and len(got) == 2):
        fail("quantize should return (q, scale). Hint: return q, scale")
    q, s = got
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.shape != w.shape:
        fail(f"q should be int8 {tuple(w.shape)}, got {getattr(q, 'dtype', type(q).__name__)} "
             f"{tuple(getattr(q, 'shape', ()))}. Hint: .round().clamp(-127, 127).to(torch.int8)")
    s = torch.as_tensor(s, dtype=torch.float32)
    if s.numel() == 1:
        fail("scale has one value for the whole matrix: rows with small weights round to 0. "
             "Hint: one scale per output channel, w.abs().amax(dim=1) / 127")
    if s.shape != (w.shape[0],):
        keepdim = " (without keepdim: .amax(dim=1), or .squeeze(1))" if s.shape == (w.shape[0], 1) else ""
        fail(f"scale should have shape ({w.shape[0]},) (one per output row), got {tuple(s.shape)}. "
             f"Hint: reduce over dim=1, the input dimension{keepdim}")
    if int(q.max()) > QMAX or int(q.min()) < -QMAX:
        fail(f"q holds {int(q.min())}..{int(q.max())}, outside [-127, 127] (symmetric: -128 is left out). "
             "Hint: scale = max|w| / 127, and clamp(-127, 127) after rounding")
    if s.max() <= s.min() * (1 + 1e-6):
        fail("every row got the same scale: rows with small weights round to 0. "
             "Hint: one scale per output channel, w.abs().amax(dim=1) / 127")
    want_s = w.abs().amax(dim=1) / QMAX
    if not torch.allclose(s, want_s, rtol=1e-3):
        for other, hint in [(w.amax(dim=1) / QMAX, "take the largest |w|, w.abs().amax(dim=1): a row's largest "
                                                    "magnitude may be negative"),
                            (w.abs().mean(dim=1) / QMAX, "the scale comes from the row's largest |w| (amax), not its mean"),
                            (w.abs().amax(dim=1) / 255, "symmetric int8 spans [-127, 127]: divide by 127, not 255"),
                            (w.abs().amax(dim=1) / 128, "divide by 127, so that the largest |w| maps to 127 exactly"),
                            (QMAX / w.abs().amax(dim=1), "scale is max|w| / 127 (a step size), not its inverse")]:
            if torch.allclose(s, other, rtol=1e-3):
                fail(f"scale[o] should be max|w[o, :]| / 127. Hint: {hint}")
        fail("scale[o] should be max|w[o, :]| / 127. Hint: " + reveal(
            "the scale of a row comes from that row's largest magnitude", "w.abs().amax(dim=1) / 127"))
    wq = reference_dequantize(q, s)
    if ((wq - w).abs() > s[:, None] / 2 * (1 + 1e-4) + 1e-12).any():
        fail("dequantize(q, scale) is off by more than scale/2 somewhere. "
             "Hint: q = round(w / scale[:, None]), rounding to nearest, not truncating")
    zero = torch.zeros(4, 8)
    zero[1] = torch.linspace(-1, 1, 8)
    qz, sz = fn(zero)
    sz = torch.as_tensor(sz, dtype=torch.float32).reshape(-1)
    if not (torch.isfinite(sz).all() and sz[0] > 0) or (qz[0] != 0).any():
        fail("an all-zero row gives a scale of 0 (dividing 0 by 0) or NaN. Hint: clamp the scale to a tiny "
             "positive minimum, e.g. .clamp(min=1e-12), before dividing")


def _check_dequantize(fn) -> None:
    w = _badly_scaled(1)
    q, s = reference_quantize(w)
    got = expect_tensor("dequantize(q, scale)", fn(q.clone(), s.clone()), tuple(w.shape))
    if got.dtype != torch.float32:
        fail(f"dequantize returned {got.dtype}. Hint: q.float() * scale[:, None]: int8 values times float scales")
    want = reference_dequantize(q, s)
    if torch.allclose(got, want, rtol=1e-6, atol=0):
        return
    if torch.allclose(got, q.float() / s[:, None], rtol=1e-4):
        fail("dequantize divides by the scale. Hint: quantize divides, dequantize multiplies: q * scale[:, None]")
    if torch.allclose(got, q.float(), rtol=1e-6):
        fail("dequantize returned q unscaled. Hint: multiply each row by its scale, q.float() * scale[:, None]")
    fail(f"dequantize is off by {max_error(got, want):.2e}. Hint: row o is q[o] * scale[o]: q.float() * scale[:, None]")


@exercise(4, "per-channel symmetric int8 quantize and dequantize")
def quantize_per_channel(quantize, dequantize) -> None:
    """``quantize(w) -> (q int8 [out, in], scale float32 [out])`` and ``dequantize(q, scale) -> w`` float32."""
    _check_quantize(quantize)
    _check_dequantize(dequantize)


quantize_per_channel.__wrapped__.hints = {
    "size of tensor a": "scale has one entry per row: scale[:, None] broadcasts it along the row",
    "too many values to unpack": "quantize returns two things: return q, scale",
}


# --- exercise 5: an int8 weight-only linear layer -------------------------------------------------

@exercise(5, "an int8 weight-only linear layer")
def int8_linear(fn) -> None:
    """``fn(x, q, scale, bias) -> y``: ``x`` float ``(..., in)``, ``q`` int8 ``[out, in]``, ``scale``
    float32 ``[out]``, ``bias`` float32 ``[out]`` or None → ``(..., out)`` in ``x.dtype``."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 0, 48)[:, None]
    q, s = reference_quantize(w)
    bias = torch.randn(48, generator=g)
    for x_shape, b, dtype in [((5, 64), bias, torch.float32), ((2, 3, 64), None, torch.float32),
                              ((1, 64), bias, torch.float64)]:
        x = torch.randn(x_shape, generator=g, dtype=dtype)
        xd, qd, sd, bd = x.double(), q.double(), s.double(), None if b is None else b.double()
        want = F.linear(xd, qd * sd[:, None], bd)
        got = expect_tensor("int8_linear(x, q, scale, bias)", fn(x, q, s, b), x_shape[:-1] + (48,), dtype)
        err = max_error(got, want)
        if err <= 1e-4:
            continue
        if b is not None and max_error(got, F.linear(xd, qd * sd[:, None])) <= 1e-4:
            fail("the bias is missing. Hint: add bias (when it is not None) after scaling")
        if b is not None and max_error(got, (xd @ qd.T + bd) * sd) <= 1e-4:
            fail("the bias was scaled too. Hint: scale the product first, then add the bias: (x @ q.T) * scale + bias")
        unscaled = F.linear(xd, qd, bd)
        if max_error(got, unscaled) <= 1e-3 * max(1.0, unscaled.abs().max().item()):
            fail(f"max error {err:.2e}: the output is not scaled. Hint: y = (x @ q.T) * scale + bias; each output "
                 "channel o is scaled by scale[o]")
        fail(f"max error {err:.2e} against x @ dequantize(q, scale).T + bias. Hint: " + reveal(
            "multiply the product by the scale once, along its last dimension (one value per output channel)",
            "(x @ q.T) * scale + bias"))


int8_linear.__wrapped__.hints = {
    "Char": "convert the int8 weight to x's dtype before the matmul: q.to(x.dtype)",
    "same dtype": "convert the int8 weight to x's dtype before the matmul: q.to(x.dtype)",
    "size of tensor a": "scale has one entry per output channel: multiply the output (..., out) by scale",
    "NoneType": "bias may be None: add it only when bias is not None",
    "ambiguous": "test `bias is not None`, not the tensor's truth value",
    "cannot be multiplied": "x is (..., in) and q is [out, in]: multiply by q.T",
    "must be a matrix": "x may have more than two dimensions (..., in): use x @ q.T (or F.linear), not torch.mm",
}


# --- exercise 6: a dynamic-batching policy --------------------------------------------------------

# (waiting arrival times, now, max_batch, max_wait) → the reference answer comes from dynamic_batch_policy
_POLICY_CASES = [
    ([0.0], 0.0, 8, 0.01),  # alone, just arrived: wait for company
    ([0.0, 0.001, 0.002], 0.005, 8, 0.01),  # not full, not late
    ([0.0, 0.001, 0.002], 0.01, 8, 0.01),  # the oldest has waited exactly max_wait: go
    ([0.0, 0.001, 0.002], 0.02, 8, 0.01),  # late: go with what waits
    ([0.0] * 10, 0.0, 8, 0.01),  # more than a full batch: take max_batch
    ([0.0, 0.0, 0.0, 0.0], 0.0, 4, 0.05),  # exactly full
    ([0.0, 0.045, 0.049], 0.05, 8, 0.05),  # the newest just arrived; the oldest is due
    ([1.0], 1.0, 4, 0.0),  # max_wait 0: never wait
    ([0.0, 0.2], 0.21, 1, 0.5),  # max_batch 1: always go, one at a time
]


def _latency(b: int) -> float:
    return 0.004 + 0.0005 * b  # seconds: a fixed cost (reading the weights) plus a little per request


def _go(waiting, max_batch):
    return min(len(waiting), max_batch)


_POLICY_MISTAKES = [
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb else 0,
     "the oldest request must not wait forever for a full batch: also start once now - waiting[0] >= max_wait"),
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb or now - w[0] > mw else 0,
     "waiting exactly max_wait is enough: compare with >=, not > (the server asks at that very moment)"),
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb or now - w[-1] >= mw else 0,
     "time max_wait from the OLDEST request, waiting[0], not the newest"),
    (lambda w, now, mb, mw: len(w) if len(w) >= mb or now - w[0] >= mw else 0,
     "never start more than max_batch: min(len(waiting), max_batch)"),
    (lambda w, now, mb, mw: _go(w, mb),
     "starting whatever waits at once is max_wait = 0; wait (return 0) for company until the batch is full or "
     "the oldest has waited max_wait"),
]


@exercise(6, "a dynamic-batching policy")
def batch_policy(fn) -> None:
    """``fn(waiting, now, max_batch, max_wait) -> int``: requests to start now (see
    :func:`teraflops.compilation.batching.dynamic_batch_policy`)."""
    answers = []
    for case in _POLICY_CASES:
        got = fn(list(case[0]), *case[1:])
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            fail(f"batch_policy should return an int (how many to start now, 0 = wait), got "
                 f"{type(got).__name__} {got!r}")
        answers.append((int(got), dynamic_batch_policy(*case), case))
    wrong = [a for a in answers if a[0] != a[1]]
    if wrong:
        got, want, (waiting, now, mb, mw) = wrong[0]
        hint = next((h for m, h in _POLICY_MISTAKES if all(m(*c) == g for g, _, c in answers)),
                    "start min(len(waiting), max_batch) when len(waiting) >= max_batch or now - waiting[0] >= "
                    "max_wait; otherwise return 0")
        fail(f"with {len(waiting)} waiting (oldest for {1e3 * (now - waiting[0]):g} ms), max_batch={mb}, "
             f"max_wait={1e3 * mw:g} ms you started {got}, expected {want}. Hint: {hint}")
    # the policy drives the simulated server: same arrivals, same batches as the reference
    for rate, mb, mw in [(300.0, 8, 0.01), (50.0, 4, 0.02)]:
        want = simulate_server(_latency, rate, mb, mw, duration=2.0, seed=1)
        try:
            got = simulate_server(_latency, rate, mb, mw, duration=2.0, seed=1, policy=fn)
        except BatchingError as e:
            fail(f"in the simulated server (rate {rate:g}/s, max_batch {mb}, max_wait {1e3 * mw:g} ms): {e}")
        if got.batch_sizes != want.batch_sizes:
            fail(f"in the simulated server (rate {rate:g}/s) your batches differ from the dynamic batcher's "
                 f"(first {list(got.batch_sizes[:6])} vs {list(want.batch_sizes[:6])}). Hint: decide only from "
                 "len(waiting), now - waiting[0], max_batch and max_wait")


# --- exercise 7: a queue delay for the real server ------------------------------------------------

SERVE_CLIENTS, SERVE_MAX_BATCH = 8, 32  # closed-loop clients < max_batch: a batch never fills by itself
REFERENCE_DELAY_MS = 2.0  # the lecture's setting (section 6): about the time the clients take to come back
MIN_SPEEDUP = 1.3  # over the unbatched server at the same clients, measured in the same check
P99_SLACK, THROUGHPUT_SLACK = 1.5, 0.7  # against the reference delay measured in the same check
_DELAY_HINT = ("with fewer clients than max_batch a batch never fills, so every batch waits the whole delay; "
               "wait only as long as the clients take to come back (a millisecond or two over loopback)")


def _serve(delay_ms: float, models: tuple[str, ...]) -> list:
    """perf_analyzer at :data:`SERVE_CLIENTS` clients on each of ``models`` of one server with ``delay_ms``."""
    try:
        with serving.Server(queue_delay_ms=delay_ms, max_batch=SERVE_MAX_BATCH) as server:
            return [loadgen.measure(server, m, concurrency=SERVE_CLIENTS, interval_ms=800, max_trials=5)
                    for m in models]
    except serving.ServingError as e:
        fail(f"the measurement at max_queue_delay {delay_ms:g} ms did not complete (not your answer's fault; "
             f"a busy machine?): {e}. Hint: run the check again")


@exercise(7, "a queue delay for the real server")
def queue_delay(fn) -> None:
    """``fn(clients, max_batch) -> float``: the dynamic batcher's ``max_queue_delay`` (ms) for ``clients``
    closed-loop clients and ``max_batch``.

    Judged by measurement, with ratios so that it holds on a loaded machine: the delay is served by
    :class:`teraflops.compilation.serving.Server` to perf_analyzer's :data:`SERVE_CLIENTS` clients beside the
    unbatched model (``decode_single``) of the same server: it must serve at least :data:`MIN_SPEEDUP` × its
    requests/s. A delay off the reference (not within ½×–2× of :data:`REFERENCE_DELAY_MS`) is also measured
    against the reference delay on a second server: p99 at most :data:`P99_SLACK` × and throughput at least
    :data:`THROUGHPUT_SLACK` × the reference's. Where the server cannot run (:func:`serving.why_not`,
    :func:`loadgen.why_not`) it skips, saying why in one line. About 20–30 s (one server), 40–50 s with the second.
    """
    delay = expect_number("choose_queue_delay", fn(SERVE_CLIENTS, SERVE_MAX_BATCH), "milliseconds")
    if not (math.isfinite(delay) and 0 <= delay <= 1e4):
        fail(f"choose_queue_delay returned {delay:g}: a queue delay is a number of milliseconds in [0, 10000]")
    reason = serving.why_not() or loadgen.why_not()
    if reason:
        raise ExerciseSkipped(reason)
    yours, single = _serve(delay, (serving.BATCHED, serving.SINGLE))
    said = f"at max_queue_delay {delay:g} ms ({SERVE_CLIENTS} clients, max_batch {SERVE_MAX_BATCH})"
    if not REFERENCE_DELAY_MS / 2 <= delay <= 2 * REFERENCE_DELAY_MS:
        (ref,) = _serve(REFERENCE_DELAY_MS, (serving.BATCHED,))
        versus = f"at {REFERENCE_DELAY_MS:g} ms, measured just now"
        if yours.p99_ms > P99_SLACK * ref.p99_ms:
            fail(f"{said} the p99 latency was {yours.p99_ms:.0f} ms, {yours.p99_ms / ref.p99_ms:.1f}x the "
                 f"{ref.p99_ms:.0f} ms {versus} (target: at most {P99_SLACK:g}x). Hint: {_DELAY_HINT}")
        if yours.throughput_rps < THROUGHPUT_SLACK * ref.throughput_rps:
            fail(f"{said} the server served {yours.throughput_rps:.0f} requests/s, "
                 f"{yours.throughput_rps / ref.throughput_rps:.2f}x the {ref.throughput_rps:.0f} {versus} (target: at "
                 f"least {THROUGHPUT_SLACK:g}x). Hint: {_DELAY_HINT}")
    if yours.throughput_rps < MIN_SPEEDUP * single.throughput_rps:
        fail(f"{said} the server served {yours.throughput_rps:.0f} requests/s, only "
             f"{yours.throughput_rps / single.throughput_rps:.2f}x the unbatched model's {single.throughput_rps:.0f} "
             f"(executed batch {yours.executed_batch:.1f}; target: at least {MIN_SPEEDUP:g}x). Hint: {_DELAY_HINT}")
