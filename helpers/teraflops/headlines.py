"""Headline numbers: how a notebook tells ``teraflops run`` what it measured.

A lecture notebook ends with a few numbers worth a line in the run summary (achieved TFLOP/s,
a speed-up, peak memory). It hands them over with::

    from teraflops import headlines
    headlines.record("matmul_tflops", tflops, "TFLOP/s", label="fp16 matmul")

The runner points the environment variable ``TERAFLOPS_REPORT`` at a fresh JSON file before it
starts the notebook's kernel and reads that file back with :func:`read` when the notebook ends.
Run by hand (in Jupyter, under pytest) the variable is unset and :func:`record` does nothing, so
notebooks can call it unconditionally. It never prints.

The file maps each key to ``{"value": float, "unit": str, "label": str}``, in the order keys were
first recorded; recording a key again replaces its entry. :func:`takeaway` adds the one line that
states the verdict the notebook measured, computed from its numbers (key ``"__takeaway__"``,
``{"text": str}``; :func:`read` leaves it out, :func:`read_takeaway` returns it). The report card
shows at most :data:`MAX_HEADLINES` numbers per notebook. Writes are whole-file replacements, so a
reader never sees half a file; record from one process at a time (e.g. rank 0 only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV_VAR = "TERAFLOPS_REPORT"

__all__ = ["ENV_VAR", "MAX_HEADLINES", "record", "takeaway", "read", "read_takeaway"]

MAX_HEADLINES = 5  # numbers a reader takes in at a glance, per unit
_TAKEAWAY = "__takeaway__"


def record(key: str, value: float, unit: str = "", label: str | None = None, card: bool = True) -> None:
    """Add or update headline number ``key`` in the file named by ``$TERAFLOPS_REPORT``.

    Args:
        key: stable identifier, e.g. ``"matmul_tflops"``.
        value: anything ``float()`` accepts (Python numbers, NumPy scalars, one-element tensors).
        unit: printed after the value, e.g. ``"TFLOP/s"``, ``"GiB"``, ``"x"``.
        label: human-readable name for the summary; defaults to ``key``.
        card: show it on the report card (at most :data:`MAX_HEADLINES` per notebook, the first
            recorded); ``False`` keeps it in the run summary and ``results.json`` only.

    Does nothing when ``TERAFLOPS_REPORT`` is unset or empty.
    """
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    value = float(value)  # fail here, in the notebook, on a non-number
    label = str(key if label is None else label)
    entry = {"value": value, "unit": str(unit), "label": label}
    if not card:
        entry["card"] = False
    _update(path, str(key), entry)


def takeaway(text: str) -> None:
    """Set the notebook's one-line takeaway: the verdict it measured, in words, with the numbers that
    carry it (e.g. ``f"memory-bound: naive attention held {r:.0f}× the memory of flash at N = {n}"``).
    Does nothing when ``TERAFLOPS_REPORT`` is unset or empty."""
    path = os.environ.get(ENV_VAR)
    if path:
        _update(path, _TAKEAWAY, {"text": " ".join(str(text).split())})


def _update(path, key: str, entry: dict) -> None:
    entries = _read_all(path)
    entries[key] = entry
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: readers see the old or the new file, never a partial one


def read(path: str | os.PathLike) -> dict[str, dict]:
    """Entries recorded in the report file at ``path``; ``{}`` if it is missing or empty."""
    return {k: v for k, v in _read_all(path).items() if k != _TAKEAWAY}


def read_takeaway(path: str | os.PathLike) -> str | None:
    """The takeaway line recorded in the report file at ``path``, or ``None``."""
    entry = _read_all(path).get(_TAKEAWAY)
    return entry.get("text") if isinstance(entry, dict) else None


def _read_all(path) -> dict:
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
