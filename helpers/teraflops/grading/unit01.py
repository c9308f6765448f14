"""Checks for Unit 1 (Model definition). Each takes the learner's function and nothing else.

References: :mod:`teraflops.model_definition.roofline` (intensities), :mod:`teraflops.model_definition.attention` (SDPA as the
reference attention), :mod:`teraflops.model_definition.profiling` (the verdict rule). FlashAttention-2's forward and
backward (Exercises 5, 6 and 8) are checked against fp64 attention and its gradients written out densely
(:func:`_dense64`), whose knobs also model the plausible mistakes each hint names; the packaged answers are
:mod:`teraflops.model_definition.flash_pytorch` and :class:`teraflops.model_definition.flash_triton.FlashAttentionTriton`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from teraflops.model_definition import roofline
from teraflops.model_definition.profiling import classify, count_ops
from teraflops.grading.core import (check_cases, close, exercise, expect_tensor, fail, kernel_setting, max_error,
    reveal)

def _size(dtype) -> int:
    return roofline.bytes_per_element(dtype)


def _byte_mistakes(denominator: str) -> list:
    """Mistakes in the byte count, common to both intensity exercises, as (holds, hint) pairs;
    ``holds(got, want, dtype, shape)``."""
    return [
        (lambda g, w, d, s: close(g, w * _size(d)),
         f"you counted elements, not bytes: the denominator is {denominator} × bytes per element of the dtype"),
        *[(lambda g, w, d, s, b=b: close(g, w * _size(d) / b), f"you used {b} bytes per element for every dtype: "
           "take it from the dtype (torch.empty((), dtype=dtype).element_size())") for b in (1, 2, 4, 8)],
    ]


def _check_intensity(fn, what: str, shapes, reference, mistakes, default_hint: str) -> None:
    """:func:`~.core.check_cases` over ``shapes`` (their last item is the dtype); ``mistakes`` hold
    as ``holds(got, want, dtype, shape)``."""
    check_cases(fn, what, "FLOP per byte", shapes, reference,
                [(lambda g, w, s, holds=holds: holds(g, w, s[-1], s), hint) for holds, hint in mistakes], default_hint,
                lambda s: f"{'×'.join(str(x) for x in s[:-1])} {s[-1]}",
                lambda got, want: f"got {got:.4g}, expected {want:.4g} FLOP/byte")


@exercise(1, "arithmetic intensity of a matmul")
def matmul_intensity(fn) -> None:
    """``fn(m, n, k, dtype) -> float``: FLOP/byte of ``(m×k) @ (k×n)`` with minimum traffic."""
    shapes = [(4096, 4096, 4096, torch.float32), (1, 8192, 8192, torch.bfloat16),
              (128, 512, 256, torch.float16), (64, 64, 2048, torch.float32)]
    mistakes = _byte_mistakes("(m·k + k·n + m·n)") + [
        (lambda g, w, d, s: close(g, w / 2), "one multiply-add is 2 FLOPs, so a matmul does 2·m·n·k"),
        (lambda g, w, d, s: close(g, 2 * s[0] * s[1] * s[2] / ((s[0] * s[2] + s[2] * s[1]) * _size(d))),
         "the output C (m×n) has to be written too"),
    ]
    _check_intensity(fn, "matmul_intensity", shapes, roofline.matmul_intensity, mistakes,
                     "FLOPs = 2·m·n·k; bytes = (m·k + k·n + m·n) × bytes per element")


@exercise(2, "arithmetic intensity of softmax")
def softmax_intensity(fn) -> None:
    """``fn(rows, cols, dtype) -> float``: 5 FLOPs per element over 2 elements moved."""
    shapes = [(4096, 4096, torch.float32), (32, 50257, torch.bfloat16), (1, 128, torch.float16)]
    mistakes = _byte_mistakes("2 × rows × cols") + [
        (lambda g, w, d, s: close(g, w * 2), "the output is written once too: bytes = 2 × elements × element size"),
    ]
    _check_intensity(fn, "softmax_intensity", shapes, roofline.softmax_intensity, mistakes,
                     "count 5 FLOPs per element (max, subtract, exp, sum, divide); read the input once, "
                     "write the output once")


def _qkv(shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) * scale for _ in range(3))


def _attention64(q, k, v, dim=-1, scale=True):
    """fp64 reference attention (or a plausible mistake: no scale, softmax over the wrong dim)."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    return torch.softmax(s, dim) @ v


