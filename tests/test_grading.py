"""Checks pass the reference answers, and plausible wrong answers fail with a helpful message."""

import math

import pytest
import torch
import triton
import triton.language as tl

from teraflops.model_definition import profiling, roofline
from teraflops.model_definition.attention import naive_attention
from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.model_definition.flash_pytorch import FlashAttentionPytorch
from teraflops.model_definition.flash_triton import FlashAttentionTriton, flash_attention
from teraflops.grading import unit01 as check


def fails(check_fn, answer, *phrases):
    with pytest.raises(ExerciseFailed) as e:
        check_fn(answer)
    msg = str(e.value)
    assert msg.startswith(f"Exercise {check_fn.exercise.number} (")
    assert "\n" not in msg, "a check message must be one line"
    assert len(e.value._render_traceback_()) == 1
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


def unattempted(*args):
    raise NotImplementedError("Exercise: replace this line with your code")


def elem(dtype):
    return torch.empty((), dtype=dtype).element_size()


def blockwise_softmax(x, block, m_start=float("-inf"), combine=torch.maximum, rescale=True, masked_safe=True,
                      on_device=True):
    """The reference online softmax, with knobs for the variants the tests need."""
    device = {"device": x.device} if on_device else {}
    m = torch.full(x.shape[:-1], m_start, dtype=x.dtype, **device)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, **device)
    for s in range(0, x.shape[-1], block):
        b = x[..., s:s + block]
        m_new = combine(m, b.max(-1).values)
        m_sub = torch.where(m_new == float("-inf"), 0.0, m_new) if masked_safe else m_new
        l = (l * torch.exp(m - m_sub) if rescale else l) + torch.exp(b - m_sub[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def dense_attention(save_max=False, scale_in_ds=True, delta="dO∘O", diagonal=0, save_row_sums=False):
    """An autograd Function computing attention densely, as a learner might, with one of the plausible
    mistakes: the row max saved instead of the log-sum-exp, the scale left out of dS, D taken from V,
    the causal mask shifted by ``diagonal``. Written here from the formulas, not from the check's
    reference."""

    def scores(q, k, is_causal):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            n = q.shape[-2]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1 + diagonal), float("-inf"))
        return s

    class Dense(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, is_causal=False):
            s = scores(q, k, is_causal)
            m = s.amax(-1, keepdim=True)
            l = torch.exp(s - m).sum(-1, keepdim=True)
            o = torch.exp(s - m) / l @ v
            saved = m if save_max else m + torch.log(l)
            extra = (l.squeeze(-1),) if save_row_sums else ()  # a second (batch, n_queries) tensor
            ctx.save_for_backward(q, k, v, o, saved.squeeze(-1), *extra)
            ctx.is_causal = is_causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors[:5]
            p = torch.exp(scores(q, k, ctx.is_causal) - lse[..., None])
            dp = do @ v.transpose(-2, -1)
            d_row = {"dO∘O": (do * o).sum(-1), "dO∘V": (do * v).sum(-1), "dO·Vᵀ": dp.sum(-1)}[delta]
            ds = p * (dp - d_row[..., None]) * (1 / math.sqrt(q.shape[-1]) if scale_in_ds else 1.0)
            return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ do, None

    return Dense


def test_references_pass(capsys):
    """Answers written here from the formulas, not the helpers the checks compare with (passing
    ``roofline.matmul_intensity`` to a check built on it would hold by construction)."""
    check.matmul_intensity(lambda m, n, k, d: 2 * m * n * k / ((m * k + k * n + m * n) * elem(d)))
    check.softmax_intensity(lambda r, c, d: 5 / (2 * elem(d)))
    check.naive_attention(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v)
    check.online_softmax(blockwise_softmax)
    check.flash_forward(FlashAttentionPytorch)
    check.flash_backward(FlashAttentionPytorch)
    check.flash_attention(flash_attention)  # the Triton kernel, checked against an fp64 reference
    check.classify_op(lambda f, b, p, bw, floor: ("framework overhead" if max(f / p, b / bw) < floor
                                                  else "math" if f / p >= b / bw else "memory"))
    assert capsys.readouterr().out.count("✓ Exercise") == 8


@pytest.mark.slow
def test_the_packaged_triton_backward_passes(capsys):
    """The course's Triton FlashAttention-2 through the learner's check (~10 s in the interpreter)."""
    check.flash_backward_triton(FlashAttentionTriton)
    assert capsys.readouterr().out.count("✓ Exercise 8") == 1


