"""Unit 4's checks: answers written here from the exercises' definitions pass, plausible wrong answers fail
with the hint that names them."""

import nbformat
import pytest
import torch
import torch.nn.functional as F

import teraflops  # noqa: F401 - sets up Triton (interpreter on CPU) before triton is imported
import triton
import triton.language as tl

from teraflops.compilation import batching, decode, loadgen, quantization, serving
from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import grader, unit04 as check
from teraflops.course.labs import PLACEHOLDER_MESSAGE


# --- the exercises as a learner writes them, from their definitions (not the package's references) -------

def count_launches(events):
    """Outermost aten:: operators (no aten:: event above them, however many ranges between), views
    left out (decode.VIEW_OPS, the names the lab hands out), plus every Inductor kernel (cpp_fused)."""
    def has_aten_ancestor(e):
        while (e := e.cpu_parent) is not None:
            if e.name.startswith("aten::"):
                return True
        return False

    fused = sum("cpp_fused" in e.name for e in events)
    return fused + sum(e.name.startswith("aten::") and e.name.removeprefix("aten::") not in decode.VIEW_OPS
                       and not has_aten_ancestor(e) for e in events)


def bandwidth_utilisation(weight_bytes, n_layers, d_model, kv_bytes_per_element, batch, cache_len, step_s, bandwidth):
    """The weights once per step, the whole KV cache (keys and values of every layer and sequence) once."""
    moved = weight_bytes + 2 * n_layers * batch * cache_len * d_model * kv_bytes_per_element
    return moved / step_s / bandwidth


def quantize(w):
    """Symmetric per output row: scale = max |w| / 127 (never 0), q = round(w / scale) in [-127, 127]."""
    scale = torch.stack([row.abs().max() for row in w]).float().clamp(min=1e-30) / 127
    return torch.clamp(torch.round(w / scale.unsqueeze(1)), -127, 127).to(torch.int8), scale


def dequantize(q, scale):
    return q.to(torch.float32) * scale.unsqueeze(1)


def int8_linear(x, q, scale, bias):
    """y = (x @ q.T) * scale + bias, in x's dtype."""
    y = torch.matmul(x, q.to(x.dtype).transpose(0, 1)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def batch_policy(waiting, now, max_batch, max_wait):
    """Start up to max_batch once a batch is full or the oldest request has waited max_wait; else wait."""
    due = len(waiting) >= max_batch or now - waiting[0] >= max_wait
    return min(len(waiting), max_batch) if due else 0


def test_answers_written_from_the_definitions_pass(capsys):
    """Each check compares with the package's reference: these answers, written here, pass only where the
    reference agrees with the exercise's definition (passing the reference itself would hold by construction)."""
    check.count_launches(count_launches)
    check.bandwidth_utilisation(bandwidth_utilisation)
    check.silu_mul(_launcher(_silu_mul_kernel))
    check.quantize_per_channel(quantize, dequantize)
    check.int8_linear(int8_linear)
    check.batch_policy(batch_policy)
    assert capsys.readouterr().out.count("passed") == 6


def test_the_references_the_checks_use_give_the_hand_computed_values():
    """What the checks compare with, on cases worked out by hand."""
    from types import SimpleNamespace as E

    linear = E(name="aten::linear", cpu_parent=None)
    events = [linear, E(name="aten::addmm", cpu_parent=linear), E(name="aten::view", cpu_parent=None),
              E(name="graph_0_cpp_fused_mul_0", cpu_parent=None)]
    assert decode.count_launches(events).total == 2  # linear (addmm inside it), the fused kernel; a view runs none
    # 7B in bf16 at batch 1, 4096 cached positions: 14 GB + 2·32·4096·4096·2 B = 16.15 GB in 10 ms on 3.35 TB/s
    assert check._utilisation(14e9, 32, 4096, 2, 1, 4096, 0.01, 3.35e12) == pytest.approx(
        (14e9 + 2 * 32 * 4096 * 4096 * 2) / 0.01 / 3.35e12)
    q, s = quantization.quantize_per_channel(torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.02]]))
    assert s.tolist() == pytest.approx([0.01, 0.02]) and q.tolist() == [[50, -127, 0], [127, 50, -1]]
    assert [batching.dynamic_batch_policy(w, now, 4, 0.01) for w, now in
            [([0.0], 0.005), ([0.0], 0.01), ([0.0] * 6, 0.0)]] == [0, 1, 4]


def test_placeholder_is_not_attempted():
    def todo(*args):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    for fn in (check.count_launches, check.bandwidth_utilisation, check.int8_linear, check.batch_policy):
        with pytest.raises(NotAttempted):
            fn(todo)
    with pytest.raises(NotAttempted):
        check.quantize_per_channel(todo, todo)


# --- exercise 1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong, hint", [
    (check._count_all_aten, "runs inside its caller's launch"),
    (check._count_with_views, "VIEW_OPS"),
    (check._no_fused, "fused kernels"),
    (check._parent_is_none, "not for no parent at all"),
    (lambda ev: float(decode.count_launches(ev).total) + 1, "count outermost"),
])
def test_count_launches_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.count_launches(wrong)