def _tolerance(v: torch.Tensor) -> float:
    """fp32 rounding of a correct answer grows with the values: 2e-5 × max|v| (≥ 1e-5)."""
    return max(1e-5, 2e-5 * v.abs().max().item())


@exercise(3, "naive attention")
def naive_attention(fn) -> None:
    """``fn(q, k, v) -> out``: softmax(q kᵀ/√d) v for (B, H, N, d); must not call SDPA.

    Compared with an fp64 reference (tolerance :func:`_tolerance`); each call gets fresh copies of
    the inputs, so an in-place change of q, k or v cannot leak into the next call.
    """
    for shape, scale in [((2, 3, 64, 32), 1.0), ((1, 2, 33, 16), 1.0), ((1, 1, 16, 64), 8.0)]:
        q, k, v = _qkv(shape, scale=scale)
        ops = count_ops(lambda: fn(q.clone(), k.clone(), v.clone()))
        if any("scaled_dot_product" in op for op in ops):
            fail("it calls scaled_dot_product_attention; this exercise builds attention by hand "
                 "(matmul, softmax, matmul) so you can measure what it materialises")
        out = expect_tensor("output", fn(q.clone(), k.clone(), v.clone()), shape, q.dtype)
        err, tol = max_error(out, _attention64(q, k, v)), _tolerance(v)
        if err <= tol:
            continue
        d = shape[-1]
        if math.isnan(err):
            fail(f"output has NaN or inf for inputs of magnitude ~{scale}. Hint: exp overflows; "
                 "subtract the row maximum before exp (or use torch.softmax)")
        if max_error(out, _attention64(q, k, v, scale=False)) <= tol:
            fail(f"max error {err:.2e} against the reference. Hint: scale the scores by 1/√d = 1/√{d} before the softmax")
        if max_error(out, _attention64(q, k, v, dim=-2)) <= tol:
            fail(f"max error {err:.2e} against the reference. Hint: the softmax runs over the keys, the last dimension (dim=-1)")
        fail(f"max error {err:.2e} against the reference for shape {shape} (tolerance {tol:.1e}). "
             f"Hint: {reveal('compare each step with the exercise text: the scores, their softmax and the product with v', 'scores = q @ kᵀ / √d, softmax over the last dim, then @ v')}")


naive_attention.__wrapped__.hints = {
    "must match the size": "q @ kᵀ needs k.transpose(-2, -1); on a 4-D tensor .T reverses all four dims",
    "cannot be multiplied": "q @ kᵀ needs k.transpose(-2, -1) (keys' last two dims swapped)",
    "Expected size for first two dimensions": "q @ kᵀ needs k.transpose(-2, -1): multiply q by the keys with their last two dims swapped",
}


