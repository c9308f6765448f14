"""Fully sharded data parallelism by hand, layer by layer: what its check asks of the ranks.

FSDP (Zhao et al., *PyTorch FSDP*, VLDB 2023, arXiv:2304.11277, §3; ZeRO stage 3, Rajbhandari et
al. 2019, §5.3) keeps on each of ``n`` ranks only a 1/n **shard** of every parameter, in fp32 (the
master copy the optimizer steps). A layer's full weight exists only while the layer runs:

1. **forward**: all-gather the shards into the full weight (cast to the ``compute_dtype``, e.g.
   bf16, when one is given), compute, and free it;
2. **backward**: all-gather it again (it was freed), compute the input's and the weight's gradients,
   free it, and **reduce-scatter** the weight's gradient, so each rank receives the sum of its own
   shard only; divide by ``n`` (data parallelism averages) and hand it, in fp32, to the shard.

Per step and layer that is two all-gathers and one reduce-scatter of the layer's size: the 3Ψ of
ZeRO-3 (:func:`teraflops.parallelization.model_states.comm_volume`). An ``autograd.Function`` whose
forward and backward each gather is the simplest way to free between them: nothing but the input is
saved for backward.

:class:`FsdpCheckSpec` is what :mod:`teraflops.workers.fsdp_check` runs for
:func:`teraflops.grading.unit02.fsdp_linear`; :class:`FsdpCheckResult` what each rank reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from teraflops.launch.rank import RankIdentity
from teraflops.parallelization.zero import RankError

FSDP_FEATURES = (8, 33, 17, 5)  # the check's MLP widths: 33 and 17 leave every weight's shards padded
FSDP_TOL = {"float32": 1e-6, "bfloat16": 2e-3}
"""max |parameter difference| from one process (fp32) after the check's 5 SGD steps: fp32 exact-ish
(the reference ShardedLinear measured 1.5e-8 on 2 gloo ranks); with bf16 compute, weights and
gradients rounded to bf16's 8-bit mantissa (2⁻⁹ ≈ 2e-3 relative) before each update of lr 0.1
(measured 1.5e-4: the tolerance leaves ~13× headroom)."""


def plain_mlp(features=FSDP_FEATURES, seed: int = 0) -> nn.Sequential:
    """Linear layers of ``features`` with GELU between them, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(features, features[1:])):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(features) - 2 else [])
    return nn.Sequential(*layers)


def fsdp_batch(step: int, rank: int, rows: int = 8, features=FSDP_FEATURES):
    """Rank ``rank``'s regression batch at ``step``: fp32 ``x [rows, features[0]]`` and ``y [rows, features[-1]]``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, features[0], generator=g)
    return x, torch.sin(x[:, :features[-1]] * (rank + 1))


@dataclass(frozen=True)
class FsdpCheckSpec:
    """What :mod:`teraflops.workers.fsdp_check` runs: the learner's class block ``source`` (class
    ``name``, built as ``cls(linear, compute_dtype=None | torch.<dtype>)`` for each ``nn.Linear``
    of :func:`plain_mlp`), once per ``dtypes`` entry ("float32" builds it without a compute dtype),
    ``steps`` of SGD at ``lr`` next to one process on the global batch; ``timeout_s``: seconds a
    collective waits."""

    source: str
    name: str
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    steps: int = 5
    lr: float = 0.1
    timeout_s: float = 20


@dataclass(frozen=True)
class FsdpRun:
    """One compute dtype on one rank: ``params`` the full parameters after the steps (each layer's
    ``full_parameters()``, flat); ``held`` parameter elements this rank's model holds and
    ``held_dtypes`` their dtypes; ``forward_gathers``/``backward_gathers``/``scatters``/``reduces``,
    calls per step of all-gathers (forward, backward), reduce-scatters, and all-reduces or reduces;
    ``kept``, elements of full-size tensors a layer holds as attributes after forward; rank 0 adds
    ``single`` and ``summed`` (one process on the global batch; with the loss × world size)."""

    dtype: str
    params: list[float]
    held: int
    held_dtypes: list[str]
    forward_gathers: int
    backward_gathers: int
    scatters: int
    reduces: int
    kept: int
    single: list[float] | None = None
    summed: list[float] | None = None


@dataclass(frozen=True)
class FsdpCheckResult(RankIdentity):
    """One rank's report: a :class:`FsdpRun` per dtype that ran, ``error`` (None if none) and
    ``sizes`` (elements of each parameter tensor of the unsharded model)."""

    error: RankError | None
    runs: list[FsdpRun]
    sizes: list[int]
