"""Unit 6's checks: answers written here from the exercises' definitions pass, plausible wrong answers fail
with the hint that names them.

Exercises 1 and 2 run on the checks' own cases. Exercise 3 needs only the seed's key. Exercise 4
triages the lab's traces; here they are synthetic (as torch 2.x writes them, see tests/test_triage.py)
and the machine's ceilings are fixed, so nothing is launched. The verdicts of real mysteries are held to the
key on recorded traces (tests/data/triage); one slow test runs the real setup and asserts what does not
depend on the load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from teraflops.triage import verdict as tr
from teraflops.triage import workloads
from teraflops.ceilings import Ceilings
from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit06 as check
from teraflops.grading.core import REGISTRY
from teraflops.course.labs import PLACEHOLDER_MESSAGE

NOMINAL = Ceilings(1e11, 1e10, torch.float32, "cpu", 0, 0)  # ridge 10 FLOP/byte
FLOOR = 5e-6
SEED = 6


# --- the solutions as a learner writes them (the solution notebook's) -----------------------------

def exposed_communication(ops, collectives, step):
    def union(intervals):
        merged = []
        for s, e in sorted(intervals):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return merged

    comm, busy = union(collectives), union(ops)
    hidden = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in busy)
    return (sum(e - s for s, e in comm) - hidden) / (step[1] - step[0])


def waited_fraction(waits, rank):
    w = np.asarray(waits, dtype=float)
    excess = w[:, rank] - w.min(axis=1)
    return float(excess.mean() / w[:, rank].mean())


def todo(*args):
    raise NotImplementedError(PLACEHOLDER_MESSAGE)


def fails(check_fn, answer, *args, match: str) -> str:
    with pytest.raises(ExerciseFailed, match=match) as e:
        check_fn(answer, *args)
    msg = str(e.value)
    assert msg.startswith(f"Exercise {check_fn.exercise.number} (") and "\n" not in msg
    assert len(e.value._render_traceback_()) == 1
    return msg


# What the lab's seed 6 builds (its setup cell shuffles the five kinds with random.Random(6)), as a learner
# who triaged each mystery answers: written out, so that a check comparing with a wrong key fails.
SEED_6_VERDICTS = {"A": "communication-bound", "B": "overhead-bound", "C": "memory-bound", "D": "compute-bound",
                   "E": "waiting (straggler)"}


def test_answers_written_from_the_definitions_pass(capsys):
    """Each check compares with the package's reference: these answers, written here (the solution
    notebook's), pass only where the reference agrees with the exercise's definition (passing the
    reference itself would hold by construction)."""
    check.exposed_communication(exposed_communication)
    check.waited_fraction(waited_fraction)
    check.verdicts(SEED_6_VERDICTS, SEED)
    out = capsys.readouterr().out
    assert out.count("passed") == 3 and "✓ Exercise 1 (exposed communication): passed" in out


def test_the_references_the_checks_use_give_the_hand_computed_values():
    """What the checks compare with, on cases worked out by hand."""
    # a collective over [0.25, 0.875] of a 1 s step, ops over [0, 0.375] and [0.75, 1]: exposed [0.375, 0.75]
    assert check.exposed_reference([(0.0, 0.375), (0.75, 1.0)], [(0.25, 0.875)], (0.0, 1.0)) == pytest.approx(0.375)
    # rank 0 waits 30 and 29 ms while the last to arrive waits 2 and 1 ms: 28 of its 29.5 ms on average
    assert check.waited_reference([[0.030, 0.031, 0.002], [0.029, 0.030, 0.001]], 0) == pytest.approx(0.028 / 0.0295)
    assert workloads.mystery_key(SEED) == {k: next(c for c, v in tr.VERDICTS.items() if v == want)
                                           for k, want in SEED_6_VERDICTS.items()}


def test_unit6_is_registered_for_grading():
    mine = sorted((ex.number, ex.name) for ex in REGISTRY.values() if ex.unit == 6)
    assert mine == [(1, "exposed_communication"), (2, "waited_fraction"), (3, "verdicts"), (4, "evidence")]


def test_placeholder_is_not_attempted(tmp_path):
    for fn in (check.exposed_communication, check.waited_fraction):
        with pytest.raises(NotAttempted, match="not attempted"):
            fn(todo)
    # exercises 3 and 4: the lab's cell starts from an empty dict, then hits the placeholder
    with pytest.raises(NotAttempted, match="^Exercise 3 \\(the verdicts\\): not attempted"):
        check.verdicts({}, SEED)
    with pytest.raises(NotAttempted, match="^Exercise 4 \\(the evidence\\): not attempted"):
        check.evidence({}, {"A": workloads.Profiled("mystery A", 0, tmp_path / "a.json", None, None, "a mystery")})


# --- exercise 1 -------------------------------------------------------------------------------------

def _merge(xs):
    return check._merge(xs)


def _len(xs):
    return sum(e - s for s, e in xs)


def _exposed_s(o, c):
    return check._exposed_seconds(o, c)


def sweep(ops, collectives, step):
    """Another correct form: walk the sorted boundaries, keep segments with a collective and no op."""
    cuts = sorted({step[0], step[1], *(t for iv in ops + collectives for t in iv)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in collectives) and not any(s <= mid < e for s, e in ops):
            total += b - a
    return total / (step[1] - step[0])


def test_exposed_other_correct_forms_pass(capsys):
    check.exposed_communication(sweep)
    check.exposed_communication(lambda o, c, s: np.float64(exposed_communication(o, c, s)))  # a NumPy float
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("wrong, hint", [
    (lambda o, c, s: _len(c) / (s[1] - s[0]), "you summed the collectives' durations"),
    (lambda o, c, s: _len(_merge(c)) / (s[1] - s[0]), "overlapped communication costs nothing"),
    (lambda o, c, s: sum(_exposed_s(o, [x]) for x in c) / (s[1] - s[0]), "count that time once"),
    (lambda o, c, s: (_len(_merge(c)) - sum(check._overlap(_merge(c), [x]) for x in o)) / (s[1] - s[0]),
     "merge the op intervals"),
    (lambda o, c, s: _exposed_s(o, c) / (_len(o) + _len(c)) if o or c else 0.0, "divide by the step's span"),
    (lambda o, c, s: _exposed_s(o, c) / _len(c) if c else 0.0, "divide by the step's span"),
    (lambda o, c, s: _exposed_s(o, c) / s[1], "not step\\[1\\]"),
    (lambda o, c, s: _exposed_s(o, c), "not seconds"),
    (lambda o, c, s: 100 * exposed_communication(o, c, s), "not a percentage"),
    (lambda o, c, s: check._overlap(_merge(c), _merge(o)) / _len(_merge(c)) if c else 0.0,
     "Holistic Trace Analysis"),
    (lambda o, c, s: 1 - exposed_communication(o, c, s), "1 minus the answer"),
    (lambda o, c, s: exposed_communication(o, c, s) * 1.01, "fit none of the usual mistakes"),
])
def test_exposed_mistakes(wrong, hint):
    fails(check.exposed_communication, wrong, match=hint)


def test_exposed_names_the_case():
    fails(check.exposed_communication, lambda o, c, s: _len(_merge(c)) / (s[1] - s[0]),
          match="for 'a collective fully overlapped by an op' \\(ops=\\[\\(0.0, 0.75\\)\\], collectives=\\[\\(0.125, "
                "0.5\\)\\], step=\\(0.0, 1.0\\)\\): got 0.375, expected 0")


@pytest.mark.parametrize("wrong, message", [
    (lambda o, c, s: None, "should return a number \\(a fraction of the step\\), got NoneType"),
    (lambda o, c, s: "0.5", "got str"),
    (lambda o, c, s: float("nan"), "got nan, expected a finite number"),
    (lambda o, c, s: _exposed_s(o, c) / _len(c), "ZeroDivisionError.*step\\[1\\] - step\\[0\\], which is never 0"),
    (lambda o, c, s: (max(e for _, e in c) - min(b for b, _ in c)) / (s[1] - s[0]), "may be empty lists"),
])
def test_exposed_garbage(wrong, message):
    fails(check.exposed_communication, wrong, match=message)


def test_exposed_gets_lists_and_may_sort_them_in_place(capsys):
    seen = []

    def sorts(ops, collectives, step):
        assert isinstance(ops, list) and isinstance(collectives, list) and isinstance(step, tuple)
        ops.sort(reverse=True)
        collectives.sort(reverse=True)
        seen.append(len(collectives))
        return exposed_communication(ops, collectives, step)

    check.exposed_communication(sorts)
    check.exposed_communication(exposed_communication)  # the cases are unchanged
    assert "passed" in capsys.readouterr().out and len(seen) == len(check._EXPOSED_CASES)


# --- exercise 2 -------------------------------------------------------------------------------------

def _a(w):
    return np.asarray(w, dtype=float)


def _ex(w):
    return _a(w) - _a(w).min(axis=1, keepdims=True)


def test_waited_other_correct_forms_pass(capsys):
    def loops(waits, rank):  # plain Python over nested lists
        rows = [list(map(float, row)) for row in np.asarray(waits).tolist()]
        return sum(r[rank] - min(r) for r in rows) / sum(r[rank] for r in rows)

    check.waited_fraction(loops)
    check.waited_fraction(lambda w, r: np.float32(waited_fraction(w, r)))
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("wrong, hint", [
    (lambda w, r: (_a(w).max(axis=1) - _a(w)[:, r]).mean() / _a(w)[:, r].mean(), "not the maximum"),
    (lambda w, r: (_a(w)[:, r] - _a(w).max(axis=1)).mean() / _a(w)[:, r].mean(), "not the maximum"),
    (lambda w, r: (_a(w)[:, r] - _a(w).min()).mean() / _a(w)[:, r].mean(), "not over the whole array"),
    (lambda w, r: (_a(w)[:, r] - _a(w)[:, r].min()).mean() / _a(w)[:, r].mean(), "not over the steps of one rank"),
    (lambda w, r: _ex(w).mean() / _a(w).mean(), "not the mean over the ranks"),
    (lambda w, r: float(np.mean(_ex(w).mean(axis=0) / _a(w).mean(axis=0))), "not the mean over the ranks"),
    (lambda w, r: _ex(w)[:, r].mean(), "not seconds"),
    (lambda w, r: _ex(w)[:, r].sum(), "not seconds"),
    (lambda w, r: float(np.mean(_ex(w)[:, r] / _a(w)[:, r])), "not the mean of per-step ratios"),
    (lambda w, r: 100 * waited_fraction(w, r), "not a percentage"),
    (lambda w, r: 1 - waited_fraction(w, r), "the transfer's share"),
    (lambda w, r: waited_fraction(w, r) + 0.01, "fit none of the usual mistakes"),
])
def test_waited_mistakes(wrong, hint):
    fails(check.waited_fraction, wrong, match=hint)


def test_waited_names_the_case():
    fails(check.waited_fraction, lambda w, r: (_a(w)[:, r] - _a(w).min()).mean() / _a(w)[:, r].mean(),
          match="for 'rank 2 arrives last in every step; rank 0's fraction' \\(waits \\(3, 4\\) \\[steps, ranks\\], "
                "rank=0\\): got 0.966667, expected 0.933333")


@pytest.mark.parametrize("wrong, message", [
    (lambda w, r: float(w.mean()), "nested lists: start with w = np.asarray"),  # a list has no .mean
    (lambda w, r: w[:, r].mean(), "nested lists, which take no \\[:, rank\\]"),
    (lambda w, r: [waited_fraction(w, r)], "should return a number \\(a fraction of the rank's time in collectives\\)"),
    (lambda w, r: float("inf"), "got inf, expected a finite number"),
])
def test_waited_garbage(wrong, message):
    fails(check.waited_fraction, wrong, match=message)


@pytest.mark.parametrize("waits, rank, late", [
    ([[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031]], 0, 2),
    ([[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031]], 3, 2),
    (np.tile([0.5, 0.52, 0.49, 0.02], (5, 1)) + np.linspace(0, 0.01, 5)[:, None], 1, 3),
])
def test_waited_reference_is_the_triage_split(waits, rank, late):
    """The check's reference is what :func:`teraflops.triage.verdict.triage` moves to waiting (one rank stands out)."""
    shares = dict.fromkeys(tr.CATEGORIES, 0.0)
    shares["communication"] = 1.0
    flagged, _, waited = tr._straggler_split(waits, shares, rank)
    assert flagged == (late,)
    assert shares["waiting"] == pytest.approx(check.waited_reference(waits, rank), rel=1e-12) == pytest.approx(waited)


