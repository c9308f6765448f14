"""``teraflops demo``: each failure mode of the course in one command, for a talk.

One mode per failure mode the lectures teach, each a few seconds to half a minute warm on a laptop's CPU,
each ending in **one large figure and one sentence of verdict** computed from what it measured:

============== ====================================================================================
mode           what it measures (the lecture helper it calls)
============== ====================================================================================
attention      peak memory and time of naive vs fused (flash) attention against N (Unit 1,
               :func:`teraflops.model_definition.attention.attention_sweep`)
zero           model-state bytes per rank at the backward pass's peak, ZeRO stages 0-3 under
               DeepSpeed (Unit 2, :func:`teraflops.parallelization.zero.run_zero`)
straggler      how long the healthy ranks wait for one late rank (Unit 3,
               :func:`teraflops.orchestration.stragglers.run`)
compile        launches and time per decoded token, eager vs ``torch.compile``, and int8 weight bytes
               (Unit 4, :mod:`teraflops.compilation.decode`, :mod:`teraflops.compilation.quantization`)
interconnect   all-reduce bus bandwidth against message size, below the memory-copy bandwidth every
               rank's bytes cross on one machine (Unit 5, :func:`teraflops.hardware.collectives.sweep`)
triage         the verdict of Unit 6's triage on three profiled workloads
               (:func:`teraflops.triage.workloads.verdict_rows`)
============== ====================================================================================

Numbers that tell the story on a busy machine: in-process timings run with one torch thread
(:func:`pinned_threads`: intra-op threads fighting other processes for two cores swamp small-op
timings), are medians of repeats (:func:`teraflops.timing.benchmark`, interleaved rounds for before/after
pairs), at sizes where the effect is many times the noise. Each :class:`DemoResult` carries ``story``:
whether the lecture's claim holds on these numbers (e.g. flash attention's peak memory below naive's at
every N); the figure and verdict are shown either way.

``--warm`` (:func:`warm`) builds what a first run would otherwise build during the talk (DeepSpeed's CPU
op, the compiled decode step in torch.compile's disk cache, Matplotlib's font cache). ``--record DIR``
writes each mode's result (``MODE.json``) and figure (``MODE.png``, ``MODE.svg``); ``--fallback DIR``
shows that recorded run, said to be one, when a live mode fails. Nothing is downloaded: the models and
data are generated.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from teraflops import plots
from teraflops.errors import CourseError
from teraflops.launch import notebook
from teraflops.machine import detect, load_average

__all__ = ["MODES", "RUNNERS", "DemoResult", "DemoError", "check_modes", "pinned_threads", "run_mode", "run_modes",
           "warm", "record", "recorded", "show", "story_holds"]

MODES = ("attention", "zero", "straggler", "compile", "interconnect", "triage")
TITLES = {
    "attention": "Attention memory: naive vs flash",
    "zero": "ZeRO: model states per rank, stages 0-3",
    "straggler": "One straggler stalls every rank",
    "compile": "Decode at batch 1: launch overhead, torch.compile, int8",
    "interconnect": "All-reduce bandwidth vs message size",
    "triage": "Triage: which bottleneck is it?",
}
ATTENTION_SEQ_LENS = (256, 512, 1024, 2048)  # naive's N×N scores reach 2·4·2048²·4 B = 134 MB at the last
ATTENTION_SHAPE = (1, 4, 32)  # batch, heads, head_dim
STRAGGLER_DELAY_MS = 200  # several times a CPU step of the course's small GPT (~20-60 ms), far above noise
STRAGGLER_STEPS = 6
ZERO_STEPS = 2  # one warm-up step (the memory is counted there) and one timed
ALLREDUCE_SIZES = tuple(4 ** k for k in range(6, 14))  # 4 KiB ... 64 MiB
COMPILE_ROUNDS = 3  # interleaved eager/compiled rounds; the median of each side
TRIAGE_WORKLOADS = ("matmul", "naive_attention", "decode")


class DemoError(CourseError, ValueError):
    """An unknown mode, or a fallback folder without a recording of the mode."""


@dataclass
class DemoResult:
    """One mode's run.

    Attributes:
        mode: a name of :data:`MODES`; title: the figure's title.
        verdict: one sentence, computed from ``numbers``.
        numbers: what the verdict and ``story`` read (bytes, seconds, ratios; keys per mode).
        story: the lecture's claim holds on these numbers.
        seconds: wall time of the mode (s); load: the 1-minute load average when it ended.
        machine: :meth:`teraflops.machine.Machine.summary` of where it ran.
        recorded_at: ISO time of the run (UTC).
        figure: the Matplotlib figure (not serialised; ``None`` for a recording read back).
    """

    mode: str
    title: str
    verdict: str
    numbers: dict
    story: bool
    seconds: float = 0.0
    load: float | None = None
    machine: str = ""
    recorded_at: str = ""
    figure: object = field(default=None, repr=False, compare=False)

    def as_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "figure"}

    def line(self) -> str:
        """``mode: verdict`` plus a warning when the story does not hold."""
        warn = "" if self.story else " (these numbers do not tell the lecture's story: is the machine busy?)"
        return f"{self.mode}: {self.verdict}{warn}"


@contextlib.contextmanager
def pinned_threads(n: int = 1):
    """torch's intra-op threads set to ``n`` for the block, then restored."""
    import torch  # lazy: `teraflops demo --help` answers without torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_modes(modes) -> tuple[str, ...]:
    modes = tuple(modes) or MODES
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise DemoError(f"unknown demo mode {', '.join(map(repr, bad))}. Hint: one or more of {', '.join(MODES)}")
    return modes


