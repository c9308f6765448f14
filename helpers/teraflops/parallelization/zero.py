"""DeepSpeed ZeRO stages 0-3 run for real, measured against the ZeRO paper's formulas.

:func:`run_zero` trains :class:`teraflops.models.GPT` for a few steps under DeepSpeed at each
stage, on N ranks started by the DeepSpeed launcher (:mod:`teraflops.workers.zero_train`; gloo on
CPU, NCCL on GPUs). What each rank holds is read from the engine's real tensors; communication
comes from DeepSpeed's comms logger (https://www.deepspeed.ai/tutorials/comms-logging/). The
tables compare both with :mod:`teraflops.parallelization.model_states` (Rajbhandari et al. 2019, §5 and §7).

Reading the comms log (:func:`comm_bytes_per_step`): DeepSpeed records, per collective and message
size, ``[count, [latency_ms…], [algbw_Gbps…], [busbw_Gbps…]]``, where the message size is the bytes
of the tensor the rank passes *in*: the full input of ``all_reduce``, ``reduce`` and
``reduce_scatter_tensor``, but only this rank's shard for ``all_gather_into_tensor``. The paper
counts a reduce-scatter or an all-gather of Ψ elements as Ψ and an all-reduce as 2Ψ
(reduce-scatter + all-gather), so bytes per step are: all-reduce 2·s; reduce, reduce-scatter,
broadcast s; all-gather s·N (the gathered output). Bytes per rank; GB = 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from teraflops.launch.launcher import launch
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.rank import RankIdentity
from teraflops.models import GPT
from teraflops.parallelization.model_states import (
    FP32_ADAM,
    FP32_ADAM_MASTER,
    STAGE_NAMES,
    comm_volume,
    comm_volume_per_use,
    model_states,
    parameter_uses,
)
from teraflops.sizing import TrainConfig, gpt_config
from teraflops.tables import table

PAPER_FACTOR = {"all_reduce": 2, "inference_all_reduce": 2, "all_reduce_coalesced": 2, "reduce": 1,
                "reduce_scatter": 1, "reduce_scatter_tensor": 1, "broadcast": 1}
"""Bytes counted per logged byte, by collective (all-gathers: × world size, see the module doc)."""
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_base")
CATEGORIES = ("params", "grads", "optimizer")
WORKER = "teraflops.workers.zero_train"
LR = 1e-3  # torch's AdamW in every stage
BUCKET = 100_000  # DeepSpeed's reduce / all-gather bucket, elements


@dataclass(frozen=True)
class ZeroSpec:
    """What :mod:`teraflops.workers.zero_train` runs: ``model`` trained ``steps`` steps at each of
    ``stages`` in turn (``bucket``: reduce / all-gather bucket, elements; ``timeout_s``: seconds a
    collective may wait)."""

    stages: tuple[int, ...]
    steps: int
    model: TrainConfig
    bucket: int = BUCKET
    timeout_s: float = 30


@dataclass(frozen=True)
class ZeroStageResult:
    """One stage on one rank (see :mod:`teraflops.workers.zero_train`): ``held`` fp32 elements by
    category, ``comms`` DeepSpeed's comms log ``{op: {msg_size_bytes: [count, latencies, algbws,
    busbws]}}`` of the ``logged_steps`` steps after the first, ``losses`` (nats) and ``step_s`` (s)
    per step; ``grads_peak``: the most gradient elements live at once during the first backward pass
    (sampled after each parameter's gradient is accumulated; ``held["grads"]`` is after it);
    ``master_elements``: the fp32 master partition's elements, part of ``held["optimizer"]`` (0 where
    there is none apart from the parameters)."""

    stage: int
    psi: int
    held: dict[str, int]
    comms: dict[str, dict[int, list]]
    logged_steps: int
    losses: list[float]
    step_s: list[float]
    optimizer_type: str
    master_copy: bool
    grads_peak: int = 0
    master_elements: int = 0


@dataclass(frozen=True)
class ZeroResult(RankIdentity):
    """One rank's runs, one per stage of the :class:`ZeroSpec`."""

    runs: tuple[ZeroStageResult, ...]


