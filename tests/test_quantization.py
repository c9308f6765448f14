"""Unit 4 §4 quantization: per-channel int8 by hand, Int8Linear, whole-model modes (the lab's checks are in
test_grading_unit04).

One small GPT is trained once per module (100 Adam steps, ~10-20 s on 2 busy CPU cores) so that the
accuracy tests compare meaningful logits.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from teraflops.grading.unit04 import _badly_scaled
from teraflops.compilation.quantization import (Int8Linear, accuracy, compare, dequantize, quantization_table,
    quantize_model, quantize_per_channel, quantize_per_tensor, torchao_status, train_small_gpt, weight_bytes)


@pytest.fixture(scope="module")
def trained():
    return train_small_gpt(steps=100)


def test_round_trip_within_half_a_step():
    w = torch.randn(48, 96) * 3
    w[5] = 0  # an all-zero row must not give NaN
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (48,) and s.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    err = (dequantize(q, s) - w).abs()
    assert torch.all(err <= s[:, None] / 2 * (1 + 1e-5))
    assert torch.all(dequantize(q, s)[5] == 0)


def test_per_channel_beats_per_tensor_on_rows_of_different_magnitude():
    w = _badly_scaled()
    rel = lambda wq: ((wq - w).norm(dim=1) / w.norm(dim=1)).max().item()  # noqa: E731
    per_channel = rel(dequantize(*quantize_per_channel(w)))
    per_tensor = rel(dequantize(*quantize_per_tensor(w)))
    assert per_channel < 0.01 and per_tensor > 0.5, (per_channel, per_tensor)


def test_int8_linear_matches_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(4, 7, 64)
    q8 = Int8Linear.from_float(lin)
    want = lin(x)
    got = q8(x)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    # the two forms of the weight-only matmul agree: scale the output or dequantize the weight
    via_weight = x @ dequantize(q8.qweight, q8.scale).T + lin.bias
    torch.testing.assert_close(got, via_weight, rtol=1e-5, atol=1e-5)


def test_int8_bytes_at_most_027_of_fp32(trained):
    model, _ = trained
    fp32, int8 = weight_bytes(quantize_model(model, "fp32")), weight_bytes(quantize_model(model, "int8"))
    assert fp32 == 4 * model.num_params()
    assert int8 <= 0.27 * fp32, int8 / fp32


def test_int8_top1_agreement_on_eval_text(trained):
    model, (x, y) = trained
    acc = accuracy(quantize_model(model, "fp32"), quantize_model(model, "int8"), x, y)
    assert acc["top1_agreement"] >= 0.95, acc
    assert acc["reference_perplexity"] < 100  # trained: uniform guessing is 256
    assert abs(acc["perplexity"] / acc["reference_perplexity"] - 1) < 0.05


def test_tied_head_stays_tied_in_int8(trained):
    model, _ = trained
    m = quantize_model(model, "int8")
    assert m.head.qweight is m.tok.qweight and m.head.scale is m.tok.scale
    assert model.head.weight is model.tok.weight  # the original is untouched


def test_int8_mode_takes_the_labs_functions(trained):
    model, (x, y) = trained
    calls = []

    def linear_fn(x, q, s, b):
        calls.append(q.shape)
        return F.linear(x, dequantize(q, s), b)

    mine = quantize_model(model, "int8", quantize_fn=quantize_per_channel, linear_fn=linear_fn)
    ref = quantize_model(model, "int8")
    assert torch.allclose(mine(x[:2]), ref(x[:2]), atol=1e-4) and calls
    assert weight_bytes(mine) == weight_bytes(ref)
    with pytest.raises(ValueError, match="int8"):
        quantize_model(model, "fp16", linear_fn=linear_fn)


def test_compare_table_side_by_side(trained):
    model, (x, y) = trained
    rows = compare(model, x[:8], y[:8], modes=("fp32", "int8"), min_run_time=0.05)
    assert [r["mode"] for r in rows] == ["fp32", "int8"]
    assert rows[0]["ratio"] == 1 and rows[0]["max_logit_error"] == 0 and rows[1]["tokens_per_s"] > 0
    text = quantization_table(rows)
    assert "top-1 agree" in text and "int8" in text


def test_torchao_route(trained):
    reason = torchao_status()
    if reason:
        pytest.skip(reason)
    model, (x, y) = trained
    m = quantize_model(model, "torchao")
    w = m.blocks[0].fc1.weight  # torchao's Int8Tensor: int8 qdata + per-row scale inside
    assert hasattr(w, "__tensor_flatten__") and getattr(w, w.__tensor_flatten__()[0][0]).dtype == torch.int8
    assert m.head.weight is m.tok.weight
    ratio = weight_bytes(m) / weight_bytes(quantize_model(model, "fp32"))
    acc = accuracy(quantize_model(model, "fp32"), m, x, y)
    assert ratio <= 0.27 and acc["top1_agreement"] >= 0.95, (ratio, acc)
    hand = quantize_model(model, "int8")(x)
    # same scheme; torchao's scale is max/127.5, not max/127, so a few weights differ by one step
    assert (m(x) - hand).abs().max() < 0.25
