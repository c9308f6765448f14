"""Checks for Unit 6 (Triage, the capstone). Exercises 1 and 2 take the learner's function and
nothing else; exercises 3 and 4 take the learner's answers about the lab's five mysteries
(:func:`teraflops.triage.workloads.mysteries`) and what the lab needs to judge them (its seed, its
profiles).

Every check compares with the package's reference (:mod:`teraflops.triage.verdict`, whose module docstring
defines the categories) on cases built here or on the lab's own profiles and, on a wrong answer,
tries the plausible wrong versions: a mistake is named only when it reproduces every answer the
learner gave. Units: seconds; intensity in FLOP/byte.
"""

from __future__ import annotations

import math

import numpy as np

from teraflops.triage import verdict as tr
from teraflops.errors import PLACEHOLDER_MESSAGE
from teraflops.triage.workloads import mystery_key
from teraflops.grading.core import check_cases, close, exercise, expect_number, fail, finite_answer, holds


def _not_attempted():
    """An answer dict the lab left empty: the decorator reports the exercise as not attempted."""
    raise NotImplementedError(PLACEHOLDER_MESSAGE)


# --- exercise 1: exposed communication ----------------------------------------------------------------

def _merge(intervals) -> list[list[float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint ``[start, end]`` pieces."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(a, b) -> float:
    """Seconds two sets of disjoint intervals share."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def _exposed_seconds(ops, collectives) -> float:
    """Seconds in which some collective runs and no op does: |∪collectives| − |∪collectives ∩ ∪ops|."""
    c = _merge(collectives)
    return _length(c) - _overlap(c, _merge(ops))


def exposed_reference(ops, collectives, step) -> float:
    """The fraction of ``step = (start, end)`` in which at least one collective runs and no op runs
    (the ``communication`` share of :func:`teraflops.triage.verdict.triage` before waits split it)."""
    clip = lambda xs: [(max(s, step[0]), min(e, step[1])) for s, e in xs]  # noqa: E731 - inside the step
    return _exposed_seconds(clip(ops), clip(collectives)) / (step[1] - step[0])


def _span(step) -> float:
    return step[1] - step[0]


def _ratio(x: float, y: float) -> float:
    """x / y, or 0 where y is 0: a wrong version that guards its division still answers every case."""
    return x / y if y else 0.0


_SUMMED = ("time when an op also runs is hidden, and time two collectives share counts once: merge the collective "
           "intervals, then subtract the time an op runs")
_PER_STEP = ("divide by the step's span, step[1] - step[0]: the share is of the step's wall time, idle time "
             "included, not of the time something runs")
_EXPOSED_CASES = {
    ((), ((0.25, 0.5),), (0.0, 1.0)): "a collective alone, no op",
    (((0.0, 0.25), (0.5, 0.75)), ((0.25, 0.5),), (0.0, 1.0)): "no overlap",
    (((0.0, 0.75),), ((0.125, 0.5),), (0.0, 1.0)): "a collective fully overlapped by an op",
    (((0.0, 0.375), (0.75, 1.0)), ((0.25, 0.875),), (0.0, 1.0)): "a collective partly overlapped",
    # c10d::allreduce_ on the main thread around gloo:all_reduce on gloo's thread
    (((0.0, 0.25), (0.875, 1.0)), ((0.25, 0.8125), (0.3125, 0.75)), (0.0, 1.0)): "nested collectives",
    (((0.0, 0.5), (0.25, 0.625)), ((0.375, 0.875),), (0.0, 1.0)): "ops on two threads overlapping each other",
    ((), ((0.125, 0.375), (0.25, 0.5)), (0.0, 1.0)): "two collectives overlapping, no ops",
    (((0.0, 0.5),), (), (0.0, 1.0)): "no collectives",
    ((), (), (0.0, 1.0)): "empty lists",
    (((96.0, 96.125), (96.0625, 96.1875), (96.375, 96.5)), ((96.125, 96.4375), (96.15625, 96.25)), (96.0, 96.5)):
        "a step that starts at 96 s, as in a trace",
    (((0.25, 0.5), (1.0, 1.5)), ((0.0, 2.0),), (0.0, 2.0)): "a collective spanning the step, ops inside it",
}

_EXPOSED_MISTAKES = [
    (lambda o, c, s: _length(c) / _span(s), "you summed the collectives' durations: " + _SUMMED),
    (lambda o, c, s: _length(_merge(c)) / _span(s),
     "a collective that runs while an op runs is hidden (overlapped communication costs nothing): count only the "
     "time when no op runs"),
    (lambda o, c, s: sum(_exposed_seconds(o, [x]) for x in c) / _span(s),
     "where collectives overlap (c10d::allreduce_ around gloo:all_reduce, or two threads) count that time once: "
     "merge the collective intervals before subtracting the ops"),
    (lambda o, c, s: (_length(_merge(c)) - sum(_overlap(_merge(c), [x]) for x in o)) / _span(s),
     "ops on several threads overlap each other too: merge the op intervals before subtracting them, or you "
     "subtract shared time twice"),
    (lambda o, c, s: (_length(c) - _overlap(_merge(c), _merge(o))) / _span(s), "you summed the collectives' "
     "durations before subtracting the ops: " + _SUMMED),
    (lambda o, c, s: _ratio(_exposed_seconds(o, c), _length(o) + _length(c)), _PER_STEP),
    (lambda o, c, s: _ratio(_exposed_seconds(o, c), _length(c)), _PER_STEP),
    (lambda o, c, s: _ratio(_exposed_seconds(o, c), _length(_merge(c))), _PER_STEP),
    (lambda o, c, s: _ratio(_exposed_seconds(o, c), _length(_merge(list(o) + list(c)))), _PER_STEP),
    (lambda o, c, s: _exposed_seconds(o, c) / s[1], "the step spans step[1] - step[0] seconds, not step[1]: a "
                                                    "trace's clock does not start at 0"),
    (lambda o, c, s: _exposed_seconds(o, c), "return a fraction of the step (seconds exposed / step[1] - step[0]), "
                                             "not seconds"),
    (lambda o, c, s: 100 * exposed_reference(o, c, s), "return a fraction between 0 and 1, not a percentage"),
    (lambda o, c, s: _ratio(_overlap(_merge(c), _merge(o)), _length(_merge(c))),
     "that is the overlapped share of communication (Holistic Trace Analysis' overlap %); the exposed share is the "
     "time a collective runs with no op, over the step"),
    (lambda o, c, s: 1 - exposed_reference(o, c, s), "you returned 1 minus the answer: the exposed share is the time "
                                                     "a collective runs with no op, over the step"),
]


def _describe_exposed(case) -> str:
    ops, coll, step = case
    return f"'{_EXPOSED_CASES[case]}' (ops={list(ops)}, collectives={list(coll)}, step={step})"


@exercise(1, "exposed communication")
def exposed_communication(fn) -> None:
    """``fn(ops, collectives, step) -> fraction``: ``ops`` and ``collectives`` are lists of ``(start_s,
    end_s)`` intervals inside the step (from several threads: they may overlap each other), ``step =
    (start_s, end_s)``; the answer is the fraction of the step in which at least one collective runs
    and no op runs: exposed communication, as :func:`teraflops.triage.verdict.triage` counts it (Holistic
    Trace Analysis, facebookresearch/HolisticTraceAnalysis, reports the complement, the overlapped
    share of communication)."""
    call = finite_answer(lambda o, c, s: fn(list(o), list(c), s), "exposed_communication", "a fraction of the step",
                   _describe_exposed)
    check_cases(call, "exposed_communication", "a fraction of the step", list(_EXPOSED_CASES), exposed_reference,
                [(holds(f), h) for f, h in _EXPOSED_MISTAKES],
                "merge the collective intervals and the op intervals (each a union), then exposed = time in the "
                "collectives' union outside the ops' union, divided by step[1] - step[0]",
                _describe_exposed, lambda g, w: f"got {g:.6g}, expected {w:.6g}")


exposed_communication.__wrapped__.hints = {
    "ZeroDivisionError": "a step with no collectives has 0 exposed communication: divide by the step's span, "
                         "step[1] - step[0], which is never 0",
    "max() arg is an empty sequence": "ops or collectives may be empty lists: an empty union has length 0",
    "min() arg is an empty sequence": "ops or collectives may be empty lists: an empty union has length 0",
    "list index out of range": "ops or collectives may be empty lists: an empty union has length 0",
}


# --- exercise 2: the waited fraction ------------------------------------------------------------------

def waited_reference(waits, rank: int) -> float:
    """Rank ``rank``'s fraction of its time in collectives spent waiting for the last rank to arrive:
    per step, the last to arrive waits least (the minimum over ranks), so the rest of a rank's wait
    is waiting for it; mean over steps of ``w[s, rank] - min(w[s, :])`` over the mean of
    ``w[:, rank]`` (as :func:`teraflops.triage.verdict.triage` splits communication from waiting; Unit 3)."""
    w = np.asarray(waits, dtype=np.float64)
    excess = w - w.min(axis=1, keepdims=True)
    return float(excess[:, rank].mean() / max(w[:, rank].mean(), 1e-12))


def _w(waits):
    return np.asarray(waits, dtype=np.float64)


def _excess(waits):
    w = _w(waits)
    return w - w.min(axis=1, keepdims=True)


def _moving_straggler() -> list[list[float]]:
    """8 ranks, 6 steps; a different rank arrives last in each step, and the transfer time varies."""
    rng = np.random.default_rng(6)
    steps = []
    for late, transfer in zip((3, 0, 5, 7, 3, 1), (0.004, 0.009, 0.005, 0.012, 0.006, 0.004)):
        row = transfer + rng.uniform(0.010, 0.040, size=8)
        row[late] = transfer
        steps.append(row)
    return np.round(np.array(steps), 6)


_STEADY = np.array([[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031], [0.031, 0.029, 0.003, 0.030]])
_EVEN = np.array([[0.0100, 0.0104, 0.0101, 0.0102], [0.0103, 0.0100, 0.0102, 0.0101],
                  [0.0101, 0.0102, 0.0100, 0.0104], [0.0102, 0.0101, 0.0103, 0.0100]])
_WAIT_CASES = [
    ("rank 2 arrives last in every step; rank 0's fraction", _STEADY, 0),
    ("the same waits; rank 2's own fraction (the straggler)", _STEADY, 2),
    ("a different rank arrives last in each step (8 ranks); rank 5", _moving_straggler(), 5),
    ("even waits, no straggler; rank 1", _EVEN, 1),
    ("one step of 3 ranks, as nested lists; rank 0", [[0.2, 0.05, 0.21]], 0),
    ("two steps of 3 ranks, as nested lists; rank 2", [[0.12, 0.02, 0.1], [0.05, 0.06, 0.3]], 2),
]

_GLOBAL_MIN = ("take the minimum over the ranks of each step, w.min(axis=1, keepdims=True), not over the whole "
               "array: the transfer itself takes longer in some steps than in others")
_ALL_RANKS = "return rank `rank`'s fraction (column w[:, rank]), not the mean over the ranks"
_MAX = ("the last rank to arrive waits least: per step subtract the minimum over the ranks (w.min(axis=1)), not the "
        "maximum")

_WAIT_MISTAKES = [
    (lambda w, r: (_w(w).max(axis=1) - _w(w)[:, r]).mean() / _w(w)[:, r].mean(), _MAX),
    (lambda w, r: (_w(w)[:, r] - _w(w).max(axis=1)).mean() / _w(w)[:, r].mean(), _MAX),
    (lambda w, r: (_w(w)[:, r] - _w(w).min()).mean() / _w(w)[:, r].mean(), _GLOBAL_MIN),
    (lambda w, r: (_w(w)[:, r] - _w(w)[:, r].min()).mean() / _w(w)[:, r].mean(),
     "the minimum is over the ranks of each step (axis=1): the last rank to arrive waits least; not over the "
     "steps of one rank"),
    (lambda w, r: _excess(w).mean() / _w(w).mean(), _ALL_RANKS),
    (lambda w, r: float(np.mean(_excess(w).mean(axis=0) / _w(w).mean(axis=0))), _ALL_RANKS),
    (lambda w, r: _excess(w)[:, r].mean(), "return a fraction of the rank's time in collectives (divide by "
                                           "w[:, rank].mean()), not seconds"),
    (lambda w, r: _excess(w)[:, r].sum(), "return a fraction of the rank's time in collectives (divide by "
                                          "w[:, rank].sum()), not seconds"),
    (lambda w, r: float(np.mean(_excess(w)[:, r] / _w(w)[:, r])),
     "a long wait weighs more than a short one: divide the total (or mean) excess by the total (or mean) wait, "
     "not the mean of per-step ratios"),
    (lambda w, r: 100 * waited_reference(w, r), "return a fraction between 0 and 1, not a percentage"),
    (lambda w, r: 1 - waited_reference(w, r),
     "that is the transfer's share (the part every rank waits); the waited fraction is the excess over each step's "
     "minimum, over the rank's wait"),
]


def _describe_wait(case) -> str:
    waits, rank = case
    name = next((n for n, w, r in _WAIT_CASES if w is waits and r == rank), "waits")
    return f"'{name}' (waits {np.asarray(waits).shape} [steps, ranks], rank={rank})"


@exercise(2, "the waited fraction")
def waited_fraction(fn) -> None:
    """``fn(waits, rank) -> fraction``: ``waits`` are seconds each rank spent in the step's collectives,
    ``[steps, ranks]`` (a NumPy array or nested lists). Per step the last rank to arrive waits least;
    the rest of a rank's wait is waiting for it. The answer: rank ``rank``'s mean over the steps of
    ``w[s, rank] - min over ranks of w[s, :]``, over its mean wait (the split of
    :func:`teraflops.triage.verdict.triage`, ``_straggler_split``; Unit 3's straggler)."""
    check_cases(finite_answer(fn, "waited_fraction", "a fraction of the rank's time in collectives", _describe_wait),
                "waited_fraction", "a fraction", [(w, r) for _, w, r in _WAIT_CASES], waited_reference,
                [(holds(f), h) for f, h in _WAIT_MISTAKES],
                "per step, excess = w[s, rank] - min(w[s, :]); fraction = mean excess / mean of w[:, rank]",
                _describe_wait, lambda g, w: f"got {g:.6g}, expected {w:.6g}")


waited_fraction.__wrapped__.hints = {
    "has no attribute": "waits may come as nested lists: start with w = np.asarray(waits, dtype=float)",
    "indices must be integers or slices, not tuple": "waits may come as nested lists, which take no [:, rank]: "
                                                     "start with w = np.asarray(waits, dtype=float)",
}


# --- exercise 3: the verdicts ----------------------------------------------------------------------

_ACCEPTED = {**{v: k for k, v in tr.VERDICTS.items()}, **{k: k for k in tr.CATEGORIES}}
_RIDGE = ("compare the top operators' arithmetic intensity (FLOP/byte, in triage's evidence) with the ridge point "
          "(peak FLOP/s / bandwidth, in its summary): right of it an op is compute-bound, left of it memory-bound; "
          "the verdict sums their time (the shares), so one matmul on top does not make a step compute-bound")
_OVERHEAD = ("an overhead-bound step is many tiny ops, each cheaper than the launch floor, with idle time between "
             "them (the '(idle: no operator running)' row): look at the calls and the time per call")


def _verdict_hint(got: str, want: str) -> str:
    if (got, want) == ("communication", "waiting"):
        return ("pass the mystery's waits: one rank's trace cannot tell waiting from communication "
                "(triage.triage(m.trace, waits=m.waits))")
    if (got, want) == ("waiting", "communication"):
        return ("waiting needs a rank that waits least (it arrives last) by a modified z-score above 3.5; when "
                "every rank waits about as long, the time in collectives is the transfer itself")
    if {got, want} == {"compute", "memory"}:
        return _RIDGE
    if "overhead" in (got, want):
        return _OVERHEAD
    return ("triage each mystery, triage.triage(m.trace, waits=m.waits), and answer its verdict: the category with "
            "the largest share of the step")


def _answers_dict(answers, labels, what: str) -> dict:
    """The learner's dict label -> answer, with exactly ``labels`` as keys, or a one-line failure."""
    if not isinstance(answers, dict):
        fail(f"pass a dict label -> {what}, got {type(answers).__name__}. Hint: e.g. {{'A': ..., 'B': ...}}, "
             "one entry per mystery")
    if not answers:
        _not_attempted()
    missing = [k for k in labels if k not in answers]
    extra = [k for k in answers if k not in labels]
    if missing:
        fail(f"no answer for mystery {', '.join(map(str, missing))}. Hint: one entry per label of found: "
             f"{', '.join(labels)}")
    if extra:
        fail(f"{', '.join(map(repr, extra))} is not a mystery's label. Hint: the labels are {', '.join(labels)}")
    return {k: answers[k] for k in labels}


@exercise(3, "the verdicts")
def verdicts(answers, seed: int, found: dict | None = None) -> None:
    """``answers``: label -> verdict of each mystery of :func:`teraflops.triage.workloads.mysteries` profiled with
    ``seed``: a string of :data:`teraflops.triage.verdict.VERDICTS` (``"memory-bound"``, ``"waiting (straggler)"``
    …) or a category name (``"memory"``, ``"waiting"``); compared with
    :func:`teraflops.triage.workloads.mystery_key`, what each mystery was built as. With ``found`` (the
    mysteries), an answer that is what the tool itself says of that trace passes too: the
    measurement, not the learner, disagrees with the key (a busy machine can do that)."""
    key = mystery_key(seed)
    answers = _answers_dict(answers, tuple(key), "verdict")
    got = {}
    for label, a in answers.items():
        norm = " ".join(a.strip().lower().split()) if isinstance(a, str) else None
        if norm not in _ACCEPTED:
            shown = a if isinstance(a, str) else type(a).__name__
            fail(f"mystery {label}: {shown!r} is not a verdict. Hint: answer one of "
                 f"{', '.join(map(repr, tr.VERDICTS.values()))}, as triage(...).verdict gives it")
        got[label] = _ACCEPTED[norm]
    wrong = [k for k in key if got[k] != key[k] and not _reads_the_trace(found, k, got[k])]
    if not wrong:
        return
    first = wrong[0]
    more = f" ({len(wrong) - 1} more wrong: {', '.join(wrong[1:])})" if len(wrong) > 1 else ""
    fail(f"mystery {first} is not {tr.VERDICTS[got[first]]}{more}. Hint: {_verdict_hint(got[first], key[first])}")


def _reads_the_trace(found, label: str, answer: str) -> bool:
    """Whether ``answer`` is what triage itself says of mystery ``label``'s trace in ``found``: a right
    reading of the measurement even where the measurement disagrees with how the mystery was built (a
    busy machine beside the profile can move a share past another), so it passes; without ``found``
    only the key counts."""
    if not isinstance(found, dict) or label not in found:
        return False
    m = found[label]
    return tr.triage(m.trace, waits=m.waits).verdict == tr.VERDICTS[answer]


# --- exercise 4: the evidence ----------------------------------------------------------------------

_IDLE = "(idle: no operator running)"


def _same(a: float, b: float) -> bool:
    """Equal to 1e-6 relative; NaN equals NaN, inf equals inf."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return close(a, b)


def _row(e) -> tuple[str, float]:
    return e.name, e.intensity


def _inverted(e) -> float:
    return e.nbytes / e.flops if e.flops else (math.inf if e.nbytes else math.nan)


def _first_not_idle(ev):
    return next((e for e in ev if e.name != _IDLE), ev[0])


_EVIDENCE_MISTAKES = [
    (lambda ev: (ev[0].name, _inverted(ev[0])),
     "arithmetic intensity is FLOP per byte, flops / nbytes, not bytes per FLOP"),
    (lambda ev: (ev[0].name, 0.0 if math.isnan(ev[0].intensity) else ev[0].intensity),
     "collectives and idle time have no FLOP/byte (no counted bytes): answer float('nan'), not 0"),
    (lambda ev: _row(ev[1] if len(ev) > 1 else ev[0]),
     "the top contributor is evidence[0] (Python counts from 0), the row with the most time; not evidence[1]"),
    (lambda ev: _row(ev[-1]), "rows are sorted by time, largest first: the top contributor is evidence[0], not the "
                              "last row"),
    (lambda ev: _row(_first_not_idle(ev)),
     f"idle time is a contributor too: when '{_IDLE}' takes the most time it is the top contributor (its name, "
     "and NaN)"),
    (lambda ev: (ev[0].name, ev[0].of_roof),
     "of_roof is the fraction of its roof the op reached; the intensity is flops / nbytes (Evidence.intensity)"),
]


def _pair(label, a) -> tuple[str, float]:
    """The learner's ``(name, intensity)`` for one mystery, or a one-line failure."""
    if not isinstance(a, (tuple, list)) or len(a) != 2:
        fail(f"mystery {label}: answer a pair (operator name, FLOP/byte), got {type(a).__name__} {a!r:.60}. "
             "Hint: (e.name, e.flops / e.nbytes) of the top evidence row")
    name, x = a
    if not isinstance(name, str):
        fail(f"mystery {label}: the operator's name should be a string, got {type(name).__name__}. Hint: the row's "
             "name, e.g. 'aten::mm'")
    if x is None:
        fail(f"mystery {label}: intensity None. Hint: a collective or the idle row has no FLOP/byte: answer "
             "float('nan')")
    return name, expect_number(f"mystery {label}'s intensity", x, "FLOP/byte")


def _words(x: float) -> str:
    return "NaN" if math.isnan(x) else f"{x:.6g} FLOP/byte"


@exercise(4, "the evidence")
def evidence(answers, found) -> None:
    """``answers``: label -> ``(operator name, arithmetic intensity FLOP/byte)`` of the top contributor
    (``evidence[0]``) of each mystery in ``found`` (the dict :func:`teraflops.triage.workloads.mysteries`
    returned), as ``triage.triage(m.trace, waits=m.waits)`` gives it on this machine. The name must
    match exactly and the intensity to 1e-6 relative; a collective's or idle time's intensity is NaN
    and must be answered as NaN."""
    if not isinstance(found, dict) or not found or not all(hasattr(m, "trace") and hasattr(m, "waits")
                                                           for m in found.values()):
        fail("pass the lab's profiles as the second argument: found = workloads.mysteries(SEED, out_dir). "
             "Hint: check.evidence(top, found)")
    labels = tuple(found)
    answers = _answers_dict(answers, labels, "(operator name, FLOP/byte)")
    got = {label: _pair(label, a) for label, a in answers.items()}
    rows = {label: tr.triage(found[label].trace, waits=found[label].waits).evidence for label in labels}
    want = {label: _row(ev[0]) for label, ev in rows.items()}
    wrong = [k for k in labels if got[k][0] != want[k][0] or not _same(got[k][1], want[k][1])]
    if wrong:
        _evidence_fails(got, want, rows, labels, wrong)


def _evidence_fails(got: dict, want: dict, rows: dict, labels: tuple, wrong: list) -> None:
    """The one-line failure of :func:`evidence`: the first wrong mystery, what was answered and expected,
    and the hint of the common mistake every answer follows (else the hint for that kind of miss)."""
    hint = next((h for model, h in _EVIDENCE_MISTAKES
                 if all(got[k][0] == model(rows[k])[0] and _same(got[k][1], model(rows[k])[1]) for k in labels)), None)
    k = wrong[0]
    (gn, gx), (wn, wx) = got[k], want[k]
    more = f" ({len(wrong) - 1} more wrong: {', '.join(wrong[1:])})" if len(wrong) > 1 else ""
    if gn != wn:
        what = f"you named {gn!r}, but the top contributor is {wn!r}"
        hint = hint or "the top contributor is the first evidence row, evidence[0]: the most time in the step"
    elif math.isnan(wx):
        what = f"{wn} has no FLOP/byte (NaN), you answered {_words(gx)}"
        hint = hint or "collectives and idle time count no bytes: answer float('nan')"
    else:
        what = f"{wn}: you answered {_words(gx)}, expected {_words(wx)}"
        hint = hint or "intensity = flops / nbytes of the row (Evidence.intensity), NaN when it has no bytes"
    fail(f"mystery {k}: {what}{more}. Hint: {hint}")