# --- exercise 3 -------------------------------------------------------------------------------------

KEY = workloads.mystery_key(SEED)


def _answers(**changes):
    return {k: tr.VERDICTS[changes.get(k, v)] for k, v in KEY.items()}


def _label(kind):
    return next(k for k, v in KEY.items() if v == kind)


def test_verdicts_accept_category_names_and_any_case(capsys):
    check.verdicts(dict(KEY), SEED)
    check.verdicts({k: f"  {tr.VERDICTS[v].upper()} " for k, v in KEY.items()}, SEED)
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("got, want, hint", [
    ("communication", "waiting", "pass the mystery's waits: one rank's trace cannot tell waiting from communication"),
    ("waiting", "communication", "waits least"),
    ("compute", "memory", "ridge point"),
    ("memory", "compute", "ridge point"),
    ("compute", "overhead", "launch floor"),
    ("overhead", "memory", "launch floor"),
    ("compute", "communication", "the category with the largest share"),
])
def test_verdict_hints(got, want, hint):
    label = _label(want)
    msg = fails(check.verdicts, _answers(**{label: got}), SEED, match=hint)
    assert f"mystery {label} is not {tr.VERDICTS[got]}." in msg


def test_verdicts_count_the_other_wrong_ones():
    swapped = {k: {"compute": "memory", "memory": "compute"}.get(v, v) for k, v in KEY.items()}
    first, second = sorted(k for k in KEY if KEY[k] in ("compute", "memory"))
    fails(check.verdicts, swapped, SEED, match=f"mystery {first} is not .* \\(1 more wrong: {second}\\)\\. Hint: .*ridge")


