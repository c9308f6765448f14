"""Unit 4 §4: weight quantization, fp32 → bf16/fp16 → int8 weight-only, by hand and by library.

The mechanism (what the lab has learners write; these are the references):

* **Per-channel symmetric int8.** For a weight ``w`` float ``[out, in]`` each output row ``o`` gets
  one scale ``s[o] = max_i |w[o, i]| / 127`` (float32) and ``q[o, i] = round(w[o, i] / s[o])``
  clamped to ``[-127, 127]`` (int8; -128 is left out so that the range is symmetric). Dequantized
  ``q * s`` differs from ``w`` by at most ``s[o] / 2`` per element (rounding to the nearest step).
* **Why per channel.** With one scale for the whole matrix (:func:`quantize_per_tensor`), a row
  whose values are 100× smaller than the largest row has most of its values rounded to 0 or ±1:
  its relative error is 100× larger. Rows of a trained layer differ in magnitude, so the per-tensor
  version is the plausible mistake the check catches.
* **Weight-only int8 linear** (:class:`Int8Linear`): the weight is stored as int8 plus one float32
  scale per output channel; activations stay in float. ``y = x @ (q * s[:, None]).T + b`` equals
  ``(x @ q.T) * s + b`` because ``s[o]`` is a constant along the summed input dimension ``i``:
  ``Σ_i x_i q[o,i] s[o] = s[o] Σ_i x_i q[o,i]``. The second form scales the small output
  ``[..., out]`` rather than the ``[out, in]`` weight. On a GPU during decode (batch 1) the gain is
  the weight bytes read from memory (¼ of fp32); here on a CPU the int8 → float conversion costs
  time, so the measured tokens/s says nothing about GPU decode speed (Unit 4 §2's roofline does).

The library route is torchao (``torchao.quantization.quantize_`` with ``Int8WeightOnlyConfig``;
https://github.com/pytorch/ao, 0.18): it stores the same thing, an int8 ``qdata`` and a float32
per-row ``scale`` (plus an unused int8 ``zero_point`` per row), inside a tensor subclass
(``Int8Tensor``). Its scale is ``max|w_row| / 127.5`` (range [-128, 127]) rather than ``/ 127``, so
about one weight in a few hundred lands one int8 step away from the hand-made one. :func:`compare` measures both next to
fp32, bf16 and fp16: weight bytes, max logit error, top-1 agreement and perplexity against fp32 on a
generated evaluation text, and forward-pass tokens/s.

What the int8 modes count (both routes the same): every ``nn.Linear`` weight and both embedding
tables are int8 with per-row float32 scales; the GPT's output head stays tied to the token
embedding (one int8 matrix, one scale vector: an embedding row is a head output channel, so the
per-row scale serves both). Biases and LayerNorm parameters stay float32 (a few KB). Without
quantizing the embeddings, the default small GPT's int8/fp32 ratio would be ≈0.35, because its
fp32 embeddings are a fifth of its weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from teraflops.data import markov_tokens
from teraflops.errors import DTypeError, ShapeError
from teraflops.models import GPT, lm_loss
from teraflops.tables import table
from teraflops.timing import benchmark

QMAX = 127  # symmetric int8 range [-127, 127]
MODES = ("fp32", "bf16", "fp16", "int8", "torchao")


# --- quantize / dequantize -----------------------------------------------------------------------

def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ShapeError(f"a weight to quantize must be a 2-D tensor [out, in], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}. "
                         "Hint: pass linear.weight, not the module")
    if not w.is_floating_point():
        raise DTypeError(f"a weight to quantize must be floating point, got {w.dtype}. "
                         "Hint: it is already quantized if it is int8")


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization.

    Args:
        w: float ``[out, in]`` (any float dtype).

    Returns:
        ``(q, scale)``: ``q`` int8 ``[out, in]`` in ``[-127, 127]``; ``scale`` float32 ``[out]`` with
        ``scale[o] = max|w[o, :]| / 127`` (an all-zero row gets scale 1.0, so ``q`` is 0 there
        instead of 0/0 = NaN). ``dequantize(q, scale)`` is within ``scale[o] / 2`` of ``w``.
    """
    _check_weight(w)
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale for the whole matrix: the mistake per-channel avoids.

    Returns ``(q, scale)``: ``q`` int8 ``[out, in]``; ``scale`` float32 0-d, ``max|w| / 127``.
    """
    _check_weight(w)
    w = w.detach().float()
    scale = w.abs().amax() / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` as ``dtype``: ``q`` int8 ``[out, in]``; ``scale`` float ``[out]`` (per channel)
    or 0-d (per tensor)."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if scale.dim() == 1:
        if scale.shape[0] != q.shape[0]:
            raise ShapeError(f"per-channel scale has {scale.shape[0]} entries but q has {q.shape[0]} rows. "
                             "Hint: one scale per output channel (row), i.e. reduce over dim=1")
        scale = scale[:, None]
    return (q.float() * scale).to(dtype)


# --- int8 weight-only modules --------------------------------------------------------------------

class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear``: int8 weight, float32 per-output-channel scales, float32 bias.

    Buffers: ``qweight`` int8 ``[out, in]``, ``scale`` float32 ``[out]``, ``bias`` float32 ``[out]``
    or ``None``. ``forward(x)``: ``x`` float ``(..., in)`` → ``(..., out)`` in ``x.dtype``, computed as
    ``(x @ qweight.T) * scale + bias`` (equal to ``x @ dequantize(qweight, scale).T + bias``; see the
    module docstring), or by ``linear_fn(x, qweight, scale, bias)`` when one is given (the lab's).
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 linear_fn: Callable | None = None):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise DTypeError(f"Int8Linear needs an int8 [out, in] weight, got {qweight.dtype} {tuple(qweight.shape)}")
        if scale.shape != (qweight.shape[0],):
            raise ShapeError(f"Int8Linear needs one scale per output channel, shape ({qweight.shape[0]},), "
                             f"got {tuple(scale.shape)}. Hint: reduce |w| over dim=1 (the input dimension)")
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.linear_fn = linear_fn

    @classmethod
    def from_float(cls, linear: nn.Linear, quantize_fn: Callable = None, linear_fn: Callable | None = None) -> "Int8Linear":
        """Quantize ``linear.weight`` per output channel (``quantize_fn``, default
        :func:`quantize_per_channel`); the bias is kept in float32."""
        q, s = (quantize_fn or quantize_per_channel)(linear.weight.detach())
        return cls(q, s, linear.bias, linear_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"Int8Linear expects (..., {self.in_features}), got {tuple(x.shape)}")
        if self.linear_fn is not None:
            return self.linear_fn(x, self.qweight, self.scale, self.bias)
        y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """Embedding table stored as int8 rows with a float32 scale per row (row = one token's vector).

    ``forward(ids)``: int64 ``(...)`` → float32 ``(..., dim)``: ``qweight[ids] * scale[ids, None]``.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_float(cls, emb: nn.Embedding, quantize_fn: Callable = None) -> "Int8Embedding":
        return cls(*(quantize_fn or quantize_per_channel)(emb.weight.detach()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.scale[ids].unsqueeze(-1)


# --- whole models ---------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_logs(*names: str):
    """Loggers ``names`` (``"root"``: the root logger) at ERROR and Python warnings ignored inside the block,
    as they were afterwards: the libraries this unit drives (torchao, the ONNX exporter and quantizer) log
    at WARNING about things that do not concern the course's model."""
    logs = [logging.getLogger(n if n != "root" else None) for n in names]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _import_torchao():
    """Import torchao quietly (its CUDA-only extensions log 'Failed to load' on a CPU machine)."""
    with quiet_logs("torchao", "torch.utils._pytree"):
        import torchao.quantization as tq
    return tq


def torchao_status() -> str:
    """``""`` if torchao's int8 weight-only route can run here, else a one-line reason."""
    try:
        tq = _import_torchao()
        tq.Int8WeightOnlyConfig  # noqa: B018
    except Exception as e:  # ImportError, or an API that moved
        why = (str(e).splitlines() or [""])[0][:120]
        return f"torchao int8 weight-only unavailable ({type(e).__name__}: {why}); pip install torchao"
    return ""


def _swap_int8(module: nn.Module, shared: dict, linear_fn: Callable | None) -> None:
    """Replace every nn.Linear/nn.Embedding under ``module``; ``shared``: id(weight) → (q, scale),
    filled with the embeddings first, so that a tied head reuses its embedding's int8 rows."""
    for name, child in module.named_children():
        if isinstance(child, (nn.Linear, nn.Embedding)):
            key = id(child.weight)
            if key not in shared:
                shared[key] = shared["quantize_fn"](child.weight.detach())
            q, s = shared[key]
            setattr(module, name, Int8Linear(q, s, child.bias, linear_fn) if isinstance(child, nn.Linear)
                    else Int8Embedding(q, s))
        else:
            _swap_int8(child, shared, linear_fn)


def _embeddings_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return sorted(model.named_modules(), key=lambda nm: not isinstance(nm[1], nn.Embedding))


def quantize_model(model: nn.Module, mode: str, *, quantize_fn: Callable | None = None,
                   linear_fn: Callable | None = None) -> nn.Module:
    """A quantized copy of ``model`` (the original is untouched), in eval mode.

    ``quantize_fn(w) -> (q, scale)`` and ``linear_fn(x, q, scale, bias) -> y`` replace the hand-made
    route's :func:`quantize_per_channel` and matmul (``"int8"`` mode only; the lab passes its own).

    Modes:
        ``"fp32"``: a float32 copy (the reference). ``"bf16"`` / ``"fp16"``: every parameter cast
        (CPUs run both; without AVX-512 BF16/FP16 units they are slower than fp32, which the
        tokens/s column shows). ``"int8"``: the hand-made route, :class:`Int8Linear` for every
        ``nn.Linear`` and :class:`Int8Embedding` for every ``nn.Embedding``, ties kept (module
        docstring). ``"torchao"``: ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())``
        on the same modules, then the tied head re-pointed at the token embedding's int8 tensor.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "int8" and (quantize_fn is not None or linear_fn is not None):
        raise ValueError(f"quantize_fn and linear_fn are for mode 'int8', not {mode!r}")
    m = copy.deepcopy(model).eval()
    if mode in ("fp32", "bf16", "fp16"):
        return m.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[mode])
    m = m.float()
    if mode == "int8":
        quantize_fn = quantize_fn or quantize_per_channel
        if isinstance(m, nn.Linear):
            return Int8Linear.from_float(m, quantize_fn, linear_fn)
        shared: dict = {"quantize_fn": quantize_fn}
        for _, mod in _embeddings_first(m):  # embeddings first: a tied head reuses their int8 rows
            if isinstance(mod, nn.Embedding) and id(mod.weight) not in shared:
                shared[id(mod.weight)] = quantize_fn(mod.weight.detach())
        _swap_int8(m, shared, linear_fn)
        return m
    reason = torchao_status()
    if reason:
        raise RuntimeError(reason)
    tq = _import_torchao()
    owners: dict[int, str] = {}  # id(weight) → first module holding it (embedding first)
    ties: list[tuple[nn.Module, str]] = []
    for name, mod in _embeddings_first(m):
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            if id(mod.weight) in owners:
                ties.append((mod, owners[id(mod.weight)]))
            else:
                owners[id(mod.weight)] = name
    tied = {id(mod) for mod, _ in ties}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_(m, tq.Int8WeightOnlyConfig(),
                     filter_fn=lambda mod, fqn: isinstance(mod, (nn.Linear, nn.Embedding)) and id(mod) not in tied)
    for mod, owner in ties:
        mod.weight = m.get_submodule(owner).weight
    return m


def _tensor_bytes(t: torch.Tensor) -> int:
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()  # torchao's Int8Tensor: qdata int8, scale fp32, ...
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied tensors counted once).

    int8 weights count 1 byte per element plus their float32 scales; torchao tensors are counted
    through their inner tensors (``qdata``, ``scale``, ``zero_point``). Biases and LayerNorm
    parameters are included. Unit: bytes (GB = 1e9 bytes).
    """
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += _tensor_bytes(t)
    return total


# --- a trained model and its evaluation text --------------------------------------------------------

def train_small_gpt(steps: int = 150, *, vocab_size: int = 256, d_model: int = 128, n_layers: int = 2,
                    n_heads: int = 4, seq_len: int = 64, batch_size: int = 16, lr: float = 3e-3,
                    num_eval: int = 32, seed: int = 0):
    """Train a small :class:`~teraflops.models.GPT` briefly on Markov-chain tokens (seconds on a CPU).

    The training and evaluation sequences come from the same seeded chain
    (:func:`~teraflops.data.markov_tokens`) in one call; every step sees fresh sequences and the last
    ``num_eval`` are held out. Adam, ``steps × batch_size`` sequences: the defaults take 10-30 s on
    2 CPU cores and bring held-out perplexity from 256 (uniform) to ≈13.

    Returns:
        ``(model, (eval_inputs, eval_targets))``: the fp32 GPT in eval mode, and int64
        ``(num_eval, seq_len)`` held-out tokens and their next-token targets.
    """
    torch.manual_seed(seed)
    pool = steps * batch_size
    x, y = markov_tokens(pool + num_eval, seq_len, vocab_size=vocab_size, seed=seed)
    model = GPT(vocab_size, d_model, n_layers, n_heads, max_seq_len=seq_len)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        idx = torch.arange(step * batch_size, (step + 1) * batch_size)
        loss = lm_loss(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval(), (x[pool:], y[pool:])


@torch.no_grad()
def accuracy(reference_model: nn.Module, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Compare ``model`` with ``reference_model`` (fp32) on one evaluation text.

    Args:
        inputs, targets: int64 ``(batch, seq_len)`` token ids and next-token targets.

    Returns a dict: ``max_logit_error`` (max |logit difference|, logits in float32),
    ``top1_agreement`` (fraction of positions whose argmax token is the same), ``perplexity``
    (exp of mean next-token cross-entropy, nats) of ``model`` and ``reference_perplexity``.
    """
    ref = reference_model(inputs).float()
    got = model(inputs).float()
    if got.shape != ref.shape:
        raise ShapeError(f"the models' logits differ in shape: {tuple(got.shape)} vs {tuple(ref.shape)}")
    v = ref.shape[-1]
    return {
        "max_logit_error": (got - ref).abs().max().item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "perplexity": math.exp(F.cross_entropy(got.reshape(-1, v), targets.reshape(-1)).item()),
        "reference_perplexity": math.exp(F.cross_entropy(ref.reshape(-1, v), targets.reshape(-1)).item()),
    }


@torch.no_grad()
def forward_tokens_per_s(model: nn.Module, inputs: torch.Tensor, min_run_time: float = 0.3) -> float:
    """Tokens per second of one forward pass over ``inputs`` (batch × seq_len tokens), median of
    :func:`teraflops.timing.benchmark`. A forward-pass throughput (prefill-like), not decode speed."""
    t = benchmark(lambda: model(inputs), min_run_time=min_run_time)
    return inputs.numel() / t.median


def compare(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, modes=MODES,
            min_run_time: float = 0.3) -> list[dict]:
    """Quantize ``model`` (fp32) each way in ``modes`` and measure it against fp32.

    Rows (dicts): ``mode``, ``route`` (what ran), ``weight_bytes`` (bytes), ``ratio`` (to fp32),
    ``max_logit_error``, ``top1_agreement``, ``perplexity``, ``tokens_per_s`` (forward pass over
    ``inputs``, measured). A torchao row whose library is missing carries the reason in ``route``.
    """
    ref = quantize_model(model, "fp32")
    fp32_bytes = weight_bytes(ref)
    routes = {"fp32": "reference", "bf16": "model.to(bfloat16)", "fp16": "model.to(float16)",
              "int8": "hand-made Int8Linear", "torchao": "torchao Int8WeightOnlyConfig"}
    rows = []
    for mode in modes:
        if mode == "torchao" and torchao_status():
            rows.append({"mode": mode, "route": torchao_status()})
            continue
        m = quantize_model(model, mode)
        row = {"mode": mode, "route": routes[mode], "weight_bytes": weight_bytes(m)}
        row["ratio"] = row["weight_bytes"] / fp32_bytes
        acc = accuracy(ref, m, inputs, targets)
        row.update({k: acc[k] for k in ("max_logit_error", "top1_agreement", "perplexity")})
        row["tokens_per_s"] = forward_tokens_per_s(m, inputs, min_run_time)
        rows.append(row)
    return rows


def quantization_table(rows: list[dict]) -> str:
    """Render :func:`compare`'s rows: one line per mode, numbers side by side."""
    headers = ["mode", "weight bytes", "× fp32", "max |Δlogit|", "top-1 agree", "perplexity",
               "fwd tokens/s", "route"]
    keys = ["mode", "weight_bytes", "ratio", "max_logit_error", "top1_agreement", "perplexity",
            "tokens_per_s", "route"]
    return table([[r.get(k) for k in keys] for r in rows], headers)