def test_the_references_the_checks_use_give_the_hand_computed_values():
    """What the checks compare with, pinned to numbers worked out by hand (each docstring's formula)."""
    assert roofline.matmul_intensity(4096, 4096, 4096, torch.float32) == pytest.approx(4096 / 6)  # 2n³ / (3n² · 4)
    assert roofline.matmul_intensity(1, 8192, 8192, torch.bfloat16) == pytest.approx(
        2 * 8192**2 / ((2 * 8192 + 8192**2) * 2))  # GEMV: about 1 FLOP/byte
    assert roofline.softmax_intensity(32, 50257, torch.bfloat16) == pytest.approx(5 / 4)
    x = torch.tensor([[0.0, 1.0, 2.0]])
    assert blockwise_softmax(x, block=2) == pytest.approx(torch.tensor([[1, math.e, math.e**2]]) / (1 + math.e + math.e**2))
    gpu, cpu = (1e15, 3e12, 5e-6), (1e11, 1e10, 2e-6)
    assert [profiling.classify(2 * 8192**3, 3 * 8192**2 * 2, *gpu), profiling.classify(2**28, 3 * 2**28 * 2, *gpu),
            profiling.classify(1024, 3 * 1024 * 2, *gpu), profiling.classify(2 * 10**9, 2 * 10**8, *cpu)] == [
        "math", "memory", "framework overhead", "math"]  # the last a tie at the ridge point, counted as math


@pytest.mark.parametrize("name", ["matmul_intensity", "softmax_intensity", "naive_attention", "online_softmax",
                                  "flash_forward", "flash_backward", "flash_attention", "flash_backward_triton",
                                  "classify_op"])
def test_placeholder_reads_not_attempted(name):
    with pytest.raises(NotAttempted, match="not attempted"):
        getattr(check, name)(unattempted)


def test_matmul_intensity_wrong_answers():
    fails(check.matmul_intensity, lambda m, n, k, d: 2 * m * n * k / (m * k + k * n + m * n), "counted elements, not bytes")
    fails(check.matmul_intensity, lambda m, n, k, d: m * n * k / ((m * k + k * n + m * n) * elem(d)), "2 FLOPs")
    fails(check.matmul_intensity, lambda m, n, k, d: 2 * m * n * k / ((m * k + k * n) * elem(d)), "output C")
    fails(check.matmul_intensity, lambda m, n, k, d: "fast", "should return a number")
    fails(check.matmul_intensity, lambda m, n, k, d: 2 * m * n * k / ((m * k + k * n + m * n) * 4), "4 bytes per element for every dtype")
    import numpy as np

    check.matmul_intensity(lambda m, n, k, d: np.float32(roofline.matmul_intensity(m, n, k, d)))  # any real number


def test_softmax_intensity_wrong_answers():
    fails(check.softmax_intensity, lambda r, c, d: 5 / 2, "counted elements, not bytes")
    fails(check.softmax_intensity, lambda r, c, d: 5 / 8, "4 bytes per element for every dtype")
    fails(check.softmax_intensity, lambda r, c, d: 5 / elem(d), "written once too")


def test_naive_attention_wrong_answers():
    fails(check.naive_attention, lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -1) @ v, "1/√d")
    fails(check.naive_attention, lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -2) @ v,
          "last dimension")
    # wrong shape: returns the probabilities instead of multiplying by v
    msg = fails(check.naive_attention, lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -1),
                "shape (2, 3, 64, 64)", "expected (2, 3, 64, 32)")
    assert "Exercise 3 (naive attention)" in msg
    fails(check.naive_attention, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
          "by hand")

    def overflow(q, k, v):
        s = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
        return s / s.sum(-1, keepdim=True) @ v

    fails(check.naive_attention, overflow, "subtract the row maximum")


def test_online_softmax_without_rescale_fails():
    no_rescale = lambda x, b: blockwise_softmax(x, b, rescale=False)  # noqa: E731 - forgot l * exp(m_old - m_new)
    fails(check.online_softmax, no_rescale, "must be rescaled")