@pytest.mark.parametrize("answers, message", [
    ({"A": "compute-bound"}, "no answer for mystery B, C, D, E"),
    ({**_answers(), "F": "compute-bound"}, "'F' is not a mystery's label"),
    ({**_answers(), "A": "slow"}, "mystery A: 'slow' is not a verdict. Hint: answer one of 'compute-bound'"),
    ({**_answers(), "B": None}, "mystery B: 'NoneType' is not a verdict"),
    (["compute-bound"] * 5, "pass a dict label -> verdict, got list"),
])
def test_verdicts_malformed(answers, message):
    fails(check.verdicts, answers, SEED, match=message)


# --- exercise 4: synthetic mysteries ----------------------------------------------------------------

def _op(name, ts, dur, dims, types, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims, "Input type": types}}


def _ddp(rank=0):
    """A data-parallel step: two matmuls, then an all-reduce (30 ms on gloo's thread), then the update."""
    f = ["float", "float"]
    return {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 4}, "traceEvents": [
        _op("aten::mm", 0, 330, [[32, 512], [512, 512]], f),
        _op("aten::mm", 340, 325, [[512, 32], [32, 512]], f),
        _op("c10d::allreduce_", 700, 45, [[[512, 512]], [], [], [], [], []], ["TensorList", "", "", "", "Scalar", "Scalar"]),
        _op("gloo:all_reduce", 740, 30000, [[262144]], ["float"], tid=2, cat="user_annotation"),
        _op("aten::add_", 30800, 380, [[512, 512], [512, 512], []], ["float", "float", "Scalar"])]}