def _mb(b: float) -> str:
    return f"{b / 1e6:.3g} MB"


def _figure(ncols: int = 1, width: float = 12.0, height: float = 5.5):
    import matplotlib.pyplot as plt  # lazy: Matplotlib only where a figure is drawn

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


# ---- the modes -------------------------------------------------------------------------------------


def _attention() -> DemoResult:
    import torch

    from teraflops.model_definition import attention  # lazy: a mode loads only its unit

    b, h, d = ATTENTION_SHAPE
    device = detect().device
    with pinned_threads():
        rows = attention.attention_sweep(ATTENTION_SEQ_LENS, b, h, d, torch.float32, device,
                                         impls=("naive", "sdpa"), min_run_time=0.2, progress=False)
    q = torch.zeros(1, 1, 8, d, device=device)
    backend = attention.sdpa_backend(q, q, q)
    naive = {r.seq_len: r.peak_bytes for r in rows if r.impl == "naive" and not r.oom}
    flash = {r.seq_len: r.peak_bytes for r in rows if r.impl == "sdpa" and not r.oom}
    n = max(set(naive) & set(flash))
    ratio = naive[n] / flash[n]
    fig = attention.plot_sweep(rows, b, h, d, 4)
    fig.set_size_inches(14, 6)
    fig.suptitle(TITLES["attention"] + f" (SDPA backend: {backend})")
    fig.tight_layout()
    numbers = {"seq_len": n, "naive_peak_bytes": naive[n], "flash_peak_bytes": flash[n], "ratio": ratio,
               "naive": naive, "flash": flash}
    verdict = (f"at N = {n} naive attention held {_mb(naive[n])}, {ratio:.0f}× the {_mb(flash[n])} of fused "
               f"attention ({backend}): it writes the N × N scores, which grow as N², while flash keeps O(N)")
    return DemoResult("attention", TITLES["attention"], verdict, numbers, story_holds("attention", numbers), figure=fig)


