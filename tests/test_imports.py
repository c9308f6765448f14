"""The package's import graph has no cycle, counting the imports inside functions.

A function-local import hides a cycle from Python (the module is already loaded by the time the
function runs) but not from a reader: two modules that import each other are one idea split in
two, or one module holding two ideas. Every module under ``helpers/teraflops`` is parsed with
:mod:`ast` (not imported, so nothing runs); every ``import`` and ``from ... import`` anywhere in
it, at the top, inside functions or under ``if TYPE_CHECKING``, is resolved to the package's
modules it names (relative imports against the module's package; ``from pkg import name`` names
the submodule ``pkg.name`` when there is one, else ``pkg``). A package's ``__init__`` importing its
own submodules is not an edge back to itself (``teraflops.grading`` → ``teraflops.grading.core``
is loading, not dependence), but a submodule importing its parent package is.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "helpers" / "teraflops"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name → file of every module of the package (``teraflops.grading`` → its ``__init__.py``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()

    def add(target: str):
        # ``import a.b.c`` loads a, a.b and a.b.c; the dependence is on the deepest one that exists.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "teraflops":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "teraflops":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in modules else source)
    if is_package:  # a package's __init__ loading its own submodules is not dependence on them
        found = {t for t in found if not t.startswith(name + ".")}
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with more than one module.

    Tarjan's algorithm (Tarjan 1972, "Depth-first search and linear graph algorithms", SIAM J.
    Comput. 1(2)) finds the components; within each, a breadth-first search from its first module
    back to itself gives the shortest cycle through it, which is what a reader has to untangle.
    """
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for component in components:
        cycles.append(shortest_cycle(graph, component[0], set(component)))
    return cycles


def shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` within ``members`` (breadth-first)."""
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (function-local imports included):\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function(tmp_path):
    root = tmp_path / "teraflops"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from . import a\n")
    (root / "a.py").write_text("from .b import thing\n")
    (root / "b.py").write_text("def f():\n    from teraflops.sub import c\n")
    (root / "sub" / "__init__.py").write_text("from . import c\n")
    (root / "sub" / "c.py").write_text("def g():\n    from ..a import x\n")
    (root / "d.py").write_text("import teraflops.a\n")
    graph = import_graph(root)
    assert graph["teraflops"] == set() and graph["teraflops.sub"] == set()
    assert graph["teraflops.b"] == {"teraflops.sub.c"} and graph["teraflops.sub.c"] == {"teraflops.a"}
    assert find_cycles(graph) == [["teraflops.a", "teraflops.b", "teraflops.sub.c", "teraflops.a"]]
    (root / "sub" / "c.py").write_text("x = 1\n")
    assert find_cycles(import_graph(root)) == []


# --- where an import may hide inside a function, and which names cross a module's border -------------

LAZY_OK = {"teraflops", "teraflops.course.cli"}  # start-up must stay torch-free: `import teraflops`, the CLI
LAZY_MARK = "# lazy:"  # any other function-level import says why on its line


def hidden_imports(root: Path = PACKAGE) -> list[str]:
    """``path:line`` of every import of the package's own modules inside a function (or any block that
    is not the module's top level) outside :data:`LAZY_OK` that does not carry :data:`LAZY_MARK`."""
    found = []
    for name, path in module_names(root).items():
        if name in LAZY_OK:
            continue
        source = path.read_text()
        tree = ast.parse(source)
        lines = source.splitlines()
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                ours = getattr(node, "level", 0) or any(n.split(".")[0] == "teraflops" for n in names)
                if ours and LAZY_MARK not in lines[node.lineno - 1]:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def private_crossings(root: Path = PACKAGE) -> list[str]:
    """``path:line`` of every use of another module's underscore name: ``from m import _x`` or ``m._x``
    with ``m`` a module of the package."""
    found = []
    for name, path in module_names(root).items():
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "teraflops":
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: from {node.module} import {a.name}")
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "teraflops"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_imports_of_the_package_sit_at_the_top_of_each_module():
    bad = hidden_imports()
    assert not bad, ("imports inside functions hide dependencies from the file's header; move them to the top, "
                     f"or say why on the line with {LAZY_MARK!r}:\n  " + "\n  ".join(bad))


def test_no_module_uses_another_modules_private_names():
    bad = private_crossings()
    assert not bad, "underscore names used outside their module (make them public or move them):\n  " + "\n  ".join(bad)


def test_both_rules_bite(tmp_path):
    root = tmp_path / "teraflops"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("_secret = 1\n\ndef f():\n    from teraflops import b  # lazy: a reason\n")
    (root / "b.py").write_text("from teraflops.a import _secret\nfrom teraflops import a\n\ndef g():\n"
                               "    from . import a\n    return a._secret\n")
    assert hidden_imports(root) == ["teraflops/b.py:5: from . import a"]
    assert private_crossings(root) == ["teraflops/b.py:1: from teraflops.a import _secret", "teraflops/b.py:6: a._secret"]