def _traces():
    f = ["float", "float"]
    return {
        "A": {"traceEvents": [_op("aten::mm", 0, 3000, [[512, 512], [512, 512]], f),
                              _op("aten::add", 3010, 40, [[64], [64]], f)]},  # compute: mm on top
        "B": _ddp(),  # communication, even waits
        "C": _ddp(),  # the straggler's waits
        "D": {"traceEvents": [_op("aten::add", t, 10, [[4], [4]], f) for t in (0, 1000, 2000)]},  # idle on top
        "E": {"traceEvents": [_op("aten::add_", 0, 5000, [[1024, 1024], [1024, 1024]], f),
                              _op("aten::mul", 5010, 200, [[256], [256]], f)]},  # memory: intensity 0
    }


WAITS = {"B": [[0.030, 0.031, 0.029, 0.030]], "C": [[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031]]}


@pytest.fixture
def found(tmp_path, monkeypatch):
    """Five synthetic mysteries triaged against fixed ceilings (the check uses triage's defaults)."""
    monkeypatch.setattr(tr, "measured_ceilings", lambda device=None: NOMINAL)
    monkeypatch.setattr(tr, "measured_launch_floor", lambda device=None: FLOOR)
    out = {}
    for label, trace in _traces().items():
        path = tmp_path / f"mystery_{label}.json"
        path.write_text(json.dumps(trace))
        out[label] = workloads.Profiled(f"mystery {label}", 0, path, WAITS.get(label), None, "a mystery")
    return out


def _evidence(found):
    return {k: tr.triage(m.trace, waits=m.waits).evidence for k, m in found.items()}


def _top(found, pick=lambda ev: ev[0], intensity=lambda e: e.flops / e.nbytes if e.nbytes else math.nan):
    return {k: (pick(ev).name, intensity(pick(ev))) for k, ev in _evidence(found).items()}


