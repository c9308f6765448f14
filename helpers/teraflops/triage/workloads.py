"""The workloads the triage capstone profiles: one per unit, mixed ones, and seeded mysteries.

Each workload is real work on this machine, profiled by :func:`teraflops.triage.trace.record` (one call
after warm-up) into a Chrome trace that :func:`teraflops.triage.verdict.triage` reads. Sizes come from
:func:`teraflops.sizing.preset`, so the same code runs on a CPU laptop and on a GPU.

* In one process (:func:`profile`): ``matmul`` (Unit 1, compute-bound: a square matmul far right
  of the ridge point), ``naive_attention`` (Unit 1, memory-bound: causal attention that writes the
  ``[B, H, L, L]`` scores, masks them and softmaxes them through memory), ``decode`` (Unit 4,
  overhead-bound: greedy batch-1 decode of a Llama whose every op moves a few KB, so each op costs
  about a launch), and the mixed ones: ``sdpa_attention`` (Unit 1's fix for naive attention: the
  fused kernel never writes the scores) and ``batched_decode`` (Unit 4's regime: its decode model,
  wider than ``decode``'s, at the preset's largest batch, where each op does enough work to pay for
  its launch).
* Across ranks (:func:`teraflops.triage.rank_traces.profile_ranks`, launched with torchrun): ``zero3``
  (Unit 2), ``straggler`` (Unit 3), ``allreduce`` (Unit 5).

:func:`mysteries` profiles five workloads whose kinds and sizes a seed picks and whose names it
hides (``"A"`` … ``"E"``); :func:`mystery_key` says what each one is, for the lab's checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from teraflops.compilation import decode
from teraflops.errors import CourseError
from teraflops.machine import detect
from teraflops.model_definition import attention
from teraflops.models import Llama
from teraflops.sizing import preset
from teraflops.tables import fmt_seconds, table
from teraflops.triage.rank_traces import profile_ranks
from teraflops.triage.trace import record
from teraflops.triage.verdict import CATEGORIES, VERDICTS, triage

# workload -> (unit, the category triage should find, what it is)
UNIT_WORKLOADS = {
    "matmul": (1, "compute", "square matmul, n = the roofline's largest"),
    "naive_attention": (1, "memory", "causal attention that materialises the L × L scores"),
    "zero3": (2, "communication", "a GPT step under DeepSpeed ZeRO-3: every layer gathered, gradients reduce-scattered"),
    "straggler": (3, "waiting", "synchronous data parallelism with one rank delayed"),
    "decode": (4, "overhead", "greedy batch-1 decode of a tiny Llama"),
    "allreduce": (5, "communication", "a loop of tiny-message all-reduces"),
}
MIXED_WORKLOADS = {
    "sdpa_attention": (1, "the same attention through scaled_dot_product_attention (fused)"),
    "batched_decode": (4, "Unit 4's decode model (the preset's size) at its largest batch"),
}
LOCAL = ("matmul", "naive_attention", "decode", "sdpa_attention", "batched_decode")
DISTRIBUTED = ("zero3", "straggler", "allreduce")
MYSTERY_LABELS = ("A", "B", "C", "D", "E")
MYSTERY_KINDS = ("compute", "memory", "overhead", "communication", "waiting")


@dataclass(frozen=True)
class Profiled:
    """A profiled workload: ``trace`` (Chrome trace path; rank 0's for a multi-rank workload),
    ``waits`` (``[steps, ranks]`` seconds in collectives, or ``None`` for one process), ``expected``
    (the category its unit teaches, or ``None`` for a mixed workload), ``unit``, ``description``."""

    name: str
    unit: int
    trace: Path
    waits: list | None
    expected: str | None
    description: str
    rank_traces: tuple = ()  # every rank's trace, by rank, for a multi-rank workload


def _attention_seq(p, device: str) -> int:
    """The longest of the preset's attention lengths whose naive ``[B, H, L, L]`` scores, written about
    four times over (scores, mask, softmax, its copy), fit in a quarter of the GPU's memory (on a GPU
    the longest lengths are there to run naive attention out of memory, Unit 1); on a CPU the longest."""
    if device != "cuda":
        return max(p.attention.seq_lens)
    budget = torch.cuda.get_device_properties(0).total_memory / 4
    elem = torch.empty((), dtype=p.attention.dtype).element_size()
    fits = [n for n in p.attention.seq_lens if 4 * p.attention.batch * p.attention.heads * n * n * elem <= budget]
    return max(fits or [min(p.attention.seq_lens)])


def _local_fn(name: str, scale: float = 1.0, seed: int = 0) -> Callable[[], object]:
    """The zero-argument function of in-process workload ``name``, its inputs built here (seeded);
    ``scale`` stretches the size (mysteries use 0.75-1.0)."""
    p, dev = preset(), detect().device
    g = torch.Generator().manual_seed(seed)
    if name == "matmul":
        n = int(max(p.roofline.matmul_sizes) * scale) // 16 * 16
        a, b = (torch.randn(n, n, generator=g).to(dev, p.dtype) for _ in range(2))
        return lambda: a @ b
    if name in ("naive_attention", "sdpa_attention"):
        seq = int(_attention_seq(p, dev) * scale) // 64 * 64
        q, k, v = (torch.randn(p.attention.batch, p.attention.heads, seq, p.attention.head_dim, generator=g).to(dev, p.attention.dtype)
                   for _ in range(3))
        if name == "naive_attention":
            return lambda: attention.naive_attention(q, k, v, causal=True)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name in ("decode", "batched_decode"):
        if name == "decode":  # a model whose ops move a few KB: every op costs about one launch
            model = Llama(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=64, seed=seed).to(dev).eval()
            prompt = torch.randint(0, 64, (1, 4), generator=g).to(dev)
            return lambda: decode.generate(model, prompt, max(4, int(16 * scale)))
        model = decode.decode_model(p, seed=seed).eval()
        prompt = torch.randint(0, p.decode.vocab, (p.decode.fit_batch, p.decode.prompt_len), generator=g).to(dev)
        return lambda: decode.generate(model, prompt, 8)
    raise CourseError(f"unknown in-process workload {name!r}. Hint: one of {', '.join(LOCAL)}")


def profile(name: str, out_dir, scale: float = 1.0, seed: int = 0) -> Profiled:
    """Profile in-process workload ``name`` (one of :data:`LOCAL`) into ``out_dir/<name>.json``.

    Raises:
        CourseError: an unknown name.
    """
    if name not in LOCAL:
        raise CourseError(f"unknown in-process workload {name!r}. Hint: one of {', '.join(LOCAL)}; "
                          f"{', '.join(DISTRIBUTED)} run across ranks (teraflops.triage.rank_traces.profile_ranks)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    trace = record(_local_fn(name, scale, seed), out / f"{name}.json")
    unit, expected, what = (UNIT_WORKLOADS[name] if name in UNIT_WORKLOADS
                            else (*MIXED_WORKLOADS[name][:1], None, MIXED_WORKLOADS[name][1]))
    return Profiled(name, unit, trace, None, expected, what)


def profile_units(out_dir, names=tuple(UNIT_WORKLOADS), cluster=None, progress: bool = True) -> list[Profiled]:
    """Profile the named workloads (default: one per unit, in unit order); those of
    :data:`DISTRIBUTED` in one torchrun launch (:func:`teraflops.triage.rank_traces.profile_ranks`,
    the rank-0 trace and every rank's waits). Returns them in the order asked."""
    from tqdm.auto import tqdm

    unknown = [n for n in names if n not in LOCAL + DISTRIBUTED]
    if unknown:
        raise CourseError(f"unknown workload(s) {', '.join(map(repr, unknown))}. Hint: one of "
                          f"{', '.join(LOCAL + DISTRIBUTED)}")
    out, done = Path(out_dir), {}
    dist = [n for n in names if n in DISTRIBUTED]
    if dist:
        for n, rt in profile_ranks(dist, out_dir=out, cluster=cluster).items():
            unit, expected, what = UNIT_WORKLOADS[n]
            done[n] = Profiled(n, unit, rt.trace, rt.waits, expected, what, tuple(rt.traces))
    for n in tqdm([n for n in names if n in LOCAL], desc="profiling", disable=not progress):
        done[n] = profile(n, out)
    return [done[n] for n in names]


def _plan(seed: int) -> list[tuple[str, str, float]]:
    """``(label, kind, scale)`` of each mystery: a seeded shuffle of :data:`MYSTERY_KINDS` and a
    size scale in [0.75, 1]."""
    rng = random.Random(seed)
    kinds = list(MYSTERY_KINDS)
    rng.shuffle(kinds)
    return [(label, kind, rng.choice((0.75, 0.875, 1.0))) for label, kind in zip(MYSTERY_LABELS, kinds)]


def mystery_key(seed: int) -> dict[str, str]:
    """What each mystery of :func:`mysteries` (same ``seed``) is: label -> category of
    :data:`teraflops.triage.verdict.CATEGORIES`."""
    return {label: kind for label, kind, _ in _plan(seed)}


_MYSTERY_LOCAL = {"compute": "matmul", "memory": "naive_attention", "overhead": "decode"}
_MYSTERY_RANKS = {"communication": "allreduce", "waiting": "straggler"}


def mysteries(seed: int, out_dir, cluster=None) -> dict[str, Profiled]:
    """Five workloads, one of each category, in an order ``seed`` picks, profiled here: label
    (``"A"`` … ``"E"``) -> :class:`Profiled` whose ``name``, ``expected`` and ``description`` are
    hidden (``"mystery A"``, ``None``), its trace in ``out_dir/mystery_<label>.json``. ``seed`` also
    picks the in-process ones' sizes (0.75-1 × the unit's) and seeds every input and model. The two
    multi-rank ones (communication, waiting) share one torchrun launch and come with their waits
    (even ones, too: the waits do not give the answer away)."""
    import json
    import tempfile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    with tempfile.TemporaryDirectory(prefix="teraflops-ranks-") as tmp:  # its file names say what ran
        ranks = profile_ranks(tuple(_MYSTERY_RANKS.values()), out_dir=tmp, cluster=cluster, seed=seed)
        for label, kind, scale in _plan(seed):
            trace, waits = out / f"mystery_{label}.json", None
            if kind in _MYSTERY_LOCAL:
                record(_local_fn(_MYSTERY_LOCAL[kind], scale, seed), trace)
            else:
                rt = ranks[_MYSTERY_RANKS[kind]]
                data = json.loads(Path(rt.trace).read_text())
                data["traceName"] = str(trace)  # the profiler wrote the rank file's name here
                trace.write_text(json.dumps(data))
                waits = rt.waits
            found[label] = Profiled(f"mystery {label}", 0, trace, waits, None, "a mystery")
    return found


def verdict_rows(profiled, ceilings=None, launch_floor=None) -> list[dict]:
    """Triage each :class:`Profiled` (with its waits): one row per workload with ``name``, ``unit``,
    ``expected`` (category or ``None``), ``result`` (the :class:`teraflops.triage.verdict.Triage`) and
    ``matches`` (verdict == expected; ``None`` for a mixed workload)."""
    rows = []
    for w in profiled:
        r = triage(w.trace, waits=w.waits, ceilings=ceilings, launch_floor=launch_floor)
        rows.append({"name": w.name, "unit": w.unit, "expected": w.expected, "result": r,
                     "matches": None if w.expected is None else r.verdict == VERDICTS[w.expected]})
    return rows


def verdict_table(rows: list[dict]) -> str:
    """The rows of :func:`verdict_rows` as a table: the unit's bottleneck beside the verdict, the
    shares (%) and the top contributor."""
    out = []
    for r in rows:
        t = r["result"]
        top = t.evidence[0].name if t.evidence else "-"
        out.append((r["name"], f"Unit {r['unit']}", VERDICTS[r["expected"]] if r["expected"] else "(mixed)",
                    t.verdict, fmt_seconds(t.step_s), *(f"{t.shares[c]:.0%}" for c in CATEGORIES), top))
    return table(out, ["workload", "unit", "unit's bottleneck", "triage verdict", "step", *CATEGORIES,
                       "top contributor"])


COLORS = {"compute": "tab:blue", "memory": "tab:orange", "overhead": "tab:gray", "communication": "tab:green",
          "waiting": "tab:red"}


def plot_shares(rows: list[dict], ax=None, title: str = "Where each workload's step goes"):
    """Stacked horizontal bars: each workload's share of its step per category (one bar per row of
    :func:`verdict_rows`, the verdict printed at the bar's end). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.4))
    names = [r["name"] for r in rows][::-1]
    left = [0.0] * len(rows)
    for c in CATEGORIES:
        vals = [r["result"].shares[c] for r in rows][::-1]
        ax.barh(names, vals, left=left, color=COLORS[c], label=c)
        left = [a + b for a, b in zip(left, vals)]
    for y, r in enumerate(rows[::-1]):
        ax.text(1.01, y, r["result"].verdict, va="center", fontsize="small")
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the step's wall time")
    ax.set_title(title)
    ax.legend(ncol=len(CATEGORIES), loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(rows), 1)),
              fontsize="small", frameon=False)
    return ax