class _WideReductions(torch.overrides.TorchFunctionMode):
    """Watches a learner's online softmax for reductions that read a whole row at once.

    A reduction (max, sum, logsumexp, sort, ...) over the last dim counts as *wide* when that dim
    is longer than ``block`` and its input is a view of ``x`` itself, or (for ``block > 1``) any
    tensor as wide as a row of ``x``. Reductions over per-row statistics (the running m and l,
    or per-block results stacked together) never count. Also notes any softmax call.
    """

    REDUCTIONS = {"max", "amax", "sum", "nansum", "mean", "logsumexp", "special_logsumexp", "cumsum",
                  "cummax", "logcumsumexp", "topk", "sort", "kthvalue", "norm", "vector_norm"}

    def __init__(self, x: torch.Tensor, block: int):
        super().__init__()
        self.x_storage = x.untyped_storage().data_ptr()
        self.cols, self.block = x.shape[-1], block
        self.widest = 0
        self.softmax = False

    def _reduces_last_dim(self, t: torch.Tensor, args, kwargs) -> bool:
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else None)
        if dim is None:
            return True  # a full reduction
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return any(d % t.dim() == t.dim() - 1 for d in dims if isinstance(d, int))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if "softmax" in name:
            self.softmax = True
        t = args[0] if args else kwargs.get("input")
        binary = len(args) > 1 and isinstance(args[1], torch.Tensor)  # torch.max(a, b) is elementwise
        if name in self.REDUCTIONS and isinstance(t, torch.Tensor) and t.dim() > 0 and not binary:
            width = t.shape[-1]
            of_x = t.untyped_storage().data_ptr() == self.x_storage
            row_wide = self.block > 1 and width == self.cols
            if width > self.block and (of_x or row_wide) and self._reduces_last_dim(t, args, kwargs):
                self.widest = max(self.widest, width)
        return func(*args, **kwargs)


@exercise(4, "online softmax")
def online_softmax(fn) -> None:
    """``fn(x, block_size) -> softmax(x, dim=-1)`` computed one block of columns at a time.

    Besides the values, checks that no max/sum reduction spans more than ``block_size`` columns.
    """
    g = torch.Generator().manual_seed(1)
    cases = [
        ("rising rows", torch.linspace(-5, 20, 100).repeat(3, 1), 16),  # the max changes in every block
        ("random", torch.randn(4, 257, generator=g), 64),
        ("block of one", torch.randn(2, 9, generator=g), 1),
        ("block wider than the row", torch.randn(2, 10, generator=g), 32),
        ("large values", torch.randn(3, 130, generator=g) * 1000, 32),
        ("very negative rows", torch.randn(3, 70, generator=g) * 10 - 200, 16),  # exp(x - 0) underflows to 0
        # masked keys (−inf): the first block of a row wholly masked makes exp(m − m_new) = exp(−inf + inf)
        ("first block fully masked", torch.randn(3, 50, generator=g).index_fill(1, torch.arange(16), float("-inf")), 16),
        ("a masked block in the middle", torch.randn(2, 48, generator=g).index_fill(1, torch.arange(16, 32), float("-inf")), 16),
    ]
    for name, x, block in cases:
        x_in = x.clone()
        with _WideReductions(x_in, block) as seen:
            got = fn(x_in, block)
        if seen.softmax:
            fail("it calls softmax; compute it yourself from a running max and a running sum")
        if seen.widest:
            fail(f"on '{name}' a max or sum read {seen.widest} columns at once, but block_size={block}: "
                 "read x one block of columns at a time (x[..., start:start + block_size])")
        out = expect_tensor(f"output ({name})", got, tuple(x.shape), x.dtype)
        want = torch.softmax(x.double(), -1)
        err = max_error(out, want)
        # fp32 rounding of a correct answer: x − m loses up to one ulp of |x| (1.5e-5 near 200)
        if not math.isnan(err) and ((out.double() - want).abs() <= 1e-6 + 3e-5 * want.abs()).all():
            continue
        if math.isnan(err) and "masked" in name:
            fail(f"NaN on '{name}' (block_size={block}). Hint: while a row has seen only −inf, m = m_new = −inf "
                 "and exp(m − m_new) = exp(−inf + inf) is NaN: subtract 0 instead of −inf for such rows "
                 "(m_safe = torch.where(m_new == -inf, 0, m_new)), as torch.softmax does")
        if math.isnan(err):
            fail(f"NaN/inf on '{name}' (block_size={block}). Hint: exp(x - m) with m the running maximum "
                 "never overflows, and never divides 0 by 0; start m at -inf and l at 0")
        fail(f"max error {err:.2e} on '{name}' (block_size={block}). Hint: " + reveal(
            "when a block raises the running max, the sum so far was taken against the old max and must be rescaled",
            "l = l·exp(m − m_new) + Σ exp(x_block − m_new); start m at -inf, not 0"))
    _runs_on_the_device_of_its_input(fn)