def test_synthetic_mysteries_cover_the_cases(found):
    ev = _evidence(found)
    assert [ev[k][0].name for k in "ABCDE"] == ["aten::mm", "gloo:all_reduce", "gloo:all_reduce",
                                                 "(idle: no operator running)", "aten::add_"]
    assert ev["A"][0].intensity == pytest.approx(512 / 6) and ev["E"][0].intensity == 0
    assert tr.triage(found["C"].trace, waits=WAITS["C"]).verdict == "waiting (straggler)"


def test_evidence_reference_passes(found, capsys):
    """The first answer worked out by hand from the synthetic traces: A's 512³ fp32 matmul moves three
    512² matrices, 2·512³ / (3·512²·4) = 512/6 FLOP/byte; B and C spend most of the step in gloo's
    all-reduce (no FLOP/byte: NaN); D is idle most of its step; E's add_ counts no FLOPs (intensity 0)."""
    nan = float("nan")
    check.evidence({"A": ("aten::mm", 512 / 6), "B": ("gloo:all_reduce", nan), "C": ("gloo:all_reduce", nan),
                    "D": ("(idle: no operator running)", nan), "E": ("aten::add_", 0.0)}, found)
    check.evidence({k: (e.name, e.intensity) for k, (e, *_) in _evidence(found).items()}, found)  # Evidence.intensity
    check.evidence({k: [n, np.float64(x)] for k, (n, x) in _top(found).items()}, found)  # a list, a NumPy float
    assert capsys.readouterr().out.count("✓ Exercise 4 (the evidence): passed") == 3


def _inverted(e):
    return e.nbytes / e.flops if e.flops else (math.inf if e.nbytes else math.nan)


@pytest.mark.parametrize("pick, intensity, hint", [
    (lambda ev: ev[0], _inverted, "FLOP per byte, flops / nbytes, not bytes per FLOP"),
    (lambda ev: ev[0], lambda e: 0.0 if math.isnan(e.intensity) else e.intensity, "answer float\\('nan'\\), not 0"),
    (lambda ev: ev[1], lambda e: e.intensity, "not evidence\\[1\\]"),
    (lambda ev: ev[-1], lambda e: e.intensity, "not the last row"),
    (lambda ev: next(e for e in ev if not e.name.startswith("(idle")), lambda e: e.intensity, "idle time is a contributor"),
    (lambda ev: ev[0], lambda e: e.of_roof, "of_roof is the fraction of its roof"),
])
def test_evidence_mistakes(found, pick, intensity, hint):
    fails(check.evidence, _top(found, pick, intensity), found, match=hint)


def test_evidence_default_hints(found):
    top = _top(found)
    msg = fails(check.evidence, {**top, "A": ("aten::matmul", top["A"][1])}, found,
                match="mystery A: you named 'aten::matmul', but the top contributor is 'aten::mm'")
    assert "more wrong" not in msg
    fails(check.evidence, {**top, "B": ("gloo:all_reduce", 1.0)}, found,
          match="mystery B: gloo:all_reduce has no FLOP/byte \\(NaN\\), you answered 1 FLOP/byte. Hint: .*float\\('nan'\\)")
    fails(check.evidence, {**top, "A": ("aten::mm", 85.0)}, found,
          match="aten::mm: you answered 85 FLOP/byte, expected 85.3333 FLOP/byte")


@pytest.mark.parametrize("change, message", [
    ({"B": ("gloo:all_reduce", None)}, "mystery B: intensity None. Hint: .*float\\('nan'\\)"),
    ({"A": "aten::mm"}, "mystery A: answer a pair \\(operator name, FLOP/byte\\), got str"),
    ({"A": ("aten::mm", 85.3, "compute")}, "answer a pair"),
    ({"A": (0, 85.3)}, "the operator's name should be a string, got int"),
    ({"A": ("aten::mm", "85")}, "mystery A's intensity should return a number"),
    ({"F": ("aten::mm", 1.0)}, "'F' is not a mystery's label"),
])
def test_evidence_malformed(found, change, message):
    fails(check.evidence, {**_top(found), **change}, found, match=message)


def test_evidence_needs_the_profiles(found):
    top = _top(found)
    fails(check.evidence, top, None, match="pass the lab's profiles as the second argument")
    fails(check.evidence, top, {k: m.trace for k, m in found.items()}, match="found = workloads.mysteries")
    fails(check.evidence, {"A": top["A"]}, found, match="no answer for mystery B, C, D, E")


# --- the real mysteries ---------------------------------------------------------------------------