def test_online_softmax_must_work_blockwise():
    fails(check.online_softmax, lambda x, b: torch.softmax(x, -1), "calls softmax")
    two_pass = lambda x, b: torch.exp(x - x.max(-1, keepdim=True).values) / torch.exp(x - x.max(-1, keepdim=True).values).sum(-1, keepdim=True)  # noqa: E731
    fails(check.online_softmax, two_pass, "columns at once")


def test_online_softmax_starting_max_at_zero_fails():
    fails(check.online_softmax, lambda x, b: blockwise_softmax(x, b, m_start=0.0), "very negative rows")


def test_online_softmax_crash_is_reported_in_one_line():
    fails(check.online_softmax, lambda x, b: x[..., :b] * 0, "shape")
    fails(check.online_softmax, lambda x, b: 1 / 0, "your code raised ZeroDivisionError")


def test_naive_attention_is_judged_against_fp64_not_sdpa_rounding():
    exact = lambda q, k, v: naive_attention(q.double(), k.double(), v.double()).float()  # noqa: E731
    check.naive_attention(exact)  # a correct answer rounded differently from SDPA passes

    def in_place(q, k, v):
        q /= math.sqrt(q.shape[-1])  # modifies the caller's tensor: the check must not be fooled
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v

    check.naive_attention(in_place)


def test_naive_attention_transpose_hint():
    fails(check.naive_attention, lambda q, k, v: torch.softmax(q @ k.T, -1) @ v, "transpose(-2, -1)")


def test_torch_not_implemented_is_not_mistaken_for_the_placeholder():
    def raises(*a):
        raise NotImplementedError("aten::foo is not implemented for CPU")

    fails(check.naive_attention, raises, "NotImplementedError")


def test_flash_attention_must_run_in_the_kernel():
    fails(check.flash_attention, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
          "not in your Triton kernel")
    fails(check.flash_attention, naive_attention, "not in your Triton kernel")


