"""Headline numbers: how a notebook tells ``teraflops run`` what it measured.

A lecture notebook ends with a few numbers worth a line in the run summary (achieved TFLOP/s,
a speed-up, peak memory). It hands them over with::

    from teraflops import report
    report.record("matmul_tflops", tflops, "TFLOP/s", label="fp16 matmul")

The runner points the environment variable ``TERAFLOPS_REPORT`` at a fresh JSON file before it
starts the notebook's kernel and reads that file back with :func:`read` when the notebook ends.
Run by hand (in Jupyter, under pytest) the variable is unset and :func:`record` does nothing, so
notebooks can call it unconditionally. It never prints.

The file maps each key to ``{"value": float, "unit": str, "label": str}``, in the order keys were
first recorded; recording a key again replaces its entry. Writes are whole-file replacements, so a
reader never sees half a file; record from one process at a time (e.g. rank 0 only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV_VAR = "TERAFLOPS_REPORT"

__all__ = ["ENV_VAR", "record", "read"]


def record(key: str, value: float, unit: str = "", label: str | None = None) -> None:
    """Add or update headline number ``key`` in the file named by ``$TERAFLOPS_REPORT``.

    Args:
        key: stable identifier, e.g. ``"matmul_tflops"``.
        value: anything ``float()`` accepts (Python numbers, NumPy scalars, one-element tensors).
        unit: printed after the value, e.g. ``"TFLOP/s"``, ``"GiB"``, ``"x"``.
        label: human-readable name for the summary; defaults to ``key``.

    Does nothing when ``TERAFLOPS_REPORT`` is unset or empty.
    """
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    value = float(value)  # fail here, in the notebook, on a non-number
    entries = read(path)
    label = str(key if label is None else label)
    entries[str(key)] = {"value": value, "unit": str(unit), "label": label}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: readers see the old or the new file, never a partial one


def read(path: str | os.PathLike) -> dict[str, dict]:
    """Entries recorded in the report file at ``path``; ``{}`` if it is missing or empty."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    if not text.strip():
        return {}
    data = json.loads(text)
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ValueError(f"{path}: expected a JSON object of headline entries, got {kind}")
    return data
