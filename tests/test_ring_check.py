"""The ring all-reduce check (Unit 5, exercise 5) and the ring's timing beside torch's.

Launched tests start real gloo ranks (2, 3 and 4 for a passing ring: ~60 s on 2 busy cores); wrong
answers fail on the first world size, 2 ranks. The rest judges reports like the ranks write.
"""

import itertools
import linecache
import os

import pytest
import torch

from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit05 as check
from teraflops.hardware import ring
from teraflops.hardware.ring import RingCheckResult

REFERENCE = ring.function_source(ring.ring_all_reduce)
_cells = itertools.count(1)


def notebook_function(source: str, name: str = "ring_all_reduce"):
    """Define a function the way a Jupyter cell does (a made-up file name registered in linecache)."""
    filename = f"/tmp/ipykernel_{os.getpid()}/ring{next(_cells)}.py"
    linecache.cache[filename] = (len(source), None, [line + "\n" for line in source.splitlines()], filename)
    namespace = {"__name__": "__main__", "torch": torch, "dist": torch.distributed}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def edited(*old_new: str):
    source = REFERENCE
    for old, new in zip(old_new[::2], old_new[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return notebook_function(source)


def fails(fn, *phrases: str) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check.ring_all_reduce(fn)
    msg = str(e.value)
    assert msg.startswith("Exercise 5 (a ring all-reduce by hand): "), msg
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


# --- launched ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_reference_passes_on_2_3_and_4_ranks(capsys):
    check.ring_all_reduce(notebook_function(REFERENCE))
    assert "✓ Exercise 5 (a ring all-reduce by hand): passed" in capsys.readouterr().out


@pytest.mark.slow
def test_ring_steps_off_by_one_fail():
    fn = edited("send, recv = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]",
                "send, recv = chunks[(rank - s - 1) % n], chunks[(rank - s) % n]")
    fails(fn, "on 2 ranks", "Hint: in reduce-scatter step s = 0 … n−2, rank r sends chunk (r − s) mod n")


@pytest.mark.slow
def test_missing_all_gather_fails():
    fn = edited("    for s in range(n - 1):  # all-gather", "    for s in range(0):  # all-gather")
    fails(fn, "each rank holds the full sum of one chunk only", "run the all-gather's n − 1 steps")


@pytest.mark.slow
def test_compare_times_the_ring_beside_torch():
    rows = ring.compare(ranks=2, elements=(2**10, 2**12), iters=2)
    assert [r["size"] for r in rows] == [4 * 2**10, 4 * 2**12]
    for r in rows:
        assert r["ranks"] == 2 and r["ring_s"] > 0 and r["torch_s"] > 0
        assert r["ring_busbw"] == pytest.approx(r["size"] / r["ring_s"])  # 2(n−1)/n = 1 on 2 ranks
        assert r["torch_busbw"] == pytest.approx(r["size"] / r["torch_s"])


# --- without launching -------------------------------------------------------------------------------

def test_placeholder_is_not_attempted_without_launching(monkeypatch):
    monkeypatch.setattr(ring, "run", lambda *a, **k: pytest.fail("the check launched ranks"))
    stub = 'def ring_all_reduce(tensor):\n    raise NotImplementedError("Exercise: replace this line with your code")\n'
    with pytest.raises(NotAttempted, match="not attempted"):
        check.ring_all_reduce(notebook_function(stub))


def test_check_sizes_cover_fewer_elements_than_ranks_and_uneven_chunks():
    assert min(ring.CHECK_ELEMENTS) < min(ring.CHECK_WORLDS)
    assert all(any(e % n for e in ring.CHECK_ELEMENTS) for n in ring.CHECK_WORLDS)
    assert ring.CHECK_WORLDS == (2, 3, 4)


def reports(n=3, **change) -> list:
    from teraflops.launch.wire import from_json

    out = []
    for r in range(n):
        cases = []
        for e in ring.CHECK_ELEMENTS:
            case = {"elements": e, "wrong": 0, "chunks": [], "partial": False,
                    "sent": 2 * (n - 1) * -(-e // n), "collectives": 0}
            case.update({k: v(r, case) if callable(v) else v for k, v in change.items()})
            cases.append(case)
        out.append({"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "error": None, "cases": cases,
                    "timed": [], "ring_s": [], "torch_s": []})
    return [from_json(RingCheckResult, rep) for rep in out]


def judged(results) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check._judge_ring(results)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_judge_passes_a_correct_report():
    for n in (2, 3, 4):
        check._judge_ring(reports(n))


@pytest.mark.parametrize("change, phrase", [
    ({"collectives": 1}, "called a collective"),
    ({"sent": lambda r, c: 3 * c["elements"]}, "Hint: send one chunk per step"),
    ({"wrong": lambda r, c: 2 if c["elements"] >= 3 else 0, "chunks": [1], "partial": True},
     "holding sums of some ranks' contributions"),
    ({"wrong": lambda r, c: 5 if c["elements"] >= 3 else 0, "chunks": [0, 2], "partial": True},
     "each rank holds the full sum of one chunk only"),
    ({"wrong": lambda r, c: 1 if c["elements"] % 3 else 0, "chunks": [2], "partial": False},
     "sizes that 3 divides come back right"),
])
def test_judge_names_the_mistake(change, phrase):
    assert phrase in judged(reports(**change))


def test_judge_names_a_deadlock():
    from teraflops.launch.wire import from_json, to_json

    error = {"where": "ring_all_reduce(tensor of 1 elements)", "type": "RuntimeError",
             "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting", "time": 1.0}
    results = [from_json(RingCheckResult, {**to_json(r), "error": error}) for r in reports(2)]
    assert "Hint: every send needs the matching receive" in judged(results)