def _zero() -> DemoResult:
    from teraflops.launch import ops  # lazy: a mode loads only its unit
    from teraflops.parallelization import zero  # lazy: a mode loads only its unit

    ops.prepare_deepspeed_ops()
    runs = zero.run_zero(steps=ZERO_STEPS)
    world = runs[0].world_size
    peak = {r.stage: max(r.peak_bytes(k) for k in range(world)) for r in runs}
    fig, (ax,) = _figure()
    x = list(range(len(runs)))
    zero.stack_states(ax, runs, [max(range(world), key=r.peak_bytes) for r in runs])
    for i, r in enumerate(runs):
        ax.annotate(f"{peak[r.stage] / 1e6:.2f} MB", (i, peak[r.stage] / 1e6), ha="center", va="bottom",
                    xytext=(0, 4), textcoords="offset points")
    ax.set_xticks(x, [f"stage {r.stage}\n{zero.STAGE_NAMES[r.stage]}" for r in runs])
    ax.set_ylim(0, max(peak.values()) / 1e6 * 1.5)  # room for the two-row legend above the tallest bar
    ax.set_ylabel("MB per rank (measured)")
    ax.legend(loc="upper right", ncols=2)
    ax.set_title(TITLES["zero"])
    ax.set_xlabel(f"{world} ranks ({runs[0].backend}), Ψ = {runs[0].psi:,} parameters, fp32; the rank with the most")
    fig.tight_layout()
    verdict = (f"per rank, model states at their peak fall from {_mb(peak[0])} (stage 0) to {_mb(peak[1])} "
               f"(1: optimizer states sharded), {_mb(peak[2])} (2: + gradients) and {_mb(peak[3])} "
               f"(3: + parameters) on {world} ranks, the stage-3 bytes sent per step "
               f"{runs[-1].comm_bytes / runs[0].comm_bytes:.2g}× stage 0's"
               + (f"; the hatched top of the optimizer bars is DeepSpeed's fp32 master copy of the weights "
                  f"({_mb(runs[1].master() * 4)} per rank at stage 1), kept even in fp32" if runs[1].master() else ""))
    numbers = {"peak_bytes": {str(k): v for k, v in peak.items()}, "world_size": world, "psi": runs[0].psi,
               "comm_bytes": {str(r.stage): r.comm_bytes for r in runs}}
    return DemoResult("zero", TITLES["zero"], verdict, numbers, story_holds("zero", numbers), figure=fig)


def _straggler() -> DemoResult:
    from teraflops.orchestration import stragglers  # lazy: a mode loads only its unit

    run = stragglers.run(experiments=("sweep",), delays_ms=(0, STRAGGLER_DELAY_MS), steps=STRAGGLER_STEPS)
    rows = {r["delay_ms"]: r for r in stragglers.sweep_rows(run)}
    base, late = rows[0], rows[STRAGGLER_DELAY_MS]
    fig, (ax,) = _figure(height=0.8 * run.world_size + 2.5)
    stragglers.plot_timeline(run.sweep[-1], ax=ax)
    ax.set_title(f"{TITLES['straggler']}: rank delayed {STRAGGLER_DELAY_MS} ms per step, {run.world_size} ranks")
    fig.tight_layout()
    verdict = (f"one rank {late['late_ms']:.0f} ms late per step left the {run.world_size - 1} healthy ranks idle "
               f"{late['healthy_idle']:.0%} of their time ({base['healthy_idle']:.0%} without it; the model predicts "
               f"{late['predicted_idle']:.0%}) and stretched a step from {base['step_ms']:.0f} to {late['step_ms']:.0f} ms: "
               "synchronous training runs at the pace of its slowest rank")
    numbers = {k: {"healthy_idle": r["healthy_idle"], "predicted_idle": r["predicted_idle"], "step_ms": r["step_ms"],
                   "late_ms": r["late_ms"]} for k, r in (("baseline", base), ("straggler", late))}
    return DemoResult("straggler", TITLES["straggler"], verdict, numbers, story_holds("straggler", numbers), figure=fig)


