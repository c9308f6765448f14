"""The package as a normal install gets it: files the package reads at run time are in the wheel."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_reference_json_is_inside_the_built_wheel(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "*.egg-info", "build", "dist",
                                                              "__pycache__", ".cache*", "node_modules"))
    ref = src / "helpers" / "teraflops" / "reference" / "test-gpu.json"
    ref.write_text(json.dumps({"gpu": "Test GPU", "teraflops": "0", "notebooks": {}}))
    out = tmp_path / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(out)],
                          cwd=src, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("tensors_to_teraflops-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "teraflops/reference/test-gpu.json" in names, sorted(n for n in names if not n.endswith(".py"))
    assert "teraflops/reference/README.md" in names
