"""Unit 2 · tensor parallelism, Megatron-LM's way, on the course's GPT: its collectives counted, its bytes
against the formula, and what a slow link does to it.

**The split** (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", arXiv:1909.08053, §3 and Fig. 3): in every transformer block the first
linear layer of a pair is split by its output columns (each of ``tp`` ranks holds ``1/tp`` of the
heads of the fused QKV projection, or ``1/tp`` of the MLP's ``4h`` hidden units) and the second by
its input rows, so the nonlinearity (attention per head, GELU per unit) runs on local data and only
the second layer's partial sums must be added up. PyTorch spells the pair ``ColwiseParallel`` /
``RowwiseParallel`` (``torch.distributed.tensor.parallel``, https://pytorch.org/docs/stable/
distributed.tensor.parallel.html). :func:`shard_gpt` applies it to :class:`~teraflops.models.GPT`'s
``qkv``/``proj`` and ``fc1``/``fc2``; embeddings, LayerNorms and the head stay replicated.

**Its communication** (Megatron-LM §3, the ``f``/``g`` operators): per block, one all-reduce after
each row-parallel layer in the forward (2) and one of the input gradient of each column-parallel
layer in the backward (2), each of the block's activations, ``b·s·h`` elements (batch × sequence ×
hidden): :func:`megatron_per_layer`. The volume grows with the tokens and not with the parameters;
data parallelism all-reduces the gradients, ``Ψ`` elements, once per step (ZeRO paper, Rajbhandari
et al. 2020, §5: ``2Ψ`` moved per rank in a ring). With sequence parallelism (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, §4.2.2) each
all-reduce becomes an all-gather and a reduce-scatter of the same total volume (not run here).

The fused QKV matters: with separate ``q``, ``k``, ``v`` projections the backward all-reduces three
input gradients instead of one (4 per block instead of 2; measured with torch 2.13). Megatron keeps
one QKV weight whose rows are grouped per head; :func:`interleave_qkv` reorders the course GPT's
``[q; k; v]`` rows so that each rank's contiguous shard is ``[q_r; k_r; v_r]`` of its own heads.

:func:`run` starts ``workers/tensor_parallel.py`` through the course launcher: every rank builds the
same GPT, checks the sharded model's logits against an unsharded copy (the single-process
reference), counts the collectives per block and phase with ``CommDebugMode``
(``torch.distributed.tensor.debug``) and their bytes, and times steps with the seconds spent inside
collectives split from the rest (compute). ``modes=("tp", "dp")`` also trains the same model data
parallel in the same launch (the global batch split over the ranks; gradients all-reduced in one
flat buffer after the backward, not overlapped, so its communication is timed alone).

:func:`degree_sweep` runs TP at several degrees inside one node and across two emulated nodes
(``tp/2`` ranks per node) and sets each launch beside the models (:func:`degree_row`): the bytes
counted against :func:`formula_per_step` (exact: ``4·L·b·s·h·4`` at any degree ≥ 2, 0 at 1; the
payload does not shrink with the degree, what each rank's link carries grows as ``2(n−1)/n``), and
on a shaped link the communication seconds against the alpha-beta model
(:func:`predicted_comm_seconds`: the link's configured rate, and ``α`` measured in the same launch
as one-float all-reduces, :func:`alpha_seconds`).

Units: bytes (GB = 1e9; KiB/MiB in tables), seconds (ms in tables); shares are fractions of a step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from teraflops.errors import CourseError
from teraflops.ceilings import measure_peak_flops
from teraflops.gpu_fit import gpt_params, launch_timeout, link_config, rank_config, tp_step_bytes, train_step_flops
from teraflops.comm_cost import FABRICS, bus_factor, ring_allreduce_seconds, scaled_rate
from teraflops.launch import launcher
from teraflops.launch.placement import place
from teraflops.launch.rank import RankIdentity
from teraflops.nodes.cluster import Cluster, Link, unavailable
from teraflops.sizing import PRESETS, TrainConfig, mp_config
from teraflops.tables import fmt_bytes, table

WORKER = "teraflops.workers.tensor_parallel"
MODES = ("tp", "dp")
# Megatron-LM §3: per transformer block, what each phase communicates (collective → calls)
MEGATRON_CALLS = {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
SEQUENCE_PARALLEL_CALLS = {"forward": {"all_gather": 2, "reduce_scatter": 2},
                           "backward": {"all_gather": 2, "reduce_scatter": 2}}


class TensorParallelError(CourseError, ValueError):
    """A tensor-parallel run that cannot be built: heads or width not divisible by the degree, bad sizes."""


def megatron_per_layer(tokens: int, hidden: int, dtype_bytes: int = 4, sequence_parallel: bool = False) -> dict:
    """What one transformer block communicates per phase under Megatron-LM tensor parallelism.

    Args:
        tokens: ``b·s``, sequences × positions that pass the block (every TP rank sees them all).
        hidden: ``h``, the model width.
        dtype_bytes: bytes per activation element (4 for fp32, 2 for bf16).
        sequence_parallel: Korthikanti et al. 2022 §4.2.2: all-gather + reduce-scatter instead of
            all-reduce, same volume.

    Returns:
        ``{"forward": {"calls": {collective: n}, "bytes": B}, "backward": {...}}`` with ``B`` the bytes
        handed to the collectives per phase: ``2·b·s·h·dtype_bytes`` (two all-reduces of the block's
        ``(b, s, h)`` activations; Megatron-LM §3, Fig. 4). A ring all-reduce over ``n`` ranks moves
        ``2(n−1)/n`` times that over each rank's link (:mod:`teraflops.hardware.collectives`).

    Raises:
        TensorParallelError: a count that is not a positive integer.
    """
    for name, v in (("tokens", tokens), ("hidden", hidden), ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TensorParallelError(f"{name} must be a positive int, got {v!r}. "
                                      "Hint: tokens = batch × seq_len, hidden = d_model, dtype_bytes = 4 for fp32")
    calls = SEQUENCE_PARALLEL_CALLS if sequence_parallel else MEGATRON_CALLS
    return {phase: {"calls": dict(c), "bytes": 2 * tokens * hidden * dtype_bytes} for phase, c in calls.items()}


def dp_bytes_per_step(params: int, dtype_bytes: int = 4) -> int:
    """Bytes data parallelism all-reduces per step: every gradient element once, ``Ψ·dtype_bytes``
    (the payload; a ring moves ``2(n−1)/n`` of it per rank's link, ZeRO paper §5)."""
    return params * dtype_bytes


def interleave_qkv(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """``[q; k; v]`` rows (``(3h, ...)``, the course GPT's fused projection) reordered to
    ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``, ``q_r`` the rows of rank ``r``'s heads: a contiguous
    ``1/tp`` shard (what ``ColwiseParallel`` gives rank ``r``) then holds whole heads of all three.
    Works on the weight ``(3h, h)`` and the bias ``(3h,)``."""
    three_h = weight.shape[0]
    if three_h % (3 * tp):
        raise TensorParallelError(f"a fused QKV of {three_h} rows does not split into 3 × {tp} shards. "
                                  "Hint: d_model must be divisible by the TP degree")
    rest = weight.shape[1:]
    return weight.reshape(3, tp, three_h // (3 * tp), *rest).transpose(0, 1).reshape(three_h, *rest)


def check_degree(cfg: TrainConfig, tp: int) -> None:
    """Raise :class:`TensorParallelError` unless ``tp`` divides the heads (and so the width and the MLP)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or cfg.heads % tp:
        raise TensorParallelError(f"TP degree {tp!r} must be a positive int that divides the {cfg.heads} heads. "
                                  "Hint: each rank holds heads / tp whole heads (Megatron-LM §3)")


def shard_gpt(model, mesh):
    """Megatron-style tensor parallelism on a :class:`~teraflops.models.GPT`, in place, on ``mesh``
    (a 1-D ``DeviceMesh`` of the TP ranks): in every block ``qkv`` and ``fc1`` column-parallel,
    ``proj`` and ``fc2`` row-parallel (their weights become DTensors; each rank keeps ``1/tp``), the
    QKV rows first grouped per rank (:func:`interleave_qkv`). Every rank must pass the same weights
    (the same seed). Returns the model.

    Raises:
        TensorParallelError: the heads do not divide by the mesh size.
    """
    tp = mesh.size()
    for block in model.blocks:
        if block.n_heads % tp:
            raise TensorParallelError(f"TP degree {tp} does not divide the {block.n_heads} heads. "
                                      "Hint: choose a degree that divides heads")
        with torch.no_grad():
            block.qkv.weight.copy_(interleave_qkv(block.qkv.weight, tp))
            block.qkv.bias.copy_(interleave_qkv(block.qkv.bias, tp))
        parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                         "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


@dataclass(frozen=True)
class TensorParallelSpec:
    """What :mod:`teraflops.workers.tensor_parallel` runs: ``model`` (``micro_batch``: the *global*
    batch, sequences; TP ranks all see it, data-parallel ranks split it) under each of ``modes``
    (``"tp"``, ``"dp"``), ``steps`` timed steps each after ``warmup`` untimed ones, taking turns
    step by step; SGD at ``model.lr``; ``timeout_s``: seconds a collective waits; ``latency_repeats``:
    one-float all-reduces timed at the end for the link's latency α (their median is read)."""

    model: TrainConfig
    modes: tuple[str, ...]
    steps: int
    warmup: int
    timeout_s: float = 60
    latency_repeats: int = 20

    def __post_init__(self):
        if not self.modes or set(self.modes) - set(MODES) or self.steps < 1 or self.warmup < 0:
            raise TensorParallelError(f"modes {self.modes!r} must be some of {MODES}, steps >= 1, warmup >= 0 "
                                      f"(got {self.steps}, {self.warmup}). Hint: modes=('tp', 'dp')")


@dataclass(frozen=True)
class ModeResult:
    """One mode on one rank: per timed step ``step_s`` and ``comm_s`` (seconds inside collectives),
    ``bytes_per_step`` and ``calls_per_step`` (handed to collectives in one counted step)."""

    mode: str
    step_s: list[float]
    comm_s: list[float]
    bytes_per_step: int
    calls_per_step: int


@dataclass(frozen=True)
class TensorParallelResult(RankIdentity):
    """One rank's run: ``params`` (of the whole model), ``config``, ``runs`` (one :class:`ModeResult`
    per mode), and, with ``"tp"``: ``max_abs_diff`` and ``loss_diff`` of the sharded model's logits
    and loss against the unsharded reference on the same batch, ``layer_calls`` and ``layer_bytes``
    (per block, ``"forward/all_reduce"``-style keys: calls and bytes ``CommDebugMode`` saw in that
    block), ``other_calls`` (collectives outside the blocks); ``small_allreduce_s``: seconds of each
    all-reduce of one float, each after a barrier (the latency a message pays whatever its size: the
    ring's per-step ``α`` is it over ``2(n−1)``, :func:`alpha_seconds`; empty on one rank)."""

    params: int
    config: TrainConfig
    runs: tuple[ModeResult, ...]
    max_abs_diff: float | None
    loss_diff: float | None
    layer_calls: list[dict[str, int]]
    layer_bytes: list[dict[str, int]]
    other_calls: int
    small_allreduce_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TensorParallelRun:
    """What :func:`run` measured: ``results`` (by rank), ``rows`` (:func:`mode_rows`), ``nodes`` (1, or
    the cluster's), ``link`` (its description, or ``"loopback"``), ``rate`` (the link's bytes/s; None on
    loopback). ``str()``: :func:`mode_table`."""

    results: list
    rows: list
    nodes: int
    link: str
    rate: float | None = None

    def __str__(self) -> str:
        return mode_table(self.rows)


def spec_for(cfg: TrainConfig, modes=("tp",), steps: int = 4, warmup: int = 1,
             collective_timeout: float = 60) -> TensorParallelSpec:
    """The worker's :class:`TensorParallelSpec` (checked)."""
    return TensorParallelSpec(model=cfg, modes=tuple(modes), steps=steps, warmup=warmup, timeout_s=collective_timeout)


def rank_flops(device: str, world: int = 1) -> float:
    """FLOP/s one rank computes, measured now: an fp32 matmul (the ranks' dtype) on ``device``
    (:func:`teraflops.ceilings.measure_peak_flops`, 1024² on a GPU, 256² on the CPU), shared by
    ``world`` CPU ranks (they split the machine's cores)."""
    if device == "cuda":
        return measure_peak_flops(1024, torch.float32, "cuda", min_run_time=0.05)
    return measure_peak_flops(256, torch.float32, "cpu", min_run_time=0.05) / max(1, world)


def fitted(cfg: TrainConfig, placement, link_rate: float | None = None, dp: bool = False) -> TrainConfig:
    """``cfg`` as ``placement``'s ranks can run it (:mod:`teraflops.gpu_fit`): on CPU ranks the CPU
    preset's sizes at most (:func:`~teraflops.gpu_fit.rank_config`). Across a link of ``link_rate``
    bytes/s, on any ranks, the CPU preset's sizes too (the link is a fabric scaled by 10⁻³ for them:
    the GPU preset's activations, ~2 GB a step, would take ~40 s a step over it) and a batch whose TP
    activations cross it in :data:`~teraflops.gpu_fit.LINK_STEP_S` (:func:`~teraflops.gpu_fit.link_config`;
    a multiple of the ranks with ``dp``)."""
    cfg = rank_config(cfg, placement.on_gpus and not link_rate, mp_config(PRESETS["cpu"]))
    return link_config(cfg, link_rate, placement.world_size if dp else 1)


def run(cfg: TrainConfig, tp: int = 2, *, modes=("tp",), steps: int = 4, warmup: int = 1, cluster=None,
        timeout: float | None = None) -> TensorParallelRun:
    """Run ``cfg``'s GPT on ``tp`` ranks (one launch): Megatron TP, and data parallelism if ``"dp"`` is
    in ``modes``. The sizes run are :func:`fitted` to where the ranks are (each result's ``config``).

    Args:
        cfg: the model and global batch (``micro_batch`` sequences).
        tp: ranks (the TP degree; also the data-parallel world size for ``"dp"``).
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` (up) whose nodes the ranks
            are spread over (then TP talks over its shaped links); None: one node, loopback.
        timeout: seconds the launch may take; None: :func:`~teraflops.gpu_fit.launch_timeout` of its
            steps' FLOPs at the rank's measured FLOP/s and its bytes over the link.

    Raises:
        TensorParallelError: ``tp`` does not divide the heads, or the batch does not split over
            ``tp`` data-parallel ranks.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    check_degree(cfg, tp)
    placement = place(tp, cpu_ranks=tp, cluster=cluster)
    rate = None if cluster is None else cluster.links[0].rate
    cfg = fitted(cfg, placement, rate, dp="dp" in modes)
    check_degree(cfg, tp)
    if "dp" in modes and cfg.micro_batch % tp:
        raise TensorParallelError(f"the global batch of {cfg.micro_batch} sequences does not split over {tp} "
                                  "data-parallel ranks. Hint: a multiple of tp")
    runs = len(modes) * (steps + warmup) + 2  # and the reference check and the counted step
    flops, nbytes = train_step_flops(cfg), tp_step_bytes(cfg) + dp_bytes_per_step(
        gpt_params(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len))
    device = "cuda" if placement.on_gpus else "cpu"
    per_rank = rank_flops(device, 1 if placement.on_gpus else placement.world_size)
    if timeout is None:
        timeout = launch_timeout(runs, flops, per_rank, nbytes, rate)
    # a collective waits at most one step's worth (its replay repeats one step's all-reduces)
    spec = spec_for(cfg, modes, steps, warmup, collective_timeout=max(60.0, launch_timeout(1, flops, per_rank, nbytes, rate)))
    results = launcher.launch(WORKER, placement, spec=spec,
                              result=TensorParallelResult, timeout=timeout, cluster=cluster,
                              desc=f"tensor parallel x{tp}: " + ", ".join(modes))
    nodes = 1 if cluster is None else cluster.nodes
    link = "loopback" if cluster is None else cluster.links[0].describe()
    return TensorParallelRun(results, mode_rows(results, nodes=nodes, link=link), nodes, link, rate)


def layer_counts(result: TensorParallelResult) -> list[dict]:
    """Per block: ``{"forward": {collective: calls}, "backward": {...}}`` from a rank's ``layer_calls``."""
    out = []
    for calls in result.layer_calls:
        per: dict = {"forward": {}, "backward": {}}
        for key, n in calls.items():
            phase, coll = key.split("/")
            per[phase][coll] = n
        out.append(per)
    return out


def layer_bytes(result: TensorParallelResult) -> list[dict]:
    """Per block: ``{"forward": bytes, "backward": bytes}`` handed to collectives, from ``layer_bytes``."""
    return [{phase: sum(v for k, v in b.items() if k.startswith(phase + "/")) for phase in ("forward", "backward")}
            for b in result.layer_bytes]


def mode_rows(results: list, nodes: int = 1, link: str = "loopback") -> list[dict]:
    """One row per mode: ``mode``, ``ranks``, ``nodes``, ``link``, ``step_ms`` and ``comm_ms`` (median
    over timed steps of the slowest rank's), ``compute_ms`` (the difference), ``comm_share``
    (``comm_ms / step_ms``), ``bytes_per_step`` and ``calls_per_step`` (rank 0's counted step)."""
    rows = []
    for i, m in enumerate(results[0].runs):
        per_rank = [r.runs[i] for r in results]
        step = max(statistics.median(x.step_s) for x in per_rank)
        comm = max(statistics.median(x.comm_s) for x in per_rank)
        rows.append({"mode": m.mode, "ranks": len(results), "nodes": nodes, "link": link, "step_ms": step * 1e3,
                     "comm_ms": comm * 1e3, "compute_ms": (step - comm) * 1e3, "comm_share": comm / step,
                     "bytes_per_step": m.bytes_per_step, "calls_per_step": m.calls_per_step})
    return rows


def mode_table(rows: list[dict]) -> str:
    """Rows of :func:`mode_rows` (from one or more runs) as a text table."""
    return table([(r["mode"], r["ranks"], r["link"], fmt_bytes(r["bytes_per_step"]), r["calls_per_step"], r["step_ms"],
                   r["compute_ms"], r["comm_ms"], f"{r['comm_share']:.0%}") for r in rows],
                 ["mode", "ranks", "link", "bytes/step/rank", "calls", "step ms", "compute ms", "comm ms", "comm share"])


def count_table(result: TensorParallelResult) -> str:
    """Rank 0's counted collectives and bytes per block and phase beside Megatron-LM's formula
    (:func:`megatron_per_layer` of the run's tokens and width, fp32)."""
    cfg = result.config
    want = megatron_per_layer(cfg.micro_batch * cfg.seq_len, cfg.d_model)
    rows = []
    for i, (calls, nbytes) in enumerate(zip(layer_counts(result), layer_bytes(result))):
        for phase in ("forward", "backward"):
            rows.append((f"block {i}", phase, ", ".join(f"{n} {c}" for c, n in sorted(calls[phase].items())) or "none",
                         ", ".join(f"{n} {c}" for c, n in want[phase]["calls"].items()), fmt_bytes(nbytes[phase]),
                         fmt_bytes(want[phase]["bytes"]), nbytes[phase] / want[phase]["bytes"]))
    return table(rows, ["layer", "phase", "counted", "Megatron", "bytes counted", "formula", "ratio"])


def link_comparison(cfg: TrainConfig, rate: float | None = None, *, steps: int = 3, warmup: int = 1,
                    timeout: float | None = None) -> dict:
    """The failure mode: TP and DP of the same model on 2 ranks, inside one node (loopback: the
    "NVLink domain") and on two emulated nodes joined by links of ``rate`` bytes/s (default: InfiniBand
    NDR scaled as Unit 5 scales fabrics, :func:`teraflops.comm_cost.scaled_rate`).

    Returns:
        ``{"rows", "rate", "comm_ratio", "bytes_ratio", "share_ratio", "inside", "across", "unavailable"}``: rows of
        :func:`mode_rows` with ``"where"`` ``"one node"`` or ``"two nodes"`` (each launch runs both
        modes: TP and DP measured in one run, on the same link); the three ratios: :func:`link_ratios`
        across the link (compare ``comm_ratio`` or ``bytes_ratio``: on GPUs ``share_ratio`` reads ≈ 1×);
        ``inside`` and ``across``: the two :class:`TensorParallelRun` s. Where emulated nodes cannot be
        made here (no root, no iproute2), ``across`` and the ratios are None and ``unavailable`` says
        why in one line.
    """
    rate = scaled_rate(FABRICS[0]) if rate is None else rate
    inside = run(cfg, 2, modes=("tp", "dp"), steps=steps, warmup=warmup, timeout=timeout)
    rows = [{**r, "where": "one node"} for r in inside.rows]
    why = unavailable()
    if why is not None:
        return {"rows": rows, "rate": rate, "comm_ratio": None, "bytes_ratio": None, "share_ratio": None,
                "inside": inside, "across": None,
                "unavailable": f"emulated nodes unavailable here ({why}): the one-node run only"}
    with Cluster(2, Link(rate=rate)) as cluster:
        across = run(cfg, 2, modes=("tp", "dp"), steps=steps, warmup=warmup, cluster=cluster, timeout=timeout)
    rows += [{**r, "where": "two nodes"} for r in across.rows]
    return {"rows": rows, "rate": rate, **link_ratios(across.rows), "inside": inside, "across": across,
            "unavailable": None}


def link_ratios(rows: list[dict]) -> dict:
    """TP against DP on the same link, from one launch's :func:`mode_rows`: ``comm_ratio`` (TP's
    communication seconds per step / DP's), ``bytes_ratio`` (bytes per step, TP / DP) and ``share_ratio``
    (communication share of the step, TP / DP).

    The seconds and the bytes are what the link costs each mode. The share also depends on the
    compute beside it: the link is scaled so that the step's compute on CPU ranks is visible beside
    it, while on GPUs the same model's compute is ~10³× faster, both shares approach 1 and their
    ratio reads ≈ 1× whatever the link does.
    """
    by = {r["mode"]: r for r in rows}
    tp, dp = by["tp"], by["dp"]
    return {"comm_ratio": tp["comm_ms"] / dp["comm_ms"] if dp["comm_ms"] > 0 else None,
            "bytes_ratio": tp["bytes_per_step"] / dp["bytes_per_step"],
            "share_ratio": tp["comm_share"] / dp["comm_share"] if dp["comm_share"] > 0 else None}


# (name, hidden h, layers L) of the published models the prediction is made for (LLaMA 2, Touvron et al. 2023, Table 1 / App.)
PUBLISHED_SHAPES = (("7B", 4096, 32), ("70B", 8192, 80))


def predict_tp_step(hidden: int, layers: int, tokens: int, tp: int, bandwidth: float, peak_flops: float,
                    mfu: float = 0.5, alpha: float = 0.0, dtype_bytes: int = 2) -> dict:
    """Predicted compute and communication of one training step of one micro-batch under TP degree ``tp``.

    Compute: ``6 · Ψ · T / (tp · peak_flops · mfu)`` with ``Ψ = 12 · L · h²`` (Kaplan et al. 2020
    §2.1; Narayanan et al. 2021 §5.1 use the same count); communication: ``4 · L`` ring all-reduces
    (:func:`megatron_per_layer`, 2 forward + 2 backward per block) of ``T · h · dtype_bytes`` bytes,
    each ``2(tp−1)/tp · S / bandwidth + 2(tp−1) α`` (:func:`teraflops.comm_cost.ring_allreduce_seconds`),
    not overlapped (each is the next layer's input).

    Args:
        hidden, layers: ``h`` and ``L``. tokens: ``T = b · s`` of the micro-batch. tp: degree (>= 2).
        bandwidth: bytes/s per direction of each rank's link. peak_flops: FLOP/s per GPU.
        mfu: the fraction of the peak the matmuls reach (an assumption, not a measurement: 0.5).
        alpha: per-step latency of the ring (s).

    Returns:
        ``{"compute_s", "comm_s", "comm_share"}``.
    """
    check = TrainConfig(vocab=1, d_model=hidden, layers=layers, heads=tp, seq_len=1, micro_batch=tokens, lr=0.0)
    check_degree(check, tp)
    compute = 6 * 12 * layers * hidden**2 * tokens / (tp * peak_flops * mfu)
    one = ring_allreduce_seconds(tokens * hidden * dtype_bytes, tp, bandwidth, alpha)
    comm = 4 * layers * one
    return {"compute_s": compute, "comm_s": comm, "comm_share": comm / (compute + comm)}


# ---- the degree sweep: TP 1, 2, 4 inside a node and across the link, bytes and seconds against the models


def formula_per_step(cfg: TrainConfig, tp: int, dtype_bytes: int = 4) -> dict:
    """What Megatron-LM TP of degree ``tp`` hands to its collectives in one step of ``cfg`` (every block,
    both phases: :func:`megatron_per_layer` of ``micro_batch · seq_len`` tokens and ``d_model``):
    ``{"bytes", "calls", "per_call": [bytes of each call]}``; nothing at ``tp = 1`` (one rank holds whole
    matrices, no partial sums to add)."""
    if tp == 1:
        return {"bytes": 0, "calls": 0, "per_call": []}
    per_call = []
    for phase in megatron_per_layer(cfg.micro_batch * cfg.seq_len, cfg.d_model, dtype_bytes).values():
        n = sum(phase["calls"].values())
        per_call += [phase["bytes"] // n] * n
    per_call *= cfg.layers
    return {"bytes": sum(per_call), "calls": len(per_call), "per_call": per_call}


def alpha_seconds(results: list) -> float | None:
    """The ring's per-step latency ``α`` measured on these ranks and this link: the slowest rank's median
    time of a one-float all-reduce (``small_allreduce_s``; its bytes take no time at any rate here) over
    the ``2(n−1)`` steps of a ring (:func:`teraflops.comm_cost.ring_allreduce_seconds`). None on one rank."""
    n = len(results)
    if n < 2 or not all(r.small_allreduce_s for r in results):
        return None
    return max(statistics.median(r.small_allreduce_s) for r in results) / (2 * (n - 1))


def predicted_comm_seconds(cfg: TrainConfig, tp: int, rate: float, alpha: float = 0.0) -> float:
    """Seconds one TP step's all-reduces take by the alpha-beta model: each call of :func:`formula_per_step`
    a ring all-reduce of its bytes over ``tp`` ranks at ``rate`` bytes/s per direction, ``α`` per ring
    step (:func:`teraflops.comm_cost.ring_allreduce_seconds`), one after the other (each is the next
    layer's input). 0 at ``tp = 1``."""
    calls = formula_per_step(cfg, tp)["per_call"]
    return sum(ring_allreduce_seconds(b, tp, rate, alpha) for b in calls)


def degree_row(got: TensorParallelRun) -> dict:
    """One row of the degree table from one launch's ``"tp"`` mode: :func:`mode_rows`' ``tp``, ``nodes``,
    ``link``, ``step_ms``, ``comm_ms``, ``compute_ms``, ``comm_share``, ``bytes_per_step`` and
    ``calls_per_step`` (counted by ``CommDebugMode``), and beside them ``tokens``, ``formula_bytes`` and
    ``formula_calls`` (:func:`formula_per_step`), ``wire_bytes`` (what a ring all-reduce moves over each
    rank's link: the bytes × ``2(n−1)/n``, nccl-tests' bus factor), ``alpha_s`` (:func:`alpha_seconds`),
    ``rate`` and, on a shaped link, ``predicted_comm_ms`` (:func:`predicted_comm_seconds` at the link's
    rate and the measured ``α``) and ``predicted_share`` (of the predicted communication plus the
    measured compute); both None on loopback, which has no rate to price."""
    row = {**next(r for r in got.rows if r["mode"] == "tp")}
    cfg, tp = got.results[0].config, len(got.results)
    want = formula_per_step(cfg, tp)
    alpha = alpha_seconds(got.results)
    row.update(tp=tp, rate=got.rate, tokens=cfg.micro_batch * cfg.seq_len, formula_bytes=want["bytes"],
               formula_calls=want["calls"], alpha_s=alpha,
               wire_bytes=row["bytes_per_step"] * bus_factor("all_reduce", tp) if tp > 1 else 0,
               predicted_comm_ms=None, predicted_share=None)
    if got.rate is not None:
        predicted = predicted_comm_seconds(cfg, tp, got.rate, alpha or 0.0) * 1e3
        row.update(predicted_comm_ms=predicted, predicted_share=predicted / (predicted + max(row["compute_ms"], 0.0)))
    return row


def degree_rows(runs) -> list[dict]:
    """:func:`degree_row` of each launch, inside a node first, then by degree."""
    return sorted((degree_row(g) for g in runs), key=lambda r: (r["nodes"], r["tp"]))


def degree_table(rows: list[dict]) -> str:
    """The degree sweep as a table: per degree and link, bytes all-reduced per step counted and by
    Megatron's formula, calls, bytes over each rank's link, step and communication time measured
    and by the alpha-beta model, and their shares of the step."""
    def ms(v):
        return "–" if v is None else f"{v:.3g}"

    out = [(r["tp"], "loopback" if r["nodes"] == 1 else f"{r['nodes']} nodes, {r['rate'] / 1e6:.3g} MB/s",
            fmt_bytes(r["bytes_per_step"]), fmt_bytes(r["formula_bytes"]), f"{r['calls_per_step']} / {r['formula_calls']}",
            fmt_bytes(r["wire_bytes"]), r["step_ms"], r["comm_ms"], ms(r["predicted_comm_ms"]), f"{r['comm_share']:.0%}",
            "–" if r["predicted_share"] is None else f"{r['predicted_share']:.0%}") for r in rows]
    return table(out, ["TP", "link", "all-reduced/step", "Megatron", "calls / formula", "over each link", "step ms",
                       "comm ms", "α-β ms", "comm share", "α-β share"])


def degree_sweep(cfg: TrainConfig, degrees=(1, 2, 4), rate: float | None = None, *, known=(), steps: int = 3,
                 warmup: int = 1, timeout: float | None = None) -> dict:
    """Megatron TP of ``cfg`` at each degree inside one node (loopback) and, with ``rate``, each degree
    >= 2 across two emulated nodes joined by links of ``rate`` bytes/s (one cluster for all of them:
    ``tp/2`` ranks per node, so a ring of ``tp`` ranks crosses the link twice, once each way).

    Args:
        degrees: TP degrees (each divides the heads: :func:`check_degree`).
        known: :class:`TensorParallelRun` s already made (e.g. :func:`link_comparison`'s ``inside`` and
            ``across``); a degree and node count they cover is not launched again.
        steps, warmup, timeout: per launch (:func:`run`).

    Returns:
        ``{"rows": degree_rows, "runs": [TensorParallelRun], "unavailable": None or one line}``; where
        emulated nodes cannot be made here, the one-node rows only and ``unavailable`` says why.
    """
    for tp in degrees:
        check_degree(cfg, tp)
    runs = [g for g in known if g is not None]
    have = {(len(g.results), g.nodes) for g in runs}
    for tp in degrees:
        if (tp, 1) not in have:
            runs.append(run(cfg, tp, steps=steps, warmup=warmup, timeout=timeout))
    across = [tp for tp in degrees if tp >= 2 and (tp, 2) not in have] if rate is not None else []
    why = unavailable() if across else None
    if across and why is None:
        with Cluster(2, Link(rate=rate)) as cluster:
            runs += [run(cfg, tp, steps=steps, warmup=warmup, cluster=cluster, timeout=timeout) for tp in across]
    return {"rows": degree_rows(runs), "runs": runs,
            "unavailable": None if why is None else f"emulated nodes unavailable here ({why}): the one-node rows only"}