DATA = Path(__file__).parent / "data" / "triage"
RECORDED = json.loads((DATA / "recorded.json").read_text())
AT_RECORDING = Ceilings(RECORDED["ceilings"]["peak_flops"], RECORDED["ceilings"]["bandwidth"], torch.float32, "cpu",
                        0, 0, source="recorded")
# the workload workloads.mysteries profiles for each kind (its _MYSTERY_LOCAL and _MYSTERY_RANKS)
RECORDED_KIND = {"compute": "matmul", "memory": "naive_attention", "overhead": "decode",
                 "communication": "allreduce", "waiting": "straggler"}


@pytest.fixture
def recorded_mysteries(monkeypatch):
    """Seed 6's mysteries as recorded traces of the workloads ``workloads.mysteries`` profiles for each
    kind (at scale 1; tests/data/triage), with their recorded waits and the recording's ceilings and launch
    floor as triage's defaults (the checks call triage with its defaults, as the lab does)."""
    monkeypatch.setattr(tr, "measured_ceilings", lambda device=None: AT_RECORDING)
    monkeypatch.setattr(tr, "measured_launch_floor", lambda device=None: RECORDED["launch_floor"])
    found = {}
    for label, kind in workloads.mystery_key(SEED).items():
        w = RECORDED["workloads"][RECORDED_KIND[kind]]
        found[label] = workloads.Profiled(f"mystery {label}", 0, DATA / w["trace"], w["waits"], None, "a mystery")
    return found


def test_recorded_mysteries_pass_the_solution_and_name_the_missing_waits(recorded_mysteries, capsys):
    """The lab's solution on recorded real traces: each mystery's verdict is its key's, its evidence is
    what the check reads; left without its waits, the straggler's trace reads communication-bound and the
    check says to pass the waits."""
    found = recorded_mysteries
    reports = {k: tr.triage(m.trace, waits=m.waits) for k, m in found.items()}
    check.verdicts({k: r.verdict for k, r in reports.items()}, SEED)
    check.evidence({k: (r.evidence[0].name, r.evidence[0].intensity) for k, r in reports.items()}, found)
    assert capsys.readouterr().out.count("passed") == 2
    blind = {k: tr.triage(m.trace).verdict for k, m in found.items()}  # the waits left out
    fails(check.verdicts, blind, SEED, found, match="pass the mystery's waits")


@pytest.mark.slow
def test_real_mysteries_are_profiled_and_the_evidence_check_reads_them(tmp_path, capsys):
    """The lab's setup for real (two workloads across 4 gloo ranks, ~1 min on the CPU machine): five
    labelled traces, waits with the two multi-rank ones, names hidden; the evidence check reads them as the
    solution does. Which verdict each gets depends on the load while it was profiled: the recorded
    mysteries above hold the verdicts to the key."""
    found = workloads.mysteries(SEED, tmp_path)
    assert list(found) == list(workloads.MYSTERY_LABELS)
    key = workloads.mystery_key(SEED)
    for label, m in found.items():
        assert m.trace == tmp_path / f"mystery_{label}.json" and m.trace.exists() and m.expected is None
        assert m.name == f"mystery {label}" and (m.waits is not None) == (key[label] in ("communication", "waiting"))
    reports = {k: tr.triage(m.trace, waits=m.waits) for k, m in found.items()}
    for r in reports.values():
        assert abs(sum(r.shares.values()) - 1) < 1e-9 and min(r.shares.values()) >= 0
    check.evidence({k: (r.evidence[0].name, r.evidence[0].intensity) for k, r in reports.items()}, found)
    assert capsys.readouterr().out.count("passed") == 1


def test_an_answer_the_tool_agrees_with_passes(found, capsys):
    """The synthetic mysteries' key is not mystery_key(SEED), as a busy machine can make a real profile
    read: where the learner writes what triage says of the trace and the key differs, the learner read
    the measurement right and passes; an answer that is neither the key nor the trace's reading fails,
    and without the mysteries only the key counts."""
    said = {k: tr.triage(m.trace, waits=m.waits).verdict for k, m in found.items()}
    key = workloads.mystery_key(SEED)
    first = next(k for k in key if tr.VERDICTS[key[k]] != said[k])
    check.verdicts(said, SEED, found)
    assert "passed" in capsys.readouterr().out
    wrong = dict(said, **{first: next(v for v in tr.VERDICTS.values() if v not in (said[first], tr.VERDICTS[key[first]]))})
    fails(check.verdicts, wrong, SEED, found, match=f"mystery {first} is not ")
    fails(check.verdicts, said, SEED, match=f"mystery {first} is not ")