# --- exercise 2 -------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong, hint", [
    (lambda w, L, d, e, b, t, s, bw: (w * b + 2 * L * b * t * d * e) / s / bw, "not once per sequence"),
    (lambda w, L, d, e, b, t, s, bw: (w + L * b * t * d * e) / s / bw, "keys AND values"),
    (lambda w, L, d, e, b, t, s, bw: w / s / bw, "whole KV cache"),
    (lambda *c: 100 * check._utilisation(*c), "not a percentage"),
    (lambda *c: check._utilisation(*c) * c[4], "do not multiply by the batch"),
    (lambda *c: 1 / check._utilisation(*c), "achieved bandwidth"),
    (lambda *c: "0.4", "should return a number"),
])
def test_bandwidth_utilisation_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.bandwidth_utilisation(wrong)


# --- exercise 3: real Triton kernels, right and wrong --------------------------------------------

@triton.jit
def _silu_mul_kernel(A, B, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (a * tl.sigmoid(a) * b).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_kernel(A, B, OUT, n, BLOCK: tl.constexpr):  # forgot the a in a·sigmoid(a)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (tl.sigmoid(a) * b).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _no_b_kernel(A, B, OUT, n, BLOCK: tl.constexpr):  # silu(a) only
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (a * tl.sigmoid(a)).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _no_store_mask_kernel(A, B, OUT, n, BLOCK: tl.constexpr):  # the tail of the last block is dropped
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + offs, mask=offs < n, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (a * tl.sigmoid(a) * b).to(OUT.dtype.element_ty), mask=offs < (n // BLOCK) * BLOCK)


@triton.jit
def _store_past_end_kernel(A, B, OUT, n, BLOCK: tl.constexpr):  # mask = offsets <= n: one element too many
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + offs, mask=offs <= n, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=offs <= n, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (a * tl.sigmoid(a) * b).to(OUT.dtype.element_ty), mask=offs <= n)


@triton.jit
def _unmasked_kernel(A, B, OUT, n, BLOCK: tl.constexpr):  # no masks at all: would corrupt the heap unguarded
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + offs).to(tl.float32)
    b = tl.load(B + offs).to(tl.float32)
    tl.store(OUT + offs, (a * tl.sigmoid(a) * b).to(OUT.dtype.element_ty))


def _launcher(kernel, block=64, grid=None):
    def silu_mul(a, b):
        a, b = a.contiguous(), b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        kernel[((grid or triton.cdiv)(n, block),)](a, b, out, n, BLOCK=block)
        return out
    return silu_mul


