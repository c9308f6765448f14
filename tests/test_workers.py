"""Every rank program reads a Spec and writes a Result: its modules parsed (``ast``), not imported.

A rank program (``helpers/teraflops/workers/*.py``, except the shared helpers of ``common.py``) gets
only ``--spec PATH`` on its command line (:func:`teraflops.launch.launcher.launch`): it must call
:func:`~teraflops.launch.rank.read_spec`, hand back a Result dataclass through
:func:`~teraflops.launch.rank.write_result` (``write_result(SomethingResult(...))``, not a dict), and
import no ``argparse``. Its sizes and hyper-parameters come from the Spec: a number at module level
or as a parameter's default in any worker module is one of :data:`NOT_CHOICES`, each with why it is
not a choice. The predicates are shown to bite on synthetic sources.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKERS = Path(__file__).resolve().parents[1] / "helpers" / "teraflops" / "workers"
SHARED = {"__init__.py", "common.py", "learner_code.py"}  # no rank program: what the rank programs share
# programs that read a Spec but are no rank of the course's launcher, so there is no rank's result file to
# write_result into: the Result goes to the path their Spec names (wire.write)
DRIVERS = {"ray_train.py": "Ray Train's driver, run once in node 0 by `cluster exec`; Ray starts the ranks",
           "serve_decode.py": "Unit 4's Triton server, started by compilation.serving.Server: its ServeReady goes "
                              "to ready.json in the folder its Spec names, while it keeps serving"}
NOT_CHOICES = {
    "collective_sweep.PERIOD": "the check pattern's period (i mod 8), part of the check's arithmetic",
    "zero_train._elements.element_size": "bytes of an fp32 element, the unit the memory is counted in",
}


def _names(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def rank_program_problems(source: str) -> list[str]:
    """What keeps ``source`` (a rank program's module) from reading a Spec and writing a Result."""
    tree = ast.parse(source)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            problems.append(f"line {node.lineno}: imports argparse")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            problems.append(f"line {node.lineno}: imports from argparse")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if not any(_names(c) == "read_spec" for c in calls):
        problems.append("never calls read_spec")
    writes = [c for c in calls if _names(c) == "write_result"]
    if not writes:
        problems.append("never calls write_result")
    for c in writes:
        arg = c.args[0] if c.args else None
        if not (isinstance(arg, ast.Call) and _names(arg).endswith("Result")):
            problems.append(f"line {c.lineno}: write_result of {ast.unparse(arg) if arg else 'nothing'}, not a Result")
    return problems


def _number(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
               for n in ast.walk(node))


def numbers_outside_the_spec(source: str, module: str) -> list[str]:
    """Numbers at module level and parameters' numeric defaults in ``source``, as ``module.NAME`` /
    ``module.function.param``, that are not in :data:`NOT_CHOICES`."""
    tree, found = ast.parse(source), []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _number(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{module}.{ast.unparse(t)}" for t in targets]
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        args = fn.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        found += [f"{module}.{fn.name}.{a.arg}" for a, d in pairs if _number(d)]
    return [name for name in found if name not in NOT_CHOICES]


def rank_programs() -> list[Path]:
    return sorted(p for p in WORKERS.glob("*.py") if p.name not in SHARED)


def test_the_rank_programs_are_found():
    names = {p.stem for p in rank_programs()}
    assert {"collective_sweep", "selftest", "zero_train", "ddp_sync", "straggler"} <= names, names


@pytest.mark.parametrize("path", rank_programs(), ids=lambda p: p.stem)
def test_every_rank_program_reads_a_spec_and_writes_a_result(path):
    problems = rank_program_problems(path.read_text())
    if path.name in DRIVERS:
        problems = [p for p in problems if p != "never calls write_result"]
    assert not problems, f"workers/{path.name}: " + "; ".join(problems)


@pytest.mark.parametrize("path", sorted(WORKERS.glob("*.py")), ids=lambda p: p.stem)
def test_no_worker_module_holds_a_size_or_hyper_parameter(path):
    extra = numbers_outside_the_spec(path.read_text(), path.stem)
    assert not extra, (f"workers/{path.name}: {', '.join(extra)}: a size or hyper-parameter goes in the Spec, "
                       "chosen by the host or the preset (or, if it is no choice, in NOT_CHOICES with why)")


GOOD = '''
from teraflops.launch.rank import read_spec, write_result

def main(argv=None):
    spec = read_spec(ThingSpec, argv)
    write_result(ThingResult(rank=0, value=spec.steps))
'''


@pytest.mark.parametrize("source, words", [
    (GOOD.replace("from teraflops", "import argparse\nfrom teraflops"), "imports argparse"),
    (GOOD.replace("from teraflops", "from argparse import ArgumentParser\nfrom teraflops"), "imports from argparse"),
    (GOOD.replace("read_spec(ThingSpec, argv)", "parse(argv)"), "never calls read_spec"),
    (GOOD.replace("write_result(ThingResult(rank=0, value=spec.steps))", "print(spec)"), "never calls write_result"),
    (GOOD.replace("ThingResult(rank=0, value=spec.steps)", '{"rank": 0, "value": spec.steps}'), "not a Result"),
])
def test_the_predicates_bite(source, words):
    assert rank_program_problems(GOOD) == []
    assert any(words in p for p in rank_program_problems(source)), rank_program_problems(source)


def test_a_number_outside_the_spec_is_named():
    source = "MOMENTUM = 0.9\nNAME = 'steps.jsonl'\n\ndef comm_hook(setting, rank: int = 2, *, start=2, hook=None):\n    pass\n"
    assert numbers_outside_the_spec(source, "w") == ["w.MOMENTUM", "w.comm_hook.rank", "w.comm_hook.start"]
    assert numbers_outside_the_spec("PERIOD = 8\n", "collective_sweep") == []