@dataclass(frozen=True)
class AdamWHyper:
    """Keywords of ``torch.optim.AdamW`` (and of the learner's class in the ZeRO-1 check): ``lr``,
    ``betas`` (the moments' decay rates), ``eps``, ``weight_decay`` (decoupled)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


ZERO1_HYPER = AdamWHyper(lr=1e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)
"""The ZeRO-1 check's AdamW. Its ``eps`` is large: AdamW divides the gradient by its own running RMS,
so a gradient scaled by a constant (summed instead of averaged) moves the parameters the same way
unless ``eps`` is comparable to the gradient's size."""
ZERO1_MLP = (8, 32, 5)  # the check's MLP: inputs, hidden, outputs; Ψ = 517 = 11 × 47 (Zero1CheckSpec.psi)


@dataclass(frozen=True)
class Zero1CheckSpec:
    """What :mod:`teraflops.workers.zero1_check` runs: the learner's class block ``source`` (its
    class named ``name``) trained ``steps`` steps next to DDP + AdamW, both with ``hyper``, on an MLP
    of ``mlp`` = (inputs, hidden, outputs) features and batches of ``batch`` rows; ``timeout_s``:
    seconds a collective waits for the others."""

    source: str
    name: str
    steps: int = 3
    timeout_s: float = 20
    hyper: AdamWHyper = ZERO1_HYPER
    mlp: tuple[int, int, int] = ZERO1_MLP
    batch: int = 16

    @property
    def psi(self) -> int:
        """Parameters of the MLP (Linear, LayerNorm, Linear): with :data:`ZERO1_MLP` 517 = 11 × 47,
        which no world size from 2 to 10 divides, so a flat vector's shards need padding."""
        inputs, hidden, outputs = self.mlp
        return (inputs + 1) * hidden + 2 * hidden + (hidden + 1) * outputs


@dataclass(frozen=True)
class RankError:
    """An exception the learner's code raised in a rank: ``where`` (what was called), its ``type``,
    first ``message`` line, ``time`` (Unix s); ``secondary``: the fallout of another rank's error."""

    where: str
    type: str
    message: str
    time: float
    secondary: bool = False


@dataclass(frozen=True)
class OptimizerInfo:
    """A ``torch.optim.Optimizer`` found among the learner's object's attributes: its ``type``,
    whether it is torch.optim's own (``torch``), elements of its state tensors with dim > 0
    (``state``) and of the parameters it ``owned``; its first group's hyperparameters (None where absent)."""

    type: str
    torch: bool
    state: int
    owned: int
    lr: object = None
    betas: object = None
    eps: object = None
    weight_decay: object = None


@dataclass(frozen=True)
class Zero1CheckResult(RankIdentity):
    """One rank's report (see :mod:`teraflops.workers.zero1_check`): ``params``, the learner's final
    flat parameters (None after an error); ``grad_left``, max |grad| right after its ``zero_grad()``;
    ``comm``, elements it passed to each collective; rank 0 adds ``initial``, ``ref`` and ``alt``
    (the references' flat parameters)."""

    psi: int
    hyper: dict[str, object]
    steps: int
    error: RankError | None
    params: list[float] | None
    grad_left: float
    optimizers: list[OptimizerInfo]
    comm: dict[str, int]
    initial: list[float] | None = None
    ref: list[float] | None = None
    alt: dict[str, list[float]] | None = None