@pytest.mark.parametrize("wrong, hint", [
    (_launcher(_sigmoid_kernel), "silu\\(a\\) = a·sigmoid\\(a\\)"),
    (_launcher(_no_b_kernel), "multiply by b"),
    (_launcher(_no_store_mask_kernel), "the rest are not"),
    (_launcher(_silu_mul_kernel, grid=lambda n, block: n // block), "the rest are not"),
    (_launcher(_store_past_end_kernel), "wrote past the end"),
    (_launcher(_unmasked_kernel), "wrote past the end"),
    (lambda a, b: F.silu(a) * b, "ran in PyTorch"),
    (lambda a, b: _launcher(_silu_mul_kernel)(a, b)[:1], "shape"),
])
def test_silu_mul_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.silu_mul(wrong)


# --- exercise 4 -------------------------------------------------------------------------------

def _per_tensor_broadcast(w):  # the per-tensor mistake hidden behind an [out] scale
    q, s = quantization.quantize_per_tensor(w)
    return q, s.expand(w.shape[0]).clone()


def _truncates(w):
    s = w.abs().amax(dim=1) / 127
    return (w / s[:, None]).trunc().to(torch.int8), s


def _wrong_axis(w):
    s = w.abs().amax(dim=0) / 127
    return torch.round(w / s).clamp(-127, 127).to(torch.int8), s


def _scaled(w, s, low=-127):  # round(w / s) with the given scale, no guard for zero rows
    return torch.round(w / s[:, None]).clamp(low, 127).to(torch.int8), s


def _float_q(w):
    q, s = quantization.quantize_per_channel(w)
    return q.float(), s


@pytest.mark.parametrize("quantize, dequantize, hint", [
    (quantization.quantize_per_tensor, quantization.dequantize, "one scale per output channel"),
    (_per_tensor_broadcast, quantization.dequantize, "one scale per output channel"),
    (_truncates, quantization.dequantize, "scale/2"),
    (_wrong_axis, quantization.dequantize, "shape"),
    (lambda w: (lambda q, s: (q, s[:, None]))(*quantization.quantize_per_channel(w)), quantization.dequantize,
     "without keepdim"),
    (lambda w: _scaled(w, w.amax(dim=1) / 127), quantization.dequantize, "may be negative"),
    (lambda w: _scaled(w, w.abs().mean(dim=1) / 127), quantization.dequantize, "not its mean"),
    (lambda w: _scaled(w, w.abs().amax(dim=1) / 127.5, -128), quantization.dequantize, "-128 is left out"),
    (lambda w: _scaled(w, w.abs().amax(dim=1) / 127), quantization.dequantize, "all-zero row"),
    (_float_q, quantization.dequantize, "int8"),
    (lambda w: quantization.quantize_per_channel(w)[0], quantization.dequantize, "return q, scale"),
    (quantization.quantize_per_channel, lambda q, s: q.float() / s[:, None], "dequantize divides"),
    (quantization.quantize_per_channel, lambda q, s: q.float(), "unscaled"),
    (quantization.quantize_per_channel, lambda q, s: (q.float() * s[:, None]).half(), "float16"),
])
def test_quantize_mistakes(quantize, dequantize, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.quantize_per_channel(quantize, dequantize)


# --- exercise 5 -------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong, hint", [
    (lambda x, q, s, b: x @ q.float().T + (0 if b is None else b), "not scaled"),
    (lambda x, q, s, b: (x @ q.float().T) * s, "bias is missing"),
    (lambda x, q, s, b: x @ q.T, "convert the int8 weight"),
    (lambda x, q, s, b: (x @ q.float().T) * s[:, None], "scale has one entry per output channel|shape"),
    (lambda x, q, s, b: ((x @ q.float().T) / s) + (0 if b is None else b), "multiply the product by the scale once"),
    (lambda x, q, s, b: ((x @ q.float().T) + (0 if b is None else b)) * s, "bias was scaled too"),
    (lambda x, q, s, b: (x @ q.float().T) * s + b, "bias may be None"),
    (lambda x, q, s, b: (x @ q.float().T) * s + (b if b else 0), "bias is not None"),
    (lambda x, q, s, b: (x @ q.float()) * s, "multiply by q.T"),
    (lambda x, q, s, b: (x.float() @ q.float().T) * s + (0 if b is None else b), "expected torch.float64"),
])
def test_int8_linear_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.int8_linear(wrong)


# --- exercise 6 -------------------------------------------------------------------------------

def _go(w, mb):
    return min(len(w), mb)


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb else 0, "must not wait forever"),
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb or now - w[0] > mw else 0, "not >"),
    (lambda w, now, mb, mw: _go(w, mb) if len(w) >= mb or now - w[-1] >= mw else 0, "OLDEST"),
    (lambda w, now, mb, mw: len(w) if len(w) >= mb or now - w[0] >= mw else 0, "never start more than max_batch"),
    (lambda w, now, mb, mw: _go(w, mb), "max_wait = 0"),
    (lambda w, now, mb, mw: 1.0, "should return an int"),
])
def test_batch_policy_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.batch_policy(wrong)


# --- exercise 7: judged on the real server ------------------------------------------------------

CAN_SERVE = serving.why_not() or loadgen.why_not()


def test_queue_delay_placeholder_is_not_attempted():
    def todo(*args):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    with pytest.raises(NotAttempted):
        check.queue_delay(todo)


@pytest.mark.parametrize("wrong, hint", [
    (lambda clients, max_batch: "2", "should return a number"),
    (lambda clients, max_batch: -1.0, "in \\[0, 10000\\]"),
    (lambda clients, max_batch: float("nan"), "in \\[0, 10000\\]"),
])
def test_queue_delay_not_a_delay_fails_before_any_server(wrong, hint, monkeypatch):
    monkeypatch.setattr(check.serving, "Server", None)  # no server may start for these
    with pytest.raises(ExerciseFailed, match=hint):
        check.queue_delay(wrong)


def test_queue_delay_says_in_one_line_why_it_skips(monkeypatch, capsys):
    monkeypatch.setattr(check.serving, "why_not", lambda: "nvidia-pytriton is not installed. Fix: pip install")
    check.queue_delay(lambda clients, max_batch: 2.0)
    out = capsys.readouterr().out
    assert out == "– Exercise 7 (a queue delay for the real server): skipped: nvidia-pytriton is not installed. " \
                  "Fix: pip install\n"
    cell = nbformat.v4.new_code_cell("check.queue_delay(choose_queue_delay)",
                                     outputs=[nbformat.v4.new_output("stream", name="stdout", text=out)])
    row = grader._result_for(check.queue_delay.exercise, [cell])
    assert row.status == "failed" and row.detail == "skipped here: nvidia-pytriton is not installed. Fix: pip install"


@pytest.mark.slow
@pytest.mark.skipif(CAN_SERVE is not None, reason=CAN_SERVE or "")
def test_a_huge_queue_delay_fails_against_the_reference_measured_beside_it():
    """500 ms with 8 clients and max_batch 32: every batch waits the whole delay (measured under load 4: p99
    930 ms, 3.4x the 2 ms setting's 273 ms; throughput below 0.3x), so it fails, naming why."""
    with pytest.raises(ExerciseFailed, match="never fills, so every batch waits the whole delay"):
        check.queue_delay(lambda clients, max_batch: 500.0)