def _compile() -> DemoResult:
    import torch

    from teraflops import sizing  # lazy: a mode loads only its unit
    from teraflops.compilation import decode, quantization  # lazy: a mode loads only its unit

    p = sizing.preset()
    with pinned_threads(), torch.no_grad():
        model = decode.decode_model(p, dtype=torch.float32).eval()
        cache = model.new_cache(1)
        eager_l = decode.launches_per_token(decode.decode_step, model, cache).total
        compiled = decode.compile_decode(model, cache)
        comp_l = decode.launches_per_token(compiled.step, model, cache).total
        eager_s, comp_s = [], []
        for _ in range(COMPILE_ROUNDS):  # interleaved: a burst of load hits both sides alike
            eager_s.append(decode.step_seconds(decode.decode_step, model, cache, min_run_time=0.3))
            comp_s.append(decode.step_seconds(compiled.step, model, cache, min_run_time=0.3))
        int8 = quantization.quantize_model(model, "int8")
    e, c = statistics.median(eager_s), statistics.median(comp_s)
    fp32_b, int8_b = quantization.weight_bytes(model), quantization.weight_bytes(int8)
    fig, axes = _figure(3)
    panels = ((axes[0], "launches per token", (eager_l, comp_l), ("eager", "compiled"), "{:.0f}"),
              (axes[1], "ms per token (median)", (e * 1e3, c * 1e3), ("eager", "compiled"), "{:.2f}"),
              (axes[2], "weight MB", (fp32_b / 1e6, int8_b / 1e6), ("fp32", "int8"), "{:.2f}"))
    for ax, label, values, names, fmt in panels:
        bars = ax.bar(names, values, color=("tab:gray", "tab:blue"))
        ax.bar_label(bars, [fmt.format(v) for v in values])
        ax.set_ylim(0, max(values) * 1.2)
        ax.set_title(label)
    fig.suptitle(f"{TITLES['compile']} (Llama, {model.num_params():,} parameters, 1 thread)")
    fig.tight_layout()
    verdict = (f"torch.compile fused {eager_l} launches per token into {comp_l} and cut a step from {e * 1e3:.2f} to "
               f"{c * 1e3:.2f} ms ({e / c:.2g}× faster; the {compiled.compile_seconds:.1f} s compile paid up front), and "
               f"int8 weights take {fp32_b / int8_b:.2g}× less memory than fp32: at batch 1, decode is bound by "
               "launch overhead and by the bytes of the weights")
    numbers = {"launches_eager": eager_l, "launches_compiled": comp_l, "step_s_eager": e, "step_s_compiled": c,
               "compile_s": compiled.compile_seconds, "fp32_weight_bytes": fp32_b, "int8_weight_bytes": int8_b}
    return DemoResult("compile", TITLES["compile"], verdict, numbers, story_holds("compile", numbers), figure=fig)


def _interconnect() -> DemoResult:
    from teraflops import ceilings  # lazy: a mode loads only its unit
    from teraflops.datasheets import PublishedLink  # lazy: a mode loads only its unit
    from teraflops.hardware import alpha_beta, collectives  # lazy: a mode loads only its unit

    device = detect().device
    rows = collectives.sweep(("all_reduce",), sizes=ALLREDUCE_SIZES)
    copy = ceilings.measure_copy_bandwidth(256 * 2**20, device)  # all threads: the machine's own ceiling
    link = PublishedLink("memory copy measured here", copy, f"{copy / 1e9:.3g} GB/s",
                         "on one machine every rank's bytes cross memory: its copy bandwidth is the link",
                         "measured: teraflops.ceilings.measure_copy_bandwidth, 256 MiB")
    fit = alpha_beta.fit_rows(rows, "all_reduce")
    fig, (ax,) = _figure()
    alpha_beta.plot_sweep(rows, fit, links=(link,), ax=ax)
    ax.set_title(f"{TITLES['interconnect']} ({rows[0]['ranks']} ranks, {rows[0]['backend']})")
    fig.tight_layout()
    peak = max(rows, key=lambda r: r["busbw"])
    small = min(rows, key=lambda r: r["size"])
    verdict = (f"all-reduce bus bandwidth rose from {small['busbw'] / 1e6:.3g} MB/s at {small['size'] / 1024:.0f} KiB "
               f"to {peak['busbw'] / 1e9:.3g} GB/s at {peak['size'] / 2**20:.3g} MiB, below the {copy / 1e9:.3g} GB/s "
               f"link (memory copy): small messages pay the latency (α = {fit.alpha * 1e6:.0f} µs), large ones the link")
    numbers = {"busbw_peak": peak["busbw"], "busbw_smallest": small["busbw"], "link": copy, "alpha_s": fit.alpha,
               "ranks": rows[0]["ranks"], "wrong": sum(r["wrong"] for r in rows)}
    return DemoResult("interconnect", TITLES["interconnect"], verdict, numbers, story_holds("interconnect", numbers),
                      figure=fig)


def _triage() -> DemoResult:
    from teraflops.triage import workloads  # lazy: a mode loads only its unit

    with tempfile.TemporaryDirectory(prefix="teraflops-demo-") as out, pinned_threads():
        rows = workloads.verdict_rows([workloads.profile(name, out) for name in TRIAGE_WORKLOADS])
    fig, (ax,) = _figure(height=4.5)
    workloads.plot_shares(rows, ax=ax, title=TITLES["triage"])
    fig.tight_layout()
    matched = sum(bool(r["matches"]) for r in rows)
    said = ", ".join(f"{r['name']} → {r['result'].verdict}" for r in rows)
    verdict = f"from the profiles alone, triage named the bottleneck its unit teaches for {matched} of {len(rows)}: {said}"
    numbers = {"matched": matched, "workloads": len(rows), "verdicts": {r["name"]: r["result"].verdict for r in rows}}
    return DemoResult("triage", TITLES["triage"], verdict, numbers, story_holds("triage", numbers), figure=fig)


