"""The package's layers: what each part of ``helpers/teraflops`` may import (function-local imports included).

The layout shows the course (docs/layout.md): the shared base at the top level, one package per
lecture, the launch machinery, the emulated nodes, the course's commands, grading and the rank
programs. Each may import only the layers below it, so a learner who follows a lecture's source
into the package finds the lesson and what it stands on, never the CLI or Slurm plumbing:

=================  ==========================================================================
layer              may import
=================  ==========================================================================
base               base
nodes              base
launch             base, nodes
lecture packages   base, nodes, launch, the same and earlier lectures (Unit 2 may use Unit 1's
                   package, never Unit 5's: what two lectures share lives in the base)
grading            base, nodes, launch, lecture packages, grading (it executes a lab with
                   ``launch.notebook``, as ``teraflops run`` executes a lecture; never ``course``)
workers            base, nodes, launch, lecture packages, workers
course             everything
=================  ==========================================================================

The graph is :mod:`test_imports`'s (parsed, not imported: nothing runs).
"""

from pathlib import Path

import pytest

from test_imports import import_graph

LECTURES = ("model_definition", "parallelization", "orchestration", "compilation", "hardware", "triage")
ALLOWED = {
    "base": {"base"},
    "nodes": {"base", "nodes"},
    "launch": {"base", "nodes", "launch"},
    "lecture": {"base", "nodes", "launch", "lecture"},
    "grading": {"base", "nodes", "launch", "lecture", "grading"},
    "workers": {"base", "nodes", "launch", "lecture", "workers"},
    "course": {"base", "nodes", "launch", "lecture", "grading", "workers", "course"},
}


def layer(module: str) -> str:
    """``teraflops.launch.wire`` → ``launch``; a lecture package's module → ``lecture``; top level → ``base``."""
    parts = module.split(".")
    if len(parts) < 2 or module == "teraflops.__main__":
        return "base" if module != "teraflops.__main__" else "course"
    top = parts[1]
    if top in LECTURES:
        return "lecture"
    if top in ("nodes", "launch", "grading", "workers", "course"):
        return top
    return "base"


def unit(module: str) -> int | None:
    """The lecture a module belongs to (0 = Unit 1's ``model_definition``), ``None`` outside the lectures."""
    parts = module.split(".")
    return LECTURES.index(parts[1]) if len(parts) > 1 and parts[1] in LECTURES else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        allowed = ALLOWED[layer(module)]
        for target in sorted(targets):
            if layer(target) not in allowed and target not in allowed:
                found.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
            elif unit(module) is not None and unit(target) is not None and unit(target) > unit(module):
                found.append(f"{module} (lecture {unit(module) + 1}) imports {target} (later lecture "
                             f"{unit(target) + 1}): move what both use to the base")
    return found


def test_every_import_goes_down_the_layers():
    bad = violations(import_graph())
    assert not bad, "imports against the layering (see this module's docstring):\n  " + "\n  ".join(bad)


def test_the_top_level_holds_only_the_shared_base():
    root = Path(__file__).resolve().parents[1] / "helpers" / "teraflops"
    top = sorted(p.stem for p in root.glob("*.py"))
    base = ["__init__", "__main__", "caches", "ceilings", "comm_cost", "data", "datasheets", "errors", "gpu_fit", "headlines",
            "machine", "mechanism", "memory", "models", "ownership", "plots", "sizing", "tables", "teardown", "timing",
            "widgets"]
    assert top == base, f"top-level modules changed: {sorted(set(top) ^ set(base))} (a lesson goes in its unit's package)"


@pytest.mark.parametrize("source, target, rule", [
    ("teraflops.ceilings", "teraflops.model_definition.roofline", "base"),
    ("teraflops.compilation.decode", "teraflops.course.runner", "lecture"),
    ("teraflops.nodes.cluster", "teraflops.launch.launcher", "nodes"),
    ("teraflops.orchestration.stragglers", "teraflops.workers.straggler", "lecture"),
    ("teraflops.grading.grader", "teraflops.course.runner", "grading"),
    ("teraflops.parallelization.tensor_parallel", "teraflops.hardware.alpha_beta", "lecture 2"),
])
def test_a_deliberate_violation_is_caught(source, target, rule):
    graph = import_graph()
    graph[source] = graph[source] | {target}
    assert any(line.startswith(f"{source} ({rule}) imports {target}") for line in violations(graph))