def _runs_on_the_device_of_its_input(fn) -> None:
    """On a ``meta`` tensor (shapes and dtypes, no data: any machine has that device) the answer must
    come back on ``meta``; running state made without ``device=x.device`` lands on the CPU and fails
    there exactly as it would against a CUDA input."""
    x = torch.empty(3, 40, device="meta")
    try:
        out = fn(x, 16)
        wrong = None if isinstance(out, torch.Tensor) and out.device == x.device else getattr(out, "device", type(out))
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:  # reached only after the values passed
        wrong = f"an error ({type(e).__name__})"
    if wrong is not None:
        fail(f"on an input on device 'meta' (as on 'cuda') it gave {wrong}. Hint: create the running max and "
             "sum on the input's device: torch.full(..., device=x.device), torch.zeros(..., device=x.device)")


# --- FlashAttention-2 forward and backward as an autograd Function (Exercises 5, 6 and 8) ---------

# (shape, is_causal): (batch, n, d) and (batch, heads, n, d); lengths that no power-of-two tile divides
_FA2_CASES = [((2, 17, 16), False), ((2, 100, 64), True), ((1, 2, 128, 16), True), ((1, 2, 257, 64), False)]


def _apply(fn):
    """The learner's ``torch.autograd.Function`` subclass (called through ``.apply``), or any callable
    ``(q, k, v, is_causal) -> O``."""
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        return fn.apply
    return fn


def _dense64(q, k, v, do, causal, diagonal=0, lse_as_max=False, scale_in_ds=True, delta="dO∘O"):
    """fp64 attention and its gradients, written out densely (FlashAttention-2, Dao 2023,
    arXiv:2307.08691, eqs. of §2.2), or a plausible mistake: a causal mask shifted by ``diagonal``
    (query i sees keys j ≤ i + diagonal), the row max saved instead of the log-sum-exp
    (``lse_as_max``), the scale left out of dQ and dK (``scale_in_ds=False``), or D taken from V
    (``delta``: ``"dO∘V"`` = rowsum(dO ∘ V), ``"dO·Vᵀ"`` = rowsum(dO Vᵀ)) instead of rowsum(dO ∘ O).
    Returns ``(O, L, dQ, dK, dV)`` (L: what the backward reads, the log-sum-exp or the max)."""
    q, k, v, do = (t.detach().double().cpu() for t in (q, k, v, do))
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1 + diagonal), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v
    saved = s.amax(-1) if lse_as_max else lse
    p = torch.exp(s - saved[..., None])
    dv = p.transpose(-2, -1) @ do
    dp = do @ v.transpose(-2, -1)
    d_row = {"dO∘O": (do * o).sum(-1), "dO∘V": (do * v).sum(-1), "dO·Vᵀ": dp.sum(-1)}[delta]
    ds = p * (dp - d_row[..., None]) * (scale if scale_in_ds else 1.0)
    return o, saved, ds @ k, ds.transpose(-2, -1) @ q, dv


def _near(got, want, tol) -> bool:
    """``got`` within ``tol`` of ``want`` wherever ``want`` is finite (rows a mistake leaves empty are
    NaN there), and finite itself there."""
    want = want.to(got.device)
    ok = torch.isfinite(want)
    return bool(ok.any()) and max_error(got.double()[ok], want[ok]) <= tol


