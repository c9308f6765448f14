"""Model-state memory of data-parallel training, and what ZeRO's three stages save.

Source: Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020 (arXiv:1910.02054). Ψ is the number of parameters, Nd the
data-parallel degree (number of devices), K the bytes of optimizer state per parameter.

* **§3.1, model states of mixed-precision Adam**: fp16 parameters (2Ψ bytes) and fp16 gradients
  (2Ψ), plus optimizer states in fp32: a master copy of the parameters, Adam's momentum and its
  variance (4Ψ each, so K = 12). In all 16Ψ bytes: a 7.5B-parameter model needs 120 GB.
* **§5 and Figure 1, per-device memory of each stage**: plain data parallelism replicates
  everything, (2 + 2 + K)Ψ; P_os partitions the optimizer states, 4Ψ + KΨ/Nd; P_os+g also the
  gradients, 2Ψ + (2 + K)Ψ/Nd; P_os+g+p also the parameters, (2 + 2 + K)Ψ/Nd. DeepSpeed calls
  these ZeRO stages 0 to 3; :func:`figure1` reproduces the figure's 7.5B, Nd = 64 example.
* **§7, communication per device per step**: data parallelism all-reduces the gradients, which
  state-of-the-art all-reduce does as a reduce-scatter then an all-gather, Ψ elements each: 2Ψ.
  P_os and P_os+g keep 2Ψ (reduce-scatter the gradients, all-gather the updated parameters).
  P_os+g+p all-gathers the parameters in the forward pass, again in the backward pass, and
  reduce-scatters the gradients: 3Ψ, 1.5× the baseline (:func:`comm_volume`).

Model states only: activations, temporary buffers and fragmentation (the paper's "residual
states", §3.2) come on top. Units: bytes; GB = 1e9 bytes (the paper's unit: its 120 GB is
16 × 7.5e9 bytes); GiB = 2**30 bytes (what DeepSpeed's estimators print, labelled "GB").
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from teraflops import widgets
from teraflops.datasheets import PUBLISHED
from teraflops.machine import GiB  # noqa: F401 - re-exported: one home for the unit
from teraflops.tables import GB, fmt, fmt_count, table

STAGE_NAMES = ("DP (replicated)", "P_os", "P_os+g", "P_os+g+p")  # the paper's names for stages 0-3


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state.

    Attributes:
        name: label for tables and widgets.
        param_bytes: the working copy of the parameters the forward and backward passes use.
        grad_bytes: the gradients.
        optimizer_bytes: K of the paper, all optimizer state per parameter, fp32 (4 bytes) each.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def optimizer_elements_per_param(self) -> float:
        """fp32 optimizer values per parameter: ``optimizer_bytes / 4`` (3 for mixed-precision Adam)."""
        return self.optimizer_bytes / 4


MIXED_ADAM = Precision("mixed-precision Adam", 2, 2, 12)
"""The paper's case (§3.1): fp16 parameters and gradients; fp32 master parameters, momentum and
variance (K = 12). bf16 training has the same byte counts."""

FP32_ADAM = Precision("fp32 Adam", 4, 4, 8)
"""Plain fp32 training with ``torch.optim.Adam``: the parameters are the master copy, so the
optimizer holds only momentum and variance (K = 8); 16Ψ in all, the same as mixed precision."""

FP32_ADAM_MASTER = Precision("fp32 Adam + fp32 master partition (DeepSpeed ZeRO)", 4, 4, 12)
"""fp32 training under DeepSpeed's ZeRO optimizers (``deepspeed/runtime/zero/stage_1_and_2.py`` and
``stage3.py``, 0.19.8): they keep this rank's partition of the weights as a separate fp32 master
copy whatever the model's dtype, so an fp32 model carries 3 fp32 optimizer values per parameter
(master, momentum, variance), K = 12, 20Ψ in all at stage 0's accounting. ``stage3.py`` has a
branch meant to reuse an fp32 parameter partition as the master, but 0.19.8 compares the
partition's ``torch.device`` with a device *string*, so the copy is always made (measured in
:mod:`teraflops.parallelization.zero`: 3 values per parameter at stages 1, 2 and 3)."""


def _check(psi, stage, nd) -> None:
    if isinstance(psi, bool) or not isinstance(psi, numbers.Real) or not psi > 0 or psi == float("inf"):
        raise ValueError(f"psi must be a positive number of parameters, got {psi!r}. Hint: 7.5 billion is 7.5e9")
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage <= 3:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}. "
                         "Hint: 0 = plain data parallel, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p")
    if isinstance(nd, bool) or not isinstance(nd, numbers.Integral) or nd < 1:
        raise ValueError(f"nd must be an integer number of data-parallel devices >= 1, got {nd!r}. "
                         "Hint: nd = 1 is a single device")


@dataclass(frozen=True)
class ModelStates:
    """Model-state memory of one device under one ZeRO stage.

    ``*_elements`` are numbers of values held per device (floats: Ψ/Nd need not be whole);
    ``*_bytes`` are bytes per device. Build one with :func:`model_states`.
    """

    psi: float
    stage: int
    nd: int
    precision: Precision
    params_elements: float
    grads_elements: float
    optimizer_elements: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        """Parameters + gradients + optimizer states, bytes per device."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def name(self) -> str:
        """The paper's name for the stage: ``"P_os+g"`` for stage 2."""
        return STAGE_NAMES[self.stage]

    @property
    def formula(self) -> str:
        """Bytes per device as a formula in Ψ and Nd with this precision's numbers, e.g. ``"4Ψ + 12Ψ/Nd"``."""
        p = self.precision
        whole = [p.param_bytes, p.grad_bytes, p.optimizer_bytes]
        split = [0, 0, 0]
        for i in range(self.stage):  # stage s partitions the last s states: optimizer, grads, params
            split[2 - i], whole[2 - i] = whole[2 - i], 0
        terms = [f"{sum(whole)}Ψ" if sum(whole) else "", f"{sum(split)}Ψ/Nd" if sum(split) else ""]
        return " + ".join(t for t in terms if t)


