"""docs/layout.md is the package's tree, rendered from it: it cannot drift.

:func:`render` lists the shared base (the top-level modules) and each package with the title of
its docstring (the words before the first colon) and its modules. ``python tests/test_layout.py``
prints the block to paste into docs/layout.md after a module is added, moved or removed.
"""

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "helpers" / "teraflops"
MARK = "<!-- layout: tests/test_layout.py renders the next block from the tree -->"
ORDER = ("model_definition", "parallelization", "orchestration", "compilation", "hardware", "triage", "launch",
         "nodes", "course", "grading", "workers")


def _title(init: Path) -> str:
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return " ".join(doc.split(":", 1)[0].split())


def _modules(folder: Path) -> list[str]:
    names = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
    names += [f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists()]
    return sorted(names)


def render() -> str:
    """The docs/layout.md block: one entry per package, modules wrapped at 100 columns."""
    packages = sorted((p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()), key=ORDER.index)
    entries = [("teraflops/", "the shared base, imported by every unit", [m for m in _modules(PACKAGE) if not m.endswith("/")])]
    entries += [(f"teraflops/{name}/", _title(PACKAGE / name / "__init__.py"), _modules(PACKAGE / name)) for name in packages]
    lines = ["helpers/"]
    for name, title, modules in entries:
        lines.append(f"  {name:<29}{title}")
        lines += textwrap.wrap(", ".join(modules), 100, initial_indent=" " * 31, subsequent_indent=" " * 31,
                               break_on_hyphens=False)
    lines += ["notebooks/                     the lectures          labs/  exercises (generated)    solutions/  lab solutions",
              "tests/                         unit tests; tests/test_unitNN_run.py runs each lecture; nbval runs solutions/",
              ".ci/run                        CI entry point: installs from scratch, runs the README test command"]
    return "\n".join(lines)


def readme_block() -> str:
    text = (ROOT / "docs" / "layout.md").read_text()
    assert MARK in text, f"docs/layout.md lost its layout marker {MARK!r}"
    found = re.search(re.escape(MARK) + r"\n```\n(.*?)\n```", text, re.S)
    assert found, "the layout marker must be followed by a ``` block"
    return found.group(1)


def test_readme_layout_is_the_tree():
    want = render()
    assert readme_block() == want, "docs/layout.md differs from the tree; paste `python tests/test_layout.py`:\n" + want


def test_every_package_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        assert _title(init), f"{init.relative_to(ROOT)} has no docstring title (the words before its first colon)"


if __name__ == "__main__":
    print(render())