def _fa2_inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _forward_checked(fn, shape, causal, dtype, device, tol, seed):
    """Run the learner's forward on one case and check O and the saved log-sum-exp; returns
    ``(q, k, v, do, O)`` with O still attached to the learner's backward."""
    q, k, v, do = _fa2_inputs(shape, dtype, device, seed)
    what = f"shape {shape}{', causal' if causal else ''}"
    ops = count_ops(lambda: _apply(fn)(q, k, v, causal))
    if any("scaled_dot_product" in op for op in ops):
        fail("it calls scaled_dot_product_attention; build the tiles yourself (this exercise is the algorithm)")
    o = expect_tensor(f"output ({what})", _apply(fn)(q, k, v, causal), shape, dtype)
    if o.grad_fn is None:
        fail(f"the output ({what}) has no grad_fn: call your class through `.apply(q, k, v, is_causal)` "
             "and return O from `forward` (subclass torch.autograd.Function)")
    want_o, want_lse, *_ = _dense64(q, k, v, do, causal)
    err = max_error(o, want_o.to(o.device))  # the reference is computed on the CPU, in fp64
    if not err <= tol:  # NaN included
        if causal and any(_near(o, _dense64(q, k, v, do, causal, diagonal=dg)[0], tol) for dg in (-1, 1)):
            fail(f"max error {err:.2e} against the reference ({what}). Hint: the causal mask is off by one: "
                 "query i attends to keys j ≤ i, the diagonal included (mask j > i, not j ≥ i or j > i + 1)")
        if math.isnan(err):
            fail(f"output has NaN or inf ({what}). Hint: a row whose keys are all masked so far has m = −inf, "
                 "and exp(m − m_new) = exp(−inf + inf) is NaN: subtract 0 instead of −inf for such rows")
        fail(f"max error {err:.2e} against the reference ({what}, tolerance {tol:g}). Hint: " + reveal(
            "check the online softmax on each tile (Exercise 4) and the causal mask of the tiles on the diagonal",
            "for each key tile: s = q kᵀ/√d (−inf where j > i), m_new = max(m, rowmax s), "
            "l = l·exp(m − m_new) + rowsum exp(s − m_new), acc = acc·exp(m − m_new) + exp(s − m_new) v; O = acc / l"))
    if not hasattr(o.grad_fn, "saved_tensors"):  # only a torch.autograd.Function's node has them
        fail(f"the output's grad_fn is PyTorch's own {type(o.grad_fn).__name__}, not your Function's: compute O "
             "inside `forward` of a torch.autograd.Function subclass, save L there, and return O")
    rows = tuple(shape[:-1])
    saved = [t for t in o.grad_fn.saved_tensors if tuple(t.shape) == rows]
    if len(saved) != 1:
        fail(f"forward saved {len(saved)} tensors of shape {rows} (batch, n_queries) with "
             "ctx.save_for_backward; save exactly one there, the log-sum-exp L of each row")
    lse_err = max_error(saved[0], want_lse.to(saved[0].device))
    if not lse_err <= max(tol, 1e-4):
        if _near(saved[0], _dense64(q, k, v, do, causal, lse_as_max=True)[1], max(tol, 1e-4)):
            fail(f"the saved L is the row maximum ({what}), not the log-sum-exp. Hint: save L = m + log(l): "
                 "the backward rebuilds P = exp(S − L), which is only normalised with l folded in")
        fail(f"the saved L is {lse_err:.2e} from logsumexp of the scaled scores ({what}). Hint: " + reveal(
            "save the log-sum-exp of each row, in natural log, of the *scaled* (and masked) scores",
            "L = m + log(l) after the last key tile"))
    return q, k, v, do, o


def _check_forward(fn, dtype, device, tol) -> None:
    for seed, (shape, causal) in enumerate(_FA2_CASES):
        _forward_checked(fn, shape, causal, dtype, device, tol, seed)


_GRAD_MISTAKES = [
    (dict(lse_as_max=True), "P rebuilt as exp(S − m) with the row max is not normalised: the forward must save "
                            "L = m + log(l) and the backward use P = exp(S − L)"),
    (dict(scale_in_ds=False), "the scale is forgotten in dS: S = Q Kᵀ · scale, so dQ = dS K · scale and "
                              "dK = dSᵀ Q · scale"),
    (dict(delta="dO∘V"), "D is computed from dO and V: D = rowsum(dO ∘ O), the output O, not V"),
    (dict(delta="dO·Vᵀ"), "D is computed from dO·Vᵀ (that is rowsum(dP), over all keys): D = rowsum(dO ∘ O)"),
    (dict(diagonal=-1), "the causal mask is off by one: query i attends to keys j ≤ i, the diagonal included"),
    (dict(diagonal=1), "the causal mask is off by one: query i attends to keys j ≤ i, not j ≤ i + 1"),
]