def model_states(psi: float, stage: int, nd: int, precision: Precision = MIXED_ADAM) -> ModelStates:
    """Per-device model-state memory of a Ψ-parameter model on ``nd`` data-parallel devices.

    Stage 0 replicates parameters, gradients and optimizer states on every device; stage 1 (P_os)
    divides the optimizer states by Nd, stage 2 (P_os+g) the gradients too, stage 3 (P_os+g+p)
    the parameters too (ZeRO §5, Figure 1; see the module docstring). With
    :data:`MIXED_ADAM`, stage 1 is ``4Ψ + 12Ψ/Nd`` bytes.

    Raises:
        ValueError: ``psi`` not a positive number, ``stage`` not in 0-3, ``nd`` not an integer >= 1.
    """
    _check(psi, stage, nd)
    opt = psi * precision.optimizer_elements_per_param / (nd if stage >= 1 else 1)
    grads = psi / (nd if stage >= 2 else 1)
    params = psi / (nd if stage >= 3 else 1)
    return ModelStates(psi, stage, nd, precision, params, grads, opt,
                       params * precision.param_bytes, grads * precision.grad_bytes, opt * 4)


def figure1(psi: float = 7.5e9, nd: int = 64, precision: Precision = MIXED_ADAM) -> list[ModelStates]:
    """Stages 0-3 for one model: by default ZeRO's Figure 1, a 7.5B-parameter model on 64 devices
    with mixed-precision Adam, which the paper labels 120, 31.4, 16.6 and 1.9 GB per device."""
    return [model_states(psi, stage, nd, precision) for stage in range(4)]


def format_gb(nbytes: float, decimals: int | None = None) -> str:
    """Bytes as GB (1e9 bytes): 3 significant figures by default, or ``decimals`` places.

    Figure 1 of the paper prints one decimal place: ``(2+2+12)·7.5e9/64`` bytes is exactly 1.875 GB,
    which 3 significant figures print as ``"1.88"`` and the paper as ``"1.9"``
    (``format_gb(x, decimals=1)``, trailing ``.0`` dropped: ``"120"``).
    """
    gb = nbytes / GB
    if decimals is None:
        return fmt(gb, 3)
    return f"{round(gb, decimals):,g}"


def model_states_table(rows: list[ModelStates]) -> str:
    """One line per :class:`ModelStates`: stage, paper's name, formula, GB of each state and the
    total (3 significant figures), and the total with one decimal as Figure 1 prints it."""
    return table(
        [(r.stage, r.name, r.formula, r.params_bytes / GB, r.grads_bytes / GB, r.optimizer_bytes / GB,
          r.total_bytes / GB, format_gb(r.total_bytes, decimals=1)) for r in rows],
        ["stage", "ZeRO", "bytes per device", "params GB", "grads GB", "optimizer GB", "total GB", "as Figure 1"],
    )


