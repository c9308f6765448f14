"""No test asserts how fast this machine is right now.

A busy core (a shared workshop box, a CI runner beside other jobs) flips a wall-clock budget or a verdict
computed from live timings, and then finished work cannot be shown to be finished. So tests assert
mechanisms: verdict logic on recorded or injected measurements, live runs on shapes, units, bytes, counts
and invariants. Speed goals are figures in ``scripts/benchmark.py`` and in ``teraflops run``'s summary,
and what a lecture claims about a live measurement is one of its stories (``holds`` / ``can't tell`` /
``contradicts``), told by the run, not asserted here.

This file reads every test module (parsed, not run) and fails on:

* a call of ``assert_within`` (the time budgets this suite used to hold lectures to), or a
  ``@pytest.mark.timeout`` below the suite's hang guard (a budget in disguise);
* an ``assert`` that orders (``<``, ``<=``, ``>``, ``>=``) a clock reading (``time.perf_counter()``,
  ``time.time()``, ``time.monotonic()``, or a name assigned from an expression that reads one) against
  anything but zero;
* an ``assert`` that orders a measured speed or duration, by its name (``seconds``, ``elapsed``,
  ``*_s``, ``tflops``, ``throughput``, ``bandwidth``, ``*_rps``, ``bubble``, ...), against a nonzero
  number or another such measurement.

A line that orders such a value for a reason that does not depend on load (a value injected by the test
itself, a timeout honoured by a fake clock) says so with ``# not timed: <why>`` on the assert's first
line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EXEMPT = "# not timed:"
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "monotonic", "monotonic_ns", "time_ns"}
# names of measured speeds and durations: a word of the identifier (split at _ and .) or its suffix
SPEED_WORD = re.compile(r"^(seconds|secs|elapsed|wall|duration|latency|tflops|gflops|gbps|throughput|bandwidth"
                        r"|busbw|algbw|rps|bubble|speedup)$")
SPEED_SUFFIX = re.compile(r"(_s|_ms|_us|_rps|_per_s|_tflops|_gbps)$")


def _clock_call(node: ast.AST) -> bool:
    """``time.perf_counter()`` and friends, or ``perf_counter()`` imported bare."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute):
        return f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time"
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _reads_clock(node: ast.AST, clocked: set[str]) -> bool:
    return any(_clock_call(n) or (isinstance(n, ast.Name) and n.id in clocked) for n in ast.walk(node))


def _words(node: ast.AST) -> list[str]:
    """The identifiers an operand is named by: names, attributes and constant subscript keys."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            out.append(n.slice.value)
    return out


def _is_speed(node: ast.AST) -> bool:
    for name in _words(node):
        low = name.lower()
        if SPEED_SUFFIX.search(low) or any(SPEED_WORD.match(w) for w in low.split("_")):
            return True
    return False


def _is_deadline(node: ast.AST) -> bool:
    """A wait's own timeout (``time.monotonic() < deadline``): a hang ends the test, a slow start does not."""
    return any("deadline" in w.lower() for w in _words(node))


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
HANG_GUARD_S = 900  # pyproject's pytest timeout: a per-test timeout below it is a budget a busy machine breaks


def timed_assertions(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: why`` for every assertion of this machine's speed in ``source`` (see the module's
    docstring for the rules)."""
    tree = ast.parse(source, filename)
    lines = source.splitlines()
    found = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        clocked: set[str] = set()
        for node in ast.walk(fn):  # names that hold a clock reading or a difference of them
            if isinstance(node, ast.Assign) and _reads_clock(node.value, clocked):
                clocked |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                clocked |= {e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "assert_within":
                found.append(f"{filename}:{node.lineno}: a wall-clock budget (assert_within)")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "timeout"
                    and "mark" in _words(node.func) and node.args and _is_number(node.args[0])
                    and node.args[0].value < HANG_GUARD_S):
                found.append(f"{filename}:{node.lineno}: a time budget as a timeout (below the {HANG_GUARD_S} s hang guard)")
            if not isinstance(node, ast.Assert) or EXEMPT in lines[node.lineno - 1]:
                continue
            for cmp in [n for n in ast.walk(node.test) if isinstance(n, ast.Compare)]:
                operands = [cmp.left, *cmp.comparators]
                for op, a, b in zip(cmp.ops, operands, operands[1:]):
                    if not isinstance(op, ORDER):
                        continue
                    for x, y in ((a, b), (b, a)):
                        if _reads_clock(x, clocked) and not _is_zero(y) and not (_is_deadline(x) or _is_deadline(y)):
                            found.append(f"{filename}:{node.lineno}: orders a clock reading")
                            break
                        if _is_speed(x) and not _is_zero(y) and (_is_number(y) or _is_speed(y)):
                            found.append(f"{filename}:{node.lineno}: orders a measured speed or duration")
                            break
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def test_no_test_asserts_this_machines_speed():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += timed_assertions(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, ("tests that assert this machine's speed (assert the mechanism instead, move the figure to "
                       "scripts/benchmark.py or a lecture's story; or say '# not timed: <why>'):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    "def test_a():\n    assert_within(result, 180, 1)\n",
    "import time\ndef test_a():\n    t = time.perf_counter()\n    run()\n    assert time.perf_counter() - t < 1.0\n",
    "import time\ndef test_a():\n    start = time.time()\n    run()\n    elapsed = time.time() - start\n    assert elapsed < 20\n",
    "def test_a():\n    assert result.seconds < 300\n",
    "def test_a():\n    assert down_s < 15, 'took too long'\n",
    "def test_a():\n    assert by[16].throughput_rps >= 2 * single.throughput_rps\n",
    "def test_a():\n    assert abs(r['bubble'] - r['theory']) < 0.15\n",
    "def test_a():\n    assert ok and copy_gbps < 1.5 * peak_gbps\n",
    "import pytest\n@pytest.mark.timeout(180)\ndef test_a():\n    run()\n",
])
def test_a_timed_assertion_is_caught(source):
    assert timed_assertions(source)


@pytest.mark.parametrize("source", [
    "def test_a():\n    assert r.delay_s > 0 and len(rows) == 3\n",  # an invariant: durations are positive
    "import time\ndef test_a():\n    while not ready():\n        assert time.monotonic() < deadline, 'hung'\n",
    "def test_a():\n    assert a.transfer_s == pytest.approx(0.06)\n",  # equality on injected data
    "def test_a():\n    assert fit.r2 >= 0.95\n",  # not a speed by its name
    "def test_a():\n    assert budget_s < 2  # not timed: the budget is the test's own constant\n",
])
def test_an_invariant_or_an_exempt_line_passes(source):
    assert not timed_assertions(source)