def _check_backward(fn, dtype, device, tol, triton_only=False) -> None:
    """The forward as :func:`_check_forward`, then dQ, dK, dV against the fp64 reference; a mismatch
    names the first plausible mistake that reproduces every gradient of that case."""
    for seed, (shape, causal) in enumerate(_FA2_CASES):
        q, k, v, do, o = _forward_checked(fn, shape, causal, dtype, device, tol, seed)
        what = f"shape {shape}{', causal' if causal else ''}"
        grads = _backward_gradients(o, (q, k, v), do, what, dtype, triton_only)
        _gradients_match(grads, (q, k, v, do), causal, what, tol)


def _backward_gradients(o, inputs, do, what: str, dtype, triton_only: bool) -> list[torch.Tensor]:
    """Run the learner's backward from ``o``; its dQ, dK, dV, checked to exist with the inputs' shapes and
    dtype (``triton_only``: and computed without PyTorch's matrix products or exponentials)."""
    ops = count_ops(lambda: o.backward(do, retain_graph=True))
    if triton_only:
        torch_math = sorted(op for op in ops if op in {"mm", "bmm", "matmul", "exp", "addmm", "baddbmm"})
        if torch_math:
            fail(f"the backward math ran in PyTorch ({', '.join(torch_math)}), not in your Triton kernels")
    grads = [t.grad for t in inputs]
    if any(g is None for g in grads):
        fail(f"backward returned no gradient for {', '.join(n for n, g in zip('qkv', grads) if g is None)}: "
             "return (dQ, dK, dV, None), one per input of forward")
    for name, g, t in zip(("dQ", "dK", "dV"), grads, inputs):
        expect_tensor(f"{name} ({what})", g, tuple(t.shape), dtype)
    return grads


def _gradients_match(grads, inputs, causal: bool, what: str, tol: float) -> None:
    """dQ, dK, dV within ``tol`` of the fp64 reference on ``inputs = (q, k, v, do)``; else the worst one,
    with the mistake that explains it."""
    want = _dense64(*inputs, causal)[2:]
    errs = [max_error(g, w.to(g.device)) for g, w in zip(grads, want)]
    if all(e <= tol for e in errs):
        return
    worst = max(range(3), key=lambda i: errs[i] if not math.isnan(errs[i]) else math.inf)
    head = f"{('dQ', 'dK', 'dV')[worst]} is {errs[worst]:.2e} from the reference ({what}, tolerance {tol:g})"
    if any(math.isnan(e) for e in errs):
        fail(f"{head}: NaN or inf. Hint: rows with L = −inf (no key seen) must give P = 0, not exp(−inf + inf)")
    _gradient_mistake(head, grads, errs, inputs, causal, tol)
    fail(f"{head}. Hint: " + reveal(
        "recompute P per tile from L, then dV, dP, D, dS, dQ and dK in that order",
        "P = exp(S − L); dV += Pᵀ dO; dP = dO Vᵀ; D = rowsum(dO ∘ O); dS = P ∘ (dP − D); "
        "dQ += dS K · scale; dK += dSᵀ Q · scale"))


def _gradient_mistake(head: str, grads, errs: list[float], inputs, causal: bool, tol: float) -> None:
    """Fail with the hint of the first of :data:`_GRAD_MISTAKES` that reproduces the gradients (the
    forgotten scale also when dV is right and dQ or dK matches it)."""
    for knobs, hint in _GRAD_MISTAKES:
        if "diagonal" in knobs and not causal:
            continue
        mistaken = _dense64(*inputs, causal, **knobs)[2:]
        if all(_near(g, w, tol) for g, w in zip(grads, mistaken)) or (
                "scale_in_ds" in knobs and errs[2] <= tol
                and any(_near(grads[i], mistaken[i], tol) for i in (0, 1))):
            fail(f"{head}. Hint: {hint}")