def comm_bytes_per_step(comms: dict, world_size: int, steps: int) -> float:
    """Bytes one rank communicated per training step, by the ZeRO paper's accounting.

    Args:
        comms: DeepSpeed's comms-logger data, ``{op: {msg_size_bytes: [count, latencies, algbws,
            busbws]}}`` (``deepspeed.comm.comms_logger.comms_dict``).
        world_size: ranks in the group (an all-gather's output is ``world_size`` logged shards).
        steps: training steps the log covers.

    Raises:
        ValueError: an op this accounting does not know (all_to_all, send/recv, ...), or steps < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    total = 0.0
    for op, sizes in comms.items():
        if not any(int(size) for size in sizes):  # barriers: logged, with no bytes
            continue
        factor = world_size if op in ALL_GATHERS else PAPER_FACTOR.get(op)
        if factor is None:
            raise ValueError(f"no byte accounting for DeepSpeed op {op!r}")
        total += sum(factor * int(size) * int(entry[0]) for size, entry in sizes.items())
    return total / steps


@dataclass(frozen=True)
class StageRun:
    """One ZeRO stage's run on every rank.

    Attributes:
        stage: ZeRO stage (0-3); psi: parameters of the model (Ψ).
        world_size, backend: ranks and process-group backend.
        held: per rank, ``{"params"|"grads"|"optimizer": fp32 elements held}``.
        comms: per rank, DeepSpeed's comms-logger data (see :func:`comm_bytes_per_step`).
        logged_steps: steps the comms log covers (all but the first).
        losses: per rank, the micro-batch loss of each step (nats).
        step_s: per rank, wall seconds of each step (forward + backward + optimizer step).
        master_copy: the ZeRO optimizer keeps its fp32 master partition apart from the parameters
            (stage 3 on a GPU uses an fp32 parameter shard itself as the master).
        grads_peak: per rank, the most gradient elements live at once during the backward pass
            (stage 1 holds all Ψ until the end of backward, stage 2 its partition plus a bucket).
        master_elements: per rank, the elements of DeepSpeed's fp32 master partition, counted inside
            ``held[rank]["optimizer"]`` (the optimizer bar's share that is a copy of the weights).
    """

    stage: int
    psi: int
    world_size: int
    backend: str
    held: list
    comms: list
    logged_steps: int
    losses: list
    step_s: list
    master_copy: bool = True
    grads_peak: list = ()
    master_elements: list = ()

    def grads_at_peak(self, rank: int = 0) -> int:
        """Gradient elements of ``rank`` at the backward pass's peak (at least those held after it)."""
        return max(self.held[rank]["grads"], self.grads_peak[rank] if self.grads_peak else 0)

    def master(self, rank: int = 0) -> int:
        """Elements of ``rank``'s fp32 master partition inside its optimizer states (0: none apart)."""
        return self.master_elements[rank] if self.master_elements else 0

    def peak_bytes(self, rank: int = 0, bytes_per_element: int = 4) -> int:
        """Model-state bytes of ``rank`` at the peak of the backward pass: parameters, gradients at
        their peak (:attr:`grads_peak`, at least those held after backward) and optimizer states,
        measured (fp32 runs: 4 bytes per element)."""
        h = self.held[rank]
        return (h["params"] + self.grads_at_peak(rank) + h["optimizer"]) * bytes_per_element

    @property
    def global_losses(self) -> list[float]:
        """Mean over ranks of each step's loss: the loss of the global batch."""
        return [sum(step) / len(step) for step in zip(*self.losses)]

    @property
    def step_time(self) -> float:
        """Median over steps after the first of the slowest rank's step time (s)."""
        slowest = sorted(max(step) for step in list(zip(*self.step_s))[1:])
        return slowest[len(slowest) // 2]

    @property
    def comm_bytes(self) -> float:
        """Bytes per step of rank 0 by the paper's accounting."""
        return comm_bytes_per_step(self.comms[0], self.world_size, self.logged_steps)

    def calculator(self):
        """The :func:`~teraflops.parallelization.model_states.model_states` row these fp32 runs should match: stage 0
        is torch's AdamW alone (momentum, variance: K = 8); stages 1-3 add DeepSpeed's fp32 master
        partition (K = 12, :data:`~teraflops.parallelization.model_states.FP32_ADAM_MASTER`) where it keeps one apart."""
        master = self.stage > 0 and self.master_copy
        return model_states(self.psi, self.stage, self.world_size, FP32_ADAM_MASTER if master else FP32_ADAM)


def run_zero(stages=(0, 1, 2, 3), plan=None, steps: int | None = None, timeout: float = 600,
             env: dict | None = None, cluster=None) -> list[StageRun]:
    """Train the preset's GPT under DeepSpeed at each of ``stages`` (one launch, stages in turn).

    ``plan`` is a :class:`~teraflops.launch.placement.DataParallelPlan` (default: this machine's); ``env``
    goes to the ranks (e.g. ``TERAFLOPS_FAULT``). With ``cluster`` (an emulated
    :class:`~teraflops.nodes.cluster.Cluster` that is up) the ``plan.ranks`` ranks are spread over its nodes
    and started by torchrun, one agent per node, DeepSpeed initialising inside them. Raises
    :class:`~teraflops.launch.launcher.LaunchFailed` (one line) if a rank fails, hangs or the launch
    passes ``timeout`` seconds; no process or port is left behind.
    """
    if steps is not None and steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is warm-up, left out of timings and comms), got {steps}")
    plan = plan or data_parallel_plan()
    spec = zero_spec(plan.preset, stages, steps)
    spread = {} if cluster is None else {"cluster": cluster, "launcher": "torchrun", "deepspeed": True}
    ranks = launch(WORKER, plan.placement, spec=spec, result=ZeroResult, **{"launcher": "deepspeed", **spread},
                   timeout=timeout, env=env, desc="ZeRO stages " + ",".join(map(str, stages)))
    return stage_runs(spec, ranks)


def zero_spec(p, stages=(0, 1, 2, 3), steps: int | None = None) -> ZeroSpec:
    """The :class:`ZeroSpec` of preset ``p``: its ``gpt``, ``dp.micro_batch`` sequences per
    rank, AdamW at :data:`LR`, ``steps`` (default ``zero.steps``) per stage."""
    return ZeroSpec(tuple(int(s) for s in stages), steps or p.zero.steps, gpt_config(p, p.dp.micro_batch, LR))


def stage_runs(spec: ZeroSpec, ranks: list[ZeroResult]) -> list[StageRun]:
    """One :class:`StageRun` per stage of ``spec``, each rank's run of it found by its ``stage``.

    Raises:
        ValueError: a rank did not run a stage of the spec.
    """
    runs = []
    for stage in spec.stages:
        per_rank = [next((s for s in r.runs if s.stage == stage), None) for r in ranks]
        if None in per_rank:
            raise ValueError(f"rank {per_rank.index(None)} has no run of ZeRO stage {stage}")
        first = per_rank[0]
        runs.append(StageRun(stage=stage, psi=first.psi, world_size=ranks[0].world_size, backend=ranks[0].backend,
                             held=[r.held for r in per_rank], comms=[r.comms for r in per_rank],
                             logged_steps=first.logged_steps, losses=[r.losses for r in per_rank],
                             step_s=[r.step_s for r in per_rank], master_copy=first.master_copy,
                             grads_peak=[r.grads_peak for r in per_rank],
                             master_elements=[r.master_elements for r in per_rank]))
    return runs


def held_table(runs: list[StageRun]) -> str:
    """Elements held per rank (rank 0; the other ranks are checked equal) against the calculator.

    Two rows beside the paper's three states say what after-backward counts hide: the gradients at
    the backward pass's peak (where stages 1 and 2 part: stage 1 still holds all Ψ, stage 2 its
    partition and one ``reduce_bucket_size`` bucket) and, inside the optimizer states, DeepSpeed's fp32
    master partition (Ψ/Nd from stage 1; the calculator's K = 12 counts it, K = 8 where there is none)."""
    rows = []

    def row(run, name, per_rank, want):
        got = per_rank(0)
        same = all(per_rank(k) == got for k in range(run.world_size))
        rows.append([f"{run.stage} {STAGE_NAMES[run.stage]}", name, got, want, got / want if want else "—",
                     "yes" if same else "NO"])

    for run in runs:
        calc = run.calculator()
        for cat in CATEGORIES:
            row(run, cat, lambda k, cat=cat: run.held[k][cat], getattr(calc, f"{cat}_elements"))
            if cat == "grads" and run.grads_peak:
                row(run, "grads at peak", run.grads_at_peak, run.psi if run.stage < 2 else calc.grads_elements)
        if run.master_elements:
            row(run, "  of which fp32 master", run.master,
                run.psi / run.world_size if run.stage > 0 and run.master_copy else 0)
    return table(rows, ["stage", "state", "measured (fp32 elements)", "calculator", "ratio", "same on all ranks"])


def comm_table(runs: list[StageRun], bytes_per_element: int = 4) -> str:
    """Bytes per step per rank from the comms log against the paper's 2Ψ / 3Ψ (fp32 runs: 4 B/element)."""
    rows = []
    for run in runs:
        want = comm_volume(run.psi, run.stage, bytes_per_element)
        rows.append([f"{run.stage} {STAGE_NAMES[run.stage]}", run.comm_bytes, want, run.comm_bytes / want,
                     f"{run.comm_bytes / (run.psi * bytes_per_element):.2f}Ψ", run.step_time * 1e3])
    return table(rows, ["stage", "measured B/step", "paper B/step", "ratio", "in Ψ", "step ms"])


def expected_comm_bytes(run: StageRun, model) -> float:
    """Bytes per step per rank the run should log: the paper's 2Ψ / 3Ψ counted per use of each
    parameter of ``model`` (the trained GPT; the ``meta`` device will do),
    :func:`teraflops.parallelization.model_states.comm_volume_per_use`; fp32 runs, 4 bytes per element. At stage 3
    the tied token embedding / output head is gathered once per module that uses it."""
    return comm_volume_per_use(parameter_uses(model), run.stage, 4)


def trained_gpt(p):
    """The GPT that :func:`run_zero` trains at preset ``p``'s ``gpt`` sizes, on the ``meta``
    device (shapes only, no memory), for :func:`expected_comm_bytes`."""
    import torch

    with torch.device("meta"):
        return GPT(p.gpt.vocab, p.gpt.d_model, p.gpt.layers, p.gpt.heads, p.gpt.seq_len)


def ops_table(run: StageRun) -> str:
    """One stage's comms log per collective: calls and logged bytes per step, bytes by the paper's count."""
    rows = []
    for op, sizes in sorted(run.comms[0].items()):
        calls = sum(int(e[0]) for e in sizes.values()) / run.logged_steps
        logged = sum(int(s) * int(e[0]) for s, e in sizes.items()) / run.logged_steps
        counted = comm_bytes_per_step({op: sizes}, run.world_size, run.logged_steps)
        rows.append([op, calls, logged, counted])
    return table(rows, ["collective", "calls/step", "logged B/step", "counted B/step"])


def max_loss_difference(runs: list[StageRun]) -> float:
    """Largest |loss − loss of the first run| over stages and steps (global-batch losses)."""
    ref = runs[0].global_losses
    return max(abs(a - b) for run in runs[1:] for a, b in zip(run.global_losses, ref)) if len(runs) > 1 else 0.0


def stack_states(ax, runs: list[StageRun], ranks: list[int]) -> list[float]:
    """Stacked bars of model-state MB per rank (fp32), one per run, each of its rank in ``ranks``:
    parameters, gradients at the backward pass's peak, AdamW's moments, and DeepSpeed's fp32 master
    partition hatched on top of the optimizer states it belongs to. Returns the bars' heights (MB)."""
    parts = (("params", "parameters", "tab:blue", "", lambda r, k: r.held[k]["params"]),
             ("grads", "gradients (peak in backward)", "tab:orange", "", lambda r, k: r.grads_at_peak(k)),
             ("moments", "optimizer: AdamW m, v", "tab:green", "", lambda r, k: r.held[k]["optimizer"] - r.master(k)),
             ("master", "optimizer: fp32 master copy (DeepSpeed)", "tab:green", "//", lambda r, k: r.master(k)))
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for name, label, color, hatch, elements in parts:
        mb = [elements(r, k) * 4 / 1e6 for r, k in zip(runs, ranks)]
        if name == "master" and not any(mb):
            continue  # no stage kept a master copy apart from the weights
        ax.bar(x, mb, bottom=bottom, color=color, hatch=hatch, edgecolor="white" if hatch else None,
               label=label)
        bottom = [b + m for b, m in zip(bottom, mb)]
    return bottom


def plot_tradeoff(runs: list[StageRun]):
    """Two panels: model-state bytes per rank by stage (measured, stacked: :func:`stack_states`, gradients
    at their peak, the fp32 master copy hatched inside the optimizer states) and bytes communicated per
    step by stage (measured bars, the paper's 2Ψ/3Ψ as markers). Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (mem, com) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = list(range(len(runs)))
    labels = [f"stage {r.stage}\n{STAGE_NAMES[r.stage]}" for r in runs]
    heights = stack_states(mem, runs, [0] * len(runs))
    mem.set_ylim(0, max(heights) * 1.5)  # the four-entry legend sits above the bars
    mem.set_xticks(x, labels)
    mem.set_ylabel("model states per rank (MB, measured)")
    mem.legend(fontsize="small", loc="upper right")
    mem.set_title("memory falls with each stage", fontsize="medium")
    com.bar(x, [r.comm_bytes / 1e6 for r in runs], color="tab:purple", label="measured (comms logger)")
    com.scatter(x, [comm_volume(r.psi, r.stage, 4) / 1e6 for r in runs], color="black", marker="_", s=600,
                label="paper's formula for this Ψ: 2Ψ, 3Ψ", zorder=3)
    com.set_xticks(x, labels)
    com.set_ylabel("bytes sent per rank per step (MB)")
    com.legend(fontsize="small")
    com.set_title("communication rises at stage 3", fontsize="medium")
    fig.suptitle(f"measured here on the course's small model: ZeRO on {runs[0].world_size} ranks ({runs[0].backend}), "
                 f"Ψ = {runs[0].psi:,} parameters, fp32", fontsize="large")
    fig.tight_layout()
    return fig