def story_holds(mode: str, n: dict) -> bool:
    """Whether the numbers ``n`` of a run of ``mode`` (:attr:`DemoResult.numbers`) tell its lecture's story;
    decided on the numbers alone, so the rule is tested on given numbers:

    * attention: fused attention's peak bytes below naive's at every length, over 2× at the longest;
    * zero: each stage's per-rank peak below the one before;
    * straggler: the healthy ranks idle over 30 % of their time, and 20 points more than without it;
    * compile: compiled decode faster per token, with fewer launches; int8 weights under 30 % of fp32's;
    * interconnect: all-reduce busbw below the link (memory copy), the smallest message's under a
      quarter of the peak's, no wrong result;
    * triage: every workload got the verdict its unit teaches.
    """
    if mode == "attention":
        naive, flash = n["naive"], n["flash"]
        return all(flash[k] < naive[k] for k in flash.keys() & naive.keys()) and n["ratio"] > 2
    if mode == "zero":
        peak = [n["peak_bytes"][k] for k in sorted(n["peak_bytes"], key=int)]
        return all(a > b for a, b in zip(peak, peak[1:]))
    if mode == "straggler":
        late, base = n["straggler"]["healthy_idle"], n["baseline"]["healthy_idle"]
        return late > max(0.3, base + 0.2)
    if mode == "compile":
        return (n["step_s_compiled"] < n["step_s_eager"] and n["launches_compiled"] < n["launches_eager"]
                and n["int8_weight_bytes"] < 0.3 * n["fp32_weight_bytes"])
    if mode == "interconnect":
        return n["busbw_peak"] < n["link"] and n["busbw_smallest"] < 0.25 * n["busbw_peak"] and n.get("wrong", 0) == 0
    if mode == "triage":
        return n["matched"] == n["workloads"]
    raise DemoError(f"unknown demo mode {mode!r}. Hint: one or more of {', '.join(TITLES)}")


# mode -> the function that runs it live (a test replaces one to simulate a failure)
RUNNERS = {"attention": _attention, "zero": _zero, "straggler": _straggler, "compile": _compile,
            "interconnect": _interconnect, "triage": _triage}


def run_mode(mode: str, scale: float | str | None = "room") -> DemoResult:
    """Run one mode live at figure scale ``scale`` (default ``room``, :mod:`teraflops.plots`); the
    result holds its figure. Raises :class:`DemoError` for an unknown mode and whatever the lecture
    helper raises (a ``LaunchFailed`` for a rank that died, say)."""
    import matplotlib

    (mode,) = check_modes([mode])
    start = time.perf_counter()
    with matplotlib.rc_context(plots.rc(scale)):
        result = RUNNERS[mode]()
    result.seconds = time.perf_counter() - start
    result.load = load_average()
    result.machine = detect().summary()
    result.recorded_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return result