@exercise(5, "FlashAttention-2 forward in PyTorch")
def flash_forward(fn) -> None:
    """``fn``: a ``torch.autograd.Function`` subclass; ``fn.apply(q, k, v, is_causal)`` on (batch, n, d)
    and (batch, heads, n, d) fp32 CPU tensors returns O (within 1e-4 of an fp64 reference) and saves
    exactly one tensor of shape (batch, n_queries) (per head), the log-sum-exp (within 1e-4)."""
    _check_forward(fn, torch.float32, "cpu", 1e-4)


@exercise(6, "FlashAttention-2 backward in PyTorch")
def flash_backward(fn) -> None:
    """``fn`` as for :func:`flash_forward`; its backward's dQ, dK, dV within 1e-4 of an fp64 reference
    (SDPA's autograd gradients, computed without rounding), causal and not."""
    _check_backward(fn, torch.float32, "cpu", 1e-4)


@exercise(8, "FlashAttention-2 backward in Triton")
def flash_backward_triton(fn) -> None:
    """``fn`` as for :func:`flash_backward`, with the backward's math in Triton kernels: fp32 within 1e-4
    under the interpreter (CPU); fp16 within 1e-2 compiled on a GPU (dQ and dK sum N rounded products)."""
    device, dtype, _ = kernel_setting()
    _check_backward(fn, dtype, device, 1e-4 if dtype == torch.float32 else 1e-2, triton_only=True)


flash_forward.__wrapped__.hints = flash_backward.__wrapped__.hints = {
    "unexpected keyword argument 'is_causal'": "forward(ctx, q, k, v, is_causal=False) takes is_causal by position: "
                                                "call it as .apply(q, k, v, is_causal)",
    "returned an incorrect number of gradients": "backward returns one gradient per input of forward: "
                                                 "(dQ, dK, dV, None), None for is_causal",
}
flash_backward_triton.__wrapped__.hints = {**flash_backward.__wrapped__.hints, **{
    "must be Tensor, not tensor": "inside a @triton.jit kernel use triton.language (tl.exp, tl.sum, tl.dot), not torch"}}


_TORCH_MATH = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_softmax", "softmax", "exp", "div", "mul"}

_KERNEL_HINTS = {
    "must be Tensor, not tensor": "inside a @triton.jit kernel use triton.language (tl.exp, tl.max, tl.sum), not torch",
    "incompatible dimensions": "check the tl.dot shapes: (BLOCK_M, D) @ (D, BLOCK_N) for the scores, "
                               "(BLOCK_M, BLOCK_N) @ (BLOCK_N, D) for p @ v",
}


@exercise(7, "FlashAttention forward kernel in Triton")
def flash_attention(fn) -> None:
    """``fn(q, k, v) -> out`` built on the learner's Triton kernel; compared with SDPA.

    fp32 within 1e-5 under the interpreter (CPU); fp16 within 2e-3 when compiled on a GPU.
    """
    device, dtype, tol = kernel_setting()
    # N=300 spans several key tiles for any block size a kernel would use (the rescale matters).
    for shape in [(1, 2, 128, 32), (2, 1, 100, 16), (1, 1, 300, 16)]:
        q, k, v = (t.to(device) for t in _qkv(shape, dtype))
        fn(q, k, v)  # first call: compiling and autotuning may run torch ops of their own
        ops = count_ops(lambda: fn(q, k, v))
        torch_math = sorted(op for op in ops if op in _TORCH_MATH or "scaled_dot_product" in op)
        if torch_math:
            fail(f"the attention math ran in PyTorch ({', '.join(torch_math)}), not in your Triton kernel: "
                 "flash_attention should only allocate the output and launch attention_kernel")
        out = expect_tensor("output", fn(q, k, v), shape, dtype)
        want = F.scaled_dot_product_attention(q, k, v)
        err = max_error(out, want)
        if math.isnan(err):
            fail(f"output has NaN/inf for shape {shape}. Hint: mask out-of-range keys with -inf *before* "
                 "the row max, and rows beyond N must not be stored")
        if err > tol:
            rows = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(shape[-1])
            unnormalised = torch.exp(rows - rows.amax(-1, keepdim=True)) @ v.float()
            if max_error(out, unnormalised) <= 100 * tol:
                fail(f"max error {err:.2e} against SDPA for shape {shape}: the output is not normalised. "
                     "Hint: divide acc by l once, after the loop")
            fail(f"max error {err:.2e} against SDPA for shape {shape} (tolerance {tol:g}). Hint: " + reveal(
                "acc and l were summed against the old running max: rescale both when a tile raises it",
                "multiply acc and l by alpha = exp(m_old − m_new) before adding the new tile, and divide by l once at the end"))


