"""The command line answers at once: importing the package imports neither torch nor Triton, and
Triton still runs the right way (TRITON_INTERPRET decided before Triton is imported)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_teraflops_imports_neither_torch_nor_triton():
    out = _python("import sys, teraflops, teraflops.course.cli; print(sorted(m for m in ('torch', 'triton', 'IPython', "
                  "'numpy', 'matplotlib') if m in sys.modules))")
    assert out == "[]", f"`import teraflops` imported {out}"


def test_triton_is_configured_before_it_is_imported():
    import torch

    want = "0" if torch.cuda.is_available() else "1"
    out = _python("import os, teraflops; before = os.environ.get('TRITON_INTERPRET'); import triton; "
                  "print(before, os.environ.get('TRITON_INTERPRET'))")
    assert out == f"None {want}"
    # torch imported first (as a lab does): decided on `import teraflops`, at once
    assert _python("import os, torch, teraflops; print(os.environ.get('TRITON_INTERPRET'))") == want


def test_detect_is_still_the_packages():
    assert _python("import teraflops; print(teraflops.detect().device in ('cpu', 'cuda'))") == "True"


HEAVY = ("torch", "triton", "numpy", "matplotlib", "IPython")  # what made the command line take seconds


def _imported(importtime_lines) -> list[str]:
    """Top-level names of the modules that ``python -X importtime`` reported in ``importtime_lines``."""
    return [line.rsplit("|", 1)[1].strip().split(".")[0] for line in importtime_lines
            if line.startswith("import time:") and "|" in line]


@pytest.mark.skipif(shutil.which("teraflops") is None, reason="the teraflops console script is not installed")
def test_help_imports_none_of_the_heavy_modules():
    """Why ``teraflops --help`` answers at once: the console script reaches its help without
    importing torch, Triton, NumPy or matplotlib (``-X importtime`` lists every import, in order). Its time
    is a figure of scripts/benchmark.py, not a test: a busy core stretches it whatever the code does."""
    done = subprocess.run([sys.executable, "-X", "importtime", shutil.which("teraflops"), "--help"], env=ENV,
                          capture_output=True, text=True, check=True, timeout=120)
    imported = _imported(done.stderr.splitlines())
    assert "teraflops" in imported and "argparse" in imported  # importtime did report this run's imports
    assert "usage:" in done.stdout
    assert sorted(set(imported) & set(HEAVY)) == [], "`teraflops --help` imported " + ", ".join(set(imported) & set(HEAVY))


def test_grade_says_its_first_line_before_it_imports_the_grader(tmp_path):
    """`teraflops grade`'s first line once came after torch's import (35 s on a busy machine). The
    line and ``-X importtime``'s report share stderr, in the order they happened: no heavy module may be
    imported before the line, and the grader's torch comes after it (the run is stopped there)."""
    out = subprocess.run([sys.executable, "-m", "teraflops.course.cli", "grade", str(tmp_path / "missing.ipynb")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such notebook" in out.stderr
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "teraflops.course.cli", "grade", __file__],
                            env=ENV, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    before, first, after = [], None, []
    try:
        for line in proc.stderr:
            if first is None and line.startswith("grading "):
                first = line
            elif first is None:
                before.append(line)
            else:
                after.append(line)
                if "torch" in _imported([line]):
                    break
    finally:
        proc.kill()
        proc.wait()
    assert first is not None, "".join(before[-5:])
    assert "teraflops" in _imported(before)  # the report was on: imports before the line were seen
    assert sorted(set(_imported(before)) & set(HEAVY)) == [], set(_imported(before)) & set(HEAVY)
    assert "torch" in _imported(after)  # the grader does import torch: after the line
