"""Optimizer-state sharding for any optimizer: what its check asks of the ranks and what they report.

A sharded optimizer (ZeRO stage 1 without the flat vector; Rajbhandari et al. 2019, arXiv:1910.02054,
§5.1; the optimizer wrapper of Stanford CS336's systems assignment) is a ``torch.optim.Optimizer``
built as ``Cls(params, optimizer_cls, **kwargs)``. It keeps the parameter groups the caller gave
(dicts, ``add_param_group`` included), assigns each parameter to one rank, and hands the wrapped
``optimizer_cls`` on each rank only the parameters that rank owns, so each parameter's state
(AdamW: exp_avg and exp_avg_sq; SGD: momentum_buffer) lives on exactly one rank. After the owners
step, every parameter is broadcast from its owner. Gradients arrive already averaged (the model is
wrapped in DDP), so the step needs no reduction of its own.

:class:`ShardedCheckSpec` is what :mod:`teraflops.workers.sharded_check` runs for
:func:`teraflops.grading.unit02.sharded_optimizer`; :class:`ShardedCheckResult` what each rank reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from teraflops.launch.rank import RankIdentity
from teraflops.parallelization.zero import ZERO1_MLP, RankError


@dataclass(frozen=True)
class OptimizerCase:
    """One optimizer the check wraps: ``torch.optim.<name>(**kwargs)`` over two parameter groups, the
    first Linear layer (group 0, the defaults) and the rest (group 1, ``kwargs`` updated by
    ``second``); ``added``: group 1 comes through ``add_param_group`` after construction, not the
    constructor's list of dicts."""

    name: str
    kwargs: dict[str, object]
    second: dict[str, object]
    added: bool


SHARDED_CASES = (
    # eps large, so that gradients scaled by a constant move AdamW differently (see zero.ZERO1_HYPER)
    OptimizerCase("AdamW", {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1},
                  {"lr": 3e-3, "weight_decay": 0.0}, added=False),
    OptimizerCase("SGD", {"lr": 5e-2, "momentum": 0.9}, {"lr": 2e-2}, added=True),
)
SHARDED_TOL = 2e-5  # max |parameter difference| from DDP + the unsharded optimizer after the steps


@dataclass(frozen=True)
class ShardedCheckSpec:
    """What :mod:`teraflops.workers.sharded_check` runs: the learner's class block ``source`` (class
    ``name``) wrapping each optimizer of ``cases`` for ``steps`` steps of a DDP-wrapped MLP of
    ``mlp`` features (batches of ``batch`` rows per rank), next to DDP with the unsharded optimizer;
    ``timeout_s``: seconds a collective waits for the others."""

    source: str
    name: str
    cases: tuple[OptimizerCase, ...] = SHARDED_CASES
    steps: int = 3
    timeout_s: float = 20
    mlp: tuple[int, int, int] = ZERO1_MLP
    batch: int = 16


@dataclass(frozen=True)
class ShardedRun:
    """One optimizer case on one rank: ``params``, the learner's final parameters (one flat list);
    ``group_sizes``, parameters in each of its ``param_groups`` and ``group_lrs`` their ``lr``;
    ``stateful``, indices (``model.parameters()`` order) of the parameters this rank's optimizers
    hold state for; ``warnings``, messages emitted while its ``step()`` ran; ``second``: the
    parameters' slice of group 1 in ``params`` (start, stop); rank 0 adds ``ref`` (DDP with the
    unsharded optimizer) and ``initial``."""

    case: str
    params: list[float]
    group_sizes: list[int]
    group_lrs: list[float]
    stateful: list[int]
    warnings: list[str]
    second: tuple[int, int]
    ref: list[float] | None = None
    initial: list[float] | None = None


@dataclass(frozen=True)
class ShardedCheckResult(RankIdentity):
    """One rank's report: a :class:`ShardedRun` per case that ran, ``error`` the learner's code
    raised first (None if none), ``shapes`` of the model's parameter tensors and ``comm`` (calls per
    collective during the learner's steps, all cases)."""

    error: RankError | None
    runs: list[ShardedRun]
    shapes: list[list[int]]
    comm: dict[str, int]
