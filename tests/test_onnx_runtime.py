"""ONNX Runtime beside torch (compilation.onnx_runtime): export and run equal within float32 rounding on a
tiny Llama, quantize_dynamic's int8 weights counted and weighed, the GPU row's skip line, and the reason
given when onnxruntime is missing. Never speed: timings are only checked to be positive and finite."""

import math
import sys

import pytest
import torch
import torch.nn as nn

from teraflops.compilation import onnx_runtime
from teraflops.models import Llama

needs_ort = pytest.mark.skipif(bool(onnx_runtime.why_not()), reason=onnx_runtime.why_not() or "ok")

VOCAB, D, LAYERS, HEADS = 64, 32, 2, 2


def _tiny():
    return Llama(VOCAB, D, LAYERS, HEADS, max_seq_len=16, seed=0).eval()


def _tokens():
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))


def test_why_not_names_the_missing_package_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # an import of it now raises ImportError
    reason = onnx_runtime.why_not()
    assert reason.startswith("onnxruntime is not installed") and "pip install onnxruntime onnxscript" in reason
    assert "\n" not in reason
    with pytest.raises(RuntimeError, match="onnxruntime is not installed"):
        onnx_runtime.compare(_tiny(), _tokens())


def test_gpu_row_says_why_not_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    provider, reason = onnx_runtime.gpu_provider()
    assert provider is None and reason.startswith("no CUDA GPU here") and "\n" not in reason


@needs_ort
def test_gpu_row_without_a_gpu_provider_in_the_wheel(monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    provider, reason = onnx_runtime.gpu_provider()
    assert provider is None and "no TensorRT/CUDA execution provider" in reason
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "TensorrtExecutionProvider"])
    assert onnx_runtime.gpu_provider() == ("TensorrtExecutionProvider", "")  # TensorRT first when both exist


def test_the_table_shows_a_skipped_row_with_its_reason():
    rows = [onnx_runtime.EngineRow("torch eager fp32", "torch", 10, 0.01, 0.0, 4_000_000, 0, "reference"),
            onnx_runtime.EngineRow("onnxruntime GPU", "onnxruntime", 10, note="skipped: no CUDA GPU here")]
    text = onnx_runtime.engine_table(rows)
    assert "skipped: no CUDA GPU here" in text and "1,000" in text  # 10 tokens in 10 ms
    assert rows[1].tokens_per_s is None and rows[0].tokens_per_s == pytest.approx(1000)


@pytest.mark.slow
@needs_ort
def test_export_runs_equal_and_dynamic_int8_stores_every_matrix_in_8_bits(tmp_path):
    model, tokens = _tiny(), _tokens()
    fp32 = onnx_runtime.export(model, tokens, tmp_path / "m.onnx")
    int8 = onnx_runtime.quantize_int8(fp32, tmp_path / "m.int8.onnx")
    with torch.no_grad():
        ref = model(tokens).numpy()
    sess = onnx_runtime.session(fp32)
    got = sess.run(None, {sess.get_inputs()[0].name: tokens.numpy()})[0]
    assert got.shape == (2, 5, VOCAB) and got.dtype == ref.dtype
    assert abs(got - ref).max() <= 1e-5  # float32 in another summation order, logits of order 0.1

    before, after = onnx_runtime.initializer_stats(fp32), onnx_runtime.initializer_stats(int8)
    matrix_elements = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    # every matrix in float32 (the exporter folds the norms' equal weights into one initializer)
    assert before.matrices_8bit == 0 and before.nbytes["float"] >= 4 * matrix_elements
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())  # 7 per block + the head
    assert after.count["int8"] == 2 * linears  # each MatMul weight: int8 matrix and its 0-d zero point
    assert after.matrices_8bit == linears + 1  # and the embedding table, uint8 for its Gather
    assert after.nbytes["int8"] + after.nbytes["uint8"] == matrix_elements + linears + 1  # a byte per zero point
    assert after.total_bytes <= 0.27 * before.total_bytes

    sess8 = onnx_runtime.session(int8)
    got8 = sess8.run(None, {sess8.get_inputs()[0].name: tokens.numpy()})[0]
    assert got8.shape == got.shape and 0 < abs(got8 - ref).max() < 0.1 * abs(ref).max()  # measured ~2 %


@pytest.mark.slow
@needs_ort
def test_compare_rows_in_order_with_errors_bytes_and_a_reference_of_zero_error():
    rows = onnx_runtime.compare(_tiny(), _tokens(), min_run_time=0.01, with_compile=False)
    assert [r.variant for r in rows] == ["torch eager fp32", "course int8", "onnxruntime fp32", "onnxruntime int8",
                                        "onnxruntime GPU"]
    eager, course, ort32, ort8, gpu = rows
    assert eager.max_error == 0 and ort32.max_error <= 1e-5
    assert all(r.seconds > 0 and math.isfinite(r.tokens_per_s) and r.tokens == 10 for r in rows[:4])
    assert course.matrices_8bit == ort8.matrices_8bit == 7 * LAYERS + 2 and eager.matrices_8bit == ort32.matrices_8bit == 0
    assert ort8.weight_bytes < 0.27 * ort32.weight_bytes and course.weight_bytes < 0.3 * eager.weight_bytes
    if not torch.cuda.is_available():
        assert gpu.seconds is None and gpu.note.startswith("skipped: no CUDA GPU here")
