"""An inference engine beside torch: the decode model exported to ONNX and run by ONNX Runtime.

A serving stack rarely runs the training framework's eager code. It hands the model to an
*inference engine*: a graph is exported once (ONNX, https://onnx.ai: operators plus weights in one
file), then the engine optimises that graph for the machine it runs on (fusing operators, picking
kernels, quantizing) and executes it without Python in the loop. This module does that with ONNX
Runtime (https://onnxruntime.ai) on the Unit 4 decode model and measures it beside torch's own
routes, from one measurement:

* **Export** (:func:`export`): ``torch.onnx.export(..., dynamo=True)`` traces the model's forward at
  one fixed shape (``tokens`` int64 ``(batch, seq_len)`` → logits float32 ``(batch, seq_len, vocab)``)
  into an ONNX graph; the dynamo exporter needs the ``onnxscript`` package. The uncached forward is
  exported: the KV cache's in-place writes (``index_copy_``) are state, which an ONNX graph can
  only take as extra inputs and outputs.
* **Dynamic int8** (:func:`quantize_int8`): ``onnxruntime.quantization.quantize_dynamic`` stores
  every ``MatMul`` weight as int8 (one scale and zero point per tensor, ``QuantType.QInt8``) and
  quantizes the activations on the fly at each call, so the matrix multiplies run in integer
  arithmetic (``DynamicQuantizeLinear`` + ``MatMulInteger``; VNNI/AMX instructions on a recent
  x86 CPU). The course's own int8 (:mod:`teraflops.compilation.quantization`) is *weight-only*:
  int8 in memory, converted back to float for the multiply.
* **The comparison** (:func:`compare`): torch eager fp32 (the reference), ``torch.compile``, the
  course's int8, ONNX Runtime fp32 and ONNX Runtime dynamic int8, each timed on the same tokens on
  the CPU, with its logits' largest difference from eager fp32 and its weight bytes; then ONNX
  Runtime's TensorRT or CUDA execution provider where this onnxruntime build has one and a GPU is
  present, else a row that says why not (:func:`gpu_provider`).

What TensorRT adds on a GPU (NVIDIA, https://developer.nvidia.com/tensorrt; not installable on the
course's CPU machines): it compiles the ONNX graph into an *engine* for one GPU model, choosing
among kernel implementations by timing them on that card, fusing layers, and running matrix
multiplies on Tensor Cores in FP16, BF16, INT8 (with calibration or quantize/dequantize nodes) or
FP8 on Hopper. ONNX Runtime reaches it as the ``TensorrtExecutionProvider`` (the
``onnxruntime-gpu`` wheel plus NVIDIA's TensorRT libraries), torch as ``torch_tensorrt``.

Nothing here downloads anything: the model is exported to a temporary folder and deleted after.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from teraflops.compilation import quantization
from teraflops.tables import table
from teraflops.timing import benchmark

__all__ = ["why_not", "export", "quantize_int8", "initializer_stats", "InitializerStats", "session", "gpu_provider",
           "EngineRow", "compare", "engine_table"]

_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def why_not() -> str:
    """``""`` when ONNX Runtime, ``onnx`` and ``onnxscript`` (the dynamo exporter's dependency) all
    import, else a one-line reason naming the missing package and the command that installs it."""
    for name in ("onnxruntime", "onnx", "onnxscript"):
        try:
            __import__(name)
        except ImportError as e:
            return f"{name} is not installed ({type(e).__name__}); pip install onnxruntime onnxscript"
    return ""


def _quiet():
    """The exporter and the quantizer log at WARNING for things that do not concern this model
    (torchvision ops it skips registering, a suggestion to pre-process): silence them here."""
    return quantization.quiet_logs("torch.onnx", "torch.onnx._internal.exporter._registration", "root", "onnxscript")


def export(model: nn.Module, tokens: torch.Tensor, path) -> Path:
    """Export ``model(tokens)`` to an ONNX file at ``path`` and return the path.

    Args:
        model: any module whose ``forward(tokens)`` returns float logits ``(batch, seq_len, vocab)``;
            exported as it is (move it to the CPU and float32 first for ONNX Runtime's CPU provider).
        tokens: int64 ``(batch, seq_len)``: the graph is specialised to this shape.
        path: the ``.onnx`` file to write (weights inside it).

    The dynamo exporter (``torch.onnx.export(..., dynamo=True)``, which needs ``onnxscript``) writes
    shape entries (``value_info``) for the weights as well as for the activations; the shape
    inference of ``quantize_dynamic`` has rejected those entries for initializers in some
    onnx/onnxruntime pairs (``ShapeInferenceError``), so they are dropped: ONNX Runtime recomputes
    every shape when it loads the graph.
    """
    import onnx

    path = Path(path)
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(model.eval(), (tokens,), dynamo=True, verbose=False, optimize=True)
        program.save(str(path))
    proto = onnx.load(str(path))
    weights = {init.name for init in proto.graph.initializer}
    kept = [vi for vi in proto.graph.value_info if vi.name not in weights]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(kept)
    onnx.save(proto, str(path))
    return path


def quantize_int8(src, dst) -> Path:
    """``onnxruntime.quantization.quantize_dynamic`` of the ONNX file ``src`` into ``dst``: every
    ``MatMul`` whose second input is a weight gets an int8 weight (``QuantType.QInt8``, one scale
    and one zero point per tensor) and runs as ``MatMulInteger`` on activations quantized at run
    time. Returns ``Path(dst)``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    return Path(dst)


@dataclass(frozen=True)
class InitializerStats:
    """The weights stored in an ONNX file (its initializers), from :func:`initializer_stats`.

    Attributes:
        count: initializers of each ONNX element type, by name (``{"float": 23, "int8": 30, ...}``).
        nbytes: bytes of each element type's initializers (elements × element size).
        matrices_8bit: int8 or uint8 initializers with two dimensions: the quantized weight
            matrices (``quantize_dynamic`` stores ``MatMul`` weights as int8 and the embedding table
            of a ``Gather`` as uint8; the 0-d ones are zero points).
    """

    count: dict[str, int]
    nbytes: dict[str, int]
    matrices_8bit: int

    @property
    def total_bytes(self) -> int:
        """All initializers' bytes: what the engine keeps in memory as weights."""
        return sum(self.nbytes.values())


def initializer_stats(path) -> InitializerStats:
    """Count the initializers of the ONNX file ``path`` by element type, with their bytes."""
    import numpy as np
    import onnx
    from onnx import helper

    count: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    matrices_8bit = 0
    for init in onnx.load(str(path)).graph.initializer:
        np_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
        name = onnx.TensorProto.DataType.Name(init.data_type).lower()
        elements = int(np.prod(init.dims)) if len(init.dims) else 1
        count[name] = count.get(name, 0) + 1
        nbytes[name] = nbytes.get(name, 0) + elements * np_dtype.itemsize
        matrices_8bit += name in ("int8", "uint8") and len(init.dims) == 2
    return InitializerStats(count, nbytes, matrices_8bit)


def session(path, providers=("CPUExecutionProvider",), threads: int | None = None):
    """An ``onnxruntime.InferenceSession`` on ``path`` with ``providers`` (in order of preference)
    and ``threads`` intra-op threads (default ``torch.get_num_threads()``, so that the engine and
    torch use the same cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))


def gpu_provider() -> tuple[str | None, str]:
    """``(provider, "")``: ONNX Runtime's TensorRT execution provider if this build has it, else its
    CUDA one, when a CUDA GPU is present; ``(None, reason)`` otherwise, the reason in one line."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU here: ONNX Runtime's TensorRT/CUDA execution providers need one"
    import onnxruntime as ort

    available = ort.get_available_providers()
    for name in _GPU_PROVIDERS:
        if name in available:
            return name, ""
    return None, (f"this onnxruntime {ort.__version__} build has no TensorRT/CUDA execution provider "
                  "(the onnxruntime-gpu wheel has them; TensorRT's libraries come from NVIDIA's own index)")


@dataclass(frozen=True)
class EngineRow:
    """One route of :func:`compare`.

    Attributes:
        variant: what ran, e.g. ``"onnxruntime int8"``.
        engine: ``"torch"`` or ``"onnxruntime"`` (with the execution provider).
        tokens: tokens per forward (``batch × seq_len``).
        seconds: median seconds per forward (:func:`teraflops.timing.benchmark`); ``None`` if skipped.
        max_error: max |logit − eager fp32 logit| over every position and vocabulary entry.
        weight_bytes: bytes of the weights the route keeps (torch: parameters and buffers,
            :func:`teraflops.compilation.quantization.weight_bytes`; ONNX: initializers).
        matrices_8bit: weight matrices (two dimensions) stored in 8 bits (int8 or uint8).
        note: why a row was skipped, or what the route is.
    """

    variant: str
    engine: str
    tokens: int
    seconds: float | None = None
    max_error: float | None = None
    weight_bytes: int | None = None
    matrices_8bit: int | None = None
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second of forward passes; ``None`` for a skipped row."""
        return self.tokens / self.seconds if self.seconds else None


def _max_error(logits, reference: torch.Tensor) -> float:
    return (torch.as_tensor(logits).float() - reference).abs().max().item()


def _torch_row(variant, model, tokens, reference, min_run_time, note) -> EngineRow:
    with torch.no_grad():
        logits = model(tokens)
        seconds = benchmark(lambda: model(tokens), min_run_time=min_run_time, warmup=2).median
    tensors = list(model.parameters()) + list(model.buffers())
    matrices = sum(t.dim() == 2 and t.dtype in (torch.int8, torch.uint8) for t in tensors)
    return EngineRow(variant, "torch", tokens.numel(), seconds, _max_error(logits, reference),
                     quantization.weight_bytes(model), matrices, note)


def _ort_row(variant, path, tokens, reference, min_run_time, providers, note) -> EngineRow:
    sess = session(path, providers)
    feed = {sess.get_inputs()[0].name: tokens.numpy()}
    logits = sess.run(None, feed)[0]
    seconds = benchmark(lambda: sess.run(None, feed), min_run_time=min_run_time, warmup=2).median
    engine = f"onnxruntime ({sess.get_providers()[0]})"
    stats = initializer_stats(path)
    return EngineRow(variant, engine, tokens.numel(), seconds, _max_error(logits, reference),
                     stats.total_bytes, stats.matrices_8bit, note)


def _gpu_row(path, tokens, reference, min_run_time) -> EngineRow:
    provider, reason = gpu_provider()
    if provider is None:
        return EngineRow("onnxruntime GPU", "onnxruntime", tokens.numel(), note=f"skipped: {reason}")
    try:
        return _ort_row("onnxruntime GPU", path, tokens, reference, min_run_time,
                        (provider, "CPUExecutionProvider"), f"{provider}, fp32 graph")
    except Exception as e:  # a provider listed by the wheel whose libraries are missing fails here
        why = (str(e).splitlines() or [""])[0][:120]
        return EngineRow("onnxruntime GPU", "onnxruntime", tokens.numel(),
                         note=f"skipped: {provider} did not start ({type(e).__name__}: {why})")


def compare(model: nn.Module, tokens: torch.Tensor, min_run_time: float = 0.3, with_compile: bool = True,
            folder=None) -> list[EngineRow]:
    """Every route on the same forward pass, on the CPU, float32 in and out.

    Args:
        model: a language model, ``forward(tokens)`` → logits ``(batch, seq_len, vocab)`` (e.g.
            :func:`teraflops.compilation.decode.decode_model`); a float32 CPU copy is measured,
            the original is untouched.
        tokens: int64 ``(batch, seq_len)``; the ONNX graphs are exported at this shape.
        min_run_time: seconds of timing per route after warm-up.
        with_compile: include ``torch.compile`` (default mode; its compile is paid before timing).
        folder: where the ONNX files go (default a temporary folder, deleted afterwards).

    Returns rows in this order: torch eager fp32 (the reference: its error is 0), torch.compile,
    the course's int8 (weight-only, ``quantization.quantize_model(.., "int8")``), onnxruntime fp32,
    onnxruntime int8 (dynamic), onnxruntime GPU (timed, or skipped with its reason). Raises
    ``RuntimeError`` with :func:`why_not`'s line when ONNX Runtime cannot run here.
    """
    reason = why_not()
    if reason:
        raise RuntimeError(reason)
    model = copy.deepcopy(model).float().cpu().eval()
    tokens = tokens.cpu()
    with torch.no_grad():
        reference = model(tokens).float()
    rows = [_torch_row("torch eager fp32", model, tokens, reference, min_run_time, "reference")]
    if with_compile:
        compiled = torch.compile(model, dynamic=False)
        rows.append(_torch_row("torch.compile fp32", compiled, tokens, reference, min_run_time, "Inductor, default mode"))
    int8 = quantization.quantize_model(model, "int8")
    rows.append(_torch_row("course int8", int8, tokens, reference, min_run_time, "weight-only Int8Linear"))
    with tempfile.TemporaryDirectory(prefix="teraflops-onnx-") if folder is None else contextlib.nullcontext(folder) as d:
        fp32_path = export(model, tokens, Path(d) / "model.onnx")
        int8_path = quantize_int8(fp32_path, Path(d) / "model.int8.onnx")
        cpu = ("CPUExecutionProvider",)
        rows.append(_ort_row("onnxruntime fp32", fp32_path, tokens, reference, min_run_time, cpu, "exported graph"))
        rows.append(_ort_row("onnxruntime int8", int8_path, tokens, reference, min_run_time, cpu,
                             "quantize_dynamic, MatMulInteger"))
        rows.append(_gpu_row(fp32_path, tokens, reference, min_run_time))
    return rows


def engine_table(rows: list[EngineRow]) -> str:
    """:func:`compare`'s rows as a table: ms per forward, tokens/s, × eager, max |Δlogit|, MB of
    weights (1e6 bytes), weight matrices stored in 8 bits, engine and note; a skipped row shows its reason in the note."""
    eager = rows[0].seconds
    body = [(r.variant, r.seconds * 1e3 if r.seconds else "-", r.tokens_per_s or "-",
             eager / r.seconds if r.seconds and eager else "-",
             "-" if r.max_error is None else r.max_error,
             "-" if r.weight_bytes is None else r.weight_bytes / 1e6,
             "-" if r.matrices_8bit is None else r.matrices_8bit, r.engine, r.note) for r in rows]
    return table(body, ["variant", "ms/forward", "tokens/s", "× eager", "max |Δlogit|", "weights MB", "8-bit matrices",
                        "engine", "note"])