def comm_volume(psi: float, stage: int, bytes_per_element: int = 2) -> float:
    """Bytes one device sends per training step, by the paper's accounting (ZeRO §7).

    2Ψ elements for stages 0-2 (a reduce-scatter and an all-gather of Ψ each), 3Ψ for stage 3
    (all-gather in the forward pass, all-gather in the backward pass, reduce-scatter of the
    gradients), times ``bytes_per_element`` (2: the paper's fp16). It counts each collective as
    Ψ per device, the limit of :func:`comm_volume_ring` as Nd grows.

    Raises:
        ValueError: ``psi`` or ``stage`` as in :func:`model_states`, or ``bytes_per_element`` < 1.
    """
    _check(psi, stage, 1)
    if isinstance(bytes_per_element, bool) or not isinstance(bytes_per_element, numbers.Integral) or bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be a positive integer, got {bytes_per_element!r}. Hint: fp16 is 2")
    return (3 if stage == 3 else 2) * psi * bytes_per_element


def parameter_uses(model) -> list[tuple[int, int]]:
    """``(elements, modules)`` per distinct parameter of ``model`` (an ``nn.Module``): how many
    submodules hold it directly (``parameters(recurse=False)``). 1 for an ordinary parameter; 2 for
    a tied one such as GPT-2's token embedding, which is also the output head's weight."""
    uses: dict[int, list] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            uses.setdefault(id(p), [p.numel(), 0])[1] += 1
    return [(n, k) for n, k in uses.values()]


def comm_volume_per_use(uses, stage: int, bytes_per_element: int = 2) -> float:
    """Bytes one device sends per step, :func:`comm_volume`'s accounting applied per use of each
    parameter: ``uses`` is :func:`parameter_uses` of the model, ``[(elements n, modules k), ...]``.

    Stages 0-2: ``Σ 2n`` = 2Ψ (gradients are reduced once per parameter, however many modules use
    it). Stage 3: ``Σ n · (2k + 1)``: DeepSpeed's stage-3 parameter coordinator all-gathers a
    module's partitioned parameters in that module's pre-forward hook and again in its
    pre-backward hook, and releases them after (``deepspeed/runtime/zero/parameter_offload.py``,
    ``partitioned_param_coordinator.py``; "ZeRO-3 ... gathers parameters just before a submodule's
    forward or backward", DeepSpeed ZeRO docs, https://deepspeed.readthedocs.io/en/latest/zero3.html),
    so a parameter held by k modules is gathered k times per pass; its gradient is reduce-scattered
    once. With every k = 1 this is the paper's 3Ψ; a tied embedding of V·d elements adds 2·V·d.

    Raises:
        ValueError: as :func:`comm_volume`, or an entry that is not two positive integers.
    """
    uses = [tuple(u) for u in uses]
    if not uses or any(len(u) != 2 or not all(isinstance(x, numbers.Integral) and x >= 1 for x in u) for u in uses):
        raise ValueError("uses must be [(elements, modules), ...] of positive integers. "
                         "Hint: model_states.parameter_uses(model)")
    psi = sum(n for n, _ in uses)
    base = comm_volume(psi, stage, bytes_per_element)
    if stage != 3:
        return base
    return sum(n * (2 * k + 1) for n, k in uses) * bytes_per_element


def comm_volume_ring(psi: float, stage: int, nd: int, bytes_per_element: int = 2) -> float:
    """Bytes one device sends per training step with ring collectives on ``nd`` devices.

    A ring reduce-scatter or all-gather of Ψ elements makes each device send (Nd-1)/Nd · Ψ
    (Nd-1 steps of Ψ/Nd; the factor nccl-tests' ``doc/PERFORMANCE.md`` uses for bus bandwidth,
    and twice it for all-reduce). So ``comm_volume · (Nd-1)/Nd``: 0 on one device, and the
    paper's 2Ψ / 3Ψ as Nd grows (within 2% from Nd = 64).

    Raises:
        ValueError: as :func:`comm_volume`, or ``nd`` not an integer >= 1.
    """
    _check(psi, stage, nd)
    return comm_volume(psi, stage, bytes_per_element) * (nd - 1) / nd


