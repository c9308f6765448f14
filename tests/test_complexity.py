"""No function of the launch machinery (``launch/``), the emulated nodes (``nodes/``), the course's
commands (``course/``) or the grading (``grading/``) grows past what one reads at a sitting: radon's cyclomatic complexity (McCabe, "A Complexity Measure",
IEEE TSE 1976: decision points + 1; radon also counts each ``and``/``or``, comprehension and ``except``)
of every function, method and class stays within rank C, at most 20, which is what
``radon cc -s -n D helpers/teraflops/launch helpers/teraflops/nodes helpers/teraflops/course
helpers/teraflops/grading`` printing nothing means. A function that grows past it is split into named
stages, as the judges of ``grading/`` are (``grading/unit02.py``'s ``_judge_zero1``, say).
"""

from pathlib import Path

import pytest

radon = pytest.importorskip("radon.complexity", reason="radon is not installed (it is in the test extra: "
                                                      "pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1] / "helpers" / "teraflops"
PACKAGES = ("launch", "nodes", "course", "grading")
LIMIT = 20  # radon's rank C (11-20); D starts at 21 (radon.complexity.cc_rank)


def _blocks(source: str):
    """Every function, class and method radon measures in ``source`` (``cc_visit``: what ``radon cc`` lists)."""
    return radon.cc_visit(source)


def test_no_function_of_launch_nodes_course_or_grading_is_above_rank_c():
    assert radon.cc_rank(LIMIT) == "C" and radon.cc_rank(LIMIT + 1) == "D"
    found, too_complex = 0, []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for block in _blocks(path.read_text()):
                found += 1
                if block.complexity > LIMIT:
                    too_complex.append(f"{path.relative_to(ROOT.parent)}:{block.lineno} {block.fullname} "
                                       f"({block.complexity})")
    assert found > 300  # the packages were read
    assert not too_complex, (f"above cyclomatic complexity {LIMIT}; split them into named steps:\n  "
                             + "\n  ".join(too_complex))


def test_the_measure_sees_a_function_that_is_too_complex():
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(LIMIT))
    (block,) = _blocks(f"def f(x):\n{branches}\n    return -1\n")
    assert block.complexity == LIMIT + 1