@triton.jit
def _no_rescale_kernel(Q, K, V, O, N, sm_scale, D: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(1) * N * D
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * D + cols[None, :], mask=rows[:, None] < N, other=0.0)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for start in range(0, N, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        k = tl.load(K + base + keys[:, None] * D + cols[None, :], mask=keys[:, None] < N, other=0.0)
        v = tl.load(V + base + keys[:, None] * D + cols[None, :], mask=keys[:, None] < N, other=0.0)
        s = tl.where(keys[None, :] < N, tl.dot(q, tl.trans(k)) * sm_scale, float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m[:, None])
        l += tl.sum(p, axis=1)  # the plausible mistake: old l and acc are not rescaled
        acc += tl.dot(p.to(v.dtype), v)
    tl.store(O + base + rows[:, None] * D + cols[None, :], (acc / l[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None] < N)


@pytest.mark.parametrize("block", [32, 128], ids=["small tiles", "one tile for N<=128"])
def test_flash_kernel_without_rescale_fails(block):
    def learner(q, k, v):
        B, H, N, D = q.shape
        o = torch.empty_like(q)
        _no_rescale_kernel[(triton.cdiv(N, block), B * H)](q.contiguous(), k.contiguous(), v.contiguous(), o, N,
                                                           1 / math.sqrt(D), D=D, BLOCK=block)
        return o

    fails(check.flash_attention, learner, "max error", "rescale both")


def test_classify_wrong_answers():
    fails(check.classify_op, lambda f, b, p, bw, fl: "math" if f / b > 1 else "memory", "floor")
    fails(check.classify_op, lambda f, b, p, bw, fl: "framework overhead" if f < 1e6 else profiling.classify(f, b, p, bw, fl),
          "10^5 elements")
    fails(check.classify_op, lambda f, b, p, bw, fl: "framework overhead" if b < 1e6 else profiling.classify(f, b, p, bw, fl),
          "65,536")
    fails(check.classify_op, lambda f, b, p, bw, fl: profiling.classify(f, b, p, bw, fl) if f / p != b / bw else "memory",
          "tie")
    fails(check.classify_op, lambda f, b, p, bw, fl: "compute", "return one of")
    # comparing intensity with the ridge point is right, but forgets the launch floor
    fails(check.classify_op, lambda f, b, p, bw, fl: "math" if f / b >= p / bw else "memory", "floor")


def test_online_softmax_accepts_other_correct_blockwise_forms():
    def binary_max(x, block):  # torch.max(a, b) is elementwise, not a reduction
        return blockwise_softmax(x, block, combine=torch.max)

    def log_sum_exp(x, block):  # FlashAttention-2's form: a running log-sum-exp
        lse = torch.full(x.shape[:-1], float("-inf"), device=x.device)
        for s in range(0, x.shape[-1], block):
            lse = torch.logaddexp(lse, torch.logsumexp(x[..., s:s + block], dim=-1))
        return torch.exp(x - lse[..., None])

    def stacked_stats(x, block):  # per-block statistics first, combined afterwards
        blocks = x.split(block, dim=-1)
        maxes = torch.stack([b.amax(-1) for b in blocks], -1)
        m = maxes.amax(-1)
        l = torch.stack([torch.exp(b - m[..., None]).sum(-1) for b in blocks], -1).sum(-1)
        return torch.exp(x - m[..., None]) / l[..., None]

    for answer in (binary_max, log_sum_exp, stacked_stats):
        check.online_softmax(answer)


def test_online_softmax_library_shortcuts_fail():
    fails(check.online_softmax, lambda x, b: torch.special.softmax(x, -1), "calls softmax")
    fails(check.online_softmax, lambda x, b: torch.exp(x - torch.special.logsumexp(x, dim=-1, keepdim=True)), "columns at once")
    fails(check.online_softmax,
          lambda x, b: torch.exp(x - torch.amax(input=x, dim=-1, keepdim=True)) / torch.exp(x - torch.amax(input=x, dim=-1, keepdim=True)).sum(-1, keepdim=True),
          "columns at once")


def test_classify_sum_instead_of_max_fails():
    def summed(f, b, p, bw, fl):
        t_math, t_mem = f / p, b / bw
        if t_math + t_mem < fl:
            return "framework overhead"
        return "math" if t_math >= t_mem else "memory"

    fails(check.classify_op, summed, "not their sum")


def test_online_softmax_nan_on_a_fully_masked_first_block_fails():
    fails(check.online_softmax, lambda x, b: blockwise_softmax(x, b, masked_safe=False), "first block fully masked",
          "exp(−inf + inf)")


def test_online_softmax_must_run_on_the_device_of_its_input():
    fails(check.online_softmax, lambda x, b: blockwise_softmax(x, b, on_device=False), "device=x.device")


def test_dense_attention_written_from_the_formulas_passes():
    """The wrong answers below differ from this one by their mistake only (and it is not tiled: the
    checks grade the results and the interface, as CS336's tests do)."""
    check.flash_forward(dense_attention())
    check.flash_backward(dense_attention())


def test_lse_saved_as_max_only_fails_with_its_hint():
    fails(check.flash_forward, dense_attention(save_max=True), "row maximum", "m + log(l)")
    fails(check.flash_backward, dense_attention(save_max=True), "row maximum")


def test_scale_forgotten_in_ds_fails_with_its_hint():
    fails(check.flash_backward, dense_attention(scale_in_ds=False), "scale is forgotten in dS")


@pytest.mark.parametrize("delta", ["dO∘V", "dO·Vᵀ"])
def test_delta_from_v_instead_of_o_fails_with_its_hint(delta):
    fails(check.flash_backward, dense_attention(delta=delta), "D = rowsum(dO ∘ O)")


@pytest.mark.parametrize("diagonal", [-1, 1], ids=["diagonal excluded", "one key too many"])
def test_causal_mask_off_by_one_fails_with_its_hint(diagonal):
    fails(check.flash_forward, dense_attention(diagonal=diagonal), "causal mask is off by one")
    fails(check.flash_backward, dense_attention(diagonal=diagonal), "causal mask is off by one")


def test_fa2_interface_mistakes_fail_in_one_line():
    def plain(q, k, v, is_causal=False):  # a function, not an autograd Function: no grad_fn of its own
        with torch.no_grad():
            return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v

    fails(check.flash_forward, plain, "no grad_fn")

    fails(check.flash_forward, dense_attention(save_row_sums=True), "saved 2 tensors of shape")
    fails(check.flash_forward, lambda q, k, v, c: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c),
          "not your Function's")

    class ThreeGrads(dense_attention()):
        @staticmethod
        def backward(ctx, do):
            return dense_attention().backward(ctx, do)[:3]

    fails(check.flash_backward, ThreeGrads, "(dQ, dK, dV, None)")


def test_triton_backward_check_wants_the_math_in_kernels():
    fails(check.flash_backward_triton, FlashAttentionPytorch, "ran in PyTorch")
