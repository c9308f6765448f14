"""teraflops.mechanism: lectures show helper source that exists, and a lost marker fails here.

The first half tests ``listing``/``show`` on small modules written for the test; the second runs every
``mechanism.show(...)`` call of the lectures (their arguments evaluated after the notebook's own imports,
nothing else executed), so a refactor that renames a helper or drops a marker fails this fast test, not a
learner's notebook.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from teraflops import mechanism
from teraflops.mechanism import MechanismError, listing

ROOT = Path(__file__).resolve().parents[1]
LECTURES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_LINES = 25  # "the ten or so lines that matter": a whole class or module slipping in fails

SAMPLE = '''\
"""A sample helper."""

import functools

TABLE = {
    "a": 1,
}


def plain(x):
    """Docstring, two lines:
    left out of the listing."""
    y = x + 1
    return y


def marked(x):
    total = 0
    for i in range(x):
        # mechanism: the loop body
        total += i  # a comment inside stays
        total *= 2
        # end mechanism
    return total


def unclosed():
    # mechanism: open
    return 1


def twice():
    # mechanism: dup
    a = 1
    # end mechanism
    # mechanism: dup
    b = 2
    # end mechanism
    return a + b


def empty():
    # mechanism: nothing
    # end mechanism
    return 0


def only_docstring():
    """Nothing else."""


def decorated_wrapper(fn):
    @functools.wraps(fn)
    def inner(*args):
        return fn(*args)
    return inner


@decorated_wrapper
def wrapped(x):
    """Wrapped."""
    return x * 3


class Box:
    """A class."""

    def method(self, v):
        """Method doc."""
        return v - 1

    @property
    def size(self):
        return 4


class Kernel:  # stands in for a Triton JITFunction: the Python function is in .fn
    fn = staticmethod(plain)
'''


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("mech") / "sample_helper.py"
    path.write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("sample_helper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sample_helper"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["sample_helper"]


def line_no(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_whole_function_leaves_out_the_docstring_and_names_its_lines(sample):
    got = listing(sample.plain)
    assert got.code == "def plain(x):\n    y = x + 1\n    return y"
    assert (got.first, got.last) == (line_no(SAMPLE, "def plain"), line_no(SAMPLE, "return y"))
    assert got.docstring_left_out and got.qualname == "plain" and got.path.endswith("sample_helper.py")
    assert got.where.endswith(f"lines {got.first}–{got.last}, in plain (docstring left out)")


def test_marked_region_is_dedented_and_markers_are_not_shown(sample):
    got = listing(sample.marked, "the loop body")
    assert got.code == "total += i  # a comment inside stays\ntotal *= 2"
    assert got.first == line_no(SAMPLE, "total += i") and got.last == got.first + 1
    assert not got.docstring_left_out and got.region == "the loop body"
    assert listing(sample.marked, "  the loop body ").code == got.code  # the name is stripped


@pytest.mark.parametrize("fn, name, says", [
    ("marked", "the loop", "has no '# mechanism: the loop' marker in its source (it has: 'the loop body')"),
    ("plain", "x", "has no '# mechanism: x' marker in its source. Hint"),
    ("unclosed", "open", "has no '# end mechanism' after it"),
    ("twice", "dup", "has 2 '# mechanism: dup' markers"),
    ("empty", "nothing", "is empty"),
])
def test_a_missing_or_broken_marker_is_a_one_line_error(sample, fn, name, says):
    with pytest.raises(MechanismError) as e:
        listing(getattr(sample, fn), name)
    assert says in one_line(e)


def test_selector_chooses_lines_by_their_text(sample):
    got = listing(sample.marked, start="for i in", stop="total *= 2")
    assert got.code.splitlines()[0] == "for i in range(x):" and got.code.splitlines()[-1] == "    total *= 2"
    assert listing(sample.marked, start="return total").code == "return total"  # no stop: to the end
    with pytest.raises(MechanismError) as e:
        listing(sample.marked, start="while True")
    assert "no line containing 'while True'" in one_line(e)
    with pytest.raises(MechanismError) as e:
        listing(sample.marked, start="total *= 2", stop="total = 0")  # stop only searched after start
    assert "no line containing 'total = 0' at or after" in one_line(e)
    with pytest.raises(MechanismError) as e:
        listing(sample.marked, "the loop body", start="for")
    assert "not both" in one_line(e)


def test_methods_properties_classes_wrappers_and_kernels(sample):
    assert listing(sample.Box.method).code == "def method(self, v):\n    return v - 1"
    assert listing(sample.Box().method).qualname == "Box.method"  # a bound method
    assert listing(sample.Box.size).code == "@property\ndef size(self):\n    return 4"
    assert listing(sample.Box).code.startswith("class Box:\n\n    def method")  # class docstring left out
    assert listing(sample.wrapped).code == "@decorated_wrapper\ndef wrapped(x):\n    return x * 3"
    assert listing(sample.Kernel()).code == listing(sample.plain).code
    assert listing(sample.only_docstring).code == 'def only_docstring():\n    """Nothing else."""'


def test_modules_need_a_selector_and_other_objects_have_no_source(sample):
    with pytest.raises(MechanismError) as e:
        listing(sample)
    assert "too long to show whole" in one_line(e)
    assert listing(sample, start="TABLE = {", stop="}").code == 'TABLE = {\n    "a": 1,\n}'
    with pytest.raises(MechanismError) as e:
        listing(len)
    assert "no source for 'len'" in one_line(e)
    with pytest.raises(MechanismError):
        listing(sample.plain, "")


def test_a_triton_kernel_is_read_from_its_python_function():
    from teraflops.compilation import fused

    got = listing(fused.rmsnorm_kernel)
    assert got.code.startswith("@triton.jit\ndef rmsnorm_kernel(")
    assert "tl.sum(x * x" in got.code and '"""' not in got.code
    assert got.path == "teraflops/compilation/fused.py"
    source = (ROOT / "helpers" / got.path).read_text().splitlines()
    assert source[got.last - 1].strip() == got.code.splitlines()[-1].strip()