def deepspeed_estimates(psi: int, nd: int, largest_layer_params: int | None = None) -> list[dict]:
    """DeepSpeed's own GPU-memory estimates for ZeRO stages 2 and 3 (no offload) next to ours.

    Calls ``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py``;
    DeepSpeed has no separate stage-1 estimator) and ``estimate_zero3_model_states_mem_needs``
    (``stage3.py``) with ``cpu_offload=False`` (and ``cpu_offload_params=False``), all ``nd`` GPUs
    on one node: the GPU figure depends only on the total GPU count. As DeepSpeed 0.19.8 computes
    them, in bytes:

    * stage 2: ``2Ψ + 18Ψ/Nd``, not the paper's ``2Ψ + 14Ψ/Nd``: its comment splits the 18 into
      fp16 gradients (2), an fp32 gradient partition (4; the optimizer steps on fp32 gradients),
      fp32 parameters (4) and momentum + variance (8).
    * stage 3: ``4·L + 18Ψ/Nd`` with L = ``largest_layer_params`` (``None`` counts 0), against
      the paper's ``16Ψ/Nd``. The code explains neither term; 4 bytes per parameter of the
      largest layer fits that layer gathered whole on every GPU, its 16-bit parameters and
      gradients (2 bytes each), which the paper's per-device formula leaves out.

    ``additional_buffer_factor`` (1.5 by default) multiplies DeepSpeed's CPU estimate only: the GPU
    numbers here carry no buffer factor. Its printing variants (``..._all_cold``) divide bytes by
    2**30 and label the result "GB": those are GiB, about 7% below the same bytes in GB.

    Returns:
        One dict per stage: ``stage``, ``deepspeed_gpu_bytes``, ``ours_bytes`` (mixed-precision
        Adam, :func:`model_states`), ``ratio`` (DeepSpeed / ours) and ``deepspeed_formula``.

    Raises:
        ValueError: as :func:`model_states`, or ``largest_layer_params`` negative or above ``psi``.
        ImportError: DeepSpeed is not installed.
    """
    _check(psi, 0, nd)
    layer = 0 if largest_layer_params is None else largest_layer_params
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer <= psi:
        raise ValueError(f"largest_layer_params must be an integer between 0 and psi, got {largest_layer_params!r}. "
                         "Hint: the parameters of the biggest single module, often the embedding (vocab × hidden)")
    estimate_zero2, estimate_zero3 = deepspeed_estimators()
    total = int(round(psi))
    _, zero2_gpu = estimate_zero2(total, num_gpus_per_node=nd, num_nodes=1, cpu_offload=False)
    _, zero3_gpu, _ = estimate_zero3(total, layer, num_gpus_per_node=nd, num_nodes=1, cpu_offload=False,
                                     cpu_offload_params=False, zero_init=True)
    rows = []
    for stage, gpu_bytes, formula in ((2, zero2_gpu, "2Ψ + 18Ψ/Nd"), (3, zero3_gpu, "4L + 18Ψ/Nd")):
        ours = model_states(psi, stage, nd).total_bytes
        rows.append({"stage": stage, "deepspeed_gpu_bytes": gpu_bytes, "ours_bytes": ours,
                     "ratio": gpu_bytes / ours, "deepspeed_formula": formula})
    return rows


def deepspeed_estimators():
    """Import DeepSpeed's two estimators (a few seconds) without its import-time log lines
    (e.g. "Setting accelerator to CPU"). Logging is paused rather than redirected: DeepSpeed's
    logger binds ``sys.stdout`` when it is created, and later messages must still show."""
    import logging
    import warnings

    paused = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    finally:
        logging.disable(paused)
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def memory_capacities() -> list[tuple[str, float]]:
    """``(label, GB)`` of the device memories drawn on the plots: 80 GB (A100 80GB, H100 SXM) and
    141 GB (H200), from the datasheet table :data:`teraflops.datasheets.PUBLISHED`, drawn as printed.
    What a GPU reports in bytes (``torch.cuda.mem_get_info``) need not equal the datasheet figure
    times 1e9, and activations and buffers need room too: a bar just under a line does not fit."""
    by_name = {g.name: g for g in PUBLISHED}
    return [("A100 / H100 80 GB", by_name["H100 SXM"].memory_gb), ("H200 141 GB", by_name["H200 SXM"].memory_gb)]