def record(result: DemoResult, folder) -> Path:
    """Write ``result`` to ``folder/MODE.json`` and its figure to ``MODE.png`` and ``MODE.svg``; returns the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result.mode}.json"
    path.write_text(json.dumps(result.as_json(), indent=2) + "\n")
    if result.figure is not None:
        for ext in ("png", "svg"):
            result.figure.savefig(folder / f"{result.mode}.{ext}", bbox_inches="tight")
    return path


def recorded(mode: str, folder) -> DemoResult:
    """The run of ``mode`` recorded in ``folder`` (:func:`record`), without its figure (``MODE.png`` beside it).

    Raises:
        DemoError: no readable recording of ``mode`` there.
    """
    path = Path(folder) / f"{mode}.json"
    try:
        data = json.loads(path.read_text())
        return DemoResult(**{k: data[k] for k in DemoResult.__dataclass_fields__ if k in data and k != "figure"})
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DemoError(f"no recorded run of {mode!r} in {folder} ({type(e).__name__}). "
                        f"Hint: record one before the talk: teraflops demo {mode} --record {folder}") from e


def run_modes(modes=(), *, out=None, record_to=None, fallback=None, scale="room", echo=print) -> list[DemoResult]:
    """Run ``modes`` (default all) in turn; print each verdict with ``echo``. Each live figure is saved
    to ``out`` (if given) and with ``record_to`` the run is recorded (:func:`record`). A mode that fails
    live is shown from ``fallback`` (its recorded result, said to be one) when it holds one; else its
    failure is one line (the line that names the cause, :func:`teraflops.launch.notebook.cause_line`;
    the whole message in ``out/MODE.error.txt``) and the next mode runs: a talk goes on. Returns the
    results of the modes shown (recordings read back for the modes that fell back), so fewer than
    ``modes`` when one failed."""
    results = []
    for mode in check_modes(modes):
        echo(f"{mode}: {TITLES[mode]} ...")
        try:
            r = run_mode(mode, scale)
        except Exception as e:  # noqa: BLE001 - a failed mode is said in one line, then the talk goes on
            cause = f"{type(e).__name__}: {notebook.cause_line(str(e), 160)}"
            if fallback is not None and (Path(fallback) / f"{mode}.json").is_file():
                r = recorded(mode, fallback)
                echo(f"{mode}: live run failed ({cause}); showing the run recorded {r.recorded_at} on {r.machine}, "
                     f"figure {Path(fallback) / (mode + '.png')}")
                echo(r.line())
                results.append(r)
                continue
            where = ""
            if out is not None:
                Path(out).mkdir(parents=True, exist_ok=True)
                log = Path(out) / f"{mode}.error.txt"
                log.write_text("".join(traceback.format_exception(e)))
                where = f"; full log: {log}"
            none = f"; no recording of it in {fallback} (teraflops demo {mode} --record {fallback})" if fallback else ""
            echo(f"{mode}: FAILED live ({cause}){where}{none}")
            continue
        for folder in (f for f in (out, record_to) if f is not None):
            saved = record(r, folder)
        if out is not None or record_to is not None:
            echo(f"{mode}: figure {saved.with_suffix('.png')} ({r.seconds:.0f} s, load {r.load:.1f})")
        echo(r.line())
        results.append(r)
    return results


def show(mode: str, fallback=None, scale="room") -> DemoResult:
    """In a notebook (the slide deck, ``demo/demo.ipynb``): run ``mode``, show its figure and print its
    verdict; a failed live run shows the recording in ``fallback`` (its PNG) instead."""
    from IPython.display import Image, display  # lazy: only in a notebook

    try:
        r = run_mode(mode, scale)
    except Exception as e:  # noqa: BLE001 - the fallback is for any live failure
        if fallback is None or not (Path(fallback) / f"{mode}.json").is_file():
            raise
        r = recorded(mode, fallback)
        print(f"live run failed ({type(e).__name__}); the run recorded {r.recorded_at} on {r.machine}:")
        display(Image(filename=str(Path(fallback) / f"{mode}.png")))
        print(r.line())
        return r
    display(r.figure)
    import matplotlib.pyplot as plt

    plt.close(r.figure)
    print(r.line())
    return r


def warm(echo=print) -> None:
    """Build before the talk what a first run builds: DeepSpeed's CPU op, the compiled decode step (in
    torch.compile's disk cache, so the talk's compile is a cache load) and Matplotlib's font cache."""
    import matplotlib.pyplot as plt
    import torch

    from teraflops import sizing  # lazy: a mode loads only its unit
    from teraflops.compilation import decode  # lazy: a mode loads only its unit
    from teraflops.launch import ops  # lazy: a mode loads only its unit

    start = time.perf_counter()
    ops.prepare_deepspeed_ops()
    echo(f"DeepSpeed's CPU op ready ({time.perf_counter() - start:.0f} s)")
    with pinned_threads(), torch.no_grad():
        model = decode.decode_model(sizing.preset(), dtype=torch.float32).eval()
        compiled = decode.compile_decode(model, model.new_cache(1))
    echo(f"decode step compiled in {compiled.compile_seconds:.1f} s (a warm cache loads it in ~1-2 s)")
    fig, ax = plt.subplots()
    ax.set_title("font cache")
    fig.canvas.draw()
    plt.close(fig)
    echo(f"warm in {time.perf_counter() - start:.0f} s; run `teraflops demo --record DIR` once for a fallback")