def test_renderings_plain_and_markdown(sample, capsys):
    got = listing(sample.plain)
    assert str(got) == repr(got) == f"# {got.where}\n{got.code}"
    md = got._repr_markdown_()
    assert md.startswith(f"`{got.where}`\n\n```python\ndef plain(x):") and md.endswith("```\n")
    page = got._repr_html_()
    assert '<pre style="font-family: var(--jp-code-font-family, monospace)' in page  # nbconvert: not the text font
    assert '<span class="k">def</span>' in page
    assert f"<code>{got.where}</code>" in page and "word-break: normal" in page
    assert mechanism.show(sample.plain) is None  # outside IPython: printed
    assert capsys.readouterr().out == str(got) + "\n"


# ---- the lectures' calls ---------------------------------------------------------------------------------

def _code_cells(path: Path) -> list[tuple[dict, str]]:
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell  # "!cmd" lines become Python, as in a kernel
    nb = json.loads(path.read_text())
    return [(c, transform("".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "code"]


def _is_show(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "show"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "mechanism")


def lecture_calls(path: Path) -> tuple[dict, list[tuple[dict, ast.Call]]]:
    """(the namespace after the notebook's imports, [(cell, show call)])."""
    namespace, calls = {}, []
    for cell, source in _code_cells(path):
        tree = ast.parse(source)
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(imports, []), str(path), "exec"), namespace)
        calls += [(cell, n) for n in ast.walk(tree) if _is_show(n)]
    return namespace, calls


@pytest.mark.parametrize("path", LECTURES, ids=[p.stem for p in LECTURES])
def test_every_lecture_shows_helper_source_that_exists(path):
    namespace, calls = lecture_calls(path)
    assert calls, f"{path.name} shows no mechanism (mechanism.show) before its measurements"
    namespace["__listing__"] = listing
    for cell, call in calls:
        what = ast.unparse(call)
        expr = ast.Expression(ast.Call(ast.Name("__listing__", ast.Load()), call.args, call.keywords))
        got = eval(compile(ast.fix_missing_locations(expr), path.name, "eval"), namespace)  # MechanismError: lost
        assert 1 <= len(got.code.splitlines()) <= MAX_LINES, f"{path.name}: {what} shows {got.where}"
        source = "".join(cell["source"])
        assert not cell["outputs"] and "NBVAL" not in source, (
            f"{path.name}: the cell of {what} must be committed without outputs and not nbval-checked")


def test_every_marker_in_the_helpers_is_shown_by_a_lecture():
    shown = set()
    for path in LECTURES:
        for _, call in lecture_calls(path)[1]:
            if len(call.args) > 1 and isinstance(call.args[1], ast.Constant):
                shown.add(call.args[1].value)
    markers = {}
    for py in (ROOT / "helpers" / "teraflops").rglob("*.py"):
        if py.name == "mechanism.py":  # its docstring's example is not a marker
            continue
        for name in re.findall(r"^\s*# mechanism: (.+?)\s*$", py.read_text(), flags=re.M):
            markers[name] = py.relative_to(ROOT)
    assert markers, "no '# mechanism: NAME' marker in the helpers"
    unused = {name: str(where) for name, where in markers.items() if name not in shown}
    assert not unused, f"markers no lecture shows (remove them, or show them): {unused}"