flash_attention.__wrapped__.hints = _KERNEL_HINTS


# Cases for Exercise 9 (classify_op): (name, FLOPs, bytes, (peak FLOP/s, bandwidth B/s, launch floor s), why).
_GPU = (100e12, 2e12, 5e-6)  # an imaginary GPU: 100 TFLOP/s, 2 TB/s, 5 µs floor
_CPU = (1e11, 1e10, 2e-6)  # a CPU-like machine: 100 GFLOP/s, 10 GB/s, 2 µs floor
_CLASSIFY_CASES = [
    ("8192³ matmul on a GPU", 2 * 8192**3, 3 * 8192**2 * 2, _GPU, "a large square matmul reuses each byte thousands of times"),
    ("add of 2^28 elements on a GPU", 2**28, 3 * 2**28 * 2, _GPU, "one FLOP per 6 bytes is far left of the ridge point"),
    ("GEMV 1×8192 @ 8192×8192 on a GPU", 2 * 8192**2, (8192 + 8192**2 + 8192) * 2, _GPU,
     "a matrix-vector product reads every weight once for 2 FLOPs"),
    ("add of 1024 elements on a GPU", 1024, 3 * 1024 * 2, _GPU, "its ideal time (ns) is far below the 5 µs launch floor"),
    ("64×64 matmul on a GPU", 2 * 64**3, 3 * 64**2 * 2, _GPU, "even a compute-heavy op is launch-bound when it is tiny"),
    ("add of 10^5 elements on a CPU", 10**5, 3 * 10**5 * 4, _CPU,
     "1.2 MB at 10 GB/s is 120 µs, far above a 2 µs floor, though it is only 10^5 FLOPs"),
    ("add of 65,536 elements on a CPU", 65536, 3 * 65536 * 4, _CPU, "0.8 MB at 10 GB/s is 79 µs: memory, not overhead"),
    ("matmul at the ridge point on a CPU", 2 * 10**9, 2 * 10**8, _CPU, "FLOPs/peak equals bytes/bandwidth: count a tie as math"),
    ("op just above the floor on a CPU", 10, 25_000, _CPU, "its ideal time, 2.5 µs, is above the 2 µs floor"),
    ("small balanced op on a CPU", 150_000, 15_000, _CPU,
     "1.5 µs of math and 1.5 µs of memory overlap: the ideal time is the larger, 1.5 µs, not their sum"),
]


@exercise(9, "math, memory or framework overhead")
def classify_op(fn) -> None:
    """``fn(flops, nbytes, peak_flops, bandwidth, launch_floor) -> "math" | "memory" | "framework overhead"``."""
    for name, flops, nbytes, (peak, bw, floor), why in _CLASSIFY_CASES:
        want = classify(flops, nbytes, peak, bw, floor)
        got = fn(flops, nbytes, peak, bw, floor)
        if got not in ("math", "memory", "framework overhead"):
            fail(f"returned {got!r} for {name}; return one of 'math', 'memory', 'framework overhead'")
        if got != want:
            fail(f"{name} (peak {peak:.0e} FLOP/s, {bw:.0e} B/s, floor {floor * 1e6:g} µs): you said {got!r}, "
                 f"it is {want!r} ({why}). Hint: compare FLOPs/peak with bytes/bandwidth, and the larger with the floor")