def plot_model_states(rows: list[ModelStates], ax=None, highlight: int | None = None):
    """Stacked bars of parameters, gradients and optimizer states (GB per device), one bar per row,
    with the totals written on top and the 80 GB and 141 GB device memories as horizontal lines.

    ``highlight`` (a stage) draws the other bars faded. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(10, 5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    handles = []
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        gb = [getattr(r, f"{part}_bytes") / GB for r in rows]
        bars = ax.bar(x, gb, bottom=bottom, color=color)
        for bar, r in zip(bars, rows):
            bar.set_alpha(1.0 if highlight is None or r.stage == highlight else 0.35)
        handles.append(Patch(color=color, label=part))
        bottom = [b + g for b, g in zip(bottom, gb)]
    capacities = memory_capacities()
    top = max(bottom + [gb for _, gb in capacities])
    for xi, total in zip(x, bottom):
        ax.text(xi, total + 0.01 * top, f"{format_gb(total * GB)} GB", ha="center", va="bottom", fontsize="small")
    for (label, gb), style in zip(capacities, ("--", ":")):
        handles.append(ax.axhline(gb, color="black", ls=style, lw=1, label=label))
    ax.set_xticks(x, [f"stage {r.stage}\n{r.name}" for r in rows])
    ax.set_ylim(0, top * 1.1)
    ax.set_ylabel("model states per device (GB = 1e9 bytes)")
    r = rows[0]
    ax.set_title(f"computed from ZeRO's formulas, not measured: Ψ = {r.psi / 1e9:.3g} billion parameters, "
                 f"Nd = {r.nd}, {r.precision.name}", fontsize="medium")
    # below the axes: the bars keep the figure's width, so their tick labels stay apart at a room's scale
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize="small",
              frameon=False)
    if own:
        ax.figure.tight_layout()
    return ax


# Ψ on the model-state slider: a 1-1.5-2-3-5-7.5 grid from 100 M to 1 T, with the ZeRO paper's 7.5 B
# and common open-model sizes (7, 13, 70, 175, 405 B), read as "7.5 B", not "7.5e+9"
PSI_OPTIONS = tuple(sorted({float(round(m * 10**e)) for e in range(8, 12) for m in (1, 1.5, 2, 3, 5, 7.5)}
                           | {7e9, 13e9, 70e9, 175e9, 405e9, 1e12}))


def model_state_widget():
    """Sliders for parameters Ψ, data-parallel devices Nd, ZeRO stage and optimizer precision →
    stacked bars of parameters, gradients and optimizer states per device for stages 0-3
    (:func:`teraflops.parallelization.model_states.model_states`, ZeRO §5), the chosen stage highlighted, drawn
    against the 80 GB and 141 GB (GB = 1e9) of an H100 and an H200.

    Returns the ``ipywidgets.interactive``; its ``result`` is the chosen stage's
    :class:`~teraflops.parallelization.model_states.ModelStates`."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    def show(psi, nd, stage, precision):
        rows = figure1(psi, nd, precision)
        chosen = rows[stage]
        fig, ax = plt.subplots(figsize=(10, 5))
        plot_model_states(rows, ax=ax, highlight=stage)
        fits = [label for label, gb in memory_capacities() if chosen.total_bytes / GB <= gb]
        verdict = f"fits {fits[0]} (model states only)" if fits else "fits on neither GPU"
        ax.set_title(f"stage {stage} ({chosen.name}, {chosen.formula}): {format_gb(chosen.total_bytes)} GB per device, "
                     f"{verdict}\nΨ = {psi / 1e9:.3g} billion, Nd = {nd}, {precision.name}", fontsize="small")
        fig.tight_layout()
        plt.show()
        return chosen

    ui = W.interactive(show, **widgets.controls(
        psi=W.SelectionSlider(options=[(fmt_count(v), v) for v in PSI_OPTIONS], value=7.5e9, description="Ψ params"),
        nd=W.SelectionSlider(options=[2**k for k in range(11)], value=64, description="Nd devices"),
        stage=W.IntSlider(value=3, min=0, max=3, description="ZeRO stage"),
        precision=W.Dropdown(options=[(p.name, p) for p in (MIXED_ADAM, FP32_ADAM, FP32_ADAM_MASTER)],
                             value=MIXED_ADAM, description="optimizer"),
    ))
    widgets.show_widget(ui)
    return ui
