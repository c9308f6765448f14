"""The launcher's self-test: a few all-reduces on real ranks, what they are asked and what each hands back.

:func:`run` launches :mod:`teraflops.workers.selftest` with a :class:`SelftestSpec` and reads each
rank's :class:`SelftestResult`; the tests of :mod:`teraflops.launch` use it (placement, loopback-only
rendezvous, Slurm batch jobs, clean-up after a killed notebook), and so does Unit 2's demonstration
of a killed rank (``TERAFLOPS_FAULT``, :mod:`teraflops.launch.faults`). At each step every rank
contributes ``rank + 1`` to an all-reduce (SUM), so each rank ends with :func:`expected_sum`.
"""

from __future__ import annotations

from dataclasses import dataclass

from teraflops.launch.launcher import launch
from teraflops.launch.rank import RankIdentity

WORKER = "teraflops.workers.selftest"


@dataclass(frozen=True)
class SelftestSpec:
    """What :mod:`teraflops.workers.selftest` runs: ``steps`` all-reduces, each after
    :func:`~teraflops.launch.faults.fault_point` ``(step)``; ``timeout_s``: seconds a collective
    waits for the others (a hung rank's peers fail after it); ``deepspeed``: join the process group
    through ``deepspeed.init_distributed``.

    Raises:
        ValueError: ``steps < 1`` or ``timeout_s <= 0``.
    """

    steps: int = 4
    timeout_s: float = 30
    deepspeed: bool = False

    def __post_init__(self):
        if self.steps < 1 or self.timeout_s <= 0:
            raise ValueError(f"steps must be >= 1 and timeout_s > 0 s, got {self.steps} and {self.timeout_s}")


@dataclass(frozen=True)
class SelftestResult(RankIdentity):
    """One rank's self-test: ``sum``, the total of its all-reduced values (:func:`expected_sum` when
    every rank took part); the rank's ``CUDA_VISIBLE_DEVICES`` and ``TRITON_INTERPRET`` (None: unset)."""

    sum: float
    cuda_visible_devices: str | None
    triton_interpret: str | None


def expected_sum(spec: SelftestSpec, world_size: int) -> float:
    """``steps × world_size (world_size + 1) / 2``: what every rank's ``sum`` is after a run of ``spec``."""
    return spec.steps * world_size * (world_size + 1) / 2


def run(ranks=2, spec: SelftestSpec | None = None, **launch_kwargs) -> list[SelftestResult]:
    """Launch the self-test on ``ranks`` (an int, ranks per node, or a
    :class:`~teraflops.launch.placement.Placement`) with ``spec`` (default :class:`SelftestSpec`\\ ());
    ``launch_kwargs`` go to :func:`~teraflops.launch.launcher.launch` (``timeout``, ``env``,
    ``launcher``, ``cluster``, ``port``, ...). A ``spec.deepspeed`` run builds DeepSpeed's CPU op first.

    Returns:
        Each rank's :class:`SelftestResult`, by rank.

    Raises:
        LaunchFailed: a rank crashed, hung, or the launch took over its ``timeout``.
    """
    spec = SelftestSpec() if spec is None else spec
    deepspeed = launch_kwargs.pop("deepspeed", False) or spec.deepspeed
    return launch(WORKER, ranks, spec=spec, result=SelftestResult, deepspeed=deepspeed, **launch_kwargs)
